"""SGLang's real host KV pools and storage configs, built on the CPU, for the SGLang backend
tests and benchmark.

SGLang builds its host pools (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``) from a
description of the device pool's buffers; here those "device" buffers are CPU tensors, which
is all the pools' storage paths touch (get/set of data pages, the page views). The tests run
in the SGLang environment (``.venv-sglang``, ``scripts/install-sglang.sh``): without sglang
every test fails with that message (:func:`require_sglang`), a missing engine must not pass
as a skipped test.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
ALL_LAYOUTS = [("mha", lay) for lay in MHA_LAYOUTS] + [("mla", lay) for lay in MLA_LAYOUTS]


def _installed(name: str) -> bool:
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin is not None


def require_sglang() -> None:
    if not _installed("sglang"):
        pytest.fail(
            "sglang is not installed: the SGLang backend tests run in .venv-sglang "
            "(`make test` creates it with scripts/install-sglang.sh)",
            pytrace=False,
        )


def host_pool(
    kind: str,
    layout: str,
    *,
    layers: int = 4,
    heads: int = 2,
    head_dim: int = 16,
    kv_dim: int = 48,
    page_size: int = 64,
    pages: int = 16,
    dtype: Any = None,
) -> Any:
    """A real SGLang host pool of ``kind`` ("mha"/"mla") and ``layout``, ``pages`` pages of
    ``page_size`` tokens (SGLang adds one padding page)."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import (
        KVBufferLayout,
        KVBuffers,
        MHABufferInfo,
        MLABufferInfo,
    )
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dtype = dtype or torch.bfloat16
    tokens = page_size * pages
    cpu = torch.device("cpu")

    def ptrs(ts: tuple[Any, ...]) -> Any:
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    common = {
        "host_to_device_ratio": 1.0,
        "host_size": 0,
        "page_size": page_size,
        "layout": layout,
        "pin_memory": False,
        "device": "cpu",
        "device_capacity_tokens": tokens,
        "start_layer": 0,
        "end_layer": layers,
    }
    if kind == "mha":
        k = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
        v = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
        buffers = KVBuffers(
            k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD
        )
        info = MHABufferInfo(
            buffers=buffers, page_size=page_size, head_num=heads, head_dim=head_dim,
            v_head_dim=head_dim, dtype=dtype, device=cpu,
        )  # fmt: skip
        return MHATokenToKVPoolHost(info, **common)
    rows = tuple(torch.zeros(tokens, 1, kv_dim, dtype=dtype) for _ in range(layers))
    minfo = MLABufferInfo(
        buffers=rows, data_ptrs=ptrs(rows), layer_indices=tuple(range(layers)),
        device_layer_num=layers, page_size=page_size, kv_lora_rank=kv_dim - 16,
        qk_rope_head_dim=16, kv_cache_dim=kv_dim, dtype=dtype, device=cpu,
    )  # fmt: skip
    return MLATokenToKVPoolHost(minfo, target_layer_num=layers, **common)


def fill_random(pool: Any, seed: int) -> None:
    """Random bytes in the whole host buffer (bf16 values: every bit pattern but NaNs)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    buf = pool.kv_buffer
    buf.copy_(torch.randn(buf.shape, generator=gen, dtype=torch.float32).to(buf.dtype))


def indices(pool: Any, pages: list[int]) -> Any:
    """Host token indices of whole pages (SGLang passes a page's worth per page)."""
    import torch

    ps = pool.page_size
    return torch.tensor([t for p in pages for t in range(p * ps, (p + 1) * ps)], dtype=torch.int64)


def page_bytes(pool: Any, page: int) -> bytes:
    """The bytes of one page, in the pool's flat order."""
    import torch

    flat = pool.get_data_page(page * pool.page_size, flat=True).contiguous()
    return bytes(flat.view(torch.uint8).numpy())


def storage_config(
    extra: dict[str, Any],
    *,
    model: str = "tiny-model",
    mla: bool = False,
    tp_rank: int = 0,
    tp_size: int = 1,
    page_first: bool = False,
) -> Any:
    """SGLang's storage config, as its cache controller builds it, for a dynamic tierkv
    backend with ``extra`` (tierkv's keys) in its extra config."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=True,
        is_page_first_layout=page_first,
        model_name=model,
        extra_config={
            "backend_name": "tierkv",
            "module_path": "tierkv.integrations.sglang",
            "class_name": "TierKVStorage",
            "interface_v1": 1,
            **extra,
        },
    )


def create_backend(config: Any, pool: Any) -> Any:
    """The backend as SGLang's cache controller creates and attaches it: through its own
    factory (``dynamic``), then ``register_mem_pool_host``."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    return backend


def mamba_pool(
    *,
    layers: int = 3,
    slots: int = 16,
    heads: int = 4,
    state_dim: int = 8,
    conv_dim: int = 16,
    conv_width: int = 3,
    side_state: bool = True,
    layout: str = "page_first",
) -> Any:
    """A real SGLang Mamba state host pool (``MambaPoolHost``): per slot an fp32 SSM state,
    a bf16 conv state per layer and (``side_state``) an int32 per-slot side state, so a
    page mixes three dtypes; page size 1 (one slot)."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(
        temporal=torch.zeros(layers, slots, heads, state_dim, state_dim, dtype=torch.float32),
        conv=(torch.zeros(layers, slots, conv_dim, conv_width, dtype=torch.bfloat16),),
        extra_checkpoint_buffers=(
            (torch.zeros(slots, 6, dtype=torch.int32),) if side_state else ()
        ),
    )
    return MambaPoolHost(
        info, 1.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout=layout
    )


def fill_random_mamba(pool: Any, seed: int) -> None:
    """Random values in every state buffer of a Mamba host pool."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for buf in pool.get_hybrid_pool_buffer():
        if buf.dtype.is_floating_point:
            buf.copy_(torch.randn(buf.shape, generator=gen, dtype=torch.float32).to(buf.dtype))
        else:
            buf.copy_(torch.randint(-(2**30), 2**30, buf.shape, generator=gen, dtype=buf.dtype))


def slot_bytes(pool: Any, slot: int) -> bytes:
    """The bytes of one slot (page) of a flat-page pool, in SGLang's flat order."""
    import torch

    return bytes(pool.get_data_page(slot, flat=True).contiguous().view(torch.uint8).numpy())


def slots(pool_slots: list[int]) -> Any:
    """Host indices of Mamba slots (page size 1)."""
    import torch

    return torch.tensor(pool_slots, dtype=torch.int64)


def single_rank() -> Any:
    """A context in which SGLang's cache controller can be built outside a launched engine:
    the parallel widths a launcher would publish, for one rank (no TP, PP or DCP)."""
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().override(
        attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False, tp_rank=0, tp_size=1, pp_rank=0,
        pp_size=1,
    )  # fmt: skip


def hybrid_controller(extra: dict[str, Any], *, page_size: int = 16, pages: int = 32) -> Any:
    """SGLang's real ``HybridCacheController`` on the CPU over a real device KV pool
    (``MHATokenToKVPool``), its allocator, the host KV pool built from the device pool's
    buffers and a Mamba state host pool, with the tierkv backend (``extra``: tierkv's keys)
    attached as SGLang attaches a dynamic backend. Call inside :func:`single_rank`."""
    import threading

    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    tokens = page_size * pages
    device = MHATokenToKVPool(
        tokens, page_size, torch.bfloat16, 2, 16, 4, device="cpu", enable_memory_saver=False
    )
    allocator = PagedTokenToKVPoolAllocator(
        tokens, page_size, torch.bfloat16, "cpu", device, need_sort=False
    )
    kv = MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, "page_first",
        pin_memory=False, device="cpu", device_capacity_tokens=tokens, start_layer=0,
        end_layer=4,
    )  # fmt: skip
    group = HostPoolGroup(
        [
            PoolEntry(PoolName.KV, kv, device, lambda layer: layer, is_primary_index_anchor=True),
            PoolEntry(PoolName.MAMBA, mamba_pool(), None, lambda layer: None),
        ]
    )
    config = {
        "backend_name": "tierkv",
        "module_path": "tierkv.integrations.sglang",
        "class_name": "TierKVStorage",
        "interface_v1": 1,
        **extra,
    }
    return HybridCacheController(
        allocator, group, page_size, tp_group=None, load_cache_event=threading.Event(),
        io_backend="direct", storage_backend="dynamic", model_name="tiny-hybrid",
        storage_backend_extra_config=config,
    )  # fmt: skip


def dsa_pools(layout: str = "page_first", *, page_size: int = 64, pages: int = 8) -> Any:
    """A real DeepSeek sparse-attention pair: the MLA host KV pool and its DSA indexer
    host pool (``DSAIndexerPoolHost``, uint8 index keys with their scales, on the KV pool's
    host indices), both built from a real CPU ``DSATokenToKVPool``. Call inside
    :func:`single_rank`."""
    import torch
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost, make_dsa_indexer_pool_decl
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    tokens = page_size * pages
    device = DSATokenToKVPool(
        tokens, page_size, 32, torch.bfloat16, 16, 2, "cpu", index_head_dim=128,
        enable_memory_saver=False, kv_cache_dim=48,
    )  # fmt: skip
    kv = MLATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, layout,
        pin_memory=False, device="cpu", device_capacity_tokens=tokens, start_layer=0,
        end_layer=2, target_layer_num=2,
    )  # fmt: skip
    indexer = DSAIndexerPoolHost(
        make_dsa_indexer_pool_decl(device), kv, pin_memory=False, device="cpu"
    )
    return kv, indexer
