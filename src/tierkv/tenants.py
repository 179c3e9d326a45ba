"""Tenants: whom a chunk in the pool belongs to, derived from what its key already carries.

A tenant is named by a salt string, the one the operator gave the engine or the request:

- an engine's tenant salt (REGISTER's ``tenant_salt``, the vLLM connector's and the SGLang
  backend's ``tenant``) names the tenant of every chunk that engine stores; a per-request
  cache salt then only separates keys inside that tenant (an engine assigned to a tenant
  cannot leave its quota by salting its requests);
- for an engine without a tenant salt, a request's cache salt names the tenant (LMCache
  names quotas by cache salt);
- chunks with neither belong to the default tenant, :data:`DEFAULT_TENANT` (``~default``).

Two more names are reserved: :data:`OTHER_TENANT` (``~other``) holds chunks the server
cannot attribute (a namespace no engine registered here, or tenants beyond
:data:`MAX_TENANTS`). No salt may equal a reserved name (REGISTER and requests refuse it),
so the names can never collide with a real tenant's.

A chunk stored under a namespace before it is bound (a cluster peer's promote, or a
prefetch, before the local engine registered) is charged to ``~other`` until the binding:
then the pool's index moves its charge to the tenant (:meth:`TenantIds.watch`), as the
tiers, which attribute by namespace when asked, do by themselves.

Keys carry only the 16-byte namespace digest, never the salt, so :class:`TenantIds` maps
digest -> tenant when a digest is made (at REGISTER, and when a cache salt's digest is
first made): the index then charges each chunk to its tenant with one dict lookup on the
key's first half. Tenants get small integer ids; ids are never reused.

The pool (:class:`~tierkv.index.ObjectIndex`) and each tier below it
(:class:`~tierkv.server.tiering.tier_quotas.TierQuota`) keep their tenants' quota settings
and what those quotas did in a :class:`TenantTally`, and report each tenant as a
:class:`TenantFigures` row.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from tierkv.keys import DIGEST_SIZE

DEFAULT_TENANT = "~default"
OTHER_TENANT = "~other"
RESERVED = frozenset({DEFAULT_TENANT, OTHER_TENANT})
DEFAULT_ID = 0
OTHER_ID = 1
MAX_TENANTS = 65536  # tenant ids at most; chunks of tenants beyond it count as ~other
MAX_DIGESTS = 1 << 20  # namespace digests mapped at most; beyond it, ~other


def tenant_name(tenant_salt: str, cache_salt: str = "") -> str:
    """The tenant of the keys of an engine with ``tenant_salt`` under ``cache_salt``."""
    return tenant_salt or cache_salt or DEFAULT_TENANT


def salt_error(what: str, salt: str) -> str | None:
    """Why ``salt`` cannot be used (it is a reserved tenant name), or None."""
    if salt in RESERVED:
        return f"{what} {salt!r} is reserved for tierkv's own tenants; pick another"
    return None


def tenant_tag(name: str) -> str:
    """A short hash that tells tenants apart in reports without showing their salt."""
    return "sha256:" + hashlib.sha256(name.encode()).hexdigest()[:12]


class TenantIds:
    """Tenant names <-> small ids, and namespace digest -> tenant id. Thread-safe; the
    index reads :attr:`by_digest` without a lock (one dict lookup, atomic in CPython)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._names: list[str] = [DEFAULT_TENANT, OTHER_TENANT]
        self._ids: dict[str, int] = {DEFAULT_TENANT: DEFAULT_ID, OTHER_TENANT: OTHER_ID}
        self.by_digest: dict[bytes, int] = {}
        self._digests: dict[int, list[bytes]] = {}  # tenant id -> its namespace digests
        self._watchers: list[Callable[[bytes, int], object]] = []

    def watch(self, watcher: Callable[[bytes, int], object]) -> None:
        """Call ``watcher(digest, tenant id)`` after each new binding (not under this
        object's lock, after :attr:`by_digest` has it): the pool's index moves what it
        charged to ``~other`` under that digest before the binding to the tenant."""
        self._watchers.append(watcher)

    def __len__(self) -> int:
        return len(self._names)

    def id_of(self, name: str) -> int:
        """The id of tenant ``name``, given one now if it has none (``~other`` beyond
        :data:`MAX_TENANTS`)."""
        tid = self._ids.get(name)
        if tid is not None:
            return tid
        with self._lock:
            tid = self._ids.get(name)
            if tid is None:
                if len(self._names) >= MAX_TENANTS:
                    return OTHER_ID
                tid = len(self._names)
                self._names.append(name)
                self._ids[name] = tid
            return tid

    def find(self, name: str) -> int | None:
        """The id of tenant ``name`` if it has one (no id is given)."""
        return self._ids.get(name)

    def name_of(self, tid: int) -> str:
        return self._names[tid]

    def bind(self, digest: bytes, name: str) -> int:
        """Record that keys under namespace ``digest`` belong to tenant ``name``; the
        watchers hear of a new binding (:meth:`watch`)."""
        if len(digest) != DIGEST_SIZE:
            raise ValueError(f"a namespace digest is {DIGEST_SIZE} bytes")
        tid = self.by_digest.get(digest)
        if tid is not None:
            return tid
        tid = self.id_of(name)
        with self._lock:
            if digest in self.by_digest:
                return self.by_digest[digest]
            if len(self.by_digest) >= MAX_DIGESTS:
                return OTHER_ID
            self.by_digest[digest] = tid
            self._digests.setdefault(tid, []).append(digest)
        for watcher in self._watchers:
            watcher(digest, tid)
        return tid

    def digests_of(self, tid: int) -> list[bytes]:
        """The namespace digests bound to tenant ``tid`` (none for ``~other``, whose
        digests are the ones nobody bound)."""
        with self._lock:
            return list(self._digests.get(tid, ()))

    def of_key(self, key: bytes) -> int:
        """The tenant id a key is charged to."""
        return self.by_digest.get(key[:DIGEST_SIZE], OTHER_ID)


@dataclass(frozen=True, slots=True)
class TenantFigures:
    """One tenant's share of a place: the pool (bytes are aligned slot sizes, as the pool
    counts) or a tier (bytes as the tier counts them: files, headers in)."""

    tenant: int  # id in the place's TenantIds
    used: int  # the pool: bytes of its slots (being written, ready, or deleted but held)
    limit: int | None  # its quota (the default's where it has none); None: unlimited
    evictions: int  # its chunks evicted (the pool: by the watermark or by its quota)
    evicted_bytes: int
    refused_chunks: int  # its new chunks refused by a hard quota
    refused_bytes: int


class TenantTally:
    """The tenant quotas of one place (the pool or a tier) and what they did there: the
    limits (tenant id -> bytes), the default limit of every other tenant (None: unlimited),
    hard or soft, and per tenant the chunks (and bytes) evicted and refused.

    Not locked: its owner's lock guards every call. Hot paths may read :attr:`limits`,
    :attr:`default` and :attr:`hard` and update the counter dicts directly."""

    __slots__ = (
        "default",
        "evicted_bytes",
        "evictions",
        "hard",
        "limits",
        "refused_bytes",
        "refused_chunks",
        "unlimited",
    )

    def __init__(self, unlimited: Collection[int] = ()) -> None:
        """``unlimited``: tenants no limit ever applies to (not even the default)."""
        self.limits: dict[int, int] = {}
        self.default: int | None = None
        self.hard = False
        self.unlimited = frozenset(unlimited)
        self.evictions: dict[int, int] = {}
        self.evicted_bytes: dict[int, int] = {}
        self.refused_chunks: dict[int, int] = {}
        self.refused_bytes: dict[int, int] = {}

    def set_limits(self, limits: Mapping[int, int], default: int | None, hard: bool) -> None:
        """Replace the settings (``{}`` and None: no quotas); the counters are kept."""
        self.limits = dict(limits)
        self.default = default
        self.hard = hard

    @property
    def limited(self) -> bool:
        """Whether some tenant has a limit (its own or the default)."""
        return bool(self.limits) or self.default is not None

    def limit_of(self, tid: int) -> int | None:
        """The limit that applies to tenant ``tid``: its own, else the default."""
        if tid in self.unlimited:
            return None
        return self.limits.get(tid, self.default)

    def count_eviction(self, tid: int, nbytes: int, chunks: int = 1) -> None:
        self.evictions[tid] = self.evictions.get(tid, 0) + chunks
        self.evicted_bytes[tid] = self.evicted_bytes.get(tid, 0) + nbytes

    def count_refusal(self, tid: int, nbytes: int, chunks: int = 1) -> None:
        self.refused_chunks[tid] = self.refused_chunks.get(tid, 0) + chunks
        self.refused_bytes[tid] = self.refused_bytes.get(tid, 0) + nbytes

    def copy(self) -> TenantTally:
        """A copy to read figures from without the owner's lock: its dicts are copied (one
        C-level pass each, cheap under the lock), the rows are built from it after."""
        out = TenantTally(self.unlimited)
        out.limits, out.default, out.hard = dict(self.limits), self.default, self.hard
        out.evictions, out.evicted_bytes = dict(self.evictions), dict(self.evicted_bytes)
        out.refused_chunks, out.refused_bytes = dict(self.refused_chunks), dict(self.refused_bytes)
        return out

    def figures(
        self, used: Mapping[int, int], between: Callable[[], None] = lambda: None
    ) -> list[TenantFigures]:
        """A row for every tenant with bytes in ``used`` (tenant id -> bytes), a quota or a
        figure, in tenant id order; ``between`` is called between tenants (a server's
        check point, :mod:`tierkv.server.engine_first`)."""
        tids = sorted({*used, *self.limits, *self.evictions, *self.refused_chunks})
        rows = []
        for tid in tids:
            between()
            rows.append(self._row(tid, used))
        return rows

    def _row(self, tid: int, used: Mapping[int, int]) -> TenantFigures:
        return TenantFigures(
            tenant=tid,
            used=used.get(tid, 0),
            limit=self.limit_of(tid),
            evictions=self.evictions.get(tid, 0),
            evicted_bytes=self.evicted_bytes.get(tid, 0),
            refused_chunks=self.refused_chunks.get(tid, 0),
            refused_bytes=self.refused_bytes.get(tid, 0),
        )
