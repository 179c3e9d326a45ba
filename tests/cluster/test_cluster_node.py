"""One cluster node in process, over a real shared-memory pool: what it serves (committed
chunks only, at their own lengths), publishing, eviction to "on disk", withdrawal, and
start-up errors."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierkv.allocator import Allocator
from tierkv.cluster.controller_messages import NamespaceInfo
from tierkv.cluster.directory import Where
from tierkv.cluster.node import KNOWN_NAMESPACE_GRACE, ClusterNode, ClusterSettings
from tierkv.cluster.router_lookup import RouterQueryError
from tierkv.config import ConfigError, ServerConfig, from_mapping
from tierkv.index import ObjectIndex
from tierkv.pool import ShmPool
from tierkv.protocol import RouterQuery
from tierkv.tiers.disk import DiskTier

CHUNK = 64 * 1024


@pytest.fixture
def pool() -> Iterator[ShmPool]:
    p = ShmPool.create(f"tierkv-test-node-{uuid.uuid4().hex[:8]}", 8 * 2**20)
    yield p
    p.close()


def make_node(pool: ShmPool, disk: DiskTier | None = None) -> ClusterNode:
    index = ObjectIndex(Allocator(pool.size, 4096))
    settings = ClusterSettings.from_config(
        ServerConfig(cluster_port=0, auth_token="t", heartbeat_interval=0.1, member_ttl=1)
    )
    return ClusterNode(settings, index, pool, disk).start()


def put(node: ClusterNode, keys: list[bytes], commit: bool = True) -> int:
    res = node.index.reserve_write(keys, CHUNK, 7)
    for i, off, n in res.slots:
        node.pool.view(off, n)[:] = bytes([i + 1]) * n
    if commit:
        node.index.commit(res.lease_id, 7)
    return res.lease_id


def published_views(node: ClusterNode, keys: list[bytes]) -> None:
    lock = node.index.lock_read(keys, 99, prefix=False)
    node.tier.store([(keys[i], node.pool.view(o, n).toreadonly()) for i, o, n in lock.slots])
    node.index.release_read(lock.lease_id, 99)


def test_serves_only_committed_chunks_at_their_own_length(pool: ShmPool) -> None:
    node = make_node(pool)
    try:
        ready, writing, absent = os.urandom(32), os.urandom(32), os.urandom(32)
        put(node, [ready])
        put(node, [writing], commit=False)
        served = node.acquire([ready, writing, absent, ready], [CHUNK, CHUNK, CHUNK, 10])
        views = served.views
        assert views[0] is not None and bytes(views[0][:2]) == b"\x01\x01"
        assert views[0].readonly
        assert views[1] is None and views[2] is None  # uncommitted, unknown: nothing
        assert views[3] is not None and len(views[3]) == CHUNK  # never the asked length
        assert node.index.stats().read_locked == 1
        node.release(served)
        assert node.index.stats().read_locked == 0
    finally:
        node.close()


def test_publish_evict_to_disk_and_withdraw(pool: ShmPool, tmp_path: Path) -> None:
    disk = DiskTier(path=tmp_path / "disk")
    node = make_node(pool, disk)
    try:
        keys = [os.urandom(32) for _ in range(4)]
        put(node, keys)
        published_views(node, keys)
        assert node.directory.flush()
        assert [locs[0].where for locs in node.directory.resolve(keys)] == [Where.POOL] * 4
        # Two of them reach the disk tier; then all four are evicted from the pool.
        lock = node.index.lock_read(keys[:2], 99, prefix=False)
        disk.store([(keys[i], node.pool.view(o, n).toreadonly()) for i, o, n in lock.slots])
        node.index.release_read(lock.lease_id, 99)
        evicted = node.index.evict(4 * CHUNK)
        assert {e.key for e in evicted} == set(keys)
        node.on_removed([e.key for e in evicted])
        assert node.directory.flush()
        found = node.directory.resolve(keys)
        assert [locs[0].where for locs in found[:2]] == [Where.DISK] * 2
        assert found[2:] == [[], []]
        # A peer asks for a chunk on disk: it is promoted into the pool first.
        served = node.acquire(keys[:3], [CHUNK] * 3)
        assert served.views[0] is not None and bytes(served.views[0][:1]) == b"\x01"
        assert served.views[2] is None
        node.release(served)
        assert node.promoted == 2
        assert node.directory.flush()
        assert [locs[0].where for locs in node.directory.resolve(keys[:2])] == [Where.POOL] * 2
        # Withdrawing (the tier's delete) removes the entries.
        assert node.tier.delete(keys[:2]) == 2
        assert node.directory.flush()
        assert node.directory.resolve(keys[:2]) == [[], []]
    finally:
        node.close()
        disk.close()


def test_eviction_of_unpublished_chunks_is_ignored(pool: ShmPool) -> None:
    node = make_node(pool)
    try:
        node.on_removed([os.urandom(32)])
        assert node.directory.flush()
        assert node.directory.stats()["unpublished"] == 0
    finally:
        node.close()


def test_busy_cluster_port_is_a_clear_error(pool: ShmPool) -> None:
    node = make_node(pool)
    try:
        settings = ClusterSettings.from_config(
            ServerConfig(cluster_port=node.control.port, auth_token="t")
        )
        other = ClusterNode(settings, node.index, pool)  # building opens nothing
        with pytest.raises(ConfigError, match="cluster port"):
            other.start()
        other.close()
    finally:
        node.close()


def test_settings_from_config(pool: ShmPool) -> None:
    cfg = from_mapping(
        {
            "cluster_seeds": "127.0.0.1:9000, 127.0.0.1:9002",
            "cluster_port": 0,
            "auth_token": "x",
            "peer_connections": 3,
            "directory_replicas": 1,
        }
    )
    settings = ClusterSettings.from_config(cfg)
    assert settings.seeds == ("127.0.0.1:9000", "127.0.0.1:9002")
    assert (settings.connections, settings.replicas, settings.token) == (3, 1, "x")
    index = ObjectIndex(Allocator(pool.size, 4096))
    node = ClusterNode(settings, index, pool).start()
    try:
        assert node.me.data.endswith(str(node.transport.port))
    finally:
        node.close()


@pytest.mark.parametrize(
    "bad",
    [
        {"cluster_seeds": "nohostport"},
        {"cluster_seeds": "h:1", "heartbeat_interval": 5, "member_ttl": 1},
        {"cluster_seeds": "h:1", "directory_replicas": 0},
        {"cluster_seeds": "h:1", "cluster_host": "0.0.0.0"},  # reachable: needs a token
    ],
)
def test_cluster_options_are_validated(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        from_mapping(bad)


def test_a_gone_engines_namespace_is_remembered_for_a_grace_then_forgotten(
    pool: ShmPool,
) -> None:
    """A server that holds none of a namespace's chunks still answers a router's lookup by
    model for KNOWN_NAMESPACE_GRACE after the namespace's last engine left, whatever
    re-publishing happens meanwhile; after that, the next re-publish forgets it."""
    clock = [1000.0]
    node = make_node(pool)
    node.clock = lambda: clock[0]
    try:
        ns = NamespaceInfo(os.urandom(16), "m", 256)
        engines = [ns]
        node.serve_namespaces(lambda: list(engines))
        query = RouterQuery("m", b"", bytes(4 * 256), None, 0)
        assert node.router_lookup(query) == {"chunks": 1, "instances": []}
        clock[0] += 10 * KNOWN_NAMESPACE_GRACE  # registered long ago ...
        engines.clear()
        node.namespaces_changed()  # ... and gone now
        clock[0] += KNOWN_NAMESPACE_GRACE - 1
        node._held()  # a membership change re-publishes what this node holds: nothing
        assert node.router_lookup(query) == {"chunks": 1, "instances": []}
        clock[0] += 1
        node._held()
        with pytest.raises(RouterQueryError, match="no engine of model 'm'"):
            node.router_lookup(query)
    finally:
        node.close()


def test_a_chunk_stored_again_while_a_peer_found_it_missing_stays_published(
    pool: ShmPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer's fetch finds a chunk missing (a stale entry) and withdraws it; an engine's
    commit of that chunk lands between the peer's read lock and the withdrawal: the chunk
    stays published (before, the withdrawal came last and dropped it from the node's record
    too, so no repair ever published it again)."""
    node = make_node(pool)
    try:
        key = os.urandom(32)
        lease = put(node, [key], commit=False)  # an engine writing it
        lock_read = node.index.lock_read

        def commit_in_between(*args: object, **kw: object) -> object:
            lock = lock_read(*args, **kw)  # type: ignore[arg-type]
            result = node.index.commit(lease, 7)
            node.publish_committed(result.committed_keys, result.committed_lengths)
            return lock

        monkeypatch.setattr(node.index, "lock_read", commit_in_between)
        served = node.acquire([key], [CHUNK])
        monkeypatch.undo()
        assert served.views == [None]  # missing when the peer looked
        node.release(served)
        assert (key, Where.POOL) in node._claimed()
        assert node.directory.flush()
        assert [loc.holder for loc in node.directory.resolve([key])[0]] == [node.node_id]
    finally:
        node.close()
