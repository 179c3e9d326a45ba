"""Signing of cluster traffic: tampering, other secrets, replays and swapped replies fail."""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from typing import Any

import pytest
import zmq

from tierkv.cluster import messages as m
from tierkv.cluster.auth import (
    AUTH_BYTES,
    OLD_AUTH_BYTES,
    REQUEST_HEAD,
    ControlSigner,
    derive_key,
    hello_proof,
    nonce,
)
from tierkv.cluster.control import ControlClient
from tierkv.cluster.control_server import ControlServer
from tierkv.cluster.replay import ReplayGuard

SKEW_NS = 300 * 10**9


def test_requests_verify_only_unchanged_and_under_the_same_secret() -> None:
    signer = ControlSigner("secret")
    auth = signer.sign_request(b"payload")
    assert len(auth) == AUTH_BYTES and signer.check_request(auth, b"payload") == ""
    assert "signature" in signer.check_request(auth, b"payloaD")
    assert "signature" in ControlSigner("other").check_request(auth, b"payload")
    assert "no request signature" in signer.check_request(b"", b"payload")
    assert "no request signature" in signer.check_request(auth[:-1], b"payload")


def test_old_or_future_requests_are_refused() -> None:
    now = 1_700_000_000 * 10**9
    server = ControlSigner("secret", max_skew=300, clock_ns=lambda: now)
    for offset_s in (-301, 301):
        sender = ControlSigner("secret", clock_ns=lambda o=offset_s: now + o * 10**9)
        auth = sender.sign_request(b"x")
        assert "skew" in server.check_request(auth, b"x")
    auth = ControlSigner("secret", clock_ns=lambda: now - 299 * 10**9).sign_request(b"x")
    assert server.check_request(auth, b"x") == ""


def test_replies_are_bound_to_their_request() -> None:
    signer = ControlSigner("secret")
    first, second = signer.sign_request(b"a"), signer.sign_request(b"b")
    reply = signer.sign_reply(first, b"answer")
    assert signer.check_reply(first, reply, b"answer")
    assert not signer.check_reply(second, reply, b"answer")  # an old reply to another request
    assert not signer.check_reply(first, reply, b"answeR")
    assert not ControlSigner("other").check_reply(first, reply, b"answer")


def test_hello_proofs_depend_on_role_nonces_both_node_ids_and_secret() -> None:
    key = derive_key("secret")
    a, b = nonce(), nonce()
    proof = hello_proof(key, b"holder", a, b, b"reader-1", b"holder-1")
    assert proof == hello_proof(key, b"holder", a, b, b"reader-1", b"holder-1")
    assert proof != hello_proof(key, b"reader", a, b, b"reader-1", b"holder-1")  # no reflection
    assert proof != hello_proof(key, b"holder", b, a, b"reader-1", b"holder-1")
    assert proof != hello_proof(key, b"holder", a, b, b"reader-2", b"holder-1")
    assert proof != hello_proof(key, b"holder", a, b, b"reader-1", b"holder-2")  # no relay
    # The ids' boundary counts: "reader-1h" + "older-1" is another pair.
    assert proof != hello_proof(key, b"holder", a, b, b"reader-1h", b"older-1")
    assert proof != hello_proof(derive_key("other"), b"holder", a, b, b"reader-1", b"holder-1")
    assert derive_key("secret") != b"secret" and len(key) == 32


def test_a_signed_request_is_served_once() -> None:
    server, sender = ControlSigner("secret"), ControlSigner("secret")
    auth = sender.sign_request(b"payload")
    assert server.check_request(auth, b"payload") == ""
    assert "replayed" in server.check_request(auth, b"payload")
    assert "replayed" in server.check_request(auth, b"payload")
    assert server.replays.refused == 2
    # Another server has not served it: single use is per receiver.
    assert ControlSigner("secret").check_request(auth, b"payload") == ""
    # Each signature is new, even for the same payload.
    assert server.check_request(sender.sign_request(b"payload"), b"payload") == ""


def test_the_old_frame_format_is_refused_with_a_clear_reason() -> None:
    reason = ControlSigner("secret").check_request(bytes(OLD_AUTH_BYTES), b"payload")
    assert "older tierkv" in reason and "upgrade" in reason
    auth = bytearray(ControlSigner("secret").sign_request(b"x"))
    auth[0] = 9  # an unknown version
    assert "no request signature" in ControlSigner("secret").check_request(bytes(auth), b"x")


def test_requests_out_of_order_within_the_window_are_all_served_once() -> None:
    guard = ReplayGuard(SKEW_NS, window=64, clock_ns=lambda: 10**18)
    order = list(range(1, 1001))
    rng = random.Random(7)
    for lo in range(0, 1000, 50):  # shuffled in blocks narrower than the window
        block = order[lo : lo + 50]
        rng.shuffle(block)
        order[lo : lo + 50] = block
    assert all(guard.first_use(b"s" * 8, c, 10**18) == "" for c in order)
    assert all("replayed" in guard.first_use(b"s" * 8, c, 10**18) for c in order[-64:])
    assert "replayed" in guard.first_use(b"s" * 8, 900, 10**18)  # older than the window
    assert guard.first_use(b"s" * 8, 1001, 10**18) == ""
    assert guard.first_use(b"t" * 8, 5, 10**18) == ""  # another sender's counters
    assert guard.refused == 65


def test_idle_senders_are_forgotten_and_a_full_table_keeps_refusing_replays() -> None:
    now = [10**18]
    guard = ReplayGuard(SKEW_NS, window=64, max_senders=4, clock_ns=lambda: now[0])
    for i in range(4):
        assert guard.first_use(bytes([i]) * 8, 1, now[0] + i) == ""
    # A fifth sender drops the one heard from least recently; that one's requests stay
    # refused (older than the floor), a new sender's are served.
    assert guard.first_use(b"\x09" * 8, 1, now[0] + 10) == ""
    assert len(guard) == 4
    assert "replayed" in guard.first_use(b"\x00" * 8, 1, now[0])
    # Senders silent for longer than the clock window are forgotten: what they signed is
    # refused by the timestamp check from then on.
    now[0] += SKEW_NS + 2 * 10**9
    assert guard.first_use(b"\x0a" * 8, 1, now[0]) == ""
    assert len(guard) == 1


def test_stamps_are_unique_across_threads_and_forks() -> None:
    signer = ControlSigner("secret")
    seen: list[tuple[bytes, int]] = []
    lock = threading.Lock()

    def sign() -> None:
        mine = [
            REQUEST_HEAD.unpack(signer.sign_request(b"x")[: REQUEST_HEAD.size]) for _ in range(500)
        ]
        with lock:
            seen.extend((sender, counter) for _, sender, counter, _ in mine)

    threads = [threading.Thread(target=sign) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(seen)) == 8 * 500
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child signs with its own sender id
        os.close(read)
        os.write(write, signer.sign_request(b"x")[: REQUEST_HEAD.size])
        os._exit(0)
    os.close(write)
    child = os.read(read, REQUEST_HEAD.size)
    os.close(read)
    os.waitpid(pid, 0)
    mine = signer.sign_request(b"x")[: REQUEST_HEAD.size]
    assert REQUEST_HEAD.unpack(child)[1] != REQUEST_HEAD.unpack(mine)[1]


def test_concurrent_signers_are_all_served() -> None:
    """Many threads sign and the server checks in whatever order they come: all pass."""
    server = ControlSigner("secret")
    client = ControlSigner("secret")
    signed: list[bytes] = []
    lock = threading.Lock()

    def sign() -> None:
        for _ in range(300):
            auth = client.sign_request(b"p")
            with lock:
                signed.append(auth)

    workers = [threading.Thread(target=sign) for _ in range(16)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    head = signed[:1000]
    random.Random(3).shuffle(head)  # and some arrive well out of order
    signed[:1000] = head
    assert [server.check_request(a, b"p") for a in signed] == [""] * len(signed)


def test_a_peer_of_the_zmq_control_wire_is_named_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """tierkv before the framed control channel spoke ZMQ: a call to such a peer gets no
    answer (and says why in the log, once), and such a peer calling us is refused, named."""
    router: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = ControlClient("secret", 2.0)
    try:
        with caplog.at_level(logging.WARNING, logger="tierkv.cluster.control"):
            assert client.call(f"127.0.0.1:{port}", m.GetMembers(0)) is None
            assert client.call(f"127.0.0.1:{port}", m.GetMembers(0)) is None
        named = [r for r in caplog.records if "older tierkv" in r.getMessage()]
        assert len(named) == 1, caplog.text
        assert client.timeouts == 2 and client.suspect(f"127.0.0.1:{port}")
    finally:
        client.close()
        router.close(linger=0)

    handlers = {m.GetMembers: lambda r: m.MemberList(r.rid, [])}
    server = ControlServer("127.0.0.1", 0, "secret", handlers)
    server.start()
    dealer: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        with caplog.at_level(logging.WARNING, logger="tierkv.cluster.control_server"):
            dealer.connect(f"tcp://127.0.0.1:{server.port}")
            dealer.send_multipart([b"auth", b"payload"])
            deadline = time.monotonic() + 10
            while server.refused == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
        assert server.refused == 1 and server.served == 0
        assert "older tierkv" in caplog.text and "upgrade" in caplog.text
        # The server goes on serving peers of its own version.
        client = ControlClient("secret", 5.0)
        try:
            assert client.call(f"127.0.0.1:{server.port}", m.GetMembers(0)) == m.MemberList(1, [])
        finally:
            client.close()
    finally:
        dealer.close(linger=0)
        server.close()
