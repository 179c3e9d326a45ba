"""Which instances may hold a key: one sorted array across all instances, plus a few runs.

The controller's lookup filter (:class:`HolderFilter`). Every entry is one ``uint64``: the
top 48 bits of a key's fingerprint (as :mod:`tierkv.controller.keytable` stores it, shifted
left by the tier bits) and, in the low 16 bits, the *slot* of the instance's current
incarnation. The entries live in one big sorted array (``base``) and a few small sorted runs
(admits, and the entries of recent full reports once extracted); a lookup is one
``np.searchsorted`` per array for the whole batch, so it costs the same whether 1 or 1000
instances are registered, and names only the slots that may hold each key.

A binary search of ``base`` (100 instances of a million keys: 800 MB) misses the caches at
nearly every step, 1.7 us a key. So ``base`` comes with a directory (:class:`Directory`,
built by the merge, outside the lock): where each bucket of entries with the same top bits
starts, about 64 entries a bucket. A lookup reads the bucket's bounds and searches only
those few lines: with numpy all keys of the batch a step at a time, 0.4 us a key; in one C
pass (``tierkv._fingerprints``, each key's bucket prefetched a few keys ahead), 0.14 us a
key on the 2-core CI machine type.

It is a filter, never the truth: the instances' own key tables
(:class:`~tierkv.controller.keytable.KeyTable`) answer for the candidates it names, so a
stale entry (an evicted key, an instance deregistered, a 48-bit collision) costs one probe
of one table and is never returned. What it must never do is miss a holder: every key an
instance's table holds is in ``base``, in a run, or the instance's slot is *pending* (a full
report not yet extracted; the index probes pending instances' tables for every lookup).

Deregistering an instance or replacing its keys retires its slot (an O(1) change, its
entries ignored from then on: the slot maps to no instance); a merge (:meth:`merge_parts`)
drops retired slots' entries, after which the slot can be given out again. Thread-safety is
the caller's: :class:`~tierkv.controller.index.ControllerIndex` calls everything but the
merge's sort under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from tierkv.controller.keytable import TIER_BITS, U64, dedupe, sort_values

_match_slots: Callable[[Any, Any, int, Any, Any, Any, int], int] | None
_merge: Callable[[Any, Any, Any], int] | None
try:
    from tierkv._fingerprints import match_slots as _match_slots
    from tierkv._fingerprints import merge as _merge
except ImportError:  # built without a C compiler: numpy does the same
    _match_slots = _merge = None

SLOT_BITS = 16
SLOTS = 1 << SLOT_BITS
_LOW = np.uint64(SLOTS - 1)
_HIGH = ~_LOW
_S = np.uint64(TIER_BITS)
MAX_RUNS = 8  # runs compacted into one beyond this many
DIRECTORY_MIN = 1 << 20  # shorter arrays are searched whole (they fit the caches)
BUCKET_ENTRIES = 64  # entries a directory's bucket holds on average
_NO_DIRECTORY = np.zeros(0, dtype=np.int64)


class NoFreeSlot(RuntimeError):
    """Every slot is live or retired awaiting a merge: a new incarnation must wait (raised
    before anything changes)."""


class Directory:
    """Where each bucket of a sorted array starts: the entries whose top ``bits`` bits are
    ``b`` lie in ``[starts[b], starts[b + 1])``."""

    def __init__(self, arr: U64) -> None:
        self.of = arr  # the array it describes (and no other)
        self.bits = max(1, (arr.size // BUCKET_ENTRIES).bit_length())
        buckets = 1 << self.bits
        self.shift = np.uint64(64 - self.bits)
        self.starts = np.empty(buckets + 1, dtype=np.int64)
        firsts = np.arange(buckets, dtype=np.uint64) << self.shift
        self.starts[:-1] = np.searchsorted(arr, firsts, side="left")
        self.starts[-1] = arr.size

    def search(self, arr: U64, want: U64) -> npt.NDArray[np.int64]:
        """``np.searchsorted(arr, want, side="left")``: per key a binary search within its
        bucket, every key of the batch a step at a time."""
        bucket = (want >> self.shift).astype(np.intp)
        lo: npt.NDArray[np.int64] = self.starts[bucket]
        hi: npt.NDArray[np.int64] = self.starts[bucket + 1]
        active = lo < hi
        while active.any():
            mid = (lo + hi) >> 1
            right = active & (arr[np.where(active, mid, 0)] < want)
            lo = np.where(right, mid + 1, lo)
            hi = np.where(active & ~right, mid, hi)
            active = lo < hi
        return lo


def directory_for(arr: U64) -> Directory | None:
    """A :class:`Directory` for a large sorted array; None: search it whole."""
    return Directory(arr) if arr.size >= DIRECTORY_MIN else None


def pack_sorted(sorted_fps: U64, slot: int) -> U64:
    """Entries of ``sorted_fps`` (sorted fingerprints) for ``slot``, without repeats."""
    out: U64 = ((sorted_fps << _S) & _HIGH) | np.uint64(slot)
    return dedupe(out)


def from_table(slots: U64, slot: int) -> U64:
    """A key table's live entries (its ``slots`` array, ``fingerprint << 2 | tier``; 0 and 1
    are empty and deleted) as this filter's entries of ``slot``, sorted."""
    held = slots[slots > 1]
    out: U64 = (held & _HIGH) | np.uint64(slot)
    return dedupe(sort_values(out))


def merge_parts(parts: list[U64], live: npt.NDArray[np.bool_]) -> U64:
    """One sorted array of ``parts`` (each sorted) without entries of slots not ``live``
    (a boolean per slot) and without repeats. In one C pass where ``tierkv._fingerprints``
    was built, into one array (a view of it when most entries were kept: the rest of its
    tail goes at the next merge): for a 100 M-entry filter the numpy version's temporaries
    were six arrays of its size, and the kernel's page faults for them most of its 3 to
    4 s."""
    parts = [p for p in parts if p.size]
    if _merge is None or not parts:
        return merge_parts_numpy(parts, live)
    out = np.empty(sum(p.size for p in parts), dtype=np.uint64)
    written = _merge(parts, np.ascontiguousarray(live, dtype=np.bool_), out)
    merged: U64 = out[:written]
    return merged if 4 * written >= 3 * out.size else merged.copy()


def merge_parts_numpy(parts: list[U64], live: npt.NDArray[np.bool_]) -> U64:
    """:func:`merge_parts` with numpy. Sorting concatenated sorted runs is a merge
    (timsort)."""
    kept = [p[live[(p & _LOW).astype(np.int64)]] for p in parts if p.size]
    if not kept:
        return np.zeros(0, dtype=np.uint64)
    merged: U64 = np.sort(np.concatenate(kept), kind="stable") if len(kept) > 1 else kept[0]
    return dedupe(merged)


class HolderFilter:
    """The sorted array, its runs, and the slots: who may hold which key."""

    def __init__(self) -> None:
        self.base: U64 = np.zeros(0, dtype=np.uint64)
        self.directory: Directory | None = None  # base's (set with it: set_base)
        self.runs: list[U64] = []  # newer than the base, each sorted
        self.merging: list[U64] = []  # runs a merge under way is folding into the base
        self.owner: list[str | None] = [None] * SLOTS  # slot -> instance, None: not live
        self.retired: set[int] = set()  # not live, entries maybe still in the arrays
        self._free = list(range(SLOTS - 1, -1, -1))

    @property
    def run_entries(self) -> int:
        return sum(r.size for r in self.runs)

    @property
    def nbytes(self) -> int:
        """The memory the arrays hold (a merged base may be a view of a longer array)."""
        arrays = [self.base, *self.runs, *self.merging]
        return sum(
            int(a.base.nbytes if isinstance(a.base, np.ndarray) else a.nbytes) for a in arrays
        )

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def take_slot(self, instance: str) -> int:
        if not self._free:
            raise NoFreeSlot(
                f"no free instance slot: {SLOTS} instances registered or retired since a merge"
            )
        slot = self._free.pop()
        self.owner[slot] = instance
        return slot

    def retire(self, slot: int) -> None:
        # A negative slot would index from the end: another live instance's slot, its keys
        # hidden from every lookup.
        if not 0 <= slot < SLOTS:
            raise ValueError(f"no such slot: {slot}")
        self.owner[slot] = None
        self.retired.add(slot)

    def free(self, slots: set[int]) -> None:
        """``slots`` (retired) have no entries left in any array: give them out again."""
        self.retired -= slots
        self._free.extend(sorted(slots, reverse=True))

    def set_base(self, base: U64, directory: Directory | None) -> None:
        """A new sorted array, with its :func:`directory_for` (built outside the lock)."""
        self.base, self.directory = base, directory

    def add_run(self, run: U64) -> None:
        if not run.size:
            return
        self.runs.append(run)
        if len(self.runs) > MAX_RUNS:  # small runs: compacting them is cheap
            self.runs = [dedupe(sort_values(np.concatenate(self.runs)))]

    def live_mask(self) -> npt.NDArray[np.bool_]:
        return np.fromiter((o is not None for o in self.owner), dtype=bool, count=SLOTS)

    def candidates(self, fps: U64) -> npt.NDArray[np.int64]:
        """The live slots whose entries match any of ``fps`` (sorted, unique). Per array and
        key: a binary search for the first entry of the key's range (within its bucket
        where the array has a directory), then a step along the array as long as entries
        match (a key has an entry per holder: a few steps). In one C call per array where
        ``tierkv._fingerprints`` was built (:meth:`candidates_numpy` does the same)."""
        if _match_slots is None:
            return self.candidates_numpy(fps)
        want = (fps << _S) & _HIGH
        seen = np.zeros(SLOTS, dtype=np.uint8)
        found = np.empty(SLOTS, dtype=np.int64)
        count = 0
        for arr, directory in self._searched():
            if directory is not None:
                starts, shift = directory.starts, int(directory.shift)
            else:
                starts, shift = _NO_DIRECTORY, 0
            count = _match_slots(arr, starts, shift, want, seen, found, count)
        return self._live(np.sort(found[:count]))

    def candidates_numpy(self, fps: U64) -> npt.NDArray[np.int64]:
        """:meth:`candidates` with numpy: a dozen calls per step of the searches, about
        twice the time of the C helper's one pass for a 512-key batch."""
        lo = (fps << _S) & _HIGH
        found: list[U64] = []
        for arr, directory in self._searched():
            if directory is not None:
                at = directory.search(arr, lo)
            else:
                at = np.searchsorted(arr, lo, side="left")
            want = lo
            while at.size:
                inside = at < arr.size
                at, want = at[inside], want[inside]
                entries = arr[at]
                match = (entries & _HIGH) == want
                if not match.any():
                    break
                found.append(entries[match])
                at, want = at[match] + 1, want[match]
        if not found:
            return np.zeros(0, dtype=np.int64)
        return self._live(np.unique((np.concatenate(found) & _LOW).astype(np.int64)))

    def _searched(self) -> Iterator[tuple[U64, Directory | None]]:
        """The arrays a lookup searches (the non-empty ones), each with its directory."""
        directory = self.directory
        for arr in [self.base, *self.merging, *self.runs]:
            if arr.size:
                yield arr, directory if directory is not None and directory.of is arr else None

    def _live(self, slots: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Those of ``slots`` (sorted) that belong to an instance now."""
        live = np.fromiter((self.owner[s] is not None for s in slots.tolist()), bool, slots.size)
        out: npt.NDArray[np.int64] = slots[live]
        return out
