"""The vLLM connector's copies between a KV cache on a GPU and pool memory (host).

Needs torch with a CUDA device (it exits with a message otherwise); no vLLM, no server: it
builds per-layer caches shaped as vLLM's GPU backends hand them to the connector
(``[blocks, kv_heads, block_size, 2 * head_size]``, FlashAttention's split-last layout) and
runs the connector's own layout code (:mod:`tierkv.integrations.vllm.layout`) on them.

For chunks of 256 tokens of a Llama-3-8B-shaped cache (32 layers, 8 KV heads of 128,
bfloat16: 32 MiB a chunk) in vLLM's GPU block size (16), it measures:

- gather (store: paged blocks on the GPU -> chunk in host memory) and scatter (load: chunk
  -> paged blocks), each with one copy per block straight between the blocks and host memory
  (how the connector copied before) and as the connector copies now (a whole chunk's blocks
  gathered on the device, by runs of consecutive blocks, into a staging buffer that crosses
  in one contiguous copy);
- the bound: one ``copy_`` of a contiguous GPU tensor of the same bytes to and from the
  same host memory, pageable (as the pool's shared memory is without ``page_lock_pool``)
  and page-locked by the connector's own :func:`~tierkv.integrations.vllm.pinning.page_lock`
  (with it), and the copies themselves into that page-locked memory.

Every copy is checked, bit for bit, against the host path's copies of the same caches. Last
line:
``gpu_copies gather_vs_copy=A scatter_vs_copy=B gather_vs_per_block=C
scatter_vs_per_block=D`` (against the pageable bound, and against the copies before).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

LAYERS, HEADS, HEAD, BLOCK, CHUNK = 32, 8, 128, 16, 256
CHUNKS = 16  # 512 MiB moved per measurement
REPEATS = 5


def main() -> None:
    import torch

    from tierkv.integrations.vllm.layout import CacheGeometry, detect_layout
    from tierkv.integrations.vllm.pinning import page_lock

    if not torch.cuda.is_available():
        print("gpu_copies: no CUDA device here; nothing measured")
        return
    dev = torch.device("cuda")
    bpc = CHUNK // BLOCK
    blocks = 4 * CHUNKS * bpc  # the chunks' blocks are a quarter of the cache
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.randint(
            -1000, 1000, (blocks, HEADS, BLOCK, 2 * HEAD), dtype=torch.int16, device=dev
        ).view(torch.bfloat16)
        for i in range(LAYERS)
    }
    layout = detect_layout(
        caches, CacheGeometry(BLOCK, HEADS, HEAD), dict.fromkeys(caches, "FLASH_ATTN")
    )
    shape = layout.chunk_shape(CHUNK)
    host = np.zeros((CHUNKS, *shape), np.int16)  # pageable, as the pool's memory is
    chunks = [layout.chunk_tensor(host[c]) for c in range(CHUNKS)]
    nbytes = host.nbytes
    plans = [[(j, (4 * c + 1) * bpc + j) for j in range(bpc)] for c in range(CHUNKS)]

    def timed(fn: Any) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return nbytes / (time.perf_counter() - t0) / 1e9

    def gather(per_block: bool) -> None:
        for plan, chunk in zip(plans, chunks, strict=True):
            for part in [[p] for p in plan] if per_block else [plan]:
                layout.read_blocks(part, chunk)

    def scatter(per_block: bool) -> None:
        for plan, chunk in zip(plans, chunks, strict=True):
            for part in [[p] for p in plan] if per_block else [plan]:
                layout.write_blocks(part, chunk)

    # Correctness first, against the same copies by the host path (numpy, caches copied to
    # host memory): bits, since random int16 patterns include bfloat16 NaNs.
    cpu_caches = {n: t.cpu() for n, t in caches.items()}
    reference = detect_layout(
        cpu_caches, CacheGeometry(BLOCK, HEADS, HEAD), dict.fromkeys(caches, "FLASH_ATTN")
    )
    expected = np.zeros_like(host)
    for c, plan in enumerate(plans):
        reference.read_blocks(plan, reference.chunk_tensor(expected[c]))
    for per_block in (True, False):
        host[:] = 0
        gather(per_block)
        assert np.array_equal(host, expected), f"gather differs (per block: {per_block})"
    host[:] = np.random.default_rng(1).integers(-1000, 1000, host.shape, dtype=np.int16)
    for t in cpu_caches.values():
        t.zero_()
    for c, plan in enumerate(plans):
        reference.write_blocks(plan, reference.chunk_tensor(host[c]))
    bits = torch.int16
    for per_block in (True, False):
        for t in caches.values():
            t.zero_()
        scatter(per_block)
        assert all(
            torch.equal(caches[n].cpu().view(bits), cpu_caches[n].view(bits)) for n in caches
        ), f"scatter differs (per block: {per_block})"
    del cpu_caches, reference

    flat = torch.from_numpy(host.reshape(-1))
    gpu = torch.empty(flat.shape, dtype=flat.dtype, device=dev)
    results: dict[str, list[float]] = {}
    for _ in range(REPEATS):
        for name, fn in {
            "gather_blocks": lambda: gather(True),
            "gather": lambda: gather(False),
            "scatter_blocks": lambda: scatter(True),
            "scatter": lambda: scatter(False),
            "d2h_pageable": lambda: flat.copy_(gpu),
            "h2d_pageable": lambda: gpu.copy_(flat),
        }.items():
            results.setdefault(name, []).append(timed(fn))
    # The host memory page-locked as the connector does it with the pool (page_lock_pool).
    started = time.perf_counter()
    unlock = page_lock(memoryview(host.reshape(-1)), dev)
    lock_seconds = time.perf_counter() - started
    if unlock is not None:
        for _ in range(REPEATS):
            results.setdefault("d2h_pinned", []).append(timed(lambda: flat.copy_(gpu)))
            results.setdefault("h2d_pinned", []).append(timed(lambda: gpu.copy_(flat)))
            results.setdefault("gather_pinned", []).append(timed(lambda: gather(False)))
            results.setdefault("scatter_pinned", []).append(timed(lambda: scatter(False)))
        unlock()
        print(f"page_lock of {nbytes >> 20} MiB: {lock_seconds * 1e3:.0f} ms")
    med = {k: float(np.median(v)) for k, v in results.items()}
    print(
        f"{torch.cuda.get_device_name()}: {CHUNKS} chunks of {nbytes // CHUNKS >> 20} MiB "
        f"({LAYERS} layers, {HEADS} KV heads x {HEAD}, bf16, {bpc} blocks of {BLOCK} a chunk)"
    )
    for k, v in med.items():
        spread = f"{min(results[k]):.1f}-{max(results[k]):.1f}"
        print(f"  {k:22s} {v:6.1f} GB/s (median of {REPEATS}: {spread})")
    print(
        f"gpu_copies gather_vs_copy={med['gather'] / med['d2h_pageable']:.2f} "
        f"scatter_vs_copy={med['scatter'] / med['h2d_pageable']:.2f} "
        f"gather_vs_per_block={med['gather'] / med['gather_blocks']:.2f} "
        f"scatter_vs_per_block={med['scatter'] / med['scatter_blocks']:.2f}"
    )


if __name__ == "__main__":
    main()
