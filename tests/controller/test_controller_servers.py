"""Controller mode with real processes on loopback: one `tierkv controller`, three
`tierkv server --controller`. Asynchronous effects are awaited by bounded polling."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from support.clusterkit import wait_for
from support.controllers import ControllerProcess, ctl_call, start_server
from support.kvops import fetch, store, tokens_for
from support.servers import ServerProcess
from tierkv.cluster import messages as m
from tierkv.controller import messages as cm

pytestmark = pytest.mark.processes
Factory = Callable[..., ServerProcess]


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[ControllerProcess]:
    ctl = ControllerProcess(tmp_path).start()
    try:
        yield ctl
    finally:
        ctl.stop()


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
    assert sorted(p for p, _, _ in located.found) == list(range(6))
    hits, retrieved = fetch(b, tokens, 6)
    assert hits == 6 and retrieved == list(range(6))
    # B's copies are reported too: C finds two holders.
    wait_for(lambda: controller.holders(keys) == [{a.node_id, b.node_id}] * 6)
    assert fetch(c, tokens, 6, rid="c") == (6, list(range(6)))


def test_unsigned_and_malformed_controller_messages_are_refused(
    controller: ControllerProcess,
) -> None:
    addr = controller.addr
    assert isinstance(ctl_call(addr, m.GetStatus(0), token="wrong"), m.Refused)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{addr}")
    try:
        for frames in ([b"\x92\xa4junk"], [b"x" * 40, b"\xc1garbage"]):
            sock.send_multipart(frames)
            assert sock.poll(5000)
            reply = m.reply_decoder.decode(sock.recv_multipart()[-1])
            assert isinstance(reply, m.Refused)
    finally:
        sock.close()
    # A signed but bad report is refused with a reason; the controller keeps serving.
    bad = cm.Report(0, "nobody", 1, 1, b"k" * 31, b"", b"")
    ack = ctl_call(addr, bad)
    assert isinstance(ack, cm.Ack) and not ack.ok
    bad_keys = ctl_call(addr, m.Resolve(0, [b"short"]))
    assert isinstance(bad_keys, m.Refused)
    status = controller.status()
    assert status is not None and status["reports_refused"] == 1
