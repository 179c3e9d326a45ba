"""The controller's index: which instance holds which key, in which tier.

One :class:`~tierkv.controller.keytable.KeyTable` per instance (no Python object per
chunk), plus per-namespace counts, plus one cross-instance filter
(:class:`~tierkv.controller.holders.HolderFilter`: a global sorted array and a few runs)
that names, for a batch of keys, the few instances that may hold them. Every operation is
a bulk operation: an admit or evict batch is a few numpy calls (an admit also appends a
sorted run to the filter); a full report builds the instance's table with one sort and
swaps it in under a new filter slot; deregistering an instance drops its table and retires
its slot. A background thread merges the runs and the new reports' entries into the global
array and drops retired slots' entries. A lookup searches the filter once for the whole
batch, asks only the candidates' tables (and those of reports not merged yet), and returns,
per instance that holds any key, the tier of each key (so every holder of every key);
:func:`tierkv.cluster.router_lookup.prefix_runs` turns that into the longest leading run
each instance can serve.

Thread-safe: one lock, held for the numpy calls only (nothing here does I/O); a merge sorts
outside it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from tierkv.cluster.messages import NO_TIER
from tierkv.controller.holders import (
    HolderFilter,
    NoFreeSlot,
    directory_for,
    from_table,
    merge_parts,
    pack_sorted,
)
from tierkv.controller.keytable import (
    I8,
    TIERS,
    KeyTable,
    fingerprints,
    fingerprints_and_namespace,
    key_array,
    namespace_groups,
    single_namespace,
    sort_values,
)

log = logging.getLogger(__name__)

RUN_LIMIT = 1 << 20  # admitted entries in runs before a merge is asked for
REBASE_MIN = 1 << 16  # evictions that never trigger a fresh extraction below this


@dataclass
class Holdings:
    """One instance's keys: the table and the count of keys per namespace and tier."""

    table: KeyTable = field(default_factory=KeyTable)
    namespaces: dict[bytes, npt.NDArray[np.int64]] = field(default_factory=dict)
    slot: int = -1  # its incarnation in the filter (tierkv.controller.holders)
    evicted: int = 0  # keys evicted since its entries were last extracted into the filter

    def count(self, keys: npt.NDArray[np.uint64], tiers: I8, sign: int) -> None:
        """Add (``sign`` 1) or subtract (-1) keys with ``tiers`` (NO_TIER: not counted)."""
        if not keys.shape[0]:
            return
        counted = tiers >= 0
        digest = single_namespace(keys)
        if digest is not None:
            adds = [(digest, np.bincount(tiers[counted].astype(np.int64), minlength=TIERS))]
        else:
            digests, inverse = namespace_groups(keys)
            cell = inverse[counted] * TIERS + tiers[counted]  # (namespace, tier)
            table = np.bincount(cell, minlength=len(digests) * TIERS).reshape(-1, TIERS)
            adds = list(zip(digests, table, strict=True))
        for digest, add in adds:
            now = self.namespaces.get(digest, np.zeros(TIERS, dtype=np.int64)) + sign * add
            if now.any():
                self.namespaces[digest] = now
            else:
                self.namespaces.pop(digest, None)


class ControllerIndex:
    """instance id -> :class:`Holdings`, and the cross-instance filter over them."""

    def __init__(self, merge_interval: float = 0.5, run_limit: int = RUN_LIMIT) -> None:
        self._holders: dict[str, Holdings] = {}
        self._lock = threading.Lock()
        self._merge_lock = threading.Lock()  # one merge at a time
        self.filter = HolderFilter()
        self._pending: dict[int, KeyTable] = {}  # slot -> table not in the filter yet
        self.merge_interval = merge_interval
        self.run_limit = run_limit
        self.merges = 0
        self.merge_seconds = 0.0  # spent merging, in all (its rate: the share of a core)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the background merge ---------------------------------------------------------------
    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(30.0)
            self._thread = None

    def _kick(self) -> None:
        """Ask the merger for a merge (under the lock)."""
        if self._stop.is_set():
            return
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._merge_loop, name="tierkv-ctl-merge", daemon=True
            )
            self._thread.start()
        self._wake.set()

    def _merge_loop(self) -> None:
        while True:
            self._wake.wait()
            if self._stop.is_set():
                return
            self._wake.clear()
            try:
                self.merge()
            except Exception:  # e.g. MemoryError: lookups stay right (runs, pending tables)
                log.exception("controller index: merge failed; trying again later")
            if self._stop.wait(self.merge_interval):
                return

    def merge(self) -> bool:
        """Fold the runs, pending full reports and retired slots into the filter's sorted
        array (the sort outside the lock; lookups meanwhile search the runs being folded).
        Returns whether there was anything to do."""
        with self._merge_lock:
            with self._lock:
                f = self.filter
                if not (self._pending or f.retired or f.runs):
                    return False
                dead = set(f.retired)
                runs, f.merging, f.runs = f.runs, f.runs, []
                base = f.base
                # Keys never move within a table's array (a rebuild makes a new one), so
                # reading it outside the lock misses nothing held now; later admits are runs.
                tables = {slot: table.slots for slot, table in self._pending.items()}
                live = f.live_mask()
            started = time.perf_counter()
            try:
                parts = [base, *runs, *(from_table(a, slot) for slot, a in tables.items())]
                merged = merge_parts(parts, live)
                directory = directory_for(merged)
            except BaseException:
                with self._lock:  # nothing lost: the runs go back, the reports stay pending
                    f.runs, f.merging = [*runs, *f.runs], []
                raise
            with self._lock:
                f.set_base(merged, directory)
                f.merging = []
                for slot in tables:
                    self._pending.pop(slot, None)
                f.free(dead)
                self.merges += 1
                self.merge_seconds += time.perf_counter() - started
            return True

    def settle(self) -> None:
        """Merge until nothing is left to merge (tests and benchmarks)."""
        while self.merge():
            pass

    def _new_slot(self, instance: str, h: Holdings, pending: bool) -> None:
        """Give ``h`` a fresh slot (under the lock), retiring its old one; ``pending``: its
        table is not in the filter (lookups probe it until a merge extracts it). The slot
        is taken first: :class:`NoFreeSlot` leaves everything as it was."""
        slot = self.filter.take_slot(instance)
        if h.slot >= 0:
            self.filter.retire(h.slot)
            self._pending.pop(h.slot, None)
            self._kick()
        h.slot = slot
        h.evicted = 0
        if pending:
            self._pending[h.slot] = h.table
            self._kick()

    # -- changes ---------------------------------------------------------------------------
    def free_slots(self) -> int:
        """How many new incarnations (registrations, full reports) can be taken now."""
        with self._lock:
            return self.filter.free_slots

    def instances(self) -> list[str]:
        with self._lock:
            return list(self._holders)

    def add(self, instance: str, keys: bytes | list[bytes], tiers: I8 | int) -> int:
        """Admit ``keys`` (or move them to ``tiers``); returns how many were new."""
        arr = key_array(keys)
        fps = fingerprints(keys)
        tier_arr = np.broadcast_to(np.asarray(tiers, dtype=np.int8), (fps.size,))
        sorted_fps = sort_values(fps.copy())
        first = self._firsts(fps, sorted_fps)  # outside the lock: lookups wait on it
        with self._lock:
            h = self._holders.get(instance)
            if h is None:
                h = Holdings()
                self._new_slot(instance, h, pending=False)  # NoFreeSlot: nothing stored
                self._holders[instance] = h
            before = h.table.add(fps, tier_arr)
            h.count(arr, self._first_only(first, before), -1)
            h.count(arr, self._first_only(first, h.table.tiers(fps)), 1)
            self.filter.add_run(pack_sorted(sorted_fps, h.slot))
            if self.filter.run_entries > self.run_limit:
                self._kick()
            new = before < 0  # a key given twice is new once
            return int(np.count_nonzero(new if first is None else new[first]))

    @staticmethod
    def _firsts(
        fps: npt.NDArray[np.uint64], sorted_fps: npt.NDArray[np.uint64] | None = None
    ) -> npt.NDArray[np.intp] | None:
        """Where each distinct key of a batch first appears; None when no key repeats (the
        batch ``sorted_fps`` tells at the cost of one comparison pass)."""
        if fps.size < 2:
            return None
        if sorted_fps is not None and bool((sorted_fps[1:] != sorted_fps[:-1]).all()):
            return None
        _, first = np.unique(fps, return_index=True)
        return None if first.size == fps.size else first

    @staticmethod
    def _first_only(first: npt.NDArray[np.intp] | None, tiers: npt.NDArray[np.int8]) -> I8:
        """``tiers`` with repeats of a key in one batch not counted twice (``first``: from
        :meth:`_firsts`)."""
        if first is None:
            return np.asarray(tiers, dtype=np.int8)
        out = np.full(tiers.size, NO_TIER, dtype=np.int8)
        out[first] = tiers[first]
        return out

    def remove(self, instance: str, keys: bytes | list[bytes]) -> int:
        """Evict ``keys``; returns how many were held. Evicted keys stay in the filter
        (lookups ask the table, so they are never returned); once an instance has evicted
        more than it holds, its table is extracted afresh under a new slot."""
        arr = key_array(keys)
        fps = fingerprints(keys)
        first = self._firsts(fps, sort_values(fps.copy()))
        with self._lock:
            h = self._holders.get(instance)
            if h is None:
                return 0
            held = self._first_only(first, h.table.remove(fps))
            h.count(arr, held, -1)
            gone = int(np.count_nonzero(held >= 0))
            h.evicted += gone
            if h.evicted > max(len(h.table), REBASE_MIN):
                # Only a clean-up: without a free slot its stale entries wait a while longer.
                with contextlib.suppress(NoFreeSlot):
                    self._new_slot(instance, h, pending=True)
            return gone

    def replace(self, instance: str, keys: bytes | list[bytes], tiers: I8 | int) -> int:
        """A full report: the instance holds exactly ``keys`` (built aside, swapped in)."""
        arr = key_array(keys)
        fps, digest = fingerprints_and_namespace(keys)
        tier_arr = np.broadcast_to(np.asarray(tiers, dtype=np.int8), (fps.size,))
        fresh = Holdings(KeyTable.build(fps, tier_arr))
        if len(fresh.table) == fps.size and digest is not None:  # the table counted its tiers
            fresh.namespaces[digest] = fresh.table.by_tier.astype(np.int64)
        elif len(fresh.table) == fps.size:
            fresh.count(arr, tier_arr, 1)
        else:  # repeats in the report: each key once, with the tier the table kept for it
            held = self._first_only(self._firsts(fps), fresh.table.tiers(fps))
            fresh.count(arr, held, 1)
        with self._lock:
            old = self._holders.get(instance)
            if old is not None:
                fresh.slot = old.slot
            # The slot first (NoFreeSlot: the previous table stays, whole), then the swap.
            self._new_slot(instance, fresh, pending=True)
            self._holders[instance] = fresh
        return len(fresh.table)

    def drop(self, instance: str) -> int:
        """Deregister: forget every key of ``instance``; returns how many it held."""
        with self._lock:
            h = self._holders.pop(instance, None)
            if h is None:
                return 0
            if h.slot >= 0:
                self.filter.retire(h.slot)
                self._pending.pop(h.slot, None)
                self._kick()
        return len(h.table)

    # -- lookups ---------------------------------------------------------------------------
    def lookup(self, keys: bytes | list[bytes]) -> dict[str, I8]:
        """Per instance holding any of ``keys``: the tier of each key (NO_TIER: not held).
        The filter names the candidates (one search of its sorted arrays for the batch);
        each candidate's own table gives the tiers."""
        fps = fingerprints(keys)
        query = np.sort(fps)
        out: dict[str, I8] = {}
        with self._lock:
            slots = self.filter.candidates(query).tolist()
            names = {self.filter.owner[s] for s in [*slots, *self._pending]}
            for instance in names:
                h = self._holders.get(instance) if instance is not None else None
                if h is None:
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

    def held_namespaces(self) -> set[bytes]:
        """The namespace digests some instance holds keys of."""
        with self._lock:
            return {d for h in self._holders.values() for d in h.namespaces}

    def total(self) -> int:
        with self._lock:
            return sum(len(h.table) for h in self._holders.values())

    def nbytes(self) -> int:
        """The tables' and the filter's bytes."""
        with self._lock:
            return sum(h.table.nbytes for h in self._holders.values()) + self.filter.nbytes
