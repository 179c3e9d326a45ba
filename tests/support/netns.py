"""Hosts simulated with network namespaces for the cluster tests: ``ip`` and commands inside
a namespace, the checks that skip (with the reason) where namespaces or a tool are missing,
unique names and a subnet per run, and a `tierkv server` that runs inside a namespace."""

from __future__ import annotations

import secrets
import shutil
import subprocess
import sys
from typing import Any

import pytest

from support.clusterkit import TOKEN
from support.servers import ServerProcess


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def in_ns(ns: str, *cmd: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, check=True, timeout=30)


def require_tools(*tools: tuple[str, str]) -> None:
    """Skip unless this is Linux with iproute2 and every (tool, apt package) given."""
    if sys.platform != "linux" or shutil.which("ip") is None:
        pytest.skip("needs Linux with iproute2 (ip netns)")
    for tool, package in tools:
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool} (apt package {package})")


def add_namespace(name: str) -> None:
    """Create namespace ``name`` with its loopback up; skip where namespaces cannot be made."""
    probe = ip("netns", "add", name, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot create network namespaces here: {probe.stderr.strip()}")
    ip("-n", name, "link", "set", "lo", "up")


def run_names() -> tuple[str, str]:
    """A tag for this run's namespace names and a /24 prefix for its addresses."""
    tag = secrets.token_hex(3)
    return tag, f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}"


class NetnsServer(ServerProcess):
    """A `tierkv server` inside a network namespace (same pid: ip netns exec execs it)."""

    netns: str = ""

    def command(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *super().command()]


def cluster(srv: ServerProcess) -> dict[str, Any]:
    """The server's cluster figures (``/status``'s cluster part, over RPC)."""
    with srv.client(auth_token=TOKEN) as c:
        return dict(c.stats().cluster)
