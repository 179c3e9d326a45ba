"""The counters the request path updates, and the Prometheus registry that exports them.

The hot path only increments: per request one locked update of its type and outcome's count
and latency histogram; per lookup one locked add of its chunk results; per commit and per
retrieve one locked add of bytes. Prometheus families are built from these at scrape time.
Everything that mirrors figures the index and the tiers already keep (pool usage, objects,
evictions, lock expiries, tier contents) is read at scrape time by
:class:`tierkv.server.collector.StatsCollector`, registered in the same registry.

Lookup chunk results (``tierkv_lookup_chunks_total``): a lookup of N chunks that makes the
first H available counts H hits, each under the tier the chunk came from (``pool``: it was
in the pool; a tier name: a prefetch loaded it from that tier), and N - H misses, all under
the reason the available prefix ended at chunk H (a chunk after a missing one is useless to
the engine, whatever its state):

- ``absent``: never stored, or gone so long ago that the server no longer remembers it
- ``evicted``: evicted from the pool (and in no tier that could give it back)
- ``expired``: its store was reserved but never committed before ``write_ttl``, or the
  lookup's own locks ended (``read_ttl``, session ended) before its prefetch finished
- ``corrupt``: a tier held it but the copy failed verification
- ``timeout``: the prefetch was not done within ``prefetch_timeout``
- ``error``: a tier failed to load it (I/O error, lost connection), a tier that might hold
  it could not be asked (it is down), or the pool had no room to load it into
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from itertools import accumulate
from typing import Any, get_args

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from tierkv import protocol as p
from tierkv.eviction import Evictor
from tierkv.index import Evicted

POOL = "pool"
_POOL_HIT = ("hit", POOL)
MISS_REASONS = ("absent", "evicted", "expired", "corrupt", "timeout", "error")
MALFORMED = "malformed"  # request type label of messages that could not be decoded
# Server-side handling time: tens of microseconds (lookups, commits) to a second (a clear).
LATENCY_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip
RECENT_EVICTIONS = 50  # seconds with evictions that the dashboard can show


class Tally:
    """Thread-safe counts by key: a few adds per request, read at scrape time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[Any, int] = {}

    def add(self, key: Any, n: int = 1) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + n

    def add_pair(self, key1: Any, n1: int, key2: Any, n2: int) -> None:
        """Two adds under one lock (zeros skipped): the common case of the hot path."""
        with self._lock:
            counts = self._counts
            if n1:
                counts[key1] = counts.get(key1, 0) + n1
            if n2:
                counts[key2] = counts.get(key2, 0) + n2

    def add_many(self, items: Iterable[tuple[Any, int]]) -> None:
        with self._lock:
            counts = self._counts
            for key, n in items:
                counts[key] = counts.get(key, 0) + n

    def snapshot(self) -> dict[Any, int]:
        with self._lock:
            return dict(self._counts)


class EvictionLog:
    """Recent evictions, newest last: the passes of each second (a busy pool is evicted
    many times a second) merged into one event."""

    def __init__(self, size: int = RECENT_EVICTIONS, merge_s: float = 1.0) -> None:
        self.merge_s = merge_s
        self._events: deque[p.EvictionEvent] = deque(maxlen=size)
        self._lock = threading.Lock()

    def record(self, evicted: Sequence[Evicted]) -> None:
        """An eviction listener (runs on the eviction thread)."""
        if not evicted:
            return
        now, nbytes = time.time(), sum(e.length for e in evicted)
        with self._lock:
            last = self._events[-1] if self._events else None
            if last is not None and now - last.time < self.merge_s:
                self._events[-1] = p.EvictionEvent(
                    last.time, last.objects + len(evicted), last.bytes + nbytes, last.passes + 1
                )
            else:
                self._events.append(p.EvictionEvent(now, len(evicted), nbytes, 1))

    def recent(self) -> list[p.EvictionEvent]:
        with self._lock:
            return list(self._events)


class _Series:
    """One request type and outcome: a count, and a latency histogram (not cumulative)."""

    __slots__ = ("buckets", "count", "total")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)  # the last one is +Inf


class RequestRecorder(Collector):
    """Requests by type and outcome, with their latencies: one lock per request on the hot
    path, and a collector that turns the series into Prometheus families at scrape time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._series: dict[tuple[str, str], _Series] = {}
        self._names: dict[type, str] = {}
        for req_type in get_args(p.Request):  # every type shows up, at zero, from the start
            self._series[(self._name(req_type), "ok")] = _Series()

    def _name(self, req_type: type) -> str:
        name = self._names.get(req_type)
        if name is None:
            config = getattr(req_type, "__struct_config__", None)
            name = self._names[req_type] = str(config.tag) if config is not None else MALFORMED
        return name

    def record(self, req_type: type, outcome: str, seconds: float) -> None:
        name = self._names.get(req_type) or self._name(req_type)
        i = bisect_left(LATENCY_BUCKETS, seconds)
        with self._lock:
            series = self._series.get((name, outcome))
            if series is None:
                series = self._series[(name, outcome)] = _Series()
            series.count += 1
            series.total += seconds
            series.buckets[i] += 1

    def snapshot(self) -> dict[tuple[str, str], tuple[int, float, list[int]]]:
        """(type, outcome) -> (count, sum of seconds, bucket counts, not cumulative)."""
        with self._lock:
            return {k: (s.count, s.total, list(s.buckets)) for k, s in self._series.items()}

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        requests = CounterMetricFamily(
            "tierkv_requests",
            "RPC requests handled, by request type and outcome (ok or the error code)",
            labels=["type", "outcome"],
        )
        by_type: dict[str, tuple[int, float, list[int]]] = {}
        for (name, outcome), (count, total, buckets) in snap.items():
            requests.add_metric([name, outcome], count)
            n, t, b = by_type.get(name, (0, 0.0, [0] * len(buckets)))
            by_type[name] = (n + count, t + total, [x + y for x, y in zip(b, buckets, strict=True)])
        yield requests
        latency = HistogramMetricFamily(
            "tierkv_request_duration_seconds",
            "Server-side time to handle a request (decode and reply excluded), by type",
            labels=["type"],
        )
        bounds = [*(str(b) for b in LATENCY_BUCKETS), "+Inf"]
        for name, (_, total, buckets) in by_type.items():
            cumulative = list(zip(bounds, accumulate(buckets), strict=True))
            latency.add_metric([name], cumulative, total)
        yield latency


class ServiceMetrics:
    """Hot-path metrics of one :class:`~tierkv.server.service.CacheService`."""

    def __init__(self, eviction: Evictor | None = None) -> None:
        self.registry = CollectorRegistry()
        self.requests = RequestRecorder()
        self.registry.register(self.requests)
        self.lookups = Tally()  # ("hit", tier) / ("miss", reason) -> chunks
        self.pool_bytes = Tally()  # "stored"/"retrieved" + "_bytes"/"_chunks" -> count
        self.evictions = EvictionLog()
        if eviction is not None:
            eviction.add_listener(self.evictions.record)

    # -- requests --------------------------------------------------------------------------
    def request_done(self, req_type: type, reply: Any, seconds: float) -> None:
        """Count one handled request (``req_type`` NoneType: an undecodable message)."""
        kind = type(reply)
        self.requests.record(req_type, reply.code.value if kind is p.Error else "ok", seconds)
        if kind is p.RetrieveSlots and reply.slots:
            self.retrieved(len(reply.slots), sum(s.length for s in reply.slots))

    # -- chunks ----------------------------------------------------------------------------
    def stored(self, chunks: int, nbytes: int) -> None:
        """Chunks an engine committed into the pool."""
        if chunks:
            self.pool_bytes.add_pair("stored_chunks", chunks, "stored_bytes", nbytes)

    def retrieved(self, chunks: int, nbytes: int) -> None:
        """Chunks handed to an engine to copy out of the pool."""
        self.pool_bytes.add_pair("retrieved_chunks", chunks, "retrieved_bytes", nbytes)

    def lookup(self, hits: dict[str, int] | int, misses: int, reason: str) -> None:
        """One lookup's chunk results: hits by tier (an int: all from the pool), and
        ``misses`` chunks missed for ``reason``."""
        if isinstance(hits, int):
            self.lookups.add_pair(_POOL_HIT, hits, ("miss", reason), misses)
            return
        items = [(("hit", tier), n) for tier, n in hits.items() if n]
        if misses:
            items.append((("miss", reason), misses))
        self.lookups.add_many(items)

    # -- reading ---------------------------------------------------------------------------
    def lookup_counts(self, tiers: Sequence[str] = ()) -> tuple[dict[str, int], dict[str, int]]:
        """Chunks looked up: (hits by tier, misses by reason), every known label present."""
        hits = dict.fromkeys((POOL, *tiers), 0)
        misses = dict.fromkeys(MISS_REASONS, 0)
        for (result, label), n in self.lookups.snapshot().items():
            (hits if result == "hit" else misses)[label] = n
        return hits, misses

    def request_totals(self) -> dict[str, dict[str, int]]:
        """Requests handled: type -> outcome -> count."""
        out: dict[str, dict[str, int]] = {}
        for (name, outcome), (count, _, _) in self.requests.snapshot().items():
            out.setdefault(name, {})[outcome] = count
        return out

    def latency_means(self) -> dict[str, dict[str, float]]:
        """Per request type: count and mean handling time in seconds."""
        sums: dict[str, tuple[int, float]] = {}
        for (name, _), (count, total, _) in self.requests.snapshot().items():
            n, t = sums.get(name, (0, 0.0))
            sums[name] = (n + count, t + total)
        return {name: {"count": n, "mean_s": t / n if n else 0.0} for name, (n, t) in sums.items()}
