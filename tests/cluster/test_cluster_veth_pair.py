"""Two hosts: each `tierkv server` in its own network namespace, the two joined by a veth
pair, for both data planes: TCP, and NIXL with UCX over TCP on the pair (``UCX_TLS=tcp``,
device eth0: no shortcut through the shared host). Reads stay byte-exact (and, with NIXL,
one-sided) through random packet loss (iptables ``statistic``) and a rate limit (``tc
tbf``); a link that drops everything makes reads misses, and they come back once the link
does. Engines reach each server over its ipc socket, a file path. Everything is named
uniquely per run and removed afterwards; skipped, with the reason, where namespaces,
iptables or tc are not available, or (the NIXL case) nixl cannot be imported."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
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
from support.nixl_kit import needs_nixl
from support.servers import ServerProcess, stop_and_clean

pytestmark = pytest.mark.processes

CONTROL_PORT = 7100
OPTIONS = [
    "--heartbeat-interval", "0.2",
    "--member-ttl", "2",
    "--peer-timeout", "3",  # a READ's deadline: a liveness bound through loss and the limit
    "--prefetch-timeout", "10",
]  # fmt: skip


@pytest.fixture
def hosts(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, tuple[str, str]]]:
    """host -> (namespace, address): two namespaces joined by a veth pair (eth0 in each)."""
    require_tools(("iptables", "iptables"), ("tc", "iproute2"))
    tag, subnet = run_names()
    made: list[str] = []
    try:
        out: dict[str, tuple[str, str]] = {}
        for i, host in enumerate("ab", start=1):
            ns = f"tkv{tag}n{host}"
            add_namespace(ns)
            made.append(ns)
            out[host] = (ns, f"{subnet}.{i}")
        (na, _), (nb, _) = out["a"], out["b"]
        ip("-n", na, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", nb)
        for ns, addr in out.values():
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
        # UCX over TCP on the veth pair: what a path to another node uses without RDMA.
        monkeypatch.setenv("UCX_TLS", "tcp")
        monkeypatch.setenv("UCX_NET_DEVICES", "eth0")
        yield out
    finally:
        for ns in made:
            ip("netns", "del", ns, check=False)


def start(
    hosts: dict[str, tuple[str, str]], host: str, tmp_path: Path, transport: str
) -> NetnsServer:
    ns, addr = hosts[host]
    seeds = ",".join(f"{a}:{CONTROL_PORT}" for _, a in hosts.values())
    args = [
        "--cluster-host", addr, "--cluster-port", str(CONTROL_PORT),
        "--cluster-seeds", seeds, "--auth-token", TOKEN, *OPTIONS,
        "--peer-transport", transport,
    ]  # fmt: skip
    instance = f"{host}-{secrets.token_hex(4)}"
    srv = NetnsServer(instance, tmp_path / f"run-{instance}", "64MiB", args)
    srv.netns = ns
    return srv.start()


def alive(srv: ServerProcess) -> int:
    return sum(r["state"] in ("alive", "self") for r in cluster(srv)["members"])


def received(reader: ServerProcess, holder_id: str, transport: str) -> int:
    """Chunks ``reader`` read from ``holder_id`` over ``transport``."""
    figures = cluster(reader)["transport"]
    if transport == "nixl":
        figures = figures["nixl"]
    return int(figures["received"].get(holder_id, {}).get("chunks", 0))


@pytest.mark.parametrize("transport", ["tcp", pytest.param("nixl", marks=needs_nixl)])
def test_reads_across_a_veth_pair_with_loss_a_rate_limit_and_a_cut(
    transport: str, hosts: dict[str, tuple[str, str]], tmp_path: Path
) -> None:
    servers: list[NetnsServer] = []
    try:
        a = start(hosts, "a", tmp_path, transport)
        servers.append(a)
        b = start(hosts, "b", tmp_path, transport)
        servers.append(b)
        wait_for(lambda: alive(a) == alive(b) == 2)
        a_id = f"{hosts['a'][1]}:{CONTROL_PORT}"
        store(a, 1)
        assert fetch(b, 1, "clean") == CHUNKS
        assert received(b, a_id, transport) == CHUNKS
        if transport == "nixl":
            nixl = cluster(b)["transport"]["nixl"]
            assert nixl["ucx_tls"] == "tcp" and nixl["fallbacks"] == 0

        # 2 % of the packets each way dropped at random, A's sends limited to 50 Mbit/s.
        ns_a, ns_b = hosts["a"][0], hosts["b"][0]
        loss = ["-m", "statistic", "--mode", "random", "--probability", "0.02", "-j", "DROP"]
        in_ns(ns_a, "iptables", "-A", "OUTPUT", "-o", "eth0", *loss)
        in_ns(ns_b, "iptables", "-A", "OUTPUT", "-o", "eth0", *loss)
        in_ns(ns_a, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "50mbit",
              "burst", "64kb", "latency", "400ms")  # fmt: skip
        for seed in (2, 3, 4):
            store(a, seed)
            assert fetch(b, seed, f"lossy-{seed}") == CHUNKS  # byte-exact
        assert received(b, a_id, transport) == 4 * CHUNKS  # all over it, none fell back
        if transport == "nixl":
            assert cluster(b)["transport"]["nixl"]["fallbacks"] == 0

        # A cut: every packet from A dropped. B's reads of A's chunks are misses, bounded.
        store(a, 5)
        cut = ["iptables", "-I", "OUTPUT", "-o", "eth0", "-j", "DROP"]
        in_ns(ns_a, *cut)
        assert fetch(b, 5, "cut") == 0
        in_ns(ns_a, *[("-D" if x == "-I" else x) for x in cut])
        # The link is back: B reads A's chunks again (over NIXL, or TCP while it falls back).
        wait_for(lambda: alive(a) == alive(b) == 2)
        wait_for(lambda: fetch(b, 5, f"back-{secrets.token_hex(2)}") == CHUNKS, timeout=60)
        assert a.proc is not None and a.proc.poll() is None
    finally:
        for srv in servers:
            stop_and_clean(srv)
