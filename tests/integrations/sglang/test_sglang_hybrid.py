"""The SGLang backend's v2 interface (hybrid models' extra host pools) against a real
tierkv server, with SGLang's real host pools (KV, sliding-window KV, Mamba states), its
real hit-policy types and its own file backend as the reference.

Runs in the SGLang environment (.venv-sglang): ``make test`` runs it there.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
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


@pytest.fixture
def backends() -> Iterator[list[Any]]:
    made: list[Any] = []
    yield made
    for b in made:
        b.close()


class Hybrid:
    """One engine rank's host pools: KV (the anchor), sliding-window KV, Mamba states."""

    def __init__(self, **mamba: Any) -> None:
        self.kv = sp.host_pool("mha", "page_first")
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
def test_restorable_prefixes_follow_each_policy_with_few_probes() -> None:
    from tierkv.integrations.sglang.hit_policy import Presence, restorable_prefixes

    held = {0, 1, 2, 4, 5, 7}  # pages 3 and 6 are missing
    calls: list[tuple[int, int]] = []

    def probe(start: int, stop: int) -> int:
        calls.append((start, stop))
        n = 0
        while start + n < stop and start + n in held:
            n += 1
        return n

    assert restorable_prefixes("all_pages", 0, 8, probe) == [1, 2, 3]
    assert restorable_prefixes("trailing_pages", 1, 8, probe) == [1, 2, 3, 5, 6, 8]
    assert restorable_prefixes("trailing_pages", 2, 8, probe) == [1, 2, 3, 6]
    assert restorable_prefixes("block_groups", 0, 8, probe) == []  # unknown: no prefix
    assert restorable_prefixes("all_pages", 0, 0, probe) == []
    calls.clear()
    presence = Presence(8, probe)
    assert [presence.present(p) for p in range(8)] == [p in held for p in range(8)]
    assert presence.probes == 3 == len(calls)  # one per missing page, and one more


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
    only_mamba = reader.batch_exists_v2(keys, query[:1])
    assert (only_mamba.kv_hit_pages, only_mamba.restorable_prefix_pages) == (6, [3, 6])

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
        pools = {str(k): v for k, v in r.extra_pool_hit_pages.items()}
        return (r.kv_hit_pages, pools, r.restorable_prefix_pages)

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
    assert ours[0] == (0, {}, [])
    assert ours[7] == (7, {"kv": 7, "mamba": 7}, [3, 6, 7])
    assert ours[8] == (7, {"kv": 7, "swa": 7}, [5, 6, 7])
    assert ours[9] == ours[10] == (7, {"kv": 7, "mamba": 7, "swa": 7}, [6, 7])
    # Mamba can restore prefix 3, SWA prefix 5: no length both can restore, no hit.
    assert ours[11] == (0, {"kv": 5, "mamba": 3, "swa": 5}, [])
    assert ours[12] == ours[13] == (0, {"kv": 7}, [])  # all pages: none has page 0
    assert ours[14] == (0, {}, [])
    assert ours[15] == {"mamba": [True], "swa": [True, True], "kv": [True] * 3}
    assert ours[16] == {"mamba": [False]}
    assert ours[17] == {"swa": [False, False]} and ours[18] == {"kv": [True, False]}
    # What was read is what was stored: the state of slot 9, the pages of SWA 5, 6, KV 0-2.
    assert ours[19] == sp.slot_bytes(mine.mamba, 9)
    assert ours[20] == [sp.page_bytes(mine.swa, p) for p in (5, 6)]
    assert ours[21] == [sp.page_bytes(mine.kv, p) for p in (0, 1, 2)]
    assert len(set(ours[21])) == 3  # random pages, not zeros
