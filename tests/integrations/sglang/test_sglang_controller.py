"""SGLang's own hybrid cache controller (``HybridCacheController``: its backup, prefetch
and prefetch-I/O threads) driving the tierkv backend on CPU pools, against a real tierkv
server. The test plays the scheduler's part only: it hands the controller host pages to
back up, asks it to prefetch, and allocates the host pages a hit lands in.

Runs in the SGLang environment (.venv-sglang): ``make test`` runs it there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from support import sglang_pools as sp
from support.servers import ServerProcess

pytestmark = [pytest.mark.sglang]
PAGE = 16


@pytest.fixture(autouse=True)
def sglang_installed() -> None:
    sp.require_sglang()


@pytest.fixture
def srv(server_factory: Callable[..., ServerProcess]) -> ServerProcess:
    return server_factory(pool_size="64MiB")


@pytest.fixture
def controllers(srv: ServerProcess) -> Iterator[Callable[[], Any]]:
    """Makes controllers attached to ``srv``; detaches them (their threads stop) after."""
    made: list[Any] = []

    def make(**settings: Any) -> Any:
        extra = {"endpoint": srv.endpoint, "model_id": "tiny-hybrid", **settings}
        ctrl = sp.hybrid_controller(extra)
        made.append(ctrl)
        return ctrl

    with sp.single_rank():
        yield make
        for ctrl in made:
            ctrl.detach_storage_backend()


def pools(ctrl: Any) -> tuple[Any, Any]:
    from sglang.srt.mem_cache.hicache_storage import PoolName

    return ctrl.mem_pool_host.get_pool(PoolName.KV), ctrl.mem_pool_host.get_pool(PoolName.MAMBA)


def back_up(
    ctrl: Any, tokens: list[int], state_after_page: int, *, stored: bool = True
) -> tuple[Any, Any]:
    """The controller's backup thread stores the KV pages of ``tokens`` and the Mamba state
    after page ``state_after_page`` (``stored``: and both succeed, else both fail); returns
    the host KV indices and the state's slot."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    kv, mamba = pools(ctrl)
    host, slot = kv.alloc(len(tokens)), mamba.alloc(1)
    hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
    state = PoolTransfer(
        PoolName.MAMBA, host_indices=slot, keys=[hashes[state_after_page]],
        hit_policy=PoolHitPolicy.TRAILING_PAGES,
    )  # fmt: skip
    op_id = ctrl.write_storage(host, tokens, hash_value=hashes, extra_pools=[state])
    ack = ctrl.ack_backup_queue.get(timeout=60)
    assert ack.id == op_id and ack.completed_tokens == (len(tokens) if stored else 0)
    assert ack.pool_storage_result.extra_pool_hit_pages == {PoolName.MAMBA: int(stored)}
    return host, slot


def prefetch(ctrl: Any, tokens: list[int]) -> tuple[Any, list[Any]]:
    """The controller's prefetch thread asks for ``tokens`` (a Mamba state at the hit); the
    test allocates the host pages of the hit as the scheduler would, then the prefetch-I/O
    thread reads them. Returns the operation and its acks."""
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    _, mamba = pools(ctrl)
    state = PoolTransfer(
        PoolName.MAMBA, keys=["__placeholder__"], hit_policy=PoolHitPolicy.TRAILING_PAGES
    )
    ctrl.prefetch(CacheRequestHandle("req", 0), tokens, None, extra_pools=[state])
    op = ctrl.prefetch_hit_queue.get(timeout=60)
    acks: list[Any] = []
    if op.storage_hit_count == 0:
        return op, acks
    op.host_indices = ctrl.alloc_prefetch_host_buffers(op, op.storage_hit_count)
    op.pool_transfers[0].host_indices = mamba.alloc(1)
    ctrl.prefetch_buffer.put(op)
    while not (acks and acks[-1].completed_req):
        acks.append(ctrl.ack_prefetch_queue.get(timeout=60))
    return op, acks


def test_sglangs_hybrid_controller_restores_kv_and_mamba_state_byte_exact(
    controllers: Callable[[], Any],
) -> None:
    from sglang.srt.mem_cache.hicache_storage import PoolName

    writer, reader = controllers(), controllers()
    assert sorted(writer.storage_backend.sidecars) == ["mamba"]
    kv, mamba = pools(writer)
    sp.fill_random(kv, seed=1)
    sp.fill_random_mamba(mamba, seed=2)
    tokens = list(range(3 * PAGE))
    host, slot = back_up(writer, tokens, state_after_page=2)

    op, acks = prefetch(reader, tokens)
    assert op.storage_hit_count == 3 * PAGE
    assert op.query_pool_hit_pages == {PoolName.KV: 3, PoolName.MAMBA: 3}
    assert acks[0].completed_tokens == 3 * PAGE
    assert [a.pool_hits[PoolName.MAMBA] for a in acks if a.pool_hits] == [1]
    kv2, mamba2 = pools(reader)
    for i in range(3):
        src, dst = int(host[i * PAGE]) // PAGE, int(op.host_indices[i * PAGE]) // PAGE
        assert sp.page_bytes(kv2, dst) == sp.page_bytes(kv, src)
    restored = int(op.pool_transfers[0].host_indices[0])
    assert sp.slot_bytes(mamba2, restored) == sp.slot_bytes(mamba, int(slot[0]))


def test_the_controller_gets_no_hit_past_the_last_restorable_state(
    controllers: Callable[[], Any],
) -> None:
    """Four KV pages are stored, the Mamba state only after page 2: the controller's hit is
    three pages (where the state can be restored), not four; a prompt whose state was
    never stored gets no hit at all."""
    writer, reader = controllers(), controllers()
    kv, mamba = pools(writer)
    sp.fill_random(kv, seed=3)
    sp.fill_random_mamba(mamba, seed=4)
    back_up(writer, list(range(4 * PAGE)), state_after_page=2)
    op, _ = prefetch(reader, list(range(4 * PAGE)))
    assert op.storage_hit_count == 3 * PAGE
    op, acks = prefetch(reader, list(range(2 * PAGE)))  # KV stored, no state by page 2
    assert (op.storage_hit_count, acks) == (0, [])


def test_a_server_killed_under_the_controllers_traffic_costs_hits_not_errors(
    srv: ServerProcess, controllers: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """kill -9 of the server between backups and prefetches of SGLang's controller: its
    backups and prefetches fail softly (no exception reaches the controller, which would
    log it as an error), and once the server is back at the same endpoint both work again
    without restarting anything."""
    import logging
    import time

    fast = {"timeout": 0.5, "retry_interval": 0.2}
    writer, reader = controllers(**fast), controllers(**fast)
    kv, mamba = pools(writer)
    sp.fill_random(kv, seed=5)
    sp.fill_random_mamba(mamba, seed=6)
    tokens = list(range(2 * PAGE))
    back_up(writer, tokens, state_after_page=1)
    assert prefetch(reader, tokens)[0].storage_hit_count == 2 * PAGE
    caplog.set_level(logging.WARNING)
    srv.kill()
    back_up(writer, list(range(100, 100 + 2 * PAGE)), state_after_page=1, stored=False)
    op, acks = prefetch(reader, tokens)
    assert (op.storage_hit_count, acks) == (0, [])
    srv.start()  # the same endpoint, an empty pool
    links = [
        pool.link
        for ctrl in (writer, reader)
        for pool in (ctrl.storage_backend.kv, *ctrl.storage_backend.sidecars.values())
    ]
    deadline = time.monotonic() + 60
    while not all(link.client() is not None for link in links):  # past retry_interval
        assert time.monotonic() < deadline, "the backends did not reconnect"
        time.sleep(0.05)
    _, slot = back_up(writer, tokens, state_after_page=1)
    op, _ = prefetch(reader, tokens)
    assert op.storage_hit_count == 2 * PAGE
    restored = int(op.pool_transfers[0].host_indices[0])
    assert sp.slot_bytes(pools(reader)[1], restored) == sp.slot_bytes(mamba, int(slot[0]))
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]
