"""One node's shard of the ring's directory (:class:`Shard`): the entries of the keys the
consistent-hash ring makes this node an owner of (:mod:`tierkv.cluster.ring_directory`), one
per holder of a key, and per holder the summary of them that the anti-entropy compares
(:mod:`tierkv.cluster.digest`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence

from tierkv.cluster import digest


class Shard:
    """This node's part of the directory: key -> ((holder, incarnation, where), ...), one
    entry per holder, newest last; and per holder, the summary of its entries that the
    holder compares with its own (:mod:`tierkv.cluster.digest`), kept up to date entry by
    entry."""

    def __init__(self) -> None:
        self._entries: dict[bytes, tuple[tuple[str, int, int], ...]] = {}
        self._summaries = digest.Summaries()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def _set(
        self,
        key: bytes,
        entry: tuple[str, int, int],
        added: list[tuple[str, bytes, int, int]],
        removed: list[tuple[str, bytes, int, int]],
    ) -> bool:
        """Put ``entry`` for ``key`` in place of its holder's previous one, noting the
        summaries' changes (lock held); False if it was there already."""
        holder = entry[0]
        old = self._entries.get(key, ())
        for e in old:
            if e[0] == holder:
                if e == entry:
                    return False
                removed.append((holder, key, e[1], e[2]))
                old = tuple(o for o in old if o[0] != holder)
                break
        self._entries[key] = (*old, entry)
        added.append((holder, key, entry[1], entry[2]))
        return True

    def _cut(
        self,
        key: bytes,
        old: tuple[tuple[str, int, int], ...],
        gone: Callable[[tuple[str, int, int]], bool],
        removed: list[tuple[str, bytes, int, int]],
    ) -> int:
        """Drop the entries of ``key`` that are ``gone``, noting them in ``removed`` (lock
        held); returns how many."""
        kept = tuple(e for e in old if not gone(e))
        if len(kept) == len(old):
            return 0
        removed.extend((e[0], key, e[1], e[2]) for e in old if gone(e))
        if kept:
            self._entries[key] = kept
        else:
            del self._entries[key]
        return len(old) - len(kept)

    def _account(
        self, added: list[tuple[str, bytes, int, int]], removed: list[tuple[str, bytes, int, int]]
    ) -> None:
        self._summaries.apply(removed, -1)
        self._summaries.apply(added, 1)

    def put(self, holder: str, incarnation: int, entries: Iterable[tuple[bytes, int]]) -> int:
        n = 0
        added: list[tuple[str, bytes, int, int]] = []
        removed: list[tuple[str, bytes, int, int]] = []
        with self._lock:
            for key, where in entries:
                self._set(key, (holder, incarnation, int(where)), added, removed)
                n += 1
            self._account(added, removed)
        return n

    def put_many(self, entries: Iterable[tuple[bytes, str, int, int]]) -> int:
        n = 0
        added: list[tuple[str, bytes, int, int]] = []
        removed: list[tuple[str, bytes, int, int]] = []
        with self._lock:
            table = self._entries
            for key, holder, incarnation, where in entries:
                if any(e[0] == holder and e[1] > incarnation for e in table.get(key, ())):
                    continue  # an entry of a previous life of that holder
                self._set(key, (holder, incarnation, where), added, removed)
                n += 1
            self._account(added, removed)
        return n

    def remove(self, holder: str, keys: Iterable[bytes]) -> int:
        n = 0
        removed: list[tuple[str, bytes, int, int]] = []
        with self._lock:
            table = self._entries
            for key in keys:
                old = table.get(key)
                if old and self._cut(key, old, lambda e: e[0] == holder, removed):
                    n += 1
            self._account([], removed)
        return n

    def get(self, keys: Sequence[bytes]) -> list[tuple[tuple[str, int, int], ...]]:
        with self._lock:
            table = self._entries
            return [table.get(k, ()) for k in keys]

    def purge(self, gone: dict[str, int]) -> int:
        """Drop entries of holders that are gone (``gone``: node id -> the incarnation that
        ended; entries of that holder with that incarnation or older go)."""
        if not gone:
            return 0
        n = 0

        def stale(e: tuple[str, int, int]) -> bool:
            return e[0] in gone and e[1] <= gone[e[0]]

        removed: list[tuple[str, bytes, int, int]] = []
        with self._lock:
            for key, old in list(self._entries.items()):
                n += self._cut(key, old, stale, removed)
            self._account([], removed)
        return n

    def drop_holders(self, holders: Iterable[str]) -> int:
        """Drop every entry of ``holders``."""
        out = set(holders)
        if not out:
            return 0
        n = 0
        removed: list[tuple[str, bytes, int, int]] = []
        with self._lock:
            for key, old in list(self._entries.items()):
                n += self._cut(key, old, lambda e: e[0] in out, removed)
            self._account([], removed)
        return n

    def items(self) -> list[tuple[bytes, tuple[tuple[str, int, int], ...]]]:
        with self._lock:
            return list(self._entries.items())

    def drop(self, keys: Iterable[bytes]) -> None:
        removed: list[tuple[str, bytes, int, int]] = []
        with self._lock:
            for key in keys:
                old = self._entries.get(key)
                if old:
                    self._cut(key, old, lambda e: True, removed)
            self._account([], removed)

    # -- anti-entropy ----------------------------------------------------------------------
    def summary(self, holder: str) -> digest.Summary:
        """The summary of ``holder``'s entries here (O(1))."""
        with self._lock:
            return self._summaries.get(holder)

    def holders(self) -> list[str]:
        """The holders that have entries here."""
        with self._lock:
            return self._summaries.holders()

    def entries_of(self, holder: str, buckets: Iterable[int]) -> list[tuple[bytes, int, int]]:
        """``holder``'s entries in ``buckets``: ``(key, incarnation, where)`` (a scan of the
        shard: only for summaries that differ)."""
        wanted = set(buckets)
        out: list[tuple[bytes, int, int]] = []
        for key, entries in self.items():
            for h, incarnation, where in entries:
                if h == holder and digest.bucket(key) in wanted:
                    out.append((key, incarnation, where))
        return out
