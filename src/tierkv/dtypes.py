"""The KV dtypes tierkv accepts, and how each maps to numpy: one table for server and client.

The server refuses a layout whose dtype :func:`itemsize` does not know (so nothing is
registered that a client could not then view), and the client views slots with
:func:`numpy_dtype`. Plain numeric numpy dtypes are accepted by name (``float16``,
``float32``, ``int8``, ...); the dtypes engines use that numpy lacks (``bfloat16`` and the
float8 variants) are viewed as unsigned ints of the same size, so bytes copy exactly.
Anything else (object, string, datetime, structured dtypes, odd strings numpy would parse)
is refused: ``itemsize`` is 0 and ``numpy_dtype`` raises ValueError.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Dtypes numpy does not know by these names but engines use: same-size raw numpy types.
_RAW = {"bfloat16": "uint16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}


def itemsize(name: str) -> int:
    """Bytes per element of ``name``, or 0 when tierkv does not accept it."""
    if name in _RAW:
        return np.dtype(_RAW[name]).itemsize
    if not name or len(name) > 32 or not name.replace("_", "").isalnum():
        return 0
    try:
        dtype = np.dtype(name)
    except Exception:
        return 0
    return dtype.itemsize if dtype.kind in "biufc" else 0


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype slots of ``name`` are viewed as."""
    if not itemsize(name):
        raise ValueError(f"unsupported KV dtype {name!r}")
    return np.dtype(_RAW.get(name, name))
