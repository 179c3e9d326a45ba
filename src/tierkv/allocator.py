"""Offset allocator for the shared-memory pool: an explicit, address-sorted free list.

Allocation is first fit over free blocks sorted by offset; every size is rounded up to the
alignment (a power of two, 4 KiB by default) so every slot starts page-aligned. Freeing a
block coalesces it with both neighbours, so a pool whose objects are all freed is one free
block again. Batch allocation is all-or-nothing.

Figures: ``used``, ``free_bytes`` and ``largest_free`` (bytes), ``free_blocks`` and
``allocations`` (counts). ``free(offset)`` is the method that gives a block back.

The allocator is not thread-safe by itself: the object index owns it and calls it under the
index lock.
"""

from __future__ import annotations

import bisect

DEFAULT_ALIGNMENT = 4096


class AllocatorError(Exception):
    """Misuse of the allocator: double free, unknown offset, bad size."""


class Allocator:
    """First-fit allocator of aligned byte ranges in ``[0, capacity)``."""

    def __init__(self, capacity: int, alignment: int = DEFAULT_ALIGNMENT) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if capacity < alignment:
            raise ValueError(f"capacity {capacity} is smaller than the alignment {alignment}")
        self.alignment = alignment
        self.capacity = capacity - capacity % alignment
        # Free blocks: sorted start offsets, and start -> size / end -> start maps.
        self._starts: list[int] = []
        self._size_at: dict[int, int] = {}
        self._start_ending_at: dict[int, int] = {}
        self._allocated: dict[int, int] = {}
        self._used = 0
        self.reset()

    # -- figures ---------------------------------------------------------------------------
    @property
    def used(self) -> int:
        """Bytes in allocated blocks (aligned sizes)."""
        return self._used

    @property
    def free_bytes(self) -> int:
        """Bytes not in any allocated block (``capacity - used``), fragmented or not."""
        return self.capacity - self._used

    @property
    def largest_free(self) -> int:
        """Size of the largest free block: the biggest allocation that can succeed now."""
        return max(self._size_at.values(), default=0)

    @property
    def free_blocks(self) -> int:
        return len(self._starts)

    @property
    def allocations(self) -> int:
        return len(self._allocated)

    def aligned(self, size: int) -> int:
        """``size`` rounded up to the alignment."""
        a = self.alignment
        return (size + a - 1) & ~(a - 1)

    # -- allocation ------------------------------------------------------------------------
    def allocate(self, size: int) -> int | None:
        """Offset of a new block of at least ``size`` bytes, or None when nothing fits."""
        if size <= 0:
            raise AllocatorError(f"allocation size must be positive, got {size}")
        need = self.aligned(size)
        size_at = self._size_at
        for start in self._starts:
            have = size_at[start]
            if have >= need:
                self._take(start, have, need)
                return start
        return None

    def free(self, offset: int, size: int | None = None) -> None:
        """Give a block back; ``size``, when given, must match what was allocated."""
        length = self._allocated.pop(offset, None)
        if length is None:
            raise AllocatorError(f"free of offset {offset} that is not allocated")
        if size is not None and self.aligned(size) != length:
            self._allocated[offset] = length
            raise AllocatorError(
                f"free of offset {offset} with size {size}, allocated with {length}"
            )
        self._used -= length
        self._insert_free(offset, length)

    def size_of(self, offset: int) -> int | None:
        """Aligned size of the allocated block at ``offset``, or None."""
        return self._allocated.get(offset)

    def reset(self) -> None:
        """Forget every allocation: the whole pool is one free block again."""
        self._starts = [0]
        self._size_at = {0: self.capacity}
        self._start_ending_at = {self.capacity: 0}
        self._allocated = {}
        self._used = 0

    # -- internals -------------------------------------------------------------------------
    def _take(self, start: int, have: int, need: int) -> None:
        del self._start_ending_at[start + have]
        del self._size_at[start]
        i = bisect.bisect_left(self._starts, start)
        if have == need:
            del self._starts[i]
        else:
            # The block keeps its place in the sorted list under its new start.
            new_start = start + need
            self._starts[i] = new_start
            self._size_at[new_start] = have - need
            self._start_ending_at[start + have] = new_start
        self._allocated[start] = need
        self._used += need

    def _insert_free(self, offset: int, length: int) -> None:
        end = offset + length
        prev_start = self._start_ending_at.pop(offset, None)
        next_size = self._size_at.pop(end, None)
        if next_size is not None:
            del self._start_ending_at[end + next_size]
            i = bisect.bisect_left(self._starts, end)
            del self._starts[i]
            end += next_size
        if prev_start is not None:
            self._size_at[prev_start] = end - prev_start
            self._start_ending_at[end] = prev_start
        else:
            self._size_at[offset] = end - offset
            self._start_ending_at[end] = offset
            bisect.insort(self._starts, offset)

    def check(self) -> None:
        """Verify every invariant (for tests): sorted, disjoint, coalesced, accounted.

        Raises AssertionError on the first violation (explicitly, so it works under -O too).
        """

        def require(ok: bool, what: str) -> None:
            if not ok:
                raise AssertionError(what)

        require(self._starts == sorted(self._size_at), "free list not sorted or out of sync")
        require(len(self._start_ending_at) == len(self._starts), "end map out of sync")
        blocks = sorted(
            [(s, self._size_at[s], "free") for s in self._starts]
            + [(s, n, "used") for s, n in self._allocated.items()]
        )
        pos = 0
        prev_kind = ""
        for start, size, kind in blocks:
            require(start == pos, f"gap or overlap at {pos} (next block at {start})")
            require(size > 0 and size % self.alignment == 0, f"bad block size {size} at {start}")
            require(not (kind == "free" and prev_kind == "free"), f"uncoalesced at {start}")
            if kind == "free":
                require(
                    self._start_ending_at.get(start + size) == start,
                    f"end map wrong for free block at {start}",
                )
            pos = start + size
            prev_kind = kind
        require(pos == self.capacity, f"blocks end at {pos}, capacity {self.capacity}")
        require(self._used == sum(self._allocated.values()), "used bytes drifted")
