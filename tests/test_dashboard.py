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

import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from conftest import ServerProcess
from httputil import free_port, get_json, wait_for

TESTS = Path(__file__).resolve().parent
ARTIFACTS = TESTS.parent / "test-artifacts"
LOADERS = 2


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError("chromium is not installed: run scripts/ensure-system-deps.sh (make test)")


def run_chromium(profile: Path, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        "--hide-scrollbars",
        "--force-device-scale-factor=1",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=5000",  # the page polls every (virtual) second
        "--window-size=1400,1000",
        *args,
        url,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


class Figures(HTMLParser):
    """Every element's id -> data-value, plus the rows that identify tiers and engines."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, str] = {}
        self.ids: set[str] = set()
        self.namespaces: list[str] = []
        self.polls = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if "id" in a:
            self.ids.add(a["id"])
            if "data-value" in a:
                self.values[a["id"]] = a["data-value"]
        if "data-namespace" in a:
            self.namespaces.append(a["data-namespace"])
        if tag == "body":
            self.polls = int(a.get("data-polls", "0"))

    def num(self, element: str) -> float:
        return float(self.values[element])


@pytest.fixture
def loaded_server(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> Iterator[tuple[ServerProcess, str]]:
    port = free_port()
    srv = server_factory(
        pool_size="8MiB",
        extra=["--http-port", str(port), "--tier", f"disk:path={tmp_path / 'disk'}"],
    )
    base = f"http://127.0.0.1:{port}"
    loaders = [
        subprocess.Popen(
            [
                sys.executable,
                str(TESTS / "load_engine.py"),
                srv.endpoint,
                f"load-{i}",
                str(i),
                "120",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
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

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    shot.unlink(missing_ok=True)
    run_chromium(tmp_path / "profile", base + "/", f"--screenshot={shot}")
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
