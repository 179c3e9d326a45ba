"""The controller's ``POST /lookup`` route in process (tierkv.web.lookup), around a stand-in
for its answer: the bodies of lookups received and not yet answered are bounded together
(each was read, up to 4 MiB, before its turn). The route answered by a real controller is
in test_router_lookup.py."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from fastapi import FastAPI

from tierkv.web import lookup as lookup_module
from tierkv.web.lookup import add_lookup_route
from tierkv.web.requests import make_authorizer


def test_lookup_bodies_held_at_once_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    size = 100_000
    monkeypatch.setattr(lookup_module, "MAX_HELD_BODIES", 3 * size)
    release = threading.Event()
    answering = threading.Semaphore(0)

    def answer(body: bytes) -> dict[str, object]:
        answering.release()
        assert release.wait(30)
        return {"chunks": 0, "instances": []}

    app = FastAPI()
    add_lookup_route(app, make_authorizer(""), answer)

    async def post(body: bytes) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://controller") as c:
            return await c.post("/lookup", content=body)

    async def scenario() -> list[httpx.Response]:
        held = [asyncio.create_task(post(bytes(size))) for _ in range(3)]
        for _ in range(2):  # two answered at a time (AT_ONCE), the third waits its turn
            while not answering.acquire(blocking=False):
                await asyncio.sleep(0.01)
        for _ in range(100):  # the third body is read, and held, while it waits
            await asyncio.sleep(0.01)
        refused = await post(bytes(size))
        release.set()
        return [refused, *await asyncio.gather(*held)]

    refused, *answered = asyncio.run(scenario())
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert [r.status_code for r in answered] == [200, 200, 200]
    assert asyncio.run(post(bytes(size))).status_code == 200  # all given back
