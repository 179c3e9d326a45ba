"""How a request names its chunks: a token sequence (chunked by the server's chunk size)
or an engine's precomputed chunk hashes, as a :class:`tierkv.protocol.ChunkSelector`, and
how many chunks that names."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from tierkv import keys
from tierkv import protocol as p

Tokens = Sequence[int] | npt.NDArray[np.integer] | bytes


def selector(
    tokens: Tokens | None,
    hashes: Sequence[bytes] | None,
    partial_last: bool = False,
    salt: str = "",
) -> p.ChunkSelector:
    """The chunks of ``tokens`` (packed once here) or of ``hashes``: exactly one of them."""
    if (tokens is None) == (hashes is None):
        raise ValueError("give exactly one of tokens or hashes")
    if tokens is not None:
        packed = tokens if isinstance(tokens, bytes) else keys.pack_tokens(tokens)
        return p.ChunkSelector(tokens=packed, partial_last=partial_last, salt=salt)
    return p.ChunkSelector(hashes=list(hashes or ()), partial_last=partial_last, salt=salt)


def num_chunks(sel: p.ChunkSelector, chunk_size: int) -> int:
    """How many chunks ``sel`` names, with ``chunk_size`` tokens per chunk."""
    if sel.hashes is not None:
        return len(sel.hashes)
    n_tokens = len(sel.tokens or b"") // 4
    return keys.num_chunks(n_tokens, chunk_size, sel.partial_last)


def chunk_count_error(given: int, expected: int, first_chunk: int) -> str:
    """The message for a store or retrieve given the wrong number of chunk arrays."""
    return f"{given} chunk arrays given for {expected} chunks (from chunk {first_chunk} on)"
