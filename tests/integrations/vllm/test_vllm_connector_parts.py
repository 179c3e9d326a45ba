"""The connector's parts without the engine: block/chunk mapping, settings, and the scheduler
and worker roles driven by hand against a real tierkv server and real vLLM CPU KV caches.

The role tests play vLLM's part: they call the scheduler side the way vLLM's scheduler does
(lookup, allocation, per-step metadata) and hand the metadata to worker sides that own real
paged caches, then check the bytes that land in the blocks. The ``store_decode`` tests also play
decoding, step by step, in vLLM's synchronous order (the token sampled in a step is known when
the next one is planned) and in its async-scheduling order (known one step later). The
``async_store`` tests hold the store thread behind a gate job to see what vLLM is told while a
store is still queued, then open it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from support import vllm_engine

try:
    import torch
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from tierkv.integrations.vllm.chunks import (
        LoadSpec,
        StoreSpec,
        blocks_per_chunk,
        chunk_hashes,
    )
    from tierkv.integrations.vllm.kv_events import MEDIUM, NoteGroup, chunk_note, stored_events
    from tierkv.integrations.vllm.layout import CacheGeometry
    from tierkv.integrations.vllm.metadata import (
        RankReport,
        TierKVConnectorMetadata,
        TierKVWorkerMetadata,
    )
    from tierkv.integrations.vllm.scheduler import SchedulerSide
    from tierkv.integrations.vllm.settings import ConnectorSettings, SettingsError, stores_async
    from tierkv.integrations.vllm.stores import StoreQueue
    from tierkv.integrations.vllm.worker import WorkerSide
    from tierkv.keys import pack_tokens
except ImportError:  # the conftest fails every test with the reason
    pass

pytestmark = pytest.mark.vllm


CHUNK, BLOCK, BPC = 256, 128, 2
LAYERS, HEADS, HEAD, NUM_BLOCKS = 2, 2, 64, 32
LATENT = 576  # an MLA latent: kv_lora_rank 512 + rope 64


# -- mapping -------------------------------------------------------------------------------------
def test_chunk_hashes_take_every_chunks_last_block_hash() -> None:
    hashes = [bytes([i]) * 32 for i in range(9)]  # 9 blocks of 128 tokens hashed
    assert chunk_hashes(hashes, 4, CHUNK, BLOCK) == [hashes[1], hashes[3], hashes[5], hashes[7]]
    assert chunk_hashes(hashes, 5, CHUNK, BLOCK) is None  # not enough blocks hashed
    assert chunk_hashes(hashes, 2, CHUNK, 96) is None  # 256 is not a multiple of 96
    assert chunk_hashes(hashes[:4], 1, CHUNK, 64) == [hashes[3]]  # finer hashing: stride 4


def test_blocks_per_chunk_needs_a_multiple() -> None:
    assert blocks_per_chunk(256, 16) == 16
    with pytest.raises(ValueError, match="multiple"):
        blocks_per_chunk(256, 96)


def test_load_spec_writes_only_blocks_vllm_does_not_have() -> None:
    # vLLM holds block 0 (its own prefix cache); tierkv has chunks 0-1 (blocks 0-3).
    spec = LoadSpec("r", start_block=1, end_block=4, block_ids=(11, 12, 13))
    assert spec.blocks_of(0, BPC) == [(1, 11)]  # chunk 0: only its second block
    assert spec.blocks_of(1, BPC) == [(0, 12), (1, 13)]
    assert spec.blocks_of(2, BPC) == []
    assert spec.failed_blocks({0, 1}, BPC) == []
    assert spec.failed_blocks({0}, BPC) == [12, 13]
    assert spec.failed_blocks(set(), BPC) == [11, 12, 13]
    assert spec.first_failed_block({0}, BPC) == 2


def test_store_spec_maps_chunks_to_their_blocks() -> None:
    spec = StoreSpec("r", first_chunk=1, end_chunk=3, block_ids=(7, 3, 9, 4), tokens=b"")
    assert spec.blocks_of(1, BPC) == (7, 3)
    assert spec.blocks_of(2, BPC) == (9, 4)


def test_worker_metadata_counts_a_token_only_if_every_rank_loaded_it() -> None:
    a = TierKVWorkerMetadata({0: RankReport({"r1": 512, "r2": 256}, {}, {"r3": 2})})
    b = TierKVWorkerMetadata({1: RankReport({"r1": 256, "r2": 256}, {"r1": 256}, {"r3": 1})})
    merged = a.aggregate(b)
    assert isinstance(merged, TierKVWorkerMetadata)
    assert merged.loaded_tokens == {"r1": 256, "r2": 256}
    assert merged.failed_from == {"r1": 256}
    assert {rank: r.written_chunks for rank, r in merged.ranks.items()} == {
        0: {"r3": 2},
        1: {"r3": 1},
    }


# -- settings ------------------------------------------------------------------------------------
def test_block_tables_of_several_groups_become_one_entry_per_position() -> None:
    """vLLM's hybrid allocator hands one block table per group; a position holds every
    group's id; a chunk with a group's null block (0) ends what a store may take."""
    from tierkv.integrations.vllm.chunks import block_positions, has_null, real_ids
    from tierkv.integrations.vllm.scheduler import _intact_chunks

    assert block_positions([[4, 5, 6]]) == [4, 5, 6]
    positions = block_positions([[0, 0, 9, 12], [3, 4, 5, 6]])
    assert positions == [(0, 3), (0, 4), (9, 5), (12, 6)]
    assert block_positions([[1, 2], [3]]) is None  # tables that do not line up
    assert [has_null(p) for p in positions] == [True, True, False, False]
    assert real_ids((0, 4)) == [4] and real_ids(0) == [0]  # one group: no null block
    assert _intact_chunks(positions, 2) == 0
    assert _intact_chunks([(1, 2), (3, 4), (5, 0), (6, 7)], 2) == 1
    assert _intact_chunks([7, 8, 9, 10, 11], 2) == 2
    spec = LoadSpec("r", 0, 4, tuple(positions))
    assert spec.failed_blocks(set(), 2) == [3, 4, 9, 5, 12, 6]


def test_settings_defaults_and_validation() -> None:
    s = ConnectorSettings.from_extra_config({"endpoint": "ipc:///x.sock"})
    assert (s.endpoint, s.chunk_size, s.timeout, s.hashes) == ("ipc:///x.sock", 256, 2.0, "auto")
    with pytest.raises(SettingsError, match="unknown"):
        ConnectorSettings.from_extra_config({"endpiont": "x"})
    with pytest.raises(SettingsError, match="hashes"):
        ConnectorSettings.from_extra_config({"hashes": "md5"})
    with pytest.raises(SettingsError, match="timeout"):
        ConnectorSettings.from_extra_config({"timeout": "soon"})
    with pytest.raises(SettingsError, match="kv_layout"):
        ConnectorSettings.from_extra_config({"kv_layout": "rows"})
    assert s.populate is True and s.page_lock_pool is True
    assert ConnectorSettings.from_extra_config({"populate": "false"}).populate is False
    off = ConnectorSettings.from_extra_config({"page_lock_pool": "false"})
    assert off.page_lock_pool is False
    with pytest.raises(SettingsError, match="page_lock_pool"):
        ConnectorSettings.from_extra_config({"page_lock_pool": "pinned"})
    with pytest.raises(SettingsError, match="populate"):
        ConnectorSettings.from_extra_config({"populate": "sometimes"})
    with pytest.raises(SettingsError, match="async_store"):
        ConnectorSettings.from_extra_config({"async_store": "sometimes"})
    assert s.copy_threads is None
    assert ConnectorSettings.from_extra_config({"copy_threads": "2"}).copy_threads == 2
    for bad in (0, -1, "two"):
        with pytest.raises(SettingsError, match="copy_threads"):
            ConnectorSettings.from_extra_config({"copy_threads": bad})
    assert s.kv_events_reannounce_interval == 30.0
    assert (
        ConnectorSettings.from_extra_config(
            {"kv_events_reannounce_interval": "0"}
        ).kv_events_reannounce_interval
        == 0.0
    )
    for bad in (-1, "often", float("nan")):
        with pytest.raises(SettingsError, match="kv_events_reannounce_interval"):
            ConnectorSettings.from_extra_config({"kv_events_reannounce_interval": bad})


@pytest.mark.parametrize("key", ["timeout", "retry_interval"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e12, -1.0, "nan", "inf"])
def test_link_seconds_must_be_finite_and_sane(key: str, bad: Any) -> None:
    """A NaN, infinite or absurd timeout or retry interval was accepted at start (NaN and
    1e12 passed ``<= 0``), and every request then missed while the log blamed the server:
    now an error at start naming the key."""
    with pytest.raises(SettingsError, match=rf"{key} must be a finite number of seconds"):
        ConnectorSettings.from_extra_config({key: bad})


def test_link_seconds_at_their_bounds_are_accepted() -> None:
    assert ConnectorSettings.from_extra_config({"timeout": 3600}).timeout == 3600
    assert ConnectorSettings.from_extra_config({"retry_interval": 0}).retry_interval == 0
    assert ConnectorSettings.from_extra_config({"retry_interval": 3600}).retry_interval == 3600
    with pytest.raises(SettingsError, match="timeout"):
        ConnectorSettings.from_extra_config({"timeout": 0})
    with pytest.raises(SettingsError, match="timeout"):
        ConnectorSettings.from_extra_config({"timeout": 3600.5})


# -- roles against a real server -----------------------------------------------------------------
def cpu_caches(name: str) -> dict[str, Any]:
    """Per-layer CPU KV caches allocated by vLLM, filled with random values seeded by
    ``name`` (another name, other values)."""
    caches = vllm_engine.vllm_cpu_caches(LAYERS, NUM_BLOCKS, BLOCK, HEADS, HEAD)
    vllm_engine.fill_random(caches.values(), name)
    return caches


@dataclass
class Engine:
    """One engine instance as vLLM would wire it: a scheduler side and one worker side per
    rank, each rank with its own paged cache (the block table is the same on every rank)."""

    scheduler: SchedulerSide
    workers: list[WorkerSide]
    caches: list[dict[str, Any]]
    free: list[int] = field(default_factory=lambda: list(range(NUM_BLOCKS)))

    @property
    def worker(self) -> WorkerSide:
        return self.workers[0]

    def blocks(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def block_bytes(self, block_id: int, rank: int = 0) -> list[Any]:
        return [t[block_id].clone() for _, t in sorted(self.caches[rank].items())]

    def worker_meta(self) -> TierKVWorkerMetadata | None:
        """The ranks' metadata of this step, aggregated as vLLM's executor does."""
        merged: Any = None
        for worker in self.workers:
            meta = worker.build_worker_meta()
            merged = meta if merged is None else (merged.aggregate(meta) if meta else merged)
        return merged  # type: ignore[no-any-return]


def make_engine(
    endpoint: str,
    engine_id: str,
    role: str = "kv_both",
    timeout: float = 5.0,
    world_size: int = 1,
    retry_interval: float = 5.0,
    store_decode: bool = False,
    async_store: bool = False,
    mla: bool = False,
    kv_events: bool = False,
    kv_variant: str = "",
    tables_change: bool = False,
    stages: bool = False,
    **extra: Any,
) -> Engine:
    """``mla``: MLA caches (one 576-value latent per token and layer, CPU_MLA);
    ``kv_events``: vLLM's KV events on (one KV cache group); ``kv_variant``: the workers'
    (config overrides); ``tables_change``: the scheduler reads vLLM's tables every step (a
    model with several KV cache groups); ``stages``: the ranks are pipeline stages (an MLA
    cache's ranks then hold different layers)."""
    settings = ConnectorSettings.from_extra_config(
        {
            "endpoint": endpoint,
            "timeout": timeout,
            "retry_interval": retry_interval,
            "store_decode": store_decode,
            **extra,
        }
    )
    can_load, can_save = role != "kv_producer", role != "kv_consumer"
    scheduler = SchedulerSide(
        settings,
        model_id="parts-model",
        engine_id=engine_id,
        block_size=BLOCK,
        hash_block_size=BLOCK,
        use_block_hashes=False,
        can_load=can_load,
        can_save=can_save,
        world_size=world_size,
        async_store=async_store,
        shared_ranks=mla and not stages,
        kv_events=kv_events,
        note_groups=[NoteGroup()] if kv_events else None,
        tables_change=tables_change,
    )
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    backend = f"CPU_ATTN/{_get_attn_isa(torch.float32, BLOCK, HEAD)}"
    workers, caches = [], []
    for rank in range(world_size):
        worker = WorkerSide(
            settings,
            model_id="parts-model",
            engine_id=engine_id,
            world_size=world_size,
            rank=rank,
            can_load=can_load,
            can_save=can_save,
            async_store=async_store,
            kv_variant=kv_variant,
            share_latent=not stages,
        )
        if mla:
            cache = vllm_engine.vllm_cpu_mla_caches(LAYERS, NUM_BLOCKS, BLOCK, LATENT)
            vllm_engine.fill_random(cache.values(), f"{engine_id}/rank{rank}")
            geometry = CacheGeometry(BLOCK, 1, LATENT, latent=True)
            worker.register_kv_caches(cache, geometry, dict.fromkeys(cache, "CPU_MLA"))
        else:
            cache = cpu_caches(f"{engine_id}/rank{rank}")
            worker.register_kv_caches(
                cache, CacheGeometry(BLOCK, HEADS, HEAD), {name: backend for name in cache}
            )
        workers.append(worker)
        caches.append(cache)
    return Engine(scheduler, workers, caches)


request = vllm_engine.scheduler_request


def step_output(
    new: list[tuple[str, list[int], int, int]],
    cached: Sequence[tuple[str, list[int], int, int]] = (),
    resumed: Collection[str] = (),
    preempted: Collection[str] = (),
) -> Any:
    """A SchedulerOutput with new requests (id, block ids, computed before, scheduled) and
    running ones (id, new block ids, or all of them if ``resumed``, computed before,
    scheduled)."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=rid, block_ids=(blocks,), num_computed_tokens=computed)
            for rid, blocks, computed, _ in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[rid for rid, _, _, _ in cached],
            resumed_req_ids=set(resumed),
            new_block_ids=[(blocks,) if blocks else None for _, blocks, _, _ in cached],
            num_computed_tokens=[computed for _, _, computed, _ in cached],
        ),
        num_scheduled_tokens={rid: n for rid, _, _, n in [*new, *cached]},
        preempted_req_ids=set(preempted),
    )


def ask(engine: Engine, req: Any, local: int = 0) -> tuple[int | None, bool]:
    """get_num_new_matched_tokens as vLLM calls it: again every step while it says None
    (a prefetch from a slower tier is running)."""
    deadline = time.monotonic() + 30
    while True:
        answer = engine.scheduler.get_num_new_matched_tokens(req, local)
        if answer[0] is not None or time.monotonic() > deadline:
            return answer
        time.sleep(0.01)


def compute_and_store(
    engine: Engine,
    rid: str,
    tokens: list[int],
    *,
    reserve_first: bool = True,
    req: Any = None,
) -> list[int]:
    """A request that misses: vLLM computes it all (here: the blocks already hold "KV"), then
    the worker stores its full chunks after the forward pass. ``reserve_first``: the slots
    are reserved before the forward pass, as binding the step's metadata does in vLLM;
    otherwise the store reserves them itself. ``req``: the request (default: one without
    block hashes, :func:`request`)."""
    req = req if req is not None else request(rid, tokens)
    assert ask(engine, req) == (0, False)
    blocks = engine.blocks(-(-len(tokens) // BLOCK))
    engine.scheduler.update_state_after_alloc(req, blocks, 0)
    meta = engine.scheduler.build_connector_meta(step_output([(rid, blocks, 0, len(tokens))]))
    assert [(s.first_chunk, s.end_chunk) for s in meta.stores] == [(0, len(tokens) // CHUNK)]
    for worker in engine.workers:
        if reserve_first:
            worker.prepare_stores(meta)
        worker.wait_for_save(meta)
    engine.scheduler.update_connector_output(engine.worker_meta())
    engine.scheduler.request_finished(req)
    return blocks


def load(engine: Engine, rid: str, tokens: list[int], local: int = 0) -> tuple[Any, list[int]]:
    """The scheduler's lookup and allocation, then the step that loads."""
    req = request(rid, tokens)
    external, load_async = engine.scheduler.get_num_new_matched_tokens(req, local)
    assert external is not None and load_async == (external > 0)
    blocks = engine.blocks(-(-len(tokens) // BLOCK))
    engine.scheduler.update_state_after_alloc(req, blocks, external)
    return req, blocks


def assert_loads_exactly(a: Engine, a_blocks: list[int], b: Engine, tokens: list[int]) -> None:
    """Engine ``b`` loads ``tokens`` (stored by ``a`` from ``a_blocks``) in one step: every
    block arrives, byte for byte."""
    _, b_blocks = load(b, "b-1", tokens)
    meta = b.scheduler.build_connector_meta(step_output([]))
    b.worker.start_load_kv(meta)
    b.worker.wait_for_save(meta)
    assert b.worker.get_block_ids_with_load_errors() == set()
    for i in range(len(tokens) // BLOCK):
        for x, y in zip(a.block_bytes(a_blocks[i]), b.block_bytes(b_blocks[i]), strict=True):
            assert torch.equal(x, y)


@pytest.fixture
def server(server_factory: Callable[..., Any]) -> Any:
    return server_factory(pool_size="64MiB")


def test_chunks_computed_by_one_engine_load_into_another_engines_blocks(server: Any) -> None:
    a, b = make_engine(server.endpoint, "engine-a"), make_engine(server.endpoint, "engine-b")
    tokens = list(range(1000, 1000 + 700))  # 2 full chunks + a tail
    a_blocks = compute_and_store(a, "a-1", tokens)

    req, b_blocks = load(b, "b-1", tokens)
    meta = b.scheduler.build_connector_meta(step_output([]))
    assert [(s.start_block, s.end_block) for s in meta.loads] == [(0, 4)]
    b.worker.start_load_kv(meta)
    b.worker.wait_for_save(meta)
    assert b.worker.get_finished() == (None, {"b-1"})
    assert b.worker.get_block_ids_with_load_errors() == set()
    for i in range(4):  # one copy from A's blocks through the pool into B's
        for x, y in zip(a.block_bytes(a_blocks[i]), b.block_bytes(b_blocks[i]), strict=True):
            assert torch.equal(x, y)
    b.scheduler.update_connector_output(b.worker.build_worker_meta())
    report = b.scheduler.request_finished(req)["tierkv"]
    assert report["hit_tokens"] == 512 and report["loaded_tokens"] == 512
    # The workers' totals: what their stores and loads moved, and the time they took.
    reg = b.worker.link.registration()
    assert reg is not None
    assert a.worker.stats["store_bytes"] == 2 * reg.chunk_bytes
    assert b.worker.stats["load_bytes"] == 2 * reg.chunk_bytes
    assert a.worker.stats["store_seconds"] > 0 and b.worker.stats["load_seconds"] > 0
    assert b.worker.stats["store_bytes"] == a.worker.stats["load_bytes"] == 0


def test_engines_whose_config_overrides_differ_never_share_chunks(server: Any) -> None:
    """The same weights with another RoPE scaling (vLLM's hf_overrides), another config file
    or other custom code compute other KV: such engines' chunks are in namespaces apart."""
    from tierkv.integrations.vllm.connector import _kv_variant

    def config(**model: Any) -> Any:
        return SimpleNamespace(model_config=SimpleNamespace(**model))

    yarn = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_theta": 1e6}
    assert _kv_variant(config()) == _kv_variant(config(hf_overrides={})) == ""
    same = _kv_variant(config(hf_overrides=yarn))
    reordered = dict(reversed(yarn.items()))
    assert same.startswith("|cfg=") and same == _kv_variant(config(hf_overrides=reordered))
    assert _kv_variant(config(hf_overrides={"rope_theta": 5e5})) != same
    assert _kv_variant(config(hf_config_path="/other")) not in ("", same)
    assert _kv_variant(config(code_revision="abc")) not in ("", same)
    function = lambda hf_config: hf_config  # noqa: E731
    assert _kv_variant(config(hf_overrides=function)) != _kv_variant(config(hf_overrides=function))

    a = make_engine(server.endpoint, "engine-a", kv_variant=same)
    tokens = list(range(1500, 1500 + 512))
    compute_and_store(a, "a-1", tokens)
    other = make_engine(server.endpoint, "engine-b", kv_variant=_kv_variant(config()))
    assert ask(other, request("b-1", tokens)) == (0, False)
    twin = make_engine(server.endpoint, "engine-c", kv_variant=same)
    assert ask(twin, request("c-1", tokens)) == (512, True)


def fp8_engine(endpoint: str, cache_dtype: str, engine_id: str) -> Engine:
    """An engine whose KV cache is ``cache_dtype`` (an fp8 encoding: uint8 tensors, vLLM's
    FP8_PER_TENSOR quant mode, FLASH_ATTN's layout) with the namespace the connector derives
    from its vLLM config; its cache holds random bytes seeded by ``engine_id``."""
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    from tierkv.integrations.vllm.connector import _attention_spec, _kv_variant

    config = SimpleNamespace(model_config=SimpleNamespace(model="org/model"))
    config.cache_config = SimpleNamespace(cache_dtype=cache_dtype)
    spec = FullAttentionSpec(
        block_size=BLOCK,
        num_kv_heads=HEADS,
        head_size=HEAD,
        dtype=STR_DTYPE_TO_TORCH_DTYPE[cache_dtype],
        kv_quant_mode=get_kv_quant_mode(cache_dtype),
    )
    assert _attention_spec(kv_cache_config(spec)) is spec  # served
    settings = ConnectorSettings.from_extra_config({"endpoint": endpoint, "timeout": 5.0})
    scheduler = SchedulerSide(
        settings,
        model_id="org/model",
        engine_id=engine_id,
        block_size=BLOCK,
        hash_block_size=BLOCK,
        use_block_hashes=False,
        can_load=True,
        can_save=True,
    )
    worker = WorkerSide(
        settings,
        model_id="org/model",
        engine_id=engine_id,
        world_size=1,
        rank=0,
        can_load=True,
        can_save=True,
        kv_variant=_kv_variant(config),
    )
    generator = torch.Generator().manual_seed(sum(engine_id.encode()))
    shape = (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)
    caches = {
        f"model.layers.{i}.attn": torch.randint(0, 255, shape, generator=generator).to(torch.uint8)
        for i in range(LAYERS)
    }
    worker.register_kv_caches(
        caches, CacheGeometry(BLOCK, HEADS, HEAD), dict.fromkeys(caches, "FLASH_ATTN")
    )
    return Engine(scheduler, [worker], [caches])


def test_fp8_caches_of_other_encodings_never_share_chunks(server: Any) -> None:
    """fp8_e4m3 and fp8_e5m2 caches are both uint8 tensors of vLLM's FP8_PER_TENSOR mode:
    the cache dtype goes into the namespace, so an e5m2 engine is never served e4m3 bytes
    (it was), while engines of the same encoding share."""
    tokens = list(range(2500, 2500 + 512))
    e4m3 = fp8_engine(server.endpoint, "fp8_e4m3", "engine-e4m3")
    a_blocks = compute_and_store(e4m3, "a-1", tokens)
    e5m2 = fp8_engine(server.endpoint, "fp8_e5m2", "engine-e5m2")
    assert ask(e5m2, request("b-1", tokens)) == (0, False)
    twin = fp8_engine(server.endpoint, "fp8_e4m3", "engine-twin")
    assert ask(twin, request("c-1", tokens)) == (512, True)
    _, c_blocks = load(twin, "c-2", tokens)
    meta = twin.scheduler.build_connector_meta(step_output([]))
    twin.worker.start_load_kv(meta)
    assert twin.worker.get_block_ids_with_load_errors() == set()
    for a, c in zip(a_blocks, c_blocks, strict=True):
        for x, y in zip(e4m3.block_bytes(a), twin.block_bytes(c), strict=True):
            assert torch.equal(x, y)


def test_fp8_of_the_fnuz_encoding_has_a_namespace_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ROCm's fp8 e4m3 is the fnuz encoding: the same cache dtype name stores other bytes
    than on CUDA or CPU, and a cluster may mix both; e5m2 is one encoding everywhere."""
    import torch as t
    from vllm.platforms import current_platform

    from tierkv.integrations.vllm.connector import _kv_variant

    def variant(cache_dtype: str) -> str:
        cache = SimpleNamespace(cache_dtype=cache_dtype)
        return _kv_variant(
            SimpleNamespace(model_config=SimpleNamespace(model="m"), cache_config=cache)
        )

    here = variant("fp8_e4m3")
    assert here == "|kv=fp8_e4m3"  # this CPU: float8_e4m3fn
    monkeypatch.setattr(current_platform, "fp8_dtype", lambda: t.float8_e4m3fnuz)
    assert variant("fp8_e4m3") == "|kv=fp8_e4m3/fnuz" != here
    assert variant("fp8_e5m2") == "|kv=fp8_e5m2"
    assert variant("auto") == ""


def test_fp8_scales_computed_at_run_time_keep_the_connector_inactive() -> None:
    """Per-tensor scales an engine computes itself (``calculate_kv_scales``, where a vLLM
    version has it) make its fp8 bytes its own: refused (the connector stays inactive);
    an unquantized cache is unaffected, and keeps its namespace."""
    from tierkv.integrations.vllm.connector import _check_kv_scales, _kv_variant
    from tierkv.integrations.vllm.layout import UnsupportedLayoutError

    def config(cache_dtype: str, calculate: bool) -> Any:
        cache = SimpleNamespace(cache_dtype=cache_dtype, calculate_kv_scales=calculate)
        return SimpleNamespace(model_config=SimpleNamespace(model="m"), cache_config=cache)

    with pytest.raises(UnsupportedLayoutError, match="calculate_kv_scales"):
        _check_kv_scales(config("fp8_e4m3", True))
    _check_kv_scales(config("fp8_e4m3", False))
    _check_kv_scales(config("auto", True))  # unquantized: scales are not applied
    assert _kv_variant(config("auto", False)) == _kv_variant(config("bfloat16", False)) == ""
    assert _kv_variant(config("fp8_e5m2", False)) == "|kv=fp8_e5m2"


@pytest.mark.parametrize("reserve_first", [True, False])
def test_stores_reserved_during_the_forward_pass_are_copied_and_committed_after_it(
    server: Any, reserve_first: bool
) -> None:
    """The step's stores are reserved before the forward pass (nothing visible yet, the
    reservation's time counted apart); wait_for_save copies and commits them; a store the
    prepare thread did not reserve reserves itself. Either way the bytes load exactly."""
    a, b = make_engine(server.endpoint, "engine-a"), make_engine(server.endpoint, "engine-b")
    tokens = list(range(1500, 1500 + 600))  # 2 full chunks + a tail
    req = request("a-1", tokens)
    assert ask(a, req) == (0, False)
    a_blocks = a.blocks(-(-600 // BLOCK))
    a.scheduler.update_state_after_alloc(req, a_blocks, 0)
    meta = a.scheduler.build_connector_meta(step_output([("a-1", a_blocks, 0, 600)]))
    if reserve_first:
        a.worker.prepare_stores(meta)
        a.worker.prepare_stores(meta)  # once per step, however often it is called
        assert a.worker._prepared[0] is not None
        a.worker._prepared[0].result(timeout=10)
        with server.client(timeout=5.0) as admin:
            stats = admin.stats()
        assert stats.write_leases == 1 and stats.writing == 2 and stats.ready == 0
        assert a.worker.stats["store_prepare_seconds"] > 0
    a.worker.wait_for_save(meta)
    assert a.worker.stats["stored_chunks"] == 2
    with server.client(timeout=5.0) as admin:
        stats = admin.stats()
    assert stats.write_leases == 0 and stats.writing == 0 and stats.ready == 2
    assert (a.worker.stats["store_prepare_seconds"] > 0) == reserve_first

    assert_loads_exactly(a, a_blocks, b, tokens)


@pytest.mark.parametrize("prompt", [1100, 1024])
def test_a_prefill_steps_commits_are_not_waited_for_until_the_request_can_finish(
    server: Any, prompt: int
) -> None:
    """A prompt prefilled in steps of 512 tokens: the commits of the steps after which the
    prompt is still being computed are sent without waiting for their answers (read by the
    next step's reservation); the step in which the request can finish (the tail step that
    stores nothing, or the step that stores the last chunks) waits for every one, so that
    at its end another client sees every chunk, and the bytes load exactly."""
    a, b = make_engine(server.endpoint, "engine-a"), make_engine(server.endpoint, "engine-b")
    tokens = list(range(40_000, 40_000 + prompt))
    req = request("a-1", tokens)
    assert ask(a, req) == (0, False)
    blocks = a.blocks(-(-prompt // BLOCK))
    a.scheduler.update_state_after_alloc(req, blocks, 0)
    client = a.worker.link.client()
    assert client is not None
    steps = [
        step_output([("a-1", blocks, 0, 512)]),
        step_output([], cached=[("a-1", [], 512, 512)]),
        step_output([], cached=[("a-1", [], 1024, prompt - 1024)]),
    ][: 2 if prompt == 1024 else 3]
    for i, output in enumerate(steps):
        meta = a.scheduler.build_connector_meta(output)
        last = i == len(steps) - 1
        assert ("a-1" in meta.prefilling) == (not last)
        a.worker.prepare_stores(meta)
        a.worker.wait_for_save(meta)
        with server.client(timeout=5.0) as admin:
            ready = admin.stats().ready
        if last:  # settled: every commit is done and visible elsewhere, at once
            assert not a.worker._unconfirmed and not client._channel.unanswered
            assert ready == 4
        else:
            assert a.worker._unconfirmed == {"a-1"}
            assert len(client._channel.unanswered) == 1  # this step's commit only: the next
            # step's reservation read the one before
    assert a.worker.stats["stored_chunks"] == 4
    assert_loads_exactly(a, blocks, b, tokens)


def test_a_commit_not_waited_for_that_fails_is_taken_back_from_the_written_chunks(
    server_factory: Callable[..., Any],
) -> None:
    """The first step's commit is sent without waiting and fails (its reservation expired
    before the copy: write_ttl 0.5 s); the step in which the request can finish settles it,
    and the chunks that step reported written for it are taken back, so the request's
    ``written_chunks`` and the worker's ``stored_chunks`` count what the server holds."""
    server = server_factory(pool_size="64MiB", extra=["--write-ttl", "0.5"])
    a = make_engine(server.endpoint, "engine-a")
    tokens = list(range(60_000, 60_000 + 1024))
    req = request("a-1", tokens)
    assert ask(a, req) == (0, False)
    blocks = a.blocks(1024 // BLOCK)
    a.scheduler.update_state_after_alloc(req, blocks, 0)
    steps = [
        step_output([("a-1", blocks, 0, 512)]),
        step_output([], cached=[("a-1", [], 512, 512)]),
    ]
    reported = []
    for i, output in enumerate(steps):
        meta = a.scheduler.build_connector_meta(output)
        a.worker.prepare_stores(meta)
        if i == 0:
            a.worker._prepare_thread.submit(lambda: None).result(timeout=10)  # reserved
            time.sleep(1.5)  # and expired: the server reclaims it
        a.worker.wait_for_save(meta)
        worker_meta = a.worker_meta()
        reported.append(worker_meta.ranks[0].written_chunks["a-1"] if worker_meta else None)
        a.scheduler.update_connector_output(worker_meta)
    assert reported == [2, 0]  # 2 sent without waiting, then 2 written and 2 taken back
    report = a.scheduler.request_finished(req)["tierkv"]
    assert report["ranks"] == [{"rank": 0, "loaded_tokens": 0, "written_chunks": 2}]
    assert a.worker.stats["stored_chunks"] == 2
    with server.client(timeout=5.0) as admin:
        assert admin.stats().ready == 2


def test_a_reservation_no_store_takes_is_given_back(server: Any) -> None:
    """A step whose wait_for_save never comes (vLLM's forward pass raised): its reservations
    are given back when the next step reserves, and at shutdown."""
    a = make_engine(server.endpoint, "engine-a")
    metas = []
    for i in range(2):
        tokens = list(range(20_000 * (i + 1), 20_000 * (i + 1) + 512))
        req = request(f"a-{i}", tokens)
        assert ask(a, req) == (0, False)
        blocks = a.blocks(512 // BLOCK)
        a.scheduler.update_state_after_alloc(req, blocks, 0)
        metas.append(a.scheduler.build_connector_meta(step_output([(f"a-{i}", blocks, 0, 512)])))
    for meta in metas:  # the second step gives the first one's reservation back
        a.worker.prepare_stores(meta)
        a.worker._prepare_thread.submit(lambda: None).result(timeout=10)  # reserved
        with server.client(timeout=5.0) as admin:
            stats = admin.stats()
        assert stats.write_leases == 1 and stats.writing == 2
    a.worker.shutdown()
    with server.client(timeout=5.0) as admin:
        stats = admin.stats()
    assert stats.write_leases == 0 and stats.writing == 0 and stats.objects == 0


def test_a_cpu_engine_copies_on_vllms_thread_alone_unless_configured(server: Any) -> None:
    """A KV cache in host memory: the worker's client copies with one thread, vLLM's own
    (the engine's OpenMP threads hold the other cores); ``copy_threads`` overrides it.
    Either way the chunks go through byte-exact."""
    a = make_engine(server.endpoint, "engine-a")
    b = make_engine(server.endpoint, "engine-b", copy_threads=2)
    a_client, b_client = a.worker.link.client(), b.worker.link.client()
    assert a_client is not None and b_client is not None
    assert (a_client.copy_threads, b_client.copy_threads) == (1, 2)
    tokens = list(range(2500, 2500 + 512))
    assert_loads_exactly(a, compute_and_store(a, "a-1", tokens), b, tokens)


def test_blocks_vllm_already_has_are_never_written(server: Any) -> None:
    a, b = make_engine(server.endpoint, "engine-a"), make_engine(server.endpoint, "engine-b")
    tokens = list(range(5, 5 + 600))
    compute_and_store(a, "a-1", tokens)

    req = request("b-1", tokens)
    # vLLM's own prefix cache holds the first block: tierkv adds the next three.
    assert b.scheduler.get_num_new_matched_tokens(req, BLOCK) == (2 * CHUNK - BLOCK, True)
    blocks = b.blocks(5)
    before = b.block_bytes(blocks[0])
    b.scheduler.update_state_after_alloc(req, blocks, 2 * CHUNK - BLOCK)
    meta = b.scheduler.build_connector_meta(step_output([]))
    assert [(s.start_block, s.end_block) for s in meta.loads] == [(1, 4)]
    b.worker.start_load_kv(meta)
    assert b.worker.get_block_ids_with_load_errors() == set()
    for x, y in zip(before, b.block_bytes(blocks[0]), strict=True):
        assert torch.equal(x, y)


def test_a_retrieve_that_fails_reports_every_block_it_should_have_written(server: Any) -> None:
    a, b = make_engine(server.endpoint, "engine-a"), make_engine(server.endpoint, "engine-b")
    tokens = list(range(9, 9 + 800))
    compute_and_store(a, "a-1", tokens)

    req, blocks = load(b, "b-1", tokens)
    # The session (and its locks) are gone before the worker retrieves: nothing can load.
    b.scheduler.link.call("end_session", lambda c: c.end_session("b-1"), 0)
    meta = b.scheduler.build_connector_meta(step_output([]))
    b.worker.start_load_kv(meta)
    assert b.worker.get_finished() == (None, {"b-1"})  # finished, so vLLM moves on ...
    assert b.worker.get_block_ids_with_load_errors() == set(blocks[:6])  # ... and recomputes
    worker_meta = b.worker.build_worker_meta()
    assert worker_meta is not None and worker_meta.failed_from == {"b-1": 0}
    b.scheduler.update_connector_output(worker_meta)
    # Asked again (vLLM reschedules it with nothing computed): no second load attempt.
    assert b.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)


def test_consumer_never_stores_and_producer_never_loads(server: Any) -> None:
    producer = make_engine(server.endpoint, "engine-p", role="kv_producer")
    consumer = make_engine(server.endpoint, "engine-c", role="kv_consumer")
    tokens = list(range(20, 20 + 520))
    compute_and_store(producer, "p-1", tokens)
    assert producer.scheduler.get_num_new_matched_tokens(request("p-2", tokens), 0) == (0, False)

    other = list(range(3000, 3000 + 520))
    req = request("c-1", other)
    assert consumer.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    blocks = consumer.blocks(5)
    consumer.scheduler.update_state_after_alloc(req, blocks, 0)
    meta = consumer.scheduler.build_connector_meta(step_output([("c-1", blocks, 0, 520)]))
    assert meta.stores == []
    assert consumer.scheduler.get_num_new_matched_tokens(request("c-2", tokens), 0) == (
        2 * CHUNK,
        True,
    )


def test_a_dead_server_is_a_miss_not_a_stall(server: Any) -> None:
    engine = make_engine(server.endpoint, "engine-a", timeout=0.5)
    server.kill()
    tokens = list(range(40, 40 + 600))
    req = request("r-1", tokens)
    assert engine.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)  # one timeout
    # Down now: the next calls return at once, for retry_interval.
    assert engine.scheduler.link.client() is None
    meta = TierKVConnectorMetadata(stores=[StoreSpec("r-1", 0, 2, (0, 1, 2, 3), tokens=b"")])
    engine.worker.wait_for_save(meta)  # the worker learns on its own and skips


def test_chunks_only_in_a_slower_tier_are_prefetched_before_vllm_is_answered(
    server_factory: Callable[..., Any], tmp_path: Any
) -> None:
    server = server_factory(
        pool_size="64MiB", extra=["--tier", f"disk:path={tmp_path / 'disk'},capacity=64MiB"]
    )
    a, b = make_engine(server.endpoint, "engine-a"), make_engine(server.endpoint, "engine-b")
    tokens = list(range(70, 70 + 600))
    compute_and_store(a, "a-1", tokens)
    with server.client(timeout=5.0) as admin:
        deadline = time.monotonic() + 30
        while sum(t.written_chunks for t in admin.stats().tiers) < 2:  # write-behind
            assert time.monotonic() < deadline, "write-behind never reached the disk tier"
            time.sleep(0.05)
        assert admin.clear() >= 2  # the pool forgets them; the disk tier keeps them

    req = request("b-1", tokens)
    answers = [b.scheduler.get_num_new_matched_tokens(req, 0)]
    deadline = time.monotonic() + 30
    while answers[-1][0] is None:  # vLLM asks again every step while the prefetch runs
        assert time.monotonic() < deadline, "the prefetch never finished"
        time.sleep(0.01)
        answers.append(b.scheduler.get_num_new_matched_tokens(req, 0))
    assert answers[-1] == (2 * CHUNK, True)
    assert all(answer == (None, False) for answer in answers[:-1])
    blocks = b.blocks(5)
    b.scheduler.update_state_after_alloc(req, blocks, 2 * CHUNK)
    meta = b.scheduler.build_connector_meta(step_output([]))
    b.worker.start_load_kv(meta)
    assert b.worker.get_block_ids_with_load_errors() == set()
    assert b.worker.get_finished() == (None, {"b-1"})


# -- tensor parallel: one worker side per rank ---------------------------------------------------
def test_every_rank_stores_and_loads_its_own_chunks(server: Any) -> None:
    a = make_engine(server.endpoint, "engine-a", world_size=2)
    b = make_engine(server.endpoint, "engine-b", world_size=2)
    tokens = list(range(2000, 2000 + 700))
    a_blocks = compute_and_store(a, "a-1", tokens)
    with server.client(timeout=5.0) as admin:
        stats = admin.stats()
    assert stats.objects == 4  # 2 chunks on each of the 2 ranks, each under its own key
    workers = [e for e in stats.engines if e.engine_id == "engine-a" and e.role == "worker"]
    assert sorted((e.rank, e.world_size) for e in workers) == [(0, 2), (1, 2)]
    assert len({e.namespace for e in workers}) == 2

    req, b_blocks = load(b, "b-1", tokens)
    meta = b.scheduler.build_connector_meta(step_output([]))
    assert [(s.start_block, s.end_block) for s in meta.loads] == [(0, 4)]
    for worker in b.workers:
        worker.start_load_kv(meta)
        assert worker.get_finished() == (None, {"b-1"})
        assert worker.get_block_ids_with_load_errors() == set()
    for rank in (0, 1):  # each rank gets its own rank's KV back
        for i in range(4):
            got, want = b.block_bytes(b_blocks[i], rank), a.block_bytes(a_blocks[i], rank)
            assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    assert not torch.equal(b.block_bytes(b_blocks[0], 0)[0], b.block_bytes(b_blocks[0], 1)[0])
    b.scheduler.update_connector_output(b.worker_meta())
    report = b.scheduler.request_finished(req)["tierkv"]
    assert report["hit_tokens"] == 512 and report["loaded_tokens"] == 512
    assert report["ranks"] == [
        {"rank": 0, "loaded_tokens": 512, "written_chunks": 0},
        {"rank": 1, "loaded_tokens": 512, "written_chunks": 0},
    ]


def test_an_mla_engine_stores_once_and_every_rank_loads_that_copy(server: Any) -> None:
    """MLA: every rank holds the same latent, so rank 0 alone stores, in one namespace, and
    alone joins the engine's group; the other ranks read the chunks it stored by key."""
    a = make_engine(server.endpoint, "engine-a", world_size=2, mla=True)
    b = make_engine(server.endpoint, "engine-b", world_size=2, mla=True)
    tokens = list(range(3000, 3000 + 700))
    a_blocks = compute_and_store(a, "a-1", tokens)
    with server.client(timeout=5.0) as admin:
        stats = admin.stats()
    assert stats.objects == 2  # each chunk once, not once per rank
    group = [e for e in stats.engines if e.engine_id == "engine-a" and e.role == "worker"]
    assert [(e.rank, e.world_size) for e in group] == [(0, 1)]

    req, b_blocks = load(b, "b-1", tokens)
    meta = b.scheduler.build_connector_meta(step_output([]))
    (spec,) = meta.loads
    assert spec.tokens == pack_tokens(tokens[:512])  # the keys, for rank 1's read
    for worker in b.workers:
        worker.start_load_kv(meta)
        assert worker.get_finished() == (None, {"b-1"})
        assert worker.get_block_ids_with_load_errors() == set()
    for rank in (0, 1):  # both ranks get the latents A's rank 0 stored, byte for byte
        for i in range(4):
            got, want = b.block_bytes(b_blocks[i], rank), a.block_bytes(a_blocks[i], 0)
            assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    b.scheduler.update_connector_output(b.worker_meta())
    report = b.scheduler.request_finished(req)["tierkv"]
    assert report["hit_tokens"] == 512 and report["loaded_tokens"] == 512
    assert [r["loaded_tokens"] for r in report["ranks"]] == [512, 512]

    # An engine of another tensor-parallel size computes other bytes: it shares nothing.
    c = make_engine(server.endpoint, "engine-c", world_size=1, mla=True)
    assert ask(c, request("c-1", tokens)) == (0, False)


def test_mla_ranks_that_are_pipeline_stages_each_store_and_load_their_own_layers(
    server: Any,
) -> None:
    """Pipeline stages hold different layers: an MLA engine's ranks share one namespace
    only when they are tensor-parallel (before, stage 1 loaded stage 0's latents); context
    parallelism (each rank a shard of every block's tokens) is refused."""
    from tierkv.integrations.vllm.connector import _check_parallelism, _shares_latent
    from tierkv.integrations.vllm.layout import UnsupportedLayoutError

    def config(**parallel: int) -> Any:
        return SimpleNamespace(parallel_config=SimpleNamespace(**parallel))

    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    latent = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.float32)
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32)
    assert not _shares_latent(config(pipeline_parallel_size=1), full)
    assert _shares_latent(config(pipeline_parallel_size=1), latent)
    assert not _shares_latent(config(pipeline_parallel_size=2), latent)
    _check_parallelism(config(decode_context_parallel_size=1, prefill_context_parallel_size=1))
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        with pytest.raises(UnsupportedLayoutError, match="context parallelism"):
            _check_parallelism(config(**{name: 2}))

    a = make_engine(server.endpoint, "engine-a", world_size=2, mla=True, stages=True)
    b = make_engine(server.endpoint, "engine-b", world_size=2, mla=True, stages=True)
    tokens = list(range(3100, 3100 + 700))
    a_blocks = compute_and_store(a, "a-1", tokens)
    with server.client(timeout=5.0) as admin:
        assert admin.stats().objects == 4  # each stage its own chunks
    _, b_blocks = load(b, "b-1", tokens)
    meta = b.scheduler.build_connector_meta(step_output([]))
    for worker in b.workers:
        worker.start_load_kv(meta)
        assert worker.get_block_ids_with_load_errors() == set()
    for rank in (0, 1):
        for i in range(4):
            got, want = b.block_bytes(b_blocks[i], rank), a.block_bytes(a_blocks[i], rank)
            assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))


def test_the_lookup_finds_only_what_every_rank_holds(server: Any) -> None:
    a = make_engine(server.endpoint, "engine-a", world_size=2)
    b = make_engine(server.endpoint, "engine-b", world_size=2)
    tokens = list(range(4000, 4000 + 800))  # 3 full chunks
    req = request("a-1", tokens)
    assert ask(a, req) == (0, False)
    blocks = a.blocks(7)
    a.scheduler.update_state_after_alloc(req, blocks, 0)
    meta = a.scheduler.build_connector_meta(step_output([("a-1", blocks, 0, len(tokens))]))
    a.workers[0].wait_for_save(meta)
    # Rank 1 stores only the first 2 chunks (its third did not fit, say).
    (spec,) = meta.stores
    a.workers[1].wait_for_save(
        TierKVConnectorMetadata(
            stores=[StoreSpec("a-1", 0, 2, spec.block_ids[:4], tokens=pack_tokens(tokens[:512]))]
        )
    )
    a.scheduler.update_connector_output(a.worker_meta())
    ranks = a.scheduler.request_finished(req)["tierkv"]["ranks"]
    assert [r["written_chunks"] for r in ranks] == [3, 2]

    # Chunk 2 exists for rank 0 only: B loads chunks 0-1, on both ranks.
    req, _ = load(b, "b-1", tokens)
    meta = b.scheduler.build_connector_meta(step_output([]))
    assert [(s.start_block, s.end_block) for s in meta.loads] == [(0, 4)]
    for worker in b.workers:
        worker.start_load_kv(meta)
        assert worker.get_block_ids_with_load_errors() == set()
    b.scheduler.update_connector_output(b.worker_meta())
    report = b.scheduler.request_finished(req)["tierkv"]
    assert report["hit_tokens"] == 512 and report["loaded_tokens"] == 512
    assert [r["loaded_tokens"] for r in report["ranks"]] == [512, 512]


def test_ranks_that_time_out_on_a_stalled_server_still_serve_their_engine(server: Any) -> None:
    """Every link of engine B gives up on a stalled server; once it answers again, B's next
    requests load as before. (A link that registered again would leave two clients for its
    rank in B's engine group: B's lookups would find nothing from then on.)"""
    a = make_engine(server.endpoint, "engine-a", world_size=2)
    b = make_engine(server.endpoint, "engine-b", world_size=2, timeout=0.5, retry_interval=0.0)
    tokens = list(range(6000, 6000 + 600))
    compute_and_store(a, "a-1", tokens)
    assert b.scheduler.link.client() is not None  # registered (its workers are already)

    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        compute_and_store(b, "b-0", list(range(8000, 8000 + 600)))  # every call times out
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert [link.failures for link in (b.scheduler.link, *(w.link for w in b.workers))] == [1] * 3

    for rid in ("b-1", "b-2"):
        req, _ = load(b, rid, tokens)
        meta = b.scheduler.build_connector_meta(step_output([]))
        for worker in b.workers:
            worker.start_load_kv(meta)
            assert worker.get_block_ids_with_load_errors() == set(), rid
        b.scheduler.update_connector_output(b.worker_meta())
        report = b.scheduler.request_finished(req)["tierkv"]
        assert report["loaded_tokens"] == 512, (rid, report)
    with server.client(timeout=5.0) as admin:
        engine_b = [e for e in admin.stats().engines if e.engine_id == "engine-b"]
    assert sorted((e.role, e.rank) for e in engine_b) == [
        ("scheduler", 0),
        ("worker", 0),
        ("worker", 1),
    ]


# -- decode chunks (store_decode) ----------------------------------------------------------------
def start(engine: Engine, req: Any) -> int:
    """The lookup and allocation of a request vLLM admits (all its blocks at once); the tokens
    tierkv will load."""
    external, _ = ask(engine, req)
    assert external is not None
    req.blocks = engine.blocks(-(-req.num_tokens // BLOCK))
    engine.scheduler.update_state_after_alloc(req, req.blocks, external)
    return external


def run_step(
    engine: Engine,
    req: Any,
    computed: int,
    scheduled: int,
    *,
    new: bool = False,
    resumed: bool = False,
) -> TierKVConnectorMetadata:
    """One engine step in which ``req`` computes tokens ``[computed, computed + scheduled)``:
    the scheduler output (with the blocks the step adds), the workers' loads and saves after
    the forward pass, their reports."""
    missing = -(-(computed + scheduled) // BLOCK) - len(req.blocks)
    fresh = engine.blocks(missing) if missing > 0 else []
    req.blocks += fresh
    rid = req.request_id
    if new:
        output = step_output([(rid, req.blocks, computed, scheduled)])
    else:
        blocks = req.blocks if resumed else fresh
        output = step_output([], [(rid, blocks, computed, scheduled)], {rid} if resumed else ())
    meta = engine.scheduler.build_connector_meta(output)
    for worker in engine.workers:
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
    engine.scheduler.update_connector_output(engine.worker_meta())
    req.num_computed_tokens = computed + scheduled
    return meta


def sample(req: Any) -> None:
    """vLLM appends the token a step sampled (the next step computes its KV)."""
    req.all_token_ids.append(9000 + req.num_tokens)
    req.num_tokens += 1


def planned(meta: TierKVConnectorMetadata) -> list[tuple[int, int]]:
    return [(spec.first_chunk, spec.end_chunk) for spec in meta.stores]


def decode(engine: Engine, req: Any, until: int, *, lag: bool = False) -> dict[int, Any]:
    """Decode one token a step until ``req`` holds ``until`` known tokens. Per step that
    planned stores, keyed by the tokens with KV after it: the chunk ranges. ``lag``: async
    scheduling, where a step is planned before the previous step's token is known (its input
    is a placeholder)."""
    plans = {}
    while req.num_tokens < until:
        computed = req.num_tokens if lag else req.num_tokens - 1
        meta = run_step(engine, req, computed, 1)
        if meta.stores:
            plans[computed + 1] = planned(meta)
        sample(req)
    return plans


def assert_loads_blocks(server: Any, a: Engine, a_blocks: list[int], tokens: list[int]) -> None:
    """A fresh engine whose prompt is ``tokens`` loads ``len(a_blocks)`` blocks: on every rank
    the bytes of A's blocks."""
    b = make_engine(server.endpoint, f"engine-b-{len(tokens)}", world_size=len(a.workers))
    req, b_blocks = load(b, "b-1", tokens)
    meta = b.scheduler.build_connector_meta(step_output([]))
    assert [(spec.start_block, spec.end_block) for spec in meta.loads] == [(0, len(a_blocks))]
    for rank, worker in enumerate(b.workers):
        worker.start_load_kv(meta)
        assert worker.get_block_ids_with_load_errors() == set()
        for a_block, b_block in zip(a_blocks, b_blocks, strict=False):
            got, want = b.block_bytes(b_block, rank), a.block_bytes(a_block, rank)
            assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    b.scheduler.request_finished(req)


def test_store_decode_is_off_by_default_and_must_be_a_flag() -> None:
    assert ConnectorSettings.from_extra_config({"endpoint": "x"}).store_decode is False
    assert ConnectorSettings.from_extra_config({"store_decode": True}).store_decode is True
    # Strings read as every tierkv option does (tierkv.options): yes/no, on/off, true/false.
    assert ConnectorSettings.from_extra_config({"store_decode": "yes"}).store_decode is True
    with pytest.raises(SettingsError, match="store_decode"):
        ConnectorSettings.from_extra_config({"store_decode": "maybe"})


def test_decode_chunks_are_stored_once_each_in_the_step_that_fills_them(server: Any) -> None:
    a = make_engine(server.endpoint, "engine-a", world_size=2, store_decode=True)
    req = request("a-1", list(range(100, 400)))  # 300 tokens: one full prompt chunk
    assert start(a, req) == 0
    assert planned(run_step(a, req, 0, 300, new=True)) == [(0, 1)]
    sample(req)
    # A token gets its KV in the step after the one that sampled it: chunk 1 is stored in the
    # step whose input is token 511, chunk 2 in the last step (input 767, sampling token 768).
    assert decode(a, req, 769) == {512: [(1, 2)], 768: [(2, 3)]}
    report = a.scheduler.request_finished(req, req.blocks)["tierkv"]
    assert not a.scheduler.keeps_blocks("a-1")  # nothing left to store
    assert report["stored_chunks"] == 3
    assert [rank["written_chunks"] for rank in report["ranks"]] == [3, 3]
    # Nothing to do: an empty step (but for the count of the scheduler's registrations).
    idle = TierKVConnectorMetadata(registrations=a.scheduler.link.generation)
    assert a.scheduler.build_connector_meta(step_output([])) == idle
    with server.client(timeout=5.0) as admin:
        assert admin.stats().objects == 6  # 3 chunks per rank; token 768 had no KV

    # The next turn, prompt + answer + more, loads all of it, each rank its own.
    assert_loads_blocks(server, a, req.blocks[:6], req.all_token_ids + [5] * 60)


def test_default_settings_store_prompt_chunks_only(server: Any) -> None:
    a = make_engine(server.endpoint, "engine-a")
    req = request("a-1", list(range(100, 400)))
    assert start(a, req) == 0
    assert planned(run_step(a, req, 0, 300, new=True)) == [(0, 1)]
    sample(req)
    assert decode(a, req, 600) == {}
    assert a.scheduler.request_finished(req, req.blocks)["tierkv"]["stored_chunks"] == 1
    assert not a.scheduler.keeps_blocks("a-1")


def test_a_chunk_completed_before_the_request_ends_unplanned_is_stored_before_its_blocks_go(
    server: Any,
) -> None:
    """Async scheduling: each step is planned before the previous step's token is known, so
    the chunk that the last computed token completes is planned by ``request_finished``, into
    the next step; vLLM keeps the blocks until the workers report that step's store."""
    a = make_engine(server.endpoint, "engine-a", world_size=2, store_decode=True)
    req = request("a-1", list(range(100, 350)))  # 250 tokens: no full prompt chunk
    assert start(a, req) == 0
    assert planned(run_step(a, req, 0, 250, new=True)) == []
    # Token 255 gets its KV in the step that computes 256 tokens; its id is known a step later.
    assert decode(a, req, 512, lag=True) == {257: [(0, 1)]}
    # Token 511 got its KV in the last step, but its id came after that step was planned.
    # max_tokens reached: vLLM schedules the request no more, then ends it.
    assert planned(a.scheduler.build_connector_meta(step_output([]))) == []
    sample(req)  # the last token, never computed
    report = a.scheduler.request_finished(req, req.blocks)["tierkv"]
    assert report["stored_chunks"] == 2
    assert a.scheduler.keeps_blocks("a-1")  # the connector answers vLLM: do not free them
    meta = a.scheduler.build_connector_meta(step_output([]))
    assert planned(meta) == [(1, 2)] and meta.release == ["a-1"]
    for worker in a.workers:
        worker.wait_for_save(meta)
        assert worker.get_finished() == ({"a-1"}, None)  # finished sending: vLLM frees them
    assert not a.scheduler.keeps_blocks("a-1")
    with server.client(timeout=5.0) as admin:
        assert admin.stats().objects == 4
    assert_loads_blocks(server, a, req.blocks[:4], req.all_token_ids + [5] * 10)

    # A request that ends while the step computing its last chunk's final token is still in
    # flight (an EOS sampled the step before): that chunk is not stored, the blocks are freed.
    req = request("a-2", list(range(2000, 2250)))
    assert start(a, req) == 0
    run_step(a, req, 0, 250, new=True)
    assert decode(a, req, 511, lag=True) == {257: [(0, 1)]}
    run_step(a, req, 511, 1)  # token 511 is this step's input, not known yet
    req.num_in_flight_tokens = 1
    sample(req)  # token 511 is EOS: vLLM ends the request, its last step still in flight
    assert a.scheduler.request_finished(req, req.blocks)["tierkv"]["stored_chunks"] == 1
    assert not a.scheduler.keeps_blocks("a-2")
    # Nothing to do: an empty step (but for the count of the scheduler's registrations).
    idle = TierKVConnectorMetadata(registrations=a.scheduler.link.generation)
    assert a.scheduler.build_connector_meta(step_output([])) == idle


def test_a_preempted_request_does_not_store_its_chunks_again(server: Any) -> None:
    engine = make_engine(server.endpoint, "engine-a", store_decode=True)
    req = request("r-1", list(range(100, 400)))
    assert start(engine, req) == 0
    assert planned(run_step(engine, req, 0, 300, new=True)) == [(0, 1)]
    sample(req)
    assert decode(engine, req, 520) == {512: [(1, 2)]}

    # Preempted: vLLM frees its blocks and computes it again. Its lookup covers the prompt.
    engine.free += req.blocks
    req.blocks, req.num_computed_tokens = [], 0
    assert start(engine, req) == CHUNK
    meta = engine.scheduler.build_connector_meta(step_output([]))
    assert [(spec.start_block, spec.end_block) for spec in meta.loads] == [(0, 2)]
    assert meta.stores == []
    for worker in engine.workers:
        worker.start_load_kv(meta)
    engine.scheduler.update_connector_output(engine.worker_meta())
    # Resumed: the rest of the prompt and the output so far in one step, chunk 1 complete again.
    assert planned(run_step(engine, req, CHUNK, 520 - CHUNK, resumed=True)) == []
    sample(req)
    assert decode(engine, req, 769) == {768: [(2, 3)]}
    report = engine.scheduler.request_finished(req, req.blocks)["tierkv"]
    assert report["stored_chunks"] == 3 and report["loaded_tokens"] == CHUNK


@pytest.mark.parametrize(
    ("async_store", "reserve_first"), [(False, False), (True, False), (False, True)]
)
def test_nothing_is_stored_on_top_of_a_failed_load(
    server: Any, async_store: bool, reserve_first: bool
) -> None:
    a = make_engine(server.endpoint, "engine-a")
    b = make_engine(server.endpoint, "engine-b", store_decode=True, async_store=async_store)
    tokens = list(range(3000, 3600))  # 2 full chunks
    compute_and_store(a, "a-1", tokens)

    req = request("b-1", tokens)
    assert start(b, req) == 2 * CHUNK
    b.scheduler.link.call("end_session", lambda c: c.end_session("b-1"), 0)  # locks gone
    meta = b.scheduler.build_connector_meta(step_output([]))
    assert meta.stores == []  # vLLM does not run a request while it loads
    # Were a chunk of it stored in the step its load fails, the worker would drop it.
    stray = StoreSpec("b-1", 2, 3, tuple(req.blocks[4:6]), tokens=pack_tokens(tokens[:512] * 2))
    meta.stores.append(stray)
    with server.client(timeout=5.0) as admin:
        objects = admin.stats().objects
    if reserve_first:  # reserved before the load failed: the reservation is given back
        b.worker.prepare_stores(meta)
    b.worker.start_load_kv(meta)
    b.worker.wait_for_save(meta)
    assert b.worker.wait_for_stores(timeout=30)
    assert b.worker.get_block_ids_with_load_errors() == set(req.blocks[:4])
    assert b.worker.stats["stored_chunks"] == 0
    with server.client(timeout=5.0) as admin:
        stats = admin.stats()
    assert stats.objects == objects and stats.write_leases == 0
    b.scheduler.update_connector_output(b.worker.build_worker_meta())

    # vLLM recomputes it all (the failure was at token 0), then decodes: every chunk is
    # planned once, after the step that computed it.
    assert planned(run_step(b, req, 0, 600, new=True)) == [(0, 2)]
    sample(req)
    assert decode(b, req, 769) == {768: [(2, 3)]}
    report = b.scheduler.request_finished(req, req.blocks)["tierkv"]
    assert report["stored_chunks"] == 3 and report["load_failed_from"] == 0


# -- asynchronous stores (async_store) -----------------------------------------------------------
def test_async_store_is_off_by_default_and_never_for_a_producer() -> None:
    assert ConnectorSettings.from_extra_config({"endpoint": "x"}).async_store is False
    settings = ConnectorSettings.from_extra_config({"endpoint": "x", "async_store": "true"})
    assert settings.async_store is True
    assert stores_async(settings, can_load=True, can_save=True)  # kv_both
    assert not stores_async(settings, can_load=False, can_save=True)  # kv_producer
    assert not stores_async(settings, can_load=True, can_save=False)  # kv_consumer
    off = ConnectorSettings.from_extra_config({"async_store": "false"})
    assert not stores_async(off, can_load=True, can_save=True)


def test_the_store_thread_runs_jobs_in_order_and_counts_each_requests_pending_ones() -> None:
    stores = StoreQueue("test-stores")
    gate, ran = threading.Event(), []
    stores.submit("gate", gate.wait)
    for i, rid in enumerate(["r-1", "r-2", "r-1"]):
        stores.submit(rid, lambda i=i: ran.append(i))
    stores.submit("r-3", lambda: 1 / 0)  # a job that raises still ends
    assert stores.pending("r-1") and stores.pending("r-3")
    assert not stores.wait(["r-1"], timeout=0)
    gate.set()
    assert stores.wait(["r-1", "r-2", "r-3"]) and stores.drain()
    assert ran == [0, 1, 2] and not stores.pending("r-1") and not stores.pending("r-3")
    assert stores.close(timeout=5.0)


def gated(engine: Engine) -> threading.Event:
    """Hold every rank's store thread until the returned event is set."""
    gate = threading.Event()
    for worker in engine.workers:
        assert worker._stores is not None
        worker._stores.submit("gate", gate.wait)
    return gate


def objects(server: Any) -> int:
    with server.client(timeout=5.0) as admin:
        return int(admin.stats().objects)


def test_an_async_store_keeps_a_finished_requests_blocks_until_every_rank_stored(
    server: Any,
) -> None:
    a = make_engine(server.endpoint, "engine-a", world_size=2, async_store=True)
    req = request("a-1", list(range(100, 700)))  # 600 tokens: 2 full chunks
    assert start(a, req) == 0
    gate = gated(a)
    assert planned(run_step(a, req, 0, 600, new=True)) == [(0, 2)]  # returns: queued
    sample(req)
    report = a.scheduler.request_finished(req, req.blocks)["tierkv"]
    assert report["stored_chunks"] == 2
    assert [rank["written_chunks"] for rank in report["ranks"]] == [0, 0]  # not yet
    assert a.scheduler.keeps_blocks("a-1")  # vLLM must not free them yet
    meta = a.scheduler.build_connector_meta(step_output([]))
    assert meta.release == ["a-1"] and meta.stores == []
    for worker in a.workers:
        worker.wait_for_save(meta)
        assert worker.get_finished() == (None, None)  # still queued: blocks held
    assert objects(server) == 0

    gate.set()
    for worker in a.workers:
        assert worker.wait_for_stores(timeout=30)
        assert worker.get_finished() == ({"a-1"}, None)  # once, from every rank
        assert worker.get_finished() == (None, None)
        assert worker.stats_snapshot()["stored_chunks"] == 2
    assert objects(server) == 4
    assert not a.scheduler.keeps_blocks("a-1")
    assert_loads_blocks(server, a, req.blocks[:4], req.all_token_ids)


def test_a_request_that_never_stored_is_freed_at_once(server: Any) -> None:
    a = make_engine(server.endpoint, "engine-a", async_store=True)
    req = request("a-1", list(range(100, 300)))  # no full chunk
    assert start(a, req) == 0
    assert planned(run_step(a, req, 0, 200, new=True)) == []
    a.scheduler.request_finished(req, req.blocks)
    assert not a.scheduler.keeps_blocks("a-1")


def test_a_preempted_requests_stores_end_before_the_next_forward_pass(server: Any) -> None:
    a = make_engine(server.endpoint, "engine-a", async_store=True)
    req = request("a-1", list(range(100, 700)))
    assert start(a, req) == 0
    gate = gated(a)
    assert planned(run_step(a, req, 0, 600, new=True)) == [(0, 2)]
    assert a.worker._stores is not None and a.worker._stores.pending("a-1")

    # vLLM preempts it: its blocks are free from the next step on.
    meta = a.scheduler.build_connector_meta(step_output([], preempted={"a-1"}))
    assert meta.preempted == ["a-1"]
    opener = threading.Thread(target=gate.set)
    opener.start()
    a.worker.handle_preemptions(meta)  # returns only once the store has ended
    assert not a.worker._stores.pending("a-1") and objects(server) == 2
    opener.join()
    # Nothing of it is left running: when it ends, vLLM may free its blocks at once.
    a.scheduler.request_finished(req, req.blocks)
    assert not a.scheduler.keeps_blocks("a-1")
    # Preemptions of requests without stores running are not waited for.
    assert a.scheduler.build_connector_meta(step_output([], preempted={"x"})).preempted == []


def test_a_failed_async_store_still_releases_its_request(server: Any) -> None:
    a = make_engine(server.endpoint, "engine-a", async_store=True, timeout=0.5)
    req = request("a-1", list(range(100, 700)))
    assert start(a, req) == 0
    gate = gated(a)
    run_step(a, req, 0, 600, new=True)
    a.scheduler.request_finished(req, req.blocks)
    meta = a.scheduler.build_connector_meta(step_output([]))
    a.worker.wait_for_save(meta)
    server.kill()  # the queued store finds the server gone
    gate.set()
    assert a.worker.wait_for_stores(timeout=30)
    assert a.worker.get_finished() == ({"a-1"}, None)  # vLLM frees the blocks anyway
    assert a.worker.stats_snapshot()["stored_chunks"] == 0
    assert a.worker.link.failures >= 1
    a.worker.shutdown()


def test_a_pool_is_page_locked_only_for_a_cache_on_a_gpu() -> None:
    """Host caches copy with numpy from pageable memory: nothing to register, and the
    mapping stays closable (no export of it is left behind)."""
    import mmap

    from tierkv.integrations.vllm.pinning import page_lock

    mm = mmap.mmap(-1, 1 << 20)
    buf = memoryview(mm)
    assert page_lock(buf, torch.device("cpu")) is None
    buf.release()
    mm.close()  # raises BufferError if a view of it were still alive


# -- which models the connector serves -----------------------------------------------------------
def kv_cache_config(*group_specs: Any) -> Any:
    """A KVCacheConfig with one group per spec (one layer each), as vLLM hands it over."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"model.layers.{i}.attn"], s) for i, s in enumerate(group_specs)]
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


def test_the_models_the_connector_serves_and_why_it_refuses_the_others() -> None:
    """Full attention (a sliding window included, as vLLM hands it with its hybrid manager
    off), MLA, and full-attention and sliding-window groups of one geometry (the hybrid
    manager on) are served; the others are refused with the reason (the connector then
    stays inactive: the engine runs, every request a miss)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    from tierkv.integrations.vllm.connector import _attention_spec, _is_latent, _layer_groups
    from tierkv.integrations.vllm.layout import UnsupportedLayoutError

    def attention(spec: Any = FullAttentionSpec, **kw: Any) -> Any:
        geometry = {"num_kv_heads": 2, "head_size": 64, "dtype": torch.float32, **kw}
        return spec(**{"block_size": BLOCK, **geometry})

    full, windowed = attention(), attention(sliding_window=128)
    sliding = attention(SlidingWindowSpec, sliding_window=128)
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32)
    assert _attention_spec(kv_cache_config(full)) is full
    assert _attention_spec(kv_cache_config(windowed)) is windowed
    assert _is_latent(_attention_spec(kv_cache_config(mla)))
    hybrid = kv_cache_config(sliding, sliding, full)
    assert _attention_spec(hybrid) is sliding
    names = [f"model.layers.{i}.attn" for i in range(3)]
    assert _layer_groups(hybrid, names) == {name: i for i, name in enumerate(names)}
    assert _layer_groups(hybrid, names[1:]) == {name: i + 1 for i, name in enumerate(names[1:])}
    assert _layer_groups(kv_cache_config(full), names[:1]) is None
    with pytest.raises(UnsupportedLayoutError, match="not SlidingWindowSpec"):
        _attention_spec(kv_cache_config(sliding))  # alone: vLLM frees every old block
    with pytest.raises(UnsupportedLayoutError, match=r"has 2 \(FullAttentionSpec, MLA"):
        _attention_spec(kv_cache_config(full, mla))
    with pytest.raises(UnsupportedLayoutError, match="one block size and head geometry"):
        _attention_spec(
            kv_cache_config(full, attention(SlidingWindowSpec, sliding_window=8, head_size=32))
        )


def test_layers_of_one_type_but_other_shapes_keep_the_connector_inactive() -> None:
    """vLLM puts layers of one type but other shapes in one group (UniformTypeKVCacheSpecs):
    every layer's spec is checked at start (both roles then go inactive), not the first
    one's alone (the worker's registration raised into vLLM and the engine did not start)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        UniformTypeKVCacheSpecs,
    )

    from tierkv.integrations.vllm.connector import _attention_spec
    from tierkv.integrations.vllm.layout import UnsupportedLayoutError

    def uniform(**second: Any) -> Any:
        geometry = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 64}
        specs = {
            "model.layers.0.attn": FullAttentionSpec(**geometry, dtype=torch.float32),
            "model.layers.1.attn": FullAttentionSpec(**{**geometry, **second}),
        }
        group = KVCacheGroupSpec(list(specs), UniformTypeKVCacheSpecs.from_specs(specs))
        return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[group])

    same = uniform(dtype=torch.float32)
    assert (
        _attention_spec(same)
        is same.kv_cache_groups[0].kv_cache_spec.kv_cache_specs["model.layers.0.attn"]
    )
    for other in ({"num_kv_heads": 4}, {"head_size": 32}, {"dtype": torch.bfloat16}):
        with pytest.raises(UnsupportedLayoutError, match="one block size, head geometry"):
            _attention_spec(uniform(**{"dtype": torch.float32, **other}))


def test_caches_the_worker_cannot_map_leave_it_inactive_never_raise_into_vllm(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Tensors that do not fit the spec vLLM gave (here: one layer with other heads)
    deactivate the worker with one log line; register_kv_caches raised into vLLM's worker
    and the engine did not start. Loads planned for it fail (vLLM recomputes)."""
    from tierkv.integrations.vllm.connector import TierKVConnector

    connector = TierKVConnector.__new__(TierKVConnector)
    spec = kv_cache_config_spec()
    settings = ConnectorSettings.from_extra_config({"endpoint": "ipc:///nonexistent.sock"})
    worker = WorkerSide(
        settings, model_id="m", engine_id="e", world_size=1, rank=0, can_load=True, can_save=True
    )
    backend = SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: "FLASH_ATTN"))
    names = ("model.layers.0.attn", "model.layers.1.attn")
    forward_context = dict.fromkeys(names, backend)
    connector.settings, connector._spec, connector._state = settings, spec, None
    connector._unsupported, connector._scheduler, connector._worker = "", None, worker
    connector._kv_cache_config = None
    connector._vllm_config = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=forward_context)
    )
    caches = {
        names[0]: torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD),
        names[1]: torch.zeros(NUM_BLOCKS, 2 * HEADS, BLOCK, 2 * HEAD),
    }
    with caplog.at_level("WARNING", logger="vllm.tierkv"):
        connector.register_kv_caches(caches)
    assert [r.getMessage() for r in caplog.records if "neither loads nor stores" in r.getMessage()]
    assert len(caplog.records) == 1 and connector._unsupported
    assert worker.layout is None and not worker.can_load and not worker.can_save
    with caplog.at_level("WARNING", logger="vllm.tierkv"):
        # The scheduler registered: an inactive worker does not try to (it cannot), which
        # logged the server as failing at every step, and retried for ever.
        meta = TierKVConnectorMetadata(loads=[LoadSpec("r", 0, 2, (3, 4))], registrations=1)
        worker.start_load_kv(meta)
    assert worker.get_block_ids_with_load_errors() == {3, 4}
    assert not [r for r in caplog.records if "server at" in r.getMessage()]  # no attempt
    worker.shutdown()


def kv_cache_config_spec() -> Any:
    """The FullAttentionSpec of this file's CPU caches."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32
    )


def test_chunks_with_a_groups_null_block_are_not_stored(server: Any) -> None:
    """Two KV cache groups (full attention, sliding window): a request's chunks are stored
    with one block id per group and position, but never from a chunk on whose sliding
    blocks vLLM freed (null block 0) on."""
    from tierkv.integrations.vllm.chunks import block_positions

    engine = make_engine(server.endpoint, "engine-a")
    tokens = list(range(5000, 5000 + 700))  # 2 full chunks, 6 blocks

    def plan(rid: str, groups: tuple[list[int], ...]) -> Any:
        req = request(rid, tokens)
        assert ask(engine, req) == (0, False)
        engine.scheduler.update_state_after_alloc(req, block_positions(groups) or [], 0)
        output = step_output([(rid, [], 0, len(tokens))])
        output.scheduled_new_reqs[0].block_ids = groups
        return engine.scheduler.build_connector_meta(output)

    full = [1, 2, 3, 4, 5, 6]
    (spec,) = plan("live", (full, [7, 8, 9, 10, 11, 12])).stores
    assert (spec.first_chunk, spec.end_chunk) == (0, 2)
    assert spec.block_ids == ((1, 7), (2, 8), (3, 9), (4, 10))
    assert plan("chunk-1-freed", (full, [7, 8, 0, 10, 11, 12])).stores[0].end_chunk == 1
    assert plan("chunk-0-freed", (full, [0, 0, 9, 10, 11, 12])).stores == []


def two_group_step(
    rid: str,
    added: tuple[list[int], list[int]],
    now: tuple[list[int], list[int]],
    computed: int,
    scheduled: int,
) -> Any:
    """A step of a running request of a two-group model (full attention, sliding window):
    the blocks vLLM added (``new_block_ids``) and its tables as they are now
    (``kv_connector_block_state``: the sliding window's freed blocks null)."""
    output = step_output([], [(rid, added[0], computed, scheduled)])
    output.scheduled_cached_reqs.new_block_ids = [added]
    output.kv_connector_block_state = SimpleNamespace(
        get_block_ids=lambda r: now if r == rid else None
    )
    return output


def start_two_groups(
    engine: Engine, rid: str, tokens: list[int], first: tuple[list[int], ...]
) -> Any:
    from tierkv.integrations.vllm.chunks import block_positions

    req = request(rid, tokens)
    assert ask(engine, req) == (0, False)
    engine.scheduler.update_state_after_alloc(req, block_positions(first) or [], 0)
    output = step_output([(rid, [], 0, BLOCK)])
    output.scheduled_new_reqs[0].block_ids = first
    assert engine.scheduler.build_connector_meta(output).stores == []  # no chunk complete
    return req


def test_a_chunk_on_sliding_blocks_vllm_freed_in_a_later_step_is_not_stored(server: Any) -> None:
    """vLLM frees a sliding-window group's blocks behind the window as a request's prefill
    moves on (and may hand them to another request in the same step), telling the connector
    only of the blocks it adds: the connector plans from the tables as they are now, so a
    chunk on a freed block is not stored (before, it was, from blocks another request's
    forward pass wrote)."""
    engine = make_engine(server.endpoint, "engine-a", tables_change=True)
    start_two_groups(engine, "sw", list(range(6000, 6700)), ([1], [7]))
    # Tokens [128, 512): chunks 0 and 1 complete; block 7 is behind the window now.
    step = two_group_step("sw", ([2, 3, 4], [8, 9, 10]), ([1, 2, 3, 4], [0, 8, 9, 10]), 128, 384)
    assert engine.scheduler.build_connector_meta(step).stores == []


def test_async_stores_of_sliding_blocks_vllm_frees_end_before_the_next_forward_pass(
    server: Any,
) -> None:
    """A store on the workers' store threads may still read blocks vLLM frees behind a
    sliding window in the next step (or as the request finishes): the workers wait for the
    request's stores before the forward pass that may reuse them, as for a preemption."""
    engine = make_engine(server.endpoint, "engine-a", async_store=True, tables_change=True)
    req = start_two_groups(engine, "sw", list(range(7000, 7700)), ([1], [7]))
    step = two_group_step("sw", ([2], [8]), ([1, 2], [7, 8]), 128, 128)
    meta = engine.scheduler.build_connector_meta(step)
    assert planned(meta) == [(0, 1)] and meta.preempted == []  # running on the store threads
    # Tokens [256, 512): vLLM freed chunk 0's sliding blocks; chunk 1 is stored.
    step = two_group_step("sw", ([3, 4], [9, 10]), ([1, 2, 3, 4], [0, 0, 9, 10]), 256, 256)
    meta = engine.scheduler.build_connector_meta(step)
    assert meta.preempted == ["sw"] and planned(meta) == [(1, 2)]
    assert meta.stores[0].block_ids == ((3, 9), (4, 10))
    # Nothing freed since: no wait.
    step = two_group_step("sw", ([], []), ([1, 2, 3, 4], [0, 0, 9, 10]), 512, 1)
    assert engine.scheduler.build_connector_meta(step).preempted == []
    # It finishes; vLLM frees block 9 first: the next forward pass waits, the rest is kept.
    engine.scheduler.request_finished(req, [(1, 0), (2, 0), (3, 0), (4, 10)])
    assert engine.scheduler.keeps_blocks("sw")
    meta = engine.scheduler.build_connector_meta(step_output([]))
    assert meta.preempted == ["sw"] and meta.release == ["sw"]


def test_a_mamba_hybrid_engine_starts_with_the_connector_inactive_every_request_a_miss(
    server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A Mamba-2 hybrid (Nemotron-H, vLLM's prefix caching off): one full-attention group and
    one Mamba state group, whose block size vLLM sets to 4096 tokens (no multiple of the
    chunk size). Both roles start, the scheduler says once why the connector is inactive,
    every request is a miss, nothing is stored, and the worker registers the raw int8 page
    views of the state layers without touching them."""
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from tierkv.integrations.vllm.connector import TierKVConnector

    block = 4096
    attention = FullAttentionSpec(
        block_size=block, num_kv_heads=2, head_size=64, dtype=torch.float32
    )
    state = MambaSpec(
        block_size=block, shapes=((3, 512), (8, 32, 16)), dtypes=(torch.float32, torch.float32)
    )
    config = kv_cache_config(attention, state)
    vllm_config = VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="TierKVConnector",
            kv_connector_module_path="tierkv.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"endpoint": server.endpoint, "model_id": "nemotron-h"},
        ),
        cache_config=CacheConfig(block_size=block),
    )
    with caplog.at_level("WARNING", logger="vllm.tierkv"):
        scheduler = TierKVConnector(vllm_config, KVConnectorRole.SCHEDULER, config)
        worker = TierKVConnector(vllm_config, KVConnectorRole.WORKER, config)
    inactive = [r for r in caplog.records if "neither loads nor stores" in r.getMessage()]
    assert len(inactive) == 1 and "MambaSpec" in inactive[0].getMessage()
    try:
        pages = torch.zeros(4, attention.page_size_bytes, dtype=torch.int8)
        caches = {"model.layers.0.attn": pages[:, : 2 * block * 2 * 64 * 4].view(torch.float32)}
        caches["model.layers.1.attn"] = pages  # the state layer: raw int8 page views
        before = pages.clone()
        worker.register_kv_caches(caches)
        tokens = list(range(7000, 7000 + 600))
        for rid in ("first", "again"):
            req = request(rid, tokens)
            assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
            scheduler.update_state_after_alloc(
                req, SimpleNamespace(get_block_ids=lambda: ([1], [2])), 0
            )
            meta = scheduler.build_connector_meta(step_output([(rid, [1], 0, len(tokens))]))
            assert isinstance(meta, TierKVConnectorMetadata)
            assert meta.loads == [] and meta.stores == []
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
            worker.wait_for_save()
            worker.clear_connector_metadata()
            assert scheduler.request_finished_all_groups(req, ([1], [2]))[0] is False
        assert torch.equal(pages, before)
    finally:
        scheduler.shutdown()
        worker.shutdown()
    with server.client(timeout=5.0) as client:
        assert client.stats().objects == 0


# -- KV events -----------------------------------------------------------------------------------
def hashed_request(rid: str, tokens: list[int]) -> Any:
    """A vLLM request with vLLM's block hashes (what KV events name blocks by)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    return Request(
        rid,
        tokens,
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(BLOCK, sha256_cbor),
    )


def events_until(engines: Sequence[Engine], want: Callable[[list[Any]], bool]) -> list[list[Any]]:
    """Each engine's KV events (``take_events``, as vLLM calls it every step) until ``want``
    holds for every engine's (a bounded poll: the feed is read on a thread)."""
    got: list[list[Any]] = [[] for _ in engines]
    deadline = time.monotonic() + 30
    while not all(want(events) for events in got):
        assert time.monotonic() < deadline, got
        for events, engine in zip(got, engines, strict=True):
            events += engine.scheduler.take_events()  # never raises, never waits
        time.sleep(0.02)
    return got


def test_kv_events_announce_what_any_engine_stored_withdraw_it_and_resume_after_a_restart(
    server: Any,
) -> None:
    """Engine A stores a prompt with KV events on: A's and B's schedulers both announce its
    chunks' blocks (vLLM's BlockStored of each chunk, in the pool's medium). The server is
    killed: both withdraw them (every lookup is a miss meanwhile), no exception reaches the
    engine. It restarts, B stores another prompt and A stores its prompt again: both announce
    both (B's scheduler registered again before B's worker did, at its store: the feed tells
    it to resync when the worker's namespace joins)."""
    a = make_engine(server.endpoint, "engine-a", timeout=1.0, retry_interval=0.2, kv_events=True)
    b = make_engine(server.endpoint, "engine-b", timeout=1.0, retry_interval=0.2, kv_events=True)
    tokens = list(range(3000, 3000 + 600))  # 2 full chunks + a tail
    req = hashed_request("a-1", tokens)
    notes = [chunk_note(req, c * BPC, BPC, BLOCK) for c in range(2)]
    compute_and_store(a, "a-1", tokens, req=req)
    want = [e for n in notes for e in stored_events(n)]
    assert all(e.medium == MEDIUM for e in want)

    def stored(events: list[Any]) -> bool:
        return all(e in events for e in want) and all(isinstance(e, BlockStored) for e in events)

    events_until([a, b], stored)
    removed = [e.block_hashes for e in want]

    def withdrawn(events: list[Any]) -> bool:
        return sorted(e.block_hashes for e in events if isinstance(e, BlockRemoved)) == sorted(
            removed
        )

    server.kill()
    for engine in (a, b):
        assert all(e.medium == MEDIUM for e in events_until([engine], withdrawn)[0])
        assert engine.scheduler.events is not None
        assert engine.scheduler.events.poller.failed_reads > 0
    server.start()
    other = list(range(5000, 5000 + 300))
    b_req = hashed_request("b-1", other)
    compute_and_store(b, "b-1", other, req=b_req)
    compute_and_store(a, "a-2", tokens, req=hashed_request("a-2", tokens))
    want += stored_events(chunk_note(b_req, 0, BPC, BLOCK))
    events_until([a, b], stored)
    for engine in (a, b):
        engine.scheduler.shutdown()


def test_kv_events_off_no_notes_and_no_feed_reading(server: Any) -> None:
    a = make_engine(server.endpoint, "engine-a")
    assert a.scheduler.events is None and a.scheduler.take_events() == []
    assert not any(t.name == "tierkv-kv-events" for t in threading.enumerate())
    tokens = list(range(4000, 4000 + 300))
    req = hashed_request("a-1", tokens)
    assert ask(a, req) == (0, False)
    blocks = a.blocks(3)
    a.scheduler.update_state_after_alloc(req, blocks, 0)
    meta = a.scheduler.build_connector_meta(step_output([("a-1", blocks, 0, 300)]))
    assert [s.notes for s in meta.stores] == [None]
    # On: the same store carries its chunk's note; a producer (never loads) reads no feed.
    p = make_engine(server.endpoint, "engine-p", role="kv_producer", kv_events=True)
    assert p.scheduler.events is None
    req = hashed_request("p-1", tokens)
    assert ask(p, req) == (0, False)
    p.scheduler.update_state_after_alloc(req, blocks, 0)
    meta = p.scheduler.build_connector_meta(step_output([("p-1", blocks, 0, 300)]))
    assert [s.notes for s in meta.stores] == [(chunk_note(req, 0, BPC, BLOCK),)]


@pytest.mark.parametrize("mla", [False, True], ids=["tp2", "tp2-mla"])
def test_kv_events_of_ranks_announce_each_chunk_once(server: Any, mla: bool) -> None:
    """Two ranks: without MLA each stores its own part, with its chunk's note, and the
    blocks are announced once both parts are held; with MLA rank 0 alone stores, for both.
    Either way each chunk's blocks are announced once, and withdrawn once."""
    engine = make_engine(
        server.endpoint, "engine-tp", world_size=2, mla=mla, kv_events=True, timeout=10.0
    )
    tokens = list(range(7000, 7000 + 512))
    req = hashed_request("t-1", tokens)
    compute_and_store(engine, "t-1", tokens, req=req)
    want = [e for c in range(2) for e in stored_events(chunk_note(req, c * BPC, BPC, BLOCK))]
    with server.client(timeout=5.0) as admin:
        assert admin.stats().objects == (2 if mla else 4)  # parts: one per chunk and rank
    (got,) = events_until([engine], lambda events: len(events) >= 2)
    assert got == want
    with server.client(timeout=5.0) as admin:
        admin.clear()
    (got,) = events_until([engine], lambda events: len(events) >= 2)
    assert sorted(e.block_hashes for e in got) == sorted(e.block_hashes for e in want)
    assert all(isinstance(e, BlockRemoved) for e in got)
    assert engine.scheduler.take_events() == []
    engine.scheduler.shutdown()
