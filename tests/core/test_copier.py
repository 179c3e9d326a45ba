"""The batch copier: balanced groups, every item exactly once, and no copy outliving the call."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierkv import priority
from tierkv.copier import Copier, split_by_size


@given(st.lists(st.integers(0, 1 << 30), max_size=64), st.integers(1, 8))
def test_split_by_size_covers_every_item_once_and_balances(sizes: list[int], groups: int) -> None:
    out = split_by_size(sizes, groups)
    flat = [i for g in out for i in g]
    assert sorted(flat) == list(range(len(sizes)))
    assert len(out) <= max(1, groups) and all(out)
    assert all(g == sorted(g) for g in out)
    if out:  # greedy largest-first: no group exceeds the mean by more than one item
        loads = [sum(sizes[i] for i in g) for g in out]
        assert max(loads) - min(loads) <= max(sizes)


def test_run_copies_every_chunk_with_several_threads() -> None:
    src = [np.random.default_rng(i).random(1 << 18) for i in range(9)]  # 2 MiB each
    dst = [np.zeros_like(a) for a in src]
    seen: set[str] = set()

    def copy(i: int) -> None:
        seen.add(threading.current_thread().name)
        np.copyto(dst[i], src[i])

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


def test_a_failure_is_raised_only_after_every_group_has_finished() -> None:
    """A slot's copy must never outlive the request: a failing group waits for the others."""
    finished: list[int] = []
    main = threading.current_thread()

    def work(i: int) -> None:
        if threading.current_thread() is main:
            raise ValueError(f"item {i} does not fit")
        time.sleep(0.2)
        finished.append(i)

    copier = Copier(threads=2, min_bytes=0)
    try:
        with pytest.raises(ValueError, match="does not fit"):
            copier.run(work, [0, 1], [10, 10])
        assert len(finished) == 1  # the other group's item had ended before run() raised
    finally:
        copier.close()


def test_the_first_error_of_a_pool_thread_is_raised() -> None:
    main = threading.current_thread()

    def work(i: int) -> None:
        if threading.current_thread() is not main:
            raise KeyError(i)

    copier = Copier(threads=2, min_bytes=0)
    try:
        with pytest.raises(KeyError):
            copier.run(work, [0, 1], [10, 10])
    finally:
        copier.close()


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
