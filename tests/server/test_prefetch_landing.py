"""A prefetch's chunks offered as they land: the pool commits and locks each landed span for
the lookup, a held QUERY_PREFETCH with ``landed_over`` answers as chunks land, and
``Client.retrieve(request_id, wait=True)`` copies each landed part out while the rest are
on the way. A real server (RPC loop, index, shared-memory pool, prefetch threads) in this
process, real clients (one in a process of its own, killed midway), and a tier kept in
memory whose chunks land one at a time when the test says (:class:`support.memtier.MemTier`
with ``steps``): a real medium cannot be paced on demand. The peer tier's landing is shown
between real servers in ``tests/cluster/test_cluster_servers.py``."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from support.memtier import CHUNK, WAIT, MemTier
from support.raw_rpc import Raw
from tierkv import keys
from tierkv import protocol as p
from tierkv.client import Client
from tierkv.config import ServerConfig
from tierkv.server.wiring import Server
from tierkv.tiers.base import LoadStatus

TOKENS = 256  # per chunk
SHAPE = (TOKENS, CHUNK // TOKENS // 4)  # float32: one chunk is CHUNK bytes
CHUNKS = 8
PROMPT = np.arange(CHUNKS * TOKENS, dtype=np.uint32)


def chunk(i: int) -> np.ndarray[Any, Any]:
    return np.full(SHAPE, i + 1, np.float32)


def new_client(endpoint: str) -> Client:
    client = Client(endpoint)
    client.register("m", SHAPE, "float32", token_axis=0)
    return client


def wait_for(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@dataclass
class Env:
    server: Server
    mem: MemTier
    client: Client
    keys: list[bytes]

    def stepped_lookup(self, request_id: str) -> threading.Semaphore:
        """A LOOKUP that hits chunk 0 and prefetches chunks 1-7 from the tier, each landing
        only when the returned semaphore is released once more."""
        steps = self.mem.steps = threading.Semaphore(0)
        found = self.client.lookup(PROMPT, request_id=request_id)
        assert found.hits == 1 and found.prefetching
        return steps

    def quiet(self) -> None:
        """Nothing in flight, nothing locked, the index consistent."""
        service = self.server.service
        wait_for(lambda: not service.tiering.prefetcher.stats.inflight, "the prefetch's end")
        stats = service.index.stats()
        assert (stats.read_locked, stats.read_leases, stats.write_leases) == (0, 0, 0)
        service.index.check()


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    mem = MemTier()
    run = f"tkv-land-{uuid.uuid4().hex[:8]}"
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
        assert len(client.store(PROMPT, [chunk(i) for i in range(CHUNKS)]).stored) == CHUNKS
        service = server.service
        assert service.tiering.write_behind.wait_idle(WAIT) and len(mem.data) == CHUNKS
        ns = client.registration.namespace
        ks = list(keys.chunk_keys(ns, PROMPT.tobytes(), TOKENS, False))
        service.index.delete(ks[1:])  # chunks 1-7 now only in the tier
        yield Env(server, mem, client, ks)
    finally:
        if mem.steps is not None:
            mem.steps.release(CHUNKS)
        client.close()
        server.stop()


def test_a_held_query_answers_as_chunks_land(env: Env) -> None:
    steps = env.stepped_lookup("r1")
    status = env.client.query_prefetch("r1", wait=0.05, landed_over=1)
    assert (status.done, status.hits, status.landed) == (False, 1, 1)  # nothing landed yet
    steps.release(2)
    landed = 1
    while landed < 3:  # each answer comes as soon as more than landed_over have landed
        status = env.client.query_prefetch("r1", wait=WAIT, landed_over=landed)
        assert not status.done and status.landed > landed
        landed = status.landed
    assert status.hits == 1  # what the engine was told stays until the prefetch is done
    assert env.server.service.index.contains(env.keys[:4]) == [True, True, True, False]
    steps.release(CHUNKS)
    assert env.client.wait_prefetch("r1") == CHUNKS
    env.client.end_session("r1")
    env.quiet()


def test_retrieve_with_wait_copies_each_part_as_it_lands(env: Env) -> None:
    steps = env.stepped_lookup("r2")
    out = [np.zeros(SHAPE, np.float32) for _ in range(CHUNKS)]
    got: list[Any] = []
    thread = threading.Thread(
        target=lambda: got.append(env.client.retrieve(request_id="r2", out=out, wait=True)),
        daemon=True,
    )
    thread.start()
    steps.release(3)  # chunks 1-3 land: with chunk 0 they are copied out at once
    wait_for(lambda: bool(out[3].any()), "chunks 0-3 copied out")
    for i in range(4):
        np.testing.assert_array_equal(out[i], chunk(i))
    assert thread.is_alive() and not any(out[i].any() for i in range(4, CHUNKS))
    steps.release(CHUNKS)
    thread.join(WAIT)
    (result,) = got
    assert result.retrieved == list(range(CHUNKS)) and result.complete
    for i in range(CHUNKS):
        np.testing.assert_array_equal(out[i], chunk(i))
    assert env.server.service.sessions.count() == 0  # the retrieve ended the lookup
    env.quiet()


def test_a_chunk_that_fails_ends_what_is_offered(env: Env) -> None:
    """Chunk 4 arrives corrupt: the engine gets chunks 0-3, the pool never offers chunk 4's
    slot, and chunks after it that landed intact are not offered either (a prefix)."""
    env.mem.load_status[env.keys[4]] = LoadStatus.CORRUPT
    steps = env.stepped_lookup("r3")
    steps.release(CHUNKS)
    out = [np.zeros(SHAPE, np.float32) for _ in range(CHUNKS)]
    result = env.client.retrieve(request_id="r3", out=out, wait=True)
    assert result.retrieved == [0, 1, 2, 3] and result.missing == [4, 5, 6, 7]
    for i in range(4):
        np.testing.assert_array_equal(out[i], chunk(i))
    assert not any(out[i].any() for i in range(4, CHUNKS))
    assert env.server.service.index.contains(env.keys) == [True] * 4 + [False] * 4
    env.quiet()


def test_retrieve_with_wait_on_a_lookup_that_needed_no_prefetch(env: Env) -> None:
    again = PROMPT[: TOKENS * 1]
    assert not env.client.lookup(again, request_id="r4").prefetching
    out = [np.zeros(SHAPE, np.float32)]
    result = env.client.retrieve(request_id="r4", out=out, wait=True)
    assert result.retrieved == [0] and result.complete
    np.testing.assert_array_equal(out[0], chunk(0))
    with pytest.raises(ValueError, match="request_id"):
        env.client.retrieve(again, out=out, wait=True)
    env.quiet()


def test_bad_landed_requests_get_a_clear_error_and_the_lookup_goes_on(env: Env) -> None:
    steps = env.stepped_lookup("r5")
    steps.release(2)
    wait_for(lambda: env.client.query_prefetch("r5").landed == 3, "chunks 1-2 landed")
    raw = Raw(env.server.endpoint)
    try:
        client = env.client.registration.client
        bad = [
            (p.PrepareRetrieve(1, client, landed_only=True), "landed_only needs a request_id"),
            (p.PrepareRetrieve(2, client, "r5", first_chunk=-1, landed_only=True), "first_chunk"),
            (p.PrepareRetrieve(3, client, "r5", first_chunk=-(2**63)), "first_chunk"),
            (p.QueryPrefetch(4, client, "r5", 1000, landed_over=-2), "landed_over"),
        ]
        for req, message in bad:
            reply = raw.call(req)
            assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.BAD_REQUEST, reply
            assert message in reply.message
        reply = raw.call(p.PrepareRetrieve(5, client, "no such lookup", landed_only=True))
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.NOT_FOUND
        # Past what has landed: nothing to lock, the session goes on.
        reply = raw.call(p.PrepareRetrieve(6, client, "r5", first_chunk=3, landed_only=True))
        assert isinstance(reply, p.RetrieveSlots) and (reply.lease, reply.slots) == (0, [])
    finally:
        raw.close()
    steps.release(CHUNKS)
    out = [np.zeros(SHAPE, np.float32) for _ in range(CHUNKS)]
    result = env.client.retrieve(request_id="r5", out=out, wait=True)
    assert result.retrieved == list(range(CHUNKS))
    for i in range(CHUNKS):
        np.testing.assert_array_equal(out[i], chunk(i))
    env.quiet()


# -- an engine killed while it copies a landed part ----------------------------------------
def retrieve_and_hang(endpoint: str, ready: Any) -> None:
    """Look up, retrieve with wait, and hang in the copy of the first landed part."""
    client = new_client(endpoint)
    assert client.lookup(PROMPT, request_id="doomed").prefetching

    def scatter(position: int, src: np.ndarray[Any, Any]) -> None:
        if position == 1:  # a chunk the prefetch landed, under the part's own lease
            ready.set()
            time.sleep(3600)

    client.retrieve(request_id="doomed", scatter=scatter, wait=True)


@pytest.mark.processes
def test_an_engine_killed_while_copying_a_landed_part_leaves_nothing_behind(env: Env) -> None:
    steps = env.mem.steps = threading.Semaphore(0)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=retrieve_and_hang, args=(env.server.endpoint, ready), daemon=True)
    proc.start()
    try:
        wait_for(lambda: env.server.service.tiering.prefetcher.stats.inflight == 1, "a lookup")
        steps.release(2)
        assert ready.wait(60), "the engine never reached the landed part"
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
        proc.join(30)
    assert proc.exitcode == -signal.SIGKILL
    service = env.server.service
    wait_for(lambda: service.sessions.count() == 0, "the killed engine's session dropped")
    steps.release(CHUNKS)  # the prefetch runs on into a lease that is gone: it stops locking
    env.quiet()
    # The server serves on, and what landed is in the pool for the next engine.
    out = [np.zeros(SHAPE, np.float32) for _ in range(CHUNKS)]
    env.client.lookup(PROMPT, request_id="after")
    result = env.client.retrieve(request_id="after", out=out, wait=True)
    assert result.retrieved == list(range(CHUNKS))
    for i in range(CHUNKS):
        np.testing.assert_array_equal(out[i], chunk(i))
    env.quiet()
