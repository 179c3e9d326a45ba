"""The counters a network tier (Redis, S3) reports in its ``stats()``: stored,
store_failed, loaded, missing, corrupt, corrupt_deleted, errors; safe to update from several
threads. (The disk tier keeps its own, larger set: :mod:`tierkv.tiers.disk_stats`.)"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable

from tierkv.tiers.base import LoadStatus

# The counter each load outcome counts in.
STATUS_COUNTER = {
    LoadStatus.OK: "loaded",
    LoadStatus.MISSING: "missing",
    LoadStatus.CORRUPT: "corrupt",
    LoadStatus.ERROR: "errors",
}


class TierCounts:
    """Named counts since start, each created on its first increment."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, **deltas: int) -> None:
        with self._lock:
            self._counts.update(deltas)

    def add_loads(self, statuses: Iterable[LoadStatus]) -> None:
        """Count each load outcome in its counter (:data:`STATUS_COUNTER`)."""
        self.add(**Counter(STATUS_COUNTER[status] for status in statuses))

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
