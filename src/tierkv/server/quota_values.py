"""Quota values as requests and configuration give them: parsed and checked.

Sizes (``8GiB`` or a number of bytes, LMCache's ``limit_gb``), the default (``unlimited``),
tenant names, and the bodies of ``PUT /quota`` (which tiers, which limits), each refused with
a :class:`QuotaError` that says why (negative, fractional, NaN, over 8 EiB, an unknown tier or
one that can have no quota). What the quotas then do is :mod:`tierkv.server.quotas`'.
"""

from __future__ import annotations

import math
from typing import Any

from tierkv.options import MAX_SIZE, OptionError, parse_size

TIERS = ("pool", "disk")  # what a quota limits
# Tiers that can have no quota, and why (the answer to a request naming them).
NO_QUOTA = {
    "redis": "Redis keeps no per-tenant usage tierkv can count exactly (keys expire and "
    "Redis evicts them on its own, other servers share it) and no LRU order tierkv controls",
    "s3": "S3 keeps no per-tenant usage tierkv can count exactly (lifecycle rules and "
    "other servers change the bucket) and no LRU order (it never evicts)",
}
MODES = ("soft", "hard")
UNLIMITED = "unlimited"
GIB = 2**30
MAX_LIMIT = MAX_SIZE  # bytes: a quota beyond it (8 EiB) is refused, not stored
MAX_NAME = 1024  # characters of a tenant name (a salt's limit)


class QuotaError(ValueError):
    """A quota request or setting that cannot be applied; the message says why."""


def parse_limit(value: Any, what: str = "limit") -> int:
    """Bytes from a JSON or YAML value: an integer number of bytes or a size ("8GiB").
    Negative, NaN, infinite, fractional-byte, non-numeric values and values above
    :data:`MAX_LIMIT` are refused."""
    if isinstance(value, bool) or value is None:
        raise QuotaError(f"{what} must be a number of bytes or a size like '8GiB', not {value!r}")
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0 or not value.is_integer():
            raise QuotaError(f"{what} must be a whole, finite number of bytes >= 0, not {value}")
        return _at_most_max(int(value), what)
    if isinstance(value, int):
        if value < 0:
            raise QuotaError(f"{what} must be >= 0 bytes, not {value}")
        return _at_most_max(value, what)
    if isinstance(value, str):
        try:
            return _at_most_max(parse_size(value), what)
        except OptionError as exc:
            raise QuotaError(f"{what}: {exc}") from None
    raise QuotaError(f"{what} must be a number of bytes or a size like '8GiB', not {value!r}")


def parse_gb(value: Any, what: str = "limit_gb") -> int:
    """Bytes from LMCache's ``limit_gb`` (GiB, a finite number >= 0, at most
    :data:`MAX_LIMIT` bytes)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise QuotaError(f"{what} must be a number, not {value!r}")
    if (isinstance(value, float) and not math.isfinite(value)) or value < 0:
        raise QuotaError(f"{what} must be a finite number >= 0, not {value}")
    if value > MAX_LIMIT // GIB:
        raise QuotaError(f"{what} must be at most {MAX_LIMIT // GIB} GiB, not {_brief(value)}")
    return _at_most_max(int(value * GIB), what)


def _brief(number: float) -> str:
    """A number for a message (a JSON integer may have thousands of digits)."""
    text = repr(number)
    return text if len(text) <= 24 else f"{text[:12]}...({len(text)} digits)"


def _at_most_max(limit: int, what: str) -> int:
    if limit > MAX_LIMIT:
        raise QuotaError(f"{what} must be at most {MAX_LIMIT} bytes (8 EiB), not {_brief(limit)}")
    return limit


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


def tenant_limits(body: Any) -> dict[str, int | None]:
    """The limits a ``PUT /quota/{tenant}`` body sets, tier -> bytes (None: back to the
    default): ``{"limit_gb": x}`` (LMCache's form, GiB) or ``{"limit": bytes or "8GiB"}`` set
    the pool's; ``{"limits": {"pool": ..., "disk": ...}}`` the tiers named."""
    if not isinstance(body, dict):
        raise QuotaError('body must be a JSON object such as {"limit_gb": 8} or {"limit": "8GiB"}')
    unknown = sorted(set(body) - {"limit", "limit_gb", "limits"})
    if unknown:
        raise QuotaError(f"unknown field(s) {unknown}; give 'limit', 'limit_gb' or 'limits'")
    given = [k for k in ("limit", "limit_gb", "limits") if k in body]
    if len(given) != 1:
        raise QuotaError("give exactly one of 'limit', 'limit_gb' or 'limits'")
    if "limit_gb" in body:
        return {"pool": parse_gb(body["limit_gb"])}
    if "limit" in body:
        return {"pool": parse_limit(body["limit"])}
    return tier_changes(body["limits"], "limits")


def tier_changes(limits: Any, what: str) -> dict[str, int | None]:
    """``{"pool": size, "disk": size or null}`` checked: tier -> bytes (None: unlimited, or
    back to the default)."""
    if not isinstance(limits, dict) or not limits:
        raise QuotaError(f'{what} must be an object of tier -> size, e.g. {{"disk": "8GiB"}}')
    for tier in sorted(limits):
        if tier in NO_QUOTA:
            raise QuotaError(f"unknown tier {tier!r} for quotas: {NO_QUOTA[tier]}")
        if tier not in TIERS:
            raise QuotaError(f"unknown tier {tier!r}: quotas limit {', '.join(TIERS)}")
    return {
        tier: None if value is None else parse_limit(value, f"{what}.{tier}")
        for tier, value in limits.items()
    }
