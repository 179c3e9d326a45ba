"""Exact per-tenant usage while engine processes of several tenants store, read and clear at
once against one server (in this process, so its index can be checked afterwards), with
quotas evicting and the watermark evicting too."""

from __future__ import annotations

import random
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from support.servers import CHUNK_BYTES, CHUNK_SIZE, chunk_data, in_process_config, register
from support.workers import run_workers
from tierkv.client import Client
from tierkv.server.wiring import Server

ENGINES = [("a", ""), ("a", ""), ("b", ""), ("", "user-1"), ("", "")]  # (tenant, cache salt)
ROUNDS = 40
JOIN_TIMEOUT = 120


def prompt(seed: int, chunks: int) -> list[int]:
    return list(range(seed * 100_000, seed * 100_000 + chunks * CHUNK_SIZE))


def engine(endpoint: str, idx: int, tenant: str, salt: str, results: Any) -> None:
    """Stores prompts (some shared with the other engine of its tenant), reads them back
    byte-exact when they hit, and now and then clears its own namespace."""
    try:
        rng = random.Random(idx)
        with Client(endpoint, timeout=20.0) as client:
            register(client, tenant_salt=tenant, name=f"engine-{idx}")
            for _ in range(ROUNDS):
                toks = prompt(rng.randrange(12), rng.randrange(1, 8))
                n = len(toks) // CHUNK_SIZE
                client.store(toks, [chunk_data(toks, i) for i in range(n)], salt=salt)
                out = [np.empty(c.shape, c.dtype) for c in [chunk_data(toks, 0)] * n]
                got = client.retrieve(toks, out=out, salt=salt)
                for i in got.retrieved:
                    np.testing.assert_array_equal(out[i], chunk_data(toks, i))
                if rng.random() < 0.05:
                    client.clear()
        results.put((idx, None))
    except BaseException:
        results.put((idx, traceback.format_exc()))


@pytest.mark.processes
def test_usage_per_tenant_is_exact_under_concurrent_engines(tmp_path: Path) -> None:
    cfg = in_process_config(
        tmp_path,
        pool_size="4MiB",  # 128 chunks: the watermark evicts too
        quotas={"a": "1MiB", "user-1": "512KiB"},
        eviction_interval=0.01,
    )
    with Server(cfg).start_background() as server:
        run_workers(
            engine, [(server.endpoint, i, t, s) for i, (t, s) in enumerate(ENGINES)], JOIN_TIMEOUT
        )
        index = server.index
        index.check()  # every tenant's usage == the sizes of its slots; tenant LRUs exact
        server.eviction.run_once()
        figures = {server.tenants.name_of(f.tenant): f for f in index.tenant_figures()}
        assert sum(f.used for f in figures.values()) == index.used
        assert figures["a"].used <= 2**20 and figures["user-1"].used <= 2**19
        assert figures["a"].evictions > 0  # its quota (or the watermark) evicted some
        assert set(figures) <= {"a", "b", "user-1", "~default"}
        for name, f in figures.items():
            assert f.used % CHUNK_BYTES == 0, name
        rows = {r.tag: r for r in server.status.snapshot().tenants}
        assert sum(r.used for r in rows.values()) == index.used
