"""Controller mode with real processes on loopback: one `tierkv controller`, three
`tierkv server --controller`. Asynchronous effects are awaited by bounded polling."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
import zmq

from cluster.test_cluster_servers import fetch, store, tokens_for
from support.clusterkit import FAST, TOKEN, Node, free_ports, wait_for
from support.servers import ServerProcess
from tierkv.cluster import messages as m
from tierkv.cluster.control import ControlClient
from tierkv.controller import messages as cm

pytestmark = pytest.mark.processes
Factory = Callable[..., ServerProcess]


def ctl_call(addr: str, msg: object, token: str = TOKEN) -> object:
    client = ControlClient(token, 2.0, decoder=cm.reply_decoder)
    try:
        return client.call(addr, msg)
    finally:
        client.close()


def ctl_status(addr: str) -> dict[str, object]:
    reply = ctl_call(addr, m.GetStatus(0))
    assert isinstance(reply, m.NodeStatus), reply
    return dict(reply.stats)


@pytest.fixture
def controller() -> Iterator[str]:
    (port,) = free_ports(1)
    cmd = [
        sys.executable, "-m", "tierkv.cli", "controller", "--port", str(port),
        "--http-port", "0", "--auth-token", TOKEN,
        "--heartbeat-interval", "0.2", "--dead-after", "1.2",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=dict(os.environ), stderr=subprocess.PIPE, text=True)
    addr = f"127.0.0.1:{port}"
    try:
        wait_for(lambda: isinstance(ctl_call(addr, m.GetStatus(0)), m.NodeStatus))
        yield addr
    finally:
        proc.terminate()
        proc.wait(15)


def start(factory: Factory, controller: str) -> Node:
    (port,) = free_ports(1)
    args = [
        "--controller", controller, "--cluster-port", str(port), "--auth-token", TOKEN,
        *FAST, "--http-port", "0",
    ]  # fmt: skip
    return Node(factory(pool_size="64MiB", extra=args), port)


def test_chunk_stored_on_a_is_retrieved_byte_exact_on_b_via_the_controller(
    server_factory: Factory, controller: str
) -> None:
    a, b, c = (start(server_factory, controller) for _ in range(3))
    wait_for(lambda: len(ctl_status(controller)["instances"]) == 3)  # type: ignore[arg-type]
    tokens = tokens_for(1, 6)
    keys = store(a, tokens, 6)
    located = ctl_call(controller, m.Resolve(0, keys))
    assert isinstance(located, cm.Located)
    assert [h.node_id for h in located.holders] == [a.node_id]
    assert sorted(p for p, _, _ in located.found) == list(range(6))
    hits, retrieved = fetch(b, tokens, 6)
    assert hits == 6 and retrieved == list(range(6))
    # B's copies are reported too: C finds two holders.
    wait_for(lambda: len(ctl_call(controller, m.Resolve(0, keys)).holders) == 2)  # type: ignore[attr-defined]
    assert fetch(c, tokens, 6, rid="c") == (6, list(range(6)))


def test_unsigned_and_malformed_controller_messages_are_refused(controller: str) -> None:
    assert isinstance(ctl_call(controller, m.GetStatus(0), token="wrong"), m.Refused)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{controller}")
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
    ack = ctl_call(controller, bad)
    assert isinstance(ack, cm.Ack) and not ack.ok
    bad_keys = ctl_call(controller, m.Resolve(0, [b"short"]))
    assert isinstance(bad_keys, m.Refused)
    assert ctl_status(controller)["reports_refused"] == 1
