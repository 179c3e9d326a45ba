"""How the Redis tier's bulk commands reach the socket: a RESP command packer that keeps
large arguments and payload views as separate buffers, and one pipelined exchange on a
pooled redis-py connection's own socket.

A SET is sent as one RESP bulk string assembled from two buffers, the 64-byte record header
and the pool's ``memoryview`` (:class:`Concat`), in pieces of
:data:`tierkv.piecewise_io.PIECE` bytes: no copy in user space. redis-py's own packer with
hiredis would convert every ``memoryview`` to ``bytes`` and pack the command into one more
``bytes``; :class:`GatherPacker`, installed as redis-py's ``command_packer``, keeps the view.
:func:`exchange` sends pipelined commands on a connection's socket and reads the replies
with :class:`tierkv.tiers.resp.Replies` (a GET's payload lands straight in its slot).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from tierkv.piecewise_io import send_all
from tierkv.tiers.records import byte_view
from tierkv.tiers.resp import ProtocolError, Replies
from tierkv.tiers.transfer import transfer_deadline

try:
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import DataError
    from redis.exceptions import TimeoutError as RedisTimeoutError
except ImportError:  # pragma: no cover - exercised only without the optional dependency
    pass

T = TypeVar("T")

# Arguments longer than this (and every memoryview) are handed to sendall on their own instead
# of being joined into the small command buffer (redis-py uses the same cut-off).
_BUFFER_CUTOFF = 6000


class Concat:
    """One RESP bulk-string argument made of several buffers, sent without joining them."""

    __slots__ = ("nbytes", "parts")

    def __init__(self, *parts: bytes | memoryview) -> None:
        self.parts = parts
        self.nbytes = sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)


Packed = list[bytes | memoryview]


def _encode(arg: object) -> bytes | memoryview:
    """A command argument as bytes, following redis-py's ``Encoder`` (minus decoding)."""
    if isinstance(arg, bytes):
        return arg
    if isinstance(arg, memoryview):
        return byte_view(arg)
    if isinstance(arg, bytearray):
        return bytes(arg)
    if isinstance(arg, str):
        return arg.encode()
    if isinstance(arg, bool):
        raise DataError("Invalid input of type: 'bool'. Convert to a bytes, string, int or float.")
    if isinstance(arg, int | float):
        return repr(arg).encode()
    raise DataError(f"Invalid input of type: {type(arg).__name__!r}")


class GatherPacker:
    """RESP command packer whose large and ``memoryview`` arguments stay separate buffers.

    redis-py calls ``pack(*args)`` for every command (also the handshake and health checks)
    and writes the returned buffers with ``sendall``; it keeps ``memoryview`` items separate
    when it batches a pipeline, so a payload view travels from the pool to the socket as is.
    """

    def pack(self, *args: Any) -> Packed:
        # redis-py passes multi-word command names ("CONFIG GET") as one argument.
        if isinstance(args[0], str):
            args = (*args[0].encode().split(), *args[1:])
        elif isinstance(args[0], bytes) and b" " in args[0]:
            args = (*args[0].split(), *args[1:])
        out: Packed = []
        buf = bytearray(b"*%d\r\n" % len(args))
        for arg in args:
            if isinstance(arg, Concat):
                parts: tuple[bytes | memoryview, ...] = arg.parts
                size = arg.nbytes
            else:
                part = _encode(arg)
                parts = (part,)
                size = part.nbytes if isinstance(part, memoryview) else len(part)
            buf += b"$%d\r\n" % size
            for part in parts:
                if isinstance(part, memoryview) or len(part) > _BUFFER_CUTOFF:
                    if buf:
                        out.append(bytes(buf))
                        buf = bytearray()
                    out.append(part)
                else:
                    buf += part
            buf += b"\r\n"
        out.append(bytes(buf))
        return out


def exchange(
    conn: Any, commands: Sequence[tuple[Any, ...]], read: Callable[[Replies], T], min_rate: int
) -> T:
    """One attempt of :meth:`tierkv.tiers.redis.RedisTier._on_socket` on ``conn`` (a
    redis-py connection, on whose socket the commands and replies go directly), each of its
    replies read within the connection's socket timeout, and the whole exchange within the
    timeout plus its bytes (sent, and the values received) at ``min_rate``
    (:mod:`tierkv.tiers.transfer`). Socket errors come out as redis-py's connection and
    timeout errors (its ``Retry`` retries only the former), the connection closed."""
    try:
        if getattr(conn, "_sock", None) is None:
            conn.connect()
        sock = conn._sock
        if not isinstance(sock, socket.socket):
            raise ProtocolError("redis-py's connection has no socket (an unknown version?)")
        packed: Packed = conn.pack_commands(commands)
        # socket_timeout is what a command may take: one deadline per reply, and one for the
        # whole exchange scaled by its bytes (a server taking the commands or trickling its
        # replies a few bytes at a time would otherwise pass each call's timeout).
        timeout = sock.gettimeout() or 0.0
        sent = sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in packed)
        deadline = transfer_deadline(sent, timeout, min_rate) if timeout else 0.0
        send_all(sock, packed, deadline)
        replies = Replies(sock, timeout, min_rate, deadline)
        result = read(replies)
        if not replies.clean:
            raise ProtocolError("more bytes arrived than the replies to the commands sent")
        replies.restore()
        return result
    except BaseException as exc:
        conn.disconnect()  # where the stream stands is unknown: never reuse the connection
        if isinstance(exc, TimeoutError):  # socket.timeout
            raise RedisTimeoutError(f"redis tier: {exc or 'timed out'}") from exc
        if isinstance(exc, OSError):  # ConnectionError and ProtocolError included
            raise RedisConnectionError(f"redis tier: {exc}") from exc
        raise
