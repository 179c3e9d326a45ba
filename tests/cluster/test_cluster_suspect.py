"""A silent peer or controller costs one timeout, not one per request: real servers (and a
real controller), one of them frozen with SIGSTOP (always resumed in a ``finally``). Checked
by counters (the requests that timed out, the lookups answered without asking), never by
timing; asynchronous effects are awaited by bounded polling."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from support.clusterkit import Node, call, converged, rows_of, start_node, status, wait_for
from support.controllers import running_controller, start_server
from support.kvops import chunk_keys, tokens_for
from support.servers import CHUNK_SHAPE, ServerProcess, chunk_data, register
from tierkv.cluster import messages as m
from tierkv.cluster.ring import Ring

pytestmark = pytest.mark.processes
Factory = Callable[..., ServerProcess]

# Heartbeats keep going, but a frozen member is not declared dead during the test: it stays
# a silent member (the case a suspect peer is for), not a departed one.
SILENT_NOT_DEAD = ["--member-ttl", "120", "--peer-timeout", "0.5"]
CHUNKS = 4


@contextmanager
def frozen(pid: int) -> Iterator[None]:
    """The process stopped (SIGSTOP, and seen stopped), resumed (SIGCONT) after."""
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: stopped(pid))
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def stopped(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def pid_of(node: Node) -> int:
    assert node.server.proc is not None
    return node.server.proc.pid


def ring_of(server_factory: Factory, n: int) -> list[Node]:
    """``n`` ring nodes seeded by the first, converged; silent members are not declared dead
    during a test."""
    first = start_node(server_factory, [], seed_self=True, extra=SILENT_NOT_DEAD)
    nodes = [first]
    for _ in range(n - 1):
        nodes.append(
            start_node(server_factory, [first.port], seed_self=True, extra=SILENT_NOT_DEAD)
        )
    wait_for(lambda: converged(nodes))
    return nodes


def test_a_frozen_ring_owner_costs_one_timeout_then_stores_and_lookups_skip_it(
    server_factory: Factory,
) -> None:
    a, b, c = ring_of(server_factory, 3)
    ring = Ring([a.node_id, b.node_id, c.node_id])
    before = status(a)
    stored: list[bytes] = []
    with a.client() as engine, frozen(pid_of(c)):
        register(engine)
        for i in range(8):  # stores: only the first to reach C waits for it
            tokens = tokens_for(100 + i, CHUNKS)
            res = engine.store(tokens, [chunk_data(tokens, j) for j in range(CHUNKS)])
            assert res.stored == list(range(CHUNKS))
            stored += chunk_keys(engine, tokens)
        for i in range(8):  # lookups of chunks nobody has: misses at once, C not asked
            tokens = tokens_for(200 + i, CHUNKS)
            assert engine.lookup(tokens, request_id=f"miss{i}", wait=True).hits == 0
            engine.end_session(f"miss{i}")
        during = status(a)
    owned_by_c = [
        k for k, o in zip(stored, ring.owners_many(stored), strict=True) if c.node_id in o
    ]
    assert owned_by_c, "no stored chunk has C among its directory owners"
    control, directory = during["control"], during["directory"]
    assert control["timeouts"] - before["control"]["timeouts"] == 1
    assert control["suspect"] == [c.addr]
    assert directory["publish_deferred"] >= len(owned_by_c) - CHUNKS
    assert directory["resolve_skipped"] > 0
    assert during["membership"]["alive"] == 3  # silent, not dead
    # C answers the probe again: no longer suspect, and what waited for it reaches it.
    wait_for(lambda: status(a)["control"]["suspect"] == [])
    wait_for(lambda: status(a)["directory"]["publish_deferred_sent"] > 0)

    def c_knows_them() -> bool:
        reply = call(c.addr, m.Resolve(0, owned_by_c))
        assert isinstance(reply, m.Resolved)
        return len({pos for pos, _, _ in rows_of(reply)}) == len(owned_by_c)

    wait_for(c_knows_them)
    assert status(a)["control"]["recovered"] >= 1


def test_a_frozen_holder_costs_one_fetch_timeout_then_its_chunks_miss_at_once(
    server_factory: Factory,
) -> None:
    a, _, c = ring_of(server_factory, 3)
    tokens = tokens_for(5, CHUNKS)
    with c.client() as producer:  # C's commit returns once the owners know the chunks
        register(producer)
        producer.store(tokens, [chunk_data(tokens, j) for j in range(CHUNKS)])

    def fetches_from_c() -> int:
        received = status(a)["transport"]["received"]
        return int(received.get(c.node_id, {}).get("requests", 0))

    with a.client() as engine:
        register(engine)
        with frozen(pid_of(c)):
            for i in range(6):
                assert engine.lookup(tokens, request_id=f"f{i}", wait=True).hits == 0
                engine.end_session(f"f{i}")
            assert fetches_from_c() <= 1  # one fetch waited for C, the others skipped it
            assert status(a)["control"]["suspect"] == [c.addr]
        wait_for(lambda: status(a)["control"]["suspect"] == [])
        assert engine.lookup(tokens, request_id="back", wait=True).hits == CHUNKS
        out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(CHUNKS)]
        assert engine.retrieve(request_id="back", out=out).retrieved == list(range(CHUNKS))
        for j in range(CHUNKS):
            np.testing.assert_array_equal(out[j], chunk_data(tokens, j))


def test_a_frozen_controller_costs_one_timeout_then_lookups_miss_at_once(
    server_factory: Factory, tmp_path: Path
) -> None:
    with running_controller(tmp_path) as ctl:
        a, b = (start_server(server_factory, ctl.addr) for _ in range(2))
        wait_for(lambda: len(ctl.instances()) == 2)
        tokens = tokens_for(7, CHUNKS)
        with b.client() as producer:
            register(producer)
            producer.store(tokens, [chunk_data(tokens, j) for j in range(CHUNKS)])
        wait_for(lambda: ctl.holders(chunk_keys_of(b, tokens)) == [{b.node_id}] * CHUNKS)
        before = status(a)["directory"]
        assert ctl.proc is not None
        with a.client() as engine:
            register(engine)
            with frozen(ctl.proc.pid):
                for i in range(10):
                    hits = engine.lookup(tokens, request_id=f"r{i}", wait=True).hits
                    assert hits == 0, (i, status(a)["directory"])  # a clean miss
                    engine.end_session(f"r{i}")
                during = status(a)["directory"]
            assert during["resolve_failures"] - before["resolve_failures"] <= 1
            assert during["resolve_skipped"] - before["resolve_skipped"] >= 9
            assert during["controller_suspect"]
            # The controller answers again: lookups go to it again, and hit.
            wait_for(lambda: not status(a)["directory"]["controller_suspect"])
            hits = engine.lookup(tokens, request_id="back", wait=True).hits
            assert hits == CHUNKS
            out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(CHUNKS)]
            got = engine.retrieve(request_id="back", out=out)
            assert got.retrieved == list(range(CHUNKS))
            for j in range(CHUNKS):
                np.testing.assert_array_equal(out[j], chunk_data(tokens, j))


def chunk_keys_of(node: Node, tokens: list[int]) -> list[bytes]:
    with node.client() as c:
        register(c)
        return chunk_keys(c, tokens)


def test_a_prefetch_not_done_in_time_is_a_miss_not_an_error(server_factory: Factory) -> None:
    """The reader's wait for a prefetch ends with the hits the pool had, never an error,
    even while the prefetch itself still waits on a frozen holder."""
    a, b = ring_of(server_factory, 2)
    tokens = tokens_for(9, CHUNKS)
    with b.client() as producer:
        register(producer)
        producer.store(tokens, [chunk_data(tokens, j) for j in range(CHUNKS)])
        keys = chunk_keys(producer, tokens)

    def a_knows_them() -> bool:
        reply = call(a.addr, m.Resolve(0, keys))
        assert isinstance(reply, m.Resolved)
        return len({pos for pos, _, _ in rows_of(reply)}) == CHUNKS

    wait_for(a_knows_them)  # A owns every key (two nodes, two replicas): no RPC to resolve
    with a.client() as engine, frozen(pid_of(b)):
        register(engine)
        found = engine.lookup(tokens, request_id="slow")
        assert found.prefetching  # from B, which cannot answer: the fetch waits its timeout
        assert engine.wait_prefetch("slow", timeout=0.05) == 0
        engine.end_session("slow")
