"""``POST /lookup`` for KV-aware routers, on a server's HTTP and the controller's: the body
is read (bounded), authorized like every POST (:func:`tierkv.server.http.make_authorizer`)
and answered by :mod:`tierkv.cluster.router_lookup` on a worker thread (a lookup may wait
for the directory's round trip). Bad bodies get a 400 (unknown model or namespace: 404)
with the reason."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from tierkv.cluster.router_lookup import MAX_BODY, LookupError_
from tierkv.server.http import Authorizer, authorized_body, error_reply


def add_lookup_route(
    app: FastAPI, authorize: Authorizer, answer: Callable[[bytes], dict[str, object]]
) -> None:
    @app.post("/lookup")
    async def lookup(request: Request) -> JSONResponse:
        body = await authorized_body(request, authorize, MAX_BODY)
        if isinstance(body, JSONResponse):
            return body
        try:
            reply = await run_in_threadpool(answer, body)
        except LookupError_ as exc:
            return error_reply(exc.status, str(exc))
        return JSONResponse(reply, headers={"Cache-Control": "no-store"})
