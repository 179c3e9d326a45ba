"""The Redis/Valkey tier against a real redis-server, with slot views from a real shm pool:
byte-exact batch round trips, contains, delete, TTL expiry, namespace separation, every kind
of corrupted value, per-item server errors, a server that goes away and comes back, usage,
the zero-copy command packing of a store, loads received straight into their slots (no
Python object holds a value), and TLS and RESP3 connections."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from redis.connection import Connection, PythonRespSerializer
from redis.exceptions import ResponseError

from support import services
from support.services import RedisServer, Slots, load_into, new_key, store_random
from tierkv.checksums import checksum
from tierkv.keys import Namespace, chunk_keys
from tierkv.tiers import LoadStatus, TierError, TierUsage, create_tier, tier_names
from tierkv.tiers.records import HEADER_SIZE, pack_header
from tierkv.tiers.redis import RedisTier
from tierkv.tiers.redis_wire import Concat, GatherPacker
from tierkv.tiers.resp import Misfit

# Fixtures of the real services (tests/conftest.py belongs to the server tests).
redis_server = services.redis_server
redis_tls_server = services.redis_tls_server
redis_service = services.redis_service
slots = services.slots

SIZES = [1, 100, 4096, 6001, 64 * 1024, 300 * 1024]


def wait_for(cond: Callable[[], bool], timeout: float = 15.0) -> bool:
    """Poll ``cond()`` until true or ``timeout`` (waits for an effect, asserts no timing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return bool(cond())


@pytest.fixture
def make_tier(redis_server: str) -> Iterator[Callable[..., RedisTier]]:
    tiers: list[RedisTier] = []

    def make(**options: object) -> RedisTier:
        opts: dict[str, object] = {
            "url": redis_server,
            "key_prefix": f"test-{uuid.uuid4().hex[:8]}:",
            "socket_timeout": 5.0,
            "socket_connect_timeout": 2.0,
            **options,
        }
        tier = create_tier("redis", opts)
        assert isinstance(tier, RedisTier)
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close()


@pytest.fixture
def tier(make_tier: Callable[..., RedisTier]) -> RedisTier:
    return make_tier()


@pytest.fixture
def raw(redis_server: str) -> Iterator[redis.Redis]:
    """A plain client to look at and tamper with what the tier stored."""
    client = redis.Redis.from_url(redis_server)
    yield client
    client.close()


# -- registry and options ------------------------------------------------------------------
def test_registered_as_redis_and_valkey(redis_server: str) -> None:
    assert {"redis", "valkey"} <= set(tier_names())
    tier = create_tier("valkey", {"url": redis_server})
    try:
        assert isinstance(tier, RedisTier)
        assert tier.name == "valkey"
    finally:
        tier.close()


@pytest.mark.parametrize(
    "options",
    [
        {"ttl": 0},
        {"ttl": -5},
        {"max_connections": 0},
        {"retries": -1},
        {"min_rate": 0},
        {"url": "http://x"},
        {"socket_timeout": -1},
        {"socket_connect_timeout": 0},
        {"pool_timeout": -1},
        {"socket_timeout": float("inf")},
    ],
)
def test_bad_options_are_tier_errors(options: dict[str, object]) -> None:
    with pytest.raises(TierError):
        create_tier("redis", options)


def test_unknown_option_is_a_tier_error() -> None:
    with pytest.raises(TierError, match="unknown option 'bucket'"):
        create_tier("redis", {"bucket": "x"})


# -- data path -----------------------------------------------------------------------------
def test_batch_round_trip_is_byte_exact(tier: RedisTier, slots: Slots) -> None:
    keys, expected = store_random(tier, slots, SIZES)
    statuses, views = load_into(tier, slots, keys, SIZES)
    assert statuses == [LoadStatus.OK] * len(SIZES)
    assert [bytes(v) for v in views] == expected
    assert tier.stats()["stored"] == len(SIZES)
    assert tier.stats()["loaded"] == len(SIZES)


def test_round_trip_over_several_pipelines(
    make_tier: Callable[..., RedisTier],
    slots: Slots,
) -> None:
    tier = make_tier(max_pipeline_bytes=100 * 1024)
    sizes = [60 * 1024] * 5 + [200 * 1024, 10]
    keys, expected = store_random(tier, slots, sizes)
    statuses, views = load_into(tier, slots, keys, sizes)
    assert statuses == [LoadStatus.OK] * len(sizes)
    assert [bytes(v) for v in views] == expected


def test_stored_value_is_header_then_payload(
    make_tier: Callable[..., RedisTier], slots: Slots, raw: redis.Redis
) -> None:
    tier = make_tier(key_prefix="layout:")
    keys, expected = store_random(tier, slots, [5000])
    assert tier.redis_key(keys[0]) == b"layout:" + keys[0].hex().encode()
    value = raw.get(tier.redis_key(keys[0]))
    assert value == pack_header(keys[0], expected[0]) + expected[0]


def test_contains(tier: RedisTier, slots: Slots) -> None:
    keys, _ = store_random(tier, slots, [10, 20])
    absent = new_key()
    assert tier.contains([keys[0], absent, keys[1]]) == [True, False, True]
    assert tier.contains([]) == []


def test_missing_chunks_are_missing_and_leave_slots_alone(
    tier: RedisTier,
    slots: Slots,
) -> None:
    keys, expected = store_random(tier, slots, [128])
    view = slots.take(64)
    view[:] = b"\xaa" * 64
    statuses, views = load_into(tier, slots, [new_key(), keys[0]], [64, 128])
    assert statuses == [LoadStatus.MISSING, LoadStatus.OK]
    assert bytes(views[1]) == expected[0]
    assert tier.stats()["missing"] == 1


def test_delete(tier: RedisTier, slots: Slots) -> None:
    keys, _ = store_random(tier, slots, [10, 20, 30])
    assert tier.delete([keys[0], new_key(), keys[2]]) == 2
    assert tier.contains(keys) == [False, True, False]
    statuses, _ = load_into(tier, slots, keys, [10, 20, 30])
    assert statuses == [LoadStatus.MISSING, LoadStatus.OK, LoadStatus.MISSING]
    assert tier.delete([]) == 0
    assert tier.delete(keys) == 1


def test_store_overwrites(tier: RedisTier, slots: Slots) -> None:
    key = new_key()
    first, _ = slots.random(256)
    second, data = slots.random(256)
    assert tier.store([(key, first)]) == [True]
    assert tier.store([(key, second)]) == [True]
    statuses, views = load_into(tier, slots, [key], [256])
    assert statuses == [LoadStatus.OK]
    assert bytes(views[0]) == data


def test_ttl_expires_chunks(
    make_tier: Callable[..., RedisTier],
    slots: Slots,
    raw: redis.Redis,
) -> None:
    tier = make_tier(ttl=1)
    forever = make_tier()
    keys, _ = store_random(tier, slots, [100, 200])
    kept, _ = store_random(forever, slots, [100])
    ttl_ms = raw.pttl(tier.redis_key(keys[0]))
    assert 0 < ttl_ms <= 1000
    assert raw.pttl(forever.redis_key(kept[0])) == -1  # no expiry without a ttl
    assert wait_for(lambda: tier.contains(keys) == [False, False])
    statuses, _ = load_into(tier, slots, keys, [100, 200])
    assert statuses == [LoadStatus.MISSING, LoadStatus.MISSING]
    assert forever.contains(kept) == [True]


def test_fractional_ttl_rounds_up(make_tier: Callable[..., RedisTier], raw: redis.Redis) -> None:
    tier = make_tier(ttl=1.2)
    key = new_key()
    assert tier.store([(key, memoryview(b"x" * 10))]) == [True]
    assert 1000 < raw.pttl(tier.redis_key(key)) <= 2000


def test_namespaces_never_share_keys(tier: RedisTier, slots: Slots) -> None:
    base = dict(model="m", kv_dtype="bfloat16", layout="2x256x8x128", world_size=2, rank=0)
    namespaces = [
        Namespace(**base),  # type: ignore[arg-type]
        Namespace(**{**base, "model": "m2"}),  # type: ignore[arg-type]
        Namespace(**{**base, "kv_dtype": "float16"}),  # type: ignore[arg-type]
        Namespace(**{**base, "rank": 1}),  # type: ignore[arg-type]
        Namespace(**base, tenant_salt="tenant-b"),  # type: ignore[arg-type]
    ]
    tokens = list(range(512))
    keys = [chunk_keys(ns.digest(), tokens)[1] for ns in namespaces]
    assert len({tier.redis_key(k) for k in keys}) == len(keys)
    chunks = [slots.random(1024) for _ in keys]
    assert tier.store([(k, v) for k, (v, _) in zip(keys, chunks, strict=True)]) == [True] * 5
    statuses, views = load_into(tier, slots, keys, [1024] * 5)
    assert statuses == [LoadStatus.OK] * 5
    assert [bytes(v) for v in views] == [data for _, data in chunks]
    # Removing one namespace's chunk leaves the others.
    assert tier.delete([keys[0]]) == 1
    assert tier.contains(keys) == [False, True, True, True, True]


# -- corruption ----------------------------------------------------------------------------
def _tamper(kind: str, value: bytes, other: bytes) -> bytes:
    if kind == "garbage":
        return os.urandom(len(value))
    if kind == "flip_payload":
        return value[:-1] + bytes([value[-1] ^ 0x01])
    if kind == "flip_header_checksum":
        return value[:63] + bytes([value[63] ^ 0x80]) + value[64:]
    if kind == "bad_magic":
        return b"XXXX" + value[4:]
    if kind == "truncated":
        return value[: len(value) // 2]
    if kind == "header_only":
        return value[:HEADER_SIZE]
    if kind == "extended":
        return value + b"\0"
    if kind == "empty":
        return b""
    if kind == "other_key":
        return other  # a valid record, of another key with a same-length payload
    raise AssertionError(kind)


CORRUPTIONS = [
    "garbage",
    "flip_payload",
    "flip_header_checksum",
    "bad_magic",
    "truncated",
    "header_only",
    "extended",
    "empty",
    "other_key",
]


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_corrupted_values_are_corrupt(
    tier: RedisTier,
    slots: Slots,
    raw: redis.Redis,
    kind: str,
) -> None:
    keys, expected = store_random(tier, slots, [4096, 4096, 4096])
    victim, other, intact = keys
    value = raw.get(tier.redis_key(victim))
    other_value = raw.get(tier.redis_key(other))
    assert isinstance(value, bytes) and isinstance(other_value, bytes)
    raw.set(tier.redis_key(victim), _tamper(kind, value, other_value))
    statuses, views = load_into(tier, slots, [victim, intact], [4096, 4096])
    assert statuses == [LoadStatus.CORRUPT, LoadStatus.OK]
    assert bytes(views[1]) == expected[2]
    # Deleted by that one load: the next one is a miss, not the same bad value again.
    assert raw.exists(tier.redis_key(victim)) == 0
    assert raw.exists(tier.redis_key(other), tier.redis_key(intact)) == 2
    statuses, _ = load_into(tier, slots, [victim], [4096])
    assert statuses == [LoadStatus.MISSING]
    assert tier.stats()["corrupt"] == 1 and tier.stats()["corrupt_deleted"] == 1


def test_wrong_type_under_the_key_is_corrupt(
    tier: RedisTier,
    slots: Slots,
    raw: redis.Redis,
) -> None:
    keys, expected = store_random(tier, slots, [64, 64])
    raw.delete(tier.redis_key(keys[0]))
    raw.hset(tier.redis_key(keys[0]), "field", "value")
    statuses, views = load_into(tier, slots, keys, [64, 64])
    assert statuses == [LoadStatus.CORRUPT, LoadStatus.OK]
    assert bytes(views[1]) == expected[1]
    assert raw.exists(tier.redis_key(keys[0])) == 0
    assert tier.stats()["corrupt_deleted"] == 1


def test_loading_into_a_slot_of_another_size_is_corrupt_and_keeps_the_chunk(
    tier: RedisTier,
    slots: Slots,
) -> None:
    keys, expected = store_random(tier, slots, [1000])
    statuses, _ = load_into(tier, slots, keys, [999])
    assert statuses == [LoadStatus.CORRUPT]
    statuses, views = load_into(tier, slots, keys, [1000])
    assert statuses == [LoadStatus.OK] and bytes(views[0]) == expected[0]


def test_a_corrupt_value_replaced_before_its_deletion_is_kept(
    tier: RedisTier,
    slots: Slots,
    raw: redis.Redis,
) -> None:
    """The deletion is of the value a load read: a fresh store that overtook it stays."""
    keys, expected = store_random(tier, slots, [4096, 4096])
    good, fresh = keys
    bad = b"garbage" * 10
    raw.set(tier.redis_key(good), bad)
    tier._drop_corrupt([(fresh, bad), (good, b"another bad value")])  # both changed since
    assert raw.exists(tier.redis_key(good), tier.redis_key(fresh)) == 2
    tier._drop_corrupt([(good, bad), (fresh, ResponseError("WRONGTYPE"))])
    assert raw.exists(tier.redis_key(good)) == 0
    # A value of another size is told by its length and first 64 bytes (it is not sent back).
    foreign = os.urandom(100_000)
    raw.set(tier.redis_key(good), foreign)
    fresh_value = raw.get(tier.redis_key(fresh))
    assert isinstance(fresh_value, bytes)
    tier._drop_corrupt(
        [
            (good, Misfit(len(foreign) + 1, foreign[:64])),  # another length
            (good, Misfit(len(foreign), os.urandom(64))),  # other first bytes
            (fresh, Misfit(len(fresh_value), fresh_value[:63] + b"?")),  # the good record
        ]
    )
    assert raw.exists(tier.redis_key(good), tier.redis_key(fresh)) == 2
    tier._drop_corrupt([(good, Misfit(len(foreign), foreign[:64]))])
    assert raw.exists(tier.redis_key(good)) == 0
    raw.set(tier.redis_key(good), b"tiny")  # shorter than a header: compared whole
    tier._drop_corrupt([(good, Misfit(4, b"tinY"))])
    assert raw.exists(tier.redis_key(good)) == 1
    tier._drop_corrupt([(good, Misfit(4, b"tiny"))])
    assert raw.exists(tier.redis_key(good)) == 0
    statuses, views = load_into(tier, slots, [fresh], [4096])
    assert statuses == [LoadStatus.OK] and bytes(views[0]) == expected[1]


def test_a_foreign_value_of_another_size_is_neither_held_nor_sent_back(
    make_tier: Callable[..., RedisTier], slots: Slots, raw: redis.Redis
) -> None:
    """Values of another size under a load's keys are received and dropped a piece at a
    time, and deleted by their length and first bytes: a load of 4 KiB chunks over four
    8 MiB foreign values stays within a few hundred KiB (it held each whole, twice, and sent
    each back to Redis in the deleting script)."""
    tier = make_tier(max_pipeline_bytes=1 << 20)
    keys, expected = store_random(tier, slots, [4096] * 5)
    for key in keys[:4]:
        raw.set(tier.redis_key(key), os.urandom(8 << 20))
    tracemalloc.start()
    try:
        statuses, views = load_into(tier, slots, keys, [4096] * 5)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert statuses == [LoadStatus.CORRUPT] * 4 + [LoadStatus.OK]
    assert bytes(views[4]) == expected[4]
    assert peak < 512 * 1024, peak
    assert raw.exists(*[tier.redis_key(k) for k in keys]) == 1
    assert tier.stats()["corrupt_deleted"] == 4


class StallingProxy:
    """A TCP proxy in front of Redis; ``mode`` sets what goes back to the client: None:
    everything; "slow": a slow link (16 KiB every 20 ms); "trickle": a byte every 10 ms
    (each receive gets something well within any socket timeout); "stall": nothing;
    "slow_requests": the commands go to Redis at 16 KiB every 20 ms (replies: everything).
    ``accepted``: connections made to it. ``rcvbuf``: the receive buffer of the client
    side (bytes; None: the kernel's, which grows to tens of MiB: the commands a slow
    Redis has not read yet would pile up there)."""

    def __init__(self, port: int, rcvbuf: int | None = None) -> None:
        self.upstream = port
        self.mode: str | None = None
        self.accepted = 0
        self._listener = socket.socket()
        if rcvbuf is not None:  # before listen: accepted sockets take it over
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen()
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.accepted += 1
            server = socket.create_connection(("127.0.0.1", self.upstream))
            self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        try:
            while not self._closed.is_set():
                data = src.recv(16384 if self.mode == "slow_requests" else 65536)
                if not data:
                    break
                if replies and self.mode == "stall":
                    continue
                if not replies and self.mode == "slow_requests":
                    for i in range(0, len(data), 16384):
                        if self._closed.wait(0.02):
                            return
                        dst.sendall(data[i : i + 16384])
                    continue
                if replies and self.mode == "slow":  # about 800 KB/s, 16 KiB at a time
                    for i in range(0, len(data), 16384):
                        if self._closed.wait(0.02):
                            return
                        dst.sendall(data[i : i + 16384])
                    continue
                if replies and self.mode == "trickle":
                    for i in range(len(data)):
                        if self._closed.wait(0.01):
                            return
                        dst.sendall(data[i : i + 1])
                    continue
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        for sock in self._sockets:
            sock.close()


@pytest.fixture
def proxy(redis_service: RedisServer) -> Iterator[StallingProxy]:
    stalling = StallingProxy(redis_service.port)
    yield stalling
    stalling.close()


def _in_thread(fn: Callable[[], Any], limit: float = 30.0) -> Any:
    """``fn()`` from a thread; fails the test (instead of hanging it) past ``limit``."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(limit)
    assert result, f"still running after {limit} s"
    return result[0]


def test_socket_timeout_bounds_each_trickling_reply_whole(
    make_tier: Callable[..., RedisTier], proxy: StallingProxy, slots: Slots
) -> None:
    """A reply trickling in (every receive well within the timeout) fails the batch once
    socket_timeout (0.5 s) has passed: the 64 KiB value would take 11 minutes at that rate,
    and the load ran that long."""
    tier = make_tier(url=f"redis://127.0.0.1:{proxy.port}/0", socket_timeout=0.5, retries=0)
    keys, expected = store_random(tier, slots, [64 * 1024])
    proxy.mode = "trickle"
    assert _in_thread(lambda: load_into(tier, slots, keys, [64 * 1024])[0]) == [LoadStatus.ERROR]
    proxy.mode = None
    statuses, views = load_into(tier, slots, keys, [64 * 1024])
    assert statuses == [LoadStatus.OK] and bytes(views[0]) == expected[0]


def test_a_batch_longer_than_socket_timeout_over_a_slow_link_loads(
    make_tier: Callable[..., RedisTier], proxy: StallingProxy, slots: Slots
) -> None:
    """socket_timeout bounds each reply, not a whole pipeline: 16 values of 64 KiB over a
    link of about 800 KB/s take over a second together, each well within 0.5 s. One
    deadline for the pipeline failed every such batch, for good, on any link too slow to
    bring a whole max_pipeline_bytes in within the timeout."""
    tier = make_tier(url=f"redis://127.0.0.1:{proxy.port}/0", socket_timeout=0.5, retries=0)
    sizes = [64 * 1024] * 16
    keys, expected = store_random(tier, slots, sizes)
    proxy.mode = "slow"
    statuses, views = _in_thread(lambda: load_into(tier, slots, keys, sizes))
    assert statuses == [LoadStatus.OK] * 16
    assert [bytes(v) for v in views] == expected


def test_replies_each_within_socket_timeout_fail_the_batch_by_its_deadline(
    make_tier: Callable[..., RedisTier], proxy: StallingProxy, slots: Slots
) -> None:
    """Eight replies of about 180 bytes trickling in at a byte every 10 ms, each whole
    well within socket_timeout (2 s), held the load for 14 s (count x timeout, at worst):
    the pipeline must be answered within socket_timeout plus its bytes at min_rate."""
    tier = make_tier(url=f"redis://127.0.0.1:{proxy.port}/0", socket_timeout=2.0, retries=0)
    sizes = [100] * 8
    keys, expected = store_random(tier, slots, sizes)
    proxy.mode = "trickle"
    assert _in_thread(lambda: load_into(tier, slots, keys, sizes)[0]) == [LoadStatus.ERROR] * 8
    proxy.mode = None
    statuses, views = load_into(tier, slots, keys, sizes)
    assert statuses == [LoadStatus.OK] * 8 and [bytes(v) for v in views] == expected


def test_a_store_sent_slower_than_min_rate_fails_by_its_deadline(
    make_tier: Callable[..., RedisTier], redis_service: RedisServer, slots: Slots
) -> None:
    """A Redis taking a 12 MiB store at about 800 KB/s, each wait for room well within
    socket_timeout (1 s), held the tier thread for the 10 s or so it took: bounded by
    socket_timeout plus its bytes at min_rate (here 16 MiB/s: 1.75 s), the store fails,
    and the next one over a normal link works. (The same store at the same rate with the
    default min_rate goes through: see the slow-link load test for that side.)"""
    proxy = StallingProxy(redis_service.port, rcvbuf=32 * 1024)
    try:
        tier = make_tier(
            url=f"redis://127.0.0.1:{proxy.port}/0",
            socket_timeout=1.0,
            retries=0,
            min_rate=16 << 20,
        )
        view, _ = slots.random(12 << 20)
        proxy.mode = "slow_requests"
        assert _in_thread(lambda: tier.store([(new_key(), view)])) == [False]
        proxy.mode = None
        assert tier.store([(new_key(), view)]) == [True]
    finally:
        proxy.close()


def test_a_timeout_is_not_retried(
    make_tier: Callable[..., RedisTier], proxy: StallingProxy, slots: Slots
) -> None:
    """``retries`` reconnects after a connection error, not after a timeout: a stalled
    Redis costs a batch one connection (and one timeout), not retries + 1."""
    tier = make_tier(url=f"redis://127.0.0.1:{proxy.port}/0", socket_timeout=0.3, retries=2)
    keys, _ = store_random(tier, slots, [1000])
    proxy.mode = "stall"
    view, _ = slots.random(1000)
    batches: list[Callable[[], object]] = [
        lambda: load_into(tier, slots, keys, [1000])[0],
        lambda: tier.presence(keys),
        lambda: tier.store([(new_key(), view)]),
    ]
    for batch in batches * 2:
        before = proxy.accepted
        assert batch() in ([LoadStatus.ERROR], [None], [False])
        assert proxy.accepted - before <= 1  # a new connection for the one attempt, at most


# -- server failures -----------------------------------------------------------------------
def test_server_errors_fail_single_items_without_raising(
    tier: RedisTier,
    slots: Slots,
    raw: redis.Redis,
) -> None:
    keys, _ = store_random(tier, slots, [100])
    raw.config_set("maxmemory-policy", "noeviction")
    raw.config_set("maxmemory", 1)  # every write is now refused with OOM
    try:
        view, _ = slots.random(100)
        assert tier.store([(new_key(), view), (new_key(), view)]) == [False, False]
        assert tier.stats()["store_failed"] == 2
        # Reads still work.
        statuses, _ = load_into(tier, slots, keys, [100])
        assert statuses == [LoadStatus.OK]
    finally:
        raw.config_set("maxmemory", 0)
    assert tier.store([(new_key(), view)]) == [True]


def test_a_redis_refusing_every_command_is_one_outage(
    tier: RedisTier, slots: Slots, raw: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """Batches whose every command is refused (OOM) do not show that Redis works: one
    outage, logged once, until a command succeeds (each batch used to end the outage it
    had started)."""
    caplog.set_level(logging.INFO, "tierkv.tiers.redis")
    view, _ = slots.random(100)
    raw.config_set("maxmemory-policy", "noeviction")
    raw.config_set("maxmemory", 1)
    try:
        for _ in range(10):
            assert tier.store([(new_key(), view), (new_key(), view)]) == [False, False]
    finally:
        raw.config_set("maxmemory", 0)
    assert tier.outage.outages == 1 and tier.outage.down
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    assert not [r for r in caplog.records if r.levelno == logging.INFO]
    assert tier.store([(new_key(), view)]) == [True]
    assert not tier.outage.down
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and "works again" in infos[0]


def test_a_batch_partly_refused_is_no_outage(
    tier: RedisTier, slots: Slots, raw: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """Stores whose batch Redis partly refused (out of memory after its first values) ended
    the outage the refusals started and started another, at every batch: the tier flapped
    (an outage counted each time). Refusals in a batch that otherwise worked are counted
    and logged, once a minute at most, without an outage."""
    caplog.set_level(logging.INFO, "tierkv.tiers.redis")
    view, _ = slots.random(100_000)
    raw.config_set("maxmemory-policy", "noeviction")
    mixed = 0
    try:
        for _ in range(5):
            raw.flushdb()
            used = int(raw.info("memory")["used_memory"])
            raw.config_set("maxmemory", used + 300_000)  # room for two or three values
            stored = tier.store([(new_key(), view) for _ in range(6)])
            mixed += any(stored) and not all(stored)
    finally:
        raw.config_set("maxmemory", 0)
    assert mixed == 5  # (each batch: some stored, the rest refused)
    assert tier.outage.outages == 0 and not tier.outage.down
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "refused for" in warnings[0] and "OOM" in warnings[0]
    assert tier.stats()["store_failed"] == 30 - tier.stats()["stored"] > 0


def test_refused_gets_count_once_as_errors(
    make_tier: Callable[..., RedisTier], raw: redis.Redis, redis_server: str
) -> None:
    """GETs Redis refused (an ACL user without those keys: NOPERM) were counted twice in
    ``errors``: once as refusals, once as the loads' ERROR statuses."""
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    user = f"limited-{uuid.uuid4().hex[:8]}"
    raw.execute_command("ACL", "SETUSER", user, "on", "nopass", f"~{prefix}a*", "+@all")
    try:
        url = redis_server.replace("redis://", f"redis://{user}@", 1)
        tier = make_tier(url=url, key_prefix=prefix)
        allowed, denied = bytes.fromhex("aa" * 32), bytes.fromhex("bb" * 32)
        views = [memoryview(bytearray(4096)) for _ in range(2)]
        statuses = tier.load([(allowed, views[0]), (denied, views[1])])
        assert statuses == [LoadStatus.MISSING, LoadStatus.ERROR]
        assert tier.load([(denied, views[1])]) == [LoadStatus.ERROR]  # every GET refused
        assert tier.stats()["errors"] == 2
    finally:
        raw.execute_command("ACL", "DELUSER", user)


def test_lost_server_gives_errors_and_the_tier_recovers(
    make_tier: Callable[..., RedisTier],
    redis_service: RedisServer,
    slots: Slots,
) -> None:
    tier = make_tier(socket_timeout=2.0, socket_connect_timeout=1.0, retries=1)
    keys, _ = store_random(tier, slots, [1000, 2000])
    before = tier.usage()
    assert before.objects == 2

    redis_service.stop()
    view, _ = slots.random(1000)
    assert tier.contains(keys) == [False, False]
    assert tier.presence(keys) == [None, None]  # not known absent: the check failed
    assert tier.store([(new_key(), view)]) == [False]
    statuses, _ = load_into(tier, slots, keys, [1000, 2000])
    assert statuses == [LoadStatus.ERROR, LoadStatus.ERROR]
    assert tier.delete(keys) == 0
    assert tier.usage() == before  # the last figures, not an exception
    assert tier.stats()["errors"] >= 5

    redis_service.start()  # same port, empty (no persistence)
    assert tier.contains(keys) == [False, False]
    assert tier.presence(keys) == [False, False]
    statuses, _ = load_into(tier, slots, keys, [1000, 2000])
    assert statuses == [LoadStatus.MISSING, LoadStatus.MISSING]
    new_keys, expected = store_random(tier, slots, [1000, 3000])
    statuses, views = load_into(tier, slots, new_keys, [1000, 3000])
    assert statuses == [LoadStatus.OK, LoadStatus.OK]
    assert [bytes(v) for v in views] == expected


def test_a_load_stops_asking_once_a_whole_pipeline_failed(
    make_tier: Callable[..., RedisTier],
    redis_service: RedisServer,
    slots: Slots,
) -> None:
    """A long load spans several pipelines; once one fails whole (Redis gone or stalled:
    each try waits out the socket timeout and its retries), the rest are errors without
    asking Redis again: a prefetch uses a load up to its first failure anyway."""
    tier = make_tier(max_pipeline_bytes=100 * 1024, socket_timeout=2.0, retries=1)
    sizes = [60 * 1024] * 6
    keys, _ = store_random(tier, slots, sizes)
    pipelines = 0
    on_socket = tier._on_socket

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal pipelines
        pipelines += 1
        return on_socket(*args, **kwargs)

    tier._on_socket = counted  # type: ignore[method-assign]
    assert load_into(tier, slots, keys, sizes)[0] == [LoadStatus.OK] * 6
    assert pipelines == 6  # one chunk per pipeline
    redis_service.stop()
    pipelines = 0
    assert load_into(tier, slots, keys, sizes)[0] == [LoadStatus.ERROR] * 6
    assert pipelines == 1
    redis_service.start()


def test_an_outage_is_logged_once_and_its_end_with_the_count(
    make_tier: Callable[..., RedisTier],
    redis_service: RedisServer,
    slots: Slots,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every batch fails while Redis is down, but the log says so once (WARNING), and once
    (INFO, with the failures counted) when Redis answers again."""
    tier = make_tier(socket_timeout=2.0, socket_connect_timeout=1.0, retries=0)
    keys, _ = store_random(tier, slots, [1000, 2000])
    caplog.set_level(logging.INFO, "tierkv.tiers.redis")
    redis_service.stop()
    batches = 50
    for _ in range(batches):
        assert tier.presence(keys) == [None, None]
        statuses, _ = load_into(tier, slots, keys, [1000, 2000])
        assert statuses == [LoadStatus.ERROR, LoadStatus.ERROR]
        view, _ = slots.random(100)
        assert tier.store([(new_key(), view)]) == [False]
    tier.usage()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "redis tier 127.0.0.1:" in warnings[0].getMessage()
    assert tier.outage.down

    redis_service.start()
    assert tier.presence(keys) == [False, False]
    assert not tier.outage.down
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and "works again" in infos[0]
    assert f"; {batches * 5 + 1} failures meanwhile" in infos[0]
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


@pytest.mark.processes
def test_server_down_at_creation_is_not_fatal(slots: Slots) -> None:
    from support.services import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    tier = create_tier("redis", {"url": url, "socket_connect_timeout": 1.0, "retries": 0})
    try:
        view, _ = slots.random(10)
        assert tier.store([(new_key(), view)]) == [False]
        assert tier.load([(new_key(), slots.take(10))]) == [LoadStatus.ERROR]
        assert tier.usage() == TierUsage(0, 0, 0)
    finally:
        tier.close()


# -- usage ---------------------------------------------------------------------------------
def test_usage_counts_this_prefix_only(
    make_tier: Callable[..., RedisTier],
    slots: Slots,
    raw: redis.Redis,
) -> None:
    tier = make_tier(key_prefix="usage*[x]?:")  # glob characters must not widen the scan
    other = make_tier(key_prefix="usage-other:")
    assert tier.usage() == TierUsage(0, 0, 0)
    sizes = [100, 2000, 30000]
    keys, _ = store_random(tier, slots, sizes)
    store_random(other, slots, [500])
    raw.set(b"usage-unrelated", b"x" * 100)
    usage = tier.usage()
    assert usage.objects == 3
    assert usage.bytes_used == sum(sizes) + 3 * HEADER_SIZE
    assert usage.capacity == 0
    raw.config_set("maxmemory", 512 << 20)
    try:
        assert tier.usage().capacity == 512 << 20
    finally:
        raw.config_set("maxmemory", 0)
    tier.delete(keys[:1])
    assert tier.usage().objects == 2


def test_usage_leaves_out_deployments_whose_prefix_extends_this_one(
    make_tier: Callable[..., RedisTier], slots: Slots, raw: redis.Redis
) -> None:
    """A SCAN of ``kv:*`` also finds ``kv:b:...``, another deployment's chunks: each was
    counted in both. Only keys named as the tier names its chunks count."""
    tier = make_tier(key_prefix="kv:")
    store_random(make_tier(key_prefix="kv:b:"), slots, [500])
    raw.set(b"kv:notes", b"x" * 100)
    raw.set(b"kv:" + b"0" * 64 + b":x", b"x" * 100)
    store_random(tier, slots, [100, 2000])
    assert tier.usage() == TierUsage(2, 2100 + 2 * HEADER_SIZE, 0)


# -- zero-copy packing ---------------------------------------------------------------------
def test_store_sends_the_pool_view_itself(slots: Slots) -> None:
    """The payload view reaches sendall as the same object; the bytes on the wire equal a
    standard RESP SET of the joined value."""
    key = new_key()
    view, data = slots.random(10_000)
    header = pack_header(key, view)
    command = ("SET", b"tierkv:" + key.hex().encode(), Concat(header, view), "EX", 30)
    conn = Connection(command_packer=GatherPacker())  # type: ignore[no-untyped-call]
    packed = conn.pack_commands([command, ("GET", b"k")])  # type: ignore[no-untyped-call]
    assert any(piece is view for piece in packed)
    reference = PythonRespSerializer(6000, lambda a: a.encode() if isinstance(a, str) else a)
    pieces = [
        *reference.pack("SET", b"tierkv:" + key.hex().encode(), header + data, "EX", b"30"),  # type: ignore[no-untyped-call]
        *reference.pack("GET", b"k"),  # type: ignore[no-untyped-call]
    ]
    expected = b"".join(bytes(p) for p in pieces)
    assert b"".join(bytes(p) for p in packed) == expected


def test_packer_handles_ordinary_commands() -> None:
    packer = GatherPacker()
    assert b"".join(packer.pack("CONFIG GET", "maxmemory")) == (
        b"*3\r\n$6\r\nCONFIG\r\n$3\r\nGET\r\n$9\r\nmaxmemory\r\n"
    )
    assert (
        b"".join(packer.pack("EXPIRE", b"k", 1.5))
        == b"*3\r\n$6\r\nEXPIRE\r\n$1\r\nk\r\n$3\r\n1.5\r\n"
    )
    with pytest.raises(redis.DataError):
        packer.pack("SET", b"k", True)
    with pytest.raises(redis.DataError):
        packer.pack("SET", b"k", object())


def test_a_load_receives_each_value_into_its_slot_without_a_copy(
    tier: RedisTier, slots: Slots
) -> None:
    """No Python object holds a value on the way (redis-py's reply would be a bytes object of
    the whole value): the peak of Python allocations during a load of 2 x 4 MiB stays far
    under one chunk. The same for a store, which sends the pool views themselves."""
    size = 4 << 20
    chunks = [slots.random(size) for _ in range(2)]
    keys = [new_key() for _ in chunks]
    tracemalloc.start()
    try:
        assert tier.store([(k, v) for k, (v, _) in zip(keys, chunks, strict=True)]) == [True] * 2
        stored_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        statuses, views = load_into(tier, slots, keys, [size, size])
        loaded_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert statuses == [LoadStatus.OK] * 2
    assert [bytes(v) for v in views] == [data for _, data in chunks]
    assert stored_peak < size // 8 and loaded_peak < size // 8, (stored_peak, loaded_peak)


def test_load_verified_hands_out_the_checksum_of_each_intact_chunk(
    tier: RedisTier, slots: Slots, raw: redis.Redis
) -> None:
    """Computed as the values landed, for the prefetcher to publish without hashing again."""
    keys, expected = store_random(tier, slots, [5000, 700_000, 64])
    value = raw.get(tier.redis_key(keys[2]))
    assert isinstance(value, bytes)
    raw.set(tier.redis_key(keys[2]), value[:-1] + bytes([value[-1] ^ 1]))
    missing = new_key()
    views = [slots.take(n) for n in (5000, 700_000, 64, 10)]
    statuses, sums = tier.load_verified(list(zip([*keys, missing], views, strict=True)))
    assert statuses == [LoadStatus.OK, LoadStatus.OK, LoadStatus.CORRUPT, LoadStatus.MISSING]
    assert sums == {keys[0]: checksum(expected[0]), keys[1]: checksum(expected[1])}


def test_a_connection_whose_replies_were_not_read_cleanly_is_not_reused(
    tier: RedisTier, slots: Slots, raw: redis.Redis
) -> None:
    """A reply that is not what the command gets (here: PING's, read as GET's) ends that
    connection's use; the tier's next batches run on a fresh one."""
    keys, expected = store_random(tier, slots, [1000])
    before = {c["id"] for c in raw.client_list()}
    with pytest.raises(redis.ConnectionError):
        tier._on_socket(
            [("PING",)],
            lambda r: r.value_into(memoryview(bytearray(64)), memoryview(bytearray(1))),
        )
    statuses, views = load_into(tier, slots, keys, [1000])
    assert statuses == [LoadStatus.OK] and bytes(views[0]) == expected[0]
    assert wait_for(lambda: len({c["id"] for c in raw.client_list()} - before) == 1)
    assert tier.stats().get("errors", 0) == 0  # nothing counted for the batches that worked


@pytest.mark.parametrize("kind", ["tls", "resp3"])
def test_tls_and_resp3_connections_round_trip(
    kind: str, redis_tls_server: str, redis_server: str, slots: Slots
) -> None:
    """Over TLS (no ``sendmsg`` on its sockets) and with RESP3 replies (their own null):
    stored, loaded byte-exact, a missing key missing, a corrupt value corrupt."""
    url = redis_tls_server if kind == "tls" else f"{redis_server}?protocol=3"
    tier = create_tier("redis", {"url": url, "key_prefix": f"{kind}-{uuid.uuid4().hex[:8]}:"})
    assert isinstance(tier, RedisTier)
    try:
        keys, expected = store_random(tier, slots, [3000, 1 << 20])
        tier._client.append(tier.redis_key(keys[0]), b"x")  # one byte too long
        statuses, views = load_into(tier, slots, [*keys, new_key()], [3000, 1 << 20, 64])
        assert statuses == [LoadStatus.CORRUPT, LoadStatus.OK, LoadStatus.MISSING]
        assert bytes(views[1]) == expected[1]
        assert tier.stats().get("errors", 0) == 0
    finally:
        tier.close()


def test_copies_is_documented(tier: RedisTier) -> None:
    assert "store: no copy" in tier.copies()
