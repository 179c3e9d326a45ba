"""The SGLang HiCache storage backend against a real tierkv server, with SGLang's real
backend factory, host pools (every standard-attention layout and MLA) and file backend.

Runs in the SGLang environment (.venv-sglang): ``make test`` runs it there.
"""

from __future__ import annotations

import logging
import os
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


def make(backends: list[Any], srv: ServerProcess, pool: Any, **kw: Any) -> Any:
    extra = {"endpoint": srv.endpoint, **kw.pop("extra", {})}
    backend = sp.create_backend(sp.storage_config(extra, **kw), pool)
    backends.append(backend)
    return backend


def keys_for(prefix: str, n: int) -> list[str]:
    import hashlib

    return [hashlib.sha256(f"{prefix}-{i}".encode()).hexdigest() for i in range(n)]


def assert_clean(srv: ServerProcess) -> None:
    """No lock, lease or reservation left behind."""
    with srv.client() as c:
        s = c.stats()
    assert s.read_locked == 0 and s.read_leases == 0, s
    assert s.write_leases == 0 and s.writing == 0, s


# -- loading through SGLang's factory --------------------------------------------------------
def test_sglang_factory_loads_the_backend_and_attaches_the_pool(
    srv: ServerProcess, backends: list[Any]
) -> None:
    from tierkv.integrations.sglang import TierKVStorage

    pool = sp.host_pool("mha", "page_first")
    backend = make(backends, srv, pool)
    assert isinstance(backend, TierKVStorage)
    assert backend.geometry.format_tag == "sglang-mha-page_first-p64"
    with srv.client() as c:
        assert c.stats().clients == 1  # registered at attach, before the first page moved


# -- every layout: byte-exact round trips, zero-copy and flat --------------------------------
@pytest.mark.parametrize(("kind", "layout"), sp.ALL_LAYOUTS)
def test_pages_round_trip_byte_exact_in_every_layout(
    srv: ServerProcess, backends: list[Any], kind: str, layout: str
) -> None:
    src, dst = sp.host_pool(kind, layout), sp.host_pool(kind, layout)
    sp.fill_random(src, seed=1)
    writer = make(backends, srv, src, mla=kind == "mla", page_first=layout != "layer_first")
    reader = make(backends, srv, dst, mla=kind == "mla", page_first=layout != "layer_first")
    keys = keys_for(f"{kind}-{layout}", 6)
    assert writer.batch_set_v1(keys, sp.indices(src, [3, 1, 4, 7, 5, 9])) == [True] * 6
    assert reader.batch_exists(keys) == 6
    # Read into other pages of another pool: every byte lands where SGLang asked.
    assert reader.batch_get_v1(keys, sp.indices(dst, [10, 2, 8, 0, 6, 11])) == [True] * 6
    for s, d in zip([3, 1, 4, 7, 5, 9], [10, 2, 8, 0, 6, 11], strict=True):
        assert sp.page_bytes(dst, d) == sp.page_bytes(src, s)
    # The generic calls move SGLang's flat data pages, in the same byte order.
    flat = reader.get(keys[2])
    assert flat is not None and bytes(flat.view(-1).view(__import__("torch").uint8).numpy()) == (
        sp.page_bytes(src, 4)
    )
    other = keys_for(f"{kind}-{layout}-flat", 2)
    assert writer.batch_set(other, [src.get_data_page(p * 64, flat=True) for p in (12, 13)])
    got = reader.batch_get_v1(other, sp.indices(dst, [12, 13]))
    assert got == [True, True]
    assert [sp.page_bytes(dst, p) for p in (12, 13)] == [sp.page_bytes(src, p) for p in (12, 13)]
    assert_clean(srv)


def test_a_hole_in_a_prefix_ends_the_hit_there(srv: ServerProcess, backends: list[Any]) -> None:
    src, dst = sp.host_pool("mha", "layer_first"), sp.host_pool("mha", "layer_first")
    sp.fill_random(src, seed=2)
    backend = make(backends, srv, src)
    reader = make(backends, srv, dst)
    keys = keys_for("hole", 5)
    assert backend.batch_set_v1([keys[i] for i in (0, 1, 3, 4)], sp.indices(src, [0, 1, 3, 4]))
    assert reader.batch_exists(keys) == 2  # prefix semantics: the hole at page 2 ends it
    assert [reader.exists(k) for k in keys] == [True, True, False, True, True]
    assert reader.batch_get_v1(keys, sp.indices(dst, [0, 1, 2, 3, 4])) == [
        True, True, False, True, True,
    ]  # fmt: skip
    assert reader.get(keys[2]) is None
    assert_clean(srv)


# -- the same contract as SGLang's own file backend ------------------------------------------
def run_contract(backend: Any, pool: Any) -> list[Any]:
    """A script of generic calls; returns every answer, bytes included."""
    import torch

    def as_bytes(t: Any) -> Any:
        return None if t is None else bytes(t.view(-1).view(torch.uint8).numpy())

    keys = keys_for("contract", 8)
    page = [pool.get_data_page(p * pool.page_size, flat=True) for p in range(8)]
    answers: list[Any] = [backend.exists(keys[0]), backend.batch_exists(keys)]
    answers.append(backend.set(keys[0], page[0]))
    answers.append(backend.batch_set(keys[1:3], page[1:3]))
    answers.append(backend.batch_set(keys[4:6], page[4:6]))  # page 3 stays a hole
    answers.append(backend.set(keys[1], page[1]))  # already there
    answers += [backend.batch_exists(keys), backend.batch_exists(keys[4:]), backend.exists(keys[3])]
    # Into fresh flat pages, as SGLang's generic prefetch path passes them.
    targets = [pool.get_dummy_flat_data_page() for _ in range(6)]
    answers.append([as_bytes(t) for t in backend.batch_get(keys[:6], targets)])
    answers.append(as_bytes(backend.get(keys[5], pool.get_dummy_flat_data_page())))
    answers.append(as_bytes(backend.get(keys[7], pool.get_dummy_flat_data_page())))
    return answers


def test_the_contract_gives_the_answers_of_sglangs_file_backend(
    srv: ServerProcess, backends: list[Any], tmp_path: Path
) -> None:
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    pool = sp.host_pool("mha", "page_first")
    sp.fill_random(pool, seed=3)
    ours = run_contract(make(backends, srv, pool), pool)
    config = sp.storage_config({})
    file_config = HiCacheStorageConfig(
        **{**config.__dict__, "extra_config": {"file_storage_path": str(tmp_path / "hicache")}}
    )
    reference = run_contract(HiCacheFile(file_config), pool)
    assert ours == reference
    assert ours[6:9] == [3, 2, False] and ours[9][3] is None and ours[11] is None


# -- MLA: one writer, every rank reads -------------------------------------------------------
def test_mla_pages_are_written_by_one_rank_and_read_by_every_rank(
    srv: ServerProcess, backends: list[Any]
) -> None:
    pools = [sp.host_pool("mla", "page_first") for _ in range(2)]
    sp.fill_random(pools[0], seed=4)
    sp.fill_random(pools[1], seed=5)  # rank 1's host pool holds other bytes
    ranks = [make(backends, srv, pools[r], mla=True, tp_rank=r, tp_size=2) for r in range(2)]
    keys = keys_for("mla", 4)
    # Rank 1 is no storage writer: it reports success and stores nothing.
    assert ranks[1].batch_set_v1(keys, sp.indices(pools[1], [0, 1, 2, 3])) == [True] * 4
    assert ranks[1].batch_exists(keys) == 0
    assert ranks[0].batch_set_v1(keys, sp.indices(pools[0], [0, 1, 2, 3])) == [True] * 4
    readers = [sp.host_pool("mla", "page_first") for _ in range(2)]
    for r in range(2):
        reader = make(backends, srv, readers[r], mla=True, tp_rank=r, tp_size=2)
        assert reader.batch_exists(keys) == 4
        assert reader.batch_get_v1(keys, sp.indices(readers[r], [4, 5, 6, 7])) == [True] * 4
        assert [sp.page_bytes(readers[r], 4 + i) for i in range(4)] == [
            sp.page_bytes(pools[0], i) for i in range(4)
        ]


# -- pages are never shared where their bytes differ -----------------------------------------
def test_pages_are_not_shared_across_layouts_ranks_models_or_tenants(
    srv: ServerProcess, backends: list[Any]
) -> None:
    src = sp.host_pool("mha", "page_first_direct")
    sp.fill_random(src, seed=6)
    writer = make(backends, srv, src, tp_rank=0, tp_size=2, extra={"tenant": "a"})
    keys = keys_for("isolation", 3)
    assert writer.batch_set_v1(keys, sp.indices(src, [0, 1, 2])) == [True] * 3
    same = make(backends, srv, sp.host_pool("mha", "page_first_direct"), tp_rank=0, tp_size=2,
                extra={"tenant": "a"})  # fmt: skip
    assert same.batch_exists(keys) == 3
    # page_head has the same size per page as page_first_direct here (4 layers, 2 heads, and
    # its heads/layers axes swapped): the bytes are permuted, so it must not hit.
    for pool, kw in (
        (sp.host_pool("mha", "page_head"), {"tp_rank": 0, "tp_size": 2, "extra": {"tenant": "a"}}),
        (sp.host_pool("mha", "page_first_direct"),
         {"tp_rank": 1, "tp_size": 2, "extra": {"tenant": "a"}}),
        (sp.host_pool("mha", "page_first_direct"),
         {"tp_rank": 0, "tp_size": 2, "extra": {"tenant": "b"}}),
        (sp.host_pool("mha", "page_first_direct"),
         {"tp_rank": 0, "tp_size": 2, "model": "other-model", "extra": {"tenant": "a"}}),
        (sp.host_pool("mha", "page_first_direct", page_size=32, pages=32),
         {"tp_rank": 0, "tp_size": 2, "extra": {"tenant": "a"}}),
    ):  # fmt: skip
        assert make(backends, srv, pool, **kw).batch_exists(keys) == 0, kw


# -- unsupported pools and settings are refused at attach ------------------------------------
def test_unsupported_pools_and_settings_are_refused_with_the_reason(
    srv: ServerProcess, backends: list[Any]
) -> None:
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from tierkv.integrations.sglang.pages import UnsupportedPoolError
    from tierkv.integrations.sglang.settings import SettingsError

    backend = make(backends, srv, sp.host_pool("mha", "page_first"))
    with pytest.raises(UnsupportedPoolError, match="mamba host pool"):
        backend.register_mem_host_pool_v2(object(), PoolName.MAMBA)
    with pytest.raises(UnsupportedPoolError, match="not object"):
        backend.register_mem_pool_host(object())
    with pytest.raises(SettingsError, match="endpont"):
        sp.create_backend(
            sp.storage_config({"endpont": srv.endpoint}), sp.host_pool("mha", "page_first")
        )
    for bad, key in (
        ({"timeout": 0}, "timeout"),
        ({"populate": "sometimes"}, "populate"),
        ({"copy_threads": 0}, "copy_threads"),
    ):
        with pytest.raises(SettingsError, match=key):
            sp.create_backend(
                sp.storage_config({"endpoint": srv.endpoint, **bad}),
                sp.host_pool("mha", "page_first"),
            )


# -- bad input: a clear log line, a miss, the server keeps serving ---------------------------
def test_bad_input_is_a_logged_miss_and_committed_pages_stay_intact(
    srv: ServerProcess, backends: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    import torch

    pool = sp.host_pool("mha", "page_first")
    sp.fill_random(pool, seed=7)
    backend = make(backends, srv, pool)
    keys = keys_for("bad", 3)
    assert backend.batch_set_v1(keys, sp.indices(pool, [0, 1, 2])) == [True] * 3
    good = [sp.page_bytes(pool, p) for p in range(3)]
    caplog.set_level(logging.WARNING, logger="sglang.tierkv")
    assert backend.batch_set_v1([keys[0], 7], sp.indices(pool, [3, 4])) == [False, False]
    assert backend.batch_set_v1(keys, sp.indices(pool, [3])) == [False] * 3  # too few indices
    assert backend.batch_get_v1(keys, None) == [False] * 3
    assert backend.batch_exists(["", keys[0]]) == 0
    assert backend.batch_set(keys[:1], [torch.zeros(5)]) is False  # not a page
    assert backend.batch_get(keys[:1], [torch.zeros(5, dtype=torch.bfloat16)]) == [None]
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) >= 6
    # The server kept serving and the committed pages are intact.
    dst = sp.host_pool("mha", "page_first")
    assert make(backends, srv, dst).batch_get_v1(keys, sp.indices(dst, [5, 6, 7])) == [True] * 3
    assert [sp.page_bytes(dst, p) for p in (5, 6, 7)] == good
    assert_clean(srv)


# -- SGLang's random failure and delay injection ---------------------------------------------
def test_random_failures_and_delays_never_serve_wrong_bytes(
    srv: ServerProcess, backends: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.005")
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector

    src = sp.host_pool("mha", "layer_first", pages=32)
    sp.fill_random(src, seed=8)
    writer = make(backends, srv, src)
    assert isinstance(writer, HiCacheStorageFailureInjector)  # SGLang wrapped our backend
    dst = sp.host_pool("mha", "layer_first", pages=32)
    reader = make(backends, srv, dst)
    outcomes = {"set": 0, "read": 0, "failed": 0}
    for r in range(30):
        keys = keys_for(f"inject-{r}", 4)
        pages = [(r + i) % 16 for i in range(4)]
        if all(writer.batch_set_v1(keys, sp.indices(src, pages))):
            outcomes["set"] += 1
        hits = reader.batch_exists(keys)
        got = reader.batch_get_v1(keys[:hits], sp.indices(dst, [16 + i for i in range(hits)]))
        for i, ok in enumerate(got):
            if ok:  # whatever was reported read is byte-exact
                assert sp.page_bytes(dst, 16 + i) == sp.page_bytes(src, pages[i])
                outcomes["read"] += 1
            else:
                outcomes["failed"] += 1
    assert outcomes["set"] and outcomes["read"] and outcomes["failed"], outcomes
    assert_clean(srv)


# -- a server that is down costs one timeout, then misses ------------------------------------
def test_a_dead_server_costs_one_timeout_then_plain_misses(
    srv: ServerProcess, backends: list[Any]
) -> None:
    pool = sp.host_pool("mha", "page_first")
    sp.fill_random(pool, seed=9)
    backend = make(backends, srv, pool, extra={"timeout": 0.5, "retry_interval": 60})
    keys = keys_for("dead", 2)
    assert backend.batch_set_v1(keys, sp.indices(pool, [0, 1])) == [True, True]
    srv.stop()
    # A stopped local server has no socket: not even one timeout is waited for.
    start = time.monotonic()
    for _ in range(20):
        assert backend.batch_exists(keys) == 0
        assert backend.batch_get_v1(keys, sp.indices(pool, [2, 3])) == [False, False]
        assert backend.batch_set_v1(keys, sp.indices(pool, [2, 3])) == [False, False]
    assert time.monotonic() - start < 0.5 * 20, "every call waited"  # bounded, not a timing goal
    assert backend.link.failures == 1


def test_a_frozen_server_costs_one_timeout_then_plain_misses(
    srv: ServerProcess, backends: list[Any]
) -> None:
    import signal

    pool = sp.host_pool("mha", "page_first")
    backend = make(backends, srv, pool, extra={"timeout": 0.3, "retry_interval": 60})
    keys = keys_for("frozen", 2)
    assert backend.batch_exists(keys) == 0
    assert srv.proc is not None
    os.kill(srv.proc.pid, signal.SIGSTOP)
    try:
        for _ in range(10):
            assert backend.batch_exists(keys) == 0
            assert backend.batch_set_v1(keys, sp.indices(pool, [0, 1])) == [False, False]
        assert backend.link.failures == 1  # one timed-out call, then misses without asking
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)


def test_a_server_killed_and_restarted_under_traffic_raises_nothing_and_hits_resume(
    srv: ServerProcess, backends: list[Any]
) -> None:
    """kill -9 and a restart at the same endpoint while four threads store, look up and load
    pages (as SGLang's cache controller does): no call raises, none answers wrong bytes, and
    once the server is back the backend registers again by itself and hits resume."""
    import threading

    src, dst = sp.host_pool("mha", "page_first"), sp.host_pool("mha", "page_first")
    sp.fill_random(src, seed=7)
    writer = make(backends, srv, src, extra={"timeout": 0.5, "retry_interval": 0.2})
    reader = make(backends, srv, dst, extra={"timeout": 0.5, "retry_interval": 0.2})
    stop = threading.Event()
    errors: list[BaseException] = []
    rounds = [0] * 4
    hits_per_thread: list[list[int]] = [[] for _ in range(4)]

    def traffic(t: int) -> None:
        keys = keys_for(f"traffic-{t}", 2)
        mine = theirs = [2 * t, 2 * t + 1]  # pages of the writer's pool, of the reader's
        while not stop.is_set():
            try:
                writer.batch_set_v1(keys, sp.indices(src, mine))
                hits = reader.batch_exists(keys)
                got = reader.batch_get_v1(keys, sp.indices(dst, theirs))
                for ok, s, d in zip(got, mine, theirs, strict=True):
                    if ok:
                        assert sp.page_bytes(dst, d) == sp.page_bytes(src, s)
                hits_per_thread[t].append(hits)
                rounds[t] += 1
            except BaseException as exc:  # what would reach SGLang
                errors.append(exc)
                return

    threads = [threading.Thread(target=traffic, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: min(rounds) >= 3 or bool(errors))
        srv.kill()  # a crash, under traffic: segment and socket file left behind
        before = list(rounds)
        wait_until(lambda: min(r - b for r, b in zip(rounds, before, strict=True)) >= 2)
        srv.start()  # the same endpoint
        restarted = [len(h) for h in hits_per_thread]
        wait_until(
            lambda: (
                bool(errors)
                or all(2 in h[n:] for h, n in zip(hits_per_thread, restarted, strict=True))
            )
        )
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert errors == [], errors
    keys = keys_for("after-restart", 3)
    assert writer.batch_set_v1(keys, sp.indices(src, [12, 13, 14])) == [True] * 3
    assert reader.batch_get_v1(keys, sp.indices(dst, [12, 13, 14])) == [True] * 3
    assert [sp.page_bytes(dst, p) for p in (12, 13, 14)] == [
        sp.page_bytes(src, p) for p in (12, 13, 14)
    ]
    with srv.client() as c:
        assert c.stats().clients == 2  # each backend registered once again, not once a call
    assert_clean(srv)


def wait_until(condition: Callable[[], bool], timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"condition not reached: {what}"
        time.sleep(0.02)


# -- stats and clear -------------------------------------------------------------------------
def test_get_stats_reports_pages_and_bandwidth_and_clear_empties_the_pool(
    srv: ServerProcess, backends: list[Any]
) -> None:
    pool = sp.host_pool("mha", "page_first")
    backend = make(backends, srv, pool)
    keys = keys_for("stats", 3)
    backend.batch_set_v1(keys, sp.indices(pool, [0, 1, 2]))
    backend.batch_get_v1(keys, sp.indices(pool, [3, 4, 5]))
    stats = backend.get_stats()
    assert stats.backup_pgs == [3] and stats.prefetch_pgs == [3]
    assert all(v > 0 for v in stats.backup_bandwidth + stats.prefetch_bandwidth)
    assert backend.get_stats().backup_pgs == []  # drained
    assert backend.clear() is True
    assert backend.batch_exists(keys) == 0


# -- SGLang's storage threads call one backend at once ---------------------------------------
def test_one_backend_serves_sglangs_prefetch_and_backup_threads_at_once(
    srv: ServerProcess, backends: list[Any]
) -> None:
    """SGLang's backup thread writes while its prefetch threads check and read, all through
    one backend object: every page read is byte-exact, nothing is left locked."""
    import threading

    src = sp.host_pool("mha", "page_first", pages=32)
    sp.fill_random(src, seed=12)
    dst = sp.host_pool("mha", "page_first", pages=32)
    backend = make(backends, srv, src)
    reader = make(backends, srv, dst)
    rounds, errors = 40, []
    written = threading.Semaphore(0)

    def backup() -> None:
        for r in range(rounds):
            keys = keys_for(f"threads-{r}", 4)
            if (
                backend.batch_set_v1(keys, sp.indices(src, [(r + i) % 16 for i in range(4)]))
                != [True] * 4
            ):
                errors.append(f"set {r}")
            written.release()

    def prefetch() -> None:
        for r in range(rounds):
            written.acquire()
            keys = keys_for(f"threads-{r}", 4)
            # This thread's pages land in dst pages 16..19, read back before the next round.
            hits = backend.batch_exists(keys)
            got = reader.batch_get_v1(keys[:hits], sp.indices(dst, list(range(16, 16 + hits))))
            for i, ok in enumerate(got):
                if not ok or sp.page_bytes(dst, 16 + i) != sp.page_bytes(src, (r + i) % 16):
                    errors.append(f"read {r}.{i}")
            if hits != 4:
                errors.append(f"exists {r}: {hits}")

    threads = [threading.Thread(target=backup), threading.Thread(target=prefetch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    assert_clean(srv)


def test_pages_another_engine_is_still_writing_are_not_reported_stored(
    srv: ServerProcess, backends: list[Any]
) -> None:
    """Engine A has reserved four pages (its copy pending) when engine B backs up the same
    pages: B must not report them stored, since A may abort and then tierkv holds none
    (SGLang would count a backup that does not exist). Once A commits, they are stored;
    where A aborts, B's next backup writes them itself."""
    from tierkv.arraycopy import copy_array
    from tierkv.integrations.sglang.pages import page_hash, raw_array

    pool = sp.host_pool("mha", "page_first")
    sp.fill_random(pool, seed=9)
    a, b = make(backends, srv, pool), make(backends, srv, pool)
    client_a = a.link.client()
    flats = [pool.get_data_page(p * pool.page_size, flat=True) for p in range(8)]

    committed, aborted = keys_for("commits", 4), keys_for("aborts", 4)
    reserved = {
        name: client_a.prepare_store(hashes=[page_hash(k) for k in keys])
        for name, keys in (("commits", committed), ("aborts", aborted))
    }
    assert all(len(r.slots.slots) == 4 for r in reserved.values())
    assert b.batch_set_v1(committed, sp.indices(pool, [0, 1, 2, 3])) == [False] * 4
    assert b.batch_set(aborted, flats[4:]) is False  # the generic calls alike

    done = client_a.finish_store(
        reserved["commits"],
        gather=lambda c, dst: copy_array(dst.reshape(-1), raw_array(flats[c]).reshape(-1)),
    )
    assert len(done.stored) == 4
    assert b.batch_set_v1(committed, sp.indices(pool, [0, 1, 2, 3])) == [True] * 4

    client_a.abort_store(reserved["aborts"])
    assert b.batch_exists(aborted) == 0  # nothing holds them: the first report was right
    assert b.batch_set_v1(aborted, sp.indices(pool, [4, 5, 6, 7])) == [True] * 4
    assert b.batch_exists(aborted) == 4
    assert_clean(srv)
