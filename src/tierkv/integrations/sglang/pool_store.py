"""``PoolStore``: the pages of one SGLang host pool in one tierkv namespace.

A hybrid model's engine has several host pools (HiCache's v2 interface names them: ``kv``,
``mamba``, ``swa``, ``indexer``, ...); each pool's pages have their own geometry, so each
pool has its own tierkv client and namespace (:class:`~tierkv.integrations.link.ServerLink`
behind a circuit breaker, as for the KV pool). A page of any pool is keyed by the KV page
key SGLang gives for it (the prefix-chained page hash), in that pool's namespace.

Pages move in one of two ways (:class:`~tierkv.integrations.sglang.pages.PageGeometry`):
as views of the host buffer (standard-attention and MLA pools: one copy each way), or as
SGLang's flat data pages (Mamba states, DSA indexer pages: SGLang gathers the page's
components into one flat page, tierkv copies that, and ``set_from_flat_data_page``
scatters it back).

A call names at most :data:`PAGES_PER_REQUEST` pages to the server (a server refuses
requests of more than its ``max_chunks_per_request``, 16,384 by default): SGLang hands a
hybrid model's whole prefetch span, or a whole backup, to one v2 call, which at a page of
one token is a long prompt's every token.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from time import monotonic
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from tierkv.arraycopy import copy_array
from tierkv.client import Client
from tierkv.integrations.link import ServerLink
from tierkv.integrations.sglang.pages import PageGeometry, page_starts, raw_array

Copy = Callable[[int, npt.NDArray[Any]], None]

PAGES_PER_REQUEST = 1024


def pieces(n: int) -> list[tuple[int, int]]:
    """``[0, n)`` as runs of at most :data:`PAGES_PER_REQUEST`."""
    return [(i, min(n, i + PAGES_PER_REQUEST)) for i in range(0, n, PAGES_PER_REQUEST)]


class PoolStore:
    """One host pool's pages in tierkv: presence, store and load. Thread-safe (the link
    is; page copies of one call touch distinct pages)."""

    def __init__(
        self,
        name: str,
        pool: Any,
        geometry: PageGeometry,
        link: ServerLink,
        log: logging.Logger,
        *,
        stores: bool,
    ) -> None:
        """``stores``: whether this rank writes the pool's pages (False where another rank
        writes the same bytes to a namespace shared by every rank)."""
        self.name = name
        self.pool = pool
        self.geometry = geometry
        self.link = link
        self.stores = stores
        self._log = log
        self._flat_dtype: torch.dtype | None = None
        if geometry.flat:
            self._flat_dtype = pool.get_dummy_flat_data_page().dtype

    # -- presence --------------------------------------------------------------------------
    def deadline(self) -> float:
        """The end (``monotonic()``) of a presence query starting now: ``timeout`` is the
        longest a whole ``batch_exists`` call waits for pages from tiers and peers, however
        many lookups it makes (one per piece, per pool, per probe)."""
        return monotonic() + self.link.settings.timeout

    def leading(self, what: str, hashes: list[bytes], deadline: float | None = None) -> int:
        """How many leading pages of ``hashes`` this namespace holds, after fetching those
        held in slower tiers or on other nodes into the pool, waiting until ``deadline``
        (default: :meth:`deadline`) at most; past it, only the pages the pool holds."""
        if deadline is None:
            deadline = self.deadline()
        held = 0
        for start, stop in pieces(len(hashes)):
            got = self._leading(what, hashes[start:stop], deadline)
            held += got
            if got < stop - start:
                break
        return held

    def _leading(self, what: str, hashes: list[bytes], deadline: float) -> int:
        def exists(client: Client) -> int:
            left = deadline - monotonic()
            if left <= 0:
                # No time left to wait: what the pool holds now, prefetching nothing (a
                # lookup without a request id neither locks nor fetches).
                return client.lookup(hashes=hashes).hits
            rid = f"sglang-{uuid.uuid4().hex}"
            try:
                found = client.lookup(hashes=hashes, request_id=rid)
                hits = client.wait_prefetch(rid, timeout=left) if found.prefetching else found.hits
            finally:
                # The pages are in the pool now; the get that follows reads them by key, so
                # the lookup's locks go (an abandoned prefetch must not pin memory).
                client.end_session(rid)
            return hits

        return self.link.call(what, exists, 0)

    def probe(self, what: str, hashes: list[bytes], deadline: float) -> Callable[[int, int], int]:
        """``probe(start, stop)``: :meth:`leading` of ``hashes[start:stop]`` by
        ``deadline``."""
        return lambda start, stop: self.leading(what, hashes[start:stop], deadline)

    # -- copies ----------------------------------------------------------------------------
    def store(
        self, what: str, hashes: list[bytes], host_indices: Any, *, exact: bool
    ) -> list[bool]:
        """Store the pages at ``host_indices`` under ``hashes``: True for each page tierkv
        holds afterwards. ``exact``: ``host_indices`` must hold exactly a page's worth per
        page (v2), else at least that many (v1)."""
        n = len(hashes)
        if not self.stores:
            return [True] * n  # another rank stores these same bytes
        copies = self._copies(what, host_indices, n, exact)
        if copies is None:
            return [False] * n
        gather, _ = copies

        def store(client: Client, start: int, stop: int) -> set[int]:
            done = client.store(
                hashes=hashes[start:stop], gather=lambda c, dst: gather(start + c, dst)
            )
            return done.held

        return self._by_piece(what, n, store)

    def load(self, what: str, hashes: list[bytes], host_indices: Any, *, exact: bool) -> list[bool]:
        """Read the pages of ``hashes`` into the host pool at ``host_indices``: True for
        each page read."""
        n = len(hashes)
        copies = self._copies(what, host_indices, n, exact)
        if copies is None:
            return [False] * n
        _, scatter = copies

        def load(client: Client, start: int, stop: int) -> set[int]:
            got = client.retrieve(
                hashes=hashes[start:stop], scatter=lambda c, src: scatter(start + c, src)
            )
            return set(got.retrieved)

        return self._by_piece(what, n, load)

    def _by_piece(
        self, what: str, n: int, call: Callable[[Client, int, int], set[int]]
    ) -> list[bool]:
        """``call(client, start, stop)`` for each piece of ``n`` pages (the pages it moved,
        counted from ``start``): True for each page moved."""
        out: list[bool] = []
        for start, stop in pieces(n):

            def piece(client: Client, start: int = start, stop: int = stop) -> list[bool]:
                moved = call(client, start, stop)
                return [i in moved for i in range(stop - start)]

            out += self.link.call(what, piece, [False] * (stop - start))
        return out

    def _copies(
        self, what: str, host_indices: Any, count: int, exact: bool
    ) -> tuple[Copy, Copy] | None:
        """``(gather, scatter)`` between chunk slots and the ``count`` pages at
        ``host_indices``, or None (logged) for indices that do not name them."""
        pool = self.pool
        try:
            if not isinstance(host_indices, torch.Tensor):
                raise TypeError(f"host indices must be a tensor, not {type(host_indices)}")
            if exact:
                starts = page_starts(pool, host_indices, count)
            else:
                have, need = int(host_indices.numel()), count * self.geometry.page_size
                if have < need:
                    raise ValueError(f"{count} pages need {need} host indices, got {have}")
                starts = page_starts(pool, host_indices[:need], count)
            if any(s < 0 or s >= int(pool.size) for s in starts):
                raise IndexError(f"host indices outside the {self.name} pool")
            if not self.geometry.flat:
                views = [raw_array(pool.get_data_page(s, flat=False)) for s in starts]
        except (ValueError, TypeError, IndexError, AttributeError, RuntimeError) as exc:
            self._log.warning("tierkv %s: %s (%s pool): %s", self.link.what, what, self.name, exc)
            return None
        if not self.geometry.flat:
            return (
                lambda c, dst: copy_array(dst, views[c]),
                lambda c, src: copy_array(views[c], src),
            )
        dtype = self._flat_dtype

        def gather(c: int, dst: npt.NDArray[Any]) -> None:
            page = pool.get_data_page(starts[c], flat=True).contiguous().view(torch.uint8)
            copy_array(dst.reshape(-1), page.numpy())

        def scatter(c: int, src: npt.NDArray[Any]) -> None:
            flat = torch.from_numpy(np.ascontiguousarray(src).reshape(-1)).view(dtype)
            pool.set_from_flat_data_page(starts[c], flat)

        return gather, scatter
