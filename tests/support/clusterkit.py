"""Helpers for cluster tests: free ports, real servers joined into a cluster, status polls."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from support import ports
from support.servers import ServerProcess
from tierkv.client import Client
from tierkv.cluster import messages as m
from tierkv.cluster.control import ControlClient
from tierkv.config import ServerConfig

TOKEN = "cluster-test-secret"
FAST = [
    "--heartbeat-interval", "0.2",
    "--member-ttl", "1.2",
    "--peer-timeout", "0.5",
    "--prefetch-timeout", "5",
    "--eviction-interval", "0.05",
]  # fmt: skip
_HAS_HTTP = "http_port" in {f.name for f in msgspec.structs.fields(ServerConfig)}


def free_ports(n: int) -> list[int]:
    """``n`` ports, each with its successor free too (control port + data port)."""
    return ports.free_ports(n, span=2)


@dataclass
class Node:
    server: ServerProcess
    port: int

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def node_id(self) -> str:
        return self.addr

    def client(self) -> Client:
        """An engine client of this server (cluster servers require the shared secret)."""
        return self.server.client(auth_token=TOKEN)


def cluster_args(port: int, seeds: list[int], token: str = TOKEN) -> list[str]:
    args = [
        "--cluster-seeds", ",".join(f"127.0.0.1:{s}" for s in seeds),
        "--cluster-port", str(port),
        "--auth-token", token,
        *FAST,
    ]  # fmt: skip
    if _HAS_HTTP:
        args += ["--http-port", "0"]
    return args


def start_node(
    factory: Callable[..., ServerProcess],
    seeds: list[int],
    pool_size: str = "64MiB",
    extra: list[str] | None = None,
    seed_self: bool = False,
) -> Node:
    """Start a server on a free port pair, joining through ``seeds`` (and itself with
    ``seed_self``). Ports are probed free, but another process on the machine may take one
    before the server binds it: then the start is retried on fresh ports."""
    for attempt in range(5):
        (port,) = free_ports(1)
        own = [port] if seed_self else []
        args = cluster_args(port, [*seeds, *own]) + list(extra or [])
        try:
            return Node(factory(pool_size=pool_size, extra=args), port)
        except RuntimeError as exc:
            if "cannot bind the cluster" not in str(exc) or attempt == 4:
                raise
    raise AssertionError("unreachable")


def call(addr: str, msg: Any, token: str = TOKEN, timeout: float = 2.0) -> Any:
    client = ControlClient(token, timeout)
    try:
        return client.call(addr, msg)
    finally:
        client.close()


def status(node: Node) -> dict[str, Any]:
    reply = call(node.addr, m.GetStatus(0))
    assert isinstance(reply, m.NodeStatus), reply
    return dict(reply.stats)


def members(node: Node) -> set[str]:
    reply = call(node.addr, m.GetMembers(0))
    assert isinstance(reply, m.MemberList), reply
    return {info.node_id for info in reply.members}


def wait_for(what: Callable[[], Any], timeout: float = 20.0, interval: float = 0.05) -> Any:
    """Poll until ``what()`` is truthy (bounded); returns its value or fails the test."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = what()
        except (AssertionError, ConnectionError):
            last = None
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s (last value {last!r})")


def converged(nodes: list[Node]) -> bool:
    """Every node sees exactly ``nodes`` as members."""
    want = {n.node_id for n in nodes}
    return all(members(n) == want for n in nodes)


def published(node: Node) -> int:
    return int(status(node)["published"])


def rows_of(answer: Any) -> list[tuple[int, int, int]]:
    """A lookup answer's (``Resolved``, ``Located``) rows as (position, holder index, tier)."""
    cols = (
        np.frombuffer(answer.positions, "<u4").tolist(),
        np.frombuffer(answer.holder_of, "<u2").tolist(),
        np.frombuffer(answer.tiers, "u1").tolist(),
    )
    return list(zip(*cols, strict=True))


def columns_of(rows: list[tuple[int, int, int]]) -> tuple[bytes, bytes, bytes]:
    """Rows as an answer's columns; values outside a column's range wrap, as a peer that
    writes them carelessly would send them."""
    pos, hold, tier = (np.array([r[i] for r in rows], np.int64) for i in range(3))
    return pos.astype("<u4").tobytes(), hold.astype("<u2").tobytes(), tier.astype("u1").tobytes()
