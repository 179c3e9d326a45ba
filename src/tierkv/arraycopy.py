"""One copy of a chunk between two arrays in host memory, with non-temporal stores where built.

Every copy of KV bytes that tierkv makes on the engine's side (a chunk into its pool slot
at a store, out of it at a retrieve, vLLM's paged blocks gathered into a slot or scattered
from one, SGLang's host pages) goes through :func:`copy_array`. The C helper
:mod:`tierkv._streamcopy` writes each contiguous run with non-temporal stores: no read of
the destination's cache lines before they are written (a third of a plain memcpy's memory
traffic) and no eviction of the caller's working set for bytes that another process or a
much later forward pass reads. 16-18 GB/s against glibc memcpy's 11-13 for 2 MiB chunks on
the CI machine type (``benchmarks/shm_path.py`` prints both bounds). Without the helper
(built at install when a C compiler is there; :data:`STREAMING`) numpy copies. Tensors in
host memory are copied through :func:`host_view`, a numpy view of the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

_stream_copy: Callable[[Any, Any], bool] | None
_stream_blocks: Callable[[Any, Any, int, Any], bool] | None
try:
    from tierkv._streamcopy import copy as _stream_copy
    from tierkv._streamcopy import copy_blocks as _stream_blocks
    from tierkv._streamcopy import kind as _kind

    STORES = _kind()
except ImportError:  # built without a C compiler: numpy copies
    _stream_copy = _stream_blocks = None
    STORES = "numpy"
"""What the copies write with: ``avx2`` or ``sse2`` streaming stores, ``memcpy`` (the helper
on another architecture), or ``numpy`` (no helper)."""

STREAMING = _stream_copy is not None
"""Whether :func:`copy_array` copies with the C helper :mod:`tierkv._streamcopy`."""

COPIES = {
    "avx2": "non-temporal AVX2 stores",
    "sse2": "non-temporal SSE2 stores",
    "memcpy": "memcpy (no non-temporal stores on this architecture)",
}.get(STORES, "numpy (tierkv._streamcopy was not built: about a third slower)")
"""The copies in words, for logs."""


def copy_array(dst: npt.NDArray[Any], src: npt.NDArray[Any]) -> None:
    """Copy ``src`` into ``dst``: the same shape and element size (the element types may
    differ: the bytes are copied as they are), any strides. ValueError if they do not match.
    Overlapping arrays and runs too short to stream are copied by numpy."""
    if dst.shape != src.shape or dst.dtype.itemsize != src.dtype.itemsize:
        raise ValueError(
            f"an array of {src.shape}/{src.dtype} does not fit one of {dst.shape}/{dst.dtype}"
        )
    if _stream_copy is not None and _stream_copy(dst, src):
        return
    np.copyto(dst, src if src.dtype == dst.dtype else src.view(dst.dtype), casting="no")


def copy_blocks(
    dst: npt.NDArray[Any], src: npt.NDArray[Any], axis: int, runs: npt.NDArray[np.int64]
) -> None:
    """For every row ``(j, b, count)`` of ``runs`` (int64, shape ``(n, 3)``): copy ``src``'s
    blocks ``b .. b + count - 1`` along ``axis`` into ``dst``'s ``j .. j + count - 1``, as
    :func:`copy_array` copies (``dst`` and ``src``: the same element size, the same shape
    but along ``axis``). All of a chunk's blocks in one call (one call into the C helper,
    which checks every row before it copies). IndexError for a row outside either array."""
    if _stream_blocks is not None and _stream_blocks(dst, src, axis, runs):
        return
    for j, b, count in runs.tolist():
        if min(j, b) < 0 or count < 1 or j + count > dst.shape[axis] or b + count > src.shape[axis]:
            raise IndexError(
                f"run ({j}, {b}, {count}) is outside {dst.shape[axis]} and {src.shape[axis]} blocks"
            )
    for j, b, count in runs.tolist():
        copy_array(_along(dst, axis, j, count), _along(src, axis, b, count))


def _along(array: npt.NDArray[Any], axis: int, start: int, count: int) -> npt.NDArray[Any]:
    """``array``'s entries ``start .. start + count - 1`` along ``axis`` (a view)."""
    index: list[Any] = [slice(None)] * array.ndim
    index[axis] = slice(start, start + count)
    view: npt.NDArray[Any] = array[tuple(index)]
    return view


# numpy has no bfloat16 or float8: host tensors are viewed as integers of their element size.
_INT_OF_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def host_view(tensor: Any) -> npt.NDArray[Any] | None:
    """A numpy view of a torch tensor in host memory: the same bytes, shape and strides, as
    the integer type of its element size (the bytes are what is copied). None for a tensor
    on another device or of an element size no integer type has."""
    name = _INT_OF_SIZE.get(tensor.element_size())
    if tensor.device.type != "cpu" or name is None:
        return None
    import torch

    array: npt.NDArray[Any] = tensor.detach().view(getattr(torch, name)).numpy()
    return array
