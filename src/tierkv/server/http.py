"""The HTTP server inside `tierkv server`: health, status, metrics, cache clearing, dashboard.

FastAPI on uvicorn, served from one thread of the server process (handlers that read the
service run on uvicorn's worker threads, so the event loop never waits for a lock). The
port is bound by :meth:`HttpServer.start` before anything serves it, so a port in use
fails start-up with a clear error. A server's port belongs to its HTTP front process
(:mod:`tierkv.server.front`), which answers routers' lookups and passes every other request
on to this app, served on a private Unix socket; the controller serves its app on its port.

Endpoints:

- ``GET /`` the dashboard (one self-contained page; it polls ``/status``)
- ``GET /healthcheck`` 200 when the RPC loop and the eviction thread are alive, else 503
- ``GET /status`` the state document (:mod:`tierkv.server.status`)
- ``GET /metrics`` Prometheus text format
- ``POST /clear-cache`` remove every object from the pool; an optional JSON body
  ``{"namespace": "<32 hex digits>"}`` (an engine's namespace from /status) removes only
  that namespace's objects. Tiers are not touched.
- ``/quota``: tenant quotas (:mod:`tierkv.server.quota_http`).
- ``POST /lookup`` in a cluster: KV-aware lookups for routers (answered by the front,
  :mod:`tierkv.server.front`; on the controller, :mod:`tierkv.server.lookup_http`).

Authorization of requests that change state (every POST, and PUT/DELETE when they exist):

- with ``--auth-token`` they need ``Authorization: Bearer <auth_token>``, on loopback too
  (any local user, or a web page in a browser on the node, could otherwise empty the pool);
- without one (configuration allows that only on loopback) they need no token;
- a request carrying an ``Origin`` other than this server's own (a web page of another
  site, or ``null``) is refused either way: browsers send cross-site form and ``text/plain``
  POSTs without a preflight, and the token would not stop a page on a node without one.

Reading (GET) needs no token. Errors are JSON: ``{"error": "..."}``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from importlib import resources
from typing import Any, Protocol

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from tierkv.server.engine_first import EnginesFirstMiddleware, no_gate
from tierkv.server.front_process import FrontProcess, FrontSettings
from tierkv.server.http_requests import (
    authorized_body,
    error_reply,
    make_authorizer,
)
from tierkv.server.quotas import Quotas
from tierkv.server.rpc import EndpointInUseError
from tierkv.server.service import CacheService

log = logging.getLogger(__name__)

NAMESPACE_HEX = 32  # a namespace digest is 16 bytes
# The dashboard may talk to this server and nothing else.
DASHBOARD_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'"
)


def dashboard_html() -> str:
    return resources.files("tierkv.server").joinpath("dashboard.html").read_text("utf-8")


def add_health_routes(
    app: FastAPI,
    health: Callable[[], dict[str, bool]],
    status_doc: Callable[[], dict[str, Any]],
    registry: CollectorRegistry,
) -> None:
    """``GET /healthcheck`` (503 when a check fails), ``GET /status`` (``status_doc``) and
    ``GET /metrics`` (Prometheus, from ``registry``): the same on every tierkv process."""

    @app.get("/healthcheck")
    def healthcheck() -> JSONResponse:
        checks = health()
        ok = all(checks.values())
        return JSONResponse(
            {"status": "ok" if ok else "unhealthy", "checks": checks},
            status_code=200 if ok else 503,
            headers={"Cache-Control": "no-store"},
        )

    @app.get("/status")
    def status() -> JSONResponse:
        return JSONResponse(status_doc(), headers={"Cache-Control": "no-store"})

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def page_response(page: str) -> HTMLResponse:
    """A dashboard page: never cached, allowed to talk to this server only."""
    return HTMLResponse(
        page, headers={"Cache-Control": "no-store", "Content-Security-Policy": DASHBOARD_CSP}
    )


def create_app(
    service: CacheService,
    status_doc: Callable[[], dict[str, Any]],
    health: Callable[[], dict[str, bool]],
    auth_token: str = "",
    quotas: Quotas | None = None,
    wait_turn: Callable[[], None] = no_gate,
) -> FastAPI:
    """The FastAPI application of one server (with ``quotas``: the /quota endpoints; a
    cluster's ``POST /lookup`` is the front's, :mod:`tierkv.server.front`). ``wait_turn``:
    the check point that lets the engines' requests go first
    (:mod:`tierkv.server.engine_first`), before each request reaches the app and inside
    the listings."""
    app = FastAPI(title="tierkv", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(EnginesFirstMiddleware, wait_turn=wait_turn)
    page = dashboard_html()
    authorize = make_authorizer(auth_token)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # Unknown paths and wrong methods answer like every other error here (405 keeps
        # its Allow header).
        return error_reply(exc.status_code, str(exc.detail), dict(exc.headers or {}))

    if quotas is not None:
        from tierkv.server.quota_http import add_quota_routes

        add_quota_routes(app, quotas, authorize, wait_turn)

    @app.get("/", response_class=HTMLResponse)
    def dashboard() -> HTMLResponse:
        return page_response(page)

    add_health_routes(app, health, status_doc, service.metrics.registry)

    @app.post("/clear-cache")
    async def clear_cache(request: Request) -> JSONResponse:
        body = await authorized_body(request, authorize)
        if isinstance(body, JSONResponse):
            return body
        try:
            prefix = _parse_clear_body(body)
        except ValueError as exc:
            return error_reply(400, str(exc))
        removed = await run_in_threadpool(service.clear_cache, prefix, "HTTP")
        return JSONResponse({"removed": removed, "namespace": prefix.hex() or None})

    return app


def _parse_clear_body(body: bytes) -> bytes:
    """The namespace prefix a /clear-cache body names (b"" for everything)."""
    if not body.strip():
        return b""
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError('body must be a JSON object, e.g. {"namespace": "<hex>"}')
    unknown = sorted(set(doc) - {"namespace"})
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}; the only field is 'namespace'")
    ns = doc.get("namespace")
    if ns is None:
        return b""
    if not isinstance(ns, str) or len(ns) != NAMESPACE_HEX:
        raise ValueError(f"namespace must be {NAMESPACE_HEX} hex digits (see /status engines)")
    try:
        return bytes.fromhex(ns)
    except ValueError:
        raise ValueError(f"namespace must be {NAMESPACE_HEX} hex digits") from None


class HttpSettings(Protocol):
    """Where to serve HTTP (the server's and the controller's configurations have it)."""

    @property
    def http_host(self) -> str: ...
    @property
    def http_port(self) -> int: ...
    @property
    def http_url(self) -> str: ...


class HttpServer:
    """uvicorn serving an app on a pre-bound socket, on its own thread. With ``front``, the
    port belongs to an HTTP front process (:mod:`tierkv.server.front`) and the app serves
    the front only, on a private Unix socket (``front.core_socket``)."""

    def __init__(self, cfg: HttpSettings, app: FastAPI, front: FrontSettings | None = None) -> None:
        self.host, self.port = cfg.http_host, cfg.http_port
        self.url = cfg.http_url
        self.sock: socket.socket | None = None
        self.front_settings = front
        self.front: FrontProcess | None = None
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
        if self.front_settings is not None:
            served = self._core_sock = _private_socket(self.front_settings.core_socket)
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
        if self.front_settings is not None:
            self.front = FrontProcess(self.sock, self.front_settings)
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
            assert self.front_settings is not None
            with contextlib.suppress(OSError):
                os.unlink(self.front_settings.core_socket)


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
