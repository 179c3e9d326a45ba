"""The local disk tier: one checksummed file per chunk, LRU-bounded, rebuilt on restart.

Layout. ``<path>/<aa>/<bb>/<64 hex digits of the key>.kv``, where ``aa`` and ``bb`` are the
first two bytes of the key's *chunk-hash* half (bytes 16 and 17). The first half of a key is
the namespace digest, the same for every chunk of an engine, so fanning out by it would put
all of an engine's chunks in one directory. Each file is the 64-byte record header of
:mod:`tierkv.tiers.base` followed by the payload. ``<path>/.tierkv-disk.lock`` is held
(``flock``) while a tier uses the directory, so two servers never share one.

Store. The pool view goes out with ``os.pwrite`` (no copy of the payload in user space) in
pieces of :data:`tierkv.piecewise_io.PIECE` bytes, each hashed right after it was written, then
the header with the checksum, to a temporary file next to the final one, optionally
``fsync``-ed, then ``os.replace``-d into place: a torn write is never visible under a chunk's
name, and a crash leaves at most a temporary file, which the next start removes. Keys
already held are skipped.

Load. ``os.pread`` reads the header, then ``os.preadv`` the payload straight into the
caller's writable slot view, in pieces hashed as they land; the header (magic, version,
key, length) and the checksum are then verified. Anything inconsistent is ``CORRUPT``: the file is
deleted and counted, and the bytes left in the slot must not be used. A missing file is
``MISSING``, an I/O error ``ERROR``; nothing raises for a single chunk. A view whose length
differs from a self-consistent file is also ``CORRUPT``, but that file is kept: the chunk
is intact, the caller asked for the wrong size.

One rule, running or restarted: a chunk file is exactly ``HEADER_SIZE`` plus its header's
length. Loads check the size the file has *now* (``fstat``), not the size it was indexed
with, so bytes appended to a file make it ``CORRUPT`` (and removed) whether they were added
while the tier ran or before it started. Whatever is at a chunk's name and is not a regular
file (a directory, a symbolic link, a FIFO) is not a chunk: a load reports it ``CORRUPT``
and removes it, a store replaces it, and a start removes it, so it never keeps that chunk
out of the tier.

Index. An in-memory index (:class:`tierkv.tiers.disk_index.DiskIndex`: key -> file size
and generation, in LRU order) bounds the tier to ``capacity`` bytes (header included); a
store that does not fit evicts the least recently used files first, and loads move a key to
the back (and bump its file's mtime, so the order survives a restart). The index also keeps
each namespace's bytes and LRU order (a key's first 16 bytes, the namespace digest), so
:meth:`DiskTier.namespace_usage` answers what each namespace holds and
:meth:`DiskTier.evict_oldest` evicts the least recently used files of a set of namespaces
(a tenant's, for the server's tenant quotas; the tier itself knows no tenants and decides
nothing: see :mod:`tierkv.server.tiering.tier_quotas`).

At start the index is rebuilt from ``os.scandir`` (sizes and mtimes, no file is opened);
leftover temporary files, files with foreign names inside the fan-out directories and
anything but a regular file under a chunk's name are removed, and headers are verified
lazily, on load.

Degradation. A write that fails because the medium cannot take writes (ENOSPC, EDQUOT,
EROFS, EACCES, EPERM, ENOTDIR) disables *writes* with one log line at ERROR: stores return
False at once, while chunks already on disk stay readable (a full disk still holds a valid
cache). Every ``retry_interval`` seconds (30 by default) one store is let through as a probe;
when it succeeds writes are enabled again. A directory that cannot be created at start
disables the tier the same way instead of failing the server.

Parallel I/O. A batch of stores or loads is spread over ``threads`` threads (default: the
cores, at most 4; see :mod:`tierkv.copier`) of lowered priority (:mod:`tierkv.priority`;
the tier thread that called only waits): each chunk is one file, and one thread copies and
checksums less than page-cache I/O can do (the checksum is in series with the copy), so two
threads reach it. Pieces keep each system call short (:mod:`tierkv.piecewise_io`): a control
thread woken meanwhile gets a core after a piece, not after a whole chunk.

Concurrency. All methods may be called from several threads. One lock guards the index,
the per-key busy markers and the counters, and is never held across file I/O. A key is at
any moment in at most one of: the index (its file is complete and readable) or ``busy`` (one
thread is writing or removing its file), so no two threads ever write or unlink the same
name. Index entries carry a generation, so a load that found a file missing or corrupt only
drops the entry it read, never one a later store put there.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import logging
import os
import re
import shutil
import stat
import threading
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tierkv.copier import Copier
from tierkv.keys import KEY_SIZE
from tierkv.options import OptionError, Size, parse_size
from tierkv.piecewise_io import read_hashed, write_hashed
from tierkv.tiers.base import (
    HEADER_SIZE,
    LoadStatus,
    Tier,
    TierError,
    TierUsage,
    byte_view,
    pack_header,
    register_tier,
    unpack_header,
    verify,
)
from tierkv.tiers.disk_index import DiskIndex

log = logging.getLogger(__name__)

SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
LOCK_NAME = ".tierkv-disk.lock"
DEFAULT_CAPACITY = 10 * 2**30
DEFAULT_RETRY_INTERVAL = 30.0

_NAME_RE = re.compile(r"[0-9a-f]{64}\.kv\Z")
_FANOUT_RE = re.compile(r"[0-9a-f]{2}\Z")
# The medium refuses writes (full, read-only, no permission, path not a directory): disable
# writes and re-probe later instead of failing (and logging) every chunk.
_DEGRADE_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR}
)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# Loads open chunk files without following a symbolic link and without blocking on a FIFO
# (no effect on a regular file); fstat then tells what was opened.
_O_LOAD = os.O_RDONLY | _O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
_CORRUPT_LOG_LIMIT = 10  # corrupt files logged at WARNING; later ones at DEBUG (see stats)

_STORE = "store"
_REMOVE = "remove"


@dataclass(frozen=True, slots=True)
class DiskTierStats:
    """A snapshot of the disk tier's counters (for metrics and ``/status``)."""

    objects: int
    bytes_used: int
    capacity: int
    stores: int  # chunks written
    store_bytes: int
    store_skipped: int  # already held (or being stored by another thread)
    store_failed: int  # not written: too big, no room, writes disabled, I/O error
    loads: int  # loads that returned OK
    load_bytes: int
    misses: int
    corrupt: int  # loads that returned CORRUPT
    errors: int  # OSErrors on any path (store, load, remove)
    evictions: int
    evicted_bytes: int
    deletes: int
    removed_at_start: int  # leftover temporary files, foreign names, headerless, not files
    writes_disabled: bool
    disabled_reason: str


class _Counters:
    __slots__ = (
        "corrupt",
        "deletes",
        "errors",
        "evicted_bytes",
        "evictions",
        "load_bytes",
        "loads",
        "misses",
        "removed_at_start",
        "store_bytes",
        "store_failed",
        "store_skipped",
        "stores",
    )

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)

    stores: int
    store_bytes: int
    store_skipped: int
    store_failed: int
    loads: int
    load_bytes: int
    misses: int
    corrupt: int
    errors: int
    evictions: int
    evicted_bytes: int
    deletes: int
    removed_at_start: int


def _byte_view(view: memoryview | bytes | bytearray) -> memoryview:
    """:func:`byte_view`, contiguous (what ``writev``/``readv`` and the checksum need)."""
    data = byte_view(view)
    if not data.c_contiguous:
        raise TypeError("memoryview is not C-contiguous")  # the caller reports it
    return data


def _remove_path(path: str) -> None:
    """Remove what is at ``path``: a file, a symbolic link or FIFO, or a directory tree
    (something that took a chunk's name; the fan-out directories hold nothing else of
    value)."""
    try:
        os.unlink(path)
    except IsADirectoryError:
        shutil.rmtree(path)
    except PermissionError:  # what unlink() of a directory gives on some systems
        if not os.path.isdir(path) or os.path.islink(path):
            raise
        shutil.rmtree(path)


class DiskTier(Tier):
    """Chunks as files under ``path``, at most ``capacity`` bytes, least recently used out.

    Options (all keyword): ``path`` (directory, created if missing), ``capacity`` (bytes,
    an int or a size string such as ``"100GiB"``; header bytes count), ``fsync`` (fsync
    each file and its directory before a store returns; default off, the rename alone
    already guarantees that a chunk's name never shows a torn file), ``retry_interval``
    (seconds between write probes while writes are disabled), ``threads`` (files read or
    written at once within a batch; default: the cores, at most 4).
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
        self._disabled = ""  # why writes are disabled ("" = enabled)
        self._next_probe = 0.0
        self._probing = False
        self._closed = False
        self._lock_fd: int | None = None
        self._c = _Counters()
        self._logged_errnos: set[tuple[str, int]] = set()

        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as exc:
            self._disable(f"cannot create {self.path}: {exc.strerror or exc}")
            return
        self._take_dir_lock()
        self._rebuild()
        self._check_free_space()

    # -- Tier interface --------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            index = self._index
            return [key in index for key in keys]

    def store(self, items: Sequence[tuple[bytes, memoryview]]) -> list[bool]:
        done = [False] * len(items)

        def one(i: int) -> None:
            done[i] = self._store_one(*items[i])

        self._batch.run(one, range(len(items)), [v.nbytes for _, v in items])
        return done

    def load(self, items: Sequence[tuple[bytes, memoryview]]) -> list[LoadStatus]:
        statuses = [LoadStatus.ERROR] * len(items)

        def one(i: int) -> None:
            statuses[i] = self._load_one(*items[i])

        self._batch.run(one, range(len(items)), [v.nbytes for _, v in items])
        return statuses

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
            picked = [key for key, _ in victims]
            for key in picked:
                self._busy[key] = _REMOVE
            self._c.evictions += len(victims)
            self._c.evicted_bytes += sum(size for _, size in victims)
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
            c = self._c
            return DiskTierStats(
                objects=len(self._index),
                bytes_used=self._index.nbytes,
                capacity=self.capacity,
                stores=c.stores,
                store_bytes=c.store_bytes,
                store_skipped=c.store_skipped,
                store_failed=c.store_failed,
                loads=c.loads,
                load_bytes=c.load_bytes,
                misses=c.misses,
                corrupt=c.corrupt,
                errors=c.errors,
                evictions=c.evictions,
                evicted_bytes=c.evicted_bytes,
                deletes=c.deletes,
                removed_at_start=c.removed_at_start,
                writes_disabled=bool(self._disabled),
                disabled_reason=self._disabled,
            )

    @property
    def writes_disabled(self) -> bool:
        return bool(self._disabled)

    def file_path(self, key: bytes) -> str:
        """Where ``key``'s chunk lives (whether or not it is held)."""
        h = key.hex()
        return f"{self.path}/{h[32:34]}/{h[34:36]}/{h}{SUFFIX}"

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
                if busy == _STORE:  # another thread is writing the same chunk
                    self._c.store_skipped += 1
                    return True
                self._c.store_failed += 1
                return False
            if size > self.capacity or not self._may_write_locked():
                self._c.store_failed += 1
                return False
            probe = bool(self._disabled)  # this store is the one write probe
            victims = self._make_room_locked(size)
            if victims is None:  # in-flight stores hold the rest of the capacity
                self._probing = False
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
                    self._probing = False
            self._write_failed(exc, key)
            return False

        recovered = False
        with self._lock:
            self._reserved -= size
            cancelled = key in self._cancelled
            if not cancelled:
                del self._busy[key]
                self._index.add(key, size)
                self._c.stores += 1
                self._c.store_bytes += data.nbytes
            else:
                self._cancelled.discard(key)
            if probe and self._disabled:
                recovered, self._disabled, self._probing = True, "", False
        if recovered:
            log.info("disk tier %s: writes work again; re-enabled", self.path)
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
        victims = self._index.pop_oldest(excess)
        for key, _ in victims:
            self._busy[key] = _REMOVE
        self._c.evictions += len(victims)
        self._c.evicted_bytes += sum(size for _, size in victims)
        return [key for key, _ in victims]

    def _may_write_locked(self) -> bool:
        """Whether this store may write; while writes are disabled, claims the one probe."""
        if self._closed:
            return False
        if not self._disabled:
            return True
        if self._probing or time.monotonic() < self._next_probe:
            return False
        self._probing = True
        return True

    def _write_file(self, path: str, tmp: str, key: bytes, data: memoryview) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o600)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(tmp, flags, 0o600)
        try:
            try:
                # The payload first, hashed as it goes out, then the header that holds the
                # checksum (the file has its final name only once both are written).
                digest = write_hashed(fd, data, HEADER_SIZE)
                if os.pwrite(fd, pack_header(key, data, digest), 0) != HEADER_SIZE:
                    raise OSError(errno.EIO, "short write of the record header")
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.replace(tmp, path)
            except IsADirectoryError:
                # A directory took the chunk's name: not ours to keep, and it would refuse
                # this chunk for good. (Files, links and FIFOs are simply replaced.)
                log.warning("disk tier: removing the directory at chunk path %s", path)
                _remove_path(path)
                os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError as exc:
                log.debug("disk tier: could not remove %s: %s", tmp, exc)
            raise
        if self.fsync:
            # The chunk is complete under its name now; if the rename cannot be made durable
            # it is still a valid chunk (and a lost rename after a crash is just a miss).
            try:
                dfd = os.open(os.path.dirname(path), os.O_RDONLY | _O_CLOEXEC)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
            except OSError as exc:
                with self._lock:
                    self._c.errors += 1
                self._log_error("directory fsync", exc, key)

    def _write_failed(self, exc: Exception, key: bytes) -> None:
        with self._lock:
            self._c.store_failed += 1
            self._c.errors += 1
        if isinstance(exc, OSError) and exc.errno in _DEGRADE_ERRNOS:
            self._disable(f"{exc.strerror or exc} ({errno.errorcode.get(exc.errno or 0, '?')})")
        else:
            self._log_error("store", exc, key)

    def _disable(self, reason: str) -> None:
        with self._lock:
            first = not self._disabled
            self._disabled = reason
            self._next_probe = time.monotonic() + self.retry_interval
            self._probing = False
        if first:
            log.error(
                "disk tier %s: writes disabled: %s. Chunks already on disk stay readable; "
                "new chunks are not kept on disk. Retrying every %gs.",
                self.path,
                reason,
                self.retry_interval,
            )
        else:
            log.debug("disk tier %s: write probe failed: %s", self.path, reason)

    # -- load ------------------------------------------------------------------------------
    def _load_one(self, key: bytes, view: memoryview) -> LoadStatus:
        try:
            data = _byte_view(view)
            if data.readonly:
                raise TypeError("load needs a writable view")
        except (TypeError, ValueError) as exc:
            with self._lock:
                self._c.errors += 1
            self._log_error("load", exc, key)
            return LoadStatus.ERROR
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                self._c.misses += 1
                return LoadStatus.MISSING
            self._index.touch(key)
        gen = entry[1]
        path = self.file_path(key)
        try:
            fd = os.open(path, _O_LOAD)
        except FileNotFoundError:
            self._forget(key, gen)  # removed behind our back
            with self._lock:
                self._c.misses += 1
            return LoadStatus.MISSING
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
                return self._corrupt(key, gen, "a symbolic link, not a chunk file")
            return self._load_error(exc, key)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return self._corrupt(key, gen, "not a regular file")
            # The size the file has now, not the one it was indexed with: the same rule as
            # after a restart, when the index is built from the sizes found.
            size = st.st_size
            if size != HEADER_SIZE + data.nbytes:
                return self._length_mismatch(fd, key, gen, data.nbytes, size)
            hdr = os.pread(fd, HEADER_SIZE, 0)
            got, digest = read_hashed(fd, data, HEADER_SIZE)
            if len(hdr) < HEADER_SIZE or got < data.nbytes:
                got += len(hdr)
                return self._corrupt(key, gen, f"truncated ({got} of {size} bytes)")
            status = verify(unpack_header(hdr), key, data, digest)
            if status is not LoadStatus.OK:
                return self._corrupt(key, gen, self._describe(hdr, key, data.nbytes))
            with contextlib.suppress(OSError):  # best effort; fails on a read-only disk
                os.utime(fd)  # recency survives a restart
        except OSError as exc:
            return self._load_error(exc, key)
        finally:
            os.close(fd)
        with self._lock:
            self._c.loads += 1
            self._c.load_bytes += data.nbytes
        return LoadStatus.OK

    def _length_mismatch(self, fd: int, key: bytes, gen: int, want: int, size: int) -> LoadStatus:
        """The slot is not the chunk's size: keep the file if it is itself consistent."""
        header = unpack_header(os.pread(fd, HEADER_SIZE, 0))
        if header is None or header.key != key or header.length + HEADER_SIZE != size:
            return self._corrupt(key, gen, f"bad header or size ({size} bytes on disk)")
        with self._lock:
            self._c.corrupt += 1
        log.debug(
            "disk tier: %s holds %d payload bytes, load asked for %d; reporting CORRUPT, "
            "keeping the file",
            key.hex(),
            header.length,
            want,
        )
        return LoadStatus.CORRUPT

    @staticmethod
    def _describe(hdr: bytes, key: bytes, length: int) -> str:
        header = unpack_header(hdr)
        if header is None:
            return "bad magic or version"
        if header.key != key:
            return f"header is for key {header.key.hex()[:16]}..."
        if header.length != length:
            return f"header length {header.length}, file holds {length}"
        return "checksum mismatch"

    def _corrupt(self, key: bytes, gen: int, why: str) -> LoadStatus:
        with self._lock:
            self._c.corrupt += 1
            n = self._c.corrupt
        level = logging.WARNING if n <= _CORRUPT_LOG_LIMIT else logging.DEBUG
        log.log(level, "disk tier: corrupt chunk %s (%s); removed", self.file_path(key), why)
        if n == _CORRUPT_LOG_LIMIT:
            log.warning("disk tier: further corrupt chunks are logged at DEBUG (see stats)")
        self._forget(key, gen, unlink=True)
        return LoadStatus.CORRUPT

    def _load_error(self, exc: OSError, key: bytes) -> LoadStatus:
        with self._lock:
            self._c.errors += 1
        self._log_error("load", exc, key)
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
                _remove_path(self.file_path(key))
            except FileNotFoundError:
                pass
            except OSError as exc:
                errors += 1
                self._log_error("remove", exc, key)
        with self._lock:
            for key in keys:
                self._busy.pop(key, None)
            self._c.errors += errors

    def _log_error(self, op: str, exc: Exception, key: bytes) -> None:
        """Log the first error of each kind per operation at WARNING, repeats at DEBUG."""
        code = exc.errno if isinstance(exc, OSError) and exc.errno is not None else -1
        with self._lock:
            first = (op, code) not in self._logged_errnos
            self._logged_errnos.add((op, code))
        level = logging.WARNING if first else logging.DEBUG
        suffix = " (repeats are logged at DEBUG)" if first else ""
        log.log(level, "disk tier %s: %s of %s failed: %s%s", self.path, op, key.hex(), exc, suffix)

    def _count_failed(self, message: str) -> None:
        with self._lock:
            self._c.store_failed += 1
            first = ("store", -2) not in self._logged_errnos
            self._logged_errnos.add(("store", -2))
        log.log(logging.WARNING if first else logging.DEBUG, "disk tier: %s", message)

    # -- start-up --------------------------------------------------------------------------
    def _take_dir_lock(self) -> None:
        lock_path = os.path.join(self.path, LOCK_NAME)
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | _O_CLOEXEC, 0o600)
        except OSError as exc:
            # A read-only directory: nothing to protect from a second writer.
            log.debug("disk tier: no lock file %s: %s", lock_path, exc)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            finally:
                os.close(fd)
            raise TierError(
                f"disk tier directory {self.path} is in use by another tierkv server "
                f"(pid {holder}); give each server its own disk path"
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass
        self._lock_fd = fd

    def _rebuild(self) -> None:
        """Index the chunk files under ``path`` (LRU order by mtime); remove leftovers."""
        started = time.monotonic()
        found: list[tuple[int, bytes, int]] = []  # (mtime_ns, key, size)
        junk: list[str] = []
        for d1 in self._scan(self.path):
            if not (_FANOUT_RE.match(d1.name) and d1.is_dir(follow_symlinks=False)):
                continue  # the lock file, or something that is not ours: leave it alone
            for d2 in self._scan(d1.path):
                if not (_FANOUT_RE.match(d2.name) and d2.is_dir(follow_symlinks=False)):
                    if not d2.is_dir(follow_symlinks=False):
                        junk.append(d2.path)
                    continue
                fanout = d1.name + d2.name
                for f in self._scan(d2.path):
                    name = f.name
                    if f.is_dir(follow_symlinks=False):
                        if _NAME_RE.match(name):
                            junk.append(f.path)  # in a chunk's way: a store would fail
                        continue
                    if not (_NAME_RE.match(name) and name[32:36] == fanout):
                        junk.append(f.path)  # temporary file, or a name that is not a key
                        continue
                    try:
                        st = f.stat(follow_symlinks=False)
                    except OSError:
                        continue  # vanished
                    if not f.is_file(follow_symlinks=False) or st.st_size < HEADER_SIZE:
                        junk.append(f.path)  # torn before its header, or not a file
                        continue
                    found.append((st.st_mtime_ns, bytes.fromhex(name[:64]), st.st_size))
        removed = 0
        for path in junk:
            try:
                _remove_path(path)
                removed += 1
            except OSError as exc:
                log.debug("disk tier: could not remove leftover %s: %s", path, exc)
        found.sort()
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

    def _scan(self, path: str) -> list[os.DirEntry[str]]:
        try:
            with os.scandir(path) as it:
                return list(it)
        except OSError as exc:
            log.warning("disk tier: cannot scan %s: %s", path, exc)
            return []

    def _check_free_space(self) -> None:
        try:
            free = shutil.disk_usage(self.path).free
        except OSError:
            return
        if self._index.nbytes + free < self.capacity:
            log.warning(
                "disk tier %s: capacity %d bytes exceeds what the filesystem can hold "
                "(%d held + %d free); writes will stop when it fills",
                self.path,
                self.capacity,
                self._index.nbytes,
                free,
            )


register_tier("disk", DiskTier)
