"""Per-chunk cost of the L1 index bookkeeping: reserve_write + commit + lock_read + release_read.

Two scenarios, each for batches of 1, 16 and 512 chunks (32-byte keys, 64 KiB chunks):

- fresh: the pool has room; every round stores fresh keys; the index is cleared between
  repeats, outside the timing.
- steady: the pool is full; every round first evicts the room it needs (what the eviction
  controller does in the background), and that eviction is inside the timing.

Each runs twice: without quotas (keys of no known tenant), and with quotas on (keys of four
tenants, a batch per tenant in turn, each with a soft quota, a default quota for the rest:
every slot is charged to its tenant and kept in its tenant's LRU too).

The figure is wall time per chunk in microseconds, the median over repeats. The last two
lines of output are ``bookkeeping_us_per_chunk batch1=X batch16=Y batch512=Z`` (the fresh
scenario, without quotas) and ``bookkeeping_quotas_us_per_chunk ...`` (with them).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

from tierkv.allocator import Allocator
from tierkv.index import ObjectIndex
from tierkv.tenants import TenantIds

CHUNK = 64 * 1024
KEY_BYTES = 32
BATCHES = (1, 16, 512)
CHUNKS_PER_REPEAT = 8192  # chunks stored per timed repeat
HOLDER = 1
TENANTS = 4
DIGESTS = [bytes([t]) * 16 for t in range(TENANTS)]
_quotas = False  # set by main() for the second run
_turn = 0


def _index(capacity: int) -> ObjectIndex:
    """An index; with quotas, its four tenants bound and given quotas (large enough never to
    evict here: the cost measured is the bookkeeping, not evictions)."""
    tenants = TenantIds()
    index = ObjectIndex(Allocator(capacity), tenants=tenants)
    if _quotas:
        ids = [tenants.bind(d, f"tenant-{t}") for t, d in enumerate(DIGESTS)]
        index.set_quotas({tid: capacity for tid in ids}, capacity, hard=False)
    return index


def _keys(n: int) -> list[bytes]:
    """Fresh keys of one batch; with quotas, of the next tenant in turn."""
    global _turn
    if not _quotas:
        return [os.urandom(KEY_BYTES) for _ in range(n)]
    _turn += 1
    digest = DIGESTS[_turn % TENANTS]
    return [digest + os.urandom(KEY_BYTES - 16) for _ in range(n)]


def _round(index: ObjectIndex, keys: list[bytes]) -> None:
    res = index.reserve_write(keys, CHUNK, HOLDER)
    if len(res.slots) != len(keys):
        raise RuntimeError(f"reserved {len(res.slots)} of {len(keys)}")
    index.commit(res.lease_id, HOLDER)
    lock = index.lock_read(keys, HOLDER)
    if len(lock.slots) != len(keys):
        raise RuntimeError(f"locked {len(lock.slots)} of {len(keys)}")
    index.release_read(lock.lease_id, HOLDER)


def fresh(batch: int, repeats: int) -> list[float]:
    """us/chunk per repeat; pool big enough for a whole repeat, cleared between repeats."""
    index = _index(CHUNKS_PER_REPEAT * CHUNK)
    rounds = CHUNKS_PER_REPEAT // batch
    out = []
    for _ in range(repeats):
        batches = [_keys(batch) for _ in range(rounds)]
        gc.collect()
        t0 = time.perf_counter_ns()
        for keys in batches:
            _round(index, keys)
        t1 = time.perf_counter_ns()
        out.append((t1 - t0) / 1e3 / (rounds * batch))
        index.clear()
    index.check()
    return out


def steady(batch: int, repeats: int) -> list[float]:
    """us/chunk per repeat with a full pool: each round evicts room for itself first."""
    capacity_chunks = CHUNKS_PER_REPEAT // 2
    index = _index(capacity_chunks * CHUNK)
    for i in range(0, capacity_chunks, 512):
        _round(index, _keys(min(512, capacity_chunks - i)))
    rounds = CHUNKS_PER_REPEAT // batch
    need = batch * CHUNK
    alloc = index.allocator
    out = []
    for _ in range(repeats):
        batches = [_keys(batch) for _ in range(rounds)]
        gc.collect()
        t0 = time.perf_counter_ns()
        for keys in batches:
            room = alloc.capacity - alloc.used
            if room < need:
                index.evict(need - room)
            _round(index, keys)
        t1 = time.perf_counter_ns()
        out.append((t1 - t0) / 1e3 / (rounds * batch))
    index.check()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    global _quotas
    results: dict[tuple[bool, str, int], list[float]] = {}
    for quotas in (False, True):
        _quotas = quotas
        for batch in BATCHES:
            results[quotas, "fresh", batch] = fresh(batch, args.repeats)
            results[quotas, "steady", batch] = steady(batch, args.repeats)

    print(f"ObjectIndex bookkeeping, {KEY_BYTES}-byte keys, {CHUNK // 1024} KiB chunks,")
    print("reserve_write + commit + lock_read + release_read, us per chunk")
    print(f"{'quotas':<8}{'scenario':<10}{'batch':>7}{'median':>10}{'min':>10}{'max':>10}")
    for (quotas, scenario, batch), xs in results.items():
        med = statistics.median(xs)
        print(
            f"{'on' if quotas else 'off':<8}{scenario:<10}{batch:>7}{med:>10.2f}"
            f"{min(xs):>10.2f}{max(xs):>10.2f}"
        )
    for quotas, name in ((False, "bookkeeping"), (True, "bookkeeping_quotas")):
        med = {b: statistics.median(results[quotas, "fresh", b]) for b in BATCHES}
        print(f"{name}_us_per_chunk " + " ".join(f"batch{b}={med[b]:.2f}" for b in BATCHES))


if __name__ == "__main__":
    main()
