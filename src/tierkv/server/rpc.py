"""The RPC loop: one thread that accepts engine connections, decodes requests, runs
handlers and sends replies (length-prefixed msgpack over Unix or TCP stream sockets,
:mod:`tierkv.framing`).

Fast requests run right here on the loop thread; the ones the service marks blocking run on
a thread pool, whose replies come back to the loop through a queue and a wake-up pipe (only
the loop thread touches the connections). Routers' requests (the service's ``router_work``)
run on threads of their own (:data:`ROUTER_WORKERS`), so that however many of them wait
(for a silent directory owner, say) the engines' blocking requests never queue behind them;
those threads keep the default time slice: woken, they do not take a core from an engine
the way the loop and its request workers do (:func:`tierkv.priority.control_thread`).

A QUERY_PREFETCH with ``wait_ms`` is answered when the lookup's prefetch lands or its wait
runs out, with no thread waiting for it (:mod:`tierkv.server.held_queries`).

A request that cannot be decoded gets an error reply and changes nothing; one announcing
more than ``max_message_bytes`` gets an error reply and its connection is closed (its body
is never read). A client whose replies pile up unread (more than ``MAX_UNSENT`` bytes) is
disconnected rather than let grow the server's memory. All connections together are bounded
too (``max_connections``, ``connection_buffer_bytes``: :mod:`tierkv.served_connections`).

For ipc endpoints the socket file lives in a 0700 runtime directory and is made 0600.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import selectors
import socket
import threading
import time
from typing import Any, get_args

import msgspec

from tierkv import framing
from tierkv import protocol as p
from tierkv.endpoints import EndpointInUseError
from tierkv.priority import control_thread
from tierkv.served_connections import Served, ServedConnections
from tierkv.server.engine_first import EngineFirst
from tierkv.server.held_queries import HeldQueries
from tierkv.server.service import CacheService
from tierkv.workers import WorkerPool

log = logging.getLogger(__name__)

POLL_SECONDS = 0.05
MAX_BATCH = 256  # messages handled per connection per turn, so no connection starves others
MAX_UNSENT = 64 * 2**20  # replies waiting for a client that does not read them
ROUTER_WORKERS = 1  # threads for routers' requests (the HTTP front sends a few at a time)


_REQUEST_TAGS = sorted(str(t.__struct_config__.tag) for t in get_args(p.Request))
_FIELD = 256  # bytes of an undecodable request's first fields looked at, at most

_Outer = list[msgspec.Raw]


def _outer_fields(payload: bytes | memoryview) -> tuple[object, object]:
    """The first two fields of an undecodable message (its tag and request id), each
    decoded only when short (None otherwise, or when the message is no array): a malformed
    message of tens of MiB must not be decoded whole, or its repr built, on the loop."""
    try:
        raw = msgspec.msgpack.decode(payload, type=_Outer)
    except Exception:
        return None, None
    fields: list[object] = []
    for part in raw[:2]:
        try:
            fields.append(msgspec.msgpack.decode(part) if len(part) <= _FIELD else None)
        except Exception:
            fields.append(None)
    fields += [None] * (2 - len(fields))
    return fields[0], fields[1]


def _lenient_rid(payload: bytes | memoryview) -> int:
    """Best-effort request id of an undecodable message, so the error reaches its caller."""
    rid = _outer_fields(payload)[1]
    # Not a bool (an int subclass): echoed as msgpack true/false, no reply would decode.
    return rid if type(rid) is int else 0


def _describe_malformed(payload: bytes | memoryview, exc: Exception) -> str:
    """The error message for an undecodable request; names an unknown request type."""
    tag = _outer_fields(payload)[0]
    if tag is not None and str(tag) not in _REQUEST_TAGS:
        return (
            f"malformed request: unknown request type {str(tag)[:40]!r} "
            f"(known: {', '.join(_REQUEST_TAGS)})"
        )
    return f"malformed request: {str(exc)[:200]}"


class _Connection(Served):
    """One engine's connection."""

    __slots__ = ()


class RpcServer:
    """Serves one :class:`CacheService` on one endpoint until :meth:`stop`."""

    def __init__(
        self, service: CacheService, endpoint: str, engines: EngineFirst | None = None
    ) -> None:
        self.service = service
        self.endpoint = endpoint
        # Engine requests in flight: HTTP work for routers waits for them (engine_first).
        self.engines = engines if engines is not None else EngineFirst()
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self.last_tick = service.clock()  # when the loop last went round (health checks)
        # Never blocks the loop; its threads, like the loop's, take a core first when woken.
        self._executor = WorkerPool(service.cfg.workers, "tierkv-rpc", control_thread)
        self._router_executor = WorkerPool(ROUTER_WORKERS, "tierkv-router")
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = p.request_decoder.decode
        self._ipc_path = endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None
        self._bound = False
        self._scratch = bytearray(framing.SCRATCH_BYTES)  # shared: one reader runs at a time
        self._results: queue.SimpleQueue[tuple[_Connection, bytes | None, bool]] = (
            queue.SimpleQueue()
        )
        # QUERY_PREFETCH replies that wait for the prefetch; deadlines in the prefetcher's clock.
        self._held: HeldQueries[_Connection] = HeldQueries(
            service, self._send_later, service.tiering.prefetcher.clock
        )

    listener: socket.socket  # from start() on
    selector: selectors.BaseSelector
    _conns: ServedConnections[_Connection]

    def start(self) -> None:
        """Bind the endpoint (the loop itself runs in :meth:`serve_forever`)."""
        self.listener = self._bind()
        self._bound = True
        self.selector = selectors.DefaultSelector()
        cfg = self.service.cfg
        self._conns: ServedConnections[_Connection] = ServedConnections(
            self.selector, "rpc", MAX_UNSENT, cfg.max_connections, cfg.connection_buffer_bytes
        )
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self._wake_r, selectors.EVENT_READ, "wake")

    # -- setup -----------------------------------------------------------------------------
    def _bind(self) -> socket.socket:
        if self._ipc_path:
            runtime_dir = os.path.dirname(self._ipc_path)
            os.makedirs(runtime_dir, mode=0o700, exist_ok=True)
            os.chmod(runtime_dir, 0o700)
            if os.path.exists(self._ipc_path):
                ensure_endpoint_free(self.endpoint)
                framing.unlink_quietly(self._ipc_path)
        old_umask = os.umask(0o177) if self._ipc_path else None
        try:
            sock = framing.bind(self.endpoint)
        except (OSError, ValueError) as exc:
            raise EndpointInUseError(f"cannot serve {self.endpoint}: {exc}") from None
        finally:
            if old_umask is not None:
                os.umask(old_umask)
        if self._ipc_path:
            os.chmod(self._ipc_path, 0o600)
        return sock

    # -- loop ------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Serve until :meth:`stop`, then answer what is queued and close the sockets."""
        if not self._bound:
            self.start()
        control_thread()
        last_sweep = self.service.clock()
        try:
            while not self._stop.is_set():
                events = self.selector.select(self._held.timeout(POLL_SECONDS))
                if events:
                    self.engines.started()  # the loop's own turn: routers wait meanwhile
                    try:
                        self._serve_events(events)
                    finally:
                        self.engines.finished()
                for conn, reply in self._held.expire():
                    if conn in self._conns:
                        self._reply(conn, reply)
                now = self.service.clock()
                self.last_tick = now
                if now - last_sweep >= 1.0:
                    last_sweep = now
                    self.service.housekeeping()
            self._shutdown()
        finally:
            self._stopped.set()

    def _serve_events(self, events: list[tuple[selectors.SelectorKey, int]]) -> None:
        for key, mask in events:
            if key.data == "accept":
                self._accept()
            elif key.data == "wake":
                self._forward_results()
            else:
                conn: _Connection = key.data
                if mask & selectors.EVENT_WRITE:
                    self._conns.flush(conn)
                if mask & selectors.EVENT_READ and conn in self._conns:
                    self._receive(conn)

    def connection_figures(self) -> dict[str, int]:
        """The engines' connections (:meth:`ServedConnections.figures`); {} before start."""
        conns = getattr(self, "_conns", None)
        return conns.figures() if conns is not None else {}

    def _accept(self) -> None:
        self._conns.accept(self.listener, self._connection)

    def _connection(self, sock: socket.socket) -> _Connection:
        reader = self._conns.reader(self.service.cfg.max_message_bytes, self._scratch)
        return _Connection(sock, reader)

    def _receive(self, conn: _Connection) -> None:
        for _ in range(MAX_BATCH):
            try:
                frames = conn.reader.read(conn.sock)
            except framing.FrameTooLargeError as exc:
                why = (
                    f"request of {exc.size} bytes refused: larger than max_message_bytes "
                    f"({exc.limit}); connection closed"
                )
                self._reply(conn, p.Error(0, p.ErrorCode.TOO_LARGE, why))  # sent if it fits
                self._conns.drop(conn)
                return
            except framing.FrameBudgetError as exc:
                why = (
                    f"request of {exc.size} bytes refused: the server holds as many large "
                    f"requests being received as it allows ({exc.limit} bytes, "
                    "connection_buffer_bytes); connection closed, try again"
                )
                self._conns.refused_large += 1
                self._reply(conn, p.Error(0, p.ErrorCode.LIMIT, why))
                self._conns.drop(conn)
                return
            except OSError:  # closed or reset by the client (it exited, or crashed)
                self._conns.drop(conn)
                return
            for frame in frames:
                self._handle(conn, frame)
            if not conn.reader.filled:
                return  # drained (a read that filled its buffer may have left more)

    def _handle(self, conn: _Connection, payload: memoryview) -> None:
        try:
            req = self._decode(payload)  # decoded fields are copies: nothing outlives the frame
        # msgspec raises a bare UnicodeDecodeError for a tag string that is not UTF-8.
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            reply: Any = self.service.malformed(
                _lenient_rid(payload), _describe_malformed(payload, exc)
            )
            self._reply(conn, reply)
            return
        if type(req) is p.QueryPrefetch and req.wait_ms:
            try:
                held = self._held.hold(conn, req)
            except Exception:  # never out of the loop: every other client would lose it
                log.exception("a held prefetch query failed")
                held = p.Error(req.rid, p.ErrorCode.INTERNAL, "internal error holding the query")
            if held is not None:
                self._reply(conn, held)
            return
        if type(req) in self.service.blocking:
            # An engine's request counts until its reply is forwarded (on this thread);
            # a router's lookup is the work that waits for them, not one of them.
            engine = type(req) not in self.service.router_work
            pool = self._executor if engine else self._router_executor
            pool.submit(self._run_blocking, conn, req, engine)
            if engine:
                self.engines.started()
            return
        self._reply(conn, self.service.handle(req))

    def _run_blocking(self, conn: _Connection, req: Any, engine: bool) -> None:
        payload = None  # no reply if the handler raised (the pool logs it)
        try:
            payload = self._encode(self.service.handle(req))
        finally:
            self._hand_to_loop(conn, payload, engine)

    def _send_later(self, conn: _Connection, reply: Any) -> None:
        """From any thread: send ``reply`` on the loop's next turn (a held query's)."""
        self._hand_to_loop(conn, self._encode(reply), False)

    def _hand_to_loop(self, conn: _Connection, payload: bytes | None, engine: bool) -> None:
        self._results.put((conn, payload, engine))
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"x")

    def _forward_results(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while self._wake_r.recv(4096):
                pass
        while True:
            try:
                conn, payload, engine = self._results.get_nowait()
            except queue.Empty:
                return
            if engine:
                self.engines.finished()
            if payload is not None and conn in self._conns:
                self._send(conn, payload)

    def _reply(self, conn: _Connection, reply: Any) -> None:
        self._send(conn, self._encode(reply))

    def _send(self, conn: _Connection, payload: bytes) -> None:
        self._conns.send(conn, framing.HEADER.pack(len(payload)), payload)

    # -- shutdown --------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the loop to finish (safe from signal handlers and other threads)."""
        self._stop.set()

    def alive(self, stall: float) -> bool:
        """Whether the loop is serving and went round within the last ``stall`` seconds."""
        return (
            not self._stop.is_set()
            and not self._stopped.is_set()
            and self.service.clock() - self.last_tick < stall
        )

    def _shutdown(self) -> None:
        # Answer what is already queued: blocking work finishes and is delivered, requests
        # still arriving are refused with SHUTTING_DOWN. Routers' queued lookups are dropped
        # (their connections close; the HTTP front answers 503).
        self._router_executor.shutdown(wait=True, cancel=True)
        self._executor.shutdown(wait=True)
        self._forward_results()
        for conn in self._conns:
            with contextlib.suppress(OSError, framing.FrameTooLargeError, framing.FrameBudgetError):
                for frame in conn.reader.read(conn.sock):
                    rid = _lenient_rid(frame)
                    self._reply(conn, p.Error(rid, p.ErrorCode.SHUTTING_DOWN, "server stopping"))
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline and any(c.outbox for c in self._conns):
            for conn in [c for c in self._conns if c.outbox]:
                self._conns.flush(conn)
            time.sleep(0.005)
        self.close()

    def close(self, linger_ms: int = 0) -> None:
        """Close the sockets and remove the ipc socket file (once; also when the loop never
        ran)."""
        if not self._bound:
            return
        self._bound = False
        self._stopped.set()
        self._executor.shutdown(wait=False, cancel=True)
        self._router_executor.shutdown(wait=False, cancel=True)
        self._conns.drop_all()
        self.selector.close()
        self.listener.close()
        self._wake_r.close()
        self._wake_w.close()
        if self._ipc_path:
            framing.unlink_quietly(self._ipc_path)


def ensure_endpoint_free(endpoint: str) -> None:
    """Raise EndpointInUseError when a live server answers on ``endpoint``.

    Called before the pool is created too: a second server for the same instance must not
    take the running server's segment name (create() replaces a segment it finds)."""
    if endpoint.startswith("ipc://") and not os.path.exists(endpoint[len("ipc://") :]):
        return
    if _endpoint_alive(endpoint):
        raise EndpointInUseError(
            f"another tierkv server is already serving {endpoint}; stop it or give this one "
            "another --instance"
        )


def _endpoint_alive(endpoint: str, timeout: float = 0.3) -> bool:
    """Whether a server answers PING on ``endpoint``."""
    try:
        conn = framing.Connection(framing.connect(endpoint, timeout))
    except OSError:
        return False
    try:
        deadline = time.monotonic() + timeout
        conn.send(msgspec.msgpack.encode(p.Ping(rid=1)), deadline)
        conn.receive(deadline)
        return True
    except (OSError, framing.FrameTooLargeError):
        return False
    finally:
        conn.close()
