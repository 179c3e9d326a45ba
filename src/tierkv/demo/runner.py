"""`tierkv demo`: command-line options, the engine processes, and the optional local server.

The engines are separate processes (``multiprocessing``, spawn context), as engine workers
are in production: each has its own client, its own paged cache, and shares only the
server and its pool with the others. They report every finished request on a queue (for
the progress bar and the report) and meet at a barrier after each round of questions.

With ``--disk-tier DIR`` the server started by ``--with-server`` gets a disk tier and, by
default, a pool of about half the working set: chunks evicted from the pool come back from
disk when a later question looks them up, and the report splits the hits into pool and
tier hits. The directory is kept, so a second run finds the first run's chunks on disk.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import shutil
import sys
import time

from tierkv.client import Client, TierKVError, default_endpoint
from tierkv.demo.engine import (
    CHUNK_TOKENS,
    DONE,
    RECORD,
    SETTLED,
    EngineSettings,
    engine_main,
)
from tierkv.demo.kv import SimModel
from tierkv.demo.local_server import LocalServer, LocalServerError
from tierkv.demo.report import DemoReport, ProgressBar
from tierkv.demo.workload import Workload
from tierkv.options import OptionError, parse_size
from tierkv.pool import SHM_DIR, format_bytes

HIGH_WATERMARK = 0.8  # the server's default: eviction starts above this pool usage
MIN_POOL = 256 * 2**20
MIB = 2**20
GIB = 2**30


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    w = parser.add_argument_group("workload (Long-Doc-QA)")
    w.add_argument("--documents", type=_positive_int, default=8, help="documents (default: 8)")
    w.add_argument(
        "--doc-tokens", type=_positive_int, default=10_000, help="tokens per document (10000)"
    )
    w.add_argument(
        "--queries-per-doc", type=_positive_int, default=2, help="questions per document (2)"
    )
    w.add_argument("--engines", type=_positive_int, default=2, help="engine processes (2)")
    w.add_argument("--seed", type=int, default=0, help="seed of the token ids (0)")

    m = parser.add_argument_group("simulated model (KV per token: 2 x layers x heads x dim)")
    m.add_argument("--layers", type=_positive_int, default=SimModel.layers, help="layers (16)")
    m.add_argument("--kv-heads", type=_positive_int, default=SimModel.kv_heads, help="KV heads (8)")
    m.add_argument(
        "--head-dim", type=_positive_int, default=SimModel.head_dim, help="head dim (64)"
    )

    s = parser.add_argument_group("server")
    s.add_argument(
        "--with-server",
        action="store_true",
        help="start a server with the built-in defaults for the demo, and stop it afterwards",
    )
    s.add_argument(
        "--pool-size",
        help="pool of the --with-server server, e.g. 4GiB (default: the workload's chunks, "
        "with room to spare)",
    )
    s.add_argument(
        "--disk-tier",
        metavar="DIR",
        help="with --with-server: give the server a disk tier in DIR (created if missing, kept "
        "afterwards) and, unless --pool-size is given, a pool of about half the working set, "
        "so that evicted chunks come back from disk",
    )
    s.add_argument(
        "--disk-tier-size",
        metavar="SIZE",
        help="capacity of the --disk-tier, e.g. 20GiB (default: twice the working set, at "
        "least 1GiB)",
    )
    s.add_argument("--endpoint", help="RPC endpoint of a running server")
    s.add_argument("--instance", default="default", help="instance name of a running server")
    s.add_argument("--timeout", type=float, default=30.0, help="RPC timeout in seconds (30)")
    s.add_argument(
        "--nodes",
        type=int,
        choices=(1, 2),
        default=1,
        help="with --with-server: 2 starts two servers in a cluster; node A's engines run the "
        "workload, then node B's engines run it again and hit node A's chunks remotely",
    )


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


def working_set_bytes(workload: Workload, model: SimModel) -> int:
    """Bytes of all the different chunks the workload stores."""
    return workload.distinct_chunks(CHUNK_TOKENS) * model.bytes_per_token * CHUNK_TOKENS


def tiered_pool_size(workload: Workload, model: SimModel) -> int:
    """A pool of about half the working set (in MiB): the rest lives on the tier.

    At least large enough that the space above the eviction watermark holds a whole
    document: a prefetch loads into free pool space and does not evict to make room (the
    eviction controller keeps usage under the high watermark in the background)."""
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


def run_demo_command(args: argparse.Namespace) -> int:
    """`tierkv demo`: exit status 0 only if every request ran and every load verified."""
    workload = Workload(args.documents, args.doc_tokens, args.queries_per_doc, args.seed)
    model = SimModel(args.layers, args.kv_heads, args.head_dim)
    server: LocalServer | None = None
    if (args.disk_tier or args.disk_tier_size) and not args.with_server:
        print(
            "tierkv demo: --disk-tier configures the server that --with-server starts; a "
            "running server has its own tiers (`tierkv server --tier disk:path=DIR`)",
            file=sys.stderr,
        )
        return 2
    if args.disk_tier_size and not args.disk_tier:
        print("tierkv demo: --disk-tier-size needs --disk-tier DIR", file=sys.stderr)
        return 2
    if args.nodes == 2:
        if not args.with_server or args.disk_tier:
            print(
                "tierkv demo: --nodes 2 needs --with-server (and no --disk-tier)", file=sys.stderr
            )
            return 2
        from tierkv.demo.cluster import run_two_node_demo

        try:
            size = parse_size(args.pool_size) if args.pool_size else 0
        except OptionError as exc:
            print(f"tierkv demo: {exc}", file=sys.stderr)
            return 2
        size = size or auto_pool_size(workload, model)[0]
        return run_two_node_demo(workload, model, args.engines, size, args.timeout)
    if args.with_server:
        try:
            pool_size = parse_size(args.pool_size) if args.pool_size else None
            tier_size = parse_size(args.disk_tier_size) if args.disk_tier_size else None
        except OptionError as exc:
            print(f"tierkv demo: {exc}", file=sys.stderr)
            return 2
        extra: list[str] = []
        described = ""
        if args.disk_tier:
            path = os.path.abspath(args.disk_tier)
            if "," in path:
                print(f"tierkv demo: --disk-tier {path!r}: no commas, please", file=sys.stderr)
                return 2
            working_set = working_set_bytes(workload, model)
            if tier_size is None:
                tier_size = max(GIB, 2 * working_set)
            described = f", disk tier {path} of up to {format_bytes(tier_size)}"
            if pool_size is None:
                pool_size = tiered_pool_size(workload, model)
                print(
                    f"note: a pool of {format_bytes(pool_size)} for a working set of "
                    f"{format_bytes(working_set)}: evicted chunks come back from the disk tier",
                    file=sys.stderr,
                )
            # The write-behind queue may hold the whole pool: chunks wait for the disk
            # instead of being dropped (queued chunks stay locked in the pool, so when the
            # disk falls behind, stores into a full pool are skipped instead).
            extra = [
                "--tier", f"disk:path={path},capacity={tier_size}",
                "--write-behind-max-bytes", str(pool_size),
            ]  # fmt: skip
        if pool_size is None:
            pool_size, note = auto_pool_size(workload, model)
            if note:
                print(note, file=sys.stderr)
        server = LocalServer(pool_size, extra)
        print(
            f"starting a tierkv server (instance {server.instance}, pool "
            f"{format_bytes(pool_size)}{described}) ...",
            file=sys.stderr,
        )
        try:
            server.start()
        except LocalServerError as exc:
            print(f"tierkv demo: {exc}", file=sys.stderr)
            server.cleanup()
            return 2
        endpoint = server.endpoint
    else:
        endpoint = args.endpoint or default_endpoint(args.instance)
        try:
            if endpoint.startswith("ipc://") and not os.path.exists(endpoint[len("ipc://") :]):
                raise TierKVError(f"no tierkv server at {endpoint} (no such socket)")
            with Client(endpoint, timeout=min(args.timeout, 5.0)) as probe:
                probe.ping()
        except TierKVError as exc:
            print(
                f"tierkv demo: {exc}\n  start one with `tierkv server`, or run "
                "`tierkv demo --with-server`",
                file=sys.stderr,
            )
            return 2

    status = 0
    report: DemoReport | None = None
    stopped = ""
    try:
        report = run_demo(
            endpoint,
            workload,
            model,
            args.engines,
            timeout=args.timeout,
            settle_tiers=bool(args.disk_tier),
        )
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        status = 130
    finally:
        if server is not None:
            try:
                server.stop()
                stopped = "server stopped cleanly (exit status 0, pool segment removed)"
            except LocalServerError as exc:
                stopped = f"tierkv demo: {exc}"
                status = status or 1
            server.cleanup()
    if report is not None:
        print(report.format())
        if not report.ok:
            status = status or 1
    if stopped:
        print(stopped)
        print(
            "note: the stores went into a fresh pool, so their time includes the first-touch "
            "page faults of its memory (`tierkv server --prefault` moves that to start-up)"
        )
    if report is not None and not report.ok:
        why = "verification failures" if report.corrupt_chunks else "requests did not complete"
        print(f"tierkv demo: FAILED ({why})", file=sys.stderr)
    return status
