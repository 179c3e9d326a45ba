"""Summaries of directory entries that a holder and an owner compare (anti-entropy).

An owner's entries for one holder are summarised per bucket of keys (``BUCKETS`` buckets,
picked by the key's word, :func:`key_word`): the number of entries and the XOR of a 64-bit
hash of each ``(key, incarnation, where)``. A key's word is taken from all of it: its first
half is its namespace (the same for every chunk of a model), its second the chunk's hash
(the same in every namespace for one prompt in some schemes), and a word of the namespace
half alone, as it once was, gave every key of a namespace one bucket and one hash (an owner
listing other keys of the namespace for a holder, as many of them, was never repaired).

XOR and counts do not depend on order, so an owner keeps its summaries up to date entry by
entry (:class:`Summaries`, O(1) per change) and a holder computes the same summaries from
what it holds in one vectorised pass (:class:`Expected`).
Equal summaries: the owner lists exactly what the holder holds (up to a 64-bit hash
collision); a bucket that differs is listed and repaired alone.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

BUCKETS = 16
_MASK = (1 << 64) - 1
# Odd multipliers of the key's other words in its word (none cancels another's bits).
_K0 = 0xC2B2AE3D27D4EB4F
_K2 = 0x165667B19E3779F9
_K3 = 0x27D4EB2F165667C5
_INC = 0x9E3779B97F4A7C15  # odd constants: incarnation and tier move every hash
_WHERE = 0xD6E8FEB86659FD93
_M1 = 0xBF58476D1CE4E5B9  # the splitmix64 finaliser's
_M2 = 0x94D049BB133111EB

_WORDS = struct.Struct("<4Q")
Summary = tuple[list[int], list[int]]  # (count per bucket, XOR of hashes per bucket)


def key_word(key: bytes) -> int:
    """A 32-byte key's 64-bit word, from each of its four little-endian words: what its
    bucket and its entries' hashes are taken from."""
    w0, w1, w2, w3 = _WORDS.unpack(key)
    return int(w1 + w2 * _K2 + w3 * _K3 + w0 * _K0) & _MASK


def bucket(key: bytes) -> int:
    """The bucket of a 32-byte key."""
    return key_word(key) & (BUCKETS - 1)


def entry_hash(key: bytes, incarnation: int, where: int) -> int:
    """The 64-bit hash of one entry (splitmix64 of the key's word, the holder's incarnation
    and the tier)."""
    z = (key_word(key) + incarnation * _INC + where * _WHERE) & _MASK
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def empty() -> Summary:
    return [0] * BUCKETS, [0] * BUCKETS


class Summaries:
    """An owner's summaries, one per holder, kept up to date entry by entry (hashes computed
    a batch at a time). Not thread-safe: its shard calls it under its lock."""

    def __init__(self) -> None:
        self._by_holder: dict[str, Summary] = {}

    def apply(self, changes: Sequence[tuple[str, bytes, int, int]], sign: int) -> None:
        """Count entries ``(holder, key, incarnation, where)`` in (``sign`` 1) or out (-1)."""
        if not changes:
            return
        words = keys_words([c[1] for c in changes])
        hashes = hashes_of(words, [c[3] for c in changes], [c[2] for c in changes])
        by_holder = self._by_holder
        buckets = (words & np.uint64(BUCKETS - 1)).tolist()
        for (holder, _, _, _), h, b in zip(changes, hashes.tolist(), buckets, strict=True):
            counts, xors = by_holder.get(holder) or by_holder.setdefault(holder, empty())
            counts[b] += sign
            xors[b] ^= h
        if sign < 0:
            for holder in {c[0] for c in changes}:
                summary = by_holder.get(holder)
                if summary is not None and not any(summary[0]):
                    del by_holder[holder]

    def get(self, holder: str) -> Summary:
        counts, hashes = self._by_holder.get(holder) or empty()
        return list(counts), list(hashes)

    def holders(self) -> list[str]:
        return list(self._by_holder)


def differing(a: Summary, b: Summary) -> list[int]:
    """The buckets whose counts or hashes differ."""
    return [i for i in range(BUCKETS) if a[0][i] != b[0][i] or a[1][i] != b[1][i]]


def _mix(z: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
    return np.asarray(z ^ (z >> np.uint64(31)), dtype=np.uint64)


def keys_words(keys: Sequence[bytes]) -> npt.NDArray[np.uint64]:
    """:func:`key_word` of many 32-byte keys at once."""
    if not keys:
        return np.zeros(0, dtype=np.uint64)
    raw = np.frombuffer(b"".join(keys), dtype="<u8")
    if raw.size != 4 * len(keys):
        raise ValueError("directory keys must be 32 bytes")
    w = raw.reshape(len(keys), 4).astype(np.uint64)
    with np.errstate(over="ignore"):
        return np.ascontiguousarray(
            w[:, 1] + w[:, 2] * np.uint64(_K2) + w[:, 3] * np.uint64(_K3) + w[:, 0] * np.uint64(_K0)
        )


def hashes_of(
    words: npt.NDArray[np.uint64], wheres: Sequence[int], incarnations: int | Sequence[int]
) -> npt.NDArray[np.uint64]:
    """:func:`entry_hash` of many entries at once: their keys' :func:`keys_words`, their
    tiers, and one incarnation for all or one each."""
    if isinstance(incarnations, int):
        base: npt.NDArray[np.uint64] | np.uint64 = np.uint64((incarnations * _INC) & _MASK)
    else:
        base = np.fromiter(
            ((i * _INC) & _MASK for i in incarnations), dtype=np.uint64, count=len(words)
        )
    tiers = np.fromiter(wheres, dtype=np.uint64, count=len(words))
    with np.errstate(over="ignore"):
        return _mix(words + base + tiers * np.uint64(_WHERE))


class Expected:
    """What a holder expects each owner to list for it: its entries (``keys``, 32 bytes,
    each once, and their tiers ``wheres``), hashed once with its ``incarnation``; ``arcs``
    and ``arc_owners``: where the ring puts each key (:meth:`tierkv.cluster.ring.Ring.arcs`)."""

    def __init__(
        self,
        keys: Sequence[bytes],
        wheres: Sequence[int],
        incarnation: int,
        arcs: npt.NDArray[np.intp],
        arc_owners: Sequence[tuple[str, ...]],
    ) -> None:
        self.incarnation = incarnation
        self.arc_owners = arc_owners
        words = keys_words(keys)
        hashes = hashes_of(words, wheres, incarnation)
        buckets = (words & np.uint64(BUCKETS - 1)).astype(np.uint8)
        order = np.argsort(buckets, kind="stable")  # by bucket: each one a slice
        self._keys, self._wheres = keys, wheres
        self._order = order
        self.buckets = buckets[order]
        self.hashes = hashes[order]
        self.arcs = arcs[order]
        ends = np.cumsum(np.bincount(self.buckets, minlength=BUCKETS))
        self.bounds = [(0 if i == 0 else int(ends[i - 1]), int(ends[i])) for i in range(BUCKETS)]

    def _share(self, owner: str) -> npt.NDArray[np.bool_]:
        """Which entries ``owner`` should list."""
        table = np.fromiter(
            (owner in names for names in self.arc_owners),
            dtype=np.bool_,
            count=len(self.arc_owners),
        )
        return table[self.arcs] if len(table) else np.zeros(len(self.arcs), dtype=np.bool_)

    def summary(self, owner: str) -> Summary:
        """The summary ``owner`` should have of this holder's entries."""
        sel = self._share(owner)
        counts = np.bincount(self.buckets[sel], minlength=BUCKETS)
        mine = np.where(sel, self.hashes, np.uint64(0))
        xors = [int(np.bitwise_xor.reduce(mine[a:b])) if b > a else 0 for a, b in self.bounds]
        return [int(c) for c in counts], xors

    def differences(
        self, owner: str, buckets: Iterable[int], listed: Iterable[tuple[bytes, int, int]]
    ) -> tuple[list[tuple[bytes, int]], list[bytes]]:
        """Given ``owner``'s entries of this holder in ``buckets`` (``(key, incarnation,
        where)``): the entries to publish to it again (missing or wrong) and the keys to
        withdraw from it (not held)."""
        sel = self._share(owner)
        mine: dict[bytes, int] = {}
        for b in set(buckets):
            if 0 <= b < BUCKETS:
                lo, hi = self.bounds[b]
                for i in self._order[np.flatnonzero(sel[lo:hi]) + lo].tolist():
                    mine[self._keys[i]] = int(self._wheres[i])
        theirs = {k: (i, w) for k, i, w in listed}
        inc = self.incarnation
        publish = [(k, w) for k, w in mine.items() if theirs.get(k) != (inc, w)]
        return publish, [k for k in theirs if k not in mine]
