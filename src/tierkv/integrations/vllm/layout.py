"""How an attention backend lays out vLLM's paged KV cache, and block <-> chunk copies.

vLLM hands the connector one tensor per attention layer. Their shapes and the meaning of
their contents depend on the vLLM version and the attention backend:

- vLLM >= 0.32, every backend: a ``[blocks, kv_heads, tokens, 2 * head_size]`` view per
  layer (strides follow the cache layout, e.g. LBHNC). What the last two axes hold is the
  backend's business:

  * ``split_last`` (``FLASH_ATTN``, ``TRITON_ATTN``, ``FLEX_ATTENTION``): per token and
    head, K in the first ``head_size`` values of the last axis and V in the rest;
  * ``native`` (``CPU_ATTN``): per block and head, a region of K followed by a region of V
    in a format that depends on the CPU kernel (ISA): K transposed for ``vec``, K and V
    packed in pairs for ``amx``. tierkv moves these regions as they are, tagged with the
    backend, its ISA and the block size, so that only engines storing KV the same way share.

- MLA (multi-head latent attention, DeepSeek-V2/V3 style): one latent vector per token and
  layer, no K/V axis, ``[blocks, 1, tokens, kv_lora_rank + rope_dim]`` (vLLM >= 0.32) or
  ``[blocks, tokens, kv_lora_rank + rope_dim]``. The backends listed in ``MLA_BACKENDS``
  write the normalized latent ``kv_c`` then the rotary key ``k_pe`` into the last axis, so
  their blocks hold the same bytes: one chunk format for all of them (others are refused).

- older vLLM: five-dimensional tensors with an explicit K/V axis, ``[2, blocks, tokens,
  heads, head_size]`` (FlashAttention) or ``[blocks, 2, tokens, heads, head_size]``
  (FlashInfer), possibly with permuted strides.

With several KV cache groups (vLLM's hybrid allocator) layers of different groups may share
one tensor, each group with its own block table: ``layer_groups`` names each layer's group,
the copies then take one block id per group for each position and move each layer by its
group's id, never touching a group's null block (block 0, behind a sliding window).

Detection checks shapes and strides against the cache spec (block size, KV heads, head size)
and the backend's name, and refuses anything it cannot map with certainty (unknown backends,
MLA backends with their own block format, mixed layer shapes) with an error that says what
it saw.

Chunk formats in the pool (``format_tag`` goes into the namespace with the chunk shape):

- ``kv_2lhtd`` for backends whose K/V positions are known: ``[2, layers, kv_heads,
  chunk_size, head_size]`` (K/V, layer, head, token, dim; token axis 3), the same for every
  such backend, so engines on different backends share chunks;
- ``native:...`` for the others: ``[layers, kv_heads, chunk_size, 2 * head_size]``, each
  block's per-head region as the backend stores it, blocks in token order (token axis 2);
- ``mla_latent`` for MLA caches: ``[layers, 1, chunk_size, kv_lora_rank + rope_dim]`` (token
  axis 2), blocks moved as they are stored (one latent per token: 576 values for DeepSeek,
  against ``2 * kv_heads * head_size`` per layer for K/V caches).

Copies go straight between the paged blocks and the pool's slot view: one copy per run of
consecutive blocks (a prefill's blocks usually are, so usually one per chunk) for all layers
at once when the layers sit in one allocation at a constant stride (vLLM's usual case), else
one per run and layer. Caches in host memory (the CPU backend) are copied on the calling
thread over integer views of the same bytes (:func:`tierkv.arraycopy.host_view`) by
:func:`tierkv.arraycopy.copy_blocks` (non-temporal stores; all of a chunk's blocks in one
call): one thread, like a memcpy, and the GIL released during each copy. A torch ``copy_``
would split every block over the process's OpenMP threads, which vLLM's CPU worker binds to
the cores: with another process on one of those cores, each copy waits for a thread that is
not running (measured: 0.15 instead of 4-6 GB/s). Caches on an accelerator are copied with
``copy_``: a whole chunk's blocks are gathered into (or scattered from) a buffer on the
device, one per copy thread, and the chunk crosses to or from the pool in one contiguous
copy.
"""

from __future__ import annotations

import itertools
import re
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from tierkv.arraycopy import copy_blocks, host_view

NULL_BLOCK = 0  # vLLM's null block (chunks.NULL_BLOCK): a group's position with no KV
NATIVE = "native"
MLA = "mla"
SPLIT_LAST = "split_last"
KV_FIRST = "kv_first"
BLOCK_FIRST = "block_first"
CONTENT_KINDS = (NATIVE, SPLIT_LAST)
CANONICAL_FORMAT = "kv_2lhtd"
MLA_FORMAT = "mla_latent"

# Backends whose four-dimensional cache contents are known (checked against their kernels).
BACKEND_CONTENT = {
    "CPU_ATTN": NATIVE,
    "FLASH_ATTN": SPLIT_LAST,
    "TRITON_ATTN": SPLIT_LAST,
    "FLEX_ATTENTION": SPLIT_LAST,
}
# MLA backends whose cache holds, per token, the normalized latent then the rotary key part
# (vLLM's concat_and_cache_mla; CPU_MLA's do_kv_cache_update; AMX_MLA's
# amx_mla_concat_and_cache, checked byte for byte): the same bytes in all of them. Not the
# sparse and DeepSeek-V4 backends.
MLA_BACKENDS = (
    "CPU_MLA",
    "AMX_MLA",
    "TRITON_MLA",
    "FLASHMLA",
    "FLASH_ATTN_MLA",
    "FLASHINFER_MLA",
    "CUTLASS_MLA",
)
# Backends whose native block format depends on a kernel variant (named after a "/").
VARIANT_BACKENDS = ("CPU_ATTN",)


class UnsupportedLayoutError(ValueError):
    """The KV cache tensors are not in a layout tierkv can map; the message says why."""


class KVLayoutSettingError(ValueError):
    """``kv_layout`` contradicts what tierkv knows of an attention backend: a configuration
    error, raised at start (not an unsupported model, which leaves the connector
    inactive)."""


@dataclass(frozen=True)
class CacheGeometry:
    """What the cache spec promises: tokens per vLLM block, KV heads (this rank), head size;
    ``latent``: an MLA cache (one head of ``head_size`` values per token, no K/V)."""

    block_size: int
    num_kv_heads: int
    head_size: int
    latent: bool = False


@dataclass
class PagedKVLayout:
    """A detected layout and per-layer zero-copy views of the blocks: ``[kernel_blocks, 2,
    heads, tokens, head_size]`` (canonical kinds), ``[kernel_blocks, heads, tokens,
    2 * head_size]`` as vLLM gave them (native) or ``[kernel_blocks, 1, tokens, head_size]``
    (MLA)."""

    kind: str
    layer_names: tuple[str, ...]
    geometry: CacheGeometry
    kernel_block_size: int  # tokens per block of the tensors (divides geometry.block_size)
    dtype: torch.dtype
    views: tuple[torch.Tensor, ...]
    stacked: torch.Tensor | None  # [layers, *view shape] over all layers, when possible
    backend: str = ""
    # With several KV cache groups (vLLM's hybrid allocator): each layer's group. The blocks
    # handed to the copies are then one id per group (chunks.BlockRef), and each layer is
    # copied from (or to) its own group's block, null blocks skipped.
    layer_groups: tuple[int, ...] | None = None
    # numpy views of views/stacked when the cache is in host memory (see arraycopy.host_view)
    host_views: tuple[npt.NDArray[Any], ...] | None = field(default=None, init=False)
    host_stacked: npt.NDArray[Any] | None = field(default=None, init=False)
    # views with the block axis moved next to the token axis (see _moved_views), by host
    _moved: dict[bool, tuple[Any, tuple[Any, ...]]] = field(
        default_factory=dict, init=False, repr=False
    )

    def __post_init__(self) -> None:
        arrays = [host_view(v) for v in self.views]
        if all(a is not None for a in arrays):
            self.host_views = tuple(a for a in arrays if a is not None)
            if self.stacked is not None:
                self.host_stacked = host_view(self.stacked)

    @property
    def native(self) -> bool:
        return self.kind == NATIVE

    @property
    def latent(self) -> bool:
        """An MLA cache: the same on every tensor-parallel rank."""
        return self.kind == MLA

    @property
    def as_stored(self) -> bool:
        """Blocks move as vLLM stores them (native and MLA), not split into K and V."""
        return self.kind in (NATIVE, MLA)

    @property
    def num_layers(self) -> int:
        return len(self.views)

    @property
    def num_blocks(self) -> int:
        """vLLM blocks (the scheduler's block ids range over these)."""
        return int(self.views[0].shape[0]) // self.sub_blocks

    @property
    def sub_blocks(self) -> int:
        """Tensor blocks per vLLM block (kernel block splitting; usually 1)."""
        return self.geometry.block_size // self.kernel_block_size

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def token_axis(self) -> int:
        return 2 if self.as_stored else 3

    @property
    def layer_axis(self) -> int:
        return 0 if self.as_stored else 1

    @property
    def format_tag(self) -> str:
        """What the chunk bytes mean, beyond shape and dtype (part of the namespace)."""
        if self.latent:
            return MLA_FORMAT
        if not self.native:
            return CANONICAL_FORMAT
        return f"native:{self.backend}:bs{self.geometry.block_size}:kb{self.kernel_block_size}"

    def chunk_shape(self, chunk_size: int) -> list[int]:
        g = self.geometry
        if self.as_stored:
            return [self.num_layers, g.num_kv_heads, chunk_size, int(self.views[0].shape[-1])]
        return [2, self.num_layers, g.num_kv_heads, chunk_size, g.head_size]

    def describe(self) -> str:
        g = self.geometry
        return (
            f"{self.kind} layout ({self.backend or 'backend unknown'}), {self.num_layers} "
            f"layers, {self.num_blocks} blocks of {g.block_size} tokens, {g.num_kv_heads} KV "
            f"heads x {g.head_size}, {self.dtype_name}; chunk format {self.format_tag}"
        )

    # -- copies ----------------------------------------------------------------------------
    def read_block(self, block_id: int, chunk: torch.Tensor, token_offset: int) -> None:
        """Copy vLLM block ``block_id`` into the chunk's tokens ``[token_offset, +block)``
        (``token_offset``: a multiple of the block size)."""
        self.read_blocks([(self._block_position(token_offset), block_id)], chunk)

    def write_block(self, block_id: int, chunk: torch.Tensor, token_offset: int) -> None:
        """Copy the chunk's tokens ``[token_offset, +block)`` into vLLM block ``block_id``
        (``token_offset``: a multiple of the block size)."""
        self.write_blocks([(self._block_position(token_offset), block_id)], chunk)

    def _block_position(self, token_offset: int) -> int:
        position, rest = divmod(token_offset, self.geometry.block_size)
        if rest:
            raise ValueError(
                f"token offset {token_offset} is not a multiple of the block size "
                f"{self.geometry.block_size}"
            )
        return position

    def read_blocks(self, blocks: Iterable[tuple[int, Any]], chunk: Any) -> None:
        """For every ``(j, block_id)``: copy vLLM block ``block_id`` into the chunk's ``j``-th
        block (tokens ``[j * block_size, +block_size)``). With :attr:`layer_groups`,
        ``block_id`` is a tuple of one id per group. ``chunk``: a tensor of the chunk's shape,
        or a pool slot's view (numpy, the chunk's shape, an element of the KV dtype's size:
        see :meth:`chunk_tensor`)."""
        host = self._host_chunk(chunk)
        if host is not None:
            for paged, part, axis, runs in self._host_copies(blocks, host):
                copy_blocks(part, paged, axis, runs)
            return
        chunk = self.chunk_tensor(chunk) if isinstance(chunk, np.ndarray) else chunk
        pairs = list(blocks)
        staging = self._staging(pairs, chunk)
        # One copy_ per part: torch._foreach_copy_ (one call for all) returned wrong bytes for
        # MLA chunks on an H200 (torch 2.11, CUDA 13), caught by benchmarks/gpu_copies.py.
        for paged, part in self._block_parts(pairs, chunk if staging is None else staging):
            part.copy_(paged)
        if staging is not None:
            chunk.copy_(staging)  # one contiguous copy off the device

    def write_blocks(self, blocks: Iterable[tuple[int, Any]], chunk: Any) -> None:
        """For every ``(j, block_id)``: copy the chunk's ``j``-th block into vLLM block
        ``block_id`` (``chunk`` as for :meth:`read_blocks`)."""
        host = self._host_chunk(chunk)
        if host is not None:
            for paged, part, axis, runs in self._host_copies(blocks, host):
                copy_blocks(paged, part, axis, _swapped(runs))
            return
        chunk = self.chunk_tensor(chunk) if isinstance(chunk, np.ndarray) else chunk
        pairs = list(blocks)
        staging = self._staging(pairs, chunk)
        if staging is not None:
            staging.copy_(chunk)  # one contiguous copy onto the device
        for paged, part in self._block_parts(pairs, chunk if staging is None else staging):
            paged.copy_(part)

    def _staging(self, blocks: list[tuple[int, int]], chunk: torch.Tensor) -> torch.Tensor | None:
        """For a cache on an accelerator and a chunk in host memory whose every block is
        copied: this thread's buffer of the chunk's shape on the cache's device. The blocks
        are gathered into it (or scattered from it) on the device, and the chunk crosses to
        or from host memory in one contiguous copy: a copy between devices of a strided view
        is several copies (measured on an H200, 32 MiB chunks in blocks of 16 tokens: 0.9
        GB/s a block at a time, 3.9 a run at a time, 13.7 for one contiguous copy). None
        otherwise (copies go straight between the blocks and the chunk)."""
        device = self.views[0].device
        if device.type == "cpu" or chunk.device == device or not chunk.is_contiguous():
            return None
        covered = {j for j, _ in blocks}
        if len(covered) * self.geometry.block_size != chunk.shape[self.token_axis]:
            return None  # part of the chunk: only its blocks' tokens may be written
        key = (tuple(chunk.shape), chunk.dtype, device)
        buffers: dict[Any, torch.Tensor] = _staging.__dict__.setdefault("buffers", {})
        staging = buffers.get(key)
        if staging is None:
            staging = buffers[key] = torch.empty(chunk.shape, dtype=chunk.dtype, device=device)
        return staging

    def _host_chunk(self, chunk: Any) -> npt.NDArray[Any] | None:
        """The chunk as a numpy view when both it and the cache are in host memory (a slot
        view as it is: no tensor made and taken apart again for every chunk)."""
        if self.host_views is None:
            return None
        if isinstance(chunk, np.ndarray):
            return chunk if chunk.dtype.itemsize == self.dtype.itemsize else None
        if chunk.dtype != self.dtype:
            return None
        return host_view(chunk)

    def _host_copies(
        self, blocks: Iterable[tuple[int, Any]], chunk: npt.NDArray[Any]
    ) -> Iterator[tuple[npt.NDArray[Any], npt.NDArray[Any], int, npt.NDArray[np.int64]]]:
        """For a cache in host memory: (paged cache view, chunk view, block axis, runs) for
        :func:`~tierkv.arraycopy.copy_blocks`, covering the vLLM blocks ``(j, block_id)``
        (runs of the chunk's kernel blocks, then the cache's: ``(j, block, count)``): one
        for all layers at once (stacked), else one per layer (with several groups, each
        layer with its group's blocks, null blocks left out). Both views have their blocks
        on the same axis (see :meth:`_block_parts`)."""
        stacked, views = self._moved_views(True)
        split = self._split_chunk(chunk)  # [..., kernel blocks, kernel block size, ...]
        axis, sub = self.token_axis, self.sub_blocks
        common, by_group = self._grouped(blocks)
        if not by_group:
            runs = _kernel_runs(common, sub)
            if stacked is not None:
                yield stacked, split, axis, runs
                return
            for view, layer in zip(views, _unbind(split, self.layer_axis), strict=True):
                yield view, layer, axis - 1, runs  # the layer axis came before the block axis
            return
        assert self.layer_groups is not None
        runs_of = {group: _kernel_runs(pairs, sub) for group, pairs in by_group.items()}
        layers = _unbind(split, self.layer_axis)
        for view, layer, group in zip(views, layers, self.layer_groups, strict=True):
            yield view, layer, axis - 1, runs_of[group]

    def _grouped(
        self, blocks: Iterable[tuple[int, Any]]
    ) -> tuple[list[tuple[int, int]], dict[int, list[tuple[int, int]]]]:
        """The blocks as ``(j, block id)`` pairs for every layer, or, with the layers in
        several of the model's groups, each group's pairs (and no common ones). A group's
        null blocks are left out; with every layer in one group (a hybrid's attention), that
        group's pairs are everyone's."""
        pairs = list(blocks)
        groups = set(self.layer_groups or ())
        if not groups:
            return pairs, {}
        by_group = {g: [(j, ref[g]) for j, ref in pairs if ref[g] != NULL_BLOCK] for g in groups}
        if len(by_group) == 1:
            return by_group.popitem()[1], {}
        return [], by_group

    def _block_parts(
        self, blocks: Iterable[tuple[int, Any]], chunk: torch.Tensor
    ) -> Iterator[tuple[Any, Any]]:
        """(paged cache view, chunk view) pairs covering the vLLM blocks ``(j, block_id)``,
        torch views of a cache on an accelerator: one per run of consecutive blocks (block
        ids and chunk positions both counting up by one, as a prefill's blocks usually are)
        for all layers at once (stacked), else one per run and layer.

        A run of ``m`` kernel blocks is one copy: the paged side is the run's blocks with
        their block axis next to the token axis, ``[..., m, tokens, dim]``; the chunk side is
        the run's tokens with the token axis split into ``(m, tokens)``. Both are slices of
        views made once (per layout, per chunk): a copy per layer costs a few microseconds of
        Python, which is most of a copy's time on a GPU (61 layers of an MLA chunk)."""
        stacked, views = self._moved_views(False)
        split = self._split_chunk(chunk)  # [..., kernel blocks, kernel block size, ...]
        axis, sub = self.token_axis, self.sub_blocks  # axis: the split chunk's block axis
        common, by_group = self._grouped(blocks)
        if stacked is None or by_group:
            layers = _unbind(split, self.layer_axis)
            axis -= 1  # the layer axis comes before the token axis
        if by_group:
            assert self.layer_groups is not None
            runs = {group: list(block_runs(pairs)) for group, pairs in by_group.items()}
            for layer, (view, group) in enumerate(zip(views, self.layer_groups, strict=True)):
                for j, block_id, count in runs[group]:
                    m = count * sub
                    yield (
                        _narrow(view, -3, block_id * sub, m),
                        _narrow(layers[layer], axis, j * sub, m),
                    )
            return
        for j, block_id, count in block_runs(common):
            kb, b0, m = block_id * sub, j * sub, count * sub
            if stacked is not None:
                yield _narrow(stacked, -3, kb, m), _narrow(split, axis, b0, m)
            else:
                for layer, view in enumerate(views):
                    yield _narrow(view, -3, kb, m), _narrow(layers[layer], axis, b0, m)

    def _moved_views(self, host: bool) -> tuple[Any, tuple[Any, ...]]:
        """(all layers, each layer) with the block axis moved next to the token axis:
        ``[(K/V,) layers, heads, blocks, tokens, dim]`` for the stacked view (K/V first for
        the canonical kinds, as in the chunk) and ``[(K/V,) heads, blocks, tokens, dim]``
        per layer. Views, made once."""
        cached = self._moved.get(host)
        if cached is None:
            stacked = self.host_stacked if host else self.stacked
            views = self.host_views if host else self.views
            assert views is not None
            move = np.moveaxis if host else torch.movedim
            all_layers = None
            if stacked is not None:
                all_layers = move(stacked, 1, -3)  # [layers, (2,) heads, blocks, tokens, dim]
                if not self.as_stored:
                    all_layers = all_layers.swapaxes(0, 1)  # K/V axis first
            cached = self._moved[host] = (all_layers, tuple(move(v, 0, -3) for v in views))
        return cached

    def _split_chunk(self, chunk: Any) -> Any:
        """The chunk with its token axis split into ``(kernel blocks, kernel block size)``
        (a view: splitting one axis never needs a copy; raises instead)."""
        n, axis = self.kernel_block_size, self.token_axis
        shape = (*chunk.shape[:axis], chunk.shape[axis] // n, n, *chunk.shape[axis + 1 :])
        if isinstance(chunk, torch.Tensor):
            return chunk.view(shape)
        return np.reshape(chunk, shape, copy=False)

    def chunk_tensor(self, slot: npt.NDArray[Any]) -> torch.Tensor:
        """A pool slot view (numpy, chunk-shaped) as a torch tensor of the KV dtype: no copy.
        (numpy has no bfloat16/fp8: the client hands out same-size unsigned ints.)"""
        tensor = torch.from_numpy(slot)
        if tensor.dtype != self.dtype:
            tensor = tensor.view(self.dtype)
        return tensor


# -- detection -------------------------------------------------------------------------------
def detect_layout(
    kv_caches: Mapping[str, torch.Tensor],
    geometry: CacheGeometry,
    backends: Mapping[str, str] | None = None,
    content: str = "auto",
    groups: Mapping[str, int] | None = None,
) -> PagedKVLayout:
    """Map vLLM's per-layer KV cache tensors to block views.

    ``groups``: each layer's KV cache group, for a model with several (vLLM's hybrid
    allocator), whose layers of different groups may share one tensor (their blocks are
    disjoint): the layout then copies each layer by its own group's block ids.

    ``backends`` names each layer's attention backend (``AttentionBackend.get_name()``,
    then ``/variant`` where the block format depends on one: ``CPU_ATTN/amx``);
    ``content`` overrides what a four-dimensional cache holds (``native`` or ``split_last``)
    for backends this module does not know (:class:`KVLayoutSettingError` for one it knows
    whose content differs). Layers that share one tensor (cross-layer KV sharing) are kept
    once. Raises :class:`UnsupportedLayoutError`.
    """
    if not kv_caches:
        raise UnsupportedLayoutError("vLLM registered no KV cache tensors")
    if content not in ("auto", *CONTENT_KINDS):
        raise UnsupportedLayoutError(
            f"kv_layout must be 'auto', 'native' or 'split_last', not {content!r}"
        )
    names: list[str] = []
    seen: set[tuple[int, int, tuple[int, ...], int]] = set()
    for name in sorted(kv_caches, key=layer_order):
        t = kv_caches[name]
        group = (groups or {}).get(name, 0)
        identity = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.stride()), group)
        if identity in seen:
            continue  # a layer that reuses another layer's KV
        seen.add(identity)
        names.append(name)
    first = kv_caches[names[0]]
    for name in names[1:]:
        t = kv_caches[name]
        if t.shape != first.shape or t.dtype != first.dtype or t.stride() != first.stride():
            raise UnsupportedLayoutError(
                f"KV cache layers differ ({names[0]}: {tuple(first.shape)} {first.dtype}, "
                f"{name}: {tuple(t.shape)} {t.dtype}): hybrid or per-layer caches are not "
                "supported"
            )
    kinds = {
        MLA if geometry.latent else _content_kind(name, kv_caches[name], backends or {}, content)
        for name in names
    }
    if len(kinds) != 1:
        raise UnsupportedLayoutError(f"layers use different attention backends: {kinds}")
    kind = kinds.pop()
    backend_names = {(backends or {}).get(name, "") for name in names}
    backend = backend_names.pop() if len(backend_names) == 1 else ""
    if kind == MLA and backend not in MLA_BACKENDS:
        raise UnsupportedLayoutError(
            f"MLA attention backend {backend or 'unknown'!r}: tierkv knows the latent cache "
            f"format of {list(MLA_BACKENDS)} only"
        )
    if kind == NATIVE:
        if not backend:
            raise UnsupportedLayoutError("a native KV layout needs the attention backend's name")
        if backend.split("/")[0] in VARIANT_BACKENDS and "/" not in backend:
            raise UnsupportedLayoutError(
                f"the {backend} block format depends on its kernel variant (ISA), which vLLM "
                "did not tell: refusing, since engines with other variants would read the "
                "bytes wrongly"
            )
    views = tuple(_block_view(kv_caches[name], geometry, kind, name) for name in names)
    kernel_block_size = int(views[0].shape[-2] if kind in (NATIVE, MLA) else views[0].shape[3])
    if views[0].device.type == "meta":
        raise UnsupportedLayoutError("KV cache tensors are on the meta device")
    layer_groups = tuple((groups or {}).get(name, 0) for name in names)
    return PagedKVLayout(
        kind=kind,
        layer_names=tuple(names),
        geometry=geometry,
        kernel_block_size=kernel_block_size,
        dtype=first.dtype,
        views=views,
        stacked=_stack(views),
        backend=backend,
        # Positions name a block per group whenever the model has several groups (a hybrid
        # model's attention layers may all be in one of them).
        layer_groups=layer_groups if groups else None,
    )


def layer_order(name: str) -> tuple[Any, ...]:
    """Natural order: model.layers.2 before model.layers.10."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def _content_kind(
    name: str, tensor: torch.Tensor, backends: Mapping[str, str], content: str
) -> str:
    _check_override(name, backends.get(name, ""), content)
    if tensor.dim() == 5:
        return BLOCK_FIRST if _is_block_first(tensor, backends.get(name, "")) else KV_FIRST
    if tensor.dim() != 4:
        raise UnsupportedLayoutError(
            f"layer {name}: KV cache of shape {tuple(tensor.shape)} is not a paged K/V cache "
            "(an MLA cache comes with vLLM's MLA cache spec)"
        )
    if content != "auto":
        return content
    backend = backends.get(name, "")
    kind = BACKEND_CONTENT.get(backend.split("/")[0])
    if kind is None:
        raise UnsupportedLayoutError(
            f"layer {name}: attention backend {backend or 'unknown'!r} with a KV cache of shape "
            f"{tuple(tensor.shape)}: tierkv does not know where K and V are in it (known: "
            f"{sorted(BACKEND_CONTENT)}); set kv_connector_extra_config.kv_layout to 'split_last' "
            "if K and V are the halves of the last axis, or 'native' to store blocks as they are"
        )
    return kind


def _check_override(name: str, backend: str, content: str) -> None:
    """``kv_layout`` names the content of a backend this module does not know; for one it
    knows, another content would tag its blocks with a format they are not in (a CPU_ATTN
    engine's native blocks stored as split_last, which FLASH_ATTN engines load as K and V
    halves): raises :class:`KVLayoutSettingError` (the engine does not start) for it."""
    known = BACKEND_CONTENT.get(backend.split("/")[0])
    if content == "auto" or known is None or content == known:
        return
    raise KVLayoutSettingError(
        f"kv_connector_extra_config.kv_layout is {content!r}, but layer {name}'s attention "
        f"backend {backend!r} is one tierkv knows (its cache holds {known!r}): kv_layout is "
        "only for attention backends tierkv does not know; leave it at 'auto'"
    )


def _is_block_first(tensor: torch.Tensor, backend: str) -> bool:
    if tensor.shape[0] == 2 and tensor.shape[1] != 2:
        return False
    if tensor.shape[1] == 2 and tensor.shape[0] != 2:
        return True
    return backend.upper().startswith("FLASHINFER")


def _block_view(t: torch.Tensor, geometry: CacheGeometry, kind: str, name: str) -> torch.Tensor:
    """The per-layer block view (see :class:`PagedKVLayout`) over ``t``'s memory, never a
    copy."""
    heads, head_size, block_size = geometry.num_kv_heads, geometry.head_size, geometry.block_size
    shape = tuple(int(d) for d in t.shape)
    if kind == MLA:
        view = t.unsqueeze(1) if t.dim() == 3 else t  # [blocks, 1, tokens, head_size]
        if view.dim() != 4:
            raise _mismatch(name, shape, kind, geometry)
        _, h, n, c = view.shape
        if h != 1 or heads != 1 or c != head_size or n <= 0 or block_size % n:
            raise _mismatch(name, shape, kind, geometry)
        return view
    if kind in (KV_FIRST, BLOCK_FIRST):
        view = t.permute(1, 0, 3, 2, 4) if kind == KV_FIRST else t.permute(0, 1, 3, 2, 4)
        _, two, h, n, d = view.shape
        if two != 2 or h != heads or d != head_size or n <= 0 or block_size % n:
            raise _mismatch(name, shape, kind, geometry)
        return view
    blocks, h, n, c = shape
    if h != heads or c != 2 * head_size or n <= 0 or block_size % n:
        raise _mismatch(name, shape, kind, geometry)
    if kind == NATIVE:
        return t  # blocks move as they are: [blocks, heads, tokens, 2 * head_size]
    s_block, s_head, s_token, s_content = t.stride()
    # SPLIT_LAST: K then V along the last axis
    sizes = (blocks, 2, h, n, head_size)
    strides = (s_block, head_size * s_content, s_head, s_token, s_content)
    return t.as_strided(sizes, strides, t.storage_offset())


def _mismatch(
    name: str, shape: tuple[int, ...], kind: str, geometry: CacheGeometry
) -> UnsupportedLayoutError:
    return UnsupportedLayoutError(
        f"layer {name}: KV cache of shape {shape} does not match a {kind} cache with "
        f"{geometry.num_kv_heads} KV heads of size {geometry.head_size} and blocks of "
        f"{geometry.block_size} tokens"
    )


_staging = threading.local()  # per copy thread: device buffers by (shape, dtype, device)


def _narrow(array: Any, axis: int, start: int, length: int) -> Any:
    """``length`` entries of ``axis`` from ``start`` (a view; the array itself when that is
    all of it): torch's ``narrow`` is one call, where indexing costs several."""
    if start == 0 and length == array.shape[axis]:
        return array
    if isinstance(array, torch.Tensor):
        return array.narrow(axis, start, length)
    index: list[Any] = [slice(None)] * array.ndim
    index[axis] = slice(start, start + length)
    return array[tuple(index)]


def _unbind(array: Any, axis: int) -> Sequence[Any]:
    """Views of each entry along ``axis`` (torch makes them all in one call)."""
    views: Sequence[Any] = (
        array.unbind(axis) if isinstance(array, torch.Tensor) else list(np.moveaxis(array, axis, 0))
    )
    return views


def _kernel_runs(pairs: Sequence[tuple[int, int]], sub: int) -> npt.NDArray[np.int64]:
    """``(j, block_id)`` pairs of vLLM blocks as rows ``(j, block, count)`` of kernel blocks
    (``sub`` per vLLM block), for :func:`~tierkv.arraycopy.copy_blocks`: one row per run of
    consecutive pairs (:func:`block_runs`). A run is one copy of ``count`` blocks, as long
    as the blocks lie one after the other in both arrays: an MLA chunk's 16 blocks of 36 KiB
    in a layer, allocated in a row as a fresh prompt's blocks usually are, copied 25-30 %
    faster as one 576 KiB run than as 16 (the AVX2-only EPYC VM type, one thread)."""
    runs = np.array(list(block_runs(pairs)), np.int64).reshape(-1, 3)
    runs *= sub
    return runs


def _swapped(runs: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Rows ``(j, block, count)`` as ``(block, j, count)``: the same runs the other way."""
    return np.ascontiguousarray(runs[:, [1, 0, 2]])


def block_runs(blocks: Iterable[tuple[int, int]]) -> Iterator[tuple[int, int, int]]:
    """``(j, block_id)`` pairs as runs ``(first j, first block id, length)`` of consecutive
    pairs (both counting up by one)."""
    run: list[int] | None = None
    for j, block_id in blocks:
        if run is not None and j == run[0] + run[2] and block_id == run[1] + run[2]:
            run[2] += 1
            continue
        if run is not None:
            yield run[0], run[1], run[2]
        run = [j, block_id, 1]
    if run is not None:
        yield run[0], run[1], run[2]


def _stack(views: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """All layers as one view ``[layers, ...]`` when they lie in one storage at a constant
    stride (one copy call per block instead of one per layer), else None."""
    first = views[0]
    if len(views) == 1:
        return first.unsqueeze(0)
    ptr = first.untyped_storage().data_ptr()
    offsets = [v.storage_offset() for v in views]
    step = offsets[1] - offsets[0]
    if step <= 0 or any(
        v.untyped_storage().data_ptr() != ptr or v.stride() != first.stride() for v in views
    ):
        return None
    if any(b - a != step for a, b in itertools.pairwise(offsets)):
        return None
    return first.as_strided((len(views), *first.shape), (step, *first.stride()), offsets[0])
