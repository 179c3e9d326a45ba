"""TenantTally: one place's tenant quota settings and counters, shared by the pool's index
and the tiers' quotas."""

from __future__ import annotations

from tierkv.tenants import OTHER_ID, TenantFigures, TenantTally


def test_no_quotas_until_set_then_own_limit_over_default() -> None:
    tally = TenantTally()
    assert not tally.limited and not tally.hard
    assert tally.limit_of(5) is None
    tally.set_limits({5: 100}, None, hard=False)
    assert tally.limited and tally.limit_of(5) == 100 and tally.limit_of(6) is None
    tally.set_limits({5: 100}, 40, hard=True)
    assert tally.hard
    assert tally.limit_of(5) == 100  # its own limit wins over the default
    assert tally.limit_of(6) == 40  # every other tenant: the default
    tally.set_limits({}, None, hard=False)  # cleared
    assert not tally.limited and not tally.hard and tally.limit_of(5) is None


def test_set_limits_copies_the_mapping() -> None:
    tally = TenantTally()
    limits = {5: 100}
    tally.set_limits(limits, None, hard=False)
    limits[5] = 1
    assert tally.limit_of(5) == 100


def test_unlimited_tenants_ignore_every_limit() -> None:
    tally = TenantTally(unlimited=(OTHER_ID,))
    tally.set_limits({OTHER_ID: 10, 7: 20}, 30, hard=True)
    assert tally.limit_of(OTHER_ID) is None
    assert tally.limit_of(7) == 20 and tally.limit_of(8) == 30


def test_counters_into_figures_rows() -> None:
    tally = TenantTally()
    tally.set_limits({3: 500}, 200, hard=True)
    tally.count_eviction(4, 64)
    tally.count_eviction(4, 128)
    tally.count_eviction(6, 300, chunks=3)
    tally.count_refusal(4, 64)
    tally.count_refusal(9, 0, chunks=0)  # a tenant with a zero figure still gets a row
    rows = tally.figures({2: 10, 4: 192})
    assert rows == [
        TenantFigures(2, used=10, limit=200, evictions=0, evicted_bytes=0,
                      refused_chunks=0, refused_bytes=0),
        TenantFigures(3, used=0, limit=500, evictions=0, evicted_bytes=0,
                      refused_chunks=0, refused_bytes=0),
        TenantFigures(4, used=192, limit=200, evictions=2, evicted_bytes=192,
                      refused_chunks=1, refused_bytes=64),
        TenantFigures(6, used=0, limit=200, evictions=3, evicted_bytes=300,
                      refused_chunks=0, refused_bytes=0),
        TenantFigures(9, used=0, limit=200, evictions=0, evicted_bytes=0,
                      refused_chunks=0, refused_bytes=0),
    ]  # fmt: skip
    tally.set_limits({}, None, hard=False)  # settings go, counters stay
    assert [(f.tenant, f.limit, f.evictions) for f in tally.figures({})] == [
        (4, None, 2),
        (6, None, 3),
        (9, None, 0),
    ]


def test_unlimited_tenant_rows_show_no_limit() -> None:
    tally = TenantTally(unlimited=(OTHER_ID,))
    tally.set_limits({}, 50, hard=False)
    rows = {f.tenant: f for f in tally.figures({OTHER_ID: 99, 2: 1})}
    assert rows[OTHER_ID].limit is None and rows[OTHER_ID].used == 99
    assert rows[2].limit == 50
