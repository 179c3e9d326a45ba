"""What every tierkv process serves alike over HTTP: its health, status and metrics routes,
and dashboard pages (the server's page, :func:`dashboard_html`, whose style the controller's
page shares), never cached and confined to the process that served them."""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

# A dashboard page may talk to the process that served it and nothing else.
DASHBOARD_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'"
)


def dashboard_html() -> str:
    return resources.files("tierkv.web").joinpath("dashboard.html").read_text("utf-8")


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
