"""What the connector's two roles tell each other every engine step.

Scheduler -> workers (:class:`TierKVConnectorMetadata`): the loads and stores of this step,
the finished requests whose blocks the scheduler kept (``release``: for a last store planned
in this step, or for stores still running on the workers' store threads; once every store of
such a request submitted so far has ended, each worker reports it to vLLM as finished
sending), the requests vLLM preempted since the last step (``preempted``: their blocks
are free again, so each worker waits for their pending stores before the forward pass), and
how many times the scheduler has registered with the server (``registrations``: a worker that
sees it grow checks its own registration, so that after a server restart it registers again
even if it has nothing to load or store, as a ``kv_consumer`` whose lookups find nothing
while no worker of its engine is registered).
Workers -> scheduler (:class:`TierKVWorkerMetadata`): what each rank's loads and stores
actually did, so the scheduler can report it per request (and per rank) and store again what
had to be recomputed. vLLM pickles both across processes; with several ranks its output
aggregator merges the workers' metadata (:meth:`TierKVWorkerMetadata.aggregate`) before the
scheduler sees it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from tierkv.integrations.vllm.chunks import LoadSpec, StateStore, StoreSpec


@dataclass
class TierKVConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    # A hybrid model's states handed over by vLLM in this step (stored after its forward pass).
    state_stores: list[StateStore] = field(default_factory=list)
    release: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    registrations: int = 0
    # Requests whose prompt is still being computed after this step: they produce no token
    # in it, so none can finish in it (and hand its KV to another engine).
    prefilling: set[str] = field(default_factory=set)


@dataclass
class RankReport:
    """One rank's results in one step, per request id: tokens loaded from tierkv (contiguous
    from the load's start), for a load that failed in part the first token not loaded, and
    the chunks its stores wrote into the pool (new chunks; those already cached not counted)."""

    loaded_tokens: dict[str, int] = field(default_factory=dict)
    failed_from: dict[str, int] = field(default_factory=dict)
    written_chunks: dict[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.loaded_tokens or self.failed_from or self.written_chunks)


@dataclass
class TierKVWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """The reports of one step by rank (one rank's own metadata holds its rank only)."""

    ranks: dict[int, RankReport] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Combine the ranks' metadata (vLLM calls this over the workers' outputs)."""
        if not isinstance(other, TierKVWorkerMetadata):
            return self
        return TierKVWorkerMetadata({**self.ranks, **other.ranks})

    @property
    def loaded_tokens(self) -> dict[str, int]:
        """Per request: a token counts as loaded only if every rank that loaded for the
        request loaded it (the smallest count)."""
        return _smallest(report.loaded_tokens for report in self.ranks.values())

    @property
    def failed_from(self) -> dict[str, int]:
        """Per request: the first token some rank failed to load."""
        return _smallest(report.failed_from for report in self.ranks.values())


def _smallest(per_rank: Iterable[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for values in per_rank:
        for rid, n in values.items():
            out[rid] = min(n, out.get(rid, n))
    return out
