"""The connector's worker role: move KV between vLLM's paged cache and the tierkv pool.

One :class:`WorkerSide` per rank. ``register_kv_caches`` detects the cache layout and
registers this rank with the server (model, chunk layout, dtype, rank and world size, and the
engine id its scheduler looks up with).

An MLA cache (:attr:`PagedKVLayout.latent`) holds the same bytes on every tensor-parallel
rank, so all ranks share one namespace (registered as rank 0 of 1, as the SGLang backend
does for MLA; the tensor-parallel size stays in the model identity, since engines of other
sizes compute other bytes: measured on vLLM's CPU MLA, where they even answer differently
without tierkv): rank 0 alone stores, and alone joins the engine's group (the scheduler's
lookup locks the chunks for it and it retrieves them by request id); the other ranks read
the same chunks by key (``LoadSpec.hashes``/``tokens``). A chunk evicted between the lookup
and such a read is a failed load on that rank: vLLM recomputes its blocks, on every rank.

Then, every step:

- loads (``start_load_kv``): retrieve by request id the chunks the scheduler's lookup locked
  for this rank, and copy each straight from its pool slot into the request's blocks (one
  copy). Blocks vLLM computed itself are never written. Any block whose chunk did not
  arrive whole (missing, server gone, lock expired) is reported through
  ``get_block_ids_with_load_errors`` in the same step that reports the load finished, so
  vLLM recomputes it before anything attends to it. With several KV cache groups (vLLM's
  hybrid allocator) a block id names no block by itself (each group has its own), and vLLM
  raises on block-level failures: there a failed load fails the whole request's load
  (``get_failed_loads``, vLLM's ``failed_recving``), which vLLM recomputes from the start.
- stores: before the forward pass (``bind_connector_metadata``, or after the step's loads),
  the rank's prepare thread reserves slots for the chunks the scheduler planned, so the
  round trip runs while the forward pass computes them; after it (``wait_for_save``), copy
  each chunk straight from the blocks into its slot, commit. In a step after which the
  request's prompt is still being computed (a long prefill, in steps), the commit's answer
  is not waited for: the request cannot finish in that step, and the step in which it can
  waits for every commit of it still unanswered (``_settle``), so a finished request's
  chunks are in the pool (and a cluster's directory) before vLLM hands it on. Chunks the
  pool already holds are skipped by the server. A failed store is a future miss, nothing
  else; a reservation whose store does not run (its request's load failed in this step) is
  given back.
  With ``async_store`` the step's stores go to the rank's store thread
  (:class:`~tierkv.integrations.vllm.stores.StoreQueue`, first in, first out) and
  ``wait_for_save`` returns at once; the copy still reads the blocks directly, so they must
  not change until it ran:

  * a running request's stored blocks never change: KV is append-only (a token's KV is
    written once, by the forward pass that computes it) and only full chunks, whose every
    token has KV and a final id, are stored; later forward passes write later blocks only.
  * a finished request's blocks are kept by vLLM while its stores may run (the scheduler
    answers ``request_finished`` with True and names it in ``meta.release``); this rank
    reports it finished sending in ``get_finished`` once every store it submitted for it has
    ended, stored or failed: vLLM frees the blocks when every rank has.
  * a preempted request's blocks are free again from the next step on: the scheduler names
    it in that step's ``meta.preempted`` and ``handle_preemptions``, before the forward
    pass, waits for its stores.

  Synchronously (a ``kv_producer``, or ``async_store`` off), the stores run in
  ``wait_for_save`` itself; ``meta.release`` then names requests whose last store just ran.

With vLLM's KV events on, a store carries its chunks' notes (``StoreSpec.notes``, the same on
every rank), and every rank that stores gives them to the server with its part: the server's
chunk feed announces only noted chunks, and with tensor parallelism the scheduler announces a
chunk's blocks once every rank's part is held (see :mod:`tierkv.integrations.vllm.kv_events`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from tierkv import keys
from tierkv.arraycopy import COPIES
from tierkv.client import Client, PreparedStore
from tierkv.integrations.link import ServerLink
from tierkv.integrations.vllm.chunks import (
    LoadSpec,
    StateLoad,
    StateStore,
    StoreSpec,
    blocks_per_chunk,
)
from tierkv.integrations.vllm.layout import (
    CacheGeometry,
    PagedKVLayout,
    UnsupportedLayoutError,
    detect_layout,
)
from tierkv.integrations.vllm.metadata import (
    RankReport,
    TierKVConnectorMetadata,
    TierKVWorkerMetadata,
)
from tierkv.integrations.vllm.pinning import page_lock
from tierkv.integrations.vllm.settings import ConnectorSettings
from tierkv.integrations.vllm.state import StateLayout
from tierkv.integrations.vllm.stats import RANK_FIELDS, TierKVStats
from tierkv.integrations.vllm.stores import StoreQueue
from tierkv.pool import ShmPool

log = logging.getLogger("vllm.tierkv")

# At shutdown, the longest wait for the stores still queued (then they are dropped).
SHUTDOWN_WAIT = 10.0


class WorkerSide:
    """The worker role of :class:`TierKVConnector` for one rank."""

    def __init__(
        self,
        settings: ConnectorSettings,
        *,
        model_id: str,
        engine_id: str,
        world_size: int,
        rank: int,
        can_load: bool,
        can_save: bool,
        async_store: bool = False,
        kv_variant: str = "",
        share_latent: bool = True,
    ) -> None:
        """``async_store``: store on a store thread (the connector decides,
        :func:`~tierkv.integrations.vllm.settings.stores_async`); ``kv_variant``: what else
        makes this engine's KV differ from another's of the same model (config overrides),
        appended to the chunk format in the namespace; ``share_latent``: the ranks of an MLA
        cache hold the same bytes (tensor parallelism only; not pipeline stages)."""
        self.settings = settings
        self.share_latent = share_latent
        self.model_id = model_id
        self.kv_variant = kv_variant
        self.engine_id = engine_id
        self.world_size = world_size
        self.rank = rank
        self.can_load = can_load
        self.can_save = can_save
        self.chunk_size = settings.chunk_size
        self.layout: PagedKVLayout | None = None
        self.state_layout: StateLayout | None = None  # a hybrid model's state layers
        self.bpc = 0
        self.link = ServerLink(
            settings,
            self._register,
            f"worker rank {rank}",
            log,
            parallel_callbacks=True,
            on_pool=self._pool_mapped,
            default_copy_threads=self._default_copy_threads,
        )
        self._finished_recving: set[str] = set()
        # Finished requests the scheduler kept (meta.release), until their stores ended.
        self._releasing: set[str] = set()
        self._stores = StoreQueue(f"tierkv-store-rank{rank}") if async_store else None
        # This step's store reservations, made on the prepare thread during the forward pass:
        # one future per spec of _prepared_for.stores (None once its store took it).
        self._prepare_thread = ThreadPoolExecutor(1, thread_name_prefix=f"tierkv-prepare-{rank}")
        self._prepared_for: TierKVConnectorMetadata | None = None
        self._prepared: list[Future[PreparedStore | None] | None] = []
        self._prepared_states: list[Future[PreparedStore | None] | None] = []
        # Guards what the store thread shares with vLLM's thread: _report and the store stats.
        self._lock = threading.Lock()
        self._load_errors: set[int] = set()
        # Several KV cache groups: failed loads are reported by request, not by block.
        self._failed_loads: set[str] | None = None
        self._report = RankReport()  # this step's, for the scheduler
        self._failed_this_step: set[str] = set()
        self._scheduler_registrations = 0  # meta.registrations, as last seen
        # Commits sent without waiting for the answer (synchronous stores of a step in which
        # the request's prompt is still being computed), until settled, by rid: (request id,
        # chunks reported written for it).
        self._commits: dict[int, tuple[str, int]] = {}
        self._reported: dict[str, float] = {}  # the totals at the last interval_stats
        # Totals for this process (tests, logs and benchmarks read them): chunks, and the
        # time the engine spent in stores (waiting for the reservation, the copies out of its
        # blocks, the commit) and in loads (the RPCs and the copies into its blocks), with the
        # bytes they moved; and the time the reservations took on the prepare thread, beside
        # the forward pass.
        self.stats: dict[str, float] = {
            "loaded_chunks": 0,
            "loaded_tokens": 0,
            "failed_blocks": 0,
            # A hybrid model's states (see tierkv.integrations.vllm.state): how many, and the
            # time and bytes of those written into the pool and loaded from it.
            "stored_states": 0,
            "loaded_states": 0,
            "state_store_seconds": 0.0,
            "state_store_bytes": 0,
            "state_load_seconds": 0.0,
            "state_load_bytes": 0,
            "stored_chunks": 0,
            "store_seconds": 0.0,
            "store_prepare_seconds": 0.0,
            "store_bytes": 0,
            "load_seconds": 0.0,
            "load_bytes": 0,
        }

    # -- registration ----------------------------------------------------------------------
    def _default_copy_threads(self) -> int | None:
        """One copy thread, vLLM's own, for a KV cache in host memory: a CPU engine's
        OpenMP threads hold the other cores (they spin for milliseconds after each forward
        pass, when stores and loads run), and a helper thread that takes a chunk and then
        waits for a core holds the whole batch up (measured: vLLM's thread idle for 5 ms of a
        10 ms store while the helper waited 7 ms). The client's default (the cores, at most
        4) for a cache on an accelerator, whose copies leave the host's cores free."""
        if self.layout is not None and self.layout.views[0].device.type == "cpu":
            return 1
        return None

    def _pool_mapped(self, pool: ShmPool) -> Callable[[], None] | None:
        """The client mapped the pool: page-lock it when the cache is on a GPU and the
        settings allow (:mod:`tierkv.integrations.vllm.pinning`)."""
        if self.layout is None or not self.settings.page_lock_pool:
            return None
        return page_lock(pool.buf, self.layout.views[0].device)

    def register_kv_caches(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        geometry: CacheGeometry,
        backends: Mapping[str, str],
        content: str = "auto",
        groups: Mapping[str, int] | None = None,
        state: StateLayout | None = None,
    ) -> PagedKVLayout:
        """Detect the layout (raises :class:`UnsupportedLayoutError` for one it cannot map)
        and register with the server (a server that is down now is retried later).
        ``groups``: each layer's KV cache group, for a model with several. ``state``: a
        hybrid model's state layers (``kv_caches`` then holds its attention layers only);
        their states are stored as pieces of this layout's chunk size."""
        # Several KV cache groups (``groups`` is given only then; a hybrid model's attention
        # layers may all be in one of them): vLLM takes failed loads by request, not block.
        self._failed_loads = set() if groups or state is not None else None
        self.layout = detect_layout(kv_caches, geometry, backends, content, groups)
        self.bpc = blocks_per_chunk(self.chunk_size, geometry.block_size)
        if state is not None:
            chunk_bytes = math.prod(self.layout.chunk_shape(self.chunk_size)) * (
                self.layout.views[0].element_size()
            )
            if chunk_bytes != state.format.piece_bytes:
                raise UnsupportedLayoutError(
                    f"tierkv: a chunk is {chunk_bytes} bytes, the state's pieces "
                    f"{state.format.piece_bytes}"
                )
        self.state_layout = state
        log.info(
            "tierkv worker rank %d/%d: %s; chunks of %d tokens (%d blocks) shaped %s; "
            "copies in host memory by %s",
            self.rank,
            self.world_size,
            self.layout.describe(),
            self.chunk_size,
            self.bpc,
            self.layout.chunk_shape(self.chunk_size),
            COPIES,
        )
        self.link.client()  # register now, so the scheduler's lookups see this rank
        return self.layout

    def deactivate(self) -> None:
        """Neither load nor store from now on (the caches could not be mapped): loads
        planned for this rank fail (vLLM recomputes), stores are skipped."""
        self.layout = None
        self.state_layout = None
        self.can_load = self.can_save = False

    @property
    def shared(self) -> bool:
        """The ranks' caches hold the same bytes (MLA, tensor-parallel ranks): one namespace
        for all of them."""
        return self.layout is not None and self.layout.latent and self.share_latent

    @property
    def reads_by_key(self) -> bool:
        """A rank other than 0 of a shared cache: it reads rank 0's chunks by key."""
        return self.shared and self.rank != 0

    @property
    def stores_here(self) -> bool:
        """This rank stores: it may (``kv_role``), and no other rank stores the same bytes."""
        return self.can_save and not self.reads_by_key

    def _register(self, client: Client) -> None:
        layout = self.layout
        assert layout is not None
        model = keys.model_with_format(self.model_id, layout.format_tag + self.kv_variant)
        if self.shared:
            model += f"|tp={self.world_size}"  # see the module doc
        client.register(
            model,
            layout.chunk_shape(self.chunk_size),
            layout.dtype_name,
            token_axis=layout.token_axis,
            world_size=1 if self.shared else self.world_size,
            rank=0 if self.shared else self.rank,
            tenant_salt=self.settings.tenant,
            name=f"vllm-worker-{self.engine_id[:8]}-rank{self.rank}",
            # The engine's group has one member per namespace rank: rank 0 (see above).
            engine_id="" if self.reads_by_key else self.engine_id,
        )

    # -- loads -----------------------------------------------------------------------------
    def start_load_kv(self, meta: TierKVConnectorMetadata) -> None:
        # (An inactive worker never registers: its caches could not be mapped.)
        if (
            self.layout is not None
            and meta.registrations != self._scheduler_registrations
            and self.link.call("registration check", _check_registered, False)
        ):
            # The scheduler registered (again: the server restarted), and this rank is known
            # to the server now (the link registered it again if it was not), so the
            # engine's lookups find chunks again. While the server is down: next step.
            self._scheduler_registrations = meta.registrations
        if not meta.loads:
            return
        if self.layout is None or not self.can_load:
            for spec in meta.loads:  # cannot load: everything must be recomputed
                self._finish_load(spec, set())
            return
        for spec in meta.loads:
            self._load(spec)
        self.prepare_stores(meta)  # after the loads: a failed one's stores are not reserved

    def _load(self, spec: LoadSpec) -> None:
        layout = self.layout
        assert layout is not None
        loaded: set[int] = set()

        def scatter(chunk: int, src: Any) -> None:
            blocks = spec.blocks_of(chunk, self.bpc)
            if not blocks:
                return  # a chunk vLLM already had, or beyond what vLLM asked for
            layout.write_blocks(blocks, src)
            loaded.add(chunk)

        start = time.perf_counter()
        if spec.state is not None and not spec.state.block_ids:
            self._finish_load(spec, set())  # the prefix vLLM took does not end at the state
            return
        if len(spec.block_ids) < spec.end_block - spec.start_block:
            # vLLM's groups' tables did not line up (a hybrid model's state group with
            # speculative decoding's extra blocks): no blocks to write into, recompute.
            self._finish_load(spec, set())
            return
        if self.reads_by_key:
            if spec.hashes is None and spec.tokens is None:
                self._finish_load(spec, set())  # no keys to read by: recompute
                return
            if spec.hashes is not None:
                named: dict[str, Any] = {"hashes": spec.hashes}
            else:
                named = {"tokens": spec.tokens}
            named.update(first_chunk=spec.start_block // self.bpc, salt=spec.salt)
        else:
            named = {"request_id": spec.request_id}
        result = self.link.call(
            f"retrieve of {spec.request_id}",
            # vLLM's thread waits for the load before its forward pass: it copies too, and
            # does not wait for the server's answer to the release of the chunks' locks.
            lambda c: c.retrieve(scatter=scatter, caller_copies=True, wait_release=False, **named),
            None,
        )
        # Only what the retrieve reports retrieved: none if the copy outlasted its locks
        # (late), nor when the retrieve failed (what it scattered is not known to be whole).
        loaded.intersection_update(result.retrieved if result is not None else ())
        with self._lock:
            self._timed("load", start, 0 if result is None else len(result.retrieved))
        if spec.state is not None and not self._load_state(spec.state):
            loaded = set()  # KV without its state is never used: vLLM recomputes it all
        self._finish_load(spec, loaded)

    def _load_state(self, state: StateLoad) -> bool:
        """Write a hybrid model's state (the scheduler's state lookup locked its pieces)
        into its blocks; whether every piece arrived."""
        layout = self.state_layout
        if layout is None or len(state.block_ids) != len(layout.format.layers):
            return False
        start = time.perf_counter()
        written: set[int] = set()

        def scatter(piece: int, src: Any) -> None:
            layout.scatter(piece, state.block_ids, src)
            written.add(piece)

        result = self.link.call(
            f"retrieve of {state.request_id}",
            lambda c: c.retrieve(
                request_id=state.request_id, scatter=scatter, caller_copies=True, wait_release=False
            ),
            None,
        )
        written.intersection_update(result.retrieved if result is not None else ())
        if len(written) != layout.format.pieces:
            return False
        self.stats["loaded_states"] += 1
        self.stats["state_load_seconds"] += time.perf_counter() - start
        self.stats["state_load_bytes"] += len(layout.format.layers) * layout.format.layer_bytes
        return True

    def _finish_load(self, spec: LoadSpec, loaded: set[int]) -> None:
        block_size = self.layout.geometry.block_size if self.layout else 1
        bpc = max(self.bpc, 1)
        first_failed = spec.first_failed_block(loaded, bpc)
        if first_failed is not None and self._failed_loads is not None:
            first_failed = spec.start_block  # vLLM recomputes the whole request's load
            loaded = set()
        end = spec.end_block if first_failed is None else first_failed
        tokens = (end - spec.start_block) * block_size
        self._report.loaded_tokens[spec.request_id] = tokens
        self.stats["loaded_chunks"] += len(loaded)
        self.stats["loaded_tokens"] += tokens
        if first_failed is not None:
            if self._failed_loads is None:
                blocks = spec.failed_blocks(loaded, bpc)
                self._load_errors.update(blocks)
                failed = len(blocks)
            else:  # the whole request (several groups): no block ids needed
                failed = spec.end_block - first_failed
                self._failed_loads.add(spec.request_id)
            self._report.failed_from[spec.request_id] = first_failed * block_size
            self._failed_this_step.add(spec.request_id)
            self.stats["failed_blocks"] += failed
            log.warning(
                "tierkv worker rank %d: request %s: %d of %d block positions not loaded; "
                "vLLM recomputes them",
                self.rank,
                spec.request_id,
                spec.end_block - first_failed,
                spec.end_block - spec.start_block,
            )
        self._finished_recving.add(spec.request_id)

    # -- stores ----------------------------------------------------------------------------
    def prepare_stores(self, meta: TierKVConnectorMetadata) -> None:
        """Before the forward pass: reserve this step's stores on the prepare thread (once
        per step; a no-op without stores). The reservation's round trip then overlaps the
        forward pass that computes the chunks, and ``wait_for_save`` only copies and
        commits."""
        if (
            meta is self._prepared_for
            or not (meta.stores or meta.state_stores)
            or self.layout is None
            or not self.stores_here
        ):
            return
        self._give_back_unused()  # a step whose wait_for_save never came
        self._prepared_for = meta
        self._prepared = [
            None
            if spec.request_id in self._failed_this_step
            else self._prepare_thread.submit(self._prepare, spec)
            for spec in meta.stores
        ]
        self._prepared_states = [
            None
            if state.request_id in self._failed_this_step or self.state_layout is None
            else self._prepare_thread.submit(self._prepare_state, state)
            for state in meta.state_stores
        ]

    def _prepare(self, spec: StoreSpec) -> PreparedStore | None:
        start = time.perf_counter()
        prepared = self.link.call(
            f"store of {spec.request_id}",
            lambda c: c.prepare_store(
                first_chunk=spec.first_chunk, salt=spec.salt, notes=spec.notes, **_keys(spec)
            ),
            None,
        )
        with self._lock:
            self.stats["store_prepare_seconds"] += time.perf_counter() - start
        return prepared

    def _prepare_state(self, state: StateStore) -> PreparedStore | None:
        return self.link.call(
            f"state store of {state.request_id}",
            lambda c: c.prepare_store(hashes=list(state.hashes)),
            None,
        )

    def _take_prepared(
        self, meta: TierKVConnectorMetadata, i: int, states: bool = False
    ) -> Future[PreparedStore | None] | None:
        """The reservation made for ``meta.stores[i]`` (``states``: for
        ``meta.state_stores[i]``; None: none was made)."""
        if meta is not self._prepared_for:
            return None
        prepared = self._prepared_states if states else self._prepared
        future, prepared[i] = prepared[i], None
        return future

    def _give_back_unused(self) -> None:
        """Abort the reservations of the last prepared step that no store took."""
        unused = [f for f in (*self._prepared, *self._prepared_states) if f is not None]
        self._prepared_for, self._prepared, self._prepared_states = None, [], []
        for future in unused:
            self._abort(future)

    def _abort(self, future: Future[PreparedStore | None]) -> None:
        prepared = future.result()
        if prepared is not None:
            self.link.call("abort of a store", lambda c: c.abort_store(prepared), None)

    def wait_for_save(self, meta: TierKVConnectorMetadata) -> None:
        failed, self._failed_this_step = self._failed_this_step, set()
        if meta.stores and self.layout is not None and self.stores_here:
            for i, spec in enumerate(meta.stores):
                future = self._take_prepared(meta, i)
                if spec.request_id in failed:
                    if future is not None:  # reserved before its load failed
                        self._abort(future)
                    continue  # never store what was computed on top of a failed load
                self._submit_store(spec, future, confirm=spec.request_id not in meta.prefilling)
        if meta.state_stores and self.state_layout is not None and self.stores_here:
            for i, state in enumerate(meta.state_stores):
                future = self._take_prepared(meta, i, states=True)
                if state.request_id in failed:
                    if future is not None:
                        self._abort(future)
                    continue
                self._store_state(state, None if future is None else future.result())
        self._settle(meta.prefilling)
        # After this step's stores were submitted: get_finished reports these once none of
        # their stores is pending (at once when synchronous). vLLM puts a finished request
        # into the finished_req_ids of the same step whose metadata releases it, so the id
        # reported always belongs to a set get_finished was given, in this call or before
        # (before: when vLLM defers wait_for_save past get_finished, with a draft model).
        self._releasing.update(meta.release)

    def _store_state(self, state: StateStore, prepared: PreparedStore | None) -> None:
        """Store a state vLLM handed over in this step, now: after this step its block may
        be freed (vLLM keeps only the states it retains). ``prepared``: its slots, reserved
        during the forward pass (None: reserved here)."""
        layout = self.state_layout
        assert layout is not None
        start = time.perf_counter()

        def gather(piece: int, dst: Any) -> None:
            layout.gather(piece, state.block_ids, dst)

        def store(c: Client) -> Any:
            if prepared is not None:
                return c.finish_store(prepared, gather=gather, caller_copies=True)
            return c.store(hashes=list(state.hashes), gather=gather, caller_copies=True)

        result = self.link.call(f"state store of {state.request_id}", store, None)
        if result is not None and len(result.held) == len(state.hashes):
            with self._lock:
                self.stats["stored_states"] += 1
                if result.stored:  # written now (not already held): time and bytes copied
                    self.stats["state_store_seconds"] += time.perf_counter() - start
                    fmt = layout.format
                    self.stats["state_store_bytes"] += len(fmt.layers) * fmt.layer_bytes

    def _submit_store(
        self, spec: StoreSpec, prepared: Future[PreparedStore | None] | None, confirm: bool
    ) -> None:
        if self._stores is None:
            self._store(spec, prepared, confirm)
        else:
            self._stores.submit(spec.request_id, lambda: self._store(spec, prepared))

    def _settle(self, prefilling: set[str]) -> None:
        """At the end of a step's stores: wait for the answers to the commits sent without
        waiting, unless every request they belong to is still computing its prompt after
        this step (``prefilling``). A synchronous store waits for its commit only when its
        request may finish in the step: a finished request's KV may be read elsewhere at
        once (a decode engine on another node, through the cluster's directory, which a
        commit's answer waits for), so every commit of it must be done by then. The other
        commits' answers are read by the client's next call (usually the prepare thread's
        reservation, during the next forward pass) or here, so the engine's thread does not
        wait a round trip after each step of a long prefill. A commit that failed is a
        future miss (logged); the chunks it did not commit (all of a failed one's, or of one
        whose answer was lost) are taken back from what this rank reported written, in this
        step's report, before the request can finish."""
        if not self._unconfirmed or self._unconfirmed <= prefilling:
            return
        start = time.perf_counter()
        settled = self.link.call(
            "settling of stores", lambda c: (c.settle(), c.commit_shortfalls()), None
        )
        commits, self._commits = self._commits, {}
        if settled is None:  # no answers: none of these commits is known to be done
            shortfalls = {rid: chunks for rid, (_, chunks) in commits.items()}
        else:
            failed, shortfalls = settled
            if failed:
                log.warning(
                    "tierkv worker rank %d: %d commit(s) not waited for failed; their chunks "
                    "are future misses",
                    self.rank,
                    failed,
                )
        with self._lock:
            self.stats["store_seconds"] += time.perf_counter() - start
            # The chunks those commits did not commit were reported written: take them back
            # (the scheduler adds each step's counts up) before the request can finish.
            written = self._report.written_chunks
            for rid, missing in shortfalls.items():
                if rid in commits:  # else settled before (a lost link counted it then)
                    request_id = commits[rid][0]
                    self.stats["stored_chunks"] -= missing
                    written[request_id] = written.get(request_id, 0) - missing

    @property
    def _unconfirmed(self) -> set[str]:
        """The requests with commits not settled yet."""
        return {request_id for request_id, _ in self._commits.values()}

    def handle_preemptions(self, meta: TierKVConnectorMetadata) -> None:
        """Before the forward pass: the blocks of the requests vLLM preempted are free again
        and this step may write them; wait for the stores that still read them."""
        if self._stores is not None and meta.preempted:
            self._stores.wait(meta.preempted)

    def wait_for_stores(self, timeout: float | None = None) -> bool:
        """Block until every store submitted so far has ended (False: ``timeout`` ran out)."""
        return True if self._stores is None else self._stores.drain(timeout)

    def _store(
        self,
        spec: StoreSpec,
        reserved: Future[PreparedStore | None] | None,
        confirm: bool = True,
    ) -> None:
        """Copy and commit one store (reserving first if the prepare thread did not).
        ``confirm=False``: do not wait for the commit's answer (see :meth:`_settle`)."""
        layout = self.layout
        assert layout is not None

        def gather(chunk: int, dst: Any) -> None:
            layout.read_blocks(enumerate(spec.blocks_of(chunk, self.bpc)), dst)

        # A synchronous store holds vLLM's thread up anyway: it copies too. The store thread
        # of asynchronous stores leaves the cores to the forward pass.
        caller_copies = self._stores is None
        start = time.perf_counter()
        if reserved is None:
            result = self.link.call(
                f"store of {spec.request_id}",
                lambda c: c.store(
                    gather=gather,
                    first_chunk=spec.first_chunk,
                    salt=spec.salt,
                    caller_copies=caller_copies,
                    notes=spec.notes,
                    **_keys(spec),
                ),
                None,
            )
        else:
            prepared = reserved.result()  # usually there: reserved during the forward pass
            result = (
                None
                if prepared is None  # the reservation failed (logged): a future miss
                else self.link.call(
                    f"store of {spec.request_id}",
                    lambda c: c.finish_store(
                        prepared, gather=gather, caller_copies=caller_copies, confirm=confirm
                    ),
                    None,
                )
            )
        stored = 0 if result is None else len(result.stored)
        if result is not None and not result.confirmed:
            self._commits[result.commit_rid] = (spec.request_id, stored)
        with self._lock:  # the store thread's results, read by vLLM's thread
            self._timed("store", start, stored)
            if stored:
                self.stats["stored_chunks"] += stored
                written = self._report.written_chunks
                written[spec.request_id] = written.get(spec.request_id, 0) + stored

    def _timed(self, what: str, start: float, chunks: int) -> None:
        """Add one store's or load's time and bytes (chunks copied) to the totals: a store's
        own time (its RPCs and copy), not the time it waited in the store queue."""
        self.stats[f"{what}_seconds"] += time.perf_counter() - start
        reg = self.link.registration()
        if reg is not None:
            self.stats[f"{what}_bytes"] += chunks * reg.chunk_bytes

    # -- per-step results ------------------------------------------------------------------
    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """(finished sending: released requests whose stores have all ended, finished
        loading)."""
        sent = {rid for rid in self._releasing if not self._store_pending(rid)}
        self._releasing -= sent
        done, self._finished_recving = self._finished_recving, set()
        return (sent or None), (done or None)

    def _store_pending(self, request_id: str) -> bool:
        return self._stores is not None and self._stores.pending(request_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_failed_loads(self) -> set[str]:
        """The requests whose load failed since the last call, with several KV cache groups
        (each also reported finished loading, as vLLM expects)."""
        if not self._failed_loads:
            return set()
        failed, self._failed_loads = self._failed_loads, set()
        return failed

    def build_worker_meta(self) -> TierKVWorkerMetadata | None:
        """This step's loads and stores, under this rank (None when there were none)."""
        with self._lock:
            report, self._report = self._report, RankReport()
        return TierKVWorkerMetadata({self.rank: report}) if report else None

    def stats_snapshot(self) -> dict[str, float]:
        """A consistent copy of :attr:`stats` (the store thread adds to it)."""
        with self._lock:
            return dict(self.stats)

    def interval_stats(self) -> TierKVStats | None:
        """What this rank loaded and stored since the last call, for vLLM's connector stats
        (None if nothing): the difference of the running totals."""
        now = self.stats_snapshot()
        last, self._reported = self._reported, now
        delta = {name: now[name] - last.get(name, 0) for name in _INTERVAL_FIELDS}
        delta["stored_tokens"] = delta["stored_chunks"] * self.settings.chunk_size
        if not any(delta.values()):
            return None
        return TierKVStats.for_rank(self.rank, delta)

    def shutdown(self) -> None:
        """Wait (at most :data:`SHUTDOWN_WAIT` seconds) for the queued stores, give back the
        reservations no store took, then close."""
        if self._stores is not None and not self._stores.close(SHUTDOWN_WAIT):
            log.warning(
                "tierkv worker rank %d: stores still queued at shutdown were dropped", self.rank
            )
        self._give_back_unused()
        self._prepare_thread.shutdown(wait=True)
        self._settle(set())
        self.link.close()


# The running totals an interval reports (stored_tokens follows from stored_chunks).
_INTERVAL_FIELDS = tuple(name for name in RANK_FIELDS if name != "stored_tokens")


def _check_registered(client: Client) -> bool:
    client.check_registered()
    return True


def _keys(spec: StoreSpec) -> dict[str, Any]:
    """How a store names its chunks: vLLM's block hashes, else the token ids."""
    return {"hashes": spec.hashes} if spec.hashes is not None else {"tokens": spec.tokens}
