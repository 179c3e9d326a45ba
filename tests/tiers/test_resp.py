"""The Redis tier's RESP reply reader over a real socket pair: replies that arrive in any
fragmentation, a value received straight into its destination (partly from the line buffer,
the rest from the socket) with its checksum, nulls, errors, values of another size, and every
kind of malformed stream, which must end the connection's use, never be read past."""

from __future__ import annotations

import os
import socket
import threading
import tracemalloc
from collections.abc import Iterator

import pytest

from tierkv.checksums import checksum
from tierkv.tiers.resp import SCRATCH, Filled, Misfit, ProtocolError, Replies, ReplyError


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.settimeout(10)
    b.settimeout(10)
    yield a, b
    a.close()
    b.close()


def _dribble(sock: socket.socket, data: bytes, step: int) -> threading.Thread:
    """Send ``data`` ``step`` bytes a call, from a thread (the reader sees every split)."""

    def run() -> None:
        for i in range(0, len(data), step):
            sock.sendall(data[i : i + step])

    t = threading.Thread(target=run)
    t.start()
    return t


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


# (value size, bytes per send): a byte a call only for small values (megabytes would be slow).
SPLITS = [
    (size, step)
    for size in (1, 100, SCRATCH, 3 * 512 * 1024 + 17)
    for step in (1, 7, 4096, 1 << 20)
    if step > 1 or size <= SCRATCH
]


@pytest.mark.parametrize(("size", "step"), SPLITS)
def test_values_of_the_expected_size_land_in_header_and_destination(
    pair: tuple[socket.socket, socket.socket], size: int, step: int
) -> None:
    writer, reader = pair
    header, payload = os.urandom(64), os.urandom(size)
    other = os.urandom(size)
    stream = _bulk(header + payload) + b"$-1\r\n" + _bulk(header + other) + b"+OK\r\n"
    t = _dribble(writer, stream, step)
    replies = Replies(reader)
    got: list[object] = []
    dests = [memoryview(bytearray(size)) for _ in range(3)]
    headers = [memoryview(bytearray(64)) for _ in range(3)]
    for h, d in zip(headers, dests, strict=True):
        got.append(replies.value_into(h, d))
    assert replies.simple() == b"OK"
    t.join(10)
    assert got[0] == Filled(checksum(payload)) and got[2] == Filled(checksum(other))
    assert got[1] is None
    assert bytes(headers[0]) == header and bytes(dests[0]) == payload
    assert bytes(dests[2]) == other
    assert bytes(dests[1]) == bytes(size)  # a miss leaves its destination alone
    assert replies.clean


def test_nulls_errors_and_values_of_another_size(pair: tuple[socket.socket, socket.socket]) -> None:
    writer, reader = pair
    stream = (
        b"_\r\n"  # RESP3 null
        + b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n"
        + _bulk(b"short")
        + b":3\r\n"
        + b"-OOM command not allowed\r\n"
    )
    writer.sendall(stream)
    replies = Replies(reader)
    h, d = memoryview(bytearray(64)), memoryview(bytearray(100))
    assert replies.value_into(h, d) is None
    err = replies.value_into(h, d)
    assert isinstance(err, ReplyError) and str(err).startswith("WRONGTYPE")
    assert replies.value_into(h, d) == Misfit(5, b"short")  # another size: its first bytes
    assert bytes(d) == bytes(100) and bytes(h) == bytes(64)
    assert replies.simple() == 3
    oom = replies.simple()
    assert isinstance(oom, ReplyError) and "OOM" in str(oom)
    assert replies.clean


@pytest.mark.parametrize(
    "stream",
    [
        b"*2\r\n$1\r\na\r\n$1\r\nb\r\n",  # an array is no answer to GET
        b"$abc\r\n",  # not a length
        b"$4\r\nabcdXY",  # no CRLF after the value
        b"+" + b"x" * (SCRATCH + 10),  # a line without an end
    ],
)
def test_a_malformed_stream_is_a_protocol_error(
    pair: tuple[socket.socket, socket.socket], stream: bytes
) -> None:
    writer, reader = pair
    writer.sendall(stream)
    with pytest.raises(ProtocolError):
        Replies(reader).value_into(memoryview(bytearray(2)), memoryview(bytearray(2)))


def test_more_bytes_than_replies_is_not_clean(pair: tuple[socket.socket, socket.socket]) -> None:
    writer, reader = pair
    writer.sendall(b"+OK\r\n+OK\r\n")
    replies = Replies(reader)
    assert replies.simple() == b"OK"
    assert not replies.clean  # the caller must not reuse the connection


def test_a_connection_closed_mid_value_is_a_connection_error(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    writer, reader = pair
    writer.sendall(b"$%d\r\n" % (64 + 100_000) + os.urandom(5000))
    writer.close()
    with pytest.raises(ConnectionError):
        Replies(reader).value_into(memoryview(bytearray(64)), memoryview(bytearray(100_000)))


def test_a_value_of_another_size_is_received_and_dropped_keeping_its_first_bytes(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """Only the first 64 bytes of a value of another size are kept, whatever its size (it
    was read whole, and copied once more); the replies after it are read as usual."""
    writer, reader = pair
    value = os.urandom(8 << 20)
    stream = memoryview(_bulk(value) + b"+OK\r\n")
    t = threading.Thread(target=writer.sendall, args=(stream,))  # no copy on this side
    t.start()
    replies = Replies(reader)
    h, d = memoryview(bytearray(64)), memoryview(bytearray(100))
    tracemalloc.start()
    try:
        got = replies.value_into(h, d)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got == Misfit(len(value), value[:64])
    assert peak < 256 * 1024, peak
    assert replies.simple() == b"OK" and replies.clean
    assert bytes(h) == bytes(64) and bytes(d) == bytes(100)
    t.join(10)


@pytest.mark.parametrize("size", [1000, 64 + 100_000])
def test_the_deadline_bounds_all_receives_together(
    pair: tuple[socket.socket, socket.socket], size: int
) -> None:
    """Bytes trickling in, each receive well within the socket's timeout (10 s), fail
    the reading at the deadline (0.3 s from now); at this rate the value takes minutes.
    Sizes: of another size than the slot (drained), and the slot's (received into it)."""
    writer, reader = pair
    stop = threading.Event()

    def trickle() -> None:
        writer.sendall(b"$%d\r\n" % (64 + 100_000))
        while not stop.wait(0.01):
            writer.sendall(b"x")

    t = threading.Thread(target=trickle)
    t.start()
    replies = Replies(reader, reply_timeout=0.3)
    try:
        with pytest.raises(TimeoutError):
            replies.value_into(memoryview(bytearray(64)), memoryview(bytearray(size - 64)))
    finally:
        stop.set()
        t.join(10)
    replies.restore()
    assert reader.gettimeout() == 10


def test_each_reply_waits_its_own_time_not_what_the_last_one_left(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """Reply 1 took most of its 2 s, lowering the socket's timeout to the little it had
    left; reply 2, whose line had arrived with reply 1's end, then waited for its payload
    only that long, failing well inside its own 2 s."""
    writer, reader = pair
    reader.settimeout(2.0)
    go = threading.Event()

    def server() -> None:
        writer.sendall(b"+")
        go.wait(10)  # reply 1 is read up to here, then waits
        writer.sendall(b"O")
        threading.Event().wait(0.05)  # its last receive: with about 0.15 s of its time left
        writer.sendall(b"K\r\n" + b"$164\r\n" + b"h" * 64)  # reply 2's line, read ahead
        threading.Event().wait(0.8)  # reply 2's payload: 0.8 s into its own 2 s
        writer.sendall(b"d" * 100 + b"\r\n")

    t = threading.Thread(target=server)
    t.start()
    replies = Replies(reader, reply_timeout=2.0)
    threading.Timer(1.8, go.set).start()  # reply 1 ends with about 0.2 s of its time left
    try:
        assert replies.simple() == b"OK"
        got = replies.value_into(memoryview(bytearray(64)), memoryview(bytearray(100)))
        assert isinstance(got, Filled)
    finally:
        go.set()
        t.join(10)
    replies.restore()
    assert reader.gettimeout() == 2.0
