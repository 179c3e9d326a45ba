"""Tenant quotas of one server: what they are, how they are changed, where they are kept.

A quota caps the bytes one tenant (:mod:`tierkv.tenants`) may hold in the pool and, with
a limit of its own, in the disk tier (:data:`TIERS`). Tenants without a quota get the
default of each tier, an explicit setting: ``unlimited`` (the default) or a size. In soft
mode (the default) a tenant may store beyond its quota and then loses its own least recently
used chunks down to it (in the pool: the eviction thread, within one eviction interval; on
disk: after each write-behind batch, see :mod:`tierkv.server.tiering.tier_quotas`); in hard
mode its stores beyond the quota are refused, reported like a full pool (skipped, never an
error; on disk: not written) and counted. The other tenants' chunks are never touched.

Quotas come from the configuration (``--quota NAME=SIZE``, ``quotas:`` in YAML,
``--default-quota``, ``--quota-mode``) and are changed live (HTTP ``/quota``, ``tierkv
quota``). Live changes are kept in the quota file (JSON, written to a temporary file and
renamed) and applied over the configuration at the next start, so they survive a restart;
a tenant's live change (a limit, or the removal of a configured one) wins over the
configuration's value for that tenant.

Redis and S3 have no tenant quotas: see :data:`tierkv.server.quota_values.NO_QUOTA`. Quota
values (sizes, names, request bodies) are parsed and checked in :mod:`tierkv.server.quota_values`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from tierkv import protocol as p
from tierkv.index import ObjectIndex
from tierkv.server.quota_values import (
    GIB,
    MODES,
    TIERS,
    UNLIMITED,
    QuotaError,
    check_name,
    parse_limit,
)
from tierkv.server.tenant_rest import RestRow
from tierkv.server.tiering.tier_quotas import TierQuota
from tierkv.tenants import (
    MAX_TENANTS,
    OTHER_ID,
    OTHER_TENANT,
    RESERVED,
    TenantFigures,
    TenantIds,
    tenant_tag,
)

log = logging.getLogger(__name__)

TOP_TENANTS = 32  # tenants shown one by one in status reports; the rest in one row


class QuotaFile(msgspec.Struct, forbid_unknown_fields=True):
    """The live changes kept across restarts."""

    version: int = 1
    limits: dict[str, int | None] = {}  # tenant -> pool bytes; None: a configured one removed
    default_set: bool = False
    default_limit: int | None = None  # None: unlimited
    mode: str = ""  # "" : the configuration's
    tier_limits: dict[str, dict[str, int | None]] = {}  # tier below the pool -> as limits
    tier_defaults: dict[str, int | None] = {}  # tier below the pool -> its default, if changed


def _check_change(name: str, tier: str, limit: int | None) -> None:
    """A change of tenant ``name``'s limit in ``tier`` (None: back to the default) that a
    server can apply (the name is checked already)."""
    if tier not in TIERS:
        raise QuotaError(f"unknown tier {tier!r}: quotas limit {', '.join(TIERS)}")
    if limit is not None:
        parse_limit(limit, f"the {tier} quota of {tenant_tag(name)}")
    if tier != "pool" and limit is not None and name == OTHER_TENANT:
        raise QuotaError(
            f"{OTHER_TENANT} holds the {tier} chunks whose tenant is not known yet "
            f"(after a restart, until their engine registers): it takes no {tier} quota"
        )


def _check_file(
    live: QuotaFile,
    changes: Mapping[str, Mapping[str, int | None]],
    defaults: Mapping[str, int | None],
) -> None:
    """The quota file's ``changes`` (tier -> tenant -> limit) and ``defaults`` (tier ->
    limit) checked as the API checks them, and its version and mode."""
    if live.version != 1:
        raise QuotaError(f"version {live.version}: this server reads version 1")
    if live.mode and live.mode not in MODES:
        raise QuotaError(f"mode {live.mode!r}: quota modes are {', '.join(MODES)}")
    for tier, limits in changes.items():
        for name, limit in limits.items():
            try:
                check_name(name)
            except QuotaError as exc:
                raise QuotaError(f"a {tier} quota: {exc}") from None
            _check_change(name, tier, limit)
    for tier, limit in defaults.items():
        if tier not in TIERS:
            raise QuotaError(
                f"a default for unknown tier {tier!r}: quotas limit {', '.join(TIERS)}"
            )
        if limit is not None:
            parse_limit(limit, f"the {tier} default")


class Quotas:
    """The quotas of one server, pushed into its index and its tiers' quotas. Thread-safe."""

    def __init__(
        self,
        index: ObjectIndex,
        tenants: TenantIds,
        *,
        limits: Mapping[str, Mapping[str, int]],
        defaults: Mapping[str, int | None],
        mode: str,
        path: str = "",
    ) -> None:
        """``limits`` (tier -> tenant -> bytes), ``defaults`` (tier -> bytes, None:
        unlimited; a tier not given: unlimited), ``mode``: the configuration's; ``path``:
        the quota file ("" keeps live changes in memory only)."""
        if mode not in MODES:
            raise QuotaError(f"quota mode must be 'soft' or 'hard', not {mode!r}")
        self.index = index
        self.tenants = tenants
        self.path = path
        self._lock = threading.Lock()
        self._push_turn = threading.Lock()  # one push of limits at a time (see _push)
        # Writers of the quota file take turns through this condition (on ``_lock``), with
        # no lock held while one writes: see :meth:`_save`.
        self._file_turn = threading.Condition(self._lock)
        self._writing = False
        self._configured = {
            t: {check_name(n): v for n, v in limits.get(t, {}).items()} for t in TIERS
        }
        self._limits = {t: dict(self._configured[t]) for t in TIERS}
        self._defaults = {t: defaults.get(t) for t in TIERS}
        self._mode = mode
        self._live: dict[str, dict[str, int | None]] = {t: {} for t in TIERS}
        self._live_defaults: dict[str, int | None] = {}
        self._live_mode = ""
        self._tiers: dict[str, TierQuota] = {}
        self._seq = 0
        self._written = 0
        self._rest = RestRow()  # the status reports' "rest" row

    # -- start -----------------------------------------------------------------------------
    def load(self) -> None:
        """Apply the quota file's live changes over the configuration, then push."""
        if self.path and os.path.exists(self.path):
            try:
                with open(self.path, "rb") as fh:
                    live = msgspec.json.decode(fh.read(), type=QuotaFile)
            except (OSError, msgspec.DecodeError) as exc:
                raise QuotaError(f"cannot read the quota file {self.path}: {exc}") from None
            changes = {"pool": live.limits, **live.tier_limits}
            defaults = dict(live.tier_defaults)
            if live.default_set:
                defaults["pool"] = live.default_limit
            try:
                _check_file(live, changes, defaults)
            except QuotaError as exc:  # a hand-edited file: checked as the API checks
                raise QuotaError(f"the quota file {self.path}: {exc}") from None
            for tier in TIERS:
                for name, limit in changes.get(tier, {}).items():
                    self._apply(tier, name, limit)
                if tier in defaults:
                    self._defaults[tier] = self._live_defaults[tier] = defaults[tier]
            if live.mode in MODES:
                self._mode = self._live_mode = live.mode
            log.info("quotas: %d live changes from %s", len(live.limits), self.path)
        self._push()

    def attach(self, quota: TierQuota) -> None:
        """Also push the quotas of ``quota``'s tier (one of :data:`TIERS`) into it."""
        if quota.name not in TIERS:
            raise QuotaError(f"tier {quota.name!r} has no quotas")
        self._tiers[quota.name] = quota
        self._push()

    # -- changes ---------------------------------------------------------------------------
    def set(self, name: str, limits: Mapping[str, int | None]) -> None:
        """Change tenant ``name``'s limits, tier -> bytes (None: back to the default); the
        tiers not named keep theirs."""
        check_name(name)
        for tier, limit in limits.items():
            _check_change(name, tier, limit)
        if name != OTHER_TENANT and self.tenants.id_of(name) == OTHER_ID:
            raise QuotaError(
                f"this server knows {MAX_TENANTS} tenants, the most it tells apart: a new "
                f"tenant's chunks count as {OTHER_TENANT}, whose quota is set by that name"
            )
        with self._lock:
            for tier, limit in limits.items():
                self._apply(tier, name, limit)
        self._changed()
        log.info("quota of tenant %s set: %s", tenant_tag(name), dict(limits))

    def delete(self, name: str) -> bool:
        """Remove a tenant's quota in every tier (it gets the defaults); False if it had
        none."""
        check_name(name)
        with self._lock:
            tiers = [t for t in TIERS if name in self._limits[t]]
            for tier in tiers:
                self._apply(tier, name, None)
        if not tiers:
            return False
        self._changed()
        log.info("quota of tenant %s removed", tenant_tag(name))
        return True

    def configure(self, defaults: Mapping[str, int | None] | None = None, mode: str = "") -> None:
        """Change the default quota of the tiers named (None: unlimited) and/or the mode."""
        if mode and mode not in MODES:
            raise QuotaError(f"mode must be 'soft' or 'hard', not {mode!r}")
        with self._lock:
            for tier, limit in (defaults or {}).items():
                if tier not in TIERS:
                    raise QuotaError(f"unknown tier {tier!r}: quotas limit {', '.join(TIERS)}")
                self._defaults[tier] = self._live_defaults[tier] = limit
            if mode:
                self._mode = self._live_mode = mode
        self._changed()

    # -- reading ---------------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        with self._lock:
            return {
                "default_limit": _shown(self._defaults["pool"]),
                "default_limits": {t: _shown(v) for t, v in self._defaults.items()},
                "mode": self._mode,
            }

    def limit_of(self, name: str, tier: str = "pool") -> tuple[int | None, str]:
        """(the tenant's limit in ``tier``, "quota" or "default")."""
        with self._lock:
            if name in self._limits[tier]:
                return self._limits[tier][name], "quota"
            if tier != "pool" and name == OTHER_TENANT:
                return None, "default"  # see tierkv.server.tiering.tier_quotas
            return self._defaults[tier], "default"

    def named(self) -> frozenset[str]:
        """The tenants with a quota of their own in some tier."""
        with self._lock:
            return frozenset(n for t in TIERS for n in self._limits[t])

    def tenant(self, name: str) -> dict[str, Any]:
        """GET /quota/{tenant}: its limits and usage, per tier."""
        return self._tenant_doc(name, *self._figures())

    def listing(self, between: Callable[[], None] = lambda: None) -> dict[str, Any]:
        """GET /quota: the settings and every tenant with a quota or with chunks. Tenants
        without a quota are shown by tag only (their names are salts, which let an engine
        read the tenant's KV); tenants with one by the name the quota was set under.
        ``between`` is called between tenants (the server's check point that lets engines'
        requests go first, :mod:`tierkv.server.engine_first`).

        Linear in the tenants: the figures of the pool and of each tier are read once (a
        read per tenant, each a pass over every tenant under the index's lock, made it
        quadratic and held engines' lookups behind that lock)."""
        named = self.named()
        pool, tiers = self._figures(between)
        shown: dict[str, dict[str, Any]] = {}
        for n in sorted(named):
            between()
            shown[n] = self._tenant_doc(n, pool, tiers)
        for tid in self._tenant_ids(pool, tiers):
            between()
            name = self.tenants.name_of(tid)
            if name in shown:
                continue
            row = self._tenant_doc(name, pool, tiers)
            if name not in RESERVED:
                row["tenant"] = None
            shown[name] = row
        return {**self.config(), "tenants": list(shown.values())}

    def rows(self, top: int = TOP_TENANTS) -> list[p.TenantInfo]:
        """The tenants as status reports show them: the ``top`` largest (pool bytes, then
        tier bytes), then one ``rest`` row summing the others (so Prometheus series stay
        bounded; its counters sum what the tenants' grew by while in it:
        :mod:`tierkv.server.tenant_rest`)."""
        named = self.named()
        pool = {f.tenant: f for f in self.index.tenant_figures()}
        tiers = {tier: quota.figures() for tier, quota in self._tiers.items()}
        rows: list[p.TenantInfo] = []
        for tid in self._tenant_ids(pool, tiers):
            name = self.tenants.name_of(tid)
            f = pool.get(tid)
            limit = f.limit if f else self.limit_of(name)[0]
            rows.append(
                p.TenantInfo(
                    tag=tenant_tag(name),
                    name=name if name in named or name in RESERVED else "",
                    used=f.used if f else 0,
                    limit=-1 if limit is None else limit,
                    limit_source="quota" if name in named else "default",
                    evictions=f.evictions if f else 0,
                    evicted_bytes=f.evicted_bytes if f else 0,
                    refused_chunks=f.refused_chunks if f else 0,
                    refused_bytes=f.refused_bytes if f else 0,
                    tiers={
                        tier: _tier_row(figures.get(tid), self.limit_of(name, tier)[0])
                        for tier, figures in tiers.items()
                    },
                )
            )
        rows.sort(key=lambda r: (r.used, sum(t.used for t in r.tiers.values())), reverse=True)
        if len(rows) <= top:
            self._rest.row(rows, [], list(tiers))  # (what each tenant's counters are now)
            return rows
        return [*rows[:top], self._rest.row(rows[:top], rows[top:], list(tiers))]

    def settings(self) -> tuple[str, int]:
        """(mode, default pool limit in bytes or -1 for unlimited)."""
        with self._lock:
            default = self._defaults["pool"]
            return self._mode, -1 if default is None else default

    # -- internals -------------------------------------------------------------------------
    def _figures(
        self, between: Callable[[], None] = lambda: None
    ) -> tuple[dict[int, TenantFigures], dict[str, dict[int, TenantFigures]]]:
        """The pool's figures and each tier's, by tenant id (one read of each)."""
        pool = {f.tenant: f for f in self.index.tenant_figures(between)}
        return pool, {tier: quota.figures() for tier, quota in self._tiers.items()}

    def _tenant_doc(
        self,
        name: str,
        pool: Mapping[int, TenantFigures],
        tiers: Mapping[str, Mapping[int, TenantFigures]],
    ) -> dict[str, Any]:
        """A tenant's document (:meth:`tenant`) from figures already read."""
        limit, source = self.limit_of(name)
        tid = self.tenants.find(name)
        f = pool.get(tid) if tid is not None else None
        doc: dict[str, Any] = {
            "tenant": name,
            "tag": tenant_tag(name),
            "limit": limit,
            "limit_gb": None if limit is None else limit / GIB,
            "source": source,
            "limits": {t: self.limit_of(name, t)[0] for t in TIERS},  # tier or not
            "usage": {"pool": f.used if f else 0},
            "evictions": f.evictions if f else 0,
            "evicted_bytes": f.evicted_bytes if f else 0,
            "refused_chunks": f.refused_chunks if f else 0,
            "refused_bytes": f.refused_bytes if f else 0,
            "tiers": {},
        }
        for tier, figures in tiers.items():
            tier_limit, tier_source = self.limit_of(name, tier)
            t = figures.get(tid) if tid is not None else None
            doc["usage"][tier] = t.used if t else 0
            doc["tiers"][tier] = {
                "limit": tier_limit,
                "source": tier_source,
                "used": t.used if t else 0,
                "evictions": t.evictions if t else 0,
                "evicted_bytes": t.evicted_bytes if t else 0,
                "refused_chunks": t.refused_chunks if t else 0,
                "refused_bytes": t.refused_bytes if t else 0,
            }
        return doc

    def _tenant_ids(
        self,
        pool: Mapping[int, object] | None = None,
        tiers: Mapping[str, Mapping[int, TenantFigures]] | None = None,
    ) -> list[int]:
        """Every tenant with a figure in the pool or a tier, in id order."""
        if pool is None:
            pool = {f.tenant: f for f in self.index.tenant_figures()}
        if tiers is None:
            tiers = {tier: quota.figures() for tier, quota in self._tiers.items()}
        return sorted({*pool, *(tid for figures in tiers.values() for tid in figures)})

    def _apply(self, tier: str, name: str, limit: int | None) -> None:
        """Set (or with None, remove) a tenant's limit in ``tier`` and note the live
        change (caller holds the lock, or is the start)."""
        if limit is not None:
            self._limits[tier][name] = limit
            self._live[tier][name] = limit
            return
        self._limits[tier].pop(name, None)
        if name in self._configured[tier]:
            self._live[tier][name] = None  # a configured quota removed: keep the removal
        else:
            self._live[tier].pop(name, None)

    def _push(self) -> None:
        """Give the index and the tiers the current limits. One push at a time, from its
        snapshot to its last tier: two changes at once otherwise could leave the older
        snapshot in force. A tenant name without an id (beyond MAX_TENANTS) is left out: its
        id would be ~other's."""
        with self._push_turn:
            with self._lock:
                ids = self.tenants.id_of
                limits = {t: _by_id(self._limits[t], ids) for t in TIERS}
                defaults, hard = dict(self._defaults), self._mode == "hard"
            self.index.set_quotas(limits["pool"], defaults["pool"], hard)
            for tier, quota in self._tiers.items():
                quota.set_limits(limits[tier], defaults[tier], hard)

    def _changed(self) -> None:
        self._push()
        self._save()

    def _file(self) -> QuotaFile:
        """The live changes as the quota file keeps them (caller holds the lock)."""
        pool_default = "pool" in self._live_defaults
        return QuotaFile(
            limits=dict(self._live["pool"]),
            default_set=pool_default,
            default_limit=self._live_defaults.get("pool"),
            mode=self._live_mode,
            tier_limits={t: dict(self._live[t]) for t in TIERS if t != "pool" and self._live[t]},
            tier_defaults={t: v for t, v in self._live_defaults.items() if t != "pool"},
        )

    def _save(self) -> None:
        """Write the live changes, returning once a state that includes this call's change
        is on disk (fsynced, then renamed over the file). One caller writes at a time, with
        no lock held during the I/O; a caller whose change a later write covered returns
        without writing."""
        if not self.path:
            return
        with self._file_turn:
            self._seq += 1
            mine = self._seq
            while self._writing and self._written < mine:
                self._file_turn.wait()
            if self._written >= mine:
                return  # a later call already wrote this state
            self._writing = True
            seq = self._seq
            data = msgspec.json.encode(self._file())
        written = False
        try:
            tmp = f"{self.path}.tmp"
            os.makedirs(os.path.dirname(self.path) or ".", mode=0o700, exist_ok=True)
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
            written = True
        finally:
            with self._file_turn:
                self._writing = False
                if written:
                    self._written = max(self._written, seq)
                self._file_turn.notify_all()


def _tier_row(f: TenantFigures | None, limit: int | None) -> p.TenantTierInfo:
    if f is None:
        return p.TenantTierInfo(0, -1 if limit is None else limit, 0, 0, 0, 0)
    return p.TenantTierInfo(
        used=f.used,
        limit=-1 if limit is None else limit,
        evictions=f.evictions,
        evicted_bytes=f.evicted_bytes,
        refused_chunks=f.refused_chunks,
        refused_bytes=f.refused_bytes,
    )


def _shown(limit: int | None) -> int | str:
    return UNLIMITED if limit is None else limit


def _by_id(limits: Mapping[str, int], id_of: Callable[[str], int]) -> dict[int, int]:
    """Limits by tenant name as limits by tenant id, leaving out names without an id of
    their own (``~other``'s is its own)."""
    out: dict[int, int] = {}
    for name, limit in limits.items():
        tid = id_of(name)
        if tid != OTHER_ID or name == OTHER_TENANT:
            out[tid] = limit
    return out
