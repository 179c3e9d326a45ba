"""Engine groups and cache salts against a real server.

A tensor-parallel engine has one worker client per rank and one scheduler client, all with
the same engine id. The scheduler's LOOKUP covers every rank (the smallest hit count) and
locks each rank's chunks, which that rank then retrieves by request id. Per-request cache
salts are part of the namespace: a chunk stored under one salt never hits under another.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import numpy as np
import pytest

from support.httputil import wait_for
from support.servers import CHUNK_SHAPE, CHUNK_SIZE, ServerProcess, chunk_data, register
from tierkv.client import Client, NotRegisteredError, ServerError

TOKENS = list(range(7000, 7000 + 4 * CHUNK_SIZE + 17))


def rank_data(rank: int, chunk: int) -> np.ndarray:
    # Each rank holds different KV for the same tokens (its own heads).
    return np.asarray(chunk_data(TOKENS, chunk)) + 1000.0 * rank


def workers(server: ServerProcess, engine_id: str, world: int = 2) -> list[Client]:
    out = []
    for rank in range(world):
        c = server.client()
        register(c, world_size=world, rank=rank, engine_id=engine_id, name=f"rank{rank}")
        out.append(c)
    return out


def test_scheduler_lookup_covers_every_rank(server: ServerProcess) -> None:
    ranks = workers(server, "engine-a")
    sched = server.client()
    try:
        sched.register_scheduler("test-model", "engine-a", name="scheduler")
        # Rank 0 stores 4 chunks, rank 1 only 2: the engine can use 2.
        ranks[0].store(TOKENS, [rank_data(0, i) for i in range(4)])
        ranks[1].store(TOKENS[: 2 * CHUNK_SIZE], [rank_data(1, i) for i in range(2)])
        res = sched.lookup(TOKENS, request_id="req-1")
        assert (res.hits, res.total) == (2, 4)
        for rank, client in enumerate(ranks):
            out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(4)]
            got = client.retrieve(request_id="req-1", out=out)
            assert got.retrieved == [0, 1] and got.missing == [2, 3]
            for i in range(2):
                np.testing.assert_array_equal(out[i], rank_data(rank, i))
        assert sched.end_session("req-1") >= 0
        stats = sched.stats()
        assert stats.read_locked == 0 and stats.read_leases == 0
        # A lookup whose locks are never used is released by END_SESSION.
        assert sched.lookup(TOKENS, request_id="req-2").hits == 2
        assert sched.stats().read_leases == 2
        sched.end_session("req-2")
        assert sched.stats().read_leases == 0
    finally:
        for c in [*ranks, sched]:
            c.close()


def test_scheduler_sees_nothing_until_every_rank_registered(server: ServerProcess) -> None:
    rank0 = server.client()
    sched = server.client()
    try:
        register(rank0, world_size=2, rank=0, engine_id="engine-b")
        rank0.store(TOKENS, [rank_data(0, i) for i in range(4)])
        sched.register_scheduler("test-model", "engine-b")
        assert sched.lookup(TOKENS, request_id="r").hits == 0
        assert sched.stats().read_leases == 0
    finally:
        rank0.close()
        sched.close()


def test_a_rank_registering_again_replaces_its_earlier_registration(
    server: ServerProcess,
) -> None:
    """A worker whose registration reply was lost registers again: the group keeps one
    client per rank (the new one) and the scheduler's lookups keep working."""
    ranks = workers(server, "engine-r")
    sched = server.client()
    again = server.client()
    try:
        sched.register_scheduler("test-model", "engine-r")
        ranks[0].store(TOKENS, [rank_data(0, i) for i in range(4)])
        ranks[1].store(TOKENS, [rank_data(1, i) for i in range(4)])
        assert sched.lookup(TOKENS, request_id="before").hits == 4  # locks held by rank 0
        register(again, world_size=2, rank=0, engine_id="engine-r", name="rank0-again")
        stats = sched.stats()
        # Scheduler, rank 1 and the new rank 0: the old rank 0 and its locks are gone.
        assert stats.clients == 3 and stats.read_leases == 1
        names = {e.name for e in stats.engines}
        assert {"rank0-again", "rank1"} <= names and "rank0" not in names
        with pytest.raises(NotRegisteredError):
            ranks[0].lookup(TOKENS)
        assert sched.lookup(TOKENS, request_id="after").hits == 4
        out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(4)]
        assert again.retrieve(request_id="after", out=out).retrieved == [0, 1, 2, 3]
        np.testing.assert_array_equal(out[3], rank_data(0, 3))
    finally:
        for c in [*ranks, sched, again]:
            c.close()


def test_a_client_of_another_engine_cannot_join_a_group(server: ServerProcess) -> None:
    """An engine id names one engine: a worker or scheduler of another tenant or model (two
    engines given one id, or a client naming someone else's engine) is refused; the group
    keeps serving its own members, and they read their own KV."""
    ranks = workers(server, "engine-g")
    sched = server.client()
    outsiders = [server.client() for _ in range(5)]
    try:
        sched.register_scheduler("test-model", "engine-g")
        ranks[0].store(TOKENS, [rank_data(0, i) for i in range(4)])
        ranks[1].store(TOKENS, [rank_data(1, i) for i in range(4)])
        assert sched.lookup(TOKENS, request_id="mine").hits == 4
        refused = [
            lambda c: c.register_scheduler("test-model", "engine-g", tenant_salt="mallory"),
            lambda c: c.register_scheduler("other-model", "engine-g"),
            # The same rank as a worker of another tenant or model: it would replace rank 0.
            lambda c: register(c, world_size=2, rank=0, engine_id="engine-g", tenant_salt="m"),
            lambda c: register(c, "other-model", world_size=2, rank=0, engine_id="engine-g"),
            lambda c: register(c, world_size=4, rank=2, engine_id="engine-g"),
        ]
        for client, attempt in zip(outsiders, refused, strict=True):
            with pytest.raises(ServerError, match="engine id 'engine-g' is registered by"):
                attempt(client)
        stats = sched.stats()
        assert stats.clients == 3 and stats.read_leases == 2  # nothing replaced or released
        for rank, client in enumerate(ranks):
            out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(4)]
            assert client.retrieve(request_id="mine", out=out).retrieved == [0, 1, 2, 3]
            np.testing.assert_array_equal(out[3], rank_data(rank, 3))
        # A scheduler of the workers' model and tenant joins (a scheduler restarted).
        with server.client() as again:
            again.register_scheduler("test-model", "engine-g")
            assert again.lookup(TOKENS).hits == 4
    finally:
        for c in [*ranks, sched, *outsiders]:
            c.close()


def _hold_rank(endpoint: str, ready: Any, stop: Any) -> None:
    """A worker process that registers rank 0 of engine-p, then waits."""
    with Client(endpoint) as client:
        register(client, world_size=2, rank=0, engine_id="engine-p", name="running")
        ready.set()
        stop.wait(60)


def test_a_rank_a_running_process_holds_is_not_replaced(server: ServerProcess) -> None:
    """Another process registering the rank of a worker whose process still runs is
    refused (that worker may be copying out of chunks its locks hold); once that process
    has exited, the rank is free."""
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_rank, args=(server.endpoint, ready, stop))
    holder.start()
    try:
        assert ready.wait(60)
        with server.client() as client:
            with pytest.raises(ServerError, match=f"running process \\(pid {holder.pid}\\)"):
                register(client, world_size=2, rank=0, engine_id="engine-p")
            register(client, world_size=2, rank=1, engine_id="engine-p")  # another rank
            stop.set()
            holder.join(60)
            wait_for("the holder to be gone", lambda: client.stats().clients == 1, 30)
            with server.client() as successor:
                register(successor, world_size=2, rank=0, engine_id="engine-p")
    finally:
        stop.set()
        holder.join(10)
        if holder.is_alive():
            holder.kill()


def test_scheduler_cannot_move_kv_and_needs_an_engine_id(server: ServerProcess) -> None:
    with server.client() as sched:
        with pytest.raises(ServerError, match="engine_id"):
            sched.register_scheduler("test-model", "")
        sched.register_scheduler("test-model", "engine-c")
        with pytest.raises(ServerError, match="scheduler"):
            sched.store(TOKENS, [rank_data(0, i) for i in range(4)])


def test_cache_salt_separates_requests(server: ServerProcess) -> None:
    with server.client() as client:
        register(client)
        client.store(TOKENS, [chunk_data(TOKENS, i) for i in range(4)], salt="tenant-1")
        assert client.lookup(TOKENS, salt="tenant-1").hits == 4
        assert client.lookup(TOKENS, salt="tenant-2").hits == 0
        assert client.lookup(TOKENS).hits == 0
        out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(4)]
        assert client.retrieve(TOKENS, out, salt="tenant-2").missing == [0, 1, 2, 3]
        assert client.retrieve(TOKENS, out, salt="tenant-1").complete
        np.testing.assert_array_equal(out[3], chunk_data(TOKENS, 3))
    # Another tenant whose tenant salt spells this one's salted namespace the way it used
    # to be built (the length of the tenant salt, ":", the two salts) shares nothing.
    with server.client() as other:
        register(other, tenant_salt="0:tenant-1")
        assert other.lookup(TOKENS).hits == 0
