"""``POST /lookup`` for KV-aware routers on the controller's HTTP: the body is read
(bounded, and the bodies held at once: ``MAX_HELD_BODIES``, then 503), authorized like
every POST (:func:`tierkv.web.requests.make_authorizer`) and answered by
:mod:`tierkv.cluster.router_lookup` on a worker thread. Bad bodies get a 400 (unknown model
or namespace: 404) with the reason. At most :data:`AT_ONCE` lookups are answered at a time
(the others wait their turn in the event loop, costing nothing), with a short GIL switch
interval while they run (:func:`tierkv.priority.sharing_the_gil`), so that the controller's
own control plane keeps its turns.

A server answers routers from its HTTP front process instead (:mod:`tierkv.server.front`),
out of its own process: there the HTTP stack's Python held the GIL that the RPC loop needs
for every engine request (an engine's LOOKUP p99 2 to 5x its idle value under 50 routers).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from tierkv.cluster.router_lookup import MAX_BODY, MAX_HELD_BODIES, RouterQueryError
from tierkv.framing import BufferBudget
from tierkv.priority import sharing_the_gil
from tierkv.web.requests import Authorizer, error_reply, held_body

AT_ONCE = 2  # lookups answered at a time (two: one may wait on a directory round trip)


def add_lookup_route(
    app: FastAPI, authorize: Authorizer, answer: Callable[[bytes], dict[str, object]]
) -> None:
    turns = asyncio.Semaphore(AT_ONCE)
    bodies = BufferBudget(MAX_HELD_BODIES)  # (the event loop's thread only)

    @app.post("/lookup")
    async def lookup(request: Request) -> JSONResponse:
        async with held_body(request, authorize, MAX_BODY, bodies) as body:
            if isinstance(body, JSONResponse):
                return body
            async with turns:
                with sharing_the_gil():
                    try:
                        reply = await run_in_threadpool(answer, body)
                    except RouterQueryError as exc:
                        return error_reply(exc.status, str(exc))
                    return JSONResponse(reply, headers={"Cache-Control": "no-store"})
