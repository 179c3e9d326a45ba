"""The control channel's wire format: what a control connection carries, byte by byte.

A client opens a TCP connection to a node's (or the controller's) control port and sends a
:data:`HELLO`: ``b"TKVC"`` and the wire version (2 bytes, little-endian, then 2 bytes of
padding). The server answers nothing to it. Then every request is one frame of
:mod:`tierkv.framing` (a 4-byte little-endian length, then the body) whose body is the
length of the signature (2 bytes), the signature (:mod:`tierkv.cluster.auth`) and the msgpack
payload; the server answers each request, in order, with a frame of the same shape (the
reply's signature and payload). A connection carries one request at a time.

A connection that opens with anything else is closed; one that opens with a ZMTP greeting
(its first byte ``0xFF``) comes from a tierkv of the versions whose control channel ran on
ZMQ, and is named so in the log (:data:`OLD_WIRE`); a client that reads a ZMTP greeting from
a server names it the same way (:func:`zmtp_greeting`: a reply whose length's low byte is
``0xFF`` is not one).
"""

from __future__ import annotations

import struct

from tierkv import framing

MAGIC = b"TKVC"
VERSION = 1
HELLO = struct.Struct("<4sH2x")
AUTH_LENGTH = struct.Struct("<H")
ZMTP_FIRST_BYTE = 0xFF
ZMTP_SIGNATURE = 10  # bytes
OLD_WIRE = (
    "speaks the ZMQ control protocol of an older tierkv: upgrade every node of the cluster, "
    "and its controller, to the same version"
)


def hello() -> bytes:
    """What a client sends first on every connection."""
    return HELLO.pack(MAGIC, VERSION)


def zmtp_greeting(head: bytes) -> bool | None:
    """Whether a server's first bytes (at least :data:`ZMTP_SIGNATURE` of them, peeked) are a
    ZMTP greeting; None while too few have arrived to tell. A ZMTP signature is ``0xFF``,
    8 bytes of padding (libzmq: a big-endian 64-bit count, so its bytes 4 and 5 are zero)
    and ``0x7F``. A reply frame may start with ``0xFF`` too (the low byte of its length),
    but its bytes 4 and 5 are the length of its signature, never zero."""
    if head[:1] != bytes([ZMTP_FIRST_BYTE]):
        return False
    if len(head) < ZMTP_SIGNATURE:
        return None
    return head[4:6] == b"\0\0" and head[9] == 0x7F


def check_hello(data: bytes | bytearray) -> str:
    """ "" if ``data`` (a whole :data:`HELLO`) opens a control connection we speak; else why
    not (for the log)."""
    if data[:1] == bytes([ZMTP_FIRST_BYTE]):
        return f"the peer {OLD_WIRE}"
    magic, version = HELLO.unpack(data)
    if magic != MAGIC:
        return "not a tierkv control connection"
    if version != VERSION:
        return f"control wire version {version}; this node speaks version {VERSION}"
    return ""


def frame(auth: bytes, payload: bytes) -> list[bytes]:
    """The parts of one message's frame (for one ``sendmsg``)."""
    head = framing.HEADER.pack(AUTH_LENGTH.size + len(auth) + len(payload))
    return [head + AUTH_LENGTH.pack(len(auth)), auth, payload]


def split(body: memoryview) -> tuple[bytes, memoryview] | None:
    """A frame's body as (signature, payload); None when it cannot hold them."""
    if len(body) < AUTH_LENGTH.size:
        return None
    (n,) = AUTH_LENGTH.unpack_from(body)
    end = AUTH_LENGTH.size + n
    if end > len(body):
        return None
    return bytes(body[AUTH_LENGTH.size : end]), body[end:]
