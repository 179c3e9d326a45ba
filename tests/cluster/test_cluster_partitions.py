"""Partitions between real servers running as three hosts: each `tierkv server` in its own
network namespace, the three linked by a bridge in a fourth (so the machine's own network is
untouched), a one-way cut made with iptables inside a namespace. Engines talk to each server
over its ipc socket, a file path that reaches into any network namespace. Everything is
named uniquely per run and removed afterwards, even on failure; skipped, with the reason,
where namespaces or iptables are not available.

Asymmetric: A can no longer send to B on connections A opens (new or already open: B's
ports are dropped in A's OUTPUT chain), while B's own connections to A, and A's answers on
them, go through; so A keeps hearing B's heartbeats. A must treat B as unreachable from A
(out of A's view, as if partitioned both ways), store at full speed and miss B's chunks
cleanly, and take B back once the cut is lifted."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.clusterkit import TOKEN, wait_for
from support.netns import (
    CHUNKS,
    NetnsServer,
    add_namespace,
    cluster,
    fetch,
    in_ns,
    ip,
    require_tools,
    run_names,
    store,
)
from support.servers import ServerProcess, stop_and_clean

pytestmark = pytest.mark.processes

CONTROL_PORT = 7100  # every host has its own ports: the same on each
TIMINGS = [
    "--heartbeat-interval", "0.2",
    "--member-ttl", "1.2",
    "--peer-timeout", "0.5",
    "--prefetch-timeout", "5",
]  # fmt: skip


@dataclass
class Hosts:
    """Three namespaces (hosts a, b, c) on one bridge, and their addresses."""

    names: dict[str, str]
    addrs: dict[str, str]
    hub: str

    def all(self) -> list[str]:
        return [*self.names.values(), self.hub]


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    require_tools(("iptables", "iptables"))
    tag, subnet = run_names()
    hub = f"tkv{tag}h"
    made: list[str] = []
    try:
        add_namespace(hub)
        made.append(hub)
        ip("-n", hub, "link", "add", "br0", "type", "bridge")
        ip("-n", hub, "link", "set", "br0", "up")
        names, addrs = {}, {}
        for i, host in enumerate("abc", start=1):
            ns = f"tkv{tag}{host}"
            add_namespace(ns)
            made.append(ns)
            ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{host}",
               "netns", hub)  # fmt: skip
            ip("-n", hub, "link", "set", f"p{host}", "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{subnet}.{i}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            names[host], addrs[host] = ns, f"{subnet}.{i}"
        yield Hosts(names, addrs, hub)
    finally:
        for ns in made:
            ip("netns", "del", ns, check=False)


def start_host(hosts: Hosts, host: str, tmp_path: Path) -> NetnsServer:
    addr = hosts.addrs[host]
    seeds = ",".join(f"{hosts.addrs[h]}:{CONTROL_PORT}" for h in "abc")
    args = [
        "--cluster-host", addr, "--cluster-port", str(CONTROL_PORT),
        "--cluster-seeds", seeds, "--auth-token", TOKEN, *TIMINGS,
    ]  # fmt: skip
    instance = f"{host}-{secrets.token_hex(4)}"
    srv = NetnsServer(instance, tmp_path / f"run-{instance}", "64MiB", args)
    srv.netns = hosts.names[host]
    return srv


def alive(srv: ServerProcess) -> set[str]:
    return {str(r["node_id"]) for r in cluster(srv)["members"] if r["state"] in ("alive", "self")}


def test_a_one_way_cut_is_detected_bounded_and_healed(hosts: Hosts, tmp_path: Path) -> None:
    servers: dict[str, NetnsServer] = {}
    cut = [
        "iptables", "-A", "OUTPUT", "-d", hosts.addrs["b"], "-p", "tcp", "-m", "multiport",
        "--dports", f"{CONTROL_PORT},{CONTROL_PORT + 1}", "-j", "DROP",
    ]  # fmt: skip
    try:
        for host in "abc":
            servers[host] = start_host(hosts, host, tmp_path).start()
        a, b, c = servers["a"], servers["b"], servers["c"]
        ids = {h: f"{hosts.addrs[h]}:{CONTROL_PORT}" for h in "abc"}
        wait_for(lambda: all(alive(s) == set(ids.values()) for s in servers.values()))
        store(b, 1)  # B's chunks, known to the directory before the cut
        assert fetch(c, 1, "warm") == CHUNKS  # ... and now C's too
        store(b, 2)  # B's only

        in_ns(hosts.names["a"], *cut)
        # A hears B but cannot reach it: B is out of A's view (B and C still count A in).
        wait_for(lambda: alive(a) == {ids["a"], ids["c"]})
        assert cluster(a)["membership"]["unreachable"] >= 1
        before = cluster(a)
        for i in range(5):  # full speed: nothing waits for B
            store(a, 10 + i)
        assert fetch(a, 1, "from-c") == CHUNKS  # copies on C serve A
        assert fetch(a, 2, "cut") == 0  # B's only: a clean miss, never an error
        after = cluster(a)
        assert after["control"]["timeouts"] == before["control"]["timeouts"]
        assert (
            after["directory"]["publish_wait_timeouts"]
            == before["directory"]["publish_wait_timeouts"]
        )
        assert alive(b) == set(ids.values())  # B reaches A: its view is whole

        in_ns(hosts.names["a"], *[("-D" if x == "-A" else x) for x in cut])
        wait_for(lambda: alive(a) == set(ids.values()))
        wait_for(lambda: fetch(a, 2, f"back{secrets.token_hex(2)}") == CHUNKS)
        store(a, 20)
        assert fetch(b, 20, "b-reads-a") == CHUNKS
    finally:
        for srv in servers.values():
            stop_and_clean(srv)
