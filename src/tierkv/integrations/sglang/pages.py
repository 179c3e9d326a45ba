"""SGLang host-pool pages as tierkv chunks: geometry, views and keys.

One SGLang page (``page_size`` tokens of every layer of one rank) is one tierkv chunk. The
chunk holds the page's bytes in the host pool's own order: for each layout the shape of
``get_data_page(index, flat=False)``, which is also the order of SGLang's flat data pages
(the generic ``get``/``set`` calls), so the flat and zero-copy paths agree byte for byte::

    MHA layer_first        [2, layers, page, heads, dim]   (K then V)
    MHA page_first         [2, page, layers, heads, dim]
    MHA page_first_direct  [2, 1, layers, page, heads, dim]
    MHA page_head          [2, 1, heads, page, layers, dim]
    MLA layer_first        [layers, page, 1, kv_dim]
    MLA page_first         [page, layers, 1, kv_dim]
    MLA page_first_direct  [1, layers, page, 1, kv_dim]

A hybrid model's other host pools (HiCache's v2 interface) page the same way where they are
standard-attention or MLA pools (sliding-window or draft KV); Mamba states and DSA indexer
pages move as SGLang's flat data pages (:func:`flat_geometry`).

Since layouts order the same bytes differently, the layout is part of the namespace, as are
the pool kind, page size and dtype: pages are shared only where the bytes mean the same.
A page's view is a view of the host pool's buffer, so moving it is one copy between the
host pool and the tierkv slot (:func:`tierkv.arraycopy.copy_array`, on the client's copy
threads).

Keys: SGLang names pages by strings (the hex SHA-256 of a prefix-chained page hash, or
backend-defined strings); :func:`page_hash` turns each into the bytes tierkv keys by.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy.typing as npt

from tierkv.arraycopy import host_view
from tierkv.keys import from_hex

# The axis of the page's tokens in get_data_page(index, flat=False), per kind and layout.
TOKEN_AXIS = {
    ("mha", "layer_first"): 2,
    ("mha", "page_first"): 1,
    ("mha", "page_first_direct"): 3,
    ("mha", "page_head"): 3,
    ("mla", "layer_first"): 1,
    ("mla", "page_first"): 0,
    ("mla", "page_first_direct"): 2,
}


class UnsupportedPoolError(ValueError):
    """A host pool (class, layout or option) the tierkv backend cannot store."""


@dataclass(frozen=True, slots=True)
class PageGeometry:
    """How one host pool's pages look as tierkv chunks."""

    kind: str  # "mha" or "mla"
    layout: str  # SGLang's host layout name
    page_size: int  # tokens per page
    shape: tuple[int, ...]  # one page, in the host pool's order
    token_axis: int
    dtype: str  # tierkv's name of the KV dtype (torch's, without "torch.")
    elements: int  # elements in one page
    nbytes: int  # bytes in one page
    signature: str = ""  # flat pages: a digest of what their bytes hold (see flat_geometry)

    @property
    def format_tag(self) -> str:
        """What the chunk bytes mean, for the namespace."""
        tag = f"sglang-{self.kind}-{self.layout}-p{self.page_size}"
        return f"{tag}-{self.signature}" if self.signature else tag

    @property
    def flat(self) -> bool:
        """Whether pages move as SGLang's flat data pages (a copy each way) rather than as
        views of the host buffer."""
        return bool(self.signature)


def geometry_of(pool: Any) -> PageGeometry:
    """The page geometry of an SGLang host pool; :class:`UnsupportedPoolError` names what
    is not supported (hybrid pool groups, other pool classes, layouts, DCP sharding)."""
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    kinds = {MHATokenToKVPoolHost: "mha", MLATokenToKVPoolHost: "mla"}
    kind = kinds.get(type(pool))
    if kind is None:
        raise UnsupportedPoolError(
            f"tierkv stores SGLang's standard-attention (MHATokenToKVPoolHost) and MLA "
            f"(MLATokenToKVPoolHost) host pools as the KV pool, not {type(pool).__name__} "
            "(a hybrid model's other pools come through register_mem_host_pool_v2)"
        )
    layout = str(pool.layout)
    if (kind, layout) not in TOKEN_AXIS:
        supported = sorted(lay for k, lay in TOKEN_AXIS if k == kind)
        raise UnsupportedPoolError(
            f"tierkv does not support the {kind.upper()} host layout {layout!r}; use one of "
            f"{supported} (--hicache-mem-layout)"
        )
    if getattr(pool, "dcp_size", 1) != 1:
        raise UnsupportedPoolError("tierkv does not support decode context parallel (DCP) pools")
    if getattr(pool, "kv_buffer", None) is None:
        raise UnsupportedPoolError("the host pool has no KV buffer (allocator-only pool)")
    page_size = int(pool.page_size)
    view = pool.get_data_page(0, flat=False)
    if view.untyped_storage().data_ptr() != pool.kv_buffer.untyped_storage().data_ptr():
        raise UnsupportedPoolError(f"{kind} {layout}: a page is not a view of the host pool")
    shape = tuple(int(d) for d in view.shape)
    axis = TOKEN_AXIS[(kind, layout)]
    if shape[axis] != page_size:
        raise UnsupportedPoolError(
            f"{kind} {layout}: page shape {shape} does not hold {page_size} tokens on axis {axis}"
        )
    dtype = str(pool.dtype).removeprefix("torch.")
    elements = int(view.numel())
    nbytes = elements * int(view.element_size())
    return PageGeometry(kind, layout, page_size, shape, axis, dtype, elements, nbytes)


def sidecar_geometry(pool: Any, name: str) -> PageGeometry:
    """The page geometry of a hybrid model's extra host pool ``name``: a standard-attention
    or MLA pool (sliding-window or draft KV) pages as views, as the KV pool; any other pool
    tierkv knows (Mamba states, DSA indexer pages) as flat data pages."""
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    if type(pool) in (MHATokenToKVPoolHost, MLATokenToKVPoolHost):
        return geometry_of(pool)
    return flat_geometry(pool, name)


def flat_geometry(pool: Any, kind: str) -> PageGeometry:
    """The geometry of a sidecar host pool whose pages are not views of one buffer (Mamba
    states: several tensors of several dtypes per slot; DSA indexer pages): a page moves as
    SGLang's flat data page (``get_data_page(i, flat=True)``, ``set_from_flat_data_page``),
    its bytes in the order SGLang's own backends store them. The chunk is those bytes, as
    ``[page_size, bytes per token]`` uint8. ``signature`` digests the pool's per-page
    description (:func:`page_description`), so that pools whose bytes mean something else
    never share pages even where the sizes agree."""
    for method in ("get_data_page", "set_from_flat_data_page", "get_dummy_flat_data_page"):
        if not callable(getattr(pool, method, None)):
            raise UnsupportedPoolError(
                f"the {kind} host pool ({type(pool).__name__}) has no {method}: tierkv "
                "cannot copy its pages"
            )
    description = page_description(pool)
    page_size = int(pool.page_size)
    try:
        dummy = pool.get_dummy_flat_data_page()
        page = pool.get_data_page(0, flat=True)
    except (TypeError, ValueError, AttributeError, IndexError, RuntimeError) as exc:
        raise UnsupportedPoolError(f"{kind}: its pages cannot be read ({exc})") from exc
    nbytes = int(dummy.numel()) * int(dummy.element_size())
    if int(page.numel()) * int(page.element_size()) != nbytes:
        raise UnsupportedPoolError(
            f"{kind}: a data page holds {page.numel() * page.element_size()} bytes, its "
            f"flat page {nbytes}"
        )
    if page_size < 1 or nbytes == 0 or nbytes % page_size:
        raise UnsupportedPoolError(f"{kind}: {nbytes} bytes per page of {page_size} tokens")
    signature = hashlib.sha256(repr(description).encode()).hexdigest()[:16]
    layout = str(getattr(pool, "layout", "flat"))
    shape = (page_size, nbytes // page_size)
    return PageGeometry(kind, layout, page_size, shape, 0, "uint8", nbytes, nbytes, signature)


def page_description(pool: Any) -> tuple[Any, ...]:
    """What one page of a flat-page sidecar pool holds, independent of the pool's size:
    the class, and per component its shape and dtype (:class:`UnsupportedPoolError` for a
    class tierkv does not know how to describe)."""
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    if isinstance(pool, MambaPoolHost):
        return (
            "mamba",
            str(pool.layout),
            int(pool.num_mamba_layers),
            tuple(pool.temporal_state_shape),
            str(pool.temporal_dtype),
            tuple(tuple(s) for s in pool.conv_state_shapes),
            str(pool.conv_dtype),
            tuple((tuple(t.shape[1:]), str(t.dtype)) for t in pool.slot_state_device_tensors),
        )
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost

    if isinstance(pool, DSAIndexerPoolHost):
        return (
            "dsa-indexer",
            str(pool.layout),
            int(pool.page_size),
            int(pool.layer_num),
            int(pool.indexer_page_stride_size),
            str(pool.indexer_dtype),
        )
    raise UnsupportedPoolError(
        f"tierkv does not know the pages of SGLang's {type(pool).__name__} host pool"
    )


def page_starts(pool: Any, host_indices: Any, count: int) -> list[int]:
    """The first host index of each of the ``count`` pages that ``host_indices`` name:
    exactly a page's worth of indices per page (ValueError otherwise)."""
    page_size = int(pool.page_size)
    have = 0 if host_indices is None else int(host_indices.numel())
    if have != count * page_size:
        raise ValueError(f"{count} pages need {count * page_size} host indices, got {have}")
    return [int(i) for i in host_indices[::page_size].tolist()]


def raw_array(tensor: Any) -> npt.NDArray[Any]:
    """The numpy view (:func:`tierkv.arraycopy.host_view`) of a tensor of SGLang's host
    pool, which is in host memory (:class:`UnsupportedPoolError` otherwise)."""
    view = host_view(tensor)
    if view is None:
        raise UnsupportedPoolError(
            f"a host pool tensor on {tensor.device} with {tensor.element_size()}-byte elements: "
            "tierkv copies pages in host memory only"
        )
    return view


# Tags keep the three key forms apart, so no string of one form maps to the bytes of another.
_HEX, _TEXT, _LONG = b"\x00", b"\x01", b"\x02"
_MAX_TEXT = 63  # tierkv takes hashes of up to 64 bytes


def page_hash(key: str) -> bytes:
    """The hash bytes tierkv keys page ``key`` by: a 64-digit hex digest as its 32 bytes,
    other strings as their UTF-8 (folded with SHA-256 when longer than 63 bytes)."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"a page key must be a non-empty str, got {key!r}")
    if len(key) == 64:
        try:
            return _HEX + from_hex(key)
        except ValueError:
            pass
    raw = key.encode("utf-8")
    if len(raw) <= _MAX_TEXT:
        return _TEXT + raw
    return _LONG + hashlib.sha256(raw).digest()
