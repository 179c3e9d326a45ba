"""The request-side pieces every tierkv HTTP app shares (a server's, its front's, the
controller's): JSON errors, the authorization of state-changing requests, and bounded
bodies (in size, and in time: :data:`BODY_SECONDS` to receive a whole body). Starlette
only: the front process imports this without FastAPI."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from tierkv.framing import BufferBudget

log = logging.getLogger(__name__)

MAX_BODY = 4096
# The time a request's body may take to arrive whole (uvicorn has no such bound: a client that
# stopped sending held its request, and the part of a body budget it had taken, for good).
BODY_SECONDS = 30.0


def error_reply(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


Authorizer = Callable[[Request], JSONResponse | None]


def make_authorizer(auth_token: str) -> Authorizer:
    """The check every state-changing request passes (see the module doc)."""

    def authorize(request: Request) -> JSONResponse | None:
        """None if ``request`` may change state, else the refusal (see the module doc)."""
        origin = request.headers.get("origin")
        if origin is not None and not _same_origin(origin, request):
            return error_reply(403, f"cross-origin request from {origin[:100]!r} refused")
        if not auth_token:
            return None  # loopback only (see config validation): local users may clear
        header = request.headers.get("authorization")
        if header is None:
            return error_reply(
                401,
                "this endpoint needs 'Authorization: Bearer <auth_token>' (the server's "
                "--auth-token)",
                {"WWW-Authenticate": "Bearer"},
            )
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), auth_token.encode()
        ):
            return error_reply(403, "wrong token", {"WWW-Authenticate": "Bearer"})
        return None

    return authorize


async def authorized_body(
    request: Request,
    authorize: Authorizer,
    limit: int = MAX_BODY,
    budget: BufferBudget | None = None,
) -> bytes | JSONResponse:
    """The body of a request that changes state (at most ``limit`` bytes), or the reply to
    send instead (refused, too large, cut short); ``budget``: see :func:`read_body`."""
    denied = authorize(request)
    if denied is not None:
        return denied
    return await read_body(request, limit, budget)


@contextlib.asynccontextmanager
async def held_body(
    request: Request, authorize: Authorizer, limit: int, budget: BufferBudget
) -> AsyncIterator[bytes | JSONResponse]:
    """:func:`authorized_body` charged to ``budget`` (what the bodies of requests of one
    kind, received and not yet answered, hold together: routers' lookups) until the block
    it is used in ends."""
    body = await authorized_body(request, authorize, limit, budget)
    try:
        yield body
    finally:
        if isinstance(body, bytes):
            budget.give(len(body))


async def read_body(
    request: Request, limit: int = MAX_BODY, budget: BufferBudget | None = None
) -> bytes | JSONResponse:
    """The request body, at most ``limit`` bytes (never buffers a huge one), or the reply
    to send instead: 413 when it is larger (at once when its ``Content-Length`` says so:
    the connection is closed, nothing of the body is waited for), 400 when the client went
    away in the middle (a quiet event: any local process can do that; the reply goes
    nowhere), 408 when it did not arrive whole within :data:`BODY_SECONDS` (the connection
    is closed).

    ``budget``: the bytes the bodies of all requests of this kind may hold together,
    charged as they arrive: past it the request is answered 503 (try again shortly), with
    what it had taken given back. A body returned stays charged: the caller gives
    ``len(body)`` back once done with it."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return error_reply(
            413,
            f"body larger than {limit} bytes (Content-Length: {declared[:20]})",
            {"Connection": "close"},
        )
    body = bytearray()
    try:
        refusal = await asyncio.wait_for(_receive(request, body, limit, budget), BODY_SECONDS)
    except ClientDisconnect:
        log.debug(
            "HTTP %s %s: the client disconnected in the body", request.method, request.url.path
        )
        refusal = error_reply(400, "the client disconnected before the end of the body")
    except asyncio.TimeoutError:
        log.debug("HTTP %s %s: the body did not arrive in time", request.method, request.url.path)
        refusal = error_reply(
            408, f"the body did not arrive within {BODY_SECONDS:g} s", {"Connection": "close"}
        )
    except BaseException:  # cancelled (a shutdown): what the body took goes back
        if budget is not None:
            budget.give(len(body))
        raise
    if refusal is not None:
        if budget is not None:
            budget.give(len(body))
        return refusal
    return bytes(body)


async def _receive(
    request: Request, body: bytearray, limit: int, budget: BufferBudget | None
) -> JSONResponse | None:
    """Receive ``request``'s body into ``body``: None once whole, else the reply to send
    instead (over ``limit``, or past ``budget``, which holds what ``body`` holds)."""
    async for chunk in request.stream():
        if budget is not None and not budget.take(len(chunk)):
            return error_reply(
                503,
                "too many request bodies being received at once: try again shortly",
                {"Retry-After": "1", "Connection": "close"},
            )
        body += chunk
        if len(body) > limit:
            return error_reply(413, f"body larger than {limit} bytes")
    return None


def _same_origin(origin: str, request: Request) -> bool:
    """Whether ``origin`` (an Origin header) is this server as the client addressed it."""
    host = request.headers.get("host")
    return host is not None and origin.lower() == f"{request.url.scheme}://{host}".lower()
