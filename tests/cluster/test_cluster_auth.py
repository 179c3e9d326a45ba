"""Signing of cluster traffic: tampering, other secrets, replays and swapped replies fail."""

from __future__ import annotations

from tierkv.cluster.auth import AUTH_BYTES, ControlSigner, derive_key, hello_proof, nonce


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


def test_hello_proofs_depend_on_role_nonces_reader_and_secret() -> None:
    key = derive_key("secret")
    a, b = nonce(), nonce()
    proof = hello_proof(key, b"holder", a, b, b"reader-1")
    assert proof == hello_proof(key, b"holder", a, b, b"reader-1")
    assert proof != hello_proof(key, b"reader", a, b, b"reader-1")  # no reflection
    assert proof != hello_proof(key, b"holder", b, a, b"reader-1")
    assert proof != hello_proof(key, b"holder", a, b, b"reader-2")
    assert proof != hello_proof(derive_key("other"), b"holder", a, b, b"reader-1")
    assert derive_key("secret") != b"secret" and len(key) == 32
