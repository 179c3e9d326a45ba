"""Controller mode with real processes on loopback: one `tierkv controller`, three
`tierkv server --controller`. Asynchronous effects are awaited by bounded polling."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from support.clusterkit import rows_of, wait_for
from support.control_wire import RawControl
from support.controllers import ControllerProcess, ctl_call, start_server
from support.kvops import fetch, store, tokens_for
from support.servers import ServerProcess, register
from tierkv.cluster import controller_messages as cm
from tierkv.cluster import messages as m

pytestmark = pytest.mark.processes
Factory = Callable[..., ServerProcess]


def test_chunk_stored_on_a_is_retrieved_byte_exact_on_b_via_the_controller(
    server_factory: Factory, controller: ControllerProcess
) -> None:
    a, b, c = (start_server(server_factory, controller.addr) for _ in range(3))
    wait_for(lambda: len(controller.instances()) == 3)
    tokens = tokens_for(1, 6)
    keys = store(a, tokens, 6)
    located = ctl_call(controller.addr, m.Resolve(0, keys))
    assert isinstance(located, cm.Located)
    assert [h.node_id for h in located.holders] == [a.node_id]
    assert sorted(p for p, _, _ in rows_of(located)) == list(range(6))
    hits, retrieved = fetch(b, tokens, 6)
    assert hits == 6 and retrieved == list(range(6))
    # B's copies are reported too: C finds two holders.
    wait_for(lambda: controller.holders(keys) == [{a.node_id, b.node_id}] * 6)
    assert fetch(c, tokens, 6, rid="c") == (6, list(range(6)))


def test_engines_namespaces_reach_the_controller_with_their_key_counts(
    server_factory: Factory, controller: ControllerProcess
) -> None:
    a, b = (start_server(server_factory, controller.addr) for _ in range(2))
    wait_for(lambda: len(controller.instances()) == 2)
    assert controller.instances()[a.node_id]["namespaces"] == []
    with a.client() as engine:  # an engine registers on A (later than A registered)
        register(engine)
        digest = engine.registration.namespace.hex()  # type: ignore[union-attr]
        wait_for(lambda: controller.instances()[a.node_id]["namespaces"] != [])
        (ns,) = controller.instances()[a.node_id]["namespaces"]
        assert ns == {
            "namespace": digest, "model": "test-model", "chunk_tokens": 256,
            "world_size": 1, "rank": 0,
        }  # fmt: skip
        assert controller.instances()[b.node_id]["namespaces"] == []  # B has no engine
    # The engine left: A no longer serves the namespace, but still holds its chunks.
    wait_for(lambda: controller.instances()[a.node_id]["namespaces"] == [])
    keys = store(a, tokens_for(5, 3), 3)
    assert keys[0][:16].hex() == digest
    by_ns = {digest: [3, 0, 0, 0]}
    wait_for(lambda: controller.instances()[a.node_id]["keys_by_namespace"] == by_ns)
    status = controller.status()
    assert status is not None
    assert status["namespaces"] == [
        {"namespace": digest, "model": "", "keys": 3,
         "keys_by_tier": [3, 0, 0, 0], "instances": 1},
    ]  # fmt: skip


def test_unsigned_and_malformed_controller_messages_are_refused(
    controller: ControllerProcess,
) -> None:
    addr = controller.addr
    assert isinstance(ctl_call(addr, m.GetStatus(0), token="wrong"), m.Refused)
    with RawControl(addr) as raw:
        for frames in ([b"\x92\xa4junk"], [b"x" * 40, b"\xc1garbage"]):
            assert isinstance(raw.call(frames), m.Refused)
        # A frame too short to say how long its signature is: refused, connection kept.
        raw.sock.sendall(b"\x01\x00\x00\x00\x07")
        assert isinstance(m.reply_decoder.decode(raw.reply()), m.Refused)
        assert isinstance(raw.call([b"\x92\xa4junk"]), m.Refused)
    # Connections that do not open with our hello are closed: another protocol, a tierkv
    # of the ZMQ control channel (its greeting), a wire version we do not speak.
    for hello in (b"GET / HTTP/1.1\r\n\r\n", b"\xff" + bytes(8) + b"\x7f", b"TKVC\x09\x00\x00\x00"):
        with RawControl(addr, hello=hello) as raw:
            assert raw.closed_by_peer(), hello
    # A signed but bad report is refused with a reason; the controller keeps serving.
    bad = cm.Report(0, "nobody", 1, 1, b"k" * 31, b"", b"")
    ack = ctl_call(addr, bad)
    assert isinstance(ack, cm.Ack) and not ack.ok
    bad_keys = ctl_call(addr, m.Resolve(0, [b"short"]))
    assert isinstance(bad_keys, m.Refused)
    member = m.MemberInfo("x:1", "x:1", "x:2", 1)
    for bad_ns in (
        cm.NamespaceInfo(b"short", "model", 256),
        cm.NamespaceInfo(b"d" * 16, "", 256),
        cm.NamespaceInfo(b"d" * 16, "model", 0),
        cm.NamespaceInfo(b"d" * 16, "model", 256, world_size=2, rank=2),
    ):
        refused = ctl_call(addr, cm.Register(0, member, [bad_ns]))
        assert isinstance(refused, m.Refused) and "register:" in refused.reason
    unknown = ctl_call(addr, cm.Namespaces(0, "x:1", 1, []))
    assert isinstance(unknown, m.Refused) and "unknown boot" in unknown.reason
    assert controller.instances() == {}
    status = controller.status()
    assert status is not None and status["reports_refused"] == 1
