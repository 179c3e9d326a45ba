"""The benchmark scripts' summary lines parse into the figures the catalogue names.

The sample outputs are the last lines of real runs, in each script's format (its final
``print``); the catalogue test ties every catalogued figure to a sample and to its script's
source, so that renaming a key in a script or the catalogue alone fails here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import summary_line
from figures import FIGURES, Figure
from summary_line import parse_line, parse_output, parse_value

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

# Each script's trailing output, as its final prints write it (one or more summary lines,
# after a line that is not one).
SAMPLES: dict[str, str] = {
    "hashing.py": """\
  server path within the 5 ms target
hash_128k_tokens_ms=0.487""",
    "bookkeeping.py": """\
on      fresh        512      6.04      5.71      6.50
bookkeeping_us_per_chunk batch1=27.21 batch16=5.69 batch512=4.50
bookkeeping_quotas_us_per_chunk batch1=19.45 batch16=8.84 batch512=6.13""",
    "prefault.py": """\
attach+1st: the same including attach (MAP_POPULATE moves the mapping cost there).
prefault create_cold_ms=1.2 create_prefault_ms=912.4 first_write_cold_gbps=0.62 \
first_write_prefault_gbps=1.66 memcpy_gbps=8.75""",
    "shm_path.py": """\
(whole run 48.3 s)
shm_path store_vs_memcpy=1.330 retrieve_vs_memcpy=1.280 store_vs_pickle=42.10 \
lookup1_p50_us=232.0 lookup512_p50_us=1219.0 events_store_overhead=-0.110""",
    "tiers.py": """\
note: s3: moto is not installed (pip install 'moto[server]'); skipped
tiers disk_write_vs_raw=0.46 disk_read_vs_raw=0.67 redis_set_vs_raw=2.20 redis_get_vs_raw=1.52""",
    "peers.py": """\
NIXL path not measured: nixl is not installed
peers fetch_vs_raw_tcp=0.890 directory_lookup512_p50_us=2748 immediate_remote_hit=1.00 \
commit_publish_wait_us=1686 nixl_ok=0 nixl_transport=none""",
    "peers.py --busy-cores 1": """\
NIXL fetch (LOOKUP + NIXL READs from C + retrieve on D, UCX_TLS=tcp): best 250.1 ms
peers_busy fetch_vs_raw_tcp=0.995 directory_lookup512_p50_us=910 immediate_remote_hit=1.00 \
commit_publish_wait_us=1412 nixl_ok=1 nixl_transport=tcp""",
    "directory_repair.py": """\
digest in sync:     0.95 us; listing one bucket 4.1 ms (a scan of 100000 entries)
directory_repair holder_round_ms=62.0 holder_vs_route=3.10 core_share_pct=1.24 \
put_overhead=1.24 digest_in_sync_us=0.9 listing_ms=4.1""",
    "silent_peer.py": """\
ring held lookup             baseline p50      0.3 ms | frozen: first   2001.2 ms
silent_peer ctl_lookup_rest_max_ms=4.1 ring_store_rest_max_ms=3.2 \
ring_lookup_rest_max_ms=2.9 ring_held_lookup_rest_max_ms=8.0 worst_rest_over_timeout=0.004""",
    "load.py": """\
    floor: p50 0.31 ms p99 4.57 ms
floor engines8_roundtrip_p99_ms=4.57 engines8_steal=0.012 under_transfer_roundtrip_p99_ms=1.73
load engines8_store_vs_memcpy=1.32 engines8_retrieve_vs_memcpy=1.20 \
engines8_lookup_p99_ms=5.94 lookup_p99_under_transfer_ms=9.15""",
    "controller.py": """\
deregister: 7.91 ms (median of [7.9, 8.1, 7.6])
controller lookup_us=2.10 memory_gb=4.41 full_report_ms=52.0 deregister_ms=7.91 \
lookup512_wire_p50_us=1040 full_report_tp4_ms=27.9""",
    "controller.py --busy-cores 1": """\
deregister: 0.04 ms (median of [0.04, 0.03, 0.05])
controller_busy lookup_us=0.21 memory_gb=3.02 full_report_ms=30.8 deregister_ms=0.04 \
lookup512_wire_p50_us=563 full_report_tp4_ms=31.2""",
    "router_load.py": """\
GET /quota: 1000 tenants 16.0 ms, 2000 tenants 30.1 ms, 4000 tenants 44.2 ms
floor idle_p99_ms=1.20 routers_p99_ms=2.10 quota_p99_ms=1.90
router_load idle_p99_ms=3.10 routers_p99_ms=3.66 routers_vs_idle=1.18 quota_1000_ms=16.0 \
quota_2000_ms=30.1 quota_4000_ms=44.2 quota_loop_p99_ms=4.00 quota_vs_idle=1.29 \
router_lookups_per_s=631 server_cpu_ms_per_lookup=0.49 front_cpu_ms_per_lookup=1.00""",
    "kv_router.py": """\
goal: router hit rate >= 0.95 x oracle: 0.674 vs 0.640
router hit_rate=0.674 oracle_hit_rate=0.674 round_robin_hit_rate=0.449 ttft_vs_round_robin=0.73""",
    "sglang_backend.py": """\
goals (A, B >= 0.7, C >= 2.0, D = 1.0): met
sglang set_vs_memcpy=1.09 get_vs_memcpy=1.11 get_vs_file=2.85 immediate_remote_hit=1.00""",
    "vllm_ttft.py": """\
connector_share=0.0007 (the cold requests' time in the connector's methods, which vLLM \
calls on its own threads, over vanilla TTFT; median)
vllm_ttft vanilla_ms=3612.0 cold_ms=3570.2 warm_ms=86.0 speedup=41.99 overhead=-0.013 \
store_vs_memcpy=0.48 load_vs_memcpy=0.77""",
    "vllm_models.py": """\
minima over the kinds the connector serves (llama, gemma3); inactive: gdn; loads over llama
vllm_models kinds=4 outputs_match=4 min_speedup=10.38 min_store_vs_memcpy=0.48 \
min_load_vs_memcpy=0.50""",
}

# Keys that the scripts build from a loop variable (batch{b}=, quota_{n}_ms=).
BUILT_KEYS = {"batch16", "batch512", "quota_1000_ms"}


def parse_sample(script: str) -> summary_line.Summary:
    """The sample of ``script`` (``"name.py"``, or with its arguments: another run's format)."""
    name = script.split()[0][:-3]
    return parse_output(SAMPLES[script].replace("\\\n", "").splitlines(), name)


def test_values() -> None:
    assert parse_value("3") == 3 and isinstance(parse_value("3"), int)
    assert parse_value("-0.110") == -0.110
    assert parse_value("nan") is None
    assert parse_value("tcp") == "tcp"


def test_nameless_line_takes_the_script_name() -> None:
    assert parse_sample("hashing.py") == {"hashing": {"hash_128k_tokens_ms": 0.487}}


def test_trailing_block_of_several_lines() -> None:
    summary = parse_sample("bookkeeping.py")
    assert summary == {
        "bookkeeping_us_per_chunk": {"batch1": 27.21, "batch16": 5.69, "batch512": 4.50},
        "bookkeeping_quotas_us_per_chunk": {"batch1": 19.45, "batch16": 8.84, "batch512": 6.13},
    }
    assert list(parse_sample("load.py")) == ["floor", "load"]


@pytest.mark.parametrize(
    "line",
    [
        "",
        "server path within the 5 ms target",
        "floor",  # a name without pairs
        "connector_share=0.0007 (the cold requests' time)",
        "GET /quota: 1000 tenants 16.0 ms",
        "goal: router hit rate >= 0.95 x oracle: 0.674 vs 0.640",
        "llama: speedup=10.38; 16384 B stored per token",
    ],
)
def test_not_summary_lines(line: str) -> None:
    assert parse_line(line, "x") is None


def test_output_not_ending_in_a_summary_line() -> None:
    assert parse_output(["tiers disk_write_vs_raw=0.46", "note: done"], "tiers") == {}
    assert parse_output([], "tiers") == {}
    # trailing blank lines do not end the block
    assert parse_output(["a k=1", "", ""], "x") == {"a": {"k": 1}}


def test_mixed_values_and_nan() -> None:
    peers = parse_sample("peers.py")["peers"]
    assert peers["nixl_transport"] == "none" and peers["nixl_ok"] == 0
    line = parse_line("tiers disk_write_vs_raw=0.46 redis_set_vs_raw=nan", "tiers")
    assert line == ("tiers", {"disk_write_vs_raw": 0.46, "redis_set_vs_raw": None})


@pytest.mark.parametrize("figure", FIGURES, ids=lambda f: f.figure_id)
def test_every_catalogued_figure_parses_from_its_script_format(figure: Figure) -> None:
    busy = figure.line.endswith("_busy")  # a run with --busy-cores (benchmarks/busy_cores.py)
    summary = parse_sample(f"{figure.script} --busy-cores 1" if busy else figure.script)
    assert isinstance(summary[figure.line][figure.key], int | float)
    for where in (figure.bound_key, figure.per):
        if where is not None:
            assert isinstance(summary[where[0]][where[1]], int | float)
    source = (BENCHMARKS / figure.script).read_text()
    assert figure.key in BUILT_KEYS or f"{figure.key}=" in source
    if busy:
        line = figure.line.removesuffix("_busy")
        assert f"line_name('{line}', args.busy_cores)" in source
    else:
        assert f"{figure.line} " in source or figure.line == figure.script[:-3]
