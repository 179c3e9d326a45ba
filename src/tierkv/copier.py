"""Copying a batch of chunks with a few threads: the engine side's one copy, spread over cores.

A store or retrieve of many chunks is a batch of independent copies (each chunk between its
pool slot and the engine's array). One core copies at most ~7 GB/s on a typical server;
two or more reach the memory bandwidth. ``np.copyto`` and ``torch`` copies release the GIL,
so plain threads run them in parallel. :class:`Copier` has up to ``threads`` threads take
the batch's items one at a time (largest first), so a thread whose core is busy with
something else (another process, an engine's OpenMP threads still spinning after a forward
step) copies fewer items instead of holding the whole batch up with a fixed share. It
returns only when every item started has ended, also when one fails: a copy into or out of
a slot must never outlive the lease that reserved the slot (a store's slot may be handed to
someone else after its abort, a retrieve's after its finish).

The pool's threads are data threads (:mod:`tierkv.priority`): bulk copies never delay a
control thread (an engine's scheduler, the server's RPC loop) for a core. With
``data_priority`` only they copy and the caller waits (an engine's thread that also sends
requests); without it the calling thread takes items too (a caller that is a data thread
already, such as a tier's). A caller that would only wait for the batch anyway (a vLLM
worker's forward thread in a synchronous store or a load) takes items too, whatever the
default (``caller_copies``): it holds a core at its own priority, which the data threads may
not get while the engine's OpenMP threads spin after a step.

Small batches (under ``min_bytes``) are copied on the calling thread: a thread handoff costs
tens of microseconds, a 1 MiB copy about 150.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from tierkv.priority import data_thread

T = TypeVar("T")

DEFAULT_MAX_THREADS = 4
DEFAULT_MIN_BYTES = 4 << 20


def default_threads() -> int:
    """Copy threads for this machine: its cores, at most ``DEFAULT_MAX_THREADS``."""
    return max(1, min(DEFAULT_MAX_THREADS, len(os.sched_getaffinity(0))))


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
                    self.threads,
                    thread_name_prefix="tierkv-copy",
                    initializer=data_thread,
                )
            return self._pool

    def run(
        self,
        fn: Callable[[T], None],
        items: Sequence[T],
        sizes: Sequence[int],
        caller_copies: bool | None = None,
    ) -> None:
        """Call ``fn(item)`` for every item (``sizes[i]``: the bytes item i moves).

        The threads take items one at a time, largest first, until none is left: a thread
        that a busy core slows down copies fewer items instead of holding the batch up with
        a fixed share. Returns when every call has returned. After a call raises, no thread
        starts another item; the error of the lowest failed item is re-raised once every
        item started has ended; so is an exception in the calling thread while it waits (a
        signal handler's). ``caller_copies``: the calling thread takes items like the
        pool's threads (default: without ``data_priority``); otherwise it copies only
        batches under ``min_bytes`` and waits for the pool's threads.
        """
        joins = not self.data_priority if caller_copies is None else caller_copies
        helpers = self.threads - 1 if joins else self.threads
        alone = helpers < 1 or (len(items) < 2 and joins)
        if alone or sum(sizes) < self.min_bytes:
            for item in items:
                fn(item)
            return
        order = iter(sorted(range(len(items)), key=lambda i: -sizes[i]))
        take = threading.Lock()
        failed: list[tuple[int, BaseException]] = []

        def work() -> None:
            while not failed:
                with take:
                    i = next(order, None)
                if i is None:
                    return
                try:
                    fn(items[i])
                except BaseException as exc:
                    failed.append((i, exc))

        pool = self._executor()
        futures = [pool.submit(work) for _ in range(min(helpers, len(items)))]
        try:
            if joins:
                work()
            for fut in futures:  # wait for every thread, even after a failure
                fut.exception()
        except BaseException as exc:  # the caller's thread interrupted (a signal handler)
            # The threads take nothing more, and the copies in flight end before this
            # returns: the caller gives the slots they copy into or from back then.
            failed.append((len(items), exc))
            for fut in futures:
                while True:
                    try:
                        fut.exception()
                        break
                    except BaseException:
                        continue
            raise
        if failed:
            raise min(failed, key=lambda f: f[0])[1]

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


__all__ = ["Copier", "default_threads"]
