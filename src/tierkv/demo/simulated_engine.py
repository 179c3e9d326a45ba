"""The simulated inference engine: a paged KV cache and the tierkv calls around prefill.

This is the integration an engine connector makes, written out with numpy:

1. ``lookup(tokens, request_id=...)``: how many leading chunks of the prompt are cached
   (the server read-locks them for this request). When the pool holds only part of the
   prefix and the server has slower tiers (disk, Redis, S3), it prefetches the following
   chunks into the pool; ``wait_prefetch`` returns the final count (this is what
   ``lookup(..., wait=True)`` does, in two steps so that the engine knows how many hits
   the pool had and how many the tiers added);
2. ``retrieve(request_id=..., scatter=...)``: copy those chunks straight from the server's
   shared-memory pool into the request's paged KV blocks (one copy, no staging buffer);
3. prefill the rest of the prompt (here: compute the deterministic KV of :mod:`.kv`);
4. ``store(tokens, gather=..., first_chunk=hits)``: copy the newly computed full chunks
   straight from the paged blocks into pool slots (one copy again);
5. ``end_session(request_id)``: release whatever the server still holds for the request.

The paged cache is laid out like one vLLM layer's KV cache stacked over layers:
``[K/V, layer, block, token in block, head, dim]``, 16 tokens per block, and a request owns
a block table: the (scattered) block ids holding its tokens in order. A 256-token chunk is
16 blocks; its layout in the pool is ``[K/V, layer, token, head, dim]``.
"""

from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from tierkv.client import Client
from tierkv.demo.kv import KV_DTYPE, TOKEN_AXIS, KVFunction, SimModel
from tierkv.demo.workload import Request, Workload

CHUNK_TOKENS = 256  # the server's chunk size (its default)
BLOCK_TOKENS = 16  # the engine's page size, as in vLLM
BLOCKS_PER_CHUNK = CHUNK_TOKENS // BLOCK_TOKENS


class PagedKVCache:
    """The engine's KV memory: fixed-size blocks handed out to requests from a free list."""

    def __init__(self, model: SimModel, num_blocks: int, seed: int = 0) -> None:
        self.model = model
        shape = (2, model.layers, num_blocks, BLOCK_TOKENS, model.kv_heads, model.head_dim)
        self.kv = np.zeros(shape, dtype=KV_DTYPE)
        # A shuffled free list, so that block tables are scattered as in a busy engine.
        self._free = [int(b) for b in np.random.default_rng(seed).permutation(num_blocks)]

    def allocate(self, num_tokens: int) -> npt.NDArray[np.intp]:
        """A block table for ``num_tokens`` tokens."""
        n = -(-num_tokens // BLOCK_TOKENS)
        if n > len(self._free):
            raise MemoryError(f"{n} blocks wanted, {len(self._free)} free")
        table, self._free = self._free[:n], self._free[n:]
        return np.array(table, dtype=np.intp)

    def free(self, table: npt.NDArray[np.intp]) -> None:
        self._free.extend(int(b) for b in table)

    def block(self, block_id: int) -> npt.NDArray[np.float16]:
        """View of one block: ``[K/V, layer, token, head, dim]``."""
        return self.kv[:, :, block_id]

    def gather(self, blocks: npt.NDArray[np.intp], dst: npt.NDArray[Any]) -> None:
        """Copy the tokens of ``blocks`` into ``dst`` (a chunk-shaped slot view), once."""
        out = _as_blocks(dst)
        # mode="clip" lets take() write straight into `out` (mode="raise" buffers).
        np.take(self.kv, blocks, axis=2, out=out, mode="clip")

    def scatter(self, blocks: npt.NDArray[np.intp], src: npt.NDArray[Any]) -> None:
        """Copy a chunk-shaped ``src`` (a slot view) into ``blocks``, once."""
        self.kv[:, :, blocks] = _as_blocks(src)


def _as_blocks(chunk: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """A ``[K/V, layer, token, head, dim]`` chunk viewed as ``[K/V, layer, block, token in
    block, head, dim]``: the same memory, never a copy (assigning ``.shape`` raises rather than
    copy, which a silent copy of a slot view would turn into lost writes)."""
    view: npt.NDArray[Any] = chunk.view()
    two, layers, tokens, heads, dim = chunk.shape
    view.shape = (two, layers, tokens // BLOCK_TOKENS, BLOCK_TOKENS, heads, dim)
    return view


@dataclass
class RequestRecord:
    """What one request did, as the engine measured it."""

    doc: int
    query: int
    engine: int
    tokens: int = 0
    full_chunks: int = 0
    hit_chunks: int = 0  # lookup: leading chunks available (after the prefetch)
    pool_hit_chunks: int = 0  # of those, in the pool at lookup time (the rest: from tiers)
    retrieved_chunks: int = 0  # loaded into the paged cache
    stored_chunks: int = 0
    present_chunks: int = 0  # at store time, already stored by another engine
    no_space_chunks: int = 0  # the pool was full
    prefill_tokens: int = 0
    lookup_s: float = 0.0  # includes waiting for the prefetch
    prefetch_s: float = 0.0  # waiting for the prefetch from the tiers
    retrieve_s: float = 0.0
    prefill_s: float = 0.0
    store_s: float = 0.0
    verify_s: float = 0.0
    corrupt_chunks: list[int] = field(default_factory=list)  # failed verification

    @property
    def tier_hit_chunks(self) -> int:
        """Hits the tiers supplied: prefetched into the pool during the lookup."""
        return self.hit_chunks - self.pool_hit_chunks


class SimEngine:
    """One engine (one rank): serves requests through its paged cache and a tierkv client."""

    def __init__(self, client: Client, model: SimModel, cache: PagedKVCache, index: int = 0):
        self.client = client
        self.model = model
        self.cache = cache
        self.index = index
        self.kv_function = KVFunction(model)

    def register(self) -> None:
        """Declare the model and the chunk layout: 256 tokens of ``[K/V, layer, token, head,
        dim]`` float16."""
        self.client.register(
            self.model.name,
            self.model.kv_shape(CHUNK_TOKENS),
            KV_DTYPE,
            token_axis=TOKEN_AXIS,
            name=f"tierkv-demo-engine-{self.index}",
        )

    def serve(self, request: Request, tokens: npt.NDArray[np.uint32]) -> RequestRecord:
        """Run one request's prefill, loading and saving KV through tierkv."""
        rec = RequestRecord(request.doc, request.query, self.index, tokens=len(tokens))
        rec.full_chunks = len(tokens) // CHUNK_TOKENS
        rid = request.request_id
        table = self.cache.allocate(len(tokens))

        def chunk_blocks(chunk: int) -> npt.NDArray[np.intp]:
            return table[chunk * BLOCKS_PER_CHUNK : (chunk + 1) * BLOCKS_PER_CHUNK]

        try:
            t0 = time.perf_counter()
            found = self.client.lookup(tokens, request_id=rid)
            rec.pool_hit_chunks = rec.hit_chunks = found.hits
            if found.prefetching:
                tp = time.perf_counter()
                rec.hit_chunks = self.client.wait_prefetch(rid)
                rec.prefetch_s = time.perf_counter() - tp
            t1 = time.perf_counter()
            rec.lookup_s = t1 - t0

            loaded = 0
            if rec.hit_chunks:
                got = self.client.retrieve(
                    request_id=rid,
                    scatter=lambda chunk, src: self.cache.scatter(chunk_blocks(chunk), src),
                )
                rec.retrieve_s = time.perf_counter() - t1
                # Chunks come back in prefix order; anything after a gap must be recomputed.
                while loaded < len(got.retrieved) and got.retrieved[loaded] == loaded:
                    loaded += 1
                rec.retrieved_chunks = loaded
                # Demo only: a real engine cannot check loaded KV, but here KV is a function
                # of the tokens, so every loaded chunk is compared with a recomputation.
                t2 = time.perf_counter()
                rec.corrupt_chunks = [c for c in range(loaded) if not self.verify(tokens, table, c)]
                rec.verify_s = time.perf_counter() - t2

            t3 = time.perf_counter()
            rec.prefill_tokens = self.prefill(tokens, table, loaded * CHUNK_TOKENS)
            rec.prefill_s = time.perf_counter() - t3

            if loaded < rec.full_chunks:
                t4 = time.perf_counter()
                stored = self.client.store(
                    tokens,
                    gather=lambda chunk, dst: self.cache.gather(chunk_blocks(chunk), dst),
                    first_chunk=loaded,
                )
                rec.store_s = time.perf_counter() - t4
                rec.stored_chunks = len(stored.stored)
                rec.present_chunks = len(stored.present)
                rec.no_space_chunks = len(stored.no_space)
        finally:
            self.client.end_session(rid)
            self.cache.free(table)
        return rec

    def prefill(
        self, tokens: npt.NDArray[np.uint32], table: npt.NDArray[np.intp], start: int
    ) -> int:
        """Simulated compute: the KV of ``tokens[start:]``, written block by block into the
        request's pages. Returns the number of tokens computed."""
        for pos in range(start, len(tokens), BLOCK_TOKENS):
            block = self.cache.block(int(table[pos // BLOCK_TOKENS]))
            n = min(BLOCK_TOKENS, len(tokens) - pos)
            self.kv_function.compute(tokens[pos : pos + n], pos, block[:, :, :n])
        return max(0, len(tokens) - start)

    def verify(
        self, tokens: npt.NDArray[np.uint32], table: npt.NDArray[np.intp], chunk: int
    ) -> bool:
        """Whether the pages of ``chunk`` hold exactly the KV its tokens would compute to."""
        for i in range(BLOCKS_PER_CHUNK):
            pos = chunk * CHUNK_TOKENS + i * BLOCK_TOKENS
            block = self.cache.block(int(table[pos // BLOCK_TOKENS]))
            if not self.kv_function.matches(tokens[pos : pos + BLOCK_TOKENS], pos, block):
                return False
        return True


# -- the engine process ----------------------------------------------------------------------
@dataclass(frozen=True)
class EngineSettings:
    """Everything an engine process needs (picklable: sent to spawned processes)."""

    endpoint: str
    workload: Workload
    model: SimModel
    engines: int
    timeout: float = 30.0
    # Between rounds, engine 0 waits (bounded) until the server's write-behind has written
    # the round's chunks to its tiers: later questions come after the tier caught up.
    settle_tiers: bool = False


# Messages an engine process puts on the event queue: (kind, engine index, payload).
RECORD, DONE, FAILED, SETTLED = "record", "done", "failed", "settled"


def settle_tiers(client: Client, timeout: float) -> float:
    """Wait until the server's write-behind queue is empty (or ``timeout``); seconds waited."""
    t0 = time.perf_counter()
    deadline = t0 + timeout
    while client.stats().write_behind_queued and time.perf_counter() < deadline:
        time.sleep(0.05)
    return time.perf_counter() - t0


def engine_main(index: int, settings: EngineSettings, events: Any, barrier: Any) -> None:
    """Entry point of an engine process: serve this engine's share of every round, waiting
    for the other engines at the end of each round."""
    try:
        workload = settings.workload
        blocks = -(-workload.max_prompt_tokens // BLOCK_TOKENS)
        cache = PagedKVCache(settings.model, blocks, seed=index)
        with Client(settings.endpoint, timeout=settings.timeout) as client:
            engine = SimEngine(client, settings.model, cache, index)
            engine.register()
            rounds = workload.rounds(settings.engines)
            for number, round_ in enumerate(rounds):
                for request in round_[index]:
                    record = engine.serve(request, workload.prompt(request))
                    events.put((RECORD, index, record))
                if settings.settle_tiers and index == 0 and number + 1 < len(rounds):
                    events.put((SETTLED, index, settle_tiers(client, 4 * settings.timeout)))
                barrier.wait()
        events.put((DONE, index, None))
    except BaseException as exc:
        barrier.abort()  # don't leave the other engines waiting for this one
        if isinstance(exc, KeyboardInterrupt):
            detail = "interrupted"
        elif isinstance(exc, threading.BrokenBarrierError):
            detail = "stopped: another engine failed"
        else:
            detail = traceback.format_exc()
        events.put((FAILED, index, detail))
        raise SystemExit(1) from None
