"""The TCP data plane in one process: real sockets on loopback, a dict-backed chunk source."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pytest

from tierkv.checksums import checksum
from tierkv.cluster import messages as m
from tierkv.cluster import transport
from tierkv.cluster.transport import (
    CHUNK,
    HELLO,
    HELLO_REPLY,
    ITEM,
    REQUEST,
    SENT_OK,
    VERSION,
    Served,
    TcpTransport,
)
from tierkv.tiers.base import LoadStatus

TOKEN = "data-plane-secret"


class DictSource:
    """Committed chunks: key -> bytes; counts what is locked."""

    def __init__(self, chunks: dict[bytes, bytes]) -> None:
        self.chunks = {k: bytearray(v) for k, v in chunks.items()}
        self.sums = {k: checksum(v) for k, v in chunks.items()}
        self.locked = 0
        self.lock = threading.Lock()

    def acquire(self, keys: Sequence[bytes], lengths: Sequence[int]) -> Served:
        views: list[memoryview | None] = []
        for key in keys:
            data = self.chunks.get(key)
            views.append(memoryview(data).toreadonly() if data is not None else None)
        with self.lock:
            self.locked += 1
        return Served(views, [self.sums.get(k, b"") for k in keys])

    def release(self, served: Served) -> None:
        served.views.clear()
        with self.lock:
            self.locked -= 1


def wait_for(what: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def holder(chunks: dict[bytes, bytes], port: int = 0, **kw: object) -> TcpTransport:
    t = TcpTransport("127.0.0.1", port, "127.0.0.1", TOKEN, f"holder-{port}", **kw)  # type: ignore[arg-type]
    t.serve(DictSource(chunks))
    t.node_id = t.address.encode()  # a test holder is the member its address names
    return t


def info(t: TcpTransport, incarnation: int = 1) -> m.MemberInfo:
    return m.MemberInfo(t.address, t.address, t.address, incarnation)


def chunks(n: int, size: int = 256 * 1024) -> dict[bytes, bytes]:
    return {os.urandom(32): os.urandom(size) for _ in range(n)}


@pytest.fixture
def reader() -> Iterator[TcpTransport]:
    t = TcpTransport("127.0.0.1", 0, "127.0.0.1", TOKEN, "reader", connections_per_peer=4)
    yield t
    t.close()


def slots(data: dict[bytes, bytes]) -> list[tuple[bytes, memoryview]]:
    return [(k, memoryview(bytearray(len(v)))) for k, v in data.items()]


def test_several_chunks_from_two_holders_in_parallel(reader: TcpTransport) -> None:
    da, db = chunks(12), chunks(5)
    ha, hb = holder(da), holder(db)
    try:
        ia, ib = slots(da), slots(db)
        out = reader.fetch_many([(info(ha), ia), (info(hb), ib)])
        assert out == [[LoadStatus.OK] * 12, [LoadStatus.OK] * 5]
        assert all(bytes(v) == da[k] for k, v in ia) and all(bytes(v) == db[k] for k, v in ib)
        figures = reader.stats()["received"]
        assert figures[ha.address]["chunks"] == 12 and figures[hb.address]["chunks"] == 5
        # The holder counts after its last send: poll (bounded) rather than race it.
        want = sum(len(v) for v in da.values())
        wait_for(lambda: ha.stats()["sent"].get("reader", {}).get("bytes") == want)
    finally:
        ha.close()
        hb.close()


def test_missing_wrong_length_and_corrupt_chunks(reader: TcpTransport) -> None:
    data = chunks(3)
    keys = list(data)
    h = holder(data, corrupt_hook=lambda key: key == keys[2])
    try:
        items = [
            (keys[0], memoryview(bytearray(len(data[keys[0]])))),
            (os.urandom(32), memoryview(bytearray(10))),  # not held
            (keys[1], memoryview(bytearray(7))),  # the holder's chunk has another length
            (keys[2], memoryview(bytearray(len(data[keys[2]])))),
        ]
        verified: dict[bytes, bytes] = {}
        statuses = reader.fetch_many([(info(h), items)], verified)[0]
        assert statuses == [
            LoadStatus.OK,
            LoadStatus.MISSING,
            LoadStatus.MISSING,
            LoadStatus.CORRUPT,
        ]
        # Only the intact chunk's checksum is handed back (to publish it without rehashing).
        assert verified == {keys[0]: checksum(data[keys[0]])}
        assert reader.stats()["received"][h.address]["corrupt"] == 1
        source = h._source
        assert isinstance(source, DictSource)
        wait_for(lambda: source.locked == 0)  # released after the last send
    finally:
        h.close()


def test_connections_are_pooled_bounded_and_reused(reader: TcpTransport) -> None:
    data = chunks(8, size=64 * 1024)
    h = holder(data)
    try:
        for _ in range(20):
            assert reader.fetch_many([(info(h), slots(data))])[0] == [LoadStatus.OK] * 8
        opened = reader.connections_opened
        assert opened <= 4  # one request per stream, streams reuse pooled connections
        errors: list[BaseException] = []

        def hammer() -> None:
            try:
                for _ in range(10):
                    got = reader.fetch_many([(info(h), slots(data))])[0]
                    assert got == [LoadStatus.OK] * 8
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=hammer) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert reader.connections_opened <= 4  # never more than connections_per_peer
    finally:
        h.close()


def test_a_pooled_connection_the_holder_dropped_is_replaced(reader: TcpTransport) -> None:
    data = chunks(2)
    h = holder(data)
    port = h.port
    assert reader.fetch_many([(info(h), slots(data))])[0] == [LoadStatus.OK] * 2
    h.close()  # the idle pooled connection dies with it
    h2 = holder(data, port=port)
    try:
        assert reader.fetch_many([(info(h2), slots(data))])[0] == [LoadStatus.OK] * 2
    finally:
        h2.close()


def test_a_dead_holder_is_an_error_not_a_hang(reader: TcpTransport) -> None:
    data = chunks(2)
    h = holder(data)
    peer = info(h)
    h.close()
    assert reader.fetch_many([(peer, slots(data))])[0] == [LoadStatus.ERROR] * 2


def test_a_member_with_an_unusable_data_address_fails_only_its_own_batch(
    reader: TcpTransport,
) -> None:
    data = chunks(2)
    h = holder(data)
    try:
        labels = ("a" * 64 + ":7000", "node1..example.com:7000")  # the resolver refuses
        for bad in ("garbage", "", "host:port", "127.0.0.1:99999", "127.0.0.1:0", "[::1", *labels):
            peer = m.MemberInfo("bogus", "127.0.0.1:1", bad, 1)
            items = slots(data)
            out = reader.fetch_many([(peer, [(os.urandom(32), memoryview(bytearray(8)))]),
                                     (info(h), items)])  # fmt: skip
            assert out == [[LoadStatus.ERROR], [LoadStatus.OK] * 2], bad
            assert all(bytes(v) == data[k] for k, v in items)
    finally:
        h.close()


class SlowSource(DictSource):
    def acquire(self, keys: Sequence[bytes], lengths: Sequence[int]) -> Served:
        time.sleep(0.5)  # a busy holder
        return super().acquire(keys, lengths)


def test_a_fetch_returns_only_once_every_stream_has_ended(reader: TcpTransport) -> None:
    """The caller frees the slots of chunks that failed when the fetch returns: one peer's
    stream failing in any way (before: a host name the resolver refused raised out of the
    fetch) must not return while another peer's stream still writes into its slots."""
    data = chunks(4)
    slow = TcpTransport("127.0.0.1", 0, "127.0.0.1", TOKEN, "slow-holder")
    slow.serve(SlowSource(data))
    slow.node_id = slow.address.encode()
    try:
        bad = m.MemberInfo("bogus", "127.0.0.1:1", "a" * 64 + ":7000", 1)
        items = slots(data)
        out = reader.fetch_many([(bad, [(os.urandom(32), memoryview(bytearray(8)))]),
                                 (info(slow), items)])  # fmt: skip
        assert out == [[LoadStatus.ERROR], [LoadStatus.OK] * 4]
        assert all(bytes(v) == data[k] for k, v in items)
    finally:
        slow.close()


def test_a_reader_with_the_wrong_secret_gets_nothing() -> None:
    data = chunks(1)
    h = holder(data)
    intruder = TcpTransport("127.0.0.1", 0, "127.0.0.1", "guess", "intruder")
    try:
        items = slots(data)
        assert intruder.fetch_many([(info(h), items)])[0] == [LoadStatus.ERROR]
        assert not any(items[0][1])
        assert intruder.stats()["refused_by_peers"] == 1  # it could not check the holder
        # The holder counts the hello it never saw completed (the intruder hung up).
        wait_for(lambda: h.stats()["refused_hellos"] == 1)
    finally:
        intruder.close()
        h.close()


def test_refused_hellos_are_counted_and_logged_once_a_minute_at_most(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Anyone who reaches the data port can send a hello and hang up: each one logged a
    WARNING, with a node name of the sender's choosing (500 connections, 500 lines)."""
    caplog.set_level(logging.INFO, "tierkv.cluster.transport")
    data = chunks(1)
    h = holder(data)
    intruder = TcpTransport("127.0.0.1", 0, "127.0.0.1", "guess", "intruder")
    try:
        for _ in range(20):
            assert intruder.fetch_many([(info(h), slots(data))])[0] == [LoadStatus.ERROR]
        wait_for(lambda: h.stats()["refused_hellos"] == 20)
        lines = [r.getMessage() for r in caplog.records if r.name.endswith("transport")]
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        hellos = [line for line in lines if "hello" in line]
        assert len([r for r in warnings if "hello" in r.getMessage()]) == 1, hellos
    finally:
        intruder.close()
        h.close()


def test_a_holder_that_trickles_its_chunks_is_cut_off_at_the_transfer_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A holder that never falls silent for a timeout but sends a chunk far too slowly: the
    fetch ends at the reader's transfer limit (a failed fetch) and writes nothing into its
    slots after (before, it went on for as long as the holder sent, past the reservation
    of the slots it wrote into)."""
    from tierkv.cluster import transport

    plain = transport.send_all

    def trickle(sock: object, parts: Sequence[memoryview | bytes]) -> None:
        if sum(len(p) for p in parts) < 4096:
            return plain(sock, parts)  # type: ignore[arg-type]
        for part in parts:
            for i in range(0, len(part), 1024):
                plain(sock, [part[i : i + 1024]])  # type: ignore[arg-type]
                time.sleep(0.01)
        return None

    data = chunks(1, size=1 << 20)  # 10 s at that rate
    h = holder(data)
    monkeypatch.setattr(transport, "send_all", trickle)
    slow = TcpTransport("127.0.0.1", 0, "127.0.0.1", TOKEN, "reader", transfer_limit=0.5)
    try:
        items = slots(data)
        assert slow.fetch_many([(info(h), items)]) == [[LoadStatus.ERROR]]
        landed = bytes(items[0][1])
        time.sleep(0.2)
        assert bytes(items[0][1]) == landed  # nothing lands after the fetch returned
        assert landed != next(iter(data.values()))
    finally:
        slow.close()
        h.close()


def test_a_hello_relayed_to_another_member_proves_nothing(reader: TcpTransport) -> None:
    """A process at a member's data address (its port taken over after the member died)
    has no secret, but relayed the reader's hello to a live member and that member's proof
    back: the proof named only the reader, so the reader took the impostor for the member
    and accepted its bytes, with a checksum of their own, as OK. A proof names the holder
    too now: the relayed one is refused, and nothing is read."""
    real = holder({})  # a live member; it need not hold the chunk
    listener = socket.create_server(("127.0.0.1", 0))
    fake = b"EVIL" * 1024
    served: list[bytes] = []

    def impostor() -> None:
        with contextlib.suppress(OSError), listener, listener.accept()[0] as conn:
            host, port = real.address.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=5) as member_sock:
                conn.settimeout(5)
                head = transport._recv_bytes(conn, HELLO.size)
                member_sock.sendall(head + transport._recv_bytes(conn, HELLO.unpack(head)[2] + 16))
                conn.sendall(transport._recv_bytes(member_sock, HELLO_REPLY.size + 16 + 32))
                member_sock.sendall(transport._recv_bytes(conn, 32))
                conn.sendall(transport._recv_bytes(member_sock, HELLO_REPLY.size))
                _, count = REQUEST.unpack(transport._recv_bytes(conn, REQUEST.size))
                for _ in range(count):
                    _, n = ITEM.unpack(transport._recv_bytes(conn, ITEM.size))
                    conn.sendall(CHUNK.pack(SENT_OK, n, checksum(fake[:n])) + fake[:n])
                    served.append(fake[:n])

    relay = threading.Thread(target=impostor, daemon=True)
    relay.start()
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        view = memoryview(bytearray(len(fake)))
        verified: dict[bytes, bytes] = {}
        got = reader.fetch_many(
            [(m.MemberInfo(address, address, address, 1), [(b"k" * 32, view)])], verified
        )
        assert got == [[LoadStatus.ERROR]] and not verified and not served
        assert bytes(view) == bytes(len(fake))
        assert reader.refused_by_peers == 1
    finally:
        real.close()
        relay.join(10)


def _trickle(sock: socket.socket, data: bytes, every: float, sent: list[int]) -> None:
    """Send ``data`` one byte each ``every`` seconds until the other side hangs up;
    ``sent``: how many bytes went out."""
    with contextlib.suppress(OSError), sock:
        for byte in data:
            sock.sendall(bytes([byte]))
            sent[0] += 1
            time.sleep(every)
            with contextlib.suppress(BlockingIOError):
                if sock.recv(1, socket.MSG_DONTWAIT) == b"":
                    return  # closed by the other side


def test_hellos_that_trickle_end_at_one_deadline_and_take_no_members_places(
    reader: TcpTransport,
) -> None:
    """Clients without the secret sending their hello a byte at a time: each wait for a
    byte had its own timeout, so a hello of 288 bytes held its connection for 288 of them,
    and counted against the places of members' connections (max_serving): a few such
    clients kept every reader out. A hello must now be whole within one timeout, and the
    connections in their hello have places of their own."""
    data = chunks(1, 4096)
    held = TcpTransport("127.0.0.1", 0, "127.0.0.1", TOKEN, "h", timeout=1.0, max_serving=2)
    held.serve(DictSource(data))
    held.node_id = held.address.encode()
    host, port = held.address.rsplit(":", 1)
    hello = HELLO.pack(b"TKVD", VERSION, 256) + b"a" * 256 + bytes(16)
    counts = [[0] for _ in range(4)]
    tricklers = [
        threading.Thread(
            target=_trickle,
            args=(socket.create_connection((host, int(port))), hello, 0.2, sent),
            daemon=True,
        )
        for sent in counts
    ]
    try:
        for t in tricklers:
            t.start()
        wait_for(lambda: all(sent[0] for sent in counts))  # every one in its hello
        items = slots(data)
        assert reader.fetch_many([(info(held), items)]) == [[LoadStatus.OK]]
        for t in tricklers:
            t.join(30)
        # Cut off after about one timeout's worth of bytes, not 288 timeouts' worth.
        assert all(0 < sent[0] < len(hello) // 4 for sent in counts), counts
    finally:
        held.close()


def test_a_holder_trickling_its_hello_reply_is_cut_off_at_one_deadline(
    reader: TcpTransport,
) -> None:
    """A process at a member's data address (no secret) answering the hello a byte at a
    time held the reader's fetch, and the chunks of good holders in the same fetch, for as
    many timeouts as the reply has bytes. The reader's hello has one deadline now."""
    data = chunks(1, 4096)
    good = holder(data)
    listener = socket.create_server(("127.0.0.1", 0))
    reply = HELLO_REPLY.pack(0) + bytes(16 + 32)
    sent = [0]

    def impostor() -> None:
        with listener, listener.accept()[0] as conn:
            conn.recv(1024)
            _trickle(conn, reply, 0.2, sent)

    slow = threading.Thread(target=impostor, daemon=True)
    slow.start()
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        quick = TcpTransport("127.0.0.1", 0, "127.0.0.1", TOKEN, "reader", timeout=1.0)
        try:
            key, view = b"z" * 32, memoryview(bytearray(4096))
            at = m.MemberInfo(address, address, address, 1)
            got = quick.fetch_many([(info(good), slots(data)), (at, [(key, view)])])
            assert got == [[LoadStatus.OK], [LoadStatus.ERROR]]
        finally:
            quick.close()
        slow.join(30)
        assert 0 < sent[0] < len(reply) // 4, sent  # the reader hung up after one deadline
    finally:
        good.close()


def test_connections_reset_before_their_hello_give_their_place_back(
    reader: TcpTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection reset between accept and its serving thread's start: the thread looked
    its address up again, got none, and gave back the place of another address, so the
    place counted under the real one leaked; 64 such resets shut that address out for
    good. The place is counted and given back under the address accept gave."""
    real_data_thread = transport.data_thread
    accepted = threading.Event()

    def late_start() -> None:  # a loaded machine: the thread runs after the reset
        accepted.wait(10)
        real_data_thread()

    monkeypatch.setattr(transport, "data_thread", late_start)
    data = chunks(1, 4096)
    held = holder(data)
    try:
        host, port = held.address.rsplit(":", 1)
        socks = [socket.create_connection((host, int(port))) for _ in range(8)]
        wait_for(lambda: held._hellos.get("127.0.0.1") == 8)  # accepted, counted
        for sock in socks:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()  # reset before the serving threads look at them
        time.sleep(0.1)
        accepted.set()
        wait_for(lambda: not held._hellos)
        assert reader.fetch_many([(info(held), slots(data))]) == [[LoadStatus.OK]]
    finally:
        held.close()


def test_peer_connections_are_probed_when_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """A holder's served connection waits for the reader's next request with no timeout:
    one whose reader's host vanished (no FIN, no RST) held its thread and its place among
    ``max_serving`` for the kernel's keepalive default (two hours before the first probe).
    Both ends probe after a minute idle and give up after six probes ten seconds apart."""
    from tierkv.cluster import transport

    tuned: list[tuple[int, int, int]] = []
    plain = transport._tune

    def recorded(sock: socket.socket) -> None:
        plain(sock)
        tuned.append(
            tuple(  # type: ignore[arg-type]
                sock.getsockopt(socket.IPPROTO_TCP, opt)
                for opt in (socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL, socket.TCP_KEEPCNT)
            )
        )

    monkeypatch.setattr(transport, "_tune", recorded)
    data = chunks(1)
    h = holder(data)
    reader = TcpTransport("127.0.0.1", 0, "127.0.0.1", TOKEN, "reader")
    try:
        assert reader.fetch_many([(info(h), slots(data))])[0] == [LoadStatus.OK]
    finally:
        reader.close()
        h.close()
    assert len(tuned) >= 2 and set(tuned) == {(60, 10, 6)}  # the reader's and the holder's
