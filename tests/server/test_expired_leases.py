"""Leases that expire while their holder still copies: a real server with short TTLs.

A store reservation's slots stay the holder's until it ends the lease (its late bytes never
land on another store's chunks); a retrieve whose copy outlasted its read locks counts its
chunks as missed (their slots may have been reused under the copy).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from support.httputil import wait_for
from support.servers import CHUNK_SHAPE, ServerProcess, chunk_data, register
from tierkv.client import ServerError

pytestmark = pytest.mark.processes

TTL = 0.5  # s; the server expires leases on its eviction pass (every 0.1 s)


def test_an_expired_store_reservation_keeps_its_slots_until_its_client_ends_it(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """A client stalled past write_ttl between its reservation and its copy (an engine
    process stopped, then resumed) writes into the slots it was given: until it ends the
    lease they are nobody else's, so another engine's chunks stored meanwhile stay intact."""
    srv = server_factory("1MiB", ["--write-ttl", str(TTL)])  # 32 slots of one chunk
    slot = int(np.prod(CHUNK_SHAPE)) * 4
    late_tokens = list(range(10_000, 10_000 + 256 * 12))
    other_tokens = list(range(50_000, 50_000 + 256 * 16))
    with srv.client() as late, srv.client() as other:
        register(late)
        register(other)
        prepared = late.prepare_store(late_tokens)
        assert len(prepared.slots.slots) == 12
        wait_for("the reservation to expire", lambda: other.stats().expired_held == 12, 10)
        assert late.lookup(late_tokens).hits == 0  # its keys are gone, its slots are not
        other_data = [chunk_data(other_tokens, i) for i in range(16)]
        assert other.store(other_tokens, other_data).stored == list(range(16))
        assert other.stats().used == (12 + 16) * slot  # none of the held slots was taken
        # The stalled client resumes: it copies into its slots, and its commit is refused.
        late_data = [chunk_data(late_tokens, i) for i in range(12)]
        with pytest.raises(ServerError, match="expired"):
            late.finish_store(prepared, late_data)
        stats = other.stats()
        assert stats.expired_held == 0 and stats.used == 16 * slot
        out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(16)]
        assert other.retrieve(other_tokens, out).retrieved == list(range(16))
        for i in range(16):
            np.testing.assert_array_equal(out[i], other_data[i])


def test_an_expired_reservation_is_let_go_when_its_client_goes(
    server_factory: Callable[..., ServerProcess],
) -> None:
    srv = server_factory("1MiB", ["--write-ttl", str(TTL)])
    tokens = list(range(256 * 4))
    with srv.client() as watcher:
        register(watcher, model="watcher")
        with srv.client() as client:
            register(client)
            client.prepare_store(tokens)
            wait_for("the reservation to expire", lambda: watcher.stats().expired_held == 4, 10)
        # close() unregistered the client: whatever it may still have been writing is over.
        wait_for("the held slots to come back", lambda: watcher.stats().expired_held == 0, 10)
        assert watcher.stats().used == 0


def test_a_reservation_its_client_lost_comes_back_one_write_ttl_after_it_expired(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """A client that never learned its reservation's id (the reply came too late) cannot
    end it, and stays registered and busy: its slots come back one write TTL after the
    reservation expired, not never."""
    srv = server_factory("1MiB", ["--write-ttl", str(TTL)])
    with srv.client() as client:
        register(client)
        client.prepare_store(list(range(256 * 4)))  # its id is dropped
        wait_for("the reservation to expire", lambda: client.stats().expired_held == 4, 10)
        wait_for("the hold to end", lambda: client.stats().expired_held == 0, 10)
        assert client.stats().used == 0


def test_a_copy_that_outlasts_its_read_locks_counts_its_chunks_as_missed(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """A retrieve's copy that stalls past read_ttl: the locks end, the chunks can be deleted
    and their slots reused by another store under the copy, so the client reports every
    chunk as missed (``late``), never as retrieved."""
    srv = server_factory("1MiB", ["--read-ttl", str(TTL)])
    tokens = list(range(7000, 7000 + 256 * 2))
    other_tokens = list(range(90_000, 90_000 + 256 * 2))
    data = [chunk_data(tokens, i) for i in range(2)]
    with srv.client() as reader, srv.client() as other:
        register(reader)
        register(other)
        assert reader.store(tokens, data).stored == [0, 1]
        copied: dict[int, np.ndarray] = {}  # type: ignore[type-arg]

        def stalled(chunk: int, src: np.ndarray) -> None:  # type: ignore[type-arg]
            if not copied:
                time.sleep(3 * TTL)  # the read locks expire meanwhile
                assert other.clear() == 2  # no lock holds the chunks: they go at once
                other.store(other_tokens, [chunk_data(other_tokens, i) for i in range(2)])
            copied[chunk] = src.copy()

        got = reader.retrieve(tokens, scatter=stalled)
        assert got.late and got.retrieved == [] and got.missing == [0, 1]
        assert sorted(copied) == [0, 1]  # the copy ran: what it read is not trusted
        # A copy within the locks' lease is retrieved as usual.
        assert reader.store(tokens, data).stored == [0, 1]
        out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(2)]
        got = reader.retrieve(tokens, out)
        assert not got.late and got.retrieved == [0, 1]
        for i in range(2):
            np.testing.assert_array_equal(out[i], data[i])
