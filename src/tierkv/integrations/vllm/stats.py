"""The connector's statistics through vLLM's own channels: its log line and ``/metrics``.

vLLM (0.32) collects a connector's :class:`KVConnectorStats` from every worker and from the
scheduler after each step (``get_kv_connector_stats``), adds them up with ``aggregate``, sends
the ``data`` dict to the front-end process, and there rebuilds the object with the connector's
``build_kv_connector_stats`` (for its periodic log line, ``reduce``) and hands the dict to the
:class:`KVConnectorPromMetrics` the connector's ``build_prom_metrics`` made (for ``/metrics``).

:class:`TierKVStats` holds counts for one interval, in plain numbers (msgpack carries them):

- ``ranks``: per worker rank (a string key), what that rank loaded and stored
  (:data:`RANK_FIELDS`). Ranks are kept apart because ``aggregate`` adds up both the ranks of
  one step and the steps of one interval: with tensor parallelism every rank loads the same
  tokens (its share of their bytes), so tokens and chunks are the most any rank moved, and
  bytes and seconds are summed over ranks.
- ``hit_tokens``: the external hit tokens vLLM took from tierkv, by where the server found
  each chunk: ``pool`` (already in its shared-memory pool), a tier's name (``disk``,
  ``redis``, ``valkey``, ``s3``: prefetched into the pool for this lookup) or ``peer``
  (another node of a cluster). ``hit_requests``: the requests with such a hit.

The worker side takes its interval from its running totals (no work on the hot path beyond
the counters it already keeps); the scheduler side counts hits as vLLM accepts them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

# What each rank reports, per interval.
RANK_FIELDS = (
    "loaded_chunks",
    "loaded_tokens",
    "load_bytes",
    "load_seconds",
    "failed_blocks",
    "stored_chunks",
    "stored_tokens",
    "store_bytes",
    "store_seconds",
)
# Summed over ranks (each rank moves its own share); the others are the most any rank moved.
_SUMMED = frozenset({"load_bytes", "store_bytes", "load_seconds", "store_seconds"})
# Where a hit chunk came from, besides the tiers' names.
POOL, PEER = "pool", "peer"


def _number(value: Any, what: str) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"tierkv stats: {what} must be a number, not {value!r}")
    if value < 0:
        raise ValueError(f"tierkv stats: {what} must not be negative ({value})")
    return value


def _counts(value: Any, what: str) -> dict[str, int | float]:
    if not isinstance(value, Mapping):
        raise ValueError(f"tierkv stats: {what} must be a mapping, not {type(value).__name__}")
    return {str(k): _number(v, f"{what}[{k!r}]") for k, v in value.items()}


def _add(into: dict[str, int | float], more: Mapping[str, int | float]) -> None:
    for key, value in more.items():
        if value:
            into[key] = into.get(key, 0) + value


@dataclass
class TierKVStats(KVConnectorStats):  # type: ignore[misc]
    """One interval's loads, stores and hits (see the module doc)."""

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        data = self.data
        ranks = data.get("ranks", {})
        if not isinstance(ranks, Mapping):
            raise ValueError("tierkv stats: 'ranks' must be a mapping of rank to counts")
        unknown = set(data) - {"ranks", "hit_tokens", "hit_requests"}
        if unknown:
            raise ValueError(f"tierkv stats: unknown fields {sorted(unknown)}")
        checked: dict[str, dict[str, int | float]] = {}
        for rank, counts in ranks.items():
            fields = _counts(counts, f"ranks[{rank!r}]")
            bad = set(fields) - set(RANK_FIELDS)
            if bad:
                raise ValueError(f"tierkv stats: unknown rank fields {sorted(bad)}")
            checked[str(rank)] = fields
        self.data = {
            "ranks": checked,
            "hit_tokens": _counts(data.get("hit_tokens", {}), "hit_tokens"),
            "hit_requests": _number(data.get("hit_requests", 0), "hit_requests"),
        }

    @classmethod
    def for_rank(cls, rank: int, counts: Mapping[str, int | float]) -> TierKVStats:
        """One worker rank's counts (zeros left out)."""
        return cls({"ranks": {str(rank): {k: v for k, v in counts.items() if v}}})

    @classmethod
    def for_hits(cls, hit_tokens: Mapping[str, int], hit_requests: int) -> TierKVStats:
        """The scheduler's hits: external tokens by source, and the requests with any."""
        return cls({"hit_tokens": dict(hit_tokens), "hit_requests": hit_requests})

    @property
    def ranks(self) -> dict[str, dict[str, int | float]]:
        """Per rank, its counts."""
        return cast("dict[str, dict[str, int | float]]", self.data["ranks"])

    @property
    def hit_tokens(self) -> dict[str, int | float]:
        """External hit tokens by source."""
        return cast("dict[str, int | float]", self.data["hit_tokens"])

    @property
    def hit_requests(self) -> int | float:
        """Requests with an external hit."""
        return cast("int | float", self.data["hit_requests"])

    def reset(self) -> None:
        self.data = {"ranks": {}, "hit_tokens": {}, "hit_requests": 0}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not isinstance(other, TierKVStats):
            raise TypeError(f"cannot add {type(other).__name__} to tierkv's stats")
        ranks = self.ranks
        for rank, counts in other.ranks.items():
            _add(ranks.setdefault(rank, {}), counts)
        _add(self.hit_tokens, other.hit_tokens)
        self.data["hit_requests"] = self.hit_requests + other.hit_requests
        return self

    def totals(self) -> dict[str, int | float]:
        """The engine's figures for the interval: every rank field, combined over ranks."""
        per_rank = list(self.ranks.values())
        out: dict[str, int | float] = {}
        for name in RANK_FIELDS:
            values = [counts.get(name, 0) for counts in per_rank] or [0]
            out[name] = sum(values) if name in _SUMMED else max(values)
        return out

    def reduce(self) -> dict[str, int | float]:
        out = self.totals()
        out["load_seconds"] = round(float(out["load_seconds"]), 6)
        out["store_seconds"] = round(float(out["store_seconds"]), 6)
        out["hit_requests"] = self.hit_requests
        for source, tokens in sorted(self.hit_tokens.items()):
            out[f"hit_tokens_{source}"] = tokens
        return out

    def is_empty(self) -> bool:
        return (
            not any(any(counts.values()) for counts in self.ranks.values())
            and not any(self.hit_tokens.values())
            and not self.hit_requests
        )


# The Prometheus counters (``_total`` is appended on export), from the interval's totals.
COUNTERS: dict[str, tuple[str, str]] = {
    "loaded_tokens": ("vllm:tierkv_loaded_tokens", "Tokens of KV loaded from tierkv."),
    "loaded_chunks": ("vllm:tierkv_loaded_chunks", "Chunks loaded from tierkv."),
    "load_bytes": ("vllm:tierkv_loaded_bytes", "Bytes loaded from tierkv (all ranks)."),
    "load_seconds": (
        "vllm:tierkv_load_seconds",
        "Seconds the workers spent loading from tierkv (all ranks).",
    ),
    "failed_blocks": (
        "vllm:tierkv_load_failed_blocks",
        "Blocks a load from tierkv did not fill (vLLM recomputed them).",
    ),
    "stored_tokens": ("vllm:tierkv_stored_tokens", "Tokens of KV stored into tierkv."),
    "stored_chunks": ("vllm:tierkv_stored_chunks", "Chunks stored into tierkv."),
    "store_bytes": ("vllm:tierkv_stored_bytes", "Bytes stored into tierkv (all ranks)."),
    "store_seconds": (
        "vllm:tierkv_store_seconds",
        "Seconds the workers spent storing into tierkv (all ranks).",
    ),
}
HIT_REQUESTS = "vllm:tierkv_hit_requests"
HIT_TOKENS = "vllm:tierkv_hit_tokens"


class TierKVPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """tierkv's counters in vLLM's ``/metrics`` (labelled like vLLM's own per engine)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for field_name, (name, doc) in COUNTERS.items():
            self._counters[field_name] = self._per_engine(name, doc, labelnames)
        self._counters["hit_requests"] = self._per_engine(
            HIT_REQUESTS,
            "Requests that loaded a prefix from tierkv.",
            labelnames,
        )
        self._hit_tokens = self._counter_cls(
            name=HIT_TOKENS,
            documentation=(
                "External prefix-cache hit tokens vLLM took from tierkv, by where the server "
                "found them: pool (its shared-memory pool), peer (another node) or a tier "
                "(disk, redis, valkey, s3)."
            ),
            labelnames=[*labelnames, "source"],
        )

    def _per_engine(self, name: str, doc: str, labelnames: list[str]) -> dict[int, Any]:
        metric = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        stats = TierKVStats(transfer_stats_data)
        totals: dict[str, int | float] = stats.totals()
        totals["hit_requests"] = stats.hit_requests
        for field_name, counters in self._counters.items():
            value = totals.get(field_name, 0)
            if value:
                counters[engine_idx].inc(value)
        labels = self.per_engine_labelvalues[engine_idx]
        for source, tokens in stats.hit_tokens.items():
            if tokens:
                self._hit_tokens.labels(*labels, source).inc(tokens)
