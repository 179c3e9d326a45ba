"""Every metric the Grafana dashboard and the Prometheus alert rules of deploy/ query is one a
running tierkv exports.

A real controller and two real servers in controller mode, each with a disk tier and HTTP:
chunks are stored through one server and fetched through the other (a peer fetch, so the
per-peer families have rows), then both /metrics pages are scraped. A name counts as
exported when the scrape has a sample of that name or announces its family (HELP/TYPE) with
a type that makes the name (a counter's ``_total``, a histogram's ``_bucket``/``_sum``/
``_count``): labelled families appear before their first row. Names of the controller
(``tierkv_controller_*``) must be on the controller's page, every other name on a server's.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.clusterkit import Node, free_ports, wait_for
from support.controllers import ControllerProcess, controller_args, running_controller
from support.deploy_kit import alert_exprs, alert_rules, dashboard, dashboard_exprs
from support.httputil import free_port, get_json, request
from support.kvops import fetch, store, tokens_for
from support.promql import SYNTHETIC, exported_names, metric_names
from support.servers import ServerProcess, stop_and_clean
from tierkv.protocol import PROTOCOL_VERSION

pytestmark = pytest.mark.processes
Factory = Callable[..., ServerProcess]


@dataclass(frozen=True)
class Scrapes:
    server: set[str]
    controller: set[str]


def scrape_text(base: str) -> str:
    reply = request("GET", base + "/metrics")
    assert reply.status == 200, (base, reply.status, reply.body[:300])
    return reply.text


@pytest.fixture(scope="module")
def scrapes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scrapes]:
    """One cluster for the module: started, exercised, scraped, stopped."""
    tmp = tmp_path_factory.mktemp("cluster")
    servers: list[ServerProcess] = []
    with running_controller(tmp, http_port=free_port()) as ctl:
        try:
            yield _exercise(tmp, ctl, servers)
        finally:
            for srv in servers:
                stop_and_clean(srv)


def _exercise(tmp: Path, ctl: ControllerProcess, servers: list[ServerProcess]) -> Scrapes:
    nodes: list[tuple[Node, str]] = []
    for i in range(2):
        (port,) = free_ports(1)
        http = free_port()
        extra = [
            *controller_args(ctl.addr, port), "--http-port", str(http),
            "--tier", f"disk:path={tmp / f'disk{i}'},capacity=64MiB",
        ]  # fmt: skip
        instance = uuid.uuid4().hex[:10]
        srv = ServerProcess(instance, tmp / f"run-{instance}", "64MiB", extra)
        servers.append(srv)
        srv.start()
        nodes.append((Node(srv, port), f"http://127.0.0.1:{http}"))
    wait_for(lambda: len(ctl.instances()) == 2)
    (a, _), (b, b_http) = nodes
    tokens = tokens_for(7, 3)
    store(a, tokens, 3)
    hits, retrieved = fetch(b, tokens, 3)
    assert hits == 3 and retrieved == [0, 1, 2]  # from a's pool: a peer fetch
    assert get_json(b_http + "/status")["server"]["protocol"] == PROTOCOL_VERSION
    return Scrapes(
        server=exported_names(scrape_text(b_http)),
        controller=exported_names(scrape_text(f"http://127.0.0.1:{ctl.http_port}")),
    )


def unexported(exprs: dict[str, str], scrapes: Scrapes) -> dict[str, set[str]]:
    """Per query, the metric names it reads that nothing exports."""
    missing: dict[str, set[str]] = {}
    for where, expr in exprs.items():
        names = metric_names(expr)
        assert names, f"{where}: no metric name found in {expr!r}"
        for name in names - SYNTHETIC:
            page = scrapes.controller if name.startswith("tierkv_controller_") else scrapes.server
            if name not in page:
                missing.setdefault(where, set()).add(name)
    return missing


def test_the_scrapes_have_peer_tier_and_tenant_rows(scrapes: Scrapes) -> None:
    """The cluster was exercised enough for the check below to mean something."""
    for name in (
        "tierkv_cluster_peer_chunks_total",
        "tierkv_tier_used_bytes",
        "tierkv_tenant_used_bytes",
        "tierkv_request_duration_seconds_bucket",
    ):
        assert name in scrapes.server
    assert "tierkv_controller_lookup_seconds_bucket" in scrapes.controller


def test_every_dashboard_query_reads_exported_metrics(scrapes: Scrapes) -> None:
    assert unexported(dashboard_exprs(dashboard()), scrapes) == {}


def test_every_alert_reads_exported_metrics(scrapes: Scrapes) -> None:
    assert unexported(alert_exprs(alert_rules()), scrapes) == {}


def test_a_misspelt_metric_is_caught(scrapes: Scrapes) -> None:
    """The check itself: a query naming a metric nobody exports is reported."""
    exprs = {"typo": 'sum(rate(tierkv_lookup_chunk_total{result="hit"}[5m]))'}
    assert unexported(exprs, scrapes) == {"typo": {"tierkv_lookup_chunk_total"}}
    exprs = {"suffix": "rate(tierkv_requests_bucket[5m])"}  # a counter has no buckets
    assert unexported(exprs, scrapes) == {"suffix": {"tierkv_requests_bucket"}}
