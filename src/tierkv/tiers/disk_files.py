"""The disk tier's directory: where each chunk's file lives, how a record file is written
and replaced, what a start finds there, and the lock that keeps one server per directory.

Layout. ``<path>/<aa>/<bb>/<64 hex digits of the key>.kv``, where ``aa`` and ``bb`` are the
first two bytes of the key's *chunk-hash* half (bytes 16 and 17). The first half of a key is
the namespace digest, the same for every chunk of an engine, so fanning out by it would put
all of an engine's chunks in one directory. Each file is the 64-byte record header of
:mod:`tierkv.tiers.records` followed by the payload. ``<path>/.tierkv-disk.lock`` is held
(``flock``) while a tier uses the directory, so two servers never share one.

A record file is written to a temporary file next to its final name (its blocks reserved
first in one ``fallocate`` where the filesystem supports it:
:func:`tierkv.piecewise_io.preallocate`; then the payload, hashed piece by piece as it goes
out, behind a zeroed header written in the same call as its first piece so that every piece
is aligned in the file; then the header with the checksum),
optionally ``fsync``-ed, then ``os.replace``-d into place: a torn write is never visible
under a chunk's name.

A record file is read into the caller's slot and verified against the size the file has
*now* (``fstat``), not the size it was indexed with, so bytes appended to a file make it
corrupt whether they were added while the tier ran or before it started. Whatever is at a
chunk's name and is not a regular file (a directory, a symbolic link, a FIFO) is not a
chunk.

A scan at start (``os.scandir``: names, sizes and mtimes; no file is opened) lists the chunk
files and the leftovers to remove: temporary files, foreign names inside the fan-out
directories, and anything but a regular file under a chunk's name.

No state and no lock here: :class:`tierkv.tiers.disk.DiskTier` decides when each runs.
Lines are logged under the disk tier's logger (``tierkv.tiers.disk``), as before the split.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import stat
from typing import NamedTuple

from tierkv.piecewise_io import preallocate, read_hashed, write_hashed
from tierkv.tiers.base import LoadStatus, TierError
from tierkv.tiers.records import HEADER_SIZE, pack_header, unpack_header, verify, whole_record

log = logging.getLogger("tierkv.tiers.disk")

SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
LOCK_NAME = ".tierkv-disk.lock"

_NO_HEADER = bytes(HEADER_SIZE)  # a tmp file's first bytes until its header is written
_NAME_RE = re.compile(r"[0-9a-f]{64}\.kv\Z")
_FANOUT_RE = re.compile(r"[0-9a-f]{2}\Z")
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# Loads open chunk files without following a symbolic link and without blocking on a FIFO
# (no effect on a regular file); fstat then tells what was opened.
O_LOAD = os.O_RDONLY | O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def chunk_path(root: str, key: bytes) -> str:
    """Where ``key``'s chunk file lives under ``root`` (whether or not it is held)."""
    h = key.hex()
    return f"{root}/{h[32:34]}/{h[34:36]}/{h}{SUFFIX}"


def remove_path(path: str) -> None:
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


def write_record(path: str, tmp: str, key: bytes, data: memoryview, fsync: bool) -> OSError | None:
    """Write ``data``'s record to ``tmp`` and rename it to ``path``; on failure ``tmp`` is
    removed and the error raised. With ``fsync`` the file and then its directory are synced;
    a directory that could not be synced is returned (the chunk is complete under its name
    all the same, and a rename lost in a crash is just a miss)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o600)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(tmp, flags, 0o600)
    try:
        try:
            # The record's blocks in one go (a refused space raises here, before any write).
            preallocate(fd, HEADER_SIZE + data.nbytes)
            # The payload first (behind a placeholder for the header, written with its first
            # piece), hashed as it goes out, then the header that holds the checksum (the
            # file has its final name only once both are written).
            digest = write_hashed(fd, data, HEADER_SIZE, _NO_HEADER)
            if os.pwrite(fd, pack_header(key, data, digest), 0) != HEADER_SIZE:
                raise OSError(errno.EIO, "short write of the record header")
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.replace(tmp, path)
        except IsADirectoryError:
            # A directory took the chunk's name: not ours to keep, and it would refuse
            # this chunk for good. (Files, links and FIFOs are simply replaced.)
            log.warning("disk tier: removing the directory at chunk path %s", path)
            remove_path(path)
            os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError as exc:
            log.debug("disk tier: could not remove %s: %s", tmp, exc)
        raise
    if not fsync:
        return None
    try:
        dfd = os.open(os.path.dirname(path), os.O_RDONLY | O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as exc:
        return exc
    return None


class Damage(NamedTuple):
    """What :func:`read_record` found wrong with a record file."""

    why: str  # for the log line
    keep: bool  # the record is whole, only not of the slot's size: the file stays


def read_record(path: str, key: bytes, data: memoryview) -> Damage | None:
    """Fill ``data`` with ``key``'s payload from its record file at ``path`` and verify it;
    None when ``data`` now holds the chunk (the file's mtime is bumped, so its recency
    survives a restart). A missing file raises FileNotFoundError, an I/O error OSError."""
    try:
        fd = os.open(path, O_LOAD)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
            return Damage("a symbolic link, not a chunk file", keep=False)
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return Damage("not a regular file", keep=False)
        # The size the file has now, not the one it was indexed with: the same rule as
        # after a restart, when the index is built from the sizes found.
        size = st.st_size
        if size != HEADER_SIZE + data.nbytes:
            return _length_mismatch(fd, key, data.nbytes, size)
        hdr = os.pread(fd, HEADER_SIZE, 0)
        got, digest = read_hashed(fd, data, HEADER_SIZE)
        if len(hdr) < HEADER_SIZE or got < data.nbytes:
            got += len(hdr)
            return Damage(f"truncated ({got} of {size} bytes)", keep=False)
        if verify(unpack_header(hdr), key, data, digest) is not LoadStatus.OK:
            return Damage(describe_mismatch(hdr, key, data.nbytes), keep=False)
        with contextlib.suppress(OSError):  # best effort; fails on a read-only disk
            os.utime(fd)  # recency survives a restart
        return None
    finally:
        os.close(fd)


def _length_mismatch(fd: int, key: bytes, want: int, size: int) -> Damage:
    """The slot is not the chunk's size: keep the file if it is itself consistent."""
    header = unpack_header(os.pread(fd, HEADER_SIZE, 0))
    if header is None or not whole_record(header, key, size):
        return Damage(f"bad header or size ({size} bytes on disk)", keep=False)
    log.debug(
        "disk tier: %s holds %d payload bytes, load asked for %d; reporting CORRUPT, "
        "keeping the file",
        key.hex(),
        header.length,
        want,
    )
    return Damage("", keep=True)


def describe_mismatch(hdr: bytes, key: bytes, length: int) -> str:
    """Why the record header ``hdr`` read for ``key`` (``length`` payload bytes on disk)
    failed verification, for the log line."""
    header = unpack_header(hdr)
    if header is None:
        return "bad magic or version"
    if header.key != key:
        return f"header is for key {header.key.hex()[:16]}..."
    if header.length != length:
        return f"header length {header.length}, file holds {length}"
    return "checksum mismatch"


def scan_chunks(root: str) -> tuple[list[tuple[int, bytes, int]], list[str]]:
    """The chunk files under ``root`` as (mtime_ns, key, size), oldest first, and the
    leftover paths to remove."""
    found: list[tuple[int, bytes, int]] = []
    junk: list[str] = []
    for d1 in _scan(root):
        if not (_FANOUT_RE.match(d1.name) and d1.is_dir(follow_symlinks=False)):
            continue  # the lock file, or something that is not ours: leave it alone
        for d2 in _scan(d1.path):
            if not (_FANOUT_RE.match(d2.name) and d2.is_dir(follow_symlinks=False)):
                if not d2.is_dir(follow_symlinks=False):
                    junk.append(d2.path)
                continue
            fanout = d1.name + d2.name
            for f in _scan(d2.path):
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
    found.sort()
    return found, junk


def remove_leftovers(paths: list[str]) -> int:
    """Remove the leftovers :func:`scan_chunks` listed; how many were removed."""
    removed = 0
    for path in paths:
        try:
            remove_path(path)
            removed += 1
        except OSError as exc:
            log.debug("disk tier: could not remove leftover %s: %s", path, exc)
    return removed


def _scan(path: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError as exc:
        log.warning("disk tier: cannot scan %s: %s", path, exc)
        return []


def take_directory_lock(root: str) -> int | None:
    """Lock ``root`` for this process (its pid written to the lock file); the descriptor
    that holds the lock (closing it releases it), or None where no lock file can be made (a
    read-only directory: nothing to protect from a second writer). Raises
    :class:`~tierkv.tiers.base.TierError` while another server holds it."""
    lock_path = os.path.join(root, LOCK_NAME)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | O_CLOEXEC, 0o600)
    except OSError as exc:
        log.debug("disk tier: no lock file %s: %s", lock_path, exc)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        finally:
            os.close(fd)
        raise TierError(
            f"disk tier directory {root} is in use by another tierkv server "
            f"(pid {holder}); give each server its own disk path"
        ) from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass
    return fd


def warn_if_over_free_space(root: str, held: int, capacity: int) -> None:
    """Warn when ``capacity`` exceeds what the filesystem of ``root`` can hold."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return
    if held + free < capacity:
        log.warning(
            "disk tier %s: capacity %d bytes exceeds what the filesystem can hold "
            "(%d held + %d free); writes will stop when it fills",
            root,
            capacity,
            held,
            free,
        )
