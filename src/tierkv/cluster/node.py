"""One server's place in the cluster: control server, membership, directory, data plane and
the peer tier, wired over the server's pool and index.

The node is also the data plane's :class:`~tierkv.cluster.transport.ChunkSource`: a fetch
read-locks the requested chunks in the index (only committed chunks can be named; a chunk
on this node's disk tier is promoted into the pool first) and hands out read-only views of
their slots with the checksums recorded when they were published. Keys it no longer has at
all are withdrawn from the directory on the spot, so stale entries heal when used.

Publishing: the write-behind gives the peer tier every committed engine chunk (pinned in the
pool meanwhile), the node records each chunk's checksum and queues the keys for the
directory; chunks fetched from peers are published right after their commit, with the
checksums verified on arrival. Eviction
withdraws a chunk's entry, or marks it "on disk" when the node's disk tier has it.
"""

from __future__ import annotations

import functools
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tierkv import protocol as p
from tierkv.checksums import checksum
from tierkv.cluster import controller_messages as cm
from tierkv.cluster import messages as m
from tierkv.cluster import router_lookup
from tierkv.cluster.control import ControlClient
from tierkv.cluster.control_server import ControlServer
from tierkv.cluster.controller_directory import ControllerDirectory
from tierkv.cluster.directory import Where
from tierkv.cluster.membership import Membership
from tierkv.cluster.peer_tier import PeerTier
from tierkv.cluster.ring_directory import RingDirectory
from tierkv.cluster.transport import Served, TcpTransport
from tierkv.config import ServerConfig
from tierkv.index import Evicted, Holder, LeaseNotFound, ObjectIndex
from tierkv.keys import DIGEST_SIZE
from tierkv.pool import ShmPool
from tierkv.tiers.base import LoadStatus, Tier

log = logging.getLogger(__name__)

# How long a server remembers a namespace after its last engine left when it holds none of
# its chunks (seconds): a router's lookup by model on it keeps answering across short engine
# restarts and the membership changes that prune what is not held.
KNOWN_NAMESPACE_GRACE = 300.0


@dataclass(frozen=True)
class ClusterSettings:
    """The cluster part of a server's configuration (:class:`tierkv.config.ServerConfig`,
    where the defaults and help of each live), under the names the cluster code uses."""

    seeds: tuple[str, ...]
    controller: str  # HOST:PORT of a `tierkv controller`: controller mode instead of the ring
    host: str
    port: int
    data_port: int  # 0: port + 1
    advertise: str
    token: str
    heartbeat_interval: float
    member_ttl: float
    replicas: int
    vnodes: int
    connections: int
    timeout: float
    repair_interval: float = 5.0
    transport: str = "tcp"  # or "nixl"
    lease_ttl: float = 10.0

    @property
    def advertise_host(self) -> str:
        if self.advertise:
            return self.advertise
        if self.host not in ("0.0.0.0", "::", ""):
            return self.host
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return socket.gethostname()

    @classmethod
    def from_config(cls, cfg: ServerConfig) -> ClusterSettings:
        """From a :class:`tierkv.config.ServerConfig`."""
        seeds = tuple(s.strip() for s in str(cfg.cluster_seeds).split(",") if s.strip())
        return cls(
            seeds=seeds,
            controller=cfg.controller,
            host=cfg.cluster_host,
            port=cfg.cluster_port,
            data_port=cfg.cluster_data_port,
            advertise=cfg.cluster_advertise,
            token=cfg.auth_token,
            heartbeat_interval=cfg.heartbeat_interval,
            member_ttl=cfg.member_ttl,
            replicas=cfg.directory_replicas,
            vnodes=cfg.ring_vnodes,
            connections=cfg.peer_connections,
            timeout=cfg.peer_timeout,
            repair_interval=cfg.directory_repair_interval,
            transport=cfg.peer_transport,
            lease_ttl=cfg.peer_lease_ttl,
        )


class ClusterNode:
    """Everything cluster-related of one server. Build (opens nothing), :meth:`start` (binds
    the control and data ports, learns this node's id, starts the threads), :meth:`close`.

    The membership, directory and peer tier exist from :meth:`start` on: a node is named by
    the address of its control socket, which is known only once it is bound."""

    membership: Membership | None  # None in controller mode
    directory: RingDirectory | ControllerDirectory
    tier: PeerTier
    me: m.MemberInfo

    def __init__(
        self,
        settings: ClusterSettings,
        index: ObjectIndex,
        pool: ShmPool,
        disk: Tier | None = None,
    ) -> None:
        """``disk``: this node's disk tier, if it has one (chunks evicted to it stay
        available to peers, promoted back into the pool when one asks)."""
        self.settings = settings
        self.index = index
        self.pool = pool
        self.disk = disk
        self.client = ControlClient(settings.token, settings.timeout)
        self.control = ControlServer(settings.host, settings.port, settings.token, {})
        self.transport = self._transport(settings, index, pool)
        self.node_id = ""
        self._lock = threading.Lock()
        self._published: dict[bytes, tuple[bytes, int]] = {}  # key -> (checksum, length)
        self._on_disk: set[bytes] = set()
        self._engines: Callable[[], list[cm.NamespaceInfo]] = list
        # The namespaces of this server's engines, those that left included, kept while this
        # node holds chunks of them or for KNOWN_NAMESPACE_GRACE after their last engine left
        # (pruned when :meth:`_held` lists what it holds), oldest first: a router's lookup by
        # model still finds the chunks of an engine gone. ``_left_at``: when the last engine
        # of each known namespace not named now left (monotonic).
        self._known_namespaces: dict[bytes, cm.NamespaceInfo] = {}
        self._left_at: dict[bytes, float] = {}
        self.clock: Callable[[], float] = time.monotonic
        self.promoted = 0
        self.stale_withdrawn = 0
        self._started = False
        self._closed = False
        self.membership = None  # ring mode: set when it joins
        self._joined = False  # a directory exists (to close)

    @staticmethod
    def _transport(settings: ClusterSettings, index: ObjectIndex, pool: ShmPool) -> TcpTransport:
        """The data plane the settings choose (NIXL imported only when chosen)."""
        host, port, token = settings.host, settings.data_port, settings.token
        advertise, timeout = settings.advertise_host, max(settings.timeout, 1.0)
        # A fetch's slots stay reserved for the index's write TTL: its streams end well before.
        limit = index.write_ttl / 2
        if settings.transport != "nixl":
            return TcpTransport(
                host,
                port,
                advertise,
                token,
                "",
                settings.connections,
                timeout=timeout,
                transfer_limit=limit,
            )
        from tierkv.cluster.nixl_transport import NixlTransport

        # A lease must end before the index's own read locks could expire under it.
        return NixlTransport(
            host,
            port,
            advertise,
            token,
            "",
            region=pool.buf,
            fence=index,
            lease_ttl=min(settings.lease_ttl, index.read_ttl / 2),
            connections_per_peer=settings.connections,
            timeout=timeout,
            transfer_limit=limit,
        )

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> ClusterNode:
        """Bind, join the cluster, serve. On failure everything opened so far is closed."""
        self._started = True
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        settings = self.settings
        self.control.bind()
        self.node_id = f"{settings.advertise_host}:{self.control.port}"
        if not settings.data_port and settings.port:
            self.transport.port = self.control.port + 1  # the default: next to control
        self.transport.bind(self.node_id)
        self.me = m.MemberInfo(self.node_id, self.node_id, self.transport.address, time.time_ns())
        self.control.handlers[m.GetStatus] = lambda req: m.NodeStatus(req.rid, self.stats())
        if settings.controller:
            self.membership = None
            directory = ControllerDirectory(
                settings.controller,
                self.me,
                settings.token,
                settings.timeout,
                self._held,
                self.namespaces,
                interval=settings.heartbeat_interval,
            )
            self.directory = directory
            self.tier = PeerTier(self.node_id, directory, directory, self.transport, self, self)
        else:
            self._join_ring()
        self._joined = True
        self.control.start()
        self.transport.serve(self)
        self.directory.start()
        if self.membership is not None:
            self.membership.start()
        log.info(
            "cluster node %s: control %s, data %s, seeds %s",
            self.node_id,
            self.me.control,
            self.me.data,
            ",".join(settings.seeds) or f"controller {settings.controller}",
        )

    def _join_ring(self) -> None:
        """Ring mode: membership among the servers, the consistent-hash directory."""
        settings = self.settings
        membership = Membership(
            self.me,
            settings.seeds,
            self.client,
            settings.heartbeat_interval,
            settings.member_ttl,
        )
        directory = RingDirectory(
            membership,
            self.client,
            self._held,
            settings.replicas,
            settings.vnodes,
            settle=2 * settings.heartbeat_interval,
            repair_interval=settings.repair_interval,
            claimed=self._claimed,
        )
        self.membership, self.directory = membership, directory
        membership.add_listener(self._membership_changed)
        self.tier = PeerTier(
            self.node_id, directory, membership, self.transport, publisher=self, health=self
        )
        self.control.handlers.update(
            {
                m.Heartbeat: membership.on_heartbeat,
                m.Leave: membership.on_leave,
                m.GetMembers: membership.on_get_members,
                m.Publish: directory.on_publish,
                m.Unpublish: directory.on_unpublish,
                m.Handoff: directory.on_handoff,
                m.Resolve: directory.on_resolve,
                m.Digest: directory.on_digest,
            }
        )

    def close(self) -> None:
        if self._closed or not self._started:
            self._closed = True
            return
        self._closed = True
        joined, membership = self._joined, self.membership
        # Stop answering first, so no peer sees this node alive again after its LEAVE.
        if membership is not None:
            membership.close(leave=False)
        self.control.close()
        if membership is not None:
            membership.leave()
        if joined:
            self.directory.close()
        self.transport.close()
        self.client.close()

    def _membership_changed(
        self, old: dict[str, m.MemberInfo], new: dict[str, m.MemberInfo]
    ) -> None:
        for nid, info in old.items():
            if nid != self.node_id and new.get(nid) != info:
                self.transport.forget(info)

    # -- holders that failed (the peer tier's Health) --------------------------------------
    def holder_suspect(self, node_id: str) -> bool:
        """Whether a holder timed out (a fetch, or a control call) and has not answered
        since: lookups leave it out until it answers a probe."""
        info = self.tier.membership.get(node_id)
        return info is not None and self.client.suspect(info.control)

    def holder_failed(self, node_id: str) -> None:
        """A fetch from this holder failed outright: suspect until it answers a probe."""
        info = self.tier.membership.get(node_id)
        if info is not None:
            self.client.mark_suspect(info.control)

    # -- the server it serves ----------------------------------------------------------------
    def hook_up(
        self,
        *,
        namespaces: Callable[[], list[tuple[bytes, str, int, int, int]]],
        namespace_listeners: list[Callable[[], None]],
        add_eviction_listener: Callable[[Callable[[Sequence[Evicted]], None]], None],
        removal_listeners: list[Callable[[list[bytes]], None]],
        publish_commits: Callable[[ClusterNode, float], None],
        commit_publish_timeout: float,
        serve_router_lookups: Callable[[Callable[[p.RouterQuery], dict[str, object]]], None],
        between: Callable[[], None],
    ) -> None:
        """Everything that ties this node to its server, in one call: the namespaces of the
        server's engines (``namespaces()``: digest, model, tokens per chunk, world size,
        rank) told to the cluster now and whenever ``namespace_listeners`` fire; evicted
        and removed chunks withdrawn from the directory; commits that wait for the
        directory (``publish_commits``, when ``commit_publish_timeout`` > 0:
        read-your-writes); routers' lookups answered through this node's directory, with
        ``between`` (the engines-first check point) between their steps."""
        self.serve_namespaces(lambda: [cm.NamespaceInfo(*ns) for ns in namespaces()])
        namespace_listeners.append(self.namespaces_changed)
        add_eviction_listener(self.on_evicted)
        removal_listeners.append(self.on_removed)
        if commit_publish_timeout > 0:
            publish_commits(self, commit_publish_timeout)
        serve_router_lookups(functools.partial(self.router_lookup, between=between))

    # -- the engines' namespaces -----------------------------------------------------------
    def serve_namespaces(self, source: Callable[[], list[cm.NamespaceInfo]]) -> None:
        """Where the namespaces of this server's engines come from (the registry); the
        controller is told now and whenever :meth:`namespaces_changed` is called."""
        self._engines = source
        self.namespaces_changed()

    def namespaces(self) -> list[cm.NamespaceInfo]:
        return self._engines()

    def namespaces_changed(self) -> None:
        current = self._engines()
        named = {ns.digest for ns in current}
        now = self.clock()
        with self._lock:
            known, left_at = self._known_namespaces, self._left_at
            for digest in known:
                if digest not in named:
                    left_at.setdefault(digest, now)
            for ns in current:
                known.pop(ns.digest, None)
                known[ns.digest] = ns
                left_at.pop(ns.digest, None)
            while len(known) > cm.MAX_NAMESPACES:
                oldest = next(iter(known))
                del known[oldest]
                left_at.pop(oldest, None)
        self.directory.namespaces_changed()

    def router_lookup(
        self, query: p.RouterQuery, between: Callable[[], None] = lambda: None
    ) -> dict[str, object]:
        """``POST /lookup`` (:mod:`tierkv.cluster.router_lookup`) through this server's
        directory: the same answer, in ring or controller mode, as the controller's. The
        namespaces are those of the engines registered here and of those gone whose chunks
        this node still holds. ``between``: the check point between its steps (the
        server's :mod:`tierkv.server.engine_first` gate)."""
        members = self.tier.membership

        def address(node_id: str) -> str | None:
            info = members.get(node_id)
            return info.data if info is not None else None

        namespaces = self.namespaces()
        named = {ns.digest for ns in namespaces}
        with self._lock:
            namespaces += [ns for d, ns in self._known_namespaces.items() if d not in named]
        return router_lookup.answer_query(
            query,
            namespaces,
            lambda ks: router_lookup.from_locations(self.directory.resolve(ks)),
            address,
            between,
        )

    # -- publishing this node's chunks -----------------------------------------------------
    def publish_local(self, items: Sequence[tuple[bytes, memoryview]]) -> None:
        """Record checksums of committed chunks (views of pinned slots) and publish them."""
        self.publish_known([(key, checksum(view), len(view)) for key, view in items])

    def publish_known(self, sums: Sequence[tuple[bytes, bytes, int]]) -> int:
        """Publish committed chunks whose (key, checksum, length) are known: chunks just
        fetched from a peer, verified on arrival, need no second pass over their bytes.
        Recorded first, then checked against the pool: a chunk evicted meanwhile is either
        withdrawn by the eviction listener or dropped here, never published stale.

        A checksum of ``b""`` means not computed yet (:meth:`publish_committed`): a fetch
        computes it from the slot. Chunks already published only get their checksum filled
        in. Returns the directory's ticket for :meth:`wait_published`."""
        if not sums:
            return 0
        fresh: list[bytes] = []
        with self._lock:
            for key, digest, length in sums:
                known = self._published.get(key)
                if known is None or known[1] != length:
                    fresh.append(key)
                if known is None or digest or known[1] != length:
                    self._published[key] = (digest, length)
                self._on_disk.discard(key)
        present = self.index.contains(fresh)
        gone = [key for key, has in zip(fresh, present, strict=True) if not has]
        if gone:
            with self._lock:
                for key in gone:
                    self._published.pop(key, None)
        return self.directory.publish(
            [k for k, has in zip(fresh, present, strict=True) if has], Where.POOL
        )

    def publish_committed(self, keys: Sequence[bytes], lengths: Sequence[int]) -> int:
        """Publish chunks an engine has just committed, before their checksums are known
        (the write-behind computes them off the request path; a fetch that comes first
        computes its own): what a COMMIT that waits for the directory sends."""
        return self.publish_known([(k, b"", n) for k, n in zip(keys, lengths, strict=True)])

    def wait_published(self, ticket: int, timeout: float) -> bool:
        """Wait until the publishes up to ``ticket`` reached the directory's owners."""
        return self.directory.wait_published(ticket, timeout)

    def withdraw(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            gone = [k for k in keys if self._published.pop(k, None) is not None]
            gone += [k for k in keys if k in self._on_disk]
            self._on_disk.difference_update(keys)
        self.directory.unpublish(gone)
        return len(gone)

    def on_evicted(self, batch: Sequence[Evicted]) -> None:
        """Eviction listener: see :meth:`on_removed`."""
        self.on_removed([e.key for e in batch])

    def on_removed(self, removed: Sequence[bytes]) -> None:
        """Chunks left the pool (evicted, cleared): withdraw them from the directory, or mark
        them as on this node's disk when its disk tier has them."""
        with self._lock:
            keys = [k for k in removed if self._published.pop(k, None) is not None]
        if not keys:
            return
        on_disk = self._disk_has(keys)
        disk_keys = [k for k, has in zip(keys, on_disk, strict=True) if has]
        gone = [k for k, has in zip(keys, on_disk, strict=True) if not has]
        with self._lock:
            self._on_disk.update(disk_keys)
        self.directory.publish(disk_keys, Where.DISK)
        self.directory.unpublish(gone)

    def _disk_has(self, keys: Sequence[bytes]) -> list[bool]:
        if self.disk is None or not keys:
            return [False] * len(keys)
        try:
            return self.disk.contains(keys)
        except Exception:
            log.exception("disk tier contains failed")
            return [False] * len(keys)

    def _held(self) -> list[tuple[bytes, Where]]:
        """What this node holds now (for re-publishing after a membership change)."""
        with self._lock:
            pool_keys = list(self._published)
            disk_keys = list(self._on_disk)
        present = self.index.contains(pool_keys)
        out = [(k, Where.POOL) for k, has in zip(pool_keys, present, strict=True) if has]
        on_disk = self._disk_has(disk_keys)
        out += [(k, Where.DISK) for k, has in zip(disk_keys, on_disk, strict=True) if has]
        stale = [k for k, has in zip(pool_keys, present, strict=True) if not has]
        named = {ns.digest for ns in self._engines()}
        held = named | {k[:DIGEST_SIZE] for k, _ in out}
        forget_before = self.clock() - KNOWN_NAMESPACE_GRACE
        with self._lock:
            for k in stale:  # deleted or cleared without an eviction: forget them
                self._published.pop(k, None)
            left_at = self._left_at
            for digest in [d for d in self._known_namespaces if d not in held]:
                if left_at.get(digest, forget_before) <= forget_before:
                    # its engines gone a while, none of its chunks here
                    del self._known_namespaces[digest]
                    left_at.pop(digest, None)
        return out

    def _claimed(self) -> list[tuple[bytes, Where]]:
        """What this node has published, as recorded (what its directory owners should
        list; compared with them by the directory's anti-entropy)."""
        with self._lock:
            out = [(k, Where.POOL) for k in self._published]
            out += [(k, Where.DISK) for k in self._on_disk]
        return out

    def published_usage(self) -> tuple[int, int]:
        with self._lock:
            return len(self._published), sum(n for _, n in self._published.values())

    # -- the data plane's chunk source -----------------------------------------------------
    def acquire(self, keys: Sequence[bytes], lengths: Sequence[int]) -> Served:
        present = self.index.contains(keys)
        absent = [i for i, has in enumerate(present) if not has]
        if absent:
            self._promote([keys[i] for i in absent], [lengths[i] for i in absent])
        lock = self.index.lock_read(keys, Holder.PEER_SERVE, prefix=False)
        views: list[memoryview | None] = [None] * len(keys)
        sums: list[bytes] = [b""] * len(keys)
        unknown: list[int] = []
        with self._lock:
            for i, offset, length in lock.slots:
                views[i] = self.pool.view(offset, length).toreadonly()
                rec = self._published.get(keys[i])
                if rec is not None and rec[0] and rec[1] == length:
                    sums[i] = rec[0]
                else:
                    unknown.append(i)
        for i in unknown:  # in the pool but never published here (e.g. fetched from a peer)
            view = views[i]
            assert view is not None
            sums[i] = checksum(view)
        if lock.missing:
            gone = lock.missing
            self._forget_missing([keys[i] for i in gone], [lengths[i] for i in gone])
        return Served(views, sums, lock.lease_id)

    def release(self, served: Served) -> None:
        served.views.clear()
        if served.handle:
            try:
                self.index.release_read(served.handle, Holder.PEER_SERVE)
            except LeaseNotFound:
                log.warning("a peer read outlived its read lock (read_ttl too short?)")

    def _promote(self, keys: list[bytes], lengths: list[int]) -> None:
        """Load chunks a peer wants from this node's disk tier into its pool."""
        if self.disk is None:
            return
        on_disk = self._disk_has(keys)
        want = [i for i, has in enumerate(on_disk) if has]
        if not want:
            return
        keys = [keys[i] for i in want]
        lengths = [lengths[i] for i in want]
        res = self.index.reserve_write(keys, lengths, Holder.PEER_PROMOTE, tier=self.disk.name)
        if not res.slots:
            return
        items = [(keys[i], self.pool.view(off, n)) for i, off, n in res.slots]
        try:
            statuses = self.disk.load(items)
        except Exception:
            log.exception("disk tier failed a promotion batch")
            statuses = [LoadStatus.ERROR] * len(items)
        if len(statuses) != len(items):
            statuses = [LoadStatus.ERROR] * len(items)
        good = [p for p, st in enumerate(statuses) if st is LoadStatus.OK]
        sums = [(items[p][0], checksum(items[p][1]), len(items[p][1])) for p in good]
        del items
        result = self.index.commit(res.lease_id, Holder.PEER_PROMOTE, good)
        committed = set(result.committed_keys)
        with self._lock:
            for key, digest, length in sums:
                if key in committed:
                    self._published[key] = (digest, length)
                    self._on_disk.discard(key)
        self.promoted += len(committed)
        self.directory.publish(list(committed), Where.POOL)

    def _forget_missing(self, keys: list[bytes], lengths: list[int]) -> None:
        """A peer asked for chunks this node no longer has: withdraw their entries. One an
        engine stored again meanwhile (after the peer's read lock missed it) is published
        again after the withdrawal: its own publish may have gone first, or not at all (an
        entry still recorded is not published twice)."""
        on_disk = self._disk_has(keys)
        gone = [(k, n) for k, n, has in zip(keys, lengths, on_disk, strict=True) if not has]
        if not gone:
            return
        with self._lock:
            for k, _ in gone:
                self._published.pop(k, None)
                self._on_disk.discard(k)
        self.stale_withdrawn += len(gone)
        self.directory.unpublish([k for k, _ in gone])
        back = self.index.contains([k for k, _ in gone])
        if any(back):
            self.publish_known([(k, b"", n) for (k, n), has in zip(gone, back, strict=True) if has])

    # -- figures ---------------------------------------------------------------------------
    def stats(self) -> dict[str, object]:
        with self._lock:
            published, on_disk = len(self._published), len(self._on_disk)
        ms = self.membership
        return {
            "node_id": self.node_id,
            "incarnation": self.me.incarnation,
            "members": ms.describe() if ms is not None else [],
            "membership": {
                "alive": len(ms.alive()),
                "changes": ms.changes,
                "heartbeats_sent": ms.heartbeats_sent,
                "heartbeats_received": ms.heartbeats_received,
                "refused_by_peers": ms.refused_by_peers,
                "self_claims": ms.self_claims,
                "unreachable": ms.unreachable,
                "candidates_turned_away": ms.candidates_turned_away,
            }
            if ms is not None
            else {},
            "directory": self.directory.stats(),
            "published": published,
            "on_disk": on_disk,
            "promoted": self.promoted,
            "stale_withdrawn": self.stale_withdrawn,
            "control": {
                **self.control.stats(),
                "calls": self.client.calls,
                "timeouts": self.client.timeouts,
                "quiet_timeouts": self.client.quiet_timeouts,
                "bad_replies": self.client.bad_replies,
                "suspect": self.client.suspects(),
                "suspected": self.client.suspected,
                "probes": self.client.probes,
                "recovered": self.client.recovered,
            },
            "transport": self.transport.stats(),
            "peer_tier": self.tier.stats(),
        }
