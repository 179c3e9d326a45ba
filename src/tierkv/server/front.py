"""The HTTP front of a server: a process of its own that owns the server's HTTP port.

Routers send ``POST /lookup`` all the time (50 of them back to back, in the campaign that
measured it), and in the server's process the HTTP stack's Python (uvicorn, Starlette,
FastAPI) held the GIL that the RPC loop needs for every engine request: an engine's LOOKUP
p99 rose 2 to 5x however short the GIL's switch interval. So the HTTP work runs here:

- ``POST /lookup`` (a cluster's): authorized, read, decoded and checked here (token ids
  packed into bytes: :func:`tierkv.cluster.router_lookup.query_of`), then answered by the
  server over RPC (ROUTER_LOOKUP: it hashes the prompt, asks its directory and returns the
  JSON answer, on its worker pool), :data:`AT_ONCE` at a time; the bodies received and not
  yet answered hold ``MAX_HELD_BODIES`` (64 MiB) at most together (past it: 503, try
  again; each must arrive whole within :data:`tierkv.web.requests.BODY_SECONDS`). A server
  that refused or failed the request itself (not the lookup's own 4xx answers) is
  told as its error's status (:data:`ERROR_STATUS`; 500 otherwise), one that did not answer
  as 503;
- every other request (dashboard, status, metrics, quotas, clear-cache) is passed on to the
  server's own HTTP app, which serves a private Unix socket in its runtime directory.

This process yields the CPU to the engines and the server
(:func:`tierkv.priority.background_process`: nice +10 and a long time slice, inherited by all
its threads): on a busy node, an engine's request and the server's RPC loop take a core from
it at once and get the larger share of the CPU; no lock or GIL is shared with them. Routers
are served from the CPU the engines leave: on the 2-core CI machine type, with 50 routers
sending back to back, it still answered 520 to 580 lookups a second, and the engine's LOOKUP
p50 under them fell from 1.3-1.4 ms to 0.9-1.0 ms against nice 0
(``benchmarks/router_load.py``).

The server starts it (:mod:`tierkv.server.front_process`), hands it the bound listening
socket and restarts it if it dies; it exits with the server (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable

import httpx
import uvicorn
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tierkv import protocol as p
from tierkv.client import ServerConnection, ServerError
from tierkv.cluster import router_lookup
from tierkv.cluster.router_lookup import MAX_BODY as MAX_LOOKUP_BODY
from tierkv.cluster.router_lookup import MAX_HELD_BODIES
from tierkv.framing import BufferBudget
from tierkv.logs import setup_logging
from tierkv.priority import background_process
from tierkv.server.front_process import READY, TOKEN_ENV
from tierkv.thread_names import name_os_threads
from tierkv.web.requests import (
    Authorizer,
    error_reply,
    held_body,
    make_authorizer,
    read_body,
)

log = logging.getLogger(__name__)

MAX_PASSED_BODY = 64 * 2**10  # bodies passed on to the server (its endpoints take less)
AT_ONCE = 4  # router lookups in flight to the server at a time
# How the server's error replies to a router lookup (not a lookup's own 4xx answers, which
# come as answers) are told to the router: the server refused or failed the request itself.
ERROR_STATUS = {
    p.ErrorCode.BAD_REQUEST: 400,
    p.ErrorCode.TOO_LARGE: 413,
    p.ErrorCode.LIMIT: 503,
    p.ErrorCode.SHUTTING_DOWN: 503,
}
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",  # recomputed for the body as passed on
        "date",  # this front's own (uvicorn's), not a second one
    }
)
PR_SET_PDEATHSIG = 1


class FrontApp:
    """The front's ASGI app: router lookups over RPC, everything else to the server."""

    def __init__(
        self,
        core: httpx.AsyncClient,
        authorize: Authorizer,
        router_lookup: Callable[[bytes], tuple[int, bytes]] | None,
    ) -> None:
        self.core = core
        self.authorize = authorize
        self.router_lookup = router_lookup
        self.turns = asyncio.Semaphore(AT_ONCE)
        self.lookup_bodies = BufferBudget(MAX_HELD_BODIES)  # (the event loop's thread only)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # no lifespan, no websockets
        request = Request(scope, receive)
        if self.router_lookup is not None and scope["path"] == "/lookup":
            if request.method == "POST":
                response = await self.lookup(request)
            else:
                response = error_reply(405, "Method Not Allowed", {"Allow": "POST"})
        else:
            response = await self.pass_on(request)
        await response(scope, receive, send)

    async def lookup(self, request: Request) -> Response:
        answer = self.router_lookup
        assert answer is not None
        async with held_body(request, self.authorize, MAX_LOOKUP_BODY, self.lookup_bodies) as body:
            if isinstance(body, Response):
                return body
            try:
                async with self.turns:
                    status, reply = await run_in_threadpool(answer, body)
            except ServerError as exc:  # the server answered, refusing or failing it
                status = ERROR_STATUS.get(exc.code, 500)
                level = logging.WARNING if status == 500 else logging.DEBUG
                log.log(level, "router lookup: %s", exc)
                return error_reply(status, f"the server refused the lookup: {exc}")
            except Exception as exc:  # the server is down or restarting: say so, briefly
                log.debug("router lookup failed: %s", exc)
                return error_reply(503, f"the server did not answer: {exc}")
        return Response(
            reply,
            status_code=status,
            media_type="application/json",
            headers={"Cache-Control": "no-store"},
        )

    async def pass_on(self, request: Request) -> Response:
        body = await read_body(request, MAX_PASSED_BODY)
        if isinstance(body, Response):
            return body
        # (values without surrounding blanks, which are not part of a value: RFC 9110 5.5)
        headers = [(k, v.strip()) for k, v in request.headers.items() if k not in HOP_BY_HOP]
        # The path as the client sent it, still percent-encoded: the core decodes it once (a
        # decoded path sent on would be decoded twice, and its "a%2F..%2Fb" become "b").
        # Dot segments are refused: an HTTP client would have removed them before sending.
        raw_path: bytes = request.scope.get("raw_path") or request.url.path.encode()
        if any(segment in (b".", b"..") for segment in raw_path.split(b"/")):
            return error_reply(400, "a path with '.' or '..' segments")
        query: bytes = request.scope.get("query_string", b"")
        url = self.core.base_url.copy_with(raw_path=raw_path + b"?" + query if query else raw_path)
        try:
            reply = await self.core.request(request.method, url, headers=headers, content=body)
        except httpx.HTTPError as exc:
            return error_reply(503, f"the server's HTTP did not answer: {exc}")
        kept = {k: v for k, v in reply.headers.items() if k.lower() not in HOP_BY_HOP}
        return Response(reply.content, status_code=reply.status_code, headers=kept)


class _Lookups:
    """ROUTER_LOOKUP over RPC, one client per thread of the pool that runs them."""

    def __init__(self, endpoint: str, auth_token: str) -> None:
        self.endpoint, self.auth_token = endpoint, auth_token
        self._local = threading.local()

    def __call__(self, body: bytes) -> tuple[int, bytes]:
        """(status, JSON body): decoded, checked and packed here; answered by the server."""
        try:
            query = router_lookup.query_of(router_lookup.parse(body))
        except router_lookup.RouterQueryError as exc:
            return exc.status, exc.body()
        conn: ServerConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self.connect()
        return conn.router_lookup(query)

    def connect(self) -> ServerConnection:
        """A connection that sleeps at once while its lookup is answered: the answer takes a
        hop to the server's router thread (about a millisecond), so reading on for the
        client's default spin would only burn CPU the engines could use."""
        return ServerConnection(
            self.endpoint, timeout=30.0, auth_token=self.auth_token, reply_spin=0.0
        )


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="tierkv's HTTP front (started by the server)")
    ap.add_argument("--fd", type=int, required=True, help="the bound listening socket")
    ap.add_argument("--core", required=True, help="the server's private HTTP socket (a path)")
    ap.add_argument("--rpc", default="", help="the server's RPC endpoint (router lookups)")
    ap.add_argument("--parent", type=int, default=0, help="exit if this pid is gone")
    ap.add_argument("--log-level", default="info")
    ap.add_argument("--log-format", default="text")
    args = ap.parse_args(argv)
    _die_with_parent()
    if args.parent and os.getppid() != args.parent:
        return  # the server died before this process could watch it
    background_process()  # before any thread starts: every thread of this process inherits it
    name_os_threads("tierkv-front")
    setup_logging(args.log_level, args.log_format)
    token = os.environ.pop(TOKEN_ENV, "")
    sock = socket.socket(fileno=args.fd)
    core = httpx.AsyncClient(
        transport=httpx.AsyncHTTPTransport(uds=args.core), base_url="http://tierkv", timeout=60.0
    )
    lookups = _Lookups(args.rpc, token) if args.rpc else None
    app = FrontApp(core, make_authorizer(token), lookups)
    config = uvicorn.Config(
        app,
        log_config=None,
        access_log=False,
        lifespan="off",
        server_header=False,
        ws="none",
        timeout_graceful_shutdown=2,
    )
    server = uvicorn.Server(config)
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request passed on

    def tell_when_ready() -> None:
        while not server.started and not server.should_exit:
            threading.Event().wait(0.01)
        if server.started:
            os.write(sys.stdout.fileno(), READY)

    threading.Thread(target=tell_when_ready, name="tierkv-front-ready", daemon=True).start()
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
