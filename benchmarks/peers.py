"""Cross-node sharing on loopback: a peer fetch through the full engine path, against raw TCP.

Two real servers (A and B) form a cluster on loopback. An engine on A stores ``--chunks``
chunks of ``--chunk-mib`` MiB; an engine on B then runs the whole read path: LOOKUP (B's
pool misses, the prefetch resolves the keys through the directory and fetches the chunks
from A's pool straight into reserved slots of B's pool, verifying checksums), waits for it
(``Client.wait_prefetch``: the server answers the moment it has landed), and retrieves the
chunks into its own (pre-touched) buffers. Between repetitions B's pool is cleared, so every
repetition crosses the network again. The bound, measured in the same run: one raw TCP stream
of the same number of bytes between two processes (``sendall`` from a touched buffer,
``recv_into`` a touched buffer). The fetch and the bounds take turns, a repetition of each in
turn, so that they see the same moments of this VM's drifting bandwidth.

The same fetch over the NIXL data plane, in the same run: a second pair of servers (C and D,
``--peer-transport nixl``, UCX restricted to ``--nixl-ucx-tls``, default ``tcp`` on
loopback: what a path to another node uses where there is no RDMA; UCX's one-host shortcut,
cma, does not exist across nodes) holds the same chunks, an engine on D reads them from C,
its rounds interleaved with the others. ``nixl_ok=1`` when every byte of every NIXL round
arrived byte-exact and over NIXL (D's figures: every chunk read by NIXL, no fallback to TCP),
0 otherwise (or when nixl cannot be imported here); ``nixl_transport``: the UCX transports
the NIXL servers were given (``none`` without NIXL). On a machine without RDMA this measures
correctness and overhead, not RDMA speed.

B's control path while B fetches: the fetch rounds run once more while a prober process (an
engine on B with 16 small chunks of its own) looks them up every 2 ms, then as long without
a fetch; the lookups' p50 and p99 in both (printed, not in the last line).

Directory lookup latency: an outside reader (the benchmark process, not a member, so every
entry is a round trip away, one per owner, all owners in parallel) resolves the keys of a
512-chunk prefix that A published; p50 over ``--lookups`` lookups.

    python benchmarks/peers.py [--chunks 32] [--chunk-mib 8] [--repeat 5] [--lookups 300]
                               [--nixl-ucx-tls tcp] [--no-nixl] [--busy-cores N]

``--busy-cores 1``: the same with a core kept busy by a process spinning at the default
priority (``busy_cores.py``), the noisier machine the goals' margin is for; its last line is
then named ``peers_busy``. Such a run also times raw TCP over as many streams with every
sending and receiving thread at the priority tierkv gives its data threads (a higher nice
value: they leave a busy core to the other process), beside the others: the bound at the
priority the fetch's own threads run at.

Beside raw TCP, every run times the design's own work over the same one stream, printed with
the fetch's speed over its speed: each chunk checksummed as it lands (tierkv's receive loop), then
copied once into an engine's buffers (tierkv's copier). A fetch cannot do less than that;
what it takes beyond it is the servers, the protocol, the pool and the directory.

The last line is machine-readable:
``peers fetch_vs_raw_tcp=A directory_lookup512_p50_us=B ... nixl_ok=C nixl_transport=D``
(A: fetch throughput over raw TCP throughput, best of the repetitions for each; goals
A >= 0.8, B <= 2000, C = 1).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from busy_cores import add_option, kept_busy, line_name
from percentiles import pct
from stop_signals import exit_on_stop_signals
from tierkv import keys as tk
from tierkv.arraycopy import copy_array
from tierkv.client import Client, wait_for_server
from tierkv.cluster import messages as m
from tierkv.cluster.control import ControlClient
from tierkv.cluster.nixl_agent import unavailable
from tierkv.cluster.ring_resolve import DirectoryReader
from tierkv.cluster.transport import DEFAULT_STREAMS_PER_FETCH
from tierkv.copier import Copier
from tierkv.piecewise_io import recv_hashed
from tierkv.priority import DATA_NICE, DATA_SLICE_NS, data_thread

MIB = 1 << 20
TOKEN = "peers-bench"
CHUNK_TOKENS = 256


def free_port_pair() -> int:
    while True:
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return int(port)


class Server:
    def __init__(
        self,
        root: str,
        name: str,
        port: int,
        seed: int,
        pool: int,
        extra: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.port = port
        self.runtime = os.path.join(root, name)
        self.pool_name = f"tierkv-bench-{uuid.uuid4().hex[:8]}"
        cmd = [
            sys.executable, "-m", "tierkv.cli", "server",
            "--instance", f"bench-{name}",
            "--runtime-dir", self.runtime,
            "--pool-name", self.pool_name,
            "--pool-size", str(pool),
            "--prefault",
            "--auth-token", TOKEN,
            "--cluster-seeds", f"127.0.0.1:{seed}",
            "--cluster-port", str(port),
            "--heartbeat-interval", "0.2",
            "--member-ttl", "2",
            "--log-level", "warning",
            # One engine stores the whole working set (over half the pool) in one request.
            "--client-reservation-share", "1",
        ]  # fmt: skip
        cmd += ["--http-port", "0", *extra]
        self.log = open(os.path.join(root, f"{name}.log"), "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        self.endpoint = f"ipc://{self.runtime}/rpc.sock"
        proc = self.proc
        if not wait_for_server(self.endpoint, 60, lambda: proc.poll() is not None):
            raise RuntimeError(f"server {name} exited; see {self.log.name}")
        self.addr = f"127.0.0.1:{port}"

    def client(self) -> Client:
        # populate: map the whole pool up front, as an engine that reads it often would.
        return Client(self.endpoint, timeout=60.0, auth_token=TOKEN, populate=True)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def members(addr: str) -> set[str]:
    client = ControlClient(TOKEN, 1.0)
    try:
        reply = client.call(addr, m.GetMembers(0))
        return {i.node_id for i in reply.members} if isinstance(reply, m.MemberList) else set()
    finally:
        client.close()


def node_status(addr: str) -> dict[str, Any]:
    client = ControlClient(TOKEN, 5.0)
    try:
        reply = client.call(addr, m.GetStatus(0))
        return dict(reply.stats) if isinstance(reply, m.NodeStatus) else {}
    finally:
        client.close()


def nixl_figures(reader: str, holder: str) -> tuple[int, int, int, str]:
    """From the reader node's figures: (chunks read from ``holder`` over NIXL, chunks
    received from it over TCP, fallbacks to TCP, its UCX transports)."""
    transport = node_status(reader).get("transport", {})
    nixl = transport.get("nixl", {})
    over_nixl = nixl.get("received", {}).get(holder, {}).get("chunks", 0)
    over_tcp = transport.get("received", {}).get(holder, {}).get("chunks", 0)
    return int(over_nixl), int(over_tcp), int(nixl.get("fallbacks", -1)), nixl.get("ucx_tls", "")


def wait_for(what: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark setup did not converge")
        time.sleep(0.05)


def chunk_keys(client: Client, tokens: np.ndarray[Any, Any]) -> list[bytes]:
    assert client.registration is not None
    return tk.chunk_keys(client.registration.namespace, tokens.astype("<u4").tobytes(), 256)


# -- raw TCP bound -----------------------------------------------------------------------
def stream_bounds(nbytes: int, streams: int) -> list[tuple[int, int]]:
    cuts = [nbytes * s // streams for s in range(streams + 1)]
    return list(itertools.pairwise(cuts))


def raw_sender(port: int, nbytes: int, rounds: int, streams: int, lowered: int = 0) -> None:
    """Serve ``streams`` connections; each round, each sends its share of the bytes
    (``lowered``: from threads at tierkv's data-thread priority)."""
    buf = np.random.default_rng(7).integers(0, 256, size=nbytes, dtype=np.uint8)
    view = memoryview(buf)

    def serve(conn: socket.socket, lo: int, hi: int) -> None:
        if lowered:
            data_thread()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(rounds):
                if conn.recv(1) != b"g":
                    return
                conn.sendall(view[lo:hi])

    with socket.create_server(("127.0.0.1", port)) as srv:
        print("ready", flush=True)
        conns = [srv.accept()[0] for _ in range(streams)]
    threads = [
        threading.Thread(target=serve, args=(c, lo, hi))
        for c, (lo, hi) in zip(conns, stream_bounds(nbytes, streams), strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class RawTcp:
    """The bound: rounds of ``nbytes`` from a sender process over ``streams`` parallel
    connections (``recv_into`` a touched buffer, one receiving thread per connection); at
    most ``rounds`` calls of :meth:`round`, each timed alone. ``lowered``: the sending and
    receiving threads run at the priority tierkv gives its data threads
    (:func:`tierkv.priority.data_thread`: a higher nice value, a longer time slice)."""

    def __init__(self, nbytes: int, rounds: int, streams: int = 1, lowered: bool = False) -> None:
        self.nbytes, self.rounds, self.streams = nbytes, rounds, streams
        self.lowered = lowered

    def __enter__(self) -> RawTcp:
        port = free_port_pair()
        self.child = subprocess.Popen(
            [sys.executable, __file__, "--raw-sender", str(port), str(self.nbytes),
             str(self.rounds), str(self.streams), str(int(self.lowered))],
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        self.socks: list[socket.socket] = []
        try:
            assert self.child.stdout is not None
            assert self.child.stdout.readline().strip() == "ready"
            self.view = memoryview(np.ones(self.nbytes, dtype=np.uint8))  # touched
            for _ in range(self.streams):
                sock = socket.create_connection(("127.0.0.1", port))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.socks.append(sock)
            self.pool = ThreadPoolExecutor(
                self.streams, initializer=data_thread if self.lowered else None
            )
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if hasattr(self, "pool"):
            self.pool.shutdown()
        for sock in self.socks:
            sock.close()
        self.child.wait(30)

    def _receive(self, sock: socket.socket, lo: int, hi: int) -> None:
        sock.sendall(b"g")
        while lo < hi:
            n = sock.recv_into(self.view[lo:hi], hi - lo)
            if not n:
                raise ConnectionError("raw sender closed early")
            lo += n

    def round(self) -> float:
        """Seconds for one round of ``nbytes``."""
        parts = zip(self.socks, stream_bounds(self.nbytes, self.streams), strict=True)
        t0 = time.perf_counter()
        for fut in [self.pool.submit(self._receive, s, lo, hi) for s, (lo, hi) in parts]:
            fut.result()
        return time.perf_counter() - t0


class DesignBound(RawTcp):
    """Raw TCP plus the work the design adds to it, over the same one stream: every chunk
    checksummed as it lands (tierkv's own receive loop, :func:`tierkv.piecewise_io.recv_hashed`:
    XXH3-128 over each piece while it is in the caches), then the one copy of every chunk
    into an engine's touched buffers (tierkv's :class:`~tierkv.copier.Copier`, as
    ``Client.retrieve`` copies). What a fetch cannot avoid doing, without the servers, the
    protocol, the pool or the directory."""

    def __init__(self, nbytes: int, rounds: int, chunk_bytes: int) -> None:
        super().__init__(nbytes, rounds)
        self.chunk_bytes = chunk_bytes

    def __enter__(self) -> DesignBound:
        super().__enter__()
        cb, src = self.chunk_bytes, np.frombuffer(self.view, np.uint8)
        self.pairs = [
            (np.ones(cb, np.uint8), src[start : start + cb])  # touched destinations
            for start in range(0, self.nbytes - cb + 1, cb)
        ]
        self.copier = Copier()
        return self

    def __exit__(self, *exc: object) -> None:
        if hasattr(self, "copier"):
            self.copier.close()
        super().__exit__(*exc)

    def _receive(self, sock: socket.socket, lo: int, hi: int) -> None:
        sock.sendall(b"g")
        for start in range(lo, hi, self.chunk_bytes):
            recv_hashed(sock, self.view[start : min(hi, start + self.chunk_bytes)])

    def round(self) -> float:
        """Seconds for one round: the checksummed receive, then the copy out."""
        received = super().round()
        t0 = time.perf_counter()
        self.copier.run(
            lambda pair: copy_array(*pair), self.pairs, [p[0].nbytes for p in self.pairs]
        )
        return received + time.perf_counter() - t0


# -- the peer fetch ----------------------------------------------------------------------
class PeerFetch:
    """The measured path: an engine on B looks the prompt up (B's pool cleared first, so the
    prefetch fetches every chunk from A), waits for the prefetch, retrieves into its own touched
    buffers, and checks every byte."""

    def __init__(
        self, b: Server, tokens: np.ndarray[Any, Any], shape: tuple[int, ...], src: list[Any]
    ) -> None:
        self.b, self.tokens, self.shape, self.src = b, tokens, shape, src

    def __enter__(self) -> PeerFetch:
        self.out = [np.ones(self.shape, np.float32) for _ in self.src]
        self.engine = self.b.client()
        self.engine.register("bench-model", self.shape, "float32", token_axis=1)
        self.rounds = 0
        self.parts: list[tuple[float, float]] = []  # (LOOKUP to prefetch done, retrieve) s
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.close()

    def round(self) -> float:
        """Seconds for one fetch, LOOKUP to the end of the retrieve."""
        n, engine, r = len(self.src), self.engine, self.rounds
        self.rounds += 1
        engine.clear()  # B's pool forgets the chunks: this round fetches them from A
        rid = f"bench-{r}"
        t0 = time.perf_counter()
        result = engine.lookup(self.tokens, request_id=rid)
        # Waits as an engine does (the server answers the moment the prefetch has landed).
        hits = engine.wait_prefetch(rid) if result.prefetching else result.hits
        t1 = time.perf_counter()
        got = engine.retrieve(request_id=rid, out=self.out)
        seconds = time.perf_counter() - t0
        self.parts.append((t1 - t0, seconds - (t1 - t0)))
        print(
            f"  round {r}: LOOKUP + prefetch {(t1 - t0) * 1e3:.1f} ms, "
            f"retrieve {(time.perf_counter() - t1) * 1e3:.1f} ms",
            flush=True,
        )
        if hits != n or len(got.retrieved) != n:
            raise RuntimeError(f"round {r}: {hits} hits, {len(got.retrieved)} retrieved of {n}")
        for i in range(n):
            if not np.array_equal(self.out[i], self.src[i]):
                raise RuntimeError(f"round {r}: chunk {i} differs")
        for arr in self.out:
            arr.fill(1.0)
        return seconds


def interleaved(repeat: int, *measures: Callable[[], float], warmup: int = 0) -> list[list[float]]:
    """``warmup + repeat`` rounds of every measure in turn (each a call that returns its
    seconds: the fetch, raw TCP, ...): this VM's bandwidth drifts within seconds, so each is
    measured beside the others rather than in a block of its own. Returns each measure's
    seconds, the warm-up rounds left out."""
    times: list[list[float]] = [[] for _ in measures]
    for r in range(warmup + repeat):
        for measure, out in zip(measures, times, strict=True):
            seconds = measure()
            if r >= warmup:
                out.append(seconds)
    return times


def store_chunks(
    server: Server, tokens: np.ndarray[Any, Any], shape: tuple[int, ...], src: list[Any]
) -> None:
    """Store the working set through an engine on ``server`` and wait for the directory."""
    with server.client() as engine:
        engine.register("bench-model", shape, "float32", token_axis=1)
        stored = engine.store(tokens, src)
        if len(stored.stored) != len(src):
            raise RuntimeError(f"{server.name} stored {len(stored.stored)} of {len(src)} chunks")
        keys = chunk_keys(engine, tokens)
    reader = DirectoryReader(server.addr, TOKEN)
    wait_for(lambda: all(reader.resolve(keys)))
    reader.close()


def lookup_latencies(a: Server, count: int, lookups: int) -> list[float]:
    """Store ``count`` small chunks on A, then time outside resolves of all their keys."""
    tokens = np.arange(10_000_000, 10_000_000 + count * CHUNK_TOKENS, dtype=np.uint32)
    shape = (2, CHUNK_TOKENS, 2)
    with a.client() as engine:
        engine.register("bench-lookup-model", shape, "float32", token_axis=1)
        data = [np.full(shape, i, np.float32) for i in range(count)]
        stored = engine.store(tokens, data)
        if len(stored.stored) != count:
            raise RuntimeError(f"stored {len(stored.stored)} of {count} lookup chunks")
        keys = chunk_keys(engine, tokens)
    reader = DirectoryReader(a.addr, TOKEN)
    try:
        reader.refresh()
        wait_for(lambda: all(reader.resolve(keys)))
        times = []
        for _ in range(lookups):
            t0 = time.perf_counter()
            found = reader.resolve(keys)
            times.append(time.perf_counter() - t0)
            if not all(found):
                raise RuntimeError("a published key did not resolve")
        return times
    finally:
        reader.close()


PROBE_SPACING = 0.002  # seconds between two lookups of the prober
PROBE_CHUNKS = 16  # the prober's own chunks, each lookup's hits


def lookup_prober(endpoint: str) -> None:
    """The prober process (``--lookup-prober``): an engine on B stores :data:`PROBE_CHUNKS`
    small chunks of its own, prints ``ready``, looks them up (local hits: only B's control
    path) every :data:`PROBE_SPACING` seconds until a line arrives on stdin, then prints the
    lookups' seconds as one JSON list."""
    shape = (2, CHUNK_TOKENS, 2)
    tokens = np.arange(30_000_000, 30_000_000 + PROBE_CHUNKS * CHUNK_TOKENS, dtype=np.uint32)
    with Client(endpoint, timeout=60.0, auth_token=TOKEN) as engine:
        engine.register("bench-probe-model", shape, "float32", token_axis=1)
        engine.store(tokens, [np.full(shape, i, np.float32) for i in range(PROBE_CHUNKS)])
        stop = threading.Event()
        threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
        print("ready", flush=True)
        times: list[float] = []
        while not stop.is_set():
            t0 = time.perf_counter()
            hits = engine.lookup(tokens).hits
            times.append(time.perf_counter() - t0)
            if hits != PROBE_CHUNKS:
                raise SystemExit(f"the prober's chunks missed: {hits} of {PROBE_CHUNKS}")
            time.sleep(PROBE_SPACING)
    print(json.dumps(times), flush=True)


def lookups_meanwhile(b: Server, busy: Callable[[], object]) -> list[float]:
    """B's LOOKUP latencies (a prober process's local hits) while ``busy()`` runs."""
    prober = subprocess.Popen(
        [sys.executable, __file__, "--lookup-prober", b.endpoint],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert prober.stdin is not None and prober.stdout is not None
        if prober.stdout.readline().strip() != "ready":
            raise RuntimeError("the lookup prober did not start")
        busy()
        prober.stdin.write("stop\n")
        prober.stdin.flush()
        times: list[float] = json.loads(prober.stdout.readline())
    finally:
        prober.kill()
        prober.wait(30)
    return times


def read_your_writes(a: Server, b: Server, rounds: int) -> tuple[int, list[float], list[float]]:
    """Prompts of 2 small chunks stored on A (whose commits wait for the directory) and
    looked up on B the moment each store returned, as a prefill/decode proxy does; the
    same stores on B (whose commits do not wait). (prompts fully hit, A's store times, B's
    store times)."""
    shape = (2, CHUNK_TOKENS, 64)
    full = 0
    waited: list[float] = []
    plain: list[float] = []
    with a.client() as producer, b.client() as consumer:
        producer.register("bench-pd-model", shape, "float32", token_axis=1)
        consumer.register("bench-pd-model", shape, "float32", token_axis=1)
        data = [np.ones(shape, np.float32)] * 2
        for r in range(rounds):
            tokens = np.arange(2 * CHUNK_TOKENS, dtype=np.uint32) + 20_000_000 + r * 1000
            t0 = time.perf_counter()
            producer.store(tokens, data)
            waited.append(time.perf_counter() - t0)
            hits = consumer.lookup(tokens, request_id=f"pd-{r}", wait=True).hits
            consumer.end_session(f"pd-{r}")
            full += hits == 2
            tokens = tokens + 500  # B's own prompts: stored where commits do not wait
            t0 = time.perf_counter()
            consumer.store(tokens, data)
            plain.append(time.perf_counter() - t0)
    return full, waited, plain


def main() -> None:
    exit_on_stop_signals()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--chunks", type=int, default=32, help="chunks fetched per round")
    ap.add_argument("--chunk-mib", type=int, default=8, help="MiB per chunk")
    ap.add_argument("--repeat", type=int, default=5, help="rounds of each measurement")
    ap.add_argument("--lookups", type=int, default=300, help="directory lookups timed")
    ap.add_argument("--ryw-rounds", type=int, default=200, help="prompts stored then read")
    ap.add_argument(
        "--nixl-ucx-tls", default="tcp", help="UCX_TLS of the NIXL servers (default: tcp)"
    )
    ap.add_argument("--no-nixl", action="store_true", help="leave the NIXL path out")
    ap.add_argument("--raw-sender", nargs=5, type=int, help=argparse.SUPPRESS)
    ap.add_argument("--lookup-prober", help=argparse.SUPPRESS)
    add_option(ap)
    args = ap.parse_args()
    if args.raw_sender:
        raw_sender(*args.raw_sender)
        return
    if args.lookup_prober:
        lookup_prober(args.lookup_prober)
        return
    with kept_busy(args.busy_cores):
        measure(args)


def measure(args: argparse.Namespace) -> None:
    """Everything but the argument parsing: servers, rounds, the figures printed."""
    chunk_bytes = args.chunk_mib * MIB
    per = chunk_bytes // (2 * CHUNK_TOKENS * 4)
    shape = (2, CHUNK_TOKENS, per)
    nbytes = args.chunks * chunk_bytes
    pool = int(nbytes * 1.6) + 64 * MIB
    root = tempfile.mkdtemp(prefix="tierkv-peers-")
    servers: list[Server] = []
    try:
        pa, pb = free_port_pair(), free_port_pair()
        a = Server(root, "a", pa, pa, pool)
        servers.append(a)
        # B's commits do not wait for the directory: the cost of waiting is A's store time
        # minus B's for the same stores.
        b = Server(root, "b", pb, pa, pool, ("--commit-publish-timeout", "0"))
        servers.append(b)
        wait_for(lambda: members(a.addr) == members(b.addr) == {a.addr, b.addr})
        time.sleep(1.0)  # let both directories settle on the two-member ring

        rng = np.random.default_rng(1)
        src = [rng.random(shape, dtype=np.float32) for _ in range(args.chunks)]
        tokens = np.arange(args.chunks * CHUNK_TOKENS, dtype=np.uint32)
        store_chunks(a, tokens, shape, src)

        # The NIXL pair: the same chunks on C, read by D.
        why_not_nixl = "--no-nixl" if args.no_nixl else unavailable()
        c = d = None
        if not why_not_nixl:
            ucx = {"UCX_TLS": args.nixl_ucx_tls}
            if args.nixl_ucx_tls == "tcp":
                ucx["UCX_NET_DEVICES"] = "lo"
            nixl_opts = ("--peer-transport", "nixl")
            pc, pd = free_port_pair(), free_port_pair()
            c = Server(root, "c", pc, pc, pool, nixl_opts, ucx)
            servers.append(c)
            d = Server(root, "d", pd, pc, pool, (*nixl_opts, "--commit-publish-timeout", "0"), ucx)
            servers.append(d)
            wait_for(lambda: members(c.addr) == members(d.addr) == {c.addr, d.addr})
            time.sleep(1.0)
            store_chunks(c, tokens, shape, src)

        streams = DEFAULT_STREAMS_PER_FETCH
        nixl_failures: list[str] = []
        with (
            PeerFetch(b, tokens, shape, src) as peer_fetch,
            RawTcp(nbytes, args.repeat) as raw_tcp,
            RawTcp(nbytes, args.repeat, streams) as raw_tcp_par,
            DesignBound(nbytes, args.repeat, chunk_bytes) as design,
            contextlib.ExitStack() as stack,
        ):
            measures = [peer_fetch.round, raw_tcp.round, raw_tcp_par.round, design.round]
            if d is not None:
                nixl_fetch = stack.enter_context(PeerFetch(d, tokens, shape, src))

                def nixl_round() -> float:
                    try:
                        return nixl_fetch.round()
                    except RuntimeError as exc:  # counted, reported: nixl_ok=0
                        print(f"  NIXL round failed: {exc}", flush=True)
                        nixl_failures.append(str(exc))
                        return math.inf

                measures.append(nixl_round)
            if args.busy_cores:  # the bound at the data threads' priority, beside the others
                lowered = stack.enter_context(RawTcp(nbytes, args.repeat, streams, lowered=True))
                measures.append(lowered.round)
            fetch, raw, raw_par, designed, *rest = interleaved(args.repeat, *measures)
            nixl_times = rest[:1] if d is not None else []
            raw_lowered = rest[-1] if args.busy_cores else []
            fetch_parts = peer_fetch.parts[-args.repeat :]
            # B's control path while B fetches: the same rounds again, a prober looking up
            # meanwhile; then as long without them.
            t0 = time.perf_counter()
            during = lookups_meanwhile(b, lambda: [peer_fetch.round() for _ in range(args.repeat)])
            spent = time.perf_counter() - t0
            idle = lookups_meanwhile(b, lambda: time.sleep(spent))
        nixl_ok, nixl_tls, nixl_line = 0, "none", f"NIXL path not measured: {why_not_nixl}"
        if c is not None and d is not None:
            over_nixl, over_tcp, fallbacks, nixl_tls = nixl_figures(d.addr, c.addr)
            want = args.repeat * args.chunks
            nixl_ok = int(
                not nixl_failures and over_nixl == want and over_tcp == 0 and fallbacks == 0
            )
            best = min(nixl_times[0])
            nixl_gbps = nbytes / best / 1e9 if math.isfinite(best) else 0.0
            nixl_line = (
                f"NIXL fetch (LOOKUP + NIXL READs from C + retrieve on D, UCX_TLS={nixl_tls}): "
                f"best {best * 1e3:.1f} ms = {nixl_gbps:.2f} GB/s; {over_nixl} of {want} chunks "
                f"read over NIXL and verified, {over_tcp} over TCP, {fallbacks} fallbacks, "
                f"{len(nixl_failures)} failed rounds"
            )
        lookups = lookup_latencies(a, 512, args.lookups)
        ryw_hits, ryw_wait, ryw_plain = read_your_writes(a, b, args.ryw_rounds)
    finally:
        for srv in servers:
            srv.stop()
        shutil.rmtree(root, ignore_errors=True)

    fetch_gbps = nbytes / min(fetch) / 1e9
    raw_gbps = nbytes / min(raw) / 1e9
    p50_us = statistics.median(lookups) * 1e6
    p99_us = pct(lookups, 0.99) * 1e6
    print(
        f"peer fetch (LOOKUP + prefetch from A + retrieve on B): {args.chunks} x "
        f"{args.chunk_mib} MiB, best {min(fetch) * 1e3:.1f} ms = {fetch_gbps:.2f} GB/s "
        f"(median {statistics.median(fetch) * 1e3:.1f} ms)"
    )
    network = min(t for t, _ in fetch_parts)
    print(
        f"  of which LOOKUP until every chunk is in B's pool, verified: best "
        f"{network * 1e3:.1f} ms ({min(raw) / network:.2f} of raw TCP's speed); the retrieve "
        f"into the engine's buffers (the design's one copy, which raw TCP does not make): "
        f"best {min(r for _, r in fetch_parts) * 1e3:.1f} ms"
    )
    print(
        f"raw TCP stream, same bytes, two processes: best {min(raw) * 1e3:.1f} ms = "
        f"{raw_gbps:.2f} GB/s (median {statistics.median(raw) * 1e3:.1f} ms)"
    )
    raw_par_gbps = nbytes / min(raw_par) / 1e9
    print(
        f"raw TCP, {streams} parallel streams (as many as a peer fetch uses), same bytes: "
        f"best {min(raw_par) * 1e3:.1f} ms = {raw_par_gbps:.2f} GB/s "
        f"(fetch / this = {fetch_gbps / raw_par_gbps:.2f})"
    )
    print(
        f"raw TCP stream plus the design's work (each chunk checksummed as it lands, then "
        f"copied once into touched buffers by tierkv's copier), same bytes: best "
        f"{min(designed) * 1e3:.1f} ms (fetch / this = {min(designed) / min(fetch):.2f})"
    )
    if raw_lowered:
        print(
            f"raw TCP, {streams} parallel streams, every sending and receiving thread at the "
            f"priority of tierkv's data threads (nice +{DATA_NICE}, {DATA_SLICE_NS / 1e6:g} ms "
            f"slice), same bytes: best {min(raw_lowered) * 1e3:.1f} ms (the fetch's network "
            f"part at {min(raw_lowered) / network:.2f} of its speed)"
        )
    print(
        f"directory lookup, 512-chunk prefix, outside reader: p50 {p50_us:.0f} us, "
        f"p99 {p99_us:.0f} us"
    )
    print(
        f"B's lookups ({PROBE_CHUNKS} local chunks, one every {PROBE_SPACING * 1e3:g} ms) "
        f"while B fetches: "
        f"{len(during)} lookups, p50 {pct(during, 0.5) * 1e6:.0f} us, p99 "
        f"{pct(during, 0.99) * 1e6:.0f} us; without a fetch: p50 "
        f"{pct(idle, 0.5) * 1e6:.0f} us, p99 {pct(idle, 0.99) * 1e6:.0f} us"
    )
    wait_us = statistics.median(ryw_wait) * 1e6
    plain_us = statistics.median(ryw_plain) * 1e6
    immediate = ryw_hits / args.ryw_rounds
    print(
        f"read-your-writes: {ryw_hits} of {args.ryw_rounds} prompts stored on A fully hit on B "
        f"looked up right after the store; store of 2 x 64 KiB p50 {wait_us:.0f} us with the "
        f"commit waiting for the directory, {plain_us:.0f} us without"
    )
    print(nixl_line)
    ratio = fetch_gbps / raw_gbps
    print(
        f"{line_name('peers', args.busy_cores)} fetch_vs_raw_tcp={ratio:.3f} "
        f"directory_lookup512_p50_us={p50_us:.0f} "
        f"immediate_remote_hit={immediate:.2f} commit_publish_wait_us={wait_us - plain_us:.0f} "
        f"nixl_ok={nixl_ok} nixl_transport={nixl_tls}"
    )


if __name__ == "__main__":
    main()
