"""The server's state as one JSON document: what GET /status returns, the dashboard shows
and the Prometheus collector exports.

Everything is read live through the service's thread-safe accessors (each takes its own
lock briefly; the document is not one atomic snapshot, but every figure in it is
consistent on its own), except tier usage: asking a Redis server or an S3 bucket how much
it holds is a scan, so each tier's answer is reused for 100 times as long as it took to get
(at most ``usage_ttl`` seconds): a disk tier's is live, an S3 listing's a few seconds old.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from tierkv import __version__
from tierkv.config import as_dict
from tierkv.server.metrics import POOL
from tierkv.tiers.base import Tier, TierUsage

if TYPE_CHECKING:
    from tierkv.server.service import CacheService

USAGE_TTL = 5.0
USAGE_REUSE = 100  # an answer is reused for this many times its cost


class StatusReader:
    """Builds the status document of one service."""

    def __init__(
        self,
        service: CacheService,
        usage_ttl: float = USAGE_TTL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.service = service
        self.usage_ttl = usage_ttl
        self.clock = clock
        self._lock = threading.Lock()
        self._usage: dict[str, tuple[float, TierUsage]] = {}  # tier -> (valid until, usage)

    def _tier_usage(self, tier: Tier) -> TierUsage:
        start = self.clock()
        with self._lock:
            cached = self._usage.get(tier.name)
        if cached is not None and start < cached[0]:
            return cached[1]
        usage = tier.usage()  # outside the lock: it may take a while
        now = self.clock()
        reuse = min(self.usage_ttl, USAGE_REUSE * (now - start))
        with self._lock:
            self._usage[tier.name] = (now + reuse, usage)
        return usage

    def status(self) -> dict[str, Any]:
        svc = self.service
        cfg = svc.cfg
        s = svc.index.stats()
        engines = svc.clients_snapshot()
        tiers = svc.tiering.tier_stats(self._tier_usage)
        wb = svc.tiering.write_behind.stats
        pf = svc.tiering.prefetcher.stats
        m = svc.metrics
        hits, misses = m.lookup_counts([t.name for t in tiers])
        pool = m.pool_bytes.snapshot()
        stored = {
            POOL: {"chunks": pool.get("stored_chunks", 0), "bytes": pool.get("stored_bytes", 0)}
        }
        retrieved = {
            POOL: {
                "chunks": pool.get("retrieved_chunks", 0),
                "bytes": pool.get("retrieved_bytes", 0),
            }
        }
        for t in tiers:
            stored[t.name] = {"chunks": t.written_chunks, "bytes": t.written_bytes}
            retrieved[t.name] = {"chunks": t.loaded_chunks, "bytes": t.loaded_bytes}
        return {
            "server": {
                "version": __version__,
                "time": time.time(),
                "uptime_s": svc.uptime(),
                "pool_name": svc.pool.name,
                "rpc_endpoint": cfg.rpc_endpoint,
                "http_url": cfg.http_url,
                "chunk_size": cfg.chunk_size,
            },
            "pool": {
                "capacity": s.capacity,
                "used": s.used,
                "largest_free": s.largest_free,
                "high_watermark": cfg.high_watermark,
                "low_watermark": cfg.low_watermark,
            },
            # Disjoint states: ready = committed and unlocked (evictable).
            "objects": {
                "total": s.objects,
                "writing": s.writing,
                "ready": s.evictable,
                "read_locked": s.read_locked,
            },
            "locks": {
                "write_leases": s.write_leases,
                "read_leases": s.read_leases,
                "sessions": sum(e.sessions for e in engines),
                "expired_write_slots": s.expired_write_slots,
                "expired_read_locks": s.expired_read_locks,
                "clients_reaped": svc.clients_reaped,
                "pinned_objects": s.pinned,
                "pin_leases": s.pin_leases,
            },
            "evictions": {
                "objects": s.evictions,
                "bytes": s.evicted_bytes,
                "recent": [
                    {"time": e.time, "objects": e.objects, "bytes": e.bytes, "passes": e.passes}
                    for e in m.evictions.recent()
                ],
            },
            "lookups": {"hits": hits, "misses": misses},
            "transfers": {"stored": stored, "retrieved": retrieved},
            "requests": m.request_totals(),
            "latency": m.latency_means(),
            "tiers": [msgspec.to_builtins(t) for t in tiers],
            "tiering": {
                "write_behind_queued": wb.queued_chunks,
                "write_behind_dropped": wb.dropped_chunks,
                "prefetch_started": pf.started,
                "prefetch_rejected": pf.rejected,
                "prefetch_timed_out": pf.timed_out,
                "prefetch_inflight": pf.inflight,
            },
            "engines": [msgspec.to_builtins(e) for e in engines],
            # Membership, directory, per-peer transfers (None when not in a cluster).
            "cluster": svc.tiering.cluster.stats() if svc.tiering.cluster is not None else None,
            "config": as_dict(cfg),
        }
