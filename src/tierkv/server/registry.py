"""Registered engine clients: one record per REGISTER, engine groups, and when a record goes.

A :class:`Registration` is the server's record of one client connection: a random token,
the namespace its keys live in, its chunk layout, and who it is. The workers of one engine
instance (one client per tensor-parallel rank) and its scheduler share an ``engine_id``:
that is an engine group, and a worker registering again for a rank its engine already has
replaces the earlier registration (a duplicate would leave the group unservable).

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

MAX_SALTS = 4096  # cache-salt digests remembered per registration (then forgotten at once)


class RegistryFull(Exception):
    """REGISTER beyond ``max_clients``."""


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
    salted: dict[str, bytes] = field(default_factory=dict)  # cache salt -> namespace digest
    chunk_tokens: int = 0  # tokens in one of its chunks (0: a scheduler, which has none)
    tenants: TenantIds | None = None  # where its digests are mapped to their tenant
    # Its last few token chains (namespace digest, full chunks' packed tokens, their keys),
    # newest first: see tierkv.server.chunk_keys.
    chains: list[tuple[bytes, bytes, list[bytes]]] = field(default_factory=list)
    # The namespaces its last chunk-feed snapshot covered (tierkv.server.chunk_feed): a
    # read of the feed after they changed (a new cache salt, a rank that joined or
    # registered again) is answered "resync".
    feed_namespaces: frozenset[bytes] | None = None

    def bind_tenant(self) -> None:
        """Record the tenant of this client's own namespace (at REGISTER)."""
        if self.tenants is not None:
            self.tenants.bind(self.digest, tenant_name(self.namespace.tenant_salt))

    def digest_for(self, salt: str) -> bytes:
        """The namespace digest of this client's keys under a per-request cache salt."""
        if not salt:
            return self.digest
        digest = self.salted.get(salt)
        if digest is None:
            tenant = self.namespace.tenant_salt
            ns = msgspec.structs.replace(
                self.namespace, tenant_salt=f"{len(tenant)}:{tenant}{salt}"
            )
            digest = ns.digest()
            if self.tenants is not None:
                self.tenants.bind(digest, tenant_name(tenant, salt))
            if len(self.salted) >= MAX_SALTS:
                self.salted.clear()
            self.salted[salt] = digest
        return digest


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
        with self._lock:
            if len(self._clients) >= self.max_clients:
                raise RegistryFull(
                    f"{len(self._clients)} clients are registered, the most this server "
                    "accepts (--max-clients); unregister idle ones or raise the limit"
                )
            group = self._groups.setdefault(reg.engine_id, {}) if reg.engine_id else {}
            rank = reg.namespace.rank
            replaced = [] if scheduler else [c for c in group.values() if c.namespace.rank == rank]
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

    def engine_namespaces(self, reg: Registration) -> set[bytes]:
        """A client's namespace digests: its own and its cache salts', and those of the other
        ranks of its engine (one engine's cache is cleared as a whole)."""
        with self._lock:
            group = self._groups.get(reg.engine_id, {}) if reg.engine_id else {}
            members = [reg, *group.values()]
            return {d for c in members for d in (c.digest, *c.salted.values())}

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
