"""The HTTP server inside `tierkv server`: health, status, metrics, cache clearing, dashboard.

FastAPI on uvicorn (:class:`tierkv.web.serving.HttpServer`), served from one thread of the
server process (handlers that read the service run on uvicorn's worker threads, so the
event loop never waits for a lock). The port is bound before anything serves it, so a port
in use fails start-up with a clear error. A server's port belongs to its HTTP front process
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
  :mod:`tierkv.server.front`; on the controller, :mod:`tierkv.web.lookup`).

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

import json
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from tierkv.keys import from_hex
from tierkv.server.engine_first import EnginesFirstMiddleware, no_gate
from tierkv.server.quota_http import add_quota_routes
from tierkv.server.quotas import Quotas
from tierkv.server.service import CacheService
from tierkv.web.pages import add_health_routes, dashboard_html, page_response
from tierkv.web.requests import (
    authorized_body,
    error_reply,
    make_authorizer,
)

log = logging.getLogger(__name__)

NAMESPACE_HEX = 32  # a namespace digest is 16 bytes


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
        return from_hex(ns)
    except ValueError:
        raise ValueError(f"namespace must be {NAMESPACE_HEX} hex digits") from None
