"""The S3 tier against a real S3-compatible HTTP server (moto's server mode on loopback), with
slot views from a real shm pool: byte-exact batch round trips, contains, delete, namespace
separation, corrupted objects, a server that goes away (and a new one), usage, and the
zero-copy body and read paths."""

from __future__ import annotations

import contextlib
import http.client
import io
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from support import services
from support.services import S3Server, Slots, load_into, new_key, store_random
from tierkv.keys import Namespace, chunk_keys
from tierkv.tiers import LoadStatus, TierError, TierUsage, create_tier, s3_body, tier_names
from tierkv.tiers.records import HEADER_SIZE, pack_header
from tierkv.tiers.s3 import S3Tier
from tierkv.tiers.s3_body import RecordBody

# Fixtures of the real services (tests/conftest.py belongs to the server tests).
s3_service = services.s3_service
s3_server = services.s3_server
s3_service_private = services.s3_service_private
slots = services.slots

SIZES = [1, 100, 16 * 1024, 16 * 1024 + 1, 300 * 1024]


def new_bucket(server: S3Server) -> str:
    name = f"tierkv-{uuid.uuid4().hex[:12]}"
    server.client().create_bucket(Bucket=name)  # type: ignore[attr-defined]
    return name


@pytest.fixture
def make_tier(s3_service: S3Server) -> Iterator[Callable[..., S3Tier]]:
    tiers: list[S3Tier] = []

    def make(bucket: str | None = None, server: S3Server | None = None, **extra: Any) -> S3Tier:
        srv = server or s3_service
        options = srv.tier_options(bucket or new_bucket(srv), **extra)
        tier = create_tier("s3", options)
        assert isinstance(tier, S3Tier)
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close()


@pytest.fixture
def tier(make_tier: Callable[..., S3Tier]) -> S3Tier:
    return make_tier()


@pytest.fixture
def raw(s3_service: S3Server) -> Any:
    """A plain boto3 client to look at and tamper with what the tier stored."""
    return s3_service.client()


def get_body(raw: Any, tier: S3Tier, key: bytes) -> bytes:
    body: bytes = raw.get_object(Bucket=tier.bucket, Key=tier.object_key(key))["Body"].read()
    return body


def put_body(raw: Any, tier: S3Tier, key: bytes, body: bytes) -> None:
    raw.put_object(Bucket=tier.bucket, Key=tier.object_key(key), Body=body)


# -- registry and options ------------------------------------------------------------------
def test_registered(s3_server: str) -> None:
    assert "s3" in tier_names()


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"bucket": ""},
        {"bucket": "b", "max_concurrency": 0},
        {"bucket": "b", "min_rate": 0},
        {"bucket": "b", "access_key_id": "only-the-id"},
        {"bucket": "b", "no_such_option": 1},
    ],
)
def test_bad_options_are_tier_errors(options: dict[str, object]) -> None:
    with pytest.raises(TierError):
        create_tier("s3", options)


@pytest.mark.parametrize(
    "url",
    [
        "s3://AKID:S3cretKey@s3.example",
        # botocore's own refusal quoted the URL whole; a good one was in every outage line.
        "http://AKID:S3cretKey@bad host:9000",
        "http://AKID:S3cretKey@127.0.0.1:9000",
    ],
)
def test_a_bad_endpoint_url_is_reported_without_its_credentials(url: str) -> None:
    with pytest.raises(TierError, match="endpoint_url") as err:
        create_tier("s3", {"bucket": "b", "endpoint_url": url})
    assert "S3cretKey" not in str(err.value) and "AKID" not in str(err.value)


def test_create_bucket_option(s3_service: S3Server, make_tier: Callable[..., S3Tier]) -> None:
    name = f"tierkv-created-{uuid.uuid4().hex[:8]}"
    tier = make_tier(bucket=name, create_bucket=True)
    assert tier.store([(new_key(), memoryview(b"abc"))]) == [True]
    make_tier(bucket=name, create_bucket=True)  # already there: fine


# -- data path -----------------------------------------------------------------------------
def test_batch_round_trip_is_byte_exact(tier: S3Tier, slots: Slots) -> None:
    keys, expected = store_random(tier, slots, SIZES)
    statuses, views = load_into(tier, slots, keys, SIZES)
    assert statuses == [LoadStatus.OK] * len(SIZES)
    assert [bytes(v) for v in views] == expected
    assert tier.stats()["stored"] == len(SIZES)
    assert tier.stats()["loaded"] == len(SIZES)


def test_object_is_header_then_payload(tier: S3Tier, slots: Slots, raw: Any) -> None:
    keys, expected = store_random(tier, slots, [5000])
    key = keys[0]
    assert tier.object_key(key) == f"tierkv/{key[:16].hex()}/{key[16:].hex()}"
    assert get_body(raw, tier, key) == pack_header(key, expected[0]) + expected[0]


def test_contains(tier: S3Tier, slots: Slots) -> None:
    keys, _ = store_random(tier, slots, [10, 20])
    assert tier.contains([keys[0], new_key(), keys[1]]) == [True, False, True]
    assert tier.contains([]) == []


def test_missing(tier: S3Tier, slots: Slots) -> None:
    keys, expected = store_random(tier, slots, [128])
    statuses, views = load_into(tier, slots, [new_key(), keys[0]], [64, 128])
    assert statuses == [LoadStatus.MISSING, LoadStatus.OK]
    assert bytes(views[1]) == expected[0]
    assert tier.stats()["missing"] == 1


def test_delete(tier: S3Tier, slots: Slots) -> None:
    keys, _ = store_random(tier, slots, [10, 20, 30])
    assert tier.delete([keys[0], new_key(), keys[2]]) == 2
    assert tier.contains(keys) == [False, True, False]
    statuses, _ = load_into(tier, slots, keys, [10, 20, 30])
    assert statuses == [LoadStatus.MISSING, LoadStatus.OK, LoadStatus.MISSING]
    assert tier.delete([]) == 0
    assert tier.delete(keys) == 1


def test_namespaces_never_share_objects(tier: S3Tier, slots: Slots) -> None:
    base: dict[str, Any] = dict(
        model="m", kv_dtype="bfloat16", layout="2x256x8x128", world_size=2, rank=0
    )
    namespaces = [
        Namespace(**base),
        Namespace(**{**base, "model": "m2"}),
        Namespace(**{**base, "kv_dtype": "float16"}),
        Namespace(**{**base, "rank": 1}),
        Namespace(**base, tenant_salt="tenant-b"),
    ]
    keys = [chunk_keys(ns.digest(), list(range(512)))[1] for ns in namespaces]
    assert len({tier.object_key(k) for k in keys}) == len(keys)
    chunks = [slots.random(1024) for _ in keys]
    assert tier.store([(k, v) for k, (v, _) in zip(keys, chunks, strict=True)]) == [True] * 5
    statuses, views = load_into(tier, slots, keys, [1024] * 5)
    assert statuses == [LoadStatus.OK] * 5
    assert [bytes(v) for v in views] == [data for _, data in chunks]
    assert tier.delete([keys[0]]) == 1
    assert tier.contains(keys) == [False, True, True, True, True]


def test_loads_read_straight_into_the_slot(
    tier: S3Tier, slots: Slots, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast path (http.client readinto on the slot) is the one taken against a real HTTP
    server, and the connection is reused afterwards."""
    seen: list[bool] = []
    original = s3_body.http_response

    def spy(body: Any) -> http.client.HTTPResponse | None:
        fp = original(body)
        seen.append(fp is not None)
        return fp

    monkeypatch.setattr(s3_body, "http_response", spy)
    keys, expected = store_random(tier, slots, [100_000, 5])
    for _ in range(3):
        statuses, views = load_into(tier, slots, keys, [100_000, 5])
        assert statuses == [LoadStatus.OK, LoadStatus.OK]
        assert [bytes(v) for v in views] == expected
    assert seen == [True] * 6


def test_fallback_read_path(tier: S3Tier, slots: Slots, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the http.client response, StreamingBody.readinto does the same job."""
    monkeypatch.setattr(s3_body, "http_response", lambda body: None)
    keys, expected = store_random(tier, slots, [70_000, 3])
    for _ in range(2):
        statuses, views = load_into(tier, slots, keys, [70_000, 3])
        assert statuses == [LoadStatus.OK, LoadStatus.OK]
        assert [bytes(v) for v in views] == expected


# -- corruption ----------------------------------------------------------------------------
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


def _tamper(kind: str, value: bytes, other: bytes) -> bytes:
    cases: dict[str, Callable[[], bytes]] = {
        "garbage": lambda: os.urandom(len(value)),
        "flip_payload": lambda: value[:-1] + bytes([value[-1] ^ 0x01]),
        "flip_header_checksum": lambda: value[:63] + bytes([value[63] ^ 0x80]) + value[64:],
        "bad_magic": lambda: b"XXXX" + value[4:],
        "truncated": lambda: value[: len(value) // 2],
        "header_only": lambda: value[:HEADER_SIZE],
        "extended": lambda: value + b"\0",
        "empty": lambda: b"",
        "other_key": lambda: other,
    }
    return cases[kind]()


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_corrupted_objects_are_corrupt(tier: S3Tier, slots: Slots, raw: Any, kind: str) -> None:
    keys, expected = store_random(tier, slots, [4096, 4096, 4096])
    victim, other, intact = keys
    put_body(
        raw, tier, victim, _tamper(kind, get_body(raw, tier, victim), get_body(raw, tier, other))
    )
    statuses, views = load_into(tier, slots, [victim, intact], [4096, 4096])
    assert statuses == [LoadStatus.CORRUPT, LoadStatus.OK]
    assert bytes(views[1]) == expected[2]
    assert tier.stats()["corrupt"] == 1
    # Deleted by that one load: the next one is a miss, not the same bad object again.
    assert tier.contains(keys) == [False, True, True]
    assert tier.stats()["corrupt_deleted"] == 1
    # The connection pool is still healthy after an abandoned response.
    statuses, _ = load_into(tier, slots, [victim, intact], [4096, 4096])
    assert statuses == [LoadStatus.MISSING, LoadStatus.OK]


def test_a_corrupt_object_replaced_before_its_deletion_is_kept(
    tier: S3Tier, slots: Slots, raw: Any
) -> None:
    """The deletion is of the object a load read (its ETag): a fresh store is kept."""
    keys, expected = store_random(tier, slots, [4096])
    name = tier.object_key(keys[0])
    put_body(raw, tier, keys[0], b"garbage")
    read = raw.head_object(Bucket=tier.bucket, Key=name)["ETag"]  # what a load found
    put_body(raw, tier, keys[0], pack_header(keys[0], expected[0]) + expected[0])  # a store
    tier._drop_corrupt(keys[0], read)
    statuses, views = load_into(tier, slots, keys, [4096])
    assert statuses == [LoadStatus.OK] and bytes(views[0]) == expected[0]
    assert tier.stats().get("corrupt_deleted", 0) == 0
    # The object a load did read is deleted.
    tier._drop_corrupt(keys[0], raw.head_object(Bucket=tier.bucket, Key=name)["ETag"])
    assert tier.contains(keys) == [False] and tier.stats()["corrupt_deleted"] == 1


def test_loading_into_a_slot_of_another_size_is_corrupt_and_keeps_the_chunk(
    tier: S3Tier, slots: Slots
) -> None:
    keys, expected = store_random(tier, slots, [1000])
    statuses, _ = load_into(tier, slots, keys, [999])
    assert statuses == [LoadStatus.CORRUPT]
    statuses, views = load_into(tier, slots, keys, [1000])
    assert statuses == [LoadStatus.OK] and bytes(views[0]) == expected[0]


def test_a_body_sent_without_content_length_is_read_by_its_record(
    tier: S3Tier, slots: Slots, raw: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An endpoint may send a GET's body chunked, without Content-Length (valid HTTP): an
    intact record loads, one of another size is kept, one longer than its record is
    corrupt (and deleted), one cut short is an error (kept: the transfer may be at fault)."""
    get_object = tier._client.get_object

    def chunked(**kwargs: Any) -> Any:
        response = get_object(**kwargs)
        response.pop("ContentLength", None)
        return response

    monkeypatch.setattr(tier._client, "get_object", chunked)
    keys, expected = store_random(tier, slots, [4096, 4096, 4096, 4096])
    intact, resized, extended, truncated = keys
    put_body(raw, tier, extended, get_body(raw, tier, extended) + b"\0")
    put_body(raw, tier, truncated, get_body(raw, tier, truncated)[:-10])
    statuses, views = load_into(tier, slots, [intact, extended, truncated], [4096] * 3)
    assert statuses == [LoadStatus.OK, LoadStatus.CORRUPT, LoadStatus.ERROR]
    assert bytes(views[0]) == expected[0]
    assert load_into(tier, slots, [resized], [4000])[0] == [LoadStatus.CORRUPT]
    assert tier.contains(keys) == [True, True, False, True]
    assert load_into(tier, slots, [resized], [4096])[0] == [LoadStatus.OK]


def test_a_batch_returns_only_once_every_request_ended(tier: S3Tier) -> None:
    """A load's GETs write into pool slots its caller frees when the load returns: one
    request raising must not return (or raise) while the others still run."""
    ended: list[int] = []

    def request(i: int) -> int:
        if i == 0:
            raise RuntimeError("boom")
        time.sleep(0.2)  # still writing when the first one has failed
        ended.append(i)
        return i

    with pytest.raises(RuntimeError, match="boom"):
        tier._map(request, [0, 1, 2])
    assert sorted(ended) == [1, 2]
    assert tier._map(lambda i: i * 2, [1, 2, 3]) == [2, 4, 6]


# -- server failures -----------------------------------------------------------------------
class FaultProxy:
    """An HTTP proxy in front of the S3 server that breaks chosen requests (``mode``):
    "cut_get": a GET's headers (Content-Length included) go out whole, its body only half
    way, then the connection closes; "trickle_get": a GET's body goes out 64 bytes every 10
    ms (each read gets something well within any read_timeout), "trickle_chunked_get" as
    chunks of 64 bytes (Transfer-Encoding: chunked), "chunked_get" as chunks of 4 KiB at once;
    "slow_get": 16 KiB every 20
    ms (a slow link, about 800 KB/s); "fail_delete": DeleteObjects is answered 500; None:
    every request is passed on."""

    def __init__(self, upstream: S3Server) -> None:
        self.mode: str | None = None
        port = upstream.port
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def handle_one(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if proxy.mode == "fail_delete" and self.command == "POST" and "delete" in self.path:
                    self._send(500, b"<Error><Code>InternalError</Code></Error>", {})
                    return
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=body, headers=headers)
                reply = conn.getresponse()
                data = reply.read()
                conn.close()
                passed = {
                    k: v
                    for k, v in reply.getheaders()
                    if k.lower() not in ("transfer-encoding", "connection", "content-length")
                }
                if proxy.mode == "cut_get" and self.command == "GET" and reply.status == 200:
                    self.send_response(200)
                    for k, v in passed.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data[: len(data) // 2])
                    self.close_connection = True
                    return
                paced = {
                    "trickle_get": (64, 0.01),
                    "trickle_chunked_get": (64, 0.01),
                    "chunked_get": (4096, 0.0),
                    "slow_get": (16384, 0.02),
                }
                if proxy.mode in paced and self.command == "GET" and reply.status == 200:
                    chunked = proxy.mode in ("trickle_chunked_get", "chunked_get")
                    self.send_response(200)
                    for k, v in passed.items():
                        self.send_header(k, v)
                    if chunked:
                        self.send_header("Transfer-Encoding", "chunked")
                    else:
                        self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    step, pause = paced[proxy.mode]
                    with contextlib.suppress(OSError):  # the client gave up
                        for i in range(0, len(data), step):
                            if pause:
                                time.sleep(pause)
                            piece = data[i : i + step]
                            if chunked:
                                piece = b"%x\r\n%s\r\n" % (len(piece), piece)
                            self.wfile.write(piece)
                        if chunked:
                            self.wfile.write(b"0\r\n\r\n")
                    return
                self._send(reply.status, b"" if self.command == "HEAD" else data, passed)

            def _send(self, status: int, data: bytes, headers: dict[str, str]) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = handle_one

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint_url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(10)


@pytest.fixture
def faulty(
    s3_service: S3Server, make_tier: Callable[..., S3Tier]
) -> Iterator[tuple[FaultProxy, S3Tier]]:
    """A tier whose requests pass through a :class:`FaultProxy` (no retries)."""
    proxy = FaultProxy(s3_service)
    yield proxy, make_tier(endpoint_url=proxy.endpoint_url, retries=0, read_timeout=10)
    proxy.close()


def test_a_failed_load_counts_once_and_a_body_cut_short_ends_no_outage(
    faulty: tuple[FaultProxy, S3Tier], slots: Slots, caplog: pytest.LogCaptureFixture
) -> None:
    """A GET whose headers came but whose body was cut short is one error (its ERROR
    status; it was counted twice), and the endpoint is not taken to work again on the
    headers: one outage for all the failed loads, not one started and ended per GET."""
    proxy, tier = faulty
    keys, expected = store_random(tier, slots, [4096, 4096])
    caplog.set_level(logging.INFO, "tierkv.tiers.s3")
    proxy.mode = "cut_get"
    for _ in range(5):
        assert load_into(tier, slots, keys, [4096, 4096])[0] == [LoadStatus.ERROR] * 2
    assert tier.stats()["errors"] == 10
    assert tier.outage.outages == 1 and tier.outage.down
    assert not [r for r in caplog.records if r.levelno == logging.INFO]
    proxy.mode = None
    statuses, views = load_into(tier, slots, keys, [4096, 4096])
    assert statuses == [LoadStatus.OK] * 2 and [bytes(v) for v in views] == expected
    assert not tier.outage.down
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and "works again" in infos[0]


def test_a_trickling_body_fails_the_load_by_its_deadline(
    faulty: tuple[FaultProxy, S3Tier],
    make_tier: Callable[..., S3Tier],
    slots: Slots,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A body coming 64 bytes every 10 ms (16 KiB: 2.6 s), each read well within the read
    timeout (1 s), was read for as long as it lasted: at the default ``min_rate`` (256
    KiB/s) it must be whole within 1 + 0.07 s. The load fails (one error), the connection
    is dropped, and the next load over the same tier works. A slow but steady body (the
    same 16 KiB and 1 MiB at about 800 KB/s, 0.5 s read timeout, the default min_rate)
    still loads."""
    proxy, _ = faulty
    tier = make_tier(endpoint_url=proxy.endpoint_url, retries=0, read_timeout=1)
    keys, expected = store_random(tier, slots, [16 * 1024])
    proxy.mode = "trickle_get"
    assert load_into(tier, slots, keys, [16 * 1024])[0] == [LoadStatus.ERROR]
    assert tier.stats()["errors"] == 1
    proxy.mode = None
    statuses, views = load_into(tier, slots, keys, [16 * 1024])
    assert statuses == [LoadStatus.OK] and bytes(views[0]) == expected[0]
    # A chunked body (http.client's readinto filled the slot chunk after chunk in one
    # call), and one read through urllib3 (it filled the slot whole in one call): bounded.
    proxy.mode = "trickle_chunked_get"
    assert load_into(tier, slots, keys, [16 * 1024])[0] == [LoadStatus.ERROR]
    with monkeypatch.context() as patched:
        patched.setattr(s3_body, "http_response", lambda body: None)
        proxy.mode = "trickle_get"
        assert load_into(tier, slots, keys, [16 * 1024])[0] == [LoadStatus.ERROR]
    assert tier.stats()["errors"] == 3
    proxy.mode = "chunked_get"  # chunked, at once: every byte, read a receive at a time
    sizes = [1, 4095, 16 * 1024 + 1, 1 << 20]
    more, wanted = store_random(tier, slots, sizes)
    for _ in range(2):
        statuses, views = load_into(tier, slots, more, sizes)
        assert statuses == [LoadStatus.OK] * 4 and [bytes(v) for v in views] == wanted

    slow = make_tier(endpoint_url=proxy.endpoint_url, retries=0, read_timeout=0.5)
    sizes = [16 * 1024, 1 << 20]
    keys, expected = store_random(slow, slots, sizes)
    proxy.mode = "slow_get"
    statuses, views = load_into(slow, slots, keys, sizes)
    assert statuses == [LoadStatus.OK] * 2 and [bytes(v) for v in views] == expected


def test_delete_counts_only_the_objects_it_removed(
    faulty: tuple[FaultProxy, S3Tier], slots: Slots
) -> None:
    """DeleteObjects failing: none removed, whatever the HEADs before it found."""
    proxy, tier = faulty
    keys, _ = store_random(tier, slots, [100, 100, 100])
    proxy.mode = "fail_delete"
    assert tier.delete(keys) == 0
    assert tier.delete([keys[0], keys[0]]) == 0  # a key twice was subtracted twice: -1
    assert tier.contains(keys) == [True, True, True]
    proxy.mode = None
    assert tier.delete([*keys[:2], keys[0], new_key()]) == 2
    assert tier.contains(keys) == [False, False, True]


def test_lost_server_gives_errors_without_raising(
    make_tier: Callable[..., S3Tier], s3_service_private: S3Server, slots: Slots
) -> None:
    server = s3_service_private
    bucket = new_bucket(server)
    tier = make_tier(bucket=bucket, server=server, retries=0, connect_timeout=2, read_timeout=5)
    keys, _ = store_random(tier, slots, [1000, 2000])
    before = tier.usage()
    assert before.objects == 2

    server.stop()
    view, _ = slots.random(1000)
    assert tier.contains(keys) == [False, False]
    assert tier.presence(keys) == [None, None]  # not known absent: the check failed
    assert tier.store([(new_key(), view), (new_key(), view)]) == [False, False]
    statuses, _ = load_into(tier, slots, keys, [1000, 2000])
    assert statuses == [LoadStatus.ERROR, LoadStatus.ERROR]
    assert tier.delete(keys) == 0
    assert tier.usage() == before
    assert tier.stats()["errors"] >= 7

    # A new server on the same endpoint (moto keeps no state): the tier works again.
    server.start()
    server.client().create_bucket(Bucket=bucket)  # type: ignore[attr-defined]
    statuses, _ = load_into(tier, slots, keys, [1000, 2000])
    assert statuses == [LoadStatus.MISSING, LoadStatus.MISSING]
    assert tier.presence(keys) == [False, False]
    new_keys, expected = store_random(tier, slots, [1000, 3000])
    statuses, views = load_into(tier, slots, new_keys, [1000, 3000])
    assert statuses == [LoadStatus.OK, LoadStatus.OK]
    assert [bytes(v) for v in views] == expected


def test_an_outage_is_logged_once_and_its_end_with_the_count(
    make_tier: Callable[..., S3Tier],
    s3_service_private: S3Server,
    slots: Slots,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every request fails while the endpoint is down, but the log says so once (WARNING),
    and once (INFO, with the failures counted) when a request works again."""
    server = s3_service_private
    bucket = new_bucket(server)
    tier = make_tier(bucket=bucket, server=server, retries=0, connect_timeout=2, read_timeout=5)
    keys, _ = store_random(tier, slots, [1000, 2000])
    caplog.set_level(logging.INFO, "tierkv.tiers.s3")
    server.stop()
    batches = 20
    for _ in range(batches):
        assert tier.presence(keys) == [None, None]
        statuses, _ = load_into(tier, slots, keys, [1000, 2000])
        assert statuses == [LoadStatus.ERROR, LoadStatus.ERROR]
        view, _ = slots.random(100)
        assert tier.store([(new_key(), view)]) == [False]
    tier.usage()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert f"s3 tier {server.endpoint_url} bucket {bucket}" in warnings[0].getMessage()
    assert tier.outage.down

    server.start()
    assert tier.presence(keys) == [False, False]  # a new, empty server: 404s, it works
    assert not tier.outage.down
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and "works again" in infos[0]
    assert f"; {batches * 5 + 1} failures meanwhile" in infos[0]
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


def test_missing_bucket_gives_errors(make_tier: Callable[..., S3Tier], slots: Slots) -> None:
    tier = make_tier(bucket=f"tierkv-absent-{uuid.uuid4().hex[:8]}")
    view, _ = slots.random(10)
    assert tier.store([(new_key(), view)]) == [False]
    assert tier.load([(new_key(), slots.take(10))]) == [LoadStatus.ERROR]
    assert tier.usage() == TierUsage(0, 0, 0)


# -- usage ---------------------------------------------------------------------------------
def test_usage_counts_this_prefix_only(
    s3_service: S3Server, make_tier: Callable[..., S3Tier], slots: Slots, raw: Any
) -> None:
    bucket = new_bucket(s3_service)
    tier = make_tier(bucket=bucket, prefix="cache-a/")
    other = make_tier(bucket=bucket, prefix="cache-b/")
    assert tier.usage() == TierUsage(0, 0, 0)
    sizes = [100, 2000, 30000]
    keys, _ = store_random(tier, slots, sizes)
    store_random(other, slots, [500])
    raw.put_object(Bucket=bucket, Key="unrelated", Body=b"x" * 100)
    usage = tier.usage()
    assert usage == TierUsage(3, sum(sizes) + 3 * HEADER_SIZE, 0)
    tier.delete(keys[:1])
    assert tier.usage().objects == 2


def test_usage_leaves_out_deployments_whose_prefix_extends_this_one(
    s3_service: S3Server, make_tier: Callable[..., S3Tier], slots: Slots, raw: Any
) -> None:
    """A listing of the prefix ``kv`` also lists ``kv2/...`` and ``kv/other/...``, the
    chunks of other deployments: each was counted in both. Only names of the tier's own
    format count."""
    bucket = new_bucket(s3_service)
    tier = make_tier(bucket=bucket, prefix="kv")
    for prefix in ("kv2/", "kv/other/", "kv/"):
        store_random(make_tier(bucket=bucket, prefix=prefix), slots, [500])
    raw.put_object(Bucket=bucket, Key="kv-notes.txt", Body=b"x" * 100)
    keys, _ = store_random(tier, slots, [100, 2000])
    assert tier.usage() == TierUsage(2, 2100 + 2 * HEADER_SIZE, 0)
    assert tier.is_chunk_object(tier.object_key(keys[0]))
    assert not tier.is_chunk_object("kv" + tier.object_key(keys[0])[2:].upper())


# -- zero-copy body ------------------------------------------------------------------------
def test_record_body_reads_are_views_of_the_pool(slots: Slots) -> None:
    key = new_key()
    view, data = slots.random(50_000)
    header = pack_header(key, view)
    body = RecordBody(header, view)
    assert len(body) == HEADER_SIZE + 50_000
    pieces = []
    while piece := body.read(16384):
        pieces.append(piece)
    assert b"".join(bytes(p) for p in pieces) == header + data
    payload_pieces = pieces[1:]
    assert bytes(pieces[0]) == header  # a read never spans the header and the payload
    assert all(isinstance(p, memoryview) and p.obj is view.obj for p in payload_pieces)
    # botocore seeks back after hashing and asks for the remaining length.
    assert body.seek(0) == 0
    assert body.seek(10, io.SEEK_CUR) == 10
    assert len(body) == HEADER_SIZE + 50_000 - 10
    assert body.seek(0, io.SEEK_END) == HEADER_SIZE + 50_000
    assert body.read(100) == b""
    body.seek(HEADER_SIZE - 4)
    assert bytes(body.read()) == header[-4:] + data
    buf = bytearray(10)
    body.seek(0)
    assert body.readinto(buf) == 10 and bytes(buf) == header[:10]


def test_copies_is_documented(tier: S3Tier) -> None:
    assert "store: no copy" in tier.copies()
