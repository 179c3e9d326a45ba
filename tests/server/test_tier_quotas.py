"""The disk tier's tenant quotas (server/tiering/tier_quotas.py) on a real disk tier, with
threads: hard mode never lets concurrent write-behind batches take a tenant past its quota
and counts every refusal; soft mode brings each tenant back within its quota and leaves the
other tenants' files alone; unattributed namespaces (~other) have no quota."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierkv.server.tiering.tier_quotas import TierQuota
from tierkv.tenants import OTHER_ID, TenantIds
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.records import HEADER_SIZE

PAYLOAD = 1000
FILE = PAYLOAD + HEADER_SIZE


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[DiskTier]:
    disk = DiskTier(path=tmp_path / "disk", capacity="64MiB", threads=2)
    yield disk
    disk.close()


def setup(tier: DiskTier) -> tuple[TierQuota, dict[str, int], dict[str, bytes]]:
    tenants = TenantIds()
    digests = {name: name.encode().ljust(16, b"#") for name in ("a", "b")}
    ids = {name: tenants.bind(digest, name) for name, digest in digests.items()}
    return TierQuota(tier, tenants), ids, digests


def write(quota: TierQuota, tier: DiskTier, keys: list[bytes]) -> None:
    """What the write-behind does with one batch."""
    data = memoryview(bytearray(PAYLOAD))
    admission = quota.admit([(k, PAYLOAD) for k in keys])
    batch = [keys[i] for i in admission.admitted]
    try:
        assert all(tier.store([(k, data) for k in batch]))
    finally:
        quota.done(admission, batch)


def batches(digest: bytes, thread: int, n: int = 10, size: int = 4) -> list[list[bytes]]:
    return [
        [digest + (thread * 10_000 + b * 100 + i).to_bytes(16, "big") for i in range(size)]
        for b in range(n)
    ]


def run_threads(quota: TierQuota, tier: DiskTier, work: list[list[list[bytes]]]) -> None:
    errors: list[BaseException] = []

    def run(batches: list[list[bytes]]) -> None:
        try:
            for keys in batches:
                write(quota, tier, keys)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_hard_mode_is_exact_under_concurrent_batches(tier: DiskTier) -> None:
    quota, ids, d = setup(tier)
    limit = 25 * FILE
    quota.set_limits({ids["a"]: limit}, None, hard=True)
    run_threads(quota, tier, [batches(d["a"], t) for t in range(4)] + [batches(d["b"], 9)])
    figures = quota.figures()
    a, b = figures[ids["a"]], figures[ids["b"]]
    assert a.used == 25 * FILE  # filled exactly, never beyond
    assert a.refused_chunks == 4 * 40 - 25 and a.refused_bytes == a.refused_chunks * FILE
    assert a.evictions == 0 and b.used == 40 * FILE and b.refused_chunks == 0
    assert quota.usage() == {ids["a"]: 25 * FILE, ids["b"]: 40 * FILE}
    write(quota, tier, batches(d["a"], 0)[0])  # held already: admitted, costs nothing
    assert quota.figures()[ids["a"]].refused_chunks == a.refused_chunks


def test_soft_mode_evicts_the_tenants_own_files_under_concurrent_batches(
    tier: DiskTier,
) -> None:
    quota, ids, d = setup(tier)
    quota.set_limits({}, 30 * FILE, hard=False)  # the default: every tenant
    run_threads(quota, tier, [batches(d["a"], t) for t in range(4)])
    assert quota.figures()[ids["a"]].used <= 30 * FILE
    run_threads(quota, tier, [batches(d["b"], 9, n=5)])
    figures = quota.figures()
    assert figures[ids["b"]].used == 20 * FILE and figures[ids["b"]].evictions == 0
    a = figures[ids["a"]]
    assert a.used + a.evicted_bytes == 160 * FILE and a.evictions * FILE == a.evicted_bytes
    # Lowered live: at once, and only that tenant's files.
    quota.set_limits({ids["a"]: 5 * FILE}, 30 * FILE, hard=False)
    assert quota.used_by(ids["a"]) == 5 * FILE and quota.used_by(ids["b"]) == 20 * FILE


def test_unattributed_namespaces_have_no_quota(tier: DiskTier) -> None:
    quota, _, _ = setup(tier)
    unknown = b"u" * 16  # no engine bound it (after a restart, say)
    quota.set_limits({}, 2 * FILE, hard=True)
    write(quota, tier, batches(unknown, 0, n=1, size=6)[0])
    assert quota.usage() == {OTHER_ID: 6 * FILE}
    assert quota.limit_of(OTHER_ID) is None and quota.enforce() == 0
    assert quota.figures()[OTHER_ID].refused_chunks == 0


def test_a_batch_that_ends_while_another_is_admitted_is_counted(tier: DiskTier) -> None:
    """Batch 2 reads the tenant's usage while batch 1 is admitted, written and done: batch
    1's file must count for batch 2 either as usage or as in flight, never as neither."""
    quota, ids, d = setup(tier)
    quota.set_limits({ids["a"]: 2 * FILE}, None, hard=True)
    first, second = batches(d["a"], 0, n=2, size=1)
    write(quota, tier, [d["a"] + b"\xff" * 16])  # one file of the quota held already
    usage = tier.namespace_usage
    done = threading.Event()
    slow = True

    def racing_usage(digests: list[bytes]) -> dict[bytes, int]:
        nonlocal slow
        read = usage(digests)
        if slow:  # batch 2 has read usage; batch 1 runs now, were it not kept out
            slow = False
            racer = threading.Thread(target=lambda: (write(quota, tier, first), done.set()))
            racer.start()
            done.wait(0.5)
        return read

    tier.namespace_usage = racing_usage  # type: ignore[method-assign]
    write(quota, tier, second)
    assert done.wait(10)
    tier.namespace_usage = usage  # type: ignore[method-assign]
    figures = quota.figures()[ids["a"]]
    assert figures.used == 2 * FILE and figures.refused_chunks == 1  # one of the two fits
