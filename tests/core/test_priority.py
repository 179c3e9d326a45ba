"""Data threads run at a lower CPU priority than the thread that serves requests, which gets
a short scheduler slice."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import pytest

from tierkv import priority

T = TypeVar("T")


def _nice_of_this_thread() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_a_data_thread_pool_runs_at_a_higher_nice_than_the_caller() -> None:
    base = _nice_of_this_thread()
    with ThreadPoolExecutor(2, initializer=priority.data_thread) as pool:
        nices = set(pool.map(lambda _: _nice_of_this_thread(), range(8)))
    assert nices == {min(19, base + priority.DATA_NICE)}
    assert _nice_of_this_thread() == base  # the calling thread keeps its priority


def test_lowering_is_done_once_per_thread_and_can_be_turned_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = _nice_of_this_thread()

    def twice() -> int:
        priority.data_thread()
        priority.data_thread()
        return _nice_of_this_thread()

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(twice).result() == min(19, base + priority.DATA_NICE)
    monkeypatch.setenv("TIERKV_DATA_NICE", "0")
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(twice).result() == base


def _slice_of_this_thread() -> int | None:
    """The thread's EEVDF slice in ns, from /proc (None where the kernel does not show it)."""
    path = f"/proc/self/task/{threading.get_native_id()}/sched"
    try:
        text = open(path).read()  # noqa: SIM115 - read once
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("se.slice"):
            return int(line.split(":")[1])
    return None


def _in_a_thread(fn: Callable[[], T]) -> T:
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result()


def test_a_control_thread_gets_a_short_slice_and_keeps_its_nice_and_policy() -> None:
    if _slice_of_this_thread() is None:
        pytest.skip("this kernel shows no EEVDF slice (before Linux 6.6)")

    def control() -> tuple[bool, int | None, int, int]:
        before = _nice_of_this_thread()
        took = priority.control_thread()
        return (
            took,
            _slice_of_this_thread(),
            _nice_of_this_thread() - before,
            os.sched_getscheduler(0),
        )

    took, slice_ns, nice_change, policy = _in_a_thread(control)
    assert nice_change == 0 and policy == os.SCHED_OTHER
    if took:  # Linux 6.12 and later take a custom slice
        assert slice_ns == priority.CONTROL_SLICE_NS
    assert _slice_of_this_thread() != priority.CONTROL_SLICE_NS  # only the calling thread


def test_a_lowered_control_thread_stays_lowered_and_the_slice_can_be_turned_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def lowered_then_control() -> tuple[int, bool]:
        priority.data_thread()
        nice = _nice_of_this_thread()
        priority.control_thread()
        return _nice_of_this_thread() - nice, priority.control_thread()

    change, _ = _in_a_thread(lowered_then_control)
    assert change == 0  # sched_setattr carries the thread's nice over
    monkeypatch.setenv("TIERKV_CONTROL_SLICE_US", "0")
    assert _in_a_thread(priority.control_thread) is False
