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

import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tierkv import __version__, keys
from tierkv.allocator import Allocator
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
from tierkv.server.metrics import ServiceMetrics
from tierkv.server.quota_values import TIERS as QUOTA_TIERS
from tierkv.server.quotas import Quotas
from tierkv.server.registry import ClientRegistry
from tierkv.server.rpc import RpcServer, ensure_endpoint_free
from tierkv.server.service import CacheService
from tierkv.server.sessions import LookupSessions
from tierkv.server.status import StatusBuilder, status_document
from tierkv.server.tiering import LookupAccounting, NamespacedTier, Tiering, TierQuota
from tierkv.tenants import TenantIds
from tierkv.tiers.base import Tier
from tierkv.tiers.registry import create_tier

if TYPE_CHECKING:  # the HTTP stack (FastAPI, uvicorn: half a second) loads with HTTP on
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
    feed: ChunkFeed
    metrics: ServiceMetrics
    tier_quotas: list[TierQuota]

    def __init__(self, cfg: ServerConfig, tiers: Sequence[Tier] | None = None) -> None:
        """``tiers``: tier objects to use instead of building ``cfg.tiers`` (tests); the
        server closes them with everything else."""
        self.cfg = cfg
        self._given_tiers = list(tiers) if tiers is not None else None
        self._stack: list[tuple[str, Callable[[], None]]] = []
        self._started = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop_rpc: Callable[[], None] = lambda: None  # the RPC loop's, once it exists
        self._pool_name = ""  # the pool's, once created

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
        # A second server for the same instance must not take the running one's segment
        # name (create() replaces a segment it finds): ask the endpoint before the pool.
        ensure_endpoint_free(self.cfg.rpc_endpoint)
        self._start_storage()  # the pool, the index, the chunk feed, quotas, eviction
        self._start_tiers()  # the media below the pool and their tenant quotas
        self._start_cluster()  # other servers' pools as the last tier (or none)
        self._start_service()  # data movement, sessions, clients, status, request handlers
        self._start_frontends()  # RPC for engines, HTTP (and its front) for people and routers
        self._announce()

    def _start_storage(self) -> None:
        """The pool: the shared-memory segment engines copy KV into and out of. The index:
        key -> slot, object states, leases with TTLs, LRU order, each slot charged to its
        tenant; what engines tell routers (the chunk feed, which the index announces noted
        chunks to); the tenants' quotas (the configuration's, then the live changes kept in
        the quota file). Eviction keeps the pool below its high watermark and expires
        overdue leases."""
        cfg = self.cfg
        self.pool = ShmPool.create(cfg.resolved_pool_name, cfg.pool_size, prefault=cfg.prefault)
        self._started_part("pool", self.pool.close)
        self._pool_name = self.pool.name
        self.tenants = TenantIds()
        self.index = ObjectIndex(
            Allocator(self.pool.size, cfg.alignment), cfg.write_ttl, cfg.read_ttl,
            tenants=self.tenants,
        )  # fmt: skip
        self.feed = ChunkFeed(cfg.chunk_feed_events)
        self.index.on_stored = self.feed.stored
        self.index.on_removed = self.feed.removed
        self.index.notes_of = self.feed.notes_of
        self.quotas = Quotas(
            self.index,
            self.tenants,
            limits={"pool": cfg.quotas, "disk": cfg.disk_quotas},
            defaults={"pool": cfg.default_quota_bytes, "disk": cfg.default_disk_quota_bytes},
            mode=cfg.quota_mode,
            path=cfg.resolved_quota_file,
        )
        self.quotas.load()
        self.eviction = Evictor(
            self.index, cfg.high_watermark, cfg.low_watermark, cfg.eviction_interval
        )
        self.metrics = ServiceMetrics(self.eviction)
        self.eviction.start()
        self._started_part("eviction", self.eviction.stop)

    def _start_tiers(self) -> None:
        """The tiers below the pool, in lookup order (media only: they move no data by
        themselves), and the tenant quotas of those that keep their usage per namespace
        (the disk): the policy is the server's, the tier only counts and evicts when told."""
        self.tiers = []
        self._started_part("tiers", self._close_tiers)
        self.tiers.extend(self._given_tiers if self._given_tiers is not None else _build(self.cfg))
        self.tier_quotas = [
            TierQuota(t, self.tenants)
            for t in self.tiers
            if isinstance(t, NamespacedTier) and t.name in QUOTA_TIERS
        ]
        for quota in self.tier_quotas:
            self.quotas.attach(quota)

    def _start_cluster(self) -> None:
        """The cluster node (with cluster seeds or a controller): other servers' pools as
        the last tier (the peer tier), this pool's chunks published to them. It is hooked
        up to the rest once the service exists (:meth:`_start_service`)."""
        cfg = self.cfg
        self.cluster = None
        if cfg.cluster_seeds or cfg.controller:
            disk = next((t for t in self.tiers if t.name == "disk"), None)
            node = ClusterNode(ClusterSettings.from_config(cfg), self.index, self.pool, disk)
            self._started_part("cluster", node.close)
            node.start()
            self.cluster = node

    def _start_service(self) -> None:
        """Write-behind (committed chunks -> tiers) and prefetch (tiers -> pool on lookup);
        lookup sessions, registered clients, the one status snapshot every surface shows,
        and the request handlers; the cluster node hooked up to them."""
        cfg, cluster = self.cfg, self.cluster
        peer = [cluster.tier] if cluster is not None else []
        lookups = LookupAccounting(self.metrics, self.index)
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
            quotas=self.tier_quotas,
        )
        self._started_part("tiering", self.tiering.close)
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
        self.status = StatusBuilder(
            cfg=cfg,
            pool=self.pool,
            index=self.index,
            registry=self.registry,
            sessions=self.sessions,
            metrics=self.metrics,
            tiering=self.tiering,
            cluster=cluster.stats if cluster is not None else None,
            quotas=self.quotas,
            feed=self.feed_figures,
            connections=self._connection_figures,
        )
        self.service = CacheService(
            cfg=cfg,
            pool=self.pool,
            index=self.index,
            eviction=self.eviction,
            tiering=self.tiering,
            registry=self.registry,
            sessions=self.sessions,
            metrics=self.metrics,
            snapshot=self.status.snapshot,
            feed=self.feed,
        )
        # Engine requests in flight make the work for routers wait (engine_first).
        self.engines = EngineFirst()
        if cluster is not None:
            cluster.hook_up(
                namespaces=self.registry.namespaces,
                namespace_listeners=self.registry.on_change,
                add_eviction_listener=self.eviction.add_listener,
                removal_listeners=self.service.removed_listeners,
                publish_commits=self.service.publish_commits,
                commit_publish_timeout=cfg.commit_publish_timeout,
                serve_router_lookups=self.service.serve_router_lookups,
                between=self.engines.wait_turn,
            )
        self.metrics.registry.register(StatsCollector(self.document))
        self.metrics.registry.register(GcPauseCollector())

    def _start_frontends(self) -> None:
        """RPC: the engines' endpoint (framed msgpack on a Unix or TCP socket; ipc is 0600).
        HTTP: health, status, metrics, the dashboard, admin requests; served by a front
        process that answers routers' lookups over RPC (:mod:`tierkv.server.front`)."""
        cfg = self.cfg
        self.rpc = RpcServer(self.service, cfg.rpc_endpoint, self.engines)
        self._started_part("rpc", self.rpc.close)
        self._stop_rpc = self.rpc.stop
        self.rpc.start()
        self.http = None
        if not cfg.http_port:
            return
        from tierkv.server.http import create_app
        from tierkv.web.serving import HttpServer

        app = create_app(
            self.service,
            self.document,
            Health(self.rpc, self.eviction).checks,
            cfg.auth_token,
            self.quotas,
            self.engines.wait_turn,
        )
        front = FrontSettings(
            core_socket=os.path.join(cfg.resolved_runtime_dir, "http.sock"),
            rpc_endpoint=self.endpoint if self.cluster is not None else "",
            auth_token=cfg.auth_token,
            log_level=cfg.log_level,
            log_format=cfg.log_format,
        )
        http = HttpServer(cfg, app, front.core_socket, lambda sock: FrontProcess(sock, front))
        self._started_part("http", http.stop)
        http.start()
        self.http = http

    def _announce(self) -> None:
        log.info(
            "tierkv %s serving %s; pool %s of %s (chunk size %d tokens)",
            __version__,
            self.endpoint,
            self.pool.name,
            format_bytes(self.pool.size),
            self.cfg.chunk_size,
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

    def _connection_figures(self) -> dict[str, int]:
        rpc = getattr(self, "rpc", None)
        return rpc.connection_figures() if rpc is not None else {}

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
        self._stop_rpc()
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
        if stopped and self._pool_name:
            log.info("tierkv server stopped; pool %s removed", self._pool_name)

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
