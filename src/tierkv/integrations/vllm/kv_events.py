"""KV events for routers: what the tierkv pool holds, in vLLM's own event format.

KV-aware routers (llm-d's kv-cache scorer, Dynamo's KV router) learn where a prompt's blocks
are from the KV events engines publish. The pool is shared by every engine attached to the
server, so each engine announces what any of them stored, and withdraws what the pool let
go, whoever stored it:

- When the connector plans the store of a chunk, it describes the chunk's vLLM blocks as
  vLLM's block pool would (:func:`chunk_note`: a ``BlockStored`` of the chunk's blocks, with
  vLLM's block hashes in vLLM's event form, parent hash, token ids, block size, LoRA, extra
  keys and the group's fields) and gives the encoded event to the server as the chunk's note
  (:mod:`tierkv.server.chunk_feed`).
- The scheduler side follows the server's chunk feed for its engine's namespaces
  (:class:`tierkv.chunk_follower.ChunkFollower`) and turns the changes into vLLM's events
  (:class:`RankedBlocks`): ``BlockStored`` with ``medium="CPU"`` for chunks now held,
  ``BlockRemoved`` (``medium="CPU"``) for chunks no longer held. (The connector does not
  publish them yet: its scheduler side is to poll the feed and return them from
  ``take_events``.)
- With several ranks that each store their own part of a chunk (tensor parallelism without
  MLA), the blocks are announced once every rank's part is held, and withdrawn as soon as
  one part goes (:class:`RankedBlocks`): a lookup serves only what every rank holds.

A server that restarted, or a feed read too late, is a resync: the follower queues the
difference between what was announced and what the pool holds, so the stream converges.
``AllBlocksCleared`` is never sent: to a router it clears the engine's GPU blocks too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

from tierkv.chunk_follower import Change

log = logging.getLogger(__name__)

MEDIUM = "CPU"  # the pool is host memory (vLLM's MEDIUM_CPU)
POLL_INTERVAL = 0.1  # seconds between reads of the chunk feed

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(BlockStored).decode


def chunk_note(
    request: Any,
    first_block: int,
    num_blocks: int,
    block_size: int,
    group_idx: int | None = None,
    spec_kind: str | None = None,
    sliding_window: int | None = None,
) -> bytes:
    """The note of a chunk: vLLM's ``BlockStored`` for ``num_blocks`` blocks of ``request``
    from ``first_block`` on, as vLLM's block pool builds it for blocks it caches (the
    medium is set when the event is published)."""
    hashes = request.block_hashes
    end = first_block + num_blocks
    if len(hashes) < end:
        raise ValueError(f"the request has {len(hashes)} block hashes, not {end}")
    extra: list[tuple[Any, ...] | None] = []
    mm_idx = 0
    for block in range(first_block, end):
        keys, mm_idx = generate_block_hash_extra_keys(
            request, block * block_size, (block + 1) * block_size, mm_idx
        )
        extra.append(keys)
    lora = request.lora_request
    event = BlockStored(
        block_hashes=[maybe_convert_block_hash(h) for h in hashes[first_block:end]],
        parent_block_hash=(
            maybe_convert_block_hash(hashes[first_block - 1]) if first_block else None
        ),
        token_ids=list(request.all_token_ids[first_block * block_size : end * block_size]),
        block_size=block_size,
        lora_id=lora.adapter_id if lora else None,
        medium=None,
        lora_name=lora.name if lora else None,
        extra_keys=to_event_extra_keys(extra),
        group_idx=group_idx,
        kv_cache_spec_kind=spec_kind,
        kv_cache_spec_sliding_window=sliding_window,
    )
    return _encode(event)


def stored_event(note: bytes) -> BlockStored:
    """The event a note announces, in the pool's medium."""
    event = _decode(note)
    # extra_keys decode as lists; vLLM's own events carry tuples
    keys = event.extra_keys
    return msgspec.structs.replace(
        event,
        medium=MEDIUM,
        extra_keys=[tuple(k) if k is not None else None for k in keys] if keys else keys,
    )


def removed_event(note: bytes) -> BlockRemoved:
    stored = _decode(note)
    return BlockRemoved(block_hashes=stored.block_hashes, medium=MEDIUM, group_idx=stored.group_idx)


class RankedBlocks:
    """Changes of per-rank chunks -> events for chunks that every rank holds. Ranks describe
    the same blocks with the same note, so a note held by ``ranks`` keys is announced, and
    withdrawn when the first of them goes."""

    def __init__(self, ranks: int) -> None:
        if ranks < 1:
            raise ValueError("ranks must be at least 1")
        self.ranks = ranks
        self._holders: dict[bytes, set[bytes]] = {}  # note -> keys (one per rank) held

    def events(self, changes: Iterable[Change]) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        for change in changes:
            keys = self._holders.get(change.note)
            if change.held:
                if keys is None:
                    keys = self._holders[change.note] = set()
                before = len(keys)
                keys.add(change.key)
                if before < self.ranks <= len(keys):
                    out.append(_checked(stored_event, change.note))
            elif keys is not None and change.key in keys:
                complete = len(keys) >= self.ranks
                keys.discard(change.key)
                if not keys:
                    del self._holders[change.note]
                if complete:
                    out.append(_checked(removed_event, change.note))
        return [e for e in out if e is not None]


def _checked(build: Callable[[bytes], KVCacheEvent], note: bytes) -> KVCacheEvent | None:
    try:
        return build(note)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        # Another engine's note in another form (another tierkv or vLLM version):
        # announcing nothing is safe, announcing garbage is not.
        log.debug("a chunk note that is not a vLLM BlockStored: %s", exc)
        return None
