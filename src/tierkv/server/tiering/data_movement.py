"""The data movement between the pool and the tiers of one server: write-behind and prefetch.

The service calls :meth:`Tiering.after_commit` when chunks become ready and
:meth:`Tiering.prefetch` on a lookup that did not hit the whole prefix; everything else
happens on the tier threads. With no tiers both are no-ops. Every prefetch's outcome is
counted when it finishes (or at once when it cannot start).

The tiers are built elsewhere (the server's wiring) and handed in, in lookup order; this
class never creates, starts or closes one. A chunk loaded from a tier goes on to the other
tiers, never back to its source, and its source hears that it is now committed in the pool
(with the checksums verified on the way in), which is how the peer tier publishes chunks
fetched from other nodes without hashing them again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from tierkv import protocol as p
from tierkv.index import ObjectIndex
from tierkv.pool import ShmPool
from tierkv.server.tiering.lookups import LookupAccounting
from tierkv.server.tiering.prefetch import Prefetcher, PrefetchJob, Verified
from tierkv.server.tiering.tier_quotas import TierQuota
from tierkv.server.tiering.write_behind import WriteBehind
from tierkv.tiers.base import Tier, TierUsage
from tierkv.workers import WorkerPool

log = logging.getLogger(__name__)


class Tiering:
    """Write-behind and prefetch over ``tiers`` (lookup order). Build, then :meth:`close`."""

    def __init__(
        self,
        index: ObjectIndex,
        pool: ShmPool,
        tiers: Sequence[Tier],
        lookups: LookupAccounting,
        *,
        workers: int,
        write_behind_max_bytes: int,
        prefetch_max_inflight: int,
        prefetch_timeout: float,
        write_first: Sequence[Tier] = (),
        wake_eviction: Callable[[], None] | None = None,
        quotas: Sequence[TierQuota] = (),
    ) -> None:
        """``write_first``: tiers the write-behind serves before the others (the peer
        tier: publishing only records a checksum, so chunks become visible to the cluster
        before a slow medium has them). ``quotas``: the tenant quotas of the tiers that
        have them (see :mod:`tierkv.server.tiering.tier_quotas`)."""
        self.lookups = lookups
        self.tiers = list(tiers)
        # Not data threads (tierkv.priority): they run Python (peer resolution, claims,
        # commits) that holds the GIL, and a lowered thread preempted while holding it stalls
        # the RPC loop behind it. A WorkerPool: the RPC loop hands lookups' prefetches to it
        # and must never wait for that (tierkv.workers).
        self.executor = WorkerPool(workers, "tierkv-tier")
        self.write_behind = WriteBehind(
            index,
            pool,
            sorted(self.tiers, key=lambda t: t not in write_first),
            self.executor,
            write_behind_max_bytes,
            {q.name: q for q in quotas},
        )
        self.prefetcher = Prefetcher(
            index,
            pool,
            self.tiers,
            self.executor,
            prefetch_max_inflight,
            prefetch_timeout,
            on_committed=self._prefetched,
            on_reserved=wake_eviction,
        )

    @property
    def enabled(self) -> bool:
        return bool(self.tiers)

    def after_commit(self, keys: Sequence[bytes]) -> None:
        """Queue freshly committed engine chunks for every tier."""
        if self.tiers and keys:
            self.write_behind.submit(keys)

    def _prefetched(self, source: Tier, keys: list[bytes], verified: list[Verified]) -> None:
        # On the tier thread, right after the commit of what ``source`` loaded.
        self.write_behind.submit(keys, source_tier=source.name)
        if verified:
            source.loaded_and_committed(verified)

    def prefetch(
        self,
        holder: int,
        keys: Sequence[bytes],
        lengths: Sequence[int],
        first: int,
        lease_id: int,
        on_done: Callable[[PrefetchJob], None],
    ) -> PrefetchJob | None:
        if not self.tiers:
            return None

        def done(job: PrefetchJob) -> None:
            self.lookups.record_prefetch(keys, job)
            on_done(job)

        job = self.prefetcher.start(holder, keys, lengths, first, lease_id, done)
        if job is None:  # too many in flight: the lookup gets what the pool had
            self.lookups.record(keys, first)
        return job

    def tier_stats(self, usage_of: Callable[[Tier], TierUsage]) -> list[p.TierStats]:
        """Per-tier figures; ``usage_of`` answers how much each tier holds."""
        wb = self.write_behind.stats
        pf = self.prefetcher.stats
        out: list[p.TierStats] = []
        for tier in self.tiers:
            try:
                usage = usage_of(tier)
            except Exception as exc:  # a tier should report failures, not raise them
                tier.outage.failed("usage", exc, 0, exc_info=True)
                usage = TierUsage(0, 0, 0)
            out.append(
                p.TierStats(
                    name=tier.name,
                    objects=usage.objects,
                    bytes_used=usage.bytes_used,
                    capacity=usage.capacity,
                    written_chunks=wb.written_chunks.get(tier.name, 0),
                    written_bytes=wb.written_bytes.get(tier.name, 0),
                    write_failures=wb.failed_chunks.get(tier.name, 0),
                    loaded_chunks=pf.loaded_chunks.get(tier.name, 0),
                    loaded_bytes=pf.loaded_bytes.get(tier.name, 0),
                    load_failures=dict(pf.failed.get(tier.name, {})),
                )
            )
        return out

    def close(self, timeout: float = 10.0) -> None:
        """Let queued writes finish (bounded), then stop the tier threads. The tiers stay
        open: whoever built them closes them."""
        if self.tiers and not self.write_behind.wait_idle(timeout):
            log.warning("stopping with tier writes still queued; those chunks are not in tiers")
        self.executor.shutdown(wait=True, cancel=True)
