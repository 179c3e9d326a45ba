"""Updates a ring directory held back for a suspect owner (:mod:`tierkv.cluster.ring_directory`)
go out in order with the ones made after it answers again, with a stand-in membership and
control client in front of a real shard (the suspect owners of real processes:
tests/cluster/test_cluster_suspect.py)."""

from __future__ import annotations

import time
from typing import Any

from tierkv.cluster import messages as m
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
