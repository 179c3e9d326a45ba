"""The documentation site, built once for the docs tests (in-process: no process starts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.docs_site import build_site


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_site(tmp_path_factory.mktemp("site"))
