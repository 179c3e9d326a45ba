"""tierkv under load: many engines at once, and the control path while data moves.

Two experiments with real server processes, each against a bound measured in the same run:

(a) ``engines8``: 8 engine processes on one server at once, each storing, looking up and
    retrieving prompts of 32k tokens (128 chunks of 8 MiB, sent in requests of 16 chunks,
    as an engine stores what each forward step completed). In rounds: every engine stores
    its prompt (and, after each store request, looks up a fresh 32k-token prompt, as its
    scheduler does for a new request: a miss) and then looks it up; once all have stored,
    every engine retrieves its prompt. Aggregate store and retrieve GB/s (each round's
    bytes over that round's span, first start to last end) against a memcpy of the same
    chunks by 8 threads at once (the same number of copiers) in this process, measured
    right before each phase while the engines wait (:class:`Gate`: this VM's memory
    bandwidth drifts by a tenth or more within seconds), and the lookups' p50/p99 (hashed
    by the server). The engines copy with non-temporal stores (:mod:`tierkv.arraycopy`),
    which can beat that memcpy; the same bound copied that way is printed beside.
(b) ``under_transfer``: one engine process looks up a fresh 32k-token prompt every 10 ms on
    server B while B fetches 256 MiB from peer A (another engine's lookup) and prefetches
    128 MiB from its disk tier (a third engine's lookup; ``--slow-tier redis``: from a Redis
    tier instead). Every round's peer working set is a prompt A has just stored: B writes
    what it fetched behind to its own tier, which B asks before the peer, so a working set
    fetched again would come from there. The
    lookups' p99 inside the transfer windows, and outside them (the same engine, the same
    server, idle).

Both also run a floor (:class:`Floor`): two processes of their own doing a bare round
trip every 5 ms under the same load, with no tierkv in between. Its p99 is what the
machine's scheduler gives any request/reply between two processes at that moment; on a
2-core VM it is of the order of the goal itself. With it, the share of the CPUs' time the
hypervisor took from this VM meanwhile (``steal`` in ``/proc/stat``). Printed on the line
before the last: ``floor engines8_roundtrip_p99_ms=.. engines8_steal=..
under_transfer_roundtrip_p99_ms=.. under_transfer_steal=..``.

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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from peers import TOKEN, Server, free_port_pair, members, wait_for
from percentiles import pct
from shm_path import start_server
from stop_signals import exit_on_stop_signals
from tierkv import arraycopy, framing
from tierkv.arraycopy import copy_array
from tierkv.client import Client
from tierkv.demo.local_process import stop_process
from tierkv.gc_pauses import freeze_startup
from tiers import redis_server

MIB = 1 << 20
CHUNK_TOKENS = 256
PROMPT_TOKENS = 32 * 1024
SHAPE = (2, CHUNK_TOKENS, 4096)  # float32: 8 MiB a chunk
CHUNK_BYTES = 2 * CHUNK_TOKENS * 4096 * 4
SMALL = (2, CHUNK_TOKENS, 2)  # the looking-up engine's chunks (their size does not matter)
GOAL_VS_MEMCPY = 0.8
GOAL_P99_MS = 5.0


def within(samples: list[tuple[float, float]], windows: list[tuple[float, float]]) -> list[float]:
    """The latencies of the (start time, latency) samples that started inside a window."""
    return [lat for start, lat in samples if any(lo <= start <= hi for lo, hi in windows)]


def describe_rtt(rtt: list[float]) -> str:
    return (
        f"a bare round trip between two other processes meanwhile: n={len(rtt)} "
        f"p50 {statistics.median(rtt) * 1e3:.2f} ms p99 {pct(rtt, 0.99) * 1e3:.2f} ms"
    )


def prompt(seed: int, tokens: int = PROMPT_TOKENS) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(0, 100_000, tokens, dtype=np.uint32)


# -- the floor: a bare request/reply round trip under the same load -----------------------------
def echo_main(endpoint: str) -> None:
    """Answer every message with itself until ``stop``, over the transport the server's RPC
    loop uses (:mod:`tierkv.framing`)."""
    listener = framing.bind(endpoint)
    listener.setblocking(True)
    conn = framing.Connection(listener.accept()[0])
    while True:
        for frame in conn.receive(time.monotonic() + 3600):
            conn.send(frame, time.monotonic() + 60)
            if frame == b"stop":
                return


def pinger_main(endpoint: str, period: float, stop_path: str, out_path: str) -> None:
    """Send 64 bytes and wait for them back every ``period`` s until ``stop_path`` exists;
    write (start time, round trip) pairs."""
    conn = framing.Connection.open(endpoint, time.monotonic() + 30)
    assert conn is not None, f"no echo process on {endpoint}"
    samples: list[tuple[float, float]] = []
    stop = Path(stop_path)
    while not stop.exists():
        t0 = time.monotonic()
        conn.send(b"x" * 64, t0 + 60)
        conn.receive(t0 + 60)
        samples.append((t0, time.monotonic() - t0))
        time.sleep(max(0.0, period - (time.monotonic() - t0)))
    conn.send(b"stop", time.monotonic() + 60)
    conn.receive(time.monotonic() + 60)
    Path(out_path).write_text(json.dumps(samples))


def steal_seconds() -> float | None:
    """CPU time the hypervisor gave other guests while this VM's vCPUs wanted to run (the
    ``steal`` column of ``/proc/stat``, all CPUs); None where there is no such figure."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


class Floor:
    """Two processes of their own pinging each other over a Unix socket, framed as tierkv's
    requests are (no tierkv, nothing to compute) while an experiment runs: the round trip
    that any request/reply between two processes gets from this machine's scheduler under
    the same load. A lookup cannot be faster than this, and on a busy 2-core VM this is
    what the tail is made of.

    Also the share of the CPUs' time the hypervisor took meanwhile (:func:`steal_seconds`):
    a vCPU taken away for milliseconds leaves whatever was about to run on it waiting
    (seen with ftrace on the CI machine type: a woken thread waited 7 ms behind a kernel
    thread that "ran" for 7 ms while the other CPU was idle)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.stop_path = root / "floor.stop"
        self.out_path = root / "floor.json"
        self.samples: list[tuple[float, float]] = []
        self.steal_share: float | None = None

    def __enter__(self) -> Floor:
        self._started = (time.monotonic(), steal_seconds())
        endpoint = f"ipc://{self.root / 'floor.sock'}"
        me = [sys.executable, __file__]
        self.echo = subprocess.Popen([*me, "--echo", endpoint])
        self.pinger = subprocess.Popen(
            [*me, "--pinger", endpoint, "0.005", str(self.stop_path), str(self.out_path)]
        )
        return self

    def __exit__(self, *exc: object) -> None:
        t0, stolen0 = self._started
        stolen1 = steal_seconds()
        if stolen0 is not None and stolen1 is not None:
            cpus = os.cpu_count() or 1
            self.steal_share = (stolen1 - stolen0) / (cpus * (time.monotonic() - t0))
        self.stop_path.touch()
        for proc in (self.pinger, self.echo):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                stop_process(proc)
        if self.out_path.exists():
            self.samples = json.loads(self.out_path.read_text())


# -- (a) 8 engines at once -------------------------------------------------------------------
def engine_main(
    endpoint: str, idx: int, prompts: int, per_request: int, gate: Any, out: Any
) -> None:
    """One engine process, per prompt: store it request by request and look it up (while the
    other engines store theirs), then, once every engine has stored, retrieve it (while the
    others retrieve theirs). Reports each phase's start and end (monotonic clock, shared by
    the processes) so that the parent computes aggregate rates over the phases' union."""
    client = Client(endpoint, timeout=120.0, populate=True, copy_threads=1)
    client.register("load-model", SHAPE, "float32", token_axis=1, name=f"engine-{idx}")
    freeze_startup()
    src = np.random.default_rng(idx).random(SHAPE, dtype=np.float32)  # every chunk's bytes
    dst = np.empty(SHAPE, np.float32)
    n_chunks = PROMPT_TOKENS // CHUNK_TOKENS
    stores: list[tuple[float, float, int]] = []
    retrieves: list[tuple[float, float, int]] = []
    lookups: list[float] = []
    for p in range(prompts):
        tokens = prompt(idx * 1000 + p)
        gate.wait()
        t0 = time.monotonic()
        stored = 0
        for first in range(0, n_chunks, per_request):
            end = (first + per_request) * CHUNK_TOKENS
            res = client.store(tokens[:end], [src] * per_request, first_chunk=first)
            stored += len(res.stored)
            # A new request reaches the engine's scheduler meanwhile: a miss.
            fresh = prompt(1_000_000 + idx * 1000 + p * 100 + first)
            t1 = time.monotonic()
            client.lookup(fresh)
            lookups.append(time.monotonic() - t1)
        stores.append((t0, time.monotonic(), stored))
        rid = f"e{idx}-p{p}"
        t0 = time.monotonic()
        found = client.lookup(tokens, request_id=rid)
        lookups.append(time.monotonic() - t0)
        gate.wait()
        t0 = time.monotonic()
        got = client.retrieve(request_id=rid, out=[dst] * n_chunks)
        retrieves.append((t0, time.monotonic(), len(got.retrieved)))
        if found.hits != len(got.retrieved):
            raise RuntimeError(f"engine {idx}: {found.hits} hits, {len(got.retrieved)} read")
    client.close()
    out.put({"stores": stores, "retrieves": retrieves, "lookups": lookups})


def phase_gbps(per_engine: list[list[tuple[float, float, int]]]) -> tuple[float, int]:
    """Aggregate GB/s of one kind of phase: every round's chunks over that round's span
    (first engine's start to last engine's end), summed over rounds; and the chunks."""
    chunks = 0
    seconds = 0.0
    for phase in zip(*per_engine, strict=True):
        seconds += max(end for _, end, _ in phase) - min(start for start, _, _ in phase)
        chunks += sum(n for _, _, n in phase)
    return chunks * CHUNK_BYTES / seconds / 1e9, chunks


class Memcpy:
    """The bound: ``threads`` copiers at once, each copying ``chunks_each`` 8 MiB chunks into
    a buffer of its own (touched), as 8 engines copy into the pool. Buffers made once."""

    def __init__(self, threads: int, chunks_each: int) -> None:
        self.threads, self.chunks_each = threads, chunks_each
        rngs = [np.random.default_rng(t) for t in range(threads)]
        self.srcs = [rng.random(SHAPE, dtype=np.float32) for rng in rngs]
        self.dsts = [np.ones((chunks_each, *SHAPE), np.float32) for _ in range(threads)]

    def gbps(self, copy: Callable[[Any, Any], None] = np.copyto) -> float:
        """Best of three. ``copy``: numpy's (glibc's memcpy: the bound) or the engines' own
        streaming copy (printed beside)."""

        def copy_share(t: int) -> None:
            for i in range(self.chunks_each):
                copy(self.dsts[t][i], self.srcs[t])

        best = float("inf")
        with ThreadPoolExecutor(self.threads) as pool:
            for _ in range(3):
                t0 = time.perf_counter()
                list(pool.map(copy_share, range(self.threads)))
                best = min(best, time.perf_counter() - t0)
        return self.threads * self.chunks_each * CHUNK_BYTES / best / 1e9


class Gate:
    """Where every engine waits before each phase, and the parent with them: once all have
    finished the previous phase the parent measures the bound (:class:`Memcpy`) on the idle
    machine, then lets the phase start. This VM's memory bandwidth drifts by a tenth or more
    within seconds; a bound measured right before each phase follows it."""

    def __init__(self, ctx: Any, engines: int) -> None:
        self._done = ctx.Barrier(engines + 1)
        self._go = ctx.Barrier(engines + 1)

    def wait(self) -> None:  # an engine
        self._done.wait()
        self._go.wait()

    def measure_and_open(self, memcpy: Memcpy, timeout: float = 600.0) -> float:  # the parent
        self._done.wait(timeout)
        try:
            return memcpy.gbps()
        finally:
            self._go.wait(timeout)


def engines8(root: Path, engines: int, prompts: int, per_request: int) -> dict[str, Any]:
    root.mkdir(parents=True)
    # Every engine's prompt stays in the pool until it has read it back: room for all of
    # them below the low watermark (older prompts are evicted as new ones come).
    # Stores never wait for eviction (a reservation that does not fit is refused), so the
    # headroom above the high watermark holds a whole wave of requests (8 x 16 x 8 MiB).
    prompt_bytes = PROMPT_TOKENS // CHUNK_TOKENS * CHUNK_BYTES
    pool = int(engines * prompt_bytes / 0.85) + 1536 * MIB
    srv = start_server(root, pool, True, ("--high-watermark", "0.9", "--low-watermark", "0.85"))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    gate = Gate(ctx, engines)
    memcpy = Memcpy(engines, 8)
    store_bounds: list[float] = []
    retrieve_bounds: list[float] = []
    try:
        procs = [
            ctx.Process(target=engine_main, args=(srv.endpoint, i, prompts, per_request, gate, out))
            for i in range(engines)
        ]
        t0 = time.perf_counter()
        with Floor(root) as floor:
            for proc in procs:
                proc.start()
            for _ in range(prompts):
                store_bounds.append(gate.measure_and_open(memcpy))
                retrieve_bounds.append(gate.measure_and_open(memcpy))
            results = [out.get(timeout=600) for _ in procs]
        wall = time.perf_counter() - t0
        for proc in procs:
            proc.join(60)
            if proc.exitcode != 0:
                raise RuntimeError(f"an engine failed (exit {proc.exitcode})")
    finally:
        stop_process(srv.proc)
    store_gbps, stored = phase_gbps([r["stores"] for r in results])
    retrieve_gbps, retrieved = phase_gbps([r["retrieves"] for r in results])
    lookups = [x for r in results for x in r["lookups"]]
    phases = [ph for r in results for ph in r["stores"] + r["retrieves"]]
    floor_rtt = within(floor.samples, [(min(p[0] for p in phases), max(p[1] for p in phases))])
    after = memcpy.gbps()  # once more after the run (the bound before each phase decides)
    streaming = memcpy.gbps(copy_array)
    # Equal phases, each against its own bound: the harmonic mean of the bounds is the rate
    # of a memcpy of every phase's bytes at that phase's rate, over the total time.
    store_bound = statistics.harmonic_mean(store_bounds)
    retrieve_bound = statistics.harmonic_mean(retrieve_bounds)
    expected = engines * prompts * (PROMPT_TOKENS // CHUNK_TOKENS)
    print(
        f"(a) {engines} engines x {prompts} prompts of {PROMPT_TOKENS} tokens "
        f"({PROMPT_TOKENS // CHUNK_TOKENS} x 8 MiB, {per_request} per store request), "
        f"{wall:.1f} s: stored {stored}/{expected}, retrieved {retrieved}"
    )
    spread = " / ".join(f"{b:.1f}" for b in store_bounds + retrieve_bounds)
    print(
        f"    store {store_gbps:.2f} GB/s against a memcpy by {engines} threads of "
        f"{store_bound:.2f} GB/s measured right before each store phase; retrieve "
        f"{retrieve_gbps:.2f} GB/s against {retrieve_bound:.2f} before each retrieve phase "
        f"(each phase's bound, stores then retrieves: {spread}; once more after the run: "
        f"{after:.2f}, against which store {store_gbps / after:.2f}, retrieve "
        f"{retrieve_gbps / after:.2f}; the engines' own streaming copy ({arraycopy.STORES}) "
        f"by {engines} threads after the run: {streaming:.2f}, against which store "
        f"{store_gbps / streaming:.2f}, retrieve {retrieve_gbps / streaming:.2f})"
    )
    print(
        f"    lookup (32k tokens) p50 {statistics.median(lookups) * 1e3:.2f} ms "
        f"p99 {pct(lookups, 0.99) * 1e3:.2f} ms"
    )
    print(f"    floor: {describe_rtt(floor_rtt)}")
    return {
        "floor_p99_ms": pct(floor_rtt, 0.99) * 1e3,
        "steal": floor.steal_share,
        "store": store_gbps / store_bound,
        "retrieve": retrieve_gbps / retrieve_bound,
        "lookup_p99_ms": pct(lookups, 0.99) * 1e3,
    }


# -- (b) lookups while the server moves data ---------------------------------------------------
def looker_main(endpoint: str, seconds: float, period: float, out_path: str) -> None:
    """Look up a fresh 32k-token prompt every ``period`` s (with a request id, as a
    scheduler does, then end the session); write (start time, latency) pairs."""
    client = Client(endpoint, timeout=30.0, auth_token=TOKEN)
    client.register("lookup-model", SMALL, "float32", token_axis=1)
    freeze_startup()  # as vLLM's engine does once started: its own collections stay short
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


def under_transfer(root: Path, rounds: int, slow_tier: str) -> dict[str, Any]:
    """(b); ``slow_tier``: the tier spec of B's local tier ("disk" or a Redis URL)."""
    root.mkdir(parents=True)
    peer_chunks, disk_chunks = 32, 16
    pa, pb = free_port_pair(), free_port_pair()
    tier = (
        f"disk:path={root / 'disk'},capacity=2GiB"
        if slow_tier == "disk"
        else f"redis:url={slow_tier}"
    )
    a = Server(str(root), "a", pa, pa, 512 * MIB)
    b = Server(str(root), "b", pb, pa, 768 * MIB, ("--tier", tier))
    try:
        wait_for(lambda: members(a.addr) == members(b.addr) == {a.addr, b.addr})
        src = np.random.default_rng(1).random(SHAPE, dtype=np.float32)
        disk_tokens = prompt(2, disk_chunks * CHUNK_TOKENS)
        with b.client() as engine:
            engine.register("load-model", SHAPE, "float32", token_axis=1)
            if len(engine.store(disk_tokens, [src] * disk_chunks).stored) != disk_chunks:
                raise RuntimeError("B did not store the disk working set")
            wait_for(lambda: engine.stats().tiers[0].objects >= disk_chunks)
        samples_path = root / "lookups.json"
        seconds = 3.0 + rounds * 2.5
        looker = subprocess.Popen(
            [sys.executable, __file__, "--looker", b.endpoint, str(seconds), "0.01",
             str(samples_path)],
        )  # fmt: skip
        windows: list[tuple[float, float]] = []  # the transfers
        busy_spans: list[tuple[float, float]] = []  # A's store before each, and the transfer
        dst = np.empty(SHAPE, np.float32)
        time.sleep(1.5)  # the looker's idle baseline first

        def fetch(engine: Client, tokens: np.ndarray[Any, Any], n: int, rid: str) -> None:
            # The engine's copies run on its client's copy threads, as a vLLM worker's do.
            found = engine.lookup(tokens, request_id=rid, wait=True)
            got = engine.retrieve(request_id=rid, out=[dst] * n)
            if found.hits != n or len(got.retrieved) != n:
                raise RuntimeError(f"{rid}: {found.hits} hits of {n}")

        with (
            Floor(root) as floor,
            a.client() as producer,
            b.client() as peer_engine,
            b.client() as disk_engine,
        ):
            for engine in (producer, peer_engine, disk_engine):
                engine.register("load-model", SHAPE, "float32", token_axis=1)
            for r in range(rounds):
                # A fresh working set on A (the last one leaves A's pool first), outside the
                # window; B's pool forgets both working sets (its disk keeps what it had).
                setup = time.monotonic()
                producer.clear()
                peer_tokens = prompt(100 + r, peer_chunks * CHUNK_TOKENS)
                if len(producer.store(peer_tokens, [src] * peer_chunks).stored) != peer_chunks:
                    raise RuntimeError("A did not store the peer working set")
                peer_engine.clear()
                time.sleep(0.2)  # A's publication reaches the directory (about 1 ms)
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
                busy_spans.append((setup, time.monotonic()))
                time.sleep(0.5)
            tiers = {t.name: t.loaded_chunks for t in peer_engine.stats().tiers}
        if tiers.get("peer", 0) != rounds * peer_chunks:
            raise RuntimeError(f"B loaded {tiers} chunks, not {rounds * peer_chunks} from A")
        looker.wait(seconds + 60)
        samples = json.loads(samples_path.read_text())
    finally:
        a.stop()
        b.stop()
    busy = within(samples, windows)
    idle = [lat for start, lat in samples if not any(lo - 0.2 <= start <= hi + 0.2
                                                     for lo, hi in busy_spans)]  # fmt: skip
    span = statistics.median(hi - lo for lo, hi in windows)
    print(
        f"(b) {rounds} rounds of 256 MiB from peer A + 128 MiB from B's "
        f"{'disk' if slow_tier == 'disk' else 'Redis'} tier "
        f"(median {span * 1e3:.0f} ms each), a 32k-token lookup every 10 ms on B"
    )
    print(
        f"    lookups during transfers: n={len(busy)} p50 {statistics.median(busy) * 1e3:.2f} "
        f"ms p99 {pct(busy, 0.99) * 1e3:.2f} ms max {max(busy) * 1e3:.2f} ms; "
        f"idle: n={len(idle)} p50 {statistics.median(idle) * 1e3:.2f} ms "
        f"p99 {pct(idle, 0.99) * 1e3:.2f} ms"
    )
    floor_rtt = within(floor.samples, windows)
    print(f"    floor: {describe_rtt(floor_rtt)}")
    return {
        "p99_ms": pct(busy, 0.99) * 1e3,
        "floor_p99_ms": pct(floor_rtt, 0.99) * 1e3,
        "steal": floor.steal_share,
    }


def main() -> None:
    exit_on_stop_signals()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=5, help="prompts per engine")
    ap.add_argument("--per-request", type=int, default=16, help="chunks per store request")
    ap.add_argument("--rounds", type=int, default=12, help="transfer rounds in (b)")
    ap.add_argument("--only", choices=("a", "b"), help="run one experiment")
    ap.add_argument(
        "--slow-tier",
        choices=("disk", "redis"),
        default="disk",
        help="B's local tier in (b): its disk tier, or a Redis tier on a redis-server "
        "this script starts",
    )
    ap.add_argument("--looker", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--echo", help=argparse.SUPPRESS)
    ap.add_argument("--pinger", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.echo:
        echo_main(args.echo)
        return
    if args.pinger:
        endpoint, period, stop_path, out_path = args.pinger
        pinger_main(endpoint, float(period), stop_path, out_path)
        return
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
        if args.only != "a" and args.slow_tier == "redis":
            with redis_server(str(root)) as url:
                if url is None:
                    raise SystemExit("--slow-tier redis: redis-server is not installed")
                b = under_transfer(root / "b", args.rounds, url)
        elif args.only != "a":
            b = under_transfer(root / "b", args.rounds, "disk")
        else:
            b = None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    floors = []
    if a:
        floors.append(f"engines8_roundtrip_p99_ms={a['floor_p99_ms']:.2f}")
        if a["steal"] is not None:
            floors.append(f"engines8_steal={a['steal']:.3f}")
    if b:
        floors.append(f"under_transfer_roundtrip_p99_ms={b['floor_p99_ms']:.2f}")
        if b["steal"] is not None:
            floors.append(f"under_transfer_steal={b['steal']:.3f}")
    print("floor " + " ".join(floors))
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
