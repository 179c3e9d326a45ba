"""The controller's index: key tables and per-instance holdings, checked against a plain
Python model of the same operations."""

from __future__ import annotations

import os
import random
import threading

import numpy as np
import pytest

from tierkv.cluster.router_lookup import prefix_runs
from tierkv.controller import holders as holders_module
from tierkv.controller import index as index_module
from tierkv.controller import keytable
from tierkv.controller.holders import SLOTS, HolderFilter, merge_parts, pack_sorted
from tierkv.controller.index import REBASE_MIN, ControllerIndex
from tierkv.controller.keytable import NO_TIER, KeyTable, fingerprints

NS_A = b"A" * 16
NS_B = b"B" * 16


def keys_of(ns: bytes, n: int) -> list[bytes]:
    return [ns + os.urandom(16) for _ in range(n)]


def test_fingerprints_are_nonzero_and_separate_namespaces() -> None:
    chunk = os.urandom(16)
    fa, fb = fingerprints([NS_A + chunk, NS_B + chunk])
    assert fa != fb and fa >= 1 and fb >= 1
    with pytest.raises(ValueError):
        fingerprints(b"x" * 31)


def test_the_c_helper_fingerprints_keys_bit_for_bit_as_numpy_does() -> None:
    """`make test` builds tierkv._fingerprints; both ways give the same fingerprints (a
    controller's tables do not depend on whether the helper was built)."""
    assert keytable.NATIVE_FINGERPRINTS, "tierkv._fingerprints was not built (needs a C compiler)"
    rng = np.random.default_rng(7)
    for n in (0, 1, 5, 4097):
        blob = rng.integers(0, 256, n * 32, dtype=np.uint8).tobytes()
        native, numpy_way = fingerprints(blob), keytable.fingerprints_numpy(blob)
        assert native.dtype == numpy_way.dtype == np.uint64
        assert np.array_equal(native, numpy_way)
    structured = [bytes([i]) * 32 for i in range(256)]  # keys far from random
    assert np.array_equal(fingerprints(structured), keytable.fingerprints_numpy(structured))
    # The namespace every key shares, found in the same pass (None: several, or no keys).
    one = b"".join(keys_of(NS_A, 1000))
    assert keytable.fingerprints_and_namespace(one)[1] == NS_A
    assert keytable.fingerprints_and_namespace(one + NS_B + b"c" * 16)[1] is None
    assert keytable.fingerprints_and_namespace(NS_B + one[16:])[1] is None  # the first differs
    assert keytable.fingerprints_and_namespace(b"")[1] is None
    with pytest.raises(ValueError):
        keytable.fingerprints_numpy(b"x" * 33)


def test_key_table_matches_a_model_through_adds_removes_and_growth() -> None:
    rng = random.Random(7)
    table = KeyTable()
    model: dict[int, int] = {}
    universe = fingerprints(b"".join(keys_of(NS_A, 20_000)))
    for _ in range(60):
        pick = np.array(rng.sample(range(universe.size), rng.randint(1, 3000)))
        fps = universe[pick]
        if rng.random() < 0.6:
            tiers = np.array([rng.randint(0, 1) for _ in pick], dtype=np.int8)
            before = table.add(fps, tiers)
            want_before = [model.get(int(f), NO_TIER) for f in fps]
            # a key given twice in the batch: the first occurrence's "before" is the model's
            seen: set[int] = set()
            for f, b, w in zip(fps.tolist(), before.tolist(), want_before, strict=True):
                if f not in seen:
                    assert b == w
                seen.add(f)
            final = table.tiers(fps)
            for f, t in zip(fps.tolist(), final.tolist(), strict=True):
                model[f] = t
            assert set(final.tolist()) <= {0, 1}
        else:
            before = table.remove(fps)
            for f, b in zip(fps.tolist(), before.tolist(), strict=True):
                assert b == model.pop(f, NO_TIER) or b == NO_TIER
        got = table.tiers(universe)
        want = np.array([model.get(int(f), NO_TIER) for f in universe], dtype=np.int8)
        np.testing.assert_array_equal(got, want)
        assert len(table) == len(model)
        assert table.by_tier[:2].tolist() == [
            sum(1 for t in model.values() if t == 0),
            sum(1 for t in model.values() if t == 1),
        ]
    assert table.capacity >= 2 * len(table)


def test_build_from_a_full_report_dedupes_and_finds_everything() -> None:
    keys = keys_of(NS_A, 5000)
    fps = fingerprints(keys + keys[:10])
    tiers = np.array([i % 2 for i in range(fps.size)], dtype=np.int8)
    table = KeyTable.build(fps, tiers)
    assert len(table) == 5000
    got = table.tiers(fps[:5000])
    assert (got >= 0).all()
    absent = fingerprints(keys_of(NS_A, 5000))
    assert (table.tiers(absent) == NO_TIER).all()
    assert (table.find(absent) == -1).all()


def test_the_c_placement_builds_the_table_numpy_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Repeats (kept once), mixed tiers, crowded homes and homes at the very end of the
    table (whose entries run past it: the tail grows) come out slot for slot the same."""
    assert keytable._place is not None, "tierkv._fingerprints was not built"
    rng = np.random.default_rng(11)
    top = np.uint64((1 << keytable.FP_BITS) - 1)
    cases = [
        rng.integers(2, 1 << 62, 20_000, dtype=np.uint64),
        np.concatenate(
            [
                top - np.arange(0, 100, 2, dtype=np.uint64),
                rng.integers(2, 1 << 62, 500, dtype=np.uint64),
            ]
        ),
        np.repeat(rng.integers(2, 1 << 62, 300, dtype=np.uint64), 3),
        np.zeros(0, dtype=np.uint64),
    ]
    grew = False
    for fps in cases:
        fps = np.maximum(fps + np.arange(fps.size, dtype=np.uint64) % 2, np.uint64(1)) & top
        tiers = rng.integers(0, 2, fps.size).astype(np.int8)
        native = KeyTable.build(fps, tiers)
        monkeypatch.setattr(keytable, "_place", None)
        reference = KeyTable.build(fps, tiers)
        monkeypatch.undo()
        assert np.array_equal(native.slots, reference.slots)
        assert len(native) == len(reference) and native.deleted == reference.deleted == 0
        assert native.by_tier.tolist() == reference.by_tier.tolist()
        grew = grew or native.slots.size > KeyTable.sized_for(fps.size).slots.size
    assert grew, "no case ran past the table's end"


def test_index_lookup_returns_every_holder_with_its_tier() -> None:
    idx = ControllerIndex()
    keys = keys_of(NS_A, 8)
    idx.add("a", keys[:5], 0)
    idx.add("b", keys[:3], 1)
    idx.add("b", keys[4:6], 0)
    found = idx.lookup(keys)
    assert set(found) == {"a", "b"}
    assert found["a"].tolist() == [0, 0, 0, 0, 0, -1, -1, -1]
    assert found["b"].tolist() == [1, 1, 1, -1, 0, 0, -1, -1]
    assert prefix_runs(found) == {"a": (5, [5, 0]), "b": (3, [0, 3])}
    # another namespace's key with the same chunk hash is nobody's
    assert idx.lookup([NS_B + keys[0][16:]]) == {}


def test_index_counts_per_namespace_and_tier_through_moves_and_evictions() -> None:
    idx = ControllerIndex()
    a, b = keys_of(NS_A, 6), keys_of(NS_B, 4)
    idx.add("x", a + b, 0)
    idx.add("x", a[:2] + a[:2], 1)  # moved to disk, given twice
    assert idx.namespaces("x") == {NS_A.hex(): [4, 2, 0, 0], NS_B.hex(): [4, 0, 0, 0]}
    assert idx.remove("x", b + b[:1]) == 4
    assert idx.namespaces("x") == {NS_A.hex(): [4, 2, 0, 0]}
    assert idx.by_tier("x")[:2] == [4, 2] and idx.size("x") == 6
    assert idx.remove("nobody", a) == 0


def _grouping(digests: list[bytes], index: np.ndarray) -> list[bytes]:
    """Each key's namespace digest, as a grouping assigns it."""
    return [digests[i] for i in index.tolist()]


@pytest.mark.parametrize("native", [True, False])
def test_keys_are_grouped_by_namespace_whatever_their_order(
    monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """namespace_groups (in C, or folded and sorted by numpy): every key is given its own
    digest, each digest listed once, for runs and interleavings of 1 to 64 namespaces, more
    namespaces than the C helper groups (numpy takes over), and two digests whose folded
    words are equal (told apart all the same)."""
    if native:
        assert keytable._namespaces is not None, "tierkv._fingerprints was not built"
    else:
        monkeypatch.setattr(keytable, "_namespaces", None)
    rng = np.random.default_rng(13)
    m1 = int(keytable._M1)
    a0, b1 = 0x0123456789ABCDEF, 0x0FEDCBA987654321
    fold = (b1 * m1 % 2**64) ^ a0
    b0 = 0x1111111111111111  # a second digest folded alike: a1 ^ b0 * M1 == fold
    a1 = fold ^ (b0 * m1 % 2**64)
    twins = [
        a0.to_bytes(8, "little") + b1.to_bytes(8, "little"),
        a1.to_bytes(8, "little") + b0.to_bytes(8, "little"),
    ]
    cases = [[rng.bytes(16) for _ in range(k)] for k in (1, 2, 4, 64, keytable.NAMESPACE_CAP + 5)]
    for case, spaces in enumerate([*cases, twins]):
        n = max(3000, 2 * len(spaces))
        pick = (
            rng.integers(0, len(spaces), n)
            if case % 2
            else np.repeat(np.arange(len(spaces)), -(-n // len(spaces)))[:n]
        )  # interleaved, or in runs
        pick[: len(spaces)] = np.arange(len(spaces))  # every namespace present
        keys = [spaces[i] + rng.bytes(16) for i in pick.tolist()]
        digests, index = keytable.namespace_groups(keytable.key_array(keys))
        assert len(digests) == len(set(digests)) == len(spaces), case
        assert _grouping(digests, index) == [k[:16] for k in keys], case
    assert keytable.namespace_groups(keytable.key_array(b""))[0] == []


def test_the_c_namespace_grouping_refuses_arguments_of_the_wrong_shape() -> None:
    from tierkv._fingerprints import namespaces

    keys = b"".join(keys_of(NS_A, 4))
    with pytest.raises(ValueError, match="32 bytes"):
        namespaces(keys[:-1], np.empty(4, np.int64), 8)
    with pytest.raises(ValueError, match="index"):
        namespaces(keys, np.empty(3, np.int64), 8)
    with pytest.raises(ValueError, match="cap"):
        namespaces(keys, np.empty(4, np.int64), 0)
    assert namespaces(keys + b"".join(keys_of(NS_B, 1)), np.empty(5, np.int64), 1) is None


def test_large_batches_with_repeats_count_each_key_once() -> None:
    """Batches past the radix sort's threshold, keys given twice in them: added, moved and
    removed keys are counted once per namespace and tier."""
    idx = ControllerIndex()
    a, b = keys_of(NS_A, 3000), keys_of(NS_B, 1000)
    assert idx.add("x", a + b + a[:500] + b[:10], 0) == 4000
    assert idx.namespaces("x") == {NS_A.hex(): [3000, 0, 0, 0], NS_B.hex(): [1000, 0, 0, 0]}
    assert idx.add("x", a[:1500] + a[:1500], 1) == 0  # moved, each given twice
    assert idx.namespaces("x") == {NS_A.hex(): [1500, 1500, 0, 0], NS_B.hex(): [1000, 0, 0, 0]}
    assert idx.remove("x", a[1000:2000] + a[1000:2000] + b) == 2000
    assert idx.namespaces("x") == {NS_A.hex(): [1000, 1000, 0, 0]}
    assert idx.size("x") == 2000
    idx.close()


def test_full_report_replaces_and_deregister_drops_in_bulk() -> None:
    idx = ControllerIndex()
    old, new = keys_of(NS_A, 1000), keys_of(NS_A, 3000)
    idx.add("x", old, 0)
    idx.add("y", old[:10], 0)
    assert idx.replace("x", b"".join(new), np.zeros(3000, dtype=np.int8)) == 3000
    assert set(idx.lookup(old)) == {"y"}
    assert (idx.lookup(new)["x"] == 0).all()
    assert idx.namespaces("x") == {NS_A.hex(): [3000, 0, 0, 0]}
    assert idx.drop("x") == 3000
    assert idx.lookup(new) == {} and idx.instances() == ["y"] and idx.total() == 10
    # A report of two namespaces and two tiers is counted per namespace and tier.
    a, b = keys_of(NS_A, 30), keys_of(NS_B, 20)
    tiers = np.array([i % 2 for i in range(50)], dtype=np.int8)
    assert idx.replace("z", a + b, tiers) == 50
    assert idx.namespaces("z") == {NS_A.hex(): [15, 15, 0, 0], NS_B.hex(): [10, 10, 0, 0]}
    idx.settle()
    assert idx.merges >= 1 and idx.merge_seconds > 0  # counted and timed (the metrics')
    idx.close()


def test_filter_names_every_slot_of_a_key_and_forgets_retired_ones_after_a_merge() -> None:
    f = HolderFilter()
    keys = fingerprints(keys_of(NS_A, 100))
    a, b, c = f.take_slot("a"), f.take_slot("b"), f.take_slot("c")
    f.base = merge_parts(
        [pack_sorted(np.sort(keys), a), pack_sorted(np.sort(keys[:50]), b)], f.live_mask()
    )
    f.add_run(pack_sorted(np.sort(keys[40:60]), c))
    assert f.candidates(np.sort(keys[45:46])).tolist() == sorted([a, b, c])
    assert f.candidates(np.sort(keys[70:])).tolist() == [a]
    assert f.candidates(np.sort(fingerprints(keys_of(NS_A, 100)))).tolist() == []
    f.retire(b)
    assert f.candidates(np.sort(keys)).tolist() == sorted([a, c])
    f.base = merge_parts([f.base, *f.runs], f.live_mask())
    f.runs = []
    assert f.base.size == 120
    f.free({b})
    assert f.take_slot("d") == b and f.candidates(np.sort(keys)).tolist() == sorted([a, c])


def test_filter_memory_counts_the_arrays_a_merge_left_as_views() -> None:
    """A merge that drops a few entries keeps a view of its array: counted whole."""
    f = HolderFilter()
    keys = fingerprints(keys_of(NS_A, 100))
    a, b = f.take_slot("a"), f.take_slot("b")
    parts = [pack_sorted(np.sort(keys), a), pack_sorted(np.sort(keys[:10]), b)]
    f.retire(b)
    f.base = merge_parts(parts, f.live_mask())
    assert f.base.size == 100 and f.nbytes == 8 * 110
    f.retire(a)
    f.base = merge_parts([f.base], f.live_mask())  # nearly all dropped: a right-sized copy
    assert f.base.size == 0 and f.nbytes == 0


def test_a_directory_search_finds_what_a_binary_search_of_the_whole_array_finds() -> None:
    rng = np.random.default_rng(3)
    top = np.iinfo(np.uint64).max
    for n in (1, 64, 1000, 70_000):
        arr = np.sort(rng.integers(0, top, n, dtype=np.uint64, endpoint=True))
        arr[n // 2 : n // 2 + n // 10] = arr[n // 2]  # a long run of one value
        arr = np.sort(arr)
        d = holders_module.Directory(arr)
        want = np.sort(
            np.concatenate(
                [
                    rng.integers(0, top, 500, dtype=np.uint64, endpoint=True),
                    arr[rng.integers(0, n, 200)],  # present
                    arr[rng.integers(0, n, 100)] + np.uint64(1),
                    np.array([0, 1, top - 1, top], dtype=np.uint64),
                ]
            )
        )
        assert np.array_equal(d.search(arr, want), np.searchsorted(arr, want, side="left"))
    empty_buckets = np.array([5, 6, top - 3], dtype=np.uint64)
    d = holders_module.Directory(empty_buckets)
    want = np.array([0, 5, 7, 1 << 62, top], dtype=np.uint64)
    assert np.array_equal(d.search(empty_buckets, want), np.searchsorted(empty_buckets, want))


def test_lookups_through_directories_match_a_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The index built with directories on every merged array gives every lookup the same
    answer as without (test_index_matches_a_model... covers the races)."""
    monkeypatch.setattr(holders_module, "DIRECTORY_MIN", 1)
    monkeypatch.setattr(holders_module, "BUCKET_ENTRIES", 4)
    idx = ControllerIndex()
    rng = random.Random(5)
    held: dict[str, set[bytes]] = {}
    try:
        for i in range(6):
            keys = keys_of(NS_A, 3000)
            idx.replace(f"i{i}", b"".join(keys), 0)
            held[f"i{i}"] = set(keys)
            idx.settle()
        assert idx.filter.directory is not None and idx.filter.directory.of is idx.filter.base
        probe = [k for keys in held.values() for k in rng.sample(sorted(keys), 50)]
        probe += keys_of(NS_A, 100)  # held by no one
        found = idx.lookup(b"".join(probe))
        for name, keys in held.items():
            want = [k in keys for k in probe]
            assert [t >= 0 for t in found.get(name, np.full(len(probe), -1))] == want
    finally:
        idx.close()


def test_the_c_helpers_search_the_filter_and_probe_tables_as_numpy_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`make test` builds tierkv._fingerprints: a lookup's filter search (a directory on the
    base, runs beside it) and its table probes (windows overflowing into the next, deleted
    slots) answer as the numpy versions do."""
    assert holders_module._match_slots is not None and keytable._probe is not None
    monkeypatch.setattr(holders_module, "DIRECTORY_MIN", 1)
    monkeypatch.setattr(holders_module, "BUCKET_ENTRIES", 4)
    idx = ControllerIndex()
    try:
        keys = [keys_of(NS_A, 4000) for _ in range(5)]
        for i, ks in enumerate(keys):
            idx.replace(f"i{i}", b"".join(ks), i % 3)
            if i < 3:
                idx.settle()  # the first three in the base (with its directory), two in runs
        idx.add("i0", b"".join(keys[4][:100]), 1)  # shared keys: several entries each
        f = idx.filter
        assert f.directory is not None and f.directory.of is f.base and (f.runs or f.merging)
        rng = np.random.default_rng(11)
        for _ in range(20):
            pick = [ks[int(j)] for ks in keys for j in rng.integers(0, len(ks), 30)]
            query = np.sort(fingerprints(pick + keys_of(NS_A, 50)))
            got = f.candidates(query)
            assert got.size and np.array_equal(got, f.candidates_numpy(query))
        assert f.candidates(np.zeros(0, dtype=np.uint64)).size == 0
    finally:
        idx.close()
    table = KeyTable(1024)  # crowded: windows overflow, then deletions leave tombstones
    held = fingerprints(b"".join(keys_of(NS_A, 500)))
    table.add(held, np.arange(held.size, dtype=np.int8) % 4)
    table.remove(held[::3])
    probe = np.concatenate([held, fingerprints(b"".join(keys_of(NS_A, 500)))])
    assert np.array_equal(table.tiers(probe), table.tiers_numpy(probe))
    assert (table.tiers(held[::3]) == NO_TIER).all()


def test_the_c_search_reads_nothing_outside_the_array_whatever_the_directory_says() -> None:
    """Bounds from a directory are clamped to the array (a wrong one finds less, never
    reads past it), and arguments of the wrong shape are refused."""
    from tierkv._fingerprints import match_slots, probe

    arr = np.sort(np.random.default_rng(2).integers(0, 2**63, 1000, dtype=np.uint64))
    want = arr[::7] & ~np.uint64(SLOTS - 1)
    seen, out = np.zeros(SLOTS, np.uint8), np.empty(SLOTS, np.int64)
    for starts in (
        np.full(9, 10**12, dtype=np.int64),
        np.full(9, -5, dtype=np.int64),
        np.array([900, 3, 10**9, -1, 0, 2000, 5, 5, 7], dtype=np.int64),
    ):
        assert 0 <= match_slots(arr, starts, 61, want, seen, out, 0) <= SLOTS
    # A count its seen slots do not account for: the slots found are not written past out.
    full = np.empty(SLOTS + 8, np.int64)
    full[SLOTS:] = -7
    one = np.array([5 << 16 | 7], np.uint64)
    assert match_slots(one, np.zeros(0, np.int64), 0, one & ~np.uint64(SLOTS - 1),
                       np.zeros(SLOTS, np.uint8), full[:SLOTS], SLOTS) == SLOTS  # fmt: skip
    assert (full[SLOTS:] == -7).all()
    with pytest.raises(ValueError):
        match_slots(arr, np.zeros(0, np.int64), 0, want, np.zeros(10, np.uint8), out, 0)
    with pytest.raises(ValueError):
        match_slots(arr, np.zeros(0, np.int64), 0, want, seen, out, SLOTS + 1)
    with pytest.raises(ValueError):
        match_slots(arr, np.zeros(3, np.int64), 64, want, seen, out, 0)
    with pytest.raises(ValueError):
        probe(arr, 0, want, np.empty(3, np.int8))


def test_the_c_merge_merges_as_numpy_does() -> None:
    """The filter's merge in C (a k-way merge taking runs from one part): the same array as
    numpy's filter, sort and dedupe, for parts that interleave, repeat each other's entries
    (the same key held twice), hold dead slots' entries, or are empty; any number of parts."""
    assert holders_module._merge is not None
    rng = np.random.default_rng(5)
    slot_of = np.uint64(SLOTS - 1)
    for case in range(60):
        k = int(rng.integers(1, 12))
        sizes = rng.integers(0, 3000 if case % 3 else 40, k)
        top = 2**20 if case % 2 else 2**63  # small values: many repeats across parts
        parts = []
        for size in sizes:
            high = rng.integers(0, top, int(size), dtype=np.uint64) << np.uint64(16)
            part = np.sort(high | rng.integers(0, 8, int(size), dtype=np.uint64))
            if case % 4 == 0 and part.size:  # a long run from one part
                part = np.sort(np.concatenate([part, part[: part.size // 2]]))
            parts.append(part)
        if k > 1 and parts[0].size:
            parts[1] = np.sort(np.concatenate([parts[1], parts[0][::3]]))  # shared entries
        live = rng.random(SLOTS) < (0.7 if case % 5 else 1.0)
        got = merge_parts(parts, live)
        want = holders_module.merge_parts_numpy(parts, live)
        assert got.dtype == np.uint64 and np.array_equal(got, want), case
        assert live[(got & slot_of).astype(np.int64)].all()
    assert merge_parts([], np.ones(SLOTS, bool)).size == 0


def test_the_c_merge_refuses_arguments_of_the_wrong_shape() -> None:
    from tierkv._fingerprints import merge

    part = np.arange(10, dtype=np.uint64)
    live = np.ones(SLOTS, dtype=np.bool_)
    with pytest.raises(ValueError, match="out holds"):
        merge([part, part], live, np.empty(19, np.uint64))
    with pytest.raises(ValueError, match="live"):
        merge([part], live[:100], np.empty(10, np.uint64))
    with pytest.raises(ValueError, match="aligned"):
        merge([part.view(np.uint8)[1:9]], live, np.empty(10, np.uint64))
    with pytest.raises(TypeError):
        merge(5, live, np.empty(10, np.uint64))
    with pytest.raises(TypeError):
        merge([part, "x"], live, np.empty(20, np.uint64))
    assert merge([], live, np.empty(0, np.uint64)) == 0


def test_the_c_sort_sorts_as_numpy_does() -> None:
    """The radix sort in C: numpy's order for uniform 64-bit values, values that share most
    of their bytes (passes skipped), repeats, the extremes, every length around its
    threshold; ``sort_values`` sorts in place where it may and leaves views to numpy."""
    from tierkv._fingerprints import sort

    rng = np.random.default_rng(11)
    top = np.uint64(2**64 - 1)
    for case in range(40):
        n = int(rng.integers(0, 5000)) if case % 4 else [0, 1, 2, 1023, 1024, 1025][case % 6]
        if case % 3 == 0:
            values = rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True)
        elif case % 3 == 1:  # one varying byte, the rest equal: seven passes skipped
            values = (rng.integers(0, 256, n, dtype=np.uint64) << np.uint64(40)) | top
        else:  # few distinct values: repeats
            values = rng.integers(0, 5, n, dtype=np.uint64) * np.uint64(0x0101010101010101)
        got = values.copy()
        sort(got)
        assert np.array_equal(got, np.sort(values)), case
        again = values.copy()
        assert keytable.sort_values(again) is again and np.array_equal(again, got), case
    strided = np.arange(4000, 0, -1, dtype=np.uint64)[::2]
    assert np.array_equal(keytable.sort_values(strided), np.arange(2, 4001, 2, dtype=np.uint64))
    with pytest.raises(ValueError, match="aligned"):
        sort(np.zeros(4, np.uint64).view(np.uint8)[1:25])
    with pytest.raises(TypeError):
        sort(b"01234567")  # read-only


def test_filter_refuses_more_instances_than_slots() -> None:
    f = HolderFilter()
    for i in range(SLOTS):
        f.take_slot(str(i))
    with pytest.raises(RuntimeError):
        f.take_slot("one more")


def check_against(
    idx: ControllerIndex, model: dict[str, dict[bytes, int]], keys: list[bytes]
) -> None:
    """Every holder of every key with its tier, nobody else (evicted, dropped)."""
    found = idx.lookup(keys)
    want = {
        inst: [held.get(k, NO_TIER) for k in keys]
        for inst, held in model.items()
        if any(k in held for k in keys)
    }
    assert {i: t.tolist() for i, t in found.items()} == want


def test_index_matches_a_model_while_merges_race_with_changes_and_lookups() -> None:
    rng = random.Random(11)
    idx = ControllerIndex(merge_interval=0.0, run_limit=500)
    universe = keys_of(NS_A, 3000) + keys_of(NS_B, 1000)
    model: dict[str, dict[bytes, int]] = {}
    stop = threading.Event()

    def merge_forever() -> None:
        while not stop.is_set():
            idx.merge()

    racer = threading.Thread(target=merge_forever)
    racer.start()
    try:
        for step in range(400):
            inst = f"i{rng.randrange(6)}"
            op = rng.random()
            batch = rng.sample(universe, rng.randint(1, 300))
            if op < 0.45:
                tier = rng.randint(0, 1)
                idx.add(inst, batch, tier)
                model.setdefault(inst, {}).update(dict.fromkeys(batch, tier))
            elif op < 0.75:
                idx.remove(inst, batch)
                for k in batch:
                    model.get(inst, {}).pop(k, None)
            elif op < 0.85:
                tiers = np.array([rng.randint(0, 1) for _ in batch], dtype=np.int8)
                idx.replace(inst, batch, tiers)
                model[inst] = dict(zip(batch, tiers.tolist(), strict=True))
            else:
                idx.drop(inst)
                model.pop(inst, None)
            model = {i: held for i, held in model.items() if held or i in idx.instances()}
            check_against(idx, model, rng.sample(universe, 200))
            if step % 50 == 0:
                check_against(idx, model, universe)
    finally:
        stop.set()
        racer.join()
    idx.settle()
    check_against(idx, model, universe)
    live = {s for s in range(SLOTS) if idx.filter.owner[s] is not None}
    assert len(live) == len(idx.instances())
    assert not idx.filter.retired and not idx.filter.runs
    # nothing but live slots is left in the merged array
    assert set(np.unique(idx.filter.base & np.uint64(SLOTS - 1)).tolist()) <= live
    idx.close()


def test_many_evictions_reextract_an_instance_and_drop_its_stale_entries() -> None:
    idx = ControllerIndex()
    keys = keys_of(NS_A, 3 * REBASE_MIN)
    idx.add("x", keys, 0)
    idx.settle()
    assert idx.filter.base.size == len(keys)
    idx.remove("x", keys[: 2 * REBASE_MIN + 10])
    idx.settle()
    assert idx.filter.base.size == len(keys) - 2 * REBASE_MIN - 10
    assert idx.lookup(keys[: 2 * REBASE_MIN + 10]) == {}
    assert (idx.lookup(keys[-5:])["x"] == 0).all()
    idx.close()


def test_a_failed_merge_loses_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    idx = ControllerIndex()
    old, admitted, reported = keys_of(NS_A, 50), keys_of(NS_A, 40), keys_of(NS_A, 30)
    idx.add("x", old, 0)
    idx.settle()
    idx.add("x", admitted, 1)  # a run
    idx.replace("y", reported, 0)  # a pending report

    def fail(*args: object) -> None:
        raise MemoryError

    monkeypatch.setattr(index_module, "merge_parts", fail)
    with pytest.raises(MemoryError):
        idx.merge()
    assert (idx.lookup(admitted)["x"] == 1).all() and (idx.lookup(reported)["y"] == 0).all()
    monkeypatch.undo()
    idx.settle()
    assert not idx.filter.runs and not idx.filter.merging
    assert (idx.lookup(old + admitted)["x"] >= 0).all() and (idx.lookup(reported)["y"] == 0).all()
    idx.close()


def test_a_table_built_with_one_tier_counts_it_like_one_built_per_key() -> None:
    """A full report of one tier (a scalar, or broadcast) is counted without a pass over
    the entries; the counts equal those of the same keys given a tier each, repeats held
    once."""
    rng = np.random.default_rng(5)
    fps = rng.integers(1, 2**62, 5000, dtype=np.uint64)
    fps = np.concatenate([fps, fps[:10]])  # ten repeats
    per_key = KeyTable.build(fps, np.full(fps.size, 2, dtype=np.int8))
    for tiers in (2, np.broadcast_to(np.int8(2), fps.shape)):
        table = KeyTable.build(fps, tiers)
        assert table.by_tier.tolist() == per_key.by_tier.tolist() == [0, 0, 5000, 0]
        assert len(table) == 5000
        assert (table.tiers(fps) == 2).all()
