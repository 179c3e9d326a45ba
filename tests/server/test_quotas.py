"""Tenant quotas on real `tierkv server` processes: soft quotas evict only the tenant's own
chunks, hard quotas refuse and count, live changes, restarts, the HTTP API's bad input, the
reserved tenant names, and the per-tenant figures in /status and Prometheus."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from support.httputil import get_json, request, scrape, val, wait_for
from support.quotas import put, start, store, tenant_client, tokens_of
from support.servers import CHUNK_BYTES, ServerProcess, register
from tierkv.client import ServerError
from tierkv.tenants import DEFAULT_TENANT, tenant_tag

Servers = Callable[..., ServerProcess]
MiB = 2**20


def usage(base: str, tenant: str) -> int:
    return int(get_json(f"{base}/quota/{tenant}")["usage"]["pool"])


def test_a_tenant_over_its_quota_evicts_only_its_own_chunks(server_factory: Servers) -> None:
    srv, base = start(server_factory, "--quota", "greedy=2MiB")
    greedy, calm = tenant_client(srv, "greedy"), tenant_client(srv, "calm")
    calm_tokens = tokens_of(1, 100)
    assert store(calm, calm_tokens) == 0
    for seed in range(10, 14):  # 4 x 50 chunks = 6.25 MiB, three times its quota
        assert store(greedy, tokens_of(seed, 50)) == 0
    wait_for("greedy back within its quota", lambda: usage(base, "greedy") <= 2 * MiB)

    assert calm.lookup(calm_tokens).hits == 100  # every chunk of the other tenant still hits
    assert usage(base, "calm") == 100 * CHUNK_BYTES
    greedy_doc, calm_doc = get_json(base + "/quota/greedy"), get_json(base + "/quota/calm")
    assert greedy_doc["limit"] == 2 * MiB and greedy_doc["source"] == "quota"
    assert greedy_doc["evictions"] == 200 - usage(base, "greedy") // CHUNK_BYTES
    assert calm_doc["evictions"] == 0 and calm_doc["limit"] is None
    # Its most recent chunks are the ones it kept.
    assert greedy.lookup(tokens_of(13, 50)).hits > 0
    assert greedy.lookup(tokens_of(10, 50)).hits == 0


def test_hard_mode_refuses_stores_beyond_the_quota_and_counts_them(
    server_factory: Servers,
) -> None:
    srv, base = start(server_factory, "--quota-mode", "hard", "--quota", "small=1MiB")
    small, other = tenant_client(srv, "small"), tenant_client(srv, "other")
    assert store(small, tokens_of(1, 48)) == 16  # 32 chunks of 32 KiB fit in 1 MiB
    assert store(other, tokens_of(2, 48)) == 0  # the default: unlimited
    doc = get_json(base + "/quota/small")
    assert doc["usage"]["pool"] == 1 * MiB
    assert doc["refused_chunks"] == 16 and doc["refused_bytes"] == 16 * CHUNK_BYTES
    assert doc["evictions"] == 0
    assert small.lookup(tokens_of(1, 48)).hits == 32
    rows = {r["tag"]: r for r in get_json(base + "/status")["tenants"]["rows"]}
    assert rows[tenant_tag("small")]["refused_chunks"] == 16
    assert rows[tenant_tag("small")]["name"] == "small"  # named by its quota
    assert rows[tenant_tag("other")]["name"] == ""  # no quota: the salt stays hidden
    assert rows[tenant_tag("other")]["refused_chunks"] == 0


def test_a_default_limit_applies_to_every_tenant_without_a_quota(
    server_factory: Servers,
) -> None:
    srv, base = start(server_factory, "--quota-mode", "hard", "--default-quota", "512KiB")
    assert get_json(base + "/quota/config") == {
        "default_limit": 512 * 1024,
        "default_limits": {"pool": 512 * 1024, "disk": "unlimited"},
        "mode": "hard",
    }
    for tenant in ("x", "y"):
        assert store(tenant_client(srv, tenant), tokens_of(3, 20)) == 4
        doc = get_json(f"{base}/quota/{tenant}")
        assert doc["source"] == "default" and doc["usage"]["pool"] == 512 * 1024


def test_a_quota_changed_live_takes_effect(server_factory: Servers) -> None:
    srv, base = start(server_factory)
    client = tenant_client(srv, "acme")
    assert store(client, tokens_of(1, 100)) == 0
    assert put(base, "/quota/acme", {"limit": "1MiB"}).status == 200
    wait_for("acme evicted down to 1 MiB", lambda: usage(base, "acme") <= 1 * MiB)
    assert usage(base, "acme") > 1 * MiB - 2 * CHUNK_BYTES  # only what the quota demands
    # LMCache's form, in GiB; and the quota removed again.
    assert put(base, "/quota/acme", {"limit_gb": 0.5}).json()["limit"] == 2**29
    assert request("DELETE", base + "/quota/acme").status == 200
    assert get_json(base + "/quota/acme")["limit"] is None
    assert request("DELETE", base + "/quota/acme").status == 404


def test_quotas_survive_a_restart(server_factory: Servers, tmp_path: Path) -> None:
    quota_file = tmp_path / "quotas.json"
    flags = ["--quota-file", str(quota_file), "--quota", "configured=4MiB", "--quota", "b=1MiB"]
    srv, base = start(server_factory, *flags)
    assert put(base, "/quota/live", {"limit": 3 * MiB}).status == 200
    assert put(base, "/quota/b", {"limit": "2MiB"}).status == 200
    assert request("DELETE", base + "/quota/configured").status == 200
    assert put(base, "/quota/config", {"default_limit": "8MiB", "mode": "hard"}).status == 200
    srv.stop()

    srv, base = start(server_factory, *flags)
    listing = get_json(base + "/quota")
    limits = {t["tenant"]: t["limit"] for t in listing["tenants"] if t["tenant"]}
    assert limits == {"live": 3 * MiB, "b": 2 * MiB}  # the removal of "configured" kept too
    assert (listing["default_limit"], listing["mode"]) == (8 * MiB, "hard")


def test_the_default_tenant_and_cache_salts(server_factory: Servers) -> None:
    srv, base = start(server_factory, "--quota", f"{DEFAULT_TENANT}=1MiB")
    anonymous = tenant_client(srv, "")
    assert store(anonymous, tokens_of(1, 8)) == 0
    assert store(anonymous, tokens_of(2, 4), salt="user-7") == 0  # a cache salt: its tenant
    assert usage(base, DEFAULT_TENANT) == 8 * CHUNK_BYTES
    assert usage(base, "user-7") == 4 * CHUNK_BYTES
    # An engine with a tenant salt keeps salted requests in its tenant.
    tenant = tenant_client(srv, "acme")
    assert store(tenant, tokens_of(3, 2), salt="user-7") == 0
    assert usage(base, "acme") == 2 * CHUNK_BYTES
    assert usage(base, "user-7") == 4 * CHUNK_BYTES
    # The reserved names cannot be salts.
    with pytest.raises(ServerError, match="reserved"):
        register(srv.client(), tenant_salt=DEFAULT_TENANT)
    with pytest.raises(ServerError, match="reserved"):
        anonymous.lookup(tokens_of(1, 1), salt="~other")


def test_per_tenant_figures_in_prometheus_by_tag_only(server_factory: Servers) -> None:
    srv, base = start(server_factory, "--quota", "secret-salt=1MiB")
    client = tenant_client(srv, "secret-salt")
    assert store(client, tokens_of(1, 40)) == 0
    wait_for("the quota pass", lambda: usage(base, "secret-salt") <= MiB)
    text = request("GET", base + "/metrics").text
    assert "secret-salt" not in text
    samples = scrape(base)
    tag = tenant_tag("secret-salt")
    assert val(samples, "tierkv_tenant_used_bytes", tenant=tag) == usage(base, "secret-salt")
    assert val(samples, "tierkv_tenant_limit_bytes", tenant=tag) == MiB
    assert val(samples, "tierkv_tenant_evictions_total", tenant=tag) == 8


BAD_PUTS = [
    ("/quota/t", {"limit": -1}, ">= 0"),
    ("/quota/t", {"limit_gb": -0.5}, "finite number >= 0"),
    ("/quota/t", b'{"limit_gb": NaN}', "finite number"),
    ("/quota/t", b'{"limit_gb": Infinity}', "finite number"),
    ("/quota/t", {"limit_gb": 1e300}, "limit_gb must be at most 8589934591 GiB"),
    ("/quota/t", {"limit_gb": 10**30}, "limit_gb must be at most"),
    ("/quota/t", {"limit": 1.5}, "whole"),
    ("/quota/t", {"limit": 2**63}, "limit must be at most 9223372036854775807 bytes"),
    ("/quota/t", {"limit": "9" * 400}, "is more than 9223372036854775807 bytes"),
    ("/quota/t", {"limit": "9223372036854775808"}, "is more than 9223372036854775807 bytes"),
    ("/quota/t", {"limits": {"disk": 1e30}}, "limits.disk must be at most"),
    ("/quota/t", {"limit": "lots"}, "not a size"),
    ("/quota/t", {"limit": "1.5"}, "not a whole number of bytes"),
    ("/quota/t", {"limit": "\u0661\u0662\u0663"}, "not a size"),  # Arabic-Indic digits
    ("/quota/t", {"limit": True}, "number of bytes"),
    ("/quota/t", {"limit": "1GiB", "limit_gb": 1}, "exactly one"),
    ("/quota/t", {"limits": {"redis": "1GiB"}}, "unknown tier 'redis' for quotas: Redis keeps"),
    ("/quota/t", {"limits": {"s3": 1}}, "unknown tier 's3' for quotas: S3 keeps"),
    ("/quota/t", {"limits": {"tape": 1}}, "unknown tier 'tape': quotas limit pool, disk"),
    ("/quota/t", {"limits": {"disk": -1}}, "limits.disk must be >= 0"),
    ("/quota/t", {"limits": {"disk": float("nan")}}, "limits.disk must be a whole, finite"),
    ("/quota/t", {"limits": {"disk": "lots"}}, "limits.disk: "),
    ("/quota/~other", {"limits": {"disk": "1GiB"}}, "takes no disk quota"),
    ("/quota/t", {"limits": "1GiB"}, "tier -> size"),
    ("/quota/t", {"limits": {}}, "tier -> size"),
    ("/quota/t", {"size": 1}, "unknown field"),
    ("/quota/t", b"{not json", "not valid JSON"),
    ("/quota/t", b"[1]", "JSON object"),
    ("/quota/config", {"default_limit": -5}, ">= 0"),
    ("/quota/config", {"default_limit": "NaN"}, "not a size"),
    ("/quota/config", {"mode": "medium"}, "soft"),
    ("/quota/config", {}, "JSON object"),
    ("/quota/config", {"default_limit_gb": float("inf")}, "finite"),
    ("/quota/config", {"default_limit_gb": 1e308}, "default_limit_gb must be at most"),
    ("/quota/config", b'{"default_limit_gb": NaN}', "default_limit_gb must be a finite"),
    ("/quota/config", {"default_limit_gb": -1}, "default_limit_gb must be a finite number >= 0"),
    ("/quota/config", {"default_limit": 1e300}, "default limit must be at most"),
    ("/quota/config", {"default_limits": {"disk": -1}}, "default_limits.disk must be >= 0"),
    ("/quota/config", {"default_limits": {"redis": 1}}, "unknown tier 'redis'"),
    ("/quota/config", {"default_limits": []}, "tier -> size"),
    ("/quota/config", {"default_limit": 1, "default_limits": {"disk": 1}}, "give one of"),
]


def test_bad_quota_requests_get_a_400_and_change_nothing(server_factory: Servers) -> None:
    srv, base = start(server_factory, "--quota", "t=1MiB")
    for path, doc, message in BAD_PUTS:
        reply = put(base, path, doc)
        assert reply.status == 400, (path, doc, reply.status, reply.body)
        assert message in reply.json()["error"], (doc, reply.json())
    assert get_json(base + "/quota/t")["limit"] == MiB
    assert get_json(base + "/quota/config")["default_limits"] == {
        "pool": "unlimited",
        "disk": "unlimited",
    }
    assert get_json(base + "/quota/config")["mode"] == "soft"
    too_long = "x" * 1025
    assert put(base, f"/quota/{too_long}", {"limit": 1}).status == 400
    assert request("GET", f"{base}/quota/{too_long}").status == 400
    assert request("POST", base + "/quota/t", b"{}").status == 405
    # "=" escapes a name: the tenant whose salt is "config".
    assert put(base, "/quota/=config", {"limit": 7}).json()["tenant"] == "config"
    assert get_json(base + "/quota/=config")["limit"] == 7
    # DELETE /quota/config is about the configuration too, as GET and PUT are: refused.
    assert request("DELETE", base + "/quota/config").status == 405
    assert get_json(base + "/quota/=config")["limit"] == 7
    assert request("DELETE", base + "/quota/=config").status == 200
    assert get_json(base + "/quota/=config")["limit"] is None
    assert "default_limit" in get_json(base + "/quota/config")
    assert srv.proc is not None and srv.proc.poll() is None
    assert "Traceback" not in srv.log() and " ERROR " not in srv.log()


def test_quota_writes_need_the_token_and_the_same_origin(server_factory: Servers) -> None:
    _, base = start(server_factory, "--auth-token", "s3cret")
    assert put(base, "/quota/t", {"limit": 1}).status == 401
    assert put(base, "/quota/t", {"limit": 1}, {"Authorization": "Bearer nope"}).status == 403
    assert request("DELETE", base + "/quota/t").status == 401
    assert put(base, "/quota/config", {"mode": "hard"}).status == 401
    good = {"Authorization": "Bearer s3cret"}
    foreign = {**good, "Origin": "http://evil.example"}
    assert put(base, "/quota/t", {"limit": 1}, foreign).status == 403
    assert put(base, "/quota/t", {"limit": 1}, good).status == 200
    assert get_json(base + "/quota/t")["limit"] == 1  # reads stay open
    assert request("DELETE", base + "/quota/t", headers=good).status == 200


def test_the_quota_command_does_the_same_over_http(server_factory: Servers) -> None:
    _, base = start(server_factory, "--auth-token", "tok")

    def cli(*args: str, token: str = "tok") -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "tierkv.cli", "quota", "--url", base, *args]
        env = {**os.environ, "TIERKV_AUTH_TOKEN": token}
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)

    assert cli("set", "a/b", "3MiB").returncode == 0  # any salt, "/" included
    assert cli("set", "config", "1024").returncode == 0  # a tenant named like the endpoint
    assert get_json(base + "/quota/a/b")["limit"] == 3 * MiB
    assert json.loads(cli("get", "config").stdout)["limit"] == 1024
    done = cli("config", "--default", "1GiB", "--mode", "hard")
    assert json.loads(done.stdout)["default_limit"] == 2**30
    assert json.loads(done.stdout)["mode"] == "hard"
    assert cli("set", "a/b", "5MiB", "--tier", "disk").returncode == 0
    assert get_json(base + "/quota/a/b")["limits"] == {"pool": 3 * MiB, "disk": 5 * MiB}
    done = cli("config", "--default-disk", "2GiB", "--default", "unlimited")
    assert json.loads(done.stdout)["default_limits"] == {"pool": "unlimited", "disk": 2**31}
    listing = json.loads(cli("list").stdout)
    assert {t["tenant"] for t in listing["tenants"]} == {"a/b", "config"}
    assert cli("delete", "config").returncode == 0
    missing = cli("delete", "config")
    assert missing.returncode == 1 and "404" in missing.stderr
    bad = cli("set", "a/b", "lots")
    assert bad.returncode == 1 and "400" in bad.stderr and "not a size" in bad.stderr
    refused = cli("set", "a/b", "1GiB", token="wrong")
    assert refused.returncode == 1 and "403" in refused.stderr
    assert get_json(base + "/quota/a/b")["limit"] == 3 * MiB


def test_a_tenant_name_in_the_path_is_decoded_once(server_factory: Servers) -> None:
    """The HTTP front passes the path on as the client sent it: "team%2F..%2Fvictim" names
    the tenant "team/../victim" (decoded once, by the server), never "victim"; a path with
    literal dot segments is refused."""
    _, base = start(server_factory)
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps({"limit": 4096}).encode()
    headers = {"Content-Type": "application/json"}

    def send(method: str, path: str) -> tuple[int, dict[str, object]]:
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            conn.request(method, path, body if method == "PUT" else None, headers)
            reply = conn.getresponse()
            return reply.status, json.loads(reply.read())
        finally:
            conn.close()

    status, doc = send("PUT", "/quota/team%2F..%2Fvictim")
    assert (status, doc["tenant"]) == (200, "team/../victim")
    status, doc = send("PUT", "/quota/acme%2Fprod%09x")
    assert (status, doc["tenant"]) == (200, "acme/prod\tx")
    for path in ("/quota/team/../victim", "/quota/./victim"):
        status, doc = send("PUT", path)
        assert status == 400 and "segments" in str(doc["error"]), (path, doc)
    status, doc = send("GET", "/quota?x=1")  # a query string still reaches the server
    assert status == 200
    names = {t["tenant"] for t in get_json(base + "/quota")["tenants"]}
    assert {"team/../victim", "acme/prod\tx"} <= names and "victim" not in names
