"""What one client can hold is bounded: registrations (count, name lengths, idle clients the
server cannot watch) and open store reservations; and what all clients hold together:
connections, descriptors, large requests being received and replies not yet sent. Against
real server processes."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from support.httputil import wait_for
from support.raw_rpc import Raw
from support.servers import (
    CHUNK_BYTES,
    CHUNK_SHAPE,
    CHUNK_SIZE,
    ServerProcess,
    chunk_data,
    register,
)
from tierkv import framing, keys
from tierkv import protocol as p

Servers = Callable[..., ServerProcess]
LAYOUT = p.Layout(list(CHUNK_SHAPE), "float32", 1)


def _register(raw: Raw, **kw: Any) -> Any:
    """REGISTER as an unwatched client (pid 0: another host or pid namespace)."""
    return raw.call(p.Register(1, p.PROTOCOL_VERSION, kw.pop("model", "m"), LAYOUT, **kw))


def _tokens(seed: int, chunks: int) -> p.ChunkSelector:
    start = seed * 1_000_000
    return p.ChunkSelector(tokens=keys.pack_tokens(range(start, start + chunks * CHUNK_SIZE)))


def test_unwatched_clients_expire_when_idle_and_requests_keep_them(server_factory: Servers) -> None:
    srv = server_factory(extra=["--client-idle-ttl", "1.5"])
    keeper = srv.client()
    register(keeper)
    tokens = list(range(2 * CHUNK_SIZE))
    keeper.store(tokens, [chunk_data(tokens, i) for i in range(2)])
    idle, busy = Raw(srv.endpoint), Raw(srv.endpoint)
    try:
        gone = _register(idle, model="test-model").client
        alive = _register(busy, model="test-model").client
        sel = p.ChunkSelector(tokens=keys.pack_tokens(tokens))
        assert idle.call(p.Lookup(2, gone, sel, "r")).hits == 2  # locks both chunks
        assert keeper.stats().read_locked == 2
        deadline = time.monotonic() + 20
        while keeper.stats().clients_expired < 1 and time.monotonic() < deadline:
            assert isinstance(busy.call(p.Ping(3)), p.Ok)
            busy.call(p.Lookup(4, alive, sel))  # any request refreshes the client
            time.sleep(0.2)
        s = keeper.stats()
        assert s.clients_expired == 1 and s.clients == 2  # the keeper and the busy one
        assert s.read_locked == 0 and s.read_leases == 0  # its locks went with it
        reply = idle.call(p.Lookup(5, gone, sel))
        assert isinstance(reply, p.Error) and "register again" in reply.message
        assert isinstance(busy.call(p.Lookup(6, alive, sel)), p.LookupResult)
    finally:
        idle.close()
        busy.close()


def test_registrations_are_bounded_in_number_and_name_length(server_factory: Servers) -> None:
    srv = server_factory(extra=["--max-clients", "2"])
    raw = Raw(srv.endpoint)
    try:
        first = _register(raw)
        assert isinstance(_register(raw), p.Registered)
        refused = _register(raw)
        assert isinstance(refused, p.Error) and refused.code is p.ErrorCode.LIMIT
        assert "--max-clients" in refused.message
        assert isinstance(raw.call(p.Unregister(2, first.client)), p.Ok)
        assert isinstance(_register(raw), p.Registered)  # room again
        for field, size in (("name", 257), ("engine_id", 257), ("model", 1025)):
            reply = _register(raw, **{field: "x" * size})
            assert isinstance(reply, p.Error) and reply.code is p.ErrorCode.BAD_REQUEST
            assert field in reply.message
        assert isinstance(raw.call(p.Ping(3)), p.Ok)
    finally:
        raw.close()


def test_one_clients_open_reservations_are_bounded(server_factory: Servers) -> None:
    # A 64 MiB pool, a quarter for one client: 512 chunks of 32 KiB.
    srv = server_factory("64MiB", ["--client-reservation-share", "0.25"])
    share = 64 * 2**20 // 4 // CHUNK_BYTES
    raw = Raw(srv.endpoint)
    try:
        hog = _register(raw).client
        other = _register(raw).client
        held = raw.call(p.PrepareStore(2, hog, _tokens(1, share + 10)))
        assert len(held.slots) == share and len(held.no_space) == 10  # refused like a full pool
        more = raw.call(p.PrepareStore(3, hog, _tokens(2, 4)))
        assert not more.slots and len(more.no_space) == 4
        theirs = raw.call(p.PrepareStore(4, other, _tokens(3, 4)))
        assert len(theirs.slots) == 4  # other clients still store
        assert isinstance(raw.call(p.CommitStore(5, hog, held.lease)), p.Committed)
        again = raw.call(p.PrepareStore(6, hog, _tokens(2, 4)))
        assert len(again.slots) == 4  # committed chunks no longer count against it
    finally:
        raw.close()


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_a_frame_header_alone_costs_the_server_no_memory(server_factory: Servers) -> None:
    """A header announcing a frame of almost max_message_bytes, then nothing: the server's
    buffer for it takes memory only as bytes arrive (16 such connections made it allocate
    and zero 1 GiB). The server keeps serving, and lets the memory go with the sockets."""
    srv = server_factory()
    assert srv.proc is not None
    path = srv.endpoint.removeprefix("ipc://")
    before = _rss_kib(srv.proc.pid)
    stalled = []
    for _ in range(16):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        sock.sendall(struct.pack("<I", 60 * 2**20))
        stalled.append(sock)
    with srv.client() as client:
        client.stats()
        assert _rss_kib(srv.proc.pid) - before < 64 * 1024  # was 16 x 60 MiB
    for sock in stalled:
        sock.close()


def test_out_of_file_descriptors_the_server_turns_connections_away_quietly(
    server_factory: Servers,
) -> None:
    """With its open files limit reached, a server could accept no connection: its
    listener stayed readable, the loop woke at once for ever and logged a warning each time
    (tens of thousands a second). It now turns the waiting connection away (closed at once)
    and warns once; once descriptors are free again, it serves new clients."""
    srv = server_factory()
    assert srv.proc is not None
    pid = srv.proc.pid
    path = srv.endpoint.removeprefix("ipc://")
    used = len(os.listdir(f"/proc/{pid}/fd"))
    limit = used + 32
    subprocess.run(["prlimit", f"--pid={pid}", f"--nofile={limit}:{limit}"], check=True)
    idle = []
    try:
        for _ in range(40):  # more than the server has descriptors left for
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            idle.append(sock)
        wait_for(
            "the server out of descriptors",
            lambda: len(os.listdir(f"/proc/{pid}/fd")) >= limit - 1,
            10,
        )
        extra = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        extra.settimeout(10)
        extra.connect(path)
        assert extra.recv(1) == b""  # turned away: closed, not left waiting
        extra.close()
    finally:
        for sock in idle:
            sock.close()
    with srv.client() as client:
        client.stats()
    warnings = [line for line in srv.log().splitlines() if "turned away" in line]
    assert 1 <= len(warnings) <= 2, warnings[:5]
    assert srv.proc.poll() is None


def _connections(srv: ServerProcess) -> dict[str, int]:
    with srv.client() as client:
        figures = dict(client.stats().connections)
    figures["open"] -= 1  # the connection that asked
    return figures


def test_connections_are_bounded_in_number(server_factory: Servers) -> None:
    """Past --max-connections a new connection is closed at once (one warning); the open
    ones keep being served, and once one closes there is room again."""
    srv = server_factory(extra=["--max-connections", "6"])
    path = srv.endpoint.removeprefix("ipc://")
    with srv.client() as client:
        assert client.stats().connections["max"] == 6
        idle = []
        try:
            for _ in range(5):  # with the client's own: the limit
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(path)
                idle.append(sock)
            wait_for("6 open", lambda: client.stats().connections["open"] == 6, 10)
            for _ in range(3):
                extra = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                extra.settimeout(10)
                extra.connect(path)
                assert extra.recv(1) == b""  # turned away: closed, not left waiting
                extra.close()
            figures = client.stats().connections
            assert figures["turned_away_max_connections"] == 3 and figures["open"] == 6
            idle.pop().close()
            wait_for("room again", lambda: client.stats().connections["open"] == 5, 10)
            raw = Raw(srv.endpoint)
            assert isinstance(raw.call(p.Ping(1)), p.Ok)
            raw.close()
        finally:
            for sock in idle:
                sock.close()
    warnings = [line for line in srv.log().splitlines() if "--max-connections" in line]
    assert len(warnings) == 1, warnings


def test_large_requests_in_progress_share_a_server_wide_budget(server_factory: Servers) -> None:
    """Each client may send a request of up to max_message_bytes before it has shown who
    it is: many such clients added up to all the server's memory. The bytes of large
    requests being received share --connection-buffer-bytes: bytes past it get a limit error
    and their connection is closed; others keep being served; a header alone holds nothing
    (idle announcers block nobody); whole requests and closed connections give their bytes
    back."""
    mib = 2**20
    srv = server_factory(extra=["--max-message-bytes", "4MiB", "--connection-buffer-bytes", "8MiB"])
    path = srv.endpoint.removeprefix("ipc://")

    def connect(data: bytes) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        sock.sendall(data)
        return sock

    idle = [connect(struct.pack("<I", 4 * mib)) for _ in range(4)]  # announced only
    partial = struct.pack("<I", 4 * mib) + b"\x00" * (4 * mib - 4096)
    stalled = [connect(partial), connect(partial)]
    held = 2 * (4 * mib - 4096)
    wait_for("two requests held", lambda: _connections(srv)["receiving_bytes"] == held, 10)
    refused = Raw(srv.endpoint)
    refused.send_bytes(struct.pack("<I", 4 * mib) + b"\x00" * 16384)
    reply = refused.recv()
    assert isinstance(reply, p.Error) and reply.code is p.ErrorCode.LIMIT
    assert "connection_buffer_bytes" in reply.message
    with pytest.raises(OSError):
        refused.call(p.Ping(1))  # closed
    refused.close()
    figures = _connections(srv)
    assert figures["refused_large_requests"] == 1 and figures["receiving_bytes"] == held
    stalled.pop().close()
    wait_for("one held", lambda: _connections(srv)["receiving_bytes"] == held // 2, 10)
    raw = Raw(srv.endpoint)
    try:
        for rid in (1, 2):  # a whole large request gives its bytes back: room for the next
            junk = msgspec.msgpack.encode(["ping", rid, b"x" * (4 * mib - 64)])
            reply = raw.call(junk)
            assert isinstance(reply, p.Error) and reply.code is p.ErrorCode.BAD_REQUEST
            assert _connections(srv)["receiving_bytes"] == held // 2
        assert isinstance(raw.call(p.Ping(3)), p.Ok)
    finally:
        raw.close()
        for sock in stalled + idle:
            sock.close()
    wait_for("nothing held", lambda: _connections(srv)["receiving_bytes"] == 0, 10)


def test_unsent_replies_share_a_server_wide_budget(server_factory: Servers) -> None:
    """Clients that send requests and never read the replies: each is bounded alone, and
    all together by --connection-buffer-bytes, past which the one holding the most unsent
    is disconnected (one warning); a client that reads its replies keeps being served."""
    srv = server_factory(
        extra=["--max-message-bytes", "64KiB", "--connection-buffer-bytes", "1MiB"]
    )
    hog = Raw(srv.endpoint)
    request = msgspec.msgpack.encode(p.GetStats(1))
    burst = (framing.HEADER.pack(len(request)) + request) * 200
    try:
        with srv.client() as client:
            reply_bytes = len(msgspec.msgpack.encode(client.stats()))

            def dropped() -> bool:
                try:
                    hog.send_bytes(burst)  # its replies pile up: it reads none
                except OSError:
                    return True  # disconnected
                return client.stats().connections["dropped_unsent"] >= 1

            # Far more than the socket buffers and the budget take: 40 MiB of replies.
            wait_for("the hog dropped", dropped, 60)
            figures = client.stats().connections
            assert figures["dropped_unsent"] == 1, figures
            assert figures["unsent_bytes"] <= 2**20
            assert reply_bytes * 200 < 2**20  # one burst alone never passes the budget
    finally:
        hog.close()
    warnings = [line for line in srv.log().splitlines() if "replies unsent in all" in line]
    assert len(warnings) == 1, warnings
