"""Data threads run at a lower CPU priority than the thread that serves requests, which waits
at most 1 ms for the GIL."""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from tierkv import priority


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


def test_while_data_moves_a_thread_waits_at_most_one_millisecond_for_the_gil() -> None:
    before = sys.getswitchinterval()
    seen: list[float] = []
    go, release = threading.Event(), threading.Event()

    def mover() -> None:
        with priority.moving_data():
            go.set()
            release.wait(10)

    with priority.moving_data():
        assert sys.getswitchinterval() == pytest.approx(priority.DATA_SWITCH_INTERVAL)
        other = threading.Thread(target=mover)
        other.start()
        go.wait(10)
    seen.append(sys.getswitchinterval())  # the other thread's block still runs
    release.set()
    other.join(10)
    assert seen == [pytest.approx(priority.DATA_SWITCH_INTERVAL)]
    assert sys.getswitchinterval() == before  # restored after the last block
    assert before > priority.DATA_SWITCH_INTERVAL
