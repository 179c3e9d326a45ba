"""Write-behind: after COMMIT_STORE, copy the new chunks from the pool to every tier.

The RPC thread only pins the committed chunks in the index (so eviction cannot take them
and a delete cannot free their slots for reuse) and queues one job per commit; tier threads
write straight from the pool slots and unpin them. A pin is not a use: the chunks keep their
place in the pool's LRU order, so their recency stays that of their commit (or of the
engine's last read), however long the tiers take, and chunks written and chunks dropped age
alike. The queue is bounded in bytes: when tiers cannot keep up, new chunks are not
written (counted as dropped) rather than making stores wait; the bound also bounds how many
pinned chunks eviction has to step over. A tier error is counted and
logged (once per outage, see :mod:`tierkv.tiers.outage`); it never reaches the engine and
never stops the server. A chunk that came from a
tier (a prefetch) is not written back to that tier. A tier with tenant quotas
(:mod:`tierkv.server.tiering.tier_quotas`) is asked which chunks it admits before each
batch (hard mode refuses a tenant's chunks beyond its quota) and enforces the quotas of the
batch's tenants after it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tierkv.index import Holder, LeaseNotFound, ObjectIndex
from tierkv.pool import ShmPool
from tierkv.priority import moving_data
from tierkv.server.tiering.tier_quotas import TierQuota
from tierkv.tiers.base import Tier
from tierkv.workers import Submit

log = logging.getLogger(__name__)


@dataclass
class WriteBehindStats:
    queued_chunks: int = 0
    queued_bytes: int = 0
    written_chunks: dict[str, int] = field(default_factory=dict)
    written_bytes: dict[str, int] = field(default_factory=dict)
    failed_chunks: dict[str, int] = field(default_factory=dict)
    dropped_chunks: int = 0


class WriteBehind:
    """Queues committed chunks for the tiers and writes them on ``executor`` threads."""

    def __init__(
        self,
        index: ObjectIndex,
        pool: ShmPool,
        tiers: Sequence[Tier],
        executor: Submit,
        max_queued_bytes: int,
        quotas: Mapping[str, TierQuota] | None = None,
    ) -> None:
        """``quotas``: tier name -> its tenant quotas, for the tiers that have them."""
        self.index = index
        self.quotas = dict(quotas or {})
        self.pool = pool
        self.tiers = list(tiers)
        self.executor = executor
        self.max_queued_bytes = max_queued_bytes
        self.stats = WriteBehindStats()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)

    def submit(self, keys: Sequence[bytes], source_tier: str = "") -> int:
        """Pin ``keys`` (just committed) and queue them; returns how many were queued.

        A full queue drops the chunks, not pinned; a pinned chunk keeps its place in the
        LRU order too, so neither way changes when a chunk will be evicted."""
        tiers = [t for t in self.tiers if t.name != source_tier]
        if not tiers or not keys:
            return 0
        with self._lock:
            if self.stats.queued_bytes >= self.max_queued_bytes:
                self.stats.dropped_chunks += len(keys)
                log.debug("write-behind queue full: %d chunks not written to tiers", len(keys))
                return 0
        lock = self.index.pin(keys, Holder.WRITE_BEHIND)
        if not lock.slots:
            return 0
        nbytes = sum(length for _, _, length in lock.slots)
        items = [(keys[i], offset, length) for i, offset, length in lock.slots]
        with self._lock:
            self.stats.queued_bytes += nbytes
            self.stats.queued_chunks += len(items)
        try:
            self.executor.submit(self._write, lock.lease_id, items, tiers, nbytes)
        except RuntimeError:  # the executor is shutting down: the server is stopping
            self._finish(lock.lease_id, items, nbytes, dropped=True)
            return 0
        return len(items)

    def _write(
        self,
        lease_id: int,
        items: list[tuple[bytes, int, int]],
        tiers: list[Tier],
        nbytes: int,
    ) -> None:
        try:
            views = [
                (key, self.pool.view(offset, length).toreadonly()) for key, offset, length in items
            ]
            for tier in tiers:
                quota = self.quotas.get(tier.name)
                if quota is None:
                    self._store(tier, views)
                    continue
                admission = quota.admit([(key, view.nbytes) for key, view in views])
                batch = [views[i] for i in admission.admitted]
                try:
                    self._store(tier, batch)
                finally:
                    quota.done(admission, [key for key, _ in batch])
                del batch
            del views
        finally:
            self._finish(lease_id, items, nbytes)

    def _store(self, tier: Tier, views: list[tuple[bytes, memoryview]]) -> None:
        """Write ``views`` to ``tier`` and count what it took."""
        if not views:
            return
        try:
            with moving_data():
                results = tier.store(views)
        except Exception as exc:  # a tier should report failures, not raise them
            tier.outage.failed("store", exc, len(views), exc_info=True)
            results = [False] * len(views)
        if len(results) != len(views):  # a broken tier: count the batch as failed
            tier.outage.failed("store", f"answered {len(results)} of the writes", len(views))
            results = [False] * len(views)
        ok = sum(results)
        written = sum(len(v) for (_, v), r in zip(views, results, strict=True) if r)
        with self._lock:
            s = self.stats
            s.written_chunks[tier.name] = s.written_chunks.get(tier.name, 0) + ok
            s.written_bytes[tier.name] = s.written_bytes.get(tier.name, 0) + written
            if ok < len(views):
                s.failed_chunks[tier.name] = s.failed_chunks.get(tier.name, 0) + len(views) - ok

    def _finish(
        self, lease_id: int, items: list[tuple[bytes, int, int]], nbytes: int, dropped: bool = False
    ) -> None:
        """Unpin a queued job's chunks and take it off the queue (as dropped, if not run)."""
        try:
            self.index.unpin(lease_id, Holder.WRITE_BEHIND)
        except LeaseNotFound:
            log.warning("write-behind pin expired before the tiers finished (read_ttl too short?)")
        with self._lock:
            s = self.stats
            s.queued_bytes -= nbytes
            s.queued_chunks -= len(items)
            if dropped:
                s.dropped_chunks += len(items)
            if s.queued_chunks == 0:
                self._idle.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued (tests, shutdown)."""
        with self._lock:
            return self._idle.wait_for(lambda: self.stats.queued_chunks == 0, timeout)
