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
  flat data pages, in the same byte order.
- Hybrid models (HiCache's v2 interface): every extra host pool SGLang registers with
  ``register_mem_host_pool_v2`` (Mamba states, sliding-window KV, DSA indexer pages, draft
  KV) gets its own namespace (:mod:`~tierkv.integrations.sglang.pool_store`), its pages
  keyed by the KV page keys. ``batch_exists_v2`` answers the longest prefix at which every
  pool can restore its state under the hit policy SGLang gives it
  (:mod:`~tierkv.integrations.sglang.hit_policy`); a pool it cannot judge is a miss.
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
from collections import deque
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any, TypeVar

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
from tierkv.integrations.sglang.hit_policy import (
    POLICIES,
    PoolCheck,
    longest_restorable,
    window_pages,
)
from tierkv.integrations.sglang.pages import (
    PageGeometry,
    UnsupportedPoolError,
    geometry_of,
    page_hash,
    raw_array,
    sidecar_geometry,
)
from tierkv.integrations.sglang.pool_store import PoolStore
from tierkv.integrations.sglang.settings import BackendSettings
from tierkv.keys import model_with_format

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
        self.kv: PoolStore | None = None  # the KV pool's pages
        self.sidecars: dict[str, PoolStore] = {}  # a hybrid model's extra pools, by name
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
        stores = self.writer or geometry.kind != "mla"  # MLA: the writer rank stores
        self.kv = PoolStore(PoolName.KV.value, mem_pool_host, geometry, self.link, log,
                            stores=stores)  # fmt: skip
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
        """Take one of a hybrid model's host pools (SGLang registers the KV pool here too,
        after ``register_mem_pool_host``). A pool whose pages tierkv cannot copy exactly
        fails the attach with the reason."""
        name = _value(host_pool_name)
        if name == PoolName.KV.value:
            if self.mem_pool_host is None:
                self.register_mem_pool_host(host_pool)
            elif host_pool is not self.mem_pool_host:
                raise UnsupportedPoolError("tierkv: a second KV host pool for one storage backend")
        else:
            self._attach_sidecar(name, host_pool)
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def _attach_sidecar(self, name: str, pool: Any) -> None:
        known = self.sidecars.get(name)
        if known is not None:
            if known.pool is pool:
                return
            raise UnsupportedPoolError(f"tierkv: a second {name} host pool for one backend")
        geometry = sidecar_geometry(pool, name)
        # Pools replicated on every rank (an MLA model's, but for the rank-sharded Mamba
        # states, as SGLang's own backends key them) share one namespace and one writer. A
        # standard-attention pool holds this rank's heads, whatever the model (an MHA draft
        # model on an MLA target): its own namespace per rank.
        shared = (
            bool(self.config.is_mla_model)
            and name != PoolName.MAMBA.value
            and geometry.kind != "mha"
        )
        link = ServerLink(
            self.settings,
            lambda client: self._register_namespace(
                client, f"{self.model_id}|pool={name}|{geometry.format_tag}", geometry, shared
            ),
            f"{self.link.what} {name} pool",
            log,
            parallel_callbacks=True,
        )
        store = PoolStore(name, pool, geometry, link, log, stores=self.writer or not shared)
        self.sidecars[name] = store
        log.info(
            "tierkv %s: %s pages of %d tokens (%d bytes), %s",
            link.what,
            geometry.format_tag,
            geometry.page_size,
            geometry.nbytes,
            "as flat data pages" if geometry.flat else "zero-copy",
        )
        link.client()  # register now: a misconfiguration shows at start, not later

    def _register(self, client: Client) -> None:
        g = self._require_geometry()
        self._register_namespace(
            client, model_with_format(self.model_id, g.format_tag), g, shared=g.kind == "mla"
        )

    def _register_namespace(
        self, client: Client, model: str, g: PageGeometry, shared: bool
    ) -> None:
        """Register ``client`` for pages of geometry ``g`` under ``model``; ``shared``: the
        same bytes on every tensor-parallel rank (one namespace for all ranks)."""
        cfg = self.config
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
        holds in slower tiers or on other nodes into the pool (waits at most ``timeout`` in
        all, however many pieces of :data:`~.pool_store.PAGES_PER_REQUEST` pages it looks up)."""
        hashes = self._hashes("batch_exists", keys)
        if not hashes or self.kv is None:
            return 0
        return self.kv.leading("batch_exists", hashes)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store the pages at ``host_indices`` under ``keys``: True for each page tierkv
        holds afterwards (stored now or already there), False where the pool was full or
        another engine is still writing the page (it may abort)."""
        return self._moved("batch_set_v1", self.kv, keys, host_indices, store=True, exact=False)

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read the pages of ``keys`` into the host pool at ``host_indices``: True for each
        page read (SGLang uses the leading run)."""
        return self._moved("batch_get_v1", self.kv, keys, host_indices, store=False, exact=False)

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
        return self._timed(
            False, len(keys), self._page_bytes, lambda: self.link.call("batch_get", load, fallback)
        )

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
            return len(done.held) == len(keys)

        return self._timed(
            True, len(keys), self._page_bytes, lambda: self.link.call("batch_set", store, False)
        )

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- v2 interface: a hybrid model's pools ---------------------------------------------
    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The longest prefix (pages of ``keys``) at which the KV pool and every pool of
        ``pool_transfers`` can restore their state, each pool under its hit policy
        (:mod:`~tierkv.integrations.sglang.hit_policy`); a pool that is not registered or
        has a policy tierkv does not know restores none. Waits for pages from tiers and
        peers ``timeout`` at most in all, whatever the pools and probes; past that, a probe
        sees only what the pools hold (a miss where they lack a page, never a false hit)."""
        what = "batch_exists_v2"
        hashes = self._hashes(what, keys)
        if not hashes or self.kv is None:
            return PoolTransferResult(0, {}, [])
        deadline = self.kv.deadline()
        checks: list[tuple[Any, PoolCheck]] = []
        for transfer in list(pool_transfers or []):
            try:
                name, policy = _value(transfer.name), _value(transfer.hit_policy)
                window = window_pages(policy, transfer.keys)
            except (AttributeError, TypeError) as exc:
                log.warning("tierkv %s: %s: not a pool transfer (%s); no hit", self.link.what,
                            what, exc)  # fmt: skip
                return PoolTransferResult(0, {}, [])
            if name == PoolName.KV.value:
                continue
            store = self.sidecars.get(name)
            if store is None or policy not in POLICIES:
                log.warning(
                    "tierkv %s: %s: %s; no hit",
                    self.link.what,
                    what,
                    f"the {name} pool is not registered"
                    if store is None
                    else f"the {name} pool's hit policy {policy!r} is not supported",
                )
                return PoolTransferResult(0, {}, [])
            probe = store.probe(what, hashes, deadline)
            checks.append((transfer.name, PoolCheck(policy, window, probe)))
        kv_pages = self.kv.leading(what, hashes, deadline)
        hits: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        if not checks:
            return PoolTransferResult(kv_pages, hits, list(range(1, kv_pages + 1)))
        longest = longest_restorable([check for _, check in checks], kv_pages)
        for name, check in checks:
            if check.longest:
                hits[name] = check.longest
        return PoolTransferResult(longest, hits, [longest] if longest else [])

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Read each transfer's pages into its host pool: per pool, True for each page
        read (SGLang uses the leading run)."""
        return self._v2("batch_get_v2", transfers, store=False)

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Store each transfer's pages from its host pool: per pool, True for each page
        tierkv holds afterwards."""
        return self._v2("batch_set_v2", transfers, store=True)

    def _v2(self, what: str, transfers: Any, store: bool) -> dict[str, list[bool]]:
        results: dict[str, list[bool]] = {}
        for transfer in list(transfers or []):
            try:
                name, keys = _value(transfer.name), list(transfer.keys or [])
                host_indices = transfer.host_indices
            except (AttributeError, TypeError) as exc:
                log.warning("tierkv %s: %s: not a pool transfer (%s)", self.link.what, what, exc)
                continue
            pool = self.kv if name == PoolName.KV.value else self.sidecars.get(name)
            if pool is None:
                log.warning("tierkv %s: %s: the %s pool is not registered", self.link.what,
                            what, name)  # fmt: skip
                results[transfer.name] = [False] * len(keys)
                continue
            results[transfer.name] = self._moved(
                what, pool, keys, host_indices, store=store, exact=True
            )
        return results

    # -- administration --------------------------------------------------------------------
    def clear(self) -> bool:
        """Remove this engine's pages, of every pool, from the tierkv pool (slower tiers
        keep theirs, as for every tierkv client)."""
        links = [self.link, *(sidecar.link for sidecar in self.sidecars.values())]
        return all([link.call("clear", lambda c: c.clear() >= 0, False) for link in links])

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
        for sidecar in self.sidecars.values():
            sidecar.link.close()

    # -- helpers ---------------------------------------------------------------------------
    def _hashes(self, what: str, keys: Sequence[str]) -> list[bytes]:
        try:
            return [page_hash(k) for k in keys]
        except (ValueError, TypeError) as exc:
            log.warning("tierkv %s: %s: %s", self.link.what, what, exc)
            return []

    def _moved(
        self,
        what: str,
        pool: PoolStore | None,
        keys: Sequence[str],
        host_indices: Any,
        *,
        store: bool,
        exact: bool,
    ) -> list[bool]:
        """Store or load the pages of ``keys`` at ``host_indices`` of ``pool``: True for
        each page moved; bad input is a logged all-False."""
        if not keys:
            return []
        if pool is None:
            log.warning("tierkv %s: %s before a host pool was registered", self.link.what, what)
            return [False] * len(keys)
        hashes = self._hashes(what, keys)
        if not hashes:
            return [False] * len(keys)
        move = pool.store if store else pool.load
        return self._timed(
            store, len(keys), pool.geometry.nbytes, lambda: move(what, hashes, host_indices,
                                                                 exact=exact)
        )  # fmt: skip

    @property
    def _page_bytes(self) -> int:
        return self.geometry.nbytes if self.geometry is not None else 0

    def _flat_fits(self, tensor: Any) -> bool:
        g = self.geometry
        return (
            g is not None
            and isinstance(tensor, torch.Tensor)
            and tensor.dtype == self._torch_dtype
            and tensor.numel() == g.elements
            and tensor.is_contiguous()
        )

    def _timed(self, store: bool, pages: int, page_bytes: int, call: Callable[[], T]) -> T:
        """``call()``, recording the pages and GB/s of the call for get_stats()."""
        start = time.perf_counter()
        result = call()
        elapsed = time.perf_counter() - start
        if elapsed > 0:
            gbps = pages * page_bytes / elapsed / 1e9
            (self._backup_pages if store else self._prefetch_pages).append(pages)
            (self._backup_gbps if store else self._prefetch_gbps).append(gbps)
        return result


def _value(member: Any) -> str:
    """An SGLang enum member's value (``PoolName``, ``PoolHitPolicy``), or a plain str."""
    value = member.value if isinstance(member, Enum) else member
    if not isinstance(value, str):
        raise TypeError(f"a pool name or hit policy must be a str, got {member!r}")
    return value
