"""State groups of hybrid models (Mamba-2, gated DeltaNet): what is stored besides the KV.

A hybrid model's state layers (vLLM's ``MambaSpec`` groups: Qwen3-Next's gated DeltaNet,
Nemotron-H's and Granite-4's Mamba-2) keep one state per request, not one vector per token:
a prefix's attention KV is of no use without the state at the end of that prefix. A prefix
hit is served only where that state is restored with the KV.

vLLM's Mamba ``"align"`` cache mode (its prefix caching on) makes prefill steps end on block
boundaries and keeps a state block per boundary it retains (by default one per prompt: the
last block boundary before the prompt's last token). Each retained boundary reaches the
connector as an exact hand-off, ``(group, block id, tokens)`` per state group, in the step
whose forward pass writes it (``SchedulerOutput.kv_connector_block_state``). The connector
stores the state of every state group at an offered boundary that ends a tierkv chunk, after
that forward pass, and a lookup serves a prefix only up to a chunk whose state it holds; the
load writes the state into each state group's block at that position, which is where vLLM
reads it (as for a hit of its own prefix cache). Any part of such a load that fails fails the
whole load: vLLM recomputes from its own prefix (never KV without its state).

A state is stored as :attr:`StateFormat.pieces` objects in the engine's own namespace (each
the size of one of its KV chunks: the pool's slots for a namespace have one size), named by
precomputed hashes: the state layers' bytes at the boundary's blocks, layer after layer, cut
into pieces (the last one zero-padded). A piece's hash covers the format's signature (the
state layers, their shapes and dtypes: engines whose states differ never share one), the
prefix's identity (the chain hash of its tokens and the cache salt) and the piece's index.

Requirements, checked when the connector starts (otherwise it stays inactive, as for any
model it cannot serve): the ``"align"`` mode, one block size for every group, and a chunk
size that is a multiple of it (vLLM sizes a hybrid's blocks so that an attention block's
page is at least a state's: hundreds of tokens, e.g. 640 or 384 for the same model on two
CPUs, often not a divisor of tierkv's default 256: pin vLLM's ``block_size`` and set the
server's ``--chunk-size`` and the connector's ``chunk_size`` to a multiple of it). vLLM's
``"none"`` mode (prefix caching off) keeps only a request's current state and never hands
one over: such a model is served as a clean miss.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from tierkv import keys
from tierkv.arraycopy import copy_array, host_view
from tierkv.integrations.vllm.layout import layer_order

STATE_SPECS = ("MambaSpec",)
ATTENTION_SPECS = ("FullAttentionSpec", "SlidingWindowSpec")
_PREFIX_DIGEST = b"tierkv/prefix-id"  # the chain's namespace for prefix identities (16 bytes)
MAX_PROBES = 8  # lower chunk boundaries asked for a state before a request counts as a miss


class UnsupportedStateError(ValueError):
    """A model whose state groups the connector cannot store and restore exactly."""


@dataclass(frozen=True)
class StateFormat:
    """The state layers of a hybrid model, as the scheduler and every worker derive it from
    vLLM's KV cache config."""

    layers: tuple[str, ...]  # state layers, in layer order
    groups: tuple[int, ...]  # each layer's KV cache group
    layer_bytes: int  # one layer's state bytes in a block (its page's used part)
    piece_bytes: int  # a KV chunk's bytes: the size of each stored piece
    signature: bytes  # what the state bytes mean (layers, shapes, dtypes, kind)

    @property
    def state_groups(self) -> frozenset[int]:
        return frozenset(self.groups)

    @property
    def pieces(self) -> int:
        return math.ceil(len(self.layers) * self.layer_bytes / self.piece_bytes)

    def piece_hashes(self, prefix_id: bytes, salt: str) -> list[bytes]:
        """The pieces' 16-byte hashes for the state at the end of the prefix ``prefix_id``."""
        out = []
        for i in range(self.pieces):
            h = hashlib.blake2b(digest_size=16, person=b"tierkv-state")
            h.update(self.signature)
            h.update(prefix_id)
            h.update(salt.encode())
            h.update(i.to_bytes(4, "little"))
            out.append(h.digest())
        return out

    def segments(self, piece: int) -> list[tuple[int, int, int, int]]:
        """Where piece ``piece`` lies in the layers' bytes: (layer index, offset in the
        layer's state, offset in the piece, length) runs; bytes of the piece past the last
        run are padding."""
        start = piece * self.piece_bytes
        end = min(start + self.piece_bytes, len(self.layers) * self.layer_bytes)
        out = []
        pos = start
        while pos < end:
            layer, offset = divmod(pos, self.layer_bytes)
            n = min(self.layer_bytes - offset, end - pos)
            out.append((layer, offset, pos - start, n))
            pos += n
        return out


def state_format(kv_cache_config: Any, chunk_size: int) -> StateFormat | None:
    """The model's :class:`StateFormat`; None for a model without state groups. Raises
    :class:`UnsupportedStateError` saying why for state groups that cannot be served."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    state = [(g, group) for g, group in enumerate(groups) if _kind(group) in STATE_SPECS]
    if not state:
        return None
    others = sorted({_kind(group) for group in groups} - set(STATE_SPECS) - set(ATTENTION_SPECS))
    if others:
        raise UnsupportedStateError(f"tierkv does not serve state models with {others} groups")
    attention = [group for group in groups if _kind(group) in ATTENTION_SPECS]
    if not attention:
        raise UnsupportedStateError("tierkv needs attention layers beside the state layers")
    modes = {str(getattr(group.kv_cache_spec, "mamba_cache_mode", "none")) for _, group in state}
    if modes != {"align"}:
        raise UnsupportedStateError(
            f"tierkv stores MambaSpec states only where vLLM hands them over, in its Mamba "
            f"cache mode 'align' (its prefix caching on); this engine's is {sorted(modes)}"
        )
    sizes = {int(group.kv_cache_spec.block_size) for group in groups}
    if len(sizes) != 1:
        raise UnsupportedStateError(f"tierkv needs one block size in every group: {sorted(sizes)}")
    (block_size,) = sizes
    if chunk_size % block_size:
        raise UnsupportedStateError(
            f"tierkv chunk size {chunk_size} is not a multiple of the hybrid model's block size "
            f"{block_size}: set the server's --chunk-size and the connector's chunk_size to a "
            f"multiple of {block_size} (and vLLM's block size, which depends on the hardware "
            f"when left to vLLM, to {block_size} or a divisor of the chunk size at least that)"
        )
    specs = {_describe(group.kv_cache_spec) for _, group in state}
    if len(specs) != 1:
        raise UnsupportedStateError(f"tierkv needs one state shape in every state group: {specs}")
    spec = state[0][1].kv_cache_spec
    layer_bytes = int(getattr(spec, "real_page_size_bytes", 0) or _used_bytes(spec))
    layers = sorted(
        ((name, g) for g, group in state for name in group.layer_names),
        key=lambda item: layer_order(item[0]),
    )
    per_block = sum(
        int(group.kv_cache_spec.page_size_bytes) * len(group.layer_names) for group in attention
    )
    signature = hashlib.blake2b(
        repr((next(iter(specs)), [name for name, _ in layers])).encode(), digest_size=16
    ).digest()
    return StateFormat(
        layers=tuple(name for name, _ in layers),
        groups=tuple(g for _, g in layers),
        layer_bytes=layer_bytes,
        piece_bytes=per_block * (chunk_size // block_size),
        signature=signature,
    )


def prefix_id(tokens: Sequence[int], chunk_size: int) -> bytes:
    """The identity of a prefix of whole chunks: the chain hash of its last chunk (the cache
    salt goes into the piece hashes)."""
    return keys.chunk_hashes(_PREFIX_DIGEST, tokens, chunk_size)[-1]


class StateLayout:
    """A worker's view of its state layers: each layer's block pages as byte rows."""

    def __init__(self, fmt: StateFormat, kv_caches: Mapping[str, Any]) -> None:
        self.format = fmt
        self._rows: list[Any] = []
        for name in fmt.layers:
            tensor = kv_caches[name]
            # [blocks, page bytes as stored]: a view (a reshape could copy, and loads would
            # then write into the copy), which raises where the pages are not rows of bytes.
            rows = tensor.view(tensor.shape[0], -1)
            if rows.shape[1] * rows.element_size() < fmt.layer_bytes:
                raise UnsupportedStateError(
                    f"state layer {name}: {rows.shape[1] * rows.element_size()} bytes per "
                    f"block, {fmt.layer_bytes} expected"
                )
            host = host_view(rows)
            self._rows.append(host.view(np.uint8) if host is not None else rows)

    def gather(self, piece: int, block_ids: Sequence[int], dst: npt.NDArray[Any]) -> None:
        """Fill ``dst`` (a piece's slot, any shape) with piece ``piece`` of the state in
        ``block_ids`` (one per state layer)."""
        out = dst.reshape(-1).view(np.uint8)
        end = 0
        for layer, offset, at, n in self.format.segments(piece):
            self._copy(out[at : at + n], layer, block_ids[layer], offset, n, store=True)
            end = at + n
        out[end:] = 0

    def scatter(self, piece: int, block_ids: Sequence[int], src: npt.NDArray[Any]) -> None:
        """Write piece ``piece`` (a slot) into the state layers' blocks ``block_ids``."""
        data = src.reshape(-1).view(np.uint8)
        for layer, offset, at, n in self.format.segments(piece):
            self._copy(data[at : at + n], layer, block_ids[layer], offset, n, store=False)

    def _copy(
        self, slot: npt.NDArray[Any], layer: int, block: int, offset: int, n: int, store: bool
    ) -> None:
        rows = self._rows[layer]
        if isinstance(rows, np.ndarray):
            page = rows[block, offset : offset + n]
            if store:
                copy_array(slot, page)
            else:
                copy_array(page, slot)
            return
        import torch  # a device cache: one copy across, through torch, straight to the slot

        page = rows[block].view(torch.uint8)[offset : offset + n]
        if store:
            torch.from_numpy(slot).copy_(page)
        else:
            page.copy_(torch.from_numpy(np.ascontiguousarray(slot)))


def _kind(group: Any) -> str:
    return type(group.kv_cache_spec).__name__


def _used_bytes(spec: Any) -> int:
    import torch

    return sum(
        math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)
    )


def _describe(spec: Any) -> str:
    kind = getattr(spec, "mamba_type", "")
    return (
        f"{getattr(kind, 'name', kind)}|{tuple(map(tuple, spec.shapes))}|"
        f"{tuple(str(d) for d in spec.dtypes)}|{int(spec.page_size_bytes)}"
    )
