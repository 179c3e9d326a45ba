"""vLLM blocks and tierkv chunks: keys, ranges, and the load/store plans the scheduler sends.

A chunk is ``chunk_size`` tokens; a vLLM block is ``block_size`` tokens; chunk ``c`` covers
blocks ``c * bpc .. (c + 1) * bpc - 1`` of the request's block table, with ``bpc =
chunk_size // block_size`` (the chunk size must be a multiple of the block size).

Chunk keys come either from token ids (the server hashes them, prefix-chained) or from vLLM's
block hashes: those are prefix-chained too (each one covers every token before it, plus the
cache salt, LoRA and multimodal inputs), so the hash of a chunk's last block identifies the
whole prefix up to the end of that chunk.

A model with several KV cache groups (vLLM's hybrid allocator: full-attention and
sliding-window layers, all groups with one block size) has one block table per group; a block
position then holds one block id per group (:data:`BlockRef`). A sliding-window group holds
vLLM's null block (:data:`NULL_BLOCK`) where a position lies behind the window: never read,
never written, and a chunk with one is never stored (its KV is gone).

Everything here is plain Python (no vLLM, no torch), sent between processes with pickle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

NULL_BLOCK = 0  # vLLM's null block (its block pool's block 0)
BlockRef = int | tuple[int, ...]  # a position's block id, or one per KV cache group


def block_positions(groups: Sequence[Sequence[int]]) -> list[BlockRef] | None:
    """vLLM's block ids, one list per KV cache group, as one entry per block position (the
    id for one group, the ids of every group for several); None when the groups' tables
    differ in length (groups of different block sizes: not supported)."""
    if len(groups) == 1:
        return list(groups[0])
    if len({len(g) for g in groups}) > 1:
        return None
    return list(zip(*groups, strict=True))


def real_ids(ref: BlockRef) -> list[int]:
    """The block ids of a position, the null blocks of its groups left out (a model with
    one group never holds the null block in a request's table)."""
    if isinstance(ref, int):
        return [ref]
    return [i for i in ref if i != NULL_BLOCK]


def has_null(ref: BlockRef, ignore: frozenset[int] = frozenset()) -> bool:
    """A group holds the null block at this position (its KV is gone); groups in ``ignore``
    (a hybrid model's state groups, whose blocks hold states only at some positions) do not
    count."""
    if isinstance(ref, int):
        return False
    return any(b == NULL_BLOCK for g, b in enumerate(ref) if g not in ignore)


def blocks_per_chunk(chunk_size: int, block_size: int) -> int:
    """``chunk_size // block_size``; raises ValueError unless it divides evenly."""
    if block_size <= 0 or chunk_size <= 0 or chunk_size % block_size:
        raise ValueError(
            f"tierkv chunk size {chunk_size} is not a multiple of the vLLM block size "
            f"{block_size}: choose --block-size dividing the chunk size (or change the "
            "server's --chunk-size and the connector's chunk_size together)"
        )
    return chunk_size // block_size


def chunk_hashes(
    block_hashes: Sequence[bytes], num_chunks: int, chunk_size: int, hash_block_size: int
) -> list[bytes] | None:
    """The key hash of each of the first ``num_chunks`` chunks: the hash of the chunk's last
    hashed block. None when the block hashes do not cover that many chunks or the chunk size
    is not a multiple of the hashing granularity."""
    if hash_block_size <= 0 or chunk_size % hash_block_size:
        return None
    stride = chunk_size // hash_block_size
    if len(block_hashes) < num_chunks * stride:
        return None
    return [bytes(block_hashes[(c + 1) * stride - 1]) for c in range(num_chunks)]


@dataclass(frozen=True)
class StateLoad:
    """The state a hybrid model's load restores with its KV (see
    :mod:`tierkv.integrations.vllm.state`): retrieved by ``request_id`` (the scheduler's
    state lookup) into ``block_ids``, one per state layer; none when vLLM accepted a prefix
    that does not end where the state does: the whole load then fails."""

    request_id: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class StateStore:
    """Store the state in ``block_ids`` (one per state layer, written by this step's
    forward pass) as the pieces named ``hashes``."""

    request_id: str
    hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class LoadSpec:
    """Load blocks ``[start_block, end_block)`` of a request from the chunks its lookup locked
    (retrieve by request id). ``block_ids[i]`` is the vLLM block of block ``start_block + i``.
    Blocks before ``start_block`` were computed by vLLM itself and are never written (other
    requests may be reading them).

    ``hashes``/``tokens`` (keys of the chunks from chunk 0, as in :class:`StoreSpec`) and
    ``salt``: set for an MLA engine with several ranks, whose ranks other than 0 read the
    chunks rank 0 stores by key (the scheduler's lookup locked them for rank 0 only).
    ``state``: a hybrid model's state at the load's end."""

    request_id: str
    start_block: int
    end_block: int
    block_ids: tuple[BlockRef, ...]
    hashes: tuple[bytes, ...] | None = None
    tokens: bytes | None = None
    salt: str = ""
    state: StateLoad | None = None

    def blocks_of(self, chunk: int, bpc: int) -> list[tuple[int, BlockRef]]:
        """(position of the block within the chunk, vLLM block id) for every block of
        ``chunk`` that this load writes."""
        out = []
        for j in range(bpc):
            block = chunk * bpc + j
            if self.start_block <= block < self.end_block:
                out.append((j, self.block_ids[block - self.start_block]))
        return out

    def failed_blocks(self, loaded_chunks: set[int], bpc: int) -> list[int]:
        """vLLM block ids of every block in range whose chunk was not loaded completely."""
        end = min(self.end_block, self.start_block + len(self.block_ids))
        return [
            block_id
            for block in range(self.start_block, end)
            if block // bpc not in loaded_chunks
            for block_id in real_ids(self.block_ids[block - self.start_block])
        ]

    def first_failed_block(self, loaded_chunks: set[int], bpc: int) -> int | None:
        for block in range(self.start_block, self.end_block):
            if block // bpc not in loaded_chunks:
                return block
        return None


@dataclass(frozen=True)
class StoreSpec:
    """Store chunks ``[first_chunk, end_chunk)`` of a request from its blocks, after this
    step's forward pass computed them. Keys: ``hashes`` (one per chunk from chunk 0) or
    ``tokens`` (packed token ids of chunks ``[0, end_chunk)``). ``block_ids`` lists the
    blocks of chunks ``[first_chunk, end_chunk)`` in order. ``notes``: with vLLM's KV events
    on, one per chunk ``[first_chunk, end_chunk)``: the chunk's blocks as vLLM's events
    describe them (:func:`tierkv.integrations.vllm.kv_events.chunk_note`), for the server's
    chunk feed."""

    request_id: str
    first_chunk: int
    end_chunk: int
    block_ids: tuple[BlockRef, ...]
    hashes: tuple[bytes, ...] | None = None
    tokens: bytes | None = None
    salt: str = ""
    notes: tuple[bytes, ...] | None = None

    def blocks_of(self, chunk: int, bpc: int) -> tuple[BlockRef, ...]:
        start = (chunk - self.first_chunk) * bpc
        return self.block_ids[start : start + bpc]


def full_chunks(num_tokens: int, chunk_size: int) -> int:
    return max(0, num_tokens) // chunk_size
