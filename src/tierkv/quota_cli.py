"""``tierkv quota``: a running server's tenant quotas from the shell, through its HTTP API
(``/quota``), so the command and operators' scripts do exactly the same thing.

    tierkv quota list                      # the default, the mode, every tenant's usage
    tierkv quota get acme                  # one tenant's limit and usage
    tierkv quota set acme 8GiB             # its pool quota (a size, or bytes)
    tierkv quota set acme 100GiB --tier disk   # its disk quota
    tierkv quota delete acme               # back to the defaults
    tierkv quota config --default 2GiB --default-disk 50GiB --mode hard
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


def add_quota_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default="http://127.0.0.1:8791", help="the server's HTTP address (--http-port)"
    )
    parser.add_argument(
        "--auth-token",
        default=os.environ.get("TIERKV_AUTH_TOKEN", ""),
        help="the server's shared secret (default: $TIERKV_AUTH_TOKEN)",
    )
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait")
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="the default quota, the mode and every tenant's usage")
    for action, what in (("get", "show"), ("delete", "remove (it gets the default)")):
        sub.add_parser(action, help=f"{what} a tenant's quota").add_argument("tenant")
    put = sub.add_parser("set", help="set a tenant's pool (or disk) quota")
    put.add_argument("tenant", help="the tenant's salt, or ~default")
    put.add_argument("limit", help="a size (8GiB) or a number of bytes")
    put.add_argument("--tier", choices=("pool", "disk"), default="pool", help="default: pool")
    config = sub.add_parser("config", help="show or change the default quotas and the mode")
    config.add_argument("--default", dest="default_limit", help="pool: 'unlimited' or a size")
    config.add_argument("--default-disk", help="disk: 'unlimited' or a size")
    config.add_argument("--mode", choices=("soft", "hard"))


def _path(tenant: str) -> str:
    # "=" + name always means the tenant of that name (even one called "config").
    return "/quota/" + urllib.parse.quote("=" + tenant, safe="")


def run_quota(args: argparse.Namespace) -> int:
    method, path, body = "GET", "/quota", None
    if args.action == "get":
        path = _path(args.tenant)
    elif args.action == "delete":
        method, path = "DELETE", _path(args.tenant)
    elif args.action == "set":
        limit: Any = int(args.limit) if args.limit.isdigit() else args.limit
        method, path, body = "PUT", _path(args.tenant), {"limits": {args.tier: limit}}
    elif args.action == "config":
        path = "/quota/config"
        defaults = {"pool": args.default_limit, "disk": args.default_disk}
        change: dict[str, Any] = {"mode": args.mode}
        if args.default_disk is None:
            change["default_limit"] = args.default_limit
        else:
            change["default_limits"] = {k: v for k, v in defaults.items() if v is not None}
        change = {k: v for k, v in change.items() if v is not None}
        if change:
            method, body = "PUT", change
    headers = {"Content-Type": "application/json"}
    if args.auth_token:
        headers["Authorization"] = f"Bearer {args.auth_token}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        args.url.rstrip("/") + path, data=data, method=method, headers=headers
    )
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as resp:
            print(json.dumps(json.loads(resp.read()), indent=2))
            return 0
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read()).get("error", exc.reason)
        except ValueError:
            message = exc.reason
        print(f"tierkv quota: {exc.code}: {message}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"tierkv quota: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
