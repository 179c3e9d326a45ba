"""Bulk I/O in pieces: no system call here moves more than :data:`PIECE` bytes (a chunk
file's writes: :data:`FILE_PIECE`).

Most server kernels are built without kernel preemption (``CONFIG_PREEMPT_NONE``, or
voluntary): a CPU switches to a thread that was just woken only when the running thread
leaves the kernel or reaches one of its rare rescheduling points. One ``readv`` of a whole
8 MiB chunk from the page cache, or one ``sendmsg``/``recv_into`` of it, copies for 1 to 4
ms in one go, and a LOOKUP's RPC thread woken meanwhile waits for the copy to end, whatever
the two threads' priorities (measured on the CI machine type: a normal-priority thread
woken while two lowered threads read 8 MiB at a time from the page cache waited 0.9 ms at
the median; with 1 MiB reads 0.14 ms, with 256 KiB 0.09 ms). So the tiers and the peer data
plane move chunks in pieces of :data:`PIECE` bytes: the calls cost a few microseconds more
per chunk, and the kernel gets a chance to switch after each piece; a data thread also
gives way after each (:func:`tierkv.priority.give_way`), so that a woken control thread gets
the core then rather than at the end of the data thread's time slice.

The checksum (:func:`tierkv.checksums.checksum`, XXH3-128) is computed piece by piece, while
the piece is in the CPU's caches, instead of in a second pass over the whole chunk: a piece
to write just before it is written (the kernel's copy then reads it from the caches), a
piece read right after it has landed.

Where the C helper ``tierkv._piecewise`` was built (:data:`NATIVE`), the same loops run in
C without the GIL: the Python loops take and drop it several times a piece (a peer fetch's
four streams on two cores took 123-148 ms each for 64 MiB with them, 87-95 ms in C). A file
whose bytes are all in the page cache is read mapped there: copied with streaming stores
and hashed in the same pass (each 64-byte stripe from the registers it was copied through;
each piece from the caches where the CPU lacks AVX2 or the destination is not aligned).
``os.preadv``'s copy leaves neither side of a large copy in the caches, so hashing after it
reads the chunk from memory again: 0.58-0.71 of a plain read's speed with the checksum,
against 0.88-0.96 mapped (8 MiB chunks, two threads, the CI machine type; 1.10-1.33 on
its AVX2-only EPYC variant, see ``_piecewise.c``). A read from the
device, or a file that changes under the copy, goes the ``os.preadv`` way. Sockets that are
not plain ``socket.socket`` objects (TLS, test doubles) take the Python loops.
"""

from __future__ import annotations

import errno
import os
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable, Sequence

import xxhash

from tierkv.checksums import checksummer
from tierkv.framing import drop_sent
from tierkv.priority import give_way, is_data_thread

_write_native: Callable[[int, int, memoryview, int, bool, bytes], bytes] | None
_read_mapped: Callable[[int, int, memoryview, int, bool, bool], bytes | None] | None
# (fd, parts, piece, give_way, timeout[, deadline]: not in a stale build, see _SEND_DEADLINE)
_send_native: Callable[..., None] | None
_recv_native: Callable[[int, memoryview, int, bool, float | None, float], bytes] | None
_preallocate: Callable[[int, int], bool] | None
try:
    from tierkv._piecewise import preallocate as _preallocate
    from tierkv._piecewise import read_hashed as _read_mapped
    from tierkv._piecewise import recv_hashed as _recv_native
    from tierkv._piecewise import send_pieces as _send_native
    from tierkv._piecewise import write_hashed as _write_native
except ImportError:  # built without a C compiler or libxxhash's headers
    _write_native = _read_mapped = _send_native = _recv_native = _preallocate = None

PIECE = 512 * 1024  # bytes per system call: about 0.1 ms of copying; half a core's L2
# Bytes per write(2) of a chunk file (the one exception to PIECE): the page cache holds what a
# write brings in folios no larger than the write, and a mapped read of 2 MiB folios (one
# page-table entry each) copies far faster than of 512 KiB ones (mapped 4 KiB at a time:
# 2048 entries per 8 MiB chunk, populated and torn down again by every read): 8 MiB
# chunk files read at 12.1-12.7 GB/s against 8.9 (two threads, the AVX2-only EPYC VM type;
# a plain read(2) of the same files 9.5-10). A 2 MiB write copies for about 0.2 ms in one
# go, during which a woken control thread waits (see above): a write of a chunk is a
# background job, its read serves a request.
FILE_PIECE = 2 * 1024 * 1024
HASH_STEP = 256 * 1024  # received bytes hashed at once
NATIVE = _write_native is not None  # whether the C helper moves the bytes (see above)
# A C helper built before send_pieces took a deadline (a stale build) sends by the Python loop.
_SEND_DEADLINE = _send_native is not None and "deadline" in (_send_native.__doc__ or "")


# -- files -------------------------------------------------------------------------------
def preallocate(fd: int, length: int) -> bool:
    """Reserve the first ``length`` bytes of ``fd`` (a file about to be written whole; its
    size becomes ``length``) in one fallocate(2): on ext4 the writes that follow then skip
    reserving blocks page by page, 30-50 % faster for a chunk file (see ``_piecewise.c``).
    False, with nothing done, where the filesystem cannot or the C helper is not built (never
    a fallback that writes zeros); OSError where the space is refused (ENOSPC, EDQUOT)."""
    if _preallocate is None:
        return False
    return _preallocate(fd, length)


def write_hashed(fd: int, data: memoryview, offset: int, head: bytes = b"") -> bytes:
    """Write ``data`` (bytes) at ``offset`` of ``fd`` in pieces, resuming after short writes;
    returns the checksum of ``data``, computed piece by piece as it was written. ``head``
    (empty, or ``offset`` bytes: a placeholder for a header the caller writes afterwards)
    goes out at 0 in the same call as the first piece, so that every piece of the file,
    the first too, is written whole and aligned (see :data:`FILE_PIECE`)."""
    if head and len(head) != offset:
        raise ValueError(f"head is {len(head)} bytes, not the offset {offset}")
    if _write_native is not None:
        return _write_native(fd, offset, data, FILE_PIECE, is_data_thread(), head)
    hasher = checksummer()
    pos = hashed = head_done = 0
    n = data.nbytes
    while pos < n or head_done < len(head):
        # Pieces end at multiples of FILE_PIECE in the file (the first is shorter by
        # ``offset``, unless ``head`` fills that): the page cache then holds the file in large
        # aligned folios, which a mapped read (tierkv._piecewise) maps and copies faster than
        # smaller ones. Each is hashed just before it is written (the write then copies it
        # from the caches).
        end = min(n, pos + FILE_PIECE - (offset + pos) % FILE_PIECE)
        if hashed < end:
            hasher.update(data[hashed:end])
            hashed = end
        head_left = len(head) - head_done
        if head_left:
            wrote = os.pwritev(fd, [head[head_done:], data[pos:end]], head_done)
        else:
            wrote = os.pwrite(fd, data[pos:end], offset + pos)
        if wrote <= 0:
            raise OSError(errno.EIO, "short write")
        of_head = min(wrote, head_left)
        head_done += of_head
        pos += wrote - of_head
        give_way()
    digest: bytes = hasher.digest()
    return digest


def read_hashed(fd: int, data: memoryview, offset: int) -> tuple[int, bytes]:
    """Fill ``data`` from ``offset`` of ``fd`` in pieces until it is full or the file ends;
    the bytes read and the checksum of what was read, computed piece by piece."""
    if _read_mapped is not None and data.nbytes:
        mapped = _read_mapped(fd, offset, data, PIECE, True, is_data_thread())
        if mapped is not None:
            return data.nbytes, mapped
    hasher = checksummer()
    pos, n = 0, data.nbytes
    while pos < n:
        got = os.preadv(fd, [data[pos : min(n, pos + PIECE)]], offset + pos)
        if got == 0:
            break  # EOF: the file is shorter than expected
        hasher.update(data[pos : pos + got])
        pos += got
        give_way()
    digest: bytes = hasher.digest()
    return pos, digest


# -- sockets ------------------------------------------------------------------------------
def send_all(
    sock: socket.socket, parts: Sequence[memoryview | bytes], deadline: float = 0.0
) -> None:
    """``sendmsg`` the parts (no copy in user space; ``send`` on a TLS socket) at most
    :data:`PIECE` bytes a call, continuing after partial sends. ``deadline``
    (``time.monotonic()``; 0: none): the whole send ends by then (TimeoutError), however
    slowly the peer takes the bytes; the socket's timeout bounds each wait for room."""
    # (not TLS, not a wrapper; and where a deadline is given, a build that takes one)
    native = type(sock) is socket.socket and (_SEND_DEADLINE or not deadline)
    if _send_native is not None and native:
        extra = (deadline,) if _SEND_DEADLINE else ()
        _send_native(sock.fileno(), parts, PIECE, is_data_thread(), sock.gettimeout(), *extra)
        return
    views = deque(memoryview(p).cast("B") for p in parts if len(p))
    timeout = sock.gettimeout()
    tls = isinstance(sock, ssl.SSLSocket)
    try:
        while views:
            batch: list[memoryview] = []
            room = PIECE
            for view in views:
                batch.append(view[:room])
                room -= len(batch[-1])
                if not room:
                    break
            _bound_wait(sock, timeout, deadline)
            # (no sendmsg on TLS sockets)
            drop_sent(views, sock.send(batch[0]) if tls else sock.sendmsg(batch))
            give_way()
    finally:
        if deadline:
            sock.settimeout(timeout)


def _bound_wait(sock: socket.socket, timeout: float | None, deadline: float) -> None:
    """Before a socket call: its wait shortened to what is left until ``deadline`` (0:
    none; TimeoutError once it has passed); ``timeout``: the socket's own."""
    if deadline:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        sock.settimeout(left if timeout is None else min(timeout, left))


def recv_exact(sock: socket.socket, view: memoryview, deadline: float = 0.0) -> None:
    """Fill ``view`` from ``sock`` at most :data:`PIECE` bytes a call. ``deadline`` (as in
    :func:`recv_hashed`): the whole fill ends by then (TimeoutError); the socket's timeout
    is given back afterwards."""
    _fill(sock, view, deadline, None)


def recv_hashed(
    sock: socket.socket,
    view: memoryview,
    hasher: xxhash.xxh3_128 | None = None,
    deadline: float = 0.0,
) -> bytes:
    """Fill ``view`` (bytes) from ``sock`` at most :data:`PIECE` bytes a call and return its
    checksum, hashing what arrived as soon as :data:`HASH_STEP` bytes have (a receive often
    returns less than asked). ``hasher``: a running checksum to go on from (of the bytes
    before ``view``; the digest then covers both). ``deadline`` (``time.monotonic()``; 0:
    none): the whole fill ends by then (TimeoutError), however slowly the bytes come; the
    socket's timeout bounds each wait for them."""
    if _recv_native is not None and hasher is None and type(sock) is socket.socket:
        timeout = sock.gettimeout()
        return _recv_native(sock.fileno(), view, PIECE, is_data_thread(), timeout, deadline)
    hasher = checksummer() if hasher is None else hasher
    _fill(sock, view, deadline, hasher)
    digest: bytes = hasher.digest()
    return digest


def _fill(
    sock: socket.socket, view: memoryview, deadline: float, hasher: xxhash.xxh3_128 | None
) -> None:
    """The receive loop of :func:`recv_exact` and :func:`recv_hashed` (``hasher``: None,
    or what takes the bytes as they arrive, :data:`HASH_STEP` at a time)."""
    pos, n = 0, len(view)
    hashed = 0
    timeout = sock.gettimeout()
    try:
        while pos < n:
            _bound_wait(sock, timeout, deadline)
            got = sock.recv_into(view[pos:], min(PIECE, n - pos))
            if not got:
                raise ConnectionError("peer closed the connection")
            if (pos + got) // PIECE != pos // PIECE:  # once a piece (a receive is at most one)
                give_way()
            pos += got
            if hasher is not None and (pos - hashed >= HASH_STEP or pos == n):
                hasher.update(view[hashed:pos])
                hashed = pos
    finally:
        if deadline:
            sock.settimeout(timeout)


__all__ = [
    "FILE_PIECE",
    "NATIVE",
    "PIECE",
    "read_hashed",
    "recv_exact",
    "recv_hashed",
    "send_all",
    "write_hashed",
]
