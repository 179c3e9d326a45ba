"""Tenant quotas of a tier below the pool (the disk): the server-side policy.

The tier is a storage medium only: it keeps its bytes per namespace digest (the first 16
bytes of every key) and evicts the oldest files of a set of namespaces when told to
(:class:`NamespacedTier`). This module decides: it maps namespaces to tenants through the
server's :class:`~tierkv.tenants.TenantIds`, and

- after each write-behind batch to the tier (and at once when quotas change), evicts, for
  each tenant above its quota, that tenant's own least recently used chunks in the tier
  until it is back within it (soft and hard mode alike; no other tenant's chunk is
  touched);
- in hard mode, refuses a tenant's write-behind beyond its quota before it is written
  (:meth:`TierQuota.admit`): chunks in flight count until their batch is done, so
  concurrent batches never take a tenant past its quota; refusals are counted.

Tenants are known by namespace, and a namespace's tenant is learned when an engine
registers (or first uses a cache salt). After a restart the tier's files are indexed at
once, but their namespaces are unattributed until then: they are shown under ``~other``,
and ``~other`` has no quota on the tier, so a restart never makes the server evict files
before it knows whose they are. When an engine of that namespace registers, the files count
for its tenant again, and its quota applies from that tenant's next write-behind batch (or
the next quota change).
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from tierkv.keys import DIGEST_SIZE
from tierkv.tenants import OTHER_ID, TenantFigures, TenantIds, TenantTally
from tierkv.tiers.records import HEADER_SIZE


@runtime_checkable
class NamespacedTier(Protocol):
    """A tier that keeps its usage per namespace digest and can evict by namespace."""

    name: str

    def namespace_usage(self, namespaces: Iterable[bytes] | None = None) -> dict[bytes, int]: ...

    def evict_oldest(
        self, namespaces: Collection[bytes], nbytes: int
    ) -> list[tuple[bytes, int]]: ...

    def contains(self, keys: Sequence[bytes]) -> list[bool]: ...


@dataclass(slots=True)
class Admission:
    """What :meth:`TierQuota.admit` let through: item positions, and the bytes in flight
    per tenant until :meth:`TierQuota.done`."""

    admitted: list[int]
    inflight: dict[int, int]


class TierQuota:
    """Per-tenant quotas on one :class:`NamespacedTier`. Thread-safe; its lock is never
    held across the tier's I/O."""

    def __init__(self, tier: NamespacedTier, tenants: TenantIds) -> None:
        self.tier = tier
        self.tenants = tenants
        self._lock = threading.Lock()
        self._tally = TenantTally(unlimited=(OTHER_ID,))  # see the module docstring
        self._inflight: dict[int, int] = {}
        self._enforcing: set[int] = set()  # tenants a thread is bringing within quota
        self._again: set[int] = set()  # of those, ones another thread asked for meanwhile

    @property
    def name(self) -> str:
        return self.tier.name

    def set_limits(self, limits: dict[int, int], default: int | None, hard: bool) -> None:
        """Tenant id -> bytes, every other tenant's limit (None: unlimited), hard or soft;
        a tenant now above its quota loses its oldest chunks in the tier at once."""
        with self._lock:
            self._tally.set_limits(limits, default, hard)
        self.enforce()

    def limit_of(self, tid: int) -> int | None:
        with self._lock:
            return self._tally.limit_of(tid)

    def usage(self) -> dict[int, int]:
        """Bytes in the tier per tenant (unattributed namespaces under ``~other``)."""
        by_digest = self.tenants.by_digest
        out: dict[int, int] = {}
        for ns, nbytes in self.tier.namespace_usage().items():
            tid = by_digest.get(ns, OTHER_ID)
            out[tid] = out.get(tid, 0) + nbytes
        return out

    def used_by(self, tid: int) -> int:
        return sum(self.tier.namespace_usage(self.tenants.digests_of(tid)).values())

    def admit(self, items: Sequence[tuple[bytes, int]]) -> Admission:
        """Which of (key, payload bytes) may be written: all in soft mode; in hard mode
        those within their tenant's quota, counting what is in flight (chunks the tier
        already holds cost nothing). Pass the result to :meth:`done` after the write."""
        everything = Admission(list(range(len(items))), {})
        with self._lock:
            if not self._tally.hard or not self._tally.limited:
                return everything
        held = self.tier.contains([key for key, _ in items])
        by_digest = self.tenants.by_digest
        want: dict[int, list[int]] = {}
        for i, (key, _) in enumerate(items):
            if not held[i]:
                want.setdefault(by_digest.get(key[:DIGEST_SIZE], OTHER_ID), []).append(i)
        admission = Admission([i for i in range(len(items)) if held[i]], {})
        with self._lock:
            # Usage is read under the lock that in-flight bytes are counted under: a batch
            # that ends in between (its file counted in neither) cannot be missed. It is the
            # tier's in-memory index, no I/O.
            used = {tid: self.used_by(tid) for tid in want if tid != OTHER_ID}
            tally = self._tally
            for tid, positions in want.items():
                limit = tally.limit_of(tid)
                if limit is None:
                    admission.admitted += positions
                    continue
                room = limit - used[tid] - self._inflight.get(tid, 0)
                taken = 0
                for i in positions:
                    size = HEADER_SIZE + items[i][1]
                    if size <= room - taken:
                        taken += size
                        admission.admitted.append(i)
                    else:
                        tally.count_refusal(tid, size)
                if taken:
                    self._inflight[tid] = self._inflight.get(tid, 0) + taken
                    admission.inflight[tid] = taken
        admission.admitted.sort()
        return admission

    def done(self, admission: Admission, keys: Iterable[bytes]) -> None:
        """The admitted batch of ``keys`` was written (or failed): release what it held in
        flight, then bring its tenants back within their quotas."""
        with self._lock:
            for tid, nbytes in admission.inflight.items():
                left = self._inflight[tid] - nbytes
                if left:
                    self._inflight[tid] = left
                else:
                    del self._inflight[tid]
        by_digest = self.tenants.by_digest
        self.enforce({by_digest.get(key[:DIGEST_SIZE], OTHER_ID) for key in keys})

    def enforce(self, tids: Iterable[int] | None = None) -> int:
        """Evict, for each tenant of ``tids`` (None: every tenant with files) above its
        quota, its own least recently used chunks in the tier; returns chunks evicted."""
        if tids is None:
            tids = self.usage()
        evicted = 0
        for tid in tids:
            if tid == OTHER_ID:
                continue
            with self._lock:
                if tid in self._enforcing:  # one thread at a time per tenant, or both
                    self._again.add(tid)  # would evict the same excess
                    continue
                self._enforcing.add(tid)
            try:
                while True:
                    evicted += self._enforce_one(tid)
                    with self._lock:
                        if tid not in self._again:
                            break
                        self._again.discard(tid)
            finally:
                with self._lock:
                    self._enforcing.discard(tid)
        return evicted

    def _enforce_one(self, tid: int) -> int:
        limit = self.limit_of(tid)
        if limit is None:
            return 0
        digests = self.tenants.digests_of(tid)
        used = sum(self.tier.namespace_usage(digests).values())
        if used <= limit:
            return 0
        victims = self.tier.evict_oldest(digests, used - limit)
        with self._lock:
            self._tally.count_eviction(tid, sum(n for _, n in victims), len(victims))
        return len(victims)

    def figures(self) -> dict[int, TenantFigures]:
        """Every tenant with files, a quota or a figure in the tier, by tenant id (in id
        order); evictions count only the chunks this quota evicted from the tier."""
        usage = self.usage()
        with self._lock:
            tally = self._tally.copy()  # the rows built without the lock
        return {f.tenant: f for f in tally.figures(usage)}
