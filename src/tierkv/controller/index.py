"""The controller's index: which instance holds which key, in which tier.

One :class:`~tierkv.controller.keytable.KeyTable` per instance (no Python object per
chunk), plus per-namespace counts. Every operation is a bulk operation: an admit or evict
batch is a few numpy calls; a full report builds the instance's table with one sort and
swaps it in; deregistering an instance drops its table (its million entries go with one
array). A lookup asks every instance's table for the whole batch of keys and returns, per
instance that holds any of them, the tier of each key (so every holder of every key), and
:func:`prefix_runs` turns that into the longest leading run each instance can serve.

Thread-safe: one lock, held for the numpy calls only (nothing here does I/O).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from tierkv.controller.keytable import I8, NO_TIER, TIERS, KeyTable, fingerprints, key_array


@dataclass
class Holdings:
    """One instance's keys: the table and the count of keys per namespace and tier."""

    table: KeyTable = field(default_factory=KeyTable)
    namespaces: dict[bytes, npt.NDArray[np.int64]] = field(default_factory=dict)

    def count(self, keys: npt.NDArray[np.uint64], tiers: I8, sign: int) -> None:
        """Add (``sign`` 1) or subtract (-1) keys with ``tiers`` (NO_TIER: not counted)."""
        ns = keys[:, :2]
        if not ns.shape[0]:
            return
        counted = tiers >= 0
        if bool((ns[:, 0] == ns[0, 0]).all() and (ns[:, 1] == ns[0, 1]).all()):
            groups = [(ns[0].tobytes(), counted)]
        else:
            uniq, inverse = np.unique(ns, axis=0, return_inverse=True)
            inverse = inverse.reshape(-1)
            groups = [(u.tobytes(), counted & (inverse == i)) for i, u in enumerate(uniq)]
        for digest, sel in groups:
            add = np.bincount(tiers[sel].astype(np.int64), minlength=TIERS)
            now = self.namespaces.get(digest, np.zeros(TIERS, dtype=np.int64)) + sign * add
            if now.any():
                self.namespaces[digest] = now
            else:
                self.namespaces.pop(digest, None)


class ControllerIndex:
    """instance id -> :class:`Holdings`."""

    def __init__(self) -> None:
        self._holders: dict[str, Holdings] = {}
        self._lock = threading.Lock()

    def instances(self) -> list[str]:
        with self._lock:
            return list(self._holders)

    def add(self, instance: str, keys: bytes | list[bytes], tiers: I8 | int) -> int:
        """Admit ``keys`` (or move them to ``tiers``); returns how many were new."""
        arr = key_array(keys)
        fps = fingerprints(keys)
        tier_arr = np.broadcast_to(np.asarray(tiers, dtype=np.int8), (fps.size,))
        with self._lock:
            h = self._holders.setdefault(instance, Holdings())
            before = h.table.add(fps, tier_arr)
            h.count(arr, self._first_only(fps, before), -1)
            h.count(arr, self._first_only(fps, h.table.tiers(fps)), 1)
            return int(np.count_nonzero(before < 0))

    @staticmethod
    def _first_only(fps: npt.NDArray[np.uint64], tiers: npt.NDArray[np.int8]) -> I8:
        """``tiers`` with repeats of a key in one batch not counted twice."""
        if fps.size < 2:
            return np.asarray(tiers, dtype=np.int8)
        _, first = np.unique(fps, return_index=True)
        if first.size == fps.size:
            return np.asarray(tiers, dtype=np.int8)
        out = np.full(fps.size, NO_TIER, dtype=np.int8)
        out[first] = tiers[first]
        return out

    def remove(self, instance: str, keys: bytes | list[bytes]) -> int:
        """Evict ``keys``; returns how many were held."""
        arr = key_array(keys)
        with self._lock:
            h = self._holders.get(instance)
            if h is None:
                return 0
            fps = fingerprints(keys)
            held = self._first_only(fps, h.table.remove(fps))
            h.count(arr, held, -1)
            return int(np.count_nonzero(held >= 0))

    def replace(self, instance: str, keys: bytes | list[bytes], tiers: I8 | int) -> int:
        """A full report: the instance holds exactly ``keys`` (built aside, swapped in)."""
        arr = key_array(keys)
        fps = fingerprints(keys)
        tier_arr = np.broadcast_to(np.asarray(tiers, dtype=np.int8), (fps.size,))
        fresh = Holdings(KeyTable.build(fps, tier_arr))
        if len(fresh.table) == fps.size:
            fresh.count(arr, tier_arr, 1)
        else:  # repeats in the report
            fresh.count(arr, self._first_only(fps, tier_arr), 1)
        with self._lock:
            self._holders[instance] = fresh
        return len(fresh.table)

    def drop(self, instance: str) -> int:
        """Deregister: forget every key of ``instance``; returns how many it held."""
        with self._lock:
            h = self._holders.pop(instance, None)
        return len(h.table) if h is not None else 0

    def lookup(self, keys: bytes | list[bytes]) -> dict[str, I8]:
        """Per instance holding any of ``keys``: the tier of each key (NO_TIER: not held)."""
        fps = fingerprints(keys)
        ns = key_array(keys)[:, :2]
        wanted = {bytes(b) for b in np.unique(ns, axis=0)} if ns.shape[0] else set()
        out: dict[str, I8] = {}
        with self._lock:
            for instance, h in self._holders.items():
                if not h.table.live or wanted.isdisjoint(h.namespaces):
                    continue
                tiers = h.table.tiers(fps)
                if (tiers >= 0).any():
                    out[instance] = tiers
        return out

    def size(self, instance: str) -> int:
        with self._lock:
            h = self._holders.get(instance)
            return len(h.table) if h is not None else 0

    def by_tier(self, instance: str) -> list[int]:
        with self._lock:
            h = self._holders.get(instance)
            return [int(x) for x in h.table.by_tier] if h is not None else [0] * TIERS

    def namespaces(self, instance: str) -> dict[str, list[int]]:
        """Namespace digest (hex) -> keys per tier, for one instance."""
        with self._lock:
            h = self._holders.get(instance)
            if h is None:
                return {}
            return {d.hex(): [int(x) for x in c] for d, c in h.namespaces.items()}

    def total(self) -> int:
        with self._lock:
            return sum(len(h.table) for h in self._holders.values())

    def nbytes(self) -> int:
        with self._lock:
            return sum(h.table.nbytes for h in self._holders.values())


def prefix_runs(found: dict[str, I8]) -> dict[str, tuple[int, list[int]]]:
    """Per instance: how many leading keys it holds, and how many of those in each tier."""
    out: dict[str, tuple[int, list[int]]] = {}
    for instance, tiers in found.items():
        missing = np.flatnonzero(tiers < 0)
        run = int(missing[0]) if missing.size else int(tiers.size)
        if run:
            counts = np.bincount(tiers[:run].astype(np.int64), minlength=TIERS)
            out[instance] = (run, [int(x) for x in counts])
    return out
