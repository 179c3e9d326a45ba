"""What the connector's two roles tell each other every engine step.

Scheduler -> workers (:class:`TierKVConnectorMetadata`): the loads and stores of this step.
Workers -> scheduler (:class:`TierKVWorkerMetadata`): what the loads actually delivered, so
the scheduler can report it per request and store again what had to be recomputed. vLLM
pickles both across processes and aggregates the workers' metadata over the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from tierkv.integrations.vllm.chunks import LoadSpec, StoreSpec


@dataclass
class TierKVConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)


@dataclass
class TierKVWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Per request: tokens loaded from tierkv (contiguous from the load's start) and, for a
    load that failed in part, the first token that was not loaded."""

    loaded_tokens: dict[str, int] = field(default_factory=dict)
    failed_from: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Combine ranks: a token counts as loaded only if every rank loaded it."""
        if not isinstance(other, TierKVWorkerMetadata):
            return self
        loaded = dict(self.loaded_tokens)
        for rid, n in other.loaded_tokens.items():
            loaded[rid] = min(n, loaded.get(rid, n))
        failed = dict(self.failed_from)
        for rid, n in other.failed_from.items():
            failed[rid] = min(n, failed.get(rid, n))
        return TierKVWorkerMetadata(loaded, failed)
