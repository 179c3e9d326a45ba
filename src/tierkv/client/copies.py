"""The one copy of a chunk between a slot view in the pool and an engine's array or tensor
(host memory through :func:`tierkv.arraycopy.copy_array`, an accelerator through torch)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from tierkv.arraycopy import copy_array, host_view
from tierkv.client.errors import LayoutError


def copy_into(dst: Any, src: Any) -> None:
    """One copy of a chunk between a numpy view and an array or tensor of the same shape:
    :func:`~tierkv.arraycopy.copy_array` when both are in host memory (a tensor through its
    numpy view), else torch's copy (to or from an accelerator)."""
    d, s = host_array(dst), host_array(src)
    if d is not None and s is not None:
        try:
            copy_array(d, s)
        except ValueError as exc:  # shapes or element sizes that do not match
            raise LayoutError(f"a chunk does not fit its slot: {exc}") from exc
        return
    import torch  # a tensor on an accelerator on one side

    dt = torch.from_numpy(dst) if isinstance(dst, np.ndarray) else dst
    st = torch.from_numpy(src) if isinstance(src, np.ndarray) else src
    if tuple(dt.shape) != tuple(st.shape) or dt.element_size() != st.element_size():
        raise LayoutError(
            f"chunk of shape {tuple(st.shape)} does not fit a slot of {tuple(dt.shape)}"
        )
    if dt.dtype != st.dtype:
        st = st.view(dt.dtype)
    dt.copy_(st)


def host_array(chunk: Any) -> npt.NDArray[Any] | None:
    """A chunk as a numpy array when it is in host memory (None: a tensor elsewhere)."""
    if isinstance(chunk, np.ndarray):
        return chunk
    if not callable(getattr(chunk, "element_size", None)):
        raise LayoutError(
            f"a chunk must be a numpy array or a torch tensor, not {type(chunk).__name__}"
        )
    return host_view(chunk)
