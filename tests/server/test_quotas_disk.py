"""Tenant quotas on the disk tier, on real `tierkv server` processes with a real disk tier
directory: a tenant over its disk quota loses its own oldest files while the other
tenant's all stay (and hit from disk); hard mode keeps a tenant's write-behind within its
quota and counts what it refused; a quota changed live applies at once; a restart keeps the
quotas and rebuilds usage per tenant (unattributed until the engine registers); the
figures in /status and Prometheus."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from support.httputil import get_json, request, scrape, val, wait_for
from support.quotas import put, start, store, tenant_client, tokens_of
from support.servers import CHUNK_BYTES, ServerProcess
from tierkv.client import Client
from tierkv.tenants import OTHER_TENANT, tenant_tag
from tierkv.tiers.records import HEADER_SIZE

Servers = Callable[..., ServerProcess]
MiB = 2**20
FILE = CHUNK_BYTES + HEADER_SIZE  # what one chunk takes on disk


def disk(path: Path) -> list[str]:
    return ["--tier", f"disk:path={path},capacity=256MiB"]


def doc(base: str, tenant: str) -> Any:
    return get_json(f"{base}/quota/{tenant}")


def disk_used(base: str, tenant: str) -> int:
    return int(doc(base, tenant)["usage"]["disk"])


def written(client: Client) -> int:
    """Chunks the write-behind has written to the disk tier so far."""
    return client.stats().tiers[0].written_chunks


def hits_from_disk(client: Client, tokens: list[int], rid: str) -> int:
    """Lookup hits once the prefetch from the tier is done (the pool was cleared)."""
    hits = client.lookup(tokens, request_id=rid, wait=True).hits
    client.end_session(rid)
    return hits


def test_over_its_disk_quota_a_tenant_loses_only_its_own_oldest_files(
    server_factory: Servers, tmp_path: Path
) -> None:
    srv, base = start(server_factory, *disk(tmp_path / "d"), "--disk-quota", "greedy=1MiB")
    greedy, calm = tenant_client(srv, "greedy"), tenant_client(srv, "calm")
    calm_tokens = tokens_of(1, 60)
    assert store(calm, calm_tokens) == 0
    for i, seed in enumerate(range(10, 14)):  # 4 x 20 chunks, 2.5 times its disk quota
        assert store(greedy, tokens_of(seed, 20)) == 0
        # One batch on disk before the next: their order on disk is their order here.
        wait_for("the write-behind", lambda i=i: written(calm) == 80 + 20 * i)
    wait_for("greedy within its disk quota", lambda: disk_used(base, "greedy") <= MiB)

    kept = MiB // FILE
    greedy_doc, calm_doc = doc(base, "greedy"), doc(base, "calm")
    assert greedy_doc["usage"]["disk"] == kept * FILE  # only what the quota demands
    assert greedy_doc["limits"] == {"pool": None, "disk": MiB}
    assert greedy_doc["tiers"]["disk"]["evictions"] == 80 - kept
    assert greedy_doc["tiers"]["disk"]["source"] == "quota"
    assert calm_doc["usage"]["disk"] == 60 * FILE and calm_doc["tiers"]["disk"]["evictions"] == 0
    assert greedy_doc["usage"]["pool"] == 80 * CHUNK_BYTES  # the pool has no quota here

    for client in (greedy, calm):
        client.clear()  # the pool only: what hits now comes from disk
    assert hits_from_disk(calm, calm_tokens, "calm") == 60  # every one of the other's
    assert hits_from_disk(greedy, tokens_of(13, 20), "newest") == 20  # its newest kept
    assert hits_from_disk(greedy, tokens_of(10, 20), "oldest") == 0  # its oldest gone

    rows = {r["tag"]: r for r in get_json(base + "/status")["tenants"]["rows"]}
    row = rows[tenant_tag("greedy")]["tiers"]["disk"]
    assert (row["limit"], row["evictions"]) == (MiB, 80 - kept)
    assert rows[tenant_tag("calm")]["tiers"]["disk"]["limit"] == -1
    samples = scrape(base)
    tag = tenant_tag("greedy")
    assert val(samples, "tierkv_tenant_tier_limit_bytes", tenant=tag, tier="disk") == MiB
    assert val(samples, "tierkv_tenant_tier_evictions_total", tenant=tag, tier="disk") == 80 - kept


def test_hard_mode_keeps_the_write_behind_within_the_disk_quota(
    server_factory: Servers, tmp_path: Path
) -> None:
    srv, base = start(
        server_factory, *disk(tmp_path / "d"), "--quota-mode", "hard", "--disk-quota", "small=1MiB"
    )
    small, other = tenant_client(srv, "small"), tenant_client(srv, "other")
    assert store(small, tokens_of(1, 48)) == 0  # the pool takes them all (no pool quota)
    assert store(other, tokens_of(2, 48)) == 0
    kept = MiB // FILE
    wait_for("the write-behind", lambda: written(other) == 48 + kept)
    tiers = doc(base, "small")["tiers"]["disk"]
    assert tiers["used"] == kept * FILE and tiers["evictions"] == 0
    assert tiers["refused_chunks"] == 48 - kept and tiers["refused_bytes"] == (48 - kept) * FILE
    assert disk_used(base, "other") == 48 * FILE
    assert small.stats().tiers[0].write_failures == 0  # refused is not failed
    samples = scrape(base)
    refused = val(
        samples, "tierkv_tenant_tier_refused_chunks_total", tenant=tenant_tag("small"), tier="disk"
    )
    assert refused == 48 - kept


def test_a_live_disk_quota_applies_and_survives_a_restart(
    server_factory: Servers, tmp_path: Path
) -> None:
    flags = [*disk(tmp_path / "d"), "--quota-file", str(tmp_path / "quotas.json")]
    srv, base = start(server_factory, *flags)
    acme = tenant_client(srv, "acme")
    assert store(acme, tokens_of(1, 20)) == 0
    wait_for("the write-behind", lambda: written(acme) == 20)
    assert store(acme, tokens_of(2, 10)) == 0  # newer: kept by the quota below
    wait_for("the write-behind", lambda: written(acme) == 30)
    assert disk_used(base, "acme") == 30 * FILE

    reply = put(base, "/quota/acme", {"limits": {"disk": "512KiB"}})
    assert reply.status == 200 and reply.json()["limits"] == {"pool": None, "disk": 512 * 1024}
    kept = 512 * 1024 // FILE
    wait_for("acme within its new disk quota", lambda: disk_used(base, "acme") == kept * FILE)
    assert put(base, "/quota/acme", {"limit": "8MiB"}).status == 200  # the pool's only
    assert doc(base, "acme")["limits"] == {"pool": 8 * MiB, "disk": 512 * 1024}
    change = {"default_limits": {"disk": "4MiB", "pool": "unlimited"}}
    assert put(base, "/quota/config", change).status == 200
    srv.stop()

    srv, base = start(server_factory, *flags)
    assert doc(base, "acme")["limits"] == {"pool": 8 * MiB, "disk": 512 * 1024}
    assert get_json(base + "/quota/config")["default_limits"] == {
        "pool": "unlimited",
        "disk": 4 * MiB,
    }
    # Files are indexed at start, but whose they are is known once their engine registers:
    # until then they are ~other's, which no disk quota limits.
    assert disk_used(base, "acme") == 0
    other = doc(base, OTHER_TENANT)
    assert other["usage"]["disk"] == kept * FILE and other["limits"]["disk"] is None
    acme = tenant_client(srv, "acme")
    assert disk_used(base, "acme") == kept * FILE and disk_used(base, OTHER_TENANT) == 0
    assert hits_from_disk(acme, tokens_of(2, 10), "after-restart") == 10
    # Removing its quota: the default disk quota (4 MiB) applies; nothing is evicted.
    assert request("DELETE", base + "/quota/acme").status == 200
    assert doc(base, "acme")["tiers"]["disk"] == {
        "limit": 4 * MiB,
        "source": "default",
        "used": kept * FILE,
        "evictions": 0,
        "evicted_bytes": 0,
        "refused_chunks": 0,
        "refused_bytes": 0,
    }


def test_salted_chunks_looked_up_back_from_disk_count_for_their_tenant(
    server_factory: Servers, tmp_path: Path
) -> None:
    """A cache salt's namespace is bound to its tenant when a chunk is stored under it, or
    when a lookup finds chunks of it (in the pool, or brought in by its prefetch): after a
    restart the engine that only looks up under the salt has its chunks counted for its
    tenant, not ~other's."""
    flags = disk(tmp_path / "d")
    srv, base = start(server_factory, *flags)
    acme = tenant_client(srv, "acme")
    assert store(acme, tokens_of(3, 8), salt="s1") == 0
    wait_for("the write-behind", lambda: written(acme) == 8)
    srv.stop()

    srv, base = start(server_factory, *flags)
    acme = tenant_client(srv, "acme")
    hits = acme.lookup(tokens_of(3, 8), request_id="back", wait=True, salt="s1").hits
    acme.end_session("back")
    assert hits == 8
    assert doc(base, "acme")["usage"]["pool"] == 8 * CHUNK_BYTES
    assert doc(base, OTHER_TENANT)["usage"]["pool"] == 0
