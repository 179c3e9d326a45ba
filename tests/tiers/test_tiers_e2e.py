"""End to end through the tiers: a real `tierkv server` process with a disk, Redis or S3 tier
(a real directory, a real `redis-server`, a moto S3 server), and engine clients, some of them
separate processes.

The scenario, for each tier: chunks stored through shared memory are written behind to the
tier (awaited through ``stats().tiers[..].written_chunks``); they leave the pool (``clear()``,
or real pressure on a small pool); a LOOKUP with a request id prefetches them back from the
tier into the pool; the retrieve through shared memory is byte-exact. Around it:

- the disk tier survives a server restart (SIGTERM, a new server on the same directory);
- a corrupted chunk on the tier ends the prefix there: fewer hits, never wrong bytes, the
  failure counted in ``load_failures``, the bad copy deleted from the tier by that lookup;
- a tier that is down (redis-server stopped) makes lookups miss while the server keeps
  serving and stores keep working; it is used again once it is back;
- chunks loaded from a tier are not written back to it;
- two engine processes prefetching one prefix at once load each chunk once;
- a chunk that only the pool has (never written to the tier) does not end the prefix that
  the prefetch brings in from the tier around it;
- every test ends with no locks or leases left (after the write-behind finished).

Asynchronous effects are awaited by bounded polling; nothing asserts on time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from support import services
from support.httputil import free_port, get_json, wait_for
from support.servers import (
    CHUNK_BYTES,
    CHUNK_SHAPE,
    CHUNK_SIZE,
    ServerProcess,
    chunk_data,
    register,
)
from support.services import RedisServer, S3Server
from tierkv import keys as chunk_keys
from tierkv import protocol as p
from tierkv.client import Client
from tierkv.pool import SHM_DIR

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm (Linux)")

redis_service = services.redis_service
s3_service = services.s3_service

TESTS_DIR = str(Path(__file__).resolve().parents[1])  # support/ lives there
Servers = Callable[..., ServerProcess]


# -- data ----------------------------------------------------------------------------------
def doc_tokens(doc: int, n_chunks: int) -> list[int]:
    """Token ids of document ``doc`` (distinct per document; exact as float32 KV)."""
    start = 1 + doc * 100_000
    return list(range(start, start + n_chunks * CHUNK_SIZE))


def chunk_key_list(client: Client, tokens: list[int]) -> list[bytes]:
    """The server's keys of the chunks of ``tokens`` for this client's namespace."""
    assert client.registration is not None
    return chunk_keys.chunk_keys(client.registration.namespace, tokens, CHUNK_SIZE)


def store(client: Client, tokens: list[int], first_chunk: int = 0) -> list[int]:
    n = len(tokens) // CHUNK_SIZE
    chunks = [chunk_data(tokens, i) for i in range(first_chunk, n)]
    return client.store(tokens, chunks, first_chunk=first_chunk).stored


def retrieve_exact(client: Client, tokens: list[int], request_id: str) -> list[int]:
    """Retrieve the lookup's chunks; returns their positions after checking every byte."""
    n = len(tokens) // CHUNK_SIZE
    out = [np.full(CHUNK_SHAPE, np.nan, np.float32) for _ in range(n)]
    got = client.retrieve(request_id=request_id, out=out)
    for i in got.retrieved:
        assert np.array_equal(out[i], chunk_data(tokens, i)), f"chunk {i} differs"
    return got.retrieved


# A separate engine process: stores a document, or looks it up (waiting for the prefetch)
# and retrieves it, checking every byte; prints a JSON line.
CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
from support.servers import CHUNK_SHAPE, CHUNK_SIZE, chunk_data, register
from tierkv.client import Client

endpoint, mode, doc, n = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
start = 1 + doc * 100_000
tokens = list(range(start, start + n * CHUNK_SIZE))
with Client(endpoint, timeout=30) as client:
    register(client)
    if mode == "store":
        res = client.store(tokens, [chunk_data(tokens, i) for i in range(n)])
        print(json.dumps({"stored": res.stored, "no_space": res.no_space}))
    else:
        rid = f"child-{doc}"
        found = client.lookup(tokens, request_id=rid, wait=True)
        out = [np.full(CHUNK_SHAPE, np.nan, np.float32) for _ in range(n)]
        got = client.retrieve(request_id=rid, out=out)
        exact = [bool(np.array_equal(out[i], chunk_data(tokens, i))) for i in got.retrieved]
        client.end_session(rid)
        print(json.dumps({"hits": found.hits, "retrieved": got.retrieved, "exact": exact}))
"""


def child_argv(srv: ServerProcess, mode: str, doc: int, n: int) -> list[str]:
    return [sys.executable, "-c", CHILD, TESTS_DIR, srv.endpoint, mode, str(doc), str(n)]


def child(srv: ServerProcess, mode: str, doc: int, n: int) -> dict[str, Any]:
    """Run one engine process to completion and return its report."""
    done = subprocess.run(
        child_argv(srv, mode, doc, n), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr + srv.log()[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# -- polling -------------------------------------------------------------------------------
def tier_stats(client: Client) -> p.TierStats:
    stats = client.stats()
    assert len(stats.tiers) == 1, stats.tiers
    return stats.tiers[0]


def wait_written(client: Client, at_least: int) -> p.Stats:
    """Wait until the write-behind is idle and has written ``at_least`` chunks in all."""

    def probe() -> p.Stats | None:
        s = client.stats()
        done = s.write_behind_queued == 0 and s.tiers[0].written_chunks >= at_least
        return s if done else None

    stats: p.Stats = wait_for(f"{at_least} chunks written to the tier", probe)
    return stats


def assert_no_locks(client: Client) -> p.Stats:
    """Once write-behind and prefetch are idle, nothing is locked or leased."""

    def probe() -> p.Stats | None:
        s = client.stats()
        return s if s.write_behind_queued == 0 and s.prefetch_inflight == 0 else None

    s: p.Stats = wait_for("tier work to finish", probe)
    assert (s.read_locked, s.read_leases, s.write_leases, s.writing) == (0, 0, 0, 0), s
    return s


def pool_hits(client: Client, tokens: list[int]) -> int:
    """Leading chunks in the pool now (a lookup without request id: no lock, no prefetch)."""
    return client.lookup(tokens).hits


# -- the tiers -----------------------------------------------------------------------------
@dataclass
class TierSetup:
    """How to run a server with one tier, and how to reach the tier's copy of a chunk."""

    name: str
    spec: str
    corrupt: Callable[[bytes], None]  # damage the tier's copy of a chunk key
    held: Callable[[bytes], bool]  # whether the tier holds a copy of a chunk key
    workdir: Path
    extra: list[str] = field(default_factory=list)

    def args(self) -> list[str]:
        return ["--tier", self.spec, *self.extra]


def flip_byte(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]


def disk_file(directory: Path, key: bytes) -> Path:
    found = list(directory.glob(f"*/*/{key.hex()}.kv"))
    assert len(found) == 1, found
    return found[0]


def disk_setup(workdir: Path) -> TierSetup:
    directory = workdir / "disk"

    def corrupt(key: bytes) -> None:
        path = disk_file(directory, key)
        path.write_bytes(flip_byte(path.read_bytes(), 64 + CHUNK_BYTES // 2))

    def held(key: bytes) -> bool:
        return bool(list(directory.glob(f"*/*/{key.hex()}.kv")))

    return TierSetup("disk", f"disk:path={directory},capacity=256MiB", corrupt, held, workdir)


def redis_setup(workdir: Path, server: RedisServer) -> TierSetup:
    prefix = f"e2e-{uuid.uuid4().hex[:8]}:"

    def corrupt(key: bytes) -> None:
        raw = redis.Redis.from_url(server.url)
        try:
            name = prefix.encode() + key.hex().encode()
            value = raw.get(name)
            assert isinstance(value, bytes) and len(value) == 64 + CHUNK_BYTES
            raw.set(name, flip_byte(value, 64 + CHUNK_BYTES // 2))
        finally:
            raw.close()

    def held(key: bytes) -> bool:
        raw = redis.Redis.from_url(server.url)
        try:
            return bool(raw.exists(prefix.encode() + key.hex().encode()))
        finally:
            raw.close()

    spec = (
        f"redis:url={server.url},key_prefix={prefix},socket_timeout=2,"
        "socket_connect_timeout=1,retries=0"
    )
    return TierSetup("redis", spec, corrupt, held, workdir)


def s3_setup(workdir: Path, server: S3Server) -> TierSetup:
    bucket = f"tierkv-e2e-{uuid.uuid4().hex[:8]}"
    s3: Any = server.client()

    def name_of(key: bytes) -> str:
        return f"tierkv/{key[:16].hex()}/{key[16:].hex()}"

    def corrupt(key: bytes) -> None:
        value = s3.get_object(Bucket=bucket, Key=name_of(key))["Body"].read()
        assert len(value) == 64 + CHUNK_BYTES
        s3.put_object(Bucket=bucket, Key=name_of(key), Body=flip_byte(value, 64 + CHUNK_BYTES // 2))

    def held(key: bytes) -> bool:
        listed = s3.list_objects_v2(Bucket=bucket, Prefix=name_of(key))
        return bool(listed.get("Contents"))

    opts = server.tier_options(bucket, create_bucket=True)
    spec = "s3:" + ",".join(f"{k}={v}" for k, v in opts.items())
    return TierSetup("s3", spec, corrupt, held, workdir)


@pytest.fixture(params=["disk", "redis", "s3"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> TierSetup:
    """Each tier in turn; Redis and S3 get a real server (S3 one per module)."""
    if request.param == "disk":
        return disk_setup(tmp_path)
    if request.param == "redis":
        return redis_setup(tmp_path, request.getfixturevalue("redis_service"))
    return s3_setup(tmp_path, request.getfixturevalue("s3_service"))


@pytest.fixture
def engine() -> Iterator[Callable[[ServerProcess], Client]]:
    """Registered in-process clients, closed after the test."""
    clients: list[Client] = []

    def connect(srv: ServerProcess) -> Client:
        client = srv.client(timeout=30.0)
        register(client)
        clients.append(client)
        return client

    yield connect
    for client in clients:
        client.close()


# -- the scenario for each tier --------------------------------------------------------------
def test_store_write_behind_clear_prefetch_retrieve(
    tier: TierSetup, server_factory: Servers, engine: Callable[[ServerProcess], Client]
) -> None:
    """One engine process stores; the pool is cleared; another engine process looks the
    document up (the prefetch brings it back from the tier) and retrieves it byte-exact."""
    srv = server_factory(extra=tier.args())
    n = 6
    stored = child(srv, "store", doc=1, n=n)
    assert stored == {"stored": list(range(n)), "no_space": []}
    client = engine(srv)
    s = wait_written(client, n)
    assert s.tiers[0].name == tier.name and s.tiers[0].written_chunks == n
    assert s.tiers[0].write_failures == 0
    # Redis and S3 count their contents by walking the medium, off the request path: the
    # figure shows up once a background count has run.
    wait_for("tier count", lambda: client.stats().tiers[0].objects == n)
    assert_no_locks(client)  # the write-behind released its read locks

    tokens = doc_tokens(1, n)
    assert client.clear() == n
    assert pool_hits(client, tokens) == 0

    found = child(srv, "retrieve", doc=1, n=n)
    assert found == {"hits": n, "retrieved": list(range(n)), "exact": [True] * n}
    s = assert_no_locks(client)
    t = s.tiers[0]
    assert t.loaded_chunks == n and t.loaded_bytes == n * CHUNK_BYTES and t.load_failures == {}
    assert t.written_chunks == n  # what came from the tier was not written back to it
    assert s.prefetch_started == 1 and s.prefetch_timed_out == 0

    # Now in the pool again: a lookup hits there, without the tier.
    found = client.lookup(tokens, request_id="again", wait=True)
    assert found.hits == n and not found.prefetching
    assert retrieve_exact(client, tokens, "again") == list(range(n))
    client.end_session("again")
    s = assert_no_locks(client)
    assert s.tiers[0].loaded_chunks == n and s.prefetch_started == 1


def test_pressure_evicts_and_the_tier_brings_it_back(
    tier: TierSetup, server_factory: Servers, engine: Callable[[ServerProcess], Client]
) -> None:
    """A 2 MiB pool (64 chunks; eviction above 80 %) and seven 12-chunk documents: the
    first one is evicted by the others, and a lookup loads it from the tier."""
    srv = server_factory(pool_size="2MiB", extra=tier.args())
    client = engine(srv)
    n, docs = 12, 7
    capacity = client.stats().capacity
    written = 0
    for doc in range(docs):
        tokens = doc_tokens(doc, n)
        written += len(store(client, tokens))
        wait_written(client, written)
        # Let the eviction controller bring the pool under its high watermark (stores
        # never wait for it; a store into a full pool would skip chunks).
        wait_for("eviction", lambda: client.stats().used <= 0.8 * capacity)
    s = client.stats()
    assert s.evictions > 0 and written > 64

    first = doc_tokens(0, n)
    in_pool = pool_hits(client, first)
    assert in_pool < n, "the first document should have been evicted"
    loaded_before = s.tiers[0].loaded_chunks
    found = client.lookup(first, request_id="first", wait=True)
    assert found.hits == n
    assert retrieve_exact(client, first, "first") == list(range(n))
    client.end_session("first")
    s = assert_no_locks(client)
    assert s.tiers[0].loaded_chunks - loaded_before == n - in_pool
    assert s.tiers[0].written_chunks == written  # nothing written back


def test_a_corrupted_chunk_on_the_tier_ends_the_prefix(
    tier: TierSetup, server_factory: Servers, engine: Callable[[ServerProcess], Client]
) -> None:
    """Chunk 3 of 6 is damaged on the tier: the lookup gets 3 hits and those 3 are exact;
    the failure is counted; storing the recomputed chunks again heals the tier."""
    srv = server_factory(extra=tier.args())
    client = engine(srv)
    n = 6
    tokens = doc_tokens(2, n)
    assert store(client, tokens) == list(range(n))
    wait_written(client, n)
    client.clear()
    tier.corrupt(chunk_key_list(client, tokens)[3])

    found = client.lookup(tokens, request_id="r1")
    assert found.hits == 0 and found.prefetching
    status = wait_for("the prefetch", lambda: (st := client.query_prefetch("r1")).done and st)
    assert status.hits == 3
    assert retrieve_exact(client, tokens, "r1") == [0, 1, 2]
    client.end_session("r1")
    s = assert_no_locks(client)
    assert s.tiers[0].load_failures == {"corrupt": 1}
    assert s.tiers[0].loaded_chunks == 3
    assert pool_hits(client, tokens) == 3  # the damaged chunk never entered the pool
    keys = chunk_key_list(client, tokens)
    assert not tier.held(keys[3])  # every tier deletes a copy it found corrupt
    assert all(tier.held(k) for k in keys[:3] + keys[4:])

    # The engine recomputes chunks 3-5 and stores them: the tier has all six again.
    assert store(client, tokens, first_chunk=3) == [3, 4, 5]
    wait_written(client, n + 3)
    client.clear()
    found = client.lookup(tokens, request_id="r2", wait=True)
    assert found.hits == n
    assert retrieve_exact(client, tokens, "r2") == list(range(n))
    client.end_session("r2")
    s = assert_no_locks(client)
    assert s.tiers[0].load_failures == {"corrupt": 1}


# -- disk: restart -------------------------------------------------------------------------
def test_disk_tier_survives_a_server_restart(
    server_factory: Servers, engine: Callable[[ServerProcess], Client], tmp_path: Path
) -> None:
    setup = disk_setup(tmp_path)
    srv = server_factory(extra=setup.args())
    n = 5
    assert child(srv, "store", doc=3, n=n)["stored"] == list(range(n))
    with srv.client(timeout=30.0) as watcher:
        register(watcher)
        wait_written(watcher, n)
    assert srv.stop(signal.SIGTERM) == 0

    again = server_factory(extra=setup.args())  # a new pool, the same directory
    client = engine(again)
    t = tier_stats(client)
    assert t.objects == n and t.written_chunks == 0  # the index was rebuilt from the files
    assert pool_hits(client, doc_tokens(3, n)) == 0
    found = child(again, "retrieve", doc=3, n=n)
    assert found == {"hits": n, "retrieved": list(range(n)), "exact": [True] * n}
    s = assert_no_locks(client)
    assert s.tiers[0].loaded_chunks == n and s.tiers[0].written_chunks == 0


def test_two_engines_prefetching_one_prefix_load_each_chunk_once(
    server_factory: Servers, engine: Callable[[ServerProcess], Client], tmp_path: Path
) -> None:
    srv = server_factory(extra=disk_setup(tmp_path).args())
    client = engine(srv)
    n = 8
    tokens = doc_tokens(4, n)
    assert store(client, tokens) == list(range(n))
    wait_written(client, n)
    client.clear()
    procs = [
        subprocess.Popen(child_argv(srv, "retrieve", 4, n), stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, srv.log()[-3000:]
        result = json.loads(out.strip().splitlines()[-1])
        assert result == {"hits": n, "retrieved": list(range(n)), "exact": [True] * n}
    s = assert_no_locks(client)
    assert s.tiers[0].loaded_chunks == n  # not 2n: the second waited for, or hit, the first


def test_a_chunk_only_in_the_pool_continues_a_prefix_loaded_from_disk(
    server_factory: Servers, engine: Callable[[ServerProcess], Client], tmp_path: Path
) -> None:
    """Chunk 0 in the pool, 1 only on disk, 2 only in the pool (its write-behind dropped),
    3 only on disk: the lookup hits all four, 1 and 3 loaded from disk, 2 served from the
    pool, and the retrieve is byte-exact."""
    setup = disk_setup(tmp_path)
    n = 4
    tokens = doc_tokens(5, n)
    first = server_factory(extra=setup.args())
    with first.client(timeout=30.0) as writer:
        register(writer)
        assert store(writer, tokens[: 2 * CHUNK_SIZE]) == [0, 1]
        assert store(writer, tokens, first_chunk=3) == [3]
        wait_written(writer, 3)
    assert first.stop(signal.SIGTERM) == 0

    # A new pool over the same directory; its write-behind drops every chunk (no room).
    srv = server_factory(extra=[*setup.args(), "--write-behind-max-bytes", "0"])
    client = engine(srv)
    assert tier_stats(client).objects == 3
    assert store(client, tokens[:CHUNK_SIZE]) == [0]
    assert store(client, tokens[: 3 * CHUNK_SIZE], first_chunk=2) == [2]
    s = client.stats()
    assert s.write_behind_dropped == 2 and s.tiers[0].objects == 3  # chunk 2 is not on disk
    assert pool_hits(client, tokens) == 1

    found = client.lookup(tokens, request_id="mixed")
    assert found.hits == 1 and found.prefetching
    status = wait_for("the prefetch", lambda: (st := client.query_prefetch("mixed")).done and st)
    assert status.hits == n
    # Where each hit came from, in chunk order (what the vLLM connector reports per source).
    assert [(r.source, r.chunks) for r in status.sources] == [
        ("pool", 1),
        ("disk", 1),
        ("pool", 1),
        ("disk", 1),
    ]
    assert retrieve_exact(client, tokens, "mixed") == list(range(n))
    client.end_session("mixed")
    s = assert_no_locks(client)
    assert s.tiers[0].loaded_chunks == 2 and s.tiers[0].load_failures == {}


# -- redis: down and back ------------------------------------------------------------------
def test_redis_down_lookups_miss_and_the_server_keeps_serving(
    redis_service: RedisServer,
    server_factory: Servers,
    engine: Callable[[ServerProcess], Client],
    tmp_path: Path,
) -> None:
    setup = redis_setup(tmp_path, redis_service)
    srv = server_factory(extra=setup.args())
    client = engine(srv)
    n = 4
    old = doc_tokens(5, n)
    assert store(client, old) == list(range(n))
    wait_written(client, n)
    client.clear()

    redis_service.stop()
    found = client.lookup(old, request_id="down", wait=True)
    assert found.hits == 0  # a miss, not an error
    assert retrieve_exact(client, old, "down") == []
    client.end_session("down")

    new = doc_tokens(6, n)  # stores still work, and are served from the pool
    assert store(client, new) == list(range(n))
    found = client.lookup(new, request_id="pool", wait=True)
    assert found.hits == n
    assert retrieve_exact(client, new, "pool") == list(range(n))
    client.end_session("pool")
    s = wait_for(
        "failed writes counted", lambda: (s := client.stats()).tiers[0].write_failures and s
    )
    assert s.tiers[0].write_failures == n and s.tiers[0].written_chunks == n
    client.ping()
    assert_no_locks(client)

    redis_service.start()  # back (empty: no persistence): the tier is used again
    newer = doc_tokens(7, n)
    assert store(client, newer) == list(range(n))
    wait_written(client, 2 * n)
    client.clear()
    found = client.lookup(newer, request_id="back", wait=True)
    assert found.hits == n
    assert retrieve_exact(client, newer, "back") == list(range(n))
    client.end_session("back")
    s = assert_no_locks(client)
    assert s.tiers[0].loaded_chunks == n


def test_redis_killed_lookups_miss_as_errors_and_the_outage_is_logged_once(
    redis_service: RedisServer,
    server_factory: Servers,
    engine: Callable[[ServerProcess], Client],
    tmp_path: Path,
) -> None:
    """Chunks written behind to Redis, then the redis-server is killed: lookups of them
    miss, and the misses count as ``error`` (the tier could not be asked), not ``absent``.
    Every one of those lookups (and the stores meanwhile) fails a tier batch, but the server
    logs the outage in one WARNING, and its end, with the failures counted, in one line."""
    setup = redis_setup(tmp_path, redis_service)
    srv = server_factory(extra=setup.args())
    client = engine(srv)
    n, docs = 4, 10
    for doc in range(docs):
        assert store(client, doc_tokens(20 + doc, n)) == list(range(n))
    wait_written(client, docs * n)
    client.clear()
    before = client.stats().lookup_misses
    log_start = len(srv.log())

    assert redis_service.proc is not None
    redis_service.proc.kill()
    redis_service.proc.wait()
    for doc in range(docs):
        found = client.lookup(doc_tokens(20 + doc, n), request_id=f"down-{doc}", wait=True)
        assert found.hits == 0
        client.end_session(f"down-{doc}")
    after = client.stats().lookup_misses
    missed = {reason: after.get(reason, 0) - before.get(reason, 0) for reason in after}
    assert missed["error"] == docs * n, missed
    assert sum(missed.values()) == docs * n, missed
    assert store(client, doc_tokens(40, n)) == list(range(n))  # its write-behind fails too
    wait_for("failed writes counted", lambda: client.stats().tiers[0].write_failures == n)
    assert_no_locks(client)

    redis_service.start()
    assert store(client, doc_tokens(41, n)) == list(range(n))
    wait_written(client, (docs + 1) * n)  # a batch works: the outage is over
    outage_log = srv.log()[log_start:].splitlines()
    warnings = [line for line in outage_log if " WARNING " in line or " ERROR " in line]
    assert len(warnings) == 1, warnings
    assert "redis tier 127.0.0.1:" in warnings[0]
    ends = [line for line in outage_log if " INFO " in line and "works again" in line]
    assert len(ends) == 1, ends
    failures = int(ends[0].split("; ")[-1].split()[0])
    # Every lookup's check (of its first chunk: the run ends there) and every write.
    assert failures >= docs + n


# -- tier options as the command line gives them -------------------------------------------
def test_tier_options_from_the_command_line_get_their_declared_types(tmp_path: Path) -> None:
    """``--tier NAME:k=v`` hands every value over as a string: each is converted to the
    type the tier declares, so ``fsync=false`` is False (not a non-empty, true string)."""
    from tierkv.config import parse_tier_spec
    from tierkv.tiers import TierError, create_tier
    from tierkv.tiers.disk import DiskTier

    spec = parse_tier_spec(f"disk:path={tmp_path / 'd'},fsync=false,retry_interval=5,capacity=1MiB")
    tier = create_tier(spec.name, dict(spec.options))
    try:
        assert isinstance(tier, DiskTier)
        assert tier.fsync is False and tier.retry_interval == 5.0 and tier.capacity == 1 << 20
    finally:
        tier.close()
    spec = parse_tier_spec(f"disk:path={tmp_path / 'e'},fsync=on")
    tier = create_tier(spec.name, dict(spec.options))
    assert isinstance(tier, DiskTier) and tier.fsync is True
    tier.close()
    with pytest.raises(TierError, match="fsync"):
        create_tier("disk", {"path": str(tmp_path / "f"), "fsync": "maybe"})
    with pytest.raises(TierError, match="max_connections"):
        create_tier("redis", {"max_connections": "many"})


def test_stats_never_wait_for_a_tier_to_count_its_contents(
    server_factory: Callable[..., ServerProcess], redis_service: RedisServer, tmp_path: Path
) -> None:
    """Counting a Redis tier's contents is a SCAN of the keyspace: STATS requests (and
    /status) show the last count with its age and never run one themselves; with the
    redis-server frozen they still answer at once."""
    port = free_port()
    srv = server_factory(
        extra=["--tier", f"redis:url={redis_service.url}", "--http-port", str(port)]
    )
    client = srv.client(timeout=3.0)
    register(client)
    tokens = list(range(3 * CHUNK_SIZE))
    client.store(tokens, [chunk_data(tokens, i) for i in range(3)])
    wait_for("tier count", lambda: client.stats().tiers[0].objects == 3)
    scans = _scan_calls(redis_service)
    for _ in range(20):
        client.stats()
        get_json(f"http://127.0.0.1:{port}/status")
    # 40 status requests: at most one more walk (the count may have gone stale meanwhile).
    assert _scan_calls(redis_service) - scans <= 1
    assert redis_service.proc is not None
    redis_service.proc.send_signal(signal.SIGSTOP)
    try:
        for _ in range(5):
            st = client.stats().tiers[0]  # would time out if it waited for a SCAN
            assert st.objects == 3 and st.usage_age_s >= 0
        assert get_json(f"http://127.0.0.1:{port}/status")["tiers"][0]["objects"] == 3
    finally:
        redis_service.proc.send_signal(signal.SIGCONT)


def _scan_calls(redis: RedisServer) -> int:
    reply = redis.command("INFO", "commandstats").decode()
    for line in reply.splitlines():
        if line.startswith("cmdstat_scan:"):
            return int(line.split("calls=")[1].split(",")[0])
    return 0
