"""Chunk keys of token requests reuse a client's recent chains, and are always the keys that
hashing the whole request gives (the same namespace, byte-identical tokens, or a fresh hash)."""

from __future__ import annotations

import random

import pytest

from tierkv import keys
from tierkv import protocol as p
from tierkv.server import registry
from tierkv.server.chunk_keys import CHAINS, ChunkKeys
from tierkv.server.registry import Registration
from tierkv.tenants import TenantIds

CHUNK = 16


def registration(model: str = "m") -> Registration:
    ns = keys.Namespace(model, "float16", "test-layout")
    return Registration(
        token=1,
        namespace=ns,
        digest=ns.digest(),
        layout=p.Layout([CHUNK, 2], "float16"),
        chunk_bytes=CHUNK * 4,
        name="test",
        pid=0,
        registered_at=0.0,
        last_seen=0.0,
        chunk_tokens=CHUNK,
    )


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def expected(
    reg: Registration, toks: list[int], partial: bool = False, salt: str = ""
) -> list[bytes]:
    return keys.chunk_keys(reg.digest_for(salt), keys.pack_tokens(toks), CHUNK, partial)


def of(ck: ChunkKeys, reg: Registration, toks: list[int], **kw: object) -> list[bytes]:
    sel = p.ChunkSelector(tokens=keys.pack_tokens(toks), **kw)  # type: ignore[arg-type]
    return ck.of(reg, sel)[0]


def count_hashing(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, how many chunks each call of the hashing loop hashed."""
    hashed: list[int] = []
    real = keys._chain

    def counting(*args: object, **kw: object) -> list[bytes]:
        out = real(*args, **kw)  # type: ignore[arg-type]
        hashed.append(len(out))
        return out

    monkeypatch.setattr(keys, "_chain", counting)
    return hashed


def test_a_prompt_stored_request_by_request_hashes_each_chunk_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ck, reg = ChunkKeys(CHUNK, 1024), registration()
    prompt = tokens(1, 8 * CHUNK)
    want = {end: expected(reg, prompt[: end * CHUNK]) for end in (2, 3, 4, 6, 8)}
    hashed = count_hashing(monkeypatch)
    for end in range(2, 9, 2):
        assert of(ck, reg, prompt[: end * CHUNK]) == want[end]
    assert hashed == [2, 2, 2, 2]  # not 2, 4, 6, 8
    # Its beginning (a lookup of a shorter prefix) and itself again: nothing new hashed.
    assert of(ck, reg, prompt[: 3 * CHUNK]) == want[3]
    assert of(ck, reg, prompt) == want[8]
    assert sum(hashed) == 8


@pytest.mark.parametrize("seed", range(20))
def test_reused_chains_always_give_the_keys_of_the_whole_request(seed: int) -> None:
    """Random requests over a few prompts sharing beginnings, under two salts, with partial
    last chunks and a second client: every answer equals a fresh hash of the request."""
    rng = random.Random(seed)
    ck = ChunkKeys(CHUNK, 1024)
    regs = [registration(), registration("other-model")]
    base = tokens(seed, 6 * CHUNK)
    prompts = [
        base,
        base[: 3 * CHUNK] + tokens(seed + 100, 5 * CHUNK),
        tokens(seed + 200, 9 * CHUNK),
    ]
    for _ in range(60):
        reg = rng.choice(regs)
        prompt = rng.choice(prompts)
        n = rng.randrange(0, len(prompt) + 1)
        partial = rng.random() < 0.3
        salt = rng.choice(["", "s1"])
        got = of(ck, reg, prompt[:n], partial_last=partial, salt=salt)
        assert got == expected(reg, prompt[:n], partial, salt)
        assert len(reg.chains) <= CHAINS


def test_a_changed_token_inside_a_known_prefix_is_hashed_again() -> None:
    ck, reg = ChunkKeys(CHUNK, 1024), registration()
    prompt = tokens(3, 4 * CHUNK)
    of(ck, reg, prompt)
    changed = list(prompt)
    changed[CHUNK + 5] += 1  # chunk 1 differs, one token
    assert of(ck, reg, changed) == expected(reg, changed)
    assert of(ck, reg, changed)[0] == of(ck, reg, prompt)[0]
    assert of(ck, reg, changed)[1] != of(ck, reg, prompt)[1]


def test_chunk_keys_after_refuses_more_known_keys_than_chunks() -> None:
    reg = registration()
    packed = keys.pack_tokens(tokens(4, 2 * CHUNK))
    known = keys.chunk_keys(reg.digest, packed, CHUNK)
    assert keys.chunk_keys_after(reg.digest, packed, known[:1], CHUNK) == known
    with pytest.raises(ValueError, match="more known keys"):
        keys.chunk_keys_after(reg.digest, packed[: CHUNK * 4], known, CHUNK)


def test_the_chains_a_client_leaves_are_bounded_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client sending long prompts cannot make the server hold more than CHAIN_BYTES of
    its tokens; a request longer than that is hashed and not kept."""
    monkeypatch.setattr("tierkv.server.chunk_keys.CHAIN_BYTES", 10 * CHUNK * 4)
    limit = 10 * CHUNK * 4
    ck, reg = ChunkKeys(CHUNK, 1024), registration()
    for seed in range(6):
        toks = tokens(10 + seed, 4 * CHUNK)  # 4 chunks each: two fit under the limit
        assert of(ck, reg, toks) == expected(reg, toks)
        assert sum(len(c[1]) for c in reg.chains) <= limit
        assert len(reg.chains) == min(seed + 1, 2)
    kept = list(reg.chains)
    long = tokens(99, 11 * CHUNK)
    assert of(ck, reg, long) == expected(reg, long)
    assert reg.chains == kept  # not kept, and nothing dropped for it


def test_a_lookup_hashes_what_it_reads_and_the_stores_after_it_reuse_that(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ck, reg = ChunkKeys(CHUNK, 1024), registration()
    prompt = tokens(7, 8 * CHUNK)
    sel = p.ChunkSelector(tokens=keys.pack_tokens(prompt))
    want = {end: expected(reg, prompt[: end * CHUNK]) for end in (6, 8)}
    hashed = count_hashing(monkeypatch)
    ks, lengths = ck.for_lookup(reg, sel)
    assert len(ks) == 8 and lengths == [reg.chunk_bytes] * 8 and hashed == []
    assert ks[2] == want[8][2]  # the lookup found chunks 0-1, lacked 2
    ck.remember(reg, ks)
    assert hashed == [3]
    # The stores of the prompt then hash only what the lookup did not.
    assert of(ck, reg, prompt[: 6 * CHUNK]) == want[6]
    assert of(ck, reg, prompt) == want[8]
    assert hashed == [3, 3, 2]
    # A lookup of what is remembered hashes nothing.
    again, _ = ck.for_lookup(reg, sel)
    assert list(again) == want[8] and hashed == [3, 3, 2]


def test_a_registration_forgets_its_least_recently_used_salts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past MAX_SALTS cache salts a registration forgot every one at once: the chunk feed
    then withdrew all salted chunks from the routers, and CLEAR missed them, until each salt
    was used again. Now the least recently used half goes; salts in use stay known."""
    monkeypatch.setattr(registry, "MAX_SALTS", 8)
    reg = registration()
    digests = {f"user-{i}": reg.digest_for(f"user-{i}") for i in range(8)}
    for i in (0, 1, 2):  # in use again: the most recent now
        assert reg.digest_for(f"user-{i}") == digests[f"user-{i}"]
    reg.digest_for("user-8")  # one more than it keeps
    assert set(reg.salted) == {"user-7", "user-0", "user-1", "user-2", "user-8"}
    assert reg.digest_for("user-3") == digests["user-3"]  # forgotten: the same digest again


def test_a_salts_tenant_is_bound_by_a_store_not_by_lookups() -> None:
    """Each cache salt of an engine without a tenant salt is a tenant of its own, and
    tenant ids are for good: binding them at lookups let an engine looking up 65,536
    made-up salts use every id up, charging every later tenant to ~other."""
    reg = registration()
    reg.tenants = TenantIds()
    ck = ChunkKeys(CHUNK, 64)
    sel = p.ChunkSelector(tokens=keys.pack_tokens(tokens(1, 2 * CHUNK)), salt="user-1")
    looked, _ = ck.for_lookup(reg, sel)
    retrieved, _ = ck.of(reg, sel)  # a retrieve by chunks: no store either
    digest = reg.salted["user-1"]
    assert reg.tenants.find("user-1") is None and digest not in reg.tenants.by_digest
    stored, _ = ck.of(reg, sel, store=True)
    assert list(looked) == retrieved == stored
    assert reg.tenants.by_digest[digest] == reg.tenants.find("user-1")


def test_a_lookup_binds_a_salts_tenant_only_once_it_found_chunks() -> None:
    """A lookup under a cache salt binds the salt's tenant when it found chunks of it in the
    pool, or hands back what binds it once its prefetch brings chunks in; finding nothing,
    it binds nothing (a tenant id is for good)."""
    from tierkv.server.service import _salt_binding

    reg = registration()
    reg.tenants = TenantIds()
    assert _salt_binding([reg], "", found=True) is None  # no salt: the engine's own tenant
    later = _salt_binding([reg], "user-1", found=False)
    digest = reg.salted["user-1"]
    assert later is not None and digest not in reg.tenants.by_digest
    later()  # the prefetch brought chunks in
    assert reg.tenants.by_digest[digest] == reg.tenants.find("user-1")
    assert _salt_binding([reg], "user-1", found=False) is None  # bound already
    assert _salt_binding([reg], "user-2", found=True) is None  # found in the pool: bound now
    assert reg.salted["user-2"] in reg.tenants.by_digest
