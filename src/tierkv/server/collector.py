"""Prometheus export of the figures the server already keeps, read at scrape time.

Pool usage, objects by state, leases, lock expiries, evictions, tier contents, write-behind
and prefetch figures, and the lookup and transfer counts of
:class:`~tierkv.server.metrics.ServiceMetrics` all come from one
:func:`~tierkv.server.status.status_document` per scrape, so the request path
pays nothing for them. Request counts and latencies are ordinary prometheus-client metrics
in the same registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _labelled(
    cls: type[CounterMetricFamily] | type[GaugeMetricFamily],
    name: str,
    doc: str,
    label: str,
    values: dict[str, Any],
) -> Metric:
    family = cls(name, doc, labels=[label])
    for key, value in values.items():
        family.add_metric([key], value)
    return family


class StatsCollector(Collector):
    """Exports the status document (:func:`tierkv.server.status.status_document` of a fresh
    snapshot) as Prometheus metrics."""

    def __init__(self, status_doc: Callable[[], dict[str, Any]]) -> None:
        self.status_doc = status_doc

    def collect(self) -> Iterator[Metric]:
        st = self.status_doc()
        server, pool, objects, locks = st["server"], st["pool"], st["objects"], st["locks"]
        info = InfoMetricFamily("tierkv_build", "tierkv version")
        info.add_metric([], {"version": server["version"]})
        yield info
        yield _gauge(
            "tierkv_uptime_seconds", "Seconds since the server started", server["uptime_s"]
        )
        yield _gauge(
            "tierkv_pool_capacity_bytes", "Size of the shared-memory pool", pool["capacity"]
        )
        yield _gauge(
            "tierkv_pool_used_bytes", "Bytes of the pool allocated to objects", pool["used"]
        )
        yield _gauge(
            "tierkv_pool_largest_free_bytes", "Largest free block of the pool", pool["largest_free"]
        )
        yield _labelled(
            GaugeMetricFamily,
            "tierkv_objects",
            "Objects in the pool by state (writing: reserved by a store, not committed; "
            "ready: committed and evictable; read_locked: held by readers)",
            "state",
            {k: objects[k] for k in ("writing", "ready", "read_locked")},
        )
        yield _gauge("tierkv_engines", "Registered engine clients", len(st["engines"]))
        yield _gauge("tierkv_lookup_sessions", "Open lookup sessions", locks["sessions"])
        yield _labelled(
            GaugeMetricFamily,
            "tierkv_leases",
            "Open lock leases (one per store or retrieve batch)",
            "kind",
            {"write": locks["write_leases"], "read": locks["read_leases"]},
        )
        yield _labelled(
            CounterMetricFamily,
            "tierkv_lock_expiries",
            "Locks that reached their TTL (write: store slots reclaimed uncommitted; "
            "read: read locks released by expiry)",
            "kind",
            {"write": locks["expired_write_slots"], "read": locks["expired_read_locks"]},
        )
        yield _gauge(
            "tierkv_pinned_objects",
            "Committed objects the write-behind holds until the tiers have them (counted in "
            "objects{state=read_locked}; they keep their LRU place)",
            locks["pinned_objects"],
        )
        yield _gauge(
            "tierkv_expired_slots_held",
            "Slots of expired store reservations and write-behind pins kept from reuse until "
            "their holder ends them or goes away (it may still be using them)",
            locks["expired_held"],
        )
        yield _counter(
            "tierkv_clients_reaped",
            "Engine clients dropped (locks released) because their process exited",
            locks["clients_reaped"],
        )
        yield _counter(
            "tierkv_clients_expired",
            "Engine clients the server cannot watch dropped (locks released) after "
            "client_idle_ttl without a request",
            locks["clients_expired"],
        )
        feed = st["chunk_feed"]
        if feed:
            yield _counter(
                "tierkv_chunk_feed_events",
                "Events of the chunk feed (noted chunks stored and removed) since start",
                feed["seq"],
            )
            yield _counter(
                "tierkv_chunk_feed_resyncs",
                "Chunk feed reads answered 'resync' (the reader was behind what the log keeps)",
                feed["resyncs"],
            )
            yield _gauge(
                "tierkv_chunk_feed_held_chunks",
                "Noted chunks the pool holds (what engines announce to routers)",
                feed["held_chunks"],
            )
            yield _gauge(
                "tierkv_chunk_feed_note_bytes",
                "Bytes of the notes of the chunks the pool holds",
                feed["held_note_bytes"],
            )
        conns = st["connections"]
        if conns:
            yield _gauge("tierkv_rpc_connections", "Open RPC connections", conns["open"])
            yield _gauge(
                "tierkv_rpc_buffered_bytes",
                "Bytes RPC connections hold in large requests being received and in replies "
                "not yet sent (each bounded by connection_buffer_bytes)",
                conns["receiving_bytes"] + conns["unsent_bytes"],
            )
            yield _labelled(
                CounterMetricFamily,
                "tierkv_rpc_connections_refused",
                "RPC connections closed by the server for a server-wide bound: max_connections "
                "open, no file descriptor left, large requests or unsent replies past "
                "connection_buffer_bytes",
                "reason",
                {
                    "max_connections": conns["turned_away_max_connections"],
                    "descriptors": conns["turned_away_descriptors"],
                    "large_requests": conns["refused_large_requests"],
                    "unsent_replies": conns["dropped_unsent"],
                },
            )
        ev = st["evictions"]
        yield _counter("tierkv_evictions", "Objects evicted from the pool", ev["objects"])
        yield _counter("tierkv_evicted_bytes", "Pool bytes freed by eviction", ev["bytes"])
        yield self._lookups(st["lookups"])
        for direction, doc in (
            ("stored", "written (pool: committed by engines; a tier: by write-behind)"),
            ("retrieved", "read (pool: handed to engines; a tier: loaded by prefetch)"),
        ):
            per_tier = st["transfers"][direction]
            for unit in ("bytes", "chunks"):
                yield _labelled(
                    CounterMetricFamily,
                    f"tierkv_{direction}_{unit}",
                    f"Chunk {unit} {doc}",
                    "tier",
                    {tier: v[unit] for tier, v in per_tier.items()},
                )
        yield from self._tiers(st["tiers"], st["tiering"])
        yield from self._tenants(st["tenants"]["rows"])
        if st.get("cluster"):
            yield from self._cluster(st["cluster"])

    @staticmethod
    def _tenants(rows: list[dict[str, Any]]) -> Iterator[Metric]:
        """Per tenant, labelled by its tag (a short hash, never the salt); the status holds
        at most 32 tenants and one "rest" row, so the series are bounded."""
        for name, doc, cls, field in (
            ("tierkv_tenant_used_bytes", "Pool bytes a tenant's chunks hold", GaugeMetricFamily,
             "used"),
            ("tierkv_tenant_limit_bytes", "A tenant's pool quota (-1: unlimited)",
             GaugeMetricFamily, "limit"),
            ("tierkv_tenant_evictions", "A tenant's chunks evicted from the pool (watermark "
             "or its quota)", CounterMetricFamily, "evictions"),
            ("tierkv_tenant_evicted_bytes", "Pool bytes of a tenant's evicted chunks",
             CounterMetricFamily, "evicted_bytes"),
            ("tierkv_tenant_refused_chunks", "A tenant's new chunks refused by its hard quota",
             CounterMetricFamily, "refused_chunks"),
        ):  # fmt: skip
            yield _labelled(cls, name, doc, "tenant", {r["tag"]: r[field] for r in rows})
        for name, doc, cls, field in (
            ("tierkv_tenant_tier_used_bytes", "Bytes a tenant's chunks hold in a tier with "
             "quotas (disk)", GaugeMetricFamily, "used"),
            ("tierkv_tenant_tier_limit_bytes", "A tenant's quota in a tier (-1: unlimited)",
             GaugeMetricFamily, "limit"),
            ("tierkv_tenant_tier_evictions", "A tenant's chunks its quota evicted from a tier",
             CounterMetricFamily, "evictions"),
            ("tierkv_tenant_tier_refused_chunks", "A tenant's chunks its hard quota kept out "
             "of a tier", CounterMetricFamily, "refused_chunks"),
        ):  # fmt: skip
            family = cls(name, doc, labels=["tenant", "tier"])
            for r in rows:
                for tier, figures in r.get("tiers", {}).items():
                    family.add_metric([r["tag"], tier], figures[field])
            yield family

    @staticmethod
    def _lookups(lookups: dict[str, dict[str, int]]) -> Metric:
        family = CounterMetricFamily(
            "tierkv_lookup_chunks",
            "Chunks looked up: hits by the tier that had them, misses by reason "
            "(absent, evicted, expired, corrupt, timeout, error)",
        )
        name = "tierkv_lookup_chunks_total"
        for tier, n in lookups["hits"].items():
            family.samples.append(Sample(name, {"result": "hit", "tier": tier}, n))
        for reason, n in lookups["misses"].items():
            family.samples.append(Sample(name, {"result": "miss", "reason": reason}, n))
        return family

    @staticmethod
    def _tiers(tiers: list[dict[str, Any]], tiering: dict[str, int]) -> Iterator[Metric]:
        for field, name, doc in (
            ("objects", "tierkv_tier_objects", "Chunks held by a tier"),
            ("bytes_used", "tierkv_tier_used_bytes", "Bytes held by a tier"),
            ("capacity", "tierkv_tier_capacity_bytes", "Capacity of a tier (0: unbounded)"),
        ):
            yield _labelled(
                GaugeMetricFamily, name, doc, "tier", {t["name"]: t[field] for t in tiers}
            )
        yield _labelled(
            CounterMetricFamily,
            "tierkv_tier_write_failures",
            "Chunks a tier failed to store",
            "tier",
            {t["name"]: t["write_failures"] for t in tiers},
        )
        failures = CounterMetricFamily(
            "tierkv_tier_load_failures",
            "Chunk loads that failed, by tier and reason (missing, corrupt, error)",
            labels=["tier", "reason"],
        )
        for t in tiers:
            for reason, n in sorted(t["load_failures"].items()):
                failures.add_metric([t["name"], reason], n)
        yield failures
        yield _gauge(
            "tierkv_write_behind_queued_chunks",
            "Chunks waiting to be written to the tiers",
            tiering["write_behind_queued"],
        )
        yield _counter(
            "tierkv_write_behind_dropped_chunks",
            "Chunks not written to the tiers because the write-behind queue was full",
            tiering["write_behind_dropped"],
        )
        yield _gauge(
            "tierkv_prefetches_inflight",
            "Prefetches from the tiers running now",
            tiering["prefetch_inflight"],
        )
        yield _labelled(
            CounterMetricFamily,
            "tierkv_prefetches",
            "Prefetches from the tiers: started, rejected (too many in flight), timed out",
            "outcome",
            {
                "started": tiering["prefetch_started"],
                "rejected": tiering["prefetch_rejected"],
                "timed_out": tiering["prefetch_timed_out"],
            },
        )

    @staticmethod
    def _cluster(cluster: dict[str, Any]) -> Iterator[Metric]:
        """Membership, directory and per-peer data-plane figures of the cluster node."""
        states: dict[str, int] = {}
        for member in cluster["members"]:
            states[member["state"]] = states.get(member["state"], 0) + 1
        yield _labelled(
            GaugeMetricFamily,
            "tierkv_cluster_members",
            "Cluster members this node knows, by state (self, alive, dead: recently lost)",
            "state",
            states,
        )
        directory = dict(cluster["directory"])
        # A ring node holds a shard of the directory; a server in controller mode holds
        # none, and its directory's figures include text and flags (mode, controller).
        yield _gauge(
            "tierkv_cluster_directory_entries",
            "Directory entries held by this node's shard (0 in controller mode)",
            directory.pop("entries", 0),
        )
        directory.pop("members", None)
        yield _labelled(
            CounterMetricFamily,
            "tierkv_cluster_directory_ops",
            "Directory operations (published/unpublished keys, resolves, owner round trips, "
            "entries handed off or re-published, rebalances, ...)",
            "op",
            {
                op: n
                for op, n in directory.items()
                if isinstance(n, int | float) and not isinstance(n, bool)
            },
        )
        yield _gauge(
            "tierkv_cluster_published_chunks",
            "Chunks of this node's pool published to the directory",
            cluster["published"],
        )
        yield _labelled(
            CounterMetricFamily,
            "tierkv_cluster_refused",
            "Cluster requests refused (wrong or missing shared secret, replayed, malformed)",
            "plane",
            {
                "control": cluster["control"]["refused"] + cluster["control"]["malformed"],
                "data": cluster["transport"]["refused_hellos"],
            },
        )
        counters = {
            name: CounterMetricFamily(
                f"tierkv_cluster_peer_{name}",
                f"Data-plane {name} per peer (received: fetched by this node; sent: served)",
                labels=["peer", "direction"],
            )
            for name in ("bytes", "chunks", "requests", "missing", "corrupt", "errors")
        }
        latency = GaugeMetricFamily(
            "tierkv_cluster_peer_request_seconds",
            "Data-plane request latency per peer, over the last 512 requests",
            labels=["peer", "direction", "quantile"],
        )
        for direction in ("received", "sent"):
            for peer, figures in cluster["transport"][direction].items():
                for name, family in counters.items():
                    family.add_metric([peer, direction], figures[name])
                for q, key in (("0.5", "latency_ms_p50"), ("0.99", "latency_ms_p99")):
                    if figures[key] is not None:
                        latency.add_metric([peer, direction, q], figures[key] / 1e3)
        yield from counters.values()
        yield latency
