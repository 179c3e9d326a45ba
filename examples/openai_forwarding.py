"""Forwarding OpenAI-compatible requests to a vLLM instance, for the examples' proxies
(``pd_proxy.py``, ``kv_router.py``): the request as it came, the instance's answer as it
comes back (streamed when the request streams), its connection released at the end."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

# Headers passed on to the instances (vLLM's --api-key).
FORWARDED_HEADERS = ("authorization",)


def forwarded_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}


async def json_body(request: Request) -> dict[str, Any] | Response:
    """The request's JSON object, or a 400 answer saying it is not one."""
    try:
        body = await request.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return JSONResponse({"error": "the body must be a JSON object"}, status_code=400)
    return body


async def forward(
    http: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    extra_headers: dict[str, str] | None = None,
) -> Response:
    """POST ``body`` to ``url``; its answer, streamed when the request streams (502 if the
    instance cannot be reached). ``extra_headers`` go on the answer."""
    request = http.build_request("POST", url, json=body, headers=headers)
    try:
        reply = await http.send(request, stream=True)
    except httpx.HTTPError as exc:
        return JSONResponse(
            {"error": f"{url} failed: {exc}"}, status_code=502, headers=extra_headers
        )
    media_type = reply.headers.get("content-type")
    if body.get("stream"):
        return StreamingResponse(
            relay(reply), status_code=reply.status_code, media_type=media_type,
            headers=extra_headers,
        )  # fmt: skip
    try:
        content = await reply.aread()
    finally:
        await reply.aclose()
    return Response(
        content, status_code=reply.status_code, media_type=media_type, headers=extra_headers
    )


async def relay(reply: httpx.Response) -> AsyncIterator[bytes]:
    """A streamed answer as it comes; its connection is released at the end, also when the
    client goes away in the middle."""
    try:
        async for piece in reply.aiter_raw():
            yield piece
    finally:
        await reply.aclose()


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every example proxy takes: where it listens, how long an upstream request
    may take, how much it logs."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds an upstream request may take"
    )
    parser.add_argument("--log-level", default="info")
