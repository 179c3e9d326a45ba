"""A client's request channel to its server: one connection, requests serialized on it, each
reply matched to its request by id.

The connection is opened on first use and again after anything makes it unusable: a broken
or timed-out round trip (a late reply must never be taken for the answer to a later
request), a reply nobody asked for, a server that restarted, or a fork (a child never shares
its parent's socket). Requests may be sent without waiting for their replies (a retrieve's
release, an unconfirmed commit): the next round trip or :meth:`RequestChannel.settle` reads
those replies first, logs the ones that are errors and keeps the commits that committed
fewer chunks than they named (:meth:`RequestChannel.commit_shortfalls`).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import threading
import time
from typing import Any

import msgspec

from tierkv import framing
from tierkv import protocol as p
from tierkv.client.errors import ServerUnavailableError, TierKVError, raise_for

log = logging.getLogger(__name__)

# A small request's reply comes 30 to 100 us after it is sent when the server's core is
# awake: spin that long before sleeping (see framing.Connection).
DEFAULT_REPLY_SPIN = 100e-6


class RequestChannel:
    """Requests to the server at ``endpoint`` and their replies (thread-safe)."""

    def __init__(
        self, endpoint: str, timeout: float, reply_spin: float, wait_for_server: bool = True
    ) -> None:
        if reply_spin < 0:
            raise ValueError("reply_spin must be >= 0")
        self.endpoint = endpoint
        self.timeout = timeout
        self.reply_spin = reply_spin
        self.wait_for_server = wait_for_server
        self.conn: framing.Connection | None = None
        self._pid = os.getpid()  # a forked child must not share its parent's connection
        self.closed = False
        # Held for each round trip; a client holds it across a registration and the pool
        # mapping it brings too (reentrant: the registration's round trip runs inside it),
        # so that every reply that names slots is read while the pool it names them in is
        # the one mapped.
        self.io = threading.RLock()
        self._rids = itertools.count(1)
        # Requests sent without waiting for their replies, by rid, with their names and
        # (commits) the chunks they commit; failed ones counted in _failed_unanswered.
        # Commits that committed fewer chunks (or none: failed, or lost with the connection)
        # go into _shortfalls, by rid.
        self.unanswered: dict[int, tuple[str, int]] = {}
        self._failed_unanswered = 0
        self._shortfalls: dict[int, int] = {}
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = p.reply_decoder.decode

    def rid(self) -> int:
        """A new request id."""
        return next(self._rids)

    def _leave_parent(self) -> None:
        """In a forked child: drop the connection and the requests the parent sent on it
        (their replies are the parent's to read, their outcomes the parent's to report)."""
        if self._pid == os.getpid():
            return
        if self.conn is not None:
            self.conn.close()  # the child's copy only: the parent's stays open
            self.conn = None
        self.unanswered.clear()
        self._shortfalls.clear()
        self._failed_unanswered = 0
        self._pid = os.getpid()

    def disconnect(self) -> None:
        if self.conn is not None:
            self.conn.close()  # in a forked child: its copy only, the parent's stays open
            self.conn = None
        self._pid = os.getpid()
        for rid, (_, chunks) in self.unanswered.items():
            if chunks:  # its answer is lost with the connection: not known to be committed
                self._shortfalls[rid] = chunks
        self.unanswered.clear()

    def close(self) -> None:
        with self.io:
            self.closed = True
            self.disconnect()

    def _connection(self, deadline: float) -> framing.Connection | None:
        """The connection to carry the next request: the current one if it is still good
        (nothing unexpected to read: no stale reply, no close by a restarted server), else a
        new one, waiting for a server that is (re)starting until ``deadline`` (unless
        ``wait_for_server`` is False: one attempt)."""
        self._leave_parent()
        conn = self.conn
        if conn is not None and conn.pending() and not self._read_unanswered(conn):
            self.disconnect()
            conn = None
        if conn is None:
            conn = self.conn = framing.Connection.open(
                self.endpoint, deadline, self.reply_spin, self.wait_for_server
            )
        return conn

    def call(
        self, req: Any, timeout: float | None = None, *, answered: bool = True, commits: int = 0
    ) -> Any:
        """Send ``req`` and return its reply (raising the error it is). ``answered=False``:
        return None once it is sent; the next call reads its reply (and logs it if it is an
        error): for a release whose outcome changes nothing for the caller, or a commit of
        ``commits`` chunks whose shortfall :meth:`commit_shortfalls` reports."""
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        with self.io:
            if self.closed:
                raise TierKVError("client is closed")
            try:
                conn = self._connection(deadline)
                if conn is None:
                    if self.wait_for_server:
                        raise TimeoutError
                    raise ConnectionRefusedError(errno.ECONNREFUSED, "nothing accepted it")
                try:
                    conn.send(self._encode(req), deadline)
                except (BrokenPipeError, ConnectionResetError):
                    if not answered:
                        raise
                    # The server may have refused the request (too large) and closed: its
                    # reason is already here to read.
                    deadline = min(deadline, time.monotonic() + 0.1)
                if not answered:
                    self.unanswered[req.rid] = (p.request_name(req), commits)
                    return None
                reply = self._await_reply(conn, req.rid, deadline)
            except (OSError, framing.FrameTooLargeError) as exc:
                raise self._unavailable(exc, wait, p.request_name(req)) from None
        if isinstance(reply, p.Error):
            raise_for(reply)
        return reply

    def _unavailable(self, exc: Exception, wait: float, what: str) -> ServerUnavailableError:
        """No reply, or a broken connection: disconnect (a late reply must not be mistaken
        for the answer to a later request, so the next call connects afresh) and return the
        error to raise, naming ``what`` waited."""
        self.disconnect()
        if isinstance(exc, ConnectionRefusedError):  # nothing listens (wait_for_server off)
            return ServerUnavailableError(
                f"no tierkv server accepts connections at {self.endpoint} ({what}): is it running?"
            )
        why = "no reply" if isinstance(exc, TimeoutError) else f"connection lost ({exc})"
        return ServerUnavailableError(
            f"{why} from tierkv server at {self.endpoint} within {wait:.1f} s ({what}): "
            "is it running?"
        )

    def _read_unanswered(self, conn: framing.Connection) -> bool:
        """Read what is there to read now, expecting only replies nobody waited for (False:
        something else came, or the server closed: the connection is not to be used)."""
        while self.unanswered and conn.pending():
            try:
                frames = conn.reader.read(conn.sock)
            except (OSError, framing.FrameTooLargeError):
                return False
            for frame in frames:
                if not self._took_unanswered(self._decode(frame)):
                    return False
        return not conn.pending()

    def _took_unanswered(self, reply: Any) -> bool:
        """Whether ``reply`` answers a request sent without waiting (then it is done with)."""
        sent = self.unanswered.pop(reply.rid, None)
        if sent is None:
            return False
        name, chunks = sent
        if isinstance(reply, p.Error):
            self._failed_unanswered += 1
            log.warning(
                "tierkv server: a %s this client did not wait for failed: %s", name, reply.message
            )
            if chunks:
                self._shortfalls[reply.rid] = chunks
        elif isinstance(reply, p.Committed) and reply.committed < chunks:
            self._shortfalls[reply.rid] = chunks - reply.committed
        return True

    def commit_shortfalls(self) -> dict[int, int]:
        """See :meth:`tierkv.client.Client.commit_shortfalls`."""
        with self.io:
            out, self._shortfalls = self._shortfalls, {}
        return out

    def settle(self, timeout: float | None = None) -> int:
        """See :meth:`tierkv.client.Client.settle`."""
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        with self.io:
            self._leave_parent()
            conn = self.conn
            try:
                while self.unanswered and conn is not None:
                    for frame in conn.receive(deadline):
                        if not self._took_unanswered(self._decode(frame)):
                            raise ConnectionError("a reply to no request sent")
            except (OSError, framing.FrameTooLargeError) as exc:
                raise self._unavailable(exc, wait, "requests sent without waiting") from None
            failed, self._failed_unanswered = self._failed_unanswered, 0
        return failed

    def _await_reply(self, conn: framing.Connection, rid: int, deadline: float) -> Any:
        """The reply to ``rid``. Every frame read with it is taken in: replies to requests
        sent without waiting may come after it (a server answers a request that blocks, a
        commit waiting for the cluster's directory, after later ones)."""
        while True:
            found = None
            for frame in conn.receive(deadline):
                reply = self._decode(frame)
                if self.unanswered and self._took_unanswered(reply):
                    continue
                # rid 0: about the connection, not a request (the server refused a message
                # too large to read and closed the connection).
                if found is None and (
                    reply.rid == rid or (reply.rid == 0 and isinstance(reply, p.Error))
                ):
                    found = reply
            if found is not None:
                if found.rid == 0:
                    self.disconnect()
                return found
