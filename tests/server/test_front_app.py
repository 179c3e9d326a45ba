"""The HTTP front's app in process (tierkv.server.front.FrontApp), around a stand-in for
the server's RPC answer: how the server's error replies reach a router, the bounds on
router lookups' bodies (held at once, and their time to arrive), and one ``date`` header
on what is passed on. The front as a process, answered by a real server, is in
test_http_front.py."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import httpx
import pytest

from tierkv import protocol as p
from tierkv.client import ServerError, ServerUnavailableError
from tierkv.server import front
from tierkv.server.front import FrontApp
from tierkv.web import requests
from tierkv.web.requests import make_authorizer

BODY = b'{"model": "m", "tokens": [1, 2, 3]}'


def app_answering(answer: object) -> FrontApp:
    core = httpx.AsyncClient(base_url="http://tierkv")  # (not reached by these tests)
    return FrontApp(core, make_authorizer(""), answer)  # type: ignore[arg-type]


async def post(app: FrontApp, body: bytes = BODY) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://front") as client:
        return await client.post("/lookup", content=body)


@pytest.mark.parametrize(
    ("error", "status", "words"),
    [
        (
            ServerError(p.ErrorCode.INTERNAL, "internal error handling router_lookup"),
            500,
            "refused",
        ),
        (ServerError(p.ErrorCode.SHUTTING_DOWN, "shutting down"), 503, "refused"),
        (ServerError(p.ErrorCode.BAD_REQUEST, "malformed"), 400, "refused"),
        (ServerUnavailableError("no reply within 30 s"), 503, "did not answer"),
        (ConnectionResetError("reset"), 503, "did not answer"),
    ],
)
def test_the_servers_error_replies_keep_their_meaning(
    error: Exception, status: int, words: str
) -> None:
    """A server that answered with an error (an internal error, shutting down) was told to
    the router as 503 "the server did not answer" whatever the error was."""

    def answer(body: bytes) -> tuple[int, bytes]:
        raise error

    app = app_answering(answer)
    reply = asyncio.run(post(app))
    assert reply.status_code == status and words in reply.json()["error"], reply.text
    assert app.lookup_bodies.used == 0


def test_router_lookup_bodies_held_at_once_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each lookup's body (up to 4 MiB) was read before its turn: routers sending many at
    once had the front hold all of them. Past the bound a lookup is answered 503 (try
    again); the bytes held are given back once each lookup is answered or refused."""
    size = 100_000
    monkeypatch.setattr(front, "MAX_HELD_BODIES", 3 * size)
    release = threading.Event()
    waiting = threading.Semaphore(0)

    def answer(body: bytes) -> tuple[int, bytes]:
        waiting.release()
        assert release.wait(30)
        return 200, b'{"instances": []}'

    app = app_answering(answer)

    async def scenario() -> list[httpx.Response]:
        held = [asyncio.create_task(post(app, bytes(size))) for _ in range(3)]
        for _ in range(3):  # all three are in the server's hands, their bodies held
            while not waiting.acquire(blocking=False):
                await asyncio.sleep(0.01)
        assert app.lookup_bodies.used == 3 * size
        refused = await post(app, bytes(size))
        release.set()
        return [refused, *await asyncio.gather(*held)]

    refused, *answered = asyncio.run(scenario())
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert "try again" in refused.json()["error"]
    assert [r.status_code for r in answered] == [200, 200, 200]
    assert app.lookup_bodies.used == 0
    too_large = asyncio.run(post(app, bytes(front.MAX_LOOKUP_BODY + 1)))
    assert too_large.status_code == 413 and app.lookup_bodies.used == 0


def test_what_is_passed_on_carries_one_date() -> None:
    """The server's reply's ``date`` was passed on beside the front's own: two of them."""

    async def core_app(scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
        await send({"type": "http.response.start", "status": 200,  # type: ignore[operator]
                    "headers": [(b"date", b"Mon, 01 Jan 2024 00:00:00 GMT"),
                                (b"content-type", b"text/plain")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]

    core = httpx.AsyncClient(transport=httpx.ASGITransport(app=core_app), base_url="http://tierkv")
    app = FrontApp(core, make_authorizer(""), None)

    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://front") as client:
            return await client.get("/status")

    reply = asyncio.run(get())
    assert reply.status_code == 200 and reply.text == "ok"
    assert reply.headers.get_list("date") == []  # (uvicorn adds the front's own)


def test_a_body_that_stops_arriving_gives_its_bytes_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A router that sent part of a lookup's body and then nothing more held its request,
    and the part of the bodies' bound it had taken, for good (uvicorn bounds no body's
    time): a few such clients kept every router lookup out. The body must arrive whole in
    :data:`tierkv.web.requests.BODY_SECONDS`; then 408, the connection closed, the bytes
    given back."""
    monkeypatch.setattr(requests, "BODY_SECONDS", 0.05, raising=False)  # (none before)
    app = app_answering(lambda body: (200, b"{}"))
    sent = asyncio.Event()

    async def stalled_body() -> AsyncIterator[bytes]:
        yield bytes(100_000)
        sent.set()
        await asyncio.Event().wait()  # (never set: the client sends nothing more)
        yield b""  # pragma: no cover

    async def scenario() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://front") as client:
            return await client.post("/lookup", content=stalled_body())

    # (the bound on the test only turns a hang, before the fix, into a failure)
    reply = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert reply.status_code == 408 and reply.headers["connection"] == "close", reply.text
    assert "did not arrive" in reply.json()["error"]
    assert app.lookup_bodies.used == 0


def test_a_lookup_cancelled_while_its_body_arrives_gives_its_bytes_back() -> None:
    """A request task cancelled in the middle of its body (a shutdown) kept what the body
    had taken of the bodies' bound."""
    app = app_answering(lambda body: (200, b"{}"))
    sent = asyncio.Event()

    async def stalled_body() -> AsyncIterator[bytes]:
        yield bytes(1000)
        sent.set()
        await asyncio.Event().wait()  # (never set)
        yield b""  # pragma: no cover

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://front") as client:
            task = asyncio.create_task(client.post("/lookup", content=stalled_body()))
            await asyncio.wait_for(sent.wait(), 10)
            for _ in range(10):  # (the front takes the part sent)
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(scenario())
    assert app.lookup_bodies.used == 0
