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

A value of another size than the slot it was asked for (a foreign value under the key, an
old record of another size) is not read into memory: only its first :data:`HEADER` bytes
are kept (:class:`Misfit`), the rest is received and dropped a scratch buffer at a time.
Read whole, eight foreign 64 MiB values under the keys of eight 4 KiB loads took 576 MiB.

``reply_timeout`` bounds each reply as a whole, not each receive: a server (or a proxy)
that trickled a reply a few bytes at a time, each within the socket's timeout, made one
256 KiB load last 24 s with a 1 s timeout. Not the whole pipeline either: its replies add
up to as many bytes as the batch (64 MiB by default), which a slower link (under 13 MB/s
with a 5 s timeout) could never bring in within one timeout. The whole pipeline is bounded
by a deadline that grows with its bytes instead (the timeout plus the bytes at a minimum
rate, :mod:`tierkv.tiers.transfer`): replies each just within the timeout held a thread
for their count times it.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

from tierkv.checksums import checksummer
from tierkv.piecewise_io import recv_exact, recv_hashed
from tierkv.tiers.transfer import transfer_time

SCRATCH = 4096  # bytes read at a time for reply lines; a value's payload bypasses it
MAX_LINE = 1024  # a reply line longer than this is not a reply to our commands
HEADER = 64  # bytes of a value of another size kept (a record header's size)
DRAIN = 64 * 1024  # bytes received at a time of a value of another size, then dropped


class ProtocolError(ConnectionError):
    """The connection's stream is not a reply to the command sent: close the connection."""


class ReplyError(Exception):
    """An error reply (``-ERR ...``) to one command; the pipeline's other replies stand."""


@dataclass(frozen=True)
class Filled:
    """A value of the expected size: its first bytes went to the header buffer, the rest to
    the destination; ``digest``: the checksum of what the destination received."""

    digest: bytes


@dataclass(frozen=True)
class Misfit:
    """A value of another size than expected: its ``size`` and its first bytes (``head``,
    up to :data:`HEADER`), enough to tell whether it is a record of the key and to delete it
    only while it is still the same value; the rest was received and dropped."""

    size: int
    head: bytes


class Replies:
    """The replies arriving on ``sock``, read in order; ``reply_timeout`` (seconds; 0:
    none): each reply must be whole that long after it is asked for (TimeoutError), however
    its bytes trickle in (the socket's own timeout still bounds each wait). ``deadline``
    (``time.monotonic()``; 0: none): all of them must be whole by then, a deadline
    extended by each value's size at ``min_rate`` (bytes per second) as it is announced
    (:mod:`tierkv.tiers.transfer`): replies each coming just within ``reply_timeout`` held
    a thread for their count times it. The socket's timeout is changed while reading:
    restore it (:meth:`restore`) before reusing the socket."""

    def __init__(
        self,
        sock: socket.socket,
        reply_timeout: float = 0.0,
        min_rate: int = 0,
        deadline: float = 0.0,
    ) -> None:
        self.sock = sock
        self.reply_timeout = reply_timeout
        self.min_rate = min_rate
        self._until = deadline  # all the replies are whole by then (0: no such bound)
        self._reply_end = 0.0  # the reply being read is whole by then (0: no such bound)
        self.deadline = 0.0  # (time.monotonic()) the earlier of the two (0: neither)
        self._timeout = sock.gettimeout()
        self._lowered = False  # the socket's timeout is the time a reply had left
        self._buf = bytearray(SCRATCH)
        self._start = self._end = 0  # unread bytes of _buf

    def restore(self) -> None:
        """Give the socket its own timeout back."""
        if self._lowered:
            self.sock.settimeout(self._timeout)
            self._lowered = False

    def _next_reply(self) -> None:
        if self.reply_timeout:
            self._reply_end = time.monotonic() + self.reply_timeout
            if self._lowered:  # the last reply's time left: not this one's
                self.sock.settimeout(self._timeout)
                self._lowered = False
        self._set_deadline()

    def _allow(self, nbytes: int) -> None:
        """A value of ``nbytes`` is coming: the exchange's deadline moves by its time at
        ``min_rate``."""
        if self._until and self.min_rate:
            self._until += transfer_time(nbytes, self.min_rate)
            self._set_deadline()

    def _set_deadline(self) -> None:
        self.deadline = min((d for d in (self._reply_end, self._until) if d), default=0.0)

    def _recv_into(self, view: memoryview) -> int:
        """One receive into ``view``, waiting no longer than the deadline allows."""
        if self.deadline:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            if self._timeout is None or left < self._timeout:  # else: the socket's own
                self.sock.settimeout(left)
                self._lowered = True
            elif self._lowered:  # the deadline moved on (a value announced): the socket's own
                self.sock.settimeout(self._timeout)
                self._lowered = False
        got = self.sock.recv_into(view)
        if not got:
            raise ConnectionError("the server closed the connection")
        return got

    # -- buffer ----------------------------------------------------------------------------
    def _more(self) -> None:
        """Receive more into the buffer (moving what is unread to its start first; there is
        room: :meth:`_line` gives up on lines longer than :data:`MAX_LINE`)."""
        if self._start:
            unread = self._end - self._start
            self._buf[:unread] = self._buf[self._start : self._end]
            self._start, self._end = 0, unread
        self._end += self._recv_into(memoryview(self._buf)[self._end :])

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
            recv_exact(self.sock, view[took:], self.deadline)

    def _drain(self, size: int) -> None:
        """Receive ``size`` bytes and drop them, :data:`DRAIN` at a time."""
        size -= self._skip(size)
        scratch = memoryview(bytearray(min(size, DRAIN)))
        while size:
            size -= self._recv_into(scratch[: min(size, DRAIN)])

    def _skip(self, size: int) -> int:
        """Drop up to ``size`` buffered bytes; returns how many that was."""
        take = min(size, self._end - self._start)
        self._start += take
        return take

    def _crlf(self) -> None:
        end = bytearray(2)
        self._fill(memoryview(end))
        if end != b"\r\n":
            raise ProtocolError("a bulk reply without its CRLF")

    # -- replies ---------------------------------------------------------------------------
    def simple(self) -> bytes | int | ReplyError:
        """A status (``+OK``), integer or error reply, as to ``SET`` or ``DEL``."""
        self._next_reply()
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
    ) -> Filled | Misfit | ReplyError | None:
        """The reply to ``GET``: None when the key does not exist; :class:`Filled` when the
        value is ``len(header) + len(dest)`` bytes (received into ``header`` and ``dest``,
        the latter checksummed as it landed); a :class:`Misfit` at any other length (the
        value is then not a record for ``dest``; neither buffer is touched); an error
        reply."""
        self._next_reply()
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
        self._allow(size)
        if size != len(header) + len(dest):
            head = memoryview(bytearray(min(size, HEADER)))
            self._fill(head)
            self._drain(size - len(head))
            self._crlf()
            return Misfit(size, bytes(head))
        self._fill(header)
        took = self._exact(dest)
        hasher = checksummer(dest[:took])
        if took < len(dest):  # goes on with the same running hash
            recv_hashed(self.sock, dest[took:], hasher, self.deadline)
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


__all__ = ["Filled", "Misfit", "ProtocolError", "Replies", "ReplyError"]
