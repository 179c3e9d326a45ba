"""``GET /quota``'s listing is linear in the tenants: it reads the pool's per-tenant
figures once, not once per tenant (each read is a pass over every tenant under the
index's lock, which engines' lookups wait for). Counted in rows read, never timed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tierkv.allocator import Allocator
from tierkv.index import ObjectIndex
from tierkv.server.quotas import Quotas
from tierkv.tenants import TenantFigures, TenantIds


class CountingIndex(ObjectIndex):
    """A real index that counts the tenant rows its callers read."""

    rows_read = 0

    def tenant_figures(self, between: Callable[[], None] = lambda: None) -> list[TenantFigures]:
        rows = super().tenant_figures(between)
        self.rows_read += len(rows)
        return rows


def quotas_of(tenants: int) -> tuple[Quotas, CountingIndex]:
    ids = TenantIds()
    index = CountingIndex(Allocator(1 << 20, 4096), tenants=ids)
    quotas = Quotas(index, ids, limits={}, defaults={"pool": None, "disk": None}, mode="soft")
    for i in range(tenants):
        quotas.set(f"tenant-{i}", {"pool": 1000 + i})
    for i in range(tenants // 2):  # tenants known by their chunks' namespace only
        ids.bind(i.to_bytes(16, "big"), f"salt-{i}")
    return quotas, index


@pytest.mark.parametrize("tenants", [100, 400])
def test_the_listing_reads_each_tenants_figures_a_constant_number_of_times(tenants: int) -> None:
    quotas, index = quotas_of(tenants)
    index.rows_read = 0
    doc: dict[str, Any] = quotas.listing()
    assert len(doc["tenants"]) == tenants
    assert index.rows_read <= 2 * tenants  # one pass (was one pass per tenant: tenants**2)
    # The same documents as GET /quota/{tenant} gives one by one.
    by_name = {t["tenant"]: t for t in doc["tenants"]}
    for i in (0, tenants // 2, tenants - 1):
        assert by_name[f"tenant-{i}"] == quotas.tenant(f"tenant-{i}")


def test_the_listing_passes_a_check_point_between_tenants() -> None:
    """Engines first (tierkv.server.engine_first): a listing of thousands of tenants waits
    between tenants while an engine's request is in flight; here, it calls the check point
    once per tenant in each of its passes: the pool's figures, the named tenants, every
    tenant with figures."""
    quotas, _ = quotas_of(100)
    calls: list[int] = []
    doc: dict[str, Any] = quotas.listing(lambda: calls.append(1))
    assert len(doc["tenants"]) == 100
    assert len(calls) == 3 * 100
