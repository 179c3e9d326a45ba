"""Engines first (:mod:`tierkv.server.engine_first`): HTTP work for routers waits at its
check points while an engine's request is in flight in the RPC loop, and goes on after.

The gate alone, its check points in a router lookup and a quota listing, and a real
in-process server: a blocking engine request held in its handler keeps an HTTP request
waiting until it is answered."""

from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from support.httputil import free_port, wait_for
from support.servers import in_process_config
from tierkv import protocol as p
from tierkv.client import Client
from tierkv.cluster import controller_messages as cm
from tierkv.cluster import router_lookup
from tierkv.server.engine_first import EngineFirst
from tierkv.server.wiring import Server

LONG = 60.0  # a wait that only the gate's opening ends in these tests


def _in_thread(fn: Any) -> tuple[threading.Thread, threading.Event]:
    done = threading.Event()

    def run() -> None:
        fn()
        done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, done


def test_a_check_point_waits_while_a_request_is_in_flight_and_goes_on_after() -> None:
    gate = EngineFirst(max_wait=LONG)
    gate.wait_turn()  # nothing in flight: passes at once, not counted
    assert (gate.in_flight, gate.waits) == (0, 0)
    gate.started()
    gate.started()
    assert gate.in_flight == 2
    thread, done = _in_thread(gate.wait_turn)
    assert not done.wait(0.2)  # held while requests are in flight
    gate.finished()
    assert not done.wait(0.2)  # one is still in flight
    gate.finished()
    assert done.wait(LONG)
    thread.join()
    assert (gate.in_flight, gate.waits) == (0, 1)


def test_the_wait_is_bounded() -> None:
    gate = EngineFirst(max_wait=0.01)
    gate.started()
    gate.wait_turn()  # returns although the request is still in flight
    assert (gate.in_flight, gate.waits) == (1, 1)


def test_a_router_lookup_passes_its_check_points() -> None:
    calls = []
    digest = bytes(range(16))
    body = json.dumps({"model": "m", "tokens": list(range(512))}).encode()
    reply = router_lookup.answer(
        body,
        [cm.NamespaceInfo(digest, "m", 256)],
        lambda ks: {},
        lambda instance: None,
        lambda: calls.append(1),
    )
    assert reply == {"chunks": 2, "instances": []}
    assert len(calls) == 4  # before parse, before the namespaces, around the directory


def _config(tmp_path: Path, http_port: int) -> Any:
    return in_process_config(tmp_path, http_port=http_port)


@pytest.mark.processes  # its server's HTTP front is a process
def test_http_waits_for_an_engine_request_in_flight(tmp_path: Path) -> None:
    """A GetStats (run on the RPC loop's workers) held in its handler: the RPC loop counts
    it in flight, GET /quota waits at the app's door, and both finish once it is
    answered."""
    port = free_port()
    server = Server(_config(tmp_path, port)).start_background()
    try:
        server.engines.max_wait = LONG
        release = threading.Event()
        handle = server.service.handle

        def held(req: Any) -> Any:
            if isinstance(req, p.GetStats):
                release.wait(LONG)
            return handle(req)

        server.service.handle = held  # type: ignore[method-assign]
        # The engine's call waits as long as the test lets it (not the client's default).
        with Client(server.endpoint, timeout=LONG) as client:
            stats: list[p.Stats] = []
            engine, engine_done = _in_thread(lambda: stats.append(client.stats()))
            wait_for("the request in flight", lambda: server.engines.in_flight == 1)
            url = f"http://127.0.0.1:{port}/quota"
            replies: list[int] = []
            router, router_done = _in_thread(
                lambda: replies.append(urllib.request.urlopen(url, timeout=LONG).status)
            )
            # The request reaches the app's door through the HTTP front (a process at a
            # lower priority: slow on a busy machine), then waits for the engine's request.
            wait_for("GET /quota at the door", lambda: server.engines.waits >= 1, LONG)
            assert not router_done.is_set()
            release.set()
            assert engine_done.wait(LONG) and router_done.wait(LONG)
            engine.join()
            router.join()
            assert replies == [200] and len(stats) == 1
            wait_for("no request in flight", lambda: server.engines.in_flight == 0)
    finally:
        release.set()
        server.stop()


def test_router_lookups_held_leave_the_engines_workers_free(tmp_path: Path) -> None:
    """Router lookups run on threads of their own: as many held in their handler as the
    server has request workers (waiting for a silent directory owner, say) leave an
    engine's blocking request (GetStats, on the request workers) free to run, and are
    answered once they go on."""
    server = Server(_config(tmp_path, 0)).start_background()
    release = threading.Event()
    routers: list[Client] = []
    try:

        def held(query: p.RouterQuery) -> dict[str, object]:
            release.wait(LONG)
            return {"chunks": 0, "instances": []}

        server.service.serve_router_lookups(held)
        query = p.RouterQuery("m", b"", b"\0" * 4, None, 0)
        for _ in range(server.cfg.workers):
            router = Client(server.endpoint, timeout=LONG)
            routers.append(router)
            lookup = p.RouterLookup(router._channel.rid(), "", query)
            router._channel.call(lookup, answered=False)
            router.ping()  # answered by the loop once it has taken the lookup (in order)
        with Client(server.endpoint, timeout=LONG) as engine:
            stats: list[p.Stats] = []
            _, engine_done = _in_thread(lambda: stats.append(engine.stats()))
            assert engine_done.wait(10.0), "the engine's request waited for the routers"
        release.set()
        for router in routers:
            assert router.settle(LONG) == 0  # each lookup answered, none failed
    finally:
        release.set()
        for router in routers:
            router.close()
        server.stop()
