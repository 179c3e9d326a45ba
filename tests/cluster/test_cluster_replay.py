"""Signed control requests are single-use on a real ring node: a captured Publish or
Unpublish played again is refused and changes nothing, while many threads of one process
calling at once (their requests arriving out of order) are all served."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from support.clusterkit import TOKEN, Node, call, rows_of, start_node, status
from support.control_wire import RawControl
from support.servers import ServerProcess
from tierkv.cluster import messages as m
from tierkv.cluster.auth import ControlSigner
from tierkv.cluster.control import ControlClient

pytestmark = pytest.mark.processes
Factory = Callable[..., ServerProcess]
KEY = bytes(range(32))
FAKE = "replay:1"  # a holder that is not a member: the directory takes its entries as given


class Wire:
    """Signed frames sent as they are, as an attacker who captured them would."""

    def __init__(self, node: Node) -> None:
        self.signer = ControlSigner(TOKEN)
        self.raw = RawControl(node.addr)

    def sign(self, msg: Any) -> list[bytes]:
        payload = m.encode(msg)
        return [self.signer.sign_request(payload), payload]

    def send(self, frames: list[bytes]) -> Any:
        return self.raw.call(frames)

    def close(self) -> None:
        self.raw.close()


def holders(node: Node) -> set[str]:
    reply = call(node.addr, m.Resolve(0, [KEY]))
    assert isinstance(reply, m.Resolved), reply
    return {reply.holders[h] for _, h, _ in rows_of(reply)}


def test_replayed_publish_and_unpublish_are_refused(server_factory: Factory) -> None:
    node = start_node(server_factory, [], pool_size="32MiB", seed_self=True)
    wire = Wire(node)
    try:
        publish = wire.sign(m.Publish(1, FAKE, 1, [(KEY, 0)]))
        unpublish = wire.sign(m.Unpublish(2, FAKE, [KEY]))
        assert wire.send(publish) == m.Done(1, 1)
        assert FAKE in holders(node)
        assert wire.send(unpublish) == m.Done(2, 1)
        assert FAKE not in holders(node)
        # The captured Publish played again would put the withdrawn entry back: refused.
        reply = wire.send(publish)
        assert isinstance(reply, m.Refused) and "replayed" in reply.reason, reply
        assert FAKE not in holders(node)
        # Published again (a new request), the captured Unpublish cannot withdraw it.
        assert wire.send(wire.sign(m.Publish(3, FAKE, 1, [(KEY, 0)]))) == m.Done(3, 1)
        reply = wire.send(unpublish)
        assert isinstance(reply, m.Refused) and "replayed" in reply.reason, reply
        assert FAKE in holders(node)
        control = status(node)["control"]
        assert control["replayed"] == 2 and control["refused"] == 2, control
    finally:
        wire.close()


def test_concurrent_calls_from_many_threads_are_all_served(server_factory: Factory) -> None:
    node = start_node(server_factory, [], pool_size="32MiB", seed_self=True)
    client = ControlClient(TOKEN, 10.0)
    failures: list[Any] = []

    def calls(n: int) -> None:
        for i in range(150):
            msg = m.GetMembers(0) if i % 2 else m.Resolve(0, [KEY, bytes([n]) * 32])
            reply = client.call(node.addr, msg)
            if not isinstance(reply, (m.MemberList, m.Resolved)):
                failures.append(reply)

    try:
        threads = [threading.Thread(target=calls, args=(n,)) for n in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        client.close()
    assert failures == []
    control = status(node)["control"]
    assert control["refused"] == 0 and control["replayed"] == 0, control
    assert control["served"] >= 16 * 150
