"""Where a server keeps its sockets and files by default: one directory per instance name
under the user's runtime directory (what a client given no endpoint looks for too)."""

from __future__ import annotations

import os


def default_runtime_dir(instance: str) -> str:
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/tierkv-{os.getuid()}"
    return os.path.join(base, "tierkv", instance)
