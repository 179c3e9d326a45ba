"""Build small Llama-architecture models with random weights, locally, for tests and benchmarks.

Nothing is downloaded: the weights come from a ``LlamaConfig`` (transformers), the tokenizer
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
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    spec = spec or ModelSpec()
    out = Path(out_dir)
    stamp = out / "tierkv-model-spec.json"
    if stamp.exists() and json.loads(stamp.read_text()) == asdict(spec):
        return out
    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(spec.vocab_size, 400),
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(SENTENCES * 10, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(out)

    torch.manual_seed(spec.seed)
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype=spec.torch_dtype,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps(asdict(spec)))
    return out


def tokenizer_size(model_dir: str | Path) -> int:
    """Token ids below this are real tokens of the model's tokenizer."""
    data = json.loads((Path(model_dir) / "tokenizer.json").read_text())
    return len(data["model"]["vocab"]) + len(data.get("added_tokens", []))
