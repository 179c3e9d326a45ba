"""Tests of the disk tier on real files, with payloads in a real shared-memory pool.

Covers: byte-exact round trips from and into pool views, skipping held keys, the capacity
bound with LRU eviction, restart (index rebuilt from the directory, LRU order from mtimes,
leftovers removed), every kind of damaged file reported as CORRUPT (never as OK) and
removed, the same way running and after a restart, a directory or link at a chunk's name
removed instead of keeping that chunk out for good, a full or read-only disk degrading to
one log line and recovering, concurrent store/load/delete with consistent usage afterwards,
and that no payload-sized ``bytes`` is allocated on the store and load paths.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import random
import shutil
import subprocess
import threading
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from tierkv.pool import SHM_DIR, ShmPool
from tierkv.tiers import LoadStatus, TierError, create_tier, tier_names
from tierkv.tiers.disk import LOCK_NAME, DiskTier
from tierkv.tiers.records import HEADER_SIZE, pack_header

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm (Linux)")

KIB = 1 << 10
MIB = 1 << 20
LOGGER = "tierkv.tiers.disk"
NAMESPACE = hashlib.blake2b(b"test-namespace", digest_size=16).digest()


def key(i: int | str) -> bytes:
    """A 32-byte key: one fixed namespace half, a chunk half derived from ``i``."""
    return NAMESPACE + hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def pattern(k: bytes, n: int) -> np.ndarray:
    """The deterministic payload of key ``k`` (n bytes)."""
    seed = int.from_bytes(k[16:24], "little")
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


class Slots:
    """Hands out non-overlapping views of a real shared-memory pool."""

    def __init__(self, pool: ShmPool) -> None:
        self.pool = pool
        self.next = 0
        self.lock = threading.Lock()

    def view(self, n: int) -> memoryview:
        with self.lock:
            off = self.next
            self.next += -(-max(n, 1) // 4096) * 4096
        return self.pool.view(off, n)

    def filled(self, k: bytes, n: int) -> memoryview:
        v = self.view(n)
        np.frombuffer(v, dtype=np.uint8)[:] = pattern(k, n)
        return v

    def blank(self, n: int, fill: int = 0xAA) -> memoryview:
        v = self.view(n)
        np.frombuffer(v, dtype=np.uint8)[:] = fill
        return v


def same(view: memoryview, k: bytes) -> bool:
    return np.array_equal(np.frombuffer(view, dtype=np.uint8), pattern(k, len(view)))


@pytest.fixture
def pool() -> Iterator[ShmPool]:
    p = ShmPool.create(f"tierkv-test-disk-{uuid.uuid4().hex[:8]}", 64 * MIB)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def slots(pool: ShmPool) -> Slots:
    return Slots(pool)


@pytest.fixture
def make_tier(tmp_path: Path) -> Iterator[Callable[..., DiskTier]]:
    """``make_tier(capacity=..., path=...)``: disk tiers closed after the test."""
    tiers: list[DiskTier] = []

    def make(**options: object) -> DiskTier:
        options.setdefault("path", tmp_path / "disk")
        options.setdefault("capacity", "64MiB")
        tier = DiskTier(**options)  # type: ignore[arg-type]
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close()


def chunk_files(root: Path) -> dict[str, int]:
    """Relative path -> size of every file under the fan-out directories."""
    out = {}
    for p in root.rglob("*"):
        if p.is_file() and p.name != LOCK_NAME:
            out[str(p.relative_to(root))] = p.stat().st_size
    return out


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


# -- basics ------------------------------------------------------------------------------
def test_round_trip_is_byte_exact(make_tier: Callable[..., DiskTier], slots: Slots) -> None:
    tier = make_tier()
    sizes = [0, 1, 4096, MIB + 3]
    keys = [key(i) for i in range(len(sizes))]
    src = [slots.filled(k, n) for k, n in zip(keys, sizes, strict=True)]
    assert tier.store(list(zip(keys, src, strict=True))) == [True] * len(sizes)
    assert tier.contains([*keys, key("absent")]) == [True] * len(sizes) + [False]

    dst = [slots.blank(n) for n in sizes]
    assert tier.load(list(zip(keys, dst, strict=True))) == [LoadStatus.OK] * len(sizes)
    assert all(same(d, k) for d, k in zip(dst, keys, strict=True))
    assert tier.load([(key("absent"), slots.blank(16))]) == [LoadStatus.MISSING]

    usage = tier.usage()
    assert usage.objects == len(sizes)
    assert usage.bytes_used == sum(sizes) + HEADER_SIZE * len(sizes)
    assert usage.capacity == 64 * MIB

    # One file per chunk, fanned out by the chunk-hash half of the key, header + payload.
    k, n = keys[2], sizes[2]
    h = k.hex()
    path = Path(tier.path) / h[32:34] / h[34:36] / f"{h}.kv"
    assert path.stat().st_size == HEADER_SIZE + n
    assert path.read_bytes()[:HEADER_SIZE] == pack_header(k, pattern(k, n).tobytes())
    assert str(path) == tier.file_path(k)
    stats = tier.stats()
    assert (stats.stores, stats.loads, stats.misses, stats.corrupt) == (4, 4, 1, 0)


def test_typed_views_are_stored_as_their_bytes(
    make_tier: Callable[..., DiskTier], pool: ShmPool, slots: Slots
) -> None:
    tier = make_tier()
    k = key("typed")
    src = slots.filled(k, 4096)
    typed = np.frombuffer(src, dtype=np.float32).reshape(32, 32).data
    assert tier.store([(k, typed)]) == [True]
    dst = slots.blank(4096)
    out = np.frombuffer(dst, dtype=np.float32).reshape(32, 32).data
    assert tier.load([(k, out)]) == [LoadStatus.OK]
    assert same(dst, k)


def test_store_skips_keys_already_held(make_tier: Callable[..., DiskTier], slots: Slots) -> None:
    tier = make_tier()
    k = key(1)
    assert tier.store([(k, slots.filled(k, 4096))]) == [True]
    inode = os.stat(tier.file_path(k)).st_ino
    assert tier.store([(k, slots.blank(4096, 0x11))]) == [True]
    assert os.stat(tier.file_path(k)).st_ino == inode
    stats = tier.stats()
    assert (stats.stores, stats.store_skipped) == (1, 1)
    dst = slots.blank(4096)
    assert tier.load([(k, dst)]) == [LoadStatus.OK]
    assert same(dst, k)


def test_delete(make_tier: Callable[..., DiskTier], slots: Slots) -> None:
    tier = make_tier()
    keys = [key(i) for i in range(3)]
    tier.store([(k, slots.filled(k, 1000)) for k in keys])
    assert tier.delete([keys[0], keys[1], keys[1], key("absent")]) == 2
    assert not os.path.exists(tier.file_path(keys[0]))
    assert tier.contains(keys) == [False, False, True]
    assert tier.load([(keys[0], slots.blank(1000))]) == [LoadStatus.MISSING]
    assert tier.usage().objects == 1
    assert tier.usage().bytes_used == 1000 + HEADER_SIZE


def _held_writing(
    tier: DiskTier, monkeypatch: pytest.MonkeyPatch, item: tuple[bytes, memoryview]
) -> tuple[threading.Thread, threading.Event, list[bool]]:
    """A store of ``item`` started on a thread and stopped inside its file write: returns
    the thread, the event that lets the write go on, and where the result goes."""
    import tierkv.tiers.disk as disk

    writing, go = threading.Event(), threading.Event()
    write_record = disk.write_record

    def held(*args: object, **kwargs: object) -> object:
        writing.set()
        assert go.wait(30)  # a bound against a hang only: the test sets it
        return write_record(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(disk, "write_record", held)
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.extend(tier.store([item])))
    thread.start()
    assert writing.wait(30)
    return thread, go, result


def test_a_delete_overtaking_a_store_removes_the_chunk_and_counts_the_store_failed(
    make_tier: Callable[..., DiskTier], slots: Slots, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier(threads=1)
    k = key("k")
    thread, go, result = _held_writing(tier, monkeypatch, (k, slots.filled(k, 1000)))
    assert tier.delete([k]) == 0  # not held yet: the store in flight is cancelled
    go.set()
    thread.join()
    assert result == [False] and tier.contains([k]) == [False]
    assert not os.path.exists(tier.file_path(k))
    stats = tier.stats()
    assert (stats.stores, stats.store_failed, stats.store_skipped) == (0, 1, 0)


@pytest.mark.parametrize("when", ["writing", "removing"])
def test_a_store_after_a_delete_that_overtook_a_store_is_refused(
    when: str, make_tier: Callable[..., DiskTier], slots: Slots, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Store A in flight, delete, store B of the same key (committed again), while A still
    writes or already removes its file: B was answered True ("another thread is writing
    it") and A then removed the file, so the tier lacked a chunk a store said it held. B is
    refused now (counted failed); a store after A's removal writes the chunk."""
    import tierkv.tiers.disk as disk

    tier = make_tier(threads=1)
    k = key("k")
    removing, go_remove = threading.Event(), threading.Event()
    remove_path = disk.remove_path

    def held_remove(path: str) -> None:
        removing.set()
        assert go_remove.wait(30)  # a bound against a hang only: the test sets it
        remove_path(path)

    monkeypatch.setattr(disk, "remove_path", held_remove)
    thread, go, result = _held_writing(tier, monkeypatch, (k, slots.filled(k, 1000)))
    assert tier.delete([k]) == 0
    if when == "removing":
        go.set()
        assert removing.wait(30)
    assert tier.store([(k, slots.filled(k, 1000))]) == [False]
    go.set()
    go_remove.set()
    thread.join()
    assert result == [False] and tier.contains([k]) == [False]
    stats = tier.stats()
    assert (stats.stores, stats.store_failed, stats.store_skipped) == (0, 2, 0)
    assert tier.store([(k, slots.filled(k, 1000))]) == [True]
    dest = slots.blank(1000)
    assert tier.load([(k, dest)]) == [LoadStatus.OK] and same(dest, k)


def test_bad_items_are_reported_not_raised(
    make_tier: Callable[..., DiskTier], slots: Slots
) -> None:
    tier = make_tier()
    k = key(1)
    tier.store([(k, slots.filled(k, 100))])
    assert tier.store([(b"short", slots.filled(k, 100))]) == [False]
    assert tier.store([(key(2), slots.view(100)[::2])]) == [False]  # not contiguous
    readonly = memoryview(bytes(100))
    assert tier.load([(k, readonly)]) == [LoadStatus.ERROR]
    assert tier.usage().objects == 1


# -- capacity and LRU --------------------------------------------------------------------
def test_capacity_evicts_least_recently_used(
    make_tier: Callable[..., DiskTier], slots: Slots
) -> None:
    n = 4096
    tier = make_tier(capacity=3 * (n + HEADER_SIZE))
    a, b, c, d = (key(x) for x in "abcd")
    assert tier.store([(k, slots.filled(k, n)) for k in (a, b, c)]) == [True] * 3
    assert tier.load([(a, slots.blank(n))]) == [LoadStatus.OK]  # a is now the most recent
    assert tier.store([(d, slots.filled(d, n))]) == [True]

    assert tier.contains([a, b, c, d]) == [True, False, True, True]
    assert not os.path.exists(tier.file_path(b))
    usage = tier.usage()
    assert usage.objects == 3 and usage.bytes_used <= usage.capacity
    stats = tier.stats()
    assert (stats.evictions, stats.evicted_bytes) == (1, n + HEADER_SIZE)

    # Storing a held key also counts as a use.
    assert tier.store([(c, slots.filled(c, n))]) == [True]
    e = key("e")
    assert tier.store([(e, slots.filled(e, n))]) == [True]
    assert tier.contains([a, c, d, e]) == [False, True, True, True]

    # A chunk larger than the whole tier is refused without evicting anything.
    big = key("big")
    assert tier.store([(big, slots.filled(big, 4 * n))]) == [False]
    assert tier.usage().objects == 3


def test_eviction_of_several_small_for_one_large(
    make_tier: Callable[..., DiskTier], slots: Slots
) -> None:
    tier = make_tier(capacity=4 * (1000 + HEADER_SIZE))
    small = [key(i) for i in range(4)]
    tier.store([(k, slots.filled(k, 1000)) for k in small])
    big = key("big")
    assert tier.store([(big, slots.filled(big, 2500))]) == [True]
    assert tier.contains(small) == [False, False, False, True]
    assert tier.usage().bytes_used == 1000 + 2500 + 2 * HEADER_SIZE


# -- per namespace (what the server's tenant quotas use) --------------------------------
def key_in(namespace: bytes, i: int) -> bytes:
    return namespace + hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def test_usage_and_oldest_first_eviction_per_namespace(
    make_tier: Callable[..., DiskTier], slots: Slots
) -> None:
    n, f = 1000, 1000 + HEADER_SIZE
    ns_a, ns_b, ns_c = NAMESPACE, b"b" * 16, b"c" * 16
    tier = make_tier()
    a, b, c = ([key_in(ns, i) for i in range(4)] for ns in (ns_a, ns_b, ns_c))
    for i in range(4):  # a0 b0 c0 a1 b1 c1 ...: one LRU order across the namespaces
        for k in (a[i], b[i], c[i]):
            assert tier.store([(k, slots.filled(k, n))]) == [True]
    assert tier.namespace_usage() == {ns_a: 4 * f, ns_b: 4 * f, ns_c: 4 * f}
    assert tier.namespace_usage([ns_b, b"x" * 16]) == {ns_b: 4 * f}
    assert tier.load([(a[0], slots.blank(n))]) == [LoadStatus.OK]  # a0: most recent now
    assert tier.store([(b[1], slots.filled(b[1], n))]) == [True]  # held: a use too

    victims = tier.evict_oldest([ns_a, ns_b], 3 * f - 1)
    assert victims == [(b[0], f), (a[1], f), (a[2], f)]
    assert tier.contains([*a, *b]) == [True, False, False, True, False, True, True, True]
    assert not any(os.path.exists(tier.file_path(k)) for k, _ in victims)
    assert tier.namespace_usage() == {ns_a: 2 * f, ns_b: 3 * f, ns_c: 4 * f}
    assert tier.usage().bytes_used == 9 * f
    assert (tier.stats().evictions, tier.stats().evicted_bytes) == (3, 3 * f)
    assert tier.evict_oldest([ns_c], 0) == [] and tier.evict_oldest([b"x" * 16], f) == []
    assert len(tier.evict_oldest([ns_c], 100 * f)) == 4  # all it has, no more
    assert ns_c not in tier.namespace_usage()

    before = tier.namespace_usage()
    tier.close()
    assert make_tier().namespace_usage() == before  # rebuilt from the file names


# -- restart -----------------------------------------------------------------------------
def test_restart_rebuilds_index_and_hits(make_tier: Callable[..., DiskTier], slots: Slots) -> None:
    first = make_tier()
    keys = [key(i) for i in range(20)]
    sizes = [1000 + 37 * i for i in range(20)]
    assert all(first.store([(k, slots.filled(k, n)) for k, n in zip(keys, sizes, strict=True)]))
    before = first.usage()
    first.close()

    second = make_tier()
    assert second.usage() == before
    assert second.contains(keys) == [True] * 20
    dst = [slots.blank(n) for n in sizes]
    assert second.load(list(zip(keys, dst, strict=True))) == [LoadStatus.OK] * 20
    assert all(same(v, k) for v, k in zip(dst, keys, strict=True))


def test_restart_orders_lru_by_mtime(make_tier: Callable[..., DiskTier], slots: Slots) -> None:
    n = 2048
    first = make_tier()
    a, b, c, d = (key(x) for x in "abcd")
    first.store([(k, slots.filled(k, n)) for k in (a, b, c)])
    first.close()
    # Explicit mtimes (no reliance on clock resolution): c oldest, then a, then b.
    for k, t in ((c, 1_000), (a, 2_000), (b, 3_000)):
        os.utime(first.file_path(k), ns=(t * 10**9, t * 10**9))

    second = make_tier(capacity=3 * (n + HEADER_SIZE))
    second.store([(d, slots.filled(d, n))])
    assert second.contains([a, b, c, d]) == [True, True, False, True]


def test_load_bumps_mtime_so_recency_survives_restart(
    make_tier: Callable[..., DiskTier], slots: Slots
) -> None:
    tier = make_tier()
    k = key(1)
    tier.store([(k, slots.filled(k, 512))])
    old = 978_307_200 * 10**9  # 2001-01-01
    os.utime(tier.file_path(k), ns=(old, old))
    assert tier.load([(k, slots.blank(512))]) == [LoadStatus.OK]
    assert os.stat(tier.file_path(k)).st_mtime_ns > old


def test_restart_with_smaller_capacity_evicts_oldest(
    make_tier: Callable[..., DiskTier], slots: Slots
) -> None:
    n = 1024
    first = make_tier()
    keys = [key(i) for i in range(6)]
    first.store([(k, slots.filled(k, n)) for k in keys])
    first.close()
    for i, k in enumerate(keys):
        os.utime(first.file_path(k), ns=((i + 1) * 10**9, (i + 1) * 10**9))
    second = make_tier(capacity=2 * (n + HEADER_SIZE))
    assert second.contains(keys) == [False] * 4 + [True] * 2
    assert len(chunk_files(Path(second.path))) == 2
    assert second.stats().evictions == 4


def test_restart_removes_leftovers(make_tier: Callable[..., DiskTier], slots: Slots) -> None:
    first = make_tier()
    k = key("good")
    first.store([(k, slots.filled(k, 3000))])
    first.close()
    root = Path(first.path)
    good = Path(first.file_path(k))
    # A torn write: the temporary file a crash left next to the final name.
    torn_key = key("torn")
    torn_final = Path(first.file_path(torn_key))
    torn_final.parent.mkdir(parents=True, exist_ok=True)
    tmp = torn_final.with_name(torn_final.name + ".123-4.tmp")
    tmp.write_bytes(good.read_bytes()[:1000])
    # A file too short to hold a header, a foreign name, a key filed in the wrong directory.
    short_key = key("short")
    short = Path(first.file_path(short_key))
    short.parent.mkdir(parents=True, exist_ok=True)
    short.write_bytes(b"TKV1")
    (good.parent / "notes.txt").write_text("x")
    misplaced = root / "00" / "00" / good.name
    misplaced.parent.mkdir(parents=True, exist_ok=True)
    misplaced.write_bytes(good.read_bytes())
    assert good.parent != misplaced.parent
    # Things outside the fan-out directories are not ours: left alone.
    (root / "README.operator").write_text("keep me")

    second = make_tier()
    assert second.contains([k, torn_key, short_key]) == [True, False, False]
    assert not tmp.exists() and not short.exists() and not misplaced.exists()
    assert not (good.parent / "notes.txt").exists()
    assert (root / "README.operator").exists()
    assert second.stats().removed_at_start == 4
    assert second.usage().objects == 1
    assert second.load([(torn_key, slots.blank(3000))]) == [LoadStatus.MISSING]


def test_one_directory_one_tier(make_tier: Callable[..., DiskTier], tmp_path: Path) -> None:
    first = make_tier()
    with pytest.raises(TierError, match="in use by another"):
        DiskTier(path=tmp_path / "disk", capacity="1MiB")
    first.close()
    make_tier()  # free again once the first is closed


def test_registry_and_options(tmp_path: Path) -> None:
    assert "disk" in tier_names()
    tier = create_tier("disk", {"path": str(tmp_path / "d"), "capacity": "2MiB", "fsync": True})
    try:
        assert isinstance(tier, DiskTier)
        assert tier.usage().capacity == 2 * MIB
        assert tier.fsync
        assert "0 extra copies" in tier.copies()
    finally:
        tier.close()
    with pytest.raises(TierError, match="capacity"):
        create_tier("disk", {"path": str(tmp_path / "e"), "capacity": "lots"})
    with pytest.raises(TierError, match="capacity"):
        create_tier("disk", {"path": str(tmp_path / "e"), "capacity": 0})
    with pytest.raises(TierError, match="unknown option 'colour'"):
        create_tier("disk", {"path": str(tmp_path / "e"), "colour": "blue"})
    with pytest.raises(TierError, match="missing required option 'path'"):
        create_tier("disk", {"capacity": "1GiB"})
    for threads in ("0", "65", "-1", "many"):
        with pytest.raises(TierError, match="threads"):
            create_tier("disk", {"path": str(tmp_path / "e"), "threads": threads})
    tier = create_tier("disk", {"path": str(tmp_path / "t"), "threads": "3"})
    tier.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_a_large_batch_keeps_every_status_in_place(
    make_tier: Callable[..., DiskTier], slots: Slots, threads: int
) -> None:
    """Batches above the parallel threshold: each chunk's own status, whichever thread ran
    it; a damaged file in the middle is CORRUPT, an absent key MISSING, the rest exact."""
    tier = make_tier(threads=threads)
    keys = [key(f"batch-{i}") for i in range(12)]
    assert tier.store([(k, slots.filled(k, MIB)) for k in keys]) == [True] * 12
    Path(tier.file_path(keys[5])).write_bytes(b"\0" * (HEADER_SIZE + MIB))
    wanted = [*keys[:8], key("absent"), *keys[8:]]
    dst = [slots.blank(MIB) for _ in wanted]
    statuses = tier.load(list(zip(wanted, dst, strict=True)))
    expect = [LoadStatus.OK] * 13
    expect[5], expect[8] = LoadStatus.CORRUPT, LoadStatus.MISSING
    assert statuses == expect
    for d, k, st in zip(dst, wanted, statuses, strict=True):
        assert st is not LoadStatus.OK or same(d, k)


def test_fsync_round_trip(make_tier: Callable[..., DiskTier], slots: Slots) -> None:
    tier = make_tier(fsync=True)
    k = key(1)
    assert tier.store([(k, slots.filled(k, 8192))]) == [True]
    dst = slots.blank(8192)
    assert tier.load([(k, dst)]) == [LoadStatus.OK] and same(dst, k)


# -- damaged files -----------------------------------------------------------------------
def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _flip_payload(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + 100)
        b = f.read(1)
        f.seek(HEADER_SIZE + 100)
        f.write(bytes([b[0] ^ 0x01]))


def _bad_magic(path: Path) -> None:
    with open(path, "r+b") as f:
        f.write(b"XXXX")


def _zeroed(path: Path) -> None:
    # What a power loss without fsync can leave: the name is there, the data never was.
    path.write_bytes(bytes(path.stat().st_size))


def _append(path: Path) -> None:
    # A self-consistent record with trailing bytes: the file is not HEADER_SIZE + length.
    with open(path, "ab") as f:
        f.write(b"trailing garbage")


DAMAGE: dict[str, Callable[[Path], None]] = {
    "appended bytes": _append,
    "truncated": _truncate,
    "flipped payload byte": _flip_payload,
    "bad magic": _bad_magic,
    "zero-filled": _zeroed,
}


@pytest.mark.parametrize("restart", [False, True], ids=["live", "after-restart"])
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_file_is_corrupt_and_removed(
    make_tier: Callable[..., DiskTier],
    slots: Slots,
    damage: str,
    restart: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    n = 4096
    tier = make_tier()
    k, other = key("victim"), key("bystander")
    tier.store([(k, slots.filled(k, n)), (other, slots.filled(other, n))])
    path = Path(tier.file_path(k))
    DAMAGE[damage](path)
    if restart:
        tier.close()
        tier = make_tier()

    dst = slots.blank(n)
    assert tier.load([(k, dst)]) == [LoadStatus.CORRUPT]
    assert not path.exists()
    assert tier.contains([k, other]) == [False, True]
    assert tier.stats().corrupt == 1
    assert tier.usage().objects == 1
    assert tier.load([(k, slots.blank(n))]) == [LoadStatus.MISSING]
    ok = slots.blank(n)
    assert tier.load([(other, ok)]) == [LoadStatus.OK] and same(ok, other)
    assert any("corrupt" in r.getMessage() for r in warnings_of(caplog))


def test_header_of_another_key_is_corrupt(make_tier: Callable[..., DiskTier], slots: Slots) -> None:
    n = 2048
    tier = make_tier()
    a, b = key("a"), key("b")
    tier.store([(a, slots.filled(a, n)), (b, slots.filled(b, n))])
    shutil.copyfile(tier.file_path(a), tier.file_path(b))  # b's name, a's record
    dst = slots.blank(n)
    assert tier.load([(b, dst)]) == [LoadStatus.CORRUPT]
    assert not os.path.exists(tier.file_path(b))
    assert tier.load([(a, dst)]) == [LoadStatus.OK] and same(dst, a)


def test_wrong_length_view_is_corrupt_but_keeps_the_chunk(
    make_tier: Callable[..., DiskTier], slots: Slots
) -> None:
    tier = make_tier()
    k = key(1)
    tier.store([(k, slots.filled(k, 4096))])
    assert tier.load([(k, slots.blank(4000))]) == [LoadStatus.CORRUPT]
    assert tier.load([(k, slots.blank(5000))]) == [LoadStatus.CORRUPT]
    assert tier.stats().corrupt == 2
    dst = slots.blank(4096)
    assert tier.load([(k, dst)]) == [LoadStatus.OK] and same(dst, k)


def test_grown_file_after_restart_is_corrupt(
    make_tier: Callable[..., DiskTier], slots: Slots
) -> None:
    first = make_tier()
    k = key(1)
    first.store([(k, slots.filled(k, 4096))])
    first.close()
    with open(first.file_path(k), "ab") as f:
        f.write(b"trailing garbage")
    second = make_tier()
    # The file no longer matches its own header: removed, whatever view the load brings.
    assert second.load([(k, slots.blank(4096))]) == [LoadStatus.CORRUPT]
    assert not os.path.exists(second.file_path(k))


def _directory_at(path: Path) -> None:
    path.unlink(missing_ok=True)
    (path / "sub").mkdir(parents=True)
    (path / "sub" / "file").write_bytes(b"not a chunk")


def _symlink_at(path: Path) -> None:
    # A link to a valid copy of the chunk: still not a chunk file of this tier.
    target = path.with_name("elsewhere")
    if path.exists():
        path.rename(target)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(b"x")
    path.symlink_to(target.name)


OBSTACLES: dict[str, Callable[[Path], None]] = {
    "directory": _directory_at,
    "symlink": _symlink_at,
}


@pytest.mark.parametrize("restart", [False, True], ids=["live", "after-restart"])
@pytest.mark.parametrize("obstacle", sorted(OBSTACLES))
def test_something_else_at_a_chunks_path_is_removed_not_blocking(
    make_tier: Callable[..., DiskTier], slots: Slots, obstacle: str, restart: bool
) -> None:
    """Not a regular file at a chunk's name, where a chunk was (``held``) and where none
    was yet (``fresh``): running or restarted, the chunk is stored and loaded again."""
    n = 4096
    tier = make_tier()
    held, fresh = key("held"), key("fresh")
    assert tier.store([(held, slots.filled(held, n))]) == [True]
    for k in (held, fresh):
        OBSTACLES[obstacle](Path(tier.file_path(k)))
    if restart:
        tier.close()
        tier = make_tier()
        assert tier.stats().removed_at_start >= 2
        assert not os.path.lexists(tier.file_path(held))
        assert tier.load([(held, slots.blank(n))]) == [LoadStatus.MISSING]
    else:
        assert tier.load([(held, slots.blank(n))]) == [LoadStatus.CORRUPT]
        assert not os.path.lexists(tier.file_path(held))
    assert tier.contains([held, fresh]) == [False, False]
    assert tier.usage().objects == 0 and tier.usage().bytes_used == 0

    assert tier.store([(k, slots.filled(k, n)) for k in (held, fresh)]) == [True, True]
    for k in (held, fresh):
        assert Path(tier.file_path(k)).is_file() and not Path(tier.file_path(k)).is_symlink()
        dst = slots.blank(n)
        assert tier.load([(k, dst)]) == [LoadStatus.OK] and same(dst, k)
    tier.close()
    again = make_tier()
    assert again.contains([held, fresh]) == [True, True]


def test_file_removed_behind_the_tiers_back_is_missing(
    make_tier: Callable[..., DiskTier], slots: Slots
) -> None:
    tier = make_tier()
    k = key(1)
    tier.store([(k, slots.filled(k, 100))])
    os.unlink(tier.file_path(k))
    assert tier.load([(k, slots.blank(100))]) == [LoadStatus.MISSING]
    assert tier.usage().objects == 0 and tier.usage().bytes_used == 0


# -- full and read-only disks ------------------------------------------------------------
def _fail_writes(monkeypatch: pytest.MonkeyPatch, code: int) -> list[int]:
    calls: list[int] = []

    def pwrite(fd: int, data: object, offset: int) -> int:
        calls.append(fd)
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "pwrite", pwrite)
    return calls


def test_full_disk_degrades_with_one_log_line(
    make_tier: Callable[..., DiskTier],
    slots: Slots,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    tier = make_tier()
    kept = key("kept")
    tier.store([(kept, slots.filled(kept, 4096))])
    caplog.clear()

    calls = _fail_writes(monkeypatch, errno.ENOSPC)
    keys = [key(i) for i in range(30)]
    for batch in (keys[:10], keys[10:20], keys[20:]):
        assert tier.store([(k, slots.filled(k, 4096)) for k in batch]) == [False] * 10
    assert len(calls) == 1  # the first failure disables writes; the rest never touch the disk
    assert len(warnings_of(caplog)) == 1
    record = warnings_of(caplog)[0]
    assert record.levelno == logging.ERROR and "No space left" in record.getMessage()
    stats = tier.stats()
    assert stats.writes_disabled and "ENOSPC" in stats.disabled_reason
    assert stats.store_failed == 30
    assert not [p for p in chunk_files(Path(tier.path)) if p.endswith(".tmp")]

    # Chunks already on disk stay readable; chunks never written miss.
    dst = slots.blank(4096)
    assert tier.load([(kept, dst), (keys[0], slots.blank(4096))]) == [
        LoadStatus.OK,
        LoadStatus.MISSING,
    ]
    assert same(dst, kept)
    assert tier.usage().objects == 1


def test_full_disk_recovers_on_a_later_probe(
    make_tier: Callable[..., DiskTier],
    slots: Slots,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    tier = make_tier(retry_interval=0)  # every store after a failure is a probe
    calls = _fail_writes(monkeypatch, errno.ENOSPC)
    for i in range(5):
        assert tier.store([(key(i), slots.filled(key(i), 1000))]) == [False]
    assert len(calls) == 5  # each store probed ...
    assert len(warnings_of(caplog)) == 1  # ... and only the first failure was logged loudly
    assert tier.writes_disabled

    monkeypatch.undo()  # space freed
    k = key("after")
    assert tier.store([(k, slots.filled(k, 1000))]) == [True]
    assert not tier.writes_disabled
    assert any("re-enabled" in r.getMessage() for r in caplog.records)
    dst = slots.blank(1000)
    assert tier.load([(k, dst)]) == [LoadStatus.OK] and same(dst, k)


def test_read_only_disk_degrades(
    make_tier: Callable[..., DiskTier],
    slots: Slots,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    tier = make_tier()
    kept = key("kept")
    tier.store([(kept, slots.filled(kept, 2048))])
    caplog.clear()
    real_open = os.open

    def read_only_open(path: str, flags: int, mode: int = 0o777, **kw: object) -> int:
        if flags & (os.O_CREAT | os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real_open(path, flags, mode, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", read_only_open)
    results = [tier.store([(key(i), slots.filled(key(i), 2048))]) for i in range(10)]
    assert results == [[False]] * 10
    assert len(warnings_of(caplog)) == 1
    assert "EROFS" in tier.stats().disabled_reason
    dst = slots.blank(2048)
    assert tier.load([(kept, dst)]) == [LoadStatus.OK] and same(dst, kept)


def test_directory_that_cannot_be_created_degrades(
    tmp_path: Path, slots: Slots, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    tier = DiskTier(path=blocker / "disk", capacity="1MiB")  # no exception
    try:
        k = key(1)
        for _ in range(5):
            assert tier.store([(k, slots.filled(k, 100))]) == [False]
        assert tier.load([(k, slots.blank(100))]) == [LoadStatus.MISSING]
        assert tier.contains([k]) == [False]
        assert len(warnings_of(caplog)) == 1
        assert tier.writes_disabled
    finally:
        tier.close()


def _permissions_enforced(where: Path) -> bool:
    """Whether a mode-0500 directory stops this process's writes (not for plain root)."""
    probe = where / "perm-probe"
    probe.mkdir()
    probe.chmod(0o500)
    try:
        (probe / "x").write_bytes(b"")
    except PermissionError:
        return True
    finally:
        probe.chmod(0o700)
    return False


def test_unwritable_directory_degrades(
    make_tier: Callable[..., DiskTier],
    slots: Slots,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    if not _permissions_enforced(tmp_path):
        pytest.skip("directory permissions do not apply to this user (root)")
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    tier = make_tier()
    kept = key("kept")
    tier.store([(kept, slots.filled(kept, 100))])
    caplog.clear()
    root = Path(tier.path)
    modes = {p: p.stat().st_mode for p in [root, *root.rglob("*")] if p.is_dir()}
    for p in modes:
        p.chmod(0o500)
    try:
        for i in range(5):
            assert tier.store([(key(i), slots.filled(key(i), 100))]) == [False]
        assert len(warnings_of(caplog)) == 1
        dst = slots.blank(100)
        assert tier.load([(kept, dst)]) == [LoadStatus.OK] and same(dst, kept)
    finally:
        for p, mode in modes.items():
            p.chmod(mode)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, where a real ENOSPC happens (skipped where mount is not allowed)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.processes
def test_real_full_disk_on_tmpfs(
    tiny_tmpfs: Path, slots: Slots, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    n = 256 * KIB
    tier = DiskTier(path=tiny_tmpfs / "disk", capacity="1GiB", retry_interval=0)
    try:
        caplog.clear()
        stored: list[bytes] = []
        results: list[bool] = []
        for i in range(8):  # 8 x 256 KiB cannot fit in 1 MiB
            k = key(i)
            ok = tier.store([(k, slots.filled(k, n))])[0]
            results.append(ok)
            if ok:
                stored.append(k)
        assert stored and not all(results)
        assert tier.writes_disabled and "ENOSPC" in tier.stats().disabled_reason
        assert len(warnings_of(caplog)) == 1
        assert not [p for p in chunk_files(tiny_tmpfs) if p.endswith(".tmp")]
        for k in stored:
            dst = slots.blank(n)
            assert tier.load([(k, dst)]) == [LoadStatus.OK] and same(dst, k)

        # Freeing space lets the next probe through.
        assert tier.delete(stored) == len(stored)
        k = key("after")
        assert tier.store([(k, slots.filled(k, n))]) == [True]
        assert not tier.writes_disabled
    finally:
        tier.close()


# -- concurrency -------------------------------------------------------------------------
def test_concurrent_store_load_delete_stay_consistent(
    make_tier: Callable[..., DiskTier], slots: Slots
) -> None:
    n = 8 * KIB
    threads_n, ops = 8, 300
    tier = make_tier(capacity=24 * (n + HEADER_SIZE))
    keys = [key(i) for i in range(64)]
    bad: list[str] = []
    start = threading.Barrier(threads_n)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        src = {k: slots.filled(k, n) for k in rng.sample(keys, 16)}
        dst = slots.view(n)
        start.wait()
        try:
            for _ in range(ops):
                op = rng.random()
                if op < 0.45:
                    batch = rng.sample(sorted(src), 3)
                    tier.store([(k, src[k]) for k in batch])
                elif op < 0.85:
                    k = rng.choice(keys)
                    status = tier.load([(k, dst)])[0]
                    if status is LoadStatus.OK and not same(dst, k):
                        bad.append(f"wrong bytes for {k.hex()}")
                    elif status not in (LoadStatus.OK, LoadStatus.MISSING):
                        bad.append(f"{status.name} for {k.hex()}")
                elif op < 0.95:
                    tier.delete(rng.sample(keys, 4))
                else:
                    tier.contains(keys)
        except Exception as exc:  # pragma: no cover - reported below
            bad.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == []

    usage = tier.usage()
    files = chunk_files(Path(tier.path))
    assert not [p for p in files if not p.endswith(".kv")]  # no temporary files left
    assert usage.objects == len(files)
    assert usage.bytes_used == sum(files.values())
    assert usage.bytes_used <= usage.capacity
    assert tier.namespace_usage() == ({NAMESPACE: usage.bytes_used} if files else {})
    held = tier.contains(keys)
    assert held == [os.path.exists(tier.file_path(k)) for k in keys]
    stats = tier.stats()
    assert stats.corrupt == 0 and stats.errors == 0
    assert stats.objects == stats.stores - stats.evictions - stats.deletes

    tier.close()
    again = make_tier(capacity=24 * (n + HEADER_SIZE))
    assert again.usage() == usage
    assert again.contains(keys) == held


# -- copies ------------------------------------------------------------------------------
def test_no_payload_sized_allocation_on_store_and_load(
    make_tier: Callable[..., DiskTier], slots: Slots
) -> None:
    n = 8 * MIB
    tier = make_tier()
    k = key("big")
    src = slots.filled(k, n)
    dst = slots.blank(n)
    tier.store([(key("warm-up"), slots.filled(key("warm-up"), 4096))])
    tier.load([(key("warm-up"), slots.blank(4096))])

    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        stored = tier.store([(k, src)])
        loaded = tier.load([(k, dst)])
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert stored == [True] and loaded == [LoadStatus.OK]
    assert same(dst, k)
    assert peak < 256 * KIB, f"peak Python allocation {peak} bytes for an {n}-byte chunk"
