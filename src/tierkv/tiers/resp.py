"""RESP for the Redis tier's bulk commands: requests sent and replies read on the connection's
own socket, each value's payload received in pieces straight into its pool slot.

redis-py with hiredis reads a GET reply into hiredis's buffer in 64 KiB steps, then builds
the whole value as one ``bytes`` object, and the tier copied its payload into the slot: three
copies of 8 MiB, two of them inside C calls that hold the GIL for their whole length (a
profile of a server prefetching from Redis: a fifth of the time the GIL was held, it was
held there), so that the server's RPC loop waited behind them for milliseconds (``load.py``
(b) with a Redis tier: lookup p99 10 ms against 3 to 4.5 with a disk tier). Here a value
takes one copy, the kernel's into the slot, in pieces of :data:`tierkv.piecewise_io.PIECE` bytes
with the GIL released, hashed as it lands (:func:`tierkv.piecewise_io.recv_hashed`); only the
reply's first line and the 64-byte record header pass through a small buffer.

:class:`Replies` reads the replies to commands that were pipelined on one socket, in order.
A reply that cannot answer the command (another type, a malformed line) raises
:class:`ProtocolError`: the stream's position is then unknown, and the caller must close the
connection, never reuse it. Works over plain, Unix and TLS sockets (only ``recv_into``).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from tierkv.checksums import checksummer
from tierkv.piecewise_io import recv_exact, recv_hashed

SCRATCH = 4096  # bytes read at a time for reply lines; a value's payload bypasses it
MAX_LINE = 1024  # a reply line longer than this is not a reply to our commands


class ProtocolError(ConnectionError):
    """The connection's stream is not a reply to the command sent: close the connection."""


class ReplyError(Exception):
    """An error reply (``-ERR ...``) to one command; the pipeline's other replies stand."""


@dataclass(frozen=True)
class Filled:
    """A value of the expected size: its first bytes went to the header buffer, the rest to
    the destination; ``digest``: the checksum of what the destination received."""

    digest: bytes


class Replies:
    """The replies arriving on ``sock``, read in order."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray(SCRATCH)
        self._start = self._end = 0  # unread bytes of _buf

    # -- buffer ----------------------------------------------------------------------------
    def _more(self) -> None:
        """Receive more into the buffer (moving what is unread to its start first; there is
        room: :meth:`_line` gives up on lines longer than :data:`MAX_LINE`)."""
        if self._start:
            unread = self._end - self._start
            self._buf[:unread] = self._buf[self._start : self._end]
            self._start, self._end = 0, unread
        got = self.sock.recv_into(memoryview(self._buf)[self._end :])
        if not got:
            raise ConnectionError("the server closed the connection")
        self._end += got

    def _line(self) -> bytes:
        """The next line, without its CRLF."""
        while True:
            at = self._buf.find(b"\r\n", self._start, self._end)
            if at >= 0:
                line = bytes(self._buf[self._start : at])
                self._start = at + 2
                return line
            if self._end - self._start > MAX_LINE:
                raise ProtocolError("a reply line without an end")
            self._more()

    def _exact(self, view: memoryview) -> int:
        """Fill ``view`` from what is buffered; returns how many bytes that was."""
        take = min(len(view), self._end - self._start)
        view[:take] = self._buf[self._start : self._start + take]
        self._start += take
        return take

    def _fill(self, view: memoryview) -> None:
        """Fill ``view`` completely: buffered bytes first, then from the socket."""
        took = self._exact(view)
        if took < len(view):
            recv_exact(self.sock, view[took:])

    def _crlf(self) -> None:
        end = bytearray(2)
        self._fill(memoryview(end))
        if end != b"\r\n":
            raise ProtocolError("a bulk reply without its CRLF")

    # -- replies ---------------------------------------------------------------------------
    def simple(self) -> bytes | int | ReplyError:
        """A status (``+OK``), integer or error reply, as to ``SET`` or ``DEL``."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b":":
            return _integer(rest)
        if kind == b"-":
            return ReplyError(rest.decode(errors="replace"))
        if kind == b"_":  # RESP3 null: SET ... NX/XX that did not set
            return b""
        raise ProtocolError(f"unexpected reply {line[:40]!r}")

    def value_into(
        self, header: memoryview, dest: memoryview
    ) -> Filled | bytes | ReplyError | None:
        """The reply to ``GET``: None when the key does not exist; :class:`Filled` when the
        value is ``len(header) + len(dest)`` bytes (received into ``header`` and ``dest``,
        the latter checksummed as it landed); the value itself (``bytes``) at any other
        length, which is then not a record for ``dest``; an error reply."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            return ReplyError(rest.decode(errors="replace"))
        if kind == b"_":  # RESP3 null
            return None
        if kind != b"$":
            raise ProtocolError(f"unexpected reply to GET {line[:40]!r}")
        size = _integer(rest)
        if size < 0:
            return None
        if size != len(header) + len(dest):
            value = memoryview(bytearray(size))
            self._fill(value)
            self._crlf()
            return bytes(value)
        self._fill(header)
        took = self._exact(dest)
        hasher = checksummer(dest[:took])
        if took < len(dest):
            recv_hashed(self.sock, dest[took:], hasher)  # goes on with the same running hash
        self._crlf()
        return Filled(hasher.digest())

    @property
    def clean(self) -> bool:
        """Whether nothing beyond the replies read has arrived (the connection may be
        reused)."""
        return self._start == self._end


def _integer(text: bytes) -> int:
    try:
        return int(text)
    except ValueError:
        raise ProtocolError(f"not an integer: {text[:40]!r}") from None


__all__ = ["Filled", "ProtocolError", "Replies", "ReplyError"]
