"""Prefill/decode disaggregation end to end: two clustered tierkv servers, two vLLM API
servers and the proxy from ``examples/pd_proxy.py``, all real processes on loopback.

Node A runs the producer (``kv_role: kv_producer``) on its tierkv server, node B the consumer
(``kv_consumer``) on its own; the servers form a cluster. Each prompt goes to the proxy,
which prefills it on the producer (one output token) and at once sends the whole request to
the consumer. Prompts of 3 to 11 full chunks (and a partial one) are sent back to back, as
completions (one streamed) and as a chat; every one must be answered with the tokens of a
vLLM engine without tierkv (greedy: an ``engine_run.py`` engine forked from the session's
engine zygote, given the chat's tokens as the API servers' template renders it), and the
consumer must have loaded every full chunk of
every prompt from tierkv: B's lookup finds them on A the moment A's store returned (the
commit waits for the directory, ``--commit-publish-timeout``). The producer prefills in steps
of 512 tokens, so most prompts' early commits are not waited for: read-your-writes must hold
all the same. Then the producer is stopped:
the proxy still answers, the same tokens, from the consumer computing the prompt itself.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from support.clusterkit import TOKEN, Node, converged, start_node, status, wait_for
from support.forked_engines import Engine, Zygote
from support.httputil import request
from support.servers import ServerProcess
from support.tiny_model import SENTENCES, tokenizer_size
from support.vllm_serve import CHAT_TEMPLATE, PDProxy, VllmServer, tierkv_connector

pytestmark = [pytest.mark.vllm, pytest.mark.processes, pytest.mark.timeout(1200)]

CHUNK = 256  # the servers' chunk size (their default)
FULL_CHUNKS = [3, 11, 5, 8, 4, 6, 3]  # per completion prompt, each plus a partial chunk
STREAMED = 3  # this completion is streamed (its answer carries no connector report)
FALLBACK_CHUNKS = 4  # the prompt sent once the producer is down
MAX_TOKENS = 16
PRODUCER_STEP = ["--max-num-batched-tokens", "512"]  # so that long prompts prefill in steps


@pytest.fixture
def vllm_servers() -> Iterator[Callable[..., list[VllmServer]]]:
    """Start vLLM API servers at the same time (``start([(model, kv_transfer_config)...])``),
    each in its own short temporary directory; all are stopped and removed after the test."""
    started: list[VllmServer] = []

    def start(specs: list[tuple[Any, ...]]) -> list[VllmServer]:
        """Each spec: (model, kv_transfer_config[, more vLLM options])."""
        servers = [
            VllmServer(Path(tempfile.mkdtemp(prefix="tierkv-vllm-")), *spec) for spec in specs
        ]
        started.extend(servers)
        with ThreadPoolExecutor(len(servers)) as pool:
            return list(pool.map(lambda s: s.start(), servers))

    yield start
    for server in started:
        server.stop()
        shutil.rmtree(server.workdir, ignore_errors=True)


@pytest.fixture
def engine_without_tierkv(
    zygote: Zygote, tiny_model: Path, tmp_path: Path
) -> Iterator[Callable[[list[list[int]]], Engine]]:
    """Start an engine of the tiny model without tierkv on prompts (token ids), each answered
    with ``MAX_TOKENS`` tokens (greedy, EOS ignored); stopped after the test."""
    started: list[Engine] = []

    def start(prompts: list[list[int]]) -> Engine:
        engine = Engine(
            zygote,
            tmp_path,
            "reference",
            model=str(tiny_model),
            prompts=[{"tokens": p} for p in prompts],
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
        )
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()


@pytest.fixture
def pd_proxy() -> Iterator[Callable[[str, str], PDProxy]]:
    started: list[PDProxy] = []

    def start(producer: str, consumer: str) -> PDProxy:
        proxy = PDProxy(Path(tempfile.mkdtemp(prefix="tierkv-pd-")), producer, consumer)
        started.append(proxy)
        return proxy.start()

    yield start
    for proxy in started:
        proxy.stop()
        shutil.rmtree(proxy.workdir, ignore_errors=True)


def connector_config(node: Node, role: str) -> dict[str, Any]:
    return tierkv_connector(node.server.endpoint, role, auth_token=TOKEN)


Request = tuple[str, dict[str, Any]]  # path, body


def make_requests(model: Path) -> tuple[list[Request], Request]:
    """Completions of random token ids (one of them streamed), then one chat of about 1350
    tokens; and one more completion, for when the producer is down."""
    rng = random.Random(2468)
    vocab = tokenizer_size(model)
    common = {
        "model": str(model),
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }

    def completion(chunks: int) -> Request:
        prompt = [rng.randrange(3, vocab) for _ in range(chunks * CHUNK + rng.randrange(1, CHUNK))]
        return ("/v1/completions", {**common, "prompt": prompt})

    requests = [completion(chunks) for chunks in FULL_CHUNKS]
    requests[STREAMED][1].update(stream=True, stream_options={"include_usage": True})
    words = " ".join(SENTENCES).split()
    text = " ".join(rng.choice(words) for _ in range(900))
    # max_completion_tokens and min_tokens: the proxy's prefill must override or drop them.
    chat = {
        **{k: v for k, v in common.items() if k != "max_tokens"},
        "max_completion_tokens": MAX_TOKENS,
        "min_tokens": MAX_TOKENS,
        "messages": [{"role": "user", "content": text}],
    }
    requests.append(("/v1/chat/completions", chat))
    return requests, completion(FALLBACK_CHUNKS)


def prompt_tokens(model: Path, body: dict[str, Any]) -> list[int]:
    """The token ids vLLM's API server makes of a request's prompt: a completion's are its
    prompt; a chat's, its messages rendered by the servers' ``CHAT_TEMPLATE`` and tokenized
    without special tokens (a chat's default: the template would hold them)."""
    if "prompt" in body:
        return list(body["prompt"])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    text = tokenizer.apply_chat_template(
        body["messages"], chat_template=CHAT_TEMPLATE, tokenize=False
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


@dataclass
class Answer:
    tokens: list[int]  # output token ids
    prompt_tokens: int
    tierkv: dict[str, Any] | None  # the connector's report; streamed answers have none


def ask(service: VllmServer | PDProxy, path: str, body: dict[str, Any]) -> Answer:
    if body.get("stream"):
        events = service.post_events(path, body)
        tokens = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
        return Answer(tokens, events[-1]["usage"]["prompt_tokens"], None)
    answer = service.post(path, body)
    tierkv = (answer.get("kv_transfer_params") or {}).get("tierkv")
    return Answer(answer["choices"][0]["token_ids"], answer["usage"]["prompt_tokens"], tierkv)


def test_consumer_loads_every_full_chunk_the_producer_prefilled(
    tiny_model: Path,
    server_factory: Callable[..., ServerProcess],
    vllm_servers: Callable[..., list[VllmServer]],
    pd_proxy: Callable[[str, str], PDProxy],
    engine_without_tierkv: Callable[[list[list[int]]], Engine],
) -> None:
    requests, fallback = make_requests(tiny_model)
    # Forked with vLLM imported, it answers while the API servers start.
    prompts = [prompt_tokens(tiny_model, body) for _, body in [*requests, fallback]]
    reference = engine_without_tierkv(prompts)
    a = start_node(server_factory, [], pool_size="256MiB", seed_self=True)
    b = start_node(server_factory, [a.port], pool_size="256MiB", seed_self=True)
    wait_for(lambda: converged([a, b]))
    producer, consumer = vllm_servers(
        [
            # Prefill in steps of 512 tokens: the commits of a prompt's steps but its last
            # are not waited for; the step in which the request can finish waits for them all.
            (tiny_model, connector_config(a, "kv_producer"), PRODUCER_STEP),
            (tiny_model, connector_config(b, "kv_consumer")),
        ]
    )
    proxy = pd_proxy(producer.url, consumer.url)
    expected = [r["tokens"] for r in reference.results()]

    answers: list[Answer] = []
    seconds: list[float] = []
    for path, body in requests:  # back to back, no pause
        started = time.perf_counter()
        answers.append(ask(proxy, path, body))
        seconds.append(time.perf_counter() - started)

    full_chunks = [answer.prompt_tokens // CHUNK for answer in answers]
    assert all(answer.prompt_tokens % CHUNK for answer in answers)  # a partial last chunk
    assert full_chunks[:-1] == FULL_CHUNKS and full_chunks[-1] >= 3, full_chunks
    # The reference answered the same prompts (the chat's, as the servers rendered it).
    assert [answer.prompt_tokens for answer in answers] == [len(p) for p in prompts[:-1]]
    assert [answer.tokens for answer in answers] == expected[: len(requests)]
    for i, answer in enumerate(answers):
        if i == STREAMED:
            continue  # checked below, with the servers' counts
        tierkv = answer.tierkv
        assert tierkv is not None, (i, consumer.log_tail())
        loaded = full_chunks[i] * CHUNK
        assert tierkv["hit_tokens"] == loaded, (i, tierkv)
        assert tierkv["external_tokens"] == loaded, (i, tierkv)
        assert tierkv["loaded_tokens"] == loaded, (i, tierkv)
        assert tierkv["load_failed_from"] is None, (i, tierkv)
        assert tierkv["stored_chunks"] == 0, (i, tierkv)  # a consumer never stores

    with a.client() as client:
        stats_a = client.stats()
    with b.client() as client:
        stats_b = client.stats()
    # The producer stored every full chunk on A; B found every one on A and the consumer
    # retrieved every one (the streamed prompt's too).
    assert stats_a.objects == sum(full_chunks), stats_a
    chunk_bytes = stats_a.stored_bytes // stats_a.objects
    assert stats_a.stored_bytes == chunk_bytes * stats_a.objects, stats_a
    assert stats_b.lookup_hits.get("peer") == sum(full_chunks), stats_b.lookup_hits
    assert stats_b.retrieved_bytes == chunk_bytes * sum(full_chunks), stats_b
    assert stats_a.errors == {} and stats_b.errors == {}, (stats_a.errors, stats_b.errors)
    directory = status(a)["directory"]
    assert directory["publish_waits"] >= len(requests), directory
    assert directory["publish_wait_timeouts"] == 0, directory
    print(
        "pd: full chunks per prompt",
        full_chunks,
        "seconds per prompt (prefill + decode through the proxy)",
        [round(s, 3) for s in seconds],
    )

    # Without a producer the consumer computes the prompt itself: the same answer.
    producer.stop()
    assert request("GET", proxy.url + "/health").status == 503
    answer = ask(proxy, *fallback)
    assert answer.tokens == expected[-1]
    assert answer.tierkv is not None and answer.tierkv["loaded_tokens"] == 0, answer.tierkv
    assert "prefill failed" in proxy.log_tail()
