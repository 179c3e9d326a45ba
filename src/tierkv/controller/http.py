"""The controller's HTTP server: ``/`` (the dashboard), ``/healthcheck``, ``/metrics``
(Prometheus), ``/status`` (the JSON the dashboard shows), ``POST /instances/remove`` (an
operator's removal, body ``{"instance": ID}``), ``POST /lookup`` for routers
(:mod:`tierkv.cluster.router_lookup`), in the server's conventions (FastAPI on uvicorn, the
server's :class:`~tierkv.server.http.HttpServer`, JSON errors, every POST authorized)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from tierkv.controller.service import LATENCY_BUCKETS, ControllerService
from tierkv.gc_pauses import GcPauseCollector
from tierkv.web.lookup import add_lookup_route
from tierkv.web.pages import add_health_routes, dashboard_html, page_response
from tierkv.web.requests import authorized_body, error_reply, make_authorizer

MAX_REMOVE_BODY = 4096


class ControllerCollector(Collector):
    """Prometheus figures read from the service at scrape time."""

    def __init__(self, service: ControllerService) -> None:
        self.service = service

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        s = self.service
        c = s.counts
        for name, key, what in (
            ("registrations", "registrations", "server registrations"),
            (
                "registrations_refused",
                "registrations_refused",
                "server registrations refused: no free instance slot",
            ),
            ("heartbeats", "heartbeats", "heartbeats received"),
            (
                "heartbeats_out_of_sequence",
                "heartbeats_out_of_sequence",
                "heartbeats whose sequence differed from the controller's (a full sync followed)",
            ),
            ("admits", "admits", "keys admitted by reports"),
            ("evicts", "evicts", "keys evicted by reports"),
            ("reports", "reports", "reports applied"),
            ("reports_refused", "reports_refused", "reports and sync parts refused"),
            ("syncs", "syncs", "full syncs applied"),
            ("lookups", "lookups", "lookups answered"),
            ("lookup_keys", "lookup_keys", "keys looked up"),
            ("router_lookups", "router_lookups", "POST /lookup answered"),
            ("sync_parts", "sync_parts", "full sync parts received"),
            ("syncs_deferred", "syncs_deferred", "full syncs deferred: max_sync_bytes held"),
        ):
            yield CounterMetricFamily(f"tierkv_controller_{name}", what, value=c[key])
        dereg = CounterMetricFamily(
            "tierkv_controller_deregistrations", "servers deregistered", labels=["reason"]
        )
        dereg.add_metric(["dead"], c["deregistered_dead"])
        dereg.add_metric(["clean"], c["deregistered_clean"])
        dereg.add_metric(["operator"], c["deregistered_operator"])
        yield dereg
        control = s.control_stats()
        refused = CounterMetricFamily(
            "tierkv_controller_control_refused",
            "control requests refused (unauthenticated: no or a wrong signature, too old; "
            "replayed; malformed)",
            labels=["reason"],
        )
        replayed = control.get("replayed", 0)
        refused.add_metric(["unauthenticated"], control.get("refused", 0) - replayed)
        refused.add_metric(["replayed"], replayed)
        refused.add_metric(["malformed"], control.get("malformed", 0))
        yield refused
        yield CounterMetricFamily(
            "tierkv_controller_index_merges",
            "merges of reports into the index's sorted array",
            value=s.index.merges,
        )
        yield CounterMetricFamily(
            "tierkv_controller_index_merge_seconds",
            "seconds spent merging reports into the index's sorted array (its rate: the share "
            "of a core the background merges take)",
            value=s.index.merge_seconds,
        )
        yield GaugeMetricFamily(
            "tierkv_controller_instances", "registered servers", value=len(s.instances())
        )
        yield GaugeMetricFamily("tierkv_controller_keys", "keys indexed", value=s.index.total())
        yield GaugeMetricFamily(
            "tierkv_controller_index_bytes",
            "bytes of the index's tables and filter",
            value=s.index.nbytes(),
        )
        counts, total = s.lookup_seconds.snapshot()
        cum, buckets = 0, []
        for bound, n in zip([*map(str, LATENCY_BUCKETS), "+Inf"], counts, strict=True):
            cum += n
            buckets.append((bound, cum))
        yield HistogramMetricFamily(
            "tierkv_controller_lookup_seconds",
            "time to answer a lookup in the index",
            buckets=buckets,
            sum_value=total,
        )


def create_app(
    service: ControllerService, health: Callable[[], dict[str, bool]], auth_token: str = ""
) -> FastAPI:
    app = FastAPI(title="tierkv controller", docs_url=None, redoc_url=None, openapi_url=None)
    authorize = make_authorizer(auth_token)
    add_lookup_route(app, authorize, service.router_lookup)
    registry = CollectorRegistry()
    registry.register(ControllerCollector(service))
    registry.register(GcPauseCollector("tierkv_controller"))
    page = controller_page()

    @app.get("/", response_class=HTMLResponse)
    def dashboard() -> HTMLResponse:
        return page_response(page)

    @app.post("/instances/remove")
    async def remove(request: Request) -> JSONResponse:
        body = await authorized_body(request, authorize, MAX_REMOVE_BODY)
        if isinstance(body, JSONResponse):
            return body
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError):  # RecursionError: nested too deep
            return error_reply(400, 'the body must be JSON: {"instance": ID}')
        instance = doc.get("instance") if isinstance(doc, dict) else None
        if not isinstance(instance, str) or not instance:
            return error_reply(400, 'the body must name an instance: {"instance": ID}')
        n = service.remove(instance)
        if n is None:
            return error_reply(404, f"instance {instance[:200]!r} is not registered")
        return JSONResponse({"instance": instance, "keys": n})

    add_health_routes(app, health, service.stats, registry)
    return app


def controller_page() -> str:
    """The controller's dashboard, styled like the server's (its ``<style>`` put in)."""
    page = resources.files("tierkv.controller").joinpath("dashboard.html").read_text("utf-8")
    style = re.search(r"<style>.*?</style>", dashboard_html(), re.DOTALL)
    return page.replace("<!--STYLE-->", style.group(0) if style else "", 1)
