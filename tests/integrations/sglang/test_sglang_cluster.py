"""Prefill/decode disaggregation with SGLang: pages set through the backend on node A are
found and read byte-exact through the backend on node B the moment the set returned (two
real clustered tierkv servers, SGLang's real host pools)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import pytest

from support import sglang_pools as sp
from support.clusterkit import TOKEN, converged, start_node, status, wait_for
from support.servers import ServerProcess

pytestmark = [pytest.mark.sglang]


@pytest.fixture(autouse=True)
def sglang_installed() -> None:
    sp.require_sglang()


def test_pages_set_on_one_node_are_read_on_another_immediately(
    server_factory: Callable[..., ServerProcess],
) -> None:
    a = start_node(server_factory, [], seed_self=True)
    b = start_node(server_factory, [a.port], seed_self=True)
    wait_for(lambda: converged([a, b]))
    prefill, decode = sp.host_pool("mha", "page_first"), sp.host_pool("mha", "page_first")
    sp.fill_random(prefill, seed=11)
    backends: list[Any] = []
    try:
        for node, pool in ((a, prefill), (b, decode)):
            config = sp.storage_config({"endpoint": node.server.endpoint, "auth_token": TOKEN})
            backends.append(sp.create_backend(config, pool))
        producer, consumer = backends
        rounds, pages = 100, 3
        hits: list[int] = []
        for r in range(rounds):
            keys = [hashlib.sha256(f"pd-{r}-{i}".encode()).hexdigest() for i in range(pages)]
            src = [(r + i) % 8 for i in range(pages)]
            assert producer.batch_set_v1(keys, sp.indices(prefill, src)) == [True] * pages
            # No pause: the decode side asks the moment the prefill side's set returned.
            hits.append(consumer.batch_exists(keys))
            dst = [8 + i for i in range(pages)]
            got = consumer.batch_get_v1(keys, sp.indices(decode, dst))
            assert got == [True] * pages, (r, got)
            for s, d in zip(src, dst, strict=True):
                assert sp.page_bytes(decode, d) == sp.page_bytes(prefill, s)
        assert hits == [pages] * rounds, f"{sum(h == pages for h in hits)} of {rounds} hit"
        directory = status(a)["directory"]
        assert directory["publish_wait_timeouts"] == 0
    finally:
        for backend in backends:
            backend.close()
