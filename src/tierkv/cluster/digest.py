"""Summaries of directory entries that a holder and an owner compare (anti-entropy).

An owner's entries for one holder are summarised per bucket of keys (``BUCKETS`` buckets,
picked by a byte of the key): the number of entries and the XOR of a 64-bit hash of each
``(key, incarnation, where)``. XOR and counts do not depend on order, so an owner keeps its
summaries up to date entry by entry (:class:`Summaries`, O(1) per change) and a holder
computes the same summaries from what it holds in one vectorised pass (:func:`summarise`).
Equal summaries: the owner lists exactly what the holder holds (up to a 64-bit hash
collision); a bucket that differs is listed and repaired alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

BUCKETS = 16
_MASK = (1 << 64) - 1
_INC = 0x9E3779B97F4A7C15  # odd constants: incarnation and tier move every hash
_WHERE = 0xD6E8FEB86659FD93
_M1 = 0xBF58476D1CE4E5B9  # the splitmix64 finaliser's
_M2 = 0x94D049BB133111EB

Summary = tuple[list[int], list[int]]  # (count per bucket, XOR of hashes per bucket)


def bucket(key: bytes) -> int:
    """The bucket of a 32-byte key (keys are uniform hashes: any byte spreads them)."""
    return key[8] & (BUCKETS - 1)


def entry_hash(key: bytes, incarnation: int, where: int) -> int:
    """The 64-bit hash of one entry (splitmix64 of the key's second word, the holder's
    incarnation and the tier)."""
    z = (int.from_bytes(key[8:16], "little") + incarnation * _INC + where * _WHERE) & _MASK
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def empty() -> Summary:
    return [0] * BUCKETS, [0] * BUCKETS


class Summaries:
    """An owner's summaries, one per holder, kept up to date entry by entry. Not
    thread-safe: its shard calls it under its lock."""

    def __init__(self) -> None:
        self._by_holder: dict[str, Summary] = {}

    def add(self, holder: str, key: bytes, incarnation: int, where: int) -> None:
        counts, hashes = self._by_holder.setdefault(holder, empty())
        b = bucket(key)
        counts[b] += 1
        hashes[b] ^= entry_hash(key, incarnation, where)

    def remove(self, holder: str, key: bytes, incarnation: int, where: int) -> None:
        summary = self._by_holder.get(holder)
        if summary is None:
            return
        counts, hashes = summary
        b = bucket(key)
        counts[b] -= 1
        hashes[b] ^= entry_hash(key, incarnation, where)
        if not any(counts):
            del self._by_holder[holder]

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


def hashes_of(
    words: npt.NDArray[np.uint64], wheres: npt.NDArray[np.uint64], incarnation: int
) -> npt.NDArray[np.uint64]:
    """:func:`entry_hash` of many entries of one holder: ``words`` are the keys' second
    little-endian words (``keys_words``), ``wheres`` their tiers."""
    base = np.uint64((incarnation * _INC) & _MASK)
    with np.errstate(over="ignore"):
        return _mix(words + base + wheres * np.uint64(_WHERE))


def keys_words(keys: Sequence[bytes]) -> npt.NDArray[np.uint64]:
    """The second little-endian 64-bit word of each 32-byte key."""
    if not keys:
        return np.zeros(0, dtype=np.uint64)
    raw = np.frombuffer(b"".join(keys), dtype="<u8")
    if raw.size != 4 * len(keys):
        raise ValueError("directory keys must be 32 bytes")
    return np.ascontiguousarray(raw.reshape(len(keys), 4)[:, 1], dtype=np.uint64)


def summarise(words: npt.NDArray[np.uint64], hashes: npt.NDArray[np.uint64]) -> Summary:
    """The summary of entries given by their keys' words and their hashes."""
    buckets = (words & np.uint64(BUCKETS - 1)).astype(np.intp)
    counts = np.bincount(buckets, minlength=BUCKETS)
    order = np.argsort(buckets, kind="stable")
    sorted_hashes = hashes[order]
    starts = np.searchsorted(buckets[order], np.arange(BUCKETS))
    xors = [0] * BUCKETS
    for b in range(BUCKETS):
        if counts[b]:
            xors[b] = int(np.bitwise_xor.reduce(sorted_hashes[starts[b] : starts[b] + counts[b]]))
    return [int(c) for c in counts], xors
