"""Quota changes reach the pool's index whole and in order, and only for tenants the server
can tell apart (in-process: a real index and a real Quotas, no server)."""

from __future__ import annotations

import threading

import pytest

from tierkv import tenants as tenants_module
from tierkv.allocator import Allocator
from tierkv.index import ObjectIndex
from tierkv.server.quotas import QuotaError, Quotas
from tierkv.tenants import OTHER_ID, OTHER_TENANT, TenantIds


def setup() -> tuple[Quotas, ObjectIndex, TenantIds]:
    ids = TenantIds()
    index = ObjectIndex(Allocator(1 << 20, 4096), tenants=ids)
    quotas = Quotas(index, ids, limits={}, defaults={"pool": None, "disk": None}, mode="hard")
    return quotas, index, ids


def enforced(index: ObjectIndex) -> dict[int, int | None]:
    """The limits the index enforces, by tenant id."""
    return {f.tenant: f.limit for f in index.tenant_figures()}


def test_two_changes_at_once_leave_the_newer_limits_in_force() -> None:
    """Each change pushes a snapshot of every limit to the index; a change's snapshot
    taken first must not land last (it would undo the other change until the next one)."""
    quotas, index, ids = setup()
    set_quotas = index.set_quotas
    second_done = threading.Event()
    first = True
    helpers: list[threading.Thread] = []

    def slow_first_push(*args: object, **kwargs: object) -> None:
        nonlocal first
        if first:  # the first change's push, stalled while the second change runs
            first = False

            def second() -> None:
                quotas.set("t2", {"pool": 2})
                second_done.set()

            helpers.append(threading.Thread(target=second))
            helpers[0].start()
            second_done.wait(0.5)  # enough for it, were it not kept waiting for this push
            set_quotas(*args, **kwargs)  # type: ignore[arg-type]
            return
        set_quotas(*args, **kwargs)  # type: ignore[arg-type]

    index.set_quotas = slow_first_push  # type: ignore[method-assign]
    quotas.set("t1", {"pool": 1})
    helpers[0].join(10)
    assert second_done.is_set()
    assert enforced(index) == {ids.id_of("t1"): 1, ids.id_of("t2"): 2}


def test_a_quota_for_a_tenant_beyond_the_last_id_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tenant ids are limited; beyond them a new tenant's chunks count as ~other. A quota set
    for such a name would have become ~other's: it is refused, and ~other's stays its own."""
    monkeypatch.setattr(tenants_module, "MAX_TENANTS", 4)  # ~default, ~other, and two
    quotas, index, ids = setup()
    quotas.set("a", {"pool": 100})
    quotas.set("b", {"pool": 200})
    with pytest.raises(QuotaError, match="the most it tells apart"):
        quotas.set("c", {"pool": 0})
    assert ids.id_of("c") == OTHER_ID
    assert enforced(index) == {ids.id_of("a"): 100, ids.id_of("b"): 200}
    quotas.set(OTHER_TENANT, {"pool": 300})
    assert enforced(index)[OTHER_ID] == 300
