"""The request transport's framing: endpoints, message splitting, limits, closes."""

from __future__ import annotations

import random
import socket
import threading
import time
import tracemalloc
from pathlib import Path

import msgspec
import pytest

from tierkv import framing
from tierkv.server.rpc import _describe_malformed, _lenient_rid


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("ipc:///run/tierkv/rpc.sock", (socket.AF_UNIX, "/run/tierkv/rpc.sock")),
        ("tcp://127.0.0.1:5555", (socket.AF_INET, ("127.0.0.1", 5555))),
        ("tcp://*:5555", (socket.AF_INET, ("0.0.0.0", 5555))),
        ("tcp://[::1]:5555", (socket.AF_INET6, ("::1", 5555))),
        ("tcp://node-7.example:80", (socket.AF_INET, ("node-7.example", 80))),
    ],
)
def test_parse_endpoint(endpoint: str, expected: tuple[object, object]) -> None:
    assert framing.parse_endpoint(endpoint) == expected


@pytest.mark.parametrize(
    "endpoint",
    [
        "ipc://",
        "tcp://host",
        "tcp://:80",
        "tcp://host:http",
        "udp://h:1",
        "/a/b",
        "tcp://host:65536",
        "tcp://host:\u0661\u0662",  # digits, not ASCII ones
    ],
)
def test_parse_endpoint_refuses_what_it_cannot_serve(endpoint: str) -> None:
    with pytest.raises(ValueError, match="endpoint"):
        framing.parse_endpoint(endpoint)


def frame(payload: bytes) -> bytes:
    return framing.HEADER.pack(len(payload)) + payload


def test_small_messages_in_one_read_and_split_across_reads() -> None:
    a, b = socket.socketpair()
    with a, b:
        reader = framing.FrameReader()
        stream = frame(b"one") + frame(b"") + frame(b"three") + frame(b"four")
        a.sendall(stream[:-3])
        assert [bytes(f) for f in reader.read(b)] == [b"one", b"", b"three"]
        a.sendall(stream[-3:])
        assert [bytes(f) for f in reader.read(b)] == [b"four"]
        # A header cut in two.
        a.sendall(frame(b"five")[:2])
        assert reader.read(b) == []
        a.sendall(frame(b"five")[2:])
        assert [bytes(f) for f in reader.read(b)] == [b"five"]


def test_a_large_message_is_received_into_its_own_buffer() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        reader = framing.FrameReader(scratch=bytearray(4096))
        big = bytes(range(256)) * 1000  # far more than the scratch buffer
        sender = threading.Thread(target=a.sendall, args=(frame(big) + frame(b"after"),))
        sender.start()
        got: list[bytes] = []
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            got += [bytes(f) for f in reader.read(b)]
        sender.join()
        assert got == [big, b"after"]


def test_a_large_message_grows_its_buffer_as_it_arrives_byte_exact() -> None:
    """A message several times the first mapping: the buffer is grown (doubled) as bytes
    arrive, and the message comes out whole and exact."""
    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        reader = framing.FrameReader(scratch=bytearray(4096))
        big = bytes(random.Random(5).randbytes(5 * framing.LARGE_FIRST_MAP + 123))
        sender = threading.Thread(target=a.sendall, args=(frame(big) + frame(b"after"),))
        sender.start()
        got: list[bytes] = []
        deadline = time.monotonic() + 20
        while len(got) < 2 and time.monotonic() < deadline:
            got += [bytes(f) for f in reader.read(b)]
        sender.join()
        assert got == [big, b"after"]


def test_a_message_over_the_limit_is_refused_from_its_header() -> None:
    a, b = socket.socketpair()
    with a, b:
        reader = framing.FrameReader(max_frame=1000)
        a.sendall(framing.HEADER.pack(1001))  # no body needed to refuse it
        with pytest.raises(framing.FrameTooLargeError) as refused:
            reader.read(b)
        assert (refused.value.size, refused.value.limit) == (1001, 1000)


def test_large_messages_being_received_share_one_budget() -> None:
    """Large messages in progress hold bytes of their server's budget as their bytes arrive
    (a header alone holds nothing); bytes past it are refused; a whole message, or a reader
    closed with its connection, gives its bytes back."""
    budget = framing.BufferBudget(10_000)
    pairs = [socket.socketpair() for _ in range(3)]
    try:
        readers = [framing.FrameReader(scratch=bytearray(1024), budget=budget) for _ in pairs]
        for b in (b for _, b in pairs):
            b.setblocking(False)
        first, second, third = pairs
        first[0].sendall(framing.HEADER.pack(60_000_000))  # announced only
        assert readers[0].read(first[1]) == [] and budget.used == 0
        # Nor is the announced size mapped: the buffer grows as bytes arrive.
        assert 0 < len(readers[0]._large or b"") <= framing.LARGE_FIRST_MAP
        first[0].sendall(b"x" * 6000)
        while budget.used < 6000:
            assert readers[0].read(first[1]) == []
        assert budget.used == 6000
        second[0].sendall(framing.HEADER.pack(5000) + b"y" * 3000)  # fits beside the first
        got: list[bytes] = []
        while budget.used < 9000:
            got += [bytes(f) for f in readers[1].read(second[1])]
        second[0].sendall(b"y" * 2000)  # past the budget
        with pytest.raises(framing.FrameBudgetError) as refused:
            while True:
                readers[1].read(second[1])
        assert (refused.value.size, refused.value.limit) == (5000, 10_000)
        readers[1].close()  # its connection is closed: what it held goes back
        assert budget.used == 6000
        third[0].sendall(framing.HEADER.pack(4000) + b"z" * 4000)
        while not got:
            got = [bytes(f) for f in readers[2].read(third[1])]
        assert got == [b"z" * 4000] and budget.used == 6000  # whole: given back
        readers[0].close()  # closed with the message half received
        assert budget.used == 0
        small = framing.FrameReader(scratch=bytearray(1024), budget=framing.BufferBudget(0))
        third[0].sendall(framing.HEADER.pack(100) + b"s" * 100)  # small: no budget needed
        assert [bytes(f) for f in small.read(third[1])] == [b"s" * 100]
    finally:
        for a, b in pairs:
            a.close()
            b.close()


def test_connection_close_and_timeout() -> None:
    a, b = socket.socketpair()
    conn = framing.Connection(b)
    try:
        with pytest.raises(TimeoutError):
            conn.receive(time.monotonic() + 0.05)
        assert not conn.pending()
        a.sendall(frame(b"last"))
        a.close()
        assert [bytes(f) for f in conn.receive(time.monotonic() + 1)] == [b"last"]
        assert conn.pending()  # the close is there to read
        with pytest.raises(framing.ConnectionClosedError):
            conn.receive(time.monotonic() + 1)
    finally:
        conn.close()


def test_a_spinning_connection_reads_a_reply_that_comes_while_it_spins() -> None:
    """With ``spin`` the receiver keeps reading instead of sleeping in poll: a reply that
    comes within the spin is read without any poll; one that comes later, a message that
    arrives in pieces, a timeout and a close all behave as without spinning."""
    a, b = socket.socketpair()
    conn = framing.Connection(b, spin=5.0)
    polls: list[int] = []
    wait = conn._wait

    def counted(event: int, deadline: float) -> None:
        polls.append(event)
        wait(event, deadline)

    conn._wait = counted  # type: ignore[method-assign]
    try:
        timer = threading.Timer(0.02, lambda: a.sendall(frame(b"soon")))
        timer.start()
        assert [bytes(f) for f in conn.receive(time.monotonic() + 10)] == [b"soon"]
        timer.join()
        assert polls == []  # read while spinning: never slept

        conn.spin = 0.001
        message = frame(b"x" * 1000)
        a.sendall(message[:10])  # a partial message: the spin ends, then poll waits
        timer = threading.Timer(0.05, lambda: a.sendall(message[10:]))
        timer.start()
        assert [bytes(f) for f in conn.receive(time.monotonic() + 10)] == [b"x" * 1000]
        timer.join()
        assert polls  # the rest came after the spin: it slept in poll for it

        with pytest.raises(TimeoutError):
            conn.receive(time.monotonic() + 0.05)
        conn.spin = 5.0
        a.close()
        with pytest.raises(framing.ConnectionClosedError):
            conn.receive(time.monotonic() + 10)  # seen while spinning
    finally:
        conn.close()


def test_connection_sends_a_message_larger_than_the_socket_buffer() -> None:
    a, b = socket.socketpair()
    conn, peer = framing.Connection(a), framing.Connection(b, scratch=4096)
    try:
        big = bytes(range(256)) * 16384  # 4 MiB: many times the socket buffer
        sender = threading.Thread(target=conn.send, args=(big, time.monotonic() + 30))
        sender.start()
        got = [bytes(f) for f in peer.receive(time.monotonic() + 30)]
        sender.join()
        assert got == [big]
        # Nobody reads: the send gives up at its deadline.
        with pytest.raises(TimeoutError):
            conn.send(big, time.monotonic() + 0.2)
    finally:
        conn.close()
        peer.close()


def test_connection_open_waits_for_a_listener(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path / 'late.sock'}"
    assert framing.Connection.open(endpoint, time.monotonic() + 0.05) is None
    listeners: list[socket.socket] = []
    timer = threading.Timer(0.2, lambda: listeners.append(framing.bind(endpoint)))
    timer.start()
    conn = framing.Connection.open(endpoint, time.monotonic() + 10)
    timer.join()
    assert conn is not None
    try:
        conn.send(b"hello", time.monotonic() + 5)
        listeners[0].setblocking(True)
        peer, _ = listeners[0].accept()
        with peer:
            got = framing.Connection(peer).receive(time.monotonic() + 5)
            assert [bytes(f) for f in got] == [b"hello"]
    finally:
        conn.close()
        listeners[0].close()


def test_an_undecodable_request_is_described_without_decoding_it_whole() -> None:
    """The RPC loop answers an undecodable request with its request id and what is wrong.
    A malformed message of tens of MiB (a first field of a million elements) was decoded
    whole twice and its first field's repr built in full, on the loop (8 s for 60 MiB, every
    other client waiting): only the outer array and short fields are decoded now."""
    payload = msgspec.msgpack.encode([[None] * 1_000_000, 7])
    tracemalloc.start()
    try:
        assert _lenient_rid(payload) == 7
        message = _describe_malformed(payload, ValueError("expected str, got array"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert message == "malformed request: expected str, got array"
    assert peak < 2**20  # the decoded list alone took 8 MB, its repr 6 MB more
    named = msgspec.msgpack.encode(["bogus", 42])
    assert _lenient_rid(named) == 42
    assert "unknown request type 'bogus'" in _describe_malformed(named, ValueError())
    assert _lenient_rid(msgspec.msgpack.encode(["x", True])) == 0  # a bool is no request id
    assert _lenient_rid(b"\xc1") == 0  # not msgpack at all
