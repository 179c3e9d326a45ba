"""tierkv under load: many engines at once, and the control path while data moves.

Two experiments with real server processes, each against a bound measured in the same run:

(a) ``engines8``: 8 engine processes on one server at once, each storing, looking up and
    retrieving prompts of 32k tokens (128 chunks of 8 MiB, sent in requests of 16 chunks,
    as an engine stores what each forward step completed). Aggregate store and retrieve
    GB/s against a memcpy of the same chunks by 8 threads at once (the same number of
    copiers) in this process, and the lookups' p50/p99 (each a 32k-token prompt, hashed by
    the server).
(b) ``under_transfer``: one engine process looks up a fresh 32k-token prompt every 10 ms on
    server B while B fetches 256 MiB from peer A (another engine's lookup) and prefetches
    128 MiB from its disk tier (a third engine's lookup). The lookups' p99 inside the
    transfer windows, and outside them (the same engine, the same server, idle).

Last line: ``load engines8_store_vs_memcpy=A engines8_retrieve_vs_memcpy=B
engines8_lookup_p99_ms=C lookup_p99_under_transfer_ms=D``.
Goals: A and B >= 0.8, C <= 5, D <= 5.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from peers import TOKEN, Server, free_port_pair, members, wait_for
from shm_path import start_server
from tierkv.client import Client
from tierkv.demo.local_process import stop_process

MIB = 1 << 20
CHUNK_TOKENS = 256
PROMPT_TOKENS = 32 * 1024
SHAPE = (2, CHUNK_TOKENS, 4096)  # float32: 8 MiB a chunk
CHUNK_BYTES = 2 * CHUNK_TOKENS * 4096 * 4
SMALL = (2, CHUNK_TOKENS, 2)  # the looking-up engine's chunks (their size does not matter)
GOAL_VS_MEMCPY = 0.8
GOAL_P99_MS = 5.0


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def prompt(seed: int, tokens: int = PROMPT_TOKENS) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(0, 100_000, tokens, dtype=np.uint32)


# -- (a) 8 engines at once -------------------------------------------------------------------
def engine_main(endpoint: str, idx: int, prompts: int, per_request: int, out: Any) -> None:
    """One engine process: store each prompt request by request, look it up, retrieve it."""
    client = Client(endpoint, timeout=120.0, populate=True, copy_threads=1)
    client.register("load-model", SHAPE, "float32", token_axis=1, name=f"engine-{idx}")
    src = np.random.default_rng(idx).random(SHAPE, dtype=np.float32)  # every chunk's bytes
    dst = np.empty(SHAPE, np.float32)
    n_chunks = PROMPT_TOKENS // CHUNK_TOKENS
    stored = retrieved = 0
    store_s = retrieve_s = 0.0
    lookups: list[float] = []
    for p in range(prompts):
        tokens = prompt(idx * 1000 + p)
        t0 = time.perf_counter()
        for first in range(0, n_chunks, per_request):
            end = (first + per_request) * CHUNK_TOKENS
            res = client.store(tokens[:end], [src] * per_request, first_chunk=first)
            stored += len(res.stored)
        store_s += time.perf_counter() - t0
        rid = f"e{idx}-p{p}"
        t0 = time.perf_counter()
        found = client.lookup(tokens, request_id=rid)
        lookups.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        got = client.retrieve(request_id=rid, scatter=lambda c, view: np.copyto(dst, view))
        retrieve_s += time.perf_counter() - t0
        retrieved += len(got.retrieved)
        if found.hits != len(got.retrieved):
            raise RuntimeError(f"engine {idx}: {found.hits} hits, {len(got.retrieved)} read")
    client.close()
    out.put(
        {
            "stored": stored,
            "retrieved": retrieved,
            "store_s": store_s,
            "retrieve_s": retrieve_s,
            "lookups": lookups,
        }
    )


def memcpy_gbps(threads: int, chunks_each: int) -> float:
    """``threads`` copiers at once, each copying ``chunks_each`` 8 MiB chunks into a pool-sized
    buffer of its own (touched), as 8 engines copy into the pool."""
    srcs = [np.random.default_rng(t).random(SHAPE, dtype=np.float32) for t in range(threads)]
    dsts = [np.ones((chunks_each, *SHAPE), np.float32) for _ in range(threads)]

    def copy(t: int) -> None:
        for i in range(chunks_each):
            np.copyto(dsts[t][i], srcs[t])

    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(3):
            t0 = time.perf_counter()
            list(pool.map(copy, range(threads)))
            best = min(best, time.perf_counter() - t0)
    return threads * chunks_each * CHUNK_BYTES / best / 1e9


def engines8(root: Path, engines: int, prompts: int, per_request: int) -> dict[str, float]:
    root.mkdir(parents=True)
    # Every engine's prompt stays in the pool until it has read it back: room for all of
    # them below the eviction watermark (older prompts are evicted as new ones come).
    prompt_bytes = PROMPT_TOKENS // CHUNK_TOKENS * CHUNK_BYTES
    pool = int(engines * prompt_bytes / 0.9) + 512 * MIB
    srv = start_server(root, pool, True, ("--high-watermark", "0.95", "--low-watermark", "0.9"))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    try:
        procs = [
            ctx.Process(target=engine_main, args=(srv.endpoint, i, prompts, per_request, out))
            for i in range(engines)
        ]
        t0 = time.perf_counter()
        for proc in procs:
            proc.start()
        results = [out.get(timeout=600) for _ in procs]
        wall = time.perf_counter() - t0
        for proc in procs:
            proc.join(60)
            if proc.exitcode != 0:
                raise RuntimeError(f"an engine failed (exit {proc.exitcode})")
    finally:
        stop_process(srv.proc)
    stored = sum(r["stored"] for r in results)
    retrieved = sum(r["retrieved"] for r in results)
    # Aggregate rates: all bytes over the longest engine's time in that phase.
    store_gbps = stored * CHUNK_BYTES / max(r["store_s"] for r in results) / 1e9
    retrieve_gbps = retrieved * CHUNK_BYTES / max(r["retrieve_s"] for r in results) / 1e9
    lookups = [x for r in results for x in r["lookups"]]
    bound = memcpy_gbps(engines, 8)
    expected = engines * prompts * (PROMPT_TOKENS // CHUNK_TOKENS)
    print(
        f"(a) {engines} engines x {prompts} prompts of {PROMPT_TOKENS} tokens "
        f"({PROMPT_TOKENS // CHUNK_TOKENS} x 8 MiB, {per_request} per store request), "
        f"{wall:.1f} s: stored {stored}/{expected}, retrieved {retrieved}"
    )
    print(
        f"    store {store_gbps:.2f} GB/s, retrieve {retrieve_gbps:.2f} GB/s, "
        f"memcpy by {engines} threads {bound:.2f} GB/s; lookup (32k tokens) "
        f"p50 {statistics.median(lookups) * 1e3:.2f} ms p99 {pct(lookups, 0.99) * 1e3:.2f} ms"
    )
    return {
        "store": store_gbps / bound,
        "retrieve": retrieve_gbps / bound,
        "lookup_p99_ms": pct(lookups, 0.99) * 1e3,
    }


# -- (b) lookups while the server moves data ---------------------------------------------------
def looker_main(endpoint: str, seconds: float, period: float, out_path: str) -> None:
    """Look up a fresh 32k-token prompt every ``period`` s (with a request id, as a
    scheduler does, then end the session); write (start time, latency) pairs."""
    client = Client(endpoint, timeout=30.0, auth_token=TOKEN)
    client.register("lookup-model", SMALL, "float32", token_axis=1)
    samples: list[tuple[float, float]] = []
    deadline = time.monotonic() + seconds
    i = 0
    while time.monotonic() < deadline:
        i += 1
        tokens = prompt(10_000_000 + i)
        t0 = time.monotonic()
        client.lookup(tokens, request_id=f"look-{i}")
        samples.append((t0, time.monotonic() - t0))
        client.end_session(f"look-{i}")
        time.sleep(max(0.0, period - (time.monotonic() - t0)))
    client.close()
    Path(out_path).write_text(json.dumps(samples))


def under_transfer(root: Path, rounds: int) -> dict[str, float]:
    root.mkdir(parents=True)
    peer_chunks, disk_chunks = 32, 16
    pa, pb = free_port_pair(), free_port_pair()
    disk = root / "disk"
    a = Server(str(root), "a", pa, pa, 512 * MIB)
    b = Server(
        str(root), "b", pb, pa, 768 * MIB,
        ("--tier", f"disk:path={disk},capacity=2GiB"),
    )  # fmt: skip
    try:
        wait_for(lambda: members(a.addr) == members(b.addr) == {a.addr, b.addr})
        src = np.random.default_rng(1).random(SHAPE, dtype=np.float32)
        peer_tokens = prompt(1, peer_chunks * CHUNK_TOKENS)
        disk_tokens = prompt(2, disk_chunks * CHUNK_TOKENS)
        with a.client() as engine:
            engine.register("load-model", SHAPE, "float32", token_axis=1)
            if len(engine.store(peer_tokens, [src] * peer_chunks).stored) != peer_chunks:
                raise RuntimeError("A did not store the peer working set")
        with b.client() as engine:
            engine.register("load-model", SHAPE, "float32", token_axis=1)
            if len(engine.store(disk_tokens, [src] * disk_chunks).stored) != disk_chunks:
                raise RuntimeError("B did not store the disk working set")
            wait_for(lambda: engine.stats().tiers[0].objects >= disk_chunks)
        samples_path = root / "lookups.json"
        seconds = 3.0 + rounds * 1.5
        looker = subprocess.Popen(
            [sys.executable, __file__, "--looker", b.endpoint, str(seconds), "0.01",
             str(samples_path)],
        )  # fmt: skip
        windows: list[tuple[float, float]] = []
        dst = np.empty(SHAPE, np.float32)
        time.sleep(1.5)  # the looker's idle baseline first

        def fetch(engine: Client, tokens: np.ndarray[Any, Any], n: int, rid: str) -> None:
            found = engine.lookup(tokens, request_id=rid, wait=True)
            got = engine.retrieve(request_id=rid, scatter=lambda c, v: np.copyto(dst, v))
            if found.hits != n or len(got.retrieved) != n:
                raise RuntimeError(f"{rid}: {found.hits} hits of {n}")

        with b.client() as peer_engine, b.client() as disk_engine:
            peer_engine.register("load-model", SHAPE, "float32", token_axis=1)
            disk_engine.register("load-model", SHAPE, "float32", token_axis=1)
            for r in range(rounds):
                peer_engine.clear()  # B's pool forgets both working sets (disk keeps its)
                t0 = time.monotonic()
                threads = [
                    threading.Thread(target=fetch, args=(peer_engine, peer_tokens, peer_chunks,
                                                         f"peer-{r}")),
                    threading.Thread(target=fetch, args=(disk_engine, disk_tokens, disk_chunks,
                                                         f"disk-{r}")),
                ]  # fmt: skip
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                windows.append((t0, time.monotonic()))
                time.sleep(0.5)
        looker.wait(seconds + 60)
        samples = json.loads(samples_path.read_text())
    finally:
        a.stop()
        b.stop()
    busy = [lat for start, lat in samples if any(lo <= start <= hi for lo, hi in windows)]
    idle = [lat for start, lat in samples if not any(lo - 0.2 <= start <= hi + 0.2
                                                     for lo, hi in windows)]  # fmt: skip
    span = statistics.median(hi - lo for lo, hi in windows)
    print(
        f"(b) {rounds} rounds of 256 MiB from peer A + 128 MiB from B's disk tier "
        f"(median {span * 1e3:.0f} ms each), a 32k-token lookup every 10 ms on B"
    )
    print(
        f"    lookups during transfers: n={len(busy)} p50 {statistics.median(busy) * 1e3:.2f} "
        f"ms p99 {pct(busy, 0.99) * 1e3:.2f} ms max {max(busy) * 1e3:.2f} ms; "
        f"idle: n={len(idle)} p50 {statistics.median(idle) * 1e3:.2f} ms "
        f"p99 {pct(idle, 0.99) * 1e3:.2f} ms"
    )
    return {"p99_ms": pct(busy, 0.99) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=3, help="prompts per engine")
    ap.add_argument("--per-request", type=int, default=16, help="chunks per store request")
    ap.add_argument("--rounds", type=int, default=6, help="transfer rounds in (b)")
    ap.add_argument("--only", choices=("a", "b"), help="run one experiment")
    ap.add_argument("--looker", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.looker:
        endpoint, seconds, period, out_path = args.looker
        looker_main(endpoint, float(seconds), float(period), out_path)
        return
    root = Path(tempfile.mkdtemp(prefix="tierkv-load-"))
    try:
        a = (
            engines8(root / "a", args.engines, args.prompts, args.per_request)
            if args.only != "b"
            else None
        )
        b = under_transfer(root / "b", args.rounds) if args.only != "a" else None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    parts = []
    if a:
        parts += [
            f"engines8_store_vs_memcpy={a['store']:.2f}",
            f"engines8_retrieve_vs_memcpy={a['retrieve']:.2f}",
            f"engines8_lookup_p99_ms={a['lookup_p99_ms']:.2f}",
        ]
    if b:
        parts.append(f"lookup_p99_under_transfer_ms={b['p99_ms']:.2f}")
    print("load " + " ".join(parts))


if __name__ == "__main__":
    os.environ.setdefault("TIERKV_TEST", "1")
    main()
