"""uvicorn serving an app on a socket bound before anything serves it (a port in use fails
start-up with a clear error), from a thread of the calling process; optionally the port is
handed to a front process and the app serves it on a private Unix socket instead (a
server's HTTP front, :mod:`tierkv.server.front_process`)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

import uvicorn
from fastapi import FastAPI

from tierkv.endpoints import EndpointInUseError

log = logging.getLogger(__name__)


class Front(Protocol):
    """A process that serves the port in the app's place (it passes requests on to the app's
    private socket): started once the app serves, stopped first."""

    def start(self) -> None: ...
    def stop(self, timeout: float) -> None: ...


class HttpSettings(Protocol):
    """Where to serve HTTP (the server's and the controller's configurations have it)."""

    @property
    def http_host(self) -> str: ...
    @property
    def http_port(self) -> int: ...
    @property
    def http_url(self) -> str: ...


class HttpServer:
    """uvicorn serving an app on a pre-bound socket, on its own thread. With
    ``core_socket`` and ``front`` (made from the bound port once the app serves), the port
    belongs to a front process and the app serves the front only, on a private Unix socket
    at ``core_socket``."""

    def __init__(
        self,
        cfg: HttpSettings,
        app: FastAPI,
        core_socket: str = "",
        front: Callable[[socket.socket], Front] | None = None,
    ) -> None:
        if bool(core_socket) != (front is not None):
            raise ValueError("a front needs the private socket it passes requests on to")
        self.host, self.port = cfg.http_host, cfg.http_port
        self.url = cfg.http_url
        self.sock: socket.socket | None = None
        self.core_socket = core_socket
        self._make_front = front
        self.front: Front | None = None
        self._core_sock: socket.socket | None = None
        config = uvicorn.Config(
            app,
            log_config=None,  # keep the server's logging set-up
            access_log=False,  # a dashboard polls every second: no line per request
            lifespan="off",
            server_header=False,
            ws="none",
            timeout_graceful_shutdown=2,
        )
        self.server = uvicorn.Server(config)
        if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
            logging.getLogger("uvicorn.error").setLevel(logging.WARNING)  # start-up chatter
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 10.0) -> None:
        """Bind, serve in a thread; returns once uvicorn accepts connections."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            self.sock = socket.create_server((self.host, self.port), family=family)
        except OSError as exc:
            raise EndpointInUseError(
                f"cannot serve HTTP on {self.host}:{self.port}: {exc.strerror or exc}; pick "
                "another --http-port (0 disables HTTP)"
            ) from None
        self.sock.set_inheritable(False)
        served = self.sock
        if self.core_socket:
            served = self._core_sock = _private_socket(self.core_socket)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [served]}, name="tierkv-http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the HTTP server thread ended at start-up (see the log)")
            if time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start in time")
            time.sleep(0.01)
        if self._make_front is not None:
            self.front = self._make_front(self.sock)
            self.front.start()
        log.info("HTTP on %s (dashboard, /status, /metrics, /healthcheck)", self.url)

    def stop(self, timeout: float = 5.0) -> None:
        if self.front is not None:
            self.front.stop(timeout)
            self.front = None
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.close()

    def close(self) -> None:
        """Release the sockets (also when the server never started)."""
        if self.sock is not None:
            self.sock.close()
        if self._core_sock is not None:
            self._core_sock.close()
            self._core_sock = None
            with contextlib.suppress(OSError):
                os.unlink(self.core_socket)


def _private_socket(path: str) -> socket.socket:
    """A listening Unix socket at ``path`` that only this user can connect to (a stale
    file of a server that was killed is replaced)."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    sock.listen(128)
    sock.set_inheritable(False)
    return sock
