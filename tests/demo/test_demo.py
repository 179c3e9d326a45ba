"""The demo: its workload end to end against real servers, and its KV verifier catching
tampered data."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from support.servers import ServerProcess
from tierkv.demo import run_demo
from tierkv.demo.kv import KVFunction, SimModel
from tierkv.demo.report import DemoReport
from tierkv.demo.simulated_engine import (
    BLOCK_TOKENS,
    CHUNK_TOKENS,
    PagedKVCache,
    SimEngine,
)
from tierkv.demo.workload import Request, Workload

TINY_MODEL = SimModel(layers=2, kv_heads=2, head_dim=16)  # 64 KiB per chunk
TINY_MODEL_ARGS = ["--layers", "2", "--kv-heads", "2", "--head-dim", "16"]


def test_workload_sends_repeat_questions_to_another_engine() -> None:
    w = Workload(documents=4, doc_tokens=700, queries_per_doc=3, seed=7)
    rounds = w.rounds(engines=2)
    assert len(rounds) == 3
    engine_of = {r: e for q in rounds for e, reqs in enumerate(q) for r in reqs}
    assert len(engine_of) == w.requests
    for doc in range(4):
        assert engine_of[Request(doc, 0)] != engine_of[Request(doc, 1)]
    a, b = w.prompt(Request(1, 0)), w.prompt(Request(1, 1))
    assert np.array_equal(a[:700], b[:700]) and np.array_equal(a, w.prompt(Request(1, 0)))
    # A document's chunks are shared by its questions; one reaching into a question is not.
    full = [(r, c) for r in engine_of for c in range(len(w.prompt(r)) // CHUNK_TOKENS)]
    distinct = {(r.doc, c) if c < 700 // CHUNK_TOKENS else (r, c) for r, c in full}
    assert len(distinct) > 4 * 2
    assert w.distinct_chunks(CHUNK_TOKENS) == len(distinct)


def test_gather_and_scatter_move_whole_chunks_between_pages_and_a_slot() -> None:
    cache = PagedKVCache(TINY_MODEL, num_blocks=40, seed=3)
    kv = KVFunction(TINY_MODEL)
    tokens = np.arange(CHUNK_TOKENS, dtype=np.uint32) * 7
    table = cache.allocate(CHUNK_TOKENS)
    assert sorted(table) != list(table)  # scattered pages
    for i, block in enumerate(table):
        span = slice(i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS)
        kv.compute(tokens[span], i * BLOCK_TOKENS, cache.block(int(block)))
    slot = np.zeros(TINY_MODEL.kv_shape(CHUNK_TOKENS), np.float16)
    cache.gather(table, slot)
    assert kv.matches(tokens, 0, slot)
    other = cache.allocate(CHUNK_TOKENS)
    cache.scatter(other, slot)
    assert np.array_equal(cache.kv[:, :, other], cache.kv[:, :, table])


def test_verifier_detects_tampered_misplaced_and_foreign_kv() -> None:
    kv = KVFunction(TINY_MODEL)
    tokens = np.random.default_rng(0).integers(0, 32000, 3 * BLOCK_TOKENS, dtype=np.uint32)
    block = np.empty(TINY_MODEL.kv_shape(BLOCK_TOKENS), np.float16)
    kv.compute(tokens[:BLOCK_TOKENS], 0, block)
    assert np.isfinite(block).all()
    assert kv.matches(tokens[:BLOCK_TOKENS], 0, block)

    tampered = block.copy()
    tampered.view(np.uint8).reshape(-1)[12345 % tampered.nbytes] ^= 0x01  # one bit
    assert not kv.matches(tokens[:BLOCK_TOKENS], 0, tampered)
    # The right tokens at the wrong position, other tokens, another model: all rejected.
    assert not kv.matches(tokens[:BLOCK_TOKENS], BLOCK_TOKENS, block)
    assert not kv.matches(tokens[BLOCK_TOKENS : 2 * BLOCK_TOKENS], 0, block)
    other_model = SimModel(layers=2, kv_heads=2, head_dim=8)
    assert not KVFunction(other_model).matches(tokens[:BLOCK_TOKENS], 0, block)


def test_engine_detects_a_corrupted_retrieve(server: ServerProcess) -> None:
    """Flip one bit of a chunk in the server's pool while it is retrieved: the engine's
    verification names exactly that chunk, and the report fails."""
    workload = Workload(documents=1, doc_tokens=4 * CHUNK_TOKENS + 10, queries_per_doc=2)
    first, second = Request(0, 0), Request(0, 1)
    with server.client() as client:
        cache = PagedKVCache(TINY_MODEL, num_blocks=80)
        engine = SimEngine(client, TINY_MODEL, cache)
        engine.register()
        rec = engine.serve(first, workload.prompt(first))
        assert rec.stored_chunks == 4 and rec.hit_chunks == 0 and not rec.corrupt_chunks

        real_scatter = cache.scatter
        scattered: list[int] = []

        def corrupting_scatter(blocks: np.ndarray, src: np.ndarray) -> None:
            if len(scattered) == 2:  # chunks arrive in order: this is chunk 2
                src.view(np.uint8).reshape(-1)[1000] ^= 0x10  # the pool's copy
            scattered.append(len(blocks))
            real_scatter(blocks, src)

        cache.scatter = corrupting_scatter  # type: ignore[method-assign]
        prompt = workload.prompt(second)
        rec = engine.serve(second, prompt)
        assert scattered == [CHUNK_TOKENS // BLOCK_TOKENS] * 4
        assert rec.hit_chunks == 4 and rec.retrieved_chunks == 4
        assert rec.corrupt_chunks == [2]

    report = DemoReport(workload, TINY_MODEL, engines=1, records=[rec])
    assert report.corrupt_chunks == 1 and not report.ok


def test_demo_end_to_end(server: ServerProcess) -> None:
    workload = Workload(documents=3, doc_tokens=3 * CHUNK_TOKENS + 100, queries_per_doc=2, seed=5)
    report = run_demo(server.endpoint, workload, TINY_MODEL, engines=2, progress=False)
    assert report.ok, report.format()
    assert len(report.records) == 6 and report.corrupt_chunks == 0
    first = [r for r in report.records if r.query == 0]
    repeat = [r for r in report.records if r.query == 1]
    assert all(r.hit_chunks == 0 and r.stored_chunks == r.full_chunks for r in first)
    # Every repeat question loads its document's chunks, stored by the other engine.
    assert all(r.hit_chunks >= 3 and r.retrieved_chunks == r.hit_chunks for r in repeat)
    assert {(r.doc, r.engine) for r in first}.isdisjoint({(r.doc, r.engine) for r in repeat})
    stats = report.server_stats
    assert stats is not None
    assert stats.read_locked == 0 and stats.read_leases == 0 and stats.write_leases == 0
    assert stats.objects == workload.distinct_chunks(CHUNK_TOKENS)
    text = report.format()
    assert "0 failures" in text and "chunk hits" in text


@pytest.mark.processes
def test_cli_with_server_runs_and_stops_its_own_server(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path), "TIERKV_POOL_SIZE": "1"}  # must be ignored
    cmd = [
        sys.executable, "-m", "tierkv.cli", "demo", "--with-server",
        "--documents", "2", "--doc-tokens", "600", "--engines", "2", *TINY_MODEL_ARGS,
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "verification  4 loaded chunks checked byte for byte" in done.stdout
    assert ": 0 failures" in done.stdout
    assert "server stopped cleanly" in done.stdout
    assert not list(tmp_path.glob("tierkv-demo-*")), "temporary directory left behind"


# -- with a disk tier and a pool smaller than the working set ------------------------------
TIER_WORKLOAD_ARGS = ["--documents", "6", "--doc-tokens", str(6 * CHUNK_TOKENS + 50)]


def test_demo_with_a_disk_tier_gets_hits_from_disk(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """A 2 MiB pool (32 tiny chunks) for a ~40-chunk working set, with a disk tier: the
    repeat questions find their documents evicted and load them back from disk, byte-exact."""
    workload = Workload(documents=6, doc_tokens=6 * CHUNK_TOKENS + 50, queries_per_doc=2)
    chunk = TINY_MODEL.bytes_per_token * CHUNK_TOKENS
    assert workload.distinct_chunks(CHUNK_TOKENS) * chunk > 2 << 20
    srv = server_factory(
        pool_size="2MiB",
        extra=[
            "--tier", f"disk:path={tmp_path / 'disk'}",
            "--write-behind-max-bytes", "2MiB",
        ],
    )  # fmt: skip
    report = run_demo(
        srv.endpoint, workload, TINY_MODEL, engines=2, progress=False, settle_tiers=True
    )
    assert report.ok, report.format()
    assert report.corrupt_chunks == 0
    from_disk = report.count("tier_hit_chunks")
    assert from_disk > 0, report.format()
    assert report.count("retrieved_chunks") == report.count("hit_chunks")
    stats = report.server_stats
    assert stats is not None and [t.name for t in stats.tiers] == ["disk"]
    assert stats.evictions > 0
    assert stats.tiers[0].loaded_chunks >= from_disk  # hits from disk were loaded from disk
    assert stats.tiers[0].load_failures == {}
    assert stats.read_locked == 0 and stats.read_leases == 0 and stats.write_leases == 0
    text = report.format()
    assert f"slower tiers {from_disk} " in text and "tier disk" in text


@pytest.mark.processes
def test_cli_with_a_disk_tier_and_again_on_the_same_directory(tmp_path: Path) -> None:
    """`tierkv demo --with-server --disk-tier DIR`: some hits come from disk, nothing fails
    verification; a second run on the same directory (a new server) finds the first run's
    chunks on disk, already for the first questions."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    cmd = [
        sys.executable, "-m", "tierkv.cli", "demo", "--with-server",
        "--disk-tier", str(tmp_path / "disk"), *TIER_WORKLOAD_ARGS,
        "--engines", "2", *TINY_MODEL_ARGS,
    ]  # fmt: skip
    outputs = []
    for _ in range(2):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stdout + done.stderr
        assert ": 0 failures" in done.stdout and "server stopped cleanly" in done.stdout
        assert "disk tier" in done.stderr and "tier disk" in done.stdout
        outputs.append(done.stdout)
    first, second = (_hits(out) for out in outputs)
    assert first["tiers"] > 0, outputs[0]
    # Second run: the first questions (no repeat yet) hit, from disk.
    assert second["all"] > second["repeat"] and second["tiers"] > 0, outputs[1]
    assert not list(tmp_path.glob("tierkv-demo-*")), "temporary directory left behind"


def _hits(report: str) -> dict[str, int]:
    hits = re.search(r"chunk hits +(\d+) of \d+ looked up \([^)]*\); (\d+) of", report)
    tiers = re.search(r"slower tiers (\d+) ", report)
    assert hits and tiers, report
    return {"all": int(hits[1]), "repeat": int(hits[2]), "tiers": int(tiers[1])}
