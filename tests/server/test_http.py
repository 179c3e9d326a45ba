"""The HTTP server of a real `tierkv server` process: every endpoint, bad requests, tokens,
and /metrics counters that add up exactly after a known workload.

Servers bind a free port on loopback (or 0.0.0.0 with a token, reached through 127.0.0.1).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from support.clusterkit import TOKEN, start_node
from support.httputil import (
    declare_huge_body,
    free_port,
    get_json,
    raw_request,
    request,
    scrape,
    val,
    wait_for,
)
from support.raw_rpc import Raw
from support.servers import (
    CHUNK_BYTES,
    CHUNK_SHAPE,
    CHUNK_SIZE,
    ServerProcess,
    chunk_data,
    in_process_config,
    register,
)
from tierkv import keys
from tierkv import protocol as p
from tierkv.client import Client
from tierkv.pool import segment_exists

Servers = Callable[..., ServerProcess]


def start_http(
    server_factory: Servers, *extra: str, pool_size: str = "16MiB", host: str = "127.0.0.1"
) -> tuple[ServerProcess, str]:
    """A server with HTTP on a free port; returns it and its base URL (via 127.0.0.1)."""
    port = free_port()
    srv = server_factory(
        pool_size=pool_size, extra=["--http-host", host, "--http-port", str(port), *extra]
    )
    return srv, f"http://127.0.0.1:{port}"


def tokens_of(seed: int, chunks: int) -> list[int]:
    return list(range(seed * 100_000, seed * 100_000 + chunks * CHUNK_SIZE))


def store(client: Client, tokens: list[int]) -> None:
    n = len(tokens) // CHUNK_SIZE
    result = client.store(tokens, [chunk_data(tokens, i) for i in range(n)])
    assert not result.no_space, result


# -- endpoints ---------------------------------------------------------------------------
def test_every_endpoint_answers(server_factory: Servers) -> None:
    _srv, base = start_http(server_factory)
    health = request("GET", base + "/healthcheck")
    assert health.status == 200
    assert health.json() == {"status": "ok", "checks": {"rpc_loop": True, "eviction": True}}

    status = get_json(base + "/status")
    assert status["pool"]["capacity"] == 16 * 2**20 and status["pool"]["used"] == 0
    assert status["server"]["http_url"] == base and status["engines"] == []
    assert status["config"]["http_port"] == int(base.rsplit(":", 1)[1])
    assert set(status["lookups"]["misses"]) == {
        "absent", "evicted", "expired", "corrupt", "timeout", "error"
    }  # fmt: skip

    metrics = scrape(base)
    assert val(metrics, "tierkv_pool_capacity_bytes") == 16 * 2**20
    assert val(metrics, "tierkv_requests_total", type="lookup", outcome="ok") == 0
    # The server process made one full collection at start (then froze what it had).
    assert val(metrics, "tierkv_gc_collections_total", generation="2") >= 1
    assert val(metrics, "tierkv_gc_pause_max_seconds", generation="2") > 0

    page = request("GET", base + "/")
    assert page.status == 200 and page.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    html = page.text
    assert "<script>" in html and 'fetch("status"' in html
    # Self-contained: nothing loaded from anywhere else.
    for needle in ("http://", "https://", "src=", "<link", "@import"):
        assert needle not in html, needle

    cleared = request("POST", base + "/clear-cache")
    assert cleared.status == 200 and cleared.json() == {"removed": 0, "namespace": None}


def test_status_shows_engines_with_tenant_hashed_and_secrets_redacted(
    server_factory: Servers,
) -> None:
    srv, base = start_http(server_factory, "--auth-token", "tok-s3cret")
    with srv.client(auth_token="tok-s3cret") as client:
        register(client, model="model-a", tenant_salt="salt-of-tenant-x", name="engine-a")
        store(client, tokens_of(1, 2))
        client.lookup(tokens_of(1, 2), request_id="open")  # one open session
        reply = request("GET", base + "/status")
        assert reply.status == 200
        assert b"salt-of-tenant-x" not in reply.body and b"tok-s3cret" not in reply.body
        st = reply.json()
        [engine] = st["engines"]
        reg = client.registration
        assert reg is not None
        assert engine["name"] == "engine-a" and engine["model"] == "model-a"
        assert engine["dtype"] == "float32" and engine["layout"] == "float32:2x256x16:t1"
        assert (engine["rank"], engine["world_size"], engine["role"]) == (0, 1, "worker")
        assert engine["namespace"] == reg.namespace.hex()
        assert engine["tenant"].startswith("sha256:") and len(engine["tenant"]) == 19
        assert engine["sessions"] == 1 and engine["chunk_bytes"] == CHUNK_BYTES
        assert 0 <= engine["idle_s"] <= engine["registered_s"]
        assert st["config"]["auth_token"] == "***"
        assert st["objects"]["total"] == 2 and st["objects"]["read_locked"] == 2
        assert st["locks"]["sessions"] == 1
        # No tiers: nothing is pinned for a write-behind, and no engine exited.
        locks = st["locks"]
        assert (locks["pinned_objects"], locks["pin_leases"], locks["clients_reaped"]) == (0, 0, 0)
        # Another tenant with the same model: a different hash.
        with srv.client(auth_token="tok-s3cret") as other:
            register(other, model="model-a", tenant_salt="salt-of-tenant-y")
            tenants = {e["tenant"] for e in get_json(base + "/status")["engines"]}
            assert len(tenants) == 2


def test_clear_cache_everything_or_one_namespace(server_factory: Servers) -> None:
    srv, base = start_http(server_factory)
    with srv.client() as a, srv.client() as b:
        register(a, model="model-a")
        register(b, model="model-b")
        store(a, tokens_of(1, 3))
        store(b, tokens_of(2, 2))
        ns_b = next(
            e["namespace"] for e in get_json(base + "/status")["engines"] if e["model"] == "model-b"
        )
        reply = request("POST", base + "/clear-cache", b'{"namespace": "%s"}' % ns_b.encode())
        assert reply.status == 200 and reply.json() == {"removed": 2, "namespace": ns_b}
        assert a.lookup(tokens_of(1, 3)).hits == 3
        assert b.lookup(tokens_of(2, 2)).hits == 0
        reply = request("POST", base + "/clear-cache", b"{}", {"Content-Type": "application/json"})
        assert reply.status == 200 and reply.json()["removed"] == 3
        assert a.lookup(tokens_of(1, 3)).hits == 0
        assert get_json(base + "/status")["pool"]["used"] == 0


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "words"),
    [
        ("GET", "/clear-cache", None, 405, ["method not allowed"]),
        ("POST", "/status", b"{}", 405, ["method not allowed"]),
        ("DELETE", "/metrics", None, 405, ["method not allowed"]),
        ("PUT", "/healthcheck", b"", 405, ["method not allowed"]),
        ("GET", "/no-such-page", None, 404, ["not found"]),
        ("POST", "/clear-cache", b"{not json", 400, ["not valid json"]),
        ("POST", "/clear-cache", b"\xff\xfe", 400, ["not valid json"]),
        ("POST", "/clear-cache", b"[1, 2]", 400, ["json object"]),
        ("POST", "/clear-cache", b'{"tiers": true}', 400, ["unknown field", "tiers"]),
        ("POST", "/clear-cache", b'{"namespace": "abc"}', 400, ["32 hex digits"]),
        ("POST", "/clear-cache", b'{"namespace": "' + b"z" * 32 + b'"}', 400, ["hex digits"]),
        ("POST", "/clear-cache", b'{"namespace": 7}', 400, ["hex digits"]),
        # bytes.fromhex skips whitespace: 32 spaces named every namespace, "45" and 30
        # spaces every one starting with 0x45.
        ("POST", "/clear-cache", b'{"namespace": "' + b" " * 32 + b'"}', 400, ["hex digits"]),
        ("POST", "/clear-cache", b'{"namespace": "45' + b" " * 30 + b'"}', 400, ["hex digits"]),
        ("POST", "/clear-cache", b" \n", 200, ["removed"]),  # blank: no body
        ("POST", "/clear-cache", b'{"x": "' + b"y" * 5000 + b'"}', 413, ["larger than 4096"]),
    ],
)
def test_bad_requests_get_clear_errors(
    server_factory: Servers,
    method: str,
    path: str,
    body: bytes | None,
    status: int,
    words: list[str],
) -> None:
    srv, base = start_http(server_factory)
    with srv.client() as client:
        register(client)
        store(client, tokens_of(1, 2))
        reply = request(method, base + path, body)
        assert reply.status == status, reply.body
        if status == 405:
            assert "GET" in reply.headers["allow"] or "POST" in reply.headers["allow"]
        if status >= 400:
            assert set(reply.json()) == {"error"}
        for word in words:
            assert word in reply.text.lower(), reply.text
        if status != 200:  # a refused clear removed nothing
            assert client.lookup(tokens_of(1, 2)).hits == 2
        assert request("GET", base + "/healthcheck").status == 200


def test_admin_token_required_beyond_loopback(server_factory: Servers) -> None:
    _srv, base = start_http(server_factory, "--auth-token", "let-me-in", host="0.0.0.0")
    missing = request("POST", base + "/clear-cache")
    assert missing.status == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert "authorization" in missing.text.lower()
    for header in ("Bearer wrong", "Bearer ", "Basic let-me-in", "let-me-in", "Bearer let-me-in!"):
        reply = request("POST", base + "/clear-cache", headers={"Authorization": header})
        assert reply.status == 403, header
    ok = request("POST", base + "/clear-cache", headers={"Authorization": "Bearer let-me-in"})
    assert ok.status == 200 and ok.json()["removed"] == 0
    ok = request("POST", base + "/clear-cache", headers={"authorization": "bearer let-me-in"})
    assert ok.status == 200
    # Reading needs no token.
    for path in ("/", "/status", "/metrics", "/healthcheck"):
        assert request("GET", base + path).status == 200, path


def test_with_a_token_clearing_needs_it_on_loopback_too(server_factory: Servers) -> None:
    srv, base = start_http(server_factory, "--auth-token", "tok")
    with srv.client(auth_token="tok") as client:
        register(client)
        store(client, tokens_of(1, 2))
        missing = request("POST", base + "/clear-cache")
        assert missing.status == 401 and "auth_token" in missing.text
        bad = {"Authorization": "Bearer nope"}
        assert request("POST", base + "/clear-cache", headers=bad).status == 403
        assert client.lookup(tokens_of(1, 2)).hits == 2  # refused: nothing removed
        good = {"Authorization": "Bearer tok"}
        assert request("POST", base + "/clear-cache", headers=good).json()["removed"] == 2


@pytest.mark.parametrize("token", ["", "tok"])
def test_a_foreign_origin_is_refused_whatever_the_token(
    server_factory: Servers, token: str
) -> None:
    """A web page of another site (or a sandboxed one, Origin: null) in a browser on the
    node posts without a preflight: refused with and without a token; the server's own
    origin is fine."""
    srv, base = start_http(server_factory, *(["--auth-token", token] if token else []))
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    with srv.client(auth_token=token) as client:
        register(client)
        store(client, tokens_of(1, 2))
        for origin in ("http://evil.example", "null", base.replace("127.0.0.1", "localhost"),
                       base + "0", "https://" + base.split("://")[1]):  # fmt: skip
            headers = {**auth, "Origin": origin, "Content-Type": "text/plain"}
            reply = request("POST", base + "/clear-cache", headers=headers)
            assert reply.status == 403 and "cross-origin" in reply.text, origin
        assert client.lookup(tokens_of(1, 2)).hits == 2
        own = request("POST", base + "/clear-cache", headers={**auth, "Origin": base})
        assert own.status == 200 and own.json()["removed"] == 2
    # Without a token, loopback clients without an Origin (curl, scripts) may clear.
    if not token:
        assert request("POST", base + "/clear-cache").status == 200


def run_server(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    instance = uuid.uuid4().hex[:10]
    cmd = [
        sys.executable, "-m", "tierkv.cli", "server",
        "--instance", instance,
        "--runtime-dir", str(tmp_path / instance),
        "--pool-name", f"tierkv-test-{instance}",
        "--pool-size", "4MiB",
        *args,
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert not segment_exists(f"tierkv-test-{instance}")
    assert not (tmp_path / instance / "rpc.sock").exists()
    return done


@pytest.mark.processes
@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--http-host", "0.0.0.0"], ["http_host", "auth_token", "loopback"]),
        (["--http-host", "::", "--http-port", "8000"], ["http_host", "auth_token"]),
        (["--http-port", "70000"], ["http_port", "0 to disable"]),
        (["--http-port", "-1"], ["http_port"]),
        (["--http-port", "many"], ["http_port"]),
    ],
)
def test_bad_http_configuration_is_refused(
    tmp_path: Path, args: list[str], words: list[str]
) -> None:
    done = run_server(tmp_path, *args)
    assert done.returncode == 2, done.stderr
    for word in words:
        assert word in done.stderr, done.stderr


@pytest.mark.processes
def test_http_port_in_use_fails_start_up_cleanly(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_server(tmp_path, "--http-port", str(port))
    assert done.returncode == 2
    assert f"cannot serve HTTP on 127.0.0.1:{port}" in done.stderr
    assert "--http-port" in done.stderr


def test_port_zero_disables_http(server: ServerProcess) -> None:
    assert "HTTP on" not in server.log()
    with server.client() as client:
        assert client.stats().http_url == ""


# -- metrics -----------------------------------------------------------------------------
def test_metrics_add_up_after_a_known_workload(server_factory: Servers) -> None:
    """4 MiB pool = 128 chunks. A (4 chunks) is stored, looked up with 2 more chunks (4
    hits, 2 absent) and retrieved; B (3 chunks, never stored) misses absent; E's store is
    prepared and never committed, expires (write_ttl 1 s) and misses as expired; D (112
    chunks) pushes the pool past its high watermark, eviction takes the oldest (A first),
    and A misses as evicted. Plus one undecodable message and one bad lookup."""
    srv, base = start_http(server_factory, "--write-ttl", "1", pool_size="4MiB")
    a, b, e = tokens_of(1, 4), tokens_of(2, 3), tokens_of(3, 2)
    raw = Raw(srv.endpoint)
    with srv.client() as client:
        register(client)
        token = client._token()
        store(client, a)
        store(client, a)  # all present: a prepare, no commit
        assert client.lookup(a + tokens_of(9, 2), request_id="l1").hits == 4
        out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(6)]
        assert client.retrieve(request_id="l1", out=out).retrieved == [0, 1, 2, 3]
        assert client.lookup(b).hits == 0
        slots = raw.call(p.PrepareStore(1, token, p.ChunkSelector(tokens=keys.pack_tokens(e))))
        assert isinstance(slots, p.StoreSlots) and len(slots.slots) == 2
        wait_for(
            "the uncommitted store to expire",
            lambda: get_json(base + "/status")["locks"]["expired_write_slots"] == 2,
        )
        assert client.lookup(e, request_id="l3").hits == 0
        for batch in range(14):
            store(client, tokens_of(100 + batch, 8))
        wait_for("an eviction", lambda: get_json(base + "/status")["evictions"]["objects"] >= 4)
        assert client.lookup(a).hits == 0
        bad = raw.call(p.Lookup(2, token, p.ChunkSelector()))
        assert isinstance(bad, p.Error) and bad.code is p.ErrorCode.BAD_REQUEST
        garbage = raw.call(b"\x93\xa3not a request")
        assert isinstance(garbage, p.Error) and garbage.code is p.ErrorCode.BAD_REQUEST

        status = get_json(base + "/status")
        m = scrape(base)
        raw.close()
    # Lookups: 15 chunks looked up.
    lookups = {
        (lbl.get("tier") or lbl.get("reason")): v
        for (name, labels), v in m.items()
        if name == "tierkv_lookup_chunks_total"
        for lbl in [dict(labels)]
    }
    assert lookups == {
        "pool": 4, "absent": 5, "expired": 2, "evicted": 4, "corrupt": 0, "timeout": 0, "error": 0
    }  # fmt: skip
    assert val(m, "tierkv_lookup_chunks_total", result="hit", tier="pool") == 4
    assert val(m, "tierkv_lookup_chunks_total", result="miss", reason="evicted") == 4
    assert status["lookups"] == {
        "hits": {"pool": 4},
        "misses": {"absent": 5, "evicted": 4, "expired": 2, "corrupt": 0, "timeout": 0, "error": 0},
    }
    # Requests by type and outcome, and as many latency observations.
    expected = {
        ("register", "ok"): 1,
        ("prepare_store", "ok"): 17,
        ("commit_store", "ok"): 15,
        ("lookup", "ok"): 4,
        ("lookup", "bad_request"): 1,
        ("prepare_retrieve", "ok"): 1,
        ("finish_retrieve", "ok"): 1,
        ("malformed", "bad_request"): 1,
    }
    requests = {
        (dict(labels)["type"], dict(labels)["outcome"]): v
        for (name, labels), v in m.items()
        if name == "tierkv_requests_total" and v
    }
    # The fixture's start-up probes: a PING not answered within 0.5 s (a server still
    # starting on a loaded machine) is sent again, and both are answered.
    assert requests.pop(("ping", "ok")) >= 1
    assert requests == expected
    for kind in ("lookup", "prepare_store", "commit_store", "prepare_retrieve"):
        count = sum(v for (t, _), v in expected.items() if t == kind)
        assert val(m, "tierkv_request_duration_seconds_count", type=kind) == count
        assert val(m, "tierkv_request_duration_seconds_bucket", type=kind, le="+Inf") == count
        assert val(m, "tierkv_request_duration_seconds_sum", type=kind) > 0
    # Bytes and chunks through the pool.
    assert val(m, "tierkv_stored_chunks_total", tier="pool") == 116
    assert val(m, "tierkv_stored_bytes_total", tier="pool") == 116 * CHUNK_BYTES
    assert val(m, "tierkv_retrieved_chunks_total", tier="pool") == 4
    assert val(m, "tierkv_retrieved_bytes_total", tier="pool") == 4 * CHUNK_BYTES
    # Lock expiries, evictions, pool and objects agree with /status.
    assert val(m, "tierkv_lock_expiries_total", kind="write") == 2
    assert val(m, "tierkv_lock_expiries_total", kind="read") == 0
    ev = status["evictions"]
    assert val(m, "tierkv_evictions_total") == ev["objects"] >= 4
    assert val(m, "tierkv_evicted_bytes_total") == ev["bytes"] == ev["objects"] * CHUNK_BYTES
    assert sum(e["objects"] for e in ev["recent"]) == ev["objects"]
    assert val(m, "tierkv_pool_capacity_bytes") == status["pool"]["capacity"] == 4 * 2**20
    assert val(m, "tierkv_pool_used_bytes") == status["pool"]["used"]
    objects = sum(val(m, "tierkv_objects", state=s) for s in ("writing", "ready", "read_locked"))
    assert objects == status["objects"]["total"] == 116 - ev["objects"]
    assert val(m, "tierkv_engines") == 1
    assert val(m, "tierkv_build_info", version=status["server"]["version"]) == 1


def test_metrics_count_tier_hits_and_corrupt_misses(
    server_factory: Servers, tmp_path: Path
) -> None:
    """T (6 chunks) is written behind to a disk tier and cleared from the pool; chunk 3's
    file is damaged. A lookup loads 3 chunks from disk (hits there) and misses 3 as corrupt;
    the next finds those 3 in the pool and misses the rest as absent (the damaged file is
    gone)."""
    directory = tmp_path / "disk"
    srv, base = start_http(server_factory, "--tier", f"disk:path={directory}")
    t = tokens_of(5, 6)
    with srv.client() as client:
        register(client)
        reg = client.registration
        assert reg is not None
        store(client, t)
        wait_for(
            "write-behind",
            lambda: (
                (s := get_json(base + "/status"))["tiers"][0]["written_chunks"] == 6
                and s["tiering"]["write_behind_queued"] == 0
            ),
        )
        assert request("POST", base + "/clear-cache").json()["removed"] == 6
        key3 = keys.chunk_keys(reg.namespace, keys.pack_tokens(t), CHUNK_SIZE)[3]
        [path] = directory.glob(f"*/*/{key3.hex()}.kv")
        data = bytearray(path.read_bytes())
        data[64 + 100] ^= 0xFF
        path.write_bytes(bytes(data))

        assert client.lookup(t, request_id="t1", wait=True).hits == 3
        out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(6)]
        assert client.retrieve(request_id="t1", out=out).retrieved == [0, 1, 2]
        assert client.lookup(t, request_id="t2", wait=True).hits == 3
        status = get_json(base + "/status")
        m = scrape(base)
    assert status["lookups"]["hits"] == {"pool": 3, "disk": 3}
    assert {k: v for k, v in status["lookups"]["misses"].items() if v} == {
        "corrupt": 3,
        "absent": 3,
    }
    assert val(m, "tierkv_lookup_chunks_total", result="hit", tier="disk") == 3
    assert val(m, "tierkv_lookup_chunks_total", result="hit", tier="pool") == 3
    assert val(m, "tierkv_lookup_chunks_total", result="miss", reason="corrupt") == 3
    assert val(m, "tierkv_stored_bytes_total", tier="disk") == 6 * CHUNK_BYTES
    assert val(m, "tierkv_stored_chunks_total", tier="disk") == 6
    assert val(m, "tierkv_retrieved_bytes_total", tier="disk") == 3 * CHUNK_BYTES
    assert val(m, "tierkv_retrieved_chunks_total", tier="pool") == 3
    assert val(m, "tierkv_tier_load_failures_total", tier="disk", reason="corrupt") == 1
    assert val(m, "tierkv_tier_objects", tier="disk") == status["tiers"][0]["objects"] == 5
    assert val(m, "tierkv_prefetches_total", outcome="started") == 2
    assert val(m, "tierkv_prefetches_inflight") == 0


# -- health ------------------------------------------------------------------------------
@pytest.mark.processes  # its server's HTTP front is a process
def test_healthcheck_fails_when_a_part_stops(tmp_path: Path) -> None:
    """An in-process server: stopping its eviction thread turns the health check to 503,
    and stopping the RPC loop ends the HTTP server with it."""
    from tierkv.server.wiring import Server

    port = free_port()
    cfg = in_process_config(tmp_path, pool_size="4MiB", http_port=port)
    base = f"http://127.0.0.1:{port}"
    server = Server(cfg).start_background()
    try:
        wait_for("HTTP", lambda: _status_code(base + "/healthcheck") == 200)
        server.eviction.stop()
        reply = request("GET", base + "/healthcheck")
        assert reply.status == 503
        assert reply.json() == {
            "status": "unhealthy",
            "checks": {"rpc_loop": True, "eviction": False},
        }
    finally:
        server.stop()
    assert _status_code(base + "/healthcheck") is None  # nobody listens any more
    assert not segment_exists(cfg.resolved_pool_name)


def _status_code(url: str) -> int | None:
    try:
        return request("GET", url, timeout=2).status
    except OSError:
        return None


def test_a_client_gone_in_the_middle_of_a_body_is_a_quiet_event(server_factory: Servers) -> None:
    srv, base = start_http(server_factory)
    port = int(base.rsplit(":", 1)[1])
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(
                b"POST /clear-cache HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Length: 4000\r\n\r\n0123456789"  # within the limit: read
            )
    wait_for(
        "three quiet disconnects in the log",
        lambda: srv.log().count("the client disconnected in the body") == 3,
    )
    assert request("GET", base + "/status").status == 200
    text = srv.log()
    assert "Traceback" not in text and " ERROR " not in text, text[-2000:]


def test_a_declared_huge_body_gets_an_early_413_on_every_write(server_factory: Servers) -> None:
    port = free_port()  # a ring server: /lookup too
    node = start_node(server_factory, [], seed_self=True, extra=["--http-port", str(port)])
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for method, path in (
        ("POST", "/clear-cache"),
        ("POST", "/lookup"),
        ("PUT", "/quota/t"),
        ("PUT", "/quota/config"),
    ):
        status, doc = declare_huge_body(base, method, path, auth)
        assert status == 413 and "larger than" in doc["error"], (path, status, doc)
    assert declare_huge_body(base, "POST", "/lookup")[0] == 401  # authorization comes first
    # A body of no declared length is cut off at the limit as it arrives.
    chunked = {**auth, "Transfer-Encoding": "chunked"}
    body = b"%x\r\n%s\r\n0\r\n\r\n" % (5000, b"y" * 5000)
    status, doc = raw_request(base, "POST", "/clear-cache", chunked, body)
    assert status == 413 and "larger than 4096" in doc["error"], doc
    assert request("GET", base + "/healthcheck").status == 200
    assert get_json(base + "/quota/t")["source"] == "default"  # nothing was set
    text = node.server.log()
    assert "Traceback" not in text and " ERROR " not in text, text[-2000:]
