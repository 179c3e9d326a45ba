"""``TierKVConnector``: vLLM's KV connector V1 interface over a tierkv server.

vLLM creates one connector in the scheduler (role SCHEDULER) and one in every worker (role
WORKER); this class reads the configuration both share and hands each call to
:class:`SchedulerSide` or :class:`WorkerSide`.

Configuration comes from vLLM: the engine id (``kv_transfer_config.engine_id``, the same in
the scheduler and every worker of one instance, unique per instance), ``kv_role`` (a
``kv_consumer`` never stores, a ``kv_producer`` never loads), the model, the parallel layout,
and ``kv_connector_extra_config`` (see :mod:`tierkv.integrations.vllm.settings`).

Stores can run off the forward pass on a store thread per worker (``async_store``, off by
default; never for a ``kv_producer``): see :mod:`tierkv.integrations.vllm.worker` for how
the blocks a store reads are kept until it ends (delayed frees of finished requests, and
``handle_preemptions`` waiting for preempted requests' stores).

MLA caches (DeepSeek-V2/V3 style) are stored once for all tensor-parallel ranks (see
:mod:`tierkv.integrations.vllm.worker`). On vLLM's CPU platform an MLA engine stores but
never loads where vLLM's own prefix caching is off for it (its reference CPU MLA backend:
vLLM 0.32 turns prefix caching and chunked prefill off there), and with several ranks: that
attention gives other tokens for a prompt whose prefix it did not compute itself, even when
an engine loads back exactly the bytes it computed (measured with a tiny DeepSeek-V2 at TP=2,
and at TP=1 by ``benchmarks/vllm_models.py``: the first token's log-probability moved by 0.1
on a loaded 2k-token prefix and the greedy outputs parted after 1 to 4 tokens, where a Llama
agrees to three decimals). Elsewhere (a GPU, where vLLM's prefix caching serves MLA
prefixes too) an MLA engine loads; that was not run here (no GPU).

The vLLM versions the connector is tested with are
:data:`~tierkv.integrations.vllm.interface.TESTED_VLLM_VERSIONS`; every hook of vLLM's base
class is implemented here or left at its default on purpose
(:data:`~tierkv.integrations.vllm.interface.KEPT_DEFAULTS`, with the reasons). On another
vLLM version the scheduler logs the hooks that are neither.

Sliding windows. Without the hybrid allocator vLLM hands sliding-window layers over as full
attention (one group carrying the window, every block kept). The connector declares
``SupportsHMA``, so vLLM keeps the allocator on: full-attention and sliding-window groups of
one geometry are served (see :func:`_hybrid_spec`). Either way a chunk holds every layer's
K/V of every token: the same bytes per token as a full-attention model of the same shape,
any prefix boundary can be served, and engines with the allocator on and off share chunks.

Hybrid models with state layers (vLLM's ``MambaSpec`` groups: gated DeltaNet, Mamba-2) are
served in vLLM's Mamba "align" mode (its prefix caching on): the states vLLM hands over are
stored beside the KV, and a prefix is served only with its state (see
:mod:`tierkv.integrations.vllm.state`); the KV chunks hold the attention layers only.

Models tierkv cannot serve exactly (other group kinds, state layers without the "align" mode
or with a block size the chunk size is no multiple of, MLA mixed with others, groups of
different geometries, an all-sliding-window cache whose blocks vLLM frees behind the window,
unsupported KV quantization) do not stop the engine: the connector logs why, once, and
neither loads nor stores.

Statistics go through vLLM's own channels (:mod:`tierkv.integrations.vllm.stats`): every
worker's loads and stores and the scheduler's hits by source are vLLM's connector stats (its
``KV Transfer metrics`` log line, and ``vllm:tierkv_*`` counters in ``/metrics``), and each
hit's split by where the server found it (its pool, a peer node, a tier) is what vLLM counts
in ``vllm:prompt_tokens_cached_by_source`` (pool: ``host``, peer: ``p2p``, disk: ``disk``,
Redis/Valkey/S3: ``external_unspecified``, vLLM having no tier for remote stores).

A failed load is recomputed: the connector sets ``kv_load_failure_policy`` to
``"recompute"`` (vLLM's default, ``"fail"``, would fail the request, which a cache miss must
never do).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from tierkv.copier import default_threads
from tierkv.integrations.vllm.chunks import block_positions
from tierkv.integrations.vllm.interface import (
    TESTED_VLLM_VERSIONS,
    connector_bases,
    interface_gaps,
)
from tierkv.integrations.vllm.kv_events import NoteGroup
from tierkv.integrations.vllm.layout import CacheGeometry, UnsupportedLayoutError
from tierkv.integrations.vllm.metadata import TierKVConnectorMetadata
from tierkv.integrations.vllm.scheduler import SchedulerSide
from tierkv.integrations.vllm.settings import ConnectorSettings, stores_async
from tierkv.integrations.vllm.state import (
    STATE_SPECS,
    StateFormat,
    StateLayout,
    UnsupportedStateError,
    state_format,
)
from tierkv.integrations.vllm.stats import PEER, POOL, TierKVPromMetrics, TierKVStats
from tierkv.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("vllm.tierkv")

# Block hash functions whose values differ between processes unless PYTHONHASHSEED is set.
_PER_PROCESS_HASHES = ("xxhash", "xxhash_cbor")
_SUPPORTED_QUANT_MODES = ("NONE", "FP8_PER_TENSOR")
# vLLM cache dtypes that store the model's (or the named) float dtype as it is.
_UNQUANTIZED_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float")
_SUPPORTED_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")
_HYBRID_SPECS = ("FullAttentionSpec", "SlidingWindowSpec")


try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    _HIT_SOURCE: Any = CacheHitSource.HOST
    # vLLM's tiers for where tierkv found a hit (vllm:prompt_tokens_cached_by_source): the
    # pool is host memory; remote stores (redis, valkey, s3) have no tier of their own there.
    _VLLM_SOURCES: dict[str, Any] = {
        POOL: CacheHitSource.HOST,
        PEER: CacheHitSource.P2P,
        "disk": CacheHitSource.DISK,
    }
    _OTHER_SOURCE: Any = CacheHitSource.EXTERNAL_UNSPECIFIED
except ImportError:  # a vLLM without per-source hit counts
    _HIT_SOURCE = _OTHER_SOURCE = None
    _VLLM_SOURCES = {}


class TierKVConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """Prefix KV from and to a tierkv server (scheduler and worker roles)."""

    # Where vLLM counts a hit whose sources are not known (get_external_cache_hit_sources):
    # the pool is in host memory (shared memory).
    _cache_hit_source = _HIT_SOURCE

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = ConnectorSettings.from_extra_config(transfer.kv_connector_extra_config)
        can_save = bool(transfer.is_kv_producer)
        can_load = bool(transfer.is_kv_consumer)
        engine_id = str(transfer.engine_id)
        async_store = stores_async(self.settings, can_load=can_load, can_save=can_save)
        model_id = self.settings.model_id or _model_identity(vllm_config)
        self._state: StateFormat | None = None
        try:
            _check_parallelism(vllm_config)
            self._state = state_format(kv_cache_config, self.settings.chunk_size)
            self._spec = _attention_spec(kv_cache_config)
            _check_kv_scales(vllm_config)
            self._unsupported = ""
        except (UnsupportedLayoutError, UnsupportedStateError) as e:
            # A model whose KV tierkv cannot store and restore exactly: the engine runs, and
            # every request is a miss (never wrong KV, never a failed start).
            self._spec, self._state, self._unsupported = None, None, str(e)
            can_load = can_save = False
            if role == KVConnectorRole.SCHEDULER:
                log.warning("tierkv: %s: this engine neither loads nor stores", e)
        if can_load and _loads_give_wrong_output(vllm_config, self._spec):
            if role == KVConnectorRole.SCHEDULER:
                log.warning(
                    "tierkv: vLLM's CPU MLA computes other tokens on top of a prefix it did "
                    "not compute itself (vLLM turns its own prefix caching off for it): this "
                    "engine stores, never loads"
                )
            can_load = False
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            _check_vllm_version(type(self))
            if transfer.kv_load_failure_policy != "recompute":
                was = transfer.kv_load_failure_policy
                log.info("tierkv: kv_load_failure_policy set to 'recompute' (was %r)", was)
                transfer.kv_load_failure_policy = "recompute"
            block_size, hash_block_size = _block_sizes(vllm_config, kv_cache_config)
            self._scheduler = SchedulerSide(
                self.settings,
                model_id=model_id,
                engine_id=engine_id,
                block_size=block_size,
                hash_block_size=hash_block_size,
                use_block_hashes=_use_block_hashes(self.settings, vllm_config, hash_block_size),
                can_load=can_load,
                can_save=can_save,
                world_size=int(vllm_config.parallel_config.world_size),
                async_store=async_store,
                shared_ranks=_shares_latent(vllm_config, self._spec),
                kv_events=_kv_events_on(vllm_config),
                # Notes name vLLM's block hashes one per block: not at another granularity,
                # nor a hybrid model's state blocks.
                note_groups=(
                    _note_groups(kv_cache_config)
                    if block_size == hash_block_size and self._state is None
                    else None
                ),
                state_format=self._state,
                tables_change=kv_cache_config is not None
                and len(kv_cache_config.kv_cache_groups) > 1,
            )
            log.info(
                "tierkv scheduler: engine %s (%d ranks), model %r, server %s, chunks of %d "
                "tokens, keys from %s, %s, %s stores",
                engine_id,
                self._scheduler.world_size,
                model_id,
                self.settings.endpoint,
                self.settings.chunk_size,
                "vLLM block hashes" if self._scheduler.use_block_hashes else "token ids",
                transfer.kv_role,
                "asynchronous" if async_store else "synchronous",
            )
        else:
            parallel = vllm_config.parallel_config
            world_size = int(parallel.world_size)
            self._worker = WorkerSide(
                self.settings,
                model_id=model_id,
                engine_id=engine_id,
                world_size=world_size,
                rank=int(parallel.rank) % world_size,
                can_load=can_load,
                can_save=can_save,
                async_store=async_store,
                kv_variant=_kv_variant(vllm_config),
                share_latent=_shares_latent(vllm_config, self._spec),
            )

    @property
    def worker_stats(self) -> dict[str, float]:
        """This worker's totals: chunks loaded, stored and failed, and the seconds and bytes
        of its loads and stores (a worker-role connector only). A store's seconds are its own
        (RPCs and copy), not the time it queued behind others on the store thread."""
        return self._require_worker().stats_snapshot()

    @property
    def worker_copy_threads(self) -> int:
        """The threads this worker copies chunks with (``copy_threads``, vLLM's own
        included)."""
        return self._require_worker().link.copy_threads() or default_threads()

    def wait_for_stores(self, timeout: float | None = None) -> bool:
        """Block until every store this worker submitted has ended (tests, benchmarks);
        False if ``timeout`` ran out."""
        return self._require_worker().wait_for_stores(timeout)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped store is a future miss, never a lost hand-off

    # -- worker role -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        worker = self._require_worker()
        if self._unsupported:
            return  # inactive (logged by the scheduler): no layout, no registration
        try:
            self._register_kv_caches(worker, kv_caches)
        except (UnsupportedLayoutError, UnsupportedStateError) as e:
            # Tensors tierkv cannot map that the spec did not tell (__init__ checks what it
            # can, for both roles): a cache must never stop the engine. This worker neither
            # loads nor stores; any load the scheduler plans fails, and vLLM recomputes.
            self._unsupported = str(e)
            worker.deactivate()
            log.warning("tierkv worker rank %d: %s: it neither loads nor stores", worker.rank, e)

    def _register_kv_caches(self, worker: WorkerSide, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map ``kv_caches`` by the spec and register them (raises
        :class:`UnsupportedLayoutError` for tensors tierkv cannot map)."""
        spec = self._spec
        if spec is None:
            raise UnsupportedLayoutError("tierkv needs the KV cache spec of an attention model")
        heads = int(getattr(spec, "num_heads", spec.num_kv_heads))
        geometry = CacheGeometry(
            int(spec.block_size), heads, int(spec.head_size), latent=_is_latent(spec)
        )
        state = StateLayout(self._state, kv_caches) if self._state is not None else None
        attention = {
            name: tensor
            for name, tensor in kv_caches.items()
            if state is None or name not in state.format.layers
        }
        worker.register_kv_caches(
            attention,
            geometry,
            _backend_names(self._vllm_config, attention),
            self.settings.kv_layout,
            _layer_groups(self._kv_cache_config, attention),
            state,
        )

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # Before the forward pass that may reuse the preempted requests' blocks.
        if isinstance(kv_connector_metadata, TierKVConnectorMetadata):
            self._require_worker().handle_preemptions(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # Before the forward pass: reserve this step's stores while it computes the chunks.
        # A step with loads reserves after them (start_load_kv), so that they go first.
        if (
            self._worker is not None
            and isinstance(connector_metadata, TierKVConnectorMetadata)
            and not connector_metadata.loads
        ):
            self._worker.prepare_stores(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._require_worker().start_load_kv(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before vLLM schedules the request

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # whole chunks are stored after the forward pass, in wait_for_save

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self._require_worker().wait_for_save(self._metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._require_worker().get_finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        worker = self._require_worker()
        sent, received = worker.get_finished()
        return KVConnectorTransferResults(
            finished_sending=set(sent or ()),
            finished_recving=set(received or ()),
            failed_recving=worker.get_failed_loads(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._require_worker().get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> Any:
        return self._require_worker().build_worker_meta()

    # -- scheduler role --------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._require_scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self._unsupported:
            return
        positions = block_positions(blocks.get_block_ids())
        self._require_scheduler().update_state_after_alloc(
            request, positions or [], num_external_tokens
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._require_scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        self._require_scheduler().update_connector_output(meta)

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[Any, int]:
        # Where the server found the chunks vLLM just agreed to load (the pool, a peer node,
        # a tier it prefetched them from), in vLLM's tiers.
        found = self._require_scheduler().external_sources(request.request_id)
        if not num_external_tokens or sum(found.values()) != num_external_tokens:
            return super().get_external_cache_hit_sources(  # type: ignore[no-any-return]
                request, num_external_tokens
            )
        out: dict[Any, int] = {}
        for where, tokens in found.items():
            source = _VLLM_SOURCES.get(where, _OTHER_SOURCE)
            out[source] = out.get(source, 0) + tokens
        return out

    def take_events(self) -> Iterable[Any]:
        # The pool's KV events (vLLM publishes them in this step's batch): see scheduler.py.
        return self._require_scheduler().take_events()

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # vLLM's hybrid allocator (SupportsHMA): one block table per KV cache group.
        return self._finished(request, block_positions(block_ids))

    def _finished(
        self, request: Any, block_ids: list[Any] | None
    ) -> tuple[bool, dict[str, Any] | None]:
        scheduler = self._require_scheduler()
        params = scheduler.request_finished(request, block_ids)
        # True: a last decode chunk is stored next step, or stores of its blocks may still run
        # on the workers' store threads; the workers report the request in get_finished
        # (finished sending) once its stores ended, and vLLM frees its blocks.
        return scheduler.keeps_blocks(request.request_id), params or None

    # -- both ------------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> TierKVStats | None:
        # Since the last call: a worker's loads and stores, the scheduler's hits by source.
        if self._worker is not None:
            return self._worker.interval_stats()
        return self._require_scheduler().interval_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TierKVStats:
        return TierKVStats(data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> TierKVPromMetrics:
        return TierKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()

    def _metadata(self) -> TierKVConnectorMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, TierKVConnectorMetadata):
            raise TypeError(f"unexpected connector metadata {type(meta).__name__}")
        return meta

    def _require_worker(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("worker-role method called on the scheduler connector")
        return self._worker

    def _require_scheduler(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("scheduler-role method called on a worker connector")
        return self._scheduler


# -- configuration helpers ---------------------------------------------------------------------
def _check_vllm_version(connector: type) -> None:
    """On a vLLM version the connector is not tested with: log it, and the base-class hooks
    it neither implements nor keeps on purpose (the engine runs on: a cache must not stop
    it; the tests fail on them instead)."""
    import vllm

    version = str(getattr(vllm, "__version__", "unknown"))
    if version in TESTED_VLLM_VERSIONS:
        return
    unlisted, _, _ = interface_gaps(connector, connector_bases())
    log.warning(
        "tierkv: vLLM %s is not a version the connector is tested with (%s); connector "
        "hooks it neither implements nor leaves at their default on purpose: %s",
        version,
        ", ".join(TESTED_VLLM_VERSIONS),
        ", ".join(unlisted) or "none",
    )


def _model_identity(vllm_config: Any) -> str:
    """Model name or path, revision and quantization: what makes weights (and KV) differ."""
    mc = vllm_config.model_config
    ident = str(mc.model)
    if getattr(mc, "revision", None):
        ident += f"@{mc.revision}"
    if getattr(mc, "quantization", None):
        ident += f"|quant={mc.quantization}"
    return ident


def _kv_variant(vllm_config: Any) -> str:
    """What else makes the KV of the same weights differ, appended to the chunk format in
    the namespace (engines whose KV differs never share chunks; routers still find the
    model by its name): a quantized cache's dtype (:func:`_cache_dtype_tag`: fp8_e4m3 and
    fp8_e5m2 caches are both uint8 tensors), and overrides of the model's config
    (``hf_overrides``: RoPE scaling or theta, ...), another config file, other custom code
    as ``"|cfg="`` and a digest. "" when there is none. Overrides given as a function
    cannot be compared across engines: such an engine shares its chunks with none."""
    return _cache_dtype_tag(vllm_config) + _config_digest(vllm_config)


def _cache_dtype_tag(vllm_config: Any) -> str:
    """``"|kv=<cache_dtype>"`` for a quantized KV cache (``fp8``, ``fp8_e4m3``,
    ``fp8_e5m2``, ...), whose tensors are uint8 whatever the encoding: the tensor dtype in
    the chunk format cannot tell them apart. "" for an unquantized cache (its tensor dtype
    says it all), so that such engines keep their namespace."""
    cache_dtype = str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto"))
    if cache_dtype in _UNQUANTIZED_CACHE_DTYPES:
        return ""
    return f"|kv={cache_dtype}{_fp8_flavour(cache_dtype)}"


def _fp8_flavour(cache_dtype: str) -> str:
    """``"/fnuz"`` where this platform's fp8 e4m3 is the fnuz encoding (ROCm on MI300):
    the same ``fp8_e4m3`` name then stores other bytes than on CUDA or CPU (float8_e4m3fn),
    and a cluster may mix both. "" otherwise."""
    if "e5m2" in cache_dtype:
        return ""  # one encoding everywhere
    try:
        from vllm.platforms import current_platform

        fp8 = str(current_platform.fp8_dtype())
    except Exception:  # no platform answer: the usual encoding
        return ""
    return "/fnuz" if "fnuz" in fp8 else ""


def _check_kv_scales(vllm_config: Any) -> None:
    """A quantized cache's bytes are the KV divided by its per-tensor scales: shared chunks
    are right only where every engine of the model has the same scales, i.e. where the
    checkpoint fixes them (or they default to 1.0), as in vLLM 0.32. Scales an engine
    computes at run time (``calculate_kv_scales`` in vLLM versions that have it) are its
    own: raises :class:`UnsupportedLayoutError` (the connector then stays inactive)."""
    tag = _cache_dtype_tag(vllm_config)
    cache = getattr(vllm_config, "cache_config", None)
    if not tag or not getattr(cache, "calculate_kv_scales", False):
        return
    raise UnsupportedLayoutError(
        f"tierkv does not support a {tag[4:]} KV cache with calculate_kv_scales: "
        "scales computed at run time make its bytes this engine's own"
    )


def _config_digest(vllm_config: Any) -> str:
    """``"|cfg="`` and a digest of the model config's overrides (see :func:`_kv_variant`),
    or ""."""
    mc = vllm_config.model_config
    parts: dict[str, Any] = {}
    overrides = getattr(mc, "hf_overrides", None)
    if overrides:
        parts["hf_overrides"] = f"function {uuid.uuid4()}" if callable(overrides) else overrides
    for name in ("hf_config_path", "code_revision"):
        if value := getattr(mc, name, None):
            parts[name] = value
    if not parts:
        return ""
    canonical = json.dumps(parts, sort_keys=True, default=str)
    return "|cfg=" + hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _kv_events_on(vllm_config: Any) -> bool:
    """vLLM publishes KV cache events (``kv_events_config.enable_kv_cache_events``)."""
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and config.enable_kv_cache_events)


def _note_groups(kv_cache_config: Any) -> list[NoteGroup]:
    """The KV cache groups a chunk's KV events describe: one event per group, with the
    group's kind and sliding window under vLLM's hybrid allocator (several groups), as
    vLLM's own CPU offloading describes them."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) < 2:
        return [NoteGroup()]
    from vllm.v1.kv_cache_interface import (
        get_kv_cache_spec_kind,
        get_kv_cache_spec_sliding_window,
    )

    return [
        NoteGroup(
            i,
            get_kv_cache_spec_kind(g.kv_cache_spec).value,
            get_kv_cache_spec_sliding_window(g.kv_cache_spec),
        )
        for i, g in enumerate(groups)
    ]


def _is_latent(spec: Any) -> bool:
    """An MLA spec: one latent vector per token, the same on every tensor-parallel rank."""
    return spec is not None and type(spec).__name__ == "MLAAttentionSpec"


def _check_parallelism(vllm_config: Any) -> None:
    """Context parallelism (decode or prefill) gives each rank a shard of every block's
    tokens, and vLLM's scheduler counts blocks of all the shards' tokens: chunks would hold
    other tokens than their keys name. Raises :class:`UnsupportedLayoutError` for it (the
    connector then stays inactive)."""
    parallel = vllm_config.parallel_config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = int(getattr(parallel, name, 1) or 1)
        if size > 1:
            raise UnsupportedLayoutError(
                f"tierkv does not support context parallelism ({name} {size}): each rank "
                "holds a shard of every block's tokens"
            )


def _shares_latent(vllm_config: Any, spec: Any) -> bool:
    """Every rank holds the same KV (MLA: one namespace, rank 0 stores, all read): only
    where the ranks are tensor-parallel. Pipeline stages hold other layers: each rank then
    keeps its own namespace, as for standard attention."""
    stages = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)
    return _is_latent(spec) and stages == 1


def _loads_give_wrong_output(vllm_config: Any, spec: Any) -> bool:
    """An MLA engine on vLLM's CPU platform whose attention cannot prefill on top of cached
    KV: the platform then turns vLLM's own prefix caching off (its reference CPU MLA
    backend; the AMX one keeps it), and so does the connector's loading (see the module
    doc)."""
    if not _is_latent(spec):
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    return int(vllm_config.parallel_config.world_size) > 1 or not bool(
        vllm_config.cache_config.enable_prefix_caching
    )


def _attention_spec(kv_cache_config: Any) -> Any:
    """The one attention spec tierkv supports: full attention (sliding windows included, as
    vLLM hands them with its hybrid manager off) or MLA, in one KV cache group. Raises
    :class:`UnsupportedLayoutError` saying why for any other (the connector then stays
    inactive)."""
    if kv_cache_config is None:
        return None
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        return _hybrid_spec(groups)
    spec = groups[0].kv_cache_spec
    specs = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    if not specs:
        return _checked_spec(spec)
    # Layers of one type but maybe of other shapes (vLLM groups them all the same): every
    # one is checked here, so that both roles go inactive at start, never the worker alone
    # when its tensors do not fit one geometry.
    checked = [_checked_spec(s) for s in specs.values()]
    _one_geometry(checked)
    return checked[0]


def _one_geometry(specs: list[Any]) -> None:
    """Raises :class:`UnsupportedLayoutError` unless ``specs`` share one block size, head
    geometry, dtype and quantization mode (a chunk holds every layer in one shape)."""
    shapes = {
        (
            s.block_size,
            s.num_kv_heads,
            s.head_size,
            s.dtype,
            getattr(getattr(s, "kv_quant_mode", None), "name", "NONE"),
        )
        for s in specs
    }
    if len(shapes) != 1:
        raise UnsupportedLayoutError(
            "tierkv needs one block size, head geometry, dtype and KV quantization in every "
            f"layer: {sorted(map(str, shapes))}"
        )


def _checked_spec(spec: Any) -> Any:
    """``spec`` if tierkv serves a layer of it (full attention or MLA, see
    :func:`_attention_spec`); raises :class:`UnsupportedLayoutError` saying why not."""
    kind = type(spec).__name__
    if kind not in _SUPPORTED_SPECS:
        # SlidingWindowSpec (a model whose every layer has a sliding window): vLLM frees the
        # blocks behind the window, so no prefix chunk survives to be stored.
        raise UnsupportedLayoutError(f"tierkv supports full attention and MLA only, not {kind}")
    # A FullAttentionSpec with a sliding window: vLLM's hybrid manager is off (the connector
    # does not declare SupportsHMA), so sliding-window layers keep every block, like full
    # attention; a token's K/V does not depend on the window (only which tokens attention
    # reads does), so every layer's K/V of every token is stored and loaded.
    if _is_latent(spec):
        if getattr(spec, "model_version", None) or getattr(spec, "alignment", None):
            raise UnsupportedLayoutError(
                f"tierkv does not support the MLA cache of model version {spec.model_version}"
            )
    elif getattr(spec, "head_size_v", None) not in (None, spec.head_size):
        raise UnsupportedLayoutError("tierkv needs the same head size for K and V")
    quant = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    if quant not in _SUPPORTED_QUANT_MODES:
        raise UnsupportedLayoutError(f"tierkv does not support KV quantization mode {quant}")
    return spec


def _hybrid_spec(groups: Any) -> Any:
    """The spec of a model with several KV cache groups (vLLM's hybrid allocator, which the
    connector allows by declaring SupportsHMA): full-attention and sliding-window groups
    whose layers have one geometry (block size, KV heads, head size, dtype). Every group's
    K/V of every token is stored (so any prefix boundary can be served, and engines with the
    hybrid allocator off share the chunks); a sliding-window group's blocks behind the
    window are null: a load skips them, and a chunk with one is not stored. A hybrid
    model's state groups are left out here (see :mod:`tierkv.integrations.vllm.state`)."""
    groups = [g for g in groups if type(g.kv_cache_spec).__name__ not in STATE_SPECS]
    kinds = sorted({type(g.kv_cache_spec).__name__ for g in groups})
    specs = [g.kv_cache_spec for g in groups]
    if not set(kinds) <= set(_HYBRID_SPECS):
        raise UnsupportedLayoutError(
            f"tierkv supports models with several KV cache groups of {list(_HYBRID_SPECS)} "
            f"only, this one has {len(groups)} ({', '.join(kinds)})"
        )
    shapes = {(s.block_size, s.num_kv_heads, s.head_size, s.dtype) for s in specs}
    if len(shapes) != 1:
        raise UnsupportedLayoutError(
            f"tierkv needs one block size and head geometry in every KV cache group: {shapes}"
        )
    for spec in specs:
        quant = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
        if quant not in _SUPPORTED_QUANT_MODES:
            raise UnsupportedLayoutError(f"tierkv does not support KV quantization mode {quant}")
        if getattr(spec, "head_size_v", None) not in (None, spec.head_size):
            raise UnsupportedLayoutError("tierkv needs the same head size for K and V")
    return specs[0]


def _layer_groups(kv_cache_config: Any, layers: Iterable[str]) -> dict[str, int] | None:
    """Each of ``layers``' KV cache group, for a model with several."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) < 2:
        return None
    wanted = set(layers)
    return {
        name: g for g, group in enumerate(groups) for name in group.layer_names if name in wanted
    }


def _block_sizes(vllm_config: Any, kv_cache_config: Any) -> tuple[int, int]:
    """(scheduler block size, block hash granularity)."""
    block_size = int(vllm_config.cache_config.block_size)
    if kv_cache_config is None:
        return block_size, block_size
    try:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        scheduler_bs, hash_bs = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        return int(scheduler_bs), int(hash_bs)
    except (ImportError, AttributeError, TypeError, ValueError):
        return block_size, block_size


def _use_block_hashes(settings: ConnectorSettings, vllm_config: Any, hash_block_size: int) -> bool:
    if settings.hashes == "tokens":
        return False
    algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
    per_process = algo in _PER_PROCESS_HASHES and os.environ.get("PYTHONHASHSEED") is None
    if settings.hashes == "vllm":
        if per_process:
            log.warning(
                "tierkv: vLLM block hashes (%s) differ between processes unless PYTHONHASHSEED "
                "is set: engines will not share KV",
                algo,
            )
        return True
    return not per_process and settings.chunk_size % hash_block_size == 0


def _backend_names(vllm_config: Any, kv_caches: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each layer's attention backend name, from the layers vLLM registered, with the kernel
    variant where the block format depends on it (``CPU_ATTN/amx``)."""
    context = getattr(vllm_config.compilation_config, "static_forward_context", {}) or {}
    names: dict[str, str] = {}
    for layer_name in kv_caches:
        layer = context.get(layer_name)
        backend = getattr(layer, "attn_backend", None)
        try:
            name = str(backend.get_name()) if backend is not None else ""
        except Exception:
            name = ""
        isa = getattr(layer, "isa", None)  # set on CPU attention layers by their builder
        names[layer_name] = f"{name}/{isa}" if name == "CPU_ATTN" and isa else name
    return names
