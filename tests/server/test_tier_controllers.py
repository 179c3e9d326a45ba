"""In-process tests of the tier controllers: write-behind
(:mod:`tierkv.server.tiering.write_behind`) and prefetch (:mod:`tierkv.server.tiering.prefetch`).

They run on a real shared-memory pool, a real :class:`ObjectIndex` and a real
:class:`DiskTier` in a temporary directory, next to :class:`MemTier`, a small tier kept
in ``support/memtier.py`` for what a real medium cannot be made to do on demand: raise,
report a chunk corrupt or missing in the middle of a run, answer with the wrong number of
results, or block until the test lets it go (to observe the controllers mid-flight and to
run into the prefetch timeout).

Every test ends with ``index.check()`` (the index's own accounting invariants). Nothing here
asserts on time: a blocked tier is released by an event, and asynchronous effects are awaited
with ``wait_idle`` / ``job.done``, each bounded.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from support.memtier import CHUNK, WAIT, MemTier, key, payload
from tierkv.allocator import Allocator
from tierkv.index import Holder, ObjectIndex
from tierkv.pool import SHM_DIR, ShmPool
from tierkv.server.tiering.prefetch import Prefetcher, PrefetchJob, Verified
from tierkv.server.tiering.write_behind import WriteBehind
from tierkv.tiers.base import LoadStatus, Tier
from tierkv.tiers.disk import DiskTier
from tierkv.workers import WorkerPool

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm (Linux)")

POOL_CHUNKS = 16
ENGINE = 7  # holder id of the "engine" that stores and looks up in these tests
OTHER_ENGINE = 8


# -- fixtures ------------------------------------------------------------------------------
@dataclass
class Env:
    pool: ShmPool
    index: ObjectIndex
    executor: WorkerPool
    disk: DiskTier

    def commit(self, keys: Sequence[bytes], holder: int = ENGINE) -> list[bytes]:
        """Store ``keys`` as an engine does: reserve, copy the payload in, commit."""
        res = self.index.reserve_write(keys, CHUNK, holder)
        for i, offset, length in res.slots:
            np.frombuffer(self.pool.view(offset, length), np.uint8)[:] = payload(keys[i])
        if not res.lease_id:
            return []
        return self.index.commit(res.lease_id, holder).committed_keys

    def pool_holds(self, keys: Sequence[bytes]) -> bool:
        """Whether every key is ready in the pool with exactly its payload."""
        lock = self.index.lock_read(keys, ENGINE, prefix=False)
        try:
            return not lock.missing and all(
                np.array_equal(np.frombuffer(self.pool.view(off, n), np.uint8), payload(keys[i]))
                for i, off, n in lock.slots
            )
        finally:
            if lock.lease_id:
                self.index.release_read(lock.lease_id, ENGINE)

    def lease_holds(self, lease_id: int, holder: int, keys: Sequence[bytes]) -> bool:
        """Whether read lease ``lease_id`` locks exactly ``keys``, in order, intact."""
        slots = self.index.lease_slots(lease_id, holder)
        return [k for k, _, _ in slots] == list(keys) and all(
            np.array_equal(np.frombuffer(self.pool.view(off, n), np.uint8), payload(k))
            for k, off, n in slots
        )

    def stage(self, tier: Tier, keys: Sequence[bytes]) -> None:
        """Put ``keys`` into ``tier`` (from plain buffers, not the pool)."""
        assert all(tier.store([(k, memoryview(payload(k)))]) == [True] for k in keys)

    def write_behind(self, tiers: Sequence[Tier], max_bytes: int = 1 << 30) -> WriteBehind:
        return WriteBehind(self.index, self.pool, tiers, self.executor, max_bytes)

    def prefetcher(
        self,
        tiers: Sequence[Tier],
        max_inflight: int = 8,
        timeout: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        on_committed: Callable[[Tier, list[bytes], list[Verified]], None] | None = None,
    ) -> Prefetcher:
        return Prefetcher(
            self.index, self.pool, tiers, self.executor, max_inflight, timeout, on_committed, clock
        )


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    pool = ShmPool.create(
        f"tierkv-test-ctl-{os.getpid()}-{time.monotonic_ns()}", POOL_CHUNKS * CHUNK
    )
    index = ObjectIndex(Allocator(pool.size, 4096))
    executor = WorkerPool(4, "test-tier")
    disk = DiskTier(path=tmp_path / "disk")
    try:
        yield Env(pool, index, executor, disk)
        executor.shutdown(wait=True)
        index.check()
    finally:
        executor.shutdown(wait=True, cancel=True)
        disk.close()
        pool.close()


def wait_done(*jobs: PrefetchJob | None) -> None:
    for job in jobs:
        assert job is not None
        assert job.done.wait(WAIT), "prefetch did not finish"


def disk_holds(disk: DiskTier, keys: Sequence[bytes]) -> bool:
    out = np.zeros(CHUNK, np.uint8)
    for k in keys:
        if disk.load([(k, memoryview(out))]) != [LoadStatus.OK]:
            return False
        if not np.array_equal(out, payload(k)):
            return False
    return True


# -- write-behind --------------------------------------------------------------------------
def test_write_behind_writes_committed_chunks_to_every_tier(env: Env) -> None:
    mem = MemTier()
    wb = env.write_behind([env.disk, mem])
    keys = [key(i) for i in range(5)]
    committed = env.commit(keys)
    assert wb.submit(committed) == 5
    assert wb.wait_idle(WAIT)
    assert disk_holds(env.disk, keys)
    assert all(mem.data[k] == payload(k).tobytes() for k in keys)
    s = wb.stats
    assert s.written_chunks == {"disk": 5, "mem": 5}
    assert s.written_bytes == {"disk": 5 * CHUNK, "mem": 5 * CHUNK}
    assert s.failed_chunks == {} and s.dropped_chunks == 0
    assert s.queued_chunks == 0 and s.queued_bytes == 0
    st = env.index.stats()
    assert st.read_locked == 0 and st.read_leases == 0 and st.evictable == 5


def test_write_behind_pins_the_slots_until_the_tiers_are_done(env: Env) -> None:
    """While a write is in flight its slots are pinned: eviction skips them, and a
    clear() leaves them allocated (zombies) until the write ends, so a new store cannot
    reuse a slot under the tier and the tier writes the committed bytes."""
    mem = MemTier()
    gate = mem.hold()
    wb = env.write_behind([mem])
    keys = [key(i) for i in range(3)]
    assert wb.submit(env.commit(keys)) == 3
    assert mem.entered.wait(WAIT)

    st = env.index.stats()
    assert st.read_locked == 3 and st.pinned == 3 and st.evictable == 0
    assert st.read_leases == st.pin_leases == 1
    assert wb.stats.queued_chunks == 3 and wb.stats.queued_bytes == 3 * CHUNK
    assert env.index.evict(env.pool.size) == []  # pinned: nothing to evict

    assert env.index.clear() == 3  # gone from lookups, slots still held by write-behind
    assert env.index.stats().zombies == 3
    others = [key(f"other-{i}") for i in range(POOL_CHUNKS)]
    assert len(env.commit(others)) == POOL_CHUNKS - 3  # the held slots are not handed out

    gate.set()
    assert wb.wait_idle(WAIT)
    assert all(mem.data[k] == payload(k).tobytes() for k in keys)
    st = env.index.stats()
    assert st.read_locked == 0 and st.read_leases == 0 and st.zombies == 0
    assert st.used == (POOL_CHUNKS - 3) * CHUNK  # the zombies' slots came back


def test_write_behind_queue_bound_drops_and_counts(env: Env) -> None:
    mem = MemTier()
    gate = mem.hold()
    wb = env.write_behind([mem], max_bytes=2 * CHUNK)
    keys = [key(i) for i in range(4)]
    committed = env.commit(keys)
    assert wb.submit(committed[:2]) == 2
    assert wb.submit(committed[2:3]) == 0  # over the bound: dropped, not waited for
    assert wb.stats.dropped_chunks == 1
    assert env.index.stats().pinned == 2  # the dropped chunk is not held

    gate.set()
    assert wb.wait_idle(WAIT)
    assert set(mem.data) == set(keys[:2])
    assert wb.submit(committed[3:]) == 1  # room again
    assert wb.wait_idle(WAIT)
    assert set(mem.data) == {*keys[:2], keys[3]}
    assert wb.stats.dropped_chunks == 1 and wb.stats.written_chunks == {"mem": 3}
    assert env.index.stats().read_locked == 0


def evict_order(index: ObjectIndex) -> list[bytes]:
    """Evict everything evictable one chunk at a time; the keys in eviction order."""
    order = []
    while batch := index.evict(CHUNK):
        assert len(batch) == 1
        order.append(batch[0].key)
    return order


def test_write_behind_leaves_the_lru_order_to_the_engines(env: Env) -> None:
    """A slow tier and a queue that drops: batch A is committed and queued, then B and C are
    committed and dropped, and an engine reads a0 meanwhile. Only uses order the pool: once
    A is written, eviction takes A's chunks in commit order (last chunk first) before B and
    C, except a0, which was read. (Were the write-behind's holds uses, A would become the
    most recent when the tier finished, and B and C would go first.)"""
    mem = MemTier()
    gate = mem.hold()
    wb = env.write_behind([mem], max_bytes=3 * CHUNK)
    a = [key(f"a{i}") for i in range(3)]
    b = [key(f"b{i}") for i in range(2)]
    c = [key(f"c{i}") for i in range(2)]
    assert wb.submit(env.commit(a)) == 3
    assert mem.entered.wait(WAIT)  # the tier holds A's write
    assert wb.submit(env.commit(b)) == 0 and wb.submit(env.commit(c)) == 0
    assert wb.stats.dropped_chunks == 4
    read = env.index.lock_read(a[:1], ENGINE)
    env.index.release_read(read.lease_id, ENGINE)

    # While A is pinned, eviction steps over it, and A keeps its place.
    assert [e.key for e in env.index.evict(CHUNK)] == [b[1]]
    gate.set()
    assert wb.wait_idle(WAIT)
    assert set(mem.data) == set(a)
    assert evict_order(env.index) == [a[2], a[1], b[0], c[1], c[0], a[0]]


def test_write_behind_keeps_the_order_of_chunks_it_did_write(env: Env) -> None:
    """Two batches whose writes finish in the opposite order of their commits: the pool
    keeps commit order (the older batch is evicted first), not completion order."""
    mem = MemTier()
    wb = env.write_behind([mem])
    old = env.commit([key(f"old{i}") for i in range(2)])
    new = env.commit([key(f"new{i}") for i in range(2)])
    assert wb.submit(new) == 2
    assert wb.wait_idle(WAIT)
    assert wb.submit(old) == 2
    assert wb.wait_idle(WAIT)
    assert evict_order(env.index) == [old[1], old[0], new[1], new[0]]


def test_write_behind_counts_tier_errors_and_never_raises(env: Env) -> None:
    raising, partial, broken = MemTier("raising"), MemTier("partial"), MemTier("broken")
    keys = [key(i) for i in range(6)]
    raising.raise_on_store = True
    partial.store_ok = lambda k: k in keys[::2]
    broken.short_answers = True
    wb = env.write_behind([raising, partial, broken, env.disk])
    assert wb.submit(env.commit(keys)) == 6
    assert wb.wait_idle(WAIT)
    s = wb.stats
    assert s.failed_chunks == {"raising": 6, "partial": 3, "broken": 6}
    assert s.written_chunks == {"raising": 0, "partial": 3, "broken": 0, "disk": 6}
    assert disk_holds(env.disk, keys)  # one failing tier does not stop the others
    assert env.index.stats().read_locked == 0


def test_write_behind_does_not_write_back_to_the_source_tier(env: Env) -> None:
    mem = MemTier()
    keys = [key(i) for i in range(3)]
    committed = env.commit(keys)
    only_disk = env.write_behind([env.disk])
    assert only_disk.submit(committed, source_tier="disk") == 0
    assert env.index.stats().read_leases == 0  # nothing locked for nothing to do
    both = env.write_behind([env.disk, mem])
    assert both.submit(committed, source_tier="disk") == 3
    assert both.wait_idle(WAIT)
    assert set(mem.data) == set(keys)
    assert env.disk.usage().objects == 0 and "disk" not in both.stats.written_chunks


def test_write_behind_skips_chunks_no_longer_in_the_pool(env: Env) -> None:
    mem = MemTier()
    wb = env.write_behind([mem])
    keys = [key(i) for i in range(4)]
    committed = env.commit(keys)
    env.index.delete(committed[1:3])
    assert wb.submit(committed) == 2
    assert wb.wait_idle(WAIT)
    assert set(mem.data) == {keys[0], keys[3]}


# -- prefetch ------------------------------------------------------------------------------
def test_prefetch_takes_the_longest_run_across_tiers_in_order(env: Env) -> None:
    """Chunks 0 and 1 are on disk (0 also in tier b), 2 only in b, 3 nowhere, 4 in b:
    chunks 0-2 are loaded, 0 and 1 from the first tier that has them, 2 from b."""
    b = MemTier("b")
    keys = [key(i) for i in range(5)]
    env.stage(env.disk, keys[:2])
    b.put([keys[0], keys[2], keys[4]])
    committed: list[tuple[list[bytes], str]] = []
    pf = env.prefetcher(
        [env.disk, b], on_committed=lambda src, ks, _: committed.append((ks, src.name))
    )
    job = pf.start(ENGINE, keys, [CHUNK] * 5, 0, 0)
    wait_done(job)
    assert job is not None and job.hits == 3 and job.loaded == 3
    assert job.lease_id and env.lease_holds(job.lease_id, ENGINE, keys[:3])
    assert b.loads == Counter({keys[2]: 1})  # chunk 0 came from the disk tier
    assert env.index.contains(keys) == [True, True, True, False, False]
    assert pf.stats.loaded_chunks == {"disk": 2, "b": 1}
    assert pf.stats.loaded_bytes == {"disk": 2 * CHUNK, "b": CHUNK}
    assert pf.stats.failed == {} and pf.stats.inflight == 0 and pf.stats.started == 1
    assert committed == [(keys[:2], "disk"), ([keys[2]], "b")]  # for write-behind, by source
    assert env.index.release_read(job.lease_id, ENGINE) == 3


class AskedTier(MemTier):
    """A MemTier that records every batch of keys it is asked about."""

    def __init__(self, name: str = "asked") -> None:
        super().__init__(name)
        self.asked: list[list[bytes]] = []

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self.asked.append(list(keys))
        return super().contains(keys)


def test_prefetch_of_a_new_prompt_asks_the_tiers_about_its_first_chunk_only(env: Env) -> None:
    """A run ends at the first chunk found nowhere: when no tier has the first chunk the
    pool lacks (a new prompt), no tier is asked about the others; when one has it, the
    rest are asked about in one batch."""
    a, b = AskedTier("a"), AskedTier("b")
    keys = [key(i) for i in range(8)]
    pf = env.prefetcher([a, b])
    job = pf.start(ENGINE, keys, [CHUNK] * 8, 0, 0)
    wait_done(job)
    assert job is not None and job.hits == 0
    assert a.asked == [[keys[0]]] and b.asked == [[keys[0]]]
    # Chunks 0-2 in b: b is asked about chunk 0, then a and b about the rest.
    a.asked.clear()
    b.asked.clear()
    b.put(keys[:3])
    job = pf.start(ENGINE, keys, [CHUNK] * 8, 0, 0)
    wait_done(job)
    assert job is not None and job.hits == 3
    assert a.asked == [[keys[0]], keys[1:]]
    assert b.asked == [[keys[0]], keys[1:]]
    assert env.index.release_read(job.lease_id, ENGINE) == 3


def test_prefetch_serves_pool_chunks_between_tier_chunks(env: Env) -> None:
    """Chunk 0 in the pool (the lookup's hit), 1 only in the tier, 2 only in the pool (e.g.
    not written yet), 3 only in the tier, 4 only in the pool: all five are hits; the tier
    loads 1 and 3 in one batch and is asked nothing about 2 and 4."""
    mem = MemTier()
    keys = [key(i) for i in range(5)]
    env.commit([keys[0]])
    env.commit([keys[2], keys[4]])
    mem.put([keys[1], keys[3]])
    lookup = env.index.lock_read(keys, ENGINE, prefix=True)
    assert len(lookup.slots) == 1
    pf = env.prefetcher([env.disk, mem])
    job = pf.start(ENGINE, keys, [CHUNK] * 5, 1, lookup.lease_id)
    wait_done(job)
    assert job is not None and job.hits == 5 and job.loaded == 4
    assert job.sources == ["mem", "pool", "mem", "pool"] and job.miss_reason == ""
    assert env.lease_holds(lookup.lease_id, ENGINE, keys)
    assert mem.loads == Counter({keys[1]: 1, keys[3]: 1})
    assert pf.stats.loaded_chunks == {"mem": 2} and pf.stats.failed == {}
    assert env.index.release_read(lookup.lease_id, ENGINE) == 5


def test_prefetch_of_a_run_that_starts_in_the_pool(env: Env) -> None:
    """The lookup missed chunk 0, which is in the pool by the time the job runs (another
    job brought it in): the run starts with pool chunks, then tier chunks."""
    keys = [key(i) for i in range(3)]
    env.stage(env.disk, keys[2:])
    pf = env.prefetcher([env.disk])
    env.commit(keys[:2])
    job = pf.start(ENGINE, keys, [CHUNK] * 3, 0, 0)
    wait_done(job)
    assert job is not None and job.hits == 3 and job.sources == ["pool", "pool", "disk"]
    assert job.lease_id and env.lease_holds(job.lease_id, ENGINE, keys)
    assert pf.stats.loaded_chunks == {"disk": 1}
    env.index.release_read(job.lease_id, ENGINE)


class EvictingTier(MemTier):
    """Deletes ``victim`` from the pool while the prefetch asks which of the chunks after
    the first it holds (its second question: the first is about the first chunk the lookup
    lacked alone): the chunk was located in the pool a moment earlier."""

    def __init__(self, index: ObjectIndex, victim: bytes) -> None:
        super().__init__("evicting")
        self.index = index
        self.victim = victim
        self.questions = 0

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self.questions += 1
        if self.questions == 2:
            self.index.delete([self.victim])
        return super().contains(keys)


@pytest.mark.parametrize("tier_has_it", [True, False])
def test_a_pool_chunk_gone_before_the_load_is_loaded_from_the_tier_or_ends_the_prefix(
    env: Env, tier_has_it: bool
) -> None:
    keys = [key(i) for i in range(4)]
    env.commit([keys[0], keys[2]])
    tier = EvictingTier(env.index, keys[2])
    tier.put([keys[1], keys[3]] + ([keys[2]] if tier_has_it else []))
    lookup = env.index.lock_read(keys, ENGINE, prefix=True)
    pf = env.prefetcher([tier])
    job = pf.start(ENGINE, keys, [CHUNK] * 4, 1, lookup.lease_id)
    wait_done(job)
    assert job is not None
    assert tier.questions == 2
    if tier_has_it:
        assert job.hits == 4 and job.sources == ["evicting"] * 3
        assert env.lease_holds(lookup.lease_id, ENGINE, keys)
    else:
        assert job.hits == 2 and job.sources == ["evicting"]
        assert pf.stats.failed == {"evicting": {"missing": 1}}
        assert env.lease_holds(lookup.lease_id, ENGINE, keys[:2])
        assert env.index.contains(keys) == [True, True, False, False]  # 3 never loaded
    env.index.release_read(lookup.lease_id, ENGINE)


def test_prefetch_after_a_pool_prefix_locks_into_the_lookups_lease(env: Env) -> None:
    """A lookup that hit chunk 0 in the pool passes its lease; the prefetched chunks are
    added to that lease, and the job reports no lease of its own (the lookup's lease may be
    in a retrieve's hands by then: whoever finishes the job must not release it)."""
    keys = [key(i) for i in range(4)]
    env.commit(keys[:1])
    env.stage(env.disk, keys)
    lookup = env.index.lock_read(keys, ENGINE, prefix=True)
    assert len(lookup.slots) == 1
    pf = env.prefetcher([env.disk])
    job = pf.start(ENGINE, keys, [CHUNK] * 4, 1, lookup.lease_id)
    wait_done(job)
    assert job is not None and job.hits == 4 and job.loaded == 3
    assert job.lease_id == 0 and job.into_lease == lookup.lease_id
    assert env.lease_holds(lookup.lease_id, ENGINE, keys)
    assert pf.stats.loaded_chunks == {"disk": 3}  # chunk 0 was not loaded again
    assert env.index.release_read(lookup.lease_id, ENGINE) == 4


def test_prefetch_whose_lookup_lease_ended_leaves_chunks_unlocked(env: Env) -> None:
    keys = [key(i) for i in range(3)]
    env.commit(keys[:1])
    env.stage(env.disk, keys)
    lookup = env.index.lock_read(keys, ENGINE, prefix=True)
    pf = env.prefetcher([env.disk])
    env.index.release_read(lookup.lease_id, ENGINE)  # the engine retrieved and finished
    job = pf.start(ENGINE, keys, [CHUNK] * 3, 1, lookup.lease_id)
    wait_done(job)
    assert job is not None and job.lease_id == 0
    assert env.pool_holds(keys)
    assert env.index.stats().read_leases == 0


def test_no_space_ends_the_run(env: Env) -> None:
    keys = [key(i) for i in range(5)]
    env.stage(env.disk, keys)
    env.commit([key(f"filler-{i}") for i in range(POOL_CHUNKS - 3)])
    pf = env.prefetcher([env.disk])
    job = pf.start(ENGINE, keys, [CHUNK] * 5, 0, 0)
    wait_done(job)
    assert job is not None and job.hits == 3
    assert env.index.contains(keys) == [True, True, True, False, False]
    assert pf.stats.failed == {}  # no space is not a tier failure
    assert pf.stats.loaded_chunks == {"disk": 3}
    assert env.index.stats().used == env.pool.size
    env.index.release_read(job.lease_id, ENGINE)


@pytest.mark.parametrize(
    ("kind", "hits", "failed"),
    [
        ("corrupt", 1, {"corrupt": 1}),
        ("missing", 1, {"missing": 1}),  # contains() said yes, load() found nothing
        ("error", 1, {"error": 1}),
        ("raise", 0, {"error": 1}),  # the whole batch fails
        ("short", 0, {"error": 1}),  # a tier answering too few results
        ("disk-bitflip", 1, {"corrupt": 1}),  # a real damaged file
    ],
)
def test_a_failing_chunk_ends_the_prefix_and_frees_its_slot(
    env: Env, kind: str, hits: int, failed: dict[str, int]
) -> None:
    keys = [key(i) for i in range(4)]
    mem = MemTier()
    mem.put(keys)
    tier: Tier = mem
    if kind == "corrupt":
        mem.load_status[keys[1]] = LoadStatus.CORRUPT
    elif kind == "missing":
        del mem.data[keys[1]]
        mem.phantom.add(keys[1])
    elif kind == "error":
        mem.load_status[keys[1]] = LoadStatus.ERROR
    elif kind == "raise":
        mem.raise_on_load = True
    elif kind == "short":
        mem.short_answers = True
    else:
        env.stage(env.disk, keys)
        with open(env.disk.file_path(keys[1]), "r+b") as fh:
            fh.seek(1000)
            byte = fh.read(1)
            fh.seek(1000)
            fh.write(bytes([byte[0] ^ 0x01]))
        tier = env.disk
    pf = env.prefetcher([tier])
    job = pf.start(ENGINE, keys, [CHUNK] * 4, 0, 0)
    wait_done(job)
    assert job is not None and job.hits == hits
    assert pf.stats.failed == {tier.name: failed}
    assert pf.stats.loaded_chunks == {tier.name: hits}
    assert env.index.contains(keys) == [i < hits for i in range(4)]
    st = env.index.stats()
    assert st.used == hits * CHUNK and st.writing == 0 and st.write_leases == 0
    if hits:
        assert env.lease_holds(job.lease_id, ENGINE, keys[:hits])
        env.index.release_read(job.lease_id, ENGINE)
    else:
        assert job.lease_id == 0


def test_max_inflight_rejects(env: Env) -> None:
    mem = MemTier()
    keys = [key(i) for i in range(2)]
    mem.put(keys)
    gate = mem.hold()
    pf = env.prefetcher([mem], max_inflight=1)
    first = pf.start(ENGINE, keys, [CHUNK] * 2, 0, 0)
    assert first is not None and mem.entered.wait(WAIT)
    assert pf.start(OTHER_ENGINE, keys, [CHUNK] * 2, 0, 0) is None
    assert pf.stats.rejected == 1 and pf.stats.inflight == 1 and pf.stats.started == 1
    gate.set()
    wait_done(first)
    assert pf.stats.inflight == 0
    again = pf.start(OTHER_ENGINE, keys, [CHUNK] * 2, 0, 0)  # a slot is free again
    wait_done(again)
    assert again is not None and again.hits == 2
    assert mem.loads == Counter({k: 1 for k in keys})  # the second found them in the pool
    env.index.release_read(first.lease_id, ENGINE)
    env.index.release_read(again.lease_id, OTHER_ENGINE)


def test_nothing_to_prefetch_starts_no_job(env: Env) -> None:
    keys = [key(i) for i in range(2)]
    assert env.prefetcher([]).start(ENGINE, keys, [CHUNK] * 2, 0, 0) is None
    assert env.prefetcher([env.disk]).start(ENGINE, keys, [CHUNK] * 2, 2, 0) is None


def test_a_timed_out_job_is_done_with_the_pools_hits_and_leaves_its_chunks_unlocked(
    env: Env,
) -> None:
    now = [1000.0]
    mem = MemTier()
    keys = [key(i) for i in range(4)]
    mem.put(keys)
    env.commit(keys[:1])
    lookup = env.index.lock_read(keys, ENGINE, prefix=True)  # the pool's hit: chunk 0
    gate = mem.hold()
    pf = env.prefetcher([mem], timeout=5.0, clock=lambda: now[0])
    job = pf.start(ENGINE, keys, [CHUNK] * 4, 1, lookup.lease_id)
    assert job is not None and mem.entered.wait(WAIT)
    assert not pf.poll(job)
    now[0] += 6.0  # past the deadline
    assert pf.poll(job) and job.cancelled and pf.stats.timed_out == 1
    assert job.hits == 1  # what the pool had
    assert pf.poll(job) and pf.stats.timed_out == 1  # counted once

    gate.set()  # the tier answers late
    wait_done(job)
    assert job.hits == 1 and job.lease_id == 0
    assert env.lease_holds(lookup.lease_id, ENGINE, keys[:1])  # nothing added to the lookup
    env.index.release_read(lookup.lease_id, ENGINE)
    assert env.pool_holds(keys)  # the late chunks stay in the pool for the next lookup
    st = env.index.stats()
    assert st.read_locked == 0 and st.read_leases == 0 and st.evictable == 4


def test_concurrent_prefetches_of_one_prefix_load_each_chunk_once(env: Env) -> None:
    """The second job waits for the chunks the first is loading, then loads only what the
    first did not cover; both end with the whole prefix locked."""
    mem = MemTier()
    keys = [key(i) for i in range(5)]
    mem.put(keys)
    gate = mem.hold()
    pf = env.prefetcher([mem])
    first = pf.start(ENGINE, keys[:3], [CHUNK] * 3, 0, 0)
    assert first is not None and mem.entered.wait(WAIT)
    second = pf.start(OTHER_ENGINE, keys, [CHUNK] * 5, 0, 0)
    gate.set()
    wait_done(first, second)
    assert first is not None and second is not None
    assert first.hits == 3 and second.hits == 5
    assert mem.loads == Counter({k: 1 for k in keys})
    assert pf.stats.loaded_chunks == {"mem": 5}
    assert env.lease_holds(first.lease_id, ENGINE, keys[:3])
    assert env.lease_holds(second.lease_id, OTHER_ENGINE, keys)
    env.index.release_read(first.lease_id, ENGINE)
    env.index.release_read(second.lease_id, OTHER_ENGINE)
    assert env.index.stats().read_locked == 0


def test_prefetched_chunks_are_not_written_back_to_their_tier(env: Env) -> None:
    """Wired as the server wires them: prefetch hands loaded chunks to write-behind with
    their source, which writes them to the other tiers only."""
    mem = MemTier()
    keys = [key(i) for i in range(3)]
    env.stage(env.disk, keys)
    wb = env.write_behind([env.disk, mem])

    def to_write_behind(source: Tier, committed: list[bytes], _: list[Verified]) -> None:
        wb.submit(committed, source_tier=source.name)

    pf = env.prefetcher([env.disk, mem], on_committed=to_write_behind)
    job = pf.start(ENGINE, keys, [CHUNK] * 3, 0, 0)
    wait_done(job)
    assert wb.wait_idle(WAIT)
    assert job is not None and job.hits == 3
    assert wb.stats.written_chunks == {"mem": 3}
    assert set(mem.data) == set(keys) and not mem.loads
    env.index.release_read(job.lease_id, ENGINE)


def test_write_behind_and_prefetch_holders_leave_no_leases(env: Env) -> None:
    """After a round trip (write-behind, clear, prefetch, release) neither controller's
    holder id owns anything."""
    keys = [key(i) for i in range(4)]
    wb = env.write_behind([env.disk])
    wb.submit(env.commit(keys))
    assert wb.wait_idle(WAIT)
    env.index.clear()
    pf = env.prefetcher([env.disk])
    job = pf.start(ENGINE, keys, [CHUNK] * 4, 0, 0)
    wait_done(job)
    assert job is not None and job.hits == 4
    env.index.release_read(job.lease_id, ENGINE)
    assert env.index.release_holder(Holder.WRITE_BEHIND) == (0, 0)
    assert env.index.release_holder(Holder.PREFETCH) == (0, 0)
    assert env.pool_holds(keys)


# -- the hand-off to the service -----------------------------------------------------------
def test_a_retrieve_that_took_the_lookups_locks_keeps_them_when_the_prefetch_lands(
    env: Env, tmp_path: Path
) -> None:
    """Through the real service: LOOKUP hits chunk 0 in the pool and starts a prefetch of
    chunks 1-3; the engine does not wait and PREPARE_RETRIEVEs chunk 0 at once; the prefetch
    finishes while the engine still copies. Its completion must leave the retrieve's lease
    alone: FINISH_RETRIEVE succeeds, and the slot stayed locked all along."""
    from tierkv import keys as chunk_keys
    from tierkv import protocol as p
    from tierkv.config import ServerConfig
    from tierkv.server.wiring import Server

    mem = MemTier()
    run = env.pool.name + "-svc"
    cfg = ServerConfig(
        pool_name=run,
        pool_size=env.pool.size,
        http_port=0,
        instance=run[-20:],
        runtime_dir=str(tmp_path / "run"),  # not the default one under /tmp, left behind
    )
    server = Server(cfg, tiers=[mem]).start()
    service = server.service
    try:
        layout = p.Layout([256, CHUNK // 256 // 4], "float32", 0)
        reg = service.handle(p.Register(1, p.PROTOCOL_VERSION, "m", layout))
        assert isinstance(reg, p.Registered), reg
        tokens = chunk_keys.pack_tokens(range(4 * 256))
        ks = chunk_keys.chunk_keys(reg.namespace, tokens, 256, False)
        sel = p.ChunkSelector(tokens=tokens)
        slots = service.handle(p.PrepareStore(2, reg.client, sel))
        assert isinstance(slots, p.StoreSlots) and len(slots.slots) == 4
        assert isinstance(service.handle(p.CommitStore(3, reg.client, slots.lease)), p.Committed)
        assert service.tiering.write_behind.wait_idle(WAIT) and set(mem.data) == set(ks)
        service.index.delete(ks[1:])

        gate = mem.hold()
        found = service.handle(p.Lookup(4, reg.client, sel, "req"))
        assert isinstance(found, p.LookupResult) and found.hits == 1 and found.prefetching
        assert mem.entered.wait(WAIT)
        got = service.handle(p.PrepareRetrieve(5, reg.client, request_id="req"))
        assert isinstance(got, p.RetrieveSlots) and len(got.slots) == 1
        gate.set()  # the prefetch lands while the engine holds the retrieve's lease
        deadline = time.monotonic() + WAIT
        while service.tiering.prefetcher.stats.inflight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert service.tiering.prefetcher.stats.inflight == 0
        assert service.index.stats().read_locked >= 1  # chunk 0 is still locked
        done = service.handle(p.FinishRetrieve(6, reg.client, got.lease))
        assert isinstance(done, p.Ok), done
        service.handle(p.EndSession(7, reg.client, "req"))
        st = service.index.stats()
        assert st.read_locked == 0 and st.read_leases == 0
        assert service.index.contains(ks) == [True] * 4  # loaded, unlocked, still cached
        service.index.check()
    finally:
        server.close()
