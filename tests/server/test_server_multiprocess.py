"""Several engine processes against one real server at once, through real shared memory.

Client processes (multiprocessing, spawn) store and retrieve overlapping and distinct token
sequences concurrently and check every byte they read back; a prefix stored by several
processes exists once; and namespaces (model, rank, world size, tenant salt, layout) never
see each other's chunks, even for identical tokens or identical precomputed hashes.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from support.servers import (
    CHUNK_BYTES,
    CHUNK_SHAPE,
    CHUNK_SIZE,
    ServerProcess,
    chunk_data,
    register,
)
from support.workers import run_workers
from tierkv.client import Client

N_PROCS = 4
SHARED = 3  # chunks of the prefix every process stores
OWN = 2  # chunks of each process's own suffix
ROUNDS = 3


def shared_prefix() -> list[int]:
    return list(range(7, 7 + SHARED * CHUNK_SIZE))


def sequence(worker: int) -> list[int]:
    """The shared prefix, then a suffix only ``worker`` stores, then a partial tail."""
    own = range(100_000 * (worker + 1), 100_000 * (worker + 1) + OWN * CHUNK_SIZE + 100)
    return shared_prefix() + list(own)


def read_back(client: Client, tokens: list[int], n: int, **kw: Any) -> list[np.ndarray[Any, Any]]:
    out = [np.full(CHUNK_SHAPE, np.nan, np.float32) for _ in range(n)]
    got = client.retrieve(tokens, out, **kw) if tokens else client.retrieve(out=out, **kw)
    assert got.retrieved == list(range(n)) and got.complete, got
    return out


def worker(endpoint: str, idx: int, barrier: Any, results: Any) -> None:
    """One engine process: store, wait for the others, then read everything back."""
    try:
        with Client(endpoint, timeout=20.0) as client:
            register(client, name=f"worker-{idx}")
            mine = sequence(idx)
            n = SHARED + OWN
            barrier.wait()  # everyone stores at the same moment
            stored = client.store(mine, [chunk_data(mine, i) for i in range(n)])
            assert not stored.no_space and sorted(stored.stored + stored.present) == list(range(n))
            # Only the shared prefix can have been stored by another process.
            assert set(range(SHARED, n)) <= set(stored.stored), stored
            barrier.wait()  # every store is committed

            for rnd in range(ROUNDS):
                # Every process's sequence, including the others' (overlapping prefix, their
                # own suffixes), by lookup session and by tokens, checked byte-exact.
                for other in [idx, *(j for j in range(N_PROCS) if j != idx)]:
                    toks = sequence(other)
                    rid = f"w{idx}-r{rnd}-s{other}"
                    assert client.lookup(toks, request_id=rid).hits == n
                    out = read_back(client, [], n, request_id=rid)
                    client.end_session(rid)
                    for i in range(n):
                        np.testing.assert_array_equal(out[i], chunk_data(toks, i))
                    out = read_back(client, toks[: 2 * CHUNK_SIZE], 2)
                    for i in range(2):
                        np.testing.assert_array_equal(out[i], chunk_data(toks, i))
                # Storing again finds everything present and writes nothing.
                again = client.store(mine, [chunk_data(mine, i) for i in range(n)])
                assert again.present == list(range(n)) and not again.stored, again
        results.put((idx, stored.stored, stored.present, None))
    except BaseException:
        results.put((idx, None, None, traceback.format_exc()))


def test_concurrent_processes_share_a_prefix_and_read_byte_exact(
    server_factory: Callable[..., ServerProcess],
) -> None:
    srv = server_factory("32MiB")
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(N_PROCS)
    results = run_workers(worker, [(srv.endpoint, i, barrier) for i in range(N_PROCS)])

    # Each shared chunk was written by exactly one process and reported present to the
    # others; each process wrote its own suffix.
    for chunk in range(SHARED):
        writers = [idx for idx, stored, _, _ in results if chunk in stored]
        assert len(writers) == 1, (chunk, results)
        presents = [idx for idx, _, present, _ in results if chunk in present]
        assert sorted(writers + presents) == list(range(N_PROCS))

    with srv.client() as client:
        register(client)
        s = client.stats()
        unique = SHARED + N_PROCS * OWN
        assert s.objects == s.ready == unique
        assert s.used == unique * CHUNK_BYTES
        assert (s.writing, s.read_locked, s.read_leases, s.write_leases) == (0, 0, 0, 0)
        assert s.sessions == 0 and s.evictions == 0
        # The prefix is there once: a lookup of it from a fresh process hits every chunk.
        assert client.lookup(shared_prefix()).hits == SHARED


# -- namespaces --------------------------------------------------------------------------
# (model, chunk shape, dtype, token axis, world size, rank, tenant salt). Every variant
# differs from the first in exactly one field; all chunks are 32 KiB.
VARIANTS: list[tuple[str, tuple[int, ...], str, int, int, int, str]] = [
    ("model-a", CHUNK_SHAPE, "float32", 1, 2, 0, ""),
    ("model-b", CHUNK_SHAPE, "float32", 1, 2, 0, ""),  # model
    ("model-a", CHUNK_SHAPE, "float32", 1, 2, 1, ""),  # rank
    ("model-a", CHUNK_SHAPE, "float32", 1, 4, 0, ""),  # world size
    ("model-a", CHUNK_SHAPE, "float32", 1, 2, 0, "tenant-b"),  # tenant salt
    ("model-a", CHUNK_SHAPE, "int32", 1, 2, 0, ""),  # dtype, same bytes per chunk
    ("model-a", (CHUNK_SIZE, 32), "float32", 0, 2, 0, ""),  # layout, same bytes per chunk
]
NS_TOKENS = list(range(3, 3 + 3 * CHUNK_SIZE))
NS_HASHES = [bytes([i]) * 16 for i in range(1, 4)]


def variant_data(variant: int, shape: tuple[int, ...], dtype: str, chunk: int) -> Any:
    """Bytes unique to (variant, chunk), in the variant's own shape and dtype."""
    raw = chunk_data(NS_TOKENS, chunk).view(np.uint32) + np.uint32(1000 * variant)
    return raw.view(np.dtype(dtype)).reshape(shape)


def ns_worker(endpoint: str, idx: int, barrier: Any, results: Any) -> None:
    try:
        model, shape, dtype, axis, world, rank, salt = VARIANTS[idx]
        with Client(endpoint, timeout=20.0) as client:
            client.register(
                model, shape, dtype, token_axis=axis, world_size=world, rank=rank, tenant_salt=salt
            )
            data = [variant_data(idx, shape, dtype, i) for i in range(3)]
            barrier.wait()
            # Same tokens and same precomputed hashes in every namespace: all new here.
            by_tokens = client.store(NS_TOKENS, data)
            assert by_tokens.stored == [0, 1, 2] and not by_tokens.present, by_tokens
            by_hashes = client.store(hashes=NS_HASHES, chunks=data[::-1])
            assert by_hashes.stored == [0, 1, 2] and not by_hashes.present, by_hashes
            barrier.wait()
            # Every namespace reads back its own bytes, never another's.
            for toks, hashes, want in ((NS_TOKENS, None, data), (None, NS_HASHES, data[::-1])):
                out = [np.zeros(shape, dtype) for _ in range(3)]
                got = client.retrieve(toks, out, hashes=hashes)
                assert got.complete
                for i in range(3):
                    assert out[i].tobytes() == want[i].tobytes()
            # A prefix in no namespace misses everywhere.
            assert client.lookup(list(range(9, 9 + CHUNK_SIZE))).hits == 0
        results.put((idx, None))
    except BaseException:
        results.put((idx, traceback.format_exc()))


def test_namespaces_never_share_chunks(server_factory: Callable[..., ServerProcess]) -> None:
    srv = server_factory("32MiB")
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(VARIANTS))
    run_workers(ns_worker, [(srv.endpoint, i, barrier) for i in range(len(VARIANTS))])

    with srv.client() as client:
        client.register("model-c", CHUNK_SHAPE, "float32", token_axis=1)
        s = client.stats()
        assert s.objects == len(VARIANTS) * 6 and s.used == len(VARIANTS) * 6 * CHUNK_BYTES
        assert (s.read_locked, s.read_leases, s.write_leases) == (0, 0, 0)
        # Yet another namespace: neither the tokens nor the hashes hit.
        assert client.lookup(NS_TOKENS).hits == 0
        assert client.lookup(hashes=NS_HASHES).hits == 0
