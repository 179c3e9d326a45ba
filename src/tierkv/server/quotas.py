"""Tenant quotas of one server: what they are, how they are changed, where they are kept.

A quota caps the pool bytes one tenant (:mod:`tierkv.tenants`) may hold. Tenants without a
quota get the default, an explicit setting: ``unlimited`` (the default) or a size. In soft
mode (the default) a tenant may store beyond its quota and the eviction thread then evicts
that tenant's own least recently used chunks down to it (within one eviction interval); in
hard mode its stores beyond the quota are refused, reported like a full pool (skipped,
never an error) and counted. The other tenants' chunks are never touched either way.

Quotas come from the configuration (``--quota NAME=SIZE``, ``quotas:`` in YAML,
``--default-quota``, ``--quota-mode``) and are changed live (HTTP ``/quota``, ``tierkv
quota``). Live changes are kept in the quota file (JSON, written to a temporary file and
renamed) and applied over the configuration at the next start, so they survive a restart;
a tenant's live change (a limit, or the removal of a configured one) wins over the
configuration's value for that tenant.

Only the pool has quotas so far; :data:`TIERS` names what a quota may limit.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Mapping
from typing import Any

import msgspec

from tierkv import protocol as p
from tierkv.index import ObjectIndex
from tierkv.options import OptionError, parse_size
from tierkv.tenants import RESERVED, TenantIds, tenant_tag

log = logging.getLogger(__name__)

TIERS = ("pool",)  # what a quota limits (tiers below the pool: not yet)
MODES = ("soft", "hard")
UNLIMITED = "unlimited"
GIB = 2**30
MAX_NAME = 1024  # characters of a tenant name (a salt's limit)
TOP_TENANTS = 32  # tenants shown one by one in status reports; the rest in one row


class QuotaError(ValueError):
    """A quota request or setting that cannot be applied; the message says why."""


class QuotaFile(msgspec.Struct, forbid_unknown_fields=True):
    """The live changes kept across restarts."""

    version: int = 1
    limits: dict[str, int | None] = {}  # tenant -> bytes; None: a configured quota removed
    default_set: bool = False
    default_limit: int | None = None  # None: unlimited
    mode: str = ""  # "" : the configuration's


def parse_limit(value: Any, what: str = "limit") -> int:
    """Bytes from a JSON or YAML value: an integer number of bytes or a size ("8GiB").
    Negative, NaN, infinite, fractional-byte and non-numeric values are refused."""
    if isinstance(value, bool) or value is None:
        raise QuotaError(f"{what} must be a number of bytes or a size like '8GiB', not {value!r}")
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0 or not value.is_integer():
            raise QuotaError(f"{what} must be a whole, finite number of bytes >= 0, not {value}")
        return int(value)
    if isinstance(value, int):
        if value < 0:
            raise QuotaError(f"{what} must be >= 0 bytes, not {value}")
        return value
    if isinstance(value, str):
        try:
            return parse_size(value)
        except OptionError as exc:
            raise QuotaError(f"{what}: {exc}") from None
    raise QuotaError(f"{what} must be a number of bytes or a size like '8GiB', not {value!r}")


def parse_gb(value: Any) -> int:
    """Bytes from LMCache's ``limit_gb`` (GiB, a finite number >= 0)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise QuotaError(f"limit_gb must be a number, not {value!r}")
    if not math.isfinite(value) or value < 0:
        raise QuotaError(f"limit_gb must be a finite number >= 0, not {value}")
    return int(value * GIB)


def parse_default(value: Any) -> int | None:
    """The default quota: ``"unlimited"`` (or null) gives None, else bytes."""
    if value is None or (isinstance(value, str) and value.strip().lower() == UNLIMITED):
        return None
    return parse_limit(value, "default limit")


def check_name(name: str) -> str:
    if not isinstance(name, str) or not name:
        raise QuotaError("a tenant name must be a non-empty string")
    if len(name) > MAX_NAME:
        raise QuotaError(f"a tenant name is at most {MAX_NAME} characters")
    return name


def tenant_limit(body: Any) -> int:
    """The pool limit a ``PUT /quota/{tenant}`` body sets: ``{"limit_gb": x}`` (LMCache's
    form, GiB), ``{"limit": bytes or "8GiB"}``, or ``{"limits": {"pool": ...}}``."""
    if not isinstance(body, dict):
        raise QuotaError('body must be a JSON object such as {"limit_gb": 8} or {"limit": "8GiB"}')
    unknown = sorted(set(body) - {"limit", "limit_gb", "limits"})
    if unknown:
        raise QuotaError(f"unknown field(s) {unknown}; give 'limit', 'limit_gb' or 'limits'")
    given = [k for k in ("limit", "limit_gb", "limits") if k in body]
    if len(given) != 1:
        raise QuotaError("give exactly one of 'limit', 'limit_gb' or 'limits'")
    if "limit_gb" in body:
        return parse_gb(body["limit_gb"])
    if "limit" in body:
        return parse_limit(body["limit"])
    limits = body["limits"]
    if not isinstance(limits, dict) or not limits:
        raise QuotaError('limits must be an object of tier -> size, e.g. {"pool": "8GiB"}')
    bad = sorted(set(limits) - set(TIERS))
    if bad:
        raise QuotaError(f"unknown tier(s) {bad}: quotas limit {', '.join(TIERS)} (tiers below "
                         "the pool have no quotas yet)")  # fmt: skip
    return parse_limit(limits["pool"], "limits.pool")


class Quotas:
    """The quotas of one server, pushed into its index. Thread-safe."""

    def __init__(
        self,
        index: ObjectIndex,
        tenants: TenantIds,
        *,
        limits: Mapping[str, int],
        default: int | None,
        mode: str,
        path: str = "",
    ) -> None:
        """``limits``, ``default``, ``mode``: the configuration's; ``path``: the quota file
        ("" keeps live changes in memory only)."""
        if mode not in MODES:
            raise QuotaError(f"quota mode must be 'soft' or 'hard', not {mode!r}")
        self.index = index
        self.tenants = tenants
        self.path = path
        self._lock = threading.Lock()
        self._file_lock = threading.Lock()  # orders writers of the quota file (admin only)
        self._configured = {check_name(n): v for n, v in limits.items()}
        self._limits = dict(self._configured)
        self._default = default
        self._mode = mode
        self._live = QuotaFile()
        self._seq = 0
        self._written = 0

    # -- start -----------------------------------------------------------------------------
    def load(self) -> None:
        """Apply the quota file's live changes over the configuration, then push."""
        if self.path and os.path.exists(self.path):
            try:
                with open(self.path, "rb") as fh:
                    live = msgspec.json.decode(fh.read(), type=QuotaFile)
            except (OSError, msgspec.DecodeError) as exc:
                raise QuotaError(f"cannot read the quota file {self.path}: {exc}") from None
            for name, limit in live.limits.items():
                if limit is None:
                    self._limits.pop(name, None)
                else:
                    self._limits[name] = limit
            if live.default_set:
                self._default = live.default_limit
            if live.mode in MODES:
                self._mode = live.mode
            self._live = live
            log.info("quotas: %d live changes from %s", len(live.limits), self.path)
        self._push()

    # -- changes ---------------------------------------------------------------------------
    def set(self, name: str, limit: int) -> None:
        check_name(name)
        if limit < 0:
            raise QuotaError("a quota must be >= 0 bytes")
        with self._lock:
            self._limits[name] = limit
            self._live.limits[name] = limit
        self._changed()
        log.info("quota of tenant %s set to %d bytes", tenant_tag(name), limit)

    def delete(self, name: str) -> bool:
        """Remove a tenant's quota (it gets the default); False if it had none."""
        check_name(name)
        with self._lock:
            if name not in self._limits:
                return False
            del self._limits[name]
            if name in self._configured:
                self._live.limits[name] = None
            else:
                self._live.limits.pop(name, None)
        self._changed()
        log.info("quota of tenant %s removed", tenant_tag(name))
        return True

    def configure(self, default: int | str | None = "", mode: str = "") -> None:
        """Change the default quota (None: unlimited; "": unchanged) and/or the mode."""
        if mode and mode not in MODES:
            raise QuotaError(f"mode must be 'soft' or 'hard', not {mode!r}")
        with self._lock:
            if not isinstance(default, str):
                self._default = default
                self._live.default_set = True
                self._live.default_limit = default
            if mode:
                self._mode = mode
                self._live.mode = mode
        self._changed()

    # -- reading ---------------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        with self._lock:
            return {"default_limit": _shown(self._default), "mode": self._mode}

    def limit_of(self, name: str) -> tuple[int | None, str]:
        """(the tenant's limit, "quota" or "default")."""
        with self._lock:
            if name in self._limits:
                return self._limits[name], "quota"
            return self._default, "default"

    def named(self) -> dict[str, int]:
        with self._lock:
            return dict(self._limits)

    def tenant(self, name: str) -> dict[str, Any]:
        """GET /quota/{tenant}: its limit and usage."""
        limit, source = self.limit_of(name)
        tid = self.tenants.find(name)
        figures = {f.tenant: f for f in self.index.tenant_figures()}
        f = figures.get(tid) if tid is not None else None
        return {
            "tenant": name,
            "tag": tenant_tag(name),
            "limit": limit,
            "limit_gb": None if limit is None else limit / GIB,
            "source": source,
            "usage": {"pool": f.used if f else 0},
            "evictions": f.evictions if f else 0,
            "evicted_bytes": f.evicted_bytes if f else 0,
            "refused_chunks": f.refused_chunks if f else 0,
            "refused_bytes": f.refused_bytes if f else 0,
        }

    def listing(self) -> dict[str, Any]:
        """GET /quota: the settings and every tenant with a quota or with chunks. Tenants
        without a quota are shown by tag only (their names are salts, which let an engine
        read the tenant's KV); tenants with one by the name the quota was set under."""
        named = self.named()
        shown: dict[str, dict[str, Any]] = {n: self.tenant(n) for n in named}
        for f in self.index.tenant_figures():
            name = self.tenants.name_of(f.tenant)
            if name in shown:
                continue
            row = self.tenant(name)
            if name not in RESERVED:
                row["tenant"] = None
            shown[name] = row
        return {**self.config(), "tenants": list(shown.values())}

    def rows(self, top: int = TOP_TENANTS) -> list[p.TenantInfo]:
        """The tenants as status reports show them: the ``top`` largest, then one ``rest``
        row summing the others (so Prometheus series stay bounded)."""
        named = self.named()
        rows: list[p.TenantInfo] = []
        for f in self.index.tenant_figures():
            name = self.tenants.name_of(f.tenant)
            rows.append(
                p.TenantInfo(
                    tag=tenant_tag(name),
                    name=name if name in named or name in RESERVED else "",
                    used=f.used,
                    limit=-1 if f.limit is None else f.limit,
                    limit_source="quota" if name in named else "default",
                    evictions=f.evictions,
                    evicted_bytes=f.evicted_bytes,
                    refused_chunks=f.refused_chunks,
                    refused_bytes=f.refused_bytes,
                )
            )
        rows.sort(key=lambda r: r.used, reverse=True)
        if len(rows) <= top:
            return rows
        rest = rows[top:]
        total = p.TenantInfo("rest", "", 0, -1, "default", 0, 0, 0, 0, len(rest))
        for r in rest:
            total.used += r.used
            total.evictions += r.evictions
            total.evicted_bytes += r.evicted_bytes
            total.refused_chunks += r.refused_chunks
            total.refused_bytes += r.refused_bytes
        return [*rows[:top], total]

    def settings(self) -> tuple[str, int]:
        """(mode, default limit in bytes or -1 for unlimited)."""
        with self._lock:
            return self._mode, -1 if self._default is None else self._default

    # -- internals -------------------------------------------------------------------------
    def _push(self) -> None:
        with self._lock:
            limits = {self.tenants.id_of(n): v for n, v in self._limits.items()}
            default, hard = self._default, self._mode == "hard"
        self.index.set_quotas(limits, default, hard)

    def _changed(self) -> None:
        self._push()
        self._save()

    def _save(self) -> None:
        """Write the live changes (the latest state, once per change at most)."""
        if not self.path:
            return
        with self._lock:
            self._seq += 1
        with self._file_lock:
            with self._lock:
                if self._written >= self._seq:
                    return  # a later call already wrote this state
                seq = self._seq
                data = msgspec.json.encode(self._live)
            tmp = f"{self.path}.tmp"
            os.makedirs(os.path.dirname(self.path) or ".", mode=0o700, exist_ok=True)
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
            self._written = seq


def _shown(limit: int | None) -> int | str:
    return UNLIMITED if limit is None else limit
