"""Authentication of cluster traffic with the shared secret, which never crosses the network.

Both planes use HMAC-SHA256 under a key derived from ``--auth-token`` (domain-separated, so
a MAC made here is worthless anywhere else the token is used):

- control plane: every request travels as ``[auth, payload]`` where ``auth`` is an 8-byte
  timestamp (ns since the epoch) and the MAC of timestamp + payload. A server refuses a
  request whose MAC is wrong or whose timestamp is further than ``max_skew`` from its own
  clock (replays are bounded to that window). Every reply is ``[auth, payload]`` too, its MAC
  bound to the request's (so a reply cannot be forged, nor an old one replayed).
- data plane: a mutual challenge-response when a connection opens. Each side sends a random
  nonce and proves it knows the key by a MAC over both nonces, its role and the reader's
  node id; a reader thus also knows the holder it reads from is a member, not an impostor
  serving bytes with a self-consistent checksum.

Traffic is authenticated, not encrypted: run the cluster on a private network (or a VPN /
service mesh with mTLS) when KV bytes must stay confidential in transit.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import time
from collections.abc import Callable

MAC_BYTES = 32
NONCE_BYTES = 16
STAMP = struct.Struct("<q")
AUTH_BYTES = STAMP.size + MAC_BYTES
DEFAULT_MAX_SKEW = 300.0  # seconds: clocks of a cluster's nodes agree far better (NTP)


def derive_key(token: str) -> bytes:
    """The cluster's MAC key from the shared secret."""
    return hmac.new(token.encode(), b"tierkv cluster v1", hashlib.sha256).digest()


def _mac(key: bytes, *parts: bytes) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        h.update(part)
    return h.digest()


class ControlSigner:
    """Signs and checks control-plane requests and replies."""

    def __init__(
        self,
        token: str,
        max_skew: float = DEFAULT_MAX_SKEW,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self.key = derive_key(token)
        self.max_skew_ns = int(max_skew * 1e9)
        self.clock_ns = clock_ns

    def sign_request(self, payload: bytes) -> bytes:
        stamp = STAMP.pack(self.clock_ns())
        return stamp + _mac(self.key, b"request", stamp, payload)

    def check_request(self, auth: bytes, payload: bytes) -> str:
        """ "" if ``auth`` proves the request; otherwise why not (for the log)."""
        if len(auth) != AUTH_BYTES:
            return "no request signature"
        stamp = auth[: STAMP.size]
        if not hmac.compare_digest(auth[STAMP.size :], _mac(self.key, b"request", stamp, payload)):
            return "wrong signature (another cluster token?)"
        (sent,) = STAMP.unpack(stamp)
        if abs(self.clock_ns() - sent) > self.max_skew_ns:
            return "timestamp outside the allowed clock skew (replayed, or clocks disagree)"
        return ""

    def sign_reply(self, request_auth: bytes, payload: bytes) -> bytes:
        stamp = STAMP.pack(self.clock_ns())
        return stamp + _mac(self.key, b"reply", request_auth, stamp, payload)

    def check_reply(self, request_auth: bytes, auth: bytes, payload: bytes) -> bool:
        if len(auth) != AUTH_BYTES:
            return False
        stamp = auth[: STAMP.size]
        want = _mac(self.key, b"reply", request_auth, stamp, payload)
        return hmac.compare_digest(auth[STAMP.size :], want)


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def hello_proof(key: bytes, role: bytes, mine: bytes, theirs: bytes, reader: bytes) -> bytes:
    """A data-plane side's proof: MAC over its role (b"holder" / b"reader"), its nonce, the
    other side's nonce and the reader's node id."""
    return _mac(key, b"hello", role, mine, theirs, reader)


__all__ = [
    "AUTH_BYTES",
    "MAC_BYTES",
    "NONCE_BYTES",
    "ControlSigner",
    "derive_key",
    "hello_proof",
    "nonce",
]
