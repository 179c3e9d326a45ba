"""Data threads run at a lower CPU priority and with a longer time slice than the thread that
serves requests, give way between pieces of bulk work, and make it wait at most 1 ms for the
GIL; a server's RPC loop and request workers run with a short time slice."""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from support.servers import ServerProcess
from tierkv import priority
from tierkv.client import Client
from tierkv.config import ServerConfig


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


def test_http_work_shortens_the_interval_further_and_the_shortest_block_applies() -> None:
    before = sys.getswitchinterval()
    with priority.moving_data():
        with priority.sharing_the_gil():
            assert sys.getswitchinterval() == pytest.approx(priority.HTTP_SWITCH_INTERVAL)
            with priority.moving_data():  # a longer one inside changes nothing
                assert sys.getswitchinterval() == pytest.approx(priority.HTTP_SWITCH_INTERVAL)
        assert sys.getswitchinterval() == pytest.approx(priority.DATA_SWITCH_INTERVAL)
    assert sys.getswitchinterval() == before
    assert priority.HTTP_SWITCH_INTERVAL < priority.DATA_SWITCH_INTERVAL < before


def _slice_in(task: Path) -> int | None:
    """The scheduler's time slice (ns) of the thread whose /proc directory is ``task``, where
    the kernel shows it."""
    try:
        text = (task / "sched").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("se.slice"):
            return int(line.split(":")[1])
    return None


def _slice_of_this_thread() -> int | None:
    return _slice_in(Path(f"/proc/self/task/{threading.get_native_id()}"))


def _skip_without_slices() -> int:
    """This thread's slice; skips where the kernel shows no slices or has no custom ones."""
    base = _slice_of_this_thread()
    if base is None:
        pytest.skip("this kernel does not show time slices (/proc/<pid>/task/<tid>/sched)")
    with ThreadPoolExecutor(1, initializer=priority.control_thread) as pool:
        if pool.submit(_slice_of_this_thread).result() == base:
            pytest.skip("this kernel has no per-thread slices (Linux 6.12 and later have)")
    return base


def test_a_data_thread_gets_a_longer_time_slice_than_the_caller() -> None:
    """So that a woken control thread, with the default (shorter) slice, may preempt it."""
    base = _skip_without_slices()
    with ThreadPoolExecutor(1, initializer=priority.data_thread) as pool:
        lowered = pool.submit(lambda: (_slice_of_this_thread(), _nice_of_this_thread())).result()
    assert lowered == (priority.DATA_SLICE_NS, min(19, _nice_of_this_thread() + priority.DATA_NICE))
    assert base < priority.DATA_SLICE_NS
    assert _slice_of_this_thread() == base  # the calling thread keeps its slice


def test_only_a_data_thread_gives_way(monkeypatch: pytest.MonkeyPatch) -> None:
    yields: list[int] = []
    monkeypatch.setattr(priority, "_sched_yield", lambda: yields.append(threading.get_native_id()))
    priority.give_way()
    assert yields == []  # this (control) thread keeps its core

    def data_work() -> int:
        priority.give_way()
        priority.give_way()
        return threading.get_native_id()

    with ThreadPoolExecutor(1, initializer=priority.data_thread) as pool:
        tid = pool.submit(data_work).result()
    assert yields == [tid, tid]


def _slices_of(pid: int) -> list[int | None]:
    """The time slice (ns) of every thread of process ``pid``."""
    return [_slice_in(task) for task in Path(f"/proc/{pid}/task").iterdir()]


def test_a_control_thread_gets_a_short_slice_at_its_own_priority(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """So that, woken, it takes a core at once from threads of the default slice."""
    base = _skip_without_slices()
    with ThreadPoolExecutor(1, initializer=priority.control_thread) as pool:
        got = pool.submit(lambda: (_slice_of_this_thread(), _nice_of_this_thread())).result()
    assert got == (priority.CONTROL_SLICE_NS, _nice_of_this_thread())
    assert base > priority.CONTROL_SLICE_NS
    monkeypatch.setenv("TIERKV_CONTROL_SLICE_US", "0")  # off: the kernel's default
    with ThreadPoolExecutor(1, initializer=priority.control_thread) as pool:
        assert pool.submit(_slice_of_this_thread).result() == base
    monkeypatch.setenv("TIERKV_CONTROL_SLICE_US", "500")
    with ThreadPoolExecutor(1, initializer=priority.control_thread) as pool:
        assert pool.submit(_slice_of_this_thread).result() == 500_000


@pytest.mark.parametrize(
    ("value", "expected"), [("two", "default"), ("", "default"), ("-5", "base")]
)
def test_a_bad_control_slice_setting_never_stops_a_thread(
    monkeypatch: pytest.MonkeyPatch, value: str, expected: str
) -> None:
    """Not a number: the default slice; negative: the kernel's own (as 0)."""
    base = _skip_without_slices()
    monkeypatch.setenv("TIERKV_CONTROL_SLICE_US", value)
    with ThreadPoolExecutor(1, initializer=priority.control_thread) as pool:
        got = pool.submit(_slice_of_this_thread).result()
    assert got == (priority.CONTROL_SLICE_NS if expected == "default" else base)


def test_a_servers_rpc_loop_and_request_workers_have_the_short_slice(
    server: ServerProcess,
) -> None:
    _skip_without_slices()
    with Client(server.endpoint) as client:
        client.ping()  # the loop has started
    assert server.proc is not None
    slices = _slices_of(server.proc.pid)
    workers = ServerConfig().workers
    assert slices.count(priority.CONTROL_SLICE_NS) == 1 + workers, slices
