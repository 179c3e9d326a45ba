"""The `tierkv` command: server, demo, status, clear, quota."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

# tierkv's processes never multiply matrices: numpy's BLAS needs no thread pool of its own,
# which OpenBLAS would start at numpy's import (an idle thread named "python" in top -H).
# Set before the first import of numpy; a value from the environment is kept.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from tierkv import __version__
from tierkv.config import ConfigError, add_arguments, load
from tierkv.protocol import PROTOCOL_VERSION

VERSION = f"tierkv {__version__} (wire protocol {PROTOCOL_VERSION})"


def _server(args: argparse.Namespace) -> int:
    from tierkv.endpoints import EndpointInUseError
    from tierkv.pool import PoolError
    from tierkv.server.app import run
    from tierkv.server.quota_values import QuotaError
    from tierkv.tiers import TierError

    try:
        return run(load(args))
    except (ConfigError, PoolError, EndpointInUseError, TierError, QuotaError) as exc:
        print(f"tierkv server: {exc}", file=sys.stderr)
        return 2


def _controller(args: argparse.Namespace) -> int:
    from tierkv.config import load_as
    from tierkv.controller.app import run
    from tierkv.controller.config import ControllerConfig
    from tierkv.endpoints import EndpointInUseError

    try:
        return run(load_as(ControllerConfig, args))
    except (ConfigError, EndpointInUseError) as exc:
        print(f"tierkv controller: {exc}", file=sys.stderr)
        return 2


def _client_for(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from tierkv.client import Client, default_endpoint

    endpoint = args.endpoint or default_endpoint(args.instance)
    return Client(endpoint, timeout=args.timeout, auth_token=args.auth_token or "")


def _status(args: argparse.Namespace) -> int:
    from tierkv.client import TierKVError
    from tierkv.pool import format_bytes

    try:
        with _client_for(args) as client:
            s = client.stats()
    except TierKVError as exc:
        print(f"tierkv status: {exc}", file=sys.stderr)
        return 1
    if args.json:
        import msgspec

        figures = msgspec.structs.asdict(s)  # an object, not the wire's array
        del figures["rid"]
        print(msgspec.json.encode(figures).decode())
        return 0
    pct = 100.0 * s.used / s.capacity if s.capacity else 0.0
    print(f"tierkv {s.server_version}, up {s.uptime_s:.0f} s, pool {s.pool_name}")
    if s.http_url:
        print(f"  dashboard {s.http_url}/")
    print(
        f"  pool      {format_bytes(s.used)} of {format_bytes(s.capacity)} used ({pct:.1f}%), "
        f"largest free block {format_bytes(s.largest_free)}"
    )
    print(
        f"  objects   {s.objects} ({s.ready} ready, {s.writing} being written, "
        f"{s.read_locked} read-locked)"
    )
    print(
        f"  clients   {s.clients} registered, {s.sessions} lookup sessions, "
        f"{s.write_leases} store and {s.read_leases} read leases open; "
        f"{s.clients_reaped} dropped after their process exited, {s.clients_expired} after "
        "idling past client_idle_ttl"
    )
    print(
        f"  evictions {s.evictions} ({format_bytes(s.evicted_bytes)}); expired: "
        f"{s.expired_write_slots} store slots, {s.expired_read_locks} read locks"
    )
    hits, misses = sum(s.lookup_hits.values()), sum(s.lookup_misses.values())
    if hits + misses:
        where = ", ".join(f"{k} {v}" for k, v in s.lookup_hits.items() if v) or "none"
        why = ", ".join(f"{k} {v}" for k, v in s.lookup_misses.items() if v) or "none"
        print(
            f"  lookups   {hits + misses} chunks, {100.0 * hits / (hits + misses):.1f}% hit "
            f"(hits: {where}; misses: {why})"
        )
    else:
        print("  lookups   none yet")
    print(
        f"  traffic   {format_bytes(s.stored_bytes)} stored, "
        f"{format_bytes(s.retrieved_bytes)} retrieved"
    )
    for t in s.tiers:
        cap = f" of {format_bytes(t.capacity)}" if t.capacity else ""
        fails = ", ".join(f"{k} {v}" for k, v in sorted(t.load_failures.items())) or "none"
        held = f"{t.objects} chunks, {format_bytes(t.bytes_used)}{cap}"
        if t.usage_age_s < 0:
            held = "contents not counted yet"
        elif t.usage_age_s >= 1:
            held += f" (counted {t.usage_age_s:.0f} s ago)"
        print(
            f"  tier {t.name:<5}{held}; wrote "
            f"{t.written_chunks} ({t.write_failures} failed), loaded {t.loaded_chunks} "
            f"(failures: {fails})"
        )
    if s.tiers:
        print(
            f"  tiering   write-behind queue {s.write_behind_queued} ({s.write_behind_dropped} "
            f"dropped); prefetches {s.prefetch_started} ({s.prefetch_inflight} running, "
            f"{s.prefetch_rejected} rejected, {s.prefetch_timed_out} timed out)"
        )
    if s.cluster:
        from tierkv.cluster.report import summary_lines

        for line in summary_lines(s.cluster):
            print(f"  {line}")
    reqs = ", ".join(f"{k} {v}" for k, v in sorted(s.requests.items())) or "none"
    print(f"  requests  {reqs}")
    if s.errors:
        print("  errors    " + ", ".join(f"{k} {v}" for k, v in sorted(s.errors.items())))
    print(f"  engines   {len(s.engines)}" + (":" if s.engines else ""))
    for e in s.engines:
        role = f" {e.role}" if e.role != "worker" else ""
        group = f" engine {e.engine_id}" if e.engine_id else ""
        tenant = f" tenant {e.tenant}" if e.tenant else ""
        print(
            f"    {e.name or '-'} (pid {e.pid}){role}{group}: {e.model}, {e.layout}, rank "
            f"{e.rank}/{e.world_size}{tenant}; {e.sessions} sessions, idle {e.idle_s:.1f} s, "
            f"namespace {e.namespace}"
        )
    return 0


def _clear(args: argparse.Namespace) -> int:
    from tierkv.client import TierKVError

    if not args.yes:
        if not sys.stdin.isatty():
            print("tierkv clear: refusing without --yes (stdin is not a terminal)", file=sys.stderr)
            return 2
        answer = input(
            "Remove every cached chunk from the server's pool (tiers keep theirs)? [y/N] "
        )
        if answer.strip().lower() not in ("y", "yes"):
            print("cancelled")
            return 1
    try:
        with _client_for(args) as client:
            removed = client.clear()
    except TierKVError as exc:
        print(f"tierkv clear: {exc}", file=sys.stderr)
        return 1
    print(f"removed {removed} objects")
    return 0


def _add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", help="server RPC endpoint (default: the instance's ipc socket)")
    p.add_argument("--instance", default="default", help="server instance name (default: default)")
    p.add_argument("--auth-token", help="shared secret, if the server requires one")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait (default: 5)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierkv", description="tierkv: a tiered KV-cache service")
    parser.add_argument("--version", action="version", version=VERSION)
    sub = parser.add_subparsers(dest="command", required=True)

    server = sub.add_parser("server", help="run the cache server for this node")
    add_arguments(server)
    server.set_defaults(func=_server)

    from tierkv.controller.config import ControllerConfig

    controller = sub.add_parser(
        "controller", help="run the cluster controller (directory of every server's chunks)"
    )
    add_arguments(controller, ControllerConfig, "controller")
    controller.set_defaults(func=_controller)

    from tierkv.demo import add_demo_arguments, run_demo_command

    demo = sub.add_parser("demo", help="run a simulated engine workload against a server")
    add_demo_arguments(demo)
    demo.set_defaults(func=run_demo_command)

    status = sub.add_parser("status", help="print a summary of a running server")
    _add_client_args(status)
    status.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    status.set_defaults(func=_status)

    clear = sub.add_parser("clear", help="remove every cached chunk from a running server")
    _add_client_args(clear)
    clear.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    clear.set_defaults(func=_clear)

    from tierkv.quota_cli import add_quota_arguments, run_quota

    quota = sub.add_parser("quota", help="show or change tenant quotas of a running server")
    add_quota_arguments(quota)
    quota.set_defaults(func=run_quota)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
