"""Copying a batch of chunks with a few threads: the engine side's one copy, spread over cores.

A store or retrieve of many chunks is a batch of independent copies (each chunk between its
pool slot and the engine's array). One core copies at most ~7 GB/s on a typical server;
two or more reach the memory bandwidth. ``np.copyto`` and ``torch`` copies release the GIL,
so plain threads run them in parallel. :class:`Copier` splits a batch into ``threads``
groups of about equal bytes and returns only when every group has finished, also when one
fails: a copy into or out of a slot must never outlive the lease that reserved the slot (a
store's slot may be handed to someone else after its abort, a retrieve's after its finish).

The pool's threads are data threads (:mod:`tierkv.priority`): bulk copies never delay a
control thread (an engine's scheduler, the server's RPC loop) for a core. With
``data_priority`` every group runs on them and the caller only waits (an engine's thread
that also sends requests); without it the calling thread copies one group itself (a
caller that is a data thread already, such as a tier's).

Small batches (under ``min_bytes``) are copied on the calling thread: a thread handoff costs
tens of microseconds, a 1 MiB copy about 150.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from tierkv.priority import data_thread

T = TypeVar("T")

DEFAULT_MAX_THREADS = 4
DEFAULT_MIN_BYTES = 4 << 20


def default_threads() -> int:
    """Copy threads for this machine: its cores, at most ``DEFAULT_MAX_THREADS``."""
    return max(1, min(DEFAULT_MAX_THREADS, len(os.sched_getaffinity(0))))


def split_by_size(sizes: Sequence[int], groups: int) -> list[list[int]]:
    """Indexes of ``sizes`` in at most ``groups`` non-empty groups of about equal total size
    (largest first onto the lightest group); each group keeps ascending index order."""
    groups = max(1, min(groups, len(sizes)))
    load = [0] * groups
    out: list[list[int]] = [[] for _ in range(groups)]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        g = min(range(groups), key=load.__getitem__)
        out[g].append(i)
        load[g] += sizes[i]
    return [sorted(g) for g in out if g]


class Copier:
    """Runs one function over the items of a batch with up to ``threads`` threads."""

    def __init__(
        self,
        threads: int | None = None,
        min_bytes: int = DEFAULT_MIN_BYTES,
        data_priority: bool = False,
    ) -> None:
        if threads is not None and threads < 1:
            raise ValueError(f"copy threads must be at least 1 (None: automatic), not {threads}")
        self.threads = default_threads() if threads is None else threads
        self.min_bytes = min_bytes
        self.data_priority = data_priority
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.threads if self.data_priority else self.threads - 1,
                    thread_name_prefix="tierkv-copy",
                    initializer=data_thread,
                )
            return self._pool

    def run(self, fn: Callable[[T], None], items: Sequence[T], sizes: Sequence[int]) -> None:
        """Call ``fn(item)`` for every item (``sizes[i]``: the bytes item i moves).

        Returns when every call has returned; re-raises the first exception (by item order
        within a group, the calling thread's group first) after all groups have ended.
        With ``data_priority`` the calling thread copies only batches under ``min_bytes``.
        """
        if sum(sizes) < self.min_bytes or (
            not self.data_priority and (self.threads == 1 or len(items) < 2)
        ):
            for item in items:
                fn(item)
            return
        groups = split_by_size(sizes, self.threads)

        def run_group(idx: list[int]) -> None:
            for i in idx:
                fn(items[i])

        pool = self._executor()
        own: list[int] = [] if self.data_priority else groups.pop(0)
        futures: list[Future[None]] = [pool.submit(run_group, g) for g in groups]
        error: BaseException | None = None
        try:
            run_group(own)
        except BaseException as exc:
            error = exc
        for fut in futures:  # wait for every group, even after a failure
            failed = fut.exception()
            if error is None and failed is not None:
                error = failed
        if error is not None:
            raise error

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


__all__ = ["Copier", "default_threads", "split_by_size"]
