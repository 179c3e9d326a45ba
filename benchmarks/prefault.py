"""What prefaulting the shared-memory pool buys: first-touch cost of a store, measured.

The server creates a pool with ``prefault=False`` (pages allocated lazily, on the first
write) or ``prefault=True`` (``posix_fallocate`` + ``MAP_POPULATE``). A second process, as an
engine would, attaches by name (with and without ``populate=True``, i.e. ``MAP_POPULATE`` in
the client) and copies a full pool's worth of bytes into it from an already-touched private
buffer, twice: the first write pays whatever page faults are left, the second shows the
steady state. The bound is a plain numpy copy of the same bytes between two already-touched
private buffers, measured in the same run.

    python benchmarks/prefault.py [--size-mib 1024] [--chunk-mib 4] [--repeat 1]

The last line is machine-readable:
``prefault create_cold_ms=A create_prefault_ms=B first_write_cold_gbps=C
first_write_prefault_gbps=D memcpy_gbps=E`` (GB/s are 1e9 bytes per second; the two
first-write figures are for a client that attaches without ``populate``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from stop_signals import exit_on_stop_signals
from tierkv.pool import ShmPool, check_shm_capacity, format_bytes, segment_exists

MIB = 1 << 20


def copy_into(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any], chunk: int) -> None:
    """Copy ``src`` into ``dst`` chunk by chunk, the way a store fills consecutive slots."""
    for off in range(0, len(src), chunk):
        np.copyto(dst[off : off + chunk], src[off : off + chunk])


def touched_buffer(size: int, seed: int) -> np.ndarray[Any, Any]:
    """A private buffer whose every page is allocated and mapped, filled with varied bytes."""
    buf = np.empty(size, dtype=np.uint8)
    pattern = np.random.default_rng(seed).integers(0, 256, size=MIB, dtype=np.uint8)
    for off in range(0, size, MIB):
        n = min(MIB, size - off)
        buf[off : off + n] = pattern[:n]
    return buf


# -- the attaching "engine" process --------------------------------------------------------


def child_main(name: str, size: int, populate: bool, chunk: int) -> None:
    src = touched_buffer(size, seed=1)
    t0 = time.perf_counter()
    pool = ShmPool.attach(name, expected_size=size, populate=populate)
    t1 = time.perf_counter()
    dst = pool.array(0, size)
    copy_into(dst, src, chunk)
    t2 = time.perf_counter()
    copy_into(dst, src, chunk)
    t3 = time.perf_counter()
    ok = bool(dst[size - 1] == src[size - 1] and dst[0] == src[0])
    del dst
    pool.close()
    result = {"attach_s": t1 - t0, "first_s": t2 - t1, "second_s": t3 - t2, "ok": ok}
    print(json.dumps(result), flush=True)


# -- the "server" side ---------------------------------------------------------------------


@dataclass
class Run:
    prefault: bool
    populate: bool
    create_s: float
    attach_s: float
    first_s: float
    second_s: float


def run_one(size: int, prefault: bool, populate: bool, chunk: int) -> Run:
    name = f"tierkv-bench-{uuid.uuid4().hex[:8]}"
    t0 = time.perf_counter()
    pool = ShmPool.create(name, size, prefault=prefault)
    create_s = time.perf_counter() - t0
    try:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", name]
        cmd += ["--size-bytes", str(size), "--chunk-mib", str(chunk // MIB)]
        if populate:
            cmd.append("--populate")
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"writer process failed:\n{out.stderr}")
        res = json.loads(out.stdout.strip().splitlines()[-1])
        if not res["ok"]:
            raise RuntimeError("writer process wrote the wrong bytes")
        if not segment_exists(name):
            raise RuntimeError("the segment disappeared when the writer process exited")
    finally:
        pool.close()
    return Run(prefault, populate, create_s, res["attach_s"], res["first_s"], res["second_s"])


def measure_memcpy(size: int, chunk: int, repeat: int) -> float:
    src = touched_buffer(size, seed=2)
    dst = touched_buffer(size, seed=3)
    copy_into(dst, src, chunk)  # warm
    times = []
    for _ in range(max(3, repeat)):
        t0 = time.perf_counter()
        copy_into(dst, src, chunk)
        times.append(time.perf_counter() - t0)
    return min(times)


def median_run(runs: list[Run]) -> Run:
    def med(field: str) -> float:
        return float(statistics.median(float(getattr(r, field)) for r in runs))

    first = runs[0]
    return Run(
        first.prefault,
        first.populate,
        med("create_s"),
        med("attach_s"),
        med("first_s"),
        med("second_s"),
    )


def main() -> None:
    exit_on_stop_signals()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024, help="pool size (default 1024 MiB)")
    ap.add_argument("--chunk-mib", type=int, default=4, help="copy granularity (default 4 MiB)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per configuration (median)")
    ap.add_argument("--child", metavar="NAME", help=argparse.SUPPRESS)
    ap.add_argument("--size-bytes", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--populate", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    chunk = max(1, args.chunk_mib) * MIB

    if args.child:
        child_main(args.child, args.size_bytes, args.populate, chunk)
        return

    size = args.size_mib * MIB
    check_shm_capacity(size)
    gb = size / 1e9

    configs = [(False, False), (True, False), (False, True), (True, True)]
    results: dict[tuple[bool, bool], Run] = {}
    for prefault, populate in configs:
        runs = [run_one(size, prefault, populate, chunk) for _ in range(max(1, args.repeat))]
        results[(prefault, populate)] = median_run(runs)
    memcpy_s = measure_memcpy(size, chunk, args.repeat)
    memcpy_gbps = gb / memcpy_s

    print(
        f"pool {format_bytes(size)}, copies in {format_bytes(chunk)} chunks, "
        f"{max(1, args.repeat)} run(s) per configuration (median), GB/s = 1e9 B/s"
    )
    print(f"memcpy bound (private -> private, both touched): {memcpy_gbps:6.2f} GB/s")
    print()
    header = (
        f"{'server create':<22}{'client attach':<16}{'create ms':>10}{'attach ms':>10}"
        f"{'1st write':>11}{'2nd write':>11}{'attach+1st':>12}{'1st/memcpy':>12}"
    )
    print(header)
    print("-" * len(header))
    for prefault, populate in configs:
        r = results[(prefault, populate)]
        first_gbps = gb / r.first_s
        print(
            f"{'prefault=True' if prefault else 'prefault=False':<22}"
            f"{'populate=True' if populate else 'populate=False':<16}"
            f"{r.create_s * 1e3:>10.1f}{r.attach_s * 1e3:>10.1f}"
            f"{first_gbps:>7.2f} GB/s{gb / r.second_s:>7.2f} GB/s"
            f"{gb / (r.attach_s + r.first_s):>8.2f} GB/s"
            f"{first_gbps / memcpy_gbps:>12.2f}"
        )
    print()
    print(
        "1st write: the attaching process's first full copy into the pool (page faults "
        "included);\nattach+1st: the same including attach (MAP_POPULATE moves the mapping "
        "cost there)."
    )

    cold = results[(False, False)]
    warm = results[(True, False)]
    print(
        f"prefault create_cold_ms={cold.create_s * 1e3:.1f} "
        f"create_prefault_ms={warm.create_s * 1e3:.1f} "
        f"first_write_cold_gbps={gb / cold.first_s:.2f} "
        f"first_write_prefault_gbps={gb / warm.first_s:.2f} "
        f"memcpy_gbps={memcpy_gbps:.2f}"
    )


if __name__ == "__main__":
    main()
