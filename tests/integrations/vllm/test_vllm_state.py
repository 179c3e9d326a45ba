"""A hybrid model's state groups (Mamba/GDN): the states vLLM hands over are stored beside the
KV, and a prefix is served only up to a chunk whose state is restored with it
(``tierkv.integrations.vllm.state``). The scheduler and worker roles run against a real
server, with real paged CPU caches and a state layer's raw int8 pages as vLLM hands them over;
the real engine runs in test_vllm_e2e.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from support import vllm_engine

try:
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    from tierkv.integrations.vllm.layout import CacheGeometry
    from tierkv.integrations.vllm.scheduler import SchedulerSide
    from tierkv.integrations.vllm.settings import ConnectorSettings
    from tierkv.integrations.vllm.state import (
        StateFormat,
        StateLayout,
        UnsupportedStateError,
        state_format,
    )
    from tierkv.integrations.vllm.worker import WorkerSide
except ImportError:  # the conftest fails every test with the reason
    pass

pytestmark = pytest.mark.vllm

CHUNK, BLOCK = 256, 128  # two blocks per chunk
LAYERS, HEADS, HEAD, NUM_BLOCKS = 2, 2, 64, 32
STATE_LAYER = "model.layers.2.linear_attn"
PAGE = 2 * BLOCK * HEADS * HEAD * 4  # an attention layer's block (float32): the state's page
STATE_SHAPES = ((3, 512), (8, 32, 16))  # conv and recurrent state: 22,528 bytes
STATE_BYTES = 3 * 512 * 4 + 8 * 32 * 16 * 4


def mamba(mode: str = "align", block: int = BLOCK, **kw: Any) -> Any:
    return MambaSpec(
        block_size=block,
        shapes=kw.pop("shapes", STATE_SHAPES),
        dtypes=(torch.float32, torch.float32),
        page_size_padded=PAGE,
        mamba_cache_mode=mode,
        **kw,
    )


def attention(block: int = BLOCK) -> Any:
    return FullAttentionSpec(
        block_size=block, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32
    )


def config(*groups: tuple[list[str], Any]) -> Any:
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups],
    )


ATTENTION_LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def hybrid(mode: str = "align") -> Any:
    """Two attention layers in group 0, one state layer in group 1 (block ids per group)."""
    return config((ATTENTION_LAYERS, attention()), ([STATE_LAYER], mamba(mode)))


# -- the format ------------------------------------------------------------------------------
def test_the_state_format_of_a_hybrid_and_why_others_are_refused() -> None:
    """A hybrid in vLLM's "align" mode with a chunk size a multiple of its block size gets a
    format (its state layers, their bytes, pieces of a KV chunk's size); a model without
    state groups gets none; the "none" mode (vLLM's prefix caching off), a chunk size that
    is no multiple of the block size, state groups of different shapes and a model of state
    layers alone are refused, each with the reason."""
    fmt = state_format(hybrid(), CHUNK)
    assert fmt is not None
    assert fmt.layers == (STATE_LAYER,) and fmt.groups == (1,)
    assert fmt.layer_bytes == STATE_BYTES
    assert fmt.piece_bytes == LAYERS * PAGE * (CHUNK // BLOCK) and fmt.pieces == 1
    assert state_format(config((ATTENTION_LAYERS, attention())), CHUNK) is None
    with pytest.raises(UnsupportedStateError, match=r"'align'.*this engine's is \['none'\]"):
        state_format(hybrid("none"), CHUNK)
    with pytest.raises(UnsupportedStateError, match=r"chunk size 256 is not a multiple of.* 384"):
        state_format(
            config((ATTENTION_LAYERS, attention(384)), ([STATE_LAYER], mamba(block=384))), CHUNK
        )
    other = mamba(shapes=((3, 256), (8, 32, 16)))
    with pytest.raises(UnsupportedStateError, match="one state shape"):
        state_format(
            config((ATTENTION_LAYERS, attention()), ([STATE_LAYER], mamba()), (["x.5"], other)),
            CHUNK,
        )
    with pytest.raises(UnsupportedStateError, match="attention layers beside"):
        state_format(config(([STATE_LAYER], mamba())), CHUNK)


def test_pieces_cover_every_state_byte_once_and_name_the_format_and_the_prefix() -> None:
    """Several state layers cut into pieces: the runs of all pieces cover each layer's bytes
    exactly once, in order; a piece's hash changes with the prefix, the salt and the format."""
    fmt = StateFormat(
        layers=("a", "b", "c"), groups=(1, 2, 3), layer_bytes=1000, piece_bytes=768, signature=b"s"
    )
    assert fmt.pieces == 4
    covered = []
    for piece in range(fmt.pieces):
        at = 0
        for layer, offset, in_piece, n in fmt.segments(piece):
            assert in_piece == at and 0 < n <= 768
            covered.append((layer, offset, n))
            at += n
    flat = [(layer, offset + i) for layer, offset, n in covered for i in range(n)]
    assert flat == [(layer, i) for layer in range(3) for i in range(1000)]
    one = fmt.piece_hashes(b"prefix-1", "")
    assert len(set(one)) == 4 and all(len(h) == 16 for h in one)
    assert one != fmt.piece_hashes(b"prefix-2", "") != fmt.piece_hashes(b"prefix-1", "salt")
    other = StateFormat(("a", "b", "c"), (1, 2, 3), 1000, 768, signature=b"t")
    assert other.piece_hashes(b"prefix-1", "") != one


def test_state_copies_through_torch_write_the_bytes_the_host_path_writes() -> None:
    """A cache numpy cannot view (on a GPU; here: a CPU tensor of 16-byte elements) is copied
    through torch, straight between its pages and the slot: gathers and scatters of pieces
    that span layers give the bytes the host path gives, pages not named stay as they were."""
    layers, blocks, page = ("s.0", "s.1", "s.2"), 6, 4096
    fmt = StateFormat(layers, (1, 1, 1), layer_bytes=3000, piece_bytes=2048, signature=b"s")
    gen = torch.Generator().manual_seed(7)
    raw = [torch.randint(0, 256, (blocks, page), dtype=torch.uint8, generator=gen) for _ in layers]
    host = StateLayout(fmt, {n: r.clone() for n, r in zip(layers, raw, strict=True)})
    wide = {n: r.clone().view(torch.complex128) for n, r in zip(layers, raw, strict=True)}
    device_like = StateLayout(fmt, wide)
    assert all(not isinstance(rows, np.ndarray) for rows in device_like._rows)  # torch's path
    at = [4, 1, 5]  # one block per layer
    for piece in range(fmt.pieces):
        a = np.full(fmt.piece_bytes, 0xAA, np.uint8)
        b = np.full(fmt.piece_bytes, 0x55, np.uint8)
        host.gather(piece, at, a)
        device_like.gather(piece, at, b)
        assert np.array_equal(a, b)
    new = np.random.default_rng(3).integers(0, 256, (fmt.pieces, fmt.piece_bytes), np.uint8)
    into = [2, 3, 0]
    for piece in range(fmt.pieces):
        host.scatter(piece, into, new[piece])
        device_like.scatter(piece, into, new[piece].copy())
    for i, name in enumerate(layers):
        got = wide[name].view(torch.uint8)
        assert torch.equal(got, torch.from_numpy(host._rows[i]))  # the host path's pages
        flat = new.reshape(-1)[i * fmt.layer_bytes : (i + 1) * fmt.layer_bytes]
        assert np.array_equal(got[into[i], : fmt.layer_bytes].numpy(), flat)
        untouched = [b for b in range(blocks) if b != into[i]]
        assert torch.equal(got[untouched], raw[i][untouched])


# -- both roles against a real server ----------------------------------------------------------
@dataclass
class Hybrid:
    scheduler: Any
    worker: Any
    kv: dict[str, Any]
    pages: Any  # the state layer's int8 pages, [blocks, PAGE]
    next_block: int = 1

    def blocks(self, n: int) -> tuple[list[int], list[int]]:
        """Block ids for ``n`` positions: attention and state groups (disjoint ids)."""
        ids = list(range(self.next_block, self.next_block + 2 * n))
        self.next_block += 2 * n
        return ids[:n], ids[n:]


def make_hybrid(endpoint: str, engine_id: str) -> Hybrid:
    fmt = state_format(hybrid(), CHUNK)
    settings = ConnectorSettings.from_extra_config({"endpoint": endpoint, "timeout": 5.0})
    scheduler = SchedulerSide(
        settings,
        model_id="hybrid-model",
        engine_id=engine_id,
        block_size=BLOCK,
        hash_block_size=BLOCK,
        use_block_hashes=False,
        can_load=True,
        can_save=True,
        state_format=fmt,
        tables_change=True,  # several KV cache groups
    )
    worker = WorkerSide(
        settings,
        model_id="hybrid-model",
        engine_id=engine_id,
        world_size=1,
        rank=0,
        can_load=True,
        can_save=True,
    )
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    kv = vllm_engine.vllm_cpu_caches(LAYERS, NUM_BLOCKS, BLOCK, HEADS, HEAD)
    generator = vllm_engine.fill_random(kv.values(), engine_id)
    pages = torch.randint(-128, 127, (NUM_BLOCKS, PAGE), dtype=torch.int8, generator=generator)
    backend = f"CPU_ATTN/{_get_attn_isa(torch.float32, BLOCK, HEAD)}"
    assert fmt is not None
    worker.register_kv_caches(
        kv,
        CacheGeometry(BLOCK, HEADS, HEAD),
        dict.fromkeys(kv, backend),
        groups=dict.fromkeys(kv, 0),
        state=StateLayout(fmt, {STATE_LAYER: pages.view(NUM_BLOCKS, 1, 1, PAGE)}),
    )
    return Hybrid(scheduler, worker, kv, pages)


request = vllm_engine.scheduler_request


def step(
    rid: str, groups: tuple[list[int], list[int]], scheduled: int, offers: list[Any] | None
) -> Any:
    """A step that computes a new request's first ``scheduled`` tokens; ``offers``: the
    state hand-offs vLLM makes in it ((group, block id, tokens), or None: no block state)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=groups, num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
        ),
        num_scheduled_tokens={rid: scheduled},
        preempted_req_ids=set(),
        kv_connector_block_state=SimpleNamespace(
            boundary_state_offloads={rid: offers} if offers else {},
            get_block_ids=lambda r: groups if r == rid else None,
        ),
    )


TOKENS = list(range(3000, 3000 + 600))  # 2 whole chunks (4 blocks) and 88 more tokens


def compute(
    engine: Hybrid, rid: str, offer_at: int | None, reserve_first: bool = True
) -> tuple[list[int], list[int]]:
    """A request vLLM computes (whatever the lookup found); with ``offer_at`` vLLM hands over
    the state at that token (the state group's block at that position). ``reserve_first``:
    the stores are reserved before the forward pass, as binding the step's metadata does in
    vLLM; otherwise each store reserves its slots itself. Returns its block ids."""
    req = request(rid, TOKENS)
    engine.scheduler.get_num_new_matched_tokens(req, 0)
    attn, state = engine.blocks(-(-len(TOKENS) // BLOCK))
    positions = list(zip(attn, state, strict=True))
    engine.scheduler.update_state_after_alloc(req, positions, 0)  # vLLM computes it all
    offers = None if offer_at is None else [(1, state[offer_at // BLOCK - 1], offer_at)]
    meta = engine.scheduler.build_connector_meta(step(rid, (attn, state), len(TOKENS), offers))
    if reserve_first:
        engine.worker.prepare_stores(meta)
    engine.worker.wait_for_save(meta)
    engine.scheduler.request_finished(req)
    return attn, state


def look_up(engine: Hybrid, rid: str) -> tuple[Any, int, list[int], list[int]]:
    req = request(rid, TOKENS)
    external, _ = engine.scheduler.get_num_new_matched_tokens(req, 0)
    assert external is not None
    attn, state = engine.blocks(-(-len(TOKENS) // BLOCK))
    return req, external, attn, state


def run_load(engine: Hybrid, req: Any, attn: list[int], state: list[int], external: int) -> None:
    engine.scheduler.update_state_after_alloc(req, list(zip(attn, state, strict=True)), external)
    meta = engine.scheduler.build_connector_meta(step(req.request_id, (attn, state), 0, None))
    engine.worker.start_load_kv(meta)
    engine.worker.wait_for_save(meta)


@pytest.fixture
def engines(server_factory: Callable[..., Any]) -> Any:
    server = server_factory()
    made: list[Hybrid] = []

    def make(engine_id: str) -> Hybrid:
        made.append(make_hybrid(server.endpoint, engine_id))
        return made[-1]

    yield make
    for engine in made:
        engine.scheduler.shutdown()
        engine.worker.shutdown()


def test_a_handed_over_state_is_stored_and_a_fresh_engine_loads_it_with_the_kv(
    engines: Callable[[str], Hybrid],
) -> None:
    """A computes a 600-token prompt and vLLM hands over the state at token 512 (a chunk's
    end): A stores the 2 KV chunks and the state (its slots reserved during the forward pass,
    as the chunks' are; C, computing it again without that, finds it held). B, a fresh
    engine, looks the prompt up:
    512 tokens, and its load writes the KV into its attention blocks and the state into its
    state group's block at the prefix's last position, byte for byte."""
    a, b = engines("engine-a"), engines("engine-b")
    a_attn, a_state = compute(a, "a-1", offer_at=512)
    assert a.worker.stats["stored_states"] == 1
    # The same prompt computed again, its stores not reserved first: the state is held.
    c = engines("engine-c")
    compute(c, "c-1", offer_at=512, reserve_first=False)
    assert c.worker.stats["stored_states"] == 1 and c.worker.stats["state_store_bytes"] == 0
    req, external, attn, state = look_up(b, "b-1")
    assert external == 512
    run_load(b, req, attn, state, external)
    assert b.worker.get_failed_loads() == set()
    assert b.worker.stats["loaded_states"] == 1
    for i in range(512 // BLOCK):
        for name in ATTENTION_LAYERS:
            assert torch.equal(b.kv[name][attn[i]], a.kv[name][a_attn[i]])
    position = 512 // BLOCK - 1
    assert torch.equal(
        b.pages[state[position], :STATE_BYTES], a.pages[a_state[position], :STATE_BYTES]
    )


def test_kv_without_its_state_is_never_served(engines: Callable[[str], Hybrid]) -> None:
    """The KV chunks are in the pool, but no state is: none handed over, or one at a token
    that ends no chunk (384). B's lookup finds no prefix it can use (0 tokens), where the
    same engine with the state hits."""
    for i, offer_at in enumerate((None, 384)):
        a, b = engines(f"a-{i}"), engines(f"b-{i}")
        compute(a, f"a-{i}", offer_at=offer_at)
        assert a.worker.stats["stored_states"] == 0
        req, external, _, _ = look_up(b, f"b-{i}")
        assert external == 0
        b.scheduler.request_finished(req)


def test_a_request_id_never_spells_another_requests_state_session(
    engines: Callable[[str], Hybrid],
) -> None:
    """A request's state is looked up in a server session of its own beside its KV's (named
    by the request id). It was ``<id>#state``: request ``x#state``, looked up in the step
    that plans x's load, replaced x's state session with its own KV lookup, and x's load
    retrieved a KV chunk as its state. The state session's name now holds a NUL, which no
    vLLM request id does (one that does is never looked up on a model with states)."""
    from tierkv.integrations.vllm.scheduler import state_session

    a, b = engines("engine-a"), engines("engine-b")
    _, a_state = compute(a, "a-1", offer_at=512)
    req, external, attn, state = look_up(b, "x")
    assert external == 512
    b.scheduler.update_state_after_alloc(req, list(zip(attn, state, strict=True)), external)
    for rid in ("x#state", state_session("x")):  # looked up before x's load
        b.scheduler.get_num_new_matched_tokens(request(rid, TOKENS[:300]), 0)
    meta = b.scheduler.build_connector_meta(step("x", (attn, state), 0, None))
    b.worker.start_load_kv(meta)
    b.worker.wait_for_save(meta)
    assert b.worker.get_failed_loads() == set() and b.worker.stats["loaded_states"] == 1
    position = 512 // BLOCK - 1
    assert torch.equal(
        b.pages[state[position], :STATE_BYTES], a.pages[a_state[position], :STATE_BYTES]
    )
    assert state_session("x") != "x#state" and "\x00" in state_session("x")


def test_group_tables_of_different_lengths_fail_the_load_not_the_engine(
    engines: Callable[[str], Hybrid],
) -> None:
    """With speculative decoding vLLM gives a state group more blocks than the attention
    groups (its lookahead), so the tables do not line up into positions: the load fails
    whole (vLLM recomputes), nothing is written, and nothing raises into vLLM's worker
    (before: an IndexError from the worker's load)."""
    from tierkv.integrations.vllm.chunks import block_positions

    a, b = engines("engine-a"), engines("engine-b")
    compute(a, "a-1", offer_at=512)
    req, external, attn, state = look_up(b, "b-1")
    assert external == 512
    groups = (attn[:4], state[:5])  # 4 attention blocks, 4 + 1 state blocks
    assert block_positions(groups) is None
    kv_before = {name: t.clone() for name, t in b.kv.items()}
    b.scheduler.update_state_after_alloc(req, [], external)  # what the connector passes
    b.worker.start_load_kv(b.scheduler.build_connector_meta(step("b-1", groups, 0, None)))
    assert b.worker.get_failed_loads() == {"b-1"}
    assert all(torch.equal(b.kv[name], kv_before[name]) for name in b.kv)


def test_a_prefix_of_another_length_than_its_state_fails_the_whole_load(
    engines: Callable[[str], Hybrid],
) -> None:
    """vLLM takes fewer tokens than the prefix whose state is held (256 of 512): the load
    fails whole (vLLM recomputes the request from its own prefix): no block is written,
    neither KV nor state."""
    a, b = engines("engine-a"), engines("engine-b")
    compute(a, "a-1", offer_at=512)
    req, external, attn, state = look_up(b, "b-1")
    assert external == 512
    kv_before = {name: t.clone() for name, t in b.kv.items()}
    pages_before = b.pages.clone()
    run_load(b, req, attn, state, 256)
    assert b.worker.get_failed_loads() == {"b-1"}
    assert b.worker.stats["loaded_states"] == 0
    assert all(torch.equal(b.kv[name], kv_before[name]) for name in b.kv)
    assert torch.equal(b.pages, pages_before)
