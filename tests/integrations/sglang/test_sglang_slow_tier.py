"""The SGLang backend against a tier that is slow to deliver: ``batch_exists`` and
``batch_exists_v2`` wait ``timeout`` at most in all (settings.py promises it), however many
lookups a call makes (one per piece of a long span, one per presence probe of a hybrid
model's pools), and a page not fetched in time is a miss, never a hit.

A real server (RPC loop, index, shared-memory pool, prefetch threads) in this process, the
backend over its socket, and a tier kept in memory that the test can stall
(:class:`support.memtier.MemTier`). The waits are counted, not timed: each wait for a
prefetch is recorded with the time it was given.

Runs in the SGLang environment (.venv-sglang): ``make test`` runs it there.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from support import sglang_pools as sp
from support.memtier import WAIT, MemTier
from tierkv.client import Client
from tierkv.config import ServerConfig
from tierkv.server.wiring import Server

pytestmark = [pytest.mark.sglang]


@pytest.fixture(autouse=True)
def sglang_installed() -> None:
    sp.require_sglang()


@dataclass
class Tiered:
    server: Server
    mem: MemTier

    def to_tier_only(self, backend_link: Any) -> int:
        """Once every page is written behind to the tier, drop the namespace's pages from
        the pool: they are then only in the (slow) tier. Returns the pages dropped."""
        service = self.server.service
        assert service.tiering.write_behind.wait_idle(WAIT)
        namespace = backend_link.registration().namespace
        return len(service.index.clear_keys(namespace))


@pytest.fixture
def tiered(tmp_path: Path) -> Iterator[Tiered]:
    mem = MemTier()
    run = f"tkv-sgl-{uuid.uuid4().hex[:8]}"
    cfg = ServerConfig(
        pool_name=run,
        pool_size=64 << 20,
        http_port=0,
        instance=run,
        runtime_dir=str(tmp_path / "run"),
        prefetch_timeout=WAIT,
    )
    server = Server(cfg, tiers=[mem]).start_background()
    try:
        yield Tiered(server, mem)
    finally:
        if mem.gate is not None:
            mem.gate.set()
        server.stop()


def keys_for(prefix: str, n: int) -> list[str]:
    return [hashlib.sha256(f"{prefix}-{i}".encode()).hexdigest() for i in range(n)]


def record_waits(monkeypatch: pytest.MonkeyPatch, after: Callable[[float], None]) -> list[Any]:
    """Record the ``timeout`` of every ``Client.wait_prefetch`` (None: the client's own),
    calling ``after(timeout)`` once each returns."""
    waits: list[Any] = []
    real = Client.wait_prefetch

    def wait_prefetch(self: Client, request_id: str, timeout: float | None = None) -> int:
        waits.append(timeout)
        hits = real(self, request_id, timeout)
        after(self.timeout if timeout is None else timeout)
        return hits

    monkeypatch.setattr(Client, "wait_prefetch", wait_prefetch)
    return waits


def wait_until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.05)


def test_batch_exists_v2_waits_once_for_a_stalled_tier_however_many_probes(
    tiered: Tiered, backends: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Mamba state at every page, all of them in the tier only, the tier stalled: the
    trailing-pages check probes page after page (up to MAX_PROBES). One wait gets the whole
    timeout; once it is spent, the other probes only look at the pool (no wait), and the
    answer is a miss."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    timeout, n = 0.5, 36
    kv = sp.host_pool("mha", "page_first", pages=40)
    sp.fill_random(kv, 1)
    mamba = sp.mamba_pool(slots=40)
    sp.fill_random_mamba(mamba, 2)
    extra = {"endpoint": tiered.server.endpoint, "timeout": timeout}
    b = sp.create_backend(sp.storage_config(extra), kv)
    backends.append(b)
    b.register_mem_host_pool_v2(kv, PoolName.KV)
    b.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    keys = keys_for("stall", n)
    assert all(b.batch_set_v1(keys, sp.indices(kv, list(range(n)))))
    stored = b.batch_set_v2(
        [PoolTransfer(name=PoolName.MAMBA, keys=keys, host_indices=sp.slots(list(range(n))))]
    )
    assert all(stored[PoolName.MAMBA])
    assert tiered.to_tier_only(b.sidecars["mamba"].link) == n

    def query() -> Any:
        last = PoolTransfer(
            name=PoolName.MAMBA, keys=[keys[-1]], hit_policy=PoolHitPolicy.TRAILING_PAGES
        )
        return b.batch_exists_v2(keys, [last])

    gate = tiered.mem.hold()
    waits = record_waits(monkeypatch, lambda _: None)
    result = query()
    assert result.kv_hit_pages == 0  # no state restorable from the pool: no hit
    # One wait, given at most the timeout: the tier stalls it to its end, and the call
    # then waits no more (before the fix: one full timeout per probe).
    assert len(waits) == 1 and 0 < waits[0] <= timeout, waits

    gate.set()  # the tier delivers: the states are found again
    wait_until(lambda: query().kv_hit_pages == n)


def test_batch_exists_waits_timeout_in_all_over_its_pieces(
    tiered: Tiered, backends: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A span of three pieces, each in the tier only: a wait that takes its whole time (a
    slow tier; the clock the backend reads is advanced by each wait's timeout) leaves no
    time for the next pieces, which then count what the pool holds: the pages fetched so
    far, never more."""
    from tierkv.integrations.sglang import pool_store

    timeout, piece = 5.0, 4
    monkeypatch.setattr(pool_store, "PAGES_PER_REQUEST", piece)
    kv = sp.host_pool("mha", "page_first", pages=16)
    sp.fill_random(kv, 3)
    b = sp.create_backend(
        sp.storage_config({"endpoint": tiered.server.endpoint, "timeout": timeout}), kv
    )
    backends.append(b)
    keys = keys_for("pieces", 3 * piece)
    assert all(b.batch_set_v1(keys, sp.indices(kv, list(range(3 * piece)))))
    assert tiered.to_tier_only(b.link) == 3 * piece

    now = [time.monotonic()]

    def spend(seconds: float) -> None:
        now[0] += seconds

    monkeypatch.setattr(pool_store, "monotonic", lambda: now[0], raising=False)
    waits = record_waits(monkeypatch, spend)
    # The first piece is fetched (the real wait returns as soon as it lands), and its wait
    # spends the whole timeout on the backend's clock: the other pieces get no wait.
    assert b.batch_exists(keys) == piece
    assert waits == [timeout], waits
