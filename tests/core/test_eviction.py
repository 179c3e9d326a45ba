"""Tests of the watermark eviction controller: run_once (watermarks, expiry with a fake clock,
listeners) and the background thread (wake-ups, periodic passes, failures, start/stop). The
thread tests wait for counted passes, never for a duration."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from tierkv.allocator import Allocator
from tierkv.eviction import Evictor
from tierkv.index import Evicted, ObjectIndex

BLOCK = 4096
BLOCKS = 10  # pool size; high = 0.8 -> 8 blocks, low = 0.5 -> 5 blocks
HIGH = 0.8
LOW = 0.5
HOLDER = 7
GUARD = 30.0  # seconds to wait for the thread before declaring it hung


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CountingController(Evictor):
    """Counts finished passes so that tests can wait for the thread deterministically."""

    guard = GUARD  # seconds ``wait_for_fresh_pass`` waits before declaring the thread hung

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.started = 0
        self.passes = 0
        self._cond = threading.Condition()

    def run_once(self) -> list[Evicted]:
        with self._cond:
            self.started += 1
        try:
            return super().run_once()
        finally:
            with self._cond:
                self.passes += 1
                self._cond.notify_all()

    def wait_for_fresh_pass(self) -> None:
        """Wake the thread and wait until a pass that started after this call has finished
        (passes run one at a time, so that is pass number ``started + 1``)."""
        with self._cond:
            target = self.started + 1
            self.wake()
            assert self._cond.wait_for(lambda: self.passes >= target, self.guard), "thread hung"


def k(i: int) -> bytes:
    return f"key-{i}".encode()


def make(clock: FakeClock | None = None) -> ObjectIndex:
    return ObjectIndex(Allocator(BLOCKS * BLOCK, BLOCK), clock=clock or FakeClock())


def fill(index: ObjectIndex, first: int, n: int, blocks: int = 1) -> list[bytes]:
    """Store n objects of ``blocks`` blocks each, one per batch, oldest first."""
    keys = [k(i) for i in range(first, first + n)]
    for key in keys:
        res = index.reserve_write([key], blocks * BLOCK, HOLDER)
        assert res.slots, "pool full"
        index.commit(res.lease_id, HOLDER)
    return keys


@pytest.mark.parametrize(
    ("high", "low", "interval"),
    [
        (0.7, 0.8, 1.0),  # low above high
        (0.8, 0.0, 1.0),
        (0.8, -0.1, 1.0),
        (1.1, 0.5, 1.0),
        (float("nan"), 0.5, 1.0),
        (0.8, float("nan"), 1.0),
        (0.8, 0.5, 0.0),
        (0.8, 0.5, -1.0),
        (0.8, 0.5, float("nan")),
    ],
)
def test_invalid_settings_are_rejected(high: float, low: float, interval: float) -> None:
    with pytest.raises(ValueError):
        Evictor(make(), high=high, low=low, interval=interval)


def test_valid_extremes_are_accepted() -> None:
    Evictor(make(), high=1.0, low=1.0)
    Evictor(make(), high=0.5, low=0.5)
    Evictor(make(), high=1.0, low=0.01, interval=0.001)


def test_nothing_happens_at_or_below_the_high_watermark() -> None:
    index = make()
    controller = Evictor(index, high=HIGH, low=LOW)
    fill(index, 0, 8)  # exactly at high
    assert not controller.above_high_watermark()
    assert controller.run_once() == []
    assert index.used == 8 * BLOCK
    assert index.stats().evictions == 0


def test_above_high_evicts_lru_first_down_to_low() -> None:
    index = make()
    controller = Evictor(index, high=HIGH, low=LOW)
    keys = fill(index, 0, 9)
    assert controller.above_high_watermark()
    evicted = controller.run_once()
    assert [e.key for e in evicted] == keys[:4]
    assert index.used == 5 * BLOCK  # at low
    assert not controller.above_high_watermark()
    assert controller.run_once() == []


def test_a_pass_evicts_in_batches_with_the_index_lock_released_between_them() -> None:
    """Each batch is one call into the index (one hold of its lock); the pass still
    evicts least recently used first, down to low, and reports one list."""
    index = make()
    controller = Evictor(index, high=HIGH, low=LOW, batch=1)
    calls: list[int | None] = []
    evict = index.evict

    def counted(nbytes: int, max_objects: int | None = None) -> list[Evicted]:
        assert not index._lock.locked()  # released between two batches
        calls.append(max_objects)
        return evict(nbytes, max_objects)

    index.evict = counted  # type: ignore[method-assign]
    keys = fill(index, 0, 9)
    evicted = controller.run_once()
    assert [e.key for e in evicted] == keys[:4]
    assert calls == [1, 1, 1, 1]
    assert index.used == 5 * BLOCK
    with pytest.raises(ValueError, match="batch"):
        Evictor(make(), batch=0)


def test_eviction_stops_as_soon_as_usage_is_at_or_below_low() -> None:
    index = make()
    controller = Evictor(index, high=HIGH, low=LOW)
    fill(index, 0, 3, blocks=3)  # 9 blocks
    evicted = controller.run_once()
    assert [e.key for e in evicted] == [k(0), k(1)]  # 9 -> 6 is still above 5
    assert index.used == 3 * BLOCK


def test_locked_objects_are_skipped_even_if_low_is_not_reached() -> None:
    index = make()
    controller = Evictor(index, high=HIGH, low=LOW)
    keys = fill(index, 0, 9)
    index.lock_read(keys[:7], HOLDER)
    index.reserve_write([k(99)], BLOCK, HOLDER)  # 10 blocks
    evicted = controller.run_once()
    assert [e.key for e in evicted] == keys[7:]
    assert index.used == 8 * BLOCK
    assert controller.run_once() == []  # nothing left that may go
    index.check()


def test_run_once_expires_leases_with_a_fake_clock() -> None:
    clock = FakeClock()
    index = make(clock)
    controller = Evictor(index, high=HIGH, low=LOW)
    keys = fill(index, 0, 3)
    index.lock_read(keys, HOLDER)
    index.reserve_write([k(10), k(11)], BLOCK, HOLDER)
    clock.now += index.read_ttl
    assert controller.run_once() == []  # below high: expiry only
    stats = index.stats()
    assert (stats.read_leases, stats.write_leases, stats.evictable) == (0, 1, 3)
    clock.now += index.write_ttl
    controller.run_once()
    stats = index.stats()
    assert (stats.write_leases, stats.expired_write_slots, stats.expired_held) == (0, 2, 2)
    assert stats.used == 5 * BLOCK  # the holder may still write into them: kept until it goes
    index.release_holder(HOLDER)
    assert index.stats().used == 3 * BLOCK
    index.check()


def test_expiry_makes_room_for_eviction_in_the_same_pass() -> None:
    clock = FakeClock()
    index = make(clock)
    controller = Evictor(index, high=HIGH, low=LOW)
    keys = fill(index, 0, 9)
    index.lock_read(keys, HOLDER)
    assert controller.run_once() == []  # everything locked
    clock.now += index.read_ttl
    # The lock covered one batch, so its release put the last chunks first in line.
    assert [e.key for e in controller.run_once()] == keys[::-1][:4]


def test_listeners_get_each_evicted_batch_and_a_raising_one_is_contained(
    caplog: pytest.LogCaptureFixture,
) -> None:
    index = make()
    controller = Evictor(index, high=HIGH, low=LOW)
    batches: list[list[Evicted]] = []

    def broken(batch: list[Evicted]) -> None:
        raise RuntimeError("listener bug")

    controller.add_listener(broken)
    controller.add_listener(batches.append)
    fill(index, 0, 9)
    with caplog.at_level(logging.ERROR, logger="tierkv.eviction"):
        evicted = controller.run_once()
    assert batches == [evicted]
    assert [e.key for e in evicted] == [k(0), k(1), k(2), k(3)]
    assert "listener" in caplog.text
    assert controller.run_once() == []
    assert len(batches) == 1  # no call for an empty pass


def test_thread_evicts_when_woken_and_survives_a_raising_listener() -> None:
    index = make()
    controller = CountingController(index, high=HIGH, low=LOW, interval=3600.0)
    batches: list[list[bytes]] = []
    got = threading.Semaphore(0)

    def broken(batch: list[Evicted]) -> None:
        raise RuntimeError("listener bug")

    def record(batch: list[Evicted]) -> None:
        batches.append([e.key for e in batch])
        got.release()

    controller.add_listener(broken)
    controller.add_listener(record)
    controller.start()
    try:
        fill(index, 0, 9)
        controller.wake_if_needed()
        assert got.acquire(timeout=GUARD), "no eviction"
        assert batches == [[k(0), k(1), k(2), k(3)]]
        assert index.used == 5 * BLOCK

        fill(index, 100, 4)  # 9 blocks again; the thread is still alive
        controller.wake()
        assert got.acquire(timeout=GUARD), "thread died after the listener raised"
        assert batches[1] == [k(4), k(5), k(6), k(7)]
        assert index.used == 5 * BLOCK
        assert controller._thread is not None and controller._thread.is_alive()
    finally:
        controller.stop()
    index.check()


def test_wake_if_needed_only_wakes_above_high() -> None:
    index = make()
    controller = Evictor(index, high=HIGH, low=LOW)
    fill(index, 0, 8)
    controller.wake_if_needed()
    assert not controller._wake.is_set()
    fill(index, 8, 1)
    controller.wake_if_needed()
    assert controller._wake.is_set()


def test_thread_passes_below_high_evict_nothing() -> None:
    index = make()
    controller = CountingController(index, high=HIGH, low=LOW, interval=0.001)
    fill(index, 0, 8)
    controller.start()
    try:
        for _ in range(5):
            controller.wait_for_fresh_pass()
    finally:
        controller.stop()
    assert controller.passes >= 5
    assert index.used == 8 * BLOCK and index.stats().evictions == 0


def test_thread_runs_periodically_without_being_woken() -> None:
    index = make()
    controller = CountingController(index, high=HIGH, low=LOW, interval=0.001)
    got = threading.Event()
    controller.add_listener(lambda batch: got.set())
    controller.start()
    try:
        fill(index, 0, 9)
        assert got.wait(GUARD), "no periodic pass evicted anything"
        assert index.used <= 5 * BLOCK
    finally:
        controller.stop()


def test_thread_expires_leases_with_a_fake_clock() -> None:
    clock = FakeClock()
    index = make(clock)
    controller = CountingController(index, high=HIGH, low=LOW, interval=0.001)
    keys = fill(index, 0, 2)
    index.lock_read(keys, HOLDER)
    index.reserve_write([k(5)], BLOCK, HOLDER)
    controller.start()
    try:
        controller.wait_for_fresh_pass()
        assert index.stats().read_leases == 1  # nothing due yet
        clock.now += index.write_ttl
        controller.wait_for_fresh_pass()
        stats = index.stats()
        assert (stats.read_leases, stats.write_leases, stats.expired_held) == (0, 0, 1)
        clock.now += index.write_ttl  # its holder did not end it: the hold lasts one more TTL
        controller.wait_for_fresh_pass()
        assert index.stats().expired_held == 0 and index.used == 2 * BLOCK
    finally:
        controller.stop()
    index.check()


def test_a_failing_pass_does_not_kill_the_thread(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    index = make()
    controller = CountingController(index, high=HIGH, low=LOW, interval=3600.0)
    fill(index, 0, 9)

    def broken_evict(nbytes: int) -> list[Evicted]:
        raise RuntimeError("evict bug")

    monkeypatch.setattr(index, "evict", broken_evict)
    with caplog.at_level(logging.ERROR, logger="tierkv.eviction"):
        controller.start()
        try:
            controller.wait_for_fresh_pass()
            assert index.used == 9 * BLOCK
            monkeypatch.undo()
            controller.wait_for_fresh_pass()
            assert index.used == 5 * BLOCK
        finally:
            controller.stop()
    assert "eviction pass failed" in caplog.text


def test_start_and_stop_are_clean_and_idempotent() -> None:
    index = make()
    controller = CountingController(index, high=HIGH, low=LOW, interval=3600.0)
    controller.stop()  # never started: a no-op
    controller.start()
    thread = controller._thread
    assert thread is not None and thread.is_alive() and thread.daemon
    assert thread.name == "tierkv-eviction"
    controller.start()  # already running: same thread
    assert controller._thread is thread
    controller.stop()
    assert not thread.is_alive() and controller._thread is None
    controller.stop()
    assert not any(t.name == "tierkv-eviction" for t in threading.enumerate())

    # It can be started again and works.
    fill(index, 0, 9)
    controller.start()
    try:
        controller.wait_for_fresh_pass()
        assert index.used == 5 * BLOCK
    finally:
        controller.stop()
    assert controller._thread is None


def test_stop_returns_promptly_with_a_long_interval() -> None:
    """stop() wakes the thread instead of waiting out the interval (a hang would trip the
    pytest timeout, no clock is read here)."""
    controller = CountingController(make(), interval=3600.0)
    controller.start()
    controller.wait_for_fresh_pass()
    controller.stop()
    assert controller._thread is None


def test_a_miss_right_after_an_eviction_knows_it_was_evicted() -> None:
    """The index tells the lookup accounting what it evicts under its own lock, so a lookup
    that misses a chunk between the eviction and the end of the pass (when the controller's
    listeners run) counts it as evicted, not absent."""
    from tierkv.server.metrics import ServiceMetrics
    from tierkv.server.tiering.lookups import LookupAccounting

    index = make()
    controller = Evictor(index, high=HIGH, low=LOW)
    lookups = LookupAccounting(ServiceMetrics(controller), index)
    keys = fill(index, 0, 9)
    evicted = index.evict(2 * BLOCK, max_objects=2)  # one batch of a pass, no listener yet
    assert [e.key for e in evicted] == keys[:2]
    assert [lookups.gone.reason(key) for key in keys[:3]] == ["evicted", "evicted", "absent"]
