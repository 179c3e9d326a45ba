"""The control channel's connections (:mod:`tierkv.cluster.control`,
:mod:`tierkv.cluster.control_server`): a peer that starts listening during a call, a peer that
restarted under pooled connections, calls to several peers at once, a connection cut in the
middle of a request, a request over the size limit, a client that never reads its replies."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

import pytest

from support.control_wire import RawControl
from tierkv import framing
from tierkv.cluster import control_server
from tierkv.cluster import control_wire as wire
from tierkv.cluster import messages as m
from tierkv.cluster.auth import REPLY_AUTH_BYTES, ControlSigner
from tierkv.cluster.control import ControlClient
from tierkv.cluster.control_server import ControlServer
from tierkv.served_connections import UnprovenLimits

TOKEN = "channel-secret"


def members_handler(req: m.GetMembers) -> m.MemberList:
    return m.MemberList(req.rid, [])


def serve(port: int = 0, max_message_bytes: int = 1 << 20) -> ControlServer:
    server = ControlServer(
        "127.0.0.1", port, TOKEN, {m.GetMembers: members_handler}, max_message_bytes
    )
    server.start()
    return server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_call_to_a_peer_that_starts_listening_meanwhile_is_answered() -> None:
    port = free_port()
    client = ControlClient(TOKEN, 10.0)
    started: list[ControlServer] = []
    later = threading.Timer(0.3, lambda: started.append(serve(port)))
    later.start()
    try:
        t = time.monotonic()
        reply = client.call(f"127.0.0.1:{port}", m.GetMembers(0))
        assert isinstance(reply, m.MemberList), reply
        assert 0.25 < time.monotonic() - t < 10.0
        assert client.timeouts == 0 and not client.suspects()
    finally:
        later.join()
        client.close()
        for server in started:
            server.close()


def test_nothing_listening_is_no_answer_by_the_timeout_and_a_suspect() -> None:
    addr = f"127.0.0.1:{free_port()}"
    client = ControlClient(TOKEN, 0.3)
    try:
        t = time.monotonic()
        assert client.call(addr, m.GetMembers(0)) is None
        assert 0.25 < time.monotonic() - t < 10.0
        assert client.suspect(addr) and client.timeouts == 1
        # An address that cannot be one: no answer at once, nobody made suspect.
        assert client.call("not an address", m.GetMembers(0)) is None
        assert not client.suspect("not an address")
    finally:
        client.close()


def test_pooled_connections_to_a_restarted_peer_are_replaced() -> None:
    server = serve()
    port = server.port
    addr = f"127.0.0.1:{port}"
    client = ControlClient(TOKEN, 5.0)
    try:
        # Several threads at once: several pooled connections.
        replies: list[object] = []
        threads = [
            threading.Thread(target=lambda: replies.append(client.call(addr, m.GetMembers(0))))
            for _ in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(isinstance(r, m.MemberList) for r in replies), replies
        server.close()
        server = serve(port)
        for _ in range(20):  # every pooled connection is stale: each is noticed, none fails
            assert isinstance(client.call(addr, m.GetMembers(0)), m.MemberList)
        assert client.timeouts == 0
    finally:
        client.close()
        server.close()


def test_call_many_waits_for_all_together_and_names_who_did_not_answer() -> None:
    servers = [serve() for _ in range(3)]
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    client = ControlClient(TOKEN, 0.5)
    try:
        addrs = [f"127.0.0.1:{s.port}" for s in servers]
        mute = f"127.0.0.1:{silent.getsockname()[1]}"
        t = time.monotonic()
        replies = client.call_many({a: m.GetMembers(0) for a in [*addrs, mute]})
        assert time.monotonic() - t >= 0.45  # waited for the silent one to its timeout
        assert sorted(replies) == sorted(addrs)
        assert all(isinstance(r, m.MemberList) for r in replies.values())
        assert client.suspects() == [mute]
    finally:
        client.close()
        silent.close()
        for s in servers:
            s.close()


def test_bogus_member_addresses_are_no_answer_never_an_error() -> None:
    """Addresses gossiped by a broken or hostile peer (a port past 65535, a host name the
    resolver refuses, digits that are not ASCII, no port): those calls get no answer, the
    others are answered. A port of 99999 raised out of call_many (OverflowError), and the
    heartbeat round that called it failed every time: no member ever expired again."""
    server = serve()
    client = ControlClient(TOKEN, 0.5)
    try:
        good = f"127.0.0.1:{server.port}"
        bogus = ["127.0.0.1:99999", "é:1", "\udcff:1", "127.0.0.1:\u0661", "garbage", ""]
        replies = client.call_many({a: m.GetMembers(0) for a in [good, *bogus]}, suspect=False)
        assert list(replies) == [good] and isinstance(replies[good], m.MemberList)
    finally:
        client.close()
        server.close()


def test_cut_and_oversized_requests_close_their_connection_only() -> None:
    server = serve(max_message_bytes=4096)
    addr = f"127.0.0.1:{server.port}"
    signer = ControlSigner(TOKEN)
    client = ControlClient(TOKEN, 5.0)
    try:
        # A request cut in the middle (its sender died): the connection goes, nothing else.
        with RawControl(addr) as raw:
            raw.sock.sendall(framing.HEADER.pack(100) + b"\x20\x00" + bytes(10))
        # Announced over the limit: refused with the reason, the body never read.
        with RawControl(addr) as raw:
            raw.sock.sendall(framing.HEADER.pack(1 << 30))
            reply = m.reply_decoder.decode(raw.reply())
            assert isinstance(reply, m.Refused) and "larger than the limit" in reply.reason
            assert raw.closed_by_peer()
        # Within the limit, signed: served, on the same server.
        with RawControl(addr) as raw:
            payload = m.encode(m.GetMembers(7))
            assert raw.call([signer.sign_request(payload), payload]) == m.MemberList(7, [])
        assert isinstance(client.call(addr, m.GetMembers(0)), m.MemberList)
        assert server.malformed == 1 and server.alive()
    finally:
        client.close()
        server.close()


def test_a_client_that_never_reads_its_replies_is_disconnected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(control_server, "MAX_UNSENT", 1 << 20)
    big = ["h" * 65536]  # each answer about 64 KiB: the kernel's buffers fill after a few
    server = ControlServer(
        "127.0.0.1",
        0,
        TOKEN,
        {m.GetMembers: members_handler, m.Resolve: lambda r: m.Resolved(r.rid, big)},
    )
    server.start()
    addr = f"127.0.0.1:{server.port}"
    signer = ControlSigner(TOKEN)
    client = ControlClient(TOKEN, 5.0)
    try:
        with RawControl(addr) as raw:
            closed = False
            for i in range(10_000):  # requests, never a read, until the server gives up
                payload = m.encode(m.Resolve(i, []))
                try:
                    raw.send([signer.sign_request(payload), payload])
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                    break
            assert closed or raw.closed_by_peer(), "the server kept replies nobody reads"
        assert isinstance(client.call(addr, m.GetMembers(0)), m.MemberList)
        assert server.alive()
    finally:
        client.close()
        server.close()


def test_a_first_reply_of_any_length_is_answered_not_taken_for_a_zmq_peer() -> None:
    """A ZMTP greeting (an older tierkv's ZMQ control wire) starts with 0xFF, and so does a
    reply frame whose length's low byte is 0xFF: every first reply on a fresh connection,
    of each of the 256 low bytes, is answered (tests/cluster/test_cluster_auth.py keeps a
    real ZMQ peer named as one)."""
    pad: list[int] = [0]
    server = ControlServer(
        "127.0.0.1",
        0,
        TOKEN,
        {m.GetStatus: lambda req: m.NodeStatus(req.rid, {"pad": "x" * pad[0]})},
    )
    server.start()
    lows: set[int] = set()
    try:
        for n in range(256):
            pad[0] = n
            client = ControlClient(TOKEN, 5.0)  # a fresh connection: its first reply
            try:
                reply = client.call(f"127.0.0.1:{server.port}", m.GetStatus(0))
            finally:
                client.close()
            assert isinstance(reply, m.NodeStatus) and reply.stats["pad"] == "x" * n, (n, reply)
            assert client.bad_replies == 0
            payload = m.encode(m.NodeStatus(0, {"pad": "x" * n}))
            lows.add(wire.frame(bytes(REPLY_AUTH_BYTES), payload)[0][0])
    finally:
        server.close()
    assert 0xFF in lows  # the case: a frame whose first byte is ZMTP's


def test_zmtp_greetings_are_told_from_reply_frames() -> None:
    libzmq = b"\xff" + (1).to_bytes(8, "big") + b"\x7f"  # what libzmq's signature looks like
    assert wire.zmtp_greeting(libzmq + b"\x03\x00NULL") is True
    assert wire.zmtp_greeting(libzmq[:5]) is None  # the rest on its way
    frame = b"".join(wire.frame(bytes(REPLY_AUTH_BYTES), bytes(0xFF - 2 - REPLY_AUTH_BYTES)))
    assert frame[0] == 0xFF and wire.zmtp_greeting(frame[:10]) is False
    assert wire.zmtp_greeting(b"") is False


def test_connections_without_a_signed_request_cannot_keep_members_out() -> None:
    """Anyone reaching the port could open connections and send nothing (or only the
    public hello), or start large messages and stall: every connection counted against the
    server's, every byte against the buffer budget, and enough kept every member out. Until
    its first signed request a connection is unproven: few at once, their large messages on
    a budget of their own, and past either the oldest goes (so a member connecting, even
    with a large first request, always gets in), each closed after a while."""
    # Long enough that none expires before the steps that evict them (a loaded machine).
    limits = UnprovenLimits(total=8, per_host=4, seconds=8.0, receive_bytes=256 * 1024)
    handlers: dict[type, Any] = {
        m.GetMembers: members_handler,
        m.Resolve: lambda req: m.MemberList(req.rid, []),
    }
    server = ControlServer("127.0.0.1", 0, TOKEN, handlers, unproven=limits)
    server.start()
    client = ControlClient(TOKEN, 5.0)
    addr = f"127.0.0.1:{server.port}"
    unproven = server._clients
    assert unproven is not None
    idle: list[socket.socket] = []

    def connect(data: bytes) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(data)
        idle.append(sock)
        return sock

    def closed_by_server(sock: socket.socket) -> bool:
        sock.settimeout(30)  # a liveness bound: expiry comes after `seconds`
        with contextlib.suppress(ConnectionResetError):
            while sock.recv(65536):
                pass
        return True

    def call_as_new_member(msg: Any) -> Any:
        other = ControlClient(TOKEN, 5.0)
        try:
            return other.call(addr, msg)
        finally:
            other.close()

    try:
        assert isinstance(client.call(addr, m.GetMembers(0)), m.MemberList)  # proven
        first = connect(b"")  # nothing at all
        connect(wire.hello())  # the hello is public: it proves nothing
        stalled = connect(wire.hello() + framing.HEADER.pack(1 << 20) + bytes(200 * 1024))
        deadline = time.monotonic() + 10
        while unproven.receiving_unproven.used < 200 * 1024:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert unproven.receiving.used == 0  # none of the members' budget
        # A member's large first request: the stalled message is closed to make room.
        big = m.Resolve(0, [bytes(32)] * 5000)
        assert isinstance(call_as_new_member(big), m.MemberList)
        assert closed_by_server(stalled) and server.stats()["evicted_unproven"] == 1
        # Four unproven from one address: a member connecting closes the oldest.
        connect(b"")
        connect(wire.hello())
        assert isinstance(call_as_new_member(m.GetMembers(0)), m.MemberList)
        assert closed_by_server(first) and server.stats()["evicted_unproven"] == 2
        assert isinstance(client.call(addr, m.GetMembers(0)), m.MemberList)  # still served
        for sock in idle:  # the others are closed once their time is up
            assert closed_by_server(sock)
        assert server.stats()["expired_unproven"] == 3
        assert unproven.receiving_unproven.used == 0 and server.stats()["connections"] == 1
    finally:
        for sock in idle:
            sock.close()
        client.close()
        server.close()


@pytest.mark.parametrize(
    "bad", [{"total": 0}, {"per_host": 0}, {"receive_bytes": 0}, {"seconds": 0.0}]
)
def test_unproven_limits_must_be_positive(bad: dict[str, Any]) -> None:
    """A zero limit left nothing to evict and crashed the accept loop: refused at once."""
    with pytest.raises(ValueError, match="positive"):
        UnprovenLimits(**bad)
