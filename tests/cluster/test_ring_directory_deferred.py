"""Updates a ring directory held back for a suspect owner (:mod:`tierkv.cluster.ring_directory`)
go out in order with the ones made after it answers again, with a stand-in membership and
control client in front of a real shard (the suspect owners of real processes:
tests/cluster/test_cluster_suspect.py)."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from tierkv.cluster import messages as m
from tierkv.cluster import ring_directory
from tierkv.cluster.directory import Where
from tierkv.cluster.ring import Ring
from tierkv.cluster.ring_directory import RingDirectory
from tierkv.cluster.ring_shard import Shard

ME = m.MemberInfo("A", "A:1", "A:2", 1)
OWNER = m.MemberInfo("O", "O:1", "O:2", 1)


class Members:
    me = ME

    def alive(self) -> dict[str, m.MemberInfo]:
        return {"A": ME, "O": OWNER}

    def view(self) -> tuple[int, dict[str, m.MemberInfo]]:
        return 1, self.alive()

    def add_listener(self, listener: Any) -> None:
        pass


class Client:
    """Delivers every call to the owner's shard; ``suspects``: control addresses that
    time out."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard
        self.suspects: set[str] = set()

    def suspect(self, addr: str) -> bool:
        return addr in self.suspects

    def forget(self, addr: str) -> None:
        pass

    def call_many(self, calls: dict[str, Any]) -> dict[str, Any]:
        for msg in calls.values():
            if isinstance(msg, m.Publish):
                self.shard.put(msg.holder, msg.incarnation, msg.entries)
            elif isinstance(msg, m.Unpublish):
                self.shard.remove(msg.holder, msg.keys)
        return {addr: m.Done(0, 1) for addr in calls}


def test_a_withdrawal_held_for_a_suspect_owner_never_undoes_a_later_publish() -> None:
    """A chunk's withdrawal was held while its owner was suspect; the owner answers again
    and the chunk is stored again: the owner ends up listing it (before, the held withdrawal
    went out after the new publish and removed it)."""
    shard = Shard()
    client = Client(shard)
    directory = RingDirectory(
        Members(),  # type: ignore[arg-type]
        client,  # type: ignore[arg-type]
        lambda: [],
        replicas=1,
        vnodes=8,
        repair_interval=0,
    )
    keys = [b"N" * 16 + bytes([i]) * 16 for i in range(64)]
    key = next(k for k in keys if directory.ring.owners_many([k])[0] == ("O",))
    directory.start()
    try:
        directory.publish([key])
        assert directory.flush()
        assert shard.get([key])[0]
        client.suspects = {OWNER.control}
        directory.unpublish([key])  # evicted while the owner is suspect: held back
        assert directory.flush()
        assert shard.get([key])[0]  # not sent yet
        client.suspects = set()  # it answers again
        ticket = directory.publish([key])  # stored again
        assert directory.wait_published(ticket, 10.0)
        deadline = time.monotonic() + 10.0
        while directory.counts["publish_deferred_sent"] == 0:  # the held updates went out
            assert time.monotonic() < deadline, "the held updates were never sent"
            time.sleep(0.01)
        assert directory.flush()
        assert shard.get([key])[0]
    finally:
        directory.close()


# -- directories talking to each other ------------------------------------------------------
def member(name: str, incarnation: int = 1) -> m.MemberInfo:
    return m.MemberInfo(name, f"{name}:1", f"{name}:2", incarnation)


class View:
    """A membership whose view the test sets (listeners told, as gossip would)."""

    def __init__(self, me: m.MemberInfo, others: list[m.MemberInfo]) -> None:
        self.me = me
        self.members = {x.node_id: x for x in [me, *others]}
        self.version = 1
        self.listeners: list[Any] = []

    def alive(self) -> dict[str, m.MemberInfo]:
        return dict(self.members)

    def view(self) -> tuple[int, dict[str, m.MemberInfo]]:
        return self.version, dict(self.members)

    def add_listener(self, listener: Any) -> None:
        self.listeners.append(listener)

    def set(self, members: list[m.MemberInfo]) -> None:
        old, self.members = self.members, {x.node_id: x for x in members}
        self.version += 1
        for listener in self.listeners:
            listener(old, dict(self.members))


class Wire:
    """Delivers calls to the directories' handlers by control address. ``silent``:
    addresses whose calls get no answer (and which turn suspect, as the control client
    makes them); ``suspects``: addresses suspect now. Calls to unknown addresses are lost."""

    def __init__(self) -> None:
        self.nodes: dict[str, RingDirectory] = {}
        self.silent: set[str] = set()
        self.suspects: set[str] = set()
        self.refusing: set[str] = set()  # answer every call with Refused
        self.calls = 0

    def suspect(self, addr: str) -> bool:
        return addr in self.suspects

    def forget(self, addr: str) -> None:
        self.suspects.discard(addr)

    def call_many(self, calls: dict[str, Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        self.calls += len(calls)
        for addr, msg in calls.items():
            node = self.nodes.get(addr)
            if addr in self.refusing:
                out[addr] = m.Refused(0, "internal error")
                continue
            if addr in self.silent or node is None:
                self.suspects.add(addr)
                continue
            handler = {
                m.Publish: node.on_publish,
                m.Unpublish: node.on_unpublish,
                m.Handoff: node.on_handoff,
                m.Resolve: node.on_resolve,
                m.Digest: node.on_digest,
            }[type(msg)]
            out[addr] = handler(msg)
            self.suspects.discard(addr)
        return out


def directory_of(wire: Wire, view: View, held: Any = list, **settings: Any) -> RingDirectory:
    options: dict[str, Any] = {"replicas": 1, "vnodes": 8, "repair_interval": 0, **settings}
    node = RingDirectory(view, wire, held, **options)  # type: ignore[arg-type]
    wire.nodes[view.me.control] = node
    return node


def owned_by(directory: RingDirectory, owner: str, n: int) -> list[bytes]:
    rng = random.Random(7)
    keys = [rng.randbytes(32) for _ in range(256)]
    return [k for k in keys if directory.ring.owners_many([k])[0] == (owner,)][:n]


def test_an_update_an_owner_did_not_take_goes_out_once_it_answers() -> None:
    """A publish the owner missed (a stall longer than the call's timeout) is kept for it
    and sent when it answers again, not dropped (the owner lacked the entry until the next
    anti-entropy round, or for good without one). The commit's wait still ends: it never
    waits for an owner that does not answer."""
    a, o = member("A"), member("O")
    wire = Wire()
    owner = directory_of(wire, View(o, [a]))
    held: list[tuple[bytes, Where]] = []
    writer = directory_of(wire, View(a, [o]), lambda: list(held))
    k1, k2 = owned_by(writer, "O", 2)
    writer.start()
    try:
        wire.silent = {o.control}
        held.append((k1, Where.POOL))
        assert writer.wait_published(writer.publish([k1]), 10.0)
        assert not owner.shard.get([k1])[0]
        wire.silent = set()
        wire.suspects = set()  # it answers again
        held.append((k2, Where.POOL))
        assert writer.wait_published(writer.publish([k2]), 10.0)
        assert owner.shard.get([k1])[0] and owner.shard.get([k2])[0]
        assert writer.counts["publish_deferred_sent"] >= 1
    finally:
        writer.close()


def test_a_commit_to_an_owner_answering_again_reaches_it_before_the_commit_returns() -> None:
    """Updates held for an owner while it was suspect go out, merged with a new commit's,
    as soon as that commit is sent to the owner answering again: the commit's wait ends
    with the owner listing the new chunk (read-your-writes), not a check later."""
    a, o = member("A"), member("O")
    wire = Wire()
    owner = directory_of(wire, View(o, [a]))
    writer = directory_of(wire, View(a, [o]))
    k1, k2 = owned_by(writer, "O", 2)
    writer.start()
    try:
        wire.suspects = {o.control}
        writer.publish([k1])
        assert writer.flush()
        assert not owner.shard.get([k1])[0]  # held back for the suspect owner
        wire.suspects = set()  # it answers again (a probe)
        assert writer.wait_published(writer.publish([k2]), 10.0)
        assert owner.shard.get([k2])[0] and owner.shard.get([k1])[0]
    finally:
        writer.close()


def test_members_that_keep_changing_do_not_hold_rebalancing_off() -> None:
    """A member restarting over and over (each restart a new incarnation: a change) kept
    the view from ever being still for ``settle`` seconds: nothing was rebalanced, so a
    member that joined meanwhile never got the entries it owns. The change is applied
    ``MAX_SETTLES`` settles after the first one at the latest."""
    a, b, d = member("A"), member("B"), member("D")
    wire = Wire()
    rng = random.Random(8)
    keys = [rng.randbytes(32) for _ in range(256)]
    view = View(a, [b])
    writer = directory_of(
        wire, view, lambda: [(k, Where.POOL) for k in keys], settle=0.2, repair_interval=0
    )
    directory_of(wire, View(b, [a]))
    joiner = directory_of(wire, View(d, [a, b]))
    writer.start()
    try:
        writer.publish(keys)
        assert writer.flush()
        view.set([a, b, d, member("X", 1)])  # D joins while X restarts in a loop
        deadline = time.monotonic() + 10.0
        incarnation = 1
        while writer.counts["rebalances"] == 0:
            assert time.monotonic() < deadline, "no rebalance while members kept changing"
            time.sleep(0.05)  # a quarter of settle: the view is never still long enough
            incarnation += 1
            view.set([a, b, d, member("X", incarnation)])
        mine = [k for k in keys if writer.ring.owners_many([k])[0] == ("D",)]
        assert mine and all(joiner.shard.get(mine))
    finally:
        writer.close()


def test_an_update_an_owner_refused_is_not_sent_again() -> None:
    """An owner that answers with a refusal (not a timeout) would refuse the same update
    again: it is not kept for it (kept, it was sent again at every check and every commit,
    and piled up)."""
    a, o = member("A"), member("O")
    wire = Wire()
    directory_of(wire, View(o, [a]))
    writer = directory_of(wire, View(a, [o]))
    keys = owned_by(writer, "O", 3)
    writer.start()
    try:
        wire.refusing = {o.control}
        for key in keys:
            assert writer.wait_published(writer.publish([key]), 10.0)
        assert writer.flush()
        calls = wire.calls
        time.sleep(0.6)  # two checks of kept updates
        assert writer.flush()
        assert wire.calls == calls and writer.counts["publish_deferred"] == 0
    finally:
        writer.close()


def test_updates_kept_for_an_owner_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ring_directory, "MAX_KEPT", 4)
    a, o = member("A"), member("O")
    wire = Wire()
    owner = directory_of(wire, View(o, [a]))
    writer = directory_of(wire, View(a, [o]))
    keys = owned_by(writer, "O", 6)
    writer.start()
    try:
        wire.suspects = {o.control}
        writer.publish(keys)
        assert writer.flush()
        assert writer.counts["publish_deferred_dropped"] == 6
        wire.suspects = set()
        assert writer.wait_published(writer.publish(keys[:1]), 10.0)
        assert owner.shard.get(keys[:1])[0] and not owner.shard.get(keys[1:2])[0]
    finally:
        writer.close()


def test_updates_kept_for_an_owner_whose_keys_moved_are_not_sent() -> None:
    """Updates kept for a suspect owner whose keys a node joining since took over. Its
    publishes are not sent to the old owner when it answers again (an entry where no reader
    looks: a wrong one if the ring changed back); the new owner has them from the
    re-publish after the change. Its withdrawals are not passed on to the new owner either:
    a chunk stored again since was published there, and the older withdrawal undid it."""
    a, o, q = member("A"), member("O"), member("Q")
    wire = Wire()
    held: list[tuple[bytes, Where]] = []
    writer_view = View(a, [o])
    writer = directory_of(wire, writer_view, lambda: list(held), settle=0.05)
    owner = directory_of(wire, View(o, [a]))
    joiner = directory_of(wire, View(q, [a, o]))
    after = Ring({x.node_id: x for x in (a, o, q)}, 8, 1)
    moving = [k for k in owned_by(writer, "O", 256) if after.owners_many([k])[0] == ("Q",)]
    assert len(moving) >= 2
    kept_pub, again = moving[:2]
    writer.start()
    try:
        held.append((again, Where.POOL))
        assert writer.wait_published(writer.publish([again]), 10.0)
        assert owner.shard.get([again])[0]
        wire.suspects = {o.control}
        held[:] = [(kept_pub, Where.POOL)]
        writer.publish([kept_pub])
        writer.unpublish([again])  # evicted
        assert writer.flush()
        assert writer.counts["publish_deferred"] == 2
        writer_view.set([a, o, q])  # Q joins
        deadline = time.monotonic() + 10.0
        while writer.counts["rebalances"] < 1:
            assert time.monotonic() < deadline, "no rebalance"
            time.sleep(0.01)
        held.append((again, Where.POOL))  # stored again: published to its new owner
        assert writer.wait_published(writer.publish([again]), 10.0)
        assert joiner.shard.get([again])[0]
        wire.suspects = set()  # the old owner answers again
        while writer.counts["publish_deferred_moved"] < 2 or writer._deferred:
            assert time.monotonic() < deadline, "the kept updates were never handled"
            time.sleep(0.01)
        assert writer.flush()
        assert not owner.shard.get([kept_pub])[0]  # not sent to the old owner
        assert joiner.shard.get([kept_pub])[0]  # the re-publish after the change
        assert joiner.shard.get([again])[0]  # the older withdrawal did not undo it
    finally:
        writer.close()
