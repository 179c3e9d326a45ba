"""The RPC loop: a ZMQ ROUTER socket that decodes requests, runs handlers, sends replies.

Fast requests run right here on the loop thread; the ones the service marks blocking run on
a thread pool, whose replies come back to the loop over an inproc socket (ZMQ sockets are
not thread-safe, so only the loop thread touches the ROUTER). A request that cannot be
decoded gets an error reply and changes nothing; one bigger than ``max_message_bytes`` is
dropped by ZMQ itself, which closes that peer's connection.

For ipc endpoints the socket file lives in a 0700 runtime directory and is made 0600.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, get_args

import msgspec
import zmq

from tierkv import protocol as p
from tierkv.server.service import CacheService

log = logging.getLogger(__name__)

POLL_MS = 50
MAX_BATCH = 256  # messages drained per poll before giving the result socket a turn


class EndpointInUseError(RuntimeError):
    """Another live server already serves this endpoint."""


def _lenient_rid(payload: bytes | memoryview) -> int:
    """Best-effort request id of an undecodable message, so the error reaches its caller."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except Exception:
        return 0
    # Not a bool (an int subclass): echoed as msgpack true/false, no reply would decode.
    if isinstance(raw, list) and len(raw) > 1 and type(raw[1]) is int:
        return raw[1]
    return 0


_REQUEST_TAGS = sorted(str(t.__struct_config__.tag) for t in get_args(p.Request))


def _describe_malformed(payload: bytes | memoryview, exc: Exception) -> str:
    """The error message for an undecodable request; names an unknown request type."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except Exception:
        raw = None
    if isinstance(raw, list) and raw and str(raw[0]) not in _REQUEST_TAGS:
        return (
            f"malformed request: unknown request type {raw[0]!r:.40} "
            f"(known: {', '.join(_REQUEST_TAGS)})"
        )
    return f"malformed request: {exc}"


class RpcServer:
    """Serves one :class:`CacheService` on one endpoint until :meth:`stop`."""

    def __init__(self, service: CacheService, endpoint: str) -> None:
        self.service = service
        self.endpoint = endpoint
        self.ctx: zmq.Context[Any] = zmq.Context.instance()
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self.last_tick = service.clock()  # when the loop last went round (health checks)
        self._executor = ThreadPoolExecutor(service.cfg.workers, thread_name_prefix="tierkv-rpc")
        self._results_addr = f"inproc://tierkv-results-{id(self)}"
        self._local = threading.local()
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = p.request_decoder.decode
        self._ipc_path = endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None
        self._bound = False

    sock: zmq.Socket[Any]  # the ROUTER clients talk to, from start() on
    results: zmq.Socket[Any]  # replies of requests run on the worker threads

    def start(self) -> None:
        """Bind the endpoint (the loop itself runs in :meth:`serve_forever`)."""
        self.sock = self._bind()
        self._bound = True
        self.results = self.ctx.socket(zmq.PULL)
        self.results.bind(self._results_addr)

    # -- setup -----------------------------------------------------------------------------
    def _bind(self) -> zmq.Socket[Any]:
        if self._ipc_path:
            runtime_dir = os.path.dirname(self._ipc_path)
            os.makedirs(runtime_dir, mode=0o700, exist_ok=True)
            os.chmod(runtime_dir, 0o700)
            if os.path.exists(self._ipc_path):
                ensure_endpoint_free(self.endpoint, self.ctx)
                os.unlink(self._ipc_path)
        sock: zmq.Socket[Any] = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.MAXMSGSIZE, self.service.cfg.max_message_bytes)
        sock.setsockopt(zmq.LINGER, 500)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        old_umask = os.umask(0o177) if self._ipc_path else None
        try:
            sock.bind(self.endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
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
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.results, zmq.POLLIN)
        last_sweep = self.service.clock()
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(POLL_MS))
                if self.results in events:
                    self._forward_results()
                if self.sock in events:
                    self._drain_requests()
                now = self.service.clock()
                self.last_tick = now
                if now - last_sweep >= 1.0:
                    last_sweep = now
                    self.service.housekeeping()
            self._shutdown()
        finally:
            self._stopped.set()

    def _drain_requests(self) -> None:
        for _ in range(MAX_BATCH):
            try:
                # Frames, not bytes: the request is decoded straight from ZMQ's buffer rather
                # than from a fresh copy of it (a long prompt's token ids are 4 bytes a token).
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(frames)

    def _handle(self, frames: list[zmq.Frame]) -> None:
        # DEALER peers send [identity, payload]; REQ peers add an empty delimiter frame.
        if len(frames) < 2:
            return
        envelope = [frame.bytes for frame in frames[:-1]]
        payload = frames[-1].buffer  # decoded fields are copies: nothing outlives the frame
        try:
            req = self._decode(payload)
        # msgspec raises a bare UnicodeDecodeError for a tag string that is not UTF-8.
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            reply: Any = self.service.malformed(
                _lenient_rid(payload), _describe_malformed(payload, exc)
            )
            self._send(envelope, reply)
            return
        if type(req) in self.service.blocking:
            self._executor.submit(self._run_blocking, envelope, req)
            return
        self._send(envelope, self.service.handle(req))

    def _run_blocking(self, envelope: list[bytes], req: Any) -> None:
        reply = self.service.handle(req)
        push = getattr(self._local, "push", None)
        if push is None:
            push = self.ctx.socket(zmq.PUSH)
            push.connect(self._results_addr)
            self._local.push = push
        push.send_multipart([*envelope, self._encode(reply)])

    def _forward_results(self) -> None:
        while True:
            try:
                frames = self.results.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._send_raw(frames)

    def _send(self, envelope: list[bytes], reply: Any) -> None:
        self._send_raw([*envelope, self._encode(reply)])

    def _send_raw(self, frames: list[bytes]) -> None:
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            log.warning("dropping a reply: the client's queue is full")
        except zmq.ZMQError as exc:
            log.warning("could not send a reply: %s", exc)

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
        # still arriving are refused with SHUTTING_DOWN.
        self._executor.shutdown(wait=True)
        self._forward_results()
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) >= 2:
                rid = _lenient_rid(frames[-1])
                self._send(frames[:-1], p.Error(rid, p.ErrorCode.SHUTTING_DOWN, "server stopping"))
        self.close(linger_ms=500)

    def close(self, linger_ms: int = 0) -> None:
        """Close the sockets and remove the ipc socket file (once; also when the loop never
        ran)."""
        if not self._bound:
            return
        self._bound = False
        self._stopped.set()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.results.close(linger=0)
        self.sock.close(linger=linger_ms)
        if self._ipc_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._ipc_path)


def ensure_endpoint_free(endpoint: str, ctx: zmq.Context[Any] | None = None) -> None:
    """Raise EndpointInUseError when a live server answers on ``endpoint``.

    Called before the pool is created too: a second server for the same instance must not
    take the running server's segment name (create() replaces a segment it finds)."""
    if endpoint.startswith("ipc://") and not os.path.exists(endpoint[len("ipc://") :]):
        return
    if _endpoint_alive(ctx or zmq.Context.instance(), endpoint):
        raise EndpointInUseError(
            f"another tierkv server is already serving {endpoint}; stop it or give this one "
            "another --instance"
        )


def _endpoint_alive(ctx: zmq.Context[Any], endpoint: str, timeout_ms: int = 300) -> bool:
    """Whether a server answers PING on ``endpoint``."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(msgspec.msgpack.encode(p.Ping(rid=1)))
        return bool(sock.poll(timeout_ms))
    finally:
        sock.close()
