"""The SGLang backend's page moves: tierkv against memcpy and against SGLang's file backend.

Run in the SGLang environment: ``make bench-sglang`` (or
``.venv-sglang/bin/python benchmarks/sglang_backend.py``).

What is measured, all in one run on this machine:

- ``batch_set_v1`` and ``batch_get_v1`` of a batch of pages through a real tierkv server,
  with SGLang's real host pool (``page_first``, 64-token pages; Llama-3-8B's KV at tensor
  parallel 2 by default: 32 layers, 4 KV heads per rank, head size 128, bf16, 8 MiB a page);
- the bound: a memcpy of the same bytes (contiguous page-sized buffers, tierkv's copier with
  the same number of threads as the client), taking turns with the set and the get round by
  round; the backend copies with non-temporal stores (:mod:`tierkv.arraycopy`), which can
  beat it, so the same copies made that way are timed and printed beside;
- SGLang's own file backend (``HiCacheFile``) on the same pages, its reads served from the
  page cache (files just written), through the generic path SGLang uses for it (flat pages,
  then ``set_from_flat_data_page``);
- prefill/decode across nodes: two clustered servers; pages set through node A, looked up
  and read through node B the moment the set returned: the share of those lookups that hit.

Last line: ``sglang set_vs_memcpy=A get_vs_memcpy=B get_vs_file=C immediate_remote_hit=D``.
Goals: A and B >= 0.7, C >= 2, D = 1.0.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from peers import TOKEN, Server, free_port_pair, interleaved, members, wait_for
from shm_path import start_server
from support import sglang_pools as sp
from tierkv import arraycopy
from tierkv.arraycopy import copy_array
from tierkv.copier import Copier, default_threads
from tierkv.demo.local_process import stop_process

GOAL_VS_MEMCPY = 0.7
GOAL_VS_FILE = 2.0


def keys_for(prefix: str, n: int) -> list[str]:
    return [hashlib.sha256(f"{prefix}-{i}".encode()).hexdigest() for i in range(n)]


def timer(fn: Callable[[], Any], before: Callable[[], Any] = lambda: None) -> Callable[[], float]:
    """A call that runs ``before()`` untimed, then ``fn()``, and returns the latter's seconds."""

    def timed() -> float:
        before()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return timed


def median_time(
    fn: Callable[[], Any], rounds: int, before: Callable[[], Any] = lambda: None
) -> float:
    """Median seconds of ``fn()`` over ``rounds`` (after one warm-up), ``before()`` untimed."""
    return statistics.median(interleaved(rounds, timer(fn, before), warmup=1)[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=4, help="KV heads per rank")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--pages", type=int, default=32, help="pages per batch")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--remote-rounds", type=int, default=100)
    args = ap.parse_args()

    shape = {"layers": args.layers, "heads": args.heads, "head_dim": args.head_dim,
             "page_size": args.page_size}  # fmt: skip
    n = args.pages
    src = sp.host_pool("mha", "page_first", pages=2 * n, **shape)
    dst = sp.host_pool("mha", "page_first", pages=2 * n, **shape)
    sp.fill_random(src, seed=1)
    page_bytes = int(src.get_data_page(0, flat=False).numel()) * src.dtype.itemsize
    batch_bytes = page_bytes * n
    src_idx, dst_idx = sp.indices(src, list(range(n))), sp.indices(dst, list(range(n, 2 * n)))
    print(f"pages: {n} x {page_bytes / 2**20:.1f} MiB (page_first, {args.page_size} tokens, "
          f"{args.layers} layers, {args.heads} KV heads x {args.head_dim}, bf16)")  # fmt: skip

    # -- the bound: memcpy of the same bytes --------------------------------------------------
    copier = Copier(default_threads())
    pages_src = [
        np.ascontiguousarray(src.get_data_page(p * args.page_size).view(torch.uint8).numpy())
        for p in range(n)
    ]
    pages_dst = [np.empty_like(a) for a in pages_src]
    sizes = [page_bytes] * n
    pairs = list(zip(pages_dst, pages_src, strict=True))

    def memcpy() -> None:
        copier.run(lambda pr: np.copyto(*pr), pairs, sizes)

    def streaming() -> None:  # the backend's own copy (non-temporal stores), printed beside
        copier.run(lambda pr: copy_array(*pr), pairs, sizes)

    with tempfile.TemporaryDirectory(prefix="tierkv-sglang-bench-") as tmp:
        root = Path(tmp)
        # -- tierkv, one node, taking turns with the bound ------------------------------------
        srv = start_server(root, pool_bytes=batch_bytes * 3, prefault=True)
        try:
            cfg = sp.storage_config({"endpoint": srv.endpoint, "timeout": 60})
            backend = sp.create_backend(cfg, src)
            reader = sp.create_backend(cfg, dst)
            counter = iter(range(1 << 30))
            fresh: list[list[str]] = []

            def new_keys() -> None:
                backend.clear()
                fresh[:] = [keys_for(f"set-{next(counter)}", n)]

            def do_set() -> None:
                assert all(backend.batch_set_v1(fresh[0], src_idx)), "set failed"

            def do_get() -> None:
                assert reader.batch_exists(fresh[0]) == n
                assert all(reader.batch_get_v1(fresh[0], dst_idx)), "get failed"

            # One round of each in turn (this VM's bandwidth drifts within seconds), the first
            # a warm-up; medians over the others.
            t_memcpy, t_stream, t_set, t_get = (
                statistics.median(t)
                for t in interleaved(
                    args.rounds,
                    timer(memcpy),
                    timer(streaming),
                    timer(do_set, new_keys),
                    timer(do_get),
                    warmup=1,
                )
            )
            for i in range(n):
                assert sp.page_bytes(dst, n + i) == sp.page_bytes(src, i), "wrong bytes"
            backend.close()
            reader.close()
        finally:
            stop_process(srv.proc)
            copier.close()

        # -- SGLang's file backend ------------------------------------------------------------
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

        file_cfg = HiCacheStorageConfig(
            **{**sp.storage_config({}).__dict__,
               "extra_config": {"file_storage_path": str(root / "hicache")}}
        )  # fmt: skip
        hf = HiCacheFile(file_cfg)
        fkeys: list[list[str]] = []

        def file_new_keys() -> None:
            hf.clear()
            fkeys[:] = [keys_for(f"file-{next(counter)}", n)]

        def file_set() -> None:  # SGLang's _generic_page_set
            data = [src.get_data_page(p * args.page_size) for p in range(n)]
            assert hf.batch_set(fkeys[0], data)

        t_file_set = median_time(file_set, args.rounds, before=file_new_keys)

        def file_get() -> None:  # SGLang's _generic_page_get
            dummy = [dst.get_dummy_flat_data_page() for _ in range(n)]
            got = hf.batch_get(fkeys[0], dummy)
            for i in range(n):
                assert got[i] is not None
                dst.set_from_flat_data_page((n + i) * args.page_size, got[i])

        t_file_get = median_time(file_get, args.rounds)
        hf.clear()

        # -- prefill on node A, decode on node B -------------------------------------------
        pa, pb = free_port_pair(), free_port_pair()
        a = Server(tmp, "a", pa, pa, batch_bytes * 2)
        b = Server(tmp, "b", pb, pa, batch_bytes * 2)
        try:
            wait_for(lambda: members(a.addr) == members(b.addr) == {a.addr, b.addr})
            prod = sp.create_backend(
                sp.storage_config({"endpoint": a.endpoint, "auth_token": TOKEN, "timeout": 60}), src
            )
            cons = sp.create_backend(
                sp.storage_config({"endpoint": b.endpoint, "auth_token": TOKEN, "timeout": 60}), dst
            )
            hit = 0
            for r in range(args.remote_rounds):
                ks = keys_for(f"pd-{r}", 1)
                assert prod.batch_set_v1(ks, sp.indices(src, [r % n])) == [True]
                hit += cons.batch_exists(ks) == 1
                ok = cons.batch_get_v1(ks, sp.indices(dst, [n + r % n]))
                assert not ok[0] or sp.page_bytes(dst, n + r % n) == sp.page_bytes(src, r % n)
            prod.close()
            cons.close()
        finally:
            a.stop()
            b.stop()

    gb = batch_bytes / 1e9
    print(f"memcpy          {gb / t_memcpy:6.2f} GB/s  ({default_threads()} threads)")
    print(f"streaming copy  {gb / t_stream:6.2f} GB/s  (the backend's, {arraycopy.STORES}; "
          f"set {t_stream / t_set:.2f} and get {t_stream / t_get:.2f} of it)")  # fmt: skip
    print(f"tierkv set      {gb / t_set:6.2f} GB/s   get {gb / t_get:6.2f} GB/s")
    print(f"file backend    set {gb / t_file_set:6.2f} GB/s   get {gb / t_file_get:6.2f} GB/s")
    print(f"immediate remote lookups that hit: {hit} of {args.remote_rounds}")
    a_, b_, c_, d_ = (
        t_memcpy / t_set,
        t_memcpy / t_get,
        t_file_get / t_get,
        hit / args.remote_rounds,
    )
    met = a_ >= GOAL_VS_MEMCPY and b_ >= GOAL_VS_MEMCPY and c_ >= GOAL_VS_FILE and d_ == 1.0
    print(f"goals (A, B >= {GOAL_VS_MEMCPY}, C >= {GOAL_VS_FILE}, D = 1.0): "
          f"{'met' if met else 'NOT met'}")  # fmt: skip
    print(f"sglang set_vs_memcpy={a_:.2f} get_vs_memcpy={b_:.2f} get_vs_file={c_:.2f} "
          f"immediate_remote_hit={d_:.2f}")  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("TIERKV_TEST", "1")
    main()
