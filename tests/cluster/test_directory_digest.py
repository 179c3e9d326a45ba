"""The directory's anti-entropy summaries (tierkv.cluster.digest), in one process: an
owner's incremental summaries equal a holder's vectorised ones, a shard's summaries stay
exact through every kind of change, and a node repairs its own shard's entries of itself."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import numpy as np
import pytest

from tierkv.cluster import digest
from tierkv.cluster import messages as m
from tierkv.cluster.control import ControlClient
from tierkv.cluster.directory import Where
from tierkv.cluster.membership import Membership
from tierkv.cluster.ring_directory import RingDirectory
from tierkv.cluster.ring_shard import Shard


def random_keys(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(32) for _ in range(n)]


def expected(entries: list[tuple[bytes, int]], incarnation: int) -> digest.Expected:
    """A holder's expectations of an owner "o" that owns every key."""
    keys, wheres = [k for k, _ in entries], [w for _, w in entries]
    arcs = np.zeros(len(entries), dtype=np.intp)
    return digest.Expected(keys, wheres, incarnation, arcs, [("o",)])


def recomputed(shard: Shard, holder: str) -> digest.Summary:
    """A holder's summary computed from scratch from the shard's entries."""
    counts, hashes = digest.empty()
    for key, entries in shard.items():
        for h, inc, where in entries:
            if h == holder:
                counts[digest.bucket(key)] += 1
                hashes[digest.bucket(key)] ^= digest.entry_hash(key, inc, where)
    return counts, hashes


def test_incremental_and_vectorised_summaries_agree() -> None:
    keys = random_keys(5000, 1)
    wheres = [i % 2 for i in range(len(keys))]
    for inc in (0, 1, 1_765_000_000_123_456_789, -5, 2**64 - 1):
        summaries = digest.Summaries()
        summaries.apply([("h", k, inc, w) for k, w in zip(keys, wheres, strict=True)], 1)
        entries = list(zip(keys, wheres, strict=True))
        assert expected(entries, inc).summary("o") == summaries.get("h")
        summaries.apply([("h", k, inc, w) for k, w in entries[:2500]], -1)
        half = expected(entries[2500:], inc)
        assert half.summary("o") == summaries.get("h")
        assert half.summary("other") == digest.empty()
        counts, hashes = digest.empty()
        for key, where in entries[2500:]:
            counts[digest.bucket(key)] += 1
            hashes[digest.bucket(key)] ^= digest.entry_hash(key, inc, where)
        assert (counts, hashes) == summaries.get("h")


def test_summaries_tell_where_and_incarnation_apart() -> None:
    keys = random_keys(100, 2)
    base = expected([(k, 0) for k in keys], 7).summary("o")
    moved = expected([(k, int(i == 5)) for i, k in enumerate(keys)], 7)
    other_life = expected([(k, 0) for k in keys], 8)
    assert len(digest.differing(base, moved.summary("o"))) == 1
    assert digest.differing(base, other_life.summary("o"))
    # The listing of a differing bucket tells what to send again and what to withdraw.
    (b,) = digest.differing(base, moved.summary("o"))
    listed = [(k, 7, 0) for k in keys if digest.bucket(k) == b]
    listed.append((bytes(32), 7, 0))  # not held
    pubs, unpubs = moved.differences("o", [b], listed)
    assert pubs == [(keys[5], 1)] and unpubs == [bytes(32)]


def test_shard_summaries_stay_exact_through_every_change() -> None:
    shard = Shard()
    keys = random_keys(400, 3)
    holders = ["a", "b", "c", "d", "e", "f"]
    shard.put("a", 1, [(k, 0) for k in keys])
    shard.put("b", 2, [(k, i % 2) for i, k in enumerate(keys[:300])])
    shard.put("a", 1, [(k, 1) for k in keys[:50]])  # a's entry replaced (where)
    shard.put_many([(k, h, 3, 0) for k in keys[100:200] for h in ("c", "d", "e", "f")])
    shard.put_many([(k, "c", 2, 1) for k in keys[100:150]])  # older life of c: skipped
    shard.put_many([(k, "c", 4, 1) for k in keys[150:160]])  # newer life of c: replaces
    for h in holders:
        assert shard.summary(h) == recomputed(shard, h), h
    assert shard.remove("b", keys[:20]) == 20
    assert shard.purge({"d": 3, "e": 2}) == 100  # d's entries go, e's are newer
    shard.drop(keys[190:200])
    assert shard.drop_holders(["f"]) == 90
    for h in holders:
        assert shard.summary(h) == recomputed(shard, h), h
    assert sorted(shard.holders()) == ["a", "b", "c", "e"]
    # Every holder of a key keeps its entry: none pushes another out.
    assert {e[0] for e in shard.get([keys[120]])[0]} == {"a", "b", "c", "e"}


@pytest.fixture
def alone() -> Iterator[RingDirectory]:
    """The directory of a node that is its own only member (it owns every key)."""
    me = m.MemberInfo("127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:2", 42)
    client = ControlClient("secret", 0.2)
    held = [(k, Where.POOL) for k in random_keys(50, 4)]
    directory = RingDirectory(
        Membership(me, [], client), client, lambda: list(held), repair_interval=0.05
    )
    directory.publish([k for k, _ in held])
    directory.start()
    try:
        yield directory
    finally:
        directory.close()
        client.close()


def test_a_node_repairs_its_own_shards_entries_of_itself(alone: RingDirectory) -> None:
    keys = [k for k, _ in alone.held()]
    me = alone.me.node_id
    assert alone.flush()
    assert dict(alone.shard.items()) == {k: ((me, 42, 0),) for k in keys}
    alone.shard.remove(me, keys[:10])  # lost
    alone.shard.put(me, 41, [(k, 0) for k in keys[10:12]])  # a previous life's
    alone.shard.put(me, 42, [(k, 1) for k in keys[12:14]])  # on disk, says the shard
    alone.shard.put(me, 42, [(k, 0) for k in random_keys(3, 5)])  # never held
    deadline = time.monotonic() + 10.0
    while alone.counts["repaired"] < 17 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert alone.counts["repaired"] == 17
    assert dict(alone.shard.items()) == {k: ((me, 42, 0),) for k in keys}


def test_other_keys_of_one_namespace_are_told_apart() -> None:
    """A key's first half is its namespace, the same for every chunk of a model: buckets and
    hashes taken from a word of that half gave every key of a namespace one bucket and one
    hash, so an owner listing other keys of the namespace for a holder, as many of them,
    had the holder's summary and was never repaired."""
    namespace = bytes(range(16))
    held = [namespace + k[16:] for k in random_keys(2, 3)]
    listed = [namespace + k[16:] for k in random_keys(2, 4)]
    owner = digest.Summaries()
    owner.apply([("h", k, 7, 0) for k in listed], 1)
    assert expected([(k, 0) for k in held], 7).summary("o") != owner.get("h")
    # Keys of one namespace spread over the buckets like any keys.
    many = [namespace + k[16:] for k in random_keys(1600, 5)]
    counts = expected([(k, 0) for k in many], 7).summary("o")[0]
    assert min(counts) > 50 and sum(counts) == 1600
    # One chunk hash under two namespaces: two entries that do not cancel in the XOR.
    twins = [bytes([1]) * 16 + held[0][16:], bytes([2]) * 16 + held[0][16:]]
    assert digest.entry_hash(twins[0], 7, 0) != digest.entry_hash(twins[1], 7, 0)
