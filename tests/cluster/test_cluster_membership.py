"""Membership and directory in one process, over real ZMQ sockets on loopback: joins through
any seed, the loss of any one node (the first seed included), restarts that rejoin, refusal
of a wrong secret, and directory entries that follow the ring through joins and leaves."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tierkv.cluster import messages as m
from tierkv.cluster.control import ControlClient
from tierkv.cluster.control_server import ControlServer
from tierkv.cluster.directory import Where
from tierkv.cluster.membership import Membership
from tierkv.cluster.ring import Ring
from tierkv.cluster.ring_directory import RingDirectory
from tierkv.cluster.ring_resolve import DirectoryReader
from tierkv.config import ConfigError

TOKEN = "s3cret"
INTERVAL, TTL = 0.05, 0.5


def bind(port: int, token: str) -> ControlServer:
    # A restarted node takes its old port back; a peer still reconnecting to that port
    # (an ephemeral one in tests) may briefly hold it as its own local port: retry.
    deadline = time.monotonic() + 10.0
    while True:
        try:
            server = ControlServer("127.0.0.1", port, token, {})
            server.bind()
            return server
        except ConfigError:
            if not port or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class Mini:
    """Control server + membership + directory: a cluster node without pool or data plane."""

    def __init__(
        self, seeds: list[str], port: int = 0, token: str = TOKEN, advertise: str = ""
    ) -> None:
        """``advertise``: the control address it tells others (its own by default)."""
        self.server = bind(port, token)
        self.addr = f"127.0.0.1:{self.server.port}"
        self.client = ControlClient(token, 0.3)
        control = advertise or self.addr
        self.me = m.MemberInfo(self.addr, control, "127.0.0.1:1", time.time_ns())
        self.held: list[tuple[bytes, Where]] = []
        self.membership = Membership(self.me, seeds, self.client, INTERVAL, TTL)
        self.directory = RingDirectory(self.membership, self.client, lambda: list(self.held))
        self.server.handlers.update(
            {
                m.Heartbeat: self.membership.on_heartbeat,
                m.Leave: self.membership.on_leave,
                m.GetMembers: self.membership.on_get_members,
                m.Publish: self.directory.on_publish,
                m.Unpublish: self.directory.on_unpublish,
                m.Handoff: self.directory.on_handoff,
                m.Resolve: self.directory.on_resolve,
            }
        )
        self.server.start()
        self.directory.start()
        self.membership.start()
        self.alive = True

    @property
    def port(self) -> int:
        return self.server.port

    def members(self) -> set[str]:
        return set(self.membership.alive())

    def publish(self, keys: list[bytes]) -> None:
        self.held += [(k, Where.POOL) for k in keys]
        self.directory.publish(keys)

    def crash(self) -> None:
        """Stop without LEAVE, as a killed process would."""
        self.alive = False
        self.membership.close(leave=False)
        self.server.close()
        self.directory.close()
        self.client.close()

    def stop(self) -> None:
        if not self.alive:
            return
        self.alive = False
        self.membership.close(leave=False)
        self.server.close()
        self.membership.leave()
        self.directory.close()
        self.client.close()


def wait_for(what: Callable[[], Any], timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"condition not met within {timeout} s")


@pytest.fixture
def spawn() -> Iterator[Callable[..., Mini]]:
    nodes: list[Mini] = []

    def make(seeds: list[str], port: int = 0, token: str = TOKEN, advertise: str = "") -> Mini:
        node = Mini(seeds, port, token, advertise)
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        if node.alive:
            node.crash()


def converged(nodes: list[Mini]) -> bool:
    want = {n.addr for n in nodes}
    return all(n.members() == want for n in nodes)


def cluster(spawn: Callable[..., Mini], n: int) -> list[Mini]:
    first = spawn([])
    first.membership.seeds = [first.addr]  # the first server lists itself
    nodes = [first]
    for i in range(1, n):
        nodes.append(spawn([first.addr, nodes[i - 1].addr]))
    wait_for(lambda: converged(nodes))
    assert all(n.directory.flush() for n in nodes)  # directories follow the settled view
    return nodes


def test_a_member_heard_from_but_not_answering_is_unreachable_from_here(
    spawn: Callable[..., Mini],
) -> None:
    """A one-way partition: B's heartbeats reach A, A's calls to B go nowhere (B advertises
    a control address nobody serves yet). A takes B out of its view, B's heartbeats do not
    bring it back; once the address answers (a relay to B's handlers), B is back."""
    a = spawn([])
    a.membership.seeds = [a.addr]
    relay = ControlServer("127.0.0.1", 0, TOKEN, {})
    relay.bind()  # a port of our own, not served until relay.start()
    b = spawn([a.addr], advertise=f"127.0.0.1:{relay.port}")
    try:
        wait_for(lambda: b.members() == {a.addr, b.addr})  # B reaches A
        wait_for(lambda: a.members() == {a.addr})
        assert a.membership.unreachable >= 1
        heard = a.membership.heartbeats_received
        wait_for(lambda: a.membership.heartbeats_received >= heard + 10)
        assert a.members() == {a.addr}  # still heard from, still out
        assert b.members() == {a.addr, b.addr}
        assert [r["state"] for r in a.membership.describe() if r["node_id"] == b.addr] == [
            "unreachable"
        ]
        relay.handlers.update(b.server.handlers)
        relay.start()
        wait_for(lambda: a.members() == {a.addr, b.addr})
    finally:
        relay.close()


def test_nodes_join_through_any_seed_and_learn_everyone(spawn: Callable[..., Mini]) -> None:
    nodes = cluster(spawn, 3)
    late = spawn([nodes[2].addr])  # knows only the last joiner
    wait_for(lambda: converged([*nodes, late]))


@pytest.mark.parametrize("lost", [0, 1, 2])
def test_member_list_survives_the_loss_of_any_node(spawn: Callable[..., Mini], lost: int) -> None:
    nodes = cluster(spawn, 3)
    first_seed = nodes[0].addr
    nodes[lost].crash()
    survivors = [n for i, n in enumerate(nodes) if i != lost]
    wait_for(lambda: converged(survivors))
    # A new node whose seed list starts with the (possibly dead) first seed still joins.
    newcomer = spawn([first_seed, survivors[-1].addr])
    wait_for(lambda: converged([*survivors, newcomer]))


def test_restarted_node_rejoins_with_a_new_incarnation(spawn: Callable[..., Mini]) -> None:
    nodes = cluster(spawn, 3)
    seed = nodes[0]
    seed.crash()
    others = nodes[1:]
    wait_for(lambda: converged(others))
    # The first seed comes back on its port knowing no one: the others find it again.
    back = spawn([], port=seed.port)
    wait_for(lambda: converged([back, *others]))
    assert all(n.membership.get(back.addr) == back.me for n in others)
    assert back.me.incarnation != seed.me.incarnation


def test_restart_replaces_the_old_incarnation_and_its_entries(
    spawn: Callable[..., Mini],
) -> None:
    nodes = cluster(spawn, 2)
    keys = [os.urandom(32) for _ in range(40)]
    nodes[1].publish(keys)
    wait_for(lambda: stored_on_owners(nodes, keys))
    port, old_me = nodes[1].port, nodes[1].me
    nodes[1].crash()
    back = spawn([nodes[0].addr], port=port)  # same id, new incarnation, empty pool
    wait_for(lambda: nodes[0].membership.get(back.addr) == back.me)
    assert back.me.node_id == old_me.node_id and back.me != old_me
    # The old life's entries are gone, whether or not it was declared dead in between.
    wait_for(lambda: not any(nodes[0].directory.resolve(keys)))
    assert nodes[0].directory.flush() and not any(back.directory.resolve(keys))


def test_graceful_leave_is_immediate(spawn: Callable[..., Mini]) -> None:
    nodes = cluster(spawn, 3)
    nodes[2].stop()
    wait_for(lambda: converged(nodes[:2]))
    assert nodes[0].membership.left == 1 and nodes[1].membership.left == 1


def test_a_node_with_the_wrong_secret_cannot_join(spawn: Callable[..., Mini]) -> None:
    nodes = cluster(spawn, 2)
    intruder = spawn([nodes[0].addr], token="guess")
    wait_for(lambda: intruder.membership.refused_by_peers > 0)
    assert all(intruder.addr not in n.members() for n in nodes)
    assert nodes[0].server.refused > 0
    assert intruder.members() == {intruder.addr}


def stored_on_owners(nodes: list[Mini], keys: list[bytes]) -> bool:
    """Every key's entry is held by exactly its owners under the current ring."""
    ring = Ring([n.addr for n in nodes])
    for key, owners in zip(keys, ring.owners_many(keys), strict=True):
        holding = {n.addr for n in nodes if n.directory.shard.get([key])[0]}
        if holding != set(owners):
            return False
    return True


def test_directory_entries_follow_the_ring(spawn: Callable[..., Mini]) -> None:
    nodes = cluster(spawn, 3)
    keys = [os.urandom(32) for _ in range(300)]
    nodes[0].publish(keys[:150])
    nodes[1].publish(keys[150:])
    wait_for(lambda: stored_on_owners(nodes, keys))
    found = nodes[2].directory.resolve(keys)
    assert [loc[0].holder for loc in found] == [nodes[0].addr] * 150 + [nodes[1].addr] * 150
    assert all(loc[0].where is Where.POOL for loc in found)
    # A join moves entries to the new member, and only the owners keep them.
    joined = spawn([nodes[1].addr])
    nodes.append(joined)
    wait_for(lambda: converged(nodes))
    wait_for(lambda: stored_on_owners(nodes, keys))
    assert len(joined.directory.shard) > 0
    # An owner crashes: the survivors re-own its keys (holders re-publish them).
    nodes[2].crash()
    survivors = [n for n in nodes if n.alive]
    wait_for(lambda: converged(survivors))
    wait_for(lambda: stored_on_owners(survivors, keys))
    # The holder of half the keys crashes: its entries are purged everywhere.
    nodes[1].crash()
    survivors = [n for n in nodes if n.alive]
    wait_for(lambda: converged(survivors))
    wait_for(lambda: stored_on_owners(survivors, keys[:150]))
    found = survivors[-1].directory.resolve(keys)
    assert all(found[i] for i in range(150)) and not any(found[150:])


def test_unpublish_removes_entries_everywhere(spawn: Callable[..., Mini]) -> None:
    nodes = cluster(spawn, 3)
    keys = [os.urandom(32) for _ in range(50)]
    nodes[0].publish(keys)
    wait_for(lambda: stored_on_owners(nodes, keys))
    nodes[0].directory.publish(keys[:10], Where.DISK)
    nodes[0].directory.unpublish(keys[10:20])
    assert nodes[0].directory.flush()
    found = nodes[1].directory.resolve(keys)
    assert all(locs and locs[0].where is Where.DISK for locs in found[:10])
    assert not any(found[10:20])
    assert all(locs and locs[0].where is Where.POOL for locs in found[20:])


def test_resolve_falls_back_to_a_replica_when_an_owner_is_silent(
    spawn: Callable[..., Mini],
) -> None:
    nodes = cluster(spawn, 3)
    reader, silent = nodes[1], nodes[2]
    # Keys the silent node is first owner of, and the reader no owner: the silent node is
    # asked them first (a resolve asks as few owners as cover the keys, first owners first).
    ring = reader.directory.ring
    keys: list[bytes] = []
    while len(keys) < 200:
        key = os.urandom(32)
        if ring.owners(key) == (silent.addr, nodes[0].addr):
            keys.append(key)
    nodes[0].publish(keys)
    wait_for(lambda: stored_on_owners(nodes, keys))
    # Freeze the silent owner's membership view in the reader: it is still "alive" there.
    reader.membership.close(leave=False)
    silent.crash()
    found = reader.directory.resolve(keys)
    assert all(locs and locs[0].holder == nodes[0].addr for locs in found)
    assert reader.client.timeouts > 0


def test_outside_reader_resolves_like_a_member(spawn: Callable[..., Mini]) -> None:
    nodes = cluster(spawn, 3)
    keys = [os.urandom(32) for _ in range(64)]
    nodes[0].publish(keys[:32])
    wait_for(lambda: stored_on_owners(nodes, keys[:32]))
    reader = DirectoryReader(nodes[1].addr, TOKEN, timeout=1.0)
    try:
        assert set(reader.refresh()) == {n.addr for n in nodes}
        found = reader.resolve(keys)
        assert [[loc.holder for loc in locs] for locs in found] == [
            [loc.holder for loc in locs] for locs in nodes[2].directory.resolve(keys)
        ]
        assert all(found[:32]) and not any(found[32:])
    finally:
        reader.close()
    with pytest.raises(PermissionError):
        DirectoryReader(nodes[1].addr, "wrong").refresh()


def test_a_heartbeat_claiming_this_nodes_id_at_another_address_changes_nothing(
    spawn: Callable[..., Mini],
) -> None:
    """A signed heartbeat naming A's node id with B's control address (another process
    claiming A's id, or a fuzzer): A keeps calling B and B stays a member."""
    a, b = cluster(spawn, 2)
    forged = m.MemberInfo(a.me.node_id, b.addr, a.me.data, a.me.incarnation)
    client = ControlClient(TOKEN, 2.0)
    try:
        assert isinstance(client.call(a.addr, m.Heartbeat(0, forged, [])), m.HeartbeatAck)
    finally:
        client.close()
    assert a.membership.self_claims == 1
    assert b.addr in a.membership.targets()
    time.sleep(3 * TTL)  # longer than a member may stay unanswered
    assert a.members() == {a.addr, b.addr}


def test_members_reported_second_hand_are_probed_a_bounded_number_at_once(
    spawn: Callable[..., Mini],
) -> None:
    """One signed heartbeat naming 20,000 made-up members made every round call them all
    (past the members' TTL: live members were declared dead). At most 256 (or twice the
    members) are probed at once; the rest are counted and wait for another report."""
    a, b = cluster(spawn, 2)
    made_up = [
        m.MemberInfo(f"10.255.{i // 250}.{i % 250}:9", f"127.0.0.1:{1 + i % 60000}", "x:1", 1)
        for i in range(20_000)
    ]
    client = ControlClient(TOKEN, 2.0)
    try:
        reply = client.call(a.addr, m.Heartbeat(0, b.me, made_up))
        assert isinstance(reply, m.HeartbeatAck)
    finally:
        client.close()
    targets = a.membership.targets()
    assert b.addr in targets and len(targets) <= 256 + 2
    assert a.membership.candidates_turned_away >= 20_000 - 256
    time.sleep(3 * TTL)  # longer than a member may stay unanswered
    assert a.members() == {a.addr, b.addr}
