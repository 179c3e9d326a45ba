"""What an engine does in cluster tests: store chunks of known tokens through a node and
fetch them back byte-exact (through whatever directory the node uses), and ask a node which
chunks its own pool holds (no peer, no directory)."""

from __future__ import annotations

import numpy as np

from support.clusterkit import Node
from support.servers import CHUNK_SHAPE, chunk_data, register
from tierkv import keys as tk
from tierkv.client import Client


def tokens_for(seed: int, chunks: int) -> list[int]:
    return list(range(seed * 100_000, seed * 100_000 + 256 * chunks))


def chunk_keys(client: Client, tokens: list[int]) -> list[bytes]:
    assert client.registration is not None
    packed = np.asarray(tokens, dtype="<u4").tobytes()
    return tk.chunk_keys(client.registration.namespace, packed, 256)


def store(node: Node, tokens: list[int], chunks: int) -> list[bytes]:
    with node.client() as c:
        register(c)
        res = c.store(tokens, [chunk_data(tokens, i) for i in range(chunks)])
        assert res.stored == list(range(chunks))
        return chunk_keys(c, tokens)


def fetch(node: Node, tokens: list[int], chunks: int, rid: str = "r") -> tuple[int, list[int]]:
    """Look up on ``node`` (waiting for the prefetch), retrieve, check bytes; (hits, ok)."""
    with node.client() as c:
        register(c)
        hits = c.lookup(tokens, request_id=rid, wait=True).hits
        out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(chunks)]
        got = c.retrieve(request_id=rid, out=out)
        for i in got.retrieved:
            np.testing.assert_array_equal(out[i], chunk_data(tokens, i))
        return hits, got.retrieved


def held_locally(node: Node, keys: list[bytes]) -> list[bool]:
    """Which of ``keys`` (of the test model's namespace) ``node``'s pool holds now: a
    lookup without a request id asks the pool only, one chunk hash at a time."""
    with node.client() as c:
        register(c)
        return [c.lookup(hashes=[key[tk.DIGEST_SIZE :]]).hits == 1 for key in keys]
