"""Tests for tierkv.keys: namespace isolation, prefix chaining, token input forms, bad input."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierkv import keys
from tierkv.keys import (
    DEFAULT_CHUNK_SIZE,
    DIGEST_SIZE,
    KEY_SIZE,
    Namespace,
    as_token_array,
    chunk_hashes,
    chunk_keys,
    keys_from_hashes,
    num_chunks,
    pack_tokens,
)

BASE = Namespace(
    model="meta-llama/Llama-3.1-8B@rev1",
    kv_dtype="bfloat16",
    layout="KV_2LTD:32x2x256x8x128",
    world_size=2,
    rank=0,
    tenant_salt="",
)

# One changed value per field; each yields a namespace that must share no key with BASE.
FIELD_CHANGES: dict[str, Any] = {
    "model": "meta-llama/Llama-3.1-8B@rev2",
    "kv_dtype": "float16",
    "layout": "KV_2LTD:32x2x256x8x64",
    "world_size": 4,
    "rank": 1,
    "tenant_salt": "tenant-a",
}


def tokens_of(n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, 2**32, n, dtype=np.uint64)]


def with_field(ns: Namespace, field: str, value: Any) -> Namespace:
    return msgspec.structs.replace(ns, **{field: value})


def reference_hashes(digest: bytes, tokens: list[int], chunk_size: int) -> list[bytes]:
    """The chain as specified, written independently of keys.py (struct, not numpy)."""
    out: list[bytes] = []
    prev = digest
    for start in range(0, len(tokens) - chunk_size + 1, chunk_size):
        data = struct.pack(f"<{chunk_size}I", *tokens[start : start + chunk_size])
        prev = hashlib.sha256(prev + data).digest()[:DIGEST_SIZE]
        out.append(prev)
    return out


# ---------------------------------------------------------------------------- namespaces


@pytest.mark.parametrize("field", sorted(FIELD_CHANGES))
def test_each_field_separates_keys(field: str) -> None:
    other = with_field(BASE, field, FIELD_CHANGES[field])
    assert other != BASE
    assert other.digest() != BASE.digest()
    tokens = tokens_of(4 * DEFAULT_CHUNK_SIZE)
    mine = chunk_keys(BASE.digest(), tokens)
    theirs = chunk_keys(other.digest(), tokens)
    assert len(mine) == len(theirs) == 4
    assert set(mine).isdisjoint(theirs)
    # Also the hashes themselves differ (the namespace seeds the chain), not just the prefix.
    assert set(chunk_hashes(BASE.digest(), tokens)).isdisjoint(chunk_hashes(other.digest(), tokens))


def test_all_single_field_changes_are_pairwise_distinct() -> None:
    namespaces = [BASE] + [with_field(BASE, f, v) for f, v in FIELD_CHANGES.items()]
    digests = {ns.digest() for ns in namespaces}
    assert len(digests) == len(namespaces)


@pytest.mark.parametrize(
    ("left", "right"),
    [
        ({"model": "ab", "kv_dtype": "c"}, {"model": "a", "kv_dtype": "bc"}),
        ({"kv_dtype": "ab", "layout": "c"}, {"kv_dtype": "a", "layout": "bc"}),
        ({"layout": "ab", "tenant_salt": "c"}, {"layout": "a", "tenant_salt": "bc"}),
        ({"model": "a\x00b", "kv_dtype": "c"}, {"model": "a", "kv_dtype": "b\x00c"}),
        ({"model": "a|b", "kv_dtype": "c"}, {"model": "a", "kv_dtype": "b|c"}),
        ({"world_size": 12, "rank": 1}, {"world_size": 1, "rank": 0}),
        ({"world_size": 11, "rank": 2}, {"world_size": 12, "rank": 1}),
        ({"layout": "L1", "world_size": 2}, {"layout": "L", "world_size": 12}),
    ],
)
def test_field_boundaries_are_unambiguous(left: dict[str, Any], right: dict[str, Any]) -> None:
    a = msgspec.structs.replace(BASE, **left)
    b = msgspec.structs.replace(BASE, **right)
    assert a.digest() != b.digest()


def test_a_model_name_holding_the_format_separator_spells_no_other_model() -> None:
    """A served model name may hold ``|kv=``: unescaped, "m|kv=T" with format X and "m"
    with format "T|kv=X" were one string, and a router asking for "m" matched the other
    model's engines."""
    named = keys.model_with_format("m|kv=T", "X")
    assert named != keys.model_with_format("m", "T|kv=X")
    assert keys.is_of_model(named, "m|kv=T") and not keys.is_of_model(named, "m")
    odd = keys.model_with_format("a%7Cb", "T")  # the escape itself is escaped
    assert odd != keys.model_with_format("a|b", "T") and not keys.is_of_model(odd, "a|b")
    # Names without them keep their namespace.
    assert keys.model_with_format("Qwen/Qwen3-8B", "kv_2lhtd") == "Qwen/Qwen3-8B|kv=kv_2lhtd"


def test_digest_is_stable_and_sized() -> None:
    assert len(BASE.digest()) == DIGEST_SIZE
    same = Namespace(**msgspec.structs.asdict(BASE))
    assert same.digest() == BASE.digest()
    assert hash(same) == hash(BASE)  # frozen: usable as a dict key


def test_namespace_roundtrips_through_msgpack() -> None:
    wire = msgspec.msgpack.encode(BASE)
    back = msgspec.msgpack.decode(wire, type=Namespace)
    assert back == BASE and back.digest() == BASE.digest()


@pytest.mark.parametrize(
    "changes",
    [
        {"model": ""},
        {"kv_dtype": ""},
        {"layout": ""},
        {"world_size": 0},
        {"rank": -1},
        {"rank": 2},  # BASE has world_size 2
    ],
)
def test_namespace_rejects_bad_values(changes: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        msgspec.structs.replace(BASE, **changes)


@pytest.mark.parametrize(
    "changes",
    [{"model": 7}, {"tenant_salt": None}, {"world_size": True}, {"rank": 0.0}, {"rank": "0"}],
)
def test_namespace_rejects_bad_types(changes: dict[str, Any]) -> None:
    # bool/float/str ints would digest differently from the "same" int: refuse them.
    with pytest.raises(TypeError):
        msgspec.structs.replace(BASE, **changes)


def test_namespace_decode_validates() -> None:
    bad = msgspec.msgpack.encode({"model": "m", "kv_dtype": "d", "layout": "", "rank": 0})
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(bad, type=Namespace)
    unknown = msgspec.msgpack.encode({"model": "m", "kv_dtype": "d", "layout": "l", "x": 1})
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(unknown, type=Namespace)


names = st.text(min_size=1, max_size=12)


@st.composite
def namespaces(draw: st.DrawFn) -> Namespace:
    world_size = draw(st.integers(1, 16))
    return Namespace(
        model=draw(names),
        kv_dtype=draw(st.sampled_from(["bfloat16", "float16", "float8_e4m3fn"]) | names),
        layout=draw(names),
        world_size=world_size,
        rank=draw(st.integers(0, world_size - 1)),
        tenant_salt=draw(st.text(max_size=8)),
    )


token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=64)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(a=namespaces(), b=namespaces(), tokens_a=token_lists, tokens_b=token_lists)
def test_different_namespaces_never_share_keys(
    a: Namespace, b: Namespace, tokens_a: list[int], tokens_b: list[int]
) -> None:
    keys_a = chunk_keys(a.digest(), tokens_a, chunk_size=4, partial_last=True)
    keys_b = chunk_keys(b.digest(), tokens_b, chunk_size=4, partial_last=True)
    if a == b:
        assert a.digest() == b.digest()
        return
    assert a.digest() != b.digest()
    assert set(keys_a).isdisjoint(keys_b)
    # Same tokens in both namespaces: still disjoint.
    assert set(chunk_keys(b.digest(), tokens_a, chunk_size=4, partial_last=True)).isdisjoint(keys_a)
    assert all(k[:DIGEST_SIZE] == a.digest() for k in keys_a)


@settings(max_examples=100, deadline=None)
@given(
    a=namespaces(), b=namespaces(), hashes=st.lists(st.binary(min_size=1, max_size=64), max_size=8)
)
def test_precomputed_hashes_never_cross_namespaces(
    a: Namespace, b: Namespace, hashes: list[bytes]
) -> None:
    if a == b:
        return
    assert set(keys_from_hashes(a.digest(), hashes)).isdisjoint(
        keys_from_hashes(b.digest(), hashes)
    )


# ---------------------------------------------------------------------------- chaining


def test_matches_the_specified_chain() -> None:
    tokens = tokens_of(3 * 16 + 5, seed=3)
    digest = BASE.digest()
    expected = reference_hashes(digest, tokens, 16)
    assert chunk_hashes(digest, tokens, 16) == expected
    assert chunk_keys(digest, tokens, 16) == [digest + h for h in expected]


def test_golden_vectors() -> None:
    """Keys persist in tiers across restarts and versions, and servers of one cluster must
    agree on them: their values must not drift. A deliberate change of the format comes with
    a new namespace version (v2: SHA-256 instead of blake3), so old keys never match new ones."""
    ns = Namespace(model="golden-model", kv_dtype="bfloat16", layout="KV_2LTD:2x4x8x16")
    digest = ns.digest()
    assert digest.hex() == "644ea57f2578378819feb3de517f9d28"
    assert [k.hex() for k in chunk_keys(digest, list(range(8)), 4)] == [
        "644ea57f2578378819feb3de517f9d28a727238cfdf79c9d3684ee4a57fb7e5b",
        "644ea57f2578378819feb3de517f9d28c6c66ef9d48adf134838466406eb6001",
    ]
    assert [k.hex() for k in keys_from_hashes(digest, [b"x" * 16, b"y" * 32])] == [
        "644ea57f2578378819feb3de517f9d2878787878787878787878787878787878",
        "644ea57f2578378819feb3de517f9d2887c5ad3105ddfcc338e1b5b9dd4d6aff",
    ]


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=80),
    extra=st.lists(st.integers(0, 2**32 - 1), max_size=40),
    chunk_size=st.integers(1, 12),
)
def test_keys_of_a_prefix_are_a_prefix(
    tokens: list[int], extra: list[int], chunk_size: int
) -> None:
    digest = BASE.digest()
    short = chunk_keys(digest, tokens, chunk_size)
    long = chunk_keys(digest, tokens + extra, chunk_size)
    assert long[: len(short)] == short
    assert len(long) == (len(tokens) + len(extra)) // chunk_size
    # With partial_last, all but the (partial) last key are still a prefix.
    short_partial = chunk_keys(digest, tokens, chunk_size, partial_last=True)
    assert short_partial[: len(short)] == short
    if short_partial:
        assert long[: len(short_partial) - 1] == short_partial[:-1]


@pytest.mark.parametrize("chunk_size", [1, 7, 16, DEFAULT_CHUNK_SIZE])
def test_changing_one_token_changes_its_chunk_and_all_later_keys(chunk_size: int) -> None:
    n_chunks = 5
    tokens = tokens_of(n_chunks * chunk_size, seed=chunk_size)
    digest = BASE.digest()
    before = chunk_keys(digest, tokens, chunk_size)
    for i in range(n_chunks):
        for pos in {i * chunk_size, i * chunk_size + chunk_size // 2, (i + 1) * chunk_size - 1}:
            changed = list(tokens)
            changed[pos] ^= 1
            after = chunk_keys(digest, changed, chunk_size)
            assert after[:i] == before[:i]
            assert all(x != y for x, y in zip(after[i:], before[i:], strict=True))


def test_same_chunk_content_at_different_positions_differs() -> None:
    chunk = tokens_of(16, seed=9)
    keys = chunk_keys(BASE.digest(), chunk * 4, 16)
    assert len(set(keys)) == 4


def test_full_chunks_only_by_default() -> None:
    digest = BASE.digest()
    tokens = tokens_of(3 * DEFAULT_CHUNK_SIZE + 17)
    assert len(chunk_keys(digest, tokens)) == 3
    assert len(chunk_keys(digest, tokens[: DEFAULT_CHUNK_SIZE - 1])) == 0
    assert chunk_keys(digest, []) == []
    partial = chunk_keys(digest, tokens, partial_last=True)
    assert len(partial) == 4
    assert partial[:3] == chunk_keys(digest, tokens)
    # The partial chunk's key is not the key of any full chunk of an extension.
    longer = chunk_keys(digest, tokens + tokens_of(DEFAULT_CHUNK_SIZE, seed=1))
    assert partial[3] not in longer
    # An exact multiple has no partial chunk to add.
    exact = tokens[: 2 * DEFAULT_CHUNK_SIZE]
    assert chunk_keys(digest, exact, partial_last=True) == chunk_keys(digest, exact)


@pytest.mark.parametrize(
    ("num_tokens", "chunk_size", "partial", "expected"),
    [
        (0, 256, False, 0),
        (0, 256, True, 0),
        (255, 256, False, 0),
        (255, 256, True, 1),
        (256, 256, True, 1),
        (131072, 256, False, 512),
        (10, 3, False, 3),
        (10, 3, True, 4),
        (10, 1, True, 10),
    ],
)
def test_num_chunks(num_tokens: int, chunk_size: int, partial: bool, expected: int) -> None:
    assert num_chunks(num_tokens, chunk_size, partial) == expected


@pytest.mark.parametrize("chunk_size", [1, 2, 16, 64, 256, 1024])
def test_chunk_sizes(chunk_size: int) -> None:
    digest = BASE.digest()
    tokens = tokens_of(4 * chunk_size - 1, seed=chunk_size)
    keys = chunk_keys(digest, tokens, chunk_size)
    assert len(keys) == 3
    assert all(len(k) == KEY_SIZE and k[:DIGEST_SIZE] == digest for k in keys)
    assert [k[DIGEST_SIZE:] for k in keys] == reference_hashes(digest, tokens, chunk_size)


def test_default_chunk_size_is_256() -> None:
    assert DEFAULT_CHUNK_SIZE == 256
    tokens = tokens_of(2 * 256)
    assert chunk_keys(BASE.digest(), tokens) == chunk_keys(BASE.digest(), tokens, 256)
    assert chunk_keys(BASE.digest(), tokens) != chunk_keys(BASE.digest(), tokens, 128)[:2]


# ---------------------------------------------------------------------------- input forms


def token_forms(tokens: list[int]) -> dict[str, Any]:
    u32 = np.array(tokens, dtype=np.uint32)
    packed = u32.astype("<u4").tobytes()
    return {
        "list": tokens,
        "tuple": tuple(tokens),
        "int64": np.array(tokens, dtype=np.int64),
        "uint64": np.array(tokens, dtype=np.uint64),
        "uint32": u32,
        "big-endian uint32": u32.astype(">u4"),
        "strided uint32": np.repeat(u32, 2)[::2],
        "numpy scalars in a list": [np.uint32(t) for t in tokens],
        "bytes": packed,
        "bytearray": bytearray(packed),
        "memoryview": memoryview(packed),
        "memoryview of uint32": u32.data,
        # A typed buffer's values are the ids (its bytes were read as packed uint32: the
        # int64 ids [1, 2] hashed as the prompt [1, 0, 2, 0]).
        "memoryview of int64": np.array(tokens, dtype=np.int64).data,
        "memoryview of big-endian uint32": u32.astype(">u4").data,
        "pack_tokens": pack_tokens(tokens),
    }


@pytest.mark.parametrize("partial_last", [False, True])
def test_all_token_forms_give_the_same_keys(partial_last: bool) -> None:
    tokens = tokens_of(2 * DEFAULT_CHUNK_SIZE + 100)
    tokens[:3] = [0, 2**31, 2**32 - 1]  # edges of the uint32 range
    digest = BASE.digest()
    expected = chunk_keys(digest, tokens, partial_last=partial_last)
    assert len(expected) == (3 if partial_last else 2)
    for name, form in token_forms(tokens).items():
        assert chunk_keys(digest, form, partial_last=partial_last) == expected, name
        assert as_token_array(form).tolist() == tokens, name


def test_small_token_values_in_narrow_dtypes() -> None:
    tokens = [0, 1, 2, 127, 7, 5]
    digest = BASE.digest()
    expected = chunk_keys(digest, tokens, 3)
    for dtype in (np.uint8, np.int8, np.uint16, np.int16, np.int32):
        assert chunk_keys(digest, np.array(tokens, dtype=dtype), 3) == expected, dtype


def test_pack_tokens_is_little_endian_uint32() -> None:
    assert pack_tokens([1, 2**32 - 1, 256]) == struct.pack("<3I", 1, 2**32 - 1, 256)
    assert pack_tokens(np.array([5], dtype=np.int64)) == b"\x05\x00\x00\x00"
    assert pack_tokens([]) == b""


def test_as_token_array_views_without_copy() -> None:
    u32 = np.arange(10, dtype=np.uint32)
    assert np.shares_memory(as_token_array(u32), u32)
    buf = bytearray(u32.tobytes())
    view = as_token_array(buf)
    assert view.dtype == np.dtype("<u4") and view.flags.c_contiguous
    assert np.shares_memory(view, np.frombuffer(buf, dtype=np.uint8))


def test_empty_inputs() -> None:
    digest = BASE.digest()
    empties: list[Any] = [[], (), np.array([], dtype=np.int64), b"", np.empty(0, dtype=np.uint32)]
    for empty in empties:
        assert chunk_keys(digest, empty, partial_last=True) == []
        assert as_token_array(empty).size == 0


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "tokens",
    [
        [-1],
        [1, 2, -5],
        [2**32],
        [2**64],
        [-1, 2**63],
        np.array([-1, 3], dtype=np.int64),
        np.array([2**32], dtype=np.int64),
        np.array([2**32 + 7], dtype=np.uint64),
        np.array([-3], dtype=np.int8),
    ],
    ids=repr,
)
def test_out_of_range_ids_are_rejected(tokens: Any) -> None:
    with pytest.raises(ValueError):
        chunk_keys(BASE.digest(), tokens, 1)
    with pytest.raises(ValueError):
        pack_tokens(tokens)


@pytest.mark.parametrize(
    "tokens",
    [
        np.array([1.0, 2.0]),
        np.array([1.5], dtype=np.float32),
        np.array([], dtype=np.float64),
        np.array([True, False]),
        np.array([1, 2], dtype=object),
        np.array(["1", "2"]),
        [1.0, 2.0],
        [1, 2.5],
        ["1", "2"],
        [None],
    ],
    ids=repr,
)
def test_non_integer_ids_are_rejected(tokens: Any) -> None:
    with pytest.raises(ValueError):
        chunk_keys(BASE.digest(), tokens, 1)


@pytest.mark.parametrize(
    "tokens",
    [np.zeros((2, 4), dtype=np.uint32), np.zeros((1, 1, 1), dtype=np.int64), [[1, 2], [3, 4]]],
    ids=lambda t: f"shape{np.shape(t)}",
)
def test_multi_dimensional_ids_are_rejected(tokens: Any) -> None:
    with pytest.raises(ValueError, match="one-dimensional"):
        chunk_keys(BASE.digest(), tokens, 1)


def test_scalar_is_rejected() -> None:
    with pytest.raises(ValueError):
        as_token_array(np.uint32(5))  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 1023])
def test_byte_buffers_must_hold_whole_uint32s(size: int) -> None:
    for buf in (b"\x00" * size, bytearray(size), memoryview(b"\x00" * size)):
        with pytest.raises(ValueError, match="multiple of 4"):
            chunk_keys(BASE.digest(), buf, 1)
        with pytest.raises(ValueError, match="multiple of 4"):
            as_token_array(buf)


def test_a_typed_buffer_of_ids_outside_uint32_is_refused() -> None:
    with pytest.raises(ValueError, match="must be in"):
        as_token_array(memoryview(np.array([1, -1], dtype=np.int32)))
    with pytest.raises(ValueError, match="must be in"):
        as_token_array(memoryview(np.array([2**32], dtype=np.int64)))


def test_non_contiguous_buffer_is_rejected() -> None:
    view = memoryview(bytes(64))[::2]
    with pytest.raises(ValueError, match="contiguous"):
        as_token_array(view)


@pytest.mark.parametrize("chunk_size", [0, -1, -256, 2.0, True, None])
def test_chunk_size_must_be_a_positive_int(chunk_size: Any) -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_keys(BASE.digest(), [1, 2, 3, 4], chunk_size)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_hashes(BASE.digest(), b"", chunk_size)
    with pytest.raises(ValueError, match="chunk_size"):
        num_chunks(4, chunk_size)


def test_num_tokens_must_not_be_negative() -> None:
    with pytest.raises(ValueError):
        num_chunks(-1, 256)


@pytest.mark.parametrize("digest", [b"", b"x" * 15, b"x" * 17, b"x" * 32, "x" * 16, None])
def test_namespace_digest_must_be_16_bytes(digest: Any) -> None:
    with pytest.raises(ValueError, match="namespace digest"):
        chunk_keys(digest, [1, 2, 3, 4], 2)
    with pytest.raises(ValueError, match="namespace digest"):
        keys_from_hashes(digest, [b"x" * 16])


# ---------------------------------------------------------------------------- precomputed


def test_keys_from_hashes_stays_inside_the_namespace() -> None:
    other = with_field(BASE, "tenant_salt", "someone-else")
    hashes = [b"\x01" * 16, b"\x02" * 32, b"\x03", b"\x04" * 64]
    mine = keys_from_hashes(BASE.digest(), hashes)
    theirs = keys_from_hashes(other.digest(), hashes)
    assert all(len(k) == KEY_SIZE for k in mine)
    assert all(k[:DIGEST_SIZE] == BASE.digest() for k in mine)
    assert all(k[:DIGEST_SIZE] == other.digest() for k in theirs)
    assert set(mine).isdisjoint(theirs)
    # Same suffix: only the namespace half differs.
    assert [k[DIGEST_SIZE:] for k in mine] == [k[DIGEST_SIZE:] for k in theirs]


def test_keys_from_hashes_folding() -> None:
    digest = BASE.digest()
    h16 = bytes(range(16))
    assert keys_from_hashes(digest, [h16]) == [digest + h16]
    long_hashes = [b"a" * 32, b"a" * 33, b"b" * 32]
    folded = keys_from_hashes(digest, long_hashes)
    assert len(set(folded)) == 3
    assert folded == keys_from_hashes(digest, [bytearray(h) for h in long_hashes])
    assert folded == keys_from_hashes(digest, [memoryview(h) for h in long_hashes])
    assert keys_from_hashes(digest, []) == []


@pytest.mark.parametrize("length", [0, 65, 128])
def test_precomputed_hash_length_limits(length: int) -> None:
    with pytest.raises(ValueError, match=r"1\.\.64"):
        keys_from_hashes(BASE.digest(), [b"\x00" * 16, b"\x00" * length])


@pytest.mark.parametrize("bad", [12345, "a" * 16, None])
def test_precomputed_hashes_must_be_bytes(bad: Any) -> None:
    with pytest.raises(TypeError):
        keys_from_hashes(BASE.digest(), [bad])


# ---------------------------------------------------------------------------- determinism

_CHILD = textwrap.dedent(
    """
    import json, sys
    from tierkv.keys import Namespace, chunk_keys, keys_from_hashes
    spec = json.loads(sys.argv[1])
    ns = Namespace(**spec["namespace"])
    keys = chunk_keys(ns.digest(), spec["tokens"], spec["chunk_size"], partial_last=True)
    keys += keys_from_hashes(ns.digest(), [bytes.fromhex(h) for h in spec["hashes"]])
    print(json.dumps([ns.digest().hex()] + [k.hex() for k in keys]))
    """
)


@pytest.mark.processes
@pytest.mark.parametrize("hash_seed", ["0", "1", "random"])
def test_keys_are_identical_across_processes(hash_seed: str) -> None:
    """Guards against per-process randomness (Python's salted hash(), id(), dict order)."""
    ns = with_field(BASE, "tenant_salt", "salty")
    spec: dict[str, Any] = {
        "namespace": msgspec.structs.asdict(ns),
        "tokens": tokens_of(3 * 64 + 9, seed=42),
        "chunk_size": 64,
        "hashes": [(b"\x07" * 16).hex(), (b"\x08" * 40).hex()],
    }
    env = {"PYTHONHASHSEED": hash_seed}
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(spec)],
        capture_output=True,
        text=True,
        check=True,
        env={**_inherited_env(), **env},
        timeout=120,
    )
    child = json.loads(result.stdout)
    local = chunk_keys(ns.digest(), spec["tokens"], 64, partial_last=True)
    local += keys_from_hashes(ns.digest(), [bytes.fromhex(h) for h in spec["hashes"]])
    assert child == [ns.digest().hex()] + [k.hex() for k in local]


def _inherited_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}


@pytest.mark.parametrize("partial_last", [False, True])
def test_lazy_chunk_keys_are_the_chunk_keys_however_they_are_read(partial_last: bool) -> None:
    digest = keys.Namespace("m", "float16", "l").digest()
    tokens = np.arange(10 * 16 + 5, dtype="<u4").tobytes()
    want = keys.chunk_keys(digest, tokens, 16, partial_last)
    assert len(want) == (11 if partial_last else 10)

    lazy = keys.LazyChunkKeys(digest, tokens, (), 16, partial_last)
    assert len(lazy) == len(want) and lazy.hashed == []  # the length costs no hash
    assert lazy[2] == want[2] and len(lazy.hashed) == 3  # up to what was read
    assert lazy[1:4] == want[1:4] and len(lazy.hashed) == 4
    assert lazy[-1] == want[-1] and lazy.hashed == want
    for read in (
        list,
        lambda k: k[::-1],
        lambda k: k[5:1:-1],
        lambda k: k[20:],
        lambda k: k[-3:-1],
    ):
        fresh = keys.LazyChunkKeys(digest, tokens, (), 16, partial_last)
        assert read(fresh) == read(want)
    with pytest.raises(IndexError):
        keys.LazyChunkKeys(digest, tokens, (), 16, partial_last)[len(want)]
    # A known prefix is taken as is and the chain goes on from it.
    known = keys.LazyChunkKeys(digest, tokens, want[:4], 16, partial_last)
    assert len(known.hashed) == 4 and list(known) == want


def test_lazy_chunk_keys_read_by_several_threads_at_once_hash_one_chain() -> None:
    digest = keys.Namespace("m", "float16", "l").digest()
    tokens = np.random.default_rng(3).integers(0, 50_000, 256 * 16, dtype="<u4").tobytes()
    want = keys.chunk_keys(digest, tokens, 16)
    lazy = keys.LazyChunkKeys(digest, tokens, (), 16)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda i: lazy[i], [255, 3, 128, 40, 200, 0] * 4))
    assert got == [want[i] for i in [255, 3, 128, 40, 200, 0] * 4]
    assert lazy.hashed == want


def test_lazy_chunk_keys_refuse_what_chunk_keys_refuse() -> None:
    digest = keys.Namespace("m", "float16", "l").digest()
    with pytest.raises(ValueError, match="multiple of 4"):
        keys.LazyChunkKeys(digest, b"abc", (), 16)
    with pytest.raises(ValueError, match="namespace digest"):
        keys.LazyChunkKeys(b"short", b"", (), 16)
    with pytest.raises(ValueError, match="more known keys"):
        keys.LazyChunkKeys(digest, bytes(64), [b"k" * 32] * 2, 16)


def test_a_cache_salt_never_spells_another_tenants_namespace() -> None:
    """A request's cache salt is a field of the digest of its own: no tenant salt, however
    chosen, gives another tenant's salted namespace (tenant "0:x" is not the default
    tenant under cache salt "x"); an unsalted namespace digests as it always did."""
    base: dict[str, Any] = {"model": "m", "kv_dtype": "float16", "layout": "L"}
    salted = Namespace(**base, tenant_salt="alice", cache_salt="user-42").digest()
    for tenant in ("7:aliceuser-42", "5:aliceuser-42", "aliceuser-42", "alice"):
        assert Namespace(**base, tenant_salt=tenant).digest() != salted
    default_salted = Namespace(**base, cache_salt="x").digest()
    for tenant in ("0:x", "x"):
        assert Namespace(**base, tenant_salt=tenant).digest() != default_salted
    assert Namespace(**base, tenant_salt="t", cache_salt="s").digest() != (
        Namespace(**base, tenant_salt="ts").digest()
    )
    unsalted = msgspec.msgpack.encode(["tierkv-namespace-v2", "m", "float16", "L", 1, 0, "t"])
    assert Namespace(**base, tenant_salt="t").digest() == keys.digest16(unsalted)
    with pytest.raises(TypeError, match="cache_salt"):
        Namespace(**base, cache_salt=3)  # type: ignore[arg-type]
