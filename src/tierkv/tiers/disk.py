"""The local disk tier: one checksummed file per chunk, LRU-bounded, rebuilt on restart.

Files. Each chunk is one record file (the 64-byte header of :mod:`tierkv.tiers.records`, then
the payload) under a fan-out of the key's chunk-hash half, in a directory locked by one
server at a time: see :mod:`tierkv.tiers.disk_files` for the layout, how a file is written
and what a start finds. This module orchestrates stores, loads, deletes and evictions.

Store. The pool view goes out with ``os.pwrite`` (no copy of the payload in user space) in
pieces hashed as they are written, to a temporary file renamed into place
(:func:`tierkv.tiers.disk_files.write_record`): a torn write is never visible under a
chunk's name, and a crash leaves at most a temporary file, which the next start removes.
Keys already held are skipped.

Load. ``os.preadv`` reads the payload straight into the caller's writable slot view, in
pieces hashed as they land, and the record is verified
(:func:`tierkv.tiers.disk_files.read_record`). Anything inconsistent is ``CORRUPT``: the
file is deleted and counted, and the bytes left in the slot must not be used. A missing file
is ``MISSING``, an I/O error ``ERROR``; nothing raises for a single chunk. A view whose
length differs from a self-consistent file is also ``CORRUPT``, but that file is kept: the
chunk is intact, the caller asked for the wrong size.

One rule, running or restarted: a chunk file is exactly ``HEADER_SIZE`` plus its header's
length, checked against the size the file has *now*. Whatever is at a chunk's name and is
not a regular file is not a chunk: a load reports it ``CORRUPT`` and removes it, a store
replaces it, and a start removes it, so it never keeps that chunk out of the tier.

Index. An in-memory index (:class:`tierkv.tiers.disk_index.DiskIndex`: key -> file size
and generation, in LRU order) bounds the tier to ``capacity`` bytes (header included); a
store that does not fit evicts the least recently used files first, and loads move a key to
the back (and bump its file's mtime, so the order survives a restart). The index also keeps
each namespace's bytes and LRU order (a key's first 16 bytes, the namespace digest), so
:meth:`DiskTier.namespace_usage` answers what each namespace holds and
:meth:`DiskTier.evict_oldest` evicts the least recently used files of a set of namespaces
(a tenant's, for the server's tenant quotas; the tier itself knows no tenants and decides
nothing: see :mod:`tierkv.server.tiering.tier_quotas`).

At start the index is rebuilt from a scan of the directory
(:func:`tierkv.tiers.disk_files.scan_chunks`: sizes and mtimes, no file is opened); the
leftovers it lists are removed, and headers are verified lazily, on load.

Degradation. A write the medium refuses (full, read-only) disables writes, not the tier:
chunks on disk stay readable and one store is let through every ``retry_interval`` seconds
as a probe (:mod:`tierkv.tiers.disk_write_gate`). A directory that cannot be created at
start disables the tier the same way instead of failing the server. Every failure is
counted (:mod:`tierkv.tiers.disk_stats`), and logged at WARNING once per kind
(:mod:`tierkv.tiers.disk_failure_log`).

Parallel I/O. A batch of stores or loads is spread over ``threads`` threads (default: the
cores, at most 4; see :mod:`tierkv.copier`) of lowered priority (:mod:`tierkv.priority`;
the tier thread that called only waits): each chunk is one file, and one thread copies and
checksums less than page-cache I/O can do (the checksum is in series with the copy), so two
threads reach it. Pieces keep each system call short (:mod:`tierkv.piecewise_io`): a control
thread woken meanwhile gets a core after a piece, not after a whole chunk.

Concurrency. All methods may be called from several threads. One lock guards the index,
the per-key busy markers, the write gate and the counters, and is never held across file
I/O. A key is at
any moment in at most one of: the index (its file is complete and readable) or ``busy`` (one
thread is writing or removing its file), so no two threads ever write or unlink the same
name. Index entries carry a generation, so a load that found a file missing or corrupt only
drops the entry it read, never one a later store put there.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, TypeVar

from tierkv.copier import Copier
from tierkv.keys import KEY_SIZE
from tierkv.options import OptionError, Size, parse_size
from tierkv.tiers.base import LoadStatus, Tier, TierError, TierUsage
from tierkv.tiers.disk_failure_log import DiskFailureLog
from tierkv.tiers.disk_files import (
    LOCK_NAME,
    TMP_SUFFIX,
    chunk_path,
    read_record,
    remove_leftovers,
    remove_path,
    scan_chunks,
    take_directory_lock,
    warn_if_over_free_space,
    write_record,
)
from tierkv.tiers.disk_index import DiskIndex
from tierkv.tiers.disk_stats import DiskCounters, DiskTierStats
from tierkv.tiers.disk_write_gate import WriteGate, refusal
from tierkv.tiers.records import HEADER_SIZE, byte_view
from tierkv.tiers.registry import register_tier

log = logging.getLogger(__name__)

DEFAULT_CAPACITY = 10 * 2**30
DEFAULT_RETRY_INTERVAL = 30.0

T = TypeVar("T")
Items = Sequence[tuple[bytes, memoryview]]

_STORE = "store"
_REMOVE = "remove"

__all__ = ["DEFAULT_CAPACITY", "LOCK_NAME", "DiskTier", "DiskTierStats"]


def _byte_view(view: memoryview | bytes | bytearray) -> memoryview:
    """:func:`byte_view`, contiguous (what ``writev``/``readv`` and the checksum need)."""
    data = byte_view(view)
    if not data.c_contiguous:
        raise TypeError("memoryview is not C-contiguous")  # the caller reports it
    return data


class DiskTier(Tier):
    """Chunks as files under ``path``, at most ``capacity`` bytes, least recently used out.

    Options (all keyword; the documentation's reference is generated from this list):

        path  the directory, created if missing
        capacity  bytes, a number or a size such as ``100GiB``; header bytes count
        fsync  fsync each file and its directory before a store returns (the rename alone
             already guarantees that a chunk's name never shows a torn file)
        retry_interval  seconds between write probes while writes are disabled (a full or
             read-only disk)
        threads  files read or written at once within a batch (default: the cores, at
             most 4)
    """

    name = "disk"

    def __init__(
        self,
        *,
        path: str | os.PathLike[str],
        capacity: Size | str = DEFAULT_CAPACITY,
        fsync: bool = False,
        retry_interval: float = DEFAULT_RETRY_INTERVAL,
        threads: int | None = None,
    ) -> None:
        self.check_options(
            path=path, capacity=capacity, retry_interval=retry_interval, threads=threads
        )
        cap = parse_size(capacity)
        self._batch = Copier(None if threads is None else int(threads), data_priority=True)
        self.path = os.path.abspath(os.fspath(path))
        self.capacity = cap
        self.fsync = bool(fsync)
        self.retry_interval = float(retry_interval)

        self._lock = threading.Lock()
        self._index = DiskIndex()  # the files held (under the lock)
        self._busy: dict[bytes, str] = {}  # key -> _STORE / _REMOVE, while its file changes
        self._cancelled: set[bytes] = set()  # in-flight stores a delete() overtook
        self._reserved = 0  # bytes of stores in flight
        self._tmp_names = itertools.count(1)  # temporary files' names
        self._gate = WriteGate(self.path, self.retry_interval)  # (under the lock)
        self._closed = False
        self._lock_fd: int | None = None
        self._c = DiskCounters()
        self._failures = DiskFailureLog(self.path)

        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as exc:
            self._disable(f"cannot create {self.path}: {exc.strerror or exc}")
            return
        self._lock_fd = take_directory_lock(self.path)
        self._rebuild()
        warn_if_over_free_space(self.path, self._index.nbytes, self.capacity)

    # -- Tier interface --------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            index = self._index
            return [key in index for key in keys]

    def store(self, items: Sequence[tuple[bytes, memoryview]]) -> list[bool]:
        return self._each(self._store_one, items, False)

    def load(self, items: Sequence[tuple[bytes, memoryview]]) -> list[LoadStatus]:
        return self._each(self._load_one, items, LoadStatus.ERROR)

    def _each(self, one: Callable[[bytes, memoryview], T], items: Items, default: T) -> list[T]:
        """``one`` on each item, on the batch's threads; the results in order."""
        results = [default] * len(items)

        def run(i: int) -> None:
            results[i] = one(*items[i])

        self._batch.run(run, range(len(items)), [v.nbytes for _, v in items])
        return results

    def delete(self, keys: Sequence[bytes]) -> int:
        held: list[tuple[bytes, int]] = []
        with self._lock:
            for key in keys:
                if key in self._index:
                    size = self._index.pop(key)
                    self._busy[key] = _REMOVE
                    held.append((key, size))
                elif self._busy.get(key) == _STORE:
                    self._cancelled.add(key)  # the store removes its file when it lands
            self._c.deletes += len(held)
        self._remove_files([key for key, _ in held])
        return len(held)

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(len(self._index), self._index.nbytes, self.capacity)

    def close(self) -> None:
        """Stop taking stores and release the directory lock. Idempotent."""
        with self._lock:
            self._closed = True
            fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # releases the flock
        self._batch.close()

    @classmethod
    def check_options(cls, **options: Any) -> None:
        if not os.fspath(options.get("path", "")):
            raise TierError("disk tier: a path is required")
        capacity = options.get("capacity", DEFAULT_CAPACITY)
        try:
            cap = parse_size(capacity)
        except OptionError as exc:
            raise TierError(f"disk tier: bad capacity {capacity!r}: {exc}") from None
        if cap <= 0:
            raise TierError(f"disk tier: capacity must be positive, got {capacity!r}")
        retry_interval = options.get("retry_interval", 0)
        if retry_interval < 0:
            raise TierError(f"disk tier: retry_interval must be >= 0, got {retry_interval}")
        threads = options.get("threads")
        if threads is not None and not 1 <= int(threads) <= 64:
            raise TierError(f"disk tier: threads must be 1 to 64, got {threads}")

    def namespace_usage(self, namespaces: Iterable[bytes] | None = None) -> dict[bytes, int]:
        """Bytes held per namespace digest (all namespaces, or those of ``namespaces``
        that hold files)."""
        with self._lock:
            return self._index.namespace_usage(namespaces)

    def evict_oldest(self, namespaces: Collection[bytes], nbytes: int) -> list[tuple[bytes, int]]:
        """Evict the least recently used files of ``namespaces`` (oldest first across
        them) until ``nbytes`` are freed or none is left; returns (key, bytes) of each."""
        with self._lock:
            victims = self._index.pop_oldest_of(namespaces, nbytes)
            picked = self._evicting_locked(victims)
        self._remove_files(picked)
        return victims

    def copies(self) -> str:
        return (
            "store: 0 extra copies (pwrite of the pool view into the page cache); "
            "load: 0 extra copies (preadv from the page cache straight into the slot); "
            "each side hashes the slot in place, piece by piece as it is copied"
        )

    # -- extras ----------------------------------------------------------------------------
    def stats(self) -> DiskTierStats:
        with self._lock:
            index = self._index
            return self._c.snapshot(len(index), index.nbytes, self.capacity, self._gate.reason)

    @property
    def writes_disabled(self) -> bool:
        return self._gate.disabled

    def file_path(self, key: bytes) -> str:
        """Where ``key``'s chunk lives (whether or not it is held)."""
        return chunk_path(self.path, key)

    # -- store -----------------------------------------------------------------------------
    def _store_one(self, key: bytes, view: memoryview) -> bool:
        if not isinstance(key, bytes) or len(key) != KEY_SIZE:
            self._count_failed(f"store: keys are {KEY_SIZE} bytes, got {key!r:.40}")
            return False
        try:
            data = _byte_view(view)
        except (TypeError, ValueError) as exc:
            self._count_failed(f"store: unusable view for {key.hex()}: {exc}")
            return False
        size = HEADER_SIZE + data.nbytes
        with self._lock:
            if key in self._index:
                self._index.touch(key)
                self._c.store_skipped += 1
                return True
            busy = self._busy.get(key)
            if busy is not None:
                if busy == _STORE and key not in self._cancelled:
                    self._c.store_skipped += 1  # another thread is writing the same chunk
                    return True
                # A removal, or a store a delete() overtook (it removes its file when it
                # lands: answered True, this store left the tier without a chunk it said it
                # held; nor may that write stand for this one, the delete was of its bytes).
                self._c.store_failed += 1
                return False
            if size > self.capacity or not self._may_write_locked():
                self._c.store_failed += 1
                return False
            probe = self._gate.disabled  # this store is the one write probe
            victims = self._make_room_locked(size)
            if victims is None:  # in-flight stores hold the rest of the capacity
                self._gate.release_probe()
                self._c.store_failed += 1
                return False
            self._busy[key] = _STORE
            self._reserved += size
            seq = next(self._tmp_names)
        self._remove_files(victims)
        path = self.file_path(key)
        try:
            self._write_file(path, f"{path}.{os.getpid()}-{seq}{TMP_SUFFIX}", key, data)
        except Exception as exc:
            with self._lock:
                del self._busy[key]
                self._cancelled.discard(key)
                self._reserved -= size
                if probe:
                    self._gate.release_probe()
            self._write_failed(exc, key)
            return False

        with self._lock:
            self._reserved -= size
            cancelled = key in self._cancelled
            if not cancelled:
                del self._busy[key]
                self._index.add(key, size)
                self._c.stores += 1
                self._c.store_bytes += data.nbytes
            else:  # not stored: the caller is answered False, counted as such
                self._cancelled.discard(key)
                self._busy[key] = _REMOVE  # stores until the file is gone are refused
                self._c.store_failed += 1
            recovered = self._gate.written(probe)
        if recovered:
            self._gate.report_enabled()
        if cancelled:  # a delete() came in while the file was being written
            self._remove_files([key])
            return False
        return True

    def _make_room_locked(self, size: int) -> list[bytes] | None:
        """Make room for ``size`` more bytes by evicting LRU keys; None if it cannot fit."""
        held = self._index.nbytes
        excess = held + self._reserved + size - self.capacity
        if excess <= 0:
            return []
        if excess > held:
            return None  # in-flight stores hold the rest
        return self._evicting_locked(self._index.pop_oldest(excess))

    def _evicting_locked(self, victims: list[tuple[bytes, int]]) -> list[bytes]:
        """Count ``victims`` (popped from the index) as evicted and mark them busy until
        their files are removed; their keys."""
        for key, _ in victims:
            self._busy[key] = _REMOVE
        self._c.evictions += len(victims)
        self._c.evicted_bytes += sum(size for _, size in victims)
        return [key for key, _ in victims]

    def _may_write_locked(self) -> bool:
        """Whether this store may write; while writes are disabled, claims the one probe."""
        return not self._closed and self._gate.may_write()

    def _write_file(self, path: str, tmp: str, key: bytes, data: memoryview) -> None:
        unsynced = write_record(path, tmp, key, data, self.fsync)
        if unsynced is not None:
            with self._lock:
                self._c.errors += 1
            self._failures.error("directory fsync", unsynced, key)

    def _write_failed(self, exc: Exception, key: bytes) -> None:
        with self._lock:
            self._c.store_failed += 1
            self._c.errors += 1
        reason = refusal(exc)
        if reason is not None:
            self._disable(reason)
        else:
            self._failures.error("store", exc, key)

    def _disable(self, reason: str) -> None:
        with self._lock:
            first = self._gate.disable(reason)
        self._gate.report_disabled(reason, first)

    # -- load ------------------------------------------------------------------------------
    def _load_one(self, key: bytes, view: memoryview) -> LoadStatus:
        try:
            data = _byte_view(view)
            if data.readonly:
                raise TypeError("load needs a writable view")
        except (TypeError, ValueError) as exc:
            return self._load_error(exc, key)
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                self._c.misses += 1
                return LoadStatus.MISSING
            self._index.touch(key)
        gen = entry[1]
        try:
            damage = read_record(self.file_path(key), key, data)
        except FileNotFoundError:
            self._forget(key, gen)  # removed behind our back
            with self._lock:
                self._c.misses += 1
            return LoadStatus.MISSING
        except OSError as exc:
            return self._load_error(exc, key)
        if damage is not None and damage.keep:
            with self._lock:
                self._c.corrupt += 1
            return LoadStatus.CORRUPT
        if damage is not None:
            return self._corrupt(key, gen, damage.why)
        with self._lock:
            self._c.loads += 1
            self._c.load_bytes += data.nbytes
        return LoadStatus.OK

    def _corrupt(self, key: bytes, gen: int, why: str) -> LoadStatus:
        with self._lock:
            self._c.corrupt += 1
            n = self._c.corrupt
        self._failures.corrupt(self.file_path(key), why, n)
        self._forget(key, gen, unlink=True)
        return LoadStatus.CORRUPT

    def _load_error(self, exc: Exception, key: bytes) -> LoadStatus:
        with self._lock:
            self._c.errors += 1
        self._failures.error("load", exc, key)
        return LoadStatus.ERROR

    def _forget(self, key: bytes, gen: int, unlink: bool = False) -> None:
        """Drop ``key``'s index entry (and file) if it is still the one read as ``gen``."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None or entry[1] != gen:
                return
            self._index.pop(key)
            if not unlink:
                return
            self._busy[key] = _REMOVE
        self._remove_files([key])

    # -- files -----------------------------------------------------------------------------
    def _remove_files(self, keys: list[bytes]) -> None:
        """Unlink the files of ``keys`` (marked busy by the caller) and release them."""
        if not keys:
            return
        errors = 0
        for key in keys:
            try:
                remove_path(self.file_path(key))
            except FileNotFoundError:
                pass
            except OSError as exc:
                errors += 1
                self._failures.error("remove", exc, key)
        with self._lock:
            for key in keys:
                self._busy.pop(key, None)
            self._c.errors += errors

    def _count_failed(self, message: str) -> None:
        with self._lock:
            self._c.store_failed += 1
        self._failures.refused(message)

    # -- start-up --------------------------------------------------------------------------
    def _rebuild(self) -> None:
        """Index the chunk files under ``path`` (LRU order by mtime); remove leftovers."""
        started = time.monotonic()
        found, junk = scan_chunks(self.path)
        removed = remove_leftovers(junk)
        with self._lock:
            for _mtime, key, size in found:
                self._index.add(key, size)
            self._c.removed_at_start += removed
            # Evict down to the capacity if it shrank since the last run (nothing is in
            # flight yet, so this never returns None).
            victims = self._make_room_locked(0) or []
        self._remove_files(victims)
        log.info(
            "disk tier %s: %d chunks, %d of %d bytes, indexed in %.3fs "
            "(%d leftover files removed, %d evicted to fit capacity)",
            self.path,
            len(self._index),
            self._index.nbytes,
            self.capacity,
            time.monotonic() - started,
            removed,
            len(victims),
        )


register_tier("disk", DiskTier)
