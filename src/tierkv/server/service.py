"""The request handlers: what each RPC request does, independent of the transport.

Every handler takes a decoded request and returns a reply struct, or raises
:class:`~tierkv.server.errors.RequestError` for an error reply. Handlers never copy KV
bytes: they hand out slot offsets, and the engine copies. The state they work on lives in
the parts the wiring built and handed in: the index (slots, leases), the client registry,
the lookup sessions, and the tiering (write-behind after a commit, prefetch on a lookup).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, Protocol

import msgspec

from tierkv import __version__, keys
from tierkv import protocol as p
from tierkv.cluster.router_lookup import RouterQueryError
from tierkv.config import ServerConfig
from tierkv.eviction import Evictor
from tierkv.index import LeaseError, LeaseNotFound, LeaseNotOwned, ObjectIndex
from tierkv.liveness import trackable
from tierkv.pool import ShmPool
from tierkv.priority import sharing_the_gil
from tierkv.server.chunk_feed import ChunkFeed, SnapshotPages
from tierkv.server.chunk_keys import ChunkKeys
from tierkv.server.errors import RequestError
from tierkv.server.metrics import ServiceMetrics
from tierkv.server.register_checks import check_register
from tierkv.server.registry import ClientRegistry, GroupConflict, Registration, RegistryFull
from tierkv.server.sessions import LookupSessions
from tierkv.server.tiering import Tiering
from tierkv.tenants import tenant_name

log = logging.getLogger(__name__)

LOOKUP_FIRST_STEP = 1  # keys a lookup hashes and checks first (then 4x as many each time)

Handler = Callable[[Any], Any]
RemovedListener = Callable[[list[bytes]], None]


class CommitPublisher(Protocol):
    """Where committed chunks are announced to other nodes (the cluster node)."""

    def publish_committed(self, keys: Sequence[bytes], lengths: Sequence[int]) -> int: ...

    def wait_published(self, ticket: int, timeout: float) -> bool: ...


class CacheService:
    """Request handlers over one pool. Thread-safe."""

    def __init__(
        self,
        *,
        cfg: ServerConfig,
        pool: ShmPool,
        index: ObjectIndex,
        eviction: Evictor,
        tiering: Tiering,
        registry: ClientRegistry,
        sessions: LookupSessions,
        metrics: ServiceMetrics,
        snapshot: Callable[[int], p.Stats],
        clock: Callable[[], float] = time.monotonic,
        feed: ChunkFeed | None = None,
    ) -> None:
        """``snapshot(rid)`` builds the STATS reply (the server's one status builder)."""
        self.cfg = cfg
        self.pool = pool
        self.index = index
        self.eviction = eviction
        self.tiering = tiering
        self.registry = registry
        self.sessions = sessions
        self.metrics = metrics
        self.snapshot = snapshot
        self.clock = clock
        # The noted chunks' events (tierkv.server.chunk_feed); fed by the index's hooks.
        self.feed = feed if feed is not None else ChunkFeed()
        self.snapshot_pages = SnapshotPages()
        self.chunk_keys = ChunkKeys(cfg.chunk_size, cfg.max_chunks_per_request)
        self.reservation_limit = int(cfg.client_reservation_share * index.capacity)
        self.removed_listeners: list[RemovedListener] = []  # chunks cleared from the pool
        self.handlers: dict[type, Handler] = {
            p.Register: self.register,
            p.Unregister: self.unregister,
            p.Lookup: self.lookup,
            p.QueryPrefetch: self.query_prefetch,
            p.PrepareStore: self.prepare_store,
            p.CommitStore: self.commit_store,
            p.AbortStore: self.abort_store,
            p.PrepareRetrieve: self.prepare_retrieve,
            p.FinishRetrieve: self.finish_retrieve,
            p.FreeLookupLocks: self.free_lookup_locks,
            p.EndSession: self.end_session,
            p.Clear: self.clear,
            p.Ping: self.ping,
            p.GetStats: self.stats,
            p.ReadChunkEvents: self.read_chunk_events,
            p.ReadChunkSnapshot: self.read_chunk_snapshot,
            p.RouterLookup: self.router_lookup,
        }
        # Requests that may take long (whole-index walks) run on the worker pool.
        # Router lookups may wait for the directory's owners (a network round trip).
        self.blocking: frozenset[type] = frozenset(
            {p.Clear, p.GetStats, p.ReadChunkSnapshot, p.RouterLookup}
        )
        # Requests for routers, not engines: they wait at the engines-first check points
        # (tierkv.server.engine_first) instead of holding them up.
        self.router_work: frozenset[type] = frozenset({p.RouterLookup})
        self._router_lookup: Callable[[p.RouterQuery], dict[str, object]] | None = None
        self._publisher: CommitPublisher | None = None
        self._publish_timeout = 0.0

    def publish_commits(self, publisher: CommitPublisher, timeout: float) -> None:
        """Read-your-writes across nodes: a COMMIT announces its chunks through
        ``publisher`` and replies once they are in the directory (or after ``timeout``
        seconds), so a lookup on any node finds them as soon as the store has returned.
        Commits then run on the worker pool: their wait is a network round trip."""
        self._publisher = publisher
        self._publish_timeout = timeout
        self.blocking = self.blocking | {p.CommitStore}

    def serve_router_lookups(self, answer: Callable[[p.RouterQuery], dict[str, object]]) -> None:
        """Answer ROUTER_LOOKUP (a cluster's ``POST /lookup``, from the HTTP front) with
        ``answer`` (:func:`tierkv.cluster.router_lookup.answer_query`)."""
        self._router_lookup = answer

    def router_lookup(self, req: p.RouterLookup) -> p.RouterAnswer:
        if not self.token_ok(req.auth_token):
            raise RequestError(p.ErrorCode.UNAUTHORIZED, "router lookups need the auth token")
        answer = self._router_lookup
        if answer is None:
            refused = RouterQueryError(
                404, "POST /lookup is answered by servers in a cluster (or the controller)"
            )
            return p.RouterAnswer(req.rid, refused.status, refused.body())
        try:
            with sharing_the_gil():  # an engine's request waits for the GIL briefly
                reply = msgspec.json.encode(answer(req.query))
        except RouterQueryError as exc:
            return p.RouterAnswer(req.rid, exc.status, exc.body())
        return p.RouterAnswer(req.rid, 200, reply)

    # -- dispatch --------------------------------------------------------------------------
    def handle(self, req: Any) -> Any:
        """Run the handler for ``req``; map failures to error replies; count and time it."""
        start = time.perf_counter()
        reply = self._dispatch(req)
        self.metrics.request_done(type(req), reply, time.perf_counter() - start)
        return reply

    def reply_to(self, req: Any) -> Any:
        """The reply to ``req`` without counting it as a request: a held request's progress
        read again (:mod:`tierkv.server.held_queries`)."""
        return self._dispatch(req)

    def malformed(self, rid: int, message: str) -> p.Error:
        """The reply to a message that could not be decoded (counted as "malformed")."""
        reply = p.Error(rid, p.ErrorCode.BAD_REQUEST, message)
        self.metrics.request_done(type(None), reply, 0.0)
        return reply

    def _dispatch(self, req: Any) -> Any:
        name = p.request_name(req)
        try:
            return self.handlers[type(req)](req)
        except RequestError as exc:
            return p.Error(req.rid, exc.code, exc.message)
        except LeaseNotFound as exc:
            return p.Error(req.rid, p.ErrorCode.NOT_FOUND, str(exc))
        except LeaseNotOwned as exc:
            return p.Error(req.rid, p.ErrorCode.NOT_OWNED, str(exc))
        except Exception:
            log.exception("internal error handling %s", name)
            return p.Error(req.rid, p.ErrorCode.INTERNAL, f"internal error handling {name}")

    def housekeeping(self) -> None:
        """Periodic work of the RPC loop: idle sessions, and clients that went away."""
        self.sessions.expire()
        self.registry.reap()
        self.snapshot_pages.expire(self.clock(), self.registry.__contains__)

    # -- registration ----------------------------------------------------------------------
    def register(self, req: p.Register) -> p.Registered:
        chunk_bytes = check_register(
            req,
            authorized=self.token_ok(req.auth_token),
            chunk_size=self.cfg.chunk_size,
            capacity=self.index.capacity,
        )
        scheduler = req.role == p.ROLE_SCHEDULER
        ns = keys.Namespace(
            model=req.model,
            kv_dtype=req.layout.dtype,
            layout=req.layout.signature(),
            world_size=req.world_size,
            rank=req.rank,
            tenant_salt=req.tenant_salt,
        )
        now = self.clock()
        reg = Registration(
            secrets.randbits(62) + 1,
            ns,
            ns.digest(),
            req.layout,
            chunk_bytes,
            req.name,
            req.pid,
            now,
            now,
            engine_id=req.engine_id,
            role=req.role,
            process=trackable(req.pid, req.process_scope),
            chunk_tokens=0 if scheduler else req.layout.shape[req.layout.token_axis],
            tenants=self.index.tenants,
        )
        try:
            self.registry.add(reg)
        except RegistryFull as exc:
            raise RequestError(p.ErrorCode.LIMIT, str(exc)) from None
        except GroupConflict as exc:
            raise RequestError(p.ErrorCode.BAD_REQUEST, str(exc)) from None
        reg.bind_tenant()  # (once registered: a refused REGISTER takes no tenant id)
        log.info(
            "registered client %s (pid %d) model=%s rank=%d/%d layout=%s",
            req.name or "-",
            req.pid,
            req.model,
            req.rank,
            req.world_size,
            ns.layout,
        )
        return p.Registered(
            req.rid,
            reg.token,
            __version__,
            p.PROTOCOL_VERSION,
            self.pool.name,
            self.pool.size,
            reg.chunk_tokens or self.cfg.chunk_size,
            chunk_bytes,
            reg.digest,
        )

    def unregister(self, req: p.Unregister) -> p.Ok:
        reg = self._client(req.client)
        freed, released = self.registry.drop(reg)
        log.info(
            "unregistered client %s (released %d write, %d read locks)",
            reg.name or "-",
            freed,
            released,
        )
        return p.Ok(req.rid, freed + released)

    def _client(self, token: int) -> Registration:
        reg = self.registry.get(token)
        if reg is None:
            raise RequestError(
                p.ErrorCode.NOT_REGISTERED,
                "unknown client token: not registered, unregistered, or the server restarted "
                "(register again)",
            )
        return reg

    def _worker(self, token: int) -> Registration:
        """The client, which must be one that moves KV (not a scheduler)."""
        reg = self._client(token)
        if reg.role != p.ROLE_WORKER:
            raise RequestError(
                p.ErrorCode.BAD_REQUEST, "a scheduler client looks up; its workers move KV"
            )
        return reg

    # -- store -----------------------------------------------------------------------------
    def prepare_store(self, req: p.PrepareStore) -> p.StoreSlots:
        reg = self._worker(req.client)
        ks, lengths = self.chunk_keys.of(reg, req.chunks, req.first_chunk, store=True)
        if req.notes is not None:
            _check_notes(req.notes, len(ks))
        res = self.index.reserve_write(
            ks, lengths, reg.token, holder_limit=self.reservation_limit, notes=req.notes
        )
        if res.quota_exceeded:
            self.eviction.wake()
        elif res.no_space or res.slots:
            self.eviction.wake_if_needed()
        base = req.first_chunk
        return p.StoreSlots(
            req.rid,
            res.lease_id,
            [p.Slot(i + base, off, n) for i, off, n in res.slots],
            [i + base for i in res.present],
            [i + base for i in res.no_space],
            [i + base for i in res.writing],
        )

    def commit_store(self, req: p.CommitStore) -> p.Committed:
        reg = self._client(req.client)
        try:
            res = self.index.commit(req.lease, reg.token, req.only)
        except LeaseNotFound:
            raise RequestError(
                p.ErrorCode.NOT_FOUND,
                f"store lease {req.lease} is not open: never prepared, already committed or "
                "aborted, or expired (write_ttl)",
            ) from None
        except LeaseNotOwned:
            raise  # an LeaseError too: answered as NOT_OWNED by the dispatcher
        except LeaseError as exc:  # `only` positions out of range
            raise RequestError(p.ErrorCode.BAD_REQUEST, str(exc)) from None
        self.tiering.after_commit(res.committed_keys)
        self.metrics.stored(res.committed, res.committed_bytes)
        publisher = self._publisher
        if publisher is not None and res.committed_keys:
            wait = self._publish_timeout
            if req.wait_ms >= 0:
                wait = min(wait, req.wait_ms / 1000)
            ticket = publisher.publish_committed(res.committed_keys, res.committed_lengths)
            if not publisher.wait_published(ticket, wait):
                log.debug("commit of %d chunks: directory not updated within %.1f s",
                          res.committed, wait)  # fmt: skip
        return p.Committed(req.rid, res.committed, res.aborted, res.cleared)

    def abort_store(self, req: p.AbortStore) -> p.Ok:
        reg = self._client(req.client)
        return p.Ok(req.rid, self.index.abort(req.lease, reg.token))

    # -- the chunk feed --------------------------------------------------------------------
    def read_chunk_events(self, req: p.ReadChunkEvents) -> p.ChunkEvents:
        reg = self._client(req.client)
        if req.after < 0 or req.limit < 1:
            raise RequestError(p.ErrorCode.BAD_REQUEST, "after must be >= 0 and limit >= 1")
        namespaces = self.registry.engine_namespaces(reg)
        known = reg.feed_namespaces
        if known is not namespaces and (known is None or known != namespaces):
            # Its namespaces changed since its snapshot (or it read none): events before now
            # of a namespace it just gained were never sent to it. Read a snapshot, unless
            # the change only added namespaces that hold nothing (a new cache salt, as with
            # every new user: a snapshot of everything each time, for nothing).
            if known is None or not known <= namespaces or self.feed.holds_any(namespaces - known):
                return p.ChunkEvents(req.rid, self.feed.epoch, [], self.feed.seq, True)
            reg.feed_namespaces = namespaces
        batch = self.feed.read(namespaces, req.after, req.limit)
        return p.ChunkEvents(req.rid, self.feed.epoch, batch.events, batch.last, batch.resync)

    def read_chunk_snapshot(self, req: p.ReadChunkSnapshot) -> p.ChunkSnapshot:
        reg = self._client(req.client)
        now = self.clock()
        if req.page == 0:
            namespaces = self.registry.engine_namespaces(reg)
            reg.feed_namespaces = namespaces
            seq, chunks = self.feed.snapshot(namespaces)
            page = self.snapshot_pages.first(reg.token, seq, chunks, now)
        else:
            found = self.snapshot_pages.next(reg.token, req.page, now)
            if found is None:
                raise RequestError(
                    p.ErrorCode.NOT_FOUND,
                    f"no snapshot page {req.page} is open for this client (not the next page, "
                    "or the snapshot expired): read again from page 0",
                )
            page = found
        return p.ChunkSnapshot(req.rid, self.feed.epoch, page.seq, page.chunks, page.next_page)

    # -- lookup and retrieve ---------------------------------------------------------------
    def lookup(self, req: p.Lookup) -> p.LookupResult:
        reg = self._client(req.client)
        if reg.role == p.ROLE_SCHEDULER:
            return self._group_lookup(reg, req)
        ks, lengths = self.chunk_keys.for_lookup(reg, req.chunks)
        ready = self._ready_prefix(ks)
        self.chunk_keys.remember(reg, ks)
        bind = _salt_binding([reg], req.chunks.salt, found=ready > 0)
        if not req.request_id:
            self.tiering.lookups.record(ks, ready)
            return p.LookupResult(req.rid, ready, len(ks))
        rid = _request_id(req.request_id)
        session = self.sessions.open(reg.token, rid, ks, lengths, on_found=bind)
        return p.LookupResult(
            req.rid, session.hits, len(ks), prefetching=session.prefetch is not None
        )

    def _group_lookup(self, scheduler: Registration, req: p.Lookup) -> p.LookupResult:
        """A scheduler's lookup: every rank of its engine, the smallest hit count."""
        workers = self.registry.workers(scheduler.engine_id)
        if not workers or len(workers) != workers[0].namespace.world_size:
            # Not every rank has registered (yet): nothing can be served consistently.
            total = len(self.chunk_keys.for_lookup(workers[0], req.chunks)[0]) if workers else 0
            return p.LookupResult(req.rid, 0, total)
        ranks = [(w.token, *self.chunk_keys.for_lookup(w, req.chunks)) for w in workers]
        readies = [self._ready_prefix(ks) for _, ks, _ in ranks]
        for w, (_, ks, _) in zip(workers, ranks, strict=True):
            self.chunk_keys.remember(w, ks)
        bind = _salt_binding(workers, req.chunks.salt, found=any(readies))
        if not req.request_id:
            for (_, ks, _), ready in zip(ranks, readies, strict=True):
                self.tiering.lookups.record(ks, ready)
            return p.LookupResult(req.rid, min(readies), len(ranks[0][1]))
        request_id = _request_id(req.request_id)
        hits, total, prefetching = self.sessions.open_group(
            scheduler.token, request_id, ranks, on_found=bind
        )
        return p.LookupResult(req.rid, hits, total, prefetching=prefetching)

    def _ready_prefix(self, ks: Sequence[bytes]) -> int:
        """How many leading chunks are ready in the pool now (no chunk locked). Lazily hashed
        keys (:meth:`ChunkKeys.for_lookup`) are hashed only up to the first chunk missing,
        in growing steps (a few index look-ups for a long hit), so a new prompt costs one
        hash; this happens before any lock is taken, the session's locks then find the
        keys hashed."""
        ready, step = 0, (LOOKUP_FIRST_STEP if isinstance(ks, keys.LazyChunkKeys) else len(ks))
        while ready < len(ks):
            batch = ks[ready : ready + step]
            found = self.index.ready_prefix(batch)
            ready += found
            if found < len(batch):
                return ready
            step *= 4
        return ready

    def query_prefetch(self, req: p.QueryPrefetch) -> p.PrefetchStatus:
        """The progress now (the RPC loop holds the reply of one with ``wait_ms``: see
        :meth:`watch_prefetch`)."""
        if not 0 <= req.wait_ms <= p.MAX_PREFETCH_WAIT_MS:
            raise RequestError(
                p.ErrorCode.BAD_REQUEST,
                f"wait_ms must be 0 to {p.MAX_PREFETCH_WAIT_MS}, not {req.wait_ms}",
            )
        reg = self._client(req.client)
        progress = self.sessions.query(reg.token, _request_id(req.request_id))
        if progress is None:
            raise RequestError(p.ErrorCode.NOT_FOUND, f"no lookup session {req.request_id!r}")
        sources = [p.SourceRun(where, chunks) for where, chunks in progress.sources]
        return p.PrefetchStatus(req.rid, progress.done, progress.hits, sources)

    def watch_prefetch(self, req: p.QueryPrefetch, wake: Callable[[], None]) -> float | None:
        """For a QUERY_PREFETCH whose reply waits: call ``wake()`` (on a tier thread) each
        time a prefetch of the lookup finishes. Returns the time (this service's clock) by
        which all of them are over, or None if none is running (answer now). Only after
        :meth:`query_prefetch` answered the same request, not done."""
        reg = self.registry.get(req.client)
        if reg is None:
            return None
        return self.sessions.watch(reg.token, req.request_id, wake)

    def prepare_retrieve(self, req: p.PrepareRetrieve) -> p.RetrieveSlots:
        reg = self._worker(req.client)
        if req.chunks is not None:
            if req.request_id:
                raise RequestError(p.ErrorCode.BAD_REQUEST, "give request_id or chunks, not both")
            ks, _ = self.chunk_keys.of(reg, req.chunks, req.first_chunk)
            lock = self.index.lock_read(ks, reg.token, prefix=False)
            base = req.first_chunk
            return p.RetrieveSlots(
                req.rid,
                lock.lease_id,
                [p.Slot(i + base, off, n) for i, off, n in lock.slots],
                [i + base for i in lock.missing],
                self._read_lease_ms(),
            )
        if not req.request_id:
            raise RequestError(p.ErrorCode.BAD_REQUEST, "give request_id or chunks")
        taken = self.sessions.take(reg.token, _request_id(req.request_id))
        if taken is None:
            raise RequestError(
                p.ErrorCode.NOT_FOUND,
                f"no lookup session {req.request_id!r} (never looked up, already "
                "retrieved, ended or expired): look up again",
            )
        lease, session = taken
        if lease == 0:
            return p.RetrieveSlots(req.rid, 0, [], list(range(session.total)))
        try:
            slots = self.index.lease_slots(lease, reg.token, renew=True)
        except LeaseNotFound:
            raise RequestError(
                p.ErrorCode.NOT_FOUND,
                f"the locks of lookup {req.request_id!r} expired (read_ttl); look up again",
            ) from None
        # A prefetch may have added locks beyond what the engine was told; those stay under
        # the lease (released by FINISH_RETRIEVE) but are not offered.
        slots = slots[: session.hits]
        if not slots:
            self.index.release_read(lease, reg.token)
            return p.RetrieveSlots(req.rid, 0, [], list(range(session.total)))
        return p.RetrieveSlots(
            req.rid,
            lease,
            [p.Slot(i, off, n) for i, (_, off, n) in enumerate(slots)],
            list(range(len(slots), session.total)),
            self._read_lease_ms(),  # renewed: a whole read TTL from now
        )

    def _read_lease_ms(self) -> int:
        """How long a read lease taken (or renewed) now holds, in whole ms."""
        return max(1, int(self.index.read_ttl * 1000))

    def finish_retrieve(self, req: p.FinishRetrieve) -> p.Ok:
        reg = self._client(req.client)
        return p.Ok(req.rid, self.index.release_read(req.lease, reg.token))

    def free_lookup_locks(self, req: p.FreeLookupLocks) -> p.Ok:
        reg = self._client(req.client)
        return p.Ok(req.rid, self.sessions.drop(reg.token, _request_id(req.request_id)))

    def end_session(self, req: p.EndSession) -> p.Ok:
        reg = self._client(req.client)
        return p.Ok(req.rid, self.sessions.drop(reg.token, _request_id(req.request_id)))

    # -- administration --------------------------------------------------------------------
    def clear(self, req: p.Clear) -> p.Ok:
        # A registered client clears its own namespaces. The whole pool is an admin request:
        # it carries the auth token when the server has one (without one, the 0600 socket
        # trusts local callers).
        reg = self._client(req.client) if req.client else None
        if reg is not None and not req.everything:
            return p.Ok(req.rid, self.clear_cache(self.registry.engine_namespaces(reg)))
        if not self.token_ok(req.auth_token):
            raise RequestError(
                p.ErrorCode.UNAUTHORIZED,
                "clearing the whole pool needs the auth token (--auth-token); a registered "
                "client may clear its own namespace",
            )
        return p.Ok(req.rid, self.clear_cache())

    def clear_cache(self, namespaces: bytes | AbstractSet[bytes] = b"", via: str = "RPC") -> int:
        """Remove every object from the pool, or those of some namespaces (16-byte digests,
        the first half of each key). Tiers keep theirs."""
        if isinstance(namespaces, bytes):
            removed = self.index.clear_keys(namespaces)
            what = f"namespace {namespaces.hex()}" if namespaces else "the cache"
        else:
            removed = [k for ns in namespaces for k in self.index.clear_keys(ns)]
            what = f"{len(namespaces)} namespace{'' if len(namespaces) == 1 else 's'}"
        if removed:
            for listener in self.removed_listeners:
                listener(removed)
        log.info("cleared %s over %s (%d objects)", what, via, len(removed))
        return len(removed)

    def token_ok(self, given: str) -> bool:
        """Whether ``given`` is the server's auth token (always, on a server without one).
        Compared as bytes in constant time: any text, non-ASCII included, is just wrong."""
        token = self.cfg.auth_token
        return not token or secrets.compare_digest(given.encode(), token.encode())

    def ping(self, req: p.Ping) -> p.Ok:
        if req.client:
            self._client(req.client)
        return p.Ok(req.rid)

    def stats(self, req: p.GetStats) -> p.Stats:
        if req.client not in self.registry and not self.token_ok(req.auth_token):
            raise RequestError(p.ErrorCode.UNAUTHORIZED, "stats need a client or auth token")
        return self.snapshot(req.rid)


def _salt_binding(
    regs: Sequence[Registration], salt: str, found: bool
) -> Callable[[], None] | None:
    """A lookup under cache salt ``salt`` found chunks of its namespaces (in the pool now:
    ``found``): they are bound to the salt's tenant now, so that they count for it (a
    store binds them too, see :meth:`Registration.digest_for`). Otherwise what binds them
    if its prefetch brings chunks in (None: nothing left to bind). Never for a lookup that
    finds nothing: a tenant id is for good, and lookups of made-up salts used them up."""
    if not salt:
        return None
    todo = [
        (reg.tenants, digest, tenant_name(reg.namespace.tenant_salt, salt))
        for reg in regs
        if reg.tenants is not None and (digest := reg.digest_for(salt)) not in reg.tenants.by_digest
    ]
    if not todo:
        return None

    def bind() -> None:
        for tenants, digest, name in todo:
            tenants.bind(digest, name)

    if found:
        bind()
        return None
    return bind


def _request_id(request_id: str) -> str:
    """``request_id`` if it is short enough to keep (a session is filed under it for its
    TTL: ids of megabytes made a client's lookups hold the server's memory)."""
    if len(request_id) > p.MAX_REQUEST_ID:
        raise RequestError(
            p.ErrorCode.BAD_REQUEST,
            f"a request id is at most {p.MAX_REQUEST_ID} characters, not {len(request_id)}",
        )
    return request_id


def _check_notes(notes: list[bytes], chunks: int) -> None:
    if len(notes) != chunks:
        raise RequestError(
            p.ErrorCode.BAD_REQUEST, f"{len(notes)} notes for {chunks} chunks: give one per chunk"
        )
    if notes and (largest := max(map(len, notes))) > p.MAX_NOTE_BYTES:
        raise RequestError(
            p.ErrorCode.BAD_REQUEST,
            f"a chunk's note is {largest} bytes, more than {p.MAX_NOTE_BYTES}",
        )
