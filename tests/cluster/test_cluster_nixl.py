"""The NIXL data plane in one process: a holder and a reader transport, each with a real
shared-memory pool and index, NIXL over UCX on loopback TCP (the stand-in for another node).
Skipped, with the reason, only where nixl cannot be imported."""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from support.nixl_kit import (
    TOKEN,
    UCX_ENV,
    WRITER,
    PoolSource,
    chunk_bytes,
    chunk_key,
    member,
    needs_nixl,
)
from tierkv.checksums import checksum
from tierkv.cluster.nixl_transport import (
    LEASE_BUSY,
    LEASE_HEAD,
    LEASED,
    META,
    RELEASE,
    RELEASE_UNKNOWN,
    RELEASED,
    SENT_OUTSIDE,
    NixlTransport,
)
from tierkv.cluster.transport import ITEM, MAX_CHUNKS, REQUEST, Served, TcpTransport
from tierkv.tiers.base import LoadStatus

pytestmark = needs_nixl
SIZE = 256 * 1024


@pytest.fixture(autouse=True)
def _ucx_over_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in UCX_ENV.items():
        monkeypatch.setenv(name, value)


def wait_for(what: Callable[[], object], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


class Side:
    """A transport over its own pool."""

    def __init__(self, source: PoolSource, transport: TcpTransport) -> None:
        self.source, self.t = source, transport

    def close(self) -> None:
        self.t.close()
        self.source.close()


def holder_side(seed: int, n: int, size: int = SIZE, **kw: object) -> tuple[Side, list[bytes]]:
    source = PoolSource(n * size + (8 << 20))
    keys = [chunk_key(seed, i) for i in range(n)]
    for i, key in enumerate(keys):
        source.put(key, chunk_bytes(seed, i, size))
    plain = kw.pop("plain", False)
    if plain:
        t: TcpTransport = TcpTransport("127.0.0.1", 0, "127.0.0.1", TOKEN, "holder")
    else:
        t = NixlTransport("127.0.0.1", 0, "127.0.0.1", TOKEN, "holder",
                          region=source.pool.buf, fence=source.index,
                          **kw)  # type: ignore[arg-type]  # fmt: skip
    t.serve(source)
    t.node_id = t.address.encode()  # a test holder is the member its address names
    return Side(source, t), keys


@pytest.fixture
def reader() -> Iterator[Side]:
    source = PoolSource(64 << 20)
    # The deadline is a liveness bound here (a loaded machine's first READ sets up UCX).
    t = NixlTransport("127.0.0.1", 0, "127.0.0.1", TOKEN, "reader", region=source.pool.buf,
                      fence=source.index, timeout=10.0)  # fmt: skip
    side = Side(source, t)
    yield side
    side.close()


def reserve(
    reader: Side, keys: list[bytes], size: int = SIZE
) -> tuple[int, list[tuple[bytes, memoryview]]]:
    """Reserved slots of the reader's pool for ``keys`` (where a fetch lands)."""
    res = reader.source.index.reserve_write(keys, [size] * len(keys), WRITER)
    assert len(res.slots) == len(keys)
    return res.lease_id, [(keys[i], reader.source.pool.view(off, n)) for i, off, n in res.slots]


def nixl_chunks(reader: Side, holder: Side) -> int:
    assert isinstance(reader.t, NixlTransport)
    received = reader.t.stats()["nixl"]["received"]  # type: ignore[index]
    return int(received.get(holder.t.address, {}).get("chunks", 0))


def leases(side: Side) -> dict[str, int]:
    assert isinstance(side.t, NixlTransport)
    return side.t.leases.stats()


def test_reads_land_in_the_readers_pool_byte_exact(reader: Side) -> None:
    holder, keys = holder_side(1, 6)
    try:
        _, items = reserve(reader, keys)
        verified: dict[bytes, bytes] = {}
        out = reader.t.fetch_many([(member(holder.t.address), items)], verified)
        assert out == [[LoadStatus.OK] * 6]
        assert [bytes(v) for _, v in items] == [chunk_bytes(1, i, SIZE) for i in range(6)]
        assert verified == {k: checksum(chunk_bytes(1, i, SIZE)) for i, k in enumerate(keys)}
        assert nixl_chunks(reader, holder) == 6  # every byte came over NIXL, none over TCP
        sent = holder.t.stats()["sent"]
        assert isinstance(sent, dict) and sent["reader"]["bytes"] == 0
        # The READ's completion notification ended the lease; the reader sent no release.
        wait_for(lambda: leases(holder)["notified"] == 1)
        assert leases(holder)["released"] == 0
        assert leases(holder)["live"] == 0 and holder.source.locked() == 0
        # Missing and wrong-length chunks are misses, as over TCP.
        odd = [(os.urandom(32), items[0][1]), (keys[1], reader.source.pool.view(0, 4096))]
        assert reader.t.fetch_many([(member(holder.t.address), odd)]) == [
            [LoadStatus.MISSING, LoadStatus.MISSING]
        ]
        received = reader.t.stats()["nixl"]["received"][holder.t.address]  # type: ignore[index]
        assert received["requests"] == 2 and received["missing"] == 2  # a batch of misses too
    finally:
        holder.close()


def test_a_chunk_evicted_or_cleared_under_a_live_lease_keeps_its_slot(reader: Side) -> None:
    holder, keys = holder_side(2, 1)
    leased_at = holder.source.offset_of(keys[0])
    seen: dict[str, object] = {}

    def meanwhile(lease_id: int) -> None:
        index = holder.source.index
        seen["evicted"] = [e.key for e in index.evict(1 << 40)]
        seen["cleared"] = index.clear()
        # The slot is still leased: a new chunk of the same size goes elsewhere.
        seen["new_at"] = holder.source.put(chunk_key(99, 0), chunk_bytes(99, 0, SIZE))

    assert isinstance(reader.t, NixlTransport)
    reader.t.before_read = meanwhile
    try:
        _, items = reserve(reader, keys)
        assert reader.t.fetch_many([(member(holder.t.address), items)]) == [[LoadStatus.OK]]
        assert bytes(items[0][1]) == chunk_bytes(2, 0, SIZE)
        assert seen["evicted"] == [] and seen["cleared"] == 1
        assert seen["new_at"] != leased_at
        wait_for(lambda: leases(holder)["notified"] == 1)
        # The lease ended: the slot is free again, and the next chunk of its size takes it.
        assert holder.source.put(chunk_key(99, 1), chunk_bytes(99, 1, SIZE)) == leased_at
    finally:
        holder.close()


@pytest.mark.parametrize("honour", [True, False], ids=["reader-deadline", "late-read"])
def test_an_expired_lease_never_lets_a_reader_accept_other_bytes(
    reader: Side, honour: bool
) -> None:
    holder, keys = holder_side(3, 1, lease_ttl=0.3)
    leased_at = holder.source.offset_of(keys[0])
    reused: list[int] = []

    def after_expiry(lease_id: int) -> None:
        wait_for(lambda: leases(holder)["expired"] == 1)  # the holder dropped the locks
        holder.source.index.clear()
        reused.append(holder.source.put(chunk_key(98, 0), chunk_bytes(98, 0, SIZE)))

    assert isinstance(reader.t, NixlTransport)
    reader.t.before_read = after_expiry
    reader.t.honour_lease_deadline = honour  # False: a READ that lands after the lease ended
    try:
        _, items = reserve(reader, keys)
        out = reader.t.fetch_many([(member(holder.t.address), items)])
        assert reused == [leased_at]  # the slot now holds another chunk's bytes
        if honour:
            assert out == [[LoadStatus.ERROR]]  # no READ past the lease: a miss
            assert reader.t.leases_expired_unread == 1
        else:
            assert out == [[LoadStatus.CORRUPT]]  # read, and refused by its checksum
            assert bytes(items[0][1]) == chunk_bytes(98, 0, SIZE)
    finally:
        holder.close()


def test_a_holder_without_nixl_is_read_over_tcp_with_one_log_line(
    reader: Side, caplog: pytest.LogCaptureFixture
) -> None:
    holder, keys = holder_side(4, 3, plain=True)
    try:
        with caplog.at_level(logging.WARNING, logger="tierkv.cluster.nixl_transport"):
            for _ in range(3):
                _, items = reserve(reader, keys)
                out = reader.t.fetch_many([(member(holder.t.address), items)])
                assert out == [[LoadStatus.OK] * 3]
                assert [bytes(v) for _, v in items] == [chunk_bytes(4, i, SIZE) for i in range(3)]
                reader.source.index.clear()
        lines = [r for r in caplog.records if "go over TCP" in r.getMessage()]
        assert len(lines) == 1 and "no NIXL" in lines[0].getMessage()
        assert nixl_chunks(reader, holder) == 0
    finally:
        holder.close()


def test_metadata_nixl_refuses_sends_that_peer_over_tcp(
    reader: Side, caplog: pytest.LogCaptureFixture
) -> None:
    holder, keys = holder_side(5, 2, metadata_hook=lambda md: md[: len(md) // 2] + bytes(8))
    try:
        with caplog.at_level(logging.WARNING, logger="tierkv.cluster.nixl_transport"):
            for _ in range(2):
                _, items = reserve(reader, keys)
                out = reader.t.fetch_many([(member(holder.t.address), items)])
                assert out == [[LoadStatus.OK] * 2]
                assert [bytes(v) for _, v in items] == [chunk_bytes(5, i, SIZE) for i in range(2)]
                reader.source.index.clear()
        assert len([r for r in caplog.records if "go over TCP" in r.getMessage()]) == 1
        assert leases(holder)["granted"] == 0 and nixl_chunks(reader, holder) == 0
    finally:
        holder.close()


def test_metadata_of_another_agent_sends_the_batch_over_tcp_at_once(reader: Side) -> None:
    decoy, _ = holder_side(11, 1)  # a live agent with a region of its own
    assert isinstance(decoy.t, NixlTransport) and decoy.t.agent is not None
    decoy_md = decoy.t.agent.metadata()
    holder, keys = holder_side(12, 2, metadata_hook=lambda md: decoy_md)
    try:
        # NIXL takes the metadata but refuses a READ outside what that agent registered:
        # nothing was transferred, so this very batch goes over TCP.
        _, items = reserve(reader, keys)
        assert reader.t.fetch_many([(member(holder.t.address), items)]) == [[LoadStatus.OK] * 2]
        assert [bytes(v) for _, v in items] == [chunk_bytes(12, i, SIZE) for i in range(2)]
        assert isinstance(reader.t, NixlTransport) and reader.t.fallbacks == 1
        assert nixl_chunks(reader, holder) == 0
        wait_for(lambda: leases(holder)["released"] == 1)
    finally:
        holder.close()
        decoy.close()


def test_slots_outside_the_readers_pool_go_over_tcp(reader: Side) -> None:
    holder, keys = holder_side(6, 2)
    try:
        items = [(k, memoryview(bytearray(SIZE))) for k in keys]  # not in a registered pool
        out = reader.t.fetch_many([(member(holder.t.address), items)])
        assert out == [[LoadStatus.OK] * 2]
        assert [bytes(v) for _, v in items] == [chunk_bytes(6, i, SIZE) for i in range(2)]
        assert leases(holder)["granted"] == 0
    finally:
        holder.close()


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(5.0)
    try:
        return sock.recv(1) == b""
    except ConnectionError:
        return True


@pytest.mark.parametrize(
    "request_bytes",
    [
        REQUEST.pack(b"TKVL", 0),
        REQUEST.pack(b"TKVL", MAX_CHUNKS + 1),
        REQUEST.pack(b"TKVL", 1) + ITEM.pack(bytes(32), 0),
        REQUEST.pack(b"TKVU", 2) + RELEASE.pack(1) * 2,
        REQUEST.pack(b"TKVM", 3),
        REQUEST.pack(b"TKVX", 1),
    ],
    ids=["no-chunks", "too-many", "zero-length", "release-two", "metadata-count", "unknown"],
)
def test_bad_lease_requests_close_the_connection_and_the_holder_keeps_serving(
    reader: Side, request_bytes: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    holder, keys = holder_side(7, 1)
    try:
        conn = reader.t._connect(member(holder.t.address))  # authenticated
        with caplog.at_level(logging.WARNING, logger="tierkv.cluster.transport"), conn.sock:
            conn.sock.sendall(request_bytes)
            assert _closed(conn.sock)
        # The holder says why, naming the peer.
        said = [r.getMessage() for r in caplog.records if r.name == "tierkv.cluster.transport"]
        assert len(said) == 1 and said[0].startswith("closing a peer connection from reader: bad")
        _, items = reserve(reader, keys)
        assert reader.t.fetch_many([(member(holder.t.address), items)]) == [[LoadStatus.OK]]
    finally:
        holder.close()


def test_a_lease_is_released_only_by_its_own_peer(reader: Side) -> None:
    holder, keys = holder_side(8, 1)
    try:
        conn = reader.t._connect(member(holder.t.address))
        with conn.sock as sock:
            sock.settimeout(5.0)
            sock.sendall(REQUEST.pack(b"TKVL", 1) + ITEM.pack(keys[0], SIZE))
            status, _, lease_id, _ = LEASE_HEAD.unpack(
                sock.recv(LEASE_HEAD.size, socket.MSG_WAITALL)
            )
            sock.recv(LEASED.size, socket.MSG_WAITALL)
            assert status == 0 and lease_id and leases(holder)["live"] == 1
            # Another peer (another node id, same secret) cannot end it; an unknown id is
            # answered, and the connection stays usable.
            other = NixlTransport("127.0.0.1", 0, "127.0.0.1", TOKEN, "other")
            try:
                with other._connect(member(holder.t.address)).sock as intruder:
                    intruder.settimeout(5.0)
                    intruder.sendall(REQUEST.pack(b"TKVU", 1) + RELEASE.pack(lease_id))
                    reply = RELEASED.unpack(intruder.recv(RELEASED.size, socket.MSG_WAITALL))
                    assert reply == (RELEASE_UNKNOWN, 0)
            finally:
                other.close()
            assert leases(holder)["live"] == 1 and holder.source.locked() == 1
            sock.sendall(REQUEST.pack(b"TKVU", 1) + RELEASE.pack(lease_id + 12345))
            assert RELEASED.unpack(sock.recv(RELEASED.size, socket.MSG_WAITALL))[0] == 1
            sock.sendall(REQUEST.pack(b"TKVU", 1) + RELEASE.pack(lease_id))
            assert RELEASED.unpack(sock.recv(RELEASED.size, socket.MSG_WAITALL)) == (0, 1)
        assert leases(holder)["live"] == 0 and holder.source.locked() == 0
    finally:
        holder.close()


def test_an_unregistered_pool_sends_readers_to_tcp(reader: Side) -> None:
    holder, keys = holder_side(9, 2)
    try:
        _, items = reserve(reader, keys)
        assert reader.t.fetch_many([(member(holder.t.address), items)]) == [[LoadStatus.OK] * 2]
        assert nixl_chunks(reader, holder) == 2
        reader.source.index.clear()
        assert isinstance(holder.t, NixlTransport)
        holder.t.unregister()  # the reader still has its metadata: the lease says no
        _, items = reserve(reader, keys)
        assert reader.t.fetch_many([(member(holder.t.address), items)]) == [[LoadStatus.OK] * 2]
        assert [bytes(v) for _, v in items] == [chunk_bytes(9, i, SIZE) for i in range(2)]
        assert nixl_chunks(reader, holder) == 2  # the second fetch went over TCP
        assert leases(holder)["live"] == 0
        wait_for(lambda: holder.source.locked() == 0)  # TCP releases after its last send
    finally:
        holder.close()


def test_a_reader_without_nixl_reads_a_nixl_holder_over_tcp(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    holder, keys = holder_side(10, 2)
    monkeypatch.setenv("TIERKV_NO_NIXL", "1")  # as where nixl cannot be imported
    source = PoolSource(16 << 20)
    with caplog.at_level(logging.WARNING, logger="tierkv.cluster.nixl_transport"):
        t = NixlTransport("127.0.0.1", 0, "127.0.0.1", TOKEN, "plain-reader",
                          region=source.pool.buf)  # fmt: skip
    reader = Side(source, t)
    try:
        assert t.agent is None
        assert [r.getMessage() for r in caplog.records if r.name.startswith("tierkv")] == [
            "peer transport nixl: TIERKV_NO_NIXL is set; peers read from this node over TCP"
        ]
        _, items = reserve(reader, keys)
        assert t.fetch_many([(member(holder.t.address), items)]) == [[LoadStatus.OK] * 2]
        assert [bytes(v) for _, v in items] == [chunk_bytes(10, i, SIZE) for i in range(2)]
        assert leases(holder)["granted"] == 0
    finally:
        reader.close()
        holder.close()


def test_a_holder_with_too_many_leases_out_serves_that_batch_over_tcp(reader: Side) -> None:
    holder, keys = holder_side(13, 2, max_leases=0)
    try:
        for _ in range(2):  # each batch over TCP; NIXL stays on for the next
            _, items = reserve(reader, keys)
            out = reader.t.fetch_many([(member(holder.t.address), items)])
            assert out == [[LoadStatus.OK] * 2]
            assert [bytes(v) for _, v in items] == [chunk_bytes(13, i, SIZE) for i in range(2)]
            reader.source.index.clear()
        assert leases(holder)["refused"] == 2 and leases(holder)["live"] == 0
        assert isinstance(reader.t, NixlTransport) and reader.t.fallbacks == 0
        wait_for(lambda: holder.source.locked() == 0)
        # No lease, no address: a BUSY reply names none of the chunks' slots.
        head, entries = reader.t._call(
            member(holder.t.address), lambda sock: reader.t._lease(sock, [(keys[0], SIZE)])
        )
        assert head[0] == LEASE_BUSY and head[2] == 0
        assert [(st, offset, length) for st, offset, length, _ in entries] == [(SENT_OUTSIDE, 0, 0)]
    finally:
        holder.close()


def test_a_lease_whose_entries_the_reader_refuses_is_released(
    reader: Side, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder naming bytes outside its region for every chunk: the reader reads nothing,
    so no READ's notification ends the lease; it kept the holder's read locks for the
    lease's whole time to live. The reader releases it."""
    holder, keys = holder_side(14, 2, lease_ttl=60.0)
    real_lease = reader.t._lease  # type: ignore[attr-defined]

    def lease_out_of_bounds(sock: Any, wanted: Any) -> Any:
        head, entries = real_lease(sock, wanted)
        return head, [(st, 1 << 50, length, digest) for st, _, length, digest in entries]

    monkeypatch.setattr(reader.t, "_lease", lease_out_of_bounds)
    try:
        _, items = reserve(reader, keys)
        assert reader.t.fetch_many([(member(holder.t.address), items)]) == [[LoadStatus.ERROR] * 2]
        wait_for(lambda: leases(holder)["live"] == 0 and holder.source.locked() == 0)
    finally:
        holder.close()


def test_a_holders_agent_loaded_while_it_was_forgotten_is_dropped(
    reader: Side, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load of a holder's agent still in flight when the holder was dropped (a READ
    given up, membership forgetting it) put the agent back, under a READ that may still
    be running. A load the holder was forgotten during is dropped now: that fetch reads
    over TCP, and the next one loads the agent afresh."""
    holder, keys = holder_side(15, 4)
    assert isinstance(reader.t, NixlTransport)
    t = reader.t
    at = member(holder.t.address)
    loading, resume = threading.Event(), threading.Event()
    real_call = t._call

    def slow_metadata(peer: Any, fn: Any, **kw: Any) -> Any:
        out = real_call(peer, fn, **kw)
        is_metadata = getattr(fn, "__func__", None) is NixlTransport._metadata
        if is_metadata and threading.current_thread().name == "first":
            loading.set()
            resume.wait(10)
        return out

    monkeypatch.setattr(t, "_call", slow_metadata)
    got: list[list[LoadStatus]] = []
    try:
        _, first_items = reserve(reader, keys[:2])
        first = threading.Thread(
            target=lambda: got.extend(t.fetch_many([(at, first_items)])), name="first"
        )
        first.start()
        assert loading.wait(10)
        t.forget(at)  # the holder left (and came back) while the first fetch loaded it
        resume.set()
        first.join(10)
        assert got == [[LoadStatus.OK] * 2]  # over TCP: its load was outdated
        assert nixl_chunks(reader, holder) == 0 and not t._remotes
        wait_for(lambda: not t._unloading)
        reader.source.index.clear()
        _, again = reserve(reader, keys)
        assert t.fetch_many([(at, again)]) == [[LoadStatus.OK] * 4]
        assert nixl_chunks(reader, holder) == 4  # loaded afresh
    finally:
        holder.close()


def test_a_batch_beyond_one_requests_chunk_limit_is_split(reader: Side) -> None:
    n = MAX_CHUNKS + 100
    holder, keys = holder_side(14, n, size=4096)
    assert isinstance(reader.t, NixlTransport) and reader.t.agent is not None
    loads: list[str] = []
    real_add = reader.t.agent.add_remote

    def add_remote(metadata: bytes) -> str:
        loads.append(threading.current_thread().name)
        return real_add(metadata)

    reader.t.agent.add_remote = add_remote  # type: ignore[method-assign]
    try:
        _, items = reserve(reader, keys, 4096)
        assert reader.t.fetch_many([(member(holder.t.address), items)]) == [[LoadStatus.OK] * n]
        assert len(loads) == 1  # the parts waited for one load of the holder's agent
        assert all(bytes(v) == chunk_bytes(14, i, 4096) for i, (_, v) in enumerate(items))
        assert nixl_chunks(reader, holder) == n
        # Split over a few leases (parts READ in parallel), each under the request limit.
        wait_for(lambda: leases(holder)["live"] == 0)
        assert leases(holder)["notified"] == leases(holder)["granted"] >= 2
    finally:
        holder.close()


class SlowOnce(PoolSource):
    """A holder's pool whose next lease takes longer than the reader waits."""

    delay = 0.0

    def acquire(self, keys: Sequence[bytes], lengths: Sequence[int]) -> Served:
        delay, self.delay = self.delay, 0.0
        time.sleep(delay)  # e.g. its chunks promoted from disk first
        return super().acquire(keys, lengths)


def test_a_lease_request_that_times_out_is_not_sent_again() -> None:
    """A pooled connection's request that times out is a slow holder, not a dropped
    connection: it is not sent again on a fresh one (which granted a second lease, and made
    the reader wait twice its timeout); the batch is a miss, and the next one is read."""
    source = SlowOnce(16 << 20)
    keys = [chunk_key(5, i) for i in range(2)]
    for i, key in enumerate(keys):
        source.put(key, chunk_bytes(5, i, SIZE))
    held = NixlTransport(
        "127.0.0.1", 0, "127.0.0.1", TOKEN, "holder", region=source.pool.buf, lease_ttl=30.0
    )
    holder = Side(source, held)
    held.serve(source)
    held.node_id = held.address.encode()
    rsrc = PoolSource(16 << 20)
    reads = NixlTransport(
        "127.0.0.1", 0, "127.0.0.1", TOKEN, "reader", region=rsrc.pool.buf, fence=rsrc.index,
        timeout=1.0,
    )  # fmt: skip
    reader = Side(rsrc, reads)
    try:
        _, items = reserve(reader, keys)
        at = member(holder.t.address)
        assert reader.t.fetch_many([(at, items)]) == [[LoadStatus.OK] * 2]  # a pooled connection
        wait_for(lambda: leases(holder)["live"] == 0)
        source.delay = 1.5
        assert reader.t.fetch_many([(at, items)]) == [[LoadStatus.ERROR] * 2]
        wait_for(lambda: leases(holder)["granted"] == 2)
        time.sleep(0.5)  # a second request would have been granted by now
        assert leases(holder)["granted"] == 2
        assert reader.t.fetch_many([(at, items)]) == [[LoadStatus.OK] * 2]
    finally:
        reader.close()
        holder.close()


@pytest.mark.parametrize("reply", ["metadata", "lease"])
def test_a_holder_trickling_a_reply_is_cut_off_at_one_deadline(
    reply: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member answering a metadata or lease request a byte at a time, never silent for a
    timeout: each receive had a timeout of its own, so the reader's fetch part waited as
    many timeouts as the reply had bytes. A reply must be whole within one timeout now:
    the reader hangs up after a few bytes, and the batch is a miss."""
    from tierkv.cluster import nixl_transport

    plain = nixl_transport.send_all
    sent: list[int] = []
    ended = threading.Event()

    def trickle(sock: socket.socket, parts: Sequence[memoryview | bytes]) -> None:
        data = b"".join(bytes(p) for p in parts)
        ours = len(parts[0]) == META.size if reply == "metadata" else data[:1] == bytes(1)
        if threading.current_thread() is threading.main_thread() or not ours:
            return plain(sock, parts)
        sent.extend([0, len(data)])
        for byte in data:
            sock.sendall(bytes([byte]))
            sent[0] += 1
            time.sleep(0.2)
            if select.select([sock], [], [], 0)[0] and sock.recv(1) == b"":
                ended.set()
                raise ConnectionError("the reader hung up")
        ended.set()
        return None

    holder, keys = holder_side(16, 1)
    rsrc = PoolSource(16 << 20)
    reads = NixlTransport("127.0.0.1", 0, "127.0.0.1", TOKEN, "reader", region=rsrc.pool.buf,
                          fence=rsrc.index, timeout=1.0)  # fmt: skip
    reader = Side(rsrc, reads)
    try:
        at = member(holder.t.address)
        if reply == "lease":  # the holder's agent loads first
            _, items = reserve(reader, keys)
            assert reads.fetch_many([(at, items)]) == [[LoadStatus.OK]]
            reader.source.index.clear()
        monkeypatch.setattr(nixl_transport, "send_all", trickle)
        _, items = reserve(reader, keys)
        assert reads.fetch_many([(at, items)]) == [[LoadStatus.ERROR]]
        assert ended.wait(60)
        assert sent[0] < sent[1] // 4, sent  # the reader hung up after one timeout
    finally:
        reader.close()
        holder.close()


@pytest.mark.parametrize("ttl", [0.0, 0.001, 86400.1, float("nan")])
def test_a_lease_time_to_live_the_wire_cannot_carry_is_refused(ttl: float) -> None:
    """Lease lifetimes go over the wire in milliseconds, as 32 bits: under 10 ms every
    READ would be late, past a day the holder could not send its grants."""
    with pytest.raises(ValueError, match="time to live"):
        NixlTransport("127.0.0.1", 0, "127.0.0.1", TOKEN, "holder", lease_ttl=ttl)
