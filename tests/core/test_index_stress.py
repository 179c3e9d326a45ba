"""Concurrency stress of the object index: six threads reserve, commit, abort, read, pin,
delete, clear and evict a small set of colliding keys in a small pool while the eviction controller
runs, then every invariant and every byte of accounting is verified; a second variant has
threads crash (drop their leases) while a fake clock runs past the TTLs, and expiry, then
the holders' release (a crashed engine's registration is dropped), must reclaim everything.

Writers stamp each reserved slot with its key in a shared buffer standing in for the pool; a
reader that holds a read lock or a pin checks the stamp, so a slot freed or reused under a
reader shows up as a wrong stamp. The thread interleavings vary from run to run; every assertion
holds for all of them (the random choices of each thread are seeded).
"""

from __future__ import annotations

import random
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import test_eviction

from tierkv.allocator import Allocator
from tierkv.eviction import Evictor
from tierkv.index import Evicted, LeaseNotFound, ObjectIndex

BLOCK = 4096
POOL_BLOCKS = 24
KEY_LEN = 16
KEYS = [f"stress-key-{i:03d}".encode()[:KEY_LEN].ljust(KEY_LEN, b".") for i in range(40)]
ORPHANS = [b"orphan-w1", b"orphan-w2", b"orphan-r"]  # stored by the crash test itself
LENGTHS = [BLOCK, 2 * BLOCK - 100, 64]
THREADS = 6
ITERATIONS = 15000
MAX_HELD = 3  # leases a thread keeps open at a time, of each kind
GUARD = 60.0


class FakeClock:
    """Shared by all threads; a float read or a += on it is atomic enough under the GIL for
    a clock that only moves forward (a lost increment merely slows it)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


class CountingController(test_eviction.CountingController):
    """Counts passes so that the test can wait for one that started after a given moment, and
    keeps what the passes evicted."""

    guard = GUARD

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.evicted: list[Evicted] = []
        self.add_listener(self.evicted.extend)


ReadHold = tuple[int, list[bytes], list[tuple[int, int, int]], bool]  # lease, keys, slots, pin


class Worker(threading.Thread):
    """One engine connection doing random requests; in crash mode it sometimes forgets its
    leases instead of ending them, and moves the fake clock."""

    def __init__(
        self,
        index: ObjectIndex,
        controller: Evictor,
        pool: bytearray,
        holder: int,
        crash: bool,
        clock: FakeClock | None,
        barrier: threading.Barrier,
    ) -> None:
        super().__init__(name=f"stress-{holder}")
        self.barrier = barrier
        self.index = index
        self.controller = controller
        self.pool = pool
        self.holder = holder
        self.crash = crash
        self.clock = clock
        self.rng = random.Random(1000 + holder)
        self.writes: list[tuple[int, int]] = []  # (lease id, number of slots)
        self.reads: list[ReadHold] = []
        self.counts: Counter[str] = Counter()
        self.error: BaseException | None = None

    # -- the thread ----------------------------------------------------------------------
    def run(self) -> None:
        try:
            self.barrier.wait(GUARD)
            for i in range(ITERATIONS):
                self.step()
                if i % 100 == 0:
                    self.index.check()
            if self.crash:
                self.writes.clear()  # the process dies holding its leases
                self.reads.clear()
            else:
                while self.writes:
                    self.end_write(self.writes.pop())
                while self.reads:
                    self.end_read(self.reads.pop())
        except BaseException as exc:  # reported by the main thread
            self.error = exc

    def step(self) -> None:
        rng = self.rng
        if self.clock is not None and rng.random() < 0.02:
            self.clock.advance(rng.choice([1.0, 5.0, 20.0]))
        if self.crash and rng.random() < 0.02:
            self.writes.clear()
            self.reads.clear()
        op = rng.random()
        if op < 0.30:
            self.reserve()
        elif op < 0.38:
            if self.writes:
                self.end_write(self.writes.pop(rng.randrange(len(self.writes))))
        elif op < 0.63:
            self.read()
        elif op < 0.71:
            if self.reads:
                self.end_read(self.reads.pop(rng.randrange(len(self.reads))))
        elif op < 0.80:
            self.counts["deleted"] += self.index.delete(self.pick_keys(3))
        elif op < 0.81:
            self.counts["cleared_objects"] += self.index.clear()
        elif op < 0.91:
            self.counts["evicted"] += len(self.index.evict(rng.randint(1, 8) * BLOCK))
        elif op < 0.92:
            for lease in self.reads:
                self.verify(lease[1], lease[2])
            freed, released = self.index.release_holder(self.holder)
            if not self.crash:
                assert freed == sum(n for _, n in self.writes)
                assert released == sum(len(slots) for _, _, slots, _ in self.reads)
            self.writes.clear()
            self.reads.clear()
        else:
            keys = self.pick_keys(6)
            assert len(self.index.contains(keys)) == len(keys)
            stats = self.index.stats()
            assert 0 <= stats.used <= stats.capacity

    def pick_keys(self, most: int) -> list[bytes]:
        """A run of consecutive keys (a prefix-like batch), sometimes with repeats."""
        rng = self.rng
        n = rng.randint(1, most)
        if rng.random() < 0.8:
            start = rng.randrange(len(KEYS) - n + 1)
            return KEYS[start : start + n]
        return [rng.choice(KEYS) for _ in range(n)]

    # -- writes --------------------------------------------------------------------------
    def reserve(self) -> None:
        rng = self.rng
        keys = self.pick_keys(6)
        length = rng.choice(LENGTHS)
        res = self.index.reserve_write(keys, length, self.holder)
        reserved = [i for i, _, _ in res.slots]
        assert sorted(reserved + res.present + res.no_space) == list(range(len(keys)))
        assert (res.lease_id == 0) == (not res.slots)
        self.counts["present"] += len(res.present)
        self.counts["no_space"] += len(res.no_space)
        if res.no_space:
            self.controller.wake()
        for i, offset, n in res.slots:
            assert n == length and offset % BLOCK == 0
            assert offset + n <= POOL_BLOCKS * BLOCK
            self.pool[offset : offset + KEY_LEN] = keys[i]  # the "copy into the slot"
        if not res.slots:
            return
        if len(self.writes) < MAX_HELD and rng.random() < 0.25:
            self.writes.append((res.lease_id, len(res.slots)))
        else:
            self.end_write((res.lease_id, len(res.slots)))

    def end_write(self, lease: tuple[int, int]) -> None:
        lease_id, n = lease
        rng = self.rng
        try:
            choice = rng.random()
            if choice < 0.15:
                assert self.index.abort(lease_id, self.holder) == n
                self.counts["aborted"] += n
                return
            only = None
            if choice < 0.35:
                only = [p for p in range(n) if rng.random() < 0.5]
            result = self.index.commit(lease_id, self.holder, only)
        except LeaseNotFound:
            assert self.crash, "a live write lease vanished"
            self.counts["lost_write_leases"] += 1
            return
        assert result.committed + result.aborted + result.cleared == n
        assert result.aborted == (0 if only is None else n - len(only))
        self.counts["committed"] += result.committed
        self.counts["cleared"] += result.cleared

    # -- reads ---------------------------------------------------------------------------
    def read(self) -> None:
        """A lookup's read lock, or (a quarter of the time) a write-behind's pin."""
        rng = self.rng
        keys = self.pick_keys(6)
        pin = rng.random() < 0.25
        if pin:
            lock = self.index.pin(keys, self.holder)
        else:
            lock = self.index.lock_read(keys, self.holder, prefix=rng.random() < 0.7)
        locked = [i for i, _, _ in lock.slots]
        assert sorted(locked + lock.missing) == list(range(len(keys)))
        self.counts["pins" if pin else "hits"] += len(lock.slots)
        if not lock.slots:
            assert lock.lease_id == 0
            return
        self.verify(keys, lock.slots)
        entry = (lock.lease_id, keys, lock.slots, pin)
        if len(self.reads) < MAX_HELD and rng.random() < 0.3:
            self.reads.append(entry)
        else:
            self.end_read(entry)

    def end_read(self, lease: ReadHold) -> None:
        lease_id, keys, slots, pin = lease
        self.verify(keys, slots)  # still ours, after everything the others did meanwhile
        end = self.index.unpin if pin else self.index.release_read
        try:
            assert end(lease_id, self.holder) == len(slots)
        except LeaseNotFound:
            assert self.crash, "a live read lease vanished"
            self.counts["lost_read_leases"] += 1

    def verify(self, keys: list[bytes], slots: list[tuple[int, int, int]]) -> None:
        """Every locked slot still carries the stamp of its key: it was not freed and reused
        while read-locked. (In crash mode a lock may expire under its holder, so no check.)"""
        if self.crash:
            return
        for i, offset, _ in slots:
            assert bytes(self.pool[offset : offset + KEY_LEN]) == keys[i], "slot reused"


def live_bytes(index: ObjectIndex) -> int:
    """Sum of the aligned sizes of every ready object (found through a full lookup)."""
    lock = index.lock_read(KEYS + ORPHANS, holder=-1, prefix=False)
    total = sum(index.allocator.aligned(n) for _, _, n in lock.slots)
    if lock.lease_id:
        index.release_read(lock.lease_id, -1)
    return total


def assert_settled(index: ObjectIndex) -> None:
    """No lease, lock or zombie left; every allocated byte belongs to a live object; and once
    everything is removed the pool is a single free block again."""
    index.check()
    stats = index.stats()
    assert stats.write_leases == 0 and stats.read_leases == 0
    assert stats.read_locked == 0 and stats.writing == 0 and stats.zombies == 0
    assert stats.pinned == 0 and stats.pin_leases == 0
    assert stats.evictable == stats.objects == stats.ready
    assert index.used == live_bytes(index)
    index.check()

    index.clear()
    index.evict(index.capacity)
    index.check()
    alloc = index.allocator
    assert index.used == 0 and alloc.allocations == 0
    assert alloc.free_blocks == 1 and alloc.largest_free == alloc.capacity
    assert index.stats().objects == 0


def run_workers(
    index: ObjectIndex, controller: Evictor, crash: bool, clock: FakeClock | None
) -> Counter[str]:
    pool = bytearray(POOL_BLOCKS * BLOCK)
    barrier = threading.Barrier(THREADS)
    workers = [
        Worker(index, controller, pool, h, crash, clock, barrier) for h in range(1, THREADS + 1)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join(GUARD)
        assert not w.is_alive(), f"{w.name} hung"
    for w in workers:
        if w.error is not None:
            raise w.error
    total: Counter[str] = Counter()
    for w in workers:
        total.update(w.counts)
    return total


@pytest.fixture(autouse=True)
def frequent_thread_switches() -> Iterator[None]:
    """Switch threads every 10 us instead of every 5 ms, so that calls really interleave."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


@pytest.mark.timeout(120)
def test_concurrent_clients_and_eviction_keep_the_index_consistent() -> None:
    index = ObjectIndex(Allocator(POOL_BLOCKS * BLOCK, BLOCK))
    controller = CountingController(index, high=0.75, low=0.5, interval=0.002)
    controller.start()
    try:
        counts = run_workers(index, controller, crash=False, clock=None)
        controller.wait_for_fresh_pass()
    finally:
        controller.stop()
    # The workload really collided: all of these happen thousands of times in a run.
    assert counts["present"] and counts["no_space"] and counts["hits"] and counts["cleared"]
    assert counts["pins"]
    assert index.stats().evictions > 0
    assert_settled(index)


@pytest.mark.timeout(120)
def test_crashed_clients_are_reclaimed_by_expiry() -> None:
    clock = FakeClock()
    index = ObjectIndex(Allocator(POOL_BLOCKS * BLOCK, BLOCK), 60.0, 30.0, clock)
    controller = CountingController(index, high=0.75, low=0.5, interval=0.002)
    controller.start()
    try:
        counts = run_workers(index, controller, crash=True, clock=clock)
        index.check()
        left = index.stats()  # whatever the dead workers still held
        clock.advance(max(index.write_ttl, index.read_ttl))
        controller.wait_for_fresh_pass()  # the controller thread expires them
        stats = index.stats()
        assert stats.write_leases == 0 and stats.read_leases == 0 and stats.zombies == 0
        assert stats.expired_write_leases >= left.write_leases
        assert stats.expired_read_leases >= left.read_leases
        assert stats.expired_held >= left.write_leases  # each held at least one slot
        index.check()
        # An expired write lease's slots come back when its holder goes (the registry drops
        # a crashed engine): it might still have been writing into them.
        for holder in range(1, THREADS + 1):
            index.release_holder(holder)
        stats = index.stats()
        assert stats.expired_held == 0 and stats.fenced_free == 0
        index.check()

        # Once more with leases known to be orphaned: the pool is at most at its high
        # watermark now and nothing is locked, so one-block chunks fit.
        orphan_write = index.reserve_write([b"orphan-w1", b"orphan-w2"], BLOCK, 99)
        assert len(orphan_write.slots) == 2
        orphan = index.reserve_write([b"orphan-r"], BLOCK, 98)
        index.commit(orphan.lease_id, 98)
        assert index.lock_read([b"orphan-r"], 98).slots
        expired = index.stats()
        clock.advance(max(index.write_ttl, index.read_ttl))
        controller.wait_for_fresh_pass()
        stats = index.stats()
        assert stats.write_leases == 0 and stats.read_leases == 0 and stats.read_locked == 0
        assert stats.expired_write_slots == expired.expired_write_slots + 2
        assert stats.expired_read_locks == expired.expired_read_locks + 1
        assert index.contains([b"orphan-w1", b"orphan-w2"]) == [False, False]
        assert stats.expired_held == 2
        index.release_holder(99)
        assert index.stats().expired_held == 0
    finally:
        controller.stop()
    assert counts["hits"] and counts["no_space"]
    assert_settled(index)
