"""The batch copier: every item exactly once, shared out to the threads that are free, and no
copy outliving the call."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from tierkv import priority
from tierkv.copier import Copier


def test_run_copies_every_chunk_with_several_threads() -> None:
    src = [np.random.default_rng(i).random(1 << 18) for i in range(9)]  # 2 MiB each
    dst = [np.zeros_like(a) for a in src]
    seen: set[str] = set()

    def copy(i: int) -> None:
        seen.add(threading.current_thread().name)
        np.copyto(dst[i], src[i])
        time.sleep(0.01)  # every thread is up before the batch runs out

    copier = Copier(threads=3, min_bytes=0)
    try:
        copier.run(copy, list(range(9)), [a.nbytes for a in src])
    finally:
        copier.close()
    assert all(np.array_equal(a, b) for a, b in zip(src, dst, strict=True))
    assert len(seen) >= 2 and threading.current_thread().name in seen  # caller + pool


def test_small_batches_stay_on_the_calling_thread() -> None:
    names: list[str] = []
    copier = Copier(threads=4, min_bytes=1 << 20)
    copier.run(lambda _: names.append(threading.current_thread().name), [1, 2, 3], [1000] * 3)
    copier.close()
    assert names == [threading.current_thread().name] * 3


def test_a_failure_is_raised_only_after_every_started_item_has_ended() -> None:
    """A slot's copy must never outlive the request: a failure waits for the items other
    threads are copying, and no item starts after it."""
    started: list[int] = []
    ended: list[int] = []
    all_busy = threading.Event()

    def work(i: int) -> None:
        started.append(i)
        if len(started) == 3:
            all_busy.set()
        if i == 0:
            all_busy.wait(5)  # every thread has taken an item
            raise ValueError(f"item {i} does not fit")
        time.sleep(0.2)
        ended.append(i)

    copier = Copier(threads=3, min_bytes=0)
    try:
        with pytest.raises(ValueError, match="item 0 does not fit"):
            copier.run(work, list(range(10)), [10] * 10)
        assert sorted(ended) == sorted(set(started) - {0})  # every other started one ended
        assert len(started) == 3  # nothing started after the failure
    finally:
        copier.close()


def test_an_interrupted_caller_returns_only_once_the_copies_in_flight_ended() -> None:
    """A signal handler raising in the waiting thread (SIGINT's KeyboardInterrupt): the
    exception comes out only once every started copy has ended, and nothing starts after
    it (before, it came out at once and the caller gave back slots still being copied)."""
    import signal

    started: list[int] = []
    ended: list[int] = []

    def work(i: int) -> None:
        started.append(i)
        time.sleep(0.3)
        ended.append(i)

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    copier = Copier(threads=2, min_bytes=0, data_priority=True)  # the caller only waits
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)  # while the caller waits for the threads
        with pytest.raises(KeyboardInterrupt):
            copier.run(work, list(range(40)), [10] * 40)  # 6 s of copies on 2 threads
        assert sorted(ended) == sorted(started)  # no copy outlives the call
        assert len(started) < 40
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        copier.close()


def test_the_lowest_failed_item_is_raised() -> None:
    def work(i: int) -> None:
        time.sleep(0.01)
        if i % 2:
            raise KeyError(i)

    copier = Copier(threads=2, min_bytes=0, data_priority=True)
    try:
        with pytest.raises(KeyError) as info:
            copier.run(work, list(range(4)), [10] * 4)
        assert info.value.args == (1,)
    finally:
        copier.close()


def test_a_thread_slowed_down_takes_fewer_items() -> None:
    """Items go to whichever thread is free: one thread held up (by a busy core, say) does
    not hold up a fixed share of the batch."""
    done: dict[str, list[int]] = {}
    slow = threading.Event()

    def work(i: int) -> None:
        name = threading.current_thread().name
        done.setdefault(name, []).append(i)
        if i == 0:
            slow.wait(5)  # this thread is stuck until every other item has been copied
        elif sum(map(len, done.values())) == 20:
            slow.set()

    copier = Copier(threads=2, min_bytes=0, data_priority=True)
    try:
        copier.run(work, list(range(20)), [10] * 20)
    finally:
        copier.close()
    assert slow.is_set()  # the other thread took all 19 others while item 0 was stuck
    assert sorted(i for items in done.values() for i in items) == list(range(20))
    assert sorted(map(len, done.values())) == [1, 19]


def test_fewer_than_one_thread_is_refused() -> None:
    for threads in (0, -1):
        with pytest.raises(ValueError, match="at least 1"):
            Copier(threads=threads)
    assert Copier(threads=None).threads >= 1


def _nice_of_this_thread() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_pool_threads_are_data_threads_and_the_caller_keeps_its_priority() -> None:
    base = _nice_of_this_thread()
    nices: dict[str, int] = {}

    def record(_: int) -> None:
        nices[threading.current_thread().name] = _nice_of_this_thread()
        time.sleep(0.02)  # every thread is up before the batch runs out

    copier = Copier(threads=3, min_bytes=0)
    try:
        copier.run(record, list(range(6)), [1] * 6)
    finally:
        copier.close()
    me = threading.current_thread().name
    assert nices.pop(me) == base  # the caller copied a share at its own priority
    assert nices and set(nices.values()) == {min(19, base + priority.DATA_NICE)}
    assert _nice_of_this_thread() == base


@pytest.mark.parametrize("threads", [1, 2])
def test_with_data_priority_the_caller_only_waits_for_large_batches(threads: int) -> None:
    base = _nice_of_this_thread()
    where: list[tuple[str, int]] = []
    me = threading.current_thread().name

    def record(_: int) -> None:
        where.append((threading.current_thread().name, _nice_of_this_thread()))

    copier = Copier(threads=threads, min_bytes=100, data_priority=True)
    try:
        copier.run(record, [1, 2, 3], [50, 50, 50])  # 150 bytes: the pool's
        assert len(where) == 3
        assert all(name != me and nice == min(19, base + priority.DATA_NICE)
                   for name, nice in where)  # fmt: skip
        where.clear()
        copier.run(record, [1], [99])  # under min_bytes: a handoff would cost more
        assert where == [(me, base)]
    finally:
        copier.close()


def test_caller_copies_overrides_the_default_either_way() -> None:
    me = threading.current_thread().name

    def run(copier: Copier, caller_copies: bool | None) -> set[str]:
        names: set[str] = set()

        def work(_: int) -> None:
            names.add(threading.current_thread().name)
            time.sleep(0.01)

        try:
            copier.run(work, list(range(8)), [10] * 8, caller_copies)
        finally:
            copier.close()
        return names

    assert me not in run(Copier(threads=2, min_bytes=0, data_priority=True), None)
    assert me in run(Copier(threads=2, min_bytes=0, data_priority=True), True)
    assert me in run(Copier(threads=2, min_bytes=0), None)
    assert me not in run(Copier(threads=2, min_bytes=0), False)
