"""A real `tierkv controller` process for tests (killable and restartable on the same
port), servers that use it as their directory, and signed calls to it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.clusterkit import FAST, TOKEN, Node, free_ports, rows_of, wait_for
from support.servers import ServerProcess
from support.stuck import FAULTHANDLER, describe_stuck
from tierkv.cluster import controller_messages as cm
from tierkv.cluster import messages as m
from tierkv.cluster.control import ControlClient


def ctl_call(addr: str, msg: object, token: str = TOKEN, timeout: float = 2.0) -> Any:
    """One signed request to the controller at ``addr`` (None when it does not answer)."""
    client = ControlClient(token, timeout, decoder=cm.reply_decoder)
    try:
        return client.call(addr, msg)
    finally:
        client.close()


@dataclass
class ControllerProcess:
    """`tierkv controller` on a fixed control port (a restart binds the same one)."""

    log_dir: Path
    heartbeat_interval: float = 0.2
    dead_after: float = 1.2
    http_port: int = 0
    port: int = field(default_factory=lambda: free_ports(1)[0])
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> ControllerProcess:
        cmd = [
            sys.executable, *FAULTHANDLER, "-m", "tierkv.cli", "controller",
            "--port", str(self.port),
            "--http-port", str(self.http_port), "--auth-token", TOKEN,
            "--heartbeat-interval", str(self.heartbeat_interval),
            "--dead-after", str(self.dead_after), "--log-level", "debug",
        ]  # fmt: skip
        self.log_path = self.log_dir / f"controller-{time.monotonic_ns()}.log"
        out = open(self.log_path, "wb")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(cmd, env=dict(os.environ), stdout=out, stderr=out)
        proc = self.proc
        try:
            wait_for(lambda: proc.poll() is not None or self.status() is not None)
        except AssertionError:
            state = describe_stuck(proc, self.log_path)
            raise RuntimeError(f"controller did not answer:\n{state}") from None
        if proc.poll() is not None:
            raise RuntimeError(f"controller exited at start-up:\n{self.log()}")
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def status(self) -> dict[str, Any] | None:
        reply = ctl_call(self.addr, m.GetStatus(0), timeout=1.0)
        return dict(reply.stats) if isinstance(reply, m.NodeStatus) else None

    def instances(self) -> dict[str, dict[str, Any]]:
        """Registered servers by instance id (an empty dict when the controller is down)."""
        st = self.status() or {}
        return {row["instance"]: row for row in st.get("instances", [])}

    def holders(self, keys: list[bytes]) -> list[set[str]]:
        """Who the controller names as holder of each key."""
        reply = ctl_call(self.addr, m.Resolve(0, keys))
        assert isinstance(reply, cm.Located), reply
        out: list[set[str]] = [set() for _ in keys]
        for pos, h, _ in rows_of(reply):
            out[pos].add(reply.holders[h].node_id)
        return out

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        """SIGKILL: a crash (no server is told)."""
        self.stop(signal.SIGKILL)


def controller_args(controller: str, port: int) -> list[str]:
    """A server's options for controller mode on cluster port ``port``."""
    return [
        "--controller", controller, "--cluster-port", str(port), "--auth-token", TOKEN,
        *FAST, "--http-port", "0",
    ]  # fmt: skip


def start_server(factory: Callable[..., ServerProcess], controller: str) -> Node:
    """A server in controller mode on a free port pair."""
    (port,) = free_ports(1)
    return Node(factory(pool_size="64MiB", extra=controller_args(controller, port)), port)


@contextmanager
def running_controller(log_dir: Path, **options: Any) -> Iterator[ControllerProcess]:
    """A started controller (``options``: :class:`ControllerProcess`'s), stopped after."""
    ctl = ControllerProcess(log_dir, **options).start()
    try:
        yield ctl
    finally:
        ctl.stop()
