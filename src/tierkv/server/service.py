"""The cache service: what each request does, independent of the transport.

It owns the pool, the object index and the eviction controller, the registry of clients
(one per REGISTER: a random token, a namespace, a chunk layout) and their lookup sessions
(request id -> the read lease a LOOKUP took, for the PREPARE_RETRIEVE that follows).

Engine groups: the workers of one engine instance (one client per tensor-parallel rank) and
its scheduler share an ``engine_id``. A scheduler's LOOKUP runs the lookup for every rank,
in that rank's namespace and under that rank's token, and reports the smallest hit count;
each rank then retrieves its own chunks by request id, as if it had looked them up itself.

Every handler takes a decoded request and returns a reply struct, or raises
:class:`RequestError` for an error reply. Handlers never copy KV bytes: they hand out slot
offsets, and the engine copies.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from tierkv import __version__, keys
from tierkv import protocol as p
from tierkv.allocator import Allocator
from tierkv.config import ServerConfig
from tierkv.eviction import EvictionController
from tierkv.index import IndexError_, LeaseNotFound, LeaseNotOwned, ObjectIndex
from tierkv.liveness import Process, trackable
from tierkv.pool import ShmPool
from tierkv.server.lookups import LookupAccounting
from tierkv.server.metrics import ServiceMetrics
from tierkv.server.tiering import Tiering
from tierkv.tiers.base import Tier
from tierkv.tiers.prefetch import PrefetchJob

log = logging.getLogger(__name__)


class RequestError(Exception):
    """Becomes an error reply with ``code``; the server carries on."""

    def __init__(self, code: p.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(slots=True)
class Session:
    """A LOOKUP's state until its retrieve: the read lease over the hit prefix, the hits the
    engine was told, and the prefetch from the tiers, if one runs."""

    lease: int
    available: int  # leading chunks locked under ``lease`` (grows when a prefetch lands)
    hits: int  # what the engine was told: a retrieve offers at most this many
    total: int
    touched: float
    prefetch: PrefetchJob | None = None
    handed_out: bool = False  # PREPARE_RETRIEVE took the lease


@dataclass(slots=True)
class GroupSession:
    """A scheduler's LOOKUP: one session per rank, each held by that rank's client."""

    members: list[tuple[Client, Session]]
    total: int
    touched: float


@dataclass(slots=True)
class Client:
    token: int
    namespace: keys.Namespace
    digest: bytes
    layout: p.Layout
    chunk_bytes: int
    name: str
    pid: int
    registered_at: float
    last_seen: float
    engine_id: str = ""
    role: str = p.ROLE_WORKER
    process: Process | None = None  # watched: the client is dropped when it is gone
    sessions: dict[str, Session] = field(default_factory=dict)
    group_sessions: dict[str, GroupSession] = field(default_factory=dict)
    salted: dict[str, bytes] = field(default_factory=dict)  # cache salt -> namespace digest


Handler = Callable[[Any], Any]


class CacheService:
    """Request handlers over one pool. Thread-safe."""

    def __init__(
        self,
        cfg: ServerConfig,
        pool: ShmPool,
        clock: Callable[[], float] = time.monotonic,
        tiers: list[Tier] | None = None,
    ):
        self.cfg = cfg
        self.pool = pool
        self.clock = clock
        self.started = clock()
        self.index = ObjectIndex(
            Allocator(pool.size, cfg.alignment), cfg.write_ttl, cfg.read_ttl, clock=clock
        )
        self.eviction = EvictionController(
            self.index, cfg.high_watermark, cfg.low_watermark, cfg.eviction_interval
        )
        self.metrics = ServiceMetrics(self.eviction)
        self.lookups = LookupAccounting(self.metrics, self.index, self.eviction)
        self.tiering = Tiering(
            cfg,
            self.index,
            pool,
            tiers,
            lookups=self.lookups,
            wake_eviction=self.eviction.wake_if_needed,
        )
        self.eviction.add_listener(self.tiering.on_evicted)
        self._clients: dict[int, Client] = {}
        self.clients_reaped = 0
        self._groups: dict[str, dict[int, Client]] = {}  # engine_id -> workers by token
        self._lock = threading.Lock()
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
        }
        # Requests that may take long (whole-index walks) run on the worker pool.
        self.blocking: frozenset[type] = frozenset({p.Clear, p.GetStats})

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self.eviction.start()

    def stop(self) -> None:
        self.eviction.stop()
        self.tiering.close()

    # -- dispatch --------------------------------------------------------------------------
    def handle(self, req: Any) -> Any:
        """Run the handler for ``req``; map failures to error replies; count and time it."""
        start = time.perf_counter()
        reply = self._dispatch(req)
        self.metrics.request_done(type(req), reply, time.perf_counter() - start)
        return reply

    def malformed(self, rid: int, message: str) -> p.Error:
        """The reply to a message that could not be decoded (counted as "malformed")."""
        reply = self.error(rid, p.ErrorCode.BAD_REQUEST, message)
        self.metrics.request_done(type(None), reply, 0.0)
        return reply

    def _dispatch(self, req: Any) -> Any:
        name = p.request_name(req)
        try:
            return self.handlers[type(req)](req)
        except RequestError as exc:
            return self.error(req.rid, exc.code, exc.message)
        except LeaseNotFound as exc:
            return self.error(req.rid, p.ErrorCode.NOT_FOUND, str(exc))
        except LeaseNotOwned as exc:
            return self.error(req.rid, p.ErrorCode.NOT_OWNED, str(exc))
        except Exception:
            log.exception("internal error handling %s", name)
            return self.error(req.rid, p.ErrorCode.INTERNAL, f"internal error handling {name}")

    def error(self, rid: int, code: p.ErrorCode, message: str) -> p.Error:
        return p.Error(rid, code, message)

    def request_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """(requests by type, error replies by code), from the metrics' request counts."""
        requests: dict[str, int] = {}
        errors: dict[str, int] = {}
        for name, outcomes in self.metrics.request_totals().items():
            total = sum(outcomes.values())
            if total:
                requests[name] = total
            for outcome, n in outcomes.items():
                if outcome != "ok" and n:
                    errors[outcome] = errors.get(outcome, 0) + n
        return requests, errors

    # -- registration ----------------------------------------------------------------------
    def register(self, req: p.Register) -> p.Registered:
        if req.protocol != p.PROTOCOL_VERSION:
            raise RequestError(
                p.ErrorCode.VERSION,
                f"client speaks protocol {req.protocol}, server {__version__} speaks "
                f"{p.PROTOCOL_VERSION}: upgrade the older side",
            )
        if not self._token_ok(req.auth_token):
            raise RequestError(p.ErrorCode.UNAUTHORIZED, "wrong or missing auth token")
        if req.role not in (p.ROLE_WORKER, p.ROLE_SCHEDULER):
            raise RequestError(
                p.ErrorCode.BAD_REQUEST, f"role must be 'worker' or 'scheduler', not {req.role!r}"
            )
        scheduler = req.role == p.ROLE_SCHEDULER
        if scheduler and not req.engine_id:
            raise RequestError(p.ErrorCode.BAD_REQUEST, "a scheduler client needs an engine_id")
        if len(req.engine_id) > 256:
            raise RequestError(p.ErrorCode.BAD_REQUEST, "engine_id is longer than 256")
        chunk_bytes = 0 if scheduler else self._check_layout(req.layout)
        if req.world_size < 1 or not 0 <= req.rank < req.world_size:
            raise RequestError(
                p.ErrorCode.BAD_REQUEST, f"rank {req.rank} outside world size {req.world_size}"
            )
        if not req.model:
            raise RequestError(p.ErrorCode.BAD_REQUEST, "model must name the model")
        ns = keys.Namespace(
            model=req.model,
            kv_dtype=req.layout.dtype,
            layout=req.layout.signature(),
            world_size=req.world_size,
            rank=req.rank,
            tenant_salt=req.tenant_salt,
        )
        now = self.clock()
        token = secrets.randbits(62) + 1
        client = Client(
            token,
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
        )
        with self._lock:
            group = self._groups.setdefault(req.engine_id, {}) if req.engine_id else {}
            # One client per rank of an engine: a worker registering again (its first
            # registration's reply was lost to a timeout, say) replaces the earlier one, which
            # would otherwise leave the group with two clients for one rank and unservable.
            replaced = (
                [] if scheduler else [c for c in group.values() if c.namespace.rank == ns.rank]
            )
            self._clients[token] = client
            if req.engine_id and not scheduler:
                group[token] = client
            elif req.engine_id and not group:
                del self._groups[req.engine_id]
        for old in replaced:
            freed, released = self._drop_client(old)
            log.warning(
                "client %s registered again as rank %d of engine %s: replaced its earlier "
                "registration (released %d write, %d read locks)",
                req.name or "-",
                ns.rank,
                req.engine_id,
                freed,
                released,
            )
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
            token,
            __version__,
            p.PROTOCOL_VERSION,
            self.pool.name,
            self.pool.size,
            self.cfg.chunk_size,
            chunk_bytes,
            client.digest,
        )

    def _check_layout(self, layout: p.Layout) -> int:
        itemsize = _EXTRA_DTYPE_SIZES.get(layout.dtype) or _numeric_itemsize(layout.dtype)
        if not itemsize:
            raise RequestError(
                p.ErrorCode.BAD_REQUEST,
                f"unknown or unsupported dtype {layout.dtype!r}: use a numeric dtype such as "
                "float16, bfloat16, float32, int8 or float8_e4m3fn",
            )
        if not layout.shape or any(d <= 0 for d in layout.shape) or len(layout.shape) > 8:
            raise RequestError(p.ErrorCode.BAD_REQUEST, f"bad chunk shape {layout.shape}")
        if not 0 <= layout.token_axis < len(layout.shape):
            raise RequestError(
                p.ErrorCode.BAD_REQUEST, f"token_axis {layout.token_axis} out of range"
            )
        if layout.shape[layout.token_axis] != self.cfg.chunk_size:
            raise RequestError(
                p.ErrorCode.BAD_REQUEST,
                f"chunk shape {layout.shape} has {layout.shape[layout.token_axis]} tokens on axis "
                f"{layout.token_axis}; this server's chunk size is {self.cfg.chunk_size}",
            )
        chunk_bytes = math.prod(layout.shape) * itemsize
        if chunk_bytes > self.index.capacity:
            raise RequestError(
                p.ErrorCode.BAD_REQUEST,
                f"one chunk is {chunk_bytes} bytes, larger than the pool ({self.index.capacity})",
            )
        return chunk_bytes

    def unregister(self, req: p.Unregister) -> p.Ok:
        client = self._client(req.client)
        freed, released = self._drop_client(client)
        log.info(
            "unregistered client %s (released %d write, %d read locks)",
            client.name or "-",
            freed,
            released,
        )
        return p.Ok(req.rid, freed + released)

    def reap_exited_clients(self) -> int:
        """Drop the clients whose (watched) process has exited: their write reservations
        and read locks are released now, not when their leases expire."""
        with self._lock:
            watched = [c for c in self._clients.values() if c.process is not None]
        reaped = 0
        for client in watched:
            assert client.process is not None
            if client.process.alive() or client.token not in self._clients:
                continue
            freed, released = self._drop_client(client)
            reaped += 1
            log.warning(
                "client %s (pid %d) exited without unregistering: released %d write "
                "reservations and %d read locks",
                client.name or "-",
                client.process.pid,
                freed,
                released,
            )
        self.clients_reaped += reaped
        return reaped

    def _drop_client(self, client: Client) -> tuple[int, int]:
        """Forget a client: its sessions, registry entries and every lock it holds."""
        for request_id in list(client.group_sessions):
            self._drop_session(client, request_id)
        with self._lock:
            self._clients.pop(client.token, None)
            group = self._groups.get(client.engine_id)
            if group is not None:
                group.pop(client.token, None)
                if not group:
                    del self._groups[client.engine_id]
        return self.index.release_holder(client.token)

    def _client(self, token: int) -> Client:
        client = self._clients.get(token)
        if client is None:
            raise RequestError(
                p.ErrorCode.UNAUTHORIZED,
                "unknown client token: not registered, unregistered, or the server restarted "
                "(register again)",
            )
        client.last_seen = self.clock()
        return client

    # -- chunk keys ------------------------------------------------------------------------
    def _digest(self, client: Client, salt: str) -> bytes:
        """The namespace digest of ``client`` under a per-request cache salt."""
        if not salt:
            return client.digest
        digest = client.salted.get(salt)
        if digest is None:
            if len(salt) > 1024:
                raise RequestError(p.ErrorCode.BAD_REQUEST, "cache salt longer than 1024")
            tenant = client.namespace.tenant_salt
            ns = msgspec.structs.replace(
                client.namespace, tenant_salt=f"{len(tenant)}:{tenant}{salt}"
            )
            digest = ns.digest()
            if len(client.salted) >= 4096:
                client.salted.clear()
            client.salted[salt] = digest
        return digest

    def _worker(self, token: int) -> Client:
        """The client, which must be one that moves KV (not a scheduler)."""
        client = self._client(token)
        if client.role != p.ROLE_WORKER:
            raise RequestError(
                p.ErrorCode.BAD_REQUEST, "a scheduler client looks up; its workers move KV"
            )
        return client

    def _keys(
        self, client: Client, sel: p.ChunkSelector, first_chunk: int = 0
    ) -> tuple[list[bytes], list[int]]:
        """Keys and byte lengths of the selected chunks, from ``first_chunk`` on."""
        limit = self.cfg.max_chunks_per_request
        chunk_size = self.cfg.chunk_size
        if (sel.tokens is None) == (sel.hashes is None):
            raise RequestError(p.ErrorCode.BAD_REQUEST, "give exactly one of tokens or hashes")
        if first_chunk < 0:
            raise RequestError(p.ErrorCode.BAD_REQUEST, "first_chunk must be >= 0")
        if sel.tokens is not None:
            if len(sel.tokens) % 4:
                raise RequestError(p.ErrorCode.BAD_REQUEST, "tokens must be packed uint32")
            n_tokens = len(sel.tokens) // 4
            n_chunks = n_tokens // chunk_size + bool(sel.partial_last and n_tokens % chunk_size)
            if n_chunks > limit:
                raise RequestError(
                    p.ErrorCode.TOO_LARGE,
                    f"{n_tokens} tokens make {n_chunks} chunks of {chunk_size}, more than "
                    f"{limit} (max_chunks_per_request)",
                )
            ks = keys.chunk_keys(
                self._digest(client, sel.salt), sel.tokens, chunk_size, sel.partial_last
            )
            lengths = [client.chunk_bytes] * len(ks)
            rest = n_tokens % chunk_size
            if sel.partial_last and rest:
                lengths[-1] = client.chunk_bytes // chunk_size * rest
        else:
            assert sel.hashes is not None
            if len(sel.hashes) > limit:
                raise RequestError(
                    p.ErrorCode.TOO_LARGE,
                    f"{len(sel.hashes)} hashes is more than {limit} (max_chunks_per_request)",
                )
            if sel.partial_last:
                raise RequestError(p.ErrorCode.BAD_REQUEST, "partial_last needs tokens, not hashes")
            try:
                ks = keys.keys_from_hashes(self._digest(client, sel.salt), sel.hashes)
            except ValueError as exc:
                raise RequestError(p.ErrorCode.BAD_REQUEST, str(exc)) from None
            lengths = [client.chunk_bytes] * len(ks)
        if first_chunk > len(ks):
            raise RequestError(
                p.ErrorCode.BAD_REQUEST, f"first_chunk {first_chunk} beyond {len(ks)} chunks"
            )
        return ks[first_chunk:], lengths[first_chunk:]

    # -- store -----------------------------------------------------------------------------
    def prepare_store(self, req: p.PrepareStore) -> p.StoreSlots:
        client = self._worker(req.client)
        ks, lengths = self._keys(client, req.chunks, req.first_chunk)
        res = self.index.reserve_write(ks, lengths, client.token)
        if res.no_space or res.slots:
            self.eviction.wake_if_needed()
        base = req.first_chunk
        return p.StoreSlots(
            req.rid,
            res.lease_id,
            [p.Slot(i + base, off, n) for i, off, n in res.slots],
            [i + base for i in res.present],
            [i + base for i in res.no_space],
        )

    def commit_store(self, req: p.CommitStore) -> p.Committed:
        client = self._client(req.client)
        try:
            res = self.index.commit(req.lease, client.token, req.only)
        except LeaseNotFound:
            raise RequestError(
                p.ErrorCode.NOT_FOUND,
                f"store lease {req.lease} is not open: never prepared, already committed or "
                "aborted, or expired (write_ttl)",
            ) from None
        except LeaseNotOwned:
            raise
        except IndexError_ as exc:  # `only` positions out of range
            raise RequestError(p.ErrorCode.BAD_REQUEST, str(exc)) from None
        self.tiering.after_commit(res.committed_keys)
        self.metrics.stored(res.committed, res.committed_bytes)
        return p.Committed(req.rid, res.committed, res.aborted, res.cleared)

    def abort_store(self, req: p.AbortStore) -> p.Ok:
        client = self._client(req.client)
        return p.Ok(req.rid, self.index.abort(req.lease, client.token))

    # -- lookup and retrieve ---------------------------------------------------------------
    def lookup(self, req: p.Lookup) -> p.LookupResult:
        client = self._client(req.client)
        if client.role == p.ROLE_SCHEDULER:
            return self._group_lookup(client, req)
        ks, lengths = self._keys(client, req.chunks)
        if not req.request_id:
            return p.LookupResult(req.rid, self._prefix_hits(ks), len(ks))
        self._drop_session(client, req.request_id)
        session = self._open_session(client, req.request_id, ks, lengths)
        return p.LookupResult(
            req.rid, session.hits, len(ks), prefetching=session.prefetch is not None
        )

    def _open_session(
        self, client: Client, request_id: str, ks: list[bytes], lengths: list[int]
    ) -> Session:
        """Lock the pool's hit prefix for ``client``, start the prefetch of the rest."""
        lock = self.index.lock_read(ks, client.token, prefix=True)
        hits = len(lock.slots)
        session = Session(lock.lease_id, hits, hits, len(ks), self.clock())
        with self._lock:
            client.sessions[request_id] = session
        if hits < len(ks) and self.tiering.enabled:
            session.prefetch = self.tiering.prefetch(
                client.token,
                ks,
                lengths,
                hits,
                lock.lease_id,
                lambda job: self._prefetch_done(client, request_id, session, job),
            )
        else:
            self.lookups.record(ks, hits)  # with a prefetch, the tiering counts it when done
        return session

    def _group_lookup(self, scheduler: Client, req: p.Lookup) -> p.LookupResult:
        """A scheduler's lookup: every rank of its engine, the smallest hit count."""
        workers = sorted(
            self._groups.get(scheduler.engine_id, {}).values(), key=lambda c: c.namespace.rank
        )
        if not workers or len(workers) != workers[0].namespace.world_size:
            # Not every rank has registered (yet): nothing can be served consistently.
            total = len(self._keys(workers[0], req.chunks)[0]) if workers else 0
            return p.LookupResult(req.rid, 0, total)
        if not req.request_id:
            key_lists = [self._keys(w, req.chunks)[0] for w in workers]
            hits = min(self._prefix_hits(ks) for ks in key_lists)
            return p.LookupResult(req.rid, hits, len(key_lists[0]))
        self._drop_session(scheduler, req.request_id)
        members: list[tuple[Client, Session]] = []
        for worker in workers:
            ks, lengths = self._keys(worker, req.chunks)
            self._drop_session(worker, req.request_id)
            members.append((worker, self._open_session(worker, req.request_id, ks, lengths)))
        group = GroupSession(members, members[0][1].total, self.clock())
        hits = min(session.available for _, session in members)
        for _, session in members:
            session.hits = hits
        with self._lock:
            scheduler.group_sessions[req.request_id] = group
        prefetching = any(session.prefetch is not None for _, session in members)
        return p.LookupResult(req.rid, hits, group.total, prefetching=prefetching)

    def _prefix_hits(self, ks: list[bytes]) -> int:
        """Leading chunks in the pool now (a lookup without locks); counted in the metrics."""
        hits = 0
        for present in self.index.contains(ks):
            if not present:
                break
            hits += 1
        self.lookups.record(ks, hits)
        return hits

    def _prefetch_done(
        self, client: Client, request_id: str, session: Session, job: PrefetchJob
    ) -> None:
        """On a tier thread: hand a lease the prefetch created to its session, or give it
        back if nobody can use it any more (session ended, retrieved or timed out)."""
        new_lease = job.lease_id if job.lease_id != session.lease else 0
        if not new_lease:
            return  # nothing locked, or locks added to the session's own lease
        with self._lock:
            attach = (
                client.sessions.get(request_id) is session
                and session.lease == 0
                and not session.handed_out
                and not job.cancelled
            )
            if attach:
                session.lease = new_lease
        if not attach:
            with contextlib.suppress(LeaseNotFound):
                self.index.release_read(new_lease, client.token)

    def _settle(self, session: Session) -> bool:
        """Whether the session's prefetch is over; folds its result into ``available``."""
        job = session.prefetch
        if job is None:
            return True
        if not self.tiering.prefetcher.poll(job):
            return False
        with self._lock:
            if job.done.is_set() and not job.cancelled and not session.handed_out:
                session.available = max(session.available, job.hits)
            session.prefetch = None
        return True

    def query_prefetch(self, req: p.QueryPrefetch) -> p.PrefetchStatus:
        client = self._client(req.client)
        now = self.clock()
        group = client.group_sessions.get(req.request_id)
        if group is not None:
            group.touched = now
            members = [session for _, session in group.members]
        else:
            single = client.sessions.get(req.request_id)
            if single is None:
                raise RequestError(p.ErrorCode.NOT_FOUND, f"no lookup session {req.request_id!r}")
            members = [single]
        for session in members:
            session.touched = now
        done = all([self._settle(session) for session in members])  # settle every member
        if not done:
            return p.PrefetchStatus(req.rid, False, min(m.hits for m in members))
        hits = min(m.available for m in members)
        for session in members:
            if not session.handed_out:
                session.hits = hits
        return p.PrefetchStatus(req.rid, True, hits)

    def prepare_retrieve(self, req: p.PrepareRetrieve) -> p.RetrieveSlots:
        client = self._worker(req.client)
        if req.chunks is not None:
            if req.request_id:
                raise RequestError(p.ErrorCode.BAD_REQUEST, "give request_id or chunks, not both")
            ks, _ = self._keys(client, req.chunks, req.first_chunk)
            lock = self.index.lock_read(ks, client.token, prefix=False)
            base = req.first_chunk
            return p.RetrieveSlots(
                req.rid,
                lock.lease_id,
                [p.Slot(i + base, off, n) for i, off, n in lock.slots],
                [i + base for i in lock.missing],
            )
        if not req.request_id:
            raise RequestError(p.ErrorCode.BAD_REQUEST, "give request_id or chunks")
        with self._lock:
            session = client.sessions.get(req.request_id)
            if session is None:
                raise RequestError(
                    p.ErrorCode.NOT_FOUND,
                    f"no lookup session {req.request_id!r} (never looked up, already "
                    "retrieved, ended or expired): look up again",
                )
            lease, session.lease = session.lease, 0
            session.handed_out = True
            # The retrieve takes the session over: its lease ends with FINISH_RETRIEVE, so
            # nothing is left to keep (engines need not send END_SESSION for it).
            del client.sessions[req.request_id]
        if lease == 0:
            return p.RetrieveSlots(req.rid, 0, [], list(range(session.total)))
        try:
            slots = self.index.lease_slots(lease, client.token)
        except LeaseNotFound:
            raise RequestError(
                p.ErrorCode.NOT_FOUND,
                f"the locks of lookup {req.request_id!r} expired (read_ttl); look up again",
            ) from None
        # A prefetch may have added locks beyond what the engine was told; those stay under
        # the lease (released by FINISH_RETRIEVE) but are not offered.
        slots = slots[: session.hits]
        if not slots:
            self.index.release_read(lease, client.token)
            return p.RetrieveSlots(req.rid, 0, [], list(range(session.total)))
        return p.RetrieveSlots(
            req.rid,
            lease,
            [p.Slot(i, off, n) for i, (_, off, n) in enumerate(slots)],
            list(range(len(slots), session.total)),
        )

    def finish_retrieve(self, req: p.FinishRetrieve) -> p.Ok:
        client = self._client(req.client)
        return p.Ok(req.rid, self.index.release_read(req.lease, client.token))

    def free_lookup_locks(self, req: p.FreeLookupLocks) -> p.Ok:
        client = self._client(req.client)
        return p.Ok(req.rid, self._drop_session(client, req.request_id))

    def end_session(self, req: p.EndSession) -> p.Ok:
        client = self._client(req.client)
        return p.Ok(req.rid, self._drop_session(client, req.request_id))

    def _drop_session(self, client: Client, request_id: str) -> int:
        """End a lookup session (a scheduler's: every rank's); returns locks released."""
        with self._lock:
            session = client.sessions.pop(request_id, None)
            group = client.group_sessions.pop(request_id, None)
            members = [(client, session)] if session is not None else []
            if group is not None:
                # A rank's session may already have been replaced or dropped by the rank.
                for worker, member in group.members:
                    if worker.sessions.get(request_id) is member:
                        del worker.sessions[request_id]
                        members.append((worker, member))
        released = 0
        for owner, member in members:
            if member.lease:
                with contextlib.suppress(LeaseNotFound):
                    released += self.index.release_read(member.lease, owner.token)
        return released

    def expire_sessions(self) -> int:
        """Forget lookup sessions idle for longer than ``session_ttl``."""
        cutoff = self.clock() - self.cfg.session_ttl
        dropped = 0
        for client in list(self._clients.values()):
            stale = [rid for rid, s in list(client.sessions.items()) if s.touched < cutoff]
            stale += [rid for rid, g in list(client.group_sessions.items()) if g.touched < cutoff]
            for rid in stale:
                self._drop_session(client, rid)
                dropped += 1
        return dropped

    # -- administration --------------------------------------------------------------------
    def clear(self, req: p.Clear) -> p.Ok:
        # A registered client clears its own namespaces. The whole pool is an admin request:
        # it carries the auth token when the server has one (without one, the 0600 socket
        # trusts local callers).
        client = self._client(req.client) if req.client else None
        if client is not None and not req.everything:
            return p.Ok(req.rid, self.clear_cache(self._namespaces_of(client)))
        if not self._token_ok(req.auth_token):
            raise RequestError(
                p.ErrorCode.UNAUTHORIZED,
                "clearing the whole pool needs the auth token (--auth-token); a registered "
                "client may clear its own namespace",
            )
        return p.Ok(req.rid, self.clear_cache())

    def _namespaces_of(self, client: Client) -> set[bytes]:
        """A client's namespace digests: its own and its cache salts', and those of the other
        ranks of its engine (one engine's cache is cleared as a whole)."""
        with self._lock:
            group = self._groups.get(client.engine_id, {}) if client.engine_id else {}
            members = [client, *group.values()]
            return {d for c in members for d in (c.digest, *c.salted.values())}

    def clear_cache(self, namespaces: bytes | set[bytes] = b"", via: str = "RPC") -> int:
        """Remove every object from the pool, or those of some namespaces (16-byte digests,
        the first half of each key). Tiers keep theirs."""
        if isinstance(namespaces, bytes):
            removed = self.index.clear_keys(namespaces)
            what = f"namespace {namespaces.hex()}" if namespaces else "the cache"
        else:
            removed = [k for ns in namespaces for k in self.index.clear_keys(ns)]
            what = f"{len(namespaces)} namespace{'' if len(namespaces) == 1 else 's'}"
        self.tiering.on_removed(removed)
        log.info("cleared %s over %s (%d objects)", what, via, len(removed))
        return len(removed)

    def uptime(self) -> float:
        return self.clock() - self.started

    def clients_snapshot(self) -> list[p.EngineInfo]:
        """The registered clients as status reports show them (the tenant salt hashed)."""
        now = self.clock()
        with self._lock:
            clients = [(c, len(c.sessions) + len(c.group_sessions)) for c in self._clients.values()]
        return [
            p.EngineInfo(
                name=c.name,
                pid=c.pid,
                role=c.role,
                engine_id=c.engine_id,
                model=c.namespace.model,
                dtype=c.namespace.kv_dtype,
                layout=c.namespace.layout,
                world_size=c.namespace.world_size,
                rank=c.namespace.rank,
                tenant=_tenant_tag(c.namespace.tenant_salt),
                namespace=c.digest.hex(),
                chunk_bytes=c.chunk_bytes,
                registered_s=now - c.registered_at,
                idle_s=now - c.last_seen,
                sessions=sessions,
            )
            for c, sessions in clients
        ]

    def _token_ok(self, given: str) -> bool:
        """Whether ``given`` is the server's auth token (always, on a server without one).
        Compared as bytes in constant time: any text, non-ASCII included, is just wrong."""
        token = self.cfg.auth_token
        return not token or secrets.compare_digest(given.encode(), token.encode())

    def ping(self, req: p.Ping) -> p.Ok:
        return p.Ok(req.rid)

    def stats(self, req: p.GetStats) -> p.Stats:
        if req.client not in self._clients and not self._token_ok(req.auth_token):
            raise RequestError(p.ErrorCode.UNAUTHORIZED, "stats need a client or auth token")
        s = self.index.stats()
        requests, errors = self.request_counts()
        tiers = self.tiering.tier_stats()
        hits, misses = self.metrics.lookup_counts([t.name for t in tiers])
        pool_bytes = self.metrics.pool_bytes.snapshot()
        wb = self.tiering.write_behind.stats
        pf = self.tiering.prefetcher.stats
        return p.Stats(
            rid=req.rid,
            server_version=__version__,
            uptime_s=self.uptime(),
            pool_name=self.pool.name,
            capacity=s.capacity,
            used=s.used,
            largest_free=s.largest_free,
            objects=s.objects,
            writing=s.writing,
            ready=s.ready,
            read_locked=s.read_locked,
            clients=len(self._clients),
            sessions=sum(len(c.sessions) for c in list(self._clients.values())),
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
            engines=self.clients_snapshot(),
            clients_reaped=self.clients_reaped,
            pinned=s.pinned,
            lookup_hits=hits,
            lookup_misses=misses,
            stored_bytes=pool_bytes.get("stored_bytes", 0),
            retrieved_bytes=pool_bytes.get("retrieved_bytes", 0),
            http_url=self.cfg.http_url,
            cluster=self.tiering.cluster.stats() if self.tiering.cluster is not None else {},
        )


def _tenant_tag(salt: str) -> str:
    """Tells tenants apart in status reports without showing their salt ("" for none)."""
    return "sha256:" + hashlib.sha256(salt.encode()).hexdigest()[:12] if salt else ""


# Dtypes numpy does not know by these names but engines use.
_EXTRA_DTYPE_SIZES = {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1}


def _numeric_itemsize(name: str) -> int:
    """Item size of a plain numeric numpy dtype name (bool, ints, floats, complex), or 0.

    Anything else is refused: numpy also parses object, string, datetime and structured
    dtypes (some of size 0, object ones holding pointers) and raises more than TypeError on
    odd strings (``"f4,,"`` is a SyntaxError)."""
    if not name or len(name) > 32 or not name.replace("_", "").isalnum():
        return 0
    try:
        dtype = np.dtype(name)
    except Exception:
        return 0
    return dtype.itemsize if dtype.kind in "biufc" else 0
