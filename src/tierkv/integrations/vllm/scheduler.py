"""The connector's scheduler role: look prefixes up, plan loads and stores, end sessions.

Per request, in vLLM's order:

1. ``get_num_new_matched_tokens``: one LOOKUP under the vLLM request id covers every rank of
   this engine (the workers registered with the same ``engine_id``) and read-locks the hit
   chunks for each rank's retrieve. While the server still prefetches from slower tiers the
   answer is None (vLLM asks again next step). The count is chunk-aligned and only what lies
   beyond vLLM's own prefix-cache hit; loads are asynchronous (vLLM schedules the request
   once the load is reported, with any failed blocks already cut off, so wrong KV never
   reaches attention).
2. ``update_state_after_alloc``: with external tokens, plan the load into the new blocks;
   without, free the lookup's locks (vLLM computes those chunks itself). An MLA engine with
   several ranks (``shared_ranks``: one namespace, only rank 0 in the lookup) also puts the
   chunks' keys into the load, for the other ranks' reads by key. The external tokens are
   counted by where the server found their chunks (a lookup answered at once: its pool; one
   that prefetched: the sources in its prefetch status), for vLLM's stats (``stats.py``).
3. ``build_connector_meta``: this step's loads, and stores of every prompt chunk that is
   complete after this step's forward pass and not already known to be cached. With
   ``store_decode`` also the chunks that fill up while the request decodes (see below).
4. ``update_connector_output``: what each rank loaded and wrote; chunks that failed (on any
   rank) are stored again once recomputed.
5. ``request_finished``: end the server session; report the request's figures in
   ``kv_transfer_params["tierkv"]``: ``hit_tokens`` (chunk-aligned tokens the lookup found on
   every rank), ``external_tokens`` (what vLLM agreed to load), ``hit_sources`` (those
   tokens by where the server found them: ``pool``, ``peer`` or a tier's name),
   ``loaded_tokens`` (what every rank loaded), ``load_failed_from``, ``stored_chunks``
   (chunks handed to the workers to store) and ``ranks``: per rank, ``loaded_tokens`` and
   ``written_chunks`` (chunks its stores wrote into the pool, not counting those already
   cached), as reported by the workers before the request finished. With asynchronous
   stores (``async_store``) a store often ends after that: ``written_chunks`` then counts
   only the stores that had ended, and ``stored_chunks`` is what will be written (less any
   the pool already held or a failure).

Asynchronous stores (``async_store``). The workers run the stores planned for a step on their
store threads, after the step's forward pass, reading the request's blocks directly. The
blocks must outlive those reads: a running request never rewrites a full block (below);
a finished request whose stores may still run is kept (``request_finished`` answers True, its
id goes into the next step's ``release``, and the workers report it finished sending once all
its stores ended); a preempted request's id goes into the next step's ``preempted``, and the
workers wait for its stores before that step's forward pass (vLLM's ``handle_preemptions``).
So does a request whose sliding-window blocks vLLM freed behind the window (every step it
frees those a running request no longer needs, and once more as it finishes): the scheduler
reads each scheduled request's table as vLLM has it now (``kv_connector_block_state``), and a
block no longer there is waited for before it can be another request's. vLLM frees blocks on
no other path while the request is known to the connector: an abort ends the request through
``request_finished`` too.

Decode chunks (``store_decode``). A chunk of the request's whole token sequence (prompt, then
output tokens) is stored once every one of its tokens has KV in the paged cache and a known id:
a token sampled in step t gets its KV in step t+1, so the chunk it completes is planned in step
t+1 (with async scheduling, whose ids lag a step behind, in step t+2). The last sampled token
never gets KV: the chunk it would complete is not stored. Keys are those of prompt chunks
(vLLM's block hashes cover output blocks too; token ids come from ``request.all_token_ids``),
so a later prompt that starts with this sequence hits them. Every chunk is handed out once: a
preempted request keeps its count (what it stored stays valid); only a failed load lowers it,
to the failure, as for prompt chunks (vLLM recomputes from there; the server skips a chunk it
already holds). A request that finishes with a complete chunk no step planned (only with async
scheduling) gets it planned into the next step by ``request_finished``; :meth:`keeps_blocks`
then tells vLLM to keep its blocks, and the workers report it finished sending once that step's
store ran, which frees them. Workers run steps in order: a store planned for a step reads its
blocks before any later step can reuse them.

KV events (vLLM's ``kv_events_config.enable_kv_cache_events``; off: none of this runs). Each
store planned carries the notes of its chunks
(:func:`~tierkv.integrations.vllm.kv_events.chunk_note`: the chunk's blocks as vLLM's
``BlockStored`` describes them, one per KV cache group), which
every rank that stores gives the server with its part (the notes are the same on every rank:
with tensor parallelism each rank's part is a chunk of its own namespace, and the pool's events
announce a chunk once every part is held). A thread reads the server's chunk feed for this
engine's namespaces (:class:`~tierkv.integrations.feed_poller.FeedPoller`, every
:data:`~tierkv.integrations.vllm.kv_events.POLL_INTERVAL`), and :meth:`SchedulerSide.take_events`
hands vLLM the changes as events (``BlockStored``/``BlockRemoved`` with ``medium="CPU"``) in the
step's batch. An engine that cannot load (``kv_producer``) announces nothing; one that cannot
store (``kv_consumer``) gives no notes but announces what the others stored.

Every RPC goes through :class:`ServerLink`: a slow or dead server is a miss, never a stall.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tierkv import keys
from tierkv import protocol as p
from tierkv.client import Client
from tierkv.integrations.link import ServerLink
from tierkv.integrations.vllm.chunks import (
    BlockRef,
    LoadSpec,
    StateLoad,
    StateStore,
    StoreSpec,
    block_positions,
    blocks_per_chunk,
    chunk_hashes,
    full_chunks,
    has_null,
)
from tierkv.integrations.vllm.kv_events import NoteGroup, PoolEvents, chunk_note
from tierkv.integrations.vllm.metadata import TierKVConnectorMetadata, TierKVWorkerMetadata
from tierkv.integrations.vllm.settings import ConnectorSettings
from tierkv.integrations.vllm.state import MAX_PROBES, StateFormat, prefix_id
from tierkv.integrations.vllm.stats import POOL, TierKVStats

log = logging.getLogger("vllm.tierkv")

# Lookup phases of a request.
NEW, PREFETCHING, LOOKED_UP, ALLOCATED = "new", "prefetching", "looked_up", "allocated"
STATE_PREFETCHING = "state_prefetching"  # a hybrid model's state is being prefetched


# Separates a request id from the suffix naming its state session. The server keys sessions
# by any string; vLLM's request ids never hold a NUL (an HTTP header cannot; vLLM appends
# "-" and 8 random hex digits to every id), and a request whose id does is not looked up
# where state sessions exist (see SchedulerSide.get_num_new_matched_tokens).
STATE_SEPARATOR = "\x00"


def state_session(request_id: str) -> str:
    """The server session (lookup locks) of a request's state, beside its KV's (which is
    named by the request id): a name no request's KV session spells (``"x#state"`` was
    request ``x#state``'s KV session too)."""
    return f"{request_id}{STATE_SEPARATOR}state"


@dataclass
class RequestState:
    """What the scheduler role knows about one request."""

    request: Any  # vllm.v1.request.Request (block hashes grow as tokens are added)
    salt: str
    prompt_chunks: int  # full chunks in the prompt: the only ones looked up (and stored,
    # unless store_decode)
    cacheable: bool
    phase: str = NEW
    hits: int = 0  # leading chunks tierkv holds (locked for this request)
    max_hits: int = 0  # the most any lookup of this request found (reported)
    # Where the server found the hit chunks: (source, chunks) runs in chunk order (see
    # tierkv.integrations.vllm.stats), and the split of the external tokens vLLM accepted.
    sources: tuple[tuple[str, int], ...] = ()
    external_sources: dict[str, int] = field(default_factory=dict)
    session: bool = False  # the server holds a lookup session under the request id
    prefetch_deadline: float = 0.0
    local_tokens: int = 0  # vLLM's own prefix-cache hit when the lookup was answered
    loading: bool = False  # a load was planned and no worker has reported it yet
    external_tokens: int = 0  # tokens vLLM agreed to load from tierkv
    loaded_tokens: int = 0  # tokens the workers reported loaded (every rank)
    rank_loaded: dict[int, int] = field(default_factory=dict)  # tokens loaded, by rank
    rank_written: dict[int, int] = field(default_factory=dict)  # chunks written, by rank
    failed_from: int | None = None
    block_ids: list[BlockRef] = field(default_factory=list)
    saved_chunks: int = 0  # chunks known cached in tierkv or already handed out for store
    stored_chunks: int = 0  # chunks handed to the workers for store
    # Asynchronous stores: stores were handed to the workers whose end no step has waited
    # for (set when one is planned, cleared when a preemption makes the workers wait).
    stores_running: bool = False
    # A hybrid model's state: the chunks whose end state the server holds for this request
    # (locked in the state session), a probe whose prefetch runs, and the state session.
    state_chunks: int = 0
    state_probe: int = 0
    state_session: bool = False
    stored_states: set[int] = field(default_factory=set)  # chunk ends with a state stored


class SchedulerSide:
    """The scheduler role of :class:`TierKVConnector`."""

    def __init__(
        self,
        settings: ConnectorSettings,
        *,
        model_id: str,
        engine_id: str,
        block_size: int,
        hash_block_size: int,
        use_block_hashes: bool,
        can_load: bool,
        can_save: bool,
        world_size: int = 1,
        async_store: bool = False,
        shared_ranks: bool = False,
        kv_events: bool = False,
        note_groups: Sequence[NoteGroup] | None = None,
        state_format: StateFormat | None = None,
        tables_change: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``async_store``: the workers store on their store threads (see the module doc;
        the connector decides, :func:`~tierkv.integrations.vllm.settings.stores_async`).
        ``shared_ranks``: every rank holds the same KV (MLA), see the module doc.
        ``kv_events``: vLLM publishes KV events (see the module doc); ``note_groups``: the
        KV cache groups the notes describe (None: no notes, as when the block hashes'
        granularity is not the block size). ``state_format``: a hybrid model's state layers
        (:mod:`tierkv.integrations.vllm.state`): a prefix is served only up to a chunk whose
        end state the server holds, and the states vLLM hands over are stored.
        ``tables_change``: vLLM frees blocks of running requests (several KV cache groups:
        a sliding window's behind it), so each step reads the scheduled requests' tables
        as they are (vLLM builds them on request: with one group they only ever grow)."""
        self.settings = settings
        self.tables_change = tables_change
        self.world_size = world_size  # ranks (workers) of this engine
        self.shared_ranks = shared_ranks
        self.model_id = model_id
        self.engine_id = engine_id
        self.block_size = block_size
        self.hash_block_size = hash_block_size
        self.use_block_hashes = use_block_hashes
        self.can_load = can_load
        self.can_save = can_save
        self.chunk_size = settings.chunk_size
        self.store_decode = settings.store_decode
        self.async_store = async_store
        # An inactive connector (a model it cannot serve) plans no chunk: its block size
        # need not divide the chunk size (a Mamba-2 hybrid's is 4096 tokens here).
        self.bpc = blocks_per_chunk(self.chunk_size, block_size) if can_load or can_save else 0
        self.state_format = state_format
        self._state_groups = state_format.state_groups if state_format else frozenset()
        self._clock = clock
        self.requests: dict[str, RequestState] = {}
        self._loads: dict[str, LoadSpec] = {}  # planned by allocations, for the next step
        # Hits vLLM accepted since the last interval_stats: tokens by source, requests.
        self._hit_tokens: dict[str, int] = {}
        self._hit_requests = 0
        # Last stores of finished requests (and their release), for the next step.
        self._final = TierKVConnectorMetadata()
        self.link = ServerLink(settings, self._register, "scheduler", log)
        self.note_groups = tuple(note_groups) if kv_events and can_save and note_groups else ()
        self._notes_too_large = False
        # Ranks whose parts make a chunk: one namespace for all of them with MLA.
        ranks = 1 if shared_ranks else world_size
        self.events = (
            PoolEvents(self.link, ranks, reannounce_interval=settings.kv_events_reannounce_interval)
            if kv_events and can_load
            else None
        )

    @property
    def keyed_loads(self) -> bool:
        """Loads carry their chunks' keys: ranks other than 0 read a shared cache by key."""
        return self.shared_ranks and self.world_size > 1

    def _register(self, client: Client) -> None:
        reg = client.register_scheduler(
            self.model_id,
            self.engine_id,
            name=f"vllm-scheduler-{self.engine_id[:8]}",
            tenant_salt=self.settings.tenant,
        )
        if reg.chunk_size != self.chunk_size:
            raise RuntimeError(
                f"the server's chunk size is {reg.chunk_size}, the connector's chunk_size is "
                f"{self.chunk_size}: set kv_connector_extra_config.chunk_size to "
                f"{reg.chunk_size}"
            )

    # -- keys ------------------------------------------------------------------------------
    def _state(self, request: Any) -> RequestState:
        state = self.requests.get(request.request_id)
        if state is None:
            prompt = request.prompt_token_ids
            cacheable = (
                prompt is not None
                and getattr(request, "prompt_embeds", None) is None
                and (self.use_block_hashes or not _needs_block_hashes(request))
            )
            state = RequestState(
                request=request,
                salt=request.cache_salt or "",
                prompt_chunks=full_chunks(request.num_prompt_tokens, self.chunk_size),
                cacheable=cacheable,
            )
            self.requests[request.request_id] = state
        return state

    def _selector(self, state: RequestState, num_chunks: int) -> dict[str, Any] | None:
        """Keys of chunks ``[0, num_chunks)``: ``hashes=`` or ``tokens=`` for the client."""
        request = state.request
        if self.use_block_hashes:
            hashes = chunk_hashes(
                request.block_hashes, num_chunks, self.chunk_size, self.hash_block_size
            )
            return None if hashes is None else {"hashes": hashes}
        end = num_chunks * self.chunk_size
        if num_chunks <= state.prompt_chunks:
            ids = request.prompt_token_ids[:end]
        else:
            ids = request.all_token_ids[:end]  # prompt then output tokens
        return {"tokens": keys.pack_tokens(ids)}

    # -- lookup ----------------------------------------------------------------------------
    def _names_a_state_session(self, request_id: str) -> bool:
        """A request id that could spell another request's state session (it holds
        :data:`STATE_SEPARATOR`), on a model with states: never looked up (a miss), so its
        KV session can never be another request's state session."""
        return self.state_format is not None and STATE_SEPARATOR in request_id

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        state = self._state(request)  # stores need it even when nothing is looked up
        if (
            not self.can_load
            or getattr(request, "skip_reading_prefix_cache", False)
            or not state.cacheable
            or state.prompt_chunks == 0
            or self._names_a_state_session(request.request_id)
        ):
            state.hits = 0
            state.phase = LOOKED_UP
            return 0, False
        if state.phase == ALLOCATED:
            # Asked again after an allocation: the request was preempted, or its load failed
            # completely. Look up afresh (the server's new lookup replaces the old session).
            state.phase = NEW
        if state.failed_from is not None and state.failed_from < self.chunk_size:
            state.hits = 0  # its load failed from the start: recompute, do not ask again
            state.phase = LOOKED_UP
            return 0, False
        if state.phase == NEW:
            state.state_chunks = state.state_probe = 0
            hits = self._lookup(state)
            if hits is None:
                return None, False
        elif state.phase == PREFETCHING:
            hits = self._poll_prefetch(state)
            if hits is None:
                return None, False
        else:
            hits = state.hits
        if state.failed_from is not None:
            # A load of this request failed before: recompute rather than try again.
            hits = min(hits, state.failed_from // self.chunk_size)
        if self.state_format is not None and hits > 0:
            state.hits = hits
            with_state = self._state_hit(state, hits, num_computed_tokens)
            if with_state is None:
                state.phase = STATE_PREFETCHING
                return None, False
            hits = with_state
        state.hits = hits
        state.max_hits = max(state.max_hits, hits)
        state.phase = LOOKED_UP
        state.local_tokens = num_computed_tokens
        external = hits * self.chunk_size - num_computed_tokens
        if external <= 0:
            return 0, False
        return external, True

    def _lookup(self, state: RequestState) -> int | None:
        """Hit chunks now, or None while a prefetch runs."""
        rid = state.request.request_id
        selector = self._selector(state, state.prompt_chunks)
        if selector is None:
            state.cacheable = False
            return 0
        result = self.link.call(
            "lookup",
            lambda c: c.lookup(**selector, request_id=rid, salt=state.salt),
            None,
        )
        if result is None:
            return 0
        state.session = True
        state.sources = ((POOL, int(result.hits)),)  # until a prefetch says otherwise
        if result.prefetching:
            state.phase = PREFETCHING
            state.hits = result.hits
            state.prefetch_deadline = self._clock() + 4 * self.settings.timeout
            return None
        return int(result.hits)

    def _state_hit(self, state: RequestState, hits: int, computed: int) -> int | None:
        """The longest prefix of at most ``hits`` chunks whose end state the server holds
        (locked in the request's state session), beyond vLLM's own ``computed`` tokens; 0 if
        none; None while a probe's prefetch runs (vLLM asks again next step). A prefix ends
        before the prompt's last token (vLLM computes that one), and at most
        :data:`MAX_PROBES` chunk ends are asked for."""
        fmt = self.state_format
        assert fmt is not None
        top = min(hits, (int(state.request.num_prompt_tokens) - 1) // self.chunk_size)
        low = computed // self.chunk_size
        if 0 < state.state_chunks <= top:
            return state.state_chunks  # found by an earlier call (vLLM asks again)
        sid = state_session(state.request.request_id)
        chunks = top
        if state.state_probe:
            chunks = state.state_probe
            status = self.link.call("query_prefetch", lambda c: c.query_prefetch(sid), None)
            if status is not None and not status.done and self._clock() < state.prefetch_deadline:
                return None
            state.state_probe = 0
            if status is not None and status.hits == fmt.pieces:
                state.state_chunks = chunks
                return chunks
            chunks -= 1
        probes = 0
        while chunks > low and probes < MAX_PROBES:
            result = self._lookup_state(
                sid, fmt.piece_hashes(self._prefix_id(state, chunks), state.salt)
            )
            if result is None:
                break
            state.state_session = True
            if result.prefetching:
                state.state_probe = chunks
                state.prefetch_deadline = self._clock() + 4 * self.settings.timeout
                return None
            if result.hits == fmt.pieces:
                state.state_chunks = chunks
                return chunks
            chunks -= 1
            probes += 1
        self._end_state_session(state)
        return 0

    def _lookup_state(self, sid: str, pieces: list[bytes]) -> p.LookupResult | None:
        return self.link.call("lookup", lambda c: c.lookup(hashes=pieces, request_id=sid), None)

    def _prefix_id(self, state: RequestState, chunks: int) -> bytes:
        """The identity of the request's first ``chunks`` chunks (see :func:`prefix_id`)."""
        request = state.request
        if self.use_block_hashes:
            hashes = chunk_hashes(
                request.block_hashes, chunks, self.chunk_size, self.hash_block_size
            )
            if hashes is not None:
                return hashes[-1]
        return prefix_id(request.all_token_ids[: chunks * self.chunk_size], self.chunk_size)

    def _poll_prefetch(self, state: RequestState) -> int | None:
        rid = state.request.request_id
        status = self.link.call("query_prefetch", lambda c: c.query_prefetch(rid), None)
        if status is None:
            return 0
        if status.done:
            state.sources = tuple((run.source, run.chunks) for run in status.sources)
            return int(status.hits)
        if self._clock() > state.prefetch_deadline:
            return int(status.hits)  # stop waiting: take what the pool holds now
        return None

    def update_state_after_alloc(
        self, request: Any, block_ids: list[BlockRef], num_external_tokens: int
    ) -> None:
        state = self.requests.get(request.request_id)
        if state is None or state.phase == ALLOCATED:
            return  # a second call once an asynchronous load is done: nothing new
        state.block_ids = list(block_ids)
        if self.store_decode:
            # After a preemption: what was stored before is still valid, not stored again.
            state.saved_chunks = max(state.hits, state.saved_chunks)
        else:
            state.saved_chunks = state.hits
        if num_external_tokens > 0 and state.hits > 0:
            start = state.local_tokens
            end = start + num_external_tokens
            start_block, end_block = start // self.block_size, -(-end // self.block_size)
            keys = self._selector(state, state.hits) if self.keyed_loads else None
            self._loads[request.request_id] = LoadSpec(
                request.request_id,
                start_block,
                end_block,
                tuple(block_ids[start_block:end_block]),
                hashes=tuple(keys["hashes"]) if keys and "hashes" in keys else None,
                tokens=keys["tokens"] if keys and "tokens" in keys else None,
                salt=state.salt,
                state=self._state_load(state, block_ids, end),
            )
            state.external_tokens = num_external_tokens
            state.external_sources = tokens_by_source(state.sources, self.chunk_size, start, end)
            self._count_hit(state.external_sources)
            state.loading = True
        else:
            if state.session:
                self._free_locks(state)
            self._end_state_session(state)
        state.phase = ALLOCATED

    def _state_load(
        self, state: RequestState, block_ids: list[BlockRef], end: int
    ) -> StateLoad | None:
        """The state a load ending at token ``end`` restores (a hybrid model): the state
        groups' blocks at the last position of the prefix; none (the load fails whole)
        if vLLM took another length than the prefix whose state is held."""
        fmt = self.state_format
        if fmt is None:
            return None
        sid = state_session(state.request.request_id)
        position = end // self.block_size - 1
        ref = block_ids[position] if 0 <= position < len(block_ids) else None
        if end != state.state_chunks * self.chunk_size or not isinstance(ref, tuple):
            return StateLoad(sid, ())
        return StateLoad(sid, tuple(ref[g] for g in fmt.groups))

    # -- per-step metadata -----------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> TierKVConnectorMetadata:
        meta, self._final = self._final, TierKVConnectorMetadata()
        meta.registrations = self.link.generation
        meta.loads.extend(self._loads.values())
        self._loads.clear()
        self._note_preemptions(scheduler_output, meta)
        scheduled = scheduler_output.num_scheduled_tokens
        # vLLM's block tables as they are now (vLLM >= 0.32): a sliding-window group's
        # blocks behind the window, freed this step, are null there.
        tables = (
            getattr(scheduler_output, "kv_connector_block_state", None)
            if self.tables_change
            else None
        )
        for new in scheduler_output.scheduled_new_reqs:
            state = self.requests.get(new.req_id)
            if state is None:
                continue
            now = tables.get_block_ids(new.req_id) if tables is not None else None
            state.block_ids = self._positions(state, now if now is not None else new.block_ids)
            computed = new.num_computed_tokens + scheduled.get(new.req_id, 0)
            self._plan_step(state, computed, meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self.requests.get(rid)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            now = tables.get_block_ids(rid) if tables is not None else None
            if rid in cached.resumed_req_ids:
                state.block_ids = self._positions(state, now if now is not None else new_blocks)
            elif now is not None:
                self._blocks_now(state, self._positions(state, now), meta)
            elif new_blocks:
                state.block_ids.extend(self._positions(state, new_blocks))
            computed = cached.num_computed_tokens[i] + scheduled.get(rid, 0)
            self._plan_step(state, computed, meta)
        if self.state_format is not None and self.can_save:
            self._plan_state_stores(scheduler_output, meta)
        return meta

    def _plan_state_stores(self, scheduler_output: Any, meta: TierKVConnectorMetadata) -> None:
        """Store the states vLLM hands over in this step (a hybrid model in its "align"
        mode): each boundary that ends a chunk and has a block of every state group."""
        fmt = self.state_format
        assert fmt is not None
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offers = getattr(block_state, "boundary_state_offloads", None) or {}
        for rid, entries in offers.items():
            state = self.requests.get(rid)
            if state is None or not state.cacheable:
                continue
            by_boundary: dict[int, dict[int, int]] = {}
            for group, block_id, tokens in entries:
                by_boundary.setdefault(int(tokens), {})[int(group)] = int(block_id)
            for tokens, blocks in sorted(by_boundary.items()):
                chunks, rest = divmod(tokens, self.chunk_size)
                if rest or not chunks or not fmt.state_groups <= blocks.keys():
                    continue
                if chunks in state.stored_states or tokens > len(state.request.all_token_ids):
                    continue
                hashes = fmt.piece_hashes(self._prefix_id(state, chunks), state.salt)
                meta.state_stores.append(
                    StateStore(rid, tuple(hashes), tuple(blocks[g] for g in fmt.groups))
                )
                state.stored_states.add(chunks)

    def _note_preemptions(self, scheduler_output: Any, meta: TierKVConnectorMetadata) -> None:
        """vLLM freed the blocks of the requests it preempted since the last step: with
        asynchronous stores the workers wait for theirs before this step's forward pass."""
        if not self.async_store:
            return
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            state = self.requests.get(rid)
            if state is not None and state.stores_running:
                meta.preempted.append(rid)
                state.stores_running = False  # none is left running after that wait

    def _blocks_now(
        self,
        state: RequestState,
        positions: list[BlockRef],
        meta: TierKVConnectorMetadata,
        finished: bool = False,
    ) -> None:
        """The request's block table as vLLM has it now. A block vLLM freed since (a
        sliding-window group's, behind the window; null now) may be another request's in
        the next forward pass: with asynchronous stores, a store of it planned earlier may
        still run, so the workers wait for the request's stores before that pass. (For a
        finished request the blocks it still has are kept as well: ``release``.)"""
        if state.stores_running and _freed(state.block_ids, positions):
            rid = state.request.request_id
            if rid not in meta.preempted:
                meta.preempted.append(rid)
            if not finished:
                state.stores_running = False  # none is left running after that wait
        state.block_ids = positions

    def _plan_step(self, state: RequestState, computed: int, meta: TierKVConnectorMetadata) -> None:
        """A scheduled request, ``computed`` tokens with KV once this step has run: its
        stores, and whether its prompt is still being computed (then the workers may leave
        this step's commits unconfirmed: the request cannot finish in it)."""
        if computed < state.request.num_prompt_tokens:
            meta.prefilling.add(state.request.request_id)
        self._plan_store(state, computed, meta)

    def _plan_store(
        self, state: RequestState, computed: int, meta: TierKVConnectorMetadata
    ) -> bool:
        """Store the chunks that are complete once this step has run (``computed`` tokens have
        KV): prompt chunks, and with ``store_decode`` output chunks too. True if planned."""
        if not self.can_save or not state.cacheable:
            return False
        done = self._storable_chunks(state, computed)
        first = state.saved_chunks
        if done <= first or len(state.block_ids) < done * self.bpc:
            return False
        # Not from a chunk with a null block on (a sliding-window group's KV behind the
        # window is gone): later chunks could never be found behind it either.
        blocks = state.block_ids[first * self.bpc : done * self.bpc]
        done = first + _intact_chunks(blocks, self.bpc, self._state_groups)
        if done <= first:
            return False
        selector = self._selector(state, done)
        if selector is None:
            return False
        meta.stores.append(
            StoreSpec(
                state.request.request_id,
                first,
                done,
                tuple(state.block_ids[first * self.bpc : done * self.bpc]),
                hashes=tuple(selector["hashes"]) if "hashes" in selector else None,
                tokens=selector.get("tokens"),
                salt=state.salt,
                notes=self._notes(state, first, done) if self.note_groups else None,
            )
        )
        state.stored_chunks += done - first
        state.saved_chunks = done
        state.stores_running = self.async_store
        return True

    def _notes(self, state: RequestState, first: int, end: int) -> tuple[bytes, ...] | None:
        """The notes of chunks ``[first, end)`` (KV events on); None where vLLM's block
        hashes do not cover them (prefix caching off) or a note would be too large."""
        bpc = self.bpc
        try:
            notes = tuple(
                chunk_note(state.request, c * bpc, bpc, self.block_size, self.note_groups)
                for c in range(first, end)
            )
        except ValueError:
            return None
        if max(map(len, notes)) > p.MAX_NOTE_BYTES:
            if not self._notes_too_large:
                self._notes_too_large = True
                log.warning(
                    "tierkv: a chunk's KV event note is over %d bytes (chunks of %d tokens): "
                    "such chunks are stored without one, and never announced",
                    p.MAX_NOTE_BYTES,
                    self.chunk_size,
                )
            return None
        return notes

    def _count_hit(self, sources: dict[str, int]) -> None:
        for where, tokens in sources.items():
            self._hit_tokens[where] = self._hit_tokens.get(where, 0) + tokens
        self._hit_requests += 1

    def external_sources(self, request_id: str) -> dict[str, int]:
        """The external tokens vLLM accepted for ``request_id``, by where the server found
        them (empty when it took none)."""
        state = self.requests.get(request_id)
        return dict(state.external_sources) if state is not None else {}

    def interval_stats(self) -> TierKVStats | None:
        """The hits vLLM accepted since the last call (None if none), for its stats."""
        if not self._hit_requests:
            return None
        stats = TierKVStats.for_hits(self._hit_tokens, self._hit_requests)
        self._hit_tokens, self._hit_requests = {}, 0
        return stats

    def take_events(self) -> list[Any]:
        """vLLM's KV events for what the pool began or stopped offering since the last call
        (never waits on the server: a thread reads the feed)."""
        return self.events.take() if self.events is not None else []

    def _storable_chunks(self, state: RequestState, computed: int) -> int:
        """Leading chunks whose tokens all have KV (``computed``) and known keys."""
        if not self.store_decode:
            return min(state.prompt_chunks, full_chunks(computed, self.chunk_size))
        request = state.request
        # Ids are known up to num_tokens: with async scheduling, not those of the step in
        # flight; spec-decode drafts are never among them.
        tokens = min(computed, request.num_tokens)
        if self.use_block_hashes:
            tokens = min(tokens, len(request.block_hashes) * self.hash_block_size)
        return full_chunks(tokens, self.chunk_size)

    def update_connector_output(self, worker_meta: Any) -> None:
        if not isinstance(worker_meta, TierKVWorkerMetadata):
            return
        for rank, report in worker_meta.ranks.items():
            for rid, tokens in report.loaded_tokens.items():
                state = self.requests.get(rid)
                if state is not None:
                    state.rank_loaded[rank] = tokens
            for rid, chunks in report.written_chunks.items():
                state = self.requests.get(rid)
                if state is not None:
                    state.rank_written[rank] = state.rank_written.get(rank, 0) + chunks
        for rid, tokens in worker_meta.loaded_tokens.items():
            state = self.requests.get(rid)
            if state is not None:
                state.loaded_tokens = tokens
                state.loading = False
        for rid, token in worker_meta.failed_from.items():
            state = self.requests.get(rid)
            if state is None:
                continue
            state.failed_from = token
            state.loading = False
            # What failed is recomputed by vLLM: store it again once it is.
            state.saved_chunks = min(state.saved_chunks, token // self.chunk_size)

    # -- end of a request ------------------------------------------------------------------
    def request_finished(
        self, request: Any, block_ids: list[BlockRef] | None = None
    ) -> dict[str, Any]:
        """End the request; its figures for ``kv_transfer_params``. ``block_ids``: its blocks
        as vLLM hands them over (for a last decode chunk, see :meth:`keeps_blocks`)."""
        state = self.requests.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        if state is None:
            return {}
        if block_ids is not None:  # vLLM freed the blocks behind a sliding window just now
            self._blocks_now(state, list(block_ids), self._final, finished=True)
        self._plan_last_store(state)
        self._keep_for_running_stores(state)
        self._end_session(state)
        return {
            "tierkv": {
                "hit_tokens": state.max_hits * self.chunk_size,
                "external_tokens": state.external_tokens,
                "hit_sources": dict(state.external_sources),
                "loaded_tokens": state.loaded_tokens,
                "load_failed_from": state.failed_from,
                "stored_chunks": state.stored_chunks,
                "ranks": [
                    {
                        "rank": rank,
                        "loaded_tokens": state.rank_loaded.get(rank, 0),
                        "written_chunks": state.rank_written.get(rank, 0),
                    }
                    for rank in range(self.world_size)
                ],
            }
        }

    def keeps_blocks(self, request_id: str) -> bool:
        """Whether a finished request's blocks must outlive ``request_finished``: a store of
        them is planned for the next step, or stores of them may still run on the workers'
        store threads; the workers report the request finished (sending) once its stores
        have ended, and vLLM frees the blocks then."""
        return request_id in self._final.release

    def _keep_for_running_stores(self, state: RequestState) -> None:
        """With asynchronous stores, keep the blocks of a finished request whose stores may
        still run (released by the workers once those ended). Never for one still loading:
        vLLM already keeps those until the load is reported, then frees them, and a second
        report (finished sending) would name a request it no longer knows. (A loading request
        has no store running: it was planned no store since its last preemption.)"""
        rid = state.request.request_id
        if state.stores_running and not state.loading and rid not in self._final.release:
            self._final.release.append(rid)

    def _plan_last_store(self, state: RequestState) -> None:
        """Plan the complete chunks of a finished request that no step planned yet."""
        if not self.store_decode or state.loading or state.phase != ALLOCATED:
            return  # a request still loading is vLLM's to keep until the load is reported
        request = state.request
        # KV computed in steps already run (not a step still in flight with async scheduling).
        computed = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
        if self._plan_store(state, computed, self._final):
            self._final.release.append(request.request_id)

    @staticmethod
    def _positions(state: RequestState, groups: Any) -> list[BlockRef]:
        """vLLM's per-group block ids as one entry per position (:func:`block_positions`);
        groups that do not line up make the request uncacheable."""
        if not groups:
            return []
        positions = block_positions(groups)
        if positions is None:
            state.cacheable = False
            return []
        return positions

    def _free_locks(self, state: RequestState) -> None:
        rid = state.request.request_id
        self.link.call("free_lookup_locks", lambda c: c.free_lookup_locks(rid), 0)

    def _end_session(self, state: RequestState) -> None:
        self._end_state_session(state)
        if not state.session:
            return
        state.session = False
        rid = state.request.request_id
        self.link.call("end_session", lambda c: c.end_session(rid), 0)

    def _end_state_session(self, state: RequestState) -> None:
        if not state.state_session:
            return
        state.state_session = False
        sid = state_session(state.request.request_id)
        self.link.call("end_session", lambda c: c.end_session(sid), 0)

    def shutdown(self) -> None:
        for state in list(self.requests.values()):
            self._end_session(state)
        self.requests.clear()
        self._loads.clear()
        if self.events is not None:
            self.events.close()
        self.link.close()


def tokens_by_source(
    runs: Sequence[tuple[str, int]], chunk_size: int, start: int, end: int
) -> dict[str, int]:
    """Split tokens ``[start, end)`` by the source of the chunk each lies in (``runs``:
    (source, chunks) in chunk order); tokens beyond the runs count under the pool."""
    out: dict[str, int] = {}
    lo = 0
    for where, chunks in runs:
        hi = lo + chunks * chunk_size
        n = min(hi, end) - max(lo, start)
        if n > 0:
            out[where] = out.get(where, 0) + n
        lo = hi
    if end > max(lo, start):
        out[POOL] = out.get(POOL, 0) + end - max(lo, start)
    return out


def _freed(before: list[BlockRef], now: list[BlockRef]) -> bool:
    """Whether a block of ``before`` is no longer at its position (vLLM freed it)."""
    return any(a != b for a, b in zip(before, now, strict=False))


def _intact_chunks(
    block_ids: list[BlockRef], bpc: int, state_groups: frozenset[int] = frozenset()
) -> int:
    """Leading whole chunks of ``block_ids`` without a null block (in a group other than a
    hybrid model's state groups)."""
    for i, ref in enumerate(block_ids):
        if has_null(ref, state_groups):
            return i // bpc
    return len(block_ids) // bpc


def _needs_block_hashes(request: Any) -> bool:
    """Whether token ids alone would not identify this request's KV (multimodal inputs,
    LoRA adapters): such requests are only cached with vLLM's block hashes as keys."""
    return bool(getattr(request, "mm_features", None)) or request.lora_request is not None
