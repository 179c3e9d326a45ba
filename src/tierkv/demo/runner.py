"""`tierkv demo`: the command line, and one function per demo mode.

- against a running server (``--endpoint`` / ``--instance``): :func:`_against_running_server`;
- with a throw-away local server (``--with-server``), optionally with a disk tier
  (``--disk-tier DIR``): :func:`_with_local_server`;
- two clustered local servers (``--with-server --nodes 2``, on a ring or, with
  ``--directory controller``, a controller): :func:`_two_nodes` (the cluster demo itself
  is :mod:`tierkv.demo.cluster`).

With ``--disk-tier DIR`` the server gets a disk tier and, by default, a pool of about half
the working set: chunks evicted from the pool come back from disk when a later question
looks them up, and the report splits the hits into pool and tier hits. The directory is
kept, so a second run finds the first run's chunks on disk.
"""

from __future__ import annotations

import argparse
import os
import sys

from tierkv.client import Client, TierKVError, default_endpoint
from tierkv.demo.cluster import run_two_node_demo
from tierkv.demo.fleet import run_demo
from tierkv.demo.kv import SimModel
from tierkv.demo.local_server import LocalServer, LocalServerError
from tierkv.demo.report import DemoReport
from tierkv.demo.sizing import auto_pool_size, tiered_pool_size, working_set_bytes
from tierkv.demo.workload import Workload
from tierkv.options import OptionError, parse_size
from tierkv.pool import format_bytes

GIB = 2**30


class _Refused(Exception):
    """Options that do not go together; the message is printed after ``tierkv demo:``."""


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
    s.add_argument(
        "--directory",
        choices=("ring", "controller"),
        default="ring",
        help="with --nodes 2: the cluster's directory, a consistent-hash ring (default) or a "
        "throw-away `tierkv controller` both servers register with",
    )


def run_demo_command(args: argparse.Namespace) -> int:
    """`tierkv demo`: exit status 0 only if every request ran and every load verified."""
    workload = Workload(args.documents, args.doc_tokens, args.queries_per_doc, args.seed)
    model = SimModel(args.layers, args.kv_heads, args.head_dim)
    try:
        _check_combination(args)
        if args.nodes == 2:
            return _two_nodes(args, workload, model)
        if args.with_server:
            return _with_local_server(args, workload, model)
        return _against_running_server(args, workload, model)
    except (_Refused, OptionError) as exc:
        print(f"tierkv demo: {exc}", file=sys.stderr)
        return 2


def _check_combination(args: argparse.Namespace) -> None:
    if (args.disk_tier or args.disk_tier_size) and not args.with_server:
        raise _Refused(
            "--disk-tier configures the server that --with-server starts; a running server "
            "has its own tiers (`tierkv server --tier disk:path=DIR`)"
        )
    if args.disk_tier_size and not args.disk_tier:
        raise _Refused("--disk-tier-size needs --disk-tier DIR")
    if args.nodes == 2 and (not args.with_server or args.disk_tier):
        raise _Refused("--nodes 2 needs --with-server (and no --disk-tier)")
    if args.directory != "ring" and args.nodes != 2:
        raise _Refused("--directory chooses the directory of --nodes 2")


def _two_nodes(args: argparse.Namespace, workload: Workload, model: SimModel) -> int:
    size = parse_size(args.pool_size) if args.pool_size else auto_pool_size(workload, model)[0]
    return run_two_node_demo(
        workload, model, args.engines, size, args.timeout, directory=args.directory
    )


def _against_running_server(args: argparse.Namespace, workload: Workload, model: SimModel) -> int:
    endpoint = args.endpoint or default_endpoint(args.instance)
    try:
        if endpoint.startswith("ipc://") and not os.path.exists(endpoint[len("ipc://") :]):
            raise TierKVError(f"no tierkv server at {endpoint} (no such socket)")
        with Client(endpoint, timeout=min(args.timeout, 5.0)) as probe:
            probe.ping()
    except TierKVError as exc:
        raise _Refused(
            f"{exc}\n  start one with `tierkv server`, or run `tierkv demo --with-server`"
        ) from None
    report, status = _run(endpoint, args, workload, model)
    return _finish(report, status)


def _with_local_server(args: argparse.Namespace, workload: Workload, model: SimModel) -> int:
    pool_size = parse_size(args.pool_size) if args.pool_size else None
    extra: list[str] = []
    described = ""
    if args.disk_tier:
        path = os.path.abspath(args.disk_tier)
        if "," in path:
            raise _Refused(f"--disk-tier {path!r}: no commas, please")
        working_set = working_set_bytes(workload, model)
        tier_size = parse_size(args.disk_tier_size) if args.disk_tier_size else None
        tier_size = tier_size or max(GIB, 2 * working_set)
        described = f", disk tier {path} of up to {format_bytes(tier_size)}"
        if pool_size is None:
            pool_size = tiered_pool_size(workload, model)
            print(
                f"note: a pool of {format_bytes(pool_size)} for a working set of "
                f"{format_bytes(working_set)}: evicted chunks come back from the disk tier",
                file=sys.stderr,
            )
        # The write-behind queue may hold the whole pool: chunks wait for the disk instead
        # of being dropped (queued chunks stay locked in the pool, so when the disk falls
        # behind, stores into a full pool are skipped instead).
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
        server.cleanup()
        raise _Refused(str(exc)) from None
    report: DemoReport | None = None
    status = 0
    try:
        report, status = _run(server.endpoint, args, workload, model)
    finally:
        try:
            server.stop()
            stopped = "server stopped cleanly (exit status 0, pool segment removed)"
        except LocalServerError as exc:
            stopped = f"tierkv demo: {exc}"
            status = status or 1
        server.cleanup()
    return _finish(report, status, stopped)


def _run(
    endpoint: str, args: argparse.Namespace, workload: Workload, model: SimModel
) -> tuple[DemoReport | None, int]:
    """The workload on the engine fleet; (report, 0), or (None, 130) after Ctrl-C."""
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
        return None, 130
    return report, 0


def _finish(report: DemoReport | None, status: int, stopped: str = "") -> int:
    """Print the report (and how the local server stopped); the exit status."""
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
