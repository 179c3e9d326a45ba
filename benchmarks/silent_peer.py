"""What a silent peer or controller costs the engines: lookups and stores on a server while
one process it depends on is frozen (SIGSTOP; SIGCONT always follows), real processes on
loopback, the default ``--peer-timeout`` (2 s).

- controller mode: a `tierkv controller` and servers A and B; ``--ops`` lookups on A of
  chunks nobody holds (each a local miss that asks the controller), first while everything
  runs (the baseline), then with the controller frozen.
- ring mode: servers A, B and C (``--member-ttl 60``: C stays a silent member, not a dead
  one, for the whole run); ``--ops`` stores on A (each commit waits for its directory
  publish), ``--ops`` lookups of missing chunks and ``--ops`` lookups of chunks only C holds
  (fetched from C while it runs; misses while it is frozen), first with C running, then
  frozen.

For each frozen phase: the first operation (which may wait out the peer timeout once) and
the others (p50, max), in ms, and the max of the others over the peer timeout: the goal is a
silent peer costing one timeout, not one per request, i.e. a ratio well below 1.

    python benchmarks/silent_peer.py [--ops 10]

The last line is machine-readable: ``silent_peer ctl_lookup_rest_max_ms=A
ring_store_rest_max_ms=B ring_lookup_rest_max_ms=C ring_held_lookup_rest_max_ms=D
worst_rest_over_timeout=E``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from peers import free_port_pair
from stop_signals import exit_on_stop_signals
from tierkv.client import Client, wait_for_server
from tierkv.cluster import controller_messages as cm
from tierkv.cluster import messages as m
from tierkv.cluster.control import ControlClient

TOKEN = "silent-peer-bench"
PEER_TIMEOUT = 2.0
CHUNKS = 4
SHAPE = (2, 256, 16)


class Proc:
    """A `tierkv server` or `tierkv controller` subprocess."""

    def __init__(self, root: str, name: str, args: list[str], endpoint: str = "") -> None:
        self.log = open(os.path.join(root, f"{name}.log"), "wb")  # noqa: SIM115
        cmd = [sys.executable, "-m", "tierkv.cli", *args, "--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.endpoint = endpoint
        if endpoint and not wait_for_server(endpoint, 60, lambda: self.proc.poll() is not None):
            raise RuntimeError(f"{name} exited; see {self.log.name}")

    @contextmanager
    def frozen(self) -> Iterator[None]:
        self.proc.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def server(root: str, name: str, port: int, cluster: list[str]) -> Proc:
    runtime = os.path.join(root, name)
    args = [
        "server", "--instance", f"bench-{name}", "--runtime-dir", runtime,
        "--pool-name", f"tierkv-bench-{uuid.uuid4().hex[:8]}", "--pool-size", "64MiB",
        "--auth-token", TOKEN, "--cluster-port", str(port), "--http-port", "0",
        "--peer-timeout", str(PEER_TIMEOUT), *cluster,
    ]  # fmt: skip
    return Proc(root, name, args, f"ipc://{runtime}/rpc.sock")


def ask(addr: str, msg: object, decoder: object = None) -> object:
    client = ControlClient(TOKEN, 1.0, **({"decoder": decoder} if decoder else {}))  # type: ignore[arg-type]
    try:
        return client.call(addr, msg)
    finally:
        client.close()


def wait_for(what: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark setup did not converge")
        time.sleep(0.05)


def prompt(seq: int) -> list[int]:
    base = (os.getpid() % 100) * 10**7 + seq * 10_000
    return list(range(base, base + 256 * CHUNKS))


class Engine:
    """An engine on one server: stores and looks up token sequences (``prompt(seq)``; fresh
    ones by default)."""

    def __init__(self, srv: Proc, first: int = 0) -> None:
        self.client = Client(srv.endpoint, timeout=60.0, auth_token=TOKEN)
        self.client.register("bench-model", SHAPE, "float32", token_axis=1)
        self.seq = first

    def store(self) -> float:
        self.seq += 1
        data = [np.full(SHAPE, i, np.float32) for i in range(CHUNKS)]
        t = time.perf_counter()
        self.client.store(prompt(self.seq), data)
        return time.perf_counter() - t

    def lookup(self, seq: int = 0, hits: int = 0) -> float:
        """A lookup (waiting for its prefetch) of ``prompt(seq)`` (a fresh one by default)
        that must find ``hits`` chunks."""
        self.seq += 1
        rid = f"r{self.seq}"
        t = time.perf_counter()
        found = self.client.lookup(prompt(seq or self.seq), request_id=rid, wait=True).hits
        took = time.perf_counter() - t
        self.client.end_session(rid)
        assert found == hits, (found, hits)
        return took

    def lookup_miss(self) -> float:
        return self.lookup()

    def close(self) -> None:
        self.client.close()


def timed(op: Callable[[], float], n: int) -> list[float]:
    return [op() * 1000 for _ in range(n)]


def report(label: str, base: list[float], frozen: list[float]) -> float:
    rest = frozen[1:]
    print(
        f"{label:28s} baseline p50 {statistics.median(base):8.1f} ms | frozen: first "
        f"{frozen[0]:8.1f} ms, others p50 {statistics.median(rest):8.1f} ms, "
        f"max {max(rest):8.1f} ms (peer timeout {PEER_TIMEOUT * 1000:.0f} ms)"
    )
    return max(rest)


def controller_mode(root: str, ops: int) -> float:
    port = free_port_pair()
    ctl = Proc(root, "controller", ["controller", "--port", str(port), "--http-port", "0",
                                    "--auth-token", TOKEN])  # fmt: skip
    servers: list[Proc] = []
    try:
        addr = f"127.0.0.1:{port}"
        for name in "ab":
            servers.append(server(root, name, free_port_pair(), ["--controller", addr]))

        def registered() -> bool:
            reply = ask(addr, m.GetStatus(0), cm.reply_decoder)
            return isinstance(reply, m.NodeStatus) and len(reply.stats["instances"]) == 2  # type: ignore[arg-type]

        wait_for(registered)
        engine = Engine(servers[0])
        base = timed(engine.lookup_miss, ops)
        with ctl.frozen():
            frozen = timed(engine.lookup_miss, ops)
        engine.close()
        return report("controller: lookup (miss)", base, frozen)
    finally:
        for srv in servers:
            srv.stop()
        ctl.stop()


def ring_mode(root: str, ops: int) -> tuple[float, float, float]:
    ports = [free_port_pair() for _ in range(3)]
    seeds = ["--cluster-seeds", f"127.0.0.1:{ports[0]}", "--member-ttl", "60"]
    servers: list[Proc] = []
    try:
        for name, port in zip("abc", ports, strict=True):
            servers.append(server(root, name, port, seeds))

        def converged() -> bool:
            reply = ask(f"127.0.0.1:{ports[0]}", m.GetMembers(0))
            return isinstance(reply, m.MemberList) and len(reply.members) == 3

        wait_for(converged)
        time.sleep(1.0)  # every view complete (members learn each other by gossip)
        held_by_c = Engine(servers[2], first=10**4)  # 2 x ops prompts only C holds
        for _ in range(2 * ops):
            held_by_c.store()
        held_by_c.close()
        c_prompts = iter(range(10**4 + 1, 10**4 + 2 * ops + 1))
        engine = Engine(servers[0])
        base_store = timed(engine.store, ops)
        base_lookup = timed(engine.lookup_miss, ops)
        base_c = timed(lambda: engine.lookup(next(c_prompts), CHUNKS), ops)  # fetched from C
        with servers[2].frozen():
            frozen_store = timed(engine.store, ops)
            frozen_lookup = timed(engine.lookup_miss, ops)
            frozen_c = timed(lambda: engine.lookup(next(c_prompts), 0), ops)  # C cannot serve
        engine.close()
        return (
            report("ring: store (commit)", base_store, frozen_store),
            report("ring: lookup (miss)", base_lookup, frozen_lookup),
            report("ring: lookup (C's chunks)", base_c, frozen_c),
        )
    finally:
        for srv in servers:
            srv.stop()


def main() -> None:
    exit_on_stop_signals()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=int, default=10, help="operations per phase")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="tierkv-silent-")
    ctl = controller_mode(root, args.ops)
    store, lookup, held = ring_mode(root, args.ops)
    worst = max(ctl, store, lookup, held) / (PEER_TIMEOUT * 1000)
    print(
        f"silent_peer ctl_lookup_rest_max_ms={ctl:.1f} ring_store_rest_max_ms={store:.1f} "
        f"ring_lookup_rest_max_ms={lookup:.1f} ring_held_lookup_rest_max_ms={held:.1f} "
        f"worst_rest_over_timeout={worst:.3f}"
    )


if __name__ == "__main__":
    main()
