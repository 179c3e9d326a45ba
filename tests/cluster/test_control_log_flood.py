"""Logs stay readable under attack: a real ring node and a real controller refuse 1,000 bad
control frames (unsigned, signed with another token, garbage signatures, the old frame
format, replays, signed garbage) and count every one, but log one WARNING, not one line
each; a server run with the wrong cluster token (against a controller, or against a ring
peer) logs a bounded number of lines however long it keeps retrying, and so does the side
that refuses it."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from support.clusterkit import (
    TOKEN,
    call,
    cluster_args,
    free_ports,
    start_node,
    status,
    wait_for,
)
from support.control_wire import RawControl
from support.controllers import ControllerProcess, controller_args
from support.servers import ServerProcess
from tierkv.cluster import messages as m
from tierkv.cluster.auth import OLD_AUTH_BYTES, ControlSigner

pytestmark = pytest.mark.processes
Factory = Callable[..., ServerProcess]
FRAMES = 1000


def bad_frames(n: int) -> list[list[bytes]]:
    """``n`` frames a control port must refuse, of every kind (fixed seed)."""
    rng = random.Random(33)
    payload = m.encode(m.GetStatus(0))  # served by ring nodes and the controller alike
    mine, other = ControlSigner(TOKEN), ControlSigner("another-token")
    replayed = [mine.sign_request(payload), payload]  # the first send is a real request
    kinds: list[Callable[[], list[bytes]]] = [
        lambda: [payload],
        lambda: [other.sign_request(payload), payload],
        lambda: [rng.randbytes(rng.randrange(0, 80)), payload],
        lambda: [bytes(OLD_AUTH_BYTES), payload],
        lambda: replayed,
        lambda: [mine.sign_request(g := rng.randbytes(rng.randrange(1, 40))), g],
    ]
    return [replayed] + [kinds[i % len(kinds)]() for i in range(n)]


def flood(addr: str, frames: list[list[bytes]]) -> list[Any]:
    """Send every frame, then collect every reply (payloads, undecoded)."""
    with RawControl(addr) as conn:
        for f in frames:
            conn.send(f)
        return [conn.reply() for _ in frames]


def noisy_lines(log: str, *words: str) -> list[str]:
    """The log's WARNING and ERROR lines that contain any of ``words``."""
    return [
        line
        for line in log.splitlines()
        if (" WARNING " in line or " ERROR " in line) and any(w in line for w in words)
    ]


REFUSALS = ("refused a request", "requests refused")


def test_a_flood_of_bad_frames_at_a_ring_node_logs_one_warning(server_factory: Factory) -> None:
    node = start_node(server_factory, [], pool_size="32MiB", seed_self=True)
    replies = flood(node.addr, bad_frames(FRAMES))
    assert sum(isinstance(m.reply_decoder.decode(r), m.Refused) for r in replies) == FRAMES
    control = status(node)["control"]
    assert control["refused"] + control["malformed"] == FRAMES, control
    assert control["replayed"] == 166, control  # one frame in six (i % 6 == 4)
    lines = noisy_lines(node.server.log(), *REFUSALS)
    assert len(lines) == 1, lines
    assert "cluster control port" in lines[0] and "summarised" in lines[0]


def test_a_flood_of_bad_frames_at_the_controller_logs_one_warning(
    controller: ControllerProcess,
) -> None:
    flood(controller.addr, bad_frames(FRAMES))
    st = controller.status()
    assert st is not None
    control = st["control"]
    assert control["refused"] + control["malformed"] == FRAMES, control
    assert control["served"] >= 1 and control["replayed"] == 166, control
    lines = noisy_lines(controller.log(), *REFUSALS)
    assert len(lines) == 1, lines


def with_token(args: list[str], token: str) -> list[str]:
    out = list(args)
    out[out.index("--auth-token") + 1] = token
    return out


def test_a_server_with_the_wrong_token_logs_few_lines(
    server_factory: Factory, controller: ControllerProcess
) -> None:
    (port,) = free_ports(1)
    srv = server_factory(
        pool_size="32MiB", extra=with_token(controller_args(controller.addr, port), "wrong")
    )

    def failures() -> int:
        reply = call(f"127.0.0.1:{port}", m.GetStatus(0), token="wrong")
        assert isinstance(reply, m.NodeStatus), reply
        return int(reply.stats["directory"]["registration_failures"])

    # Registration is retried every 0.2 s here (the heartbeat interval).
    wait_for(lambda: failures() >= 15, timeout=60.0)
    lines = noisy_lines(srv.log(), "controller")
    assert len(lines) == 1, lines
    assert "refused" in lines[0] and "wrong signature" in lines[0]
    assert len(noisy_lines(controller.log(), *REFUSALS)) == 1


def test_a_ring_node_with_the_wrong_token_logs_few_lines(server_factory: Factory) -> None:
    seed = start_node(server_factory, [], pool_size="32MiB", seed_self=True)
    (port,) = free_ports(1)
    intruder = server_factory(pool_size="32MiB", extra=cluster_args(port, [seed.port], "wrong"))
    wait_for(lambda: status(seed)["control"]["refused"] >= 25, timeout=60.0)
    lines = noisy_lines(intruder.log(), "cluster peer")
    assert len(lines) == 1, lines
    assert "refused" in lines[0] and "wrong signature" in lines[0]
    assert len(noisy_lines(seed.server.log(), *REFUSALS)) == 1
