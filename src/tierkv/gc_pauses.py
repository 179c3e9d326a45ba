"""Python's cycle collector, kept from stalling a server's control path, and its pauses watched.

A collection stops every thread of the process while it scans the tracked objects of its
generations; a full (generation 2) one scans all of them. In a server that is a pause in
which the RPC loop answers nothing: measured under load (``benchmarks/load.py`` (b)), full
collections of 36 to 94 ms were most of the lookups' worst cases, with a nearly empty pool,
and a pool of a million chunks added ~0.3 s more (one tracked index entry per chunk).

Two measures keep them short: what exists once a process has started (modules, the wiring)
is frozen out of every later collection (:func:`freeze_startup`), and the long-lived
objects kept per chunk are not tracked at all (:class:`tierkv.index.Entry`). What remains
is watched: :data:`PAUSES` counts every collection's pause per generation, exported as
Prometheus metrics by :class:`GcPauseCollector`, and in a server's own process a pause of
more than :data:`LOG_PAUSE_S` is logged.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

LOG_PAUSE_S = 0.05
GENERATIONS = (0, 1, 2)


class CollectionPauses:
    """Per generation: collections, their summed and their longest pause (since install)."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = [0.0, 0.0, 0.0]
        self._started = 0.0
        self._started_cpu = 0.0
        self._installed = False
        self.log_long = False  # log pauses over LOG_PAUSE_S (a server's own process)
        self._lock = threading.Lock()

    def install(self, log_long: bool = False) -> None:
        """Watch this process's collections (once); ``log_long``: also log long pauses
        (a process that is a server; not one that only embeds one, such as a test run)."""
        with self._lock:
            self.log_long = self.log_long or log_long
            if not self._installed:
                self._installed = True
                gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        # Runs in the thread that triggered the collection, with the GIL held: no other
        # Python thread runs in between, so the start time needs no lock.
        if phase == "start":
            self._started = time.perf_counter()
            self._started_cpu = time.thread_time()
            return
        pause = time.perf_counter() - self._started
        gen = min(2, max(0, int(info.get("generation", 2))))
        self.counts[gen] += 1
        self.seconds[gen] += pause
        if pause > self.longest[gen]:
            self.longest[gen] = pause
        if self.log_long and pause > LOG_PAUSE_S:
            # The CPU time tells a long scan (many tracked objects) from a short one whose
            # thread was preempted (a busy machine): the pause is as long either way.
            log.warning(
                "garbage collection (generation %d) paused every thread for %.0f ms "
                "(%.0f ms of CPU; %d objects collected)",
                gen,
                pause * 1e3,
                (time.thread_time() - self._started_cpu) * 1e3,
                info.get("collected", 0),
            )


PAUSES = CollectionPauses()


def freeze_startup() -> None:
    """Collect once, then move every object that exists now to the permanent generation:
    a process's imports are never scanned again; and log its long pauses from now on.
    Call in a server's own process before it binds its sockets (a collection then delays
    nobody)."""
    PAUSES.install()
    gc.collect()  # counted, not logged: it is meant to take a while, before any request
    gc.freeze()
    PAUSES.install(log_long=True)


class GcPauseCollector(Collector):
    """:data:`PAUSES` as Prometheus families (installs it)."""

    def __init__(self, prefix: str = "tierkv") -> None:
        self.prefix = prefix
        PAUSES.install()

    def collect(self) -> Iterator[Metric]:
        counts = CounterMetricFamily(
            f"{self.prefix}_gc_collections",
            "Garbage collections of this process, by generation",
            labels=["generation"],
        )
        seconds = CounterMetricFamily(
            f"{self.prefix}_gc_pause_seconds",
            "Seconds every thread was paused by garbage collections, by generation",
            labels=["generation"],
        )
        longest = GaugeMetricFamily(
            f"{self.prefix}_gc_pause_max_seconds",
            "The longest garbage-collection pause since start, by generation",
            labels=["generation"],
        )
        for gen in GENERATIONS:
            label = [str(gen)]
            counts.add_metric(label, PAUSES.counts[gen])
            seconds.add_metric(label, PAUSES.seconds[gen])
            longest.add_metric(label, PAUSES.longest[gen])
        yield counts
        yield seconds
        yield longest


__all__ = ["PAUSES", "CollectionPauses", "GcPauseCollector", "freeze_startup"]
