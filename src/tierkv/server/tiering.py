"""The tiers of one server: built from configuration, with their write-behind and prefetch.

The service calls :meth:`Tiering.after_commit` when chunks become ready and
:meth:`Tiering.prefetch` on a lookup that did not hit the whole prefix; everything else
happens on the tier threads. With no tiers configured both are no-ops. Every prefetch's
outcome is counted when it finishes (or at once when it cannot start).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from tierkv import protocol as p
from tierkv.cluster.node import start_cluster
from tierkv.config import ServerConfig
from tierkv.index import Evicted, ObjectIndex
from tierkv.pool import ShmPool
from tierkv.tiers.base import Tier, TierUsage, create_tier
from tierkv.tiers.prefetch import Prefetcher, PrefetchJob
from tierkv.tiers.write_behind import WriteBehind

if TYPE_CHECKING:
    from tierkv.server.lookups import LookupAccounting

log = logging.getLogger(__name__)


class Tiering:
    def __init__(
        self,
        cfg: ServerConfig,
        index: ObjectIndex,
        pool: ShmPool,
        tiers: Sequence[Tier] | None = None,
        *,
        lookups: LookupAccounting,
        wake_eviction: Callable[[], None] | None = None,
    ) -> None:
        self.lookups = lookups
        self.tiers: list[Tier] = list(tiers) if tiers is not None else build_tiers(cfg)
        # Cluster: other servers' pools are the last tier; publishing is its write-behind.
        self.cluster = start_cluster(cfg, index, pool, self.tiers) if cfg.cluster_seeds else None
        if self.cluster is not None:
            self.tiers.append(self.cluster.tier)
        self.executor = ThreadPoolExecutor(cfg.tier_workers, thread_name_prefix="tierkv-tier")
        self.write_behind = WriteBehind(  # publishing to peers first: it only records a checksum
            index,
            pool,
            sorted(self.tiers, key=lambda t: t is not getattr(self.cluster, "tier", None)),
            self.executor,
            cfg.write_behind_max_bytes,
        )
        self.prefetcher = Prefetcher(
            index,
            pool,
            self.tiers,
            self.executor,
            cfg.prefetch_max_inflight,
            cfg.prefetch_timeout,
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

    def on_evicted(self, batch: list[Evicted]) -> None:
        """Eviction listener: evicted chunks leave the cluster directory (or go "on disk")."""
        if self.cluster is not None:
            self.cluster.on_removed([e.key for e in batch])

    def on_removed(self, keys: list[bytes]) -> None:
        """Chunks deleted from the pool (a clear) leave the cluster directory likewise."""
        if self.cluster is not None and keys:
            self.cluster.on_removed(keys)

    def _prefetched(self, keys: list[bytes], source: str) -> None:
        # Chunks loaded from a tier go to the other tiers, never back to their source. Chunks
        # fetched from a peer are also published: this node is one more holder of them
        # (readers spread over the holders; a chunk outlives its first holder), with the
        # checksums verified on arrival (on this thread, right after the commit).
        self.write_behind.submit(keys, source_tier=source)
        if self.cluster is not None and source == self.cluster.tier.name:
            self.cluster.publish_known(self.cluster.tier.take_verified(keys))

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

    def tier_stats(self, usage_of: Callable[[Tier], TierUsage] | None = None) -> list[p.TierStats]:
        """Per-tier figures. ``usage()`` may ask the medium (a Redis SCAN, an S3 listing):
        not for hot paths; ``usage_of`` may answer from a cache instead."""
        wb = self.write_behind.stats
        pf = self.prefetcher.stats
        out: list[p.TierStats] = []
        for tier in self.tiers:
            try:
                usage = usage_of(tier) if usage_of is not None else tier.usage()
            except Exception:
                log.exception("tier %s usage failed", tier.name)
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
        """Let queued writes finish (bounded), stop the threads, close the tiers."""
        if self.tiers and not self.write_behind.wait_idle(timeout):
            log.warning("stopping with tier writes still queued; those chunks are not in tiers")
        self.executor.shutdown(wait=True, cancel_futures=True)
        for tier in self.tiers:
            try:
                tier.close()
            except Exception:
                log.exception("closing tier %s failed", tier.name)


def build_tiers(cfg: ServerConfig) -> list[Tier]:
    tiers: list[Tier] = []
    try:
        for spec in cfg.tiers:
            tier = create_tier(spec.name, dict(spec.options))
            log.info("tier %s ready (%s)", tier.name, tier.copies())
            tiers.append(tier)
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        for tier in tiers:
            tier.close()
        raise ValueError(f"each tier may appear once; got {names}")
    return tiers
