"""The disk tier's counters, and the snapshot of them it reports (metrics, ``/status``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DiskTierStats:
    """A snapshot of the disk tier's counters (for metrics and ``/status``)."""

    objects: int
    bytes_used: int
    capacity: int
    stores: int  # chunks written
    store_bytes: int
    store_skipped: int  # already held (or being stored by another thread)
    # not stored: too big, no room, writes disabled, I/O error, overtaken by a delete
    store_failed: int
    loads: int  # loads that returned OK
    load_bytes: int
    misses: int
    corrupt: int  # loads that returned CORRUPT
    errors: int  # OSErrors on any path (store, load, remove)
    evictions: int
    evicted_bytes: int
    deletes: int
    removed_at_start: int  # leftover temporary files, foreign names, headerless, not files
    writes_disabled: bool
    disabled_reason: str


class DiskCounters:
    """The disk tier's running counts (changed under the tier's lock)."""

    __slots__ = (
        "corrupt",
        "deletes",
        "errors",
        "evicted_bytes",
        "evictions",
        "load_bytes",
        "loads",
        "misses",
        "removed_at_start",
        "store_bytes",
        "store_failed",
        "store_skipped",
        "stores",
    )

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)

    stores: int
    store_bytes: int
    store_skipped: int
    store_failed: int
    loads: int
    load_bytes: int
    misses: int
    corrupt: int
    errors: int
    evictions: int
    evicted_bytes: int
    deletes: int
    removed_at_start: int

    def snapshot(
        self, objects: int, bytes_used: int, capacity: int, disabled_reason: str
    ) -> DiskTierStats:
        return DiskTierStats(
            objects=objects,
            bytes_used=bytes_used,
            capacity=capacity,
            stores=self.stores,
            store_bytes=self.store_bytes,
            store_skipped=self.store_skipped,
            store_failed=self.store_failed,
            loads=self.loads,
            load_bytes=self.load_bytes,
            misses=self.misses,
            corrupt=self.corrupt,
            errors=self.errors,
            evictions=self.evictions,
            evicted_bytes=self.evicted_bytes,
            deletes=self.deletes,
            removed_at_start=self.removed_at_start,
            writes_disabled=bool(disabled_reason),
            disabled_reason=disabled_reason,
        )
