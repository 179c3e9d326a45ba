"""The connector's statistics in a real ``vllm serve``'s ``/metrics``: loads, stores and
where each hit came from.

One tierkv server with a disk tier, one vLLM API server with the connector (vLLM's own
prefix caching off, so that every repeat asks tierkv). A prompt of three full chunks and a
partial one is sent three times: the first stores its three chunks; the second loads them
from the pool; then the pool is cleared (the disk tier keeps its copies) and the third loads
them from disk (the server prefetches them into the pool). ``/metrics`` must count exactly
that under tierkv's counters (``vllm:tierkv_*``) and vLLM's own per-source counter.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from support.httputil import Samples, scrape, val, wait_for
from support.servers import ServerProcess
from support.tiny_model import ModelSpec, tokenizer_size
from support.vllm_serve import VllmServer, tierkv_connector
from tierkv.client import Client

pytestmark = [pytest.mark.vllm, pytest.mark.processes, pytest.mark.timeout(900)]

CHUNK = 256  # the server's chunk size (its default)
FULL_CHUNKS = 3
SPEC = ModelSpec()  # the tiny model's shape
# K and V of every layer for a chunk's tokens, float32.
CHUNK_BYTES = (
    SPEC.num_layers * 2 * SPEC.num_kv_heads * (SPEC.hidden_size // SPEC.num_heads) * CHUNK * 4
)


@pytest.fixture
def vllm_server() -> Iterator[Callable[..., VllmServer]]:
    started: list[VllmServer] = []

    def start(*args: Any) -> VllmServer:
        server = VllmServer(Path(tempfile.mkdtemp(prefix="tierkv-vllm-")), *args)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()
        shutil.rmtree(server.workdir, ignore_errors=True)


def tierkv(samples: Samples, name: str, **labels: str) -> float:
    """A counter of the one engine's (vLLM labels every sample with model and engine)."""
    return sum(
        value
        for (sample, sample_labels), value in samples.items()
        if sample == name and set(labels.items()) <= set(sample_labels)
    )


def test_metrics_count_loads_stores_and_where_each_hit_came_from(
    tiny_model: Path,
    server_factory: Callable[..., ServerProcess],
    vllm_server: Callable[..., VllmServer],
    tmp_path: Path,
) -> None:
    srv = server_factory(extra=["--tier", f"disk:path={tmp_path / 'disk'},capacity=256MiB"])
    engine = vllm_server(tiny_model, tierkv_connector(srv.endpoint), ["--no-enable-prefix-caching"])
    rng = random.Random(97)
    vocab = tokenizer_size(tiny_model)
    prompt = [rng.randrange(3, vocab) for _ in range(FULL_CHUNKS * CHUNK + 40)]
    body = {
        "model": str(tiny_model),
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0.0,
        "ignore_eos": True,
    }

    def ask() -> dict[str, Any]:
        report: dict[str, Any] = engine.post("/v1/completions", body)["kv_transfer_params"]
        return report["tierkv"]

    tokens = FULL_CHUNKS * CHUNK
    first = ask()
    assert (first["loaded_tokens"], first["stored_chunks"]) == (0, FULL_CHUNKS)
    second = ask()
    assert second["loaded_tokens"] == tokens  # from the pool
    assert second["hit_sources"] == {"pool": tokens}
    with Client(srv.endpoint) as admin:
        wait_for(
            "the disk tier to hold the chunks",
            lambda: admin.stats().tiers[0].written_chunks == FULL_CHUNKS,
        )
        assert admin.clear() == FULL_CHUNKS  # the disk tier keeps its copies
    third = ask()
    assert third["loaded_tokens"] == tokens  # prefetched from disk into the pool
    assert third["hit_sources"] == {"disk": tokens}

    expected = {
        "vllm:tierkv_stored_chunks_total": FULL_CHUNKS,
        "vllm:tierkv_stored_tokens_total": tokens,
        "vllm:tierkv_stored_bytes_total": FULL_CHUNKS * CHUNK_BYTES,
        "vllm:tierkv_loaded_chunks_total": 2 * FULL_CHUNKS,
        "vllm:tierkv_loaded_tokens_total": 2 * tokens,
        "vllm:tierkv_loaded_bytes_total": 2 * FULL_CHUNKS * CHUNK_BYTES,
        "vllm:tierkv_hit_requests_total": 2,
        "vllm:tierkv_load_failed_blocks_total": 0,
    }
    by_source = {"pool": tokens, "disk": tokens}
    vllm_by_source = {"host": tokens, "disk": tokens, "p2p": 0, "external_unspecified": 0}

    def counted() -> Samples | None:
        # vLLM exports each step's stats as its front-end receives them: poll briefly.
        samples = scrape(engine.url)
        done = all(tierkv(samples, name) == value for name, value in expected.items()) and all(
            tierkv(samples, "vllm:tierkv_hit_tokens_total", source=source) == value
            for source, value in by_source.items()
        )
        return samples if done else None

    samples = wait_for("tierkv's counters in /metrics", counted, timeout=30.0)
    assert tierkv(samples, "vllm:tierkv_load_seconds_total") > 0
    assert tierkv(samples, "vllm:tierkv_store_seconds_total") > 0
    for source, value in vllm_by_source.items():
        name = "vllm:prompt_tokens_cached_by_source_total"
        assert tierkv(samples, name, source=source) == value, (source, samples)
    assert val(samples, "vllm:tierkv_hit_tokens_total") == 0  # always labelled by source
