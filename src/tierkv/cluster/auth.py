"""Authentication of cluster traffic with the shared secret, which never crosses the network.

Both planes use HMAC-SHA256 under a key derived from ``--auth-token`` (domain-separated, so
a MAC made here is worthless anywhere else the token is used):

- control plane: every request travels as ``[auth, payload]`` where ``auth`` is a version
  byte, the sender's id (8 random bytes drawn once per process), the sender's request counter
  (8 bytes, +1 per request signed), an 8-byte timestamp (ns since the epoch) and the MAC of
  all of them + payload. A server refuses a request whose MAC is wrong, whose timestamp is
  further than ``max_skew`` from its own clock, or that it served already: each signed
  request is single-use (:mod:`tierkv.cluster.replay`), so a captured one cannot be played
  again. Every reply is ``[auth, payload]`` too (version, timestamp, MAC), its MAC bound to
  the request's (so a reply cannot be forged, nor an old one replayed). A request in the
  format of tierkv before single-use requests is refused with a message saying so: the
  nodes of a cluster (and its controller) upgrade together.
- data plane: a mutual challenge-response when a connection opens. Each side sends a random
  nonce and proves it knows the key by a MAC over both nonces, its role and the node ids of
  the reader and of the holder it means to read from; a reader thus also knows it reads
  from that member, not an impostor serving bytes with a self-consistent checksum (nor one
  relaying the hello to another member). What passes after the hello is not MACed: a party
  on the network path itself could still alter it (see below).

Traffic is authenticated, not encrypted: run the cluster on a private network (or a VPN /
service mesh with mTLS) when KV bytes must stay confidential in transit.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable

from tierkv.cluster.replay import ReplayGuard

MAC_BYTES = 32
NONCE_BYTES = 16
SENDER_BYTES = 8
VERSION = 2  # of the control plane's auth frames (1: a bare timestamp + MAC, no version)
REQUEST_HEAD = struct.Struct(f"<B{SENDER_BYTES}sQq")  # version, sender, counter, stamp
REPLY_HEAD = struct.Struct("<Bq")  # version, stamp
AUTH_BYTES = REQUEST_HEAD.size + MAC_BYTES
REPLY_AUTH_BYTES = REPLY_HEAD.size + MAC_BYTES
OLD_AUTH_BYTES = 8 + MAC_BYTES  # version 1's frame (both ways)
DEFAULT_MAX_SKEW = 300.0  # seconds: clocks of a cluster's nodes agree far better (NTP)
OLD_VERSION = (
    "signed in the format of an older tierkv (before single-use control requests): upgrade "
    "every node of the cluster, and its controller, to the same version"
)


def derive_key(token: str) -> bytes:
    """The cluster's MAC key from the shared secret."""
    return hmac.new(token.encode(), b"tierkv cluster v1", hashlib.sha256).digest()


def _mac(key: bytes, *parts: bytes | memoryview) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        h.update(part)
    return h.digest()


class _Sender:
    """This process as a sender of control requests: a random id and a request counter
    (drawn again in a forked child, which would otherwise reuse its parent's counters)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._lock = threading.Lock()  # new in a forked child: the fork may copy it held
        self.id = secrets.token_bytes(SENDER_BYTES)
        self._counter = 0

    def next(self) -> tuple[bytes, int]:
        with self._lock:
            self._counter += 1
            return self.id, self._counter


_SENDER = _Sender()
os.register_at_fork(after_in_child=_SENDER.reset)


class ControlSigner:
    """Signs control-plane requests and replies, and checks them (on a server: single use
    too, with the :class:`~tierkv.cluster.replay.ReplayGuard` of :attr:`replays`)."""

    def __init__(
        self,
        token: str,
        max_skew: float = DEFAULT_MAX_SKEW,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self.key = derive_key(token)
        self.max_skew_ns = int(max_skew * 1e9)
        self.clock_ns = clock_ns
        self.replays = ReplayGuard(self.max_skew_ns, clock_ns=clock_ns)

    def sign_request(self, payload: bytes | memoryview) -> bytes:
        sender, counter = _SENDER.next()
        head = REQUEST_HEAD.pack(VERSION, sender, counter, self.clock_ns())
        return head + _mac(self.key, b"request", head, payload)

    def check_request(self, auth: bytes, payload: bytes | memoryview) -> str:
        """ "" if ``auth`` proves the request and it was not served before (it is then
        remembered as served); otherwise why not (for the log)."""
        if len(auth) != AUTH_BYTES or auth[0] != VERSION:
            return OLD_VERSION if len(auth) == OLD_AUTH_BYTES else "no request signature"
        head = auth[: REQUEST_HEAD.size]
        if not hmac.compare_digest(
            auth[REQUEST_HEAD.size :], _mac(self.key, b"request", head, payload)
        ):
            return "wrong signature (another cluster token?)"
        _, sender, counter, sent = REQUEST_HEAD.unpack(head)
        if abs(self.clock_ns() - sent) > self.max_skew_ns:
            return "timestamp outside the allowed clock skew (replayed, or clocks disagree)"
        return self.replays.first_use(sender, counter, sent)

    def sign_reply(self, request_auth: bytes, payload: bytes | memoryview) -> bytes:
        head = REPLY_HEAD.pack(VERSION, self.clock_ns())
        return head + _mac(self.key, b"reply", request_auth, head, payload)

    def check_reply(self, request_auth: bytes, auth: bytes, payload: bytes | memoryview) -> bool:
        if len(auth) != REPLY_AUTH_BYTES or auth[0] != VERSION:
            return False
        head = auth[: REPLY_HEAD.size]
        want = _mac(self.key, b"reply", request_auth, head, payload)
        return hmac.compare_digest(auth[REPLY_HEAD.size :], want)


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def hello_proof(
    key: bytes, role: bytes, mine: bytes, theirs: bytes, reader: bytes, holder: bytes
) -> bytes:
    """A data-plane side's proof: MAC over its role (b"holder" / b"reader"), its nonce, the
    other side's nonce, the reader's node id and the holder's. With both ids, a proof made
    for one pair convinces no other: a process at a member's data address (a stale member's
    port taken over) that relays a reader's hello to another member, and that member's
    proof back, is refused by the reader (the proof names another holder), and the reader's
    proof is refused by that member (it names another holder than itself)."""
    return _mac(
        key, b"hello", role, mine, theirs, len(reader).to_bytes(2, "little"), reader, holder
    )


__all__ = [
    "AUTH_BYTES",
    "MAC_BYTES",
    "NONCE_BYTES",
    "OLD_AUTH_BYTES",
    "REPLY_AUTH_BYTES",
    "ControlSigner",
    "derive_key",
    "hello_proof",
    "nonce",
]
