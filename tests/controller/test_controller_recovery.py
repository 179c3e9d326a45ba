"""Liveness and recovery in controller mode, with a real controller and three real servers
on loopback (short heartbeat and dead-after options): the controller killed and restarted
while engines keep storing, a server killed, a server restarted before it is declared dead.
Asynchronous effects are awaited by bounded polling, never by timing assertions."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from support.clusterkit import Node, wait_for
from support.controllers import ControllerProcess, start_server
from support.kvops import chunk_keys, fetch, held_locally, store, tokens_for
from support.servers import ServerProcess, register

pytestmark = pytest.mark.processes
Factory = Callable[..., ServerProcess]
CHUNKS = 2  # per stored request


class Engines:
    """Engines storing through two servers, and one reading through a third, from threads
    until :meth:`stop`; every retrieved chunk is checked byte for byte by :func:`fetch`."""

    def __init__(self, writers: list[Node], reader: Node) -> None:
        self.stored: list[list[int]] = []  # token lists, in the order their stores returned
        self.by: list[str] = []  # the node each was stored through
        self.errors: list[BaseException] = []
        self.reads = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        seeds = itertools.count(1000)
        self._threads = [
            threading.Thread(target=self._guard, args=(self._write, node, seeds), daemon=True)
            for node in writers
        ]
        self._threads.append(
            threading.Thread(target=self._guard, args=(self._read, reader), daemon=True)
        )
        for t in self._threads:
            t.start()

    def _guard(self, body: Callable[..., None], *args: object) -> None:
        try:
            body(*args)
        except BaseException as exc:  # reported by stop()
            self.errors.append(exc)

    def _write(self, node: Node, seeds: itertools.count[int]) -> None:
        while not self._stop.wait(0.02):
            tokens = tokens_for(next(seeds), CHUNKS)
            store(node, tokens, CHUNKS)
            with self._lock:
                self.stored.append(tokens)
                self.by.append(node.node_id)

    def _read(self, node: Node) -> None:
        for n in itertools.count():
            if self._stop.wait(0.02):
                return
            with self._lock:
                if not self.stored:
                    continue
                tokens = self.stored[n % len(self.stored)]
            hits, retrieved = fetch(node, tokens, CHUNKS, rid=f"read-{n}")
            assert retrieved == list(range(len(retrieved))) and len(retrieved) <= hits
            self.reads += 1

    def count(self) -> int:
        with self._lock:
            return len(self.stored)

    def stop(self) -> list[list[int]]:
        self._stop.set()
        for t in self._threads:
            t.join(30)
        assert not self.errors, self.errors
        return list(self.stored)


def views_agree(ctl: ControllerProcess, nodes: list[Node], keys: list[bytes]) -> bool:
    """The controller names exactly the servers whose pools hold each key, and counts no
    other key for any of them."""
    named = ctl.holders(keys)
    held = {n.node_id: held_locally(n, keys) for n in nodes}
    truth = [{nid for nid, has in held.items() if has[i]} for i in range(len(keys))]
    rows = ctl.instances()
    counts = {nid: rows[nid]["keys"] if nid in rows else -1 for nid in held}
    return named == truth and counts == {nid: sum(h) for nid, h in held.items()}


def keys_of(node: Node, stored: list[list[int]]) -> list[bytes]:
    with node.client() as c:
        register(c)
        return [k for tokens in stored for k in chunk_keys(c, tokens)]


def test_controller_restarted_while_engines_store(server_factory: Factory, tmp_path: Path) -> None:
    ctl = ControllerProcess(tmp_path).start()
    try:
        a, b, c = nodes = [start_server(server_factory, ctl.addr) for _ in range(3)]
        wait_for(lambda: len(ctl.instances()) == 3)
        engines = Engines([a, b], c)
        try:
            wait_for(lambda: engines.count() >= 10 and engines.reads >= 3)
            ctl.kill()
            before = engines.count()
            wait_for(lambda: engines.count() >= before + 20)  # stores go on, reads miss
            ctl.start()  # a new boot on the same port: every server registers and syncs
            wait_for(lambda: [r["syncs"] for r in ctl.instances().values()] == [1, 1, 1])
            # Chunks stored through A while the controller was away are found again by B
            # (which never held them: a hit can only come through the controller).
            during = [
                t for t, by in zip(engines.stored[before:], engines.by[before:], strict=False)
                if by == a.node_id
            ]  # fmt: skip
            wait_for(lambda: ctl.holders(keys_of(a, during[-1:])) == [{a.node_id}] * CHUNKS)
            assert fetch(b, during[-1], CHUNKS, rid="again") == (CHUNKS, [0, 1])
            reads = engines.reads
            wait_for(lambda: engines.reads >= reads + 5)
        finally:
            stored = engines.stop()
        status = ctl.status()
        assert status is not None and status["registrations"] == 3
        keys = keys_of(a, stored)
        wait_for(lambda: views_agree(ctl, nodes, keys))
    finally:
        ctl.stop()


def test_server_killed_is_deregistered_and_its_chunks_are_clean_misses(
    server_factory: Factory, tmp_path: Path
) -> None:
    ctl = ControllerProcess(tmp_path, heartbeat_interval=0.2, dead_after=1.2).start()
    try:
        a, b, c = (start_server(server_factory, ctl.addr) for _ in range(3))
        wait_for(lambda: len(ctl.instances()) == 3)
        tokens = tokens_for(3, 4)
        keys = store(a, tokens, 4)
        wait_for(lambda: ctl.holders(keys) == [{a.node_id}] * 4)
        a.server.kill()
        wait_for(lambda: set(ctl.instances()) == {b.node_id, c.node_id})
        status = ctl.status()
        assert status is not None and status["deregistered_dead"] == 1
        assert ctl.holders(keys) == [set()] * 4
        assert fetch(b, tokens, 4) == (0, [])  # a clean miss: nothing names A any more
        assert store(b, tokens, 4) == keys  # the engine recomputes and stores
        wait_for(lambda: fetch(c, tokens, 4, rid="c") == (4, [0, 1, 2, 3]))
    finally:
        ctl.stop()


def test_server_restarted_before_it_is_declared_dead_loses_its_old_entries(
    server_factory: Factory, tmp_path: Path
) -> None:
    # dead_after is long: only the new boot token can tell the controller about the restart.
    ctl = ControllerProcess(tmp_path, heartbeat_interval=0.2, dead_after=120).start()
    try:
        a, b, _ = (start_server(server_factory, ctl.addr) for _ in range(3))
        wait_for(lambda: len(ctl.instances()) == 3)
        tokens = tokens_for(4, 3)
        keys = store(a, tokens, 3)
        wait_for(lambda: ctl.holders(keys) == [{a.node_id}] * 3)
        old_boot = ctl.instances()[a.node_id]["boot"]
        a.server.kill()
        a.server.start()  # same cluster port, so the same instance id; an empty pool
        wait_for(lambda: ctl.instances()[a.node_id]["boot"] != old_boot)
        status = ctl.status()
        assert status is not None
        assert status["restarts_noticed"] == 1 and status["deregistered_dead"] == 0
        assert ctl.holders(keys) == [set()] * 3
        assert fetch(b, tokens, 3) == (0, [])
        # The restarted server serves what it stores from now on.
        store(a, tokens, 3)
        wait_for(lambda: fetch(b, tokens, 3, rid="b") == (3, [0, 1, 2]))
    finally:
        ctl.stop()
