"""The vLLM connector's copies between a KV cache on a GPU and pool memory (host).

Needs torch with a CUDA device (it exits with a message otherwise; ``--device cpu --small``
runs the same checks on host memory, to try the script itself); no vLLM, no server: it
builds per-layer caches shaped as vLLM's GPU backends hand them to the connector and runs
the connector's own layout code (:mod:`tierkv.integrations.vllm.layout`) on them, for three
kinds of cache, in chunks of 256 tokens:

- ``llama``: Llama-3-8B's shape (32 layers, 8 KV heads of 128, bfloat16, blocks of 16:
  32 MiB a chunk), FlashAttention's ``[blocks, kv_heads, block_size, 2 * head_size]``, one
  tensor per layer;
- ``mla``: DeepSeek-V3's latent cache (61 layers, one latent of 576 per token, bfloat16:
  18 MiB a chunk) as FlashMLA hands it, ``[blocks, 64, 576]``, blocks of 64 tokens;
- ``hybrid``: vLLM's hybrid allocator with four KV cache groups (one full-attention and
  three sliding-window groups of eight layers, Llama's layer shape: 32 MiB a chunk): every
  tensor is shared by one layer of each group, a block id belongs to one group, and a load
  gives the sliding groups vLLM's null block (0) for the positions behind their window,
  which must be neither read nor written.

For each kind it measures gather (store: paged blocks on the GPU -> chunk in host memory)
and scatter (load: chunk -> paged blocks) as the connector copies (a whole chunk's blocks
gathered on the device, by runs of consecutive blocks, into a staging buffer that crosses in
one contiguous copy), and the bound: one ``copy_`` of a contiguous GPU tensor of the same
bytes to and from the same host memory, pageable (as the pool's shared memory is without
``page_lock_pool``) and page-locked by the connector's own
:func:`~tierkv.integrations.vllm.pinning.page_lock` (with it), and the copies themselves into
that page-locked memory. For ``llama`` also the copies before the staging buffer (one per
block, straight between the blocks and host memory).

Every copy is first checked, bit for bit, against the host path's copies of the same caches
(the connector's copies when vLLM runs on the CPU): gathers of consecutive and scattered
block ids, scatters including null blocks, and the whole cache compared after a scatter (a
block the plan does not name, the null block included, must not change). Last lines, one
per kind and a summary:
``gpu_copies[KIND] gather_vs_copy=A scatter_vs_copy=B`` (against the pageable bound) and
``gpu_copies kinds=3 bit_exact=3 state_exact=1 min_gather_vs_copy=A min_scatter_vs_copy=B``
(``state_exact``: a hybrid's state layers, raw byte pages as vLLM hands a gated-DeltaNet or
Mamba layer over, copied to and from pool memory bit for bit, pieces spanning layers).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

CHUNK = 256  # tokens a chunk
REPEATS = 5
Plan = list[tuple[int, Any]]  # (block position in the chunk, block id or one id per group)


@dataclass
class Case:
    """One kind of KV cache: its tensors, as vLLM hands them, and the copies to run."""

    name: str
    summary: str
    caches: dict[str, Any]  # layer name -> tensor on the device
    backend: str
    geometry: Any  # CacheGeometry
    groups: dict[str, int] | None
    stores: list[Plan]  # per chunk: blocks gathered into it (what a store copies)
    loads: list[Plan]  # per chunk: blocks it is scattered into (null blocks where a load has)
    per_block: bool  # also time the copies before the staging buffer (one per block)


def random_bf16(shape: tuple[int, ...], device: Any, seed: int) -> Any:
    """Random bit patterns as bfloat16 (NaNs included: checks compare bits)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    bits = torch.randint(-32768, 32767, shape, dtype=torch.int16, device=device, generator=gen)
    return bits.view(torch.bfloat16)


def llama(device: Any, chunks: int, layers: int) -> Case:
    from tierkv.integrations.vllm.layout import CacheGeometry

    heads, head, block = 8, 128, 16
    bpc = CHUNK // block
    blocks = 4 * chunks * bpc  # the chunks' blocks are a quarter of the cache
    caches = {
        f"model.layers.{i}.self_attn.attn": random_bf16((blocks, heads, block, 2 * head), device, i)
        for i in range(layers)
    }
    stores = [[(j, (4 * c + 1) * bpc + j) for j in range(bpc)] for c in range(chunks)]
    loads = [[(j, (4 * c + 2) * bpc + j) for j in range(bpc)] for c in range(chunks)]
    return Case(
        "llama", f"{layers} layers, {heads} KV heads x {head}, bf16, blocks of {block}, "
        "FlashAttention", caches, "FLASH_ATTN", CacheGeometry(block, heads, head), None,
        stores, loads, per_block=True,
    )  # fmt: skip


def mla(device: Any, chunks: int, layers: int) -> Case:
    from tierkv.integrations.vllm.layout import CacheGeometry

    latent, block = 576, 64  # kv_lora_rank 512 + qk_rope_head_dim 64; FlashMLA's blocks
    bpc = CHUNK // block
    blocks = 4 * chunks * bpc
    caches = {
        f"model.layers.{i}.self_attn.attn": random_bf16((blocks, block, latent), device, 100 + i)
        for i in range(layers)
    }
    stores = [[(j, (4 * c + 1) * bpc + j) for j in range(bpc)] for c in range(chunks)]
    loads = [[(j, (4 * c + 3) * bpc + j) for j in range(bpc)] for c in range(chunks)]
    return Case(
        "mla", f"{layers} layers, one latent of {latent} a token, bf16, blocks of {block}, "
        "FlashMLA", caches, "FLASHMLA", CacheGeometry(block, 1, latent, latent=True), None,
        stores, loads, per_block=False,
    )  # fmt: skip


def hybrid(device: Any, chunks: int, layers: int) -> Case:
    from tierkv.integrations.vllm.layout import CacheGeometry

    groups, heads, head, block = 4, 8, 128, 16
    per_group = layers // groups
    bpc = CHUNK // block
    region = groups * chunks * bpc  # one region for the stores' blocks, one for the loads'
    blocks = 1 + 2 * region  # block 0: vLLM's null block
    caches: dict[str, Any] = {}
    group_of: dict[str, int] = {}
    for i in range(per_group):
        shared = random_bf16((blocks, heads, block, 2 * head), device, 200 + i)
        for g in range(groups):  # group 0: full attention; 1-3: sliding windows
            name = f"model.layers.{groups * i + g}.self_attn.attn"
            caches[name], group_of[name] = shared, g

    def ref(c: int, j: int, base: int, behind_window: bool) -> tuple[int, ...]:
        return tuple(
            0 if g and behind_window else base + (g * chunks + c) * bpc + j for g in range(groups)
        )

    stores = [[(j, ref(c, j, 1, False)) for j in range(bpc)] for c in range(chunks)]
    loads = [[(j, ref(c, j, 1 + region, j < bpc // 2)) for j in range(bpc)]
             for c in range(chunks)]  # fmt: skip
    return Case(
        "hybrid", f"{groups} KV cache groups (1 full, {groups - 1} sliding) of {per_group} "
        f"layers sharing {per_group} tensors, {heads} KV heads x {head}, bf16, blocks of "
        f"{block}, FlashAttention", caches, "FLASH_ATTN", CacheGeometry(block, heads, head),
        group_of, stores, loads, per_block=False,
    )  # fmt: skip


def check_bits(case: Case, device: Any) -> None:
    """The device copies equal the host path's copies of the same caches, bit for bit."""
    import torch

    from tierkv.integrations.vllm.layout import detect_layout

    def layout_of(caches: dict[str, Any]) -> Any:
        return detect_layout(
            caches, case.geometry, dict.fromkeys(caches, case.backend), groups=case.groups
        )

    on_device = layout_of(case.caches)
    host_caches = _host_copies(case.caches)
    reference = layout_of(host_caches)
    bits = torch.int16
    shape = on_device.chunk_shape(CHUNK)
    scrambled = [list(reversed(case.stores[0])), case.stores[0][1::2] + case.stores[-1][::2]]
    scrambled = [[(j, b) for j, (_, b) in enumerate(p)] for p in scrambled]
    for name, plan in [("consecutive", case.stores[0]), ("last", case.stores[-1])] + [
        (f"scrambled {k}", p) for k, p in enumerate(scrambled)
    ]:
        got = torch.zeros(shape, dtype=torch.bfloat16)
        want = torch.zeros(shape, dtype=torch.bfloat16)
        on_device.read_blocks(plan, got)
        reference.read_blocks(plan, want)
        assert want.view(bits).any(), f"{case.name}: the {name} gather read nothing"
        assert torch.equal(got.view(bits), want.view(bits)), f"{case.name}: {name} gather differs"
    source = random_bf16(tuple(shape), torch.device("cpu"), 7)
    for name, plan in [("load", case.loads[0]), ("load last", case.loads[-1])] + [
        (f"scrambled {k}", p) for k, p in enumerate(scrambled)
    ]:
        on_device.write_blocks(plan, source)
        reference.write_blocks(plan, source)
        for layer in case.caches:
            assert torch.equal(
                case.caches[layer].cpu().view(bits), host_caches[layer].view(bits)
            ), f"{case.name}: {name} scatter differs ({layer})"
    if case.groups is not None:  # the null block: never written
        null_before = {n: t[0].clone() for n, t in _host_copies(case.caches).items()}
        on_device.write_blocks(case.loads[1], random_bf16(tuple(shape), torch.device("cpu"), 8))
        for n, t in case.caches.items():
            assert torch.equal(t[0].cpu().view(bits), null_before[n].view(bits)), n
    del host_caches, reference


def check_state(device: Any, layers: int) -> None:
    """A hybrid's state layers (:class:`~tierkv.integrations.vllm.state.StateLayout`: raw
    byte pages per block, as vLLM hands a Mamba/GDN layer over) copied to and from pool
    memory on the device: pieces that span layers gathered and scattered as on the host,
    bit for bit, and pages not named left as they were."""
    import torch

    from tierkv.integrations.vllm.state import StateFormat, StateLayout

    blocks, page, state = 8, 1 << 20, 3 * (1 << 18) + 1000  # a state: most of its page, odd
    names = tuple(f"model.layers.{i}.linear_attn" for i in range(layers))
    fmt = StateFormat(names, (1,) * layers, layer_bytes=state, piece_bytes=2 << 20, signature=b"s")
    gen = torch.Generator(device=device).manual_seed(9)
    pages = {
        n: torch.randint(-128, 127, (blocks, page), dtype=torch.int8, device=device, generator=gen)
        for n in names
    }
    host_pages = _host_copies(pages)
    on_device, reference = StateLayout(fmt, pages), StateLayout(fmt, host_pages)
    at, into = [i % blocks for i in range(layers)], [(i + 3) % blocks for i in range(layers)]
    for piece in range(fmt.pieces):
        got = np.full(fmt.piece_bytes, 0xAA, np.uint8)
        want = np.full(fmt.piece_bytes, 0x55, np.uint8)
        on_device.gather(piece, at, got)
        reference.gather(piece, at, want)
        assert np.array_equal(got, want), f"state: piece {piece} gather differs"
    source = np.random.default_rng(10).integers(0, 256, (fmt.pieces, fmt.piece_bytes), np.uint8)
    for piece in range(fmt.pieces):
        on_device.scatter(piece, into, source[piece])
        reference.scatter(piece, into, source[piece])
    for n in names:
        assert torch.equal(pages[n].cpu(), host_pages[n]), f"state: scatter differs ({n})"
    print(f"state: {layers} layers of {state} bytes in {fmt.pieces} pieces, bit-exact")


def _host_copies(caches: dict[str, Any]) -> dict[str, Any]:
    """Copies in host memory, tensors shared between layers still shared."""
    copies: dict[int, Any] = {}
    return {n: copies.setdefault(id(t), t.cpu().clone()) for n, t in caches.items()}


def measure(case: Case, device: Any) -> tuple[dict[str, list[float]], int]:
    import torch

    from tierkv.integrations.vllm.layout import detect_layout
    from tierkv.integrations.vllm.pinning import page_lock

    layout = detect_layout(
        case.caches, case.geometry, dict.fromkeys(case.caches, case.backend), groups=case.groups
    )
    shape = layout.chunk_shape(CHUNK)
    host = np.zeros((len(case.stores), *shape), np.int16)  # pageable, as the pool's memory is
    chunks = [layout.chunk_tensor(host[c]) for c in range(len(case.stores))]
    nbytes = host.nbytes
    cuda = device.type == "cuda"

    def timed(fn: Callable[[], Any]) -> float:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        return nbytes / (time.perf_counter() - t0) / 1e9

    def copies(per_block: bool, gather: bool) -> None:
        for plan, chunk in zip(case.stores, chunks, strict=True):
            for part in [[p] for p in plan] if per_block else [plan]:
                (layout.read_blocks if gather else layout.write_blocks)(part, chunk)

    flat = torch.from_numpy(host.reshape(-1))
    contiguous = torch.empty(flat.shape, dtype=flat.dtype, device=device)
    runs: dict[str, Callable[[], Any]] = {
        "gather": lambda: copies(False, True),
        "scatter": lambda: copies(False, False),
        "d2h_pageable": lambda: flat.copy_(contiguous),
        "h2d_pageable": lambda: contiguous.copy_(flat),
    }
    if case.per_block:
        runs["gather_blocks"] = lambda: copies(True, True)
        runs["scatter_blocks"] = lambda: copies(True, False)
    results: dict[str, list[float]] = {}
    for _ in range(REPEATS):
        for name, fn in runs.items():
            results.setdefault(name, []).append(timed(fn))
    # The host memory page-locked as the connector does it with the pool (page_lock_pool).
    started = time.perf_counter()
    unlock = page_lock(host.reshape(-1).data, device)
    lock_seconds = time.perf_counter() - started
    if unlock is not None:
        for _ in range(REPEATS):
            results.setdefault("d2h_pinned", []).append(timed(lambda: flat.copy_(contiguous)))
            results.setdefault("h2d_pinned", []).append(timed(lambda: contiguous.copy_(flat)))
            results.setdefault("gather_pinned", []).append(timed(runs["gather"]))
            results.setdefault("scatter_pinned", []).append(timed(runs["scatter"]))
        unlock()
        print(f"  page_lock of {nbytes >> 20} MiB: {lock_seconds * 1e3:.0f} ms")
    return results, nbytes


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run)")
    parser.add_argument("--small", action="store_true", help="4 chunks and 4 or 8 layers")
    parser.add_argument("--kinds", default="llama,mla,hybrid")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_copies: no CUDA device here; nothing measured")
        return
    device = torch.device(args.device)
    chunks = 4 if args.small else 16
    builders = {"llama": (llama, 32), "mla": (mla, 61), "hybrid": (hybrid, 32)}
    kinds = [k for k in args.kinds.split(",") if k]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "host memory"
    ratios: dict[str, tuple[float, float]] = {}
    exact = 0
    for kind in kinds:
        build, layers = builders[kind]
        case = build(device, chunks, 8 if args.small else layers)
        check_bits(case, device)
        exact += 1
        results, nbytes = measure(case, device)
        med = {k: float(np.median(v)) for k, v in results.items()}
        print(f"{kind} on {name}: {case.summary}; {chunks} chunks of {nbytes // chunks >> 20} "
              f"MiB, bit-exact against the host path")  # fmt: skip
        for k, v in med.items():
            spread = f"{min(results[k]):.1f}-{max(results[k]):.1f}"
            print(f"  {k:22s} {v:6.1f} GB/s (median of {REPEATS}: {spread})")
        ratios[kind] = (med["gather"] / med["d2h_pageable"], med["scatter"] / med["h2d_pageable"])
        extra = ""
        if case.per_block:
            extra = (
                f" gather_vs_per_block={med['gather'] / med['gather_blocks']:.2f}"
                f" scatter_vs_per_block={med['scatter'] / med['scatter_blocks']:.2f}"
            )
        if "gather_pinned" in med:
            extra += (
                f" pinned_gather_vs_copy={med['gather_pinned'] / med['d2h_pinned']:.2f}"
                f" pinned_scatter_vs_copy={med['scatter_pinned'] / med['h2d_pinned']:.2f}"
            )
        print(f"gpu_copies[{kind}] gather_vs_copy={ratios[kind][0]:.2f} "
              f"scatter_vs_copy={ratios[kind][1]:.2f}{extra}")  # fmt: skip
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
    check_state(device, 4 if args.small else 36)
    print(
        f"gpu_copies kinds={len(kinds)} bit_exact={exact} state_exact=1 "
        f"min_gather_vs_copy={min(r[0] for r in ratios.values()):.2f} "
        f"min_scatter_vs_copy={min(r[1] for r in ratios.values()):.2f}"
    )


if __name__ == "__main__":
    main()
