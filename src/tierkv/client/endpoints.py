"""Where a server listens by default (the endpoint a server started with the same instance
name serves), for a client given no endpoint."""

from __future__ import annotations

import os

from tierkv.runtime_dir import default_runtime_dir


def default_endpoint(instance: str = "default") -> str:
    """The endpoint a server started with the same instance name listens on."""
    env = os.environ.get("TIERKV_ENDPOINT")
    if env:
        return env
    return f"ipc://{os.path.join(default_runtime_dir(instance), 'rpc.sock')}"
