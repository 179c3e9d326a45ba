"""The server's side of its HTTP front (:mod:`tierkv.server.front`): start it with the bound
HTTP socket, wait until it serves, start it again if it dies, stop it with the server.

A front that exits (killed, crashed) is started again after :data:`RESTART_DELAY` seconds
(one WARNING each time, with its exit status); meanwhile the kernel keeps the listening
socket and queues new connections, which the next front accepts. Its output goes to the
server's.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)

TOKEN_ENV = "TIERKV_FRONT_AUTH_TOKEN"  # the auth token reaches the front here, not in argv
READY = b"ready\n"  # the front writes it to its stdout once it serves

RESTART_DELAY = 1.0  # seconds between a front's exit and the next start
START_TIMEOUT = 30.0  # seconds a front may take to serve (imports on a loaded machine)


@dataclass(frozen=True)
class FrontSettings:
    core_socket: str  # the server's private HTTP socket (a path)
    rpc_endpoint: str  # for router lookups; "" when the server answers none
    auth_token: str
    log_level: str
    log_format: str


class FrontProcess:
    """One HTTP front process at a time, serving ``sock`` (kept open here to hand to the
    next one)."""

    def __init__(self, sock: socket.socket, settings: FrontSettings) -> None:
        self.sock = sock
        self.settings = settings
        self.proc: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        """Start the front and wait until it serves; then watch it."""
        self._spawn()
        self._watcher = threading.Thread(target=self._watch, name="tierkv-front-watch", daemon=True)
        self._watcher.start()

    def _spawn(self) -> None:
        s = self.settings
        argv = [
            sys.executable, "-m", "tierkv.server.front",
            "--fd", str(self.sock.fileno()),
            "--core", s.core_socket,
            "--rpc", s.rpc_endpoint,
            "--parent", str(os.getpid()),
            "--log-level", s.log_level,
            "--log-format", s.log_format,
        ]  # fmt: skip
        env = {**os.environ, TOKEN_ENV: s.auth_token}
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, env=env, pass_fds=(self.sock.fileno(),)
        )
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT)
        line = proc.stdout.readline() if ready else b""
        proc.stdout.close()  # it writes nothing else there
        if line != READY:
            proc.kill()
            proc.wait()
            raise RuntimeError(
                f"the HTTP front did not start (exit status {proc.returncode}; see the log)"
            )
        self.proc = proc

    def _watch(self) -> None:
        while not self._stop.is_set():
            proc = self.proc
            if proc is None or proc.poll() is None:
                self._stop.wait(0.2)
                continue
            if self._stop.is_set():
                return
            log.warning(
                "the HTTP front (pid %d) exited with status %s: starting another",
                proc.pid,
                proc.returncode,
            )
            if self._stop.wait(RESTART_DELAY):
                return
            try:
                self._spawn()
            except (OSError, RuntimeError) as exc:
                log.warning("%s; trying again", exc)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(START_TIMEOUT)  # (it may be starting one: then that one)
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
