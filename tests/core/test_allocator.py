"""Tests of the pool's offset allocator: unit cases, then hypothesis state machines that check
every invariant (check(), disjoint aligned in-bounds blocks, exact accounting, first fit)
after each step and full coalescing once everything is freed."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tierkv.allocator import DEFAULT_ALIGNMENT, Allocator, AllocatorError

KIB = 1024
MIB = 1024 * KIB


def allocate_all(a: Allocator, sizes: list[int]) -> list[int] | None:
    """Offsets for every size, or None with nothing allocated (freed again) if any does not
    fit: the exact previous state comes back, as the free list is fully coalesced."""
    out: list[int] = []
    for size in sizes:
        offset = a.allocate(size)
        if offset is None:
            for offset in out:
                a.free(offset)
            return None
        out.append(offset)
    return out


def snapshot(a: Allocator) -> tuple[Any, ...]:
    """Everything that makes up the allocator's state, public figures and free list."""
    return (
        a.used,
        a.free_bytes,
        a.largest_free,
        a.free_blocks,
        a.allocations,
        list(a._starts),
        dict(a._size_at),
        dict(a._start_ending_at),
        dict(a._allocated),
    )


# -- construction and alignment ------------------------------------------------------------


def test_default_alignment_is_a_page() -> None:
    assert Allocator(MIB).alignment == DEFAULT_ALIGNMENT == 4096


@pytest.mark.parametrize(
    ("size", "alignment", "expected"),
    [
        (1, 4096, 4096),
        (4095, 4096, 4096),
        (4096, 4096, 4096),
        (4097, 4096, 8192),
        (1, 1, 1),
        (3, 2, 4),
        (65, 64, 128),
        (MIB + 1, MIB, 2 * MIB),
    ],
)
def test_aligned_rounds_up(size: int, alignment: int, expected: int) -> None:
    assert Allocator(4 * MIB, alignment).aligned(size) == expected


@pytest.mark.parametrize("alignment", [0, -1, -4096, 3, 6, 100, 4095, 4097, 3 * 4096])
def test_alignment_must_be_a_power_of_two(alignment: int) -> None:
    with pytest.raises(ValueError, match="power of two"):
        Allocator(MIB, alignment)


def test_capacity_smaller_than_alignment_is_rejected() -> None:
    with pytest.raises(ValueError, match="smaller than the alignment"):
        Allocator(4095, 4096)


def test_capacity_is_rounded_down_to_the_alignment() -> None:
    a = Allocator(10 * 4096 + 123, 4096)
    assert a.capacity == 10 * 4096
    assert a.largest_free == a.free_bytes == 10 * 4096
    a.check()


def test_every_block_is_aligned_and_sized_by_the_alignment() -> None:
    a = Allocator(MIB, 4096)
    first = a.allocate(1)
    second = a.allocate(4097)
    third = a.allocate(4096)
    assert (first, second, third) == (0, 4096, 3 * 4096)
    assert a.size_of(0) == 4096
    assert a.size_of(4096) == 8192
    assert a.size_of(3 * 4096) == 4096
    assert a.size_of(5) is None
    assert a.used == 4 * 4096
    a.check()


@pytest.mark.parametrize("size", [0, -1, -4096])
def test_non_positive_size_is_an_error(size: int) -> None:
    a = Allocator(MIB)
    with pytest.raises(AllocatorError, match="positive"):
        a.allocate(size)
    assert a.used == 0
    a.check()


# -- free ----------------------------------------------------------------------------------


def test_double_free_is_an_error_and_changes_nothing() -> None:
    a = Allocator(MIB)
    x = a.allocate(100)
    y = a.allocate(100)
    assert x is not None and y is not None
    a.free(x)
    before = snapshot(a)
    with pytest.raises(AllocatorError, match="not allocated"):
        a.free(x)
    assert snapshot(a) == before
    a.check()
    a.free(y)
    assert a.free_blocks == 1 and a.largest_free == a.capacity


def test_free_of_an_offset_never_allocated_is_an_error() -> None:
    a = Allocator(MIB)
    x = a.allocate(8192)
    assert x == 0
    for bad in (4096, 1, -4096, a.capacity, 10 * MIB):
        with pytest.raises(AllocatorError):
            a.free(bad)
    assert a.size_of(0) == 8192
    a.check()


def test_free_with_the_wrong_size_is_an_error_and_keeps_the_block() -> None:
    a = Allocator(MIB, 4096)
    x = a.allocate(5000)  # 8192 once aligned
    assert x is not None
    before = snapshot(a)
    for wrong in (4096, 12288, 1):
        with pytest.raises(AllocatorError, match="allocated with 8192"):
            a.free(x, wrong)
        assert snapshot(a) == before
    a.check()
    a.free(x, 8000)  # same aligned size as what was asked for: fine
    assert a.used == 0
    a.check()


def test_free_with_the_requested_size_is_accepted() -> None:
    a = Allocator(MIB)
    x = a.allocate(123)
    assert x is not None
    a.free(x, 123)
    assert a.allocations == 0 and a.used == 0


# -- first fit and coalescing --------------------------------------------------------------


def test_first_fit_reuses_the_lowest_hole_that_fits() -> None:
    a = Allocator(64 * 4096, 4096)
    blocks = [a.allocate(4096 * n) for n in (1, 2, 1, 3, 1)]
    assert blocks == [0, 4096, 3 * 4096, 4 * 4096, 7 * 4096]
    a.free(4096)  # 2-page hole at 1
    a.free(4 * 4096)  # 3-page hole at 4
    assert a.allocate(3 * 4096) == 4 * 4096  # the first hole is too small
    assert a.allocate(4096) == 4096  # lowest hole that fits
    assert a.allocate(4096) == 2 * 4096
    assert a.allocate(4096) == 8 * 4096  # holes are full: the tail
    a.check()


def test_freeing_coalesces_with_both_neighbours() -> None:
    a = Allocator(16 * 4096, 4096)
    assert allocate_all(a, [4096] * 4) == [0, 4096, 8192, 12288]
    x, y, z, w = 0, 4096, 8192, 12288
    a.free(x)
    a.free(z)
    assert a.free_blocks == 3  # [x], [z], tail after w
    a.check()
    a.free(y)  # merges x, y, z into one block
    assert a.free_blocks == 2
    assert a.largest_free == 12 * 4096
    a.check()
    a.free(w)  # and with the tail
    assert a.free_blocks == 1
    assert a.largest_free == a.capacity == 16 * 4096
    a.check()


def test_full_pool_returns_none_and_fragmentation_shows_in_largest_free() -> None:
    a = Allocator(8 * 4096, 4096)
    offsets = [a.allocate(4096) for _ in range(8)]
    assert None not in offsets
    assert a.allocate(1) is None
    assert (a.free_bytes, a.largest_free, a.free_blocks) == (0, 0, 0)
    for off in offsets[::2]:
        assert off is not None
        a.free(off)
    assert a.free_bytes == 4 * 4096
    assert a.largest_free == 4096
    assert a.free_blocks == 4
    assert a.allocate(8192) is None  # enough bytes free, but no contiguous block
    a.check()


# -- batches -------------------------------------------------------------------------------


def test_freeing_what_was_just_allocated_restores_the_exact_free_list() -> None:
    a = Allocator(16 * 4096, 4096)
    keep = [a.allocate(4096) for _ in range(4)]
    assert keep[1] is not None
    a.free(keep[1])  # a hole, so a rollback must restore a fragmented free list exactly
    before = snapshot(a)
    assert allocate_all(a, [4096, 4096, 8 * 4096, 4 * 4096]) is None
    assert snapshot(a) == before
    a.check()
    # The same batch minus the item that did not fit goes through.
    assert allocate_all(a, [4096, 4096, 8 * 4096]) == [4096, 4 * 4096, 5 * 4096]
    a.check()


# -- figures, reset, check -----------------------------------------------------------------


def test_figures() -> None:
    a = Allocator(32 * 4096, 4096)
    assert (a.used, a.free_bytes, a.largest_free, a.free_blocks, a.allocations) == (
        0,
        32 * 4096,
        32 * 4096,
        1,
        0,
    )
    x = a.allocate(3 * 4096)
    a.allocate(1)
    assert x is not None
    assert (a.used, a.free_bytes, a.largest_free, a.free_blocks, a.allocations) == (
        4 * 4096,
        28 * 4096,
        28 * 4096,
        1,
        2,
    )
    a.free(x)
    assert (a.used, a.free_bytes, a.largest_free, a.free_blocks, a.allocations) == (
        4096,
        31 * 4096,
        28 * 4096,
        2,
        1,
    )


def test_free_is_the_method_and_free_bytes_the_figure() -> None:
    # Regression: a `free` property used to be shadowed by the `free()` method.
    a = Allocator(MIB)
    assert callable(a.free)
    assert isinstance(a.free_bytes, int)


def test_frees_and_reset() -> None:
    a = Allocator(MIB)
    offsets = allocate_all(a, [4096] * 10)
    assert offsets is not None
    for offset in offsets[:5]:
        a.free(offset)
    assert a.allocations == 5
    a.check()
    a.reset()
    assert (a.used, a.allocations, a.free_blocks, a.largest_free) == (0, 0, 1, a.capacity)
    a.check()


def test_check_detects_corruption() -> None:
    a = Allocator(MIB)
    a.allocate(4096)
    a._used += 4096
    with pytest.raises(AssertionError, match="used bytes"):
        a.check()

    b = Allocator(MIB)
    x = b.allocate(4096)
    y = b.allocate(4096)
    assert x is not None and y is not None
    b._allocated[x] = 8192  # overlaps y
    with pytest.raises(AssertionError, match="gap or overlap"):
        b.check()


# -- property-based ------------------------------------------------------------------------

ALIGNMENTS = st.sampled_from([1, 8, 64, 512, 4096])


@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 1 << 40), alignment=st.sampled_from([1 << k for k in range(0, 31)]))
def test_aligned_property(size: int, alignment: int) -> None:
    a = Allocator(alignment, alignment)
    n = a.aligned(size)
    assert n % alignment == 0
    assert size <= n < size + alignment


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate / batch / free sequences checked against a plain model of live blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc: Allocator = Allocator(4096)
        self.live: dict[int, int] = {}  # offset -> aligned size
        self.dead: set[int] = set()  # offsets freed and not reallocated since

    @initialize(alignment=ALIGNMENTS, blocks=st.integers(1, 64), slack=st.integers(0, 4095))
    def make(self, alignment: int, blocks: int, slack: int) -> None:
        self.alloc = Allocator(blocks * alignment + slack % alignment, alignment)
        assert self.alloc.capacity == blocks * alignment

    # model helpers
    def gaps(self) -> list[tuple[int, int]]:
        """Free (start, size) ranges implied by the model, in address order."""
        out = []
        pos = 0
        for off in sorted(self.live):
            if off > pos:
                out.append((pos, off - pos))
            pos = off + self.live[off]
        if pos < self.alloc.capacity:
            out.append((pos, self.alloc.capacity - pos))
        return out

    def first_fit(self, need: int) -> int | None:
        return next((start for start, size in self.gaps() if size >= need), None)

    def sizes(self) -> st.SearchStrategy[int]:
        return st.integers(1, 8 * self.alloc.alignment)

    def record(self, offset: int, need: int) -> None:
        self.live[offset] = need
        self.dead.discard(offset)

    # rules
    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        size = data.draw(self.sizes())
        need = self.alloc.aligned(size)
        expected = self.first_fit(need)
        got = self.alloc.allocate(size)
        assert got == expected
        if got is not None:
            self.record(got, need)

    @rule(data=st.data())
    def allocate_batch(self, data: st.DataObject) -> None:
        sizes = data.draw(st.lists(self.sizes(), max_size=6))
        before = snapshot(self.alloc)
        got = allocate_all(self.alloc, sizes)
        if got is None:
            assert snapshot(self.alloc) == before
            return
        assert len(got) == len(sizes)
        for off, size in zip(got, sizes, strict=True):
            need = self.alloc.aligned(size)
            assert off == self.first_fit(need)
            self.record(off, need)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), with_size=st.booleans())
    def free(self, data: st.DataObject, with_size: bool) -> None:
        off = data.draw(st.sampled_from(sorted(self.live)))
        need = self.live.pop(off)
        self.alloc.free(off, need if with_size else None)
        self.dead.add(off)

    @precondition(lambda self: self.dead)
    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        off = data.draw(st.sampled_from(sorted(self.dead)))
        before = snapshot(self.alloc)
        with pytest.raises(AllocatorError):
            self.alloc.free(off)
        assert snapshot(self.alloc) == before

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free_wrong_size(self, data: st.DataObject) -> None:
        off = data.draw(st.sampled_from(sorted(self.live)))
        wrong = self.live[off] + self.alloc.alignment
        before = snapshot(self.alloc)
        with pytest.raises(AllocatorError):
            self.alloc.free(off, wrong)
        assert snapshot(self.alloc) == before

    # invariants, checked after every step
    @invariant()
    def consistent(self) -> None:
        a = self.alloc
        a.check()
        pos = 0
        for off in sorted(self.live):
            size = self.live[off]
            assert off >= pos, "blocks overlap"
            assert off % a.alignment == 0 and size % a.alignment == 0
            assert off >= 0 and off + size <= a.capacity
            assert a.size_of(off) == size
            pos = off + size
        assert a.used == sum(self.live.values())
        assert a.free_bytes == a.capacity - a.used
        assert a.allocations == len(self.live)
        gaps = self.gaps()
        assert a.free_blocks == len(gaps)
        assert a.largest_free == max((size for _, size in gaps), default=0)

    def teardown(self) -> None:
        a = self.alloc
        for off in list(self.live):
            a.free(off)
            a.check()
        assert a.used == 0
        assert a.free_blocks == 1
        assert a.largest_free == a.free_bytes == a.capacity
        assert a.allocate(a.capacity) == 0  # really one block


AllocatorMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAllocatorMachine = AllocatorMachine.TestCase


@settings(max_examples=150, deadline=None)
@given(
    alignment=ALIGNMENTS,
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("alloc"), st.integers(1, 20_000)),
            st.tuples(st.just("free"), st.integers(0, 10_000)),
        ),
        max_size=120,
    ),
)
def test_random_sequences_coalesce_back_to_one_block(
    alignment: int, ops: list[tuple[str, int]]
) -> None:
    """Plain @given twin of the state machine: larger sizes, longer runs, fewer examples."""
    a = Allocator(256 * KIB, alignment)
    live: dict[int, int] = {}
    for kind, n in ops:
        if kind == "alloc":
            off = a.allocate(n)
            if off is not None:
                assert off not in live
                live[off] = a.aligned(n)
        elif live:
            off = sorted(live)[n % len(live)]
            a.free(off, live.pop(off))
        a.check()
        assert a.used == sum(live.values())
        ends = sorted((off, off + size) for off, size in live.items())
        for (_, end), (start, _) in itertools.pairwise(ends):
            assert end <= start
        assert all(off % alignment == 0 and end <= a.capacity for off, end in ends)
    for offset in list(live):
        a.free(offset)
    a.check()
    assert a.free_blocks == 1 and a.largest_free == a.capacity and a.used == 0
