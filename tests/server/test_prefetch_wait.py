"""QUERY_PREFETCH with ``wait_ms``: the server holds the reply until the lookup's prefetch
lands (or the wait runs out), with no thread waiting for it, and keeps serving everything
else meanwhile. A real server (RPC loop, index, shared-memory pool, prefetch threads) in this
process, real clients over its socket, and a tier kept in memory that the test can stall
(:class:`support.memtier.MemTier`): a real medium cannot be made to block on demand."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from support.memtier import CHUNK, WAIT, MemTier
from support.raw_rpc import Raw
from tierkv import protocol as p
from tierkv.client import Client
from tierkv.config import ServerConfig
from tierkv.server.wiring import Server

TOKENS = 256  # per chunk
SHAPE = (TOKENS, CHUNK // TOKENS // 4)  # float32: one chunk is CHUNK bytes
PROMPT = np.arange(4 * TOKENS, dtype=np.uint32)


@dataclass
class Env:
    server: Server
    mem: MemTier
    client: Client

    def queries(self) -> int:
        """QUERY_PREFETCH requests the server counted (any outcome)."""
        figures = self.server.service.metrics.requests.snapshot()
        return sum(n for (name, _), (n, _, _) in figures.items() if name == "query_prefetch")

    def stall_lookup(self, request_id: str) -> threading.Event:
        """A LOOKUP that hits chunk 0 and prefetches chunks 1-3 from the tier, which the
        returned event holds back until it is set."""
        gate = self.mem.hold()
        found = self.client.lookup(PROMPT, request_id=request_id)
        assert found.hits == 1 and found.prefetching
        assert self.mem.entered.wait(WAIT)
        return gate


def new_client(endpoint: str) -> Client:
    client = Client(endpoint)
    client.register("m", SHAPE, "float32", token_axis=0)
    return client


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    mem = MemTier()
    run = f"tkv-wait-{uuid.uuid4().hex[:8]}"
    cfg = ServerConfig(
        pool_name=run,
        pool_size=64 * CHUNK,
        http_port=0,
        instance=run,
        runtime_dir=str(tmp_path / "run"),
        prefetch_timeout=WAIT,
    )
    server = Server(cfg, tiers=[mem]).start_background()
    client = new_client(server.endpoint)
    try:
        chunks = [np.full(SHAPE, i, np.float32) for i in range(4)]
        assert len(client.store(PROMPT, chunks).stored) == 4
        service = server.service
        assert service.tiering.write_behind.wait_idle(WAIT) and len(mem.data) == 4
        ns = client.registration.namespace
        from tierkv import keys

        ks = keys.chunk_keys(ns, PROMPT.tobytes(), TOKENS, False)
        service.index.delete(list(ks)[1:])  # chunks 1-3 now only in the tier
        yield Env(server, mem, client)
    finally:
        if mem.gate is not None:
            mem.gate.set()
        client.close()
        server.stop()


def in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


def test_a_held_query_is_answered_when_the_prefetch_lands(env: Env) -> None:
    gate = env.stall_lookup("r1")
    before = env.queries()
    thread, out = in_thread(lambda: env.client.query_prefetch("r1", wait=WAIT))
    thread.join(0.3)
    assert thread.is_alive(), out  # held: the tier has not let the prefetch finish
    # Meanwhile the server serves: another engine stores and looks up.
    other = new_client(env.server.endpoint)
    try:
        other_prompt = PROMPT + 100_000
        assert len(other.store(other_prompt, [np.ones(SHAPE, np.float32)] * 4).stored) == 4
        assert other.lookup(other_prompt).hits == 4
    finally:
        other.close()
    gate.set()
    thread.join(WAIT)
    (status,) = out
    assert status.done and status.hits == 4
    assert env.queries() - before == 1  # one request: no polling
    got = env.client.retrieve(request_id="r1", out=[np.zeros(SHAPE, np.float32)] * 4)
    assert len(got.retrieved) == 4


def test_a_held_query_ends_with_its_wait_and_the_progress_so_far(env: Env) -> None:
    env.stall_lookup("r2")
    start = time.monotonic()
    status = env.client.query_prefetch("r2", wait=0.2)
    assert time.monotonic() - start >= 0.2
    assert not status.done and status.hits == 1
    env.mem.gate.set()  # type: ignore[union-attr]
    assert env.client.wait_prefetch("r2") == 4


def test_wait_prefetch_is_answered_once_the_prefetch_lands(env: Env) -> None:
    """wait_prefetch holds each query up to a slice (the client's other threads wait no
    longer for the connection) and returns the final count once the tier lets go."""
    gate = env.stall_lookup("r3")
    thread, out = in_thread(lambda: env.client.wait_prefetch("r3", timeout=WAIT))
    thread.join(0.3)
    assert thread.is_alive()
    gate.set()
    thread.join(WAIT)
    assert out == [4]


def test_a_prefetch_ended_by_the_servers_timeout_answers_the_held_query(
    env: Env, tmp_path: Path
) -> None:
    """The server's prefetch_timeout ends a prefetch whose tier never answers: the held
    query is answered then, done with the pool's hits, not at the end of its own wait."""
    env.server.service.tiering.prefetcher.timeout = 0.3
    env.stall_lookup("r4")
    start = time.monotonic()
    status = env.client.query_prefetch("r4", wait=WAIT)
    assert status.done and status.hits == 1
    assert time.monotonic() - start < WAIT  # answered by the prefetch's end, not the wait
    env.mem.gate.set()  # type: ignore[union-attr]


def test_bad_waits_get_a_clear_error_and_the_server_keeps_serving(env: Env) -> None:
    env.stall_lookup("r5")
    raw = Raw(env.server.endpoint)
    try:
        client = env.client.registration.client
        for wait_ms in (-1, p.MAX_PREFETCH_WAIT_MS + 1, -(2**63)):
            reply = raw.call(p.QueryPrefetch(1, client, "r5", wait_ms))
            assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.BAD_REQUEST
            assert "wait_ms" in reply.message
        reply = raw.call(p.QueryPrefetch(2, client, "no such lookup", 5_000))
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.NOT_FOUND
        reply = raw.call(p.QueryPrefetch(3, 12345, "r5", 5_000))
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.NOT_REGISTERED
    finally:
        raw.close()
    env.mem.gate.set()  # type: ignore[union-attr]
    assert env.client.wait_prefetch("r5") == 4  # the lookup was left as it was


def test_a_client_gone_while_its_query_is_held_leaves_nothing_behind(env: Env) -> None:
    """A client that sent a held query and crashed (its connection closed): the prefetch
    lands, the reply has nowhere to go, the server serves on; ending the client's session
    leaves no locks."""
    gate = env.stall_lookup("r6")
    raw = Raw(env.server.endpoint)
    raw.send(p.QueryPrefetch(1, env.client.registration.client, "r6", 10_000))
    time.sleep(0.1)  # the request reaches the server before the connection closes
    raw.close()
    gate.set()
    service = env.server.service
    deadline = time.monotonic() + WAIT
    while service.tiering.prefetcher.stats.inflight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert env.client.wait_prefetch("r6") == 4  # the session is intact, the server serves
    env.client.end_session("r6")
    stats = service.index.stats()
    assert stats.read_locked == 0 and stats.read_leases == 0
    service.index.check()


def test_a_connection_holds_a_bounded_number_of_waiting_queries(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client sending waiting queries in a loop made the loop hold each one (and the
    prefetch keep a callback for it) for up to 60 s: past MAX_HELD filed on a connection,
    a query is answered at once with the progress so far."""
    from tierkv.server import held_queries

    monkeypatch.setattr(held_queries, "MAX_HELD", 2)
    gate = env.stall_lookup("r7")
    raw = Raw(env.server.endpoint)
    try:
        client = env.client.registration.client
        for rid in (1, 2, 3):
            raw.send(p.QueryPrefetch(rid, client, "r7", 10_000))
        reply = raw.recv(WAIT)  # the third, at once: the first two are held
        assert isinstance(reply, p.PrefetchStatus) and reply.rid == 3 and not reply.done
        gate.set()
        held = sorted([raw.recv(WAIT), raw.recv(WAIT)], key=lambda r: r.rid)
        assert [(r.rid, r.done, r.hits) for r in held] == [(1, True, 4), (2, True, 4)]
    finally:
        raw.close()
    env.client.end_session("r7")


class _Landing:
    """A service whose lookups' prefetches the test lands (for HeldQueries alone)."""

    def __init__(self) -> None:
        self.done: dict[str, bool] = {}
        self.wakes: dict[str, list[Any]] = {}

    def handle(self, req: p.QueryPrefetch) -> p.PrefetchStatus:
        return self.reply_to(req)

    def reply_to(self, req: p.QueryPrefetch) -> p.PrefetchStatus:
        return p.PrefetchStatus(req.rid, self.done.get(req.request_id, False), 0)

    def watch_prefetch(self, req: p.QueryPrefetch, wake: Any) -> float:
        self.wakes.setdefault(req.request_id, []).append(wake)
        return 1e9  # the prefetch's own deadline: far off

    def land(self, request_id: str) -> None:
        self.done[request_id] = True
        for wake in self.wakes.pop(request_id):
            wake()


def test_queries_answered_when_their_prefetch_landed_leave_room_for_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Queries answered as their prefetch landed stay filed until their wait would have
    ended: counted against the limit, they made a connection's next waiting query be
    answered at once, not done, with nothing held for it."""
    from tierkv.server import held_queries

    monkeypatch.setattr(held_queries, "MAX_HELD", 4)
    service, sent = _Landing(), []
    held = held_queries.HeldQueries(service, lambda _c, r: sent.append(r), lambda: 0.0)  # type: ignore[arg-type]
    conn = object()
    for i in range(4):
        assert held.hold(conn, p.QueryPrefetch(i, 1, f"r{i}", 60_000)) is None
        service.land(f"r{i}")
    assert [r.rid for r in sent] == [0, 1, 2, 3]
    assert held.hold(conn, p.QueryPrefetch(4, 1, "fresh", 60_000)) is None  # held
    for i in range(5, 8):
        assert held.hold(conn, p.QueryPrefetch(i, 1, f"r{i}", 60_000)) is None
    answered_now = held.hold(conn, p.QueryPrefetch(8, 1, "r8", 60_000))  # 4 waiting: full
    assert isinstance(answered_now, p.PrefetchStatus) and not answered_now.done
    # Nothing answered since: a query past the limit costs no pass over the heap (each one
    # rebuilt it, a loop's time quadratic in what a client sent).
    passes = []
    monkeypatch.setattr(held, "_prune", lambda c: passes.append(c) or 4)
    for i in range(9, 20):
        assert held.hold(conn, p.QueryPrefetch(i, 1, f"r{i}", 60_000)) is not None
    assert passes == []
