"""The directory heals itself in seconds, on real servers: entries an owner's shard lost or
lists wrong (corrupted on purpose here by signed control messages) come back through the
anti-entropy (``--directory-repair-interval``), and do not without it; a node's own entries
cannot be written from outside; entries of holders that are no members do not push a
holder's entry out, and go."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from support.clusterkit import (
    TOKEN,
    Node,
    call,
    converged,
    rows_of,
    start_node,
    status,
    wait_for,
)
from support.kvops import store, tokens_for
from support.servers import ServerProcess
from tierkv.cluster import messages as m

pytestmark = pytest.mark.processes

Factory = Callable[..., ServerProcess]
Where = m.Where


def pair(factory: Factory, repair_interval: float) -> tuple[Node, Node]:
    extra = ["--directory-repair-interval", str(repair_interval)]
    a = start_node(factory, [], seed_self=True, extra=extra)
    b = start_node(factory, [a.port], seed_self=True, extra=extra)
    wait_for(lambda: converged([a, b]))
    # Each node moves the directory once it sees the other (logged when done): a corruption
    # made before that could be undone by the move instead of the repair.
    wait_for(lambda: all("directory rebalanced" in n.server.log() for n in (a, b)))
    return a, b


def listed(node: Node, keys: list[bytes]) -> list[set[tuple[str, Where]]]:
    """(holder, where) of each key in ``node``'s own shard (with two nodes and two replicas,
    every node owns every key)."""
    reply = call(node.addr, m.Resolve(0, keys))
    assert isinstance(reply, m.Resolved), reply
    out: list[set[tuple[str, Where]]] = [set() for _ in keys]
    for pos, h, where in rows_of(reply):
        out[pos].add((reply.holders[h], Where(where)))
    return out


def incarnation(node: Node) -> int:
    return int(status(node)["incarnation"])


def signed(node: Node, msg: m.Struct) -> object:
    """A control message signed with the cluster's secret: trusted cluster traffic."""
    return call(node.addr, msg, TOKEN)


def done(node: Node, msg: m.Struct) -> int:
    """Send a signed message that must be done; how many entries it changed."""
    reply = signed(node, msg)
    assert isinstance(reply, m.Done), reply
    return reply.count


@pytest.mark.parametrize("repair", [True, False], ids=["repair", "no-repair"])
def test_entries_an_owner_lost_or_lists_wrong_come_back(
    server_factory: Factory, repair: bool
) -> None:
    a, b = pair(server_factory, 0.2 if repair else 0)
    keys = store(a, tokens_for(41, 6), 6)
    good = {(a.node_id, Where.POOL)}
    wait_for(lambda: listed(b, keys) == [good] * 6)
    inc = incarnation(a)
    # B (an owner of every key) loses three of A's entries, lists one as on disk and one
    # under another incarnation of A.
    assert done(b, m.Unpublish(0, a.node_id, keys[:3])) == 3
    assert done(b, m.Publish(0, a.node_id, inc, [(keys[3], Where.DISK)])) == 1
    assert done(b, m.Publish(0, a.node_id, inc + 1, [(keys[4], Where.POOL)])) == 1
    if repair:
        wait_for(lambda: listed(b, keys) == [good] * 6, timeout=20.0)
        # Every wrong entry was noticed (the one under another incarnation too), no more.
        wait_for(lambda: status(a)["directory"]["repaired"] == 5, timeout=20.0)
        assert status(b)["directory"]["served_digests"] > 0
    else:
        time.sleep(2.0)  # ten rounds of the repairing runs above
        assert listed(b, keys) == [set(), set(), set(), {(a.node_id, Where.DISK)}, good, good]
        assert status(a)["directory"]["repair_rounds"] == 0
    assert listed(a, keys) == [good] * 6  # A's own shard was never touched


def test_a_nodes_own_entries_cannot_be_written_from_outside(server_factory: Factory) -> None:
    """A node publishes its entries to its own shard itself: a PUBLISH or UNPUBLISH naming it
    as the holder is refused, a HANDOFF's entries naming it are skipped."""
    a, _ = pair(server_factory, 0)
    keys = store(a, tokens_for(42, 3), 3)
    good = {(a.node_id, Where.POOL)}
    wait_for(lambda: listed(a, keys) == [good] * 3)
    inc = incarnation(a)
    reply = signed(a, m.Publish(0, a.node_id, inc + 1, [(keys[0], Where.DISK)]))
    assert isinstance(reply, m.Refused), reply
    reply = signed(a, m.Unpublish(0, a.node_id, keys[1:2]))
    assert isinstance(reply, m.Refused), reply
    assert done(a, m.Handoff(0, [(keys[2], a.node_id, inc + 1, int(Where.DISK))])) == 0
    assert listed(a, keys) == [good] * 3


def test_holders_that_are_no_members_push_nobody_out_and_go(server_factory: Factory) -> None:
    """Entries of many holders for one key: none pushes another's out (the anti-entropy
    would put it back and push the next out, for ever); those of holders that are no
    members are dropped after a few repair rounds."""
    a, b = pair(server_factory, 0.2)
    keys = store(a, tokens_for(43, 2), 2)
    good = {(a.node_id, Where.POOL)}
    wait_for(lambda: listed(b, keys) == [good] * 2)
    ghosts = [f"ghost:{i}" for i in range(6)]
    for ghost in ghosts:
        entries = [(k, int(Where.POOL)) for k in keys]
        assert done(b, m.Publish(0, ghost, 1, entries)) == 2
    assert all((a.node_id, Where.POOL) in got for got in listed(b, keys))
    wait_for(lambda: listed(b, keys) == [good] * 2, timeout=20.0)
    assert status(b)["directory"]["unknown_purged"] == 12
