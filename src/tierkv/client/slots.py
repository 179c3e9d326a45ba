"""A registration's slots as an engine touches them: zero-copy views over the pool mapping
they were given in, and the one copy per chunk between those views and the engine's arrays
or ``gather``/``scatter`` callbacks (run on the copy threads)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from tierkv import dtypes
from tierkv import protocol as p
from tierkv.client.copies import copy_into
from tierkv.client.errors import LeaseExpiredError, TierKVError
from tierkv.copier import Copier
from tierkv.pool import ShmPool

SlotCallback = Callable[[int, npt.NDArray[Any]], None]


class SlotLayout:
    """How one registration's chunks lie in their slots: shape, dtype and bytes per token."""

    def __init__(self, layout: p.Layout, chunk_size: int, chunk_bytes: int) -> None:
        self.layout = layout
        self.chunk_bytes = chunk_bytes
        self.bytes_per_token = chunk_bytes // chunk_size
        self.dtype: np.dtype[Any] = dtypes.numpy_dtype(layout.dtype)

    def view(self, slot: p.Slot, pool: ShmPool) -> npt.NDArray[Any]:
        """Zero-copy numpy view of ``slot`` in ``pool``, shaped like the chunk (partial
        chunks: fewer tokens on the token axis)."""
        if pool.closed:
            raise pool_gone()
        if slot.offset < 0 or slot.length <= 0 or slot.offset + slot.length > pool.size:
            raise TierKVError(f"server sent a slot outside the pool: {slot}")
        shape = list(self.layout.shape)
        if slot.length != self.chunk_bytes:
            if slot.length % self.bytes_per_token:
                raise TierKVError(f"slot length {slot.length} is not a whole number of tokens")
            shape[self.layout.token_axis] = slot.length // self.bytes_per_token
        return pool.array(slot.offset, slot.length, self.dtype, shape)

    def tensor(self, slot: p.Slot, pool: ShmPool) -> Any:
        """Zero-copy torch tensor over ``slot`` (torch must be installed)."""
        import torch

        tensor = torch.from_numpy(self.view(slot, pool))
        if self.layout.dtype == "bfloat16":
            tensor = tensor.view(torch.bfloat16)
        return tensor


def copy_slots(
    layout: SlotLayout,
    copier: Copier,
    slots: Sequence[p.Slot],
    pool: ShmPool,
    callback: SlotCallback | None,
    arrays: Sequence[Any] | None,
    first_chunk: int,
    into_slots: bool,
    parallel_callbacks: bool,
    caller_copies: bool | None,
) -> None:
    """For every slot, ``callback(chunk, view)`` or one copy between the view (in ``pool``,
    the mapping the slots were given in) and ``arrays[chunk - first_chunk]`` (into the
    slots for a store). Array copies run on ``copier``'s threads, callbacks only with
    ``parallel_callbacks``; returns only when every call has ended."""
    if callback is None:
        assert arrays is not None

        def copy(chunk: int, view: npt.NDArray[Any]) -> None:
            array = arrays[chunk - first_chunk]
            if into_slots:
                copy_into(view, array)
            else:
                copy_into(array, view)

    views = [(slot.chunk, layout.view(slot, pool)) for slot in slots]
    fn = callback or copy
    if callback is not None and not parallel_callbacks:
        for chunk, view in views:
            fn(chunk, view)
        return
    copier.run(lambda cv: fn(*cv), views, [s.length for s in slots], caller_copies)


def pool_gone() -> LeaseExpiredError:
    """The error for slots given in a pool mapping the client has since closed."""
    return LeaseExpiredError(
        p.ErrorCode.NOT_FOUND,
        "the slots were given in a pool this client no longer maps (the server restarted "
        "and the client registered again): store or retrieve again",
    )
