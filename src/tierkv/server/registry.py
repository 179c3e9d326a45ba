"""Registered engine clients: one record per REGISTER, engine groups, and when a record goes.

A :class:`Registration` is the server's record of one client connection: a random token,
the namespace its keys live in, its chunk layout, and who it is. The workers of one engine
instance (one client per tensor-parallel rank) and its scheduler share an ``engine_id``:
that is an engine group, and a worker registering again for a rank its engine already has
replaces the earlier registration (a duplicate would leave the group unservable).

A group's lookups run in its workers' namespaces and its scheduler hands their locks to the
workers by request id, so every member must be of one engine: the same tenant, the workers
of one model (namespace model and world size) and the scheduler of that model. A REGISTER
that does not fit the group its ``engine_id`` names is refused (two engines given one
engine id by mistake, or a client of another tenant naming someone else's engine: it would
learn what that engine has cached, take its locks, or have it load other KV). A worker does
not replace a rank that a running process (one the server watches) still holds: that
process may be copying out of chunks its locks hold.

A registration ends with UNREGISTER, or without one:

- a *watched* client (its process is visible to the server: same boot, same pid namespace)
  is dropped as soon as that process has exited;
- an *unwatched* one (pid 0, another host or pid namespace, RPC over TCP) is dropped once it
  has sent nothing for ``idle_ttl`` seconds: any request refreshes it.

Either way its sessions and every lock it holds are released. The number of registrations
is bounded (``max_clients``); beyond it REGISTER is refused with a clear error.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from tierkv import keys
from tierkv import protocol as p
from tierkv.index import ObjectIndex
from tierkv.liveness import Process
from tierkv.server.sessions import LookupSessions
from tierkv.tenants import TenantIds, tenant_name, tenant_tag

log = logging.getLogger(__name__)

# Cache-salt digests remembered per registration; past it the least recently used half is
# forgotten (its chunks stay, but this engine's CLEAR and chunk feed no longer cover them).
MAX_SALTS = 4096


class RegistryFull(Exception):
    """REGISTER beyond ``max_clients``."""


class GroupConflict(Exception):
    """REGISTER into an engine group it is not a member of (see the module doc)."""


@dataclass(slots=True)
class Registration:
    """The server's record of one registered client."""

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
    process: Process | None = None  # watched: dropped when the process is gone
    salted: OrderedDict[str, bytes] = field(default_factory=OrderedDict)  # salt -> digest
    chunk_tokens: int = 0  # tokens in one of its chunks (0: a scheduler, which has none)
    tenants: TenantIds | None = None  # where its digests are mapped to their tenant
    # Its last few token chains (namespace digest, full chunks' packed tokens, their keys),
    # newest first: see tierkv.server.chunk_keys.
    chains: list[tuple[bytes, bytes, list[bytes]]] = field(default_factory=list)
    # The namespaces its last chunk-feed snapshot covered (tierkv.server.chunk_feed): a
    # read of the feed after they changed (a new cache salt, a rank that joined or
    # registered again) is answered "resync".
    feed_namespaces: frozenset[bytes] | None = None
    # Counts the changes of ``salted``'s digests (a salt added, salts forgotten), not its
    # reordering: :meth:`Registry.engine_namespaces` reuses its set while none changed.
    salts_changed: int = 0
    # (the members' tokens and salts_changed, their namespaces) last computed for this
    # client (Registry.engine_namespaces).
    namespaces_cache: tuple[tuple[tuple[int, int], ...], frozenset[bytes]] | None = None

    def bind_tenant(self) -> None:
        """Record the tenant of this client's own namespace (at REGISTER)."""
        if self.tenants is not None:
            self.tenants.bind(self.digest, tenant_name(self.namespace.tenant_salt))

    def digest_for(self, salt: str, store: bool = False) -> bytes:
        """The namespace digest of this client's keys under a per-request cache salt;
        ``store``: for chunks to be stored, which are charged to the salt's tenant (bound
        then, not at lookups: a tenant id is for good, and lookups of made-up salts used
        them all up, sending every later tenant to ~other)."""
        if not salt:
            return self.digest
        digest = self.salted.get(salt)
        if digest is not None:
            # The most recently used last, moved in one step: the digests never lack it
            # (Registry.engine_namespaces may read them meanwhile, and keeps what it read).
            self.salted.move_to_end(salt)
        else:
            digest = msgspec.structs.replace(self.namespace, cache_salt=salt).digest()
            if len(self.salted) >= MAX_SALTS:
                # The least recently used half at once: forgetting shrinks the namespaces
                # the chunk feed covers, and each shrink makes the engine read a snapshot.
                # (Forgetting all at once withdrew every salt's chunks from the routers.)
                for old in list(self.salted)[: MAX_SALTS // 2]:
                    self.salted.pop(old, None)
            self.salted[salt] = digest
            self.salts_changed += 1  # (after the change: a reader's stamp is never newer)
        if store and self.tenants is not None:  # (a dict lookup once bound)
            self.tenants.bind(digest, tenant_name(self.namespace.tenant_salt, salt))
        return digest


def _check_same_engine(member: Registration, reg: Registration) -> None:
    """Raise GroupConflict unless ``reg`` can be of the engine ``member`` is of."""
    mine, theirs = reg.namespace, member.namespace
    if mine.tenant_salt != theirs.tenant_salt:
        same = False
    elif reg.role == p.ROLE_SCHEDULER and member.role == p.ROLE_SCHEDULER:
        same = mine.model == theirs.model
    elif reg.role == p.ROLE_SCHEDULER:
        same = keys.is_of_model(theirs.model, mine.model)
    elif member.role == p.ROLE_SCHEDULER:
        same = keys.is_of_model(mine.model, theirs.model)
    else:
        same = (mine.model, mine.world_size) == (theirs.model, theirs.world_size)
    if not same:
        raise GroupConflict(
            f"engine id {reg.engine_id!r} is registered by an engine of another model, "
            "world size or tenant: give each engine instance its own engine id"
        )


def _same_rank(member: Registration, reg: Registration) -> bool:
    """Whether ``member`` is a worker of ``reg``'s engine id and rank."""
    return (
        member.engine_id == reg.engine_id
        and member.role != p.ROLE_SCHEDULER
        and member.namespace.rank == reg.namespace.rank
    )


def _check_replaceable(old: Registration, reg: Registration) -> None:
    """Raise GroupConflict if ``old``'s rank is held by a running process other than
    ``reg``'s (a process the server watches; others are taken to be gone)."""
    if old.process is not None and old.pid != reg.pid and old.process.alive():
        raise GroupConflict(
            f"rank {old.namespace.rank} of engine {reg.engine_id!r} is registered by a "
            f"running process (pid {old.pid}): give each engine instance its own engine id"
        )


class ClientRegistry:
    """The registrations of one server. Thread-safe."""

    def __init__(
        self,
        index: ObjectIndex,
        sessions: LookupSessions,
        clock: Callable[[], float],
        *,
        idle_ttl: float,
        max_clients: int,
    ) -> None:
        self.index = index
        self.sessions = sessions
        self.clock = clock
        self.idle_ttl = idle_ttl
        self.max_clients = max_clients
        self._lock = threading.Lock()
        self._clients: dict[int, Registration] = {}
        self._groups: dict[str, dict[int, Registration]] = {}  # engine_id -> workers by token
        self.on_change: list[Callable[[], None]] = []  # called after a client came or went
        self.reaped = 0  # watched clients dropped because their process exited
        self.expired = 0  # unwatched clients dropped after idle_ttl

    def __len__(self) -> int:
        return len(self._clients)

    def __contains__(self, token: object) -> bool:
        return token in self._clients

    def get(self, token: int) -> Registration | None:
        """The registration of ``token`` (None if unknown); marks it as seen now."""
        reg = self._clients.get(token)
        if reg is not None:
            reg.last_seen = self.clock()
        return reg

    def add(self, reg: Registration) -> list[Registration]:
        """Record ``reg``; returns the registrations it replaced (already dropped)."""
        scheduler = reg.role == p.ROLE_SCHEDULER
        checked: set[int] = set()  # the registrations of reg's rank, not held by a process
        if reg.engine_id and not scheduler:
            with self._lock:
                olds = [c for c in self._clients.values() if _same_rank(c, reg)]
            for old in olds:  # reads /proc: not under the lock
                _check_replaceable(old, reg)
                checked.add(old.token)
        with self._lock:
            if len(self._clients) >= self.max_clients:
                raise RegistryFull(
                    f"{len(self._clients)} clients are registered, the most this server "
                    "accepts (--max-clients); unregister idle ones or raise the limit"
                )
            rank = reg.namespace.rank
            replaced: list[Registration] = []
            if reg.engine_id:
                members = [c for c in self._clients.values() if c.engine_id == reg.engine_id]
                for member in members:
                    _check_same_engine(member, reg)
                if not scheduler:
                    replaced = [c for c in members if _same_rank(c, reg)]
                    if any(c.token not in checked for c in replaced):
                        raise GroupConflict(f"engine {reg.engine_id!r} changed: register again")
            group = self._groups.setdefault(reg.engine_id, {}) if reg.engine_id else {}
            self._clients[reg.token] = reg
            if reg.engine_id and not scheduler:
                group[reg.token] = reg
            elif reg.engine_id and not group:
                del self._groups[reg.engine_id]
        self._changed()
        for old in replaced:
            freed, released = self.drop(old)
            log.warning(
                "client %s registered again as rank %d of engine %s: replaced its earlier "
                "registration (released %d write, %d read locks)",
                reg.name or "-",
                rank,
                reg.engine_id,
                freed,
                released,
            )
        return replaced

    def drop(self, reg: Registration) -> tuple[int, int]:
        """Forget a client: its sessions, its registry entries and every lock it holds;
        returns (write slots freed, read locks released)."""
        self.sessions.drop_holder(reg.token)
        with self._lock:
            self._clients.pop(reg.token, None)
            group = self._groups.get(reg.engine_id)
            if group is not None:
                group.pop(reg.token, None)
                if not group:
                    del self._groups[reg.engine_id]
        self._changed()
        return self.index.release_holder(reg.token)

    def _changed(self) -> None:
        for listener in self.on_change:
            listener()

    def namespaces(self) -> list[tuple[bytes, str, int, int, int]]:
        """The namespaces the registered workers store in: (digest, model, tokens per
        chunk, world size, rank), each once."""
        with self._lock:
            clients = list(self._clients.values())
        out: dict[bytes, tuple[bytes, str, int, int, int]] = {}
        for c in clients:
            if c.chunk_tokens > 0:
                ns = c.namespace
                out[c.digest] = (c.digest, ns.model, c.chunk_tokens, ns.world_size, ns.rank)
        return list(out.values())

    def workers(self, engine_id: str) -> list[Registration]:
        """The workers of an engine, by rank."""
        with self._lock:
            group = list(self._groups.get(engine_id, {}).values())
        return sorted(group, key=lambda c: c.namespace.rank)

    def engine_namespaces(self, reg: Registration) -> frozenset[bytes]:
        """A client's namespace digests: its own and its cache salts', and those of the other
        ranks of its engine (one engine's cache is cleared as a whole). The same set while
        neither the members nor their salts changed: each chunk-feed read asks (on the RPC
        loop), and building it anew cost ~3 ms for 8 ranks of 4096 salts."""
        with self._lock:
            group = self._groups.get(reg.engine_id, {}) if reg.engine_id else {}
            members = [reg, *group.values()]
            stamp = tuple((c.token, c.salts_changed) for c in members)  # (read first)
            cached = reg.namespaces_cache
            if cached is not None and cached[0] == stamp:
                return cached[1]
            namespaces = frozenset(d for c in members for d in (c.digest, *c.salted.values()))
            reg.namespaces_cache = (stamp, namespaces)
            return namespaces

    def reap(self) -> int:
        """Drop watched clients whose process has exited and unwatched ones idle for longer
        than ``idle_ttl``: their write reservations and read locks are released now."""
        cutoff = self.clock() - self.idle_ttl
        with self._lock:
            clients = list(self._clients.values())
        dropped = 0
        for reg in clients:
            if reg.process is not None:
                if reg.process.alive():
                    continue
                why = f"(pid {reg.process.pid}) exited without unregistering"
                self.reaped += 1
            elif reg.last_seen < cutoff:
                why = f"(pid {reg.pid}) sent nothing for {self.idle_ttl:g} s (--client-idle-ttl)"
                self.expired += 1
            else:
                continue
            if reg.token not in self._clients:
                continue
            freed, released = self.drop(reg)
            dropped += 1
            log.warning(
                "client %s %s: released %d write reservations and %d read locks",
                reg.name or "-",
                why,
                freed,
                released,
            )
        return dropped

    def snapshot(self) -> list[p.EngineInfo]:
        """The registered clients as status reports show them (the tenant salt hashed)."""
        now = self.clock()
        with self._lock:
            clients = list(self._clients.values())
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
                sessions=self.sessions.count_of(c.token),
            )
            for c in clients
        ]


def _tenant_tag(salt: str) -> str:
    """Tells tenants apart in status reports without showing their salt ("" for none)."""
    return tenant_tag(salt) if salt else ""
