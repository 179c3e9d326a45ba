"""The SGLang HiCache storage backend for tierkv (SGLang's L3 tier).

Load it into SGLang (with ``--enable-hierarchical-cache``) as a dynamic backend::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "tierkv",
        "module_path": "tierkv.integrations.sglang", "class_name": "TierKVStorage",
        "interface_v1": 1, "endpoint": "ipc:///run/tierkv/default/rpc.sock"}'

``interface_v1`` makes SGLang use the zero-copy calls (one copy per page between its host
pool and tierkv's shared memory). Hybrid models (Mamba, sliding-window, DSA indexer pools)
need nothing more: SGLang's hybrid cache controller registers their extra host pools and
moves them through the v2 calls. ``backend.py`` is the backend, ``pool_store.py`` one host
pool's pages in tierkv, ``hit_policy.py`` where a hybrid prefix can be restored,
``pages.py`` maps host-pool pages to tierkv chunks, ``settings.py`` reads tierkv's keys of
the extra config.

``TierKVStorage`` is resolved lazily, so the helper modules import without SGLang installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TierKVStorage"]


def __getattr__(name: str) -> Any:
    if name == "TierKVStorage":
        from tierkv.integrations.sglang.backend import TierKVStorage

        return TierKVStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
