"""The client connections of a server that serves stream sockets from one selector thread.

The engine RPC loop (:mod:`tierkv.server.rpc`) and the cluster control port
(:mod:`tierkv.cluster.control_server`) both read length-prefixed messages
(:mod:`tierkv.framing`) on one thread and answer on it. :class:`ServedConnections` is what
they share: accepting connections, queueing a reply and sending what the kernel takes now
(the rest when the socket is writable again), and dropping a connection that failed or whose
replies pile up unread (more than ``max_unsent`` bytes: a client that does not read must not
grow the server's memory). Only the serving thread calls it.

Clients that each stay within those limits must not add up to all the server's memory
either (a client can send a large request before it has proved who it is). So there are
server-wide bounds too: at most ``max_connections`` open connections (one more is accepted
and closed at once, like one out of descriptors below); the bytes of large requests being
received, charged as they arrive, at most ``buffer_limit`` together (bytes past it get the
caller's refusal, and their connection is closed); replies not yet sent at most
``buffer_limit`` together (past it, the connection with the most unsent is dropped). Small
requests are read through one scratch buffer; a partial one (at most half of it) carried
over between reads is all a connection holds besides.

A server whose clients prove who they are on a connection (the cluster control port: a
signed request) can keep connections that have not yet apart (:class:`UnprovenLimits`):
few at once, for a short while, on a receive budget of their own, so that anyone who
reaches the port cannot keep its members out.

Out of file descriptors, a listener stays readable with connections it cannot accept: the
serving thread would wake at once for ever, and log a warning each time. One descriptor is
kept spare for that: given up to accept one waiting connection and close it at once (its
client sees the connection closed, and tries again later), then taken back; the warning is
logged once a minute at most, with how many connections were turned away.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import selectors
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from tierkv import framing

log = logging.getLogger(__name__)

ACCEPT_BATCH = 256  # connections accepted per turn of the loop
DEFAULT_MAX_CONNECTIONS = 8192
DEFAULT_BUFFER_LIMIT = 2**30
REFUSAL_LOG_SECONDS = 60.0  # the warning about connections turned away, once a minute at most


class AddressCounts(dict[str, int]):
    """Connections counted by peer address (none: no entry), for limits in all and per
    address on connections that have not shown who they are."""

    def add(self, host: str) -> None:
        self[host] = self.get(host, 0) + 1

    def remove(self, host: str) -> None:
        left = self.get(host, 0) - 1
        if left > 0:
            self[host] = left
        else:
            self.pop(host, None)

    def total(self) -> int:
        return sum(self.values())

    def busiest(self) -> str:
        """The address with the most connections (the first counted of those tied)."""
        return max(self, key=lambda h: self[h])


@dataclass(frozen=True)
class UnprovenLimits:
    """Connections whose client has not shown who it is yet (see :meth:`ServedConnections.
    prove`): at most ``total`` at once and ``per_host`` from one address (past either, the
    oldest unproven one of the address holding most goes, so a newcomer always gets in and
    a member proves itself before its turn comes), each for ``seconds`` (then closed); their
    large messages share ``receive_bytes`` of their own. They take none of the places,
    and none of the buffer budget, of proven ones: clients without the secret cannot keep
    members out by opening connections, or sending large messages, and never proving."""

    total: int = 256
    per_host: int = 64
    seconds: float = 10.0
    receive_bytes: int = 128 * 2**20

    def __post_init__(self) -> None:
        if min(self.total, self.per_host, self.receive_bytes) < 1 or not self.seconds > 0:
            raise ValueError(f"unproven connection limits must be positive: {self}")


class _UnprovenShare:
    """The unproven connections' budget for large messages as one of them charges it: short
    of room, the oldest other unproven connections holding bytes are closed until the bytes
    fit (a member's first request, fresh, outlasts clients that started large messages and
    stalled; to close it one would have to send faster than it), and only then refused."""

    __slots__ = ("conns", "held", "owner")

    def __init__(self, conns: ServedConnections[Any]) -> None:
        self.conns = conns
        self.owner: Served | None = None  # set once the connection is made
        self.held = 0

    @property
    def limit(self) -> int:
        return self.conns.receiving_unproven.limit

    @property
    def used(self) -> int:
        return self.conns.receiving_unproven.used

    def take(self, n: int) -> bool:
        shared = self.conns.receiving_unproven
        while not shared.take(n):
            if not self.conns.evict_unproven_holder(self.owner):
                return False
        self.held += n
        return True

    def force(self, n: int) -> None:
        self.conns.receiving_unproven.force(n)
        self.held += n

    def give(self, n: int) -> None:
        self.conns.receiving_unproven.give(n)
        self.held -= n


class Served:
    """One client's connection: its socket, the reader of its messages, unsent replies."""

    __slots__ = ("host", "opened", "outbox", "proven", "reader", "sock", "writing")

    def __init__(self, sock: socket.socket, reader: framing.FrameReader) -> None:
        self.sock = sock
        self.reader = reader
        self.outbox = framing.Outbox()
        self.writing = False  # registered for EVENT_WRITE
        self.opened = 0.0  # when it was accepted (monotonic)
        self.host = ""  # the peer's address ("" for a Unix socket)
        self.proven = True  # see ServedConnections.prove


C = TypeVar("C", bound=Served)


class ServedConnections(Generic[C]):
    """The open connections of one server, registered with its ``selector`` (each with
    itself as the key's data)."""

    def __init__(
        self,
        selector: selectors.BaseSelector,
        what: str,
        max_unsent: int,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        buffer_limit: int = DEFAULT_BUFFER_LIMIT,
        unproven: UnprovenLimits | None = None,
    ) -> None:
        """``unproven``: connections must prove their client (:meth:`prove`) within these
        limits; None: every connection counts as proven from the start."""
        self.selector = selector
        self.what = what  # names the server in log lines
        self.max_unsent = max_unsent
        self.max_connections = max_connections
        self.receiving = framing.BufferBudget(buffer_limit)  # large requests in progress
        self.unsent = framing.BufferBudget(buffer_limit)  # replies queued, all connections
        self._by_fd: dict[int, C] = {}
        self._spare = _spare_fd()
        self.turned_away = 0  # connections closed at once: no descriptor left for them
        self.over_limit = 0  # connections closed at once: max_connections were open
        self.overflowed = 0  # connections dropped: all replies unsent past buffer_limit
        self.refused_large = 0  # large requests refused: receiving past buffer_limit
        self.unproven_limits = unproven
        self._unproven: dict[int, C] = {}  # by descriptor, oldest first
        self._unproven_hosts = AddressCounts()
        # Large messages of unproven connections (moved to `receiving` when one proves).
        self.receiving_unproven = framing.BufferBudget(unproven.receive_bytes if unproven else 0)
        self.evicted_unproven = 0  # closed for a newer one: too many unproven
        self.expired_unproven = 0  # closed: not proven in time
        self._unlogged = 0
        self._logged_at = -REFUSAL_LOG_SECONDS

    def figures(self) -> dict[str, int]:
        """What the connections hold and how many were turned away, and why (for status
        pages; read from any thread: a moment's view)."""
        return {
            "open": len(self._by_fd),
            "max": self.max_connections,
            "receiving_bytes": self.receiving.used,
            "unsent_bytes": self.unsent.used,
            "buffer_limit": self.receiving.limit,
            "turned_away_max_connections": self.over_limit,
            "turned_away_descriptors": self.turned_away,
            "refused_large_requests": self.refused_large,
            "dropped_unsent": self.overflowed,
            "unproven": len(self._unproven),
            "evicted_unproven": self.evicted_unproven,
            "expired_unproven": self.expired_unproven,
        }

    def __len__(self) -> int:
        return len(self._by_fd)

    def reader(self, max_frame: int, scratch: bytearray) -> framing.FrameReader:
        """A reader for a new connection's requests, within the server-wide budget (the
        unproven connections' own, until the connection proves its client)."""
        if self.unproven_limits is None:
            return framing.FrameReader(max_frame, scratch, self.receiving)
        return framing.FrameReader(max_frame, scratch, _UnprovenShare(self))

    def evict_unproven_holder(self, keep: Served | None) -> bool:
        """Close the oldest unproven connection (not ``keep``) holding bytes of a large
        message; whether there was one."""
        for conn in self._unproven.values():
            share = conn.reader.budget
            if conn is not keep and isinstance(share, _UnprovenShare) and share.held > 0:
                self.evicted_unproven += 1
                self._warn("unproven connections hold their whole budget: the oldest closed")
                self.drop(conn)
                return True
        return False

    def __iter__(self) -> Iterator[C]:
        return iter(list(self._by_fd.values()))

    def __contains__(self, conn: C) -> bool:
        """Whether ``conn`` is still open (not dropped)."""
        return self._by_fd.get(conn.sock.fileno()) is conn

    def accept(self, listener: socket.socket, make: Callable[[socket.socket], C]) -> None:
        """Accept the connections waiting on ``listener``; ``make`` wraps each."""
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors, for one
                if exc.errno in (errno.EMFILE, errno.ENFILE) and self._turn_away(listener):
                    continue
                self._warn(f"could not accept a connection: {exc}")
                return
            if len(self._by_fd) >= self.max_connections:
                sock.close()
                self.over_limit += 1
                self._warn(
                    f"{self.max_connections} connections open: new ones turned away (raise "
                    "--max-connections if so many clients are expected)"
                )
                continue
            host = _host_of(sock)
            self._make_room_unproven(host)
            sock.setblocking(False)
            framing.tune(sock)
            conn = make(sock)
            share = conn.reader.budget
            if isinstance(share, _UnprovenShare):
                share.owner = conn
            conn.opened, conn.host = time.monotonic(), host
            fd = sock.fileno()
            self._by_fd[fd] = conn
            if self.unproven_limits is not None:
                conn.proven = False
                self._unproven[fd] = conn
                self._unproven_hosts.add(host)
            self.selector.register(sock, selectors.EVENT_READ, conn)

    def _make_room_unproven(self, host: str) -> None:
        """Room for one more unproven connection from ``host``: past a limit, the oldest
        unproven connection of ``host`` (its own limit) or of the address holding most (the
        total) is closed."""
        limits = self.unproven_limits
        if limits is None:
            return
        if self._unproven_hosts.get(host, 0) >= limits.per_host:
            why = f"{limits.per_host} unproven connections from {host or 'one address'}"
        elif len(self._unproven) >= limits.total:
            why = f"{limits.total} unproven connections"
            host = self._unproven_hosts.busiest()
        else:
            return
        oldest = next(c for c in self._unproven.values() if c.host == host)
        self.evicted_unproven += 1
        self._warn(f"{why}: the oldest closed for a new one")
        self.drop(oldest)

    def prove(self, conn: C) -> None:
        """``conn``'s client showed who it is (a request it signed, a registration): it no
        longer counts against the unproven limits, nor expires."""
        if conn.proven:
            return
        conn.proven = True
        if self._unproven.pop(conn.sock.fileno(), None) is conn:
            self._unproven_hosts.remove(conn.host)
            conn.reader.rebudget(self.receiving)

    def sweep(self) -> None:
        """Close the connections that have not proven their client in time (the oldest
        first; cheap when none is due)."""
        limits = self.unproven_limits
        if limits is None or not self._unproven:
            return
        due = time.monotonic() - limits.seconds
        for conn in list(self._unproven.values()):
            if conn.opened > due:
                return
            self.expired_unproven += 1
            self.drop(conn)

    def _turn_away(self, listener: socket.socket) -> bool:
        """Out of descriptors: accept one waiting connection with the spare one and close
        it; whether one was turned away."""
        if self._spare is None:
            return False
        os.close(self._spare)
        self._spare = None
        try:
            sock: socket.socket | None = listener.accept()[0]
        except OSError:
            sock = None
        if sock is not None:
            sock.close()  # before the spare is taken back: its descriptor is the one freed
        self._spare = _spare_fd()
        if sock is None:
            return False
        self.turned_away += 1
        self._warn("out of file descriptors: connections turned away (raise the open files limit)")
        return True

    def _warn(self, what: str) -> None:
        """Log ``what`` once a minute at most, with how many times it happened."""
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at < REFUSAL_LOG_SECONDS:
            return
        log.warning("%s: %s (%d times since the last warning)", self.what, what, self._unlogged)
        self._logged_at, self._unlogged = now, 0

    def send(self, conn: C, *parts: bytes | memoryview) -> None:
        """Queue ``parts`` behind what ``conn`` has not sent yet, and send what the kernel
        takes now."""
        if conn not in self:
            return  # dropped since (a blocking request's reply came back late)
        before = conn.outbox.size
        conn.outbox.add(*parts)
        self.unsent.used += conn.outbox.size - before  # counted even past the limit: then
        # the connection holding the most goes (below), not this reply
        self.flush(conn)
        if conn.outbox.size > self.max_unsent:
            log.warning(
                "%s: disconnecting a client that does not read its replies (%d bytes unsent)",
                self.what,
                conn.outbox.size,
            )
            self.drop(conn)
        if self.unsent.used > self.unsent.limit:
            self._drop_most_unsent()

    def _drop_most_unsent(self) -> None:
        """All connections' unsent replies are past the budget: drop the one holding most."""
        worst = max(self._by_fd.values(), key=lambda c: c.outbox.size)
        self.overflowed += 1
        log.warning(
            "%s: %d bytes of replies unsent in all, past the %d allowed: disconnecting the "
            "client holding %d of them",
            self.what,
            self.unsent.used,
            self.unsent.limit,
            worst.outbox.size,
        )
        self.drop(worst)

    def flush(self, conn: C) -> None:
        """Send what the kernel takes; wait for writability only while bytes remain."""
        before = conn.outbox.size
        try:
            conn.outbox.flush(conn.sock)
        except OSError:
            self.unsent.give(before - conn.outbox.size)
            self.drop(conn)
            return
        self.unsent.give(before - conn.outbox.size)
        waiting = bool(conn.outbox)
        if conn.writing != waiting and conn in self:
            conn.writing = waiting
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if waiting else 0)
            self.selector.modify(conn.sock, events, conn)

    def drop(self, conn: C) -> None:
        """Close ``conn`` (once)."""
        if conn not in self:
            return
        fd = conn.sock.fileno()
        del self._by_fd[fd]
        if not conn.proven and self._unproven.pop(fd, None) is conn:
            self._unproven_hosts.remove(conn.host)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(conn.sock)
        self.unsent.give(conn.outbox.size)
        conn.outbox.clear()
        conn.reader.close()
        conn.sock.close()

    def drop_all(self) -> None:
        for conn in self:
            self.drop(conn)
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None


def _host_of(sock: socket.socket) -> str:
    """The peer's address ("" for a Unix socket, or one that reset already)."""
    try:
        peer = sock.getpeername()
    except OSError:
        return ""
    return str(peer[0]) if isinstance(peer, tuple) else ""


def _spare_fd() -> int | None:
    """A descriptor held in reserve (None if even that cannot be had)."""
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
