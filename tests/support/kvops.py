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


def fetch(
    node: Node, tokens: list[int], chunks: int, rid: str = "r", landing: bool = False
) -> tuple[int, list[int]]:
    """Look up on ``node`` (waiting for the prefetch), retrieve, check bytes; (hits, ok).
    ``landing``: retrieve while the prefetch lands (``retrieve(wait=True)``); hits is then
    the number of leading chunks retrieved."""
    with node.client() as c:
        register(c)
        out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(chunks)]
        if landing:
            c.lookup(tokens, request_id=rid)
            got = c.retrieve(request_id=rid, out=out, wait=True)
            hits = len(got.retrieved)
            assert got.retrieved == list(range(hits)) and got.missing == list(range(hits, chunks))
        else:
            hits = c.lookup(tokens, request_id=rid, wait=True).hits
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
