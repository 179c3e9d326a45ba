"""Tests of the L1 object index: states, write/read leases, pins (holds that leave the LRU
order alone), TTL expiry with a fake clock, prefix-aware LRU eviction, delete/clear of held
objects, release_holder and stats. The index
under test runs ``check()`` after every call (successful or not), and a hypothesis state
machine compares it with a plain model."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tierkv.allocator import Allocator
from tierkv.index import (
    CommitResult,
    Evicted,
    Holder,
    IndexStats,
    LeaseError,
    LeaseNotFound,
    LeaseNotOwned,
    ObjectIndex,
    SlotPositionError,
)

BLOCK = 4096  # allocator alignment; a "chunk" in these tests is one block unless stated
WRITE_TTL = 600.0
READ_TTL = 300.0
ALICE = 1
BOB = 2


class FakeClock:
    """A clock that only moves when told to."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


_PUBLIC = (
    "reserve_write",
    "commit",
    "abort",
    "lock_read",
    "release_read",
    "pin",
    "unpin",
    "lease_slots",
    "contains",
    "release_holder",
    "delete",
    "clear",
    "evict",
    "expire",
    "stats",
    "fence",
    "unfence",
)


def _checked(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(self: ObjectIndex, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        finally:
            self.check()

    return call


class CheckedIndex(ObjectIndex):
    """An ObjectIndex that verifies its invariants after every public call."""


for _name in _PUBLIC:
    setattr(CheckedIndex, _name, _checked(getattr(ObjectIndex, _name)))


def k(name: str | int) -> bytes:
    return f"key-{name}".encode()


def make(blocks: int = 16) -> tuple[CheckedIndex, FakeClock]:
    clock = FakeClock()
    index = CheckedIndex(Allocator(blocks * BLOCK, BLOCK), WRITE_TTL, READ_TTL, clock)
    index.check()
    return index, clock


def store(index: ObjectIndex, keys: list[bytes], holder: int = ALICE, length: int = BLOCK) -> None:
    res = index.reserve_write(keys, length, holder)
    assert len(res.slots) == len(keys), res
    assert index.commit(res.lease_id, holder).committed == len(keys)


def evict_order(index: ObjectIndex) -> list[bytes]:
    """Evict everything evictable one object at a time; the keys in eviction order."""
    order = []
    while batch := index.evict(1):
        assert len(batch) == 1
        order.append(batch[0].key)
    return order


def figures(index: ObjectIndex, **expected: int) -> None:
    stats = dataclasses.asdict(index.stats())
    assert {name: stats[name] for name in expected} == expected


# -- state transitions ---------------------------------------------------------------------
def test_store_read_evict_lifecycle() -> None:
    index, _ = make()
    key = k(0)
    assert index.contains([key]) == [False]

    res = index.reserve_write([key], 100, ALICE)  # absent -> writing
    assert res.lease_id > 0 and res.present == [] and res.no_space == []
    ((i, offset, length),) = res.slots
    assert (i, length) == (0, 100) and offset % BLOCK == 0
    assert index.contains([key]) == [False]
    figures(index, objects=1, writing=1, ready=0, evictable=0, used=BLOCK, write_leases=1)

    result = index.commit(res.lease_id, ALICE)  # writing -> ready
    assert result == CommitResult(
        committed=1, committed_keys=[key], committed_lengths=[100], committed_bytes=100
    )
    assert index.contains([key]) == [True]
    figures(index, objects=1, writing=0, ready=1, evictable=1, read_locked=0, write_leases=0)

    first = index.lock_read([key], ALICE)  # ready -> read-locked (1)
    second = index.lock_read([key], BOB)  # read-locked (2)
    assert first.slots == second.slots == [(0, offset, 100)]
    assert first.lease_id != second.lease_id
    figures(index, ready=1, read_locked=1, evictable=0, read_leases=2)
    assert index.evict(10 * BLOCK) == []

    assert index.release_read(first.lease_id, ALICE) == 1  # still locked by BOB
    figures(index, read_locked=1, evictable=0, read_leases=1)
    assert index.evict(10 * BLOCK) == []
    assert index.release_read(second.lease_id, BOB) == 1  # ready, unlocked
    figures(index, read_locked=0, evictable=1, read_leases=0)

    assert index.evict(1) == [Evicted(key, 100, "")]  # ready -> absent
    assert index.contains([key]) == [False]
    figures(index, objects=0, used=0, evictions=1, evicted_bytes=BLOCK)


def test_abort_gives_slots_back() -> None:
    index, _ = make()
    res = index.reserve_write([k(0), k(1)], BLOCK, ALICE)
    assert index.used == 2 * BLOCK
    assert index.abort(res.lease_id, ALICE) == 2
    assert index.used == 0 and index.contains([k(0), k(1)]) == [False, False]
    figures(index, objects=0, writing=0, write_leases=0)
    with pytest.raises(LeaseNotFound):
        index.commit(res.lease_id, ALICE)
    store(index, [k(0), k(1)])  # the keys can be stored again


def test_a_fenced_slot_is_not_reused_until_its_last_fence_is_lifted() -> None:
    """A fence (a one-sided READ given up at its deadline may still land there) keeps a
    slot allocated through whatever its object goes through: aborted, committed and
    evicted, deleted; the slot goes back to the pool with the last fence."""
    index, _ = make(blocks=4)
    res = index.reserve_write([k(0), k(1), k(2)], BLOCK, ALICE)
    offsets = {key: off for (i, off, _), key in zip(res.slots, [k(0), k(1), k(2)], strict=True)}
    index.fence([offsets[k(0)], offsets[k(1)]])
    index.fence([offsets[k(1)]])  # fenced twice
    assert index.abort(res.lease_id, ALICE) == 3
    figures(index, objects=0, fenced_free=2)
    assert index.used == 2 * BLOCK  # k(2)'s slot is free again, the fenced ones are not
    res = index.reserve_write([k(3), k(4)], BLOCK, ALICE)
    assert not {off for _, off, _ in res.slots} & {offsets[k(0)], offsets[k(1)]}
    assert index.abort(res.lease_id, ALICE) == 2
    assert index.unfence([offsets[k(0)], offsets[k(1)]]) == 1  # k(1) still has a fence
    figures(index, fenced_free=1)
    assert index.unfence([offsets[k(1)]]) == 1
    figures(index, fenced_free=0)
    assert index.used == 0
    # A fence on a committed object: evicted, its slot stays allocated till the unfence.
    store(index, [k(5)])
    ((_, off, _),) = index.lock_read([k(5)], BOB).slots
    index.fence([off])
    index.release_holder(BOB)
    assert [e.key for e in index.evict(BLOCK)] == [k(5)]
    figures(index, objects=0, fenced_free=1)
    assert index.unfence([off]) == 1 and index.used == 0
    # A fence on a slot that stays in use: lifted, the object keeps it.
    store(index, [k(6)])
    ((_, off, _),) = index.lock_read([k(6)], BOB).slots
    index.fence([off])
    assert index.unfence([off]) == 0
    figures(index, objects=1, fenced_free=0)


def test_fences_refuse_slots_that_are_not_allocated_or_not_fenced() -> None:
    index, _ = make(blocks=4)
    with pytest.raises(ValueError, match="not allocated"):
        index.fence([0])
    store(index, [k(0)])
    with pytest.raises(ValueError, match="not fenced"):
        index.unfence([0])
    index.fence([0])
    with pytest.raises(ValueError, match="not fenced"):
        index.unfence([0, 0])  # one fence, two lifts: nothing lifted
    assert index.unfence([0]) == 0
    with pytest.raises(ValueError, match="not allocated"):
        index.fence([0, 4 * BLOCK])  # all or nothing
    with pytest.raises(ValueError, match="not fenced"):
        index.unfence([0])


def test_reserve_reports_present_keys_and_never_allocates_twice() -> None:
    index, _ = make()
    store(index, [k("ready")])
    writing = index.reserve_write([k("writing")], BLOCK, BOB)
    used = index.used

    res = index.reserve_write(
        [k("ready"), k("new"), k("writing"), k("new"), k("other"), k("ready")], BLOCK, ALICE
    )
    assert res.present == [0, 2, 3, 5]
    assert [i for i, _, _ in res.slots] == [1, 4]
    assert res.no_space == []
    assert index.used == used + 2 * BLOCK
    figures(index, objects=4, writing=3, ready=1)

    # The being-written key stays with its writer; the duplicate commits once.
    assert index.commit(res.lease_id, ALICE).committed_keys == [k("new"), k("other")]
    assert index.contains([k("writing")]) == [False]
    assert index.commit(writing.lease_id, BOB).committed == 1
    assert index.contains([k("writing")]) == [True]


def test_reserve_tells_which_present_keys_another_writer_has_not_committed() -> None:
    """A key another engine has only reserved is present (never written twice) but not
    stored: if that engine aborts, nothing holds it. A repeat of this batch's own key, a
    committed key and one being loaded from a tier are stored (or held elsewhere)."""
    index, _ = make()
    store(index, [k("ready")])
    other = index.reserve_write([k("writing")], BLOCK, BOB)
    index.reserve_write([k("loading")], BLOCK, Holder.PREFETCH, tier="disk")

    keys = [k("ready"), k("new"), k("writing"), k("new"), k("loading"), k("writing")]
    res = index.reserve_write(keys, BLOCK, ALICE)
    assert res.present == [0, 2, 3, 4, 5]
    assert res.writing == [2, 5]

    index.abort(other.lease_id, BOB)  # the other writer gives up: tierkv holds nothing
    assert index.contains([k("writing")]) == [False]
    again = index.reserve_write([k("ready"), k("writing")], BLOCK, BOB)
    assert again.present == [0] and again.writing == [] and len(again.slots) == 1


def test_reserve_of_only_present_keys_takes_no_lease() -> None:
    index, _ = make()
    store(index, [k(0)])
    res = index.reserve_write([k(0), k(0)], BLOCK, ALICE)
    assert res.lease_id == 0 and res.slots == [] and res.present == [0, 1]
    figures(index, write_leases=0, objects=1)
    assert index.reserve_write([], BLOCK, ALICE).lease_id == 0
    with pytest.raises(LeaseNotFound):
        index.commit(0, ALICE)


def test_reserve_skips_chunks_that_do_not_fit() -> None:
    index, _ = make(blocks=4)
    res = index.reserve_write([k(i) for i in range(6)], BLOCK, ALICE)
    assert [i for i, _, _ in res.slots] == [0, 1, 2, 3]
    assert res.no_space == [4, 5]
    assert len({offset for _, offset, _ in res.slots}) == 4
    assert index.contains([k(4)]) == [False]
    figures(index, used=4 * BLOCK, objects=4, writing=4)
    # A commit does not need space: the skipped chunks are simply not there.
    assert index.commit(res.lease_id, ALICE).committed == 4


def test_reserve_skips_a_big_chunk_and_still_fits_later_small_ones() -> None:
    index, _ = make(blocks=4)
    res = index.reserve_write([k(0), k(1), k(2), k(3)], [BLOCK, 3 * BLOCK + 1, BLOCK, 1], ALICE)
    assert res.no_space == [1]
    assert [(i, n) for i, _, n in res.slots] == [(0, BLOCK), (2, BLOCK), (3, 1)]
    figures(index, used=3 * BLOCK, writing=3)
    # Nothing fits at all: every chunk reported, no lease.
    full = index.reserve_write([k(8), k(9)], 2 * BLOCK, BOB)
    assert full.lease_id == 0 and full.no_space == [0, 1] and full.slots == []


def test_reserve_rejects_bad_lengths_without_reserving() -> None:
    index, _ = make()
    with pytest.raises(ValueError):
        index.reserve_write([k(0), k(1)], [BLOCK], ALICE)
    with pytest.raises(ValueError):
        index.reserve_write([k(0), k(1)], [BLOCK, 0], ALICE)
    with pytest.raises(ValueError):
        index.reserve_write([k(0)], -1, ALICE)
    figures(index, used=0, objects=0, write_leases=0)


def test_ttls_must_be_positive() -> None:
    with pytest.raises(ValueError):
        ObjectIndex(Allocator(BLOCK), write_ttl=0)
    with pytest.raises(ValueError):
        ObjectIndex(Allocator(BLOCK), read_ttl=-1)


def test_commit_only_commits_a_subset_and_aborts_the_rest() -> None:
    index, _ = make()
    keys = [k(i) for i in range(4)]
    res = index.reserve_write(keys, BLOCK, ALICE)
    result = index.commit(res.lease_id, ALICE, only=[0, 2])
    assert result == CommitResult(
        committed=2,
        aborted=2,
        committed_keys=[k(0), k(2)],
        committed_lengths=[BLOCK, BLOCK],
        committed_bytes=2 * BLOCK,
    )
    assert index.contains(keys) == [True, False, True, False]
    figures(index, used=2 * BLOCK, objects=2, ready=2, writing=0, write_leases=0)
    # The aborted keys can be stored again.
    store(index, [k(1), k(3)])

    res = index.reserve_write([k(8), k(9)], BLOCK, ALICE)
    assert index.commit(res.lease_id, ALICE, only=[]) == CommitResult(aborted=2)
    assert index.contains([k(8), k(9)]) == [False, False]


def test_commit_only_out_of_range_changes_nothing() -> None:
    index, _ = make()
    res = index.reserve_write([k(0), k(1)], BLOCK, ALICE)
    before = index.stats()
    with pytest.raises(SlotPositionError):
        index.commit(res.lease_id, ALICE, only=[0, 2])
    with pytest.raises(LeaseError):
        index.commit(res.lease_id, ALICE, only=[-1])
    with pytest.raises(IndexError):  # also a builtin IndexError
        index.commit(res.lease_id, ALICE, only=[5])
    assert index.stats() == before
    assert index.commit(res.lease_id, ALICE, only=[1]).committed_keys == [k(1)]


def test_unknown_lease_ids_are_refused_and_change_nothing() -> None:
    index, _ = make()
    store(index, [k(0)])
    write = index.reserve_write([k(1)], BLOCK, ALICE)
    read = index.lock_read([k(0)], ALICE)
    before = index.stats()
    for bad in (0, 9999, -1):
        with pytest.raises(LeaseNotFound):
            index.commit(bad, ALICE)
        with pytest.raises(LeaseNotFound):
            index.abort(bad, ALICE)
        with pytest.raises(LeaseNotFound):
            index.release_read(bad, ALICE)
        with pytest.raises(LeaseNotFound):
            index.lease_slots(bad, ALICE)
    # A write lease is not a read lease and vice versa.
    with pytest.raises(LeaseNotFound):
        index.release_read(write.lease_id, ALICE)
    with pytest.raises(LeaseNotFound):
        index.lease_slots(write.lease_id, ALICE)
    with pytest.raises(LeaseNotFound):
        index.commit(read.lease_id, ALICE)
    with pytest.raises(LeaseNotFound):
        index.abort(read.lease_id, ALICE)
    assert index.stats() == before
    # Ending a lease twice is refused the second time.
    index.commit(write.lease_id, ALICE)
    index.release_read(read.lease_id, ALICE)
    with pytest.raises(LeaseNotFound):
        index.commit(write.lease_id, ALICE)
    with pytest.raises(LeaseNotFound):
        index.abort(write.lease_id, ALICE)
    with pytest.raises(LeaseNotFound):
        index.release_read(read.lease_id, ALICE)


def test_another_holders_lease_is_refused_and_changes_nothing() -> None:
    index, _ = make()
    store(index, [k(0)])
    write = index.reserve_write([k(1), k(2)], BLOCK, ALICE)
    read = index.lock_read([k(0)], ALICE)
    before = index.stats()
    with pytest.raises(LeaseNotOwned):
        index.commit(write.lease_id, BOB)
    with pytest.raises(LeaseNotOwned):
        index.commit(write.lease_id, BOB, only=[0])
    with pytest.raises(LeaseNotOwned):
        index.abort(write.lease_id, BOB)
    with pytest.raises(LeaseNotOwned):
        index.release_read(read.lease_id, BOB)
    with pytest.raises(LeaseNotOwned):
        index.lease_slots(read.lease_id, BOB)
    assert index.release_holder(BOB) == (0, 0)
    assert index.stats() == before
    assert index.contains([k(1), k(2)]) == [False, False]
    # The owner still holds both leases.
    assert index.lease_slots(read.lease_id, ALICE) == [
        (k(0), read.slots[0][1], BLOCK),
    ]
    assert index.commit(write.lease_id, ALICE).committed == 2
    assert index.release_read(read.lease_id, ALICE) == 1


def test_a_retrieve_renews_the_lookups_lease() -> None:
    """The locks a lookup took get a whole read TTL again when a retrieve takes them: a copy
    that starts late in the lease cannot outlive it (its slots then reused under it)."""
    index, clock = make()
    store(index, [k(0)])
    lock = index.lock_read([k(0)], ALICE)
    clock.advance(READ_TTL - 1)
    assert index.lease_slots(lock.lease_id, ALICE, renew=True)[0][0] == k(0)
    clock.advance(READ_TTL - 1)  # past the first deadline, within the renewed one
    assert index.release_read(lock.lease_id, ALICE) == 1
    other = index.lock_read([k(0)], ALICE)
    clock.advance(READ_TTL - 1)
    index.lease_slots(other.lease_id, ALICE)  # not renewed
    clock.advance(2)
    with pytest.raises(LeaseNotFound):
        index.release_read(other.lease_id, ALICE)


# -- reads ---------------------------------------------------------------------------------
def test_objects_being_written_are_invisible_to_readers() -> None:
    index, _ = make()
    store(index, [k(0)])
    res = index.reserve_write([k(1)], BLOCK, ALICE)
    lookup = index.lock_read([k(0), k(1)], BOB)
    assert [i for i, _, _ in lookup.slots] == [0] and lookup.missing == [1]
    lookup2 = index.lock_read([k(1), k(0)], BOB, prefix=False)
    assert [i for i, _, _ in lookup2.slots] == [1] and lookup2.missing == [0]
    none = index.lock_read([k(1)], BOB)
    assert none.lease_id == 0 and none.slots == [] and none.missing == [0]
    figures(index, read_leases=2, writing=1)
    index.commit(res.lease_id, ALICE)
    assert [i for i, _, _ in index.lock_read([k(1)], BOB).slots] == [0]


def test_prefix_lookup_stops_at_the_first_miss() -> None:
    index, _ = make()
    store(index, [k(0), k(2), k(3)])
    lookup = index.lock_read([k(0), k(1), k(2), k(3)], ALICE)
    assert [i for i, _, _ in lookup.slots] == [0]
    assert lookup.missing == [1, 2, 3]
    figures(index, read_locked=1, evictable=2)  # k(2), k(3) were not locked
    assert [key for key, _, _ in index.lease_slots(lookup.lease_id, ALICE)] == [k(0)]

    miss_first = index.lock_read([k(1), k(0)], ALICE)
    assert miss_first.lease_id == 0 and miss_first.missing == [0, 1]


def test_non_prefix_lookup_locks_every_ready_key_and_reports_missing() -> None:
    index, _ = make()
    store(index, [k(0), k(2), k(3)])
    lookup = index.lock_read([k(0), k(1), k(2), k(9), k(3)], ALICE, prefix=False)
    assert [i for i, _, _ in lookup.slots] == [0, 2, 4]
    assert lookup.missing == [1, 3]
    figures(index, read_locked=3, evictable=0)
    assert index.release_read(lookup.lease_id, ALICE) == 3
    figures(index, read_locked=0, evictable=3)


def test_the_same_key_twice_in_one_lookup_counts_twice() -> None:
    index, _ = make()
    store(index, [k(0)])
    lookup = index.lock_read([k(0), k(0)], ALICE)
    assert len(lookup.slots) == 2
    assert index.release_read(lookup.lease_id, ALICE) == 2
    figures(index, read_locked=0, evictable=1)


def test_contains_takes_no_lock_and_leaves_lru_alone() -> None:
    index, _ = make()
    store(index, [k(0)])
    store(index, [k(1)])
    assert index.contains([k(0), k(5), k(1)]) == [True, False, True]
    figures(index, read_locked=0, read_leases=0)
    assert evict_order(index) == [k(0), k(1)]


def test_lock_read_into_an_existing_lease() -> None:
    index, clock = make()
    store(index, [k(0), k(1), k(2), k(3)])
    lookup = index.lock_read([k(0), k(1), k(5)], ALICE)
    assert lookup.missing == [2]
    clock.advance(READ_TTL - 10)
    # A prefetch adds the following chunks to the lookup's lease and renews it.
    more = index.lock_read([k(2), k(3), k(9)], ALICE, into_lease=lookup.lease_id)
    assert more.lease_id == lookup.lease_id
    assert [i for i, _, _ in more.slots] == [0, 1] and more.missing == [2]
    assert [key for key, _, _ in index.lease_slots(lookup.lease_id, ALICE)] == [
        k(0),
        k(1),
        k(2),
        k(3),
    ]
    figures(index, read_leases=1, read_locked=4, evictable=0)
    clock.advance(20)  # past the first deadline, not the renewed one
    assert index.expire() == (0, 0)
    assert index.release_read(lookup.lease_id, ALICE) == 4
    figures(index, read_leases=0, read_locked=0, evictable=4)


def test_lock_read_into_a_lease_that_locks_nothing_keeps_its_deadline() -> None:
    index, clock = make()
    store(index, [k(0)])
    lookup = index.lock_read([k(0)], ALICE)
    clock.advance(READ_TTL - 10)
    none = index.lock_read([k(7)], ALICE, into_lease=lookup.lease_id)
    assert none.lease_id == lookup.lease_id and none.slots == [] and none.missing == [0]
    clock.advance(10)
    assert index.expire() == (0, 1)


def test_lock_read_into_a_bad_lease_locks_nothing() -> None:
    index, _ = make()
    store(index, [k(0), k(1)])
    lookup = index.lock_read([k(0)], ALICE)
    write = index.reserve_write([k(2)], BLOCK, ALICE)
    before = index.stats()
    with pytest.raises(LeaseNotOwned):
        index.lock_read([k(1)], BOB, into_lease=lookup.lease_id)
    with pytest.raises(LeaseNotFound):
        index.lock_read([k(1)], ALICE, into_lease=write.lease_id)
    with pytest.raises(LeaseNotFound):
        index.lock_read([k(1)], ALICE, into_lease=12345)
    assert index.stats() == before
    index.release_read(lookup.lease_id, ALICE)
    with pytest.raises(LeaseNotFound):
        index.lock_read([k(1)], ALICE, into_lease=lookup.lease_id)
    figures(index, read_leases=0, read_locked=0)


# -- TTL -----------------------------------------------------------------------------------
def test_an_expired_write_lease_keeps_its_slots_until_its_holder_ends_it() -> None:
    """The holder of an expired write lease may still be writing into its slots (an engine
    stopped mid-copy, resumed): its keys go at the deadline, its slots when it ends the
    lease (a commit or abort, refused as expired) or goes away, never to another store."""
    index, clock = make(blocks=3)
    res = index.reserve_write([k(0), k(1)], BLOCK, ALICE)
    clock.advance(WRITE_TTL - 1)
    assert index.expire() == (0, 0)
    clock.advance(1)
    # The next reservation expires the lease first: k(0) may be stored again, but ALICE's
    # two slots are not free: only the third block is.
    late = index.reserve_write([k(2), k(0)], BLOCK, BOB)
    assert [i for i, _, _ in late.slots] == [0] and late.no_space == [1]
    assert {off for _, off, _ in late.slots}.isdisjoint(off for _, off, _ in res.slots)
    figures(
        index,
        expired_write_leases=1,
        expired_write_slots=2,
        expired_held=2,
        fenced_free=2,
        write_leases=1,
        objects=1,
        used=3 * BLOCK,
    )
    with pytest.raises(LeaseNotOwned):
        index.commit(res.lease_id, BOB)  # not BOB's to end: nothing changes
    figures(index, expired_held=2, used=3 * BLOCK)
    with pytest.raises(LeaseNotFound):
        index.commit(res.lease_id, ALICE)
    figures(index, expired_held=0, fenced_free=0, used=BLOCK)
    with pytest.raises(LeaseNotFound):
        index.abort(res.lease_id, ALICE)
    index.commit(late.lease_id, BOB)
    assert index.contains([k(0), k(1), k(2)]) == [False, False, True]


def test_an_expired_write_lease_is_ended_by_abort_or_by_its_holder_leaving() -> None:
    index, clock = make(blocks=4)
    first = index.reserve_write([k(0)], BLOCK, ALICE)
    index.reserve_write([k(1), k(2)], BLOCK, ALICE)
    clock.advance(WRITE_TTL)
    figures(index, expired_held=0, used=3 * BLOCK)  # not expired until something looks
    assert index.expire() == (3, 0)
    figures(index, expired_held=3, used=3 * BLOCK, objects=0)
    with pytest.raises(LeaseNotFound):
        index.abort(first.lease_id, ALICE)
    figures(index, expired_held=2, used=2 * BLOCK)
    assert index.release_holder(ALICE) == (0, 0)  # expired leases count as expiries
    figures(index, expired_held=0, fenced_free=0, used=0)


def test_a_hold_lasts_one_write_ttl_and_stays_charged_to_its_tenant_and_holder() -> None:
    """A holder that lost its lease id (a reply that never came) never ends it: its slots
    come back one write TTL after the expiry. Until then they count as the holder's
    reservations (its limit) and as its tenant's bytes (its quota)."""
    index, clock = make(blocks=4)
    index.reserve_write([k(0), k(1)], BLOCK, ALICE)
    clock.advance(WRITE_TTL)
    assert index.expire() == (2, 0)

    def tenant_bytes() -> int:
        return sum(f.used for f in index.tenant_figures())

    figures(index, expired_held=2, used=2 * BLOCK)
    assert tenant_bytes() == 2 * BLOCK
    more = index.reserve_write([k(2), k(3)], BLOCK, ALICE, holder_limit=3 * BLOCK)
    assert len(more.slots) == 1 and more.no_space == [1]  # 2 held + 1 within 3 blocks
    index.abort(more.lease_id, ALICE)
    clock.advance(WRITE_TTL - 1)
    figures(index, expired_held=2, used=2 * BLOCK)
    clock.advance(1)
    assert index.expire() == (0, 0)
    figures(index, expired_held=0, fenced_free=0, used=0)
    assert tenant_bytes() == 0


def test_the_servers_own_holders_keep_their_holds_until_they_end_them() -> None:
    """A prefetch's tier read or a write-behind's tier write that outlasts its lease may
    still be running: the server's own holders always end their leases (in a finally), so
    their holds never end on a timer (a slot freed under a late tier read was overwritten)."""
    index, clock = make(blocks=4)
    res = index.reserve_write([k(0)], BLOCK, Holder.PREFETCH)
    clock.advance(WRITE_TTL)
    index.expire()
    clock.advance(10 * WRITE_TTL)
    index.expire()
    figures(index, expired_held=1, used=BLOCK)
    with pytest.raises(LeaseNotFound):
        index.commit(res.lease_id, Holder.PREFETCH)
    figures(index, expired_held=0, used=0)


def test_an_expired_pin_charges_its_chunks_once() -> None:
    """A write-behind's pin that expires holds slots of chunks that are still in the pool
    (charged as such): the tenant is charged once, while the chunk is there and then while
    the hold keeps its freed slot, and not at all once both are gone."""
    index, clock = make(blocks=4)
    store(index, [k(0), k(1)])

    def charged() -> int:
        return sum(f.used for f in index.tenant_figures())

    pin = index.pin([k(0), k(1)], Holder.WRITE_BEHIND)
    clock.advance(READ_TTL)
    index.expire()
    figures(index, expired_held=2, used=2 * BLOCK, pin_leases=0)
    assert charged() == 2 * BLOCK
    assert [e.key for e in index.evict(BLOCK)] == [k(1)]  # evictable: its slot stays held
    figures(index, used=2 * BLOCK, fenced_free=1, objects=1)
    assert charged() == 2 * BLOCK
    with pytest.raises(LeaseNotFound):
        index.unpin(pin.lease_id, Holder.WRITE_BEHIND)
    figures(index, expired_held=0, used=BLOCK, fenced_free=0, objects=1)
    assert charged() == BLOCK


def test_an_expired_lease_keeps_a_fence_the_slot_also_has() -> None:
    """An expired write lease's hold and a transfer's fence on the same slot: the slot
    comes back with the last of the two."""
    index, clock = make(blocks=2)
    res = index.reserve_write([k(0)], BLOCK, ALICE)
    offset = res.slots[0][1]
    index.fence([offset])
    clock.advance(WRITE_TTL)
    index.expire()
    with pytest.raises(LeaseNotFound):
        index.commit(res.lease_id, ALICE)
    figures(index, expired_held=0, fenced_free=1, used=BLOCK)
    assert index.unfence([offset]) == 1
    figures(index, fenced_free=0, used=0)


def test_expire_reports_and_counts_expired_write_slots() -> None:
    index, clock = make()
    index.reserve_write([k(0), k(1)], BLOCK, ALICE)
    clock.advance(10)
    index.reserve_write([k(2)], BLOCK, BOB)
    clock.advance(WRITE_TTL - 5)
    assert index.expire() == (2, 0)  # only ALICE's lease is overdue
    figures(index, write_leases=1, expired_write_leases=1, expired_write_slots=2, expired_held=2)
    clock.advance(10)
    assert index.expire() == (1, 0)
    figures(index, write_leases=0, expired_write_leases=2, expired_write_slots=3, expired_held=3)
    index.release_holder(ALICE)
    index.release_holder(BOB)
    figures(index, expired_held=0, used=0)


def test_commit_after_the_deadline_fails_even_before_anything_reaped_the_lease() -> None:
    index, clock = make()
    res = index.reserve_write([k(0)], BLOCK, ALICE)
    clock.advance(WRITE_TTL + 1)
    with pytest.raises(LeaseNotFound):
        index.commit(res.lease_id, ALICE)
    figures(index, used=0, objects=0, write_leases=0, expired_write_slots=1)
    assert index.contains([k(0)]) == [False]


def test_expired_read_lease_makes_objects_evictable_again() -> None:
    index, clock = make()
    store(index, [k(0), k(1)])
    lookup = index.lock_read([k(0), k(1)], ALICE)
    assert index.evict(10 * BLOCK) == []
    clock.advance(READ_TTL)
    assert index.expire() == (0, 2)
    figures(
        index,
        read_locked=0,
        evictable=2,
        read_leases=0,
        expired_read_leases=1,
        expired_read_locks=2,
    )
    with pytest.raises(LeaseNotFound):
        index.release_read(lookup.lease_id, ALICE)
    with pytest.raises(LeaseNotFound):
        index.lease_slots(lookup.lease_id, ALICE)
    assert [e.key for e in index.evict(10 * BLOCK)] == [k(1), k(0)]


def test_a_read_lease_holds_until_its_deadline() -> None:
    index, clock = make()
    store(index, [k(0)])
    lookup = index.lock_read([k(0)], ALICE)
    clock.advance(READ_TTL - 0.5)
    assert index.expire() == (0, 0)
    assert index.evict(BLOCK) == []
    assert index.release_read(lookup.lease_id, ALICE) == 1
    figures(index, expired_read_leases=0, evictable=1)


def test_release_after_the_deadline_fails_cleanly() -> None:
    index, clock = make()
    store(index, [k(0)])
    lookup = index.lock_read([k(0)], ALICE)
    clock.advance(READ_TTL + 5)
    with pytest.raises(LeaseNotFound):
        index.release_read(lookup.lease_id, ALICE)
    figures(index, read_locked=0, evictable=1, read_leases=0, expired_read_locks=1)


def test_read_and_write_leases_expire_on_their_own_ttls() -> None:
    index, clock = make()
    store(index, [k(0)])
    write = index.reserve_write([k(1)], BLOCK, ALICE)  # deadline t + 600
    clock.advance(100)
    read = index.lock_read([k(0)], ALICE)  # deadline t + 400
    clock.advance(READ_TTL)
    assert index.expire() == (0, 1)
    with pytest.raises(LeaseNotFound):
        index.release_read(read.lease_id, ALICE)
    assert index.commit(write.lease_id, ALICE).committed == 1


def test_a_lease_renewed_by_a_new_lookup_keeps_its_object_locked() -> None:
    index, clock = make()
    store(index, [k(0)])
    index.lock_read([k(0)], ALICE)
    clock.advance(READ_TTL / 2)
    second = index.lock_read([k(0)], BOB)
    clock.advance(READ_TTL / 2)
    assert index.expire() == (0, 1)
    figures(index, read_locked=1, evictable=0)
    assert index.evict(BLOCK) == []
    index.release_read(second.lease_id, BOB)
    assert [e.key for e in index.evict(BLOCK)] == [k(0)]


# -- eviction and LRU ----------------------------------------------------------------------
def test_locked_and_unfinished_objects_are_never_evicted() -> None:
    index, _ = make()
    store(index, [k(0), k(1), k(2)])
    index.lock_read([k(1)], ALICE)
    index.reserve_write([k(3)], BLOCK, BOB)
    evicted = index.evict(100 * BLOCK)
    assert sorted(e.key for e in evicted) == [k(0), k(2)]
    assert index.contains([k(0), k(1), k(2)]) == [False, True, False]
    figures(index, objects=2, writing=1, read_locked=1, evictable=0, used=2 * BLOCK)
    assert index.evict(100 * BLOCK) == []


def test_evict_frees_at_least_the_bytes_asked_for_and_reports_tier() -> None:
    index, _ = make()
    res = index.reserve_write([k(0), k(1), k(2)], [3 * BLOCK, BLOCK, 10], ALICE, tier="disk")
    index.commit(res.lease_id, ALICE)
    assert index.evict(0) == []
    evicted = index.evict(BLOCK + 1)  # k(2) (one block) then k(1) (one block)
    assert evicted == [Evicted(k(2), 10, "disk"), Evicted(k(1), BLOCK, "disk")]
    figures(index, evictions=2, evicted_bytes=2 * BLOCK, used=3 * BLOCK)


def test_evict_stops_at_max_objects_and_refuses_a_limit_below_one() -> None:
    index, _ = make()
    store(index, [k(0), k(1), k(2), k(3)])
    first = index.evict(100 * BLOCK, max_objects=3)
    assert [e.key for e in first] == [k(3), k(2), k(1)]  # LRU order, three only
    assert [e.key for e in index.evict(100 * BLOCK, max_objects=3)] == [k(0)]
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_objects"):
            index.evict(BLOCK, max_objects=bad)
    index.check()


def test_lru_evicts_the_last_chunks_of_a_committed_batch_first() -> None:
    index, _ = make()
    store(index, [k(0), k(1), k(2), k(3)])
    assert evict_order(index) == [k(3), k(2), k(1), k(0)]


def test_lru_evicts_the_last_chunks_of_a_released_batch_first() -> None:
    index, _ = make()
    store(index, [k(3)])  # stored in "wrong" order: k(3) oldest
    store(index, [k(2)])
    store(index, [k(1)])
    store(index, [k(0)])
    lookup = index.lock_read([k(0), k(1), k(2), k(3)], ALICE)
    index.release_read(lookup.lease_id, ALICE)
    assert evict_order(index) == [k(3), k(2), k(1), k(0)]


def test_a_recently_read_prefix_outlives_an_older_one() -> None:
    index, _ = make()
    a = [k("a0"), k("a1"), k("a2")]
    b = [k("b0"), k("b1"), k("b2")]
    store(index, a)
    store(index, b)
    lookup = index.lock_read(a, BOB)
    index.release_read(lookup.lease_id, BOB)
    evicted = index.evict(3 * BLOCK)
    assert [e.key for e in evicted] == [k("b2"), k("b1"), k("b0")]
    assert index.contains(a) == [True, True, True]


def test_an_older_prefix_goes_first_when_nothing_was_read() -> None:
    index, _ = make()
    store(index, [k("a0"), k("a1")])
    store(index, [k("b0"), k("b1")])
    assert evict_order(index) == [k("a1"), k("a0"), k("b1"), k("b0")]


def test_a_partial_read_refreshes_only_the_chunks_read() -> None:
    index, _ = make()
    store(index, [k(0), k(1), k(2)])
    lookup = index.lock_read([k(0), k(1)], ALICE)
    index.release_read(lookup.lease_id, ALICE)
    assert evict_order(index) == [k(2), k(1), k(0)]


def test_an_object_returns_to_the_lru_only_when_its_last_reader_leaves() -> None:
    index, _ = make()
    store(index, [k(0)])
    store(index, [k(1)])
    first = index.lock_read([k(0)], ALICE)
    second = index.lock_read([k(0)], BOB)
    index.release_read(first.lease_id, ALICE)
    store(index, [k(2)])
    index.release_read(second.lease_id, BOB)  # k(0) is now the most recently used
    assert evict_order(index) == [k(1), k(2), k(0)]


# -- pins ----------------------------------------------------------------------------------
def test_a_pin_keeps_the_lru_order_where_a_read_lock_refreshes_it() -> None:
    pinned, _ = make()
    read, _ = make()
    for index in (pinned, read):
        store(index, [k("old")])
        store(index, [k("new")])
    pin = pinned.pin([k("old")], ALICE)
    assert pin.slots == [(0, pin.slots[0][1], BLOCK)] and pin.missing == []
    assert pinned.unpin(pin.lease_id, ALICE) == 1
    lock = read.lock_read([k("old")], ALICE)
    read.release_read(lock.lease_id, ALICE)
    assert evict_order(pinned) == [k("old"), k("new")]  # a pin is not a use
    assert evict_order(read) == [k("new"), k("old")]  # a read is


def test_eviction_steps_over_pinned_objects_and_they_keep_their_place() -> None:
    index, _ = make()
    for i in range(4):
        store(index, [k(i)])  # k(0) oldest
    pin = index.pin([k(0), k(2)], BOB)
    figures(index, ready=4, read_locked=2, pinned=2, evictable=2, read_leases=1, pin_leases=1)
    assert [e.key for e in index.evict(BLOCK)] == [k(1)]
    assert [e.key for e in index.evict(BLOCK)] == [k(3)]
    assert index.evict(BLOCK) == []  # only pinned objects left
    store(index, [k(4)])
    index.unpin(pin.lease_id, BOB)
    assert evict_order(index) == [k(0), k(2), k(4)]


def test_a_read_lock_on_a_pinned_object_is_a_use() -> None:
    index, _ = make()
    store(index, [k(0)])
    store(index, [k(1)])
    pin = index.pin([k(0)], BOB)
    lock = index.lock_read([k(0)], ALICE)
    figures(index, read_locked=1, pinned=1, evictable=1)
    index.release_read(lock.lease_id, ALICE)  # k(0) is now the most recently used
    figures(index, read_locked=1, pinned=1, evictable=1)
    index.unpin(pin.lease_id, BOB)  # and stays so
    assert evict_order(index) == [k(1), k(0)]


def test_pin_skips_what_is_not_ready_and_repeats_count_twice() -> None:
    index, _ = make()
    store(index, [k(0)])
    index.reserve_write([k(1)], BLOCK, ALICE)
    pin = index.pin([k(1), k(0), k(9), k(0)], BOB)
    assert [i for i, _, _ in pin.slots] == [1, 3] and pin.missing == [0, 2]
    assert index.pin([k(1), k(9)], BOB).lease_id == 0
    assert index.unpin(pin.lease_id, BOB) == 2
    figures(index, pinned=0, evictable=1, read_leases=0)


def test_pin_and_read_lock_leases_are_not_interchangeable() -> None:
    index, _ = make()
    store(index, [k(0)])
    pin = index.pin([k(0)], ALICE)
    lock = index.lock_read([k(0)], ALICE)
    with pytest.raises(LeaseNotFound):
        index.release_read(pin.lease_id, ALICE)
    with pytest.raises(LeaseNotFound):
        index.unpin(lock.lease_id, ALICE)
    with pytest.raises(LeaseNotFound):
        index.lock_read([k(0)], ALICE, into_lease=pin.lease_id)
    with pytest.raises(LeaseNotOwned):
        index.unpin(pin.lease_id, BOB)
    assert index.lease_slots(pin.lease_id, ALICE) == index.lease_slots(lock.lease_id, ALICE)
    assert index.unpin(pin.lease_id, ALICE) == 1
    assert index.release_read(lock.lease_id, ALICE) == 1
    with pytest.raises(LeaseNotFound):
        index.unpin(pin.lease_id, ALICE)


@pytest.mark.parametrize("unpin_first", [True, False])
def test_delete_of_a_pinned_object_frees_when_the_last_hold_ends(unpin_first: bool) -> None:
    index, _ = make(blocks=2)
    store(index, [k(0)])
    pin = index.pin([k(0)], BOB)
    lock = index.lock_read([k(0)], ALICE)
    offset = pin.slots[0][1]
    assert index.delete([k(0)]) == 1
    figures(index, used=BLOCK, objects=0, zombies=1, pinned=0, evictable=0)
    res = index.reserve_write([k(1), k(2)], BLOCK, ALICE)  # the held slot is not handed out
    assert [off for _, off, _ in res.slots] != [offset] and res.no_space == [1]
    index.commit(res.lease_id, ALICE)
    if unpin_first:
        assert index.unpin(pin.lease_id, BOB) == 1
        figures(index, used=2 * BLOCK, zombies=1)
        index.release_read(lock.lease_id, ALICE)
    else:
        index.release_read(lock.lease_id, ALICE)
        figures(index, used=2 * BLOCK, zombies=1)
        assert index.unpin(pin.lease_id, BOB) == 1
    figures(index, used=BLOCK, zombies=0, read_leases=0)


def test_clear_of_pinned_unlocked_objects_frees_them_on_unpin() -> None:
    index, _ = make()
    store(index, [k(0), k(1)])
    pin = index.pin([k(0)], BOB)
    assert index.clear() == 2
    figures(index, used=BLOCK, zombies=1, objects=0, evictable=0, pinned=0)
    assert index.evict(100 * BLOCK) == []
    index.unpin(pin.lease_id, BOB)
    figures(index, used=0, zombies=0, pin_leases=0)


def test_an_expired_pin_leaves_the_lru_order_alone() -> None:
    index, clock = make()
    store(index, [k(0)])
    store(index, [k(1)])
    store(index, [k(2)])
    pin = index.pin([k(0), k(2)], BOB)
    index.delete([k(2)])
    clock.advance(READ_TTL)
    assert index.expire() == (0, 2)
    # The pin's holder (the write-behind) may still be reading the slots for a tier: the
    # deleted k(2)'s slot stays fenced until it ends the pin.
    figures(index, used=3 * BLOCK, zombies=0, pinned=0, expired_read_leases=1, fenced_free=1)
    with pytest.raises(LeaseNotFound):
        index.unpin(pin.lease_id, BOB)
    figures(index, used=2 * BLOCK, fenced_free=0, expired_held=0)
    assert evict_order(index) == [k(0), k(1)]


def test_release_holder_ends_pins_without_moving_them() -> None:
    index, _ = make()
    store(index, [k(0)])
    store(index, [k(1)])
    index.pin([k(0)], BOB)
    index.pin([k(0), k(1)], BOB)
    index.lock_read([k(1)], ALICE)
    assert index.release_holder(BOB) == (0, 3)
    figures(index, pinned=0, pin_leases=0, read_locked=1, evictable=1)
    index.release_holder(ALICE)
    assert evict_order(index) == [k(0), k(1)]


# -- delete, clear, zombies ----------------------------------------------------------------
def test_delete_ready_unlocked_frees_at_once() -> None:
    index, _ = make()
    store(index, [k(0), k(1)])
    assert index.delete([k(0), k(9), k(0)]) == 1
    assert index.contains([k(0), k(1)]) == [False, True]
    figures(index, used=BLOCK, objects=1, zombies=0, evictable=1)


def test_delete_of_a_read_locked_object_frees_when_the_lease_ends() -> None:
    index, _ = make()
    store(index, [k(0)])
    lookup = index.lock_read([k(0)], ALICE)
    offset = lookup.slots[0][1]
    assert index.delete([k(0)]) == 1
    assert index.contains([k(0)]) == [False]
    assert index.lock_read([k(0)], BOB).missing == [0]
    figures(index, used=BLOCK, objects=0, zombies=1, read_leases=1)
    # The reader still has its slot, and a new version of the key gets another one.
    assert index.lease_slots(lookup.lease_id, ALICE) == [(k(0), offset, BLOCK)]
    res = index.reserve_write([k(0)], BLOCK, BOB)
    assert res.slots[0][1] != offset
    index.commit(res.lease_id, BOB)
    figures(index, used=2 * BLOCK, objects=1, zombies=1)
    assert index.release_read(lookup.lease_id, ALICE) == 1
    figures(index, used=BLOCK, objects=1, zombies=0, evictable=1)
    assert index.contains([k(0)]) == [True]


def test_delete_of_an_object_being_written_reports_cleared_on_commit() -> None:
    index, _ = make()
    res = index.reserve_write([k(0), k(1)], BLOCK, ALICE)
    assert index.delete([k(0)]) == 1
    figures(index, used=2 * BLOCK, objects=1, writing=1, zombies=1)
    # Another writer may store the key again meanwhile.
    again = index.reserve_write([k(0)], BLOCK, BOB)
    assert again.slots and again.present == []
    figures(index, used=3 * BLOCK, zombies=1)
    result = index.commit(res.lease_id, ALICE)
    assert result == CommitResult(
        committed=1,
        cleared=1,
        committed_keys=[k(1)],
        committed_lengths=[BLOCK],
        committed_bytes=BLOCK,
    )
    figures(index, used=2 * BLOCK, zombies=0, writing=1)
    assert index.contains([k(0), k(1)]) == [False, True]
    index.commit(again.lease_id, BOB)
    assert index.contains([k(0)]) == [True]


def test_delete_of_an_object_being_written_then_abort() -> None:
    index, _ = make()
    res = index.reserve_write([k(0)], BLOCK, ALICE)
    index.delete([k(0)])
    assert index.abort(res.lease_id, ALICE) == 1
    figures(index, used=0, zombies=0, objects=0)


def test_commit_only_of_a_cleared_reservation() -> None:
    index, _ = make()
    res = index.reserve_write([k(0), k(1), k(2)], BLOCK, ALICE)
    index.clear()
    result = index.commit(res.lease_id, ALICE, only=[0])
    assert result == CommitResult(aborted=2, cleared=1)
    figures(index, used=0, zombies=0, objects=0)


def test_clear_removes_everything_and_frees_held_slots_when_leases_end() -> None:
    index, _ = make()
    store(index, [k("free0"), k("free1")])
    store(index, [k("read")])
    lookup = index.lock_read([k("read")], BOB)
    writing = index.reserve_write([k("w0"), k("w1")], BLOCK, ALICE)
    assert index.clear() == 5
    keys = [k("free0"), k("free1"), k("read"), k("w0"), k("w1")]
    assert index.contains(keys) == [False] * 5
    assert index.lock_read(keys, BOB, prefix=False).missing == [0, 1, 2, 3, 4]
    figures(index, used=3 * BLOCK, objects=0, writing=0, ready=0, zombies=3, evictable=0)
    assert index.evict(100 * BLOCK) == []

    assert index.commit(writing.lease_id, ALICE) == CommitResult(cleared=2)
    figures(index, used=BLOCK, zombies=1, write_leases=0)
    assert index.release_read(lookup.lease_id, BOB) == 1
    figures(index, used=0, zombies=0, read_leases=0, largest_free=16 * BLOCK)
    assert index.clear() == 0


def test_cleared_objects_held_by_expired_leases_are_freed() -> None:
    index, clock = make()
    store(index, [k(0)])
    index.lock_read([k(0)], ALICE)
    index.reserve_write([k(1)], BLOCK, BOB)
    index.clear()
    figures(index, zombies=2, used=2 * BLOCK)
    clock.advance(WRITE_TTL)
    assert index.expire() == (1, 1)
    # The read lock's slot is free; the write lease's waits for BOB to end it.
    figures(index, zombies=0, used=BLOCK, fenced_free=1, read_leases=0, write_leases=0)
    index.release_holder(BOB)
    figures(index, used=0, fenced_free=0)


def test_release_holder_ends_all_of_a_holders_leases() -> None:
    index, _ = make()
    store(index, [k(0), k(1)])
    w1 = index.reserve_write([k(2), k(3)], BLOCK, ALICE)
    w2 = index.reserve_write([k(4)], BLOCK, ALICE)
    r1 = index.lock_read([k(0), k(1)], ALICE)
    r2 = index.lock_read([k(0)], ALICE)
    bob_read = index.lock_read([k(1)], BOB)
    bob_write = index.reserve_write([k(5)], BLOCK, BOB)

    assert index.release_holder(ALICE) == (3, 3)
    figures(index, write_leases=1, read_leases=1, writing=1, read_locked=1, evictable=1)
    assert index.contains([k(2), k(3), k(4)]) == [False] * 3
    for lease_id in (w1.lease_id, w2.lease_id):
        with pytest.raises(LeaseNotFound):
            index.commit(lease_id, ALICE)
    for lease_id in (r1.lease_id, r2.lease_id):
        with pytest.raises(LeaseNotFound):
            index.release_read(lease_id, ALICE)
    assert index.release_holder(ALICE) == (0, 0)

    # BOB is untouched.
    assert index.commit(bob_write.lease_id, BOB).committed == 1
    assert index.release_read(bob_read.lease_id, BOB) == 1
    figures(index, used=3 * BLOCK, write_leases=0, read_leases=0, evictable=3)


def test_release_holder_frees_held_zombies() -> None:
    index, _ = make()
    store(index, [k(0)])
    index.lock_read([k(0)], ALICE)
    index.reserve_write([k(1)], BLOCK, ALICE)
    index.clear()
    assert index.release_holder(ALICE) == (1, 1)
    figures(index, used=0, zombies=0)


# -- stats ---------------------------------------------------------------------------------
def test_stats_figures() -> None:
    index, clock = make(blocks=16)
    assert index.stats() == IndexStats(
        capacity=16 * BLOCK,
        used=0,
        largest_free=16 * BLOCK,
        objects=0,
        writing=0,
        ready=0,
        read_locked=0,
        pinned=0,
        evictable=0,
        zombies=0,
        write_leases=0,
        read_leases=0,
        pin_leases=0,
        expired_write_leases=0,
        expired_read_leases=0,
        expired_write_slots=0,
        expired_read_locks=0,
        evictions=0,
        evicted_bytes=0,
    )
    store(index, [k(i) for i in range(6)], length=2 * BLOCK - 1)  # 12 blocks
    index.lock_read([k(0), k(1)], ALICE)
    index.lock_read([k(1)], BOB)
    index.pin([k(1), k(2)], BOB)
    index.reserve_write([k(10)], BLOCK, ALICE)  # 13 blocks
    expiring = index.reserve_write([k(11)], BLOCK, BOB)  # 14 blocks
    index.delete([k(0)])  # read-locked: becomes a zombie
    clock.advance(WRITE_TTL)
    # Every lease is overdue now; release_holder expires them first, so they count as
    # expired, and it finds nothing left to release.
    assert index.release_holder(BOB) == (0, 0)
    with pytest.raises(LeaseNotFound):
        index.commit(expiring.lease_id, BOB)
    evicted = index.evict(1)  # k(5), the last chunk of the batch
    assert [e.key for e in evicted] == [k(5)]
    stats = index.stats()
    assert stats == IndexStats(
        capacity=16 * BLOCK,
        # k(1) .. k(4), and k(10): ALICE has not ended its expired write lease; k(0) and
        # k(11) freed by expiry (BOB's leases ended when it left), k(5) evicted.
        used=9 * BLOCK,
        largest_free=3 * BLOCK,  # k(11) and the 2 never used blocks
        objects=4,
        writing=0,
        ready=4,
        read_locked=0,
        pinned=0,
        evictable=4,
        zombies=0,
        write_leases=0,
        read_leases=0,
        pin_leases=0,
        expired_write_leases=2,
        expired_read_leases=3,  # two read-lock leases and the pin lease
        expired_write_slots=2,
        expired_read_locks=5,  # three read locks and two pins
        evictions=1,
        evicted_bytes=2 * BLOCK,
        fenced_free=1,
        expired_held=1,
    )


def test_stats_while_leases_are_held() -> None:
    index, _ = make(blocks=16)
    store(index, [k(i) for i in range(4)])
    index.lock_read([k(0), k(1)], ALICE)
    index.lock_read([k(1)], BOB)
    index.reserve_write([k(10), k(11)], BLOCK, ALICE)
    index.pin([k(1), k(2), k(2)], BOB)  # k(1) is read-locked too
    index.delete([k(0), k(10)])
    figures(
        index,
        used=6 * BLOCK,
        objects=4,  # k(1), k(2), k(3) ready, k(11) writing
        writing=1,
        ready=3,
        read_locked=2,  # k(1) (read-locked and pinned) and k(2) (pinned)
        pinned=2,
        evictable=1,  # k(3)
        zombies=2,
        write_leases=1,
        read_leases=3,
        pin_leases=1,
    )


# -- model-based ---------------------------------------------------------------------------
KEYS = [k(i) for i in range(6)]
HOLDERS = [ALICE, BOB]
POOL_BLOCKS = 8


@dataclasses.dataclass(eq=False)
class MEntry:
    key: bytes
    blocks: int
    ready: bool = False
    readers: int = 0
    pins: int = 0
    live: bool = True
    offset: int = -1


@dataclasses.dataclass
class MLease:
    holder: int
    kind: str  # "write", "read" or "pin"
    deadline: float
    entries: list[MEntry]


@settings(
    max_examples=200,
    stateful_step_count=50,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
class IndexModel(RuleBasedStateMachine):
    """Random calls against the index and a plain model of it; every result must agree."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.index = CheckedIndex(
            Allocator(POOL_BLOCKS * BLOCK, BLOCK), WRITE_TTL, READ_TTL, self.clock
        )
        self.keymap: dict[bytes, MEntry] = {}
        self.held: list[MEntry] = []  # every entry with a block (live or zombie)
        self.lru: list[MEntry] = []  # oldest first
        self.leases: dict[int, MLease] = {}
        self.fences: dict[int, int] = {}  # offset -> fences on it
        # Expired write leases and pins their holders have not ended: id -> (kind, holder,
        # offsets of their slots, when the hold ends), which stay allocated until then.
        self.expired: dict[int, tuple[str, int, list[int], float]] = {}
        self.kept: dict[int, int] = {}  # fenced or held slots freed meanwhile: offset -> blocks

    # model helpers
    def _keeps(self, offset: int) -> bool:
        return offset in self.fences or any(offset in x[2] for x in self.expired.values())

    def _free(self, entry: MEntry) -> None:
        self.held.remove(entry)
        if self._keeps(entry.offset):
            self.kept[entry.offset] = entry.blocks

    def _let_go(self, lease_id: int) -> int:
        """The holder ended an expired lease: slots nothing keeps any more come back."""
        _, _, offsets, _ = self.expired.pop(lease_id)
        return self._give_back(offsets)

    def _give_back(self, offsets: list[int]) -> int:
        given = 0
        for offset in set(offsets):
            if offset in self.kept and not self._keeps(offset):
                del self.kept[offset]
                given += 1
        return given

    def _unmap(self, entry: MEntry) -> None:
        del self.keymap[entry.key]
        entry.live = False
        if entry in self.lru:
            self.lru.remove(entry)
            if entry.pins == 0:
                self._free(entry)

    def _drop_writing(self, entry: MEntry) -> None:
        if entry.live:
            del self.keymap[entry.key]
            entry.live = False
        self._free(entry)

    def _unlock(self, entries: list[MEntry]) -> None:
        for entry in reversed(entries):
            entry.readers -= 1
            if entry.readers == 0:
                if entry.live:
                    self.lru.append(entry)
                elif entry.pins == 0:
                    self._free(entry)

    def _unpin(self, entries: list[MEntry]) -> None:
        for entry in entries:
            entry.pins -= 1
            if entry.pins == 0 and entry.readers == 0 and not entry.live:
                self._free(entry)

    def _end(self, lease_id: int) -> MLease:
        lease = self.leases.pop(lease_id)
        if lease.kind == "write":
            for entry in lease.entries:
                self._drop_writing(entry)
        elif lease.kind == "pin":
            self._unpin(lease.entries)
        else:
            self._unlock(lease.entries)
        return lease

    def _expire(self) -> None:
        for lease_id, lease in list(self.leases.items()):
            if lease.deadline <= self.clock.now:
                if lease.kind != "read":  # its holder may still use the slots
                    self.expired[lease_id] = (
                        lease.kind,
                        lease.holder,
                        [e.offset for e in lease.entries],
                        self.clock.now + WRITE_TTL,
                    )
                self._end(lease_id)
        for lease_id, held in list(self.expired.items()):
            if held[3] <= self.clock.now:  # a hold lasts one write TTL at most
                self._let_go(lease_id)

    def _check_lease_call(self, lease_id: int, holder: int, kind: str) -> type[Exception] | None:
        self._expire()
        expired = self.expired.get(lease_id)
        if expired is not None and expired[0] == kind:
            if expired[1] != holder:
                return LeaseNotOwned
            self._let_go(lease_id)
            return LeaseNotFound
        lease = self.leases.get(lease_id)
        if lease is None or lease.kind != kind:
            return LeaseNotFound
        if lease.holder != holder:
            return LeaseNotOwned
        return None

    # rules
    @rule(
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5),
        blocks=st.integers(1, 3),
        holder=st.sampled_from(HOLDERS),
    )
    def reserve(self, keys: list[bytes], blocks: int, holder: int) -> None:
        self._reserve(keys, blocks, holder)

    @rule(
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5),
        blocks=st.integers(1, 3),
        holder=st.sampled_from(HOLDERS),
    )
    def store(self, keys: list[bytes], blocks: int, holder: int) -> None:
        """Reserve and commit at once (the common path)."""
        lease_id = self._reserve(keys, blocks, holder)
        if lease_id:
            self._commit(lease_id, holder, None)

    def _reserve(self, keys: list[bytes], blocks: int, holder: int) -> int:
        self._expire()
        res = self.index.reserve_write(keys, blocks * BLOCK, holder)
        reserved = [i for i, _, _ in res.slots]
        assert sorted(reserved + res.present + res.no_space) == list(range(len(keys)))
        entries = []
        seen: set[bytes] = set()
        for i, key in enumerate(keys):
            if key in self.keymap or key in seen:
                assert i in res.present
                continue
            assert i not in res.present
            if i in res.no_space:
                assert self.index.stats().largest_free < blocks * BLOCK
                continue
            seen.add(key)
            entry = MEntry(key, blocks, offset=dict((j, o) for j, o, _ in res.slots)[i])
            self.keymap[key] = entry
            self.held.append(entry)
            entries.append(entry)
        if entries:
            lease = MLease(holder, "write", self.clock.now + WRITE_TTL, entries)
            self.leases[res.lease_id] = lease
        else:
            assert res.lease_id == 0
        return res.lease_id

    @rule(
        pick=st.integers(0, 10**6),
        subset=st.none() | st.none() | st.lists(st.integers(0, 4), max_size=4),
    )
    def commit(self, pick: int, subset: list[int] | None) -> None:
        lease_id, holder = self._pick(pick, "write")
        self._commit(lease_id, holder, subset)

    def _commit(self, lease_id: int, holder: int, subset: list[int] | None) -> None:
        error = self._check_lease_call(lease_id, holder, "write")
        if (
            error is None
            and subset is not None
            and any(p >= len(self.leases[lease_id].entries) for p in subset)
        ):
            error = LeaseError
        if error is not None:
            with pytest.raises(error):
                self.index.commit(lease_id, holder, subset)
            return
        result = self.index.commit(lease_id, holder, subset)
        lease = self.leases.pop(lease_id)
        expected = CommitResult()
        ready = []
        for pos, entry in enumerate(lease.entries):
            if subset is not None and pos not in subset:
                self._drop_writing(entry)
                expected.aborted += 1
            elif not entry.live:
                self._free(entry)
                expected.cleared += 1
            else:
                entry.ready = True
                ready.append(entry)
                expected.committed_keys.append(entry.key)
                expected.committed_lengths.append(entry.blocks * BLOCK)
                expected.committed_bytes += entry.blocks * BLOCK
        expected.committed = len(ready)
        self.lru.extend(reversed(ready))
        assert result == expected

    @rule(pick=st.integers(0, 10**6))
    def abort(self, pick: int) -> None:
        lease_id, holder = self._pick(pick, "write")
        error = self._check_lease_call(lease_id, holder, "write")
        if error is not None:
            with pytest.raises(error):
                self.index.abort(lease_id, holder)
            return
        assert self.index.abort(lease_id, holder) == len(self._end(lease_id).entries)

    @rule(
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5),
        holder=st.sampled_from(HOLDERS),
        prefix=st.booleans(),
    )
    def lock_read(self, keys: list[bytes], holder: int, prefix: bool) -> None:
        self._lock_read(keys, holder, prefix)

    @rule(
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5),
        holder=st.sampled_from(HOLDERS),
        prefix=st.booleans(),
    )
    def read(self, keys: list[bytes], holder: int, prefix: bool) -> None:
        """Lock and release at once (a complete retrieve)."""
        lease_id = self._lock_read(keys, holder, prefix)
        if lease_id:
            self._release_read(lease_id, holder)

    @rule(
        pick=st.integers(0, 10**6),
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3),
        prefix=st.booleans(),
    )
    def lock_into(self, pick: int, keys: list[bytes], prefix: bool) -> None:
        """Add locks to an existing read lease (a prefetch joining its lookup's lease)."""
        lease_id, holder = self._pick(pick, "read")
        error = self._check_lease_call(lease_id, holder, "read")
        if lease_id == 0:
            error = None  # into_lease=0 means a new lease
        if error is not None:
            with pytest.raises(error):
                self.index.lock_read(keys, holder, prefix, into_lease=lease_id)
            return
        self._lock_read(keys, holder, prefix, into=lease_id)

    def _lock_read(self, keys: list[bytes], holder: int, prefix: bool, into: int = 0) -> int:
        self._expire()
        result = self.index.lock_read(keys, holder, prefix, into_lease=into)
        entries: list[MEntry] = []
        locked: list[int] = []
        missing: list[int] = []
        for i, key in enumerate(keys):
            entry = self.keymap.get(key)
            if entry is None or not entry.ready:
                if prefix:
                    missing.extend(range(i, len(keys)))
                    break
                missing.append(i)
                continue
            if entry.readers == 0:
                self.lru.remove(entry)
            entry.readers += 1
            entries.append(entry)
            locked.append(i)
        assert [i for i, _, _ in result.slots] == locked
        assert result.missing == missing
        if into:
            assert result.lease_id == into
            if entries:
                self.leases[into].entries.extend(entries)
                self.leases[into].deadline = self.clock.now + READ_TTL
        elif entries:
            self.leases[result.lease_id] = MLease(
                holder, "read", self.clock.now + READ_TTL, entries
            )
        else:
            assert result.lease_id == 0
        return result.lease_id

    @rule(pick=st.integers(0, 10**6))
    def release_read(self, pick: int) -> None:
        lease_id, holder = self._pick(pick, "read")
        self._release_read(lease_id, holder)

    def _release_read(self, lease_id: int, holder: int) -> None:
        error = self._check_lease_call(lease_id, holder, "read")
        if error is not None:
            with pytest.raises(error):
                self.index.release_read(lease_id, holder)
            return
        assert self.index.release_read(lease_id, holder) == len(self._end(lease_id).entries)

    @rule(
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5),
        holder=st.sampled_from(HOLDERS),
    )
    def pin(self, keys: list[bytes], holder: int) -> None:
        """A background hold (the write-behind): the LRU order must not change."""
        self._pin(keys, holder)

    @rule(pick=st.integers(0, 10**6), holder=st.sampled_from(HOLDERS), delete=st.booleans())
    def hold_again(self, pick: int, holder: int, delete: bool) -> None:
        """Pin what a read lease holds, or read-lock what a pin lease holds (the write-behind
        and an engine on the same chunks), and maybe delete them then (zombies held both
        ways): random keys alone rarely overlap like this."""
        held = sorted(i for i, lease in self.leases.items() if lease.kind != "write")
        if not held:
            return
        lease = self.leases[held[pick % len(held)]]
        keys = [e.key for e in lease.entries]
        if lease.kind == "read":
            self._pin(keys, holder)
        else:
            self._lock_read(keys, holder, prefix=False)
        if delete:
            self.delete(keys)

    def _pin(self, keys: list[bytes], holder: int) -> None:
        self._expire()
        result = self.index.pin(keys, holder)
        entries: list[MEntry] = []
        pinned: list[int] = []
        for i, key in enumerate(keys):
            entry = self.keymap.get(key)
            if entry is None or not entry.ready:
                continue
            entry.pins += 1
            entries.append(entry)
            pinned.append(i)
        assert [i for i, _, _ in result.slots] == pinned
        assert result.missing == [i for i in range(len(keys)) if i not in pinned]
        if entries:
            self.leases[result.lease_id] = MLease(holder, "pin", self.clock.now + READ_TTL, entries)
        else:
            assert result.lease_id == 0

    @rule(pick=st.integers(0, 10**6))
    def unpin(self, pick: int) -> None:
        lease_id, holder = self._pick(pick, "pin")
        error = self._check_lease_call(lease_id, holder, "pin")
        if error is not None:
            with pytest.raises(error):
                self.index.unpin(lease_id, holder)
            return
        assert self.index.unpin(lease_id, holder) == len(self._end(lease_id).entries)

    @rule(holder=st.sampled_from(HOLDERS))
    def release_holder(self, holder: int) -> None:
        self._expire()
        for lease_id in [i for i, x in self.expired.items() if x[1] == holder]:
            self._let_go(lease_id)
        freed = released = 0
        for lease_id, lease in list(self.leases.items()):
            if lease.holder == holder:
                self._end(lease_id)
                if lease.kind == "write":
                    freed += len(lease.entries)
                else:
                    released += len(lease.entries)
        assert self.index.release_holder(holder) == (freed, released)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=3))
    def delete(self, keys: list[bytes]) -> None:
        n = 0
        for key in keys:
            entry = self.keymap.get(key)
            if entry is not None:
                self._unmap(entry)
                n += 1
        assert self.index.delete(keys) == n

    @rule(dice=st.integers(0, 9))
    def clear(self, dice: int) -> None:
        if dice:  # rare: it empties the model
            return
        entries = list(self.keymap.values())
        for entry in entries:
            self._unmap(entry)
        assert self.index.clear() == len(entries)

    @rule(blocks=st.integers(0, 5))
    def evict(self, blocks: int) -> None:
        expected = []
        freed = 0
        for entry in [e for e in self.lru if e.pins == 0]:  # oldest first, pinned skipped
            if freed >= blocks * BLOCK:
                break
            self.lru.remove(entry)
            del self.keymap[entry.key]
            entry.live = False
            self._free(entry)
            freed += entry.blocks * BLOCK
            expected.append(entry.key)
        assert [e.key for e in self.index.evict(blocks * BLOCK)] == expected

    @rule(seconds=st.sampled_from([0.0, 0.0, 1.0, 100.0, READ_TTL - 1, READ_TTL, WRITE_TTL]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule()
    def expire(self) -> None:
        self.index.expire()
        self._expire()

    @rule(pick=st.integers(0, 10**6))
    def fence(self, pick: int) -> None:
        """A fence on a slot in use (a one-sided READ into it given up at its deadline)."""
        if not self.held:
            return
        offset = self.held[pick % len(self.held)].offset
        self.index.fence([offset])
        self.fences[offset] = self.fences.get(offset, 0) + 1

    @rule(
        pick=st.integers(0, 10**6), other=st.booleans(), subset=st.booleans(), stall=st.booleans()
    )
    def end_expired(self, pick: int, other: bool, subset: bool, stall: bool) -> None:
        """The holder of an expired write lease or pin (or another holder) ends it: a
        stalled engine resumed, or a write-behind done late. Refused either way. With
        ``stall``, the clock first runs to the deadline of a live write lease or pin."""
        live = sorted(i for i, lease in self.leases.items() if lease.kind != "read")
        if stall and live:
            deadline = self.leases[live[pick % len(live)]].deadline
            self.clock.advance(max(0.0, deadline - self.clock.now))
        self._expire()
        self.index.expire()  # the index expires as the model did (it may not be called)
        if not self.expired:
            return
        lease_id = sorted(self.expired)[pick % len(self.expired)]
        kind, holder = self.expired[lease_id][:2]
        if other:
            holder = HOLDERS[HOLDERS.index(holder) - 1]
        error = self._check_lease_call(lease_id, holder, kind)
        assert error is not None
        with pytest.raises(error):
            if kind == "pin":
                self.index.unpin(lease_id, holder)
            elif subset:
                self.index.commit(lease_id, holder, [0])
            else:
                self.index.abort(lease_id, holder)

    @rule(pick=st.integers(0, 10**6))
    def unfence(self, pick: int) -> None:
        if not self.fences:
            with pytest.raises(ValueError):
                self.index.unfence([pick % POOL_BLOCKS * BLOCK])
            return
        offset = sorted(self.fences)[pick % len(self.fences)]
        self.fences[offset] -= 1
        given = 0
        if not self.fences[offset]:
            del self.fences[offset]
            given = self._give_back([offset])
        assert self.index.unfence([offset]) == given

    def _pick(self, pick: int, kind: str) -> tuple[int, int]:
        """(lease id, holder): mostly a live lease of the right kind and its holder,
        sometimes another holder, an id of another kind or one never issued."""
        ids = sorted(i for i, lease in self.leases.items() if lease.kind == kind)
        if not ids or pick % 10 == 0:
            return pick % 50, HOLDERS[pick % 2]
        lease_id = ids[pick % len(ids)]
        holder = self.leases[lease_id].holder
        if pick % 10 == 1:
            holder = HOLDERS[HOLDERS.index(holder) - 1]
        return lease_id, holder

    @invariant()
    def agrees(self) -> None:
        self.index.check()
        kept = sum(self.kept.values())
        assert self.index.used == (sum(e.blocks for e in self.held) + kept) * BLOCK
        assert self.index.contains(KEYS) == [
            key in self.keymap and self.keymap[key].ready for key in KEYS
        ]
        stats = self.index.stats()
        assert stats.zombies == sum(1 for e in self.held if not e.live)
        assert stats.fenced_free == len(self.kept)
        assert stats.expired_held == sum(len(x[2]) for x in self.expired.values())
        # Tenants are charged for the slots of objects, and for freed slots an expired lease
        # still holds (not for those only a fence keeps).
        held = {o for x in self.expired.values() for o in x[2]}
        charged = sum(e.blocks for e in self.held) + sum(
            blocks for offset, blocks in self.kept.items() if offset in held
        )
        assert sum(f.used for f in self.index.tenant_figures()) == charged * BLOCK
        assert stats.evictable == sum(1 for e in self.lru if e.pins == 0)
        assert stats.pinned == sum(1 for e in self.keymap.values() if e.pins)
        assert stats.read_locked == stats.ready - stats.evictable
        assert stats.objects == len(self.keymap)


TestIndexModel = IndexModel.TestCase
