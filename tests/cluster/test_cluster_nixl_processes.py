"""NIXL reads from holders in other processes that fail: killed, stopped (SIGSTOP), handing
out metadata NIXL refuses, unregistering their pool. Each is a miss or a read over TCP,
never a hang, and the reader keeps reading afterwards. Then real servers with
``--peer-transport nixl``. UCX over loopback TCP stands in for another node."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from support.clusterkit import converged, start_node, status, wait_for
from support.kvops import fetch, store, tokens_for
from support.nixl_kit import (
    SHM_DIR,
    TOKEN,
    UCX_ENV,
    WRITER,
    HolderProcess,
    PoolSource,
    chunk_key,
    member,
    needs_nixl,
    sigstop,
)
from support.servers import ServerProcess
from tierkv.cluster.nixl_transport import NixlTransport
from tierkv.tiers.base import LoadStatus

pytestmark = [needs_nixl, pytest.mark.processes]
SIZE = 1 << 20
# The reader's deadline for a READ (and its socket timeout): what ends a READ from a stopped
# holder, and a liveness bound for the others (a loaded machine's first READ sets up UCX).
TIMEOUT = 5.0


@pytest.fixture(autouse=True)
def _ucx_over_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in UCX_ENV.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def reader() -> Iterator[tuple[PoolSource, NixlTransport]]:
    source = PoolSource(64 << 20)
    t = NixlTransport(
        "127.0.0.1",
        0,
        "127.0.0.1",
        TOKEN,
        "reader",
        region=source.pool.buf,
        fence=source.index,
        timeout=TIMEOUT,
    )
    yield source, t
    t.close()
    source.close()


@pytest.fixture
def holders(tmp_path: Path) -> Iterator[Callable[..., HolderProcess]]:
    started: list[HolderProcess] = []

    def start(seed: int, *extra: str, chunks: int = 4) -> HolderProcess:
        h = HolderProcess(tmp_path, seed, chunks, SIZE, *extra)
        started.append(h)
        return h

    yield start
    for h in started:
        if h.proc.poll() is None:
            os.kill(h.proc.pid, signal.SIGCONT)
        h.stop()
    # Killed or not, no holder leaves its pool behind in /dev/shm.
    assert not [h.pool_name for h in started if (SHM_DIR / h.pool_name).exists()]


def read_all(
    reader: tuple[PoolSource, NixlTransport], h: HolderProcess
) -> tuple[list[LoadStatus], list[bool]]:
    """Fetch every chunk of ``h`` into fresh slots of the reader's pool: (statuses, which
    arrived byte-exact). The slots are given back after."""
    source, t = reader
    res = source.index.reserve_write(h.keys, [SIZE] * len(h.keys), WRITER)
    assert len(res.slots) == len(h.keys)
    items = [(h.keys[i], source.pool.view(off, n)) for i, off, n in res.slots]
    statuses = t.fetch_many([(member(h.address), items)])[0]
    exact = [bytes(v) == h.data(i) for i, (_, v) in enumerate(items)]
    del items
    source.index.abort(res.lease_id, WRITER)
    return statuses, exact


def over_nixl(t: NixlTransport, h: HolderProcess) -> int:
    received = t.stats()["nixl"]["received"]  # type: ignore[index]
    return int(received.get(h.address, {}).get("chunks", 0))


OK4 = [LoadStatus.OK] * 4


def test_a_killed_holder_is_a_miss_and_the_reader_keeps_reading(
    reader: tuple[PoolSource, NixlTransport], holders: Callable[..., HolderProcess]
) -> None:
    _, t = reader
    a, b = holders(11), holders(12)
    assert read_all(reader, a) == (OK4, [True] * 4) and over_nixl(t, a) == 4

    def kill(lease_id: int) -> None:
        a.proc.kill()
        a.proc.wait()

    t.before_read = kill  # leased, then the holder dies before the READ
    statuses, _ = read_all(reader, a)
    assert statuses == [LoadStatus.ERROR] * 4
    t.before_read = None
    assert read_all(reader, b) == (OK4, [True] * 4) and over_nixl(t, b) == 4


def test_a_stopped_holder_is_a_miss_at_the_readers_deadline(
    reader: tuple[PoolSource, NixlTransport], holders: Callable[..., HolderProcess]
) -> None:
    """The READ that NIXL cannot stop lands once the holder is back: until it has, its
    slots are used for nothing else (no other chunk is stored there, nothing fetched into
    them); then they go back to the pool. Before, the slots were freed at the deadline and
    the late READ overwrote the chunks committed there meanwhile."""
    source, t = reader
    a, b = holders(21), holders(22)
    assert read_all(reader, a) == (OK4, [True] * 4)
    t.before_read = lambda lease_id: sigstop(a.proc.pid)
    started = time.monotonic()
    res = source.index.reserve_write(a.keys, [SIZE] * 4, WRITER)
    items = [(a.keys[i], source.pool.view(off, n)) for i, off, n in res.slots]
    # NIXL would wait forever: the reader's deadline ends the fetch.
    assert t.fetch_many([(member(a.address), items)])[0] == [LoadStatus.ERROR] * 4
    assert time.monotonic() - started < 60  # a liveness bound, not a timing claim
    assert t.read_timeouts == 1
    t.before_read = None
    # Another holder's chunks into the same slots: refused while the READ may land.
    retry = [(b.keys[i], view) for i, (_, view) in enumerate(items)]
    assert t.fetch_many([(member(b.address), retry)])[0] == [LoadStatus.ERROR] * 4
    assert over_nixl(t, b) == 0
    del items, retry
    source.index.abort(res.lease_id, WRITER)  # the prefetcher gives the slots back
    fenced = {off for _, off, _ in res.slots}
    assert source.index.stats().fenced_free == 4
    source.index.check()
    others = {chunk_key(99, i): bytes([i + 1]) * SIZE for i in range(4)}
    placed = {key: source.put(key, data) for key, data in others.items()}
    assert not fenced & set(placed.values())  # stored elsewhere
    assert read_all(reader, b) == (OK4, [True] * 4) and over_nixl(t, b) == 4
    os.kill(a.proc.pid, signal.SIGCONT)
    assert t.late is not None
    wait_for(lambda: t.late is not None and t.late.stats()["pending"] == 0, timeout=60)
    late = t.late.stats()
    assert (late["given_up"], late["landed"], late["slots_given_back"]) == (1, 1, 4), late
    assert source.index.stats().fenced_free == 0
    source.index.check()
    for key, data in others.items():  # the chunks committed meanwhile are intact
        assert bytes(source.pool.view(placed[key], SIZE)) == data
    # The holder is back; its reads go over TCP for a while (one fallback), byte-exact.
    assert read_all(reader, a) == (OK4, [True] * 4)
    assert over_nixl(t, a) == 4 and t.fallbacks == 1


def test_a_holder_forgotten_during_a_read_is_unloaded_only_after_it(
    reader: tuple[PoolSource, NixlTransport], holders: Callable[..., HolderProcess]
) -> None:
    """Membership forgets a holder (declared dead: a stall) while a READ from it runs. Its
    agent was unloaded at once: NIXL failed the READ but not its transfer, the slots were
    fenced only for the grace of a failed READ, and the holder, resumed, wrote into chunks
    committed there since. Now the agent is unloaded by the last fetch using it, once its
    given-up READ has ended: the READ is given up at the deadline, its slots stay fenced
    until it lands, and the holder is not loaded again before its agent is unloaded."""
    source, t = reader
    a = holders(23)
    assert read_all(reader, a) == (OK4, [True] * 4)

    def stop_then_forget(lease_id: int) -> None:
        sigstop(a.proc.pid)
        t.forget(member(a.address))  # on another thread in a server: the same race

    t.before_read = stop_then_forget
    res = source.index.reserve_write(a.keys, [SIZE] * 4, WRITER)
    items = [(a.keys[i], source.pool.view(off, n)) for i, off, n in res.slots]
    assert t.fetch_many([(member(a.address), items)])[0] == [LoadStatus.ERROR] * 4
    t.before_read = None
    assert t.late is not None
    late = t.late.stats()
    assert (late["given_up"], late["failed"], late["pending"]) == (1, 0, 1), late
    del items
    source.index.abort(res.lease_id, WRITER)
    fenced = {off for _, off, _ in res.slots}
    assert source.index.stats().fenced_free == 4
    others = {chunk_key(98, i): bytes([i + 7]) * SIZE for i in range(4)}
    placed = {key: source.put(key, data) for key, data in others.items()}
    assert not fenced & set(placed.values())
    os.kill(a.proc.pid, signal.SIGCONT)
    wait_for(lambda: t.late is not None and t.late.stats()["pending"] == 0, timeout=60)
    wait_for(lambda: not t._unloading, timeout=10)  # unloaded once the READ ended
    for key, data in others.items():
        assert bytes(source.pool.view(placed[key], SIZE)) == data
    assert source.index.stats().fenced_free == 0
    assert read_all(reader, a) == (OK4, [True] * 4)  # loaded again after


def test_metadata_nixl_refuses_is_read_over_tcp(
    reader: tuple[PoolSource, NixlTransport], holders: Callable[..., HolderProcess]
) -> None:
    _, t = reader
    a = holders(31, "--bad-metadata")
    for _ in range(2):
        assert read_all(reader, a) == (OK4, [True] * 4)
    assert over_nixl(t, a) == 0 and t.fallbacks == 1
    b = holders(32)
    assert read_all(reader, b) == (OK4, [True] * 4) and over_nixl(t, b) == 4


def test_a_region_the_holder_unregistered_is_never_read_wrong(
    reader: tuple[PoolSource, NixlTransport], holders: Callable[..., HolderProcess]
) -> None:
    _, t = reader
    a = holders(41)
    assert read_all(reader, a) == (OK4, [True] * 4) and over_nixl(t, a) == 4
    # Unregistered between the lease and the READ: the READ fails (a miss) or reads the
    # bytes still there, which the checksums vouch for; never other bytes accepted.
    t.before_read = lambda lease_id: a.command("unregister")
    statuses, exact = read_all(reader, a)
    t.before_read = None
    assert set(statuses) <= {LoadStatus.OK, LoadStatus.ERROR}
    assert all(ok for st, ok in zip(statuses, exact, strict=True) if st is LoadStatus.OK)
    # From then on the holder's leases say "not registered": reads go over TCP.
    assert read_all(reader, a) == (OK4, [True] * 4)
    assert a.proc.poll() is None
    a.command("clear")  # and it still answers: chunks gone are misses
    assert read_all(reader, a)[0] == [LoadStatus.MISSING] * 4


# -- real servers ----------------------------------------------------------------------------
# A READ's deadline is the peer timeout (at least 1 s): 3 s, so that setting up UCX on a
# loaded machine does not pass it.
NIXL = ["--peer-transport", "nixl", "--peer-timeout", "3"]


def nixl_figures(node_status: dict[str, object]) -> dict[str, object]:
    transport = node_status["transport"]
    assert isinstance(transport, dict)
    figures = transport["nixl"]
    assert isinstance(figures, dict)
    return figures


def test_servers_read_each_others_chunks_over_nixl(
    server_factory: Callable[..., ServerProcess],
) -> None:
    a = start_node(server_factory, [], extra=NIXL, seed_self=True)
    b = start_node(server_factory, [a.port], extra=NIXL, seed_self=True)
    wait_for(lambda: converged([a, b]))
    tokens = tokens_for(51, 6)
    store(a, tokens, 6)
    assert fetch(b, tokens, 6) == (6, list(range(6)))
    figures = nixl_figures(status(b))
    assert figures["available"] and figures["ucx_tls"] == "tcp"
    received = figures["received"]
    assert isinstance(received, dict) and received[a.node_id]["chunks"] == 6
    held = nixl_figures(status(a))["leases"]
    assert isinstance(held, dict)
    wait_for(lambda: nixl_figures(status(a))["leases"]["live"] == 0)  # type: ignore[index]
    assert held["granted"] >= 1 and held["expired"] == 0
    # The holder stops (SIGSTOP) under a read: B's engine gets a miss, B keeps serving.
    tokens2 = tokens_for(52, 3)
    store(a, tokens2, 3)
    assert a.server.proc is not None
    sigstop(a.server.proc.pid)
    try:
        hits, _ = fetch(b, tokens2, 3, rid="stopped")
        assert hits == 0
        assert fetch(b, tokens, 6, rid="again") == (6, list(range(6)))  # its own copies now
    finally:
        os.kill(a.server.proc.pid, signal.SIGCONT)


def test_a_nixl_server_reads_from_a_tcp_server_over_tcp(
    server_factory: Callable[..., ServerProcess],
) -> None:
    a = start_node(server_factory, [], seed_self=True)  # default: tcp
    b = start_node(server_factory, [a.port], extra=NIXL, seed_self=True)
    wait_for(lambda: converged([a, b]))
    tokens = tokens_for(61, 4)
    store(a, tokens, 4)
    assert fetch(b, tokens, 4) == (4, list(range(4)))
    figures = nixl_figures(status(b))
    received = figures["received"]
    assert isinstance(received, dict) and figures["fallbacks"] == 1
    assert received.get(a.node_id, {}).get("chunks", 0) == 0
    assert b.server.log().count("go over TCP") == 1
