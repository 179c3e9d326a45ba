"""Tests for tierkv._keychain, the C helper that hashes key chains: it is built here, it gives
exactly the keys of the Python reference, and it refuses bad arguments without crashing."""

from __future__ import annotations

import random
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv import keys

try:
    from tierkv._keychain import chain
except ImportError:  # the first test fails and says why; the others skip
    chain = None
python_chain = keys._hash_pieces_python
built = pytest.mark.skipif(chain is None, reason="tierkv._keychain was not built")


def test_the_key_chain_is_hashed_by_the_c_helper() -> None:
    """`make test` installs what the helper needs; a build that silently fell back to Python
    would run every long prompt's hashing at about half the speed."""
    assert keys.NATIVE_CHAIN, (
        "tierkv._keychain was not built: a C compiler and Python's and OpenSSL's headers must "
        "be present when tierkv is installed (scripts/ensure-system-deps.sh installs them)"
    )
    assert keys._hash_pieces is chain


@built
@settings(max_examples=300, deadline=None)
@given(
    data=st.binary(max_size=300),
    start=st.integers(0, 300),
    length=st.integers(0, 400),
    step=st.integers(1, 70),
    prefix=st.sampled_from([b"", bytes(range(16))]),
    prev=st.binary(min_size=16, max_size=16),
)
def test_the_c_helper_gives_the_references_keys(
    data: bytes, start: int, length: int, step: int, prefix: bytes, prev: bytes
) -> None:
    start = min(start, len(data))
    view = memoryview(data)
    expected = python_chain(prev, view, start, start + length, step, prefix)
    assert chain(prev, view, start, start + length, step, prefix) == expected


@built
def test_a_long_prompts_chain_matches_and_takes_any_buffer() -> None:
    rng = random.Random(5)
    tokens = np.array([rng.randrange(2**32) for _ in range(512 * 256 + 77)], dtype="<u4")
    digest = keys.Namespace(model="m", kv_dtype="bfloat16", layout="L").digest()
    raw = tokens.tobytes()
    step = 256 * 4
    expected = python_chain(digest, memoryview(raw), 0, len(raw) + step, step, digest)
    assert len(expected) == 513  # 512 full chunks and the partial one
    for buf in (raw, bytearray(raw), memoryview(raw), tokens):
        assert chain(digest, buf, 0, len(raw) + step, step, digest) == expected
    # Starting after known keys continues the chain from the last of them.
    assert chain(expected[99][16:], raw, 100 * step, len(raw), step, digest) == expected[100:]
    # A step past the end: one piece, the rest of the data (no overflow in the count).
    whole = python_chain(digest, memoryview(raw), 0, len(raw), len(raw), digest)
    assert chain(digest, raw, 0, len(raw), sys.maxsize, digest) == whole


@built
@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((b"x" * 15, b"", 0, 0, 4, b""), ValueError),  # prev of the wrong size
        ((b"x" * 17, b"", 0, 0, 4, b""), ValueError),
        ((b"x" * 16, b"abcd", 0, 4, 0, b""), ValueError),  # step 0
        ((b"x" * 16, b"abcd", 0, 4, -4, b""), ValueError),
        ((b"x" * 16, b"abcd", -1, 4, 4, b""), ValueError),  # start before the data
        ((b"x" * 16, b"abcd", 5, 8, 4, b""), ValueError),  # start past the data
        ((b"x" * 16, b"abcd", 3, 2, 4, b""), ValueError),  # stop before start
        (("x" * 16, b"abcd", 0, 4, 4, b""), TypeError),  # str is not bytes-like
        ((b"x" * 16, [1, 2], 0, 4, 4, b""), TypeError),
        ((b"x" * 16, b"abcd", 0.5, 4, 4, b""), TypeError),
        ((b"x" * 16, b"abcd", 0, 4, 4), TypeError),  # an argument short
        ((b"x" * 16, np.arange(8)[::2], 0, 4, 4, b""), (TypeError, BufferError, ValueError)),
    ],
)
def test_the_c_helper_refuses_bad_arguments(args: tuple[Any, ...], error: Any) -> None:
    with pytest.raises(error):
        chain(*args)
    # And keeps working afterwards.
    assert chain(b"x" * 16, b"abcd", 0, 4, 4, b"") == python_chain(
        b"x" * 16, memoryview(b"abcd"), 0, 4, 4, b""
    )
