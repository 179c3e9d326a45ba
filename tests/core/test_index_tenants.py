"""Per-tenant accounting in the index: exact usage under random operations (hypothesis) and
under threads of several tenants at once, soft quotas evicting only the tenant's own oldest
chunks, hard quotas refusing."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.allocator import Allocator
from tierkv.index import Entry, Holder, LeaseError, LeaseNotFound, ObjectIndex
from tierkv.tenants import DEFAULT_ID, OTHER_ID, TenantIds

BLOCK = 4096
TENANTS = ("a", "b", "c")


def make(blocks: int = 64) -> tuple[ObjectIndex, dict[str, bytes]]:
    tenants = TenantIds()
    digests = {name: name.encode().ljust(16, b"#") for name in TENANTS}
    for name, digest in digests.items():
        tenants.bind(digest, name)
    return ObjectIndex(Allocator(blocks * BLOCK, BLOCK), tenants=tenants), digests


def key(digest: bytes, i: int) -> bytes:
    return digest + i.to_bytes(16, "big")


def used_by(index: ObjectIndex) -> dict[str, int]:
    return {index.tenants.name_of(f.tenant): f.used for f in index.tenant_figures() if f.used}


def test_soft_quota_evicts_only_the_tenants_own_oldest_chunks() -> None:
    index, d = make()
    a = index.tenants.id_of("a")
    index.set_quotas({a: 4 * BLOCK}, None, hard=False)
    index.reserve_write([key(d["b"], i) for i in range(3)], BLOCK, 1)
    res = index.reserve_write([key(d["a"], i) for i in range(6)], BLOCK, 1)
    assert res.quota_exceeded and not res.no_space  # soft: stored, evicted afterwards
    index.commit(res.lease_id, 1)
    index.commit(index.reserve_write([key(d["b"], 9)], BLOCK, 1).lease_id, 1)
    evicted = index.evict_over_quota()
    # A batch goes into the LRU last chunk first: its last chunks are the oldest.
    assert [e.key for e in evicted] == [key(d["a"], 5), key(d["a"], 4)]
    assert used_by(index) == {"a": 4 * BLOCK, "b": 4 * BLOCK}
    assert index.evict_over_quota() == []
    index.check()


def test_hard_quota_refuses_beyond_the_limit_and_counts() -> None:
    index, d = make()
    a = index.tenants.id_of("a")
    index.set_quotas({a: 2 * BLOCK}, 3 * BLOCK, hard=True)  # default 3 blocks for others
    res = index.reserve_write([key(d["a"], i) for i in range(4)], BLOCK, 1)
    assert res.over_quota == [2, 3] and res.no_space == [2, 3]
    res = index.reserve_write([key(d["b"], i) for i in range(5)], BLOCK, 1)
    assert res.over_quota == [3, 4]
    unknown = index.reserve_write([b"\x00" * 32], BLOCK, 1)  # a namespace nobody bound
    assert unknown.slots and index.tenants.name_of(OTHER_ID) == "~other"
    figures = {f.tenant: f for f in index.tenant_figures()}
    assert figures[a].used == 2 * BLOCK and figures[a].refused_chunks == 2
    assert figures[a].refused_bytes == 2 * BLOCK and figures[a].limit == 2 * BLOCK
    assert figures[OTHER_ID].used == BLOCK and figures[OTHER_ID].limit == 3 * BLOCK
    assert DEFAULT_ID not in figures
    index.check()


OPS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                *("store", "store", "reserve", "read", "hold", "release", "delete", "evict"),
                *("quota", "config", "bind", "bind", "clear", "fence", "unfence", "tick"),
                "leave",
            ]
        ),
        st.sampled_from(TENANTS),
        st.lists(st.integers(0, 11), min_size=1, max_size=6),
        st.integers(0, 40),
        st.booleans(),  # under the tenant's late-bound namespace (~other's until "bind")
    ),
    min_size=30,
    max_size=60,
)


def charged_entries(index: ObjectIndex) -> list[Entry]:
    """Every entry whose slot is charged: mapped, being written, locked, pinned or held."""
    with index._lock:
        charged = [*index._entries.values(), *index._held_charges.values()]
        for leases in (index._write_leases, index._read_leases):
            charged += [e for lease in leases.values() for e in lease.entries]
    return charged


@settings(max_examples=150, deadline=None)
@given(ops=OPS, hard=st.booleans())
def test_usage_is_exact_under_random_operations(
    ops: list[tuple[str, str, list[int], int, bool]], hard: bool
) -> None:
    """Usage, LRUs and each chunk's tenant stay exact under random operations, among them
    bindings of namespaces stored into before (their chunks move from ~other to the tenant:
    being written, ready, deleted but locked, freed but held), expiries, fences and clears."""
    now = [0.0]
    tenants = TenantIds()
    d = {name: name.encode().ljust(16, b"#") for name in TENANTS}
    for name, digest in d.items():
        tenants.bind(digest, name)
    index = ObjectIndex(
        Allocator(24 * BLOCK, BLOCK), write_ttl=5, read_ttl=5, clock=lambda: now[0], tenants=tenants
    )
    ids = {n: index.tenants.id_of(n) for n in TENANTS}
    # A second namespace per tenant, bound by the "bind" op: stored into before, ~other's.
    late = {n: f"late-{n}".encode().ljust(16, b"#") for n in TENANTS}
    limits: dict[int, int] = {}
    held: list[tuple[int, str, int]] = []  # (lease, "write" / "read" / "pin", holder)
    fences: list[list[int]] = []
    for op, tenant, picks, n, unbound in ops:
        keys = [key(late[tenant] if unbound else d[tenant], i) for i in picks]
        sizes = BLOCK * (1 + n % 3)
        holder = 1 + n % 2
        try:
            if op in ("store", "reserve"):
                before = {f.tenant: f.used for f in index.tenant_figures()}
                res = index.reserve_write(keys, sizes, holder)
                limit = limits.get(ids[tenant])
                if hard and limit is not None and not unbound:  # never crossed by a store
                    after = {f.tenant: f.used for f in index.tenant_figures()}
                    assert after.get(ids[tenant], 0) <= max(limit, before.get(ids[tenant], 0))
                if res.lease_id and op == "store":
                    index.commit(res.lease_id, holder, only=[0] if n % 4 == 0 else None)
                elif res.lease_id:
                    held.append((res.lease_id, "write", holder))
            elif op == "read":
                lock = index.lock_read(keys, holder, prefix=False)
                if lock.lease_id:
                    held.append((lock.lease_id, "read", holder))
            elif op == "hold":
                lock = index.pin(keys, holder)
                if lock.lease_id:
                    held.append((lock.lease_id, "pin", holder))
            elif op == "release" and held:
                lease, kind, owner = held.pop(n % len(held))
                if kind == "write":
                    index.commit(lease, owner)
                elif kind == "read":
                    index.release_read(lease, owner)
                else:
                    index.unpin(lease, owner)
            elif op == "delete":
                index.delete(keys)
            elif op == "clear":
                index.clear(late[tenant] if unbound else d[tenant])
            elif op == "evict":
                index.evict(n * BLOCK // 4)
            elif op == "quota":
                limits[ids[tenant]] = n * BLOCK // 4
                index.set_quotas(limits, None, hard)
            elif op == "config":
                before_use = {f.tenant: f.used for f in index.tenant_figures()}
                evicted = index.evict_over_quota()
                for f in index.tenant_figures():  # only tenants over their quota lost any
                    limit = limits.get(f.tenant)
                    if limit is None or before_use.get(f.tenant, 0) <= limit:
                        assert f.used == before_use.get(f.tenant, 0)
                assert all(index.tenants.of_key(e.key) in limits for e in evicted)
            elif op == "bind":
                index.tenants.bind(late[tenant], tenant)
            elif op == "fence":
                offsets = [e.offset for e in charged_entries(index)[n % 7 :: 3]]
                if offsets:
                    index.fence(offsets)
                    fences.append(offsets)
            elif op == "unfence" and fences:
                index.unfence(fences.pop(n % len(fences)))
            elif op == "tick":  # leases past their TTL expire; holds end a TTL later
                now[0] += 1 + n % 7
                index.expire()
            elif op == "leave":
                index.release_holder(holder)
        except LeaseError:  # expired or ended meanwhile
            pass
        index.check()  # usage per tenant == its slots' sizes; per-tenant LRUs exact
        for entry in charged_entries(index):
            assert entry.tenant == index.tenants.of_key(entry.key), entry.key
    for offsets in fences:  # a fenced slot the index freed is allocated, charged to nobody
        index.unfence(offsets)
    index.check()
    total = sum(f.used for f in index.tenant_figures())
    assert total == index.used


def test_usage_is_exact_with_threads_of_several_tenants() -> None:
    index, d = make(blocks=48)
    ids = {n: index.tenants.id_of(n) for n in TENANTS}
    index.set_quotas({ids["a"]: 8 * BLOCK, ids["b"]: 16 * BLOCK}, None, hard=False)
    hard_refusals: list[int] = []
    errors: list[BaseException] = []

    def engine(tenant: str, holder: int, seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(400):
                keys = [key(d[tenant], rng.randrange(40)) for _ in range(rng.randrange(1, 6))]
                res = index.reserve_write(keys, BLOCK, holder)
                hard_refusals.append(len(res.over_quota))
                if res.lease_id:
                    if rng.random() < 0.2:
                        index.abort(res.lease_id, holder)
                    else:
                        index.commit(res.lease_id, holder)
                lock = index.lock_read(keys, holder, prefix=False)
                if lock.lease_id:
                    index.release_read(lock.lease_id, holder)
                if rng.random() < 0.05:
                    index.delete(keys[:1])
        except BaseException as exc:  # reported below
            errors.append(exc)

    def evictor(stop: threading.Event) -> None:
        while not stop.is_set():
            index.evict_over_quota()
            if index.used > 40 * BLOCK:
                index.evict(8 * BLOCK)

    stop = threading.Event()
    threads = [
        threading.Thread(target=engine, args=(t, h, h)) for h, t in enumerate(TENANTS * 2, 1)
    ]
    background = threading.Thread(target=evictor, args=(stop,))
    background.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    background.join()
    assert not errors, errors
    assert not any(hard_refusals)  # soft mode never refuses
    index.check()
    index.evict_over_quota()
    used = {f.tenant: f.used for f in index.tenant_figures()}
    assert used.get(ids["a"], 0) <= 8 * BLOCK and used.get(ids["b"], 0) <= 16 * BLOCK
    assert sum(used.values()) == index.used


def test_the_watermark_takes_unlimited_and_over_quota_tenants_first() -> None:
    """With some quotas, watermark eviction takes the chunks of tenants without a quota
    (or above theirs) before those of tenants within their quotas, oldest first."""
    index, d = make()
    a, b = index.tenants.id_of("a"), index.tenants.id_of("b")
    index.set_quotas({a: 8 * BLOCK, b: 2 * BLOCK}, None, hard=False)

    def committed(name: str, ids: range) -> None:
        for i in ids:  # one chunk a batch: commit order is LRU order
            index.commit(index.reserve_write([key(d[name], i)], BLOCK, 1).lease_id, 1)

    committed("a", range(4))  # the oldest, within its quota
    committed("b", range(3))  # above its quota (nothing evicted it yet)
    committed("c", range(3))  # no quota: unlimited
    evicted = [e.key for e in index.evict(5 * BLOCK)]
    assert evicted == [*(key(d["b"], i) for i in range(3)), key(d["c"], 0), key(d["c"], 1)]
    assert used_by(index) == {"a": 4 * BLOCK, "c": BLOCK}
    # Not enough outside the quotas: then the oldest of everyone, as without quotas.
    assert [e.key for e in index.evict(2 * BLOCK)] == [key(d["c"], 2), key(d["a"], 0)]
    index.check()

    # One tenant first (its own LRU) and none at all (the global LRU) take the same path
    # as without quotas: everyone within, nothing preferred.
    index.set_quotas({}, 100 * BLOCK, hard=False)
    assert [e.key for e in index.evict(BLOCK)] == [key(d["a"], 1)]
    index.check()


def test_evictions_in_batches_see_a_tenant_back_within_its_quota() -> None:
    """Each call decides anew who is above a quota: once a tenant is back within its quota,
    the next batch takes the unlimited tenants' chunks, and then the oldest of everyone."""
    index, d = make()
    a, b = index.tenants.id_of("a"), index.tenants.id_of("b")
    index.set_quotas({a: 8 * BLOCK, b: 2 * BLOCK}, None, hard=False)
    for name, n in (("a", 4), ("b", 3), ("c", 3)):
        for i in range(n):  # one chunk a batch: commit order is LRU order
            index.commit(index.reserve_write([key(d[name], i)], BLOCK, 1).lease_id, 1)
    evicted = [e.key for _ in range(5) for e in index.evict(BLOCK, max_objects=1)]
    assert evicted == [key(d["b"], 0), *(key(d["c"], i) for i in range(3)), key(d["a"], 0)]
    assert used_by(index) == {"a": 3 * BLOCK, "b": 2 * BLOCK}
    index.check()


def test_tenant_ids_list_the_digests_of_each_tenant() -> None:
    index, d = make()
    tenants = index.tenants
    extra = b"a2".ljust(16, b"#")
    assert tenants.bind(extra, "a") == tenants.id_of("a")
    assert tenants.bind(extra, "b") == tenants.id_of("a")  # a digest is bound once
    assert tenants.digests_of(tenants.id_of("a")) == [d["a"], extra]
    assert tenants.digests_of(OTHER_ID) == []


def test_chunks_stored_before_their_namespace_is_bound_are_charged_to_its_tenant() -> None:
    """A namespace stored into before it is bound (a peer's promote before the engine
    registered): its chunks are ~other's until the binding, then the tenant's, in every
    state, and join the tenant's LRU as its newest; its hard quota counts them."""
    index, d = make()
    late = b"late".ljust(16, b"#")
    lk = [key(late, i) for i in range(5)]
    index.commit(index.reserve_write(lk[:2], BLOCK, Holder.PEER_PROMOTE).lease_id, -4)
    index.commit(index.reserve_write([key(d["a"], 0)], BLOCK, 1).lease_id, 1)
    index.commit(index.reserve_write(lk[2:3], BLOCK, Holder.PEER_PROMOTE).lease_id, -4)
    writing = index.reserve_write(lk[3:4], BLOCK, Holder.PEER_PROMOTE)  # not committed yet
    lock = index.lock_read(lk[:1], 2)  # read-locked: out of the LRU
    pin = index.pin(lk[2:3], 3)
    index.delete(lk[2:3])  # deleted but pinned: still charged
    assert used_by(index) == {"a": BLOCK, "~other": 4 * BLOCK}

    a = index.tenants.bind(late, "a")
    assert used_by(index) == {"a": 5 * BLOCK}
    index.check()  # the tenant's LRU is the global one's chunks of "a", in its order
    index.set_quotas({a: 5 * BLOCK}, None, hard=True)
    assert index.reserve_write([key(d["a"], 1)], BLOCK, 1).over_quota == [0]
    index.commit(writing.lease_id, -4)
    index.release_read(lock.lease_id, 2)
    index.unpin(pin.lease_id, 3)
    assert used_by(index) == {"a": 4 * BLOCK}
    index.set_quotas({a: 2 * BLOCK}, None, hard=False)
    # Oldest first: d["a"]'s chunk, then the moved ones (the binding counted as their use:
    # put back in their place, a bind walked the whole LRU under the index lock); lk[0] and
    # lk[3] were used since.
    assert [e.key for e in index.evict_over_quota()] == [key(d["a"], 0), lk[1]]
    index.check()


def test_a_bound_namespaces_chunks_keep_their_order_in_the_lru() -> None:
    """A committed batch is in the LRU last chunk first (its prefix newest). Moved to its
    tenant's LRU in reservation order, a binding made chunk 0 the tenant's oldest: a quota
    eviction took the prefix first, and the rest of the chain was of no use."""
    index, d = make()
    late = b"late".ljust(16, b"#")
    index.commit(index.reserve_write([key(late, i) for i in range(6)], BLOCK, 1).lease_id, 1)
    index.commit(index.reserve_write([key(d["b"], 0)], BLOCK, 1).lease_id, 1)
    a = index.tenants.bind(late, "a")
    assert [e.key for e in index._lru] == [
        key(d["b"], 0),
        *(key(late, i) for i in range(5, -1, -1)),
    ]
    index.set_quotas({a: 4 * BLOCK}, None, hard=False)
    assert [e.key for e in index.evict_over_quota()] == [key(late, 5), key(late, 4)]
    index.check()


def test_a_held_charge_of_an_unbound_namespace_moves_to_its_tenant() -> None:
    """A slot freed while an expired pin holds it stays charged: to the tenant once its
    namespace is bound, and off the tenant's account when the hold ends."""
    now = [0.0]
    index = ObjectIndex(Allocator(8 * BLOCK, BLOCK), clock=lambda: now[0])
    late = b"late".ljust(16, b"#")
    index.commit(index.reserve_write([key(late, 0)], BLOCK, -4).lease_id, -4)
    pin = index.pin([key(late, 0)], Holder.WRITE_BEHIND)
    now[0] += index.read_ttl + 1
    index.expire()  # the pin expired: its slot is held
    index.delete([key(late, 0)])
    assert used_by(index) == {"~other": BLOCK}
    index.tenants.bind(late, "a")
    assert used_by(index) == {"a": BLOCK}
    index.check()
    with pytest.raises(LeaseNotFound):  # refused as expired; the hold ends
        index.unpin(pin.lease_id, Holder.WRITE_BEHIND)
    assert used_by(index) == {} and index.used == 0
    index.check()
