"""The server's figures, built in one place: every surface shows the same snapshot.

:meth:`StatusBuilder.snapshot` reads the index, the client registry, the lookup sessions,
the request metrics, the tiering and the cluster node once and returns a
:class:`~tierkv.protocol.Stats`. The RPC STATS reply *is* that struct (``tierkv status``
prints it); :func:`status_document` turns it into the JSON of GET /status (and the
dashboard); the Prometheus collector exports that document. So "ready" (committed, no
reader), "sessions" (every open lookup session, a scheduler's counting once) and every other
figure mean the same thing everywhere.

Each part is read through its own thread-safe accessor (each takes its own lock briefly):
the snapshot is not one atomic cut across the parts, but every figure is consistent on its
own.

Tier usage: a tier whose ``usage()`` walks the medium (a Redis SCAN, an S3 listing:
``Tier.usage_scans``) is never asked on a request's thread. Its last answer is shown with
its age, and a refresh runs on a background thread when the answer is older than
``usage_ttl`` (or than ten times what the last walk took), one walk per tier at a time.
Tiers that keep counters (disk, peer) are read live.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from tierkv import __version__
from tierkv import protocol as p
from tierkv.config import ServerConfig, as_dict
from tierkv.index import ObjectIndex
from tierkv.pool import ShmPool
from tierkv.server.metrics import POOL, ServiceMetrics
from tierkv.server.quotas import Quotas
from tierkv.server.registry import ClientRegistry
from tierkv.server.sessions import LookupSessions
from tierkv.server.tiering import Tiering
from tierkv.tiers.base import Tier, TierUsage

USAGE_TTL = 5.0
USAGE_REUSE = 10  # a walk's answer is reused for at least this many times its cost


class TierUsageCache:
    """Usage of tiers that must walk their medium to answer, refreshed off the caller's
    thread; live for the others."""

    def __init__(self, ttl: float = USAGE_TTL, clock: Callable[[], float] = time.monotonic):
        self.ttl = ttl
        self.clock = clock
        self._lock = threading.Lock()
        self._known: dict[str, tuple[float, float, TierUsage]] = {}  # tier -> (at, cost, usage)
        self._walking: set[str] = set()

    def usage(self, tier: Tier) -> tuple[TierUsage, float]:
        """(usage, its age in seconds: 0 when live, -1 when not known yet)."""
        if not tier.usage_scans:
            return tier.usage(), 0.0
        now = self.clock()
        with self._lock:
            known = self._known.get(tier.name)
            stale = known is None or now - known[0] >= max(self.ttl, USAGE_REUSE * known[1])
            start = stale and tier.name not in self._walking
            if start:
                self._walking.add(tier.name)
        if start:
            threading.Thread(
                target=self._walk, args=(tier,), name="tierkv-tier-usage", daemon=True
            ).start()
        if known is None:
            return TierUsage(0, 0, 0), -1.0
        return known[2], now - known[0]

    def _walk(self, tier: Tier) -> None:
        start = self.clock()
        try:
            usage = tier.usage()
        except Exception as exc:  # a tier should report failures, not raise them
            tier.outage.failed("usage", exc, 0, exc_info=True)
            with self._lock:
                self._walking.discard(tier.name)
            return
        now = self.clock()
        with self._lock:
            self._known[tier.name] = (now, now - start, usage)
            self._walking.discard(tier.name)


class StatusBuilder:
    """Builds the :class:`~tierkv.protocol.Stats` snapshot of one server."""

    def __init__(
        self,
        *,
        cfg: ServerConfig,
        pool: ShmPool,
        index: ObjectIndex,
        registry: ClientRegistry,
        sessions: LookupSessions,
        metrics: ServiceMetrics,
        tiering: Tiering,
        cluster: Callable[[], dict[str, Any]] | None = None,
        quotas: Quotas | None = None,
        clock: Callable[[], float] = time.monotonic,
        feed: Callable[[], dict[str, int]] | None = None,
        connections: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        """``cluster()`` gives the cluster node's figures (None: not in a cluster);
        ``feed()`` the chunk feed's; ``connections()`` the RPC connections'."""
        self.cfg = cfg
        self.pool = pool
        self.index = index
        self.registry = registry
        self.sessions = sessions
        self.metrics = metrics
        self.tiering = tiering
        self.cluster = cluster
        self.quotas = quotas
        self.feed = feed
        self.connections = connections
        self.clock = clock
        self.started = clock()
        self.usage = TierUsageCache(clock=clock)

    def uptime(self) -> float:
        return self.clock() - self.started

    def _tier_stats(self) -> list[p.TierStats]:
        ages: dict[str, float] = {}

        def usage_of(tier: Tier) -> TierUsage:
            usage, ages[tier.name] = self.usage.usage(tier)
            return usage

        tiers = self.tiering.tier_stats(usage_of)
        for t in tiers:
            t.usage_age_s = ages.get(t.name, 0.0)
        return tiers

    def snapshot(self, rid: int = 0) -> p.Stats:
        s = self.index.stats()
        tiers = self._tier_stats()
        m = self.metrics
        hits, misses = m.lookup_counts([t.name for t in tiers])
        outcomes = m.request_totals()
        requests = {name: sum(o.values()) for name, o in outcomes.items() if sum(o.values())}
        errors: dict[str, int] = {}
        for per_outcome in outcomes.values():
            for outcome, n in per_outcome.items():
                if outcome != "ok" and n:
                    errors[outcome] = errors.get(outcome, 0) + n
        pool = m.pool_bytes.snapshot()
        mode, default_quota = self.quotas.settings() if self.quotas else ("", -1)
        wb = self.tiering.write_behind.stats
        pf = self.tiering.prefetcher.stats
        return p.Stats(
            rid=rid,
            server_version=__version__,
            uptime_s=self.uptime(),
            pool_name=self.pool.name,
            capacity=s.capacity,
            used=s.used,
            largest_free=s.largest_free,
            objects=s.objects,
            writing=s.writing,
            ready=s.evictable,
            read_locked=s.read_locked,
            clients=len(self.registry),
            sessions=self.sessions.count(),
            write_leases=s.write_leases,
            read_leases=s.read_leases,
            expired_write_slots=s.expired_write_slots,
            expired_read_locks=s.expired_read_locks,
            evictions=s.evictions,
            evicted_bytes=s.evicted_bytes,
            requests=requests,
            errors=errors,
            tiers=tiers,
            write_behind_queued=wb.queued_chunks,
            write_behind_dropped=wb.dropped_chunks,
            prefetch_started=pf.started,
            prefetch_rejected=pf.rejected,
            prefetch_timed_out=pf.timed_out,
            prefetch_inflight=pf.inflight,
            engines=self.registry.snapshot(),
            lookup_hits=hits,
            lookup_misses=misses,
            stored_bytes=pool.get("stored_bytes", 0),
            retrieved_bytes=pool.get("retrieved_bytes", 0),
            http_url=self.cfg.http_url,
            cluster=self.cluster() if self.cluster is not None else {},
            clients_reaped=self.registry.reaped,
            pinned=s.pinned,
            pin_leases=s.pin_leases,
            expired_held=s.expired_held,
            clients_expired=self.registry.expired,
            stored_chunks=pool.get("stored_chunks", 0),
            retrieved_chunks=pool.get("retrieved_chunks", 0),
            request_outcomes=outcomes,
            latency=m.latency_means(),
            recent_evictions=m.evictions.recent(),
            chunk_size=self.cfg.chunk_size,
            rpc_endpoint=self.cfg.rpc_endpoint,
            time=time.time(),
            tenants=self.quotas.rows() if self.quotas else [],
            quota_mode=mode,
            default_quota=default_quota,
            chunk_feed=self.feed() if self.feed is not None else {},
            connections=self.connections() if self.connections is not None else {},
        )


def status_document(s: p.Stats, cfg: ServerConfig) -> dict[str, Any]:
    """GET /status: the snapshot ``s`` as one JSON document (the dashboard reads it)."""
    stored = {POOL: {"chunks": s.stored_chunks, "bytes": s.stored_bytes}}
    retrieved = {POOL: {"chunks": s.retrieved_chunks, "bytes": s.retrieved_bytes}}
    for t in s.tiers:
        stored[t.name] = {"chunks": t.written_chunks, "bytes": t.written_bytes}
        retrieved[t.name] = {"chunks": t.loaded_chunks, "bytes": t.loaded_bytes}
    return {
        "server": {
            "version": s.server_version,
            "protocol": p.PROTOCOL_VERSION,  # the wire protocol engines must speak
            "time": s.time,
            "uptime_s": s.uptime_s,
            "pool_name": s.pool_name,
            "rpc_endpoint": s.rpc_endpoint,
            "http_url": s.http_url,
            "chunk_size": s.chunk_size,
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
            "ready": s.ready,
            "read_locked": s.read_locked,
        },
        "locks": {
            "write_leases": s.write_leases,
            "read_leases": s.read_leases,
            "sessions": s.sessions,
            "expired_write_slots": s.expired_write_slots,
            "expired_read_locks": s.expired_read_locks,
            "clients_reaped": s.clients_reaped,
            "clients_expired": s.clients_expired,
            "pinned_objects": s.pinned,
            "pin_leases": s.pin_leases,
            "expired_held": s.expired_held,
        },
        "evictions": {
            "objects": s.evictions,
            "bytes": s.evicted_bytes,
            "recent": [msgspec.to_builtins(e) for e in s.recent_evictions],
        },
        "lookups": {"hits": s.lookup_hits, "misses": s.lookup_misses},
        "transfers": {"stored": stored, "retrieved": retrieved},
        "requests": s.request_outcomes,
        "latency": s.latency,
        "tiers": [msgspec.to_builtins(t) for t in s.tiers],
        "tiering": {
            "write_behind_queued": s.write_behind_queued,
            "write_behind_dropped": s.write_behind_dropped,
            "prefetch_started": s.prefetch_started,
            "prefetch_rejected": s.prefetch_rejected,
            "prefetch_timed_out": s.prefetch_timed_out,
            "prefetch_inflight": s.prefetch_inflight,
        },
        "engines": [msgspec.to_builtins(e) for e in s.engines],
        # Per tenant: pool bytes, quota, evictions, hard-quota refusals (names hidden
        # unless a quota names them; the largest 32, then one "rest" row).
        "tenants": {
            "mode": s.quota_mode,
            "default_limit": s.default_quota,
            "rows": [msgspec.to_builtins(t) for t in s.tenants],
        },
        # The chunk feed engines read for KV events (tierkv.server.chunk_feed).
        "chunk_feed": s.chunk_feed,
        # The engines' RPC connections: open, bytes they hold, turned away and why.
        "connections": s.connections,
        # Membership, directory, per-peer transfers (None when not in a cluster).
        "cluster": s.cluster or None,
        "config": as_dict(cfg),
    }
