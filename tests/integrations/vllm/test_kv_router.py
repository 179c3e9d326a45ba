"""The KV-aware router of ``examples/kv_router.py`` end to end: two vLLM API servers, each
on its own tierkv server (not clustered: only routing decides where a prefix is found), with
vLLM's KV events on, and the router subscribed to both streams, all real processes.

A document's first question goes to an instance by load; once that instance's stream has
announced the document's blocks (vLLM's own, medium GPU, and the pool's chunks, medium CPU),
its next questions go there and find the prefix; another document goes to the other
instance, by load, and sticks there too. A text prompt is scored through ``--tokenizer``.
After the instance's own cache is reset (vLLM's ``AllBlocksCleared``), the pool's chunks it
still announces (CPU) keep the document there, and the prefix is loaded from tierkv.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from support.clusterkit import free_ports
from support.httputil import request
from support.servers import ServerProcess
from support.tiny_model import SENTENCES, tokenizer_size
from support.vllm_serve import KVRouter, VllmServer, kv_events_args, tierkv_connector

pytestmark = [pytest.mark.vllm, pytest.mark.processes, pytest.mark.timeout(900)]

BLOCK = 128  # vLLM's CPU block size (its default)
CHUNK = 256  # the servers' chunk size (their default)


@pytest.fixture
def services() -> Iterator[list[Any]]:
    """The services a test started, all stopped (at once: a vLLM API server takes seconds to
    stop) and removed after it."""
    started: list[Any] = []
    yield started

    def stop(service: Any) -> None:
        service.stop()
        shutil.rmtree(service.workdir, ignore_errors=True)

    if started:
        with ThreadPoolExecutor(len(started)) as pool:
            list(pool.map(stop, started))


def ask(router: KVRouter, body: dict[str, Any], path: str = "/v1/completions") -> dict[str, Any]:
    """The answer, with the instance that served it and the prompt tokens it had cached."""
    reply = request(
        "POST",
        router.url + path,
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
        timeout=300.0,
    )
    assert reply.status == 200, reply.body[:500]
    answer: dict[str, Any] = reply.json()
    answer["instance"] = reply.headers["x-kv-router-instance"]
    details = answer["usage"].get("prompt_tokens_details") or {}
    answer["cached"] = details.get("cached_tokens") or 0
    return answer


def wait_announced(
    router: KVRouter, url: str, medium: str, blocks: int, at_most: int | None = None
) -> None:
    """Until the router's index holds ``blocks`` blocks of ``url`` in ``medium`` (and no more
    than ``at_most``)."""
    deadline = time.monotonic() + 60
    while True:
        (held,) = [i["blocks"] for i in router.stats()["instances"] if i["url"] == url]
        count = held.get(medium, 0)
        if count >= blocks and (at_most is None or count <= at_most):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"{url} announced {held}, not {blocks} {medium} blocks")
        time.sleep(0.1)


def test_the_router_sends_a_documents_questions_where_its_prefix_is_held(
    tiny_model: Path,
    server_factory: Callable[..., ServerProcess],
    services: list[Any],
) -> None:
    servers = [server_factory(pool_size="256MiB") for _ in range(2)]
    ports = free_ports(2)
    instances = [
        VllmServer(
            Path(tempfile.mkdtemp(prefix="tierkv-vllm-")),
            tiny_model,
            # Announce the pool's content again often: the test does not wait 30 s.
            tierkv_connector(server.endpoint, kv_events_reannounce_interval=2.0),
            ["--enable-prompt-tokens-details", *kv_events_args(port)],
            {"VLLM_SERVER_DEV_MODE": "1"},  # POST /reset_prefix_cache
        )
        for server, port in zip(servers, ports, strict=True)
    ]
    services.extend(instances)
    with ThreadPoolExecutor(len(instances)) as pool:
        list(pool.map(lambda i: i.start(), instances))
    urls = [i.url for i in instances]
    router = KVRouter(
        Path(tempfile.mkdtemp(prefix="tierkv-router-")),
        [(url, f"tcp://127.0.0.1:{port}") for url, port in zip(urls, ports, strict=True)],
        BLOCK,
        tokenizer=tiny_model,
    )
    services.append(router)
    router.start()
    # Bad input: a clear 400, and the router goes on serving.
    for bad in (b"not json", b"[1, 2]"):
        reply = request("POST", router.url + "/v1/completions", bad, timeout=30.0)
        assert reply.status == 400 and b"JSON object" in reply.body, reply.body

    rng = random.Random(1357)
    vocab = tokenizer_size(tiny_model)
    docs = [[rng.randrange(3, vocab) for _ in range(2 * CHUNK + 40)] for _ in range(2)]

    def question(doc: list[int]) -> dict[str, Any]:
        tail = [rng.randrange(3, vocab) for _ in range(30)]
        return {"model": str(tiny_model), "prompt": doc + tail, "max_tokens": 4}

    first = ask(router, question(docs[0]))
    assert first["cached"] == 0
    home = first["instance"]
    other = next(u for u in urls if u != home)
    # vLLM's own blocks (GPU): 4 full blocks of the document. (The pool's chunks, CPU, may
    # come only with the instance's next step: its stores may commit after its last one.)
    wait_announced(router, home, "GPU", 4)
    again = ask(router, question(docs[0]))
    assert again["instance"] == home and again["cached"] >= 4 * BLOCK, again

    second_doc = ask(router, question(docs[1]))
    assert second_doc["instance"] == other  # by load: home has had two requests
    wait_announced(router, other, "GPU", 4)
    assert ask(router, question(docs[1]))["instance"] == other

    # A text prompt, scored through the tokenizer: its first question goes by load, the
    # next one follows it.
    text = " ".join(rng.choice(" ".join(SENTENCES).split()) for _ in range(700))
    body = {"model": str(tiny_model), "prompt": text, "max_tokens": 4}
    text_home = ask(router, body)["instance"]
    wait_for_blocks = len(router_tokens(tiny_model, text)) // BLOCK
    wait_announced(router, text_home, "GPU", wait_for_blocks)
    assert ask(router, {**body, "prompt": text + " again"})["instance"] == text_home

    # The home instance's own cache reset: vLLM announces AllBlocksCleared with its next step
    # (a request of one block, sent to it directly), and the router drops its GPU blocks. The
    # pool's chunks it still announces (CPU) keep the document there, although the other
    # instance got fewer requests, and the prefix is loaded from its tierkv server.
    (home_instance,) = [i for i in instances if i.url == home]
    reply = request("POST", home + "/reset_prefix_cache", b"", timeout=60.0)
    assert reply.status == 200 and reply.json() == {"success": True}, reply.body
    filler = [rng.randrange(3, vocab) for _ in range(BLOCK + 10)]
    home_instance.post(
        "/v1/completions", {"model": str(tiny_model), "prompt": filler, "max_tokens": 1}
    )
    wait_announced(router, home, "GPU", 1, at_most=1)
    wait_announced(router, home, "CPU", 4)  # announced in the steps since the first question
    reloaded = ask(router, question(docs[0]))
    assert reloaded["instance"] == home, reloaded
    assert reloaded["kv_transfer_params"]["tierkv"]["hit_tokens"] == 2 * CHUNK, reloaded

    stats = {i["url"]: i for i in router.stats()["instances"]}
    assert stats[home]["prefix_routed"] >= 1 and stats[other]["prefix_routed"] >= 1, stats
    assert all(i["sequence_gaps"] == 0 for i in stats.values()), stats


def router_tokens(model: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(str(model)).encode(text))
