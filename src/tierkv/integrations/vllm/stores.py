"""The worker's store thread: stores run off vLLM's forward pass, in order, one at a time.

:class:`StoreQueue` runs jobs (one per planned store) on one background thread (a
:class:`~tierkv.workers.WorkerPool` of one), first in, first out, so a request's chunks are
stored in the order the scheduler planned them. It counts the jobs of each request that
have been submitted and have not ended yet (stored, failed or raised: every job ends), so
the worker can tell vLLM when a request's source blocks may be freed or reused
(:meth:`pending`, :meth:`wait`).

No lock is held while a job runs: the lock guards the counts only. The thread keeps the
process's CPU priority: a store's gather is a Python loop over blocks that holds the GIL
between its copies, and a lowered thread preempted while holding it would stall vLLM's own
threads behind it (the GIL knows no priorities); see :mod:`tierkv.priority`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection

from tierkv.workers import WorkerPool

log = logging.getLogger("vllm.tierkv")

Job = Callable[[], None]


class StoreQueue:
    """One FIFO store thread and the per-request counts of its unfinished jobs."""

    def __init__(self, name: str) -> None:
        self._cond = threading.Condition()
        self._pending: dict[str, int] = {}
        self._closed = False
        # One thread (first in, first out), a daemon: a store still queued when the process
        # exits is a future miss, nothing more (shutdown drains the queue first, within a
        # bound).
        self._pool = WorkerPool(1, name)

    def submit(self, request_id: str, job: Job) -> None:
        """Queue ``job`` (a store of ``request_id``'s blocks) behind every earlier one."""
        with self._cond:
            if self._closed:
                raise RuntimeError("store queue closed")
            self._pending[request_id] = self._pending.get(request_id, 0) + 1
        self._pool.submit(self._run, request_id, job)

    def pending(self, request_id: str) -> bool:
        """Whether a job of ``request_id`` was submitted and has not ended."""
        with self._cond:
            return request_id in self._pending

    def wait(self, request_ids: Collection[str], timeout: float | None = None) -> bool:
        """Block until no job of ``request_ids`` is pending; False if ``timeout`` ran out."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._pending.keys().isdisjoint(request_ids), timeout
            )

    def drain(self, timeout: float | None = None) -> bool:
        """Block until every submitted job has ended; False if ``timeout`` ran out."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending, timeout)

    def close(self, timeout: float) -> bool:
        """Drain (at most ``timeout`` seconds), then stop the thread: jobs still queued then
        are dropped, a job running then ends first. False if jobs were still pending."""
        start = time.monotonic()
        drained = self.drain(timeout)
        with self._cond:
            self._closed = True
        self._pool.shutdown(timeout=max(0.0, timeout - (time.monotonic() - start)))
        return drained

    def _run(self, request_id: str, job: Job) -> None:
        try:
            if not self._closed:  # once closed, queued jobs are dropped
                job()
        except Exception:  # a store is a cache write: log, never kill the thread
            log.exception("tierkv: a store of request %s failed", request_id)
        finally:
            self._ended(request_id)

    def _ended(self, request_id: str) -> None:
        with self._cond:
            left = self._pending[request_id] - 1
            if left:
                self._pending[request_id] = left
            else:
                del self._pending[request_id]
            self._cond.notify_all()
