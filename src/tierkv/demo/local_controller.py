"""A throw-away `tierkv controller` for `tierkv demo --with-server --nodes 2 --directory
controller`.

It runs as a subprocess with the built-in defaults (``TIERKV_*`` variables of the caller's
environment are not passed on), on a free loopback control port, no HTTP port, fast
heartbeats, its log in a temporary directory. :meth:`LocalController.stop` sends SIGTERM
and checks that it exited cleanly.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from tierkv.cluster import messages as m
from tierkv.cluster.control import ControlClient
from tierkv.controller import messages as cm
from tierkv.demo.local_server import LocalServerError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalController:
    def __init__(self, heartbeat_interval: float = 0.5, dead_after: float = 3.0) -> None:
        self.port = _free_port()
        self.heartbeat_interval = heartbeat_interval
        self.dead_after = dead_after
        self.tmpdir = tempfile.mkdtemp(prefix="tierkv-demo-controller-")
        self.log_path = os.path.join(self.tmpdir, "controller.log")
        self.proc: subprocess.Popen[bytes] | None = None
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
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIERKV_")}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # a Ctrl-C of the demo: the demo stops it, last
            )
        deadline = time.monotonic() + timeout
        while self.status() is None:
            if self.proc.poll() is not None:
                raise LocalServerError(f"the controller exited at start-up:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait()
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
        """SIGTERM, then check for exit status 0."""
        self._client.close()
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise LocalServerError(
                    f"the controller did not stop within {timeout:.0f} s of SIGTERM (killed):\n"
                    f"{self.log_tail()}"
                ) from None
        if proc.returncode != 0:
            raise LocalServerError(
                f"the controller exited with status {proc.returncode}:\n{self.log_tail()}"
            )

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                return "".join(fh.readlines()[-lines:])
        except OSError:
            return "(no controller log)"

    def cleanup(self) -> None:
        shutil.rmtree(self.tmpdir, ignore_errors=True)
