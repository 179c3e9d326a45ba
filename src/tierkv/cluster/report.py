"""Human-readable lines of a cluster node's figures (``ClusterNode.stats()``), for
`tierkv status` and other plain-text reports."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tierkv.pool import format_bytes


def summary_lines(stats: Mapping[str, Any]) -> list[str]:
    """A few lines: membership, directory, publishing, then one line per peer."""
    if not stats:
        return []
    members = [m for m in stats.get("members", []) if m.get("state") in ("alive", "self")]
    dead = [m for m in stats.get("members", []) if m.get("state") == "dead"]
    d = stats.get("directory", {})
    ctl = stats.get("control", {})
    lines = [
        f"cluster   node {stats.get('node_id')}: {len(members)} members"
        + (f" ({len(dead)} recently dead)" if dead else "")
        + f"; directory {d.get('entries', 0)} entries here, {d.get('resolves', 0)} lookups "
        f"({d.get('resolve_rpcs', 0)} owner round trips), {d.get('rebalances', 0)} rebalances; "
        f"published {stats.get('published', 0)} in pool, {stats.get('on_disk', 0)} on disk; "
        f"{ctl.get('refused', 0)} requests refused",
    ]
    transport = stats.get("transport", {})
    for direction, verb in (("received", "from"), ("sent", "to")):
        for peer, f in sorted(transport.get(direction, {}).items()):
            p50 = f.get("latency_ms_p50")
            lines.append(
                f"  {verb:<4} {peer}: {f.get('chunks', 0)} chunks, "
                f"{format_bytes(f.get('bytes', 0))}, {f.get('requests', 0)} requests"
                + (f" (p50 {p50:.1f} ms)" if p50 is not None else "")
                + f"; missing {f.get('missing', 0)}, corrupt {f.get('corrupt', 0)}, "
                f"errors {f.get('errors', 0)}"
            )
    return lines
