"""The shared-memory store/retrieve path against its bounds, and LOOKUP latency, end to end.

Starts a real ``tierkv server`` process (its own instance, runtime dir and pool) and, in the
same run, measures:

- store: ``client.store`` of R requests of N chunks of S MiB each (PREPARE_STORE -> one
  copy per chunk into its slot view -> COMMIT_STORE), in GB/s (1e9 bytes/s);
- retrieve: the same chunks through ``client.retrieve`` into preallocated numpy arrays
  (PREPARE_RETRIEVE -> one copy per chunk out of its slot view -> FINISH_RETRIEVE);
- memcpy, the bound: ``np.copyto`` of the same bytes, chunk by chunk, with the client's copy
  threads (``--copy-threads``, the same batching as the client), between preallocated,
  already-touched private buffers, in the direction of each path (store-shaped: the same
  source chunks into a buffer as large as the bytes moved; retrieve-shaped: back out of it
  into the same destination arrays). Store is compared with the first, retrieve with the
  second. The client copies with non-temporal stores (:mod:`tierkv.arraycopy`), which
  neither read the destination's cache lines first nor keep them, so it can beat this bound;
  the same copies by ``copy_array`` instead of ``np.copyto`` (streaming copy) are printed
  beside, and the client's figures against them: what the protocol costs on top of its copy;
- pickle over ZMQ, the path tierkv replaces: each request's chunk arrays ``pickle.dumps``-ed
  (highest protocol) and sent, one message per request, over a ZMQ DEALER to a ROUTER in a
  second process, which ``pickle.loads`` them into memory (kept until the round's clear) and
  acknowledges the request. ZMQ frames are zero-copy on both ends, so the baseline pays only
  pickling, the socket transfer and unpickling;
- LOOKUP latency (no locks taken) of 1 and of 512 chunks given as token ids, hashed by the
  server, p50 and p99 over many repetitions, with every chunk present (a second client
  with a small layout stored them, so the pool size does not limit the chunk count). The
  lookups go round more prompts than the server remembers key chains per client, so each
  one is hashed; the same prompt looked up again and again (its chain reused, nothing
  hashed) is printed beside them.

Steady state: the server runs with ``--prefault`` (every pool page allocated and mapped
up front) and the client attaches with ``populate=True`` (MAP_POPULATE), so no page fault
of the pool is paid in a timed copy; the cache is cleared between rounds so every store
really copies; all source and destination buffers are touched before timing. The first
round is still reported separately, the medians are over the rounds after it. Measurements
are interleaved (memcpy, store, memcpy, retrieve, pickle) within each round so drift hits
all of them alike; the pickle baseline, ~20x slower, runs in fewer rounds (--pickle-rounds).

    .venv/bin/python benchmarks/shm_path.py [--chunk-mib 8] [--chunks-per-request 16]
        [--total-gib 2] [--rounds 4] [--pickle-rounds 2] [--pool-gib 4] [--no-prefault]

KV events (an engine that relays the pool's chunk feed to routers, issue 35): the same
stores with events on, i.e. a note per chunk the size of the vLLM connector's (``BlockStored``
of 16 blocks of 16 tokens: 16 hashes, 256 token ids, about 1.2 KB) and, in a second process,
an engine's reader of the chunk feed (:class:`~tierkv.chunk_follower.ChunkFollower`, every
0.1 s as the connector's poller, its changes taken at once); it is stopped (SIGSTOP) while
the other paths run. The LOOKUP of one chunk is measured again with the reader running. The
reader must see every chunk stored with a note (waited for after each timed store).

The last line is machine-readable:
``shm_path store_vs_memcpy=A retrieve_vs_memcpy=B store_vs_pickle=C lookup1_p50_us=D
lookup512_p50_us=E events_store_overhead=F`` (A = store / memcpy, B = retrieve / memcpy,
C = store / pickle, F = 1 - store with events / store without, medians of the rounds:
negative when the stores with events ran faster).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import pickle
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq

from stop_signals import exit_on_stop_signals
from tierkv import arraycopy
from tierkv.arraycopy import copy_array
from tierkv.chunk_follower import ChunkFollower
from tierkv.client import Client, ServerUnavailableError, wait_for_server
from tierkv.copier import Copier, default_threads
from tierkv.demo.local_process import stop_process
from tierkv.pool import segment_exists
from tierkv.server.chunk_keys import CHAINS

MIB = 1 << 20
CHUNK_TOKENS = 256
LAYERS = 32
Array = np.ndarray[Any, Any]

# Goals for this benchmark (2-core machine, 8 MiB chunks, 16 per request).
GOAL_STORE_VS_MEMCPY = 0.8
GOAL_RETRIEVE_VS_MEMCPY = 0.8
GOAL_STORE_VS_PICKLE = 10.0
GOAL_LOOKUP1_P50_US = 150.0
GOAL_LOOKUP512_P50_US = 2000.0
NEXT_GOAL_LOOKUP512_P50_US = 1000.0  # issue #16's next step, once the first goals hold


# -- processes -----------------------------------------------------------------------------


@dataclass
class ServerProc:
    proc: subprocess.Popen[bytes]
    endpoint: str
    pool_name: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_server(
    run_dir: Path, pool_bytes: int, prefault: bool, extra: Sequence[str] = ()
) -> ServerProc:
    instance = f"bench-{os.getpid()}"
    runtime_dir = run_dir / "rt"
    pool_name = f"tierkv-bench-{os.getpid()}"
    log_path = run_dir / "server.log"
    cmd = [
        sys.executable, "-m", "tierkv.cli", "server",
        "--instance", instance,
        "--runtime-dir", str(runtime_dir),
        "--pool-name", pool_name,
        "--pool-size", str(pool_bytes),
        "--log-level", "warning",
        "--http-port", "0",
        "--prefault" if prefault else "--no-prefault",
        *extra,
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    srv = ServerProc(proc, f"ipc://{runtime_dir / 'rpc.sock'}", pool_name, log_path)
    try:
        if not wait_for_server(srv.endpoint, 60.0, lambda: proc.poll() is not None):
            raise RuntimeError(f"server exited at start-up:\n{srv.log()}")
    except ServerUnavailableError:
        stop_process(proc)
        raise RuntimeError(f"server did not answer:\n{srv.log()}") from None
    return srv


def pickle_server_main(endpoint: str) -> None:
    """The baseline's receiving side: unpickle every request into memory, acknowledge it."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    store: dict[bytes, Any] = {}
    while True:
        ident, payload = sock.recv_multipart(copy=False)
        op, names, arrays = pickle.loads(payload.buffer)  # copies the arrays out of the frame
        if op == "store":
            for name, arr in zip(names, arrays, strict=True):
                store[name] = arr
            reply: Any = len(names)
        elif op == "clear":
            reply = len(store)
            store.clear()
        else:  # "stop"
            sock.send_multipart([ident, pickle.dumps(0)])
            break
        sock.send_multipart([ident, pickle.dumps(reply)])
    sock.close(linger=1000)
    ctx.term()


class PickleClient:
    """The baseline's engine side: one DEALER, one pickled message per request."""

    def __init__(self, run_dir: Path) -> None:
        self.endpoint = f"ipc://{run_dir / 'pickle.sock'}"
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--pickle-server", self.endpoint]
        )
        self.ctx: zmq.Context[Any] = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.endpoint)
        self.call("clear", [], [], timeout=30.0)  # waits until the server process is up

    def call(self, op: str, names: list[bytes], arrays: list[Array], timeout: float = 60.0) -> Any:
        payload = pickle.dumps((op, names, arrays), protocol=pickle.HIGHEST_PROTOCOL)
        self.sock.send(payload, copy=False)
        if not self.sock.poll(int(timeout * 1000)):
            raise RuntimeError(f"pickle server did not answer {op!r} within {timeout} s")
        return pickle.loads(self.sock.recv())

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.proc.poll() is None:
                self.call("stop", [], [], timeout=10.0)
        self.sock.close(linger=0)
        stop_process(self.proc)


LOOKUP1_EVENTS = "lookup 1 chunk, feed reader running"
READER_INTERVAL = 0.1  # seconds between reads of the chunk feed (the vLLM connector's poller)
NOTE_BLOCKS, NOTE_BLOCK_TOKENS = 16, 16  # a chunk of 256 tokens in vLLM blocks of 16


def feed_reader_main(endpoint: str, shape: str, report: str) -> None:
    """An engine's reader of the chunk feed: a client of the store's namespace (the same
    layout) that reads the feed every READER_INTERVAL and takes the changes, writing how many
    stored chunks it has seen to ``report`` after every read that saw some."""
    dims = tuple(int(d) for d in shape.split(","))
    seen = 0
    with Client(endpoint, timeout=60.0) as client:
        client.register("bench-shm-path", dims, "float16", token_axis=2)
        follower = ChunkFollower(client.read_chunk_events, client.read_chunk_snapshot)
        while True:
            follower.poll()
            stored = sum(1 for change in follower.take() if change.held)
            if stored:
                seen += stored
                Path(report).write_text(str(seen))
            time.sleep(READER_INTERVAL)


class FeedReader:
    """The feed reader process, running only while the events are measured (SIGSTOP else)."""

    def __init__(self, endpoint: str, shape: tuple[int, ...], run_dir: Path) -> None:
        self.report = run_dir / "feed-reader.count"
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--feed-reader", endpoint,
             ",".join(map(str, shape)), str(self.report)]
        )  # fmt: skip
        self.running = True
        self.expected = 0  # stored chunks it must have seen

    def resume(self) -> None:
        if not self.running:
            self.proc.send_signal(signal.SIGCONT)
            self.running = True

    def pause(self) -> None:
        if self.running:
            self.proc.send_signal(signal.SIGSTOP)
            self.running = False

    def seen_all(self, stored: int) -> None:
        """Wait until the reader has seen ``stored`` more stored chunks; RuntimeError if it
        does not within 10 s."""
        self.expected += stored
        seen = self.seen(at_least=self.expected)
        if seen < self.expected:
            raise RuntimeError(f"the feed reader saw {seen} of {self.expected} stored chunks")

    def seen(self, at_least: int, timeout: float = 10.0) -> int:
        """Stored chunks seen so far, once at least ``at_least`` (or the timeout)."""
        self.resume()
        deadline = time.monotonic() + timeout
        count = 0
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                count = int(self.report.read_text())
            if count >= at_least or self.proc.poll() is not None:
                break
            time.sleep(READER_INTERVAL)
        return count

    def close(self) -> None:
        self.resume()
        stop_process(self.proc)


def vllm_sized_note(chunk: int) -> bytes:
    """A note the size of the vLLM connector's for one chunk (its content is opaque to the
    server): 16 block hashes (64-bit), the parent's, 256 token ids, the block size."""
    first = chunk * NOTE_BLOCKS
    hashes = [(0x9E3779B97F4A7C15 * (first + i)) % (1 << 63) for i in range(NOTE_BLOCKS)]
    tokens = list(range(1000 + first, 1000 + first + NOTE_BLOCKS * NOTE_BLOCK_TOKENS))
    return msgspec.msgpack.encode(
        [["BlockStored", hashes, hashes[0] - 1, tokens, NOTE_BLOCK_TOKENS, None, None, None]]
    )


# -- workload ------------------------------------------------------------------------------


@dataclass
class Workload:
    chunk_bytes: int
    per_request: int
    requests: int
    shape: tuple[int, ...]
    sources: list[Array]  # one request's chunks (every request stores the same bytes)
    outs: list[Array]  # preallocated retrieve destinations for one request
    tokens: list[Array]  # uint32 token ids per request (distinct keys per request)
    bound_buf: Array  # private, touched buffer as large as the bytes moved per round

    @property
    def total_bytes(self) -> int:
        return self.chunk_bytes * self.per_request * self.requests


def touched(shape: tuple[int, ...], seed: int) -> Array:
    """A float16 array with every page written (varied bytes, not zeros)."""
    arr = np.empty(shape, dtype=np.float16)
    flat = arr.reshape(-1).view(np.uint16)
    flat[:] = np.random.default_rng(seed).integers(0, 1 << 14, size=flat.size, dtype=np.uint16)
    return arr


def make_workload(chunk_mib: int, per_request: int, total_gib: float) -> Workload:
    # KV_2LTD-like chunk: (K/V, layers, tokens, hidden) in float16.
    hidden = chunk_mib * MIB // (2 * LAYERS * CHUNK_TOKENS * 2)
    shape = (2, LAYERS, CHUNK_TOKENS, hidden)
    chunk_bytes = math.prod(shape) * 2
    if chunk_bytes != chunk_mib * MIB:
        raise SystemExit(f"--chunk-mib {chunk_mib} does not give a whole layout")
    requests = max(1, round(total_gib * (1 << 30) / (chunk_bytes * per_request)))
    sources = [touched(shape, seed=i) for i in range(per_request)]
    outs = [touched(shape, seed=1000 + i) for i in range(per_request)]
    tokens_per_request = per_request * CHUNK_TOKENS
    tokens = [
        np.arange(r * tokens_per_request, (r + 1) * tokens_per_request, dtype=np.uint32)
        for r in range(requests)
    ]
    bound_buf = np.ones(chunk_bytes * per_request * requests, dtype=np.uint8)
    return Workload(chunk_bytes, per_request, requests, shape, sources, outs, tokens, bound_buf)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- the measured paths --------------------------------------------------------------------


Copy = Callable[[Any, Any], None]


def memcpy_store(w: Workload, copier: Copier, copy: Copy = np.copyto) -> None:
    """Per request, the request's chunks into the next part of a private buffer, with the
    client's copy threads (the same ``Copier`` batching as ``client.store``); ``copy``:
    ``np.copyto`` (glibc's memcpy, the bound) or the client's own streaming copy."""
    size = w.chunk_bytes
    srcs = [s.reshape(-1).view(np.uint8) for s in w.sources]
    sizes = [size] * len(srcs)
    for r in range(w.requests):
        base = r * len(srcs) * size
        pairs = [(w.bound_buf[base + i * size : base + (i + 1) * size], src)
                 for i, src in enumerate(srcs)]  # fmt: skip
        copier.run(lambda pair: copy(*pair), pairs, sizes)


def memcpy_retrieve(w: Workload, copier: Copier, copy: Copy = np.copyto) -> None:
    size = w.chunk_bytes
    dsts = [d.reshape(-1).view(np.uint8) for d in w.outs]
    sizes = [size] * len(dsts)
    for r in range(w.requests):
        base = r * len(dsts) * size
        pairs = [(dst, w.bound_buf[base + i * size : base + (i + 1) * size])
                 for i, dst in enumerate(dsts)]  # fmt: skip
        copier.run(lambda pair: copy(*pair), pairs, sizes)


def tierkv_store(client: Client, w: Workload, notes: list[list[bytes]] | None = None) -> None:
    for r, toks in enumerate(w.tokens):
        res = client.store(toks, w.sources, notes=None if notes is None else notes[r])
        if len(res.stored) != w.per_request:
            raise RuntimeError(f"store did not store every chunk: {res}")


def tierkv_retrieve(client: Client, w: Workload) -> None:
    for toks in w.tokens:
        res = client.retrieve(toks, w.outs)
        if not res.complete:
            raise RuntimeError(f"retrieve missed chunks: {res.missing}")


def pickle_store(pc: PickleClient, w: Workload) -> None:
    for r in range(w.requests):
        names = [f"{r}:{i}".encode() for i in range(w.per_request)]
        if pc.call("store", names, w.sources) != w.per_request:
            raise RuntimeError("pickle server did not store every chunk")


@dataclass
class Series:
    first: float = 0.0
    rest: list[float] = field(default_factory=list)

    def add(self, value: float, first: bool) -> None:
        if first:
            self.first = value
        else:
            self.rest.append(value)

    @property
    def median(self) -> float:
        return statistics.median(self.rest)

    @property
    def best(self) -> float:
        return max(self.rest)


def run_throughput(
    client: Client,
    pc: PickleClient,
    reader: FeedReader,
    w: Workload,
    rounds: int,
    pickle_rounds: int,
    copy_threads: int,
) -> dict[str, Series]:
    copier = Copier(copy_threads)
    keys = ("memcpy_store", "stream_store", "store", "memcpy_retrieve", "stream_retrieve")
    results = {k: Series() for k in (*keys, "retrieve", "store_events")}
    results["pickle"] = Series()
    notes = [
        [vllm_sized_note(r * w.per_request + c) for c in range(w.per_request)]
        for r in range(w.requests)
    ]
    noted = w.requests * w.per_request  # chunks stored with a note in each round
    total = w.total_bytes

    def store_plain(first: bool) -> None:
        results["store"].add(gbps(total, timed(lambda: tierkv_store(client, w))), first)

    def store_with_events(first: bool) -> None:
        reader.resume()
        results["store_events"].add(
            gbps(total, timed(lambda: tierkv_store(client, w, notes))), first
        )
        reader.seen_all(noted)  # every chunk announced to the reader (untimed)
        reader.pause()

    for rnd in range(rounds + 1):
        first = rnd == 0
        results["memcpy_store"].add(gbps(total, timed(lambda: memcpy_store(w, copier))), first)
        stream = timed(lambda: memcpy_store(w, copier, copy_array))
        results["stream_store"].add(gbps(total, stream), first)
        pair = (store_plain, store_with_events) if rnd % 2 else (store_with_events, store_plain)
        pair[0](first)
        client.clear()
        pair[1](first)  # both into an empty pool, in turns first; the second's are retrieved
        bound = timed(lambda: memcpy_retrieve(w, copier))
        results["memcpy_retrieve"].add(gbps(total, bound), first)
        stream = timed(lambda: memcpy_retrieve(w, copier, copy_array))
        results["stream_retrieve"].add(gbps(total, stream), first)
        for out in w.outs:
            out.fill(0)
        results["retrieve"].add(gbps(total, timed(lambda: tierkv_retrieve(client, w))), first)
        if first:  # byte-exact check of the last request, outside the timings
            for src, out in zip(w.sources, w.outs, strict=True):
                if not np.array_equal(src.view(np.uint16), out.view(np.uint16)):
                    raise RuntimeError("retrieved bytes differ from the stored ones")
        client.clear()
        if rnd <= pickle_rounds:  # the slow baseline gets fewer rounds, to bound the run time
            results["pickle"].add(gbps(total, timed(lambda: pickle_store(pc, w))), first)
            pc.call("clear", [], [])
    copier.close()
    return results


# -- lookup latency ------------------------------------------------------------------------


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def lookup_latencies(client: Client, prompts: list[Any], chunks: int, reps: int) -> list[float]:
    """Lookups of ``prompts`` in turn (each a hit of ``chunks`` chunks). There are more of
    them than the server remembers key chains per client (``CHAINS``), so every lookup hashes
    its tokens: the figure includes hashing."""
    for i in range(max(20, reps // 20)):  # warm-up
        client.lookup(prompts[i % len(prompts)])
    lookup = client.lookup
    perf = time.perf_counter
    samples = []
    for i in range(reps):
        tokens = prompts[i % len(prompts)]
        t0 = perf()
        res = lookup(tokens)
        samples.append((perf() - t0) * 1e6)
        if res.hits != chunks:
            raise RuntimeError(f"lookup found {res.hits} of {chunks} chunks")
    return samples


def run_lookups(endpoint: str, reps: int, reader: FeedReader) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    with Client(endpoint) as small:
        # A small layout (8 KiB chunks) in its own namespace: the stored chunks fit anywhere.
        small.register("bench-lookup", (2, CHUNK_TOKENS, 8), "float16", token_axis=1)
        zero = np.zeros((2, CHUNK_TOKENS, 8), np.float16)
        prompts = []
        for p in range(CHAINS + 1):
            first = 7 + p * 1_000_000
            tokens = np.arange(first, first + 512 * CHUNK_TOKENS, dtype=np.uint32)
            stored = small.store(tokens, [zero] * 512)
            if len(stored.stored) != 512:
                raise RuntimeError(f"could not store the lookup chunks: {stored}")
            prompts.append(tokens)
        ones = [t[:CHUNK_TOKENS] for t in prompts]
        out["lookup 1 chunk (uint32 array)"] = lookup_latencies(small, ones, 1, reps)
        reader.resume()
        out[LOOKUP1_EVENTS] = lookup_latencies(small, ones, 1, reps)
        reader.pause()
        out["lookup 512 chunks (uint32 array)"] = lookup_latencies(small, prompts, 512, reps // 4)
        out["lookup 512 chunks (list of int)"] = lookup_latencies(
            small, [t.tolist() for t in prompts], 512, reps // 8
        )
        # The same prompt again and again: its key chain is reused, nothing is hashed.
        out["lookup 512, repeated (chain reused)"] = lookup_latencies(
            small, prompts[:1], 512, reps // 4
        )
        small.clear()
    return out


# -- report --------------------------------------------------------------------------------


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT MET"


def report(
    args: argparse.Namespace,
    w: Workload,
    res: dict[str, Series],
    lat: dict[str, list[float]],
    wall: float,
    seen: int,
) -> None:
    store = res["store"].median
    f = 1 - res["store_events"].median / store
    retrieve = res["retrieve"].median
    a = store / res["memcpy_store"].median
    b = retrieve / res["memcpy_retrieve"].median
    c = store / res["pickle"].median
    a_stream = store / res["stream_store"].median
    b_stream = retrieve / res["stream_retrieve"].median
    stored_stream = f"the client's ({arraycopy.STORES})"
    d = statistics.median(lat["lookup 1 chunk (uint32 array)"])
    e = statistics.median(lat["lookup 512 chunks (uint32 array)"])
    print(
        f"tierkv shm path: {w.requests} requests x {w.per_request} chunks x "
        f"{w.chunk_bytes / MIB:.0f} MiB = {w.total_bytes / (1 << 30):.2f} GiB per round, "
        f"chunk shape {w.shape} float16; {args.rounds} measured rounds after a first one "
        f"({min(args.pickle_rounds, args.rounds)} for the pickle baseline)"
    )
    print(
        f"pool {args.pool_gib} GiB, server {'--prefault' if args.prefault else '--no-prefault'}, "
        f"client populate={args.prefault}; cache cleared between rounds; {os.cpu_count()} CPUs; "
        f"{args.copy_threads} copy threads (client and memcpy bound alike); GB/s = 1e9 bytes/s"
    )
    print()
    print(f"{'path':<40}{'first':>9}{'median':>9}{'best':>9}  vs bound")
    rows = [
        ("memcpy, store-shaped (bound)", "memcpy_store", ""),
        ("streaming copy, store-shaped", "stream_store", f"{stored_stream} copy"),
        ("store: client.store", "store", f"{a:.2f} x memcpy, {a_stream:.2f} x streaming"),
        ("memcpy, retrieve-shaped (bound)", "memcpy_retrieve", ""),
        ("streaming copy, retrieve-shaped", "stream_retrieve", f"{stored_stream} copy"),
        ("retrieve: client.retrieve", "retrieve", f"{b:.2f} x memcpy, {b_stream:.2f} x streaming"),
        ("pickle over ZMQ store (baseline)", "pickle", f"store is {c:.1f} x this"),
        ("store with KV events (notes, reader)", "store_events", f"{-f:+.1%} vs store"),
    ]
    for label, key, note in rows:
        s = res[key]
        print(f"{label:<40}{s.first:>9.2f}{s.median:>9.2f}{s.best:>9.2f}  {note}")
    print()
    print(f"{'LOOKUP latency, all chunks present':<40}{'p50 us':>9}{'p99 us':>9}{'reps':>9}")
    for label, samples in lat.items():
        p50, p99 = statistics.median(samples), percentile(samples, 0.99)
        print(f"{label:<40}{p50:>9.1f}{p99:>9.1f}{len(samples):>9}")
    note_bytes = len(vllm_sized_note(0))
    print(
        f"KV events: a {note_bytes}-byte note per chunk, a feed reader every {READER_INTERVAL} s "
        f"(it saw {seen} stored chunks); events_store_overhead {f:.3f}"
    )
    print()
    goals = [
        (f"store / memcpy >= {GOAL_STORE_VS_MEMCPY}", f"{a:.2f}", a >= GOAL_STORE_VS_MEMCPY),
        (
            f"retrieve / memcpy >= {GOAL_RETRIEVE_VS_MEMCPY}",
            f"{b:.2f}",
            b >= GOAL_RETRIEVE_VS_MEMCPY,
        ),
        (f"store / pickle >= {GOAL_STORE_VS_PICKLE:.0f}", f"{c:.1f}", c >= GOAL_STORE_VS_PICKLE),
        (f"lookup 1 p50 <= {GOAL_LOOKUP1_P50_US:.0f} us", f"{d:.1f}", d <= GOAL_LOOKUP1_P50_US),
        (
            f"lookup 512 p50 <= {GOAL_LOOKUP512_P50_US:.0f} us",
            f"{e:.1f}",
            e <= GOAL_LOOKUP512_P50_US,
        ),
        (
            f"lookup 512 p50 <= {NEXT_GOAL_LOOKUP512_P50_US:.0f} us (next)",
            f"{e:.1f}",
            e <= NEXT_GOAL_LOOKUP512_P50_US,
        ),
    ]
    print("goals:")
    for text, value, ok in goals:
        print(f"  {text:<39}{value:>9}  {verdict(ok)}")
    print(f"(whole run {wall:.1f} s)")
    print(
        f"shm_path store_vs_memcpy={a:.3f} retrieve_vs_memcpy={b:.3f} store_vs_pickle={c:.2f} "
        f"lookup1_p50_us={d:.1f} lookup512_p50_us={e:.1f} events_store_overhead={f:.3f}"
    )


@contextlib.contextmanager
def server_and_clients(
    run_dir: Path, pool_bytes: int, prefault: bool, copy_threads: int
) -> Iterator[tuple[ServerProc, Client, PickleClient]]:
    srv = start_server(run_dir, pool_bytes, prefault)
    client: Client | None = None
    pc: PickleClient | None = None
    try:
        client = Client(srv.endpoint, timeout=60.0, populate=prefault, copy_threads=copy_threads)
        pc = PickleClient(run_dir)
        yield srv, client, pc
    finally:
        if pc is not None:
            pc.close()
        if client is not None:
            client.close()
        stop_process(srv.proc)
        if srv.proc.returncode not in (0, None):
            print(f"server exited with {srv.proc.returncode}:\n{srv.log()}", file=sys.stderr)
        if segment_exists(srv.pool_name):
            from tierkv.pool import _posix_name, _shm_unlink

            _shm_unlink(_posix_name(srv.pool_name))


def main(argv: list[str] | None = None) -> int:
    exit_on_stop_signals()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--chunk-mib", type=int, default=8, help="chunk size S (default 8)")
    parser.add_argument("--chunks-per-request", type=int, default=16, help="N (default 16)")
    parser.add_argument("--total-gib", type=float, default=2.0, help="bytes per round")
    parser.add_argument("--rounds", type=int, default=4, help="measured rounds after the first")
    parser.add_argument("--pool-gib", type=float, default=4.0, help="server pool size")
    parser.add_argument(
        "--pickle-rounds", type=int, default=2, help="baseline rounds (after the first)"
    )
    parser.add_argument("--lookup-reps", type=int, default=4000, help="1-chunk lookups")
    parser.add_argument(
        "--prefault",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="server --prefault and client populate=True (default: on)",
    )
    parser.add_argument(
        "--copy-threads",
        type=int,
        default=default_threads(),
        help="client copy threads, also used by the memcpy bound (default: cores, max 4)",
    )
    parser.add_argument("--pickle-server", metavar="ENDPOINT", help=argparse.SUPPRESS)
    parser.add_argument("--feed-reader", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.pickle_server:
        pickle_server_main(args.pickle_server)
        return 0
    if args.feed_reader:
        feed_reader_main(*args.feed_reader)
        return 0
    if args.rounds < 1 or args.pickle_rounds < 1:
        parser.error("--rounds and --pickle-rounds must be >= 1")

    t_start = time.perf_counter()
    w = make_workload(args.chunk_mib, args.chunks_per_request, args.total_gib)
    pool_bytes = int(args.pool_gib * (1 << 30))
    if pool_bytes < w.total_bytes + 64 * MIB:
        parser.error("--pool-gib must exceed the bytes per round (--total-gib) a little")
    with (
        tempfile.TemporaryDirectory(prefix="tierkv-bench-") as tmp,
        server_and_clients(Path(tmp), pool_bytes, args.prefault, args.copy_threads) as (
            srv,
            client,
            pc,
        ),
    ):
        client.register("bench-shm-path", w.shape, "float16", token_axis=2)
        reader = FeedReader(srv.endpoint, w.shape, Path(tmp))
        try:
            reader.pause()
            lat = run_lookups(srv.endpoint, args.lookup_reps, reader)
            pickle_rounds = min(args.pickle_rounds, args.rounds)
            res = run_throughput(
                client, pc, reader, w, args.rounds, pickle_rounds, args.copy_threads
            )
            seen = reader.seen(at_least=0)
        finally:
            reader.close()
    report(args, w, res, lat, time.perf_counter() - t_start, seen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
