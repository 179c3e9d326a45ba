"""Bulk I/O in pieces (tierkv.piecewise_io): every byte arrives, checksums equal a one-shot hash,
and no system call moves more than PIECE bytes (real files, real sockets)."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tierkv import piecewise_io as pieces
from tierkv.checksums import checksum

SIZES = [1, pieces.PIECE - 1, pieces.PIECE, 3 * pieces.PIECE + 12345, 2 * pieces.FILE_PIECE + 99]


def _payload(n: int) -> memoryview:
    return memoryview(np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes())


@pytest.mark.parametrize("n", SIZES)
def test_file_pieces_write_and_read_back_with_their_checksum(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    data = _payload(n)
    sizes: list[int] = []  # every call's bytes, in order
    writes: list[tuple[int, int]] = []  # (offset, length)
    reads: list[int] = []
    real_pwrite, real_preadv = os.pwrite, os.preadv

    real_pwritev = os.pwritev

    def pwrite(fd: int, buf: memoryview, offset: int) -> int:
        sizes.append(len(buf))
        writes.append((offset, len(buf)))
        return real_pwrite(fd, buf, offset)

    def pwritev(fd: int, bufs: list[memoryview], offset: int) -> int:
        sizes.append(sum(len(b) for b in bufs))
        writes.append((offset, sizes[-1]))
        return real_pwritev(fd, bufs, offset)

    def preadv(fd: int, bufs: list[memoryview], offset: int) -> int:
        sizes.append(sum(len(b) for b in bufs))
        reads.append(sizes[-1])
        return real_preadv(fd, bufs, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "pwritev", pwritev)
    monkeypatch.setattr(os, "preadv", preadv)
    # The Python loops (without the C helper; with it: test_piecewise.py).
    monkeypatch.setattr(pieces, "_write_native", None)
    monkeypatch.setattr(pieces, "_read_mapped", None)
    ways: list[int] = []
    monkeypatch.setattr(pieces, "give_way", lambda: ways.append(len(sizes)))
    path = tmp_path / "chunk"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        head = bytes(range(64))  # written with the first piece
        assert pieces.write_hashed(fd, data, 64, head) == checksum(data)
        assert path.read_bytes() == head + data.tobytes()
        back = bytearray(n)
        got, digest = pieces.read_hashed(fd, memoryview(back), 64)
        assert (got, digest, bytes(back)) == (n, checksum(data), data.tobytes())
        # A data thread gives way after every piece (tierkv.priority.give_way).
        assert ways == list(range(1, len(sizes) + 1))
        # A file shorter than the view: what was there, and its checksum.
        os.ftruncate(fd, 64 + n // 2)
        got, digest = pieces.read_hashed(fd, memoryview(bytearray(n)), 64)
        assert (got, digest) == (n // 2, checksum(data[: n // 2]))
    finally:
        os.close(fd)
    # Reads of at most PIECE bytes a call; writes of at most FILE_PIECE, each starting and
    # ending at a multiple of it in the file (or at the end of the data): the first, with
    # the head, at 0.
    assert writes and all(
        length <= pieces.FILE_PIECE
        and offset % pieces.FILE_PIECE == 0
        and ((offset + length) % pieces.FILE_PIECE == 0 or offset + length == 64 + n)
        for offset, length in writes
    )
    assert reads and max(reads) <= pieces.PIECE


def test_short_file_writes_resume_and_the_checksum_covers_each_byte_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel may write less than asked: the rest follows, hashed once (each piece is
    hashed before it is written, so a resumed piece must not be hashed again)."""
    n = 2 * pieces.FILE_PIECE + 12345
    data = _payload(n)
    real_pwrite = os.pwrite
    asked: list[int] = []

    def short_pwrite(fd: int, buf: memoryview, offset: int) -> int:
        asked.append(len(buf))
        return real_pwrite(fd, buf[: max(1, len(buf) // 3)], offset)  # a third of it

    def short_pwritev(fd: int, bufs: list[memoryview], offset: int) -> int:
        flat = b"".join(bufs)  # the test's copy
        asked.append(len(flat))
        part = 10 if offset == 0 else max(1, len(flat) // 3)  # the first: part of the head
        return real_pwrite(fd, flat[:part], offset)

    monkeypatch.setattr(os, "pwrite", short_pwrite)
    monkeypatch.setattr(os, "pwritev", short_pwritev)
    monkeypatch.setattr(pieces, "_write_native", None)
    path = tmp_path / "chunk"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        assert pieces.write_hashed(fd, data, 64, b"h" * 64) == checksum(data)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"h" * 64 + data.tobytes()
    assert len(asked) > 3 * 3  # every piece took several calls


class _CountingSocket(socket.socket):
    """A real socket that records how many bytes each send and receive call asked for."""

    asked: list[int]

    def sendmsg(self, buffers, *args):  # type: ignore[no-untyped-def, override]
        self.asked.append(sum(len(b) for b in buffers))
        return super().sendmsg(buffers, *args)

    def recv_into(self, buffer, nbytes=0, *args):  # type: ignore[no-untyped-def, override]
        self.asked.append(nbytes or len(buffer))
        return super().recv_into(buffer, nbytes, *args)


def _pair() -> tuple[_CountingSocket, _CountingSocket]:
    a, b = socket.socketpair()
    out = []
    for s in (a, b):
        c = _CountingSocket(s.family, s.type, s.proto, fileno=s.detach())
        c.asked = []
        c.settimeout(10)
        out.append(c)
    return out[0], out[1]


@pytest.mark.parametrize("n", SIZES)
def test_socket_pieces_arrive_whole_with_their_checksum(
    monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    ways = {"send": 0, "recv": 0}
    t = threading.Thread(target=lambda: pieces.send_all(sender, [head, data]))

    def give_way() -> None:
        # Counted by thread: a thread another test left running may give way meanwhile.
        me = threading.current_thread()
        if me is t:
            ways["send"] += 1
        elif me is threading.main_thread():
            ways["recv"] += 1

    monkeypatch.setattr(pieces, "give_way", give_way)
    sender, receiver = _pair()
    head, data = b"header-of-32-bytes-exactly-here!", _payload(n)
    try:
        t.start()
        got_head = bytearray(len(head))
        pieces.recv_exact(receiver, memoryview(got_head))
        view = memoryview(bytearray(n))
        assert pieces.recv_hashed(receiver, view) == checksum(data)
        t.join(10)
        assert bytes(got_head) == head and view.tobytes() == data.tobytes()
        assert max(sender.asked) <= pieces.PIECE and max(receiver.asked) <= pieces.PIECE
        # Once a piece each way (a receiver: once a full piece has arrived, however many
        # receives it took).
        assert ways["send"] == len(sender.asked)
        assert ways["recv"] == n // pieces.PIECE
    finally:
        sender.close()
        receiver.close()


def test_a_peer_that_hangs_up_midway_is_an_error_not_a_short_chunk() -> None:
    sender, receiver = _pair()
    try:
        pieces.send_all(sender, [b"x" * 1000])
        sender.close()
        with pytest.raises(ConnectionError):
            pieces.recv_hashed(receiver, memoryview(bytearray(5000)))
    finally:
        receiver.close()


@pytest.mark.parametrize("native", [True, False])
def test_a_peer_that_trickles_is_cut_off_at_the_deadline(native: bool) -> None:
    """Each wait for bytes is bounded by the socket's timeout, the whole fill by the
    deadline: a peer that sends a byte every 10 ms (never silent for a timeout) cannot keep
    the fill going past it. ``native``: the C loop (a plain socket), else the Python one."""
    a, b = socket.socketpair()
    if native:
        sender, receiver = a, b
        receiver.settimeout(10)
    else:
        sender, receiver = _pair()
        a.close()
        b.close()
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.01):
            try:
                sender.send(b"x")
            except OSError:
                return

    t = threading.Thread(target=trickle)
    t.start()
    view = memoryview(bytearray(1 << 20))  # 10,000 s at that rate
    try:
        with pytest.raises(TimeoutError):
            pieces.recv_hashed(receiver, view, deadline=time.monotonic() + 0.3)
        assert view.tobytes().count(b"x") < len(view)
        assert receiver.gettimeout() == 10  # the socket's own timeout is left as it was
    finally:
        stop.set()
        t.join(10)
        sender.close()
        receiver.close()


@pytest.mark.parametrize("native", [True, False])
def test_a_peer_that_reads_slowly_is_cut_off_at_the_send_deadline(native: bool) -> None:
    """Each wait for room is bounded by the socket's timeout, the whole send by the
    deadline: a peer reading 64 KiB every 10 ms (never leaving the sender waiting for a
    timeout) cannot keep a 64 MiB send (10 s at that rate) going past it. ``native``: the
    C loop (a plain socket), else the Python one."""
    a, b = socket.socketpair()
    if native:
        sender, receiver = a, b
        sender.settimeout(10)
    else:
        sender, receiver = _pair()
        a.close()
        b.close()
    stop = threading.Event()

    def read_slowly() -> None:
        while not stop.wait(0.01):
            try:
                if not receiver.recv(65536):
                    return
            except OSError:
                return

    t = threading.Thread(target=read_slowly)
    t.start()
    try:
        with pytest.raises(TimeoutError):
            pieces.send_all(sender, [bytes(64 << 20)], deadline=time.monotonic() + 0.3)
        assert sender.gettimeout() == 10  # the socket's own timeout is left as it was
    finally:
        stop.set()
        t.join(10)
        sender.close()
        receiver.close()
