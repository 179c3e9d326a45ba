"""Chunk keys: the namespace that makes KV incompatible, and prefix-chained chunk hashes.

A key is 32 bytes: the 16-byte digest of the namespace followed by the 16-byte chained hash
of the chunk. The namespace digest covers every field that makes KV bytes incompatible
(model identity, KV dtype, layout signature, world size, rank, tenant salt), so two
namespaces that differ in any field never share a key, and a key's first half tells the
server which namespace it belongs to without any lookup.

The chained hash makes a hit on chunk ``i`` imply the whole prefix:
``h_i = blake3(h_{i-1} || tokens of chunk i)`` with ``h_{-1}`` the namespace digest.
Tokens are hashed as little-endian uint32 so hashing never touches Python ints.
"""

from __future__ import annotations

from collections.abc import Sequence

import blake3
import msgspec
import numpy as np
import numpy.typing as npt

DIGEST_SIZE = 16
KEY_SIZE = 2 * DIGEST_SIZE
DEFAULT_CHUNK_SIZE = 256
TOKEN_DTYPE = np.dtype("<u4")

ChunkKey = bytes
"""A 32-byte key: namespace digest + chained chunk hash."""


class Namespace(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything that makes KV bytes of one engine incompatible with another's."""

    model: str
    kv_dtype: str
    layout: str
    world_size: int = 1
    rank: int = 0
    tenant_salt: str = ""

    def digest(self) -> bytes:
        """A 16-byte digest over every field, with field boundaries unambiguous."""
        encoded = msgspec.msgpack.encode(
            [
                "tierkv-namespace-v1",
                self.model,
                self.kv_dtype,
                self.layout,
                self.world_size,
                self.rank,
                self.tenant_salt,
            ]
        )
        return blake3.blake3(encoded).digest(length=DIGEST_SIZE)


def as_token_array(tokens: Sequence[int] | npt.NDArray[np.integer] | bytes) -> npt.NDArray[np.uint32]:
    """View or convert token ids as a contiguous little-endian uint32 array (no copy if possible)."""
    if isinstance(tokens, bytes | bytearray | memoryview):
        if len(tokens) % TOKEN_DTYPE.itemsize:
            raise ValueError(f"token buffer of {len(tokens)} bytes is not a multiple of 4")
        return np.frombuffer(tokens, dtype=TOKEN_DTYPE)
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size and arr.dtype != TOKEN_DTYPE:
        if arr.min() < 0 or arr.max() > 0xFFFFFFFF:
            raise ValueError("token ids must fit in uint32")
    return np.ascontiguousarray(arr, dtype=TOKEN_DTYPE)


def pack_tokens(tokens: Sequence[int] | npt.NDArray[np.integer]) -> bytes:
    """Token ids as the little-endian uint32 bytes the wire protocol carries."""
    return as_token_array(tokens).tobytes()


def num_chunks(num_tokens: int, chunk_size: int, partial_last: bool = False) -> int:
    """How many chunks ``num_tokens`` make: full chunks only unless ``partial_last``."""
    full, rest = divmod(num_tokens, chunk_size)
    return full + (1 if partial_last and rest else 0)


def chunk_hashes(
    namespace_digest: bytes,
    tokens: Sequence[int] | npt.NDArray[np.integer] | bytes,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    partial_last: bool = False,
) -> list[bytes]:
    """Prefix-chained 16-byte hashes, one per chunk of ``tokens``."""
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    arr = as_token_array(tokens)
    data = memoryview(arr).cast("B")
    step = chunk_size * TOKEN_DTYPE.itemsize
    count = num_chunks(arr.size, chunk_size, partial_last)
    out: list[bytes] = []
    prev = namespace_digest
    hasher = blake3.blake3
    for i in range(count):
        h = hasher(prev)
        h.update(data[i * step : (i + 1) * step])
        prev = h.digest(length=DIGEST_SIZE)
        out.append(prev)
    return out


def chunk_keys(
    namespace_digest: bytes,
    tokens: Sequence[int] | npt.NDArray[np.integer] | bytes,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    partial_last: bool = False,
) -> list[ChunkKey]:
    """Keys (namespace digest + chained hash) for each chunk of ``tokens``."""
    return [
        namespace_digest + h
        for h in chunk_hashes(namespace_digest, tokens, chunk_size, partial_last)
    ]


def keys_from_hashes(namespace_digest: bytes, hashes: Sequence[bytes]) -> list[ChunkKey]:
    """Keys for precomputed chunk hashes (for example an engine's own block hashes).

    Hashes of any length are folded to 16 bytes within the namespace, so a precomputed
    hash can never collide with a key of another namespace.
    """
    out: list[ChunkKey] = []
    for h in hashes:
        if not 1 <= len(h) <= 64:
            raise ValueError(f"a chunk hash must be 1..64 bytes, got {len(h)}")
        folded = h if len(h) == DIGEST_SIZE else blake3.blake3(h).digest(length=DIGEST_SIZE)
        out.append(namespace_digest + folded)
    return out


def namespace_of(key: ChunkKey) -> bytes:
    """The namespace digest a key belongs to."""
    return key[:DIGEST_SIZE]
