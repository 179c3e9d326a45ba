"""Cluster tests with real servers on loopback: every server its own process, pool, runtime
dir and ports; short heartbeat/TTL options. Asynchronous effects are awaited by bounded
polling, never by timing assertions."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from support.browser import Figures, run_chromium
from support.clusterkit import (
    TOKEN,
    Node,
    call,
    converged,
    free_ports,
    rows_of,
    start_node,
    status,
    wait_for,
)
from support.control_wire import RawControl
from support.kvops import fetch, store, tokens_for
from support.servers import CHUNK_SHAPE, ServerProcess, chunk_data, register
from tierkv.checksums import checksum
from tierkv.cluster import messages as m
from tierkv.cluster.auth import ControlSigner
from tierkv.cluster.transport import Served, TcpTransport
from tierkv.tiers.base import LoadStatus

Factory = Callable[..., ServerProcess]


def located(nodes: list[Node], keys: list[bytes]) -> list[set[str]]:
    """Holders of each key, asked of every node's shard (a test's view of the directory)."""
    return [{holder for holder, _ in entries} for entries in entries_of(nodes, keys)]


def entries_of(nodes: list[Node], keys: list[bytes]) -> list[set[tuple[str, m.Where]]]:
    """(holder, where) entries of each key, from every node's shard."""
    out: list[set[tuple[str, m.Where]]] = [set() for _ in keys]
    for node in nodes:
        reply = call(node.addr, m.Resolve(0, keys))
        assert isinstance(reply, m.Resolved)
        for pos, h, where in rows_of(reply):
            out[pos].add((reply.holders[h], m.Where(where)))
    return out


def peer_tier(node: Node) -> dict[str, object]:
    with node.client() as c:
        stats = c.stats()
    tier = next(t for t in stats.tiers if t.name == "peer")
    return {
        "loaded": tier.loaded_chunks,
        "failures": dict(tier.load_failures),
        "published": tier.written_chunks,
    }


@pytest.fixture
def trio(server_factory: Factory) -> list[Node]:
    """Three servers: A seeds itself, B and C join through A."""
    a = start_node(server_factory, [], seed_self=True)
    b = start_node(server_factory, [a.port], seed_self=True)
    c = start_node(server_factory, [a.port], seed_self=True)
    nodes = [a, b, c]
    wait_for(lambda: converged(nodes))
    return nodes


def test_chunk_stored_on_a_is_retrieved_byte_exact_on_b(trio: list[Node]) -> None:
    a, b, c = trio
    tokens = tokens_for(1, 6)
    keys = store(a, tokens, 6)
    wait_for(lambda: all(holders == {a.node_id} for holders in located(trio, keys)))
    hits, retrieved = fetch(b, tokens, 6)
    assert hits == 6 and retrieved == list(range(6))
    figures = peer_tier(b)
    assert figures["loaded"] == 6 and not figures["failures"]
    assert peer_tier(a)["published"] == 6
    # B's copies are local now, and published: C fetches from A or B.
    wait_for(lambda: all(holders == {a.node_id, b.node_id} for holders in located(trio, keys)))
    assert fetch(c, tokens, 6, rid="c") == (6, list(range(6)))

    def sent(node: Node) -> int:
        return sum(int(p["chunks"]) for p in status(node)["transport"]["sent"].values())

    wait_for(lambda: sent(a) + sent(b) == 12 and sent(a) >= 6)
    # The same figures reach engines (RPC stats) and `tierkv status`.
    with b.client() as cb:
        figures = cb.stats().cluster
    assert figures["node_id"] == b.node_id
    assert figures["transport"]["received"][a.node_id]["chunks"] == 6
    cmd = [sys.executable, "-m", "tierkv.cli", "status", "--endpoint", b.server.endpoint]
    out = subprocess.run(
        [*cmd, "--auth-token", TOKEN], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    assert f"cluster   node {b.node_id}: 3 members" in out
    assert f"from {a.node_id}: 6 chunks" in out


def test_a_fetched_chunk_is_published_and_outlives_its_first_holder(trio: list[Node]) -> None:
    a, b, c = trio
    tokens = tokens_for(11, 5)
    keys = store(a, tokens, 5)
    wait_for(lambda: all(holders == {a.node_id} for holders in located(trio, keys)))
    assert fetch(b, tokens, 5) == (5, list(range(5)))
    wait_for(lambda: all(holders == {a.node_id, b.node_id} for holders in located(trio, keys)))
    assert status(b)["published"] == 5  # published with the checksums verified on arrival
    a.server.kill()  # the first holder is gone; entries still name it until it is declared dead
    hits, retrieved = fetch(c, tokens, 5)
    assert hits == 5 and retrieved == list(range(5))  # served by B (A, if tried, fails fast)


def test_a_clear_withdraws_the_nodes_entries(trio: list[Node]) -> None:
    a, b, _ = trio
    tokens = tokens_for(9, 3)
    keys = store(a, tokens, 3)
    wait_for(lambda: all(holders == {a.node_id} for holders in located(trio, keys)))
    with a.client() as ca:
        register(ca)
        assert ca.clear() == 3
    wait_for(lambda: all(holders == set() for holders in located(trio, keys)))
    assert fetch(b, tokens, 3) == (0, [])  # a clean miss, nothing asked of A


def test_directory_owner_killed_replicas_answer(trio: list[Node]) -> None:
    a, b, c = trio
    tokens = tokens_for(2, 8)
    keys = store(a, tokens, 8)
    wait_for(lambda: all(holders == {a.node_id} for holders in located(trio, keys)))
    c.server.kill()  # C owns entries of most keys (2 replicas of 3 members)
    hits, retrieved = fetch(b, tokens, 8)
    assert hits == 8 and retrieved == list(range(8))


def test_data_holder_killed_is_a_clean_miss_then_recompute(trio: list[Node]) -> None:
    a, b, c = trio
    tokens = tokens_for(3, 4)
    keys = store(a, tokens, 4)
    wait_for(lambda: all(holders == {a.node_id} for holders in located(trio, keys)))
    a.server.kill()
    hits, retrieved = fetch(b, tokens, 4)  # entries still name A: the fetch fails fast
    assert hits == 0 and retrieved == []
    assert store(b, tokens, 4) == keys  # the engine recomputes and stores
    assert fetch(b, tokens, 4, rid="again") == (4, list(range(4)))
    # Once A is declared dead, C finds the chunks at B.
    wait_for(lambda: members_of(c) == {b.node_id, c.node_id})
    wait_for(lambda: fetch(c, tokens, 4, rid="c")[0] == 4)


def members_of(node: Node) -> set[str]:
    reply = call(node.addr, m.GetMembers(0))
    assert isinstance(reply, m.MemberList)
    return {info.node_id for info in reply.members}


def test_node_joins_entries_rebalance_and_lookups_hit(
    trio: list[Node], server_factory: Factory
) -> None:
    a, b, _ = trio
    tokens = tokens_for(4, 16)
    keys = store(a, tokens, 16)
    wait_for(lambda: all(holders == {a.node_id} for holders in located(trio, keys)))
    d = start_node(server_factory, [b.port])  # joins through a seed other than the first
    nodes = [*trio, d]
    wait_for(lambda: converged(nodes))
    # D now owns some entries: they moved to it (handoff and re-publish).
    wait_for(lambda: status(d)["directory"]["entries"] > 0)
    assert all(holders == {a.node_id} for holders in located(nodes, keys))
    assert fetch(d, tokens, 16) == (16, list(range(16)))
    stats = status(d)["directory"]
    assert stats["handoff_received"] + stats["served_publish"] > 0


def test_corrupt_transfer_is_detected_and_counted(trio: list[Node]) -> None:
    a, b, _ = trio
    tokens = tokens_for(5, 3)
    keys = store(a, tokens, 3)
    wait_for(lambda: all(holders == {a.node_id} for holders in located(trio, keys)))

    # Flip bytes of chunk 1 in A's pool after its checksum was published.
    def flip(chunk: int, src: np.ndarray) -> None:
        if chunk == 1:
            raw = src.view(np.uint8).reshape(-1)
            raw[:64] ^= 0xFF

    with a.client() as ca:
        register(ca)
        assert ca.retrieve(tokens, scatter=flip).retrieved == [0, 1, 2]
    hits, retrieved = fetch(b, tokens, 3)
    assert hits == 1 and retrieved == [0]  # chunk 1 is a miss, which ends the prefix
    figures = peer_tier(b)
    assert figures["failures"] == {"corrupt": 1}
    received = status(b)["transport"]["received"][a.node_id]
    assert received["corrupt"] == 1


def test_cluster_in_the_http_status_metrics_and_dashboard(
    server_factory: Factory, tmp_path: Path
) -> None:
    (http_port,) = free_ports(1)
    a = start_node(server_factory, [], seed_self=True, extra=["--http-port", str(http_port)])
    b = start_node(server_factory, [a.port])
    wait_for(lambda: converged([a, b]))
    tokens = tokens_for(8, 2)
    keys = store(b, tokens, 2)
    wait_for(lambda: all(holders == {b.node_id} for holders in located([a, b], keys)))
    assert fetch(a, tokens, 2) == (2, [0, 1])
    url = f"http://127.0.0.1:{http_port}"
    with urllib.request.urlopen(f"{url}/status", timeout=10) as resp:
        doc = json.load(resp)
    assert doc["cluster"]["node_id"] == a.node_id
    assert sorted(m["state"] for m in doc["cluster"]["members"]) == ["alive", "self"]
    assert doc["cluster"]["transport"]["received"][b.node_id]["chunks"] == 2
    assert doc["lookups"]["hits"].get("peer") == 2  # remote hits are their own tier
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert 'tierkv_cluster_members{state="alive"} 1.0' in metrics
    line = f'tierkv_cluster_peer_chunks_total{{direction="received",peer="{b.node_id}"}} 2.0'
    assert line in metrics
    assert 'tierkv_lookup_chunks_total{result="hit",tier="peer"} 2.0' in metrics
    # The dashboard shows the membership and what came from each peer.
    page = Figures()
    page.feed(run_chromium(tmp_path / "chromium", url + "/", "--dump-dom").stdout)
    assert page.num("cluster-alive") == 2 and page.num("cluster-entries") >= 0  # a and b
    assert f"member-{b.node_id}" in page.ids and f"member-{a.node_id}" in page.ids


def test_unauthenticated_peer_is_refused(trio: list[Node]) -> None:
    a, b, _ = trio
    tokens = tokens_for(6, 2)
    keys = store(a, tokens, 2)
    wait_for(lambda: all(holders == {a.node_id} for holders in located(trio, keys)))
    # Control plane: requests signed with another secret are refused and change nothing.
    intruder_info = m.MemberInfo("intruder:1", "127.0.0.1:1", "127.0.0.1:2", 1)
    for token, msg in (
        ("", m.Resolve(0, keys)),
        ("wrong", m.GetMembers(0)),
        ("wrong", m.Heartbeat(0, intruder_info, [])),
        ("wrong", m.Unpublish(0, a.node_id, keys)),
    ):
        reply = call(b.addr, msg, token=token)
        assert isinstance(reply, m.Refused) and "unauthenticated" in reply.reason, reply
    # Unsigned (the bare payload), and correctly signed but replayed from long ago.
    with RawControl(b.addr) as raw:
        payload = m.encode(m.Unpublish(1, a.node_id, keys))
        old = ControlSigner(TOKEN, clock_ns=lambda: time.time_ns() - 3600 * 10**9)
        for frames in ([payload], [old.sign_request(payload), payload]):
            reply = raw.call(frames)
            assert isinstance(reply, m.Refused) and "unauthenticated" in reply.reason, reply
    assert "intruder:1" not in members_of(b)
    assert all(holders == {a.node_id} for holders in located(trio, keys))
    assert status(b)["control"]["refused"] >= 6
    # Data plane: a hello with a wrong token gets no bytes.
    intruder = TcpTransport("127.0.0.1", 0, "127.0.0.1", "wrong", "intruder:1", timeout=2.0)
    try:
        info = m.MemberInfo(a.node_id, a.addr, f"127.0.0.1:{a.port + 1}", 0)
        view = memoryview(bytearray(2 * 256 * 16 * 4))
        assert intruder.fetch_many([(info, [(keys[0], view)])]) == [[LoadStatus.ERROR]]
        assert not any(view)
    finally:
        intruder.close()
    wait_for(lambda: status(a)["transport"]["refused_hellos"] >= 1)
    # And an impostor holder (another secret) cannot serve bytes to a member.
    impostor = TcpTransport("127.0.0.1", 0, "127.0.0.1", "wrong", "impostor:1", timeout=2.0)
    impostor.serve(FixedSource(keys[0], bytes([7]) * (2 * 256 * 16 * 4)))
    member = TcpTransport("127.0.0.1", 0, "127.0.0.1", TOKEN, "member:1", timeout=2.0)
    try:
        info = m.MemberInfo("impostor:1", "127.0.0.1:1", impostor.address, 1)
        view = memoryview(bytearray(2 * 256 * 16 * 4))
        assert member.fetch_many([(info, [(keys[0], view)])]) == [[LoadStatus.ERROR]]
        assert not any(view) and member.stats()["refused_by_peers"] == 1
    finally:
        member.close()
        impostor.close()


class FixedSource:
    """A data-plane source serving one chunk (an impostor's)."""

    def __init__(self, key: bytes, data: bytes) -> None:
        self.key, self.data = key, data

    def acquire(self, keys: Sequence[bytes], lengths: Sequence[int]) -> Served:
        views = [memoryview(self.data) if k == self.key else None for k in keys]
        return Served(views, [checksum(self.data)] * len(keys))

    def release(self, served: Served) -> None:
        served.views.clear()


def test_chunk_on_the_holders_disk_is_promoted_before_sending(
    server_factory: Factory, tmp_path: Path
) -> None:
    # A: a 2 MiB pool (64 chunks of 32 KiB) over a disk tier, so old chunks go to disk.
    disk = ["--tier", f"disk:path={tmp_path / 'disk-a'}"]
    a = start_node(server_factory, [], pool_size="2MiB", extra=disk, seed_self=True)
    b = start_node(server_factory, [a.port])
    nodes = [a, b]
    wait_for(lambda: converged(nodes))
    tokens = tokens_for(7, 8)
    keys = store(a, tokens, 8)
    wait_for(lambda: all(e == {(a.node_id, m.Where.POOL)} for e in entries_of(nodes, keys)))
    wait_for(lambda: disk_written(a) >= 8)
    for batch in range(6):  # newer chunks push the first ones out of A's pool
        filler = tokens_for(100 + batch, 10)
        with a.client() as c:
            register(c)
            c.store(filler, [chunk_data(filler, i) for i in range(10)])
        wait_for(lambda: pool_fraction(a) < 0.8)
    # Evicted from the pool but on A's disk: the entries say so.
    wait_for(lambda: all(e == {(a.node_id, m.Where.DISK)} for e in entries_of(nodes, keys)))
    assert fetch(b, tokens, 8) == (8, list(range(8)))  # A promotes, then sends
    assert status(a)["promoted"] >= 8
    both = {(a.node_id, m.Where.POOL), (b.node_id, m.Where.POOL)}  # B published its copies
    wait_for(lambda: all(e == both for e in entries_of(nodes, keys)))


def disk_written(node: Node) -> int:
    with node.client() as c:
        return next(t.written_chunks for t in c.stats().tiers if t.name == "disk")


def pool_fraction(node: Node) -> float:
    with node.client() as c:
        s = c.stats()
    return s.used / s.capacity


def test_servers_stop_cleanly_and_leave(trio: list[Node]) -> None:
    a, b, c = trio
    assert c.server.stop(signal.SIGTERM) == 0
    wait_for(lambda: converged([a, b]))


def test_read_your_writes_across_nodes(server_factory: Factory) -> None:
    """Prefill/decode disaggregation: as soon as a store on A returns, a lookup on B finds
    every chunk (the commit waits for the directory, --commit-publish-timeout), 100 of 100
    prompts, each looked up on B the moment its store returned."""
    a = start_node(server_factory, [], seed_self=True)
    b = start_node(server_factory, [a.port], seed_self=True)
    wait_for(lambda: converged([a, b]))
    chunks, rounds = 2, 100
    hits: list[int] = []
    with a.client() as producer, b.client() as consumer:
        register(producer)
        register(consumer)
        for r in range(rounds):
            tokens = tokens_for(1000 + r, chunks)
            stored = producer.store(tokens, [chunk_data(tokens, i) for i in range(chunks)])
            assert stored.stored == list(range(chunks))
            rid = f"pd-{r}"
            hits.append(consumer.lookup(tokens, request_id=rid, wait=True).hits)
            out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(chunks)]
            got = consumer.retrieve(request_id=rid, out=out)
            for i in got.retrieved:
                np.testing.assert_array_equal(out[i], chunk_data(tokens, i))
    assert hits == [chunks] * rounds, f"{sum(h == chunks for h in hits)} of {rounds} hit"
    directory = status(a)["directory"]
    assert directory["publish_waits"] >= rounds and directory["publish_wait_timeouts"] == 0
