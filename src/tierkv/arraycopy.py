"""One copy of a chunk between two numpy arrays, with non-temporal stores where built.

Every copy of KV bytes that tierkv makes on the engine's side (a chunk into its pool slot
at a store, out of it at a retrieve, vLLM's paged blocks gathered into a slot or scattered
from one, SGLang's host pages) goes through :func:`copy_array`. The C helper
:mod:`tierkv._streamcopy` writes each contiguous run with non-temporal stores: no read of
the destination's cache lines before they are written (a third of a plain memcpy's memory
traffic) and no eviction of the caller's working set for bytes that another process or a
much later forward pass reads. 16-18 GB/s against glibc memcpy's 11-13 for 2 MiB chunks on
the CI machine type (``benchmarks/shm_path.py`` prints both bounds). Without the helper
(built at install when a C compiler is there; :data:`STREAMING`) numpy copies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

_stream_copy: Callable[[Any, Any], bool] | None
try:
    from tierkv._streamcopy import copy as _stream_copy
    from tierkv._streamcopy import kind as _kind

    STORES = _kind()
except ImportError:  # built without a C compiler: numpy copies
    _stream_copy = None
    STORES = "numpy"
"""What the copies write with: ``avx2`` or ``sse2`` streaming stores, ``memcpy`` (the helper
on another architecture), or ``numpy`` (no helper)."""

STREAMING = _stream_copy is not None
"""Whether :func:`copy_array` copies with the C helper :mod:`tierkv._streamcopy`."""


def copy_array(dst: npt.NDArray[Any], src: npt.NDArray[Any]) -> None:
    """Copy ``src`` into ``dst``: the same shape and element size (the element types may
    differ: the bytes are copied as they are), any strides, not overlapping. ValueError if
    they do not match."""
    if dst.shape != src.shape or dst.dtype.itemsize != src.dtype.itemsize:
        raise ValueError(
            f"an array of {src.shape}/{src.dtype} does not fit one of {dst.shape}/{dst.dtype}"
        )
    if _stream_copy is not None and _stream_copy(dst, src):
        return
    np.copyto(dst, src if src.dtype == dst.dtype else src.view(dst.dtype), casting="no")
