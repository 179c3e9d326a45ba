"""`tierkv demo --with-server --nodes 2`: two servers in a cluster, engines on each.

Two throw-away servers form a cluster on loopback: by default a consistent-hash ring (A
seeds itself, B joins through A); with ``--directory controller`` both register with a
throw-away `tierkv controller` (:mod:`tierkv.demo.local_controller`) instead. First
the engines of node A run the workload: they compute and store every document's KV. Then
the engines of node B run the same workload: B's pool is empty, so their lookups miss
locally, the prefetch finds the chunks through the cluster directory and fetches them from
A's pool into B's; the second report splits B's hits into its own pool and the peer tier
(remote hits). Every loaded chunk is verified byte for byte, on both nodes.
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable

from tierkv.cluster import messages as m
from tierkv.cluster.control import ControlClient
from tierkv.demo.fleet import run_demo
from tierkv.demo.kv import SimModel
from tierkv.demo.local_controller import LocalController
from tierkv.demo.local_server import LocalServer, LocalServerError
from tierkv.demo.report import DemoReport
from tierkv.demo.workload import Workload
from tierkv.pool import format_bytes


def _free_port_pair() -> int:
    """A free port whose successor is free too (cluster control port + data port)."""
    while True:
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = int(a.getsockname()[1])
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port


def _members(client: ControlClient, addr: str) -> set[str]:
    reply = client.call(addr, m.GetMembers(0))
    return {info.node_id for info in reply.members} if isinstance(reply, m.MemberList) else set()


def _published(client: ControlClient, addr: str) -> int:
    reply = client.call(addr, m.GetStatus(0))
    value = reply.stats.get("published") if isinstance(reply, m.NodeStatus) else None
    return value if isinstance(value, int) else -1


class _Steady:
    """True once a node's count of published chunks is positive and stopped changing."""

    def __init__(self, client: ControlClient, addr: str) -> None:
        self.client, self.addr, self.last = client, addr, -1

    def __call__(self) -> bool:
        now = _published(self.client, self.addr)
        steady = now == self.last and now > 0
        self.last = now
        return steady


def _wait(what: Callable[[], bool], timeout: float, why: str) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            raise LocalServerError(f"the two demo servers did not {why} within {timeout:.0f} s")
        time.sleep(0.1)


def run_two_node_demo(
    workload: Workload,
    model: SimModel,
    engines: int,
    pool_size: int,
    timeout: float,
    directory: str = "ring",
) -> int:
    """Run the workload on node A's engines, then on node B's; print both reports.
    ``directory``: ``ring`` or ``controller`` (see the module doc)."""

    pa, pb = _free_port_pair(), _free_port_pair()
    fast = ["--heartbeat-interval", "0.5", "--member-ttl", "3"]
    ctl = LocalController() if directory == "controller" else None
    if ctl is not None:
        a_dir, b_dir = ["--controller", ctl.addr], ["--controller", ctl.addr]
    else:
        a_dir = b_dir = ["--cluster-seeds", f"127.0.0.1:{pa}"]
    a = LocalServer(pool_size, [*a_dir, "--cluster-port", str(pa), *fast])
    b = LocalServer(pool_size, [*b_dir, "--cluster-port", str(pb), *fast])
    a.instance += "-a"
    b.instance += "-b"
    how = f"with a controller on {ctl.addr}" if ctl is not None else "in a cluster"
    print(
        f"starting two tierkv servers {how} (pools of {format_bytes(pool_size)}; "
        f"cluster ports {pa} and {pb}) ...",
        file=sys.stderr,
    )
    control = ControlClient("", 1.0)
    status = 0
    reports: list[tuple[str, DemoReport]] = []
    started: list[LocalServer] = []
    ctl_started = False
    try:
        if ctl is not None:
            ctl.start()
            ctl_started = True
        for server in (a, b):
            server.start()
            started.append(server)
        addrs = {f"127.0.0.1:{pa}", f"127.0.0.1:{pb}"}
        if ctl is not None:
            _wait(lambda: ctl.synced() == addrs, 30, "register with the controller")
        else:
            _wait(lambda: all(_members(control, x) == addrs for x in addrs), 30, "find each other")
            time.sleep(1.5)  # let both directories settle on the two-member ring
        for name, server in (("A", a), ("B", b)):
            print(f"node {name}: {engines} engine processes run the workload ...", file=sys.stderr)
            report = run_demo(server.endpoint, workload, model, engines, timeout=timeout)
            reports.append((name, report))
            if name == "A":  # node A's chunks reach the directory asynchronously
                _wait(_Steady(control, f"127.0.0.1:{pa}"), 60, "publish node A's chunks")
    except LocalServerError as exc:
        print(f"tierkv demo: {exc}", file=sys.stderr)
        status = 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        status = 130
    finally:
        control.close()
        for server in reversed(started):
            try:
                server.stop()
            except LocalServerError as exc:
                print(f"tierkv demo: {exc}", file=sys.stderr)
                status = status or 1
        if ctl is not None:
            if ctl_started:
                try:
                    ctl.stop()  # last: the servers deregistered from it as they stopped
                except LocalServerError as exc:
                    print(f"tierkv demo: {exc}", file=sys.stderr)
                    status = status or 1
            ctl.cleanup()
        for server in (a, b):
            server.cleanup()
    for name, report in reports:
        print(f"\n===== node {name} =====")
        print(report.format())
        if not report.ok:
            status = status or 1
    if len(reports) == 2:
        first, second = reports[0][1], reports[1][1]
        remote = _peer_loaded(second)
        print(
            f"\nremote hits: node B's engines hit {second.count('hit_chunks')} chunks, "
            f"{remote} of them fetched from node A's pool through the cluster (peer tier); "
            f"prefill computed {second.count('prefill_tokens')} tokens on node B, "
            f"{first.count('prefill_tokens')} on node A"
        )
        if not remote:
            status = status or 1
    if started and status == 0:
        what = "both servers and the controller" if ctl is not None else "both servers"
        print(f"{what} stopped cleanly (exit status 0, pool segments removed)")
    return status


def _peer_loaded(report: DemoReport) -> int:
    stats = report.server_stats
    if stats is None:
        return 0
    return sum(t.loaded_chunks for t in stats.tiers if t.name == "peer")
