"""A throw-away `tierkv server` for `tierkv demo --with-server`.

It runs as a subprocess with the built-in defaults (``TIERKV_*`` variables of the caller's
environment are not passed on), its own instance name, a temporary runtime directory and
a pool sized for the demo, plus any extra server flags the demo asks for (its tiers).
:meth:`LocalServer.stop` sends SIGTERM and checks that the server exited cleanly and
removed its shared-memory segment.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from tierkv.client import ServerUnavailableError, wait_for_server
from tierkv.config import ServerConfig
from tierkv.pool import segment_exists


class LocalServerError(RuntimeError):
    """The server did not start, or did not stop cleanly; the message includes its log."""


class LocalServer:
    def __init__(self, pool_size: int, extra_args: Sequence[str] = ()) -> None:
        self.pool_size = pool_size
        self.extra_args = list(extra_args)  # e.g. ["--tier", "disk:path=...,capacity=..."]
        self.instance = f"demo-{os.getpid()}"
        self.tmpdir = tempfile.mkdtemp(prefix="tierkv-demo-")
        self.runtime_dir = os.path.join(self.tmpdir, "run")
        self.log_path = os.path.join(self.tmpdir, "server.log")
        self.proc: subprocess.Popen[bytes] | None = None

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
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIERKV_")}
        # No HTTP server: its fixed default port may be taken (by the server the demo would
        # otherwise talk to, or another demo), and the demo prints its own report.
        env["TIERKV_HTTP_PORT"] = "0"
        with open(self.log_path, "wb") as log:
            # Its own session: a Ctrl-C of the demo reaches the engines, and the demo then
            # stops the server itself, last.
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        proc = self.proc
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
                    f"the server did not stop within {timeout:.0f} s of SIGTERM (killed):\n"
                    f"{self.log_tail()}"
                ) from None
        if proc.returncode != 0:
            raise LocalServerError(
                f"the server exited with status {proc.returncode}:\n{self.log_tail()}"
            )
        if segment_exists(self.pool_name):
            raise LocalServerError(f"the server exited but left its pool {self.pool_name}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                return "".join(fh.readlines()[-lines:])
        except OSError:
            return "(no server log)"

    def cleanup(self) -> None:
        """Remove the temporary directory (socket and log)."""
        shutil.rmtree(self.tmpdir, ignore_errors=True)
