"""The dashboard in headless Chromium against a real server under load.

Two engine processes store, look up and retrieve in the background (a small pool and a
disk tier, so there are hits in both, misses, evictions). Chromium loads the page, lets it
poll a few times (virtual time) and dumps the DOM; the figures it shows must be the
server's: fixed ones equal to /status, counters between /status read just before and just
after. A screenshot is saved to test-artifacts/dashboard.png.

Chromium is the Debian ``chromium`` package, installed by scripts/ensure-system-deps.sh
(``make test``).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from support.browser import Figures, run_chromium, screenshot
from support.httputil import free_port, get_json, wait_for
from support.servers import ServerProcess
from tierkv.tenants import DEFAULT_TENANT, tenant_tag

TESTS = Path(__file__).resolve().parents[1]
ARTIFACTS = TESTS.parent / "test-artifacts"
LOADERS = 2
TENANT = "acme"


@pytest.fixture
def loaded_server(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> Iterator[tuple[ServerProcess, str]]:
    port = free_port()
    srv = server_factory(
        pool_size="8MiB",
        extra=[
            "--http-port",
            str(port),
            "--tier",
            f"disk:path={tmp_path / 'disk'}",
            *("--quota", f"{TENANT}=2MiB", "--disk-quota", f"{TENANT}=1MiB"),
        ],
    )
    base = f"http://127.0.0.1:{port}"
    loaders = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "support.load_engine",
                srv.endpoint,
                f"load-{i}",
                str(i),
                "120",
                TENANT if i == 0 else "",  # the other: the default tenant
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=TESTS,
        )
        for i in range(LOADERS)
    ]
    try:
        for proc in loaders:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"

        def busy() -> bool:
            st = get_json(base + "/status")
            return (
                len(st["engines"]) == LOADERS
                and st["evictions"]["objects"] > 0
                and st["lookups"]["hits"].get("disk", 0) > 0
            )

        wait_for("the load to evict and hit the disk tier", busy, timeout=120)
        yield srv, base
    finally:
        for proc in loaders:
            proc.terminate()
        for proc in loaders:
            proc.wait(30)
    # The loaders were killed mid-request at worst: the server is still healthy.
    assert get_json(base + "/healthcheck")["status"] == "ok"


def test_dashboard_shows_live_figures(
    loaded_server: tuple[ServerProcess, str], tmp_path: Path
) -> None:
    _srv, base = loaded_server
    before = get_json(base + "/status")
    dom = run_chromium(tmp_path / "profile", base + "/", "--dump-dom").stdout
    after = get_json(base + "/status")

    page = Figures()
    page.feed(dom)
    assert page.polls >= 2, dom[:2000]  # rates need two polls

    def between(element: str, figure: Callable[[dict[str, Any]], float]) -> None:
        shown = page.num(element)
        assert figure(before) <= shown <= figure(after), (
            element,
            figure(before),
            shown,
            figure(after),
        )

    # Fixed figures: exactly the server's.
    assert page.num("pool-capacity") == before["pool"]["capacity"] == 8 * 2**20
    assert 0 <= page.num("objects-pinned") <= page.num("objects-locked")
    assert page.num("engines-count") == LOADERS
    assert sorted(page.namespaces) == sorted(e["namespace"] for e in before["engines"])
    assert {"tier-pool", "tier-disk", "hits-pool", "hits-disk", "misses-evicted"} <= page.ids
    # Counters: between the two reads around the page's life.
    between(
        "lookup-chunks",
        lambda s: sum(s["lookups"]["hits"].values()) + sum(s["lookups"]["misses"].values()),
    )
    between("lookup-hits", lambda s: sum(s["lookups"]["hits"].values()))
    between("stored-bytes", lambda s: s["transfers"]["stored"]["pool"]["bytes"])
    between("retrieved-bytes", lambda s: s["transfers"]["retrieved"]["pool"]["bytes"])
    between("evictions-total", lambda s: s["evictions"]["objects"])
    between("requests-total", lambda s: sum(sum(o.values()) for o in s["requests"].values()))
    # Tenants: one row each, limits exactly the server's, counters between the two reads.
    acme, anonymous = tenant_tag(TENANT), tenant_tag(DEFAULT_TENANT)
    assert page.num("tenants-count") == len(before["tenants"]["rows"]) == 2
    assert page.num("default-quota") == -1  # unlimited
    assert {f"tenant-{acme}", f"tenant-{anonymous}"} <= page.ids
    assert page.num(f"tenant-limit-{acme}") == 2 * 2**20
    assert page.num(f"tenant-limit-{anonymous}") == -1
    assert page.num(f"tenant-disk-limit-{acme}") == 2**20
    assert page.num(f"tenant-disk-limit-{anonymous}") == -1

    def row(tag: str, field: str) -> Callable[[dict[str, Any]], float]:
        return lambda s: next(r[field] for r in s["tenants"]["rows"] if r["tag"] == tag)

    between(f"tenant-evictions-{acme}", row(acme, "evictions"))
    between(f"tenant-evictions-{anonymous}", row(anonymous, "evictions"))
    assert page.num(f"tenant-refused-{acme}") == 0  # soft mode refuses nothing
    assert page.num(f"tenant-disk-{anonymous}") > 0
    assert page.num("hit-rate-total") == pytest.approx(
        page.num("lookup-hits") / page.num("lookup-chunks")
    )
    # Gauges: within their bounds. Rates: computed from two polls (not "—"), never negative.
    # Whether the last interval saw a store or a retrieve depends on how much real time
    # Chromium's virtual clock let pass between the polls (CI once saw a store but no
    # retrieve): the counters above are what proves the traffic is counted.
    assert 0 < page.num("pool-used") <= page.num("pool-capacity")
    assert 0 <= page.num("hit-rate") <= 1
    for rate in ("store-rate", "retrieve-rate", "req-rate"):
        assert page.num(rate) >= 0, rate

    screenshot(tmp_path / "profile", base + "/", ARTIFACTS / "dashboard.png", 20_000)
