"""WorkerPool: threads up front, submit never waits, failures logged, shutdown semantics."""

from __future__ import annotations

import logging
import threading

import pytest

from tierkv.workers import WorkerPool


def test_runs_every_task_on_its_threads() -> None:
    pool = WorkerPool(3, "test-pool")
    seen: list[tuple[int, str]] = []
    lock = threading.Lock()

    def task(i: int) -> None:
        with lock:
            seen.append((i, threading.current_thread().name))

    for i in range(100):
        pool.submit(task, i)
    pool.shutdown(wait=True)  # runs what is queued first
    assert sorted(i for i, _ in seen) == list(range(100))
    assert {name for _, name in seen} <= {"test-pool-0", "test-pool-1", "test-pool-2"}
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(task, 0)


def test_submit_does_not_wait_for_busy_workers() -> None:
    """Every thread is blocked: submitting still returns at once (the tasks queue)."""
    pool = WorkerPool(2, "test-busy")
    release = threading.Event()
    done: list[int] = []
    for _ in range(2):
        pool.submit(release.wait)
    submitted = []
    for i in range(1000):
        pool.submit(done.append, i)
        submitted.append(i)
    assert len(submitted) == 1000 and not done
    release.set()
    pool.shutdown(wait=True)
    assert sorted(done) == list(range(1000))


def test_a_failing_task_is_logged_and_the_worker_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    pool = WorkerPool(1, "test-fail")
    done = threading.Event()

    def boom() -> None:
        raise ValueError("injected")

    with caplog.at_level(logging.ERROR, logger="tierkv.workers"):
        pool.submit(boom)
        pool.submit(done.set)
        assert done.wait(10)
    pool.shutdown()
    assert "test-fail: a task failed" in caplog.text and "injected" in caplog.text


def test_shutdown_with_cancel_drops_what_has_not_started() -> None:
    pool = WorkerPool(1, "test-cancel")
    started, release = threading.Event(), threading.Event()
    ran: list[int] = []

    def first() -> None:
        started.set()
        release.wait(10)

    pool.submit(first)
    for i in range(10):
        pool.submit(ran.append, i)
    assert started.wait(10)
    threading.Timer(0.1, release.set).start()
    pool.shutdown(wait=True, cancel=True)
    assert ran == []


def test_needs_a_thread() -> None:
    with pytest.raises(ValueError, match="at least one"):
        WorkerPool(0, "none")


def test_shutdown_waits_at_most_its_timeout() -> None:
    pool = WorkerPool(1, "test-timeout")
    release = threading.Event()
    pool.submit(release.wait)
    pool.shutdown(wait=True, timeout=0.05)  # the task still runs: returns anyway
    assert not release.is_set()
    release.set()
    pool.shutdown(wait=True)  # now it ends
