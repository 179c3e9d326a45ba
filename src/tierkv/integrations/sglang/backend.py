"""``TierKVStorage``: SGLang's HiCache storage backend (its L3) over a tierkv server.

SGLang loads it as a dynamic backend (see the package docstring), calls it with
``(storage_config, extra_config)`` and hands it the host KV pool through
``register_mem_pool_host``. Each engine rank has its own backend object and its own tierkv
client, registered for the pool's page geometry (:mod:`tierkv.integrations.sglang.pages`).

- ``batch_set_v1``/``batch_get_v1`` (SGLang's zero-copy interface): one PREPARE and one
  COMMIT/FINISH RPC for the whole batch; each page is copied once, between its view in the
  host pool and its slot in tierkv's shared-memory pool.
- ``batch_exists`` answers how many leading pages tierkv can serve: a LOOKUP that also
  fetches the pages it finds in slower tiers or on other nodes into the pool, waiting for
  them (at most ``timeout``), so that the ``batch_get_v1`` that follows reads them locally.
- The generic calls (``get``/``set``/``batch_get``/``batch_set``/``exists``) move SGLang's
  flat data pages, in the same byte order; the v2 calls serve the KV pool.
- MLA: the KV of a page is the same on every tensor-parallel rank, so all ranks share one
  namespace; only the storage writer (SGLang's ``is_storage_writer``) stores, every rank reads.

The engine never fails because of the cache: every RPC goes through
:class:`~tierkv.integrations.link.ServerLink` (short timeout, one warning, then misses for
``retry_interval``), and bad input (a key that is not a string, too few host indices) is a
logged miss or a failed write, never an exception out of the backend.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy.typing as npt
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from tierkv.arraycopy import COPIES, copy_array
from tierkv.client import Client
from tierkv.integrations.link import ServerLink
from tierkv.integrations.sglang.pages import (
    PageGeometry,
    UnsupportedPoolError,
    geometry_of,
    page_hash,
    page_views,
    raw_array,
)
from tierkv.integrations.sglang.settings import BackendSettings

log = logging.getLogger("sglang.tierkv")

T = TypeVar("T")
STATS_KEPT = 4096  # calls remembered for get_stats()


class TierKVStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang HiCache storage in a tierkv server (zero-copy v1 interface)."""

    def __init__(
        self, storage_config: HiCacheStorageConfig, extra_config: dict[str, Any] | None = None
    ) -> None:
        """``storage_config.extra_config`` holds the tierkv settings (SGLang's factory passes
        its own keyword arguments as ``extra_config``; none are needed)."""
        self.config = storage_config
        self.settings = BackendSettings.from_extra_config(storage_config.extra_config)
        self.model_id = self.settings.model_id or storage_config.model_name or ""
        if not self.model_id:
            raise ValueError(
                "tierkv needs the model's identity for its keys: SGLang gave no model name; "
                "set model_id in --hicache-storage-backend-extra-config"
            )
        self.writer = bool(storage_config.is_storage_writer)
        self.geometry: PageGeometry | None = None
        self.mem_pool_host: Any = None
        what = f"tp rank {storage_config.tp_rank}"
        if storage_config.pp_size > 1:
            what += f" pp rank {storage_config.pp_rank}"
        # Page copies run on the client's copy threads (numpy releases the GIL).
        self.link = ServerLink(self.settings, self._register, what, log, parallel_callbacks=True)
        self._torch_dtype: torch.dtype | None = None
        # For get_stats(): pages per call and GB/s, drained by each get_stats() (bounded:
        # SGLang calls it only with storage metrics on).
        self._prefetch_pages: deque[int] = deque(maxlen=STATS_KEPT)
        self._backup_pages: deque[int] = deque(maxlen=STATS_KEPT)
        self._prefetch_gbps: deque[float] = deque(maxlen=STATS_KEPT)
        self._backup_gbps: deque[float] = deque(maxlen=STATS_KEPT)

    # -- attach ----------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take the host pool; an unsupported one fails the attach with the reason."""
        geometry = geometry_of(mem_pool_host)
        self.mem_pool_host = mem_pool_host
        self.geometry = geometry
        self._torch_dtype = mem_pool_host.dtype
        log.info(
            "tierkv %s: %s pages of %d tokens, %s, server %s, copies by %s",
            self.link.what,
            geometry.format_tag,
            geometry.page_size,
            "storing and reading" if self.writer else "reading (another rank stores)",
            self.settings.endpoint,
            COPIES,
        )
        self.link.client()  # register now: a misconfiguration shows at start, not later

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        if str(host_pool_name) != PoolName.KV.value:
            raise UnsupportedPoolError(
                f"tierkv stores the KV pool only, not SGLang's {host_pool_name!s} pool: hybrid "
                "models (Mamba, SWA, sparse indexers, ...) are not supported"
            )
        if self.mem_pool_host is None:
            self.register_mem_pool_host(host_pool)
        elif host_pool is not self.mem_pool_host:
            raise UnsupportedPoolError("tierkv: a second KV host pool for one storage backend")
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def _register(self, client: Client) -> None:
        g = self._require_geometry()
        cfg = self.config
        shared = g.kind == "mla"  # the same bytes on every tensor-parallel rank
        model = f"{self.model_id}|kv={g.format_tag}"
        if cfg.pp_size > 1:
            model += f"|pp={cfg.pp_rank}/{cfg.pp_size}"  # a stage holds its own layers
        if cfg.attn_cp_size > 1:
            model += f"|cp={cfg.attn_cp_rank}/{cfg.attn_cp_size}"  # a slice of every page
        client.register(
            model,
            g.shape,
            g.dtype,
            token_axis=g.token_axis,
            world_size=1 if shared else cfg.tp_size,
            rank=0 if shared else cfg.tp_rank,
            tenant_salt=self.settings.tenant,
            name=f"sglang {self.link.what}",
            chunk_tokens=g.page_size,
        )

    def _require_geometry(self) -> PageGeometry:
        if self.geometry is None:
            raise UnsupportedPoolError("no host pool registered (register_mem_pool_host)")
        return self.geometry

    # -- zero-copy interface ---------------------------------------------------------------
    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading pages of ``keys`` tierkv can serve, after fetching those it
        holds in slower tiers or on other nodes into the pool (waits at most ``timeout``)."""
        hashes = self._hashes("batch_exists", keys)
        if not hashes:
            return 0
        rid = f"sglang-{uuid.uuid4().hex}"

        def exists(client: Client) -> int:
            try:
                found = client.lookup(hashes=hashes, request_id=rid)
                hits = client.wait_prefetch(rid) if found.prefetching else found.hits
            finally:
                # The pages are in the pool now; batch_get_v1 reads them by key, so the
                # lookup's locks go (an abandoned prefetch must not pin memory).
                client.end_session(rid)
            return hits

        return self.link.call("batch_exists", exists, 0)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store the pages at ``host_indices`` under ``keys``: True for each page tierkv
        holds afterwards (stored now or already there), False where the pool was full."""
        if not keys:
            return []
        if not self.writer:
            return [True] * len(keys)  # MLA: the writer rank stores these same bytes
        prepared = self._pages("batch_set_v1", keys, host_indices)
        if prepared is None:
            return [False] * len(keys)
        hashes, views = prepared

        def store(client: Client) -> list[bool]:
            done = client.store(hashes=hashes, gather=lambda c, dst: copy_array(dst, views[c]))
            held = set(done.stored) | set(done.present)
            return [i in held for i in range(len(hashes))]

        return self._timed(
            True, len(keys), lambda: self.link.call("batch_set_v1", store, [False] * len(keys))
        )

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read the pages of ``keys`` into the host pool at ``host_indices``: True for each
        page read (SGLang uses the leading run)."""
        if not keys:
            return []
        prepared = self._pages("batch_get_v1", keys, host_indices)
        if prepared is None:
            return [False] * len(keys)
        hashes, views = prepared

        def load(client: Client) -> list[bool]:
            got = client.retrieve(hashes=hashes, scatter=lambda c, src: copy_array(views[c], src))
            read = set(got.retrieved)
            return [i in read for i in range(len(hashes))]

        return self._timed(
            False, len(keys), lambda: self.link.call("batch_get_v1", load, [False] * len(keys))
        )

    # -- generic interface (flat data pages) -----------------------------------------------
    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Flat data pages of ``keys`` (into ``target_locations`` when given), None where
        tierkv does not hold one."""
        if not keys:
            return []
        hashes = self._hashes("batch_get", keys)
        pool = self.mem_pool_host
        if not hashes or pool is None:
            return [None] * len(keys)
        targets = (
            list(target_locations)
            if target_locations is not None
            else [pool.get_dummy_flat_data_page() for _ in keys]
        )
        if len(targets) != len(keys) or not all(self._flat_fits(t) for t in targets):
            log.warning(
                "tierkv %s: batch_get: targets do not match the keys' pages", self.link.what
            )
            return [None] * len(keys)
        flats = [raw_array(t).reshape(-1) for t in targets]

        def load(client: Client) -> list[torch.Tensor | None]:
            got = client.retrieve(
                hashes=hashes, scatter=lambda c, src: copy_array(flats[c], src.reshape(-1))
            )
            read = set(got.retrieved)
            return [targets[i] if i in read else None for i in range(len(keys))]

        fallback: list[torch.Tensor | None] = [None] * len(keys)
        return self._timed(False, len(keys), lambda: self.link.call("batch_get", load, fallback))

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store flat data pages; True when tierkv holds every one afterwards."""
        if not keys:
            return True
        if not self.writer:
            return True
        hashes = self._hashes("batch_set", keys)
        pages = list(values) if values is not None else []
        if not hashes or len(pages) != len(keys) or not all(self._flat_fits(v) for v in pages):
            log.warning("tierkv %s: batch_set: values do not match the keys' pages", self.link.what)
            return False
        flats = [raw_array(v).reshape(-1) for v in pages]

        def store(client: Client) -> bool:
            done = client.store(
                hashes=hashes, gather=lambda c, dst: copy_array(dst.reshape(-1), flats[c])
            )
            return len(done.stored) + len(done.present) == len(keys)

        return self._timed(True, len(keys), lambda: self.link.call("batch_set", store, False))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- v2 interface: the KV pool ---------------------------------------------------------
    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        if any(str(t.name) != PoolName.KV.value for t in pool_transfers or []):
            log.warning("tierkv %s: only the KV pool is stored; no hit", self.link.what)
            return PoolTransferResult.empty()
        hits = self.batch_exists(keys, extra_info)
        return PoolTransferResult(
            hits, {PoolName.KV: hits} if hits else {}, list(range(1, hits + 1))
        )

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._v2(transfers, self.batch_get_v1, extra_info)

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._v2(transfers, self.batch_set_v1, extra_info)

    def _v2(
        self,
        transfers: list[PoolTransfer],
        move: Callable[[list[str], Any, Any], list[bool]],
        extra_info: HiCacheStorageExtraInfo | None,
    ) -> dict[str, list[bool]]:
        results: dict[str, list[bool]] = {}
        for t in transfers:
            keys = list(t.keys or [])
            if str(t.name) != PoolName.KV.value:
                log.warning("tierkv %s: the %s pool is not stored", self.link.what, t.name)
                results[str(t.name)] = [False] * len(keys)
            else:
                results[str(t.name)] = move(keys, t.host_indices, extra_info)
        return results

    # -- administration --------------------------------------------------------------------
    def clear(self) -> bool:
        """Remove this engine's pages from the tierkv pool (slower tiers keep theirs, as
        for every tierkv client)."""
        return self.link.call("clear", lambda c: c.clear() >= 0, False)

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics: pages per read/write call and their GB/s since the
        previous call."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        for mine, theirs in (
            (self._prefetch_pages, metrics.prefetch_pgs),
            (self._backup_pages, metrics.backup_pgs),
            (self._prefetch_gbps, metrics.prefetch_bandwidth),
            (self._backup_gbps, metrics.backup_bandwidth),
        ):
            theirs.extend(mine)
            mine.clear()
        return metrics

    def close(self) -> None:
        self.link.close()

    # -- helpers ---------------------------------------------------------------------------
    def _hashes(self, what: str, keys: Sequence[str]) -> list[bytes]:
        try:
            return [page_hash(k) for k in keys]
        except (ValueError, TypeError) as exc:
            log.warning("tierkv %s: %s: %s", self.link.what, what, exc)
            return []

    def _pages(
        self, what: str, keys: Sequence[str], host_indices: Any
    ) -> tuple[list[bytes], list[npt.NDArray[Any]]] | None:
        """Hashes of ``keys`` and views of their pages, or None (logged) for bad input."""
        hashes = self._hashes(what, keys)
        if not hashes:
            return None
        if self.mem_pool_host is None:
            log.warning("tierkv %s: %s before a host pool was registered", self.link.what, what)
            return None
        try:
            views = page_views(self.mem_pool_host, host_indices, len(keys))
        except (ValueError, TypeError, IndexError, AttributeError) as exc:
            log.warning("tierkv %s: %s: %s", self.link.what, what, exc)
            return None
        return hashes, views

    def _flat_fits(self, tensor: Any) -> bool:
        g = self.geometry
        return (
            g is not None
            and isinstance(tensor, torch.Tensor)
            and tensor.dtype == self._torch_dtype
            and tensor.numel() == g.elements
            and tensor.is_contiguous()
        )

    def _timed(self, store: bool, pages: int, call: Callable[[], T]) -> T:
        """``call()``, recording the pages and GB/s of the call for get_stats()."""
        start = time.perf_counter()
        result = call()
        elapsed = time.perf_counter() - start
        g = self.geometry
        if g is not None and elapsed > 0:
            gbps = pages * g.nbytes / elapsed / 1e9
            (self._backup_pages if store else self._prefetch_pages).append(pages)
            (self._backup_gbps if store else self._prefetch_gbps).append(gbps)
        return result
