"""The ``rest`` row of the tenant table: the tenants beyond those shown one by one, summed,
with counters that never go down.

Status reports and Prometheus show the largest tenants (by pool bytes) one by one and the
others as one ``rest`` row, so that the series stay bounded. Which tenants are in ``rest``
changes as they grow and shrink, and the plain sum of their counters (evictions, refusals)
fell whenever a tenant with counts left it: Prometheus took each fall for a counter reset (a
false spike in ``rate()``). :class:`RestRow` sums instead what each tenant's counters grew
by while it was in ``rest`` (it remembers every tenant's counters as it last saw them), so
every series only grows: a tenant's counts go to its own row while it is shown, to ``rest``
while it is not.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from tierkv import protocol as p

COUNTERS = ("evictions", "evicted_bytes", "refused_chunks", "refused_bytes")
POOL = ""  # the pool's counters, beside each tier's by its name


class RestRow:
    """Builds the ``rest`` row from the rows not shown (thread-safe: status reports may be
    built at the same time)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, dict[str, tuple[int, ...]]] = {}  # tag -> tier -> counters
        self._summed: dict[str, list[int]] = {}  # tier -> what rest's counters hold

    def row(
        self, shown: Sequence[p.TenantInfo], rest: Sequence[p.TenantInfo], tiers: Sequence[str]
    ) -> p.TenantInfo:
        """The ``rest`` row of ``rest`` (the tenants not shown), beside ``shown`` (those
        shown one by one), for tables of the pool and ``tiers``."""
        with self._lock:
            for r in shown:
                self._saw(r.tag, _counters(r))
            for r in rest:
                now = _counters(r)
                before = self._seen.get(r.tag, {})
                for tier, counts in now.items():
                    was = before.get(tier, (0,) * len(COUNTERS))
                    summed = self._summed.setdefault(tier, [0] * len(COUNTERS))
                    for i, (n, m) in enumerate(zip(counts, was, strict=True)):
                        summed[i] += max(0, n - m)  # (a tenant's counters only grow)
                self._saw(r.tag, now)
            summed_now = {t: list(v) for t, v in self._summed.items()}
        pool = summed_now.get(POOL, [0] * len(COUNTERS))
        total = p.TenantInfo(
            "rest", "", sum(r.used for r in rest), -1, "default",
            pool[0], pool[1], pool[2], pool[3], len(rest),
        )  # fmt: skip
        total.tiers = {tier: _tier_row(rest, tier, summed_now.get(tier)) for tier in tiers}
        return total

    def _saw(self, tag: str, now: dict[str, tuple[int, ...]]) -> None:
        """Remember a tenant's counters (lock held): the highest seen of each, since two
        reports built at once may come here in either order (the older figures second
        would have its growth counted twice)."""
        before = self._seen.get(tag)
        if before is not None:
            now = {
                tier: tuple(map(max, counts, before.get(tier, counts)))
                for tier, counts in now.items()
            }
        self._seen[tag] = now


def _counters(row: p.TenantInfo) -> dict[str, tuple[int, ...]]:
    """A row's counters: the pool's (:data:`POOL`) and each tier's."""
    counts = {POOL: tuple(getattr(row, name) for name in COUNTERS)}
    for tier, t in row.tiers.items():
        counts[tier] = tuple(getattr(t, name) for name in COUNTERS)
    return counts


def _tier_row(
    rest: Sequence[p.TenantInfo], tier: str, summed: list[int] | None
) -> p.TenantTierInfo:
    """``rest``'s row of ``tier``: the bytes they hold there now, the counters ``summed``."""
    n = summed or [0] * len(COUNTERS)
    used = sum(r.tiers[tier].used for r in rest if tier in r.tiers)
    return p.TenantTierInfo(used, -1, n[0], n[1], n[2], n[3])
