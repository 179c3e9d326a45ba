"""In-process unit tests of the lookup session state machine (:mod:`tierkv.server.sessions`):
a real index over a real shared-memory pool, real write-behind and prefetch threads, a tier
kept in memory, a hand-driven clock. No server process."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from support.memtier import CHUNK, WAIT, MemTier, key, payload
from tierkv.allocator import Allocator
from tierkv.eviction import Evictor
from tierkv.index import ObjectIndex
from tierkv.keys import LazyChunkKeys, Namespace, chunk_keys
from tierkv.pool import ShmPool
from tierkv.server.metrics import ServiceMetrics
from tierkv.server.sessions import LookupSessions, Progress
from tierkv.server.tiering import LookupAccounting, Tiering

ENGINE, RANK0, RANK1, SCHEDULER = 7, 10, 11, 12
TTL = 30.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Env:
    pool: ShmPool
    index: ObjectIndex
    tier: MemTier
    tiering: Tiering
    sessions: LookupSessions
    clock: Clock
    metrics: ServiceMetrics

    def store(self, keys: list[bytes]) -> None:
        """Commit ``keys`` into the pool, as an engine would."""
        res = self.index.reserve_write(keys, CHUNK, ENGINE)
        for i, off, n in res.slots:
            np.frombuffer(self.pool.view(off, n), np.uint8)[:] = payload(keys[i])
        self.index.commit(res.lease_id, ENGINE)

    def settle(self, holder: int, request_id: str) -> Progress:
        deadline = time.monotonic() + WAIT
        while True:
            progress = self.sessions.query(holder, request_id)
            assert progress is not None
            if progress.done or time.monotonic() > deadline:
                return progress
            time.sleep(0.005)


@pytest.fixture
def env() -> Iterator[Env]:
    pool = ShmPool.create(f"tierkv-test-sess-{uuid.uuid4().hex[:8]}", 32 * CHUNK)
    clock = Clock()
    index = ObjectIndex(Allocator(pool.size, 4096), 600.0, 300.0, clock=clock)
    eviction = Evictor(index)
    metrics = ServiceMetrics(eviction)
    lookups = LookupAccounting(metrics, index)
    tier = MemTier()
    tiering = Tiering(
        index,
        pool,
        [tier],
        lookups,
        workers=2,
        write_behind_max_bytes=2**30,
        prefetch_max_inflight=4,
        prefetch_timeout=WAIT,
    )
    sessions = LookupSessions(index, tiering, lookups, clock, TTL)
    try:
        yield Env(pool, index, tier, tiering, sessions, clock, metrics)
    finally:
        tiering.close()
        pool.close()


def keys(n: int, tag: str = "") -> list[bytes]:
    return [key(f"{tag}{i}") for i in range(n)]


def test_a_full_hit_is_locked_until_the_retrieve_takes_it_over(env: Env) -> None:
    ks = keys(3)
    env.store(ks)
    session = env.sessions.open(ENGINE, "r", ks, [CHUNK] * 3)
    assert (session.hits, session.total, session.prefetch) == (3, 3, None)
    assert env.index.stats().read_locked == 3
    assert env.sessions.query(ENGINE, "r") == Progress(True, 3, (("pool", 3),))
    lease = session.lease
    taken = env.sessions.take(ENGINE, "r")
    assert taken is not None and taken[0] == lease and taken[1] is session
    assert session.handed_out and session.lease == 0  # a late prefetch cannot attach
    assert env.sessions.query(ENGINE, "r") is None  # the session is the retrieve's now
    assert env.sessions.take(ENGINE, "r") is None
    assert env.sessions.count() == 0
    assert env.index.release_read(taken[0], ENGINE) == 3  # FINISH_RETRIEVE ends it
    env.index.check()


def test_a_partial_hit_prefetches_the_rest_from_the_tier(env: Env) -> None:
    ks = keys(4)
    env.store(ks[:1])
    env.tier.put(ks[1:])
    session = env.sessions.open(ENGINE, "r", ks, [CHUNK] * 4)
    assert session.hits == 1 and session.prefetch is not None
    # Where each hit came from, in chunk order (the engine reports it as its hit sources).
    assert env.settle(ENGINE, "r") == Progress(True, 4, (("pool", 1), ("mem", 3)))
    lease, _ = env.sessions.take(ENGINE, "r") or (0, None)
    assert [k for k, _, _ in env.index.lease_slots(lease, ENGINE)] == ks
    env.index.release_read(lease, ENGINE)
    hits, misses = env.metrics.lookup_counts(["mem"])
    assert hits == {"pool": 1, "mem": 3} and sum(misses.values()) == 0


def test_dropping_or_reopening_a_session_releases_its_locks(env: Env) -> None:
    ks = keys(2)
    env.store(ks)
    env.sessions.open(ENGINE, "r", ks, [CHUNK] * 2)
    env.sessions.open(ENGINE, "r", ks[:1], [CHUNK])  # same request id: replaces it
    assert env.index.stats().read_locked == 1 and env.sessions.count() == 1
    assert env.sessions.drop(ENGINE, "r") == 1
    assert env.sessions.drop(ENGINE, "r") == 0  # twice is harmless
    st = env.index.stats()
    assert st.read_locked == 0 and st.read_leases == 0
    env.index.check()


def test_idle_sessions_expire_and_queries_keep_them_alive(env: Env) -> None:
    ks = keys(1)
    env.store(ks)
    env.sessions.open(ENGINE, "idle", ks, [CHUNK])
    env.sessions.open(ENGINE, "busy", ks, [CHUNK])
    env.clock.now += TTL * 0.75
    assert env.sessions.query(ENGINE, "busy") is not None  # touched now
    env.clock.now += TTL * 0.5
    assert env.sessions.expire() == 1
    assert env.sessions.query(ENGINE, "idle") is None
    assert env.sessions.query(ENGINE, "busy") is not None
    assert env.index.stats().read_locked == 1


def test_a_group_lookup_answers_the_smallest_rank_and_ends_as_a_whole(env: Env) -> None:
    rank0, rank1 = keys(3, "a"), keys(3, "b")
    env.store(rank0)
    env.store(rank1[:2])
    hits, total, prefetching = env.sessions.open_group(
        SCHEDULER, "r", [(RANK0, rank0, [CHUNK] * 3), (RANK1, rank1, [CHUNK] * 3)]
    )
    assert (hits, total, prefetching) == (2, 3, True)  # rank 1 prefetches (and misses)
    assert env.settle(SCHEDULER, "r") == Progress(True, 2, (("pool", 2),))
    # One count per open session: the scheduler's group and each rank's own.
    assert [env.sessions.count_of(t) for t in (SCHEDULER, RANK0, RANK1)] == [1, 1, 1]
    assert env.sessions.count() == 3
    # Each rank retrieves its own chunks by request id, at most the group's hit count.
    taken = env.sessions.take(RANK0, "r")
    assert taken is not None and taken[1].hits == 2
    env.index.release_read(taken[0], RANK0)
    assert env.sessions.drop(SCHEDULER, "r") == 2  # rank 1's locks; rank 0's were taken
    assert env.sessions.count() == 0
    st = env.index.stats()
    assert st.read_locked == 0 and st.read_leases == 0


def test_a_rank_that_looked_up_again_keeps_its_new_session_when_the_group_ends(
    env: Env,
) -> None:
    rank0, rank1 = keys(1, "a"), keys(1, "b")
    env.store(rank0 + rank1)
    env.sessions.open_group(SCHEDULER, "r", [(RANK0, rank0, [CHUNK]), (RANK1, rank1, [CHUNK])])
    env.sessions.open(RANK1, "r", rank1, [CHUNK])  # the rank replaced its session
    assert env.sessions.drop(SCHEDULER, "r") == 1  # rank 0's only
    assert env.sessions.query(RANK1, "r") == Progress(True, 1, (("pool", 1),))


def test_a_group_hit_counts_under_the_tier_any_rank_prefetched_it_from(env: Env) -> None:
    """Rank 0 holds all three chunks in the pool; rank 1 holds its first and prefetches the
    other two from the tier: chunks 1 and 2 came from the tier (rank 1 waited for them)."""
    rank0, rank1 = keys(3, "a"), keys(3, "b")
    env.store(rank0)
    env.store(rank1[:1])
    env.tier.put(rank1[1:])
    hits, _, prefetching = env.sessions.open_group(
        SCHEDULER, "r", [(RANK0, rank0, [CHUNK] * 3), (RANK1, rank1, [CHUNK] * 3)]
    )
    assert (hits, prefetching) == (1, True)
    assert env.settle(SCHEDULER, "r") == Progress(True, 3, (("pool", 1), ("mem", 2)))
    env.sessions.drop(SCHEDULER, "r")
    assert env.index.stats().read_locked == 0


def test_a_client_with_too_many_open_sessions_loses_its_oldest(env: Env) -> None:
    """An engine that never ends its lookups kept a session (and its locks) per lookup for
    a whole TTL: 60,000 lookups held them all. Past the limit its oldest sessions end."""
    ks = keys(2)
    env.store(ks)
    env.sessions.max_sessions = 3
    for rid in "abcd":
        env.sessions.open(ENGINE, rid, ks, [CHUNK] * 2)
    env.sessions.open(RANK0, "other", ks, [CHUNK] * 2)  # another client's are its own
    assert env.sessions.count_of(ENGINE) == 3 and env.sessions.ended_over_limit == 1
    assert env.sessions.query(ENGINE, "a") is None  # the oldest went, its locks with it
    assert env.sessions.query(ENGINE, "d") is not None
    assert env.index.stats().read_locked == 2 and env.index.stats().read_leases == 4
    env.sessions.open_group(SCHEDULER, "g", [(RANK0, ks, [CHUNK] * 2), (RANK1, ks, [CHUNK] * 2)])
    for rid in "hij":
        env.sessions.open_group(SCHEDULER, rid, [(RANK1, ks, [CHUNK] * 2)])
    assert env.sessions.count_of(SCHEDULER) == 3 and env.sessions.query(SCHEDULER, "g") is None
    assert env.sessions.count_of(RANK1) == 3  # its own limit too
    for holder in (ENGINE, RANK0, RANK1, SCHEDULER):
        env.sessions.drop_holder(holder)
    assert env.index.stats().read_leases == 0
    # A rank's part of a group is ended with the whole group: the group answered its full
    # hit count while that rank could no longer retrieve.
    env.sessions.open_group(SCHEDULER, "g", [(RANK0, ks, [CHUNK] * 2), (RANK1, ks, [CHUNK] * 2)])
    for rid in ("own1", "own2", "own3"):
        env.sessions.open(RANK0, rid, ks, [CHUNK] * 2)
    assert env.sessions.query(SCHEDULER, "g") is None and env.sessions.take(RANK1, "g") is None
    assert env.sessions.count_of(RANK0) == 3 and env.sessions.count_of(RANK1) == 0
    env.sessions.drop_holder(RANK0)
    assert env.index.stats().read_leases == 0
    env.index.check()


def test_a_client_going_away_ends_every_session_it_holds(env: Env) -> None:
    ks = keys(2)
    env.store(ks)
    env.sessions.open(ENGINE, "a", ks, [CHUNK] * 2)
    env.sessions.open(ENGINE, "b", ks, [CHUNK] * 2)
    assert env.sessions.drop_holder(ENGINE) == 4
    assert env.sessions.count_of(ENGINE) == 0 and env.index.stats().read_locked == 0


def lazy_prompt(n: int, seed: int) -> tuple[LazyChunkKeys, list[bytes]]:
    """A prompt of ``n`` chunks of 16 tokens: its keys hashed as read, and all of them."""
    digest = Namespace("m", "float16", "test-layout").digest()
    tokens = np.random.default_rng(seed).integers(0, 50_000, n * 16, dtype="<u4").tobytes()
    return LazyChunkKeys(digest, tokens, (), 16), chunk_keys(digest, tokens, 16)


def test_a_lookup_of_a_new_prompt_hashes_its_first_chunk_only(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No tier has the first chunk the pool lacks: neither the session's locks nor the
    prefetch read the other keys, so they are never hashed."""
    asked: list[list[bytes]] = []
    real = env.tier.contains
    monkeypatch.setattr(env.tier, "contains", lambda ks: asked.append(list(ks)) or real(ks))
    lazy, _ = lazy_prompt(32, seed=1)
    session = env.sessions.open(ENGINE, "r", lazy, [CHUNK] * 32)
    assert (session.hits, session.total) == (0, 32)
    assert env.settle(ENGINE, "r") == Progress(True, 0)
    assert len(lazy.hashed) == 1
    assert asked == [[lazy[0]]]
    env.sessions.drop(ENGINE, "r")


def test_lazily_hashed_keys_are_prefetched_in_full_once_a_tier_has_the_first_miss(
    env: Env,
) -> None:
    lazy, ks = lazy_prompt(6, seed=2)
    env.store(ks[:2])
    env.tier.put(ks[2:])
    session = env.sessions.open(ENGINE, "r", lazy, [CHUNK] * 6)
    assert session.hits == 2
    assert env.settle(ENGINE, "r") == Progress(True, 6, (("pool", 2), ("mem", 4)))
    assert lazy.hashed == ks
    lease, _ = env.sessions.take(ENGINE, "r") or (0, None)
    assert [k for k, _, _ in env.index.lease_slots(lease, ENGINE)] == ks
    env.index.release_read(lease, ENGINE)


def test_a_prefetch_that_timed_out_after_loading_still_says_it_found_chunks(env: Env) -> None:
    """The chunks a prefetch brought into the pool stay there when the lookup stopped
    waiting for it (its deadline passed while it loaded): ``on_found`` (which binds a cache
    salt's tenant to them) was called only for a prefetch that was not cancelled, so such
    chunks stayed charged to ``~other``."""
    ks = keys(3)
    env.tier.put(ks)
    gate = env.tier.hold()
    found: list[int] = []
    session = env.sessions.open(ENGINE, "r", ks, [CHUNK] * 3, on_found=lambda: found.append(1))
    job = session.prefetch
    assert job is not None and env.tier.entered.wait(WAIT)
    prefetcher = env.tiering.prefetcher
    prefetcher.clock = lambda: job.deadline  # the lookup's wait is over: cancelled
    assert env.sessions.query(ENGINE, "r") == Progress(True, 0, ()) and job.cancelled
    gate.set()
    assert job.done.wait(WAIT)
    assert env.index.contains(ks) == [True] * 3  # loaded into the pool all the same
    assert found == [1]
