"""An engine's namespaces (asked at each read of the chunk feed, on the RPC loop) are built
once and reused while neither its ranks nor their cache salts change."""

from __future__ import annotations

from typing import Any, cast

from tierkv import keys
from tierkv import protocol as p
from tierkv.server.registry import ClientRegistry, Registration


def rank(token: int, r: int) -> Registration:
    ns = keys.Namespace("m", "float16", "test-layout", world_size=2, rank=r)
    return Registration(
        token, ns, ns.digest(), p.Layout([16, 2], "float16"), 64, f"rank{r}", 0, 0.0, 0.0,
        engine_id="e", chunk_tokens=16,
    )  # fmt: skip


def test_an_engines_namespaces_are_reused_until_a_rank_or_a_salt_changes() -> None:
    """Each read built the set of every rank's digests anew (8 ranks of 4096 salts: ~3 ms
    a read); now the same set comes back until something in it changes, and then the new
    one is exactly the ranks' digests and salts."""
    registry = ClientRegistry(
        cast(Any, None), cast(Any, None), lambda: 0.0, idle_ttl=60.0, max_clients=8
    )
    r0, r1 = rank(1, 0), rank(2, 1)
    registry.add(r0)
    first = registry.engine_namespaces(r0)
    assert first == {r0.digest} and registry.engine_namespaces(r0) is first
    registry.add(r1)  # a rank joined
    joined = registry.engine_namespaces(r0)
    assert joined == {r0.digest, r1.digest} and registry.engine_namespaces(r0) is joined
    salted = {r1.digest_for("user-a"), r0.digest_for("user-b")}  # new salts
    grown = registry.engine_namespaces(r0)
    assert grown == {r0.digest, r1.digest, *salted}
    r1.digest_for("user-a")  # used again: the same namespaces
    assert registry.engine_namespaces(r0) is grown
    registry._groups["e"].pop(r1.token)  # (drop() without its sessions and index)
    assert registry.engine_namespaces(r0) == {r0.digest, *r0.salted.values()}
