"""A KV-aware router in front of several vLLM instances, fed only by their KV event streams.

Each instance runs with vLLM's KV events on (``--kv-events-config '{"enable_kv_cache_events":
true, "publisher": "zmq", "endpoint": "tcp://*:5557"}'``) and, with the tierkv connector,
its stream also announces the chunks its tierkv server holds (medium ``CPU``; see "KV
events" in docs/cluster.md). The router subscribes to every stream and keeps, per instance
and medium, the blocks announced (``BlockStored``) and not yet removed (``BlockRemoved``;
``AllBlocksCleared``, which vLLM sends when its own cache is reset, clears the GPU medium),
as llm-d's kv-cache scorer does. A request's prompt is scored on each instance: the longest
run of its leading blocks held there, each block weighted by the best medium holding it (GPU
1.0, CPU 0.8, anything else 1.0; llm-d's defaults). The request goes to the best-scoring
instance; with no prefix anywhere (or a tie), to the one with the fewest requests in flight,
then the fewest requests so far, then in turn. The answer (streamed or not) is the
instance's, with the header ``x-kv-router-instance`` naming it.

Blocks are matched as vLLM's events describe them: block ``i`` of a prompt is the block
announced with the tokens ``i * B .. (i + 1) * B`` whose parent is the block matched for
``i - 1`` (the router never computes vLLM's block hashes, so it needs no hash seed). To
score, the router needs the prompt's token ids: ``/v1/completions`` prompts given as token
ids are used as they are; text prompts and chat messages are tokenized with ``--tokenizer``
(a model directory or name; chat messages through its chat template), which must be the
instances' own; without one, text requests go to the least-loaded instance.

Run it with vLLM's Python (it uses fastapi, uvicorn, httpx, msgspec and pyzmq, which vLLM
installs; transformers for ``--tokenizer``)::

    python examples/kv_router.py --block-size 16 --tokenizer /models/llama \\
        --instance http://node1:8100=tcp://node1:5557 \\
        --instance http://node2:8100=tcp://node2:5557 --port 8000

``GET /health`` answers 200 when some instance does; ``GET /router/stats`` gives each
instance's requests, the requests routed to it for a prefix it held, and the blocks its
stream announced. A stream whose sequence numbers skip (a lost message) is logged: the index
then lacks those events until they come again (tierkv announces its pool's content again
every ``kv_events_reannounce_interval``; vLLM's own blocks are announced as they change).
vLLM publishes a step's events at the end of the step, so what changes while an instance is
idle (a store committed after its last step, a reset of its cache) reaches the router with
that instance's next request. This is an example to adapt (no retries, no authentication of
the streams).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import uvicorn
import zmq
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from openai_forwarding import add_server_arguments, forward, forwarded_headers, json_body

log = logging.getLogger("kv_router")

# llm-d's default weights per medium; a medium not named here weighs 1.0.
MEDIUM_WEIGHTS = {"GPU": 1.0, "CPU": 0.8}
Block = tuple[Any, tuple[int, ...]]  # (parent block hash, the block's token ids)


class PrefixIndex:
    """The blocks one instance's stream announced, per medium: hash -> block, and the way
    back, block -> hash, to walk a prompt from its first block. Not thread-safe."""

    def __init__(self) -> None:
        self.blocks: dict[str, dict[Any, Block]] = {}
        self.hashes: dict[str, dict[Block, Any]] = {}

    def apply(self, event: dict[str, Any]) -> None:
        """One decoded event (a msgpack map: ``type`` and vLLM's field names)."""
        kind = event.get("type")
        medium = event.get("medium") or "GPU"
        if kind == "BlockStored":
            size = int(event["block_size"])
            tokens = event["token_ids"]
            blocks = self.blocks.setdefault(medium, {})
            hashes = self.hashes.setdefault(medium, {})
            parent = _hashable(event.get("parent_block_hash"))
            for i, h in enumerate(event["block_hashes"]):
                h = _hashable(h)
                block = (parent, tuple(tokens[i * size : (i + 1) * size]))
                blocks[h] = block
                hashes[block] = h
                parent = h
        elif kind == "BlockRemoved":
            blocks = self.blocks.get(medium, {})
            hashes = self.hashes.get(medium, {})
            for h in event["block_hashes"]:
                removed = blocks.pop(_hashable(h), None)
                if removed is not None:
                    hashes.pop(removed, None)
        elif kind == "AllBlocksCleared":  # vLLM's own cache was reset, not other media
            self.blocks.pop("GPU", None)
            self.hashes.pop("GPU", None)

    def score(self, tokens: Sequence[int], block_size: int) -> tuple[float, int]:
        """(the weighted length of the longest run of leading blocks held, those blocks)."""
        parent: Any = None
        total, run = 0.0, 0
        for start in range(0, len(tokens) - block_size + 1, block_size):
            block = (parent, tuple(tokens[start : start + block_size]))
            best, found = 0.0, None
            for medium, hashes in self.hashes.items():
                h = hashes.get(block)
                if h is not None:
                    found = h  # vLLM's hash of a block is the same in every medium
                    best = max(best, MEDIUM_WEIGHTS.get(medium, 1.0))
            if found is None:
                break
            total += best
            run += 1
            parent = found
        return total, run

    def size(self) -> dict[str, int]:
        return {medium: len(blocks) for medium, blocks in self.blocks.items()}


def _hashable(h: Any) -> Any:
    return tuple(h) if isinstance(h, list) else h


@dataclass
class Instance:
    """One vLLM instance: its base URL, its event stream, what the router knows of it."""

    url: str
    events: str
    index: PrefixIndex = field(default_factory=PrefixIndex)
    in_flight: int = 0
    requests: int = 0
    prefix_routed: int = 0
    events_seen: int = 0
    gaps: int = 0
    last_seq: int | None = None


class EventFeed(threading.Thread):
    """Reads every instance's ZMQ stream into its index (one thread for all of them)."""

    def __init__(self, instances: list[Instance], lock: threading.Lock) -> None:
        super().__init__(name="kv-router-events", daemon=True)
        self.instances = instances
        self.lock = lock
        self.context = zmq.Context()
        self.stopping = threading.Event()
        self.decoder = msgspec.msgpack.Decoder()

    def run(self) -> None:
        poller = zmq.Poller()
        sockets: dict[Any, Instance] = {}
        for instance in self.instances:
            sub = self.context.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.LINGER, 0)
            sub.connect(instance.events)
            poller.register(sub, zmq.POLLIN)
            sockets[sub] = instance
        try:
            while not self.stopping.is_set():
                for sub, _ in poller.poll(200):
                    self.receive(sockets[sub], sub.recv_multipart())
        finally:
            for sub in sockets:
                sub.close(0)
            self.context.term()

    def receive(self, instance: Instance, frames: list[bytes]) -> None:
        """One message of vLLM's publisher: (topic, sequence number, event batch)."""
        if len(frames) != 3:
            log.warning("%s: a message of %d frames, not 3: ignored", instance.events, len(frames))
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        try:
            batch = self.decoder.decode(frames[2])
            events = batch[1]  # an EventBatch: [timestamp, events, data parallel rank]
        except (msgspec.DecodeError, IndexError, TypeError) as exc:
            log.warning("%s: an undecodable event batch (%s): ignored", instance.events, exc)
            return
        with self.lock:
            if instance.last_seq is not None and seq != instance.last_seq + 1:
                instance.gaps += 1
                log.warning(
                    "%s: events %d to %d missed: the index lacks them until they come again",
                    instance.events,
                    instance.last_seq + 1,
                    seq - 1,
                )
            instance.last_seq = seq
            for event in events:
                if isinstance(event, dict):
                    instance.index.apply(event)
                    instance.events_seen += 1

    def stop(self) -> None:
        self.stopping.set()
        self.join(5)


class Router:
    """Picks an instance for each request and forwards it there."""

    def __init__(
        self,
        instances: list[Instance],
        block_size: int,
        tokenize: Callable[[str, dict[str, Any]], list[int] | None],
        timeout: float,
    ) -> None:
        self.instances = instances
        self.block_size = block_size
        self.tokenize = tokenize
        self.lock = threading.Lock()
        self.feed = EventFeed(instances, self.lock)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(timeout))
        self._turn = itertools.count()

    def choose(self, tokens: list[int] | None) -> tuple[Instance, int]:
        """The instance for a prompt, and the blocks of its prefix held there."""
        with self.lock:
            scores = [
                i.index.score(tokens, self.block_size) if tokens else (0.0, 0)
                for i in self.instances
            ]
        turn, n = next(self._turn), len(self.instances)

        def rank(k: int) -> tuple[float, int, int, int]:
            instance = self.instances[k]
            return (
                scores[k][0],  # the longest weighted prefix held
                -instance.in_flight,  # then the least busy
                -instance.requests,  # then the one that got the fewest requests
                -((k - turn) % n),  # then in turn
            )

        k = max(range(n), key=rank)
        (best, run), chosen = scores[k], self.instances[k]
        return chosen, run if best > 0 else 0

    async def route(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        try:
            tokens = await asyncio.to_thread(self.tokenize, path, body)
        except Exception as exc:  # a prompt the tokenizer refuses: still served
            log.warning("cannot tokenize the request (%s): routed by load", exc)
            tokens = None
        instance, run = self.choose(tokens)
        instance.requests += 1
        instance.prefix_routed += run > 0
        instance.in_flight += 1
        log.debug("%s -> %s (%d leading blocks held)", path, instance.url, run)
        try:
            return await forward(
                self.http,
                instance.url + path,
                body,
                headers,
                extra_headers={"x-kv-router-instance": instance.url},
            )
        finally:
            instance.in_flight -= 1

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {
                "instances": [
                    {
                        "url": i.url,
                        "events": i.events,
                        "requests": i.requests,
                        "prefix_routed": i.prefix_routed,
                        "in_flight": i.in_flight,
                        "blocks": i.index.size(),
                        "events_seen": i.events_seen,
                        "sequence_gaps": i.gaps,
                    }
                    for i in self.instances
                ]
            }


def prompt_tokenizer(name: str | None) -> Callable[[str, dict[str, Any]], list[int] | None]:
    """``tokenize(path, body)``: a request's prompt as token ids (None: none to score)."""
    tokenizer = None
    if name is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(name)

    def tokenize(path: str, body: dict[str, Any]) -> list[int] | None:
        if path.endswith("/chat/completions"):
            if tokenizer is None or not isinstance(body.get("messages"), list):
                return None
            ids = tokenizer.apply_chat_template(
                body["messages"], add_generation_prompt=True, tokenize=True
            )
            return list(ids)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        if isinstance(prompt, str) and tokenizer is not None:
            return list(tokenizer.encode(prompt))
        return None  # several prompts in one request, or text without a tokenizer

    return tokenize


def create_app(
    instances: list[tuple[str, str]],
    block_size: int,
    tokenizer: str | None = None,
    timeout: float = 600.0,
) -> FastAPI:
    router = Router(
        [Instance(url.rstrip("/"), events) for url, events in instances],
        block_size,
        prompt_tokenizer(tokenizer),
        timeout,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        router.feed.start()
        yield
        router.feed.stop()
        await router.http.aclose()

    app = FastAPI(lifespan=lifespan)

    async def routed(request: Request) -> Response:
        body = await json_body(request)
        if isinstance(body, Response):
            return body
        return await router.route(request.url.path, body, forwarded_headers(request))

    app.add_api_route("/v1/completions", routed, methods=["POST"])
    app.add_api_route("/v1/chat/completions", routed, methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        for instance in router.instances:
            try:
                if (await router.http.get(instance.url + "/health")).status_code == 200:
                    return Response(status_code=200)
            except httpx.HTTPError:
                continue
        return Response(status_code=503)

    @app.get("/router/stats")
    async def stats() -> Response:
        return JSONResponse(router.stats())

    return app


def parse_instance(text: str) -> tuple[str, str]:
    url, sep, events = text.partition("=")
    if not sep or not url.startswith("http") or "://" not in events:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give an instance as BASE_URL=EVENTS_ENDPOINT "
            "(http://node1:8100=tcp://node1:5557)"
        )
    return url, events


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--instance",
        action="append",
        type=parse_instance,
        required=True,
        help="a vLLM instance: BASE_URL=ZMQ_EVENTS_ENDPOINT (repeat for each)",
    )
    parser.add_argument(
        "--block-size", type=int, required=True, help="the instances' KV block size (tokens)"
    )
    parser.add_argument("--tokenizer", help="the instances' tokenizer, to score text prompts")
    add_server_arguments(parser)
    args = parser.parse_args(argv)
    if args.block_size < 1:
        parser.error("--block-size must be at least 1")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = create_app(args.instance, args.block_size, args.tokenizer, args.timeout)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
