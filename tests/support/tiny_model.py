"""Build small random-weight models locally, for tests and benchmarks: Llama (full
attention), DeepSeek-V2 (multi-head latent attention, MLA), Gemma-3 and gpt-oss
(sliding-window and full-attention layers; gpt-oss's with attention sinks and experts), and
hybrids with state layers: Nemotron-H (Mamba-2) and
Qwen3-Next (gated DeltaNet, GDN).

Nothing is downloaded: the weights come from a transformers config, the tokenizer
is a byte-level BPE trained with the ``tokenizers`` library on a few sentences. Both are
saved with ``save_pretrained`` into a directory that vLLM loads like any checkpoint.

Weights are drawn with a large initializer range so that the logits are far apart: greedy
decoding then picks the same tokens even when two runs differ in the last bits of their
floating-point sums (a cached prefix is computed in another batch shape than a fresh one).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a cache keeps what was computed so that it need not be computed again",
    "prefill is the expensive part of a long prompt",
    "engines store and retrieve chunks of attention state through shared memory",
    "one server per node owns the pool and every engine copies straight into it",
]


@dataclass(frozen=True)
class ModelSpec:
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    initializer_range: float = 0.2
    torch_dtype: str = "float32"
    seed: int = 0


def build_model(out_dir: str | Path, spec: ModelSpec | None = None) -> Path:
    """Write a random-weight Llama model and its tokenizer to ``out_dir`` (reused when the
    directory already holds a model built from the same spec)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = spec or ModelSpec()
    return _build(
        out_dir,
        asdict(spec),
        spec.seed,
        lambda: LlamaForCausalLM(
            LlamaConfig(
                num_hidden_layers=spec.num_layers,
                num_attention_heads=spec.num_heads,
                num_key_value_heads=spec.num_kv_heads,
                **_shared(spec),
            )
        ),
    )


@dataclass(frozen=True)
class MLAModelSpec:
    """A DeepSeek-V2-style model with multi-head latent attention (MLA), all layers dense
    (no experts). vLLM's CPU MLA decode kernel needs ``kv_lora_rank=512`` and
    ``qk_rope_head_dim=64``: a 576-value latent per token and layer."""

    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    q_lora_rank: int = 128
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 64
    v_head_dim: int = 64
    intermediate_size: int = 512
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    initializer_range: float = 0.2
    torch_dtype: str = "float32"
    seed: int = 0


def build_mla_model(out_dir: str | Path, spec: MLAModelSpec | None = None) -> Path:
    """Write a random-weight DeepSeek-V2 (MLA) model and its tokenizer to ``out_dir`` (reused
    when the directory already holds a model built from the same spec)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    spec = spec or MLAModelSpec()
    return _build(
        out_dir,
        asdict(spec),
        spec.seed,
        lambda: DeepseekV2ForCausalLM(
            DeepseekV2Config(
                num_hidden_layers=spec.num_layers,
                num_attention_heads=spec.num_heads,
                num_key_value_heads=spec.num_heads,
                q_lora_rank=spec.q_lora_rank,
                kv_lora_rank=spec.kv_lora_rank,
                qk_nope_head_dim=spec.qk_nope_head_dim,
                qk_rope_head_dim=spec.qk_rope_head_dim,
                v_head_dim=spec.v_head_dim,
                first_k_dense_replace=spec.num_layers,  # every layer dense: no experts
                n_routed_experts=4,  # unused: every layer is dense
                n_shared_experts=1,
                num_experts_per_tok=2,
                moe_intermediate_size=64,
                **_shared(spec),
            )
        ),
    )


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles: vLLM then runs MLA models with its AMX_MLA backend
    (bfloat16 only), which keeps vLLM's own prefix caching on and so lets the connector load
    MLA prefixes; elsewhere vLLM's reference CPU_MLA backend turns both off."""
    with open("/proc/cpuinfo") as fh:
        return "amx_tile" in fh.read().split()


@dataclass(frozen=True)
class SlidingModelSpec:
    """A Gemma-3-style model: ``sliding_per_full`` sliding-window layers (window of
    ``sliding_window`` tokens) before each full-attention layer."""

    hidden_size: int = 256
    num_layers: int = 4
    sliding_per_full: int = 3
    sliding_window: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    initializer_range: float = 0.2
    torch_dtype: str = "float32"
    seed: int = 0


def build_sliding_model(out_dir: str | Path, spec: SlidingModelSpec | None = None) -> Path:
    """Write a random-weight Gemma-3 text model (sliding-window and full-attention layers)
    and its tokenizer to ``out_dir`` (reused when it already holds the same spec)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    spec = spec or SlidingModelSpec()
    period = spec.sliding_per_full + 1
    layer_types = [
        "full_attention" if (i + 1) % period == 0 else "sliding_attention"
        for i in range(spec.num_layers)
    ]
    return _build(
        out_dir,
        asdict(spec),
        spec.seed,
        lambda: Gemma3ForCausalLM(
            Gemma3TextConfig(
                num_hidden_layers=spec.num_layers,
                num_attention_heads=spec.num_heads,
                num_key_value_heads=spec.num_kv_heads,
                head_dim=spec.head_dim,
                sliding_window=spec.sliding_window,
                layer_types=layer_types,
                pad_token_id=0,
                **_shared(spec),
            )
        ),
    )


@dataclass(frozen=True)
class GptOssSpec:
    """A gpt-oss-style model: sliding-window (``sliding_window`` tokens) and full-attention
    layers alternating, each with attention sinks and a mixture of ``num_experts`` experts
    (``experts_per_token`` per token), unquantized."""

    hidden_size: int = 256
    num_layers: int = 4
    sliding_window: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    num_experts: int = 4
    experts_per_token: int = 2
    intermediate_size: int = 256
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    initializer_range: float = 0.2
    torch_dtype: str = "float32"
    seed: int = 0


def build_gpt_oss_model(out_dir: str | Path, spec: GptOssSpec | None = None) -> Path:
    """Write a random-weight gpt-oss model and its tokenizer to ``out_dir`` (reused when it
    already holds the same spec)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    spec = spec or GptOssSpec()
    layer_types = ["sliding_attention", "full_attention"] * (spec.num_layers // 2)
    return _build(
        out_dir,
        asdict(spec),
        spec.seed,
        lambda: GptOssForCausalLM(
            GptOssConfig(
                num_hidden_layers=spec.num_layers,
                num_attention_heads=spec.num_heads,
                num_key_value_heads=spec.num_kv_heads,
                head_dim=spec.head_dim,
                sliding_window=spec.sliding_window,
                layer_types=layer_types,
                num_local_experts=spec.num_experts,
                num_experts_per_tok=spec.experts_per_token,
                **_shared(spec),
            )
        ),
    )


@dataclass(frozen=True)
class MambaHybridSpec:
    """A Nemotron-H-style hybrid: Mamba-2 state layers, one full-attention layer and MLP
    layers (``pattern``: ``M`` Mamba-2, ``*`` attention, ``-`` MLP, Nemotron-H's notation)."""

    hidden_size: int = 256
    pattern: str = "M-*-M-"
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    mamba_num_heads: int = 8
    mamba_head_dim: int = 32
    ssm_state_size: int = 16
    n_groups: int = 1
    intermediate_size: int = 512
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    initializer_range: float = 0.2
    torch_dtype: str = "float32"
    seed: int = 0


def build_mamba_hybrid_model(out_dir: str | Path, spec: MambaHybridSpec | None = None) -> Path:
    """Write a random-weight Nemotron-H (Mamba-2 hybrid) model and its tokenizer to
    ``out_dir`` (reused when it already holds the same spec)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    spec = spec or MambaHybridSpec()
    return _build(
        out_dir,
        asdict(spec),
        spec.seed,
        lambda: NemotronHForCausalLM(
            NemotronHConfig(
                hybrid_override_pattern=spec.pattern,
                num_hidden_layers=len(spec.pattern),
                num_attention_heads=spec.num_heads,
                num_key_value_heads=spec.num_kv_heads,
                head_dim=spec.head_dim,
                mamba_num_heads=spec.mamba_num_heads,
                mamba_head_dim=spec.mamba_head_dim,
                ssm_state_size=spec.ssm_state_size,
                n_groups=spec.n_groups,
                pad_token_id=0,
                **_shared(spec),
            )
        ),
    )


@dataclass(frozen=True)
class GDNHybridSpec:
    """A Qwen3-Next-style hybrid: gated DeltaNet (GDN) linear-attention layers and a
    full-attention layer every ``full_attention_interval`` layers; a few small experts per
    layer (vLLM's Qwen3-Next needs at least one mixture-of-experts layer)."""

    hidden_size: int = 256
    num_layers: int = 4
    full_attention_interval: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    intermediate_size: int = 512
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    initializer_range: float = 0.2
    torch_dtype: str = "bfloat16"
    seed: int = 0


def build_gdn_hybrid_model(out_dir: str | Path, spec: GDNHybridSpec | None = None) -> Path:
    """Write a random-weight Qwen3-Next (GDN hybrid) model and its tokenizer to ``out_dir``
    (reused when it already holds the same spec)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    spec = spec or GDNHybridSpec()
    return _build(
        out_dir,
        asdict(spec),
        spec.seed,
        lambda: Qwen3NextForCausalLM(
            Qwen3NextConfig(
                num_hidden_layers=spec.num_layers,
                full_attention_interval=spec.full_attention_interval,
                num_attention_heads=spec.num_heads,
                num_key_value_heads=spec.num_kv_heads,
                head_dim=spec.head_dim,
                linear_key_head_dim=spec.linear_key_head_dim,
                linear_value_head_dim=spec.linear_value_head_dim,
                linear_num_key_heads=spec.linear_num_key_heads,
                linear_num_value_heads=spec.linear_num_value_heads,
                num_experts=spec.num_experts,
                num_experts_per_tok=spec.num_experts_per_tok,
                moe_intermediate_size=spec.moe_intermediate_size,
                shared_expert_intermediate_size=spec.moe_intermediate_size,
                pad_token_id=0,
                **_shared(spec),
            )
        ),
    )


def _shared(spec: Any) -> dict[str, Any]:
    """The configuration every tiny model shares, from its spec's fields of the same names."""
    return {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": spec.initializer_range,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": spec.torch_dtype,
    }


def _build(out_dir: str | Path, stamp_data: dict[str, Any], seed: int, make: Any) -> Path:
    """Save the tokenizer and ``make()``'s model (weights drawn after seeding torch with
    ``seed``) to ``out_dir``, unless it already holds what ``stamp_data`` describes."""
    import torch

    out = Path(out_dir)
    stamp = out / "tierkv-model-spec.json"
    if stamp.exists() and json.loads(stamp.read_text()) == stamp_data:
        return out
    out.mkdir(parents=True, exist_ok=True)
    _build_tokenizer(out, int(stamp_data["vocab_size"]))
    torch.manual_seed(seed)
    model = make()
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps(stamp_data))
    return out


def _build_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, 400),
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(SENTENCES * 10, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(out)


def tokenizer_size(model_dir: str | Path) -> int:
    """Token ids below this are real tokens of the model's tokenizer."""
    data = json.loads((Path(model_dir) / "tokenizer.json").read_text())
    return len(data["model"]["vocab"]) + len(data.get("added_tokens", []))
