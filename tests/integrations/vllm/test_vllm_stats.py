"""The connector's statistics object and Prometheus metrics (:mod:`tierkv.integrations.vllm.
stats`), and the split of a hit by source (:func:`~tierkv.integrations.vllm.scheduler.
tokens_by_source`), in process: vLLM's aggregation across ranks and steps, its reduction for
the log line, the msgpack trip to the front-end process, and bad input."""

from __future__ import annotations

import functools

import msgspec
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

try:
    from tierkv.integrations.vllm.scheduler import tokens_by_source
    from tierkv.integrations.vllm.stats import TierKVPromMetrics, TierKVStats
except ImportError:  # the fixture below fails every test with the reason
    pass

pytestmark = pytest.mark.vllm


LOAD = {"loaded_chunks": 2, "loaded_tokens": 512, "load_bytes": 1000, "load_seconds": 0.5}
STORE = {"stored_chunks": 3, "stored_tokens": 768, "store_bytes": 1500, "store_seconds": 0.25}


def test_ranks_of_a_step_add_up_as_one_engine_and_steps_as_one_interval() -> None:
    # Two tensor-parallel ranks load the same tokens, each its half of the bytes.
    step1 = TierKVStats.for_rank(0, LOAD).aggregate(TierKVStats.for_rank(1, LOAD))
    step1 = step1.aggregate(TierKVStats.for_hits({"pool": 256, "disk": 256}, 1))
    step2 = TierKVStats.for_rank(0, STORE).aggregate(TierKVStats.for_rank(1, STORE))
    interval = step1.aggregate(step2)
    assert isinstance(interval, TierKVStats)
    reduced = interval.reduce()
    assert reduced["loaded_chunks"] == 2 and reduced["loaded_tokens"] == 512
    assert reduced["load_bytes"] == 2000 and reduced["load_seconds"] == 1.0
    assert reduced["stored_chunks"] == 3 and reduced["stored_tokens"] == 768
    assert reduced["store_bytes"] == 3000 and reduced["store_seconds"] == 0.5
    assert reduced["hit_requests"] == 1
    assert (reduced["hit_tokens_pool"], reduced["hit_tokens_disk"]) == (256, 256)
    # A second interval of rank 0 alone adds to its own counts.
    interval.aggregate(TierKVStats.for_rank(0, LOAD))
    assert interval.reduce()["loaded_tokens"] == 1024


def test_the_data_survives_the_trip_to_the_front_end_and_reset_empties_it() -> None:
    stats = TierKVStats.for_rank(3, LOAD).aggregate(TierKVStats.for_hits({"peer": 256}, 1))
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(stats.to_dict()))
    rebuilt = TierKVStats(wire)
    assert rebuilt.reduce() == stats.reduce()
    assert not rebuilt.is_empty()
    rebuilt.reset()
    assert rebuilt.is_empty() and rebuilt.reduce()["loaded_tokens"] == 0
    assert TierKVStats().is_empty() and TierKVStats.for_rank(0, {"loaded_chunks": 0}).is_empty()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"ranks": {"0": {"loaded_chunks": -1}}}, "must not be negative"),
        ({"ranks": {"0": {"loaded_chunks": "2"}}}, "must be a number"),
        ({"ranks": {"0": {"loaded_chunks": True}}}, "must be a number"),
        ({"ranks": {"0": {"teleported": 1}}}, "unknown rank fields"),
        ({"ranks": [1, 2]}, "must be a mapping"),
        ({"hit_tokens": {"pool": None}}, "must be a number"),
        ({"hit_requests": -2}, "must not be negative"),
        ({"surprise": 1}, "unknown fields"),
    ],
)
def test_bad_data_is_refused_with_a_clear_error(data: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TierKVStats(data)


def test_stats_of_another_connector_cannot_be_added() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

    with pytest.raises(TypeError, match="tierkv"):
        TierKVStats().aggregate(KVConnectorStats())


def test_prometheus_counters_add_each_step_per_engine() -> None:
    registry = CollectorRegistry()
    types = {
        kind: functools.partial(kind, registry=registry) for kind in (Gauge, Counter, Histogram)
    }

    class Config:
        kv_transfer_config = None

    metrics = TierKVPromMetrics(Config(), types, ["model_name", "engine"], {0: ["m", "0"]})
    step = TierKVStats.for_rank(0, {**LOAD, **STORE}).aggregate(
        TierKVStats.for_hits({"pool": 256, "disk": 256}, 1)
    )
    metrics.observe(step.to_dict(), 0)
    metrics.observe(TierKVStats.for_rank(0, LOAD).to_dict(), 0)
    labels = {"model_name": "m", "engine": "0"}

    def value(name: str, **more: str) -> float | None:
        return registry.get_sample_value(name, {**labels, **more})

    assert value("vllm:tierkv_loaded_tokens_total") == 1024
    assert value("vllm:tierkv_loaded_bytes_total") == 2000
    assert value("vllm:tierkv_load_seconds_total") == 1.0
    assert value("vllm:tierkv_stored_chunks_total") == 3
    assert value("vllm:tierkv_stored_bytes_total") == 1500
    assert value("vllm:tierkv_hit_requests_total") == 1
    assert value("vllm:tierkv_hit_tokens_total", source="pool") == 256
    assert value("vllm:tierkv_hit_tokens_total", source="disk") == 256
    assert value("vllm:tierkv_load_failed_blocks_total") == 0


def test_a_hit_splits_by_the_source_of_each_chunk_beyond_vllms_own_prefix() -> None:
    runs = (("pool", 1), ("disk", 2), ("pool", 1))  # chunks of 16 tokens
    assert tokens_by_source(runs, 16, 0, 64) == {"pool": 32, "disk": 32}
    # vLLM had the first 24 tokens itself: only the rest is tierkv's hit.
    assert tokens_by_source(runs, 16, 24, 64) == {"disk": 24, "pool": 16}
    assert tokens_by_source(runs, 16, 40, 48) == {"disk": 8}
    assert tokens_by_source((), 16, 0, 32) == {"pool": 32}  # a server that says nothing
    assert tokens_by_source(runs, 16, 64, 64) == {}
