"""The demo's engine fleet: ``engines`` engine processes running a workload against one
server, and their events gathered into a :class:`DemoReport`.

The engines are separate processes (``multiprocessing``, spawn context), as engine workers
are in production: each has its own client, its own paged cache, and shares only the
server and its pool with the others. They report every finished request on a queue (for
the progress bar and the report) and meet at a barrier after each round of questions.
"""

from __future__ import annotations

import multiprocessing
import queue
import time

from tierkv.client import Client, TierKVError
from tierkv.demo.kv import SimModel
from tierkv.demo.report import DemoReport, ProgressBar
from tierkv.demo.simulated_engine import DONE, RECORD, SETTLED, EngineSettings, engine_main
from tierkv.demo.workload import Workload


def run_demo(
    endpoint: str,
    workload: Workload,
    model: SimModel,
    engines: int,
    *,
    timeout: float = 30.0,
    progress: bool = True,
    settle_tiers: bool = False,
) -> DemoReport:
    """Run the workload on ``engines`` engine processes against the server at ``endpoint``.

    With ``settle_tiers`` each round of questions starts once the server's write-behind has
    written the previous round's chunks to its tiers (bounded wait)."""
    ctx = multiprocessing.get_context("spawn")
    events = ctx.Queue()
    barrier = ctx.Barrier(engines)
    settings = EngineSettings(endpoint, workload, model, engines, timeout, settle_tiers)
    procs = [
        ctx.Process(
            target=engine_main,
            args=(i, settings, events, barrier),
            name=f"tierkv-demo-engine-{i}",
        )
        for i in range(engines)
    ]
    report = DemoReport(workload, model, engines)
    bar = ProgressBar(workload.requests)
    started = time.perf_counter()
    for proc in procs:
        proc.start()
    try:
        running = set(range(engines))
        silent_and_dead: dict[int, int] = {}
        while running:
            try:
                kind, index, payload = events.get(timeout=0.5)
            except queue.Empty:
                # An engine that died without a word (killed): give its last messages a
                # moment to arrive, then count it as failed.
                for i in list(running):
                    if not procs[i].is_alive():
                        silent_and_dead[i] = silent_and_dead.get(i, 0) + 1
                        if silent_and_dead[i] > 2:
                            running.discard(i)
                            barrier.abort()
                            report.engine_failures.append(
                                f"engine {i}: exited with status {procs[i].exitcode}"
                            )
                continue
            if kind == RECORD:
                report.records.append(payload)
                if progress:
                    hits, looked_up = report.count("hit_chunks"), report.count("full_chunks")
                    bar.update(len(report.records), f"chunk hits {hits}/{looked_up}")
            elif kind == SETTLED:
                report.settle_s += payload
            elif kind == DONE:
                running.discard(index)
            else:
                running.discard(index)
                report.engine_failures.append(f"engine {index}: {payload}")
    except BaseException:  # Ctrl-C: don't wait for the engines to finish their rounds
        for proc in procs:
            proc.terminate()
        raise
    finally:
        bar.close()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join()
    report.wall_s = time.perf_counter() - started
    try:
        with Client(endpoint, timeout=timeout) as client:
            report.server_stats = client.stats()
    except TierKVError as exc:
        report.engine_failures.append(f"server stats: {exc}")
    return report
