"""Hosts simulated with network namespaces for the cluster tests: ``ip`` and commands inside
a namespace, the checks that skip (with the reason) where namespaces or a tool are missing,
unique names and a subnet per run, a `tierkv server` that runs inside a namespace, and what
the tests do on a host (store a prompt's chunks; look them up and read them back, checked)."""

from __future__ import annotations

import secrets
import shutil
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from support.clusterkit import TOKEN
from support.kvops import chunk_keys, tokens_for
from support.servers import CHUNK_SHAPE, ServerProcess, chunk_data, register

CHUNKS = 4  # a prompt's chunks in store() and fetch()


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


def store(srv: ServerProcess, seed: int) -> list[bytes]:
    """Store prompt ``seed``'s :data:`CHUNKS` chunks on ``srv``; their keys."""
    tokens = tokens_for(seed, CHUNKS)
    with srv.client(auth_token=TOKEN) as c:
        register(c)
        res = c.store(tokens, [chunk_data(tokens, j) for j in range(CHUNKS)])
        assert res.stored == list(range(CHUNKS))
        return chunk_keys(c, tokens)


def fetch(srv: ServerProcess, seed: int, rid: str) -> int:
    """Look up prompt ``seed`` on ``srv`` (waiting for the prefetch) and retrieve it, bytes
    checked: the hits."""
    tokens = tokens_for(seed, CHUNKS)
    with srv.client(auth_token=TOKEN) as c:
        register(c)
        hits = c.lookup(tokens, request_id=rid, wait=True).hits
        out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(CHUNKS)]
        got = c.retrieve(request_id=rid, out=out)
        assert got.retrieved == list(range(hits))
        for j in got.retrieved:
            np.testing.assert_array_equal(out[j], chunk_data(tokens, j))
        return int(hits)
