"""Length-prefixed messages over stream sockets: the engine <-> server request transport.

An RPC endpoint is ``ipc://PATH`` (a Unix stream socket, the usual case: engines run on the
server's node) or ``tcp://HOST:PORT``. Every message is a 4-byte little-endian length and
that many bytes of msgpack. One request/reply is one ``sendmsg`` and (usually) one
``recv_into`` on each side (:class:`Connection`) and a single wake-up of the thread that
waits for it: no broker threads in between, which is what keeps a small request fast while
the machine is busy moving bulk data.

:class:`FrameReader` splits a byte stream into messages: small ones are parsed out of one
reused scratch buffer; a large one (a long prompt's token ids) gets a buffer of its own that
the kernel fills directly, so no message is copied after it is received.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import select
import socket
import struct
import time
from collections import deque
from typing import Protocol

HEADER = struct.Struct("<I")
MAX_FRAME = (1 << 32) - 1
SCRATCH_BYTES = 256 * 1024
LARGE_FIRST_MAP = 256 * 1024  # a large message's first mapping; doubled as its bytes arrive
SEND_BUFFER_BYTES = 2 * 2**20


class FrameTooLargeError(Exception):
    """A peer announced a message larger than this side accepts."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"message of {size} bytes is larger than the limit ({limit} bytes)")
        self.size = size
        self.limit = limit


class FrameBudgetError(Exception):
    """The bytes of a large message would take this side past what it lets all its
    connections' messages in progress hold together (:class:`BufferBudget`)."""

    def __init__(self, size: int, budget: Budget) -> None:
        super().__init__(
            f"message of {size} bytes: the messages being received hold {budget.used} of the "
            f"{budget.limit} bytes allowed"
        )
        self.size = size
        self.limit = budget.limit


class Budget(Protocol):
    """What a :class:`FrameReader` charges the bytes of its large messages to."""

    @property
    def limit(self) -> int: ...

    @property
    def used(self) -> int: ...

    def take(self, n: int) -> bool: ...

    def force(self, n: int) -> None: ...

    def give(self, n: int) -> None: ...


class BufferBudget:
    """Bytes that the connections of one server may hold together in one kind of buffer
    (large messages being received, or replies not sent yet), so that many clients, each
    within its own limit, cannot together take all its memory. Used by one thread."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> bool:
        """Count ``n`` more bytes if they fit (whether they did)."""
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def force(self, n: int) -> None:
        """Count ``n`` more bytes, fitting or not (bytes held already, moved here)."""
        self.used += n

    def give(self, n: int) -> None:
        self.used -= n


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
        if not sep or not (port.isascii() and port.isdigit()) or not host:
            raise ValueError(f"endpoint {endpoint!r} is not tcp://HOST:PORT")
        if int(port) > 65535:
            raise ValueError(f"endpoint {endpoint!r}: port {port} is not 0-65535")
        if host.startswith("[") and host.endswith("]"):
            return socket.AF_INET6, (host[1:-1], int(port))
        return socket.AF_INET, ("0.0.0.0" if host == "*" else host, int(port))
    raise ValueError(f"endpoint {endpoint!r}: expected ipc://PATH or tcp://HOST:PORT")


def tune(sock: socket.socket) -> None:
    """Options every RPC socket gets: no Nagle delay on TCP; a send buffer that takes a
    long prompt's token ids in one ``sendmsg`` (the default, ~208 KiB, made a 512-chunk
    lookup's 512 KiB go out in three pieces, each waiting for the server to drain the last).
    The kernel caps the buffer at ``net.core.wmem_max``."""
    if sock.family == socket.AF_UNIX:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    else:
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


def connect_until(endpoint: str, deadline: float, wait: bool = True) -> socket.socket | None:
    """Connect, retrying (a server that is starting or restarting) until ``deadline``
    (``time.monotonic()``); None if it never accepted. ``wait=False``: one attempt (still
    bounded by ``deadline``), None at once when nothing listens there."""
    pause = 0.002
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            return connect(endpoint, left)
        except (FileNotFoundError, ConnectionError, TimeoutError):
            if not wait:
                return None
            # nothing listens yet (or any more): try again
        time.sleep(min(pause, max(deadline - time.monotonic(), 0)))
        pause = min(pause * 2, 0.05)


def drop_sent(parts: deque[memoryview], sent: int) -> None:
    """Remove the first ``sent`` bytes from ``parts`` (what a ``sendmsg`` of them took),
    and the empty parts that then lead."""
    while parts and sent >= len(parts[0]):
        sent -= len(parts.popleft())
    if sent:
        parts[0] = parts[0][sent:]


class Outbox:
    """Bytes queued for a non-blocking socket that the kernel has not taken yet (a server's
    replies to a client that reads them slower than they come)."""

    __slots__ = ("parts", "size")

    def __init__(self) -> None:
        self.parts: deque[memoryview] = deque()
        self.size = 0  # bytes queued

    def __bool__(self) -> bool:
        return bool(self.parts)

    def add(self, *parts: bytes | memoryview) -> None:
        for part in parts:
            self.parts.append(memoryview(part))
            self.size += len(part)

    def flush(self, sock: socket.socket) -> None:
        """Send what the kernel takes now (OSError when the connection failed)."""
        while self.parts:
            try:
                sent = sock.sendmsg(list(itertools.islice(self.parts, 64)))
            except (BlockingIOError, InterruptedError):
                return
            self.size -= sent
            drop_sent(self.parts, sent)

    def clear(self) -> None:
        self.parts.clear()
        self.size = 0


class FrameReader:
    """Reads length-prefixed messages from one stream socket.

    :meth:`read` does one ``recv`` on a non-blocking socket and returns the messages
    completed by it (``[]`` when nothing is there), as views that stay valid until the next
    call (decode them before reading again)."""

    def __init__(
        self,
        max_frame: int = MAX_FRAME,
        scratch: bytearray | None = None,
        budget: Budget | None = None,
    ) -> None:
        """``budget``: shared by a server's connections, charged with the bytes of large
        messages as they arrive (a header alone costs nothing); bytes it has no room for
        raise :class:`FrameBudgetError` (the connection is then closed)."""
        self.max_frame = max_frame
        self._scratch = scratch if scratch is not None else bytearray(SCRATCH_BYTES)
        self._budget = budget
        self._pending = b""  # a partial message (or header) carried over from the last read
        # A large message being received in place: an anonymous mapping, grown (doubled, by
        # mremap: no copy) as its bytes arrive, so that neither memory nor address space
        # follows what a header announces (a zero-filled bytearray of the announced size was
        # resident at once; a mapping of that size counted whole under strict overcommit).
        self._large: mmap.mmap | None = None
        self._size = 0  # the large message's announced size
        self._have = 0
        self._charged = 0  # of the budget, for the large message's bytes received
        self.filled = False  # the last read filled its buffer: more may be waiting

    @property
    def budget(self) -> Budget | None:
        """What the bytes of its large messages are charged to."""
        return self._budget

    def read(self, sock: socket.socket) -> list[memoryview]:
        if self._large is not None:
            return self._read_large(sock)
        try:
            n = sock.recv_into(self._scratch)
        except (BlockingIOError, InterruptedError):
            self.filled = False
            return []
        if n == 0:
            raise ConnectionClosedError("connection closed by peer")
        self.filled = n == len(self._scratch)
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
                first = end - start
                # Private: a shared anonymous mapping cannot grow (its backing object keeps
                # its first size; bytes past it fault).
                self._large = mmap.mmap(
                    -1, min(size, max(first, LARGE_FIRST_MAP)), flags=mmap.MAP_PRIVATE
                )
                self._size = size
                self._large[:first] = data[start:end]
                self._have = first
                self._charge(first, size)
                return frames
            break
        self._pending = bytes(data[pos:end])
        return frames

    def _read_large(self, sock: socket.socket) -> list[memoryview]:
        large = self._large
        assert large is not None
        if self._have == len(large):  # full, the message is not: twice the room
            large.resize(min(self._size, 2 * len(large)))
        with memoryview(large) as view:
            try:
                n = sock.recv_into(view[self._have :])
            except (BlockingIOError, InterruptedError):
                self.filled = False
                return []
        if n == 0:
            raise ConnectionClosedError("connection closed by peer")
        self.filled = n == len(large) - self._have
        self._have += n
        self._charge(n, self._size)
        if self._have < self._size:
            return []
        self._end_large()
        return [memoryview(large)]

    def _charge(self, n: int, size: int) -> None:
        """Charge ``n`` more received bytes of a large message of ``size`` to the budget;
        past it, FrameBudgetError (the bytes are let go with the connection)."""
        if self._budget is None:
            return
        if not self._budget.take(n):
            raise FrameBudgetError(size, self._budget)
        self._charged += n

    def _end_large(self) -> None:
        """The large message is whole (its mapping lives on in the view returned) or is
        given up: its bytes leave the budget."""
        if self._budget is not None:
            self._budget.give(self._charged)
        self._charged = 0
        self._large = None

    def close(self) -> None:
        """Give up a message still being received (its connection is closed)."""
        self._end_large()
        self._pending = b""

    def rebudget(self, budget: Budget | None) -> None:
        """Charge ``budget`` from now on, with what a message in progress holds (moved
        over: it may pass the new budget's limit for as long as that message lasts)."""
        if self._budget is not None:
            self._budget.give(self._charged)
        self._budget = budget
        if budget is not None:
            budget.force(self._charged)
        else:
            self._charged = 0


class Connection:
    """One connected stream socket carrying requests one at a time, with deadlines.

    The socket stays non-blocking and is waited on with ``poll(2)``: a round trip is one
    ``sendmsg``, one ``poll`` and (usually) one ``recv_into``, and nothing else (no
    per-call switching of the socket's mode).

    ``spin``: seconds :meth:`receive` keeps trying to read before it sleeps in ``poll``. A
    thread that sleeps leaves its core idle, and on a virtual machine an idle core halts:
    waking it for the reply costs tens of microseconds, about as much as the server takes
    to answer a small request. Spinning a little keeps the core awake for a reply that is
    about to come and costs at most ``spin`` of CPU per request."""

    def __init__(
        self,
        sock: socket.socket,
        max_frame: int = MAX_FRAME,
        scratch: int = 65536,
        spin: float = 0.0,
    ):
        sock.setblocking(False)
        self.sock = sock
        self.spin = spin
        self.reader = FrameReader(max_frame, bytearray(scratch))
        self._readable = select.poll()
        self._readable.register(sock, select.POLLIN)

    @classmethod
    def open(
        cls, endpoint: str, deadline: float, spin: float = 0.0, wait: bool = True
    ) -> Connection | None:
        """Connect (see :func:`connect_until`); None if nothing accepted by ``deadline`` (with
        ``wait`` False: at the first attempt)."""
        sock = connect_until(endpoint, deadline, wait)
        return None if sock is None else cls(sock, spin=spin)

    def pending(self) -> bool:
        """Whether there is something to read: with no request outstanding, a stale reply
        or the peer's close (either way this connection should not carry the next one)."""
        return bool(self._readable.poll(0))

    def send(self, payload: bytes | bytearray | memoryview, deadline: float) -> None:
        """Send one message whole (TimeoutError when the peer does not take it in time)."""
        view = memoryview(payload).cast("B")
        parts = deque([memoryview(HEADER.pack(len(view))), view])
        while parts:
            with contextlib.suppress(BlockingIOError, InterruptedError):
                drop_sent(parts, self.sock.sendmsg(parts))
            if parts:
                self._wait(select.POLLOUT, deadline)

    def receive(self, deadline: float) -> list[memoryview]:
        """The next messages (at least one; valid until the next call), by ``deadline``:
        else TimeoutError, or ConnectionClosedError when the peer closed."""
        if self.spin > 0:
            give_up = time.perf_counter() + self.spin
            while True:
                frames = self.reader.read(self.sock)
                if frames:
                    return frames
                if time.perf_counter() >= give_up:
                    break
        while True:
            self._wait(select.POLLIN, deadline)
            frames = self.reader.read(self.sock)
            if frames:
                return frames

    def _wait(self, event: int, deadline: float) -> None:
        left = deadline - time.monotonic()
        if event == select.POLLIN:
            ready = left > 0 and self._readable.poll(int(left * 1000) + 1)
        else:
            writable = select.poll()
            writable.register(self.sock, event)
            ready = left > 0 and writable.poll(int(left * 1000) + 1)
        if not ready:
            raise TimeoutError("the peer did not answer in time")

    def close(self) -> None:
        self.sock.close()


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
