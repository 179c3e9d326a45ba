"""A throw-away `tierkv server` for `tierkv demo --with-server`.

It runs as a subprocess with the built-in defaults (``TIERKV_*`` variables of the caller's
environment are not passed on), its own instance name, a temporary runtime directory and
a pool sized for the demo, plus any extra server flags the demo asks for (its tiers).
:meth:`LocalServer.stop` sends SIGTERM and checks that the server exited cleanly and
removed its shared-memory segment.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from tierkv.client import ServerUnavailableError, wait_for_server
from tierkv.config import ServerConfig
from tierkv.demo.local_process import LocalProcess, LocalServerError
from tierkv.pool import segment_exists

__all__ = ["LocalServer", "LocalServerError"]


class LocalServer(LocalProcess):
    what = "server"

    def __init__(
        self, pool_size: int, extra_args: Sequence[str] = (), instance: str | None = None
    ) -> None:
        """``instance``: the server's instance name (its pool's name follows from it), one
        per server this process starts; by default ``demo-PID``."""
        super().__init__()
        self.pool_size = pool_size
        self.extra_args = list(extra_args)  # e.g. ["--tier", "disk:path=...,capacity=..."]
        self.instance = instance or f"demo-{os.getpid()}"
        self.runtime_dir = os.path.join(self.tmpdir, "run")

    @property
    def endpoint(self) -> str:
        return f"ipc://{os.path.join(self.runtime_dir, 'rpc.sock')}"

    @property
    def pool_name(self) -> str:
        return ServerConfig(instance=self.instance).resolved_pool_name

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "tierkv.cli", "server",
            "--instance", self.instance,
            "--runtime-dir", self.runtime_dir,
            "--pool-size", str(self.pool_size),
            "--http-port", "0",  # a throw-away server: no HTTP port to collide with another's
            *self.extra_args,
        ]  # fmt: skip

    def start(self, timeout: float = 30.0) -> LocalServer:
        """Start the server and wait until it answers a ping."""
        # No HTTP server: its fixed default port may be taken (by the server the demo would
        # otherwise talk to, or another demo), and the demo prints its own report.
        self.spawn(self.command(), {"TIERKV_HTTP_PORT": "0"})
        proc = self.proc
        assert proc is not None
        try:
            if not wait_for_server(self.endpoint, timeout, lambda: proc.poll() is not None):
                raise LocalServerError(f"the server exited at start-up:\n{self.log_tail()}")
        except ServerUnavailableError:
            proc.kill()
            proc.wait()
            raise LocalServerError(
                f"the server did not answer within {timeout:.0f} s:\n{self.log_tail()}"
            ) from None
        return self

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM, then check for exit status 0 and a removed pool segment."""
        started = self.proc is not None
        super().stop(timeout)
        if started and segment_exists(self.pool_name):
            raise LocalServerError(f"the server exited but left its pool {self.pool_name}")
