"""How big the demo's pools and disk tier are: the working set of a workload, a pool that
holds it, and a pool of about half of it for the disk-tier demo."""

from __future__ import annotations

import shutil

from tierkv.demo.kv import SimModel
from tierkv.demo.simulated_engine import CHUNK_TOKENS
from tierkv.demo.workload import Workload
from tierkv.pool import SHM_DIR, format_bytes

HIGH_WATERMARK = 0.8  # the server's default: eviction starts above this pool usage
MIN_POOL = 256 * 2**20
MIB = 2**20


def working_set_bytes(workload: Workload, model: SimModel) -> int:
    """Bytes of all the different chunks the workload stores."""
    return workload.distinct_chunks(CHUNK_TOKENS) * model.bytes_per_token * CHUNK_TOKENS


def tiered_pool_size(workload: Workload, model: SimModel) -> int:
    """A pool of about half the working set (in MiB): the rest lives on the tier.

    At least large enough that the space above the eviction watermark holds a whole
    document: a prefetch loads into free pool space and does not evict to make room (the
    evictor keeps usage under the high watermark in the background)."""
    document = (workload.doc_tokens // CHUNK_TOKENS) * model.bytes_per_token * CHUNK_TOKENS
    wanted = max(working_set_bytes(workload, model) // 2, int(document / (1 - HIGH_WATERMARK)))
    return max(MIB, -(-wanted // MIB) * MIB)


def auto_pool_size(workload: Workload, model: SimModel) -> tuple[int, str]:
    """A pool that holds the whole working set below the eviction watermark, rounded up to
    256 MiB; smaller, with a note, when /dev/shm cannot hold that much."""
    working_set = working_set_bytes(workload, model)
    wanted = int(working_set / (HIGH_WATERMARK - 0.05))
    size = max(MIN_POOL, -(-wanted // MIN_POOL) * MIN_POOL)
    try:
        free = shutil.disk_usage(SHM_DIR).free
    except OSError:
        return size, ""
    if size > free * 0.8:
        smaller = max(model.bytes_per_token * CHUNK_TOKENS * 4, int(free * 0.8) // 4096 * 4096)
        note = (
            f"note: {SHM_DIR} has {format_bytes(free)} free, less than the "
            f"{format_bytes(size)} the whole workload needs; using a {format_bytes(smaller)} "
            f"pool, so evictions will lower the hit rate (Docker: --shm-size)"
        )
        return smaller, note
    return size, ""
