"""The server end of the cluster's control channel: one thread that serves a TCP port.

The thread accepts connections, reads framed requests (:mod:`tierkv.cluster.control_wire`)
and answers each inline: handlers are small dict operations (membership, directory entries).
A request is answered by the thread that received it, with one ``sendmsg``: no broker threads
between the socket and the handler, so a lookup costs a peer one wake-up of this thread.

Requests and replies are signed with the cluster secret (:mod:`tierkv.cluster.auth`): a
request whose signature is wrong, or that was served already (a replay), is refused before
it is even decoded; one that cannot be decoded gets :class:`~tierkv.cluster.messages.Refused`
too; all are counted and change nothing. A connection that does not open with our hello, or
announces a request over ``max_message_bytes`` (refused, its body never read), is closed; so
is one whose replies pile up unread, and all connections together are bounded
(:mod:`tierkv.served_connections`): a connection that has sent no signed request yet is
*unproven* (at most 256 at once, 64 from one address: past that the oldest goes; each closed
after 10 s; their large requests have a budget of their own), so clients without the secret
cannot take members' places. Refusals are logged as one
:class:`~tierkv.logs.FailureLog` (:class:`RefusalLog`): the first at WARNING with its cause,
then a summary at most once a minute, never a line each (a port under attack, or a node with
the wrong token, would otherwise flood the log).
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from tierkv import framing
from tierkv.cluster import control_wire as wire
from tierkv.cluster import messages as m
from tierkv.cluster.auth import ControlSigner
from tierkv.cluster.replay import REPLAYED
from tierkv.config import ConfigError
from tierkv.logs import FailureLog
from tierkv.priority import control_thread
from tierkv.served_connections import (
    DEFAULT_BUFFER_LIMIT,
    Served,
    ServedConnections,
    UnprovenLimits,
)

log = logging.getLogger(__name__)

POLL_SECONDS = 0.1
DEFAULT_MAX_MESSAGE = 64 * 2**20
MAX_BATCH = 64  # reads per connection per turn, so that no connection starves the others
MAX_UNSENT = 64 * 2**20  # replies waiting for a client that does not read them

Handler = Callable[[Any], Any]


def endpoint(host: str, port: int) -> str:
    """``tcp://host:port`` (an IPv6 host in brackets)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


class RefusalLog(FailureLog):
    """Requests a control port refused: a :class:`~tierkv.logs.FailureLog` whose episode
    never ends (refusals have no "works again"), worded for refusals."""

    FIRST = (
        "%(what)s: refused a request: %(error)s; further refusals are logged at DEBUG and "
        "summarised at most every %(interval).0fs"
    )
    STILL = "%(what)s: %(failures)d requests refused in %(lasted).0fs; the last: %(error)s"
    EACH = "%(what)s: refused a request: %(error)s"


class _Client(Served):
    """One client connection, with its hello until it is whole."""

    __slots__ = ("hello",)

    def __init__(self, sock: socket.socket, reader: framing.FrameReader) -> None:
        super().__init__(sock, reader)
        self.hello: bytearray | None = bytearray()  # None once the hello was accepted


class ControlServer:
    """Serves cluster requests on ``host:port`` (port 0: any free port) until :meth:`close`."""

    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        handlers: Mapping[type, Handler],
        max_message_bytes: int = DEFAULT_MAX_MESSAGE,
        decoder: msgspec.msgpack.Decoder[Any] = m.request_decoder,
        unproven: UnprovenLimits | None = None,
    ) -> None:
        """``decoder``: the requests this server understands (the cluster's by default; the
        controller serves its own); ``unproven``: the limits on connections that have sent
        no signed request yet (:class:`~tierkv.served_connections.UnprovenLimits`)."""
        self.signer = ControlSigner(token)
        self.handlers = dict(handlers)
        self.refused = 0  # unauthenticated: no or a wrong signature, too old, replayed
        self.malformed = 0
        self.served = 0
        self.host, self.port = host, port  # port 0: the one bind() got
        self.max_message_bytes = max_message_bytes
        self.listener: socket.socket | None = None
        self._clients: ServedConnections[_Client] | None = None
        self._scratch = bytearray(framing.SCRATCH_BYTES)  # shared: one reader runs at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._decode = decoder.decode
        self.refusals = RefusalLog(f"cluster control port {host}:{port}", log)
        self.unproven = unproven

    @property
    def replayed(self) -> int:
        """Requests refused as replays (counted in :attr:`refused` too)."""
        return self.signer.replays.refused

    def stats(self) -> dict[str, int]:
        conns = self._clients.figures() if self._clients is not None else {}
        return {
            "served": self.served,
            "refused": self.refused,
            "replayed": self.replayed,
            "malformed": self.malformed,
            # Connections: open, not yet proven (no signed request), turned away or closed
            # for the bounds of tierkv.served_connections.
            "connections": conns.get("open", 0),
            "unproven_connections": conns.get("unproven", 0),
            "evicted_unproven": conns.get("evicted_unproven", 0),
            "expired_unproven": conns.get("expired_unproven", 0),
            "turned_away_max_connections": conns.get("turned_away_max_connections", 0),
            "refused_large_requests": conns.get("refused_large_requests", 0),
        }

    def bind(self) -> None:
        """Open the listening socket (once); :attr:`port` is known from then on."""
        if self.listener is not None:
            return
        try:
            listener = framing.bind(endpoint(self.host, self.port))
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"cannot bind the cluster port {self.host}:{self.port}: {exc} (choose another "
                "--cluster-port, or stop the server using it)"
            ) from None
        self.port = listener.getsockname()[1]
        self.listener = listener
        selector = selectors.DefaultSelector()
        selector.register(listener, selectors.EVENT_READ, None)
        # Every connection's large requests together: at least one of the largest size.
        budget = max(DEFAULT_BUFFER_LIMIT, self._frame_limit())
        # Anyone who reaches the port may connect and send the (public) hello: connections
        # count as a member's only from their first signed request on.
        self._clients = ServedConnections(
            selector, "cluster control port", MAX_UNSENT, buffer_limit=budget,
            # Room for two of the largest requests while unproven (a member's first).
            unproven=self.unproven or UnprovenLimits(receive_bytes=2 * self._frame_limit()),
        )  # fmt: skip
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
        if self._clients is not None:
            self._clients.drop_all()
            self._clients.selector.close()
        if self.listener is not None:
            self.listener.close()

    # -- loop ------------------------------------------------------------------------------
    def _serve(self) -> None:
        clients = self._clients
        assert clients is not None
        control_thread()  # a peer's lookup waits for this thread: it takes a core first
        while not self._stop.is_set():
            clients.sweep()
            for key, mask in clients.selector.select(POLL_SECONDS):
                client: _Client | None = key.data
                if client is None:
                    assert self.listener is not None
                    clients.accept(self.listener, self._client)
                    continue
                if mask & selectors.EVENT_WRITE:
                    clients.flush(client)
                if mask & selectors.EVENT_READ and client in clients:
                    self._receive(client)

    def _frame_limit(self) -> int:
        # A request's frame holds its signature and its length too.
        return self.max_message_bytes + wire.AUTH_LENGTH.size + 256

    def _client(self, sock: socket.socket) -> _Client:
        assert self._clients is not None
        return _Client(sock, self._clients.reader(self._frame_limit(), self._scratch))

    def _receive(self, client: _Client) -> None:
        if client.hello is not None and not self._read_hello(client):
            return
        for _ in range(MAX_BATCH):
            try:
                frames = client.reader.read(client.sock)
            except framing.FrameTooLargeError as exc:
                self.malformed += 1
                why = f"request of {exc.size} bytes is larger than the limit ({exc.limit} bytes)"
                self.refusals.failed("request", why)
                self._send(client, b"", m.Refused(0, f"{why}; connection closed"))
                self._drop(client)
                return
            except framing.FrameBudgetError as exc:
                why = (
                    f"request of {exc.size} bytes refused: large requests being received "
                    f"hold all the {exc.limit} bytes allowed"
                )
                assert self._clients is not None
                self._clients.refused_large += 1
                self.refusals.failed("request", why)
                self._send(client, b"", m.Refused(0, f"{why}; connection closed, try again"))
                self._drop(client)
                return
            except OSError:  # closed or reset by the client (it exited, or crashed)
                self._drop(client)
                return
            for body in frames:
                self._answer(client, body)
            if not client.reader.filled:
                return

    def _read_hello(self, client: _Client) -> bool:
        """Read (the rest of) the hello; True once it is whole and accepted."""
        assert client.hello is not None
        try:
            data = client.sock.recv(wire.HELLO.size - len(client.hello))
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            data = b""
        if not data:
            self._drop(client)
            return False
        client.hello += data
        if client.hello[0] != wire.ZMTP_FIRST_BYTE and len(client.hello) < wire.HELLO.size:
            return False  # the rest is still coming
        why = wire.check_hello(client.hello)
        if not why:
            client.hello = None
            return True
        self.refused += 1
        self.refusals.failed("connection", why)
        self._drop(client)
        return False

    def _answer(self, client: _Client, body: memoryview) -> None:
        parts = wire.split(body)
        if parts is None:
            self.malformed += 1
            self.refusals.failed("request", "malformed: no signature length")
            self._send(client, b"", m.Refused(0, "malformed cluster request: no signature"))
            return
        auth, payload = parts
        self._send(client, auth, self._handle(client, auth, payload))

    def _handle(self, client: _Client, auth: bytes, payload: memoryview) -> Any:
        why = self.signer.check_request(auth, payload)
        if why:
            self.refused += 1
            self.refusals.failed("request", why)
            hint = "" if why.startswith(REPLAYED) else " (--auth-token)"
            return m.Refused(0, f"unauthenticated cluster request: {why}{hint}")
        assert self._clients is not None
        self._clients.prove(client)  # signed with the cluster secret: a member's
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

    # -- replies ---------------------------------------------------------------------------
    def _send(self, client: _Client, request_auth: bytes, reply: Any) -> None:
        payload = m.encode(reply)
        assert self._clients is not None
        auth = self.signer.sign_reply(request_auth, payload)
        self._clients.send(client, *wire.frame(auth, payload))

    def _drop(self, client: _Client) -> None:
        assert self._clients is not None
        self._clients.drop(client)
