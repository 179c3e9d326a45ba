"""The disk tier's index of its files: each key's file size and generation, least recently
used first, and per namespace (a key's first 16 bytes) its bytes and its keys in LRU order,
with the recency stamp each was last used at (stamps order files across namespaces).

A pure structure: no I/O and no lock (:class:`tierkv.tiers.disk.DiskTier` calls it under
its own). A file's generation is the stamp it was indexed at: a reader that found a key at
one generation and then found its file bad forgets it only if the index still holds that
generation (a newer file of the same key stays).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Collection, Iterable

from tierkv.keys import DIGEST_SIZE


class _Space:
    """The files of one namespace: their bytes, and their keys in LRU order with their
    stamps."""

    __slots__ = ("lru", "nbytes")

    def __init__(self) -> None:
        self.nbytes = 0
        self.lru: OrderedDict[bytes, int] = OrderedDict()


class DiskIndex:
    """Key -> (file size, generation), least recently used first; bytes per namespace."""

    def __init__(self) -> None:
        self._entries: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self._spaces: dict[bytes, _Space] = {}  # namespace digest -> its files
        self.nbytes = 0  # the sizes of all files indexed
        self._stamp = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> tuple[int, int] | None:
        """``key``'s (file size, generation), or None."""
        return self._entries.get(key)

    def add(self, key: bytes, size: int) -> int:
        """Index ``key``'s complete file of ``size`` bytes as the most recently used
        (replacing an entry it had); returns its generation."""
        if key in self._entries:
            self.pop(key)
        self._stamp += 1
        self._entries[key] = (size, self._stamp)
        self.nbytes += size
        ns = key[:DIGEST_SIZE]
        space = self._spaces.get(ns)
        if space is None:
            space = self._spaces[ns] = _Space()
        space.lru[key] = self._stamp
        space.nbytes += size
        return self._stamp

    def pop(self, key: bytes) -> int:
        """Drop ``key`` (indexed); returns its file's size."""
        size = self._entries.pop(key)[0]
        self.nbytes -= size
        ns = key[:DIGEST_SIZE]
        space = self._spaces[ns]
        del space.lru[key]
        space.nbytes -= size
        if not space.lru:
            del self._spaces[ns]
        return size

    def touch(self, key: bytes) -> None:
        """Make ``key`` (indexed) the most recently used."""
        self._entries.move_to_end(key)
        self._stamp += 1
        lru = self._spaces[key[:DIGEST_SIZE]].lru
        lru.move_to_end(key)
        lru[key] = self._stamp

    def pop_oldest(self, nbytes: int) -> list[tuple[bytes, int]]:
        """Drop the least recently used keys until their files free ``nbytes`` or none is
        left; returns (key, size) of each, oldest first."""
        out: list[tuple[bytes, int]] = []
        freed = 0
        while freed < nbytes and self._entries:
            key = next(iter(self._entries))
            size = self.pop(key)
            out.append((key, size))
            freed += size
        return out

    def pop_oldest_of(self, namespaces: Collection[bytes], nbytes: int) -> list[tuple[bytes, int]]:
        """:meth:`pop_oldest` among the keys of ``namespaces`` only (oldest first across
        them)."""
        spaces = [self._spaces[ns] for ns in namespaces if ns in self._spaces]
        oldest = heapq.merge(*(((stamp, key) for key, stamp in s.lru.items()) for s in spaces))
        picked: list[bytes] = []
        freed = 0
        for _stamp, key in oldest:
            if freed >= nbytes:
                break
            picked.append(key)
            freed += self._entries[key][0]
        return [(key, self.pop(key)) for key in picked]

    def namespace_usage(self, namespaces: Iterable[bytes] | None = None) -> dict[bytes, int]:
        """Bytes held per namespace digest (all namespaces, or those of ``namespaces``
        that hold files)."""
        spaces = self._spaces
        if namespaces is None:
            return {ns: space.nbytes for ns, space in spaces.items()}
        return {ns: spaces[ns].nbytes for ns in namespaces if ns in spaces}
