"""KV events of the pool in vLLM's form, against vLLM's own: a chunk's note describes its
blocks exactly as vLLM's block pool does when it caches them (hashes, parent, token ids,
LoRA, cache salt, group), and ranks' parts announce a chunk only when all are held."""

from __future__ import annotations

import msgspec
import pytest

try:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from tierkv.chunk_follower import Change
    from tierkv.integrations.vllm.kv_events import (
        MEDIUM,
        NoteGroup,
        RankedBlocks,
        Reannouncement,
        chunk_note,
        removed_events,
        stored_events,
    )
except ImportError:  # the conftest fails every test with the reason
    pass

pytestmark = pytest.mark.vllm

BLOCK = 16
CHUNK_BLOCKS = 4  # a chunk of 64 tokens


def request(tokens: list[int], **kw: object) -> Request:
    init_none_hash(sha256_cbor)
    return Request(
        "r",
        tokens,
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(BLOCK, sha256_cbor),
        **kw,  # type: ignore[arg-type]
    )


def vllms_own(req: Request, first: int, count: int, group: int = 0) -> BlockStored:
    """The event vLLM's block pool emits for caching blocks first..first+count of req."""
    pool = BlockPool(64, enable_caching=True, hash_block_size=BLOCK, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(first + count)
    if first:
        pool.cache_full_blocks(req, blocks[:first], 0, first, BLOCK, group)
        pool.take_events()
    pool.cache_full_blocks(req, blocks, first, first + count, BLOCK, group)
    (event,) = pool.take_events()
    assert isinstance(event, BlockStored)
    return event


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"cache_salt": "tenant-7"},
        {"lora_request": ("adapter-a", 3, "/nowhere")},  # made in the test: vLLM's type
    ],
    ids=["plain", "cache_salt", "lora"],
)
@pytest.mark.parametrize("chunk", [0, 1, 2])
def test_a_notes_event_is_vllms_own_event_in_the_pools_medium(
    kw: dict[str, object], chunk: int
) -> None:
    if "lora_request" in kw:
        kw = {"lora_request": LoRARequest(*kw["lora_request"])}
    req = request(list(range(1000, 1000 + 3 * CHUNK_BLOCKS * BLOCK + 5)), **kw)
    first = chunk * CHUNK_BLOCKS
    (ours,) = stored_events(chunk_note(req, first, CHUNK_BLOCKS, BLOCK))
    theirs = vllms_own(req, first, CHUNK_BLOCKS)
    assert ours.medium == MEDIUM and theirs.medium == "GPU"
    for field in BlockStored.__struct_fields__:
        if field != "medium":
            assert getattr(ours, field) == getattr(theirs, field), field
    assert len(ours.block_hashes) == CHUNK_BLOCKS and len(ours.token_ids) == CHUNK_BLOCKS * BLOCK
    (removed,) = removed_events(chunk_note(req, first, CHUNK_BLOCKS, BLOCK))
    assert removed == BlockRemoved(block_hashes=theirs.block_hashes, medium=MEDIUM, group_idx=0)


def test_under_hma_a_note_holds_each_groups_event_with_the_groups_fields() -> None:
    """vLLM's hybrid allocator: one event per KV cache group (as vLLM's block pool emits per
    group), with the group's kind and window as vLLM's own CPU offloading adds them."""
    req = request(list(range(500, 500 + 2 * CHUNK_BLOCKS * BLOCK)))
    groups = [NoteGroup(0, "full_attention"), NoteGroup(1, "sliding_window", 128)]
    note = chunk_note(req, CHUNK_BLOCKS, CHUNK_BLOCKS, BLOCK, groups)
    ours = stored_events(note)
    assert [e.group_idx for e in ours] == [0, 1]
    for event, group in zip(ours, groups, strict=True):
        theirs = vllms_own(req, CHUNK_BLOCKS, CHUNK_BLOCKS, group=group.idx)
        assert event.kv_cache_spec_kind == group.kind
        assert event.kv_cache_spec_sliding_window == group.sliding_window
        for field in BlockStored.__struct_fields__:
            if field not in ("medium", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"):
                assert getattr(event, field) == getattr(theirs, field), field
    assert removed_events(note) == [
        BlockRemoved(block_hashes=ours[0].block_hashes, medium=MEDIUM, group_idx=g.idx)
        for g in groups
    ]


def test_a_chunk_beyond_the_requests_hashes_is_refused() -> None:
    req = request(list(range(2 * BLOCK)))
    with pytest.raises(ValueError, match="2 block hashes, not 4"):
        chunk_note(req, 0, 4, BLOCK)


def test_ranks_announce_a_chunk_once_every_part_is_held_and_withdraw_it_at_the_first_loss() -> None:
    req = request(list(range(2 * CHUNK_BLOCKS * BLOCK)))
    n0, n1 = (chunk_note(req, c * CHUNK_BLOCKS, CHUNK_BLOCKS, BLOCK) for c in range(2))
    blocks = RankedBlocks(ranks=2)
    assert blocks.events([Change(True, b"r0c0", n0), Change(True, b"r0c1", n1)]) == []
    (stored,) = blocks.events([Change(True, b"r1c0", n0)])
    assert isinstance(stored, BlockStored) and [stored] == stored_events(n0)
    assert blocks.events([Change(True, b"r1c0", n0)]) == []  # told twice: once announced
    (removed,) = blocks.events([Change(False, b"r0c0", n0)])
    assert [removed] == removed_events(n0)
    assert blocks.events([Change(False, b"r1c0", n0), Change(False, b"r0c1", n1)]) == []
    # Another engine's note in another form is announced as nothing, never as garbage.
    one = RankedBlocks(ranks=1)
    notes = [b"not a vLLM event", msgspec.msgpack.encode({"block_hashes": 1}), n1]
    changes = [Change(True, f"k{i}".encode(), n) for i, n in enumerate(notes)]
    assert one.events(changes) == stored_events(n1)


def test_every_held_chunk_is_announced_again_once_per_interval_spread_over_the_takes() -> None:
    """A router that subscribed late learns what the pool holds from the re-announcement:
    each chunk every ranks hold, once per interval, oldest first (parents before children),
    a share at each take; none before one interval has passed; a chunk let go meanwhile is
    not announced again; a take after a long pause starts a new cycle at once."""
    now = [0.0]
    blocks = RankedBlocks(ranks=1)
    again = Reannouncement(10.0, clock=lambda: now[0])
    req = request(list(range(8 * CHUNK_BLOCKS * BLOCK)))
    notes = [chunk_note(req, c * CHUNK_BLOCKS, CHUNK_BLOCKS, BLOCK) for c in range(8)]
    blocks.events([Change(True, f"k{i}".encode(), n) for i, n in enumerate(notes)])
    half = RankedBlocks(ranks=2)  # a chunk one rank of two holds is not announced
    half.events([Change(True, b"r0", notes[0])])
    assert again.due(blocks) == [] and Reannouncement(10.0, lambda: 11.0).due(half) == []
    now[0] = 9.9
    assert again.due(blocks) == []  # not before one interval
    now[0] = 10.0
    assert again.due(blocks) == notes[:1] and again.cycles == 1  # a new cycle: at once
    now[0] = 12.5
    assert again.due(blocks) == notes[1:2]  # a quarter of the interval: 2 of 8
    blocks.events([Change(False, b"k3", notes[3])])  # let go: not announced again
    now[0] = 15.0
    assert again.due(blocks) == [notes[2]]
    now[0] = 19.0
    assert again.due(blocks) == notes[4:8]
    assert again.due(blocks) == []  # the cycle is done; the next one in 1 s
    now[0] = 20.0
    assert again.due(blocks) == notes[:1] and again.cycles == 2
    now[0] = 100.0  # a long pause (an idle engine takes nothing): the rest at once
    assert again.due(blocks) == [notes[1], notes[2], *notes[4:8]]
    assert again.due(blocks) == notes[:1] and again.cycles == 3
    assert Reannouncement(0.0, lambda: 1e9).due(blocks) == []  # 0: never
    with pytest.raises(ValueError, match="must not be negative"):
        Reannouncement(-1.0)
