"""The client end of the cluster's control channel: signed calls to peers' control ports.

Requests travel over TCP stream sockets in the format of :mod:`tierkv.cluster.control_wire`
and are served by :class:`~tierkv.cluster.control_server.ControlServer`. The client leases
one connection per call from a per-peer pool (so directory lookups to one owner from several
threads run concurrently) and returns it only after a clean exchange; a connection whose call
failed or timed out is closed, never reused, so a late reply can never be taken for the
answer to a later request. :meth:`ControlClient.call_many` sends to several peers at once
and waits for all replies together: one round trip, however many owners. A call is one
``sendmsg`` and one ``recv`` on the calling thread, with no broker thread in between.

A peer that is not listening (yet, or any more) is tried again, backing off from 2 ms to
100 ms, until the call's timeout: a peer that is starting answers as soon as it listens. A
pooled connection the peer closed (it restarted) is replaced by a fresh one the same way.

A peer that did not answer in time is *suspect* until it answers again: callers skip it
(lookups answer without it, publishes to it are deferred), so a silent peer or controller
costs one timeout, not one per request. While any peer is suspect, a probe thread sends each
one a cheap request (an empty ``Resolve``, which cluster nodes and the controller both
answer) every ``probe_interval`` seconds with a short timeout; any answer, to a probe or to
any other call (a heartbeat), ends the suspicion. A reply whose signature does not match its
request counts as no answer (counted in ``bad_replies``), except a refusal: a peer with
another secret cannot sign for us, and a forged refusal only fails this call.
"""

from __future__ import annotations

import errno
import itertools
import logging
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from tierkv import framing
from tierkv.cluster import control_wire as wire
from tierkv.cluster import messages as m
from tierkv.cluster.auth import ControlSigner

log = logging.getLogger(__name__)

PROBE_INTERVAL = 0.5  # seconds between probes of suspect peers
PROBE_TIMEOUT = 1.0  # the most a probe waits (less when the client's timeout is shorter)
MAX_REPLY_BYTES = 256 * 2**20
LINK_SCRATCH_BYTES = 64 * 1024
FIRST_RETRY = 0.002  # seconds before a refused connection is tried again (then doubling)
MAX_RETRY = 0.1
_NO_ANSWER = object()  # what a call ends with when it got no answer it could use


class _Link:
    """One connection to a peer's control port, and the reader of its replies."""

    __slots__ = ("answered", "reader", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = framing.FrameReader(MAX_REPLY_BYTES, bytearray(LINK_SCRATCH_BYTES))
        self.answered = False  # it carried a reply already (its peer speaks our wire)

    def stale(self) -> bool:
        """Whether an idle connection has something to read: the peer's close, most likely
        (it restarted); either way it cannot carry the next request."""
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        return bool(poller.poll(0))


class _Call:
    """One request of a :meth:`ControlClient.call_many` on its way to one peer."""

    __slots__ = ("addr", "auth", "connecting", "link", "out", "pause", "payload", "retry_at", "rid")

    def __init__(self, addr: str, rid: int, payload: bytes) -> None:
        self.addr = addr
        self.rid = rid
        self.payload = payload
        self.auth = b""  # the signature it was sent with (signed just before sending)
        self.link: _Link | None = None
        self.connecting = False
        self.out: deque[memoryview] = deque()  # bytes still to send
        self.pause = FIRST_RETRY
        self.retry_at = 0.0


class ControlClient:
    """Calls peers' control servers; thread-safe (a connection is leased per call)."""

    def __init__(
        self,
        token: str,
        timeout: float,
        max_idle_per_peer: int = 16,
        probe_interval: float = PROBE_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
        decoder: msgspec.msgpack.Decoder[Any] = m.reply_decoder,
    ) -> None:
        """``decoder``: the replies expected (the cluster's by default).
        ``probe_interval``: seconds between probes of suspect peers."""
        self.signer = ControlSigner(token)
        self._decode = decoder.decode
        self.timeout = timeout
        self.max_idle = max_idle_per_peer
        self.probe_interval = probe_interval
        self.probe_timeout = min(timeout, PROBE_TIMEOUT)
        self.clock = clock
        self._idle: dict[str, list[_Link]] = {}
        self._suspect: dict[str, float] = {}  # address -> since when
        self._old_peers: set[str] = set()  # named in the log as speaking the ZMQ wire
        self._lock = threading.Lock()
        self._rids = itertools.count(1)
        self._closed = False
        self._prober: threading.Thread | None = None
        self._probe_wake = threading.Event()
        self.timeouts = 0  # requests with no answer (heartbeats and probes not counted)
        self.quiet_timeouts = 0  # heartbeats and probes with no answer (suspect=False)
        self.calls = 0
        self.bad_replies = 0  # replies whose signature did not match, or unreadable
        self.suspected = 0  # times a peer became suspect
        self.probes = 0  # probes sent to suspect peers
        self.recovered = 0  # suspect peers that answered again

    # -- connections -----------------------------------------------------------------------
    def _lease(self, addr: str) -> _Link | None:
        """A pooled connection to ``addr`` that is fit to carry a request, if there is one."""
        while True:
            with self._lock:
                idle = self._idle.get(addr)
                if not idle:
                    return None
                link = idle.pop()
            if not link.stale():
                return link
            link.sock.close()

    def _give_back(self, addr: str, link: _Link, clean: bool) -> None:
        with self._lock:
            if clean and not self._closed:
                idle = self._idle.setdefault(addr, [])
                if len(idle) < self.max_idle:
                    idle.append(link)
                    return
        link.sock.close()

    # -- suspicion -------------------------------------------------------------------------
    def suspect(self, addr: str) -> bool:
        """Whether ``addr`` timed out and has not answered anything since."""
        return addr in self._suspect

    def suspects(self) -> list[str]:
        """The addresses suspect now."""
        with self._lock:
            return list(self._suspect)

    def mark_suspect(self, addr: str) -> None:
        """``addr`` failed on another channel (a data-plane fetch timed out): suspect until
        it answers a probe, like a peer whose call timed out."""
        self._suspected(addr)

    def _suspected(self, addr: str) -> None:
        with self._lock:
            if addr in self._suspect or self._closed:
                return
            self._suspect[addr] = self.clock()
            self.suspected += 1
            start = self._prober is None
            if start:
                self._prober = threading.Thread(
                    target=self._probe_loop, name="tierkv-cluster-probe", daemon=True
                )
        log.info("cluster peer %s did not answer in time: suspect until it answers", addr)
        if start:
            assert self._prober is not None
            self._prober.start()

    def _answered(self, addr: str) -> None:
        if addr not in self._suspect:
            return
        with self._lock:
            since = self._suspect.pop(addr, None)
            if since is None:
                return
            self.recovered += 1
        log.info("cluster peer %s answers again (suspect for %.1f s)", addr, self.clock() - since)

    def _probe_loop(self) -> None:
        """While peers are suspect: probe each, every ``probe_interval`` seconds."""
        while not self._probe_wake.wait(self.probe_interval):
            addrs = self.suspects()
            if not addrs:
                continue
            self.probes += len(addrs)
            self.call_many({a: m.Resolve(0, []) for a in addrs}, self.probe_timeout, False)

    def forget(self, addr: str) -> None:
        """Close the pooled connections to a peer that left, and forget its suspicion."""
        with self._lock:
            links = self._idle.pop(addr, [])
            self._suspect.pop(addr, None)
        for link in links:
            link.sock.close()

    # -- calls -----------------------------------------------------------------------------
    def call(self, addr: str, msg: Any, timeout: float | None = None) -> Any | None:
        """One request to one peer; the reply, or None on timeout (Refused is a reply)."""
        return self.call_many({addr: msg}, timeout).get(addr)

    def call_many(
        self, requests: Mapping[str, Any], timeout: float | None = None, suspect: bool = True
    ) -> dict[str, Any]:
        """Send every request at once, wait for the replies together (up to ``timeout``);
        returns the replies that came back, by address. A peer that does not answer becomes
        suspect, unless ``suspect`` is False (calls with a short timeout of their own, such as
        heartbeats, whose misses mean less than a request's); any reply ends suspicion."""
        if not requests:
            return {}
        deadline = self.clock() + (self.timeout if timeout is None else timeout)
        pending: list[_Call] = []
        for addr, msg in requests.items():
            msg.rid = next(self._rids)
            call = _Call(addr, msg.rid, m.encode(msg))
            link = self._lease(addr)
            if link is not None:
                call.link = link
                self._queue(call, b"")
                pending.append(call)
            elif self._connect(call):
                pending.append(call)
        self.calls += len(requests)
        replies: dict[str, Any] = {}
        unanswered: list[_Call] = []
        try:
            while pending:
                now = self.clock()
                if now >= deadline:
                    break
                wait = deadline - now
                poller = select.poll()
                by_fd: dict[int, _Call] = {}
                for call in pending:
                    if call.link is None and call.retry_at <= now:
                        self._connect(call)
                    if call.link is None:
                        wait = min(wait, call.retry_at - now)
                        continue
                    sending = call.connecting or bool(call.out)
                    by_fd[call.link.sock.fileno()] = call
                    poller.register(call.link.sock, select.POLLOUT if sending else select.POLLIN)
                for fd, _ in poller.poll(max(0, int(wait * 1000)) + 1):
                    call = by_fd[fd]
                    outcome = self._progress(call)
                    if outcome is None:
                        continue
                    pending.remove(call)
                    if outcome is _NO_ANSWER:
                        unanswered.append(call)
                    else:
                        replies[call.addr] = outcome
                        self._answered(call.addr)
        finally:
            for call in pending + unanswered:
                if suspect:
                    self.timeouts += 1
                    self._suspected(call.addr)
                else:
                    self.quiet_timeouts += 1
                if call.link is not None:
                    self._give_back(call.addr, call.link, clean=False)
        return replies

    def _connect(self, call: _Call) -> bool:
        """Start a new connection for ``call`` (or schedule another try when the peer refuses
        it); False when its address cannot be reached at all (the call is dropped)."""
        try:
            family, address = framing.parse_endpoint(f"tcp://{call.addr}")
            sock = socket.socket(family, socket.SOCK_STREAM)
        except (ValueError, OSError) as exc:
            # A bogus member's address: no reply, like a timeout, but nothing to wait for.
            log.debug("cannot reach cluster peer %r: %s", call.addr, exc)
            return False
        sock.setblocking(False)
        try:
            framing.tune(sock)
            err = sock.connect_ex(address)
        # A host name that does not resolve, or that the resolver refuses (UnicodeError; a
        # TypeError for one that cannot be encoded at all).
        except (OSError, ValueError, TypeError) as exc:
            sock.close()
            log.debug("cannot reach cluster peer %r: %s", call.addr, exc)
            return False
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            self._retry_later(call)
            return True
        call.link = _Link(sock)
        call.connecting = True
        return True

    def _retry_later(self, call: _Call) -> None:
        """The connection failed before a reply: try a fresh one after a pause."""
        if call.link is not None:
            call.link.sock.close()
            call.link = None
        call.connecting = False
        call.out.clear()
        call.retry_at = self.clock() + call.pause
        call.pause = min(call.pause * 2, MAX_RETRY)

    def _queue(self, call: _Call, hello: bytes) -> None:
        """Sign the request (just before it is sent: requests of this process's threads
        reach a peer nearly in the order of their counters, the peer's replay window) and
        send what the socket takes now."""
        call.auth = self.signer.sign_request(call.payload)
        parts = wire.frame(call.auth, call.payload)
        if hello:
            parts[0] = hello + parts[0]
        call.out.extend(memoryview(part) for part in parts)
        self._send(call)

    def _send(self, call: _Call) -> None:
        assert call.link is not None
        try:
            framing.drop_sent(call.out, call.link.sock.sendmsg(call.out))
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._retry_later(call)

    def _progress(self, call: _Call) -> Any:
        """Move ``call`` on after its socket became ready: the reply, :data:`_NO_ANSWER`, or
        None while it goes on."""
        link = call.link
        assert link is not None
        if call.connecting:
            if link.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                self._retry_later(call)  # refused: nothing listens there (yet)
                return None
            call.connecting = False
            self._queue(call, wire.hello())
            return None
        if call.out:
            self._send(call)
            return None
        return self._receive(call, link)

    def _receive(self, call: _Call, link: _Link) -> Any:
        try:
            if not link.answered:
                zmtp = wire.zmtp_greeting(link.sock.recv(wire.ZMTP_SIGNATURE, socket.MSG_PEEK))
                if zmtp is None:
                    return None  # the rest of the first 10 bytes is on its way
                if zmtp:
                    self._old_peer(call.addr)
                    return _NO_ANSWER
            frames = link.reader.read(link.sock)
        except (BlockingIOError, InterruptedError):
            return None
        except (OSError, framing.FrameTooLargeError):
            self._retry_later(call)  # closed (a peer restarting) or broken
            return None
        if not frames:
            return None
        reply = self._verified(call, frames) if len(frames) == 1 else None
        if reply is None:
            self.bad_replies += 1
            return _NO_ANSWER
        link.answered = True
        call.link = None
        self._give_back(call.addr, link, clean=not link.reader.filled)
        return reply

    def _verified(self, call: _Call, frames: list[memoryview]) -> Any:
        """The reply in ``frames`` if it is the answer to ``call``; None if not."""
        parts = wire.split(frames[0])
        if parts is None:
            return None
        auth, payload = parts
        try:
            reply = self._decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
            return None
        if not self.signer.check_reply(call.auth, auth, payload):
            if not isinstance(reply, m.Refused):
                return None
            reply.rid = call.rid  # a refusal we cannot verify still fails the call
        return reply if reply.rid == call.rid else None

    def _old_peer(self, addr: str) -> None:
        with self._lock:
            first = addr not in self._old_peers
            self._old_peers.add(addr)
        if first:
            log.warning("cluster peer %s %s", addr, wire.OLD_WIRE)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links = [link for idle in self._idle.values() for link in idle]
            self._idle.clear()
            prober, self._prober = self._prober, None
        self._probe_wake.set()
        if prober is not None and prober is not threading.current_thread():
            prober.join(5.0)
        for link in links:
            link.sock.close()
