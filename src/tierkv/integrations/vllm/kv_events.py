"""KV events for routers: what the tierkv pool holds, in vLLM's own event format.

KV-aware routers (llm-d's kv-cache scorer, Dynamo's KV router) learn where a prompt's blocks
are from the KV events engines publish. The pool is shared by every engine attached to the
server, so each engine announces what any of them stored, and withdraws what the pool let
go, whoever stored it:

- When the connector plans the store of a chunk, it describes the chunk's vLLM blocks as
  vLLM's block pool would (:func:`chunk_note`: a ``BlockStored`` of the chunk's blocks per KV
  cache group, with vLLM's block hashes in vLLM's event form, parent hash, token ids, block
  size, LoRA, extra keys and the group's fields) and gives the encoded list to the server as
  the chunk's note (:mod:`tierkv.server.chunk_feed`).
- The scheduler side follows the server's chunk feed for its engine's namespaces on a thread
  (:class:`tierkv.integrations.feed_poller.FeedPoller`: a dead or slow server never holds
  the engine's step up; while the link to it is down everything is withdrawn, since every
  lookup is then a miss) and turns the changes into vLLM's events
  (:class:`RankedBlocks`): ``BlockStored`` with ``medium="CPU"`` for chunks now held,
  ``BlockRemoved`` (``medium="CPU"``) for chunks no longer held (:class:`PoolEvents`, which
  the connector's scheduler side returns from ``take_events``).
- With several ranks that each store their own part of a chunk (tensor parallelism without
  MLA), the blocks are announced once every rank's part is held, and withdrawn as soon as
  one part goes (:class:`RankedBlocks`): a lookup serves only what every rank holds.

A server that restarted, or a feed read too late, is a resync: the follower queues the
difference between what was announced and what the pool holds, so the stream converges. An
engine that (re)starts reads a snapshot first, so its stream announces everything the pool
holds for it. A router that subscribes late has missed what was announced before: vLLM's
replay endpoint (``kv_events_config.replay_endpoint``; Dynamo's router uses it after a gap)
serves its last ``buffer_steps`` batches, and llm-d's indexer reads no replay at all. So the
connector announces every held chunk again once per ``kv_events_reannounce_interval``
(:class:`Reannouncement`), spread over the interval's steps: a late router knows what the
pool holds within two intervals while the engine runs requests (an idle engine publishes
nothing). A ``BlockStored`` for a block a router already has changes nothing there.
``AllBlocksCleared`` is never sent: to a router it clears the engine's GPU blocks too.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

from tierkv.chunk_follower import Change
from tierkv.integrations.feed_poller import FeedPoller
from tierkv.integrations.link import ServerLink

log = logging.getLogger(__name__)

MEDIUM = "CPU"  # the pool is host memory (vLLM's MEDIUM_CPU)
POLL_INTERVAL = 0.1  # seconds between reads of the chunk feed
REANNOUNCE_INTERVAL = 30.0  # seconds: every held chunk is announced again once per interval

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(list[BlockStored]).decode


@dataclass(frozen=True, slots=True)
class NoteGroup:
    """A KV cache group a chunk's blocks are announced for: vLLM's ``group_idx``, and under
    its hybrid allocator (several groups) the group's spec kind and sliding window, as vLLM's
    own CPU offloading describes them (without it, vLLM's block pool leaves them out)."""

    idx: int = 0
    kind: str | None = None
    sliding_window: int | None = None


ONE_GROUP = (NoteGroup(),)


def chunk_note(
    request: Any,
    first_block: int,
    num_blocks: int,
    block_size: int,
    groups: Sequence[NoteGroup] = ONE_GROUP,
) -> bytes:
    """The note of a chunk: vLLM's ``BlockStored`` for ``num_blocks`` blocks of ``request``
    from ``first_block`` on, one per KV cache group, as vLLM's block pool builds them for
    blocks it caches (the medium is set when the events are published), encoded as a list.
    ``block_size`` must be the granularity of ``request.block_hashes``."""
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
    )
    return _encode(
        [
            msgspec.structs.replace(
                event,
                group_idx=g.idx,
                kv_cache_spec_kind=g.kind,
                kv_cache_spec_sliding_window=g.sliding_window,
            )
            for g in groups
        ]
    )


def stored_events(note: bytes) -> list[BlockStored]:
    """The events a note announces (one per group), in the pool's medium."""
    return [
        msgspec.structs.replace(
            event,
            medium=MEDIUM,
            # extra_keys decode as lists; vLLM's own events carry tuples
            extra_keys=(
                [tuple(k) if k is not None else None for k in event.extra_keys]
                if event.extra_keys
                else event.extra_keys
            ),
        )
        for event in _decode(note)
    ]


def removed_events(note: bytes) -> list[BlockRemoved]:
    """The events that withdraw what a note announced."""
    return [
        BlockRemoved(block_hashes=e.block_hashes, medium=MEDIUM, group_idx=e.group_idx)
        for e in _decode(note)
    ]


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
                    out += _checked(stored_events, change.note)
            elif keys is not None and change.key in keys:
                complete = len(keys) >= self.ranks
                keys.discard(change.key)
                if not keys:
                    del self._holders[change.note]
                if complete:
                    out += _checked(removed_events, change.note)
        return out

    def held(self) -> Iterator[bytes]:
        """The notes of the chunks every rank holds (announced), oldest first: a chunk's
        prefix was stored before it, so a router meets parents before their children."""
        return (note for note, keys in self._holders.items() if len(keys) >= self.ranks)

    def holds(self, note: bytes) -> bool:
        keys = self._holders.get(note)
        return keys is not None and len(keys) >= self.ranks


class Reannouncement:
    """Every held chunk announced again once per ``interval`` seconds, a share of them at
    each take (the share of the interval that has passed), so a large pool's announcements
    spread over the steps instead of weighing on one. A cycle starts when the last one has
    ended and a whole interval has passed since it started; it goes through the chunks held
    at its start, skipping those no longer held. ``interval`` 0: never."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        if interval < 0:
            raise ValueError("the re-announcement interval must not be negative")
        self.interval = interval
        self.clock = clock
        self.cycles = 0  # cycles started
        self._started = clock()  # the first cycle starts one interval after the engine
        self._cycle: list[bytes] = []
        self._done = 0

    def due(self, blocks: RankedBlocks) -> list[bytes]:
        """The notes to announce again now."""
        if not self.interval:
            return []
        now = self.clock()
        elapsed = now - self._started
        if self._done >= len(self._cycle) and elapsed >= self.interval:
            self._cycle, self._done, self._started, elapsed = list(blocks.held()), 0, now, 0.0
            self.cycles += 1
        end = min(len(self._cycle), math.ceil(len(self._cycle) * elapsed / self.interval))
        if elapsed == 0.0 and self._cycle:
            end = max(end, 1)  # a new cycle announces at once, then spreads the rest
        notes = [n for n in self._cycle[self._done : end] if blocks.holds(n)]
        self._done = max(self._done, end)
        return notes


def _checked(build: Callable[[bytes], Sequence[KVCacheEvent]], note: bytes) -> list[KVCacheEvent]:
    try:
        return list(build(note))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        # Another engine's note in another form (another tierkv or vLLM version):
        # announcing nothing is safe, announcing garbage is not.
        log.debug("a chunk note that is not a list of vLLM BlockStored: %s", exc)
        return []


class PoolEvents:
    """The scheduler side's KV events: the chunk feed of its link's engine, read on a thread
    (:class:`~tierkv.integrations.feed_poller.FeedPoller`), as vLLM's events for blocks that
    ``ranks`` parts make (:class:`RankedBlocks`)."""

    def __init__(
        self,
        link: ServerLink,
        ranks: int,
        interval: float = POLL_INTERVAL,
        reannounce_interval: float = REANNOUNCE_INTERVAL,
    ) -> None:
        self.blocks = RankedBlocks(ranks)
        self.reannouncement = Reannouncement(reannounce_interval)
        self.poller = FeedPoller(link, interval, "tierkv-kv-events").start()

    def take(self) -> list[KVCacheEvent]:
        """The events since the last take, and this take's share of the re-announcement
        (never waits on the server)."""
        changes = self.poller.take()
        events = self.blocks.events(changes) if changes else []
        for note in self.reannouncement.due(self.blocks):
            events += _checked(stored_events, note)
        return events

    def close(self) -> None:
        self.poller.close()
