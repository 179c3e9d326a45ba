"""Prefill/decode disaggregation with vLLM and tierkv: a small proxy in front of two instances.

Each ``/v1/completions`` or ``/v1/chat/completions`` request is first sent to the producer
(a vLLM instance with ``"kv_role": "kv_producer"``) with one output token and no streaming:
its prefill stores the prompt's KV chunks into its node's tierkv server, and the response
comes back once they are committed (and, in a cluster, published to the directory: a
server's ``--commit-publish-timeout``). The proxy then forwards the original request, at
once, to the consumer (``"kv_role": "kv_consumer"``), whose connector finds every full chunk
through its own node's tierkv server (fetched from the producer's node) and loads it instead
of prefilling; the consumer's response (streamed or not) is the client's.

tierkv is a cache, not a hand-off: if the prefill fails (producer down, overloaded, refused
the request), the proxy logs it and still forwards the request; the consumer then computes
the prompt itself. Clients see the consumer's answer either way.

Run it with vLLM's Python (it uses fastapi, uvicorn and httpx, which vLLM installs)::

    python examples/pd_proxy.py --producer http://prefill-node:8100 \\
        --consumer http://decode-node:8200 --port 8000

``GET /health`` answers 200 when both instances do; ``GET /v1/models`` is the consumer's.
An ``Authorization`` header (vLLM's ``--api-key``) is passed on to both instances.
This is an example to adapt (one producer, one consumer, no retries or load balancing).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response

from openai_forwarding import add_server_arguments, forward, forwarded_headers, json_body

log = logging.getLogger("pd_proxy")

# Sampling fields that would conflict with a one-token, non-streamed, single-sequence prefill.
PREFILL_DROPPED = ("stream_options", "min_tokens", "best_of")


def prefill_request(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The producer's copy of a request: the same prompt and sampling, one output token, one
    sequence, not streamed."""
    prefill = {k: v for k, v in body.items() if k not in PREFILL_DROPPED}
    prefill.update(max_tokens=1, stream=False, n=1)
    if chat:
        prefill["max_completion_tokens"] = 1  # it wins over max_tokens in chat requests
    return prefill


class PDProxy:
    """Forwards requests: prefill on the producer, then the whole request on the consumer."""

    def __init__(self, producer: str, consumer: str, timeout: float) -> None:
        self.producer = producer.rstrip("/")
        self.consumer = consumer.rstrip("/")
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(timeout))

    async def close(self) -> None:
        await self.http.aclose()

    async def prefill(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        """Run the prompt on the producer; a failure is logged, never raised."""
        started = time.perf_counter()
        try:
            reply = await self.http.post(
                self.producer + path,
                json=prefill_request(body, chat=path.endswith("chat/completions")),
                headers=headers,
            )
        except httpx.HTTPError as exc:
            log.warning("prefill failed (%s): the consumer computes the prompt", exc)
            return
        took_ms = (time.perf_counter() - started) * 1e3
        if reply.status_code != 200:
            log.warning(
                "prefill answered %d (%s): the consumer computes the prompt",
                reply.status_code,
                reply.text[:200],
            )
            return
        report = (reply.json().get("kv_transfer_params") or {}).get("tierkv") or {}
        log.info("prefill %.1f ms, stored %s chunks", took_ms, report.get("stored_chunks"))

    async def forward(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        """The original request on the consumer; its answer, streamed when it streams."""
        return await forward(self.http, self.consumer + path, body, headers)

    async def healthy(self) -> bool:
        for base in (self.producer, self.consumer):
            try:
                if (await self.http.get(base + "/health")).status_code != 200:
                    return False
            except httpx.HTTPError:
                return False
        return True


def create_app(producer: str, consumer: str, timeout: float = 600.0) -> FastAPI:
    proxy = PDProxy(producer, consumer, timeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await proxy.close()

    app = FastAPI(lifespan=lifespan)

    async def disaggregated(request: Request) -> Response:
        path = request.url.path
        body = await json_body(request)
        if isinstance(body, Response):
            return body
        headers = forwarded_headers(request)
        await proxy.prefill(path, body, headers)
        return await proxy.forward(path, body, headers)

    app.add_api_route("/v1/completions", disaggregated, methods=["POST"])
    app.add_api_route("/v1/chat/completions", disaggregated, methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if await proxy.healthy() else 503)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        reply = await proxy.http.get(
            proxy.consumer + "/v1/models", headers=forwarded_headers(request)
        )
        media_type = reply.headers.get("content-type")
        return Response(reply.content, status_code=reply.status_code, media_type=media_type)

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--producer", required=True, help="the kv_producer instance's base URL")
    parser.add_argument("--consumer", required=True, help="the kv_consumer instance's base URL")
    add_server_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = create_app(args.producer, args.consumer, args.timeout)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
