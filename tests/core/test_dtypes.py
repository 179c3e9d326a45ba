"""tierkv.dtypes: the one table of KV dtypes, shared by the server (REGISTER) and the client
(viewing slots)."""

from __future__ import annotations

import numpy as np
import pytest

from tierkv.dtypes import itemsize, numpy_dtype


@pytest.mark.parametrize(
    ("name", "size", "view"),
    [
        ("float16", 2, "float16"),
        ("float32", 4, "float32"),
        ("int8", 1, "int8"),
        ("bfloat16", 2, "uint16"),
        ("float8_e4m3fn", 1, "uint8"),
        ("float8_e5m2", 1, "uint8"),
    ],
)
def test_every_accepted_dtype_can_be_viewed_by_the_client(name: str, size: int, view: str) -> None:
    assert itemsize(name) == size
    assert numpy_dtype(name) == np.dtype(view) and numpy_dtype(name).itemsize == size


@pytest.mark.parametrize("name", ["fp8", "float33", "", "object", "U10", "f4,i4", "V16", "M8"])
def test_what_the_server_refuses_the_client_cannot_view(name: str) -> None:
    assert itemsize(name) == 0
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        numpy_dtype(name)
