"""A throw-away `tierkv controller` for `tierkv demo --with-server --nodes 2 --directory
controller`.

A :class:`~tierkv.demo.local_process.LocalProcess` on a free loopback control port, with no
HTTP port and fast heartbeats.
"""

from __future__ import annotations

import socket
import sys
import time
from typing import Any

from tierkv.cluster import controller_messages as cm
from tierkv.cluster import messages as m
from tierkv.cluster.control import ControlClient
from tierkv.demo.local_process import LocalProcess, LocalServerError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalController(LocalProcess):
    what = "controller"

    def __init__(self, heartbeat_interval: float = 0.5, dead_after: float = 3.0) -> None:
        super().__init__()
        self.port = _free_port()
        self.heartbeat_interval = heartbeat_interval
        self.dead_after = dead_after
        self._client = ControlClient("", 1.0, decoder=cm.reply_decoder)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "tierkv.cli", "controller",
            "--port", str(self.port), "--http-port", "0",
            "--heartbeat-interval", str(self.heartbeat_interval),
            "--dead-after", str(self.dead_after),
        ]  # fmt: skip

    def start(self, timeout: float = 30.0) -> LocalController:
        """Start the controller and wait until it answers a status request."""
        self.spawn(self.command())
        proc = self.proc
        assert proc is not None
        deadline = time.monotonic() + timeout
        while self.status() is None:
            if proc.poll() is not None:
                raise LocalServerError(f"the controller exited at start-up:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise LocalServerError(
                    f"the controller did not answer within {timeout:.0f} s:\n{self.log_tail()}"
                )
            time.sleep(0.1)
        return self

    def status(self) -> dict[str, Any] | None:
        reply = self._client.call(self.addr, m.GetStatus(0))
        return dict(reply.stats) if isinstance(reply, m.NodeStatus) else None

    def synced(self) -> set[str]:
        """The instances registered and done with their full sync."""
        st = self.status() or {}
        rows: list[dict[str, Any]] = list(st.get("instances", []))
        return {str(r["instance"]) for r in rows if r["syncs"] and not r["syncing"]}

    def stop(self, timeout: float = 20.0) -> None:
        self._client.close()
        super().stop(timeout)
