"""The tenant table's ``rest`` row (tierkv.server.tenant_rest): its counters never go down
as tenants move in and out of it, and every tenant's counts are counted once, in the row it
was in when they were seen."""

from __future__ import annotations

import random

from tierkv import protocol as p
from tierkv.server.tenant_rest import RestRow


def tenant(tag: str, evictions: int, disk_refused: int = 0, used: int = 0) -> p.TenantInfo:
    row = p.TenantInfo(tag, "", used, -1, "default", evictions, evictions * 10, 0, 0)
    row.tiers = {"disk": p.TenantTierInfo(0, -1, 0, 0, disk_refused, 0)}
    return row


def test_a_tenant_leaving_rest_takes_none_of_its_counts_with_it() -> None:
    """The rest row summed its tenants' counters as they were: a tenant with evictions that
    grew into the rows shown took them out of rest, whose counter fell (Prometheus: a reset,
    a false spike in rate())."""
    rest = RestRow()
    first = rest.row([tenant("a", 0)], [tenant("b", 5, disk_refused=2)], ["disk"])
    assert (first.evictions, first.evicted_bytes, first.tiers["disk"].refused_chunks) == (5, 50, 2)
    moved = rest.row([tenant("b", 5, disk_refused=2)], [tenant("a", 0)], ["disk"])
    assert (moved.evictions, moved.tiers["disk"].refused_chunks) == (5, 2)  # (was 0, 0)
    grew = rest.row([tenant("b", 6)], [tenant("a", 3)], ["disk"])  # a's 3 while in rest
    assert (grew.evictions, grew.tenants) == (8, 1)
    back = rest.row([tenant("a", 3)], [tenant("b", 9), tenant("c", 1)], ["disk"])
    assert back.evictions == 8 + 3 + 1  # b's growth since it was last seen, c's first counts


def test_rest_only_grows_and_counts_every_increment_once() -> None:
    rng = random.Random(5)
    rest = RestRow()
    counts = dict.fromkeys("abcdefgh", 0)
    last_rest = 0
    shown_last: dict[str, int] = {}  # each shown series' last value
    for _ in range(300):
        for tag in rng.sample(sorted(counts), 3):
            counts[tag] += rng.randrange(4)
        tags = sorted(counts)
        rng.shuffle(tags)
        shown, others = tags[:3], tags[3:]
        row = rest.row(
            [tenant(t, counts[t]) for t in shown], [tenant(t, counts[t]) for t in others], []
        )
        assert row.evictions >= last_rest
        last_rest = row.evictions
        shown_last.update({t: counts[t] for t in shown})
        # What the series say cannot exceed what happened (each increment counted once).
        assert row.evictions + sum(shown_last.values()) >= sum(counts.values())
    final = rest.row([], [tenant(t, counts[t]) for t in sorted(counts)], [])
    assert final.evictions <= sum(counts.values())


def test_reports_built_at_once_count_nothing_twice() -> None:
    """Status reports are built at once (RPC stats, /status, /metrics): one that read older
    figures and came second set a tenant back, and its growth was counted again."""
    rest = RestRow()
    assert rest.row([], [tenant("x", 10)], []).evictions == 10
    newer, older = tenant("x", 20), tenant("x", 15)  # read in this order, used the other
    assert rest.row([], [newer], []).evictions == 20
    assert rest.row([], [older], []).evictions == 20
    assert rest.row([], [tenant("x", 25)], []).evictions == 25  # (was 30)
    assert rest.row([tenant("x", 24)], [], []).evictions == 25  # shown: a stale read too
    assert rest.row([], [tenant("x", 26)], []).evictions == 26
