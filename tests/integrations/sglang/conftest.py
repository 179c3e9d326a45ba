"""Fixtures the SGLang backend's tests share."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def backends() -> Iterator[list[Any]]:
    """Backends to close after the test."""
    made: list[Any] = []
    yield made
    for b in made:
        b.close()
