"""Lookup accounting: how many chunks each lookup found, where, and why the rest missed.

The service calls :meth:`LookupAccounting.record` for a lookup settled at once (no prefetch
from the tiers); the tiering calls :meth:`LookupAccounting.record_prefetch` when a lookup's
prefetch has finished, or :meth:`LookupAccounting.record` when none could start. The miss
reasons are defined in :mod:`tierkv.server.metrics`.

To tell a chunk that was evicted, or whose store expired, from one never seen, the server
remembers the keys that recently left the pool that way: a bounded insertion-ordered map
(oldest forgotten first, ~150 bytes a key), fed by the index itself, under its lock, as it
evicts objects or expires write leases: a lookup that misses a chunk an instant after it left
already knows why. A key re-stored and then looked up is a hit and never consulted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence

from tierkv.index import Evicted, ObjectIndex
from tierkv.server.metrics import POOL, ServiceMetrics
from tierkv.server.tiering.prefetch import PrefetchJob

log = logging.getLogger(__name__)

RECENT_KEYS = 32768  # keys remembered after they left the pool


class RecentlyGone:
    """Keys that left the pool recently, with why ("evicted", "expired")."""

    def __init__(self, capacity: int = RECENT_KEYS) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._reasons: dict[bytes, str] = {}

    def add(self, keys: Iterable[bytes], reason: str) -> None:
        with self._lock:
            reasons = self._reasons
            for key in keys:
                reasons.pop(key, None)  # re-inserted: now the newest
                reasons[key] = reason
            while len(reasons) > self.capacity:
                del reasons[next(iter(reasons))]

    def reason(self, key: bytes) -> str:
        """Why ``key`` is not in the pool, as far as the server knows ("absent" if not)."""
        return self._reasons.get(key, "absent")

    def on_evicted(self, evicted: Sequence[Evicted]) -> None:
        self.add((e.key for e in evicted), "evicted")

    def on_write_expired(self, keys: Sequence[bytes]) -> None:
        self.add(keys, "expired")

    def __len__(self) -> int:
        return len(self._reasons)


class LookupAccounting:
    """Turns lookup outcomes into ``tierkv_lookup_chunks_total`` counts."""

    def __init__(self, metrics: ServiceMetrics, index: ObjectIndex) -> None:
        self.metrics = metrics
        self.gone = RecentlyGone()
        index.on_evicted = self.gone.on_evicted
        index.on_write_expired = self.gone.on_write_expired

    def record(self, keys: Sequence[bytes], hits: int) -> None:
        """A lookup whose first ``hits`` chunks were in the pool, and nothing more."""
        misses = len(keys) - hits
        self.metrics.lookup(hits, misses, self.gone.reason(keys[hits]) if misses else "")

    def record_prefetch(self, keys: Sequence[bytes], job: PrefetchJob) -> None:
        """A lookup whose prefetch finished (on the tier thread, before it is reported)."""
        try:
            self._record_prefetch(keys, job)
        except Exception:  # accounting must never break the hand-over of the locks
            log.exception("lookup accounting failed")

    def _record_prefetch(self, keys: Sequence[bytes], job: PrefetchJob) -> None:
        total, first = len(keys), job.first
        if job.cancelled:  # the engine was told it was done with the pool's hits
            self.metrics.lookup(first, total - first, "timeout")
            return
        sources = job.sources[: job.loaded]
        hits: dict[str, int] = {POOL: first}
        for source in sources:
            hits[source] = hits.get(source, 0) + 1
        end = first + len(sources)
        misses = total - end
        if not misses:
            reason = ""
        elif len(sources) < len(job.sources):
            reason = "evicted"  # loaded, then gone before the lookup could lock it
        else:
            reason = job.miss_reason or self.gone.reason(keys[end])
        self.metrics.lookup(hits, misses, reason)
