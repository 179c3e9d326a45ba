"""What a tierkv server consists of, built and started in one place, stopped in reverse.

:meth:`Server.start` is the whole server in the order of the data path. An engine process
copies KV into and out of the *pool* (a shared-memory segment) and tells the server what it
did over *RPC*; the RPC loop hands each request to the *service* (the handlers), which
keeps chunks in the *index* (key -> slot, states, leases, LRU) with *eviction* keeping the
pool below its watermark; committed chunks go on to the *tiers* through the
*write-behind*, and a lookup brings them back through the *prefetch*; the *cluster node*
makes other servers' pools one more tier (the peer tier) and publishes this pool's chunks
to them. *HTTP* shows the *status* all of this adds up to.

Constructors only build: every thread and every listener starts in a ``start()`` called
from here, and each part that started is pushed on a stack of stop actions. If any step
fails (a port in use, a tier that cannot connect), everything already started is stopped in
reverse order, the pool segment is removed, and the error propagates: ``tierkv server``
prints it as one line. :meth:`Server.close` runs the same stack after a normal shutdown.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Sequence

from tierkv import __version__, keys
from tierkv.allocator import Allocator
from tierkv.cluster import controller_messages as cm
from tierkv.cluster.node import ClusterNode, ClusterSettings
from tierkv.config import ServerConfig
from tierkv.eviction import Evictor
from tierkv.gc_pauses import GcPauseCollector
from tierkv.index import ObjectIndex
from tierkv.pool import ShmPool, format_bytes
from tierkv.server.chunk_feed import ChunkFeed
from tierkv.server.collector import StatsCollector
from tierkv.server.engine_first import EngineFirst
from tierkv.server.front_process import FrontProcess, FrontSettings
from tierkv.server.health import Health
from tierkv.server.http import create_app
from tierkv.server.metrics import ServiceMetrics
from tierkv.server.quotas import TIERS as QUOTA_TIERS
from tierkv.server.quotas import Quotas
from tierkv.server.registry import ClientRegistry
from tierkv.server.rpc import RpcServer, ensure_endpoint_free
from tierkv.server.service import CacheService
from tierkv.server.sessions import LookupSessions
from tierkv.server.status import StatusBuilder, status_document
from tierkv.server.tiering import LookupAccounting, NamespacedTier, Tiering, TierQuota
from tierkv.tenants import TenantIds
from tierkv.tiers.base import Tier, create_tier
from tierkv.web.serving import HttpServer

log = logging.getLogger(__name__)


class Server:
    """One tierkv server. :meth:`serve` runs it on this thread until :meth:`stop`;
    :meth:`start_background` runs it on a thread (tests, the demo); as a context manager it
    is stopped on exit."""

    pool: ShmPool
    tenants: TenantIds
    index: ObjectIndex
    quotas: Quotas
    eviction: Evictor
    tiers: list[Tier]
    cluster: ClusterNode | None
    tiering: Tiering
    sessions: LookupSessions
    registry: ClientRegistry
    status: StatusBuilder
    service: CacheService
    engines: EngineFirst
    rpc: RpcServer
    http: HttpServer | None

    def __init__(self, cfg: ServerConfig, tiers: Sequence[Tier] | None = None) -> None:
        """``tiers``: tier objects to use instead of building ``cfg.tiers`` (tests); the
        server closes them with everything else."""
        self.cfg = cfg
        self._given_tiers = list(tiers) if tiers is not None else None
        self._stack: list[tuple[str, Callable[[], None]]] = []
        self._started = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return self.cfg.rpc_endpoint

    def _started_part(self, name: str, stop: Callable[[], None]) -> None:
        self._stack.append((name, stop))

    # -- start -----------------------------------------------------------------------------
    def start(self) -> Server:
        """Build and start every part, in data-path order. On failure, stop what started."""
        if self._started:
            return self
        self._started = True
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        cfg = self.cfg
        # A second server for the same instance must not take the running one's segment
        # name (create() replaces a segment it finds): ask the endpoint before the pool.
        ensure_endpoint_free(cfg.rpc_endpoint)

        # The pool: the shared-memory segment engines copy KV into and out of.
        self.pool = ShmPool.create(cfg.resolved_pool_name, cfg.pool_size, prefault=cfg.prefault)
        self._started_part("pool", self.pool.close)

        # The index: key -> slot, object states, leases with TTLs, LRU order, each slot
        # charged to its tenant; the tenants' quotas (the configuration's, then the live
        # changes kept in the quota file).
        self.tenants = TenantIds()
        self.index = ObjectIndex(
            Allocator(self.pool.size, cfg.alignment),
            cfg.write_ttl,
            cfg.read_ttl,
            tenants=self.tenants,
        )
        # What engines tell routers (KV events): the index announces noted chunks to it.
        self.feed = ChunkFeed(cfg.chunk_feed_events)
        self.index.on_stored = self.feed.stored
        self.index.on_removed = self.feed.removed
        self.quotas = Quotas(
            self.index,
            self.tenants,
            limits={"pool": cfg.quotas, "disk": cfg.disk_quotas},
            defaults={"pool": cfg.default_quota_bytes, "disk": cfg.default_disk_quota_bytes},
            mode=cfg.quota_mode,
            path=cfg.resolved_quota_file,
        )
        self.quotas.load()

        # Eviction: keeps the pool below its high watermark, expires overdue leases.
        self.eviction = Evictor(
            self.index, cfg.high_watermark, cfg.low_watermark, cfg.eviction_interval
        )
        metrics = ServiceMetrics(self.eviction)
        lookups = LookupAccounting(metrics, self.index)
        self.eviction.start()
        self._started_part("eviction", self.eviction.stop)

        # The tiers below the pool, in lookup order (media only: they move no data by
        # themselves).
        self.tiers = []
        self._started_part("tiers", self._close_tiers)
        self.tiers.extend(self._given_tiers if self._given_tiers is not None else _build(cfg))
        # Tenant quotas of the tiers that keep their usage per namespace (the disk): the
        # policy is the server's, the tier only counts and evicts when told.
        tier_quotas = [
            TierQuota(t, self.tenants)
            for t in self.tiers
            if isinstance(t, NamespacedTier) and t.name in QUOTA_TIERS
        ]
        for quota in tier_quotas:
            self.quotas.attach(quota)

        # The cluster node: other servers' pools as the last tier (the peer tier), this
        # pool's chunks published to them, evicted or cleared ones withdrawn.
        self.cluster = None
        if cfg.cluster_seeds or cfg.controller:
            disk = next((t for t in self.tiers if t.name == "disk"), None)
            node = ClusterNode(ClusterSettings.from_config(cfg), self.index, self.pool, disk)
            self._started_part("cluster", node.close)
            node.start()
            self.cluster = node
            self.eviction.add_listener(node.on_evicted)
        peer = [self.cluster.tier] if self.cluster is not None else []

        # Write-behind (committed chunks -> tiers) and prefetch (tiers -> pool on lookup).
        self.tiering = Tiering(
            self.index,
            self.pool,
            [*self.tiers, *peer],
            lookups,
            workers=cfg.tier_workers,
            write_behind_max_bytes=cfg.write_behind_max_bytes,
            prefetch_max_inflight=cfg.prefetch_max_inflight,
            prefetch_timeout=cfg.prefetch_timeout,
            write_first=peer,
            wake_eviction=self.eviction.wake_if_needed,
            quotas=tier_quotas,
        )
        self._started_part("tiering", self.tiering.close)

        # The service: lookup sessions, registered clients, the request handlers, and the
        # one status snapshot every surface shows.
        self.sessions = LookupSessions(
            self.index, self.tiering, lookups, self.index.clock, cfg.session_ttl
        )
        self.registry = ClientRegistry(
            self.index,
            self.sessions,
            self.index.clock,
            idle_ttl=cfg.client_idle_ttl,
            max_clients=cfg.max_clients,
        )
        cluster = self.cluster
        self.status = StatusBuilder(
            cfg,
            self.pool,
            self.index,
            self.registry,
            self.sessions,
            metrics,
            self.tiering,
            cluster.stats if cluster is not None else None,
            self.quotas,
            feed=self.feed_figures,
        )
        self.service = CacheService(
            cfg,
            self.pool,
            self.index,
            self.eviction,
            self.tiering,
            self.registry,
            self.sessions,
            metrics,
            self.status.snapshot,
            feed=self.feed,
        )
        if cluster is not None:
            registry = self.registry
            cluster.serve_namespaces(
                lambda: [cm.NamespaceInfo(*ns) for ns in registry.namespaces()]
            )
            registry.on_change.append(cluster.namespaces_changed)
            self.service.removed_listeners.append(cluster.on_removed)
            if cfg.commit_publish_timeout > 0:
                self.service.publish_commits(cluster, cfg.commit_publish_timeout)
        metrics.registry.register(StatsCollector(self.document))
        metrics.registry.register(GcPauseCollector())

        # RPC: the engines' endpoint (framed msgpack on a Unix or TCP socket; ipc is 0600).
        # Engine requests in flight there make HTTP work for routers wait (engine_first).
        self.engines = EngineFirst()
        self.rpc = RpcServer(self.service, cfg.rpc_endpoint, self.engines)
        self._started_part("rpc", self.rpc.close)
        self.rpc.start()

        # HTTP: health, status, metrics, the dashboard, admin requests; served by a front
        # process that answers routers' lookups over RPC (tierkv.server.front).
        self.http = None
        if cluster is not None:
            self.service.serve_router_lookups(
                functools.partial(cluster.router_lookup, between=self.engines.wait_turn)
            )
        if cfg.http_port:
            health = Health(self.rpc, self.eviction)
            app = create_app(
                self.service,
                self.document,
                health.checks,
                cfg.auth_token,
                self.quotas,
                self.engines.wait_turn,
            )
            front = FrontSettings(
                core_socket=os.path.join(cfg.resolved_runtime_dir, "http.sock"),
                rpc_endpoint=self.endpoint if cluster is not None else "",
                auth_token=cfg.auth_token,
                log_level=cfg.log_level,
                log_format=cfg.log_format,
            )
            http = HttpServer(cfg, app, front.core_socket, lambda sock: FrontProcess(sock, front))
            self._started_part("http", http.stop)
            http.start()
            self.http = http
        log.info(
            "tierkv %s serving %s; pool %s of %s (chunk size %d tokens)",
            __version__,
            self.endpoint,
            self.pool.name,
            format_bytes(self.pool.size),
            cfg.chunk_size,
        )
        if not keys.NATIVE_CHAIN:
            log.warning(
                "tierkv._keychain is not built (tierkv was installed without a C compiler or "
                "OpenSSL's headers): token ids are hashed in Python, about 1.6x slower; "
                "reinstall tierkv where they are present"
            )

    def feed_figures(self) -> dict[str, int]:
        """The chunk feed's figures, with the snapshots being read (status, metrics)."""
        return {**self.feed.figures(), "open_snapshots": len(self.service.snapshot_pages)}

    def document(self) -> dict[str, object]:
        """The status document (GET /status, the dashboard, Prometheus)."""
        return status_document(self.status.snapshot(), self.cfg)

    def _close_tiers(self) -> None:
        for tier in reversed(self.tiers):
            try:
                tier.close()
            except Exception:
                log.exception("closing tier %s failed", tier.name)

    # -- run and stop ----------------------------------------------------------------------
    def serve(self) -> None:
        """Start (if not yet) and serve on this thread until :meth:`stop`; then close."""
        try:
            self.start()
            if not self._stop.is_set():
                self.rpc.serve_forever()
        finally:
            self.close()

    def start_background(self) -> Server:
        """Start here (errors raise here), then serve on a thread."""
        self.start()
        self._thread = threading.Thread(target=self.serve, name="tierkv-server", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        """Ask the RPC loop to finish (safe from signal handlers and other threads); with a
        background thread, wait for the server to close."""
        self._stop.set()
        rpc = getattr(self, "rpc", None)
        if rpc is not None:
            rpc.stop()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def close(self) -> None:
        """Stop every part that started, in reverse order (once)."""
        stopped = bool(self._stack)
        while self._stack:
            name, stop = self._stack.pop()
            try:
                stop()
            except Exception:
                log.exception("stopping %s failed", name)
        if stopped and hasattr(self, "pool"):
            log.info("tierkv server stopped; pool %s removed", self.pool.name)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.close()


def _build(cfg: ServerConfig) -> list[Tier]:
    """The configured tiers, created (connected, opened) in lookup order; on failure the
    ones already created are closed."""
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
    return tiers
