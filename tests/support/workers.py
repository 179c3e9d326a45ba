"""Engine worker processes for tests: spawn several, collect what each reports."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any


def run_workers(
    target: Callable[..., None], args: list[tuple[Any, ...]], timeout: float = 60.0
) -> list[Any]:
    """Run ``target(*args[i], results)`` in spawned processes; each puts one tuple on
    ``results``, its index first and an error (a traceback, or None) last. Fails on any
    error or a non-zero exit; returns the tuples in index order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, results)) for a in args]
    for proc in procs:
        proc.start()
    try:
        out = [results.get(timeout=timeout) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
    errors = [r[-1] for r in out if r[-1]]
    assert not errors, "\n".join(errors)
    assert all(proc.exitcode == 0 for proc in procs)
    return sorted(out, key=lambda r: r[0])
