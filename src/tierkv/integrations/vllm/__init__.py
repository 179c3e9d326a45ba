"""The vLLM KV connector for tierkv.

Load it into vLLM (V1 engine) with::

    --kv-transfer-config '{"kv_connector": "TierKVConnector",
                           "kv_connector_module_path": "tierkv.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"endpoint": "ipc:///..."}}'

The scheduler role looks prefixes up (``scheduler.py``), the worker role moves KV between
the paged cache and the pool (``worker.py``); ``layout.py`` detects how the attention backend
lays out its KV cache, ``chunks.py`` maps vLLM blocks to tierkv chunks, ``settings.py``
reads ``kv_connector_extra_config``, ``interface.py`` holds the vLLM versions the connector is
tested with and why each base-class hook it does not implement keeps its default.

``TierKVConnector`` is resolved lazily, so the helper modules import without vLLM installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TierKVConnector"]


def __getattr__(name: str) -> Any:
    if name == "TierKVConnector":
        from tierkv.integrations.vllm.connector import TierKVConnector

        return TierKVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
