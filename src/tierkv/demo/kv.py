"""The simulated model: its KV layout and a deterministic stand-in for its forward pass.

The demo engine does not run a model. Instead the KV of a token is a pure function of
(token id, position, K or V, layer): a cheap integer hash of those, spread over the
``heads x head_dim`` values of the row with a fixed random pattern (the "weights"). Any
process can recompute the KV of any token, so every chunk loaded from the cache is checked
byte for byte against a recomputation: a chunk of the wrong tokens, of the wrong position,
a misplaced block or a single flipped bit is caught.

Values are float16 with the top exponent bit cleared, so they are finite and below 2 in
magnitude, like real activations (comparisons are on the raw bits anyway).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

KV_DTYPE = "float16"
WEIGHTS_SEED = 0x71E5  # the same "weights" in every process
_FINITE_MASK = np.uint16(0xBFFF)  # clears the top exponent bit: no inf/nan, |x| < 2


@dataclass(frozen=True)
class SimModel:
    """KV geometry of the simulated model, per rank.

    The default (16 layers x 8 KV heads x 64 dims, float16) is 32 KiB of KV per token and
    8 MiB per 256-token chunk: what one tensor-parallel rank of a 7-8B GQA model holds.
    """

    layers: int = 16
    kv_heads: int = 8
    head_dim: int = 64

    @property
    def name(self) -> str:
        """The model identity registered with the server (part of the cache namespace)."""
        return f"tierkv-demo/sim-{self.layers}l-{self.kv_heads}h-{self.head_dim}d"

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * np.dtype(KV_DTYPE).itemsize

    def kv_shape(self, tokens: int) -> tuple[int, int, int, int, int]:
        """Shape of the KV of ``tokens`` consecutive tokens: (K/V, layer, token, head, dim).

        This is also the chunk layout registered with the server, with the token axis at
        :data:`TOKEN_AXIS`.
        """
        return (2, self.layers, tokens, self.kv_heads, self.head_dim)


TOKEN_AXIS = 2  # the token axis of SimModel.kv_shape


class KVFunction:
    """What the simulated forward pass computes: the KV of tokens at given positions."""

    def __init__(self, model: SimModel) -> None:
        self.model = model
        rng = np.random.default_rng(WEIGHTS_SEED)
        row = (2, model.layers, 1, model.kv_heads, model.head_dim)
        self._pattern = rng.integers(0, 1 << 16, row, dtype=np.uint16)
        self._salt = rng.integers(0, 1 << 32, (2, model.layers, 1), dtype=np.uint32)

    def _row_hashes(self, tokens: npt.NDArray[np.integer], start: int) -> npt.NDArray[np.uint16]:
        """A 16-bit hash per (K/V, layer, token) of (token id, position, K/V, layer)."""
        ids = np.asarray(tokens).astype(np.uint32)
        pos = np.arange(start, start + ids.size, dtype=np.uint32)
        x = (ids * np.uint32(0x9E3779B1)) ^ (pos * np.uint32(0x85EBCA77))
        x = x[None, None, :] ^ self._salt  # (2, layers, tokens)
        # murmur3's finalizer: every input bit flips about half of the output bits.
        x ^= x >> np.uint32(16)
        x *= np.uint32(0x85EBCA6B)
        x ^= x >> np.uint32(13)
        x *= np.uint32(0xC2B2AE35)
        x ^= x >> np.uint32(16)
        out: npt.NDArray[np.uint16] = (x & np.uint32(0xFFFF)).astype(np.uint16)
        return out

    def compute(
        self, tokens: npt.NDArray[np.integer], start: int, out: npt.NDArray[np.float16]
    ) -> None:
        """Write the KV of ``tokens`` (at positions ``start``...) into ``out``, an array or
        view of shape ``model.kv_shape(len(tokens))``."""
        bits = out.view(np.uint16)
        h = self._row_hashes(tokens, start)
        np.bitwise_xor(self._pattern, h[:, :, :, None, None], out=bits)
        np.bitwise_and(bits, _FINITE_MASK, out=bits)

    def matches(
        self, tokens: npt.NDArray[np.integer], start: int, kv: npt.NDArray[np.float16]
    ) -> bool:
        """Whether ``kv`` holds, bit for bit, the KV of ``tokens`` at positions ``start``..."""
        expected = np.empty(self.model.kv_shape(len(tokens)), dtype=np.float16)
        if kv.shape != expected.shape:
            return False
        self.compute(tokens, start, expected)
        return bool(np.array_equal(kv.view(np.uint16), expected.view(np.uint16)))
