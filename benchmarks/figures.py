"""The catalogue of benchmark figures: what each one measures, its bound and its goal.

A figure is one value of a script's summary line (``script``, the line's ``line`` name and
``key``; see ``summary_line.py``). Its ``bound`` says what it is compared against, measured
in the same run; ``bound_key`` names the bound's own value where the summary prints it (the
charts draw it beside the figure). ``per`` makes a figure the ratio of two values of the same
run (the KV router's hit rate over the oracle's). Goals come from the issues that set them.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

_COMPARE: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    "<": operator.lt,
    "==": operator.eq,
}


@dataclass(frozen=True)
class Goal:
    """A figure meets its goal when ``figure <comparator> value``."""

    comparator: str
    value: float

    def __post_init__(self) -> None:
        if self.comparator not in _COMPARE:
            raise ValueError(f"unknown comparator {self.comparator!r}")

    def met(self, figure: float) -> bool:
        return _COMPARE[self.comparator](figure, self.value)

    def __str__(self) -> str:
        return f"{self.comparator} {self.value:g}"


@dataclass(frozen=True)
class Figure:
    script: str  # benchmarks/<script>
    line: str  # the summary line's name
    key: str
    unit: str  # "x" for a ratio
    measures: str  # in a few words
    bound: str  # what the figure is compared against
    goal: Goal | None = None
    bound_key: tuple[str, str] | None = None  # (line, key) of the bound's value, if printed
    per: tuple[str, str] | None = None  # (line, key): the figure is key / this value
    name: str = ""  # the name shown; key by default

    @property
    def title(self) -> str:
        return self.name or self.key

    @property
    def figure_id(self) -> str:
        return f"{self.script}:{self.line}.{self.title}"


def _fig(
    script: str,
    key: str,
    unit: str,
    measures: str,
    bound: str,
    *,
    line: str | None = None,
    goal: Goal | None = None,
    bound_key: tuple[str, str] | None = None,
    per: tuple[str, str] | None = None,
    name: str = "",
) -> Figure:
    line = line or script.removesuffix(".py")
    return Figure(script, line, key, unit, measures, bound, goal, bound_key, per, name)


MEMCPY = "memcpy of the same bytes"
X = "x"

FIGURES: tuple[Figure, ...] = (
    _fig("hashing.py", "hash_128k_tokens_ms", "ms", "128k tokens to 512 chained chunk keys",
         "SHA-256 of the same bytes, one call", goal=Goal("<=", 5)),
    _fig("bookkeeping.py", "batch16", "us", "index cost per chunk, batches of 16",
         "none: an absolute time", line="bookkeeping_us_per_chunk", goal=Goal("<=", 10)),
    _fig("bookkeeping.py", "batch512", "us", "index cost per chunk, batches of 512",
         "none: an absolute time", line="bookkeeping_us_per_chunk", goal=Goal("<=", 10)),
    _fig("bookkeeping.py", "batch16", "us", "the same with tenant quotas, 16",
         "none: an absolute time", line="bookkeeping_quotas_us_per_chunk", goal=Goal("<=", 10),
         name="quotas_batch16"),
    _fig("bookkeeping.py", "batch512", "us", "the same with tenant quotas, 512",
         "none: an absolute time", line="bookkeeping_quotas_us_per_chunk", goal=Goal("<=", 10),
         name="quotas_batch512"),
    _fig("prefault.py", "first_write_cold_gbps", "GB/s", "1 GiB pool, first write, no prefault",
         MEMCPY + " (memcpy_gbps)", bound_key=("prefault", "memcpy_gbps")),
    _fig("prefault.py", "first_write_prefault_gbps", "GB/s", "the same with --prefault",
         MEMCPY + " (memcpy_gbps)", bound_key=("prefault", "memcpy_gbps")),
    _fig("shm_path.py", "store_vs_memcpy", X, "store of 16 x 8 MiB through the server",
         MEMCPY, goal=Goal(">=", 0.8)),
    _fig("shm_path.py", "retrieve_vs_memcpy", X, "retrieve of 16 x 8 MiB", MEMCPY,
         goal=Goal(">=", 0.8)),
    _fig("shm_path.py", "store_vs_pickle", X, "store against a pickling client",
         "pickle over a socket", goal=Goal(">=", 10)),
    _fig("shm_path.py", "lookup1_p50_us", "us", "lookup of 1 stored chunk, p50",
         "none: an absolute time", goal=Goal("<=", 150)),
    _fig("shm_path.py", "lookup512_p50_us", "us", "lookup of 512 chunks, hashing included",
         "none: an absolute time; next goal <= 1000", goal=Goal("<=", 2000)),
    _fig("shm_path.py", "events_store_overhead", X, "a store's extra time with KV events on",
         "the same stores without events"),
    _fig("tiers.py", "disk_write_vs_raw", X, "8 MiB chunks written to the disk tier",
         "plain file writes", goal=Goal(">=", 0.8)),
    _fig("tiers.py", "disk_read_vs_raw", X, "read from the disk tier", "plain file reads",
         goal=Goal(">=", 0.8)),
    _fig("tiers.py", "redis_set_vs_raw", X, "SET through the Redis tier", "redis-py SET"),
    _fig("tiers.py", "redis_get_vs_raw", X, "GET through the Redis tier", "redis-py GET"),
    _fig("peers.py", "fetch_vs_raw_tcp", X, "32 x 8 MiB fetched from a peer",
         "one raw TCP stream, same bytes", goal=Goal(">=", 0.8)),
    _fig("peers.py", "directory_lookup512_p50_us", "us", "512-chunk cross-node directory lookup",
         "none: an absolute time", goal=Goal("<=", 2000)),
    _fig("peers.py", "fetch_vs_raw_tcp", X, "the same fetch, a core kept busy (--busy-cores 1)",
         "one raw TCP stream, same bytes, same run", line="peers_busy", goal=Goal(">=", 0.8),
         name="busy_fetch_vs_raw_tcp"),
    _fig("peers.py", "directory_lookup512_p50_us", "us", "the same lookup, a core kept busy",
         "none: an absolute time", line="peers_busy", goal=Goal("<=", 2000),
         name="busy_directory_lookup512_p50_us"),
    _fig("peers.py", "immediate_remote_hit", X, "lookups on B right after a store on A that hit",
         "all of them"),
    _fig("peers.py", "commit_publish_wait_us", "us", "a store's wait for the directory owners",
         "the same store without the wait"),
    _fig("directory_repair.py", "core_share_pct", "%", "one repair round of 100k keys, per core",
         "one core", goal=Goal("<=", 2)),
    _fig("directory_repair.py", "put_overhead", X, "storing an entry with summaries",
         "the same without summaries"),
    _fig("silent_peer.py", "worst_rest_over_timeout", X, "worst operation after a frozen peer's "
         "first timeout", "the peer timeout (2 s)", goal=Goal("<=", 0.05)),
    _fig("load.py", "engines8_store_vs_memcpy", X, "8 engines storing 32k-token prompts",
         "8-thread memcpy, same bytes", line="load", goal=Goal(">=", 0.8)),
    _fig("load.py", "engines8_retrieve_vs_memcpy", X, "8 engines retrieving",
         "8-thread memcpy, same bytes", line="load", goal=Goal(">=", 0.8)),
    _fig("load.py", "engines8_lookup_p99_ms", "ms", "lookup p99 beside 8 engines",
         "a bare round trip under the same load (floor)", line="load", goal=Goal("<=", 5),
         bound_key=("floor", "engines8_roundtrip_p99_ms")),
    _fig("load.py", "lookup_p99_under_transfer_ms", "ms", "lookup p99 during peer/tier transfers",
         "a bare round trip under the same load (floor)", line="load", goal=Goal("<=", 5),
         bound_key=("floor", "under_transfer_roundtrip_p99_ms")),
    _fig("controller.py", "lookup512_wire_p50_us", "us",
         "512-chunk lookup through a controller holding 100 x 1M chunks, over the wire",
         "none: an absolute time", goal=Goal("<=", 2000)),
    _fig("controller.py", "full_report_ms", "ms", "one instance's full report of 1M keys applied",
         "none: an absolute time", goal=Goal("<=", 60)),
    _fig("controller.py", "lookup512_wire_p50_us", "us", "the same, a core kept busy "
         "(--busy-cores 1)", "none: an absolute time", line="controller_busy",
         goal=Goal("<=", 2000), name="busy_lookup512_wire_p50_us"),
    _fig("controller.py", "full_report_ms", "ms", "the same, a core kept busy",
         "none: an absolute time", line="controller_busy", goal=Goal("<=", 60),
         name="busy_full_report_ms"),
    _fig("controller.py", "full_report_tp4_ms", "ms", "a full report of 1M keys of 4 "
         "namespaces (an engine with 4 tensor-parallel ranks)", "none: an absolute time",
         goal=Goal("<=", 60)),
    _fig("router_load.py", "routers_vs_idle", X, "engine lookup p99 beside 50 routers",
         "the same lookups, idle", goal=Goal("<=", 2)),
    _fig("router_load.py", "quota_1000_ms", "ms", "GET /quota of 1,000 tenants",
         "none: an absolute time", goal=Goal("<", 100)),
    _fig("kv_router.py", "hit_rate", X, "KV router's prompt-token hit rate", "the oracle's",
         line="router", per=("router", "oracle_hit_rate"), name="hit_rate_vs_oracle",
         goal=Goal(">=", 0.95)),
    _fig("kv_router.py", "ttft_vs_round_robin", X, "mean TTFT behind the KV router",
         "round-robin's", line="router"),
    _fig("sglang_backend.py", "set_vs_memcpy", X, "SGLang batch_set_v1 of 32 x 8 MiB pages",
         "2-thread memcpy, same bytes", line="sglang", goal=Goal(">=", 0.7)),
    _fig("sglang_backend.py", "get_vs_memcpy", X, "batch_get_v1", "2-thread memcpy, same bytes",
         line="sglang", goal=Goal(">=", 0.7)),
    _fig("sglang_backend.py", "get_vs_file", X, "batch_get_v1 against SGLang's file backend",
         "SGLang's file backend", line="sglang", goal=Goal(">=", 2)),
    _fig("sglang_backend.py", "immediate_remote_hit", X, "cross-node lookups right after a set",
         "all of them", line="sglang", goal=Goal("==", 1)),
    _fig("vllm_ttft.py", "speedup", X, "TTFT of an 8300-token prompt, cold over warm",
         "vLLM without tierkv, same prompts", goal=Goal(">=", 3)),
    _fig("vllm_ttft.py", "overhead", X, "cold requests' extra TTFT with tierkv",
         "vLLM without tierkv", goal=Goal("<=", 0.03)),
    _fig("vllm_ttft.py", "store_vs_memcpy", X, "the connector's stores",
         "one-thread memcpy of the same chunks", goal=Goal(">=", 0.7)),
    _fig("vllm_ttft.py", "load_vs_memcpy", X, "the connector's loads",
         "one-thread memcpy of the same chunks", goal=Goal(">=", 0.7)),
    _fig("vllm_models.py", "min_speedup", X, "warm-vs-cold TTFT, least of the model kinds",
         "vLLM without tierkv", goal=Goal(">=", 3)),
    _fig("vllm_models.py", "min_store_vs_memcpy", X, "stores, least of the model kinds",
         "memcpy of the same chunks", goal=Goal(">=", 0.7)),
    _fig("vllm_models.py", "min_load_vs_memcpy", X, "loads, least of the model kinds",
         "memcpy of the same chunks", goal=Goal(">=", 0.7)),
)  # fmt: skip

SCRIPTS: tuple[str, ...] = tuple(dict.fromkeys(f.script for f in FIGURES))
