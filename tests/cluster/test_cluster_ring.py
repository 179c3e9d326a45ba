"""The consistent-hash ring: owners, balance, and minimal movement on join and leave."""

from __future__ import annotations

import os
import statistics

import pytest

from tierkv.cluster.ring import Ring, key_points

MEMBERS = [f"10.0.0.{i}:8792" for i in range(10)]
KEYS = [os.urandom(32) for _ in range(40_000)]


def test_owners_are_distinct_members_primary_first() -> None:
    ring = Ring(MEMBERS, replicas=3)
    for owners in ring.owners_many(KEYS[:2000]):
        assert len(owners) == 3 and len(set(owners)) == 3
        assert set(owners) <= set(MEMBERS)
    assert ring.owners(KEYS[0]) == ring.owners_many([KEYS[0]])[0]


def test_every_node_builds_the_same_ring() -> None:
    a = Ring(MEMBERS)
    b = Ring(reversed(MEMBERS))
    assert a.owners_many(KEYS[:5000]) == b.owners_many(KEYS[:5000])


def test_small_and_empty_rings() -> None:
    assert Ring([]).owners(KEYS[0]) == ()
    assert Ring([]).owners_many(KEYS[:3]) == [(), (), ()]
    assert Ring(["solo:1"], replicas=2).owners(KEYS[0]) == ("solo:1",)
    two = Ring(["a:1", "b:1"], replicas=5)
    assert sorted(two.owners(KEYS[0])) == ["a:1", "b:1"]
    with pytest.raises(ValueError):
        Ring(MEMBERS, vnodes=0)
    with pytest.raises(ValueError):
        key_points([b"short"])


def test_primaries_are_balanced() -> None:
    ring = Ring(MEMBERS, vnodes=160)
    counts = {m: 0 for m in MEMBERS}
    for owners in ring.owners_many(KEYS):
        counts[owners[0]] += 1
    mean = statistics.mean(counts.values())
    assert all(0.7 * mean < c < 1.3 * mean for c in counts.values()), counts


def test_keys_repeating_across_namespaces_still_spread() -> None:
    # Precomputed chunk hashes (second half) repeat across namespaces (first half).
    chunk = os.urandom(16)
    keys = [os.urandom(16) + chunk for _ in range(2000)]
    ring = Ring(MEMBERS)
    primaries = {owners[0] for owners in ring.owners_many(keys)}
    assert primaries == set(MEMBERS)


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_join_moves_only_keys_the_new_member_takes(replicas: int) -> None:
    before = Ring(MEMBERS, replicas=replicas)
    joined = "10.0.0.99:8792"
    after = Ring([*MEMBERS, joined], replicas=replicas)
    moved = 0
    for old, new in zip(before.owners_many(KEYS), after.owners_many(KEYS), strict=True):
        if old != new:
            moved += 1
            assert joined in new  # nothing moves between old members
            assert len(set(old) - set(new)) == 1
    expected = replicas / (len(MEMBERS) + 1)
    assert 0.5 * expected < moved / len(KEYS) < 1.5 * expected


@pytest.mark.parametrize("replicas", [1, 2])
def test_leave_moves_only_keys_the_member_owned(replicas: int) -> None:
    before = Ring(MEMBERS, replicas=replicas)
    gone = MEMBERS[3]
    after = Ring([m for m in MEMBERS if m != gone], replicas=replicas)
    moved = 0
    for old, new in zip(before.owners_many(KEYS), after.owners_many(KEYS), strict=True):
        if old != new:
            moved += 1
            assert gone in old and gone not in new
            assert set(old) - {gone} <= set(new)  # surviving owners keep their entries
        else:
            assert gone not in old
    expected = replicas / len(MEMBERS)
    assert 0.5 * expected < moved / len(KEYS) < 1.5 * expected
