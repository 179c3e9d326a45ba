"""Length-prefixed messages over stream sockets: the engine <-> server request transport.

An RPC endpoint is ``ipc://PATH`` (a Unix stream socket, the usual case: engines run on the
server's node) or ``tcp://HOST:PORT``. Every message is a 4-byte little-endian length and
that many bytes of msgpack. One request/reply is one ``sendmsg`` and (usually) one
``recv_into`` on each side and a single wake-up of the thread that waits for it: no broker
threads in between, which is what keeps a small request fast while the machine is busy
moving bulk data.

:class:`FrameReader` splits a byte stream into messages: small ones are parsed out of one
reused scratch buffer; a large one (a long prompt's token ids) gets a buffer of its own that
the kernel fills directly, so no message is copied after it is received.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import time

HEADER = struct.Struct("<I")
MAX_FRAME = (1 << 32) - 1
SCRATCH_BYTES = 256 * 1024


class FrameTooLargeError(Exception):
    """A peer announced a message larger than this side accepts."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"message of {size} bytes is larger than the limit ({limit} bytes)")
        self.size = size
        self.limit = limit


class ConnectionClosedError(ConnectionError):
    """The peer closed the connection."""


def parse_endpoint(endpoint: str) -> tuple[socket.AddressFamily, str | tuple[str, int]]:
    """``ipc://PATH`` -> (AF_UNIX, PATH); ``tcp://HOST:PORT`` -> (AF_INET[6], (HOST, PORT)).

    ``*`` as the host means every interface; an IPv6 host is written in brackets."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        if not path:
            raise ValueError(f"endpoint {endpoint!r} has no socket path")
        return socket.AF_UNIX, path
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://") :].rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ValueError(f"endpoint {endpoint!r} is not tcp://HOST:PORT")
        if host.startswith("[") and host.endswith("]"):
            return socket.AF_INET6, (host[1:-1], int(port))
        return socket.AF_INET, ("0.0.0.0" if host == "*" else host, int(port))
    raise ValueError(f"endpoint {endpoint!r}: expected ipc://PATH or tcp://HOST:PORT")


def tune(sock: socket.socket) -> None:
    """Options every RPC socket gets: no Nagle delay on TCP."""
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def connect(endpoint: str, timeout: float) -> socket.socket:
    """A connected, blocking socket (raises OSError when nothing listens there)."""
    family, address = parse_endpoint(endpoint)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(max(timeout, 0.001))
        sock.connect(address)
        tune(sock)
    except BaseException:
        sock.close()
        raise
    return sock


def connect_until(endpoint: str, deadline: float) -> socket.socket | None:
    """Connect, retrying (a server that is starting or restarting) until ``deadline``
    (``time.monotonic()``); None if it never accepted."""
    pause = 0.002
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            return connect(endpoint, left)
        except (FileNotFoundError, ConnectionRefusedError, TimeoutError):
            pass
        except OSError as exc:
            if not isinstance(exc, ConnectionError):
                raise
        time.sleep(min(pause, max(deadline - time.monotonic(), 0)))
        pause = min(pause * 2, 0.05)


def send_frame(sock: socket.socket, payload: bytes | bytearray | memoryview) -> None:
    """Send one message on a blocking socket (whole, or an OSError)."""
    view = memoryview(payload).cast("B")
    sent = sock.sendmsg([HEADER.pack(len(view)), view])
    total = HEADER.size + len(view)
    while sent < total:  # a partial send: rare, for large messages
        if sent < HEADER.size:
            sent += sock.sendmsg([HEADER.pack(len(view))[sent:], view])
        else:
            sent += sock.send(view[sent - HEADER.size :])


def has_pending(sock: socket.socket) -> bool:
    """Whether a socket with no request outstanding has something to read: a stale reply
    or the peer's close (either way it should not carry the next request)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


class FrameReader:
    """Reads length-prefixed messages from one stream socket.

    :meth:`read` does one ``recv`` and returns the messages completed by it, as views that
    stay valid until the next call (decode them before reading again). On a non-blocking
    socket it returns ``[]`` when nothing is there; on a blocking one it waits (honouring
    the socket's timeout)."""

    def __init__(self, max_frame: int = MAX_FRAME, scratch: bytearray | None = None) -> None:
        self.max_frame = max_frame
        self._scratch = scratch if scratch is not None else bytearray(SCRATCH_BYTES)
        self._pending = b""  # a partial message (or header) carried over from the last read
        self._large: bytearray | None = None  # a large message being received in place
        self._have = 0

    def read(self, sock: socket.socket) -> list[memoryview]:
        if self._large is not None:
            return self._read_large(sock)
        try:
            n = sock.recv_into(self._scratch)
        except (BlockingIOError, InterruptedError):
            return []
        if n == 0:
            raise ConnectionClosedError("connection closed by peer")
        data = memoryview(self._scratch)[:n]
        if self._pending:
            data = memoryview(self._pending + data)
            self._pending = b""
        return self._split(data)

    def _split(self, data: memoryview) -> list[memoryview]:
        frames: list[memoryview] = []
        pos = 0
        end = len(data)
        while end - pos >= HEADER.size:
            (size,) = HEADER.unpack_from(data, pos)
            if size > self.max_frame:
                raise FrameTooLargeError(size, self.max_frame)
            start = pos + HEADER.size
            if end - start >= size:
                frames.append(data[start : start + size])
                pos = start + size
                continue
            if size > len(self._scratch) // 2:
                # Large: its own buffer, filled in place from here on.
                self._large = bytearray(size)
                self._large[: end - start] = data[start:end]
                self._have = end - start
                return frames
            break
        self._pending = bytes(data[pos:end])
        return frames

    def _read_large(self, sock: socket.socket) -> list[memoryview]:
        assert self._large is not None
        view = memoryview(self._large)
        try:
            n = sock.recv_into(view[self._have :])
        except (BlockingIOError, InterruptedError):
            return []
        if n == 0:
            raise ConnectionClosedError("connection closed by peer")
        self._have += n
        if self._have < len(view):
            return []
        self._large = None
        return [view]


def read_frames(sock: socket.socket, reader: FrameReader, deadline: float) -> list[memoryview]:
    """The next messages on a blocking socket (at least one), waiting until ``deadline`` at
    most: raises TimeoutError, or ConnectionClosedError when the peer closed."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no message in time")
        sock.settimeout(left)
        frames = reader.read(sock)  # TimeoutError when the socket's timeout passes
        if frames:
            return frames


def bind(endpoint: str, backlog: int = 128) -> socket.socket:
    """A listening, non-blocking socket on ``endpoint`` (an ipc path must not exist)."""
    family, address = parse_endpoint(endpoint)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if family != socket.AF_UNIX:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
