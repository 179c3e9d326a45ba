"""The cluster's control channel over ZMQ: a ROUTER server and a pooled DEALER client.

The server binds ``tcp://HOST:PORT`` and answers each request on its own thread; handlers
are small dict operations (membership, directory entries), so they run inline. Requests and
replies are signed with the cluster secret (:mod:`tierkv.cluster.auth`): a request whose
signature is wrong, or that was served already (a replay), is refused before it is even
decoded; one that cannot be decoded gets :class:`Refused` too; all are counted and change
nothing. They are logged as one :class:`~tierkv.logs.FailureLog` (:class:`RefusalLog`): the
first at WARNING with its cause, then a summary at most once a minute, never a line each (a
port under attack, or a node with the wrong token, would otherwise flood the log). Messages above
``max_message_bytes`` are dropped by ZMQ itself. A reply whose signature does not match its
request is ignored (counted), as if it never came.

The client leases one DEALER socket per call from a per-peer pool (so directory lookups to
one owner from several threads run concurrently) and returns it only after a clean call; a
socket whose call timed out is closed, never reused, so a late reply can never be taken for
the answer to a later request. :meth:`ControlClient.call_many` sends to several peers at
once and waits for all replies together: one round trip, however many owners.

A peer that timed out is *suspect* until it answers again: callers skip it (lookups answer
without it, publishes to it are deferred), so a silent peer or controller costs one timeout,
not one per request. While any peer is suspect, a probe thread sends each one a cheap request
(an empty ``Resolve``, which cluster nodes and the controller both answer) every
``probe_interval`` seconds with a short timeout; any answer, to a probe or to any other call
(a heartbeat), ends the suspicion.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import zmq

from tierkv.cluster import messages as m
from tierkv.cluster.auth import OLD_AUTH_BYTES, ControlSigner
from tierkv.cluster.replay import REPLAYED
from tierkv.config import ConfigError
from tierkv.logs import FailureLog
from tierkv.priority import control_thread

log = logging.getLogger(__name__)

POLL_MS = 100
DEFAULT_MAX_MESSAGE = 64 * 2**20
PROBE_INTERVAL = 0.5  # seconds between probes of suspect peers
PROBE_TIMEOUT = 1.0  # the most a probe waits (less when the client's timeout is shorter)

Handler = Callable[[Any], Any]


def tcp(addr: str) -> str:
    return f"tcp://{addr}"


class RefusalLog(FailureLog):
    """Requests a control port refused: a :class:`~tierkv.logs.FailureLog` whose episode
    never ends (refusals have no "works again"), worded for refusals."""

    FIRST = (
        "%(what)s: refused a request: %(error)s; further refusals are logged at DEBUG and "
        "summarised at most every %(interval).0fs"
    )
    STILL = "%(what)s: %(failures)d requests refused in %(lasted).0fs; the last: %(error)s"
    EACH = "%(what)s: refused a request: %(error)s"


class ControlServer:
    """Serves cluster requests on ``host:port`` (port 0: any free port) until :meth:`close`."""

    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        handlers: Mapping[type, Handler],
        ctx: zmq.Context[Any] | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE,
        decoder: msgspec.msgpack.Decoder[Any] = m.request_decoder,
    ) -> None:
        """``decoder``: the requests this server understands (the cluster's by default; the
        controller serves its own)."""
        self.signer = ControlSigner(token)
        self.handlers = dict(handlers)
        self.ctx = ctx or zmq.Context.instance()
        self.refused = 0  # unauthenticated: no or a wrong signature, too old, replayed
        self.malformed = 0
        self.served = 0
        self.host, self.port = host, port  # port 0: the one bind() got
        self.max_message_bytes = max_message_bytes
        self.sock: zmq.Socket[Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._decode = decoder.decode
        self.refusals = RefusalLog(f"cluster control port {host}:{port}", log)

    @property
    def replayed(self) -> int:
        """Requests refused as replays (counted in :attr:`refused` too)."""
        return self.signer.replays.refused

    def stats(self) -> dict[str, int]:
        return {
            "served": self.served,
            "refused": self.refused,
            "replayed": self.replayed,
            "malformed": self.malformed,
        }

    def bind(self) -> None:
        """Open the listening socket (once); :attr:`port` is known from then on."""
        if self.sock is not None:
            return
        sock: zmq.Socket[Any] = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        try:
            sock.bind(f"tcp://{self.host}:{self.port}")
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ConfigError(
                f"cannot bind the cluster port {self.host}:{self.port}: {exc} (choose another "
                "--cluster-port, or stop the server using it)"
            ) from None
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(endpoint, bytes)
        self.port = int(endpoint.decode().rsplit(":", 1)[1])
        self.sock = sock
        self.refusals.what = f"cluster control port {self.host}:{self.port}"

    def start(self) -> None:
        """Bind (if not yet) and serve on a thread."""
        self.bind()
        self._thread = threading.Thread(target=self._serve, name="tierkv-cluster-ctl", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        """Whether its serving thread runs (for health checks)."""
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
        if self.sock is not None:
            self.sock.close(linger=0)

    def _serve(self) -> None:
        sock = self.sock
        assert sock is not None
        control_thread()  # a peer's lookup waits for this thread: it takes a core first
        while not self._stop.is_set():
            try:
                if not sock.poll(POLL_MS):
                    continue
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                raise
            if len(frames) < 2:
                continue
            # [identity, auth, payload] from our DEALERs; [identity, payload] is refused.
            envelope, auth = (frames[:-2], frames[-2]) if len(frames) >= 3 else (frames[:1], b"")
            payload = m.encode(self._handle(auth, frames[-1]))
            reply = [*envelope, self.signer.sign_reply(auth, payload), payload]
            with contextlib.suppress(zmq.ZMQError):
                sock.send_multipart(reply, zmq.NOBLOCK)

    def _handle(self, auth: bytes, payload: bytes) -> Any:
        why = self.signer.check_request(auth, payload)
        if why:
            self.refused += 1
            self.refusals.failed("request", why)
            hint = "" if why.startswith(REPLAYED) else " (--auth-token)"
            return m.Refused(0, f"unauthenticated cluster request: {why}{hint}")
        try:
            req = self._decode(payload)
        # msgspec raises a bare UnicodeDecodeError for a tag string that is not UTF-8.
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            self.malformed += 1
            self.refusals.failed("request", f"malformed: {exc}")
            return m.Refused(0, f"malformed cluster request: {exc}")
        handler = self.handlers.get(type(req))
        if handler is None:
            return m.Refused(req.rid, f"unsupported request {type(req).__name__}")
        try:
            reply = handler(req)
        except Exception:
            log.exception("cluster handler for %s failed", type(req).__name__)
            return m.Refused(req.rid, "internal error")
        self.served += 1
        return reply


class ControlClient:
    """Calls peers' control servers; thread-safe (a socket is leased per call)."""

    def __init__(
        self,
        token: str,
        timeout: float,
        ctx: zmq.Context[Any] | None = None,
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
        self.ctx = ctx or zmq.Context.instance()
        self.max_idle = max_idle_per_peer
        self.probe_interval = probe_interval
        self.probe_timeout = min(timeout, PROBE_TIMEOUT)
        self.clock = clock
        self._idle: dict[str, list[zmq.Socket[Any]]] = {}
        self._suspect: dict[str, float] = {}  # address -> since when
        self._lock = threading.Lock()
        self._rids = itertools.count(1)
        self._closed = False
        self._prober: threading.Thread | None = None
        self._probe_wake = threading.Event()
        self.timeouts = 0  # requests that timed out (heartbeats and probes not counted)
        self.quiet_timeouts = 0  # heartbeats and probes that timed out (suspect=False)
        self.calls = 0
        self.bad_replies = 0  # replies whose signature did not match (ignored)
        self.suspected = 0  # times a peer became suspect
        self.probes = 0  # probes sent to suspect peers
        self.recovered = 0  # suspect peers that answered again

    # -- sockets ---------------------------------------------------------------------------
    def _lease(self, addr: str) -> zmq.Socket[Any]:
        with self._lock:
            idle = self._idle.get(addr)
            if idle:
                return idle.pop()
        sock: zmq.Socket[Any] = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 1000)
        sock.setsockopt(zmq.SNDHWM, 1000)
        try:
            sock.connect(tcp(addr))
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        return sock

    def _give_back(self, addr: str, sock: zmq.Socket[Any], clean: bool) -> None:
        with self._lock:
            idle = self._idle.setdefault(addr, [])
            if clean and not self._closed and len(idle) < self.max_idle:
                idle.append(sock)
                return
        sock.close(linger=0)

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
        """Drop pooled sockets to a peer that left (their connections would only retry)."""
        with self._lock:
            socks = self._idle.pop(addr, [])
            self._suspect.pop(addr, None)
        for sock in socks:
            sock.close(linger=0)

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
        pending: dict[zmq.Socket[Any], tuple[str, int, bytes]] = {}
        replies: dict[str, Any] = {}
        poller = zmq.Poller()
        for addr, msg in requests.items():
            msg.rid = next(self._rids)
            payload = m.encode(msg)
            try:
                sock = self._lease(addr)
            except zmq.ZMQError as exc:
                # An address ZMQ cannot parse (a bogus member's): no reply, like a timeout;
                # the other requests of this call go on.
                log.debug("cannot reach cluster peer %r: %s", addr, exc)
                continue
            # Signed just before it is sent: requests of this process's threads reach a
            # peer nearly in the order of their counters (the peer's replay window).
            auth = self.signer.sign_request(payload)
            try:
                sock.send_multipart([auth, payload], zmq.NOBLOCK)
            except zmq.ZMQError:
                self._give_back(addr, sock, clean=False)
                continue
            pending[sock] = (addr, msg.rid, auth)
            poller.register(sock, zmq.POLLIN)
        self.calls += len(requests)
        try:
            while pending:
                left = deadline - self.clock()
                if left <= 0:
                    break
                for sock, _ in poller.poll(max(1, int(left * 1000))):
                    addr, rid, auth = pending[sock]
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.ZMQError:
                        continue
                    if len(frames) != 2:
                        self.bad_replies += 1
                        continue
                    try:
                        reply = self._decode(frames[1])
                    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
                        continue
                    # Unverifiable replies are ignored, except a refusal: a peer with another
                    # secret cannot sign for us, and a forged refusal only fails this call.
                    if not self.signer.check_reply(auth, *frames):
                        self.bad_replies += 1
                        if not isinstance(reply, m.Refused):
                            continue
                        reply.rid = rid
                        if len(frames[0]) == OLD_AUTH_BYTES:  # it could not read ours either
                            reply.reason = f"the peer runs an older tierkv: {reply.reason}"
                    if reply.rid != rid:
                        continue  # cannot happen on a fresh lease; ignore defensively
                    replies[addr] = reply
                    poller.unregister(sock)
                    del pending[sock]
                    self._answered(addr)
                    self._give_back(addr, sock, clean=True)
        finally:
            for sock, (addr, _, _) in pending.items():
                if suspect:
                    self.timeouts += 1
                    self._suspected(addr)
                else:
                    self.quiet_timeouts += 1
                self._give_back(addr, sock, clean=False)
        return replies

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks = [s for idle in self._idle.values() for s in idle]
            self._idle.clear()
            prober, self._prober = self._prober, None
        self._probe_wake.set()
        if prober is not None and prober is not threading.current_thread():
            prober.join(5.0)
        for sock in socks:
            sock.close(linger=0)
