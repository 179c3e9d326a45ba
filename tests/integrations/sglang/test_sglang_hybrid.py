"""The SGLang backend's v2 interface (hybrid models' extra host pools) against a real
tierkv server, with SGLang's real host pools (KV, sliding-window KV, Mamba states), its
real hit-policy types and its own file backend as the reference.

Runs in the SGLang environment (.venv-sglang): ``make test`` runs it there.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from support import sglang_pools as sp
from support.servers import ServerProcess

pytestmark = [pytest.mark.sglang]


@pytest.fixture(autouse=True)
def sglang_installed() -> None:
    sp.require_sglang()


@pytest.fixture
def srv(server_factory: Callable[..., ServerProcess]) -> ServerProcess:
    return server_factory(pool_size="64MiB")


class Hybrid:
    """One engine rank's host pools: KV (the anchor), sliding-window KV, Mamba states."""

    def __init__(self, kv: str = "mha", **mamba: Any) -> None:
        self.kv = sp.host_pool(kv, "page_first")
        self.swa = sp.host_pool("mha", "page_first")
        self.mamba = sp.mamba_pool(**mamba)

    def pools(self) -> dict[Any, Any]:
        from sglang.srt.mem_cache.hicache_storage import PoolName

        return {PoolName.KV: self.kv, PoolName.SWA: self.swa, PoolName.MAMBA: self.mamba}

    def fill(self, seed: int) -> None:
        sp.fill_random(self.kv, seed)
        sp.fill_random(self.swa, seed + 1)
        sp.fill_random_mamba(self.mamba, seed + 2)


def attach(backend: Any, hybrid: Hybrid) -> Any:
    """Register the pools as SGLang's hybrid cache controller does: the anchor through
    ``register_mem_pool_host``, then every pool (the anchor too) through v2."""
    backend.register_mem_pool_host(hybrid.kv)
    for name, pool in hybrid.pools().items():
        backend.register_mem_host_pool_v2(pool, name)
    backend.on_host_pools_registered()
    return backend


def make(backends: list[Any], srv: ServerProcess, hybrid: Hybrid, **kw: Any) -> Any:
    extra = {"endpoint": srv.endpoint, **kw.pop("extra", {})}
    backend = attach(sp.create_backend(sp.storage_config(extra, **kw), hybrid.kv), hybrid)
    backends.append(backend)
    return backend


def keys_for(prefix: str, n: int) -> list[str]:
    return [hashlib.sha256(f"{prefix}-{i}".encode()).hexdigest() for i in range(n)]


def transfer(name: Any, keys: list[str], indices: Any = None, policy: Any = None) -> Any:
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer

    return PoolTransfer(
        name=name, keys=keys, host_indices=indices, hit_policy=policy or PoolHitPolicy.ALL_PAGES
    )


def assert_clean(srv: ServerProcess) -> None:
    with srv.client() as c:
        s = c.stats()
    assert s.read_locked == 0 and s.read_leases == 0, s
    assert s.write_leases == 0 and s.writing == 0, s


# -- the hit policies, on their own ----------------------------------------------------------
def test_the_longest_restorable_prefix_follows_each_policy_within_a_probe_budget() -> None:
    from tierkv.integrations.sglang.hit_policy import PoolCheck, longest_restorable

    def pool(held: set[int], calls: list[tuple[int, int]]) -> Any:
        def probe(start: int, stop: int) -> int:
            calls.append((start, stop))
            n = 0
            while start + n < stop and start + n in held:
                n += 1
            return n

        return probe

    held = {0, 1, 2, 4, 5, 7}  # pages 3 and 6 are missing
    calls: list[tuple[int, int]] = []

    def longest(policy: str, window: int, pages: int = 8, budget: int = 32) -> int:
        calls.clear()
        return longest_restorable([PoolCheck(policy, window, pool(held, calls), budget)], pages)

    assert longest("all_pages", 0) == 3 and calls == [(0, 8)]
    assert longest("trailing_pages", 1) == 8 and calls == [(7, 8)]
    assert longest("trailing_pages", 2) == 6 and calls == [(6, 8), (5, 6), (4, 5)]
    assert longest("trailing_pages", 2, pages=5) == 3
    assert len(calls) == len({s for s, _ in calls})  # no page is probed twice
    # Past the budget: no hit (a miss), never a guess.
    assert longest("trailing_pages", 2, budget=2) == 0
    # Several pools: the longest prefix all of them restore.
    a_calls: list[tuple[int, int]] = []
    checks = [
        PoolCheck("trailing_pages", 1, pool({2, 5}, a_calls)),  # states after pages 2, 5
        PoolCheck("trailing_pages", 2, pool({1, 2, 3, 4}, [])),  # windows ending 2..5
    ]
    assert longest_restorable(checks, 8) == 3
    assert [c.longest for c in checks] == [6, 3]
    with pytest.raises(ValueError, match="block_groups"):
        PoolCheck("block_groups", 0, pool(held, calls))


# -- byte-exact round trips of every pool ----------------------------------------------------
def test_hybrid_pools_round_trip_byte_exact(srv: ServerProcess, backends: list[Any]) -> None:
    """KV pages, sliding-window pages and Mamba states (three dtypes in one page) stored
    from one engine's pools are read by another engine into other slots, byte for byte;
    the prefix hit is where every pool can restore its state."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName

    trailing = PoolHitPolicy.TRAILING_PAGES
    src, dst = Hybrid(), Hybrid()
    src.fill(seed=1)
    writer, reader = make(backends, srv, src), make(backends, srv, dst)
    assert writer.sidecars["mamba"].geometry.flat and not writer.sidecars["swa"].geometry.flat
    keys = keys_for("hybrid", 6)
    assert writer.batch_set_v1(keys, sp.indices(src.kv, [0, 1, 2, 3, 4, 5])) == [True] * 6
    # A Mamba state after pages 2 and 5 (slots 7 and 3), SWA pages 4 and 5.
    stored = writer.batch_set_v2(
        [
            transfer(PoolName.MAMBA, [keys[2]], sp.slots([7]), trailing),
            transfer(PoolName.SWA, keys[4:6], sp.indices(src.swa, [8, 9]), trailing),
        ]
    )
    assert stored == {PoolName.MAMBA: [True], PoolName.SWA: [True, True]}
    assert writer.batch_set_v2([transfer(PoolName.MAMBA, [keys[5]], sp.slots([3]), trailing)]) == {
        PoolName.MAMBA: [True]
    }

    query = [
        transfer(PoolName.MAMBA, ["?"], policy=trailing),
        transfer(PoolName.SWA, ["?", "?"], policy=trailing),
    ]
    hit = reader.batch_exists_v2(keys, query)
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (6, [6])
    assert hit.extra_pool_hit_pages == {PoolName.KV: 6, PoolName.MAMBA: 6, PoolName.SWA: 6}
    only_mamba = reader.batch_exists_v2(keys[:5], query[:1])  # the state after page 2
    assert (only_mamba.kv_hit_pages, only_mamba.restorable_prefix_pages) == (3, [3])

    assert reader.batch_get_v1(keys, sp.indices(dst.kv, [10, 11, 12, 13, 14, 15])) == [True] * 6
    got = reader.batch_get_v2(
        [
            transfer(PoolName.MAMBA, [keys[5]], sp.slots([11]), trailing),
            transfer(PoolName.SWA, keys[4:6], sp.indices(dst.swa, [1, 2]), trailing),
        ]
    )
    assert got == {PoolName.MAMBA: [True], PoolName.SWA: [True, True]}
    assert sp.slot_bytes(dst.mamba, 11) == sp.slot_bytes(src.mamba, 3)
    assert [sp.page_bytes(dst.swa, p) for p in (1, 2)] == [
        sp.page_bytes(src.swa, p) for p in (8, 9)
    ]
    for s, d in zip(range(6), range(10, 16), strict=True):
        assert sp.page_bytes(dst.kv, d) == sp.page_bytes(src.kv, s)
    # A state that was never stored is a failed read, and leaves the slot as it was.
    before = sp.slot_bytes(dst.mamba, 12)
    assert reader.batch_get_v2([transfer(PoolName.MAMBA, [keys[4]], sp.slots([12]), trailing)]) == {
        PoolName.MAMBA: [False]
    }
    assert sp.slot_bytes(dst.mamba, 12) == before
    assert_clean(srv)
    # clear() empties every pool of the engine, its sidecars too.
    assert writer.clear() is True
    assert reader.batch_exists(keys) == 0
    mamba_only = transfer(PoolName.MAMBA, keys[5:6], sp.slots([13]), trailing)
    assert reader.batch_get_v2([mamba_only]) == {PoolName.MAMBA: [False]}


# -- the same answers as SGLang's own file backend -------------------------------------------
def run_contract(backend: Any, pools: Hybrid) -> list[Any]:
    """A script of v2 calls (every pool through v2, KV included) on the backend attached to
    ``pools``: it stores some of their pages and reads them back into others; every
    answer, and the bytes of every page read."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName

    trailing, all_pages = PoolHitPolicy.TRAILING_PAGES, PoolHitPolicy.ALL_PAGES
    kv, swa, mamba = PoolName.KV, PoolName.SWA, PoolName.MAMBA
    keys = keys_for("contract-v2", 8)

    def result(r: Any) -> Any:
        # The hit, the KV pool's own count and the longest restorable prefix: what both
        # backends answer alike (the file backend also lists every shorter restorable
        # prefix, tierkv only the longest: see hit_policy).
        return (
            r.kv_hit_pages,
            r.extra_pool_hit_pages.get("kv"),
            max(r.restorable_prefix_pages, default=0),
        )

    def plain(r: dict[Any, list[bool]]) -> dict[str, list[bool]]:
        return {str(k): v for k, v in r.items()}

    answers: list[Any] = [result(backend.batch_exists_v2(keys, []))]
    answers.append(
        plain(backend.batch_set_v2([transfer(kv, keys[:7], sp.indices(pools.kv, range(7)))]))
    )
    for page, slot in ((2, 4), (5, 9), (6, 1)):  # Mamba states after pages 2, 5 and 6
        t = transfer(mamba, [keys[page]], sp.slots([slot]), trailing)
        answers.append(plain(backend.batch_set_v2([t])))
    answers.append(
        plain(
            backend.batch_set_v2(
                [transfer(swa, keys[3:7], sp.indices(pools.swa, [3, 4, 5, 6]), trailing)]
            )
        )
    )
    answers.append(
        plain(backend.batch_set_v2([transfer(kv, keys[:2], sp.indices(pools.kv, [0, 1]))]))
    )
    mamba_q = transfer(mamba, ["?"], policy=trailing)
    swa_q = transfer(swa, ["?", "?"], policy=trailing)
    for query_keys, query_pools in (
        (keys, [mamba_q]),
        (keys, [swa_q]),
        (keys, [mamba_q, swa_q]),
        (keys, [swa_q, mamba_q]),
        (keys[:5], [mamba_q, swa_q]),
        (keys, [transfer(mamba, ["?"], policy=all_pages)]),
        (keys, [transfer(swa, ["?"], policy=all_pages)]),
        (keys_for("absent", 3), [mamba_q]),
        (keys[:5], [mamba_q]),
        (keys[:6], [mamba_q, swa_q]),
    ):
        answers.append(result(backend.batch_exists_v2(query_keys, query_pools)))
    got = backend.batch_get_v2(
        [
            transfer(mamba, [keys[5]], sp.slots([12]), trailing),
            transfer(swa, keys[5:7], sp.indices(pools.swa, [10, 11]), trailing),
            transfer(kv, keys[:3], sp.indices(pools.kv, [12, 13, 14])),
        ]
    )
    answers.append(plain(got))
    answers.append(
        plain(backend.batch_get_v2([transfer(mamba, [keys[3]], sp.slots([13]), trailing)]))
    )
    answers.append(
        plain(
            backend.batch_get_v2(
                [transfer(swa, keys[1:3], sp.indices(pools.swa, [2, 3]), trailing)]
            )
        )
    )
    answers.append(
        plain(backend.batch_get_v2([transfer(kv, keys[6:8], sp.indices(pools.kv, [7, 15]))]))
    )
    answers.append(sp.slot_bytes(pools.mamba, 12))
    answers.append([sp.page_bytes(pools.swa, p) for p in (10, 11)])
    answers.append([sp.page_bytes(pools.kv, p) for p in (12, 13, 14)])
    return answers


def test_v2_answers_equal_sglangs_file_backend(
    srv: ServerProcess, backends: list[Any], tmp_path: Path
) -> None:
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    mine, theirs = Hybrid(), Hybrid()
    mine.fill(seed=3)
    theirs.fill(seed=3)
    ours = run_contract(make(backends, srv, mine), mine)
    config = sp.storage_config({})
    file_config = HiCacheStorageConfig(
        **{**config.__dict__, "extra_config": {"file_storage_path": str(tmp_path / "hicache")}}
    )
    reference = run_contract(attach(HiCacheFile(file_config), theirs), theirs)
    assert ours == reference
    # Not trivially equal: the hits have holes and differ per policy.
    assert ours[0] == (0, None, 0)
    assert ours[7] == ours[8] == ours[9] == ours[10] == (7, 7, 7)
    assert ours[11] == (0, 5, 0)  # Mamba can restore prefix 3, SWA prefix 5: none both
    assert ours[12] == ours[13] == (0, 7, 0)  # all pages: none has page 0
    assert ours[14] == (0, None, 0)
    assert ours[15] == (3, 5, 3) and ours[16] == (6, 6, 6)  # the states after pages 2, 5
    assert ours[17] == {"mamba": [True], "swa": [True, True], "kv": [True] * 3}
    assert ours[18] == {"mamba": [False]}
    assert ours[19] == {"swa": [False, False]} and ours[20] == {"kv": [True, False]}
    # What was read is what was stored: the state of slot 9, the pages of SWA 5, 6, KV 0-2.
    assert ours[21] == sp.slot_bytes(mine.mamba, 9)
    assert ours[22] == [sp.page_bytes(mine.swa, p) for p in (5, 6)]
    assert ours[23] == [sp.page_bytes(mine.kv, p) for p in (0, 1, 2)]
    assert len(set(ours[23])) == 3  # random pages, not zeros


# -- a pool that cannot restore its state exactly gives a miss -------------------------------
def test_a_state_that_cannot_be_restored_exactly_is_a_miss(
    srv: ServerProcess, backends: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName

    trailing = PoolHitPolicy.TRAILING_PAGES
    src = Hybrid()
    src.fill(seed=5)
    writer = make(backends, srv, src)
    keys = keys_for("miss", 4)
    assert writer.batch_set_v1(keys, sp.indices(src.kv, [0, 1, 2, 3])) == [True] * 4
    assert writer.batch_set_v2([transfer(PoolName.MAMBA, [keys[3]], sp.slots([2]), trailing)])
    mamba_q = [transfer(PoolName.MAMBA, ["?"], policy=trailing)]
    assert make(backends, srv, Hybrid()).batch_exists_v2(keys, mamba_q).kv_hit_pages == 4
    # Mamba states of other shapes (16 heads of 4x4 instead of 4 of 8x8) have the same size
    # per slot: their bytes mean something else, so they are never restored from these.
    other = make(backends, srv, Hybrid(heads=16, state_dim=4))
    assert other.sidecars["mamba"].geometry.nbytes == writer.sidecars["mamba"].geometry.nbytes
    assert (other.batch_exists_v2(keys, mamba_q).kv_hit_pages, other.batch_exists(keys)) == (0, 4)
    reader = make(backends, srv, Hybrid())
    caplog.set_level(logging.WARNING, logger="sglang.tierkv")
    # A policy tierkv does not know, a pool it does not have: no hit, one line saying why.
    for query in (
        [transfer(PoolName.MAMBA, ["?"], policy=PoolHitPolicy.BLOCK_GROUPS)],
        [transfer(PoolName.INDEXER, ["?"])],
        [*mamba_q, transfer(PoolName.MAMBA, ["?"], policy="some_new_policy")],
    ):
        hit = reader.batch_exists_v2(keys, query)
        assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (0, []), query
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3 and "block_groups" in warnings[0] and "indexer" in warnings[1]
    assert reader.batch_get_v2([transfer(PoolName.INDEXER, keys[:1], sp.indices(src.kv, [5]))]) == {
        PoolName.INDEXER: [False]
    }
    assert_clean(srv)


def test_mamba_states_are_per_rank_where_mla_kv_is_shared(
    srv: ServerProcess, backends: list[Any]
) -> None:
    """With an MLA model the KV pages are the same on every rank (rank 0 writes them) but
    the Mamba states are sharded: every rank stores and reads its own."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName

    trailing = PoolHitPolicy.TRAILING_PAGES
    ranks = [Hybrid(kv="mla") for _ in range(2)]
    for r, hybrid in enumerate(ranks):
        hybrid.fill(seed=10 + r)
    backend = [make(backends, srv, ranks[r], mla=True, tp_rank=r, tp_size=2) for r in range(2)]
    keys = keys_for("mla-mamba", 3)
    mamba_q = [transfer(PoolName.MAMBA, ["?"], policy=trailing)]
    for r in range(2):
        assert backend[r].batch_set_v1(keys, sp.indices(ranks[r].kv, [0, 1, 2])) == [True] * 3
    assert backend[1].batch_exists(keys) == 3  # rank 0's KV pages
    stored = backend[0].batch_set_v2([transfer(PoolName.MAMBA, [keys[2]], sp.slots([5]), trailing)])
    assert stored == {PoolName.MAMBA: [True]}
    assert backend[0].batch_exists_v2(keys, mamba_q).kv_hit_pages == 3
    assert backend[1].batch_exists_v2(keys, mamba_q).kv_hit_pages == 0  # not rank 1's state
    assert backend[1].batch_set_v2([transfer(PoolName.MAMBA, [keys[2]], sp.slots([6]), trailing)])
    assert backend[1].batch_exists_v2(keys, mamba_q).kv_hit_pages == 3
    for r, slot in ((0, 5), (1, 6)):
        reader = Hybrid(kv="mla")
        fresh = make(backends, srv, reader, mla=True, tp_rank=r, tp_size=2)
        got = fresh.batch_get_v2([transfer(PoolName.MAMBA, [keys[2]], sp.slots([0]), trailing)])
        assert got == {PoolName.MAMBA: [True]}
        assert sp.slot_bytes(reader.mamba, 0) == sp.slot_bytes(ranks[r].mamba, slot)


def test_an_mha_pool_of_an_mla_model_is_per_rank(srv: ServerProcess, backends: list[Any]) -> None:
    """A standard-attention sidecar (an MHA draft model on an MLA target) holds each rank's
    own heads: rank 1 never reads rank 0's pages (before, every non-Mamba pool of an MLA model
    shared one namespace, written by rank 0, and rank 1 loaded rank 0's heads)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    ranks = [Hybrid(kv="mla") for _ in range(2)]
    for r, hybrid in enumerate(ranks):
        hybrid.fill(seed=20 + r)
    backend = [make(backends, srv, ranks[r], mla=True, tp_rank=r, tp_size=2) for r in range(2)]
    keys = keys_for("mla-mha-sidecar", 3)
    pages = [0, 1, 2]
    kv0 = transfer(PoolName.KV, keys, sp.indices(ranks[0].kv, pages))
    swa = [transfer(PoolName.SWA, keys, sp.indices(ranks[r].swa, pages)) for r in range(2)]
    assert backend[0].batch_set_v2([kv0, swa[0]]) == {
        PoolName.KV: [True] * 3,
        PoolName.SWA: [True] * 3,
    }
    swa_q = [transfer(PoolName.SWA, keys)]
    assert backend[1].batch_exists_v2(keys, swa_q).kv_hit_pages == 0  # not rank 1's heads
    assert backend[1].batch_set_v2([swa[1]]) == {PoolName.SWA: [True] * 3}
    assert backend[1].batch_exists_v2(keys, swa_q).kv_hit_pages == 3
    for r in range(2):
        reader = Hybrid(kv="mla")
        fresh = make(backends, srv, reader, mla=True, tp_rank=r, tp_size=2)
        got = fresh.batch_get_v2([transfer(PoolName.SWA, keys, sp.indices(reader.swa, [4, 5, 6]))])
        assert got == {PoolName.SWA: [True] * 3}
        for page, own in zip([4, 5, 6], pages, strict=True):
            assert sp.page_bytes(reader.swa, page) == sp.page_bytes(ranks[r].swa, own)
    assert_clean(srv)


def test_v2_spans_longer_than_a_servers_request_go_in_pieces(
    server_factory: Callable[..., ServerProcess],
    backends: list[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SGLang hands a hybrid model's whole prefetch span (and a whole backup) to one v2
    call: the backend sends it in pieces the server takes (before, a span of more pages than
    the server's max_chunks_per_request was refused whole: a miss, a failed write). Here a
    server taking 8 chunks a request, pieces of 4, a span of 12."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName

    from tierkv.integrations.sglang import pool_store

    monkeypatch.setattr(pool_store, "PAGES_PER_REQUEST", 4)
    srv = server_factory(pool_size="64MiB", extra=["--max-chunks-per-request", "8"])
    src = Hybrid()
    src.fill(seed=3)
    backend = make(backends, srv, src)
    keys = keys_for("request-limit", 12)
    pages = list(range(12))
    trailing = PoolHitPolicy.TRAILING_PAGES
    assert backend.batch_set_v2(
        [
            transfer(PoolName.KV, keys, sp.indices(src.kv, pages)),
            transfer(PoolName.SWA, keys, sp.indices(src.swa, pages)),
            transfer(PoolName.MAMBA, [keys[11]], sp.slots([3]), trailing),
        ]
    ) == {PoolName.KV: [True] * 12, PoolName.SWA: [True] * 12, PoolName.MAMBA: [True]}
    query = [transfer(PoolName.SWA, keys), transfer(PoolName.MAMBA, ["?"], policy=trailing)]
    assert backend.batch_exists_v2(keys, query).kv_hit_pages == 12
    reader = Hybrid()
    fresh = make(backends, srv, reader)
    got = fresh.batch_get_v2(
        [
            transfer(PoolName.KV, keys, sp.indices(reader.kv, pages)),
            transfer(PoolName.SWA, keys, sp.indices(reader.swa, pages)),
        ]
    )
    assert got == {PoolName.KV: [True] * 12, PoolName.SWA: [True] * 12}
    for page in pages:
        assert sp.page_bytes(reader.kv, page) == sp.page_bytes(src.kv, page)
        assert sp.page_bytes(reader.swa, page) == sp.page_bytes(src.swa, page)
    assert_clean(srv)


# -- bad input: a logged miss, the server keeps serving --------------------------------------
def test_bad_v2_input_is_a_logged_miss_and_stored_pages_stay_intact(
    srv: ServerProcess, backends: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName

    trailing = PoolHitPolicy.TRAILING_PAGES
    src = Hybrid()
    src.fill(seed=7)
    backend = make(backends, srv, src)
    keys = keys_for("bad-v2", 3)
    good = backend.batch_set_v2(
        [
            transfer(PoolName.KV, keys, sp.indices(src.kv, [0, 1, 2])),
            transfer(PoolName.MAMBA, keys[2:], sp.slots([4]), trailing),
        ]
    )
    assert good == {PoolName.KV: [True] * 3, PoolName.MAMBA: [True]}
    caplog.set_level(logging.WARNING, logger="sglang.tierkv")
    mamba, kv = PoolName.MAMBA, PoolName.KV
    for bad, expected in (
        (transfer(mamba, keys[:2], sp.slots([5])), [False, False]),  # too few indices
        (transfer(mamba, keys[:1], sp.slots([5, 6])), [False]),  # too many
        (transfer(mamba, keys[:1], None), [False]),
        (transfer(mamba, keys[:1], [5]), [False]),  # not a tensor
        (transfer(mamba, keys[:1], sp.slots([10_000])), [False]),  # outside the pool
        (transfer(mamba, keys[:1], sp.slots([-3])), [False]),
        (transfer(mamba, [7], sp.slots([5])), [False]),  # a key that is not a str
        (transfer(kv, ["", keys[0]], sp.indices(src.kv, [5, 6])), [False, False]),
        (transfer("no-such-pool", keys[:1], sp.slots([5])), [False]),
        (transfer(mamba, None, sp.slots([5])), []),
    ):
        for call in (backend.batch_set_v2, backend.batch_get_v2):
            assert call([bad]) == {bad.name: expected}, (call, bad)
    assert backend.batch_get_v2([object()]) == {}  # type: ignore[list-item]
    assert backend.batch_set_v2(None) == {}
    assert backend.batch_exists_v2([keys[0], 7], []).kv_hit_pages == 0  # type: ignore[list-item]
    assert backend.batch_exists_v2(keys, [object()]).kv_hit_pages == 0  # type: ignore[list-item]
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) >= 10
    # Bad input is the caller's, not the server's: no link took the server for down.
    assert [s.link.failures for s in (backend.kv, *backend.sidecars.values())] == [0, 0, 0]
    # The server kept serving, the stored pages are intact and nothing is left locked.
    dst = Hybrid()
    reader = make(backends, srv, dst)
    hit = reader.batch_exists_v2(keys, [transfer(mamba, ["?"], policy=trailing)])
    assert hit.kv_hit_pages == 3
    got = reader.batch_get_v2(
        [
            transfer(kv, keys, sp.indices(dst.kv, [3, 4, 5])),
            transfer(mamba, keys[2:], sp.slots([1]), trailing),
        ]
    )
    assert got == {kv: [True] * 3, mamba: [True]}
    assert [sp.page_bytes(dst.kv, p) for p in (3, 4, 5)] == [
        sp.page_bytes(src.kv, p) for p in (0, 1, 2)
    ]
    assert sp.slot_bytes(dst.mamba, 1) == sp.slot_bytes(src.mamba, 4)
    assert_clean(srv)


# -- a server killed under v2 traffic --------------------------------------------------------
def test_a_server_killed_and_restarted_under_v2_traffic_raises_nothing_and_hits_resume(
    srv: ServerProcess, backends: list[Any]
) -> None:
    """kill -9 and a restart at the same endpoint while SGLang-like backup and prefetch
    threads move KV pages and Mamba/SWA sidecars: no call raises, nothing read is wrong,
    every pool's client registers again by itself and hybrid hits resume."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName

    trailing = PoolHitPolicy.TRAILING_PAGES
    src, dst = Hybrid(), Hybrid()
    src.fill(seed=9)
    fast = {"timeout": 0.5, "retry_interval": 0.2}
    writer = make(backends, srv, src, extra=fast)
    reader = make(backends, srv, dst, extra=fast)
    query = [
        transfer(PoolName.MAMBA, ["?"], policy=trailing),
        transfer(PoolName.SWA, ["?", "?"], policy=trailing),
    ]
    stop = threading.Event()
    errors: list[BaseException] = []
    hits: list[list[int]] = [[] for _ in range(2)]

    def traffic(t: int) -> None:
        keys = keys_for(f"v2-traffic-{t}", 3)
        mine = [3 * t, 3 * t + 1, 3 * t + 2]
        while not stop.is_set():
            try:
                writer.batch_set_v2(
                    [
                        transfer(PoolName.MAMBA, keys[2:], sp.slots([t]), trailing),
                        transfer(PoolName.SWA, keys[1:], sp.indices(src.swa, mine[1:]), trailing),
                    ]
                )
                writer.batch_set_v1(keys, sp.indices(src.kv, mine))
                hit = reader.batch_exists_v2(keys, query)
                got = reader.batch_get_v2(
                    [
                        transfer(PoolName.KV, keys, sp.indices(dst.kv, mine)),
                        transfer(PoolName.MAMBA, keys[2:], sp.slots([t]), trailing),
                        transfer(PoolName.SWA, keys[1:], sp.indices(dst.swa, mine[1:]), trailing),
                    ]
                )
                for ok, page in zip(got[PoolName.KV], mine, strict=True):
                    assert not ok or sp.page_bytes(dst.kv, page) == sp.page_bytes(src.kv, page)
                for ok, page in zip(got[PoolName.SWA], mine[1:], strict=True):
                    assert not ok or sp.page_bytes(dst.swa, page) == sp.page_bytes(src.swa, page)
                if got[PoolName.MAMBA] == [True]:
                    assert sp.slot_bytes(dst.mamba, t) == sp.slot_bytes(src.mamba, t)
                hits[t].append(hit.kv_hit_pages)
            except BaseException as exc:  # what would reach SGLang
                errors.append(exc)
                return

    threads = [threading.Thread(target=traffic, args=(t,)) for t in range(2)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: min(len(h) for h in hits) >= 3 or bool(errors))
        srv.kill()
        before = [len(h) for h in hits]
        wait_until(lambda: min(len(h) - b for h, b in zip(hits, before, strict=True)) >= 2)
        srv.start()
        restarted = [len(h) for h in hits]
        wait_until(
            lambda: bool(errors) or all(3 in h[n:] for h, n in zip(hits, restarted, strict=True))
        )
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert errors == [], errors
    assert all(0 in h for h in hits)  # misses while the server was down
    with srv.client() as c:
        assert c.stats().clients == 6  # two engines, three pools each, registered once again
    assert_clean(srv)


def wait_until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


# -- DeepSeek sparse attention: indexer pages on every KV page -------------------------------
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_dsa_indexer_pages_round_trip_and_gate_the_hit_on_every_page(
    srv: ServerProcess, backends: list[Any], tmp_path: Path, layout: str
) -> None:
    """The indexer pool (all-pages policy) must hold every page of the prefix: a missing
    indexer page ends the hit there, as in SGLang's file backend; the pages read are
    byte-exact; the indexer pages are replicated like the MLA KV (rank 0 writes, every rank
    reads)."""
    import torch
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheFile,
        HiCacheStorageConfig,
        PoolName,
    )

    indexer_name, kv_name = PoolName.INDEXER, PoolName.KV
    with sp.single_rank():
        ranks = [sp.dsa_pools(layout) for _ in range(2)]
        readers = [sp.dsa_pools(layout) for _ in range(2)]
        reference_pools = sp.dsa_pools(layout)
    for r, (kv, indexer) in enumerate(ranks):
        sp.fill_random(kv, seed=20 + r)
        gen = torch.Generator().manual_seed(30 + r)
        buf = indexer.index_k_with_scale_buffer
        buf.copy_(torch.randint(0, 256, buf.shape, generator=gen, dtype=torch.int32).to(buf.dtype))

    def attach_dsa(backend: Any, kv: Any, indexer: Any) -> Any:
        backend.register_mem_pool_host(kv)
        backend.register_mem_host_pool_v2(kv, kv_name)
        backend.register_mem_host_pool_v2(indexer, indexer_name)
        return backend

    def dsa(pools: tuple[Any, Any], rank: int) -> Any:
        config = sp.storage_config(
            {"endpoint": srv.endpoint}, mla=True, tp_rank=rank, tp_size=2,
            page_first=layout == "page_first",
        )  # fmt: skip
        backend = attach_dsa(sp.create_backend(config, pools[0]), *pools)
        backends.append(backend)
        return backend

    writers = [dsa(ranks[r], r) for r in range(2)]
    assert writers[0].sidecars["indexer"].geometry.flat
    keys = keys_for(f"dsa-{layout}", 4)
    kv0, indexer0 = ranks[0]

    def store(backend: Any, pools: tuple[Any, Any], pages: list[int], ix: list[int]) -> Any:
        return backend.batch_set_v2(
            [
                transfer(kv_name, [keys[p] for p in pages], sp.indices(pools[0], pages)),
                transfer(indexer_name, [keys[p] for p in ix], sp.indices(pools[1], ix)),
            ]
        )

    # Rank 1 is no storage writer: it reports both pools held and stores neither.
    assert store(writers[1], ranks[1], [0, 1, 2, 3], [0, 1, 2, 3]) == {
        kv_name: [True] * 4, indexer_name: [True] * 4,
    }  # fmt: skip
    assert writers[1].batch_exists(keys) == 0
    # Rank 0 stores four KV pages and the indexer pages of pages 0, 1 and 3 (not 2).
    assert store(writers[0], ranks[0], [0, 1, 2, 3], [0, 1, 3]) == {
        kv_name: [True] * 4, indexer_name: [True] * 3,
    }  # fmt: skip
    query = [transfer(indexer_name, keys)]
    for r in range(2):
        reader = dsa(readers[r], r)
        hit = reader.batch_exists_v2(keys, query)
        assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (2, [2])
        assert hit.extra_pool_hit_pages == {kv_name: 4, indexer_name: 2}
        kv, indexer = readers[r]
        got = reader.batch_get_v2(
            [
                transfer(kv_name, keys[:2], sp.indices(kv, [5, 6])),
                transfer(indexer_name, keys[:2], sp.indices(indexer, [5, 6])),
            ]
        )
        assert got == {kv_name: [True, True], indexer_name: [True, True]}
        assert [sp.page_bytes(kv, p) for p in (5, 6)] == [sp.page_bytes(kv0, p) for p in (0, 1)]
        assert [sp.page_bytes(indexer, p) for p in (5, 6)] == [
            sp.page_bytes(indexer0, p) for p in (0, 1)
        ]
    # SGLang's file backend, given the same pages, gives the same answer.
    config = sp.storage_config({}, mla=True)
    file_config = HiCacheStorageConfig(
        **{**config.__dict__, "extra_config": {"file_storage_path": str(tmp_path / "hicache")}}
    )
    reference = attach_dsa(HiCacheFile(file_config), *reference_pools)
    reference_pools[0].kv_buffer.copy_(kv0.kv_buffer)
    reference_pools[1].index_k_with_scale_buffer.copy_(indexer0.index_k_with_scale_buffer)
    store(reference, reference_pools, [0, 1, 2, 3], [0, 1, 3])
    theirs = reference.batch_exists_v2(keys, query)
    assert (theirs.kv_hit_pages, theirs.extra_pool_hit_pages, theirs.restorable_prefix_pages) == (
        2, {kv_name: 4, indexer_name: 2}, [1, 2],
    )  # fmt: skip
    assert_clean(srv)
