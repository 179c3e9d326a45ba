"""Chunk keys: the namespace that makes KV incompatible, and prefix-chained chunk hashes.

A key is 32 bytes: the 16-byte digest of the namespace followed by the 16-byte chained hash
of the chunk. The namespace digest covers every field that makes KV bytes incompatible
(model identity, KV dtype, layout signature, world size, rank, tenant salt), so two
namespaces that differ in any field never share a key, and a key's first half tells the
server which namespace it belongs to without any lookup.

The chained hash makes a hit on chunk ``i`` imply the whole prefix:
``h_i = sha256(h_{i-1} || tokens of chunk i)[:16]`` with ``h_{-1}`` the namespace digest.
Tokens are hashed as little-endian uint32 so hashing never touches Python ints.

Why SHA-256: a chunk is 1 KiB of tokens, too short for blake3's parallelism, and one call
per chunk is the whole cost of a long prompt's chain. OpenSSL's SHA-256 on CPUs with SHA
instructions (x86 since Zen and Ice Lake, Arm v8.2) hashed a 512-chunk chain in 0.54 ms
here against blake3's 0.87 ms. Keys must resist deliberate collisions (one prompt must
never be served another's KV), so a non-cryptographic hash is not an option.

The hashing loop runs in C (:mod:`tierkv._keychain`, OpenSSL's SHA-256 without the
interpreter's share per chunk: 0.34 ms for those 512 chunks) where it was built, and in
Python otherwise (:data:`NATIVE_CHAIN`); both give the same keys.
"""

from __future__ import annotations

import array
import hashlib
import operator
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeAlias, overload

import msgspec
import numpy as np
import numpy.typing as npt

DIGEST_SIZE = 16
KEY_SIZE = 2 * DIGEST_SIZE
DEFAULT_CHUNK_SIZE = 256
MAX_CHUNK_TOKENS = 1 << 20  # tokens in one chunk at most (of a client, or a router's lookup)
MAX_PRECOMPUTED_HASH_SIZE = 64
TOKEN_DTYPE = np.dtype("<u4")
_TOKEN_LIMIT = 1 << 32

ChunkKey = bytes
"""A 32-byte key: namespace digest + chained chunk hash."""

Tokens: TypeAlias = "Sequence[int] | npt.NDArray[np.integer] | bytes | bytearray | memoryview"
"""Token ids: a sequence of ints, an integer array, or packed little-endian uint32 bytes."""

# array.array("I") converts a list of ints to C unsigned ints several times faster than
# numpy's type discovery, and rejects negative and too-large ids by itself. It is only
# usable where a C unsigned int is exactly 4 bytes (every platform tierkv targets).
_ARRAY_CODE_U32 = "I" if array.array("I").itemsize == 4 else None


KV_FORMAT_SEPARATOR = "|kv="  # between a model's name and what its chunk bytes mean


def model_with_format(model: str, format_tag: str) -> str:
    """The namespace model of an engine's connector: the model as the engine serves it, then
    what its chunk bytes mean (a cache layout's format tag), so that engines storing KV of
    one model in different formats never share chunks. The model's own ``|`` (and ``%``)
    are escaped: a served name holding the separator could otherwise spell another
    model's name and format, and routers asking for a model matched another one."""
    return f"{_escaped(model)}{KV_FORMAT_SEPARATOR}{format_tag}"


def is_of_model(registered: str, model: str) -> bool:
    """A namespace whose model is ``registered`` holds KV of ``model``: the same name, or
    ``model`` with a format (:func:`model_with_format`)."""
    return registered == model or registered.startswith(_escaped(model) + KV_FORMAT_SEPARATOR)


def _escaped(model: str) -> str:
    return model.replace("%", "%25").replace("|", "%7C")


class Namespace(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything that makes KV bytes of one engine incompatible with another's.

    ``model``, ``kv_dtype`` and ``layout`` must be non-empty: an empty field would make
    unrelated engines share a namespace. ``0 <= rank < world_size``.
    """

    model: str
    kv_dtype: str
    layout: str
    world_size: int = 1
    rank: int = 0
    tenant_salt: str = ""
    cache_salt: str = ""  # a request's cache salt (an engine's namespace has none)

    def __post_init__(self) -> None:
        for name in ("model", "kv_dtype", "layout", "tenant_salt", "cache_salt"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"namespace {name} must be a str, got {type(value).__name__}")
            if not value and name not in ("tenant_salt", "cache_salt"):
                raise ValueError(f"namespace {name} must not be empty")
        for name in ("world_size", "rank"):
            value = getattr(self, name)
            # bool is an int subclass, and would digest differently from the same int.
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"namespace {name} must be an int, got {type(value).__name__}")
        if self.world_size < 1:
            raise ValueError(f"namespace world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"namespace rank must be in [0, {self.world_size}), got {self.rank}")

    def digest(self) -> bytes:
        """A 16-byte digest over every field, with field boundaries unambiguous: the cache
        salt is a field of its own (appended only when there is one, so unsalted digests
        stay what they were), never text inside another field, so no tenant salt can spell
        another tenant's salted namespace."""
        fields: list[str | int] = [
            "tierkv-namespace-v2",  # v2: SHA-256 keys (v1: blake3)
            self.model,
            self.kv_dtype,
            self.layout,
            self.world_size,
            self.rank,
            self.tenant_salt,
        ]
        if self.cache_salt:
            fields.append(self.cache_salt)
        return digest16(msgspec.msgpack.encode(fields))


_SHA256 = hashlib.sha256()  # never updated: only copied


_BYTE_FORMATS = ("B", "b", "c")  # buffers of raw bytes: packed little-endian uint32 ids


def from_hex(text: str) -> bytes:
    """The bytes of ``text``, hex digits and nothing else (ValueError otherwise):
    ``bytes.fromhex`` skips whitespace, so 32 spaces named the empty prefix (every
    namespace) and padded digits a shorter one."""
    raw = bytes.fromhex(text)
    if 2 * len(raw) != len(text):
        raise ValueError("hex digits only, no whitespace")
    return raw


def digest16(data: bytes) -> bytes:
    """The 16-byte digest keys are made of: SHA-256, truncated."""
    return hashlib.sha256(data).digest()[:DIGEST_SIZE]


def _from_buffer(tokens: bytes | bytearray | memoryview) -> npt.NDArray[np.uint32]:
    view = memoryview(tokens)
    if view.format not in _BYTE_FORMATS:
        # A typed buffer (int64, big-endian uint32, ...): its values are the ids, not its
        # bytes (read as packed uint32, [1, 2] as int64 was the prompt [1, 0, 2, 0]).
        return _from_ndarray(np.asarray(view), strict_dtype=True)
    if not view.c_contiguous:
        raise ValueError("token buffer must be contiguous")
    if view.nbytes % TOKEN_DTYPE.itemsize:
        raise ValueError(f"token buffer of {view.nbytes} bytes is not a multiple of 4")
    return np.frombuffer(view.cast("B"), dtype=TOKEN_DTYPE)


def _from_ndarray(arr: npt.NDArray[np.generic], strict_dtype: bool) -> npt.NDArray[np.uint32]:
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.dtype.kind not in "iu" and (strict_dtype or arr.size):
        if arr.dtype.kind == "O":
            raise ValueError(f"token ids must be integers in [0, 2**32), got dtype {arr.dtype}")
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.dtype == TOKEN_DTYPE:
        return np.ascontiguousarray(arr)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= _TOKEN_LIMIT):
        raise ValueError("token ids must be in [0, 2**32)")
    return np.ascontiguousarray(arr, dtype=TOKEN_DTYPE)


def as_token_array(tokens: Tokens) -> npt.NDArray[np.uint32]:
    """Token ids as a contiguous little-endian uint32 array (a view when possible).

    Raises ``ValueError`` for ids outside ``[0, 2**32)``, non-integer or multi-dimensional
    arrays, and byte buffers whose length is not a multiple of 4.
    """
    if isinstance(tokens, bytes | bytearray | memoryview):
        return _from_buffer(tokens)
    if isinstance(tokens, np.ndarray):
        return _from_ndarray(tokens, strict_dtype=True)
    if _ARRAY_CODE_U32 is not None and isinstance(tokens, list | tuple | range):
        try:
            packed = array.array(_ARRAY_CODE_U32, tokens)
        except (TypeError, OverflowError):
            pass  # numpy below gives the precise error (or accepts, e.g. numpy scalars)
        else:
            native = np.frombuffer(packed, dtype=np.uint32)
            return native if sys.byteorder == "little" else native.astype(TOKEN_DTYPE)
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"token ids must be a flat sequence of integers: {exc}") from None
    return _from_ndarray(arr, strict_dtype=False)


def pack_tokens(tokens: Tokens) -> bytes:
    """Token ids as the little-endian uint32 bytes the wire protocol carries."""
    return as_token_array(tokens).tobytes()


def _check_chunk_size(chunk_size: int) -> None:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def num_chunks(num_tokens: int, chunk_size: int, partial_last: bool = False) -> int:
    """How many chunks ``num_tokens`` make: full chunks only unless ``partial_last``."""
    _check_chunk_size(chunk_size)
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    full, rest = divmod(num_tokens, chunk_size)
    return full + (1 if partial_last and rest else 0)


def _check_digest(namespace_digest: bytes) -> bytes:
    if not isinstance(namespace_digest, bytes) or len(namespace_digest) != DIGEST_SIZE:
        raise ValueError(f"a namespace digest must be {DIGEST_SIZE} bytes (Namespace.digest())")
    return namespace_digest


def _chain(
    namespace_digest: bytes,
    tokens: Tokens,
    chunk_size: int,
    partial_last: bool,
    prefix: bytes,
    known: Sequence[bytes] = (),
    limit: int | None = None,
) -> list[bytes]:
    """``prefix + h_i`` for every chunk after the ``known`` ones (keys of the first chunks,
    hashed before), up to chunk ``limit`` (exclusive; None: all); the one hashing loop
    behind the public functions."""
    _check_digest(namespace_digest)
    _check_chunk_size(chunk_size)
    if isinstance(tokens, bytes):
        # The server path: packed bytes off the wire, hashed in place without numpy.
        if len(tokens) % TOKEN_DTYPE.itemsize:
            raise ValueError(f"token buffer of {len(tokens)} bytes is not a multiple of 4")
        data = memoryview(tokens)
    else:
        data = as_token_array(tokens).data.cast("B")
    step = chunk_size * TOKEN_DTYPE.itemsize
    count = num_chunks(len(data) // TOKEN_DTYPE.itemsize, chunk_size, partial_last)
    if limit is not None:
        count = min(count, limit)
    prev = known[-1][-DIGEST_SIZE:] if known else namespace_digest
    return _hash_pieces(prev, data, len(known) * step, count * step, step, prefix)


def _hash_pieces_python(
    prev: bytes, data: memoryview, start: int, stop: int, step: int, prefix: bytes
) -> list[bytes]:
    """``prefix + h`` for each piece ``data[s : s + step]``, ``s`` in ``range(start,
    min(stop, len(data)), step)``, with ``h = sha256(h of the piece before || piece)[:16]``
    and ``prev`` the ``h`` before the first piece. The reference for :mod:`tierkv._keychain`
    and what runs where it could not be built."""
    out: list[bytes] = []
    append = out.append
    fresh = _SHA256.copy  # a copy of an initialised context: cheaper than a new one
    for s in range(start, min(stop, len(data)), step):
        h = fresh()
        h.update(prev)
        h.update(data[s : s + step])
        prev = h.digest()[:DIGEST_SIZE]
        append(prefix + prev)
    return out


_hash_pieces: Callable[[bytes, memoryview, int, int, int, bytes], list[bytes]]
try:
    from tierkv._keychain import chain as _hash_pieces
except ImportError:  # built without a C compiler or OpenSSL's headers: the same keys, slower
    _hash_pieces = _hash_pieces_python
NATIVE_CHAIN = _hash_pieces is not _hash_pieces_python
"""Whether chains are hashed by the C helper :mod:`tierkv._keychain` (about 1.7x faster)."""


def chunk_hashes(
    namespace_digest: bytes,
    tokens: Tokens,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    partial_last: bool = False,
) -> list[bytes]:
    """Prefix-chained 16-byte hashes, one per chunk of ``tokens``.

    Only full chunks are hashed unless ``partial_last``, which adds the trailing partial
    chunk (its hash differs from that of any full chunk, since its input is shorter).
    """
    return _chain(namespace_digest, tokens, chunk_size, partial_last, b"")


def chunk_keys(
    namespace_digest: bytes,
    tokens: Tokens,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    partial_last: bool = False,
) -> list[ChunkKey]:
    """Keys (namespace digest + chained hash) for each chunk of ``tokens``."""
    return _chain(namespace_digest, tokens, chunk_size, partial_last, namespace_digest)


def chunk_keys_after(
    namespace_digest: bytes,
    tokens: bytes,
    known: Sequence[ChunkKey],
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    partial_last: bool = False,
) -> list[ChunkKey]:
    """:func:`chunk_keys` of packed ``tokens`` whose first ``len(known)`` full chunks have the
    keys ``known`` (computed before from the same tokens and namespace: the caller vouches
    for that): only the chunks after them are hashed."""
    if len(known) * chunk_size * TOKEN_DTYPE.itemsize > len(tokens):
        raise ValueError("more known keys than full chunks of tokens")
    return [
        *known,
        *_chain(namespace_digest, tokens, chunk_size, partial_last, namespace_digest, known),
    ]


class LazyChunkKeys(Sequence[ChunkKey]):
    """:func:`chunk_keys_after` of packed ``tokens``, hashed only as far as they are read.

    A lookup needs the keys of a prompt's chunks only up to the first one the pool lacks
    (and the rest only if some tier has that one): a new prompt, the usual lookup, costs one
    chunk hash instead of one per chunk. Its length is known without hashing. Reading key
    ``i`` hashes the chain up to ``i``; iterating hashes ahead in growing steps. Safe to
    read from several threads (a prefetch reads on a tier thread)."""

    def __init__(
        self,
        namespace_digest: bytes,
        tokens: bytes,
        known: Sequence[ChunkKey] = (),
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        partial_last: bool = False,
    ) -> None:
        _check_digest(namespace_digest)
        if len(tokens) % TOKEN_DTYPE.itemsize:
            raise ValueError(f"token buffer of {len(tokens)} bytes is not a multiple of 4")
        if len(known) * chunk_size * TOKEN_DTYPE.itemsize > len(tokens):
            raise ValueError("more known keys than full chunks of tokens")
        self._digest = namespace_digest
        self._tokens = tokens
        self._chunk_size = chunk_size
        self._partial_last = partial_last
        self._len = num_chunks(len(tokens) // TOKEN_DTYPE.itemsize, chunk_size, partial_last)
        self._keys: list[ChunkKey] = list(known)
        self._known = len(known)
        self._lock = threading.Lock()

    @property
    def hashed(self) -> list[ChunkKey]:
        """The keys hashed so far (a prefix of the sequence)."""
        return self._keys[:]

    def new_full_chunks(self) -> tuple[bytes, bytes, list[ChunkKey]] | None:
        """(namespace digest, the tokens of the full chunks hashed so far, their keys), if
        any full chunk was hashed here (beyond the ``known`` keys); else None."""
        keys = self._keys[:]
        step = self._chunk_size * TOKEN_DTYPE.itemsize
        full = min(len(keys), len(self._tokens) // step)
        if full <= self._known:
            return None
        return self._digest, self._tokens[: full * step], keys[:full]

    def hash_upto(self, n: int) -> None:
        """Make sure the first ``n`` keys are hashed."""
        n = min(n, self._len)
        if n <= len(self._keys):
            return
        with self._lock:
            keys = self._keys
            if n > len(keys):
                keys.extend(
                    _chain(
                        self._digest, self._tokens, self._chunk_size, self._partial_last,
                        self._digest, keys, n,
                    )
                )  # fmt: skip

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> ChunkKey: ...

    @overload
    def __getitem__(self, index: slice) -> list[ChunkKey]: ...

    def __getitem__(self, index: int | slice) -> ChunkKey | list[ChunkKey]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._len)
            if step > 0 and stop > start:
                self.hash_upto(stop)
            elif step < 0 and start > stop:
                self.hash_upto(start + 1)
            keys = self._keys
            if step == 1:
                return keys[start:stop]
            return [keys[i] for i in range(start, stop, step)]
        i = operator.index(index)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError("chunk key index out of range")
        self.hash_upto(i + 1)
        return self._keys[i]

    def __iter__(self) -> Iterator[ChunkKey]:
        done = 0
        while done < self._len:
            if done == len(self._keys):
                self.hash_upto(max(1, 2 * done))
            ahead = self._keys[done:]
            yield from ahead
            done += len(ahead)


def keys_from_hashes(
    namespace_digest: bytes, hashes: Sequence[bytes | bytearray | memoryview]
) -> list[ChunkKey]:
    """Keys for precomputed chunk hashes (for example an engine's own block hashes).

    A 16-byte hash is used as is; hashes of other lengths (1..64 bytes) are folded to 16
    bytes (:func:`digest16`). Either way the key starts with the namespace digest, so a
    precomputed hash can never collide with a key of another namespace.
    """
    _check_digest(namespace_digest)
    out: list[ChunkKey] = []
    for h in hashes:
        if not isinstance(h, bytes | bytearray | memoryview):
            raise TypeError(f"a chunk hash must be bytes, got {type(h).__name__}")
        raw = bytes(h)
        if not 1 <= len(raw) <= MAX_PRECOMPUTED_HASH_SIZE:
            raise ValueError(
                f"a chunk hash must be 1..{MAX_PRECOMPUTED_HASH_SIZE} bytes, got {len(raw)}"
            )
        folded = raw if len(raw) == DIGEST_SIZE else digest16(raw)
        out.append(namespace_digest + folded)
    return out
