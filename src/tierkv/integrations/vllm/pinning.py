"""Page-locking the pool for a vLLM worker whose KV cache is on a GPU.

A copy between GPU memory and pageable host memory goes through the driver's own staging
buffers; from page-locked (pinned) memory the GPU's copy engines read or write it directly.
Measured on an H200 (``benchmarks/gpu_copies.py``): a chunk's gather or scatter reached 7 to
11 GB/s into pageable memory and 23 to 26 GB/s into the same memory page-locked (a plain
contiguous copy: 9 to 16 against 55). The pool is the engine's side of every store and load,
so a worker with a cache on a GPU registers the whole pool mapping with CUDA
(``cudaHostRegister``) when its client attaches it, and unregisters it before the mapping
is closed (:class:`tierkv.client.Client`'s ``on_pool``).

Registering takes time at start (it walks every page of the mapping) and the pages stay
resident while registered; a pool in ``/dev/shm`` is resident anyway. If registration fails
(a driver that refuses shared mappings, a limit on locked memory), the worker logs it once
and copies through pageable memory, as without this.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

log = logging.getLogger("vllm.tierkv")


def page_lock(buf: memoryview, device: torch.device) -> Callable[[], None] | None:
    """Register ``buf`` (host memory, writable) with CUDA when ``device`` is a CUDA device;
    the function that unregisters it, or None when nothing was registered."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    array = np.frombuffer(buf, dtype=np.uint8)
    address, nbytes = int(array.ctypes.data), int(array.nbytes)
    del array  # no export of the buffer may outlive this call: the pool must stay closable
    cudart = torch.cuda.cudart()
    started = time.perf_counter()
    error = int(cudart.cudaHostRegister(address, nbytes, 0))
    if error:
        log.warning(
            "tierkv: could not page-lock the pool (%d GiB) for GPU copies (CUDA error %d); "
            "copying through pageable memory",
            nbytes >> 30,
            error,
        )
        return None
    log.info(
        "tierkv: pool page-locked for GPU copies (%.1f GiB in %.2f s)",
        nbytes / 2**30,
        time.perf_counter() - started,
    )

    def unlock() -> None:
        cudart.cudaHostUnregister(address)

    return unlock


__all__ = ["page_lock"]
