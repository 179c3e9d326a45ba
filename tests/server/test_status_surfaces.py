"""One status, three surfaces: the RPC STATS reply (what `tierkv status` prints), GET /status
(the dashboard) and GET /metrics agree figure by figure after a scripted workload that
leaves objects in every state and sessions of every kind open."""

from __future__ import annotations

from collections.abc import Callable

from support.httputil import free_port, get_json, scrape, val
from support.servers import CHUNK_BYTES, CHUNK_SIZE, ServerProcess, chunk_data, register
from tierkv import keys
from tierkv import protocol as p


def test_rpc_stats_status_and_metrics_show_the_same_figures(
    server_factory: Callable[..., ServerProcess],
) -> None:
    port = free_port()
    srv = server_factory(pool_size="16MiB", extra=["--http-port", str(port)])
    base = f"http://127.0.0.1:{port}"
    worker, scheduler = srv.client(), srv.client()
    reg = register(worker, engine_id="e1", name="w0")
    scheduler.register_scheduler("test-model", "e1", name="sched")
    tokens = list(range(6 * CHUNK_SIZE))
    assert len(worker.store(tokens, [chunk_data(tokens, i) for i in range(6)]).stored) == 6
    missing = list(range(10**6, 10**6 + 2 * CHUNK_SIZE))
    assert worker.lookup(missing).hits == 0  # two misses, absent
    # Open, and left open: a worker session locking 2 chunks, a scheduler's group session
    # (with its rank's session) locking 3, and a store reservation of 1 chunk.
    assert worker.lookup(tokens[: 2 * CHUNK_SIZE], request_id="mine").hits == 2
    assert scheduler.lookup(tokens[: 3 * CHUNK_SIZE], request_id="group").hits == 3
    extra = keys.pack_tokens(range(2 * 10**6, 2 * 10**6 + CHUNK_SIZE))
    reservation = worker._channel.call(p.PrepareStore(0, reg.client, p.ChunkSelector(tokens=extra)))
    assert isinstance(reservation, p.StoreSlots) and len(reservation.slots) == 1

    rpc = worker.stats()
    doc = get_json(base + "/status")
    m = scrape(base)

    # The workload's own figures, so that agreement is not agreement on zeros.
    assert (rpc.objects, rpc.writing, rpc.read_locked, rpc.ready) == (7, 1, 3, 3)
    assert rpc.sessions == 3  # the worker's own, the group, the group's rank session
    assert rpc.clients == 2 and rpc.write_leases == 1
    assert rpc.lookup_misses["absent"] == 2

    objects = doc["objects"]
    assert (rpc.objects, rpc.writing, rpc.ready, rpc.read_locked) == (
        objects["total"],
        objects["writing"],
        objects["ready"],
        objects["read_locked"],
    )
    for state in ("writing", "ready", "read_locked"):
        assert val(m, "tierkv_objects", state=state) == objects[state]
    locks = doc["locks"]
    assert rpc.sessions == locks["sessions"] == val(m, "tierkv_lookup_sessions")
    assert rpc.sessions == sum(e.sessions for e in rpc.engines)
    assert rpc.sessions == sum(e["sessions"] for e in doc["engines"])
    assert rpc.clients == len(doc["engines"]) == val(m, "tierkv_engines")
    assert rpc.write_leases == locks["write_leases"] == val(m, "tierkv_leases", kind="write")
    assert rpc.read_leases == locks["read_leases"] == val(m, "tierkv_leases", kind="read")
    assert rpc.pinned == locks["pinned_objects"] == val(m, "tierkv_pinned_objects")
    assert rpc.used == doc["pool"]["used"] == val(m, "tierkv_pool_used_bytes")
    assert rpc.capacity == doc["pool"]["capacity"] == val(m, "tierkv_pool_capacity_bytes")
    assert rpc.evictions == doc["evictions"]["objects"] == val(m, "tierkv_evictions_total")
    for tier, n in rpc.lookup_hits.items():
        assert n == doc["lookups"]["hits"][tier]
        assert n == val(m, "tierkv_lookup_chunks_total", result="hit", tier=tier)
    for reason, n in rpc.lookup_misses.items():
        assert n == doc["lookups"]["misses"][reason]
        assert n == val(m, "tierkv_lookup_chunks_total", result="miss", reason=reason)
    pool = doc["transfers"]["stored"]["pool"]
    assert rpc.stored_bytes == pool["bytes"] == 6 * CHUNK_BYTES
    assert rpc.stored_bytes == val(m, "tierkv_stored_bytes_total", tier="pool")
    assert rpc.stored_chunks == pool["chunks"] == val(m, "tierkv_stored_chunks_total", tier="pool")
    # Requests: the STATS request itself is counted after its reply was built.
    for kind, n in rpc.requests.items():
        assert n == sum(doc["requests"][kind].values())
    assert doc["requests"]["stats"] == {"ok": 1}
    worker._channel.call(p.AbortStore(0, reg.client, reservation.lease))
