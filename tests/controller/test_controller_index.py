"""The controller's index: key tables and per-instance holdings, checked against a plain
Python model of the same operations."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from tierkv.controller.index import ControllerIndex, prefix_runs
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
    assert prefix_runs(found) == {"a": (5, [5, 0, 0, 0]), "b": (3, [0, 3, 0, 0])}
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
