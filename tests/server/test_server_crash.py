"""Crashes against a real server: engines killed mid-request, the server killed and restarted.

An engine process SIGKILLed between PREPARE_STORE and COMMIT_STORE, or between
PREPARE_RETRIEVE and FINISH_RETRIEVE, leaves locks that expire (short TTLs here), after
which the slots are usable again and the accounting is exact; other clients' committed data
is untouched. A server SIGKILLed and restarted under the same instance replaces the stale
pool segment and socket file; its old clients get NotRegisteredError once it is back (or
ServerUnavailableError while it is down), register again and carry on. SIGTERM shuts down
cleanly: exit code 0, no segment, no socket file. A second server for the same instance
(the same runtime directory, or another) refuses to start and leaves the running one alone.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from support.httputil import free_port, request
from support.servers import (
    CHUNK_BYTES,
    CHUNK_SHAPE,
    CHUNK_SIZE,
    ServerProcess,
    chunk_data,
    register,
)
from tierkv.client import (
    Client,
    LeaseExpiredError,
    NotRegisteredError,
    ServerUnavailableError,
)
from tierkv.pool import SHM_DIR, ShmPool, segment_exists

SHORT_TTLS = [
    "--write-ttl", "1", "--read-ttl", "1", "--session-ttl", "1",
    "--eviction-interval", "0.05",
]  # fmt: skip


def toks(start: int, n_chunks: int) -> list[int]:
    return list(range(start, start + n_chunks * CHUNK_SIZE))


def store_chunks(client: Client, tokens: list[int], n: int) -> None:
    assert client.store(tokens, [chunk_data(tokens, i) for i in range(n)]).stored == list(range(n))


def check_bytes(client: Client, tokens: list[int], n: int) -> None:
    out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(n)]
    got = client.retrieve(tokens, out)
    assert got.retrieved == list(range(n)) and got.complete, got
    for i in range(n):
        np.testing.assert_array_equal(out[i], chunk_data(tokens, i))


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# -- engines killed mid-request ----------------------------------------------------------
def unwatched() -> None:
    """Register as an engine the server cannot watch (another pid namespace or host): its
    locks end only by TTL."""
    import tierkv.client.connection

    tierkv.client.connection.process_scope = lambda: ""  # type: ignore[assignment]


def store_and_hang(endpoint: str, tokens: list[int], ready: Any, watched: bool = False) -> None:
    """Prepare a store, write the first slot, tell the parent, then hang until killed."""
    if not watched:
        unwatched()
    client = Client(endpoint)
    register(client, model="crash")

    def gather(chunk: int, dst: np.ndarray[Any, Any]) -> None:
        dst[:] = -1.0  # garbage that must never be read as this chunk
        ready.set()
        time.sleep(3600)

    client.store(tokens, gather=gather)


def retrieve_and_hang(endpoint: str, tokens: list[int], ready: Any, watched: bool = False) -> None:
    """Look up (locking), prepare the retrieve, tell the parent, then hang until killed."""
    if not watched:
        unwatched()
    client = Client(endpoint)
    register(client, model="crash")
    assert client.lookup(tokens, request_id="doomed").hits == len(tokens) // CHUNK_SIZE

    def scatter(chunk: int, src: np.ndarray[Any, Any]) -> None:
        ready.set()
        time.sleep(3600)

    client.retrieve(request_id="doomed", scatter=scatter)


def kill_midway(
    target: Callable[..., None], endpoint: str, tokens: list[int], watched: bool = False
) -> None:
    """Run ``target`` in a spawned process and SIGKILL it once it signals."""
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=target, args=(endpoint, tokens, ready, watched), daemon=True)
    proc.start()
    try:
        assert ready.wait(60), "the engine process never reached its callback"
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
        proc.join(30)
    assert proc.exitcode == -signal.SIGKILL


def test_watched_engines_killed_midway_are_dropped_at_once(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """Default TTLs (minutes): only noticing the exited process can free these locks fast."""
    port = free_port()
    srv = server_factory("16MiB", ["--http-port", str(port)])
    with srv.client() as keeper:
        register(keeper, model="crash")
        doomed = toks(20_000, 4)
        kill_midway(store_and_hang, srv.endpoint, doomed, watched=True)
        wait_for(lambda: keeper.stats().write_leases == 0, "the exited engine's store dropped")
        s = keeper.stats()
        assert (s.writing, s.expired_write_slots, s.clients_reaped) == (0, 0, 1)
        assert s.clients == 1 and s.used == 0
        store_chunks(keeper, doomed, 4)  # the slots are usable again

        kill_midway(retrieve_and_hang, srv.endpoint, doomed, watched=True)
        wait_for(lambda: keeper.stats().read_leases == 0, "the exited engine's locks dropped")
        s = keeper.stats()
        assert (s.read_locked, s.expired_read_locks, s.clients_reaped) == (0, 0, 2)
        assert s.clients == 1 and s.sessions == 0 and s.objects == 4
        check_bytes(keeper, doomed, 4)
    metrics = request("GET", f"http://127.0.0.1:{port}/metrics").text
    assert "tierkv_clients_reaped_total 2.0" in metrics


def test_engines_killed_mid_store_and_mid_retrieve(
    server_factory: Callable[..., ServerProcess],
) -> None:
    srv = server_factory("16MiB", SHORT_TTLS)
    with srv.client() as keeper, srv.client() as other:
        register(keeper, model="keeper")
        kept = toks(1, 3)
        store_chunks(keeper, kept, 3)
        register(other, model="crash")  # the crashed engines' namespace

        # 1. Killed between PREPARE_STORE and COMMIT_STORE.
        doomed_store = toks(10_000, 4)
        kill_midway(store_and_hang, srv.endpoint, doomed_store)
        s = keeper.stats()
        # (Its lease may already be gone if the kill came late and the TTL passed.)
        assert s.write_leases in (0, 1) and s.writing in (0, 4)
        # Reserved slots are never visible to readers; the write TTL ends the reservation,
        # and its slots are reused one write TTL later (a client the server cannot watch
        # might only be stalled, and write into them meanwhile).
        assert other.lookup(doomed_store).hits == 0
        wait_for(lambda: keeper.stats().write_leases == 0, "write lease expiry")
        wait_for(lambda: keeper.stats().expired_held == 0, "the silent client's slots let go")
        s = keeper.stats()
        assert s.writing == 0 and s.expired_write_slots == 4
        assert s.used == s.objects * CHUNK_BYTES == 3 * CHUNK_BYTES

        # The slots are usable again: the same chunks store and read back correctly.
        store_chunks(other, doomed_store, 4)
        check_bytes(other, doomed_store, 4)

        # 2. Killed between PREPARE_RETRIEVE and FINISH_RETRIEVE (locks from a lookup).
        kill_midway(retrieve_and_hang, srv.endpoint, doomed_store)
        wait_for(lambda: keeper.stats().read_leases == 0, "read lease expiry")
        wait_for(lambda: keeper.stats().sessions == 0, "lookup session expiry")
        s = keeper.stats()
        assert s.read_locked == 0 and s.expired_read_locks == 4
        assert (s.write_leases, s.writing) == (0, 0)
        assert s.objects == 7 and s.used == 7 * CHUNK_BYTES
        # The chunks it was reading are intact and evictable/usable again.
        check_bytes(other, doomed_store, 4)

        # Committed data of the other client never changed.
        check_bytes(keeper, kept, 3)
        s = keeper.stats()
        assert (s.read_locked, s.read_leases, s.write_leases) == (0, 0, 0)
        assert s.used == s.objects * CHUNK_BYTES


# -- the server killed, restarted, stopped -----------------------------------------------
def shm_inode(name: str) -> int:
    return os.stat(os.path.join(SHM_DIR, name)).st_ino


def identity(path: Path) -> tuple[int, int]:
    """Inode and change time (inode numbers alone get reused at once on some filesystems)."""
    st = path.stat()
    return st.st_ino, st.st_ctime_ns


def test_server_killed_and_restarted(server_factory: Callable[..., ServerProcess]) -> None:
    srv = server_factory("16MiB")
    sock = Path(srv.endpoint[len("ipc://") :])
    data = toks(5, 2)
    with srv.client(timeout=5.0) as client:
        register(client)
        client.check_registered()  # known: no error
        store_chunks(client, data, 2)
        old_segment, old_socket = shm_inode(srv.pool_name), identity(sock)

        srv.kill()  # SIGKILL: the segment and the socket file stay behind
        assert segment_exists(srv.pool_name) and sock.exists()
        # While the server is down: ServerUnavailableError (no reply within the timeout).
        client.timeout = 0.3
        with pytest.raises(ServerUnavailableError, match="is it running"):
            client.lookup(data)
        client.timeout = 5.0

        srv.start()  # same instance, pool name and runtime dir
        assert shm_inode(srv.pool_name) != old_segment  # stale segment replaced
        assert identity(sock) != old_socket  # stale socket file replaced
        # Once it is back: NotRegisteredError (the new server does not know this client).
        with pytest.raises(NotRegisteredError, match="register again"):
            client.lookup(data)
        with pytest.raises(NotRegisteredError, match="register again"):
            client.check_registered()  # what an idle engine worker asks
        # Register again: the client re-attaches to the new segment and works.
        register(client)
        assert client.pool is not None
        assert client.lookup(data).hits == 0  # the pool was lost with the server
        store_chunks(client, data, 2)
        check_bytes(client, data, 2)
        s = client.stats()
        assert s.objects == 2 and s.used == 2 * CHUNK_BYTES
        # Another process attaching now sees the same bytes.
        with srv.client() as fresh:
            register(fresh)
            check_bytes(fresh, data, 2)


def test_a_store_reserved_before_a_server_restart_never_writes_into_the_new_pool(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """A store reserved, the server killed and restarted, the client registered again (as
    an engine's link does on its next call) and another engine's chunks committed at the
    same offsets of the new pool: finishing the old reservation is refused without copying
    a byte, and the new chunks stay intact."""
    srv = server_factory("16MiB")
    old, new = toks(40_000, 2), toks(50_000, 2)
    with srv.client(timeout=5.0) as client:
        register(client)
        prepared = client.prepare_store(old)
        assert [s.chunk for s in prepared.slots.slots] == [0, 1]
        srv.kill()
        srv.start()
        register(client)  # maps the new pool
        with srv.client(timeout=5.0) as other:
            register(other)
            stored = other.store(new, [chunk_data(new, i) for i in range(2)])
            assert stored.stored == [0, 1]
            with pytest.raises(LeaseExpiredError, match="no longer maps"):
                client.finish_store(prepared, [np.full(CHUNK_SHAPE, 7.0, np.float32)] * 2)
            check_bytes(other, new, 2)
            check_bytes(client, new, 2)
            assert client.lookup(old).hits == 0


def test_a_store_whose_server_restarts_during_its_copy_commits_nothing_of_another(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """The server restarts while a store copies, the client registers again (another
    thread of the engine meeting NOT_REGISTERED) and reserves another store: the first
    store's commit named the new registration and an old lease number, which a restarted
    server (numbering leases from 1) had just given that other reservation, so it committed
    slots nobody had written: readers got other chunks' bytes as its KV. The commit names
    the registration it reserved under now (refused: unknown), and lease numbers start at
    random on every start."""
    srv = server_factory("16MiB")
    first, other, filler = toks(60_000, 2), toks(70_000, 2), toks(80_000, 2)
    with srv.client(timeout=5.0) as client:
        register(client)
        store_chunks(client, toks(5, 1), 1)
        prepared = client.prepare_store(first)
        later: list[Any] = []

        def restart_then_reserve(chunk: int, dst: np.ndarray) -> None:
            dst[...] = 1.0
            if later:
                return
            srv.stop()
            srv.start()
            register(client)
            store_chunks(client, filler, 2)
            client.clear()  # its slots are free again, holding its bytes
            later.append(client.prepare_store(other))

        with pytest.raises(NotRegisteredError):
            client.finish_store(prepared, gather=restart_then_reserve)
        assert prepared.slots.lease != later[0].slots.lease
        with srv.client(timeout=5.0) as reader:
            register(reader)
            assert reader.lookup(other).hits == 0  # reserved, never written: not readable
        assert client.finish_store(later[0], [chunk_data(other, i) for i in range(2)]).stored
        check_bytes(client, other, 2)


def test_sigterm_shuts_down_cleanly(server_factory: Callable[..., ServerProcess]) -> None:
    srv = server_factory("16MiB")
    sock = Path(srv.endpoint[len("ipc://") :])
    with srv.client(timeout=5.0) as client:
        register(client)
        store_chunks(client, toks(5, 2), 2)
        assert client.lookup(toks(5, 2), request_id="open").hits == 2  # locks held
        assert segment_exists(srv.pool_name) and sock.exists()
        assert srv.stop(signal.SIGTERM) == 0
        assert not segment_exists(srv.pool_name)
        assert not sock.exists()
        assert "stopped" in srv.log()
        with pytest.raises(ServerUnavailableError):
            client.ping(timeout=0.3)
        client.registration = None  # nothing to unregister from


def test_second_server_for_the_same_instance_leaves_the_first_alone(
    server_factory: Callable[..., ServerProcess],
) -> None:
    srv = server_factory("16MiB")
    data = toks(5, 2)
    with srv.client() as client:
        register(client)
        store_chunks(client, data, 2)
    segment = shm_inode(srv.pool_name)

    second = subprocess.run(srv.command(), capture_output=True, text=True, timeout=60)
    assert second.returncode != 0
    assert "already serving" in second.stderr, second.stderr
    # The same instance (so the same pool name) with another runtime directory: refused
    # too, by the pool the first server holds, instead of replacing it under its engines.
    elsewhere = srv.command()
    elsewhere[elsewhere.index("--runtime-dir") + 1] = str(srv.runtime_dir.parent / "elsewhere")
    third = subprocess.run(elsewhere, capture_output=True, text=True, timeout=60)
    assert third.returncode != 0
    assert "belongs to a running server" in third.stderr, third.stderr

    # The running server's segment and socket are untouched: a new engine attaches and
    # reads what was stored before.
    assert segment_exists(srv.pool_name) and shm_inode(srv.pool_name) == segment
    with srv.client() as client:
        register(client)
        check_bytes(client, data, 2)


def test_on_pool_follows_every_mapping_of_the_pool(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """A client's ``on_pool`` hook (a GPU engine page-locks the pool there) runs for each
    mapping, and what it returned runs before that mapping closes: at re-registration after
    a server restart (a new segment) and at close."""
    srv = server_factory("16MiB")
    events: list[tuple[str, str, bool]] = []

    def mapped(pool: ShmPool) -> bool:
        try:
            return pool.buf.nbytes > 0
        except ValueError:  # a released view
            return False

    def on_pool(pool: ShmPool) -> Callable[[], None]:
        events.append(("mapped", pool.name.lstrip("/"), mapped(pool)))

        def undo() -> None:  # the mapping must still be there: unregister needs it
            events.append(("undo", pool.name.lstrip("/"), mapped(pool)))

        return undo

    data = toks(9, 1)
    client = srv.client(timeout=5.0, on_pool=on_pool)
    register(client)
    store_chunks(client, data, 1)
    assert events == [("mapped", srv.pool_name, True)]
    srv.kill()
    srv.start()
    with pytest.raises(NotRegisteredError):
        client.lookup(data)
    register(client)  # the new server's segment
    assert events[1:] == [("undo", srv.pool_name, True), ("mapped", srv.pool_name, True)]
    client.close()
    assert events[3:] == [("undo", srv.pool_name, True)]
    assert client.pool is None
