"""Fixed pools of worker threads fed by a lock-free queue: how the control path hands off work.

``concurrent.futures.ThreadPoolExecutor`` does not suit the RPC loop: its ``submit`` holds a
lock shared by every executor of the process, and while holding it may start a new thread
and wait for that thread to run. So the loop's hand-off of a lookup's prefetch could wait
behind another pool's ``submit`` on a data thread (lowered, preempted, or starting a thread
of its own): measured 2 to 15 ms per lookup while the server moved data
(``benchmarks/load.py`` (b)).

A :class:`WorkerPool` starts all its threads up front, and :meth:`WorkerPool.submit` is one
``SimpleQueue.put`` (implemented in C, no Python-level lock): it never waits for anything.
Tasks return nothing to the submitter; one that raises is logged and the worker goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger(__name__)

Task = tuple[Callable[..., object], tuple[Any, ...]]


class Submit(Protocol):
    """What hands work to threads: a :class:`WorkerPool` (the server), or any executor."""

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> object: ...


class WorkerPool:
    """``workers`` threads named ``name-N`` running submitted calls in submission order;
    each first calls ``initializer`` if given (its priority, for one)."""

    def __init__(
        self, workers: int, name: str, initializer: Callable[[], object] | None = None
    ) -> None:
        if workers < 1:
            raise ValueError("a worker pool needs at least one thread")
        self.name = name
        self._queue: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._closed = False
        self._initializer = initializer
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., object], /, *args: Any) -> None:
        """Queue ``fn(*args)``; raises RuntimeError once the pool is shut down."""
        if self._closed:
            raise RuntimeError(f"{self.name}: the worker pool is shut down")
        self._queue.put((fn, args))

    def _work(self) -> None:
        if self._initializer is not None:
            self._initializer()
        while True:
            task = self._queue.get()
            if task is None:
                return
            fn, args = task
            try:
                fn(*args)
            except Exception:
                log.exception("%s: a task failed", self.name)

    def shutdown(
        self, wait: bool = True, cancel: bool = False, timeout: float | None = None
    ) -> None:
        """Refuse new work; ``cancel``: drop what has not started; ``wait``: until every
        thread has finished what it runs (and, without ``cancel``, what is queued), or
        ``timeout`` seconds have passed (the threads are daemons: they then end with the
        process)."""
        self._closed = True
        if cancel:
            while True:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
        for _ in self._threads:  # one stop per thread, after what is still queued
            self._queue.put(None)
        if wait:
            deadline = None if timeout is None else time.monotonic() + timeout
            me = threading.current_thread()
            for thread in self._threads:
                if thread is not me:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    thread.join(left)
