"""One instance's keys in the controller: an open-addressing hash table in one numpy array.

No Python object per chunk: a key is reduced to a 62-bit fingerprint (:func:`fingerprints`,
vectorised over a whole batch) and stored as one ``uint64`` slot, ``fingerprint << 2 | tier``
(``0`` is an empty slot, ``1`` a deleted one), so a million chunks take 16 MiB at the
table's worst load (a half) and 8 MiB at its best. Every operation is a handful of numpy
calls over a whole batch: a key's home slot is the top bits of its fingerprint, so sorting
fingerprints sorts keys by home and a table is built from a sorted batch with no probing at
all (each key's slot is a running maximum, :meth:`KeyTable.build`); small adds probe
linearly in rounds, each round looking at a window of :data:`WINDOW` consecutive slots for
every key of the batch at once, and lookups the same way, or in one C call per batch where
``tierkv._fingerprints`` was built (5x faster for 512 keys). Probing never wraps: the array
ends with at least :data:`WINDOW` empty slots, so every probe ends there at the latest.

A fingerprint can collide with another key's (about one lookup in 2**62 / keys held): the
controller may then name a holder that does not have the chunk. That is safe by
construction: a reader fetches by the full 32-byte key and the holder answers "missing".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from tierkv.cluster.messages import NO_TIER
from tierkv.keys import KEY_SIZE

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]
I8 = npt.NDArray[np.int8]

EMPTY = 0
DELETED = 1
WINDOW = 8  # slots looked at per key and round (one 64-byte cache line)
MIN_CAPACITY = 1024
MAX_LOAD = 0.5  # live + deleted slots over capacity before a rehash
TIER_BITS = 2
TIERS = 1 << TIER_BITS

_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xBF58476D1CE4E5B9)
_M3 = np.uint64(0x94D049BB133111EB)
_S = np.uint64(TIER_BITS)
_ARANGE = np.arange(WINDOW, dtype=np.int64)
_TMASK = np.uint64(TIERS - 1)
FP_BITS = 62
_fill: Callable[[Any, Any], bool] | None
_probe: Callable[[Any, int, Any, Any], None] | None
_place: Callable[[Any, Any, int, Any], tuple[int, int]] | None
_radix_sort: Callable[[Any], None] | None
_namespaces: Callable[[Any, Any, int], list[bytes] | None] | None
try:
    from tierkv._fingerprints import fill as _fill
    from tierkv._fingerprints import namespaces as _namespaces
    from tierkv._fingerprints import place as _place
    from tierkv._fingerprints import probe as _probe
    from tierkv._fingerprints import sort as _radix_sort
except ImportError:  # built without a C compiler: numpy computes the same
    _fill = _probe = _place = _radix_sort = _namespaces = None
NATIVE_FINGERPRINTS = _fill is not None
# From this many values on the C helper's radix sort beats numpy's (1,024 values: 11 against
# 12 us; a million: 12 against 51 ms on an AVX-512 AMD EPYC VM, 13 against 117 ms of qsort).
RADIX_SORT_MIN = 1024
# Distinct namespaces the C helper groups a batch's keys by; past this many, numpy does.
NAMESPACE_CAP = 4096
FEW = 8  # keys past their window looked up one by one rather than in a vectorised round


def sort_values(values: U64) -> U64:
    """``values`` (a uint64 array of this process's own) sorted in place, and returned: by
    the C helper's radix sort where it was built and the array is large, else by numpy.
    Fingerprints are uniform 62-bit values, which a radix sort takes in a fixed number of
    passes, where numpy's sort follows the CPU (its AVX-512 quicksort is slow on AMD's)."""
    if (
        _radix_sort is not None
        and values.size >= RADIX_SORT_MIN
        and values.flags.c_contiguous
        and values.flags.writeable
    ):
        _radix_sort(values)
    else:
        values.sort()
    return values


def dedupe(sorted_values: U64) -> U64:
    """``sorted_values`` without repeats (a value equal to the one before is left out)."""
    if sorted_values.size < 2:
        return sorted_values
    keep = np.empty(sorted_values.size, dtype=bool)
    keep[0] = True
    np.not_equal(sorted_values[1:], sorted_values[:-1], out=keep[1:])
    out: U64 = sorted_values[keep]
    return out


def key_array(keys: bytes | list[bytes]) -> npt.NDArray[np.uint64]:
    """``keys`` (32-byte keys, or their concatenation) as an ``(n, 4)`` uint64 array."""
    blob = keys if isinstance(keys, bytes) else b"".join(keys)
    if len(blob) % KEY_SIZE:
        raise ValueError(f"keys must be {KEY_SIZE} bytes each")
    return np.frombuffer(blob, dtype="<u8").reshape(-1, KEY_SIZE // 8)


def fingerprints(keys: bytes | list[bytes]) -> U64:
    """A 62-bit non-zero fingerprint of each key (namespace digest and chunk hash both mix
    in, so equal chunk hashes of two namespaces never share one)."""
    return fingerprints_and_namespace(keys)[0]


def fingerprints_and_namespace(keys: bytes | list[bytes]) -> tuple[U64, bytes | None]:
    """:func:`fingerprints`, and the namespace digest every key shares (None: several, or
    no keys). In one pass in C where ``tierkv._fingerprints`` was built (a full report of a
    million keys: 6 ms, against 35 with numpy); :func:`fingerprints_numpy` and
    :func:`single_namespace` compute the same."""
    if _fill is None:
        return fingerprints_numpy(keys), single_namespace(key_array(keys))
    blob = keys if isinstance(keys, bytes) else b"".join(keys)
    out: U64 = np.empty(len(blob) // KEY_SIZE, dtype=np.uint64)
    one = _fill(blob, out)  # ValueError for a length that is not whole keys
    return out, blob[:16] if one else None


def single_namespace(keys: npt.NDArray[np.uint64]) -> bytes | None:
    """The namespace digest of ``keys`` (a :func:`key_array`) if they all share one."""
    ns = keys[:, :2]
    if ns.shape[0] and bool((ns[:, 0] == ns[0, 0]).all() and (ns[:, 1] == ns[0, 1]).all()):
        return bytes(ns[0].tobytes())
    return None


def namespace_groups(keys: npt.NDArray[np.uint64]) -> tuple[list[bytes], I64]:
    """The distinct namespace digests of ``keys`` (a :func:`key_array`) and, per key, the
    index of its own among them. An engine with several tensor-parallel ranks, or tenants
    with cache salts, reports keys of several namespaces at once; numpy's ``unique`` over
    the digests' rows took 0.75 to 1.3 s to group a million keys of 4 to 64 namespaces on a
    2-core VM. In one pass in C where ``tierkv._fingerprints`` was built (up to
    :data:`NAMESPACE_CAP` namespaces): a few milliseconds. Otherwise each digest's two
    words are folded into one, whose distinct values are found by one sort (the folds are
    checked against the digests, so that two digests that fold alike still count apart)."""
    ns = keys[:, :2]
    n = ns.shape[0]
    if not n:
        return [], np.zeros(0, dtype=np.int64)
    if _namespaces is not None and keys.flags.c_contiguous:
        index = np.empty(n, dtype=np.int64)
        digests = _namespaces(keys, index, NAMESPACE_CAP)
        if digests is not None:
            return digests, index
    folded: U64 = ns[:, 1] * _M1
    folded ^= ns[:, 0]
    distinct = dedupe(sort_values(folded.copy()))
    inverse: I64 = np.searchsorted(distinct, folded).astype(np.int64)
    member = np.empty(distinct.size, dtype=np.int64)
    member[inverse] = np.arange(n, dtype=np.int64)  # one key of each fold (whichever)
    rep = member[inverse]
    if not (np.array_equal(ns[:, 0], ns[rep, 0]) and np.array_equal(ns[:, 1], ns[rep, 1])):
        rows, back = np.unique(ns, axis=0, return_inverse=True)  # two digests folded alike
        return [bytes(r.tobytes()) for r in rows], back.reshape(-1).astype(np.int64)
    return [bytes(ns[i].tobytes()) for i in member.tolist()], inverse


def fingerprints_numpy(keys: bytes | list[bytes]) -> U64:
    """:func:`fingerprints` with numpy (without the C helper)."""
    k = key_array(keys)
    # In place, in two arrays: no temporary per operation (each a fresh 8 MB allocation to
    # fault in, for a million keys).
    h: U64 = np.multiply(k[:, 0], _M1)
    h ^= k[:, 2]
    t = np.multiply(k[:, 3], _M2)
    h ^= t
    np.multiply(k[:, 1], _M3, out=t)
    h ^= t
    np.right_shift(h, np.uint64(31), out=t)
    h ^= t
    h *= _M2
    np.right_shift(h, np.uint64(29), out=t)
    h ^= t
    h >>= _S
    h |= np.uint64(1)
    return h


class KeyTable:
    """Fingerprint -> tier for one holder; every method takes and returns whole batches."""

    def __init__(self, capacity: int = MIN_CAPACITY) -> None:
        bits = (max(MIN_CAPACITY, capacity) - 1).bit_length()
        self.capacity = 1 << bits
        self.shift = np.uint64(FP_BITS - bits)
        self.slots: U64 = np.zeros(self.capacity + 2 * WINDOW, dtype=np.uint64)
        self.live = 0
        self.deleted = 0
        self.by_tier = np.zeros(TIERS, dtype=np.int64)

    @classmethod
    def sized_for(cls, n: int) -> KeyTable:
        return cls(int(n / MAX_LOAD) + 1)

    def __len__(self) -> int:
        return self.live

    @property
    def nbytes(self) -> int:
        return int(self.slots.nbytes)

    def _home(self, fps: U64) -> I64:
        home: I64 = (fps >> self.shift).view(np.int64)  # a fresh array (below 2**62): no copy
        return home

    # -- lookups ---------------------------------------------------------------------------
    def find(self, fps: U64) -> I64:
        """The slot of each fingerprint, -1 where absent."""
        out = np.full(fps.size, -1, dtype=np.int64)
        todo = np.arange(fps.size, dtype=np.int64)
        start = self._home(fps)
        slots = self.slots
        while todo.size:
            base = start[todo]
            win = slots[base[:, None] + _ARANGE]
            match = (win >> _S) == fps[todo, None]
            hit = match.any(axis=1)
            out[todo[hit]] = base[hit] + match[hit].argmax(axis=1)
            # Absent once the window holds an empty slot; otherwise look further.
            go_on = ~hit & ~(win == EMPTY).any(axis=1)
            todo = todo[go_on]
            start[todo] += WINDOW
        return out

    def tiers(self, fps: U64) -> I8:
        """The tier of each fingerprint, :data:`NO_TIER` where absent. The lookup path: one
        C call per batch where ``tierkv._fingerprints`` was built (0.12 ms of numpy for 512
        keys in a table of a million on the CI machine type), else :meth:`tiers_numpy`."""
        if _probe is None:
            return self.tiers_numpy(fps)
        out: I8 = np.empty(fps.size, dtype=np.int8)
        _probe(self.slots, int(self.shift), np.ascontiguousarray(fps, dtype=np.uint64), out)
        return out

    def tiers_numpy(self, fps: U64) -> I8:
        """:meth:`tiers` with numpy: one window per key; a key neither in its window nor
        stopped by an empty slot in it is looked up further by :meth:`find`. A few numpy
        calls per batch, nothing per key."""
        win = np.take(self.slots, self._home(fps)[:, None] + _ARANGE)
        match = (win >> _S) == fps[:, None]
        rows = np.arange(fps.size)
        col = match.argmax(axis=1)
        hit = match[rows, col]
        tier = (win[rows, col] & _TMASK).astype(np.int8)
        out: I8 = np.where(hit, tier, np.int8(NO_TIER))
        more = np.flatnonzero(~hit & ~(win == EMPTY).any(axis=1))
        if more.size > FEW:
            pos = self.find(fps[more])
            out[more[pos >= 0]] = (self.slots[pos[pos >= 0]] & _TMASK).astype(np.int8)
        elif more.size:  # typically one key in a few hundred: cheaper one by one
            for i in more.tolist():
                out[i] = self._probe_one(int(fps[i]))
        return out

    def _probe_one(self, fp: int) -> int:
        slots = self.slots
        at = (fp >> int(self.shift)) + WINDOW
        while True:
            entry = int(slots[at])
            if entry == EMPTY:
                return NO_TIER
            if entry >> TIER_BITS == fp:
                return entry & (TIERS - 1)
            at += 1

    def entries(self) -> U64:
        """Every live slot (fingerprint << 2 | tier)."""
        s = self.slots
        out: U64 = s[s > DELETED]
        return out

    # -- changes ---------------------------------------------------------------------------
    @classmethod
    def build(cls, fps: U64, tiers: npt.NDArray[np.integer] | int) -> KeyTable:
        """A table holding exactly ``fps`` with their ``tiers`` (a full report): one sort,
        no probing. A fingerprint given twice is held once, with one of its tiers."""
        table = cls.sized_for(fps.size)
        t = np.asarray(tiers)
        # One tier for every key (a scalar, or broadcast from one): counted without a pass.
        uniform = int(t.flat[0]) if t.size and (t.ndim == 0 or t.strides == (0,)) else None
        table._fill(_entries(fps, tiers), uniform)
        return table

    def _fill(self, entries: U64, uniform_tier: int | None = None) -> None:
        """Place ``entries`` (a fresh array: sorted here in place, no copy) into this
        (empty) table: sorted by fingerprint they are sorted by home, and linear probing
        puts the i-th at max(home_i, slot_{i-1} + 1). ``uniform_tier``: every entry has
        that tier (the counts need no pass)."""
        sort_values(entries)
        if _place is not None:
            self._place(entries)
            return
        fps = entries >> _S
        if fps.size > 1:
            keep = np.empty(fps.size, dtype=bool)
            keep[0] = True
            np.not_equal(fps[1:], fps[:-1], out=keep[1:])
            if not keep.all():  # a fingerprint given twice: held once
                entries, fps = entries[keep], fps[keep]
        n = entries.size
        if n:
            rank = np.arange(n, dtype=np.int64)
            at = self._home(fps)  # a fresh array, worked on in place:
            at -= rank
            np.maximum.accumulate(at, out=at)
            at += rank
            end = int(at[-1]) + 2 * WINDOW
            if end > self.slots.size:  # the last homes overflowed: a longer tail
                self.slots = np.zeros(end, dtype=np.uint64)
            self.slots[at] = entries
        self.live, self.deleted = n, 0
        if uniform_tier is None:
            self.by_tier = np.bincount((entries & _TMASK).astype(np.int64), minlength=TIERS)
        else:
            self.by_tier = np.zeros(TIERS, dtype=np.int64)
            self.by_tier[uniform_tier] = n

    def _place(self, entries: U64) -> None:
        """:meth:`_fill`'s placement in one C pass (``tierkv._fingerprints.place``): for a
        million keys about 5 ms on the CI machine type (most of it the first writes into the
        fresh table), where the numpy passes it replaces (repeats, homes, a running maximum,
        the scatter, counts) took about 20."""
        assert _place is not None
        by_tier = np.zeros(TIERS, dtype=np.int64)
        live, last = _place(entries, self.slots, int(self.shift), by_tier)
        if last + 2 * WINDOW > self.slots.size:  # the last homes overflowed: a longer tail
            self.slots = np.zeros(last + 2 * WINDOW, dtype=np.uint64)
            by_tier[:] = 0
            live, last = _place(entries, self.slots, int(self.shift), by_tier)
        self.live, self.deleted = live, 0
        self.by_tier = by_tier

    def add(self, fps: U64, tiers: npt.NDArray[np.integer] | int) -> I8:
        """Insert, or change the tier of keys already held (a fingerprint given twice in one
        batch is stored once, with one of its tiers). A batch that is large for the table,
        or one that would fill it past :data:`MAX_LOAD`, rebuilds it (one sort). Returns
        each key's tier before (:data:`NO_TIER`: new)."""
        n = fps.size
        entries = _entries(fps, tiers)
        before = self.tiers(fps)
        if n * 8 > self.capacity or self.live + self.deleted + n > MAX_LOAD * self.capacity:
            self._rebuild(entries)
            return before
        slots = self.slots
        todo = np.arange(n, dtype=np.int64)
        start = self._home(fps)
        limit = slots.size - WINDOW
        while todo.size:
            base = start[todo]
            if int(base.max()) >= limit:  # would probe into the last window: grow instead
                self._rebuild(entries)
                return before
            win = slots[base[:, None] + _ARANGE]
            match = (win >> _S) == fps[todo, None]
            hit = match.any(axis=1)
            if hit.any():
                slots[base[hit] + match[hit].argmax(axis=1)] = entries[todo[hit]]
            empty = win == EMPTY
            free = ~hit & empty.any(axis=1)
            retry = np.zeros(todo.size, dtype=bool)
            if free.any():
                at = base[free] + empty[free].argmax(axis=1)
                idx = todo[free]
                slots[at] = entries[idx]  # several keys may race for one slot
                # Losers look at the same window again (the winner may be a duplicate).
                retry[free] = slots[at] != entries[idx]
            full = ~hit & ~free
            start[todo[full]] += WINDOW
            todo = todo[retry | full]
        uniq, first = np.unique(fps, return_index=True)
        was = before[first].astype(np.int64)
        now = self.tiers(uniq).astype(np.int64)
        self.live += int(np.count_nonzero(was < 0))
        self.by_tier -= np.bincount(was[was >= 0], minlength=TIERS)
        self.by_tier += np.bincount(now[now >= 0], minlength=TIERS)
        return before

    def _rebuild(self, extra: U64) -> None:
        """Rebuild from the live entries and ``extra`` (whose tiers win), sized for both."""
        live = self.slots > DELETED
        if extra.size:
            held = self.find(extra >> _S)
            live[held[held >= 0]] = False
        old = self.slots[live]
        fresh = KeyTable.sized_for(old.size + extra.size)
        fresh._fill(np.concatenate([old, extra]))
        self.__dict__.update(fresh.__dict__)

    def remove(self, fps: U64) -> I8:
        """Delete; returns each key's tier before (:data:`NO_TIER`: it was not there)."""
        pos = self.find(fps)
        found = pos >= 0
        before = np.full(fps.size, NO_TIER, dtype=np.int8)
        before[found] = (self.slots[pos[found]] & _TMASK).astype(np.int8)
        at = np.unique(pos[found])
        if at.size:
            gone = (self.slots[at] & _TMASK).astype(np.int64)
            self.by_tier -= np.bincount(gone, minlength=TIERS)
            self.slots[at] = DELETED
            self.live -= int(at.size)
            self.deleted += int(at.size)
        return before


def _entries(fps: U64, tiers: npt.NDArray[np.integer] | int) -> U64:
    t = np.asarray(tiers)
    if t.size and (t.ndim == 0 or t.strides == (0,)):  # one tier for all: no array of it
        t = t.flat[0]
    if t.size and int(t.max()) >= TIERS:
        raise ValueError(f"tiers must be below {TIERS}")
    out: U64 = fps << _S
    out |= t.astype(np.uint64)
    return out
