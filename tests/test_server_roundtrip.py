"""A real server process and a client: register, store, look up, retrieve byte-exact."""

from __future__ import annotations

import numpy as np

from conftest import CHUNK_SHAPE, ServerProcess, chunk_data, register


def test_store_lookup_retrieve_roundtrip(server: ServerProcess) -> None:
    tokens = list(range(1000, 1000 + 256 * 4 + 100))
    with server.client() as client:
        register(client)
        stored = client.store(tokens, [chunk_data(tokens, i) for i in range(4)])
        assert stored.stored == [0, 1, 2, 3] and not stored.no_space
        assert client.lookup(tokens, request_id="r1").hits == 4
        out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(4)]
        got = client.retrieve(request_id="r1", out=out)
        assert got.retrieved == [0, 1, 2, 3] and got.complete
        for i in range(4):
            np.testing.assert_array_equal(out[i], chunk_data(tokens, i))
        stats = client.stats()
        assert stats.read_locked == 0 and stats.write_leases == 0 and stats.read_leases == 0
