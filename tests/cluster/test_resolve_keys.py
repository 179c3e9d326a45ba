"""Batch resolves (:func:`tierkv.cluster.ring_resolve.resolve_keys`) against a fake client:
which owner each key is asked of, retries on the next replica, suspect owners, the local
shard, and replies that are partly malformed."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, cast

from support.clusterkit import columns_of
from tierkv.cluster import messages as m
from tierkv.cluster.control import ControlClient
from tierkv.cluster.directory import Location, Where
from tierkv.cluster.ring import Ring
from tierkv.cluster.ring_resolve import resolve_keys

NAMES = ["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"]
MEMBERS = {n: m.MemberInfo(n, n, n + "0", 1) for n in NAMES}
KEYS = [os.urandom(32) for _ in range(600)]


class FakeClient:
    """Answers each Resolve from ``tables[owner]`` (key -> reply entries) and records the
    keys each owner was asked."""

    def __init__(self, tables: dict[str, dict[bytes, list[tuple[str, int]]]]) -> None:
        self.tables = tables
        self.asked: dict[str, list[bytes]] = {}
        self.suspects: set[str] = set()
        self.extra: list[tuple[int, int, int]] = []  # appended to every reply's entries
        self.columns: tuple[bytes, bytes, bytes] | None = None  # every reply's, if set

    def suspect(self, addr: str) -> bool:
        return addr in self.suspects

    def call_many(self, calls: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for addr, req in calls.items():
            assert isinstance(req, m.Resolve)
            self.asked.setdefault(addr, []).extend(req.keys)
            holders: dict[str, int] = {}
            found: list[tuple[int, int, int]] = []
            for pos, key in enumerate(req.keys):
                for holder, where in self.tables.get(addr, {}).get(key, []):
                    found.append((pos, holders.setdefault(holder, len(holders)), where))
            columns = self.columns or columns_of(found + self.extra)
            out[addr] = m.Resolved(req.rid, list(holders), *columns)
        return out


def resolve(client: FakeClient, ring: Ring, **kw: Any) -> tuple[list[list[Location]], int, int]:
    return resolve_keys(KEYS, MEMBERS, ring, cast(ControlClient, client), **kw)


def test_a_prefix_is_asked_of_as_few_owners_as_cover_it_then_of_the_others() -> None:
    ring = Ring(NAMES, vnodes=16, replicas=2)
    owners = ring.owners_many(KEYS)
    # Every owner knows the even keys; only the first owner of each odd key knows it.
    tables: dict[str, dict[bytes, list[tuple[str, int]]]] = {n: {} for n in NAMES}
    for i, (key, key_owners) in enumerate(zip(KEYS, owners, strict=True)):
        for o in key_owners if i % 2 == 0 else key_owners[:1]:
            tables[o][key] = [("h:1", i % 2)]
    client = FakeClient(tables)
    found, rpcs, skipped = resolve(client, ring)
    assert found == [[Location("h:1", Where(i % 2))] for i in range(len(KEYS))]
    asked: dict[bytes, list[str]] = {}
    for addr, keys in client.asked.items():
        for key in keys:
            asked.setdefault(key, []).append(addr)
    for i, (key, key_owners) in enumerate(zip(KEYS, owners, strict=True)):
        assert set(asked[key]) <= set(key_owners) and len(set(asked[key])) == len(asked[key])
        if i % 2 == 0:
            assert len(asked[key]) == 1  # found at the first owner asked
    # Three members, two replicas: two owners cover every key (three were asked before).
    assert rpcs <= 4 and skipped == 0
    assert len({addrs[0] for addrs in asked.values()}) == 2


def test_two_members_answer_a_prefix_in_one_round_trip() -> None:
    names = NAMES[:2]
    ring = Ring(names, vnodes=16, replicas=2)
    client = FakeClient({n: {k: [("h:1", 0)] for k in KEYS} for n in names})
    found, rpcs, _ = resolve(client, ring)
    assert rpcs == 1 and len(client.asked) == 1
    assert found == [[Location("h:1", Where.POOL)] for _ in KEYS]


def test_suspect_owners_are_skipped_and_this_node_answers_locally() -> None:
    ring = Ring(NAMES, vnodes=16, replicas=2)
    client = FakeClient({n: {k: [("h:1", 0)] for k in KEYS} for n in NAMES})
    client.suspects.add(NAMES[1])
    asked_local: list[bytes] = []

    def local(keys: Any) -> list[tuple[tuple[str, int, int], ...]]:
        asked_local.extend(keys)
        return [(("h:3", 7, 1),) for _ in keys]

    found, _, skipped = resolve(client, ring, me=NAMES[0], local=local)
    assert NAMES[1] not in client.asked and skipped > 0
    owners = ring.owners_many(KEYS)
    assert asked_local == [k for k, o in zip(KEYS, owners, strict=True) if NAMES[0] in o]
    for key, o, locs in zip(KEYS, owners, found, strict=True):
        holder = "h:3" if NAMES[0] in o else "h:1"
        assert locs == [Location(holder, Where(1 if holder == "h:3" else 0))], key


def test_malformed_entries_are_left_out() -> None:
    ring = Ring(NAMES, vnodes=16, replicas=1)
    client = FakeClient({n: {k: [("h:1", 0)] for k in KEYS} for n in NAMES})
    # A position past the request, a holder index past the table, an unknown tier code.
    client.extra = [(10_000, 0, 0), (0, 99, 0), (0, 0, 7), (-1, 0, 0)]
    found, _, _ = resolve(client, ring)
    assert found == [[Location("h:1", Where.POOL)] for _ in KEYS]


def test_answers_whose_columns_are_not_whole_rows_are_not_used() -> None:
    ring = Ring(NAMES, vnodes=16, replicas=1)
    client = FakeClient({n: {k: [("h:1", 0)] for k in KEYS} for n in NAMES})
    assert all(resolve(client, ring)[0])
    positions, holder_of, tiers = columns_of([(i, 0, 0) for i in range(len(KEYS))])
    for broken in (
        (positions[:-4], holder_of, tiers),  # one position short
        (positions + b"\x00", holder_of, tiers),  # not whole uint32s
        (positions, holder_of[:-1], tiers),
        (positions, holder_of, tiers + b"\x00"),
    ):
        client.columns = broken
        found, _, _ = resolve(client, ring)
        assert found == [[] for _ in KEYS]


def test_only_live_holders_are_kept() -> None:
    ring = Ring(NAMES, vnodes=16, replicas=1)
    client = FakeClient({n: {k: [("h:1", 0), ("dead:1", 1)] for k in KEYS} for n in NAMES})
    found, _, _ = resolve(client, ring, live={"h:1"})
    assert found == [[Location("h:1", Where.POOL)] for _ in KEYS]
    found, _, _ = resolve(client, ring)
    assert found == [[Location("h:1", Where.POOL), Location("dead:1", Where.DISK)] for _ in KEYS]


def test_empty_ring_and_no_keys() -> None:
    client = FakeClient({})
    assert resolve_keys([], MEMBERS, Ring(NAMES), cast(ControlClient, client)) == ([], 0, 0)
    assert resolve(client, Ring([])) == ([[] for _ in KEYS], 0, 0)
