"""The controller's dashboard in headless Chromium, and its remove action, against a real
`tierkv controller` with two real servers (one with an engine) holding chunks.

Chromium loads the page, lets it poll (virtual time) and dumps the DOM; with no traffic
meanwhile, every figure it shows must equal the controller's /status. A screenshot is
saved to test-artifacts/controller-dashboard.png.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from support.browser import Figures, run_chromium, screenshot
from support.clusterkit import TOKEN, wait_for
from support.controllers import ControllerProcess, running_controller, start_server
from support.httputil import free_port, get_json, request, scrape, val
from support.kvops import store, tokens_for
from support.servers import ServerProcess, register

pytestmark = pytest.mark.processes
Factory = Callable[..., ServerProcess]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[ControllerProcess]:
    with running_controller(tmp_path, http_port=free_port()) as ctl:
        yield ctl


def test_dashboard_shows_the_controllers_figures(
    server_factory: Factory, controller: ControllerProcess, tmp_path: Path
) -> None:
    base = f"http://127.0.0.1:{controller.http_port}"
    a, b = (start_server(server_factory, controller.addr) for _ in range(2))
    wait_for(lambda: len(controller.instances()) == 2)
    with a.client() as engine:
        register(engine)
        wait_for(lambda: controller.instances()[a.node_id]["namespaces"] != [])
        store(a, tokens_for(1, 5), 5)
        store(b, tokens_for(2, 3), 3)
        wait_for(lambda: {r["keys"] for r in controller.instances().values()} == {5, 3})
        st = get_json(base + "/status")
        dom = run_chromium(tmp_path / "profile", base + "/", "--dump-dom").stdout
        assert get_json(base + "/status")["total_keys"] == st["total_keys"] == 8
        page = Figures()
        page.feed(dom)
        assert page.polls >= 1, dom[:2000]
        assert page.values["health"] == "ok"
        assert page.num("instances-count") == 2
        assert page.num("total-keys") == 8
        assert page.num("syncing-count") == 0
        assert page.num("syncs-total") == st["syncs"] >= 2
        assert page.num("admits-total") == st["admits"] == 8
        # One row per instance, sorted, with its keys per tier and a remove button.
        rows = st["instances"]
        assert page.data["instance"] == [r["instance"] for r in rows]
        assert page.data["remove"] == [r["instance"] for r in rows]
        for i, r in enumerate(rows):
            assert page.num(f"instance-keys-{i}") == r["keys"]
            assert page.num(f"instance-pool-{i}") == r["keys_by_tier"]["pool"]
            assert page.num(f"instance-disk-{i}") == r["keys_by_tier"]["disk"] == 0
            assert page.num(f"instance-heartbeat-{i}") >= 0
        # Per namespace: both servers' chunks are of the engine's namespace.
        (ns,) = st["namespaces"]
        assert page.namespaces == [ns["namespace"]]
        assert page.num(f"ns-keys-{ns['namespace']}") == 8
        assert page.num(f"ns-instances-{ns['namespace']}") == 2
        # Recent activity: both registrations and their syncs.
        assert page.data["event"].count("registered") >= 2
        assert page.data["event"].count("synced") >= 2
    shot = ARTIFACTS / "controller-dashboard.png"
    screenshot(tmp_path / "profile", base + "/", shot, 10_000)


def remove(base: str, body: bytes, token: str | None = TOKEN) -> tuple[int, dict[str, object]]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    reply = request("POST", base + "/instances/remove", body, headers)
    return reply.status, reply.json()


def test_remove_needs_the_token_refuses_bad_bodies_and_forgets_the_instance(
    server_factory: Factory, controller: ControllerProcess
) -> None:
    base = f"http://127.0.0.1:{controller.http_port}"
    a = start_server(server_factory, controller.addr)
    wait_for(lambda: a.node_id in controller.instances())
    keys = store(a, tokens_for(3, 4), 4)
    wait_for(lambda: controller.instances()[a.node_id]["keys"] == 4)
    body = json.dumps({"instance": a.node_id}).encode()
    assert remove(base, body, token=None)[0] == 401
    assert remove(base, body, token="wrong")[0] == 403
    for bad, status in (
        (b"not json", 400),
        (b"[1]", 400),
        (b'{"instance": 7}', 400),
        (b'{"instance": ""}', 400),
        (b'{"instance": "nobody:1"}', 404),
        (b"[" * 3000, 400),  # nested deeper than the JSON decoder recurses
        (b"x" * 5000, 413),
    ):
        got, answer = remove(base, bad)
        assert got == status and answer["error"], (bad, answer)
    assert a.node_id in controller.instances()  # nothing removed so far
    # Between the removal and A's next heartbeat nobody is named; A then registers and
    # syncs again (it is alive), so its chunks are found again.
    assert remove(base, body) == (200, {"instance": a.node_id, "keys": 4})
    events = [e["event"] for e in get_json(base + "/status")["activity"]]
    assert "removed" in events
    assert val(scrape(base), "tierkv_controller_deregistrations_total", reason="operator") == 1
    wait_for(lambda: controller.holders(keys) == [{a.node_id}] * 4)
    # The merge that dropped A's removed slot (at least): counted and timed.
    wait_for(lambda: val(scrape(base), "tierkv_controller_index_merges_total") >= 1)
    assert val(scrape(base), "tierkv_controller_index_merge_seconds_total") > 0
