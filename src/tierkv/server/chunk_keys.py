"""A request's chunk selector turned into chunk keys and byte lengths, with its limits.

Engines name chunks by token ids (the server hashes them into prefix-chained keys) or by
their own chained hashes, under the client's namespace and an optional per-request cache
salt. Everything about a selector that can be wrong is refused here with a clear
:class:`RequestError`, before any key is computed or any lock taken.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierkv import keys
from tierkv import protocol as p
from tierkv.server.errors import RequestError
from tierkv.server.registry import Registration
from tierkv.tenants import salt_error

MAX_SALT = 1024  # characters of a per-request cache salt
CHAINS = 4  # token chains remembered per client
CHAIN_BYTES = 2 * 2**20  # and the most token bytes they may hold together (512k tokens)


class ChunkKeys:
    """Keys and lengths of selected chunks, for one server's chunk size and limits.

    An engine stores a long prompt request by request, each naming the whole token prefix
    up to its last chunk, and looks a prompt up before it stores it: hashing every request's
    tokens from the start would hash a prompt's first chunks again and again (576 chunk
    hashes for a 32k-token prompt stored 16 chunks at a time, instead of 128). So each
    client keeps its last few chains (:data:`CHAINS` of them, :data:`CHAIN_BYTES` of tokens
    at most: a client cannot make the server hold more than that); a request whose tokens
    extend one, or are its beginning, reuses its keys and hashes only what is new. Reuse
    needs the same namespace digest and byte-identical tokens, so a key is never taken for
    tokens it was not computed from."""

    def __init__(self, chunk_size: int, max_chunks: int) -> None:
        self.chunk_size = chunk_size
        self.max_chunks = max_chunks

    def of(
        self, reg: Registration, sel: p.ChunkSelector, first_chunk: int = 0, store: bool = False
    ) -> tuple[list[bytes], list[int]]:
        """Keys and byte lengths of the selected chunks of ``reg``, from ``first_chunk`` on;
        ``store``: of chunks to be stored (see :meth:`Registration.digest_for`)."""
        if first_chunk < 0:
            raise RequestError(p.ErrorCode.BAD_REQUEST, "first_chunk must be >= 0")
        ks, lengths = self._of(reg, sel, lazy=False, store=store)
        assert isinstance(ks, list)  # only lookups get lazily hashed keys
        if first_chunk > len(ks):
            raise RequestError(
                p.ErrorCode.BAD_REQUEST, f"first_chunk {first_chunk} beyond {len(ks)} chunks"
            )
        return ks[first_chunk:], lengths[first_chunk:]

    def for_lookup(
        self, reg: Registration, sel: p.ChunkSelector
    ) -> tuple[Sequence[bytes], list[int]]:
        """:meth:`of` for a lookup: chunks named by tokens get keys hashed only as far as
        they are read (:class:`tierkv.keys.LazyChunkKeys`); :meth:`remember` them after."""
        return self._of(reg, sel, lazy=True)

    def remember(self, reg: Registration, ks: Sequence[bytes]) -> None:
        """Keep the chain a lookup hashed (as far as it did), for the stores that follow."""
        if isinstance(ks, keys.LazyChunkKeys) and (new := ks.new_full_chunks()) is not None:
            self._remember(reg, *new)

    def _of(
        self, reg: Registration, sel: p.ChunkSelector, lazy: bool, store: bool = False
    ) -> tuple[Sequence[bytes], list[int]]:
        limit = self.max_chunks
        chunk_size = self.chunk_size
        if (sel.tokens is None) == (sel.hashes is None):
            raise RequestError(p.ErrorCode.BAD_REQUEST, "give exactly one of tokens or hashes")
        if len(sel.salt) > MAX_SALT:
            raise RequestError(p.ErrorCode.BAD_REQUEST, f"cache salt longer than {MAX_SALT}")
        if sel.salt and (why := salt_error("cache salt", sel.salt)):
            raise RequestError(p.ErrorCode.BAD_REQUEST, why)
        if sel.tokens is not None:
            if reg.chunk_tokens and reg.chunk_tokens != chunk_size:
                raise RequestError(
                    p.ErrorCode.BAD_REQUEST,
                    f"this client's chunks hold {reg.chunk_tokens} tokens, not the server's "
                    f"chunk size {chunk_size}: name them by hashes, not token ids",
                )
            if len(sel.tokens) % 4:
                raise RequestError(p.ErrorCode.BAD_REQUEST, "tokens must be packed uint32")
            n_tokens = len(sel.tokens) // 4
            n_chunks = n_tokens // chunk_size + bool(sel.partial_last and n_tokens % chunk_size)
            if n_chunks > limit:
                raise RequestError(
                    p.ErrorCode.TOO_LARGE,
                    f"{n_tokens} tokens make {n_chunks} chunks of {chunk_size}, more than "
                    f"{limit} (max_chunks_per_request)",
                )
            digest = reg.digest_for(sel.salt, store)
            ks = self._chain(reg, digest, sel.tokens, sel.partial_last, lazy)
            lengths = [reg.chunk_bytes] * len(ks)
            rest = n_tokens % chunk_size
            if sel.partial_last and rest:
                lengths[-1] = reg.chunk_bytes // chunk_size * rest
        else:
            assert sel.hashes is not None
            if len(sel.hashes) > limit:
                raise RequestError(
                    p.ErrorCode.TOO_LARGE,
                    f"{len(sel.hashes)} hashes is more than {limit} (max_chunks_per_request)",
                )
            if sel.partial_last:
                raise RequestError(p.ErrorCode.BAD_REQUEST, "partial_last needs tokens, not hashes")
            try:
                ks = keys.keys_from_hashes(reg.digest_for(sel.salt, store), sel.hashes)
            except ValueError as exc:
                raise RequestError(p.ErrorCode.BAD_REQUEST, str(exc)) from None
            lengths = [reg.chunk_bytes] * len(ks)
        return ks, lengths

    def _chain(
        self, reg: Registration, digest: bytes, tokens: bytes, partial_last: bool, lazy: bool
    ) -> Sequence[bytes]:
        """The keys of ``tokens`` under ``digest``, reusing a chain ``reg`` hashed before
        (``lazy``: hashed as far as they are read, and not remembered yet)."""
        step = self.chunk_size * keys.TOKEN_DTYPE.itemsize
        full = len(tokens) // step
        whole = tokens if full * step == len(tokens) else tokens[: full * step]
        known: list[bytes] = []
        for cached_digest, cached_tokens, cached_keys in reg.chains:
            if cached_digest != digest:
                continue
            if len(cached_keys) <= full and whole.startswith(cached_tokens):
                known = cached_keys  # this request extends that chain
                break
            if len(cached_keys) > full and cached_tokens.startswith(whole):
                known = cached_keys[:full]  # this request is that chain's beginning
                break
        if lazy:
            return keys.LazyChunkKeys(digest, tokens, known, self.chunk_size, partial_last)
        ks = keys.chunk_keys_after(digest, tokens, known, self.chunk_size, partial_last)
        if len(known) < full:
            self._remember(reg, digest, whole, ks[:full])
        return ks

    def _remember(self, reg: Registration, digest: bytes, whole: bytes, ks: list[bytes]) -> None:
        """Keep ``ks``, the keys of the full chunks ``whole`` (some of them hashed just now),
        among ``reg``'s chains."""
        if ks and len(whole) <= CHAIN_BYTES:
            entry = (digest, whole, ks)
            older = [c for c in reg.chains if not (c[0] == digest and whole.startswith(c[1]))]
            kept, total = [entry], len(whole)
            for chain in older[: CHAINS - 1]:
                total += len(chain[1])
                if total > CHAIN_BYTES:
                    break
                kept.append(chain)
            reg.chains = kept
