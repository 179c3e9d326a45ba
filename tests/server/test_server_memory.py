"""Out of memory against a real server with a small pool (4 MiB, 1 MiB chunks).

A store that does not fit stores what fits and reports the rest in ``no_space`` (not an
error); what was stored reads back byte-exact. Watermark eviction frees space in the
background, so a later store succeeds. A retrieve with chunks missing reports them in
``RetrieveResult.missing`` and leaves no lock behind.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from support.servers import ServerProcess
from tierkv.client import Client

MIB = 2**20
CHUNK = 256
SHAPE = (CHUNK, 1024)  # float32: exactly 1 MiB per chunk
POOL = "4MiB"


def tokens(start: int, n_chunks: int) -> list[int]:
    return list(range(start, start + n_chunks * CHUNK))


def data(toks: list[int], chunk: int) -> np.ndarray[Any, Any]:
    """1 MiB of KV derived from the chunk's tokens (distinct per chunk and sequence)."""
    base = np.asarray(toks[chunk * CHUNK : (chunk + 1) * CHUNK], np.float32)[:, None]
    return (base * 3.0 + np.arange(1024, dtype=np.float32) + 0.25 * chunk).astype(np.float32)


def connect(srv: ServerProcess) -> Client:
    client = srv.client(timeout=10.0)
    client.register("mem-model", SHAPE, "float32", token_axis=0)
    return client


def check_no_locks(client: Client) -> Any:
    s = client.stats()
    assert (s.read_locked, s.read_leases, s.write_leases, s.writing) == (0, 0, 0, 0), s
    return s


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_partial_store_when_the_pool_is_full(server_factory: Callable[..., ServerProcess]) -> None:
    # high watermark 1.0: eviction never starts, so the pool stays exactly full.
    # One client fills the whole pool on purpose: lift the per-client reservation bound.
    srv = server_factory(
        POOL,
        ["--high-watermark", "1.0", "--low-watermark", "0.5", "--client-reservation-share", "1"],
    )
    with connect(srv) as client:
        seq = tokens(10, 6)
        res = client.store(seq, [data(seq, i) for i in range(6)])
        assert res.stored == [0, 1, 2, 3] and res.no_space == [4, 5] and not res.present
        s = check_no_locks(client)
        assert s.used == s.capacity == 4 * MIB and s.objects == 4

        # The chunks that fit read back byte-exact; the others are reported missing.
        out = [np.zeros(SHAPE, np.float32) for _ in range(6)]
        got = client.retrieve(seq, out)
        assert got.retrieved == [0, 1, 2, 3] and got.missing == [4, 5] and not got.complete
        for i in range(4):
            np.testing.assert_array_equal(out[i], data(seq, i))
        assert not out[4].any() and not out[5].any()  # untouched
        check_no_locks(client)

        # A full pool is not an error: another store skips every chunk, changes nothing.
        other = tokens(90_000, 2)
        res = client.store(other, [data(other, i) for i in range(2)])
        assert res.no_space == [0, 1] and not res.stored
        assert client.lookup(seq).hits == 4 and client.lookup(other).hits == 0
        s = check_no_locks(client)
        assert s.used == 4 * MIB and s.evictions == 0

        # Storing the tail now that it is asked for alone: still no room, still reported.
        res = client.store(seq, [data(seq, i) for i in range(4, 6)], first_chunk=4)
        assert res.no_space == [4, 5]


def test_eviction_frees_space_for_a_later_store(
    server_factory: Callable[..., ServerProcess],
) -> None:
    # Default watermarks (0.8 / 0.7): above 3.2 MiB used, evict down to 2.8 MiB.
    # One client fills the whole pool on purpose: lift the per-client reservation bound.
    srv = server_factory(POOL, ["--eviction-interval", "0.05", "--client-reservation-share", "1"])
    with connect(srv) as client:
        first = tokens(10, 6)
        res = client.store(first, [data(first, i) for i in range(6)])
        assert res.stored == [0, 1, 2, 3] and res.no_space == [4, 5]

        # In the background the pool goes down to the low watermark: two chunks go.
        wait_for(lambda: client.stats().evictions >= 2, "eviction")
        s = check_no_locks(client)
        assert s.evictions == 2 and s.used == 2 * MIB and s.objects == 2
        assert s.evicted_bytes == 2 * MIB

        # Prefix-aware LRU: the last chunks of the sequence went first, the prefix that is
        # left reads back byte-exact.
        assert client.lookup(first).hits == 2
        out = [np.zeros(SHAPE, np.float32) for _ in range(6)]
        got = client.retrieve(first, out)
        assert got.retrieved == [0, 1] and got.missing == [2, 3, 4, 5]
        for i in got.retrieved:
            np.testing.assert_array_equal(out[i], data(first, i))
        check_no_locks(client)

        # A later store now has room.
        second = tokens(50_000, 2)
        res = client.store(second, [data(second, i) for i in range(2)])
        assert res.stored == [0, 1] and not res.no_space
        out = [np.zeros(SHAPE, np.float32) for _ in range(2)]
        assert client.retrieve(second, out).complete
        for i in range(2):
            np.testing.assert_array_equal(out[i], data(second, i))
        check_no_locks(client)


def test_locked_chunks_are_not_evicted(server_factory: Callable[..., ServerProcess]) -> None:
    # One client fills the whole pool on purpose: lift the per-client reservation bound.
    srv = server_factory(POOL, ["--eviction-interval", "0.05", "--client-reservation-share", "1"])
    with connect(srv) as client:
        held = tokens(10, 3)  # 3 MiB: below the high watermark (3.2 MiB)
        assert client.store(held, [data(held, i) for i in range(3)]).stored == [0, 1, 2]
        assert client.lookup(held, request_id="held").hits == 3  # read-locked now
        extra = tokens(60_000, 1)
        assert client.store(extra, [data(extra, 0)]).stored == [0]  # 4 MiB: above it
        # Only the unlocked chunk can go, so it goes, and the locked ones stay.
        wait_for(lambda: client.stats().evictions >= 1, "eviction")
        time.sleep(0.2)  # several more passes: still nothing else is evictable
        s = client.stats()
        assert s.evictions == 1 and s.used == 3 * MIB and s.read_locked == 3
        assert client.lookup(extra).hits == 0
        out = [np.zeros(SHAPE, np.float32) for _ in range(3)]
        got = client.retrieve(request_id="held", out=out)
        assert got.retrieved == [0, 1, 2] and got.complete
        for i in range(3):
            np.testing.assert_array_equal(out[i], data(held, i))
        client.end_session("held")
        check_no_locks(client)
        # Released, they are evictable again: the next store that crosses the high
        # watermark brings the pool down to the low one (2.8 MiB), last chunks first.
        assert client.store(extra, [data(extra, 0)]).stored == [0]
        wait_for(lambda: client.stats().evictions >= 3, "eviction after release")
        s = check_no_locks(client)
        assert s.used == 2 * MIB and s.evictions == 3
        assert client.lookup(extra).hits == 1  # the newest chunk was kept


def test_retrieve_with_missing_chunks_releases_every_lock(
    server_factory: Callable[..., ServerProcess],
) -> None:
    srv = server_factory("16MiB")
    with connect(srv) as client:
        seq = tokens(10, 5)
        # Store chunks 0, 1 and 3 only (3 through precomputed positions: first_chunk).
        assert client.store(seq[: 2 * CHUNK], [data(seq, 0), data(seq, 1)]).stored == [0, 1]
        assert client.store(seq, [data(seq, 3)] * 2, first_chunk=3).stored == [3, 4]
        # Chunk 2 is missing: a lookup stops there, a retrieve by tokens reads around it.
        assert client.lookup(seq).hits == 2
        out = [np.zeros(SHAPE, np.float32) for _ in range(5)]
        got = client.retrieve(seq, out)
        assert got.retrieved == [0, 1, 3, 4] and got.missing == [2] and not got.complete
        for i in (0, 1, 3):
            np.testing.assert_array_equal(out[i], data(seq, i))
        check_no_locks(client)

        # By lookup session: the hits are locked and retrieved, the rest reported missing.
        assert client.lookup(seq, request_id="r").hits == 2
        s = client.stats()
        assert s.read_locked == 2 and s.read_leases == 1
        out = [np.zeros(SHAPE, np.float32) for _ in range(5)]
        got = client.retrieve(request_id="r", out=out)
        assert got.retrieved == [0, 1] and got.missing == [2, 3, 4]
        check_no_locks(client)

        # Nothing present at all: everything missing, nothing locked.
        none = tokens(70_000, 3)
        got = client.retrieve(none, [np.zeros(SHAPE, np.float32) for _ in range(3)])
        assert got.missing == [0, 1, 2] and not got.retrieved
        assert client.lookup(none, request_id="empty").hits == 0
        got = client.retrieve(request_id="empty", out=[np.zeros(SHAPE, np.float32)] * 3)
        assert got.missing == [0, 1, 2] and not got.retrieved
        s = check_no_locks(client)
        assert s.objects == 4 and s.used == 4 * MIB
