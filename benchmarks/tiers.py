"""The tiers against the raw speed of their medium, measured in the same run.

Chunks of 8 MiB (what one rank of a 7-8B model holds per 256-token chunk) are written from
and read into views of a real shared-memory pool, as the server's write-behind and prefetch
do, through each tier, and the same bytes through the plainest use of the same medium:

- disk (a temporary directory; ``--dir`` to pick the filesystem): the tier's ``store`` /
  ``load`` against one plain file per chunk, ``os.write`` of the pool view / ``os.preadv``
  into the pool view, with as many threads as the tier uses (``--disk-threads``); every
  write run starts after ``os.sync()``. The tier does not fsync by default (``fsync=false``:
  the temp-file + rename already keeps torn files invisible), so **the ratio compares the
  tier with plain writes without fsync**; plain writes + fsync and the tier with
  ``fsync=true`` are shown beside it, and plain writes into files whose blocks were reserved
  first with one ``fallocate`` (what the tier does for each record file: on ext4 a write
  then skips reserving blocks page by page, ``tierkv.piecewise_io.preallocate``), so that
  what the tier gains from that is visible apart from the rest. Reads right after writing
  come from the page cache; when this process may write ``/proc/sys/vm/drop_caches`` (root,
  outside a restricted container) cold reads are measured too, each after ``sync`` and a
  drop, for the tier and the plain files alike (this empties the page cache of the whole machine);
- redis: a ``redis-server`` this script starts on a free loopback port, without persistence
  (skipped with a note when it is not installed): the tier's pipelined ``SET`` / ``GET``
  against raw redis-py ``SET`` / ``GET`` of the same bytes (``bytes`` objects prepared before
  timing), pipelined in the same batches (all writes in one pipeline; reads in pipelines of
  at most 64 MiB of replies, the tier's ``max_pipeline_bytes``);
- s3: a moto S3 server on loopback (skipped when moto is not installed): the tier's
  ``put_object`` / ``get_object`` against raw boto3 calls with the same concurrency. moto
  is a Python emulator: the figures show the tier's overhead over boto3, not S3 speed.

Every tier figure includes the tier's checksum of each chunk (XXH3-128, written in the record
header, verified on load); the single-thread checksum speed over the same bytes is printed
beside them. Loads are checked byte for byte after timing.

    .venv/bin/python benchmarks/tiers.py [--chunks 24] [--s3-chunks 8] [--repeat 5]
        [--disk-repeat 25] [--dir D]

Figures are GB/s (1e9 bytes/s), the median of ``--repeat`` runs (``--disk-repeat`` for disk).
A tier's run and its raw bound's run alternate, and "vs raw" is the median over the runs of
(raw time / tier time) of each such pair. Why pairs, and more runs for disk: on a VM whose
host takes freed guest memory back (virtio-balloon free page reporting, as on the CI VM type),
a write into the page cache that is handed such pages runs 2-3x slower while the host backs
them again (measured there: plain 8 MiB file writes at 6-7 GB/s, and at 2.6-3.2 GB/s in 4 to
8 runs of 20, whichever side ran; with reporting held back for 10 s, 1 of 12). The medians of
each side's runs then land on either mode by chance, and their ratio swung 0.57-1.25 between
runs of this script; a pair's ratio is spoiled only when one of its two runs was. The last
line is machine-readable: ``tiers disk_write_vs_raw=A disk_read_vs_raw=B redis_set_vs_raw=C
redis_get_vs_raw=D`` (tier / raw; disk write without fsync on both sides, disk read from the
page cache on both sides; ``nan`` where a medium was skipped).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stop_signals import exit_on_stop_signals
from tierkv.checksums import checksum
from tierkv.copier import Copier, default_threads
from tierkv.piecewise_io import preallocate
from tierkv.pool import ShmPool
from tierkv.tiers.base import LoadStatus
from tierkv.tiers.disk import DiskTier

MIB = 1 << 20
NAMESPACE = hashlib.blake2b(b"tierkv-benchmark-tiers", digest_size=16).digest()
Items = list[tuple[bytes, memoryview]]


def key(i: int, run: str) -> bytes:
    return NAMESPACE + hashlib.blake2b(f"{run}/{i}".encode(), digest_size=16).digest()


# -- results -------------------------------------------------------------------------------
@dataclass
class Row:
    medium: str
    op: str
    path: str
    seconds: list[float]
    nbytes: int
    baseline: Row | None = None  # the raw figure this one is compared with

    @property
    def gbps(self) -> float:
        return self.nbytes / statistics.median(self.seconds) / 1e9

    @property
    def ratio(self) -> float:
        """This path's speed against its baseline's: the median over the runs of (baseline's
        time / this time), each run paired with the baseline's run next to it (the two were
        measured one after the other: every medium's runs alternate). A run disturbed from
        outside (on a VM, see the module's docstring) then spoils its pair, not the figure."""
        if self.baseline is None:
            return float("nan")
        pairs = zip(self.baseline.seconds, self.seconds, strict=True)
        return statistics.median(base / own for base, own in pairs)


@dataclass
class Results:
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(
        self, medium: str, op: str, path: str, secs: list[float], nbytes: int, base: Row | None
    ) -> Row:
        row = Row(medium, op, path, secs, nbytes, base)
        self.rows.append(row)
        return row

    def ratio(self, medium: str, op: str) -> float:
        for row in self.rows:
            if row.medium == medium and row.op == op and row.baseline is not None:
                return row.ratio
        return float("nan")

    def ratio_row(self, medium: str, op: str) -> Row:
        """The raw row a tier row of ``medium``/``op`` is compared with."""
        for row in self.rows:
            if row.medium == medium and row.op == op and row.baseline is not None:
                return row.baseline
        raise KeyError((medium, op))


def measure(
    fn: Callable[[], object], repeat: int, before: Callable[[], object] | None
) -> list[float]:
    """Wall times of ``fn()``, each run after an untimed ``before()``."""
    out = []
    for _ in range(repeat):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# -- the pool ------------------------------------------------------------------------------
class PoolChunks:
    """``n`` source chunks (random bytes) and ``n`` destination slots in one shm pool."""

    def __init__(self, n: int, chunk: int) -> None:
        self.n, self.chunk = n, chunk
        self.pool = ShmPool.create(f"tierkv-bench-tiers-{os.getpid()}", 2 * n * chunk)
        self.pool.prefault()
        rng = np.random.default_rng(0)
        pattern = rng.integers(0, 256, chunk + 4096 * n, dtype=np.uint8)
        for i in range(n):  # every chunk different (shifted pattern), every page touched
            np.frombuffer(self.src(i), np.uint8)[:] = pattern[4096 * i : 4096 * i + chunk]
        np.frombuffer(self.pool.view(n * chunk, n * chunk), np.uint8)[:] = 0

    def src(self, i: int) -> memoryview:
        return self.pool.view(i * self.chunk, self.chunk)

    def dst(self, i: int) -> memoryview:
        return self.pool.view((self.n + i) * self.chunk, self.chunk)

    def store_items(self, keys: Sequence[bytes], n: int | None = None) -> Items:
        return [(k, self.src(i).toreadonly()) for i, k in enumerate(keys[: n or self.n])]

    def load_items(self, keys: Sequence[bytes], n: int | None = None) -> Items:
        return [(k, self.dst(i)) for i, k in enumerate(keys[: n or self.n])]

    def clear_dst(self) -> None:
        np.frombuffer(self.pool.view(self.n * self.chunk, self.n * self.chunk), np.uint8)[:] = 0

    def check_dst(self, n: int | None = None) -> None:
        for i in range(n or self.n):
            if not np.array_equal(
                np.frombuffer(self.dst(i), np.uint8), np.frombuffer(self.src(i), np.uint8)
            ):
                raise SystemExit(f"benchmark error: chunk {i} came back different")

    def close(self) -> None:
        self.pool.close()


def expect_stored(results: list[bool], what: str) -> None:
    if not all(results):
        raise SystemExit(f"benchmark error: {what} stored {sum(results)} of {len(results)}")


def expect_loaded(results: list[LoadStatus], what: str) -> None:
    if any(st is not LoadStatus.OK for st in results):
        raise SystemExit(f"benchmark error: {what} loads: {[st.name for st in results]}")


# -- disk ----------------------------------------------------------------------------------
def drop_page_cache() -> bool:
    """sync + drop clean page-cache pages machine-wide; False if not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")
        return True
    except OSError:
        return False


def write_file(path: str, view: memoryview, fsync: bool, reserve: bool = False) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        if reserve:  # the file's blocks in one fallocate first, as the disk tier does
            preallocate(fd, len(view))
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def read_file(path: str, view: memoryview) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], done)
            if n <= 0:
                raise SystemExit(f"benchmark error: {path} is short")
            done += n
    finally:
        os.close(fd)


def bench_disk(res: Results, chunks: PoolChunks, workdir: str, repeat: int, threads: int) -> None:
    n, size = chunks.n, chunks.n * chunks.chunk
    keys = [key(i, "disk") for i in range(n)]
    capacity = 4 * size
    tier = DiskTier(path=os.path.join(workdir, "tier"), capacity=capacity, threads=threads)
    synced = DiskTier(
        path=os.path.join(workdir, "tier-fsync"), capacity=capacity, fsync=True, threads=threads
    )
    raw_dir = os.path.join(workdir, "raw")
    os.makedirs(raw_dir)
    raw_paths = [os.path.join(raw_dir, f"{i}.bin") for i in range(n)]
    # The plain-file bound does its files with as many threads as the tier does its chunks
    # (the same batching), so the ratio is the tier's overhead, not a thread count.
    batch = Copier(threads)
    sizes = [chunks.chunk] * n
    try:
        store, load = chunks.store_items(keys), chunks.load_items(keys)

        def raw_write(fsync: bool, reserve: bool = False) -> None:
            def one(i: int) -> None:
                write_file(raw_paths[i], store[i][1], fsync, reserve)

            batch.run(one, range(n), sizes)

        def raw_remove() -> None:
            for path in raw_paths:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

        def raw_read() -> None:
            batch.run(lambda i: read_file(raw_paths[i], load[i][1]), range(n), sizes)

        def tier_store(t: DiskTier) -> Callable[[], None]:
            return lambda: expect_stored(t.store(store), "disk tier")

        def tier_load() -> None:
            expect_loaded(tier.load(load), "disk tier")

        # Writes, interleaved raw / tier per repetition (the tier skips held keys: delete
        # them first; the raw files are removed first too, so both create new files).
        raw_s, reserved_s, tier_s, raw_sync_s, tier_sync_s = [], [], [], [], []
        for _ in range(repeat):
            # os.sync() first: every write starts without a dirty-page backlog (the kernel
            # throttles writers by it, which made single runs 5x apart on this VM).
            raw_s += measure(lambda: raw_write(False), 1, lambda: (raw_remove(), os.sync()))
            reserved_s += measure(
                lambda: raw_write(False, reserve=True), 1, lambda: (raw_remove(), os.sync())
            )
            tier_s += measure(tier_store(tier), 1, lambda: (tier.delete(keys), os.sync()))
            raw_sync_s += measure(lambda: raw_write(True), 1, lambda: (raw_remove(), os.sync()))
            tier_sync_s += measure(tier_store(synced), 1, lambda: (synced.delete(keys), os.sync()))
        raw_write(False)  # leave the plain files of a no-fsync write for the reads
        tier.store(store)
        t = f"{threads} thread{'s' if threads > 1 else ''}"
        base = res.add("disk", "write", f"plain files, os.write, no fsync, {t}", raw_s, size, None)
        label = f"plain files, fallocate + os.write, no fsync, {t}"
        reserved = res.add("disk", "write", label, reserved_s, size, None)
        res.add("disk", "write", "disk tier (fsync=false, the default)", tier_s, size, base)
        base = res.add(
            "disk", "write+fsync", f"plain files, os.write + fsync, {t}", raw_sync_s, size, None
        )
        res.add("disk", "write+fsync", "disk tier, fsync=true", tier_sync_s, size, base)

        raw_r, tier_r = [], []
        for _ in range(repeat):
            raw_r += measure(raw_read, 1, chunks.clear_dst)
            tier_r += measure(tier_load, 1, chunks.clear_dst)
        chunks.check_dst()
        base = res.add("disk", "read", f"plain files, preadv (page cache), {t}", raw_r, size, None)
        res.add("disk", "read", "disk tier (page cache)", tier_r, size, base)
        check = res.rows[0].gbps * threads  # the checksum, measured first on one thread
        r = res.ratio_row("disk", "read")
        res.notes.append(
            f"disk: the plain file I/O and one checksum pass in series, {t}, would make "
            f"at most {1 / (1 / reserved.gbps + 1 / check):.2f} GB/s write (fallocate + "
            f"os.write, as the tier writes), {1 / (1 / r.gbps + 1 / check):.2f} GB/s read "
            "(the tier's own bound here)"
        )

        if drop_page_cache():
            cold_raw, cold_tier = [], []
            for _ in range(repeat):
                cold_raw += measure(raw_read, 1, lambda: (chunks.clear_dst(), drop_page_cache()))
                cold_tier += measure(tier_load, 1, lambda: (chunks.clear_dst(), drop_page_cache()))
            chunks.check_dst()
            label = f"plain files, preadv (cache dropped), {t}"
            base = res.add("disk", "read cold", label, cold_raw, size, None)
            res.add("disk", "read cold", "disk tier (cache dropped)", cold_tier, size, base)
            res.notes.append(
                "disk: cold reads measured after sync + /proc/sys/vm/drop_caches before each run"
            )
        else:
            res.notes.append(
                "disk: reads come from the page cache (the files were just written); "
                "/proc/sys/vm/drop_caches is not writable here, so no cold reads"
            )
    finally:
        tier.close()
        synced.close()
        batch.close()


# -- redis ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def _serving(
    proc: subprocess.Popen[bytes],
    port: int,
    probe: bytes,
    answer: bytes,
    timeout: float,
    interval: float,
    what: str,
) -> Iterator[None]:
    """Wait until the server ``proc`` answers ``probe`` on ``port`` with a reply starting
    with ``answer`` (a benchmark error after ``timeout`` s or if it exits), SIGTERM it after."""
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    s.sendall(probe)
                    if s.recv(16).startswith(answer):
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"benchmark error: {what} did not start")
            time.sleep(interval)
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)


@contextlib.contextmanager
def redis_server(workdir: str) -> Iterator[str | None]:
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir, "--protected-mode", "yes"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    with _serving(proc, port, b"PING\r\n", b"+PONG", 20, 0.02, "redis-server"):
        yield f"redis://127.0.0.1:{port}/0"


class RespSocket:
    """The medium's bound: RESP commands over one plain socket, no client library. SET sends
    the pool view itself; GET reads each reply's payload with ``recv_into`` straight into
    the destination slot."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray(1 << 16)
        self.have = memoryview(self.buf)[:0]

    def set_many(self, items: Sequence[tuple[bytes, memoryview]]) -> None:
        for name, view in items:
            self.sock.sendall(
                b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(name), name, len(view))
            )
            self.sock.sendall(view)
            self.sock.sendall(b"\r\n")
        for _ in items:
            if self._line() != b"+OK":
                raise SystemExit("benchmark error: raw socket SET failed")

    def get_many(self, items: Sequence[tuple[bytes, memoryview]]) -> None:
        self.sock.sendall(
            b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k, _ in items)
        )
        for _, view in items:
            if self._line() != b"$%d" % len(view):
                raise SystemExit("benchmark error: raw socket GET came back wrong")
            self._read_into(view)
            self._read_into(memoryview(bytearray(2)))

    def _fill(self) -> None:
        n = self.sock.recv_into(self.buf)
        if n == 0:
            raise SystemExit("benchmark error: redis closed the connection")
        self.have = memoryview(self.buf)[:n]

    def _line(self) -> bytes:
        out = b""
        while True:
            if not self.have:
                self._fill()
            data = bytes(self.have)
            end = data.find(b"\r\n")
            if end >= 0:
                self.have = self.have[end + 2 :]
                return out + data[:end]
            out += data
            self.have = self.have[:0]

    def _read_into(self, view: memoryview) -> None:
        done = min(len(self.have), len(view))
        view[:done] = self.have[:done]
        self.have = self.have[done:]
        while done < len(view):
            n = self.sock.recv_into(view[done:])
            if n == 0:
                raise SystemExit("benchmark error: redis closed the connection")
            done += n

    def close(self) -> None:
        self.sock.close()


def bench_redis(res: Results, chunks: PoolChunks, url: str, repeat: int) -> None:
    import redis

    from tierkv.tiers.redis import RedisTier

    n, size = chunks.n, chunks.n * chunks.chunk
    keys = [key(i, "redis") for i in range(n)]
    tier = RedisTier(url=url, key_prefix="bench-tier:")
    raw = redis.Redis.from_url(url)
    bound = RespSocket(int(url.rsplit(":", 1)[1].split("/")[0]))
    try:
        store, load = chunks.store_items(keys), chunks.load_items(keys)
        values = [bytes(view) for _, view in store]  # raw redis-py sends bytes objects
        raw_keys = [b"bench-raw:" + k.hex().encode() for k in keys]
        per_pipeline = max(1, (64 * MIB) // (chunks.chunk + 64))  # the tier's read batches

        def raw_set() -> None:
            with raw.pipeline(transaction=False) as pipe:
                for k, v in zip(raw_keys, values, strict=True):
                    pipe.set(k, v)
                if not all(pipe.execute()):
                    raise SystemExit("benchmark error: raw SET failed")

        def raw_get() -> None:
            for start in range(0, n, per_pipeline):
                with raw.pipeline(transaction=False) as pipe:
                    for k in raw_keys[start : start + per_pipeline]:
                        pipe.get(k)
                    got = pipe.execute()
                if any(len(v) != chunks.chunk for v in got):
                    raise SystemExit("benchmark error: raw GET came back short")
                del got

        def tier_set() -> None:
            expect_stored(tier.store(store), "redis tier")

        def tier_get() -> None:
            expect_loaded(tier.load(load), "redis tier")

        sock_items = [(b"bench-sock:" + k.hex().encode(), v) for k, v in store]
        sock_load = [(name, view) for (name, _), (_, view) in zip(sock_items, load, strict=True)]

        def sock_get() -> None:
            for start in range(0, n, per_pipeline):
                bound.get_many(sock_load[start : start + per_pipeline])

        bound.set_many(sock_items)  # warm-up: redis grows its memory once, untimed
        raw_set()
        tier_set()
        sock_s, raw_s, tier_s, sock_g, raw_g, tier_g = [], [], [], [], [], []
        for _ in range(repeat):
            sock_s += measure(lambda: bound.set_many(sock_items), 1, None)
            raw_s += measure(raw_set, 1, lambda: raw.delete(*raw_keys))
            tier_s += measure(tier_set, 1, lambda: tier.delete(keys))
        for _ in range(repeat):
            sock_g += measure(sock_get, 1, chunks.clear_dst)
            raw_g += measure(raw_get, 1, None)
            tier_g += measure(tier_get, 1, chunks.clear_dst)
        chunks.check_dst()
        sock_set_row = res.add(
            "redis", "SET", "bound: RESP over a plain socket, sendall(view)", sock_s, size, None
        )
        base = res.add("redis", "SET", "raw redis-py, bytes, one pipeline", raw_s, size, None)
        tier_set_row = res.add(
            "redis", "SET", "redis tier (pool views, one pipeline)", tier_s, size, base
        )
        sock_get_row = res.add(
            "redis", "GET", "bound: RESP over a plain socket, recv_into(slot)", sock_g, size, None
        )
        base = res.add("redis", "GET", "raw redis-py, pipelined", raw_g, size, None)
        tier_get_row = res.add("redis", "GET", "redis tier (into pool slots)", tier_g, size, base)
        res.notes.append(
            "redis: 'vs raw' compares with redis-py; its hiredis command packer copies every "
            "value into one bytes before sending (the tier sends the pool view). Tier against "
            f"the plain-socket bound: SET "
            f"{tier_set_row.gbps / sock_set_row.gbps:.2f}, GET "
            f"{tier_get_row.gbps / sock_get_row.gbps:.2f}"
        )
        raw.delete(*raw_keys)
        raw.delete(*[name for name, _ in sock_items])
        tier.delete(keys)
    finally:
        tier.close()
        raw.close()
        bound.close()


# -- s3 ------------------------------------------------------------------------------------
@contextlib.contextmanager
def moto_server(workdir: str) -> Iterator[str | None]:
    try:
        import moto.server  # noqa: F401
    except ImportError:
        yield None
        return
    port = free_port()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=workdir, env=env,
    )  # fmt: skip
    probe = b"GET /moto-api/ HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with _serving(proc, port, probe, b"HTTP/1.", 30, 0.05, "moto server"):
        yield f"http://127.0.0.1:{port}"


def bench_s3(res: Results, chunks: PoolChunks, endpoint: str, n: int, repeat: int) -> None:
    import boto3

    from tierkv.tiers.s3 import S3Tier

    creds = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    concurrency = 8
    tier = S3Tier(
        bucket,
        endpoint_url=endpoint,
        region="us-east-1",
        access_key_id="testing",
        secret_access_key="testing",
        max_concurrency=concurrency,
        create_bucket=True,
    )
    import botocore.config

    try:  # the tier's settings: botocore's own CRC32 checksums off (ours cover chunks)
        config = botocore.config.Config(
            max_pool_connections=concurrency,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
    except TypeError:  # botocore < 1.36 has neither option
        config = botocore.config.Config(max_pool_connections=concurrency)
    raw: Any = boto3.session.Session().client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", config=config, **creds
    )
    pool = ThreadPoolExecutor(concurrency)
    size = n * chunks.chunk
    keys = [key(i, "s3") for i in range(n)]
    try:
        store, load = chunks.store_items(keys, n), chunks.load_items(keys, n)
        values = [bytes(view) for _, view in store]
        names = [f"raw/{k.hex()}" for k in keys]

        def raw_put() -> None:
            list(pool.map(lambda kv: raw.put_object(Bucket=bucket, Key=kv[0], Body=kv[1]),
                          zip(names, values, strict=True)))  # fmt: skip

        def raw_get() -> None:
            def get(name: str) -> None:
                body = raw.get_object(Bucket=bucket, Key=name)["Body"].read()
                if len(body) != chunks.chunk:
                    raise SystemExit("benchmark error: raw GET came back short")

            list(pool.map(get, names))

        raw_p, tier_p, raw_g, tier_g = [], [], [], []
        for _ in range(repeat):
            raw_p += measure(raw_put, 1, None)
            tier_p += measure(lambda: expect_stored(tier.store(store), "s3 tier"), 1, None)
        for _ in range(repeat):
            raw_g += measure(raw_get, 1, None)
            tier_g += measure(
                lambda: expect_loaded(tier.load(load), "s3 tier"), 1, chunks.clear_dst
            )
        chunks.check_dst(n)
        base = res.add(
            "s3", "PUT", f"raw boto3 put_object, {concurrency} threads", raw_p, size, None
        )
        res.add("s3", "PUT", "s3 tier (pool views as the body)", tier_p, size, base)
        base = res.add(
            "s3", "GET", f"raw boto3 get_object().read(), {concurrency} threads", raw_g, size, None
        )
        res.add("s3", "GET", "s3 tier (readinto pool slots)", tier_g, size, base)
        res.notes.append(
            "s3: moto is a Python emulator; compare the tier with boto3 (same client settings, "
            "same concurrency), not with S3"
        )
    finally:
        pool.shutdown()
        tier.delete(keys)
        tier.close()
        raw.close()


# -- main ----------------------------------------------------------------------------------
def checksum_row(res: Results, chunks: PoolChunks, repeat: int) -> None:
    def run() -> None:
        for i in range(chunks.n):
            checksum(chunks.src(i))

    secs = measure(run, repeat, None)
    res.add("cpu", "checksum", "XXH3-128 of the same bytes, 1 thread (the tiers' extra pass)",
            secs, chunks.n * chunks.chunk, None)  # fmt: skip


def print_table(res: Results, chunk: int, n: int, repeat: int, disk_repeat: int) -> None:
    print(f"tierkv tiers: {n} chunks of {chunk // MIB} MiB per run, median of {repeat} runs "
          f"({disk_repeat} for disk), GB/s = 1e9 bytes/s; 'vs raw' = the median over the runs "
          "of (raw time / tier time), each tier run paired with the raw run before it")  # fmt: skip
    print()
    print(f"{'medium':<7}{'operation':<13}{'path':<58}{'GB/s':>8}{'vs raw':>8}")
    for row in res.rows:
        ratio = f"{row.ratio:.2f}" if row.baseline else ""
        print(f"{row.medium:<7}{row.op:<13}{row.path:<58}{row.gbps:>8.2f}{ratio:>8}")
    print()
    for note in res.notes:
        print("note: " + note)


def main() -> None:
    exit_on_stop_signals()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=24, help="chunks per run (disk, redis)")
    ap.add_argument("--s3-chunks", type=int, default=8, help="chunks per run for s3 (moto)")
    ap.add_argument("--chunk-mib", type=int, default=8, help="chunk size in MiB (8)")
    ap.add_argument("--repeat", type=int, default=5, help="runs per figure; the median counts")
    ap.add_argument(
        "--disk-repeat", type=int, default=25, help="runs per disk figure (25; see the docstring)"
    )
    ap.add_argument("--dir", default=None, help="directory for the disk files (a temp dir)")
    ap.add_argument(
        "--disk-threads",
        type=int,
        default=default_threads(),
        help="the disk tier's threads, also used by the plain-file bound (default: cores, max 4)",
    )
    args = ap.parse_args()
    chunk = args.chunk_mib * MIB
    s3_chunks = min(args.s3_chunks, args.chunks)

    res = Results()
    chunks = PoolChunks(args.chunks, chunk)
    workdir = tempfile.mkdtemp(prefix="tierkv-bench-tiers-", dir=args.dir)
    try:
        checksum_row(res, chunks, args.repeat)
        bench_disk(res, chunks, workdir, args.disk_repeat, args.disk_threads)
        with redis_server(workdir) as url:
            if url is None:
                res.notes.append("redis: redis-server is not installed; skipped")
            else:
                bench_redis(res, chunks, url, args.repeat)
        with moto_server(workdir) as endpoint:
            if endpoint is None:
                res.notes.append("s3: moto is not installed (pip install 'moto[server]'); skipped")
            else:
                bench_s3(res, chunks, endpoint, s3_chunks, args.repeat)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        chunks.close()

    print_table(res, chunk, args.chunks, args.repeat, args.disk_repeat)
    print(
        f"tiers disk_write_vs_raw={res.ratio('disk', 'write'):.2f} "
        f"disk_read_vs_raw={res.ratio('disk', 'read'):.2f} "
        f"redis_set_vs_raw={res.ratio('redis', 'SET'):.2f} "
        f"redis_get_vs_raw={res.ratio('redis', 'GET'):.2f}"
    )


if __name__ == "__main__":
    main()
