"""Waiting until a server answers (a process just started, or restarting)."""

from __future__ import annotations

import time
from collections.abc import Callable

from tierkv.client.api import Client
from tierkv.client.errors import ServerUnavailableError


def wait_for_server(
    endpoint: str,
    timeout: float,
    exited: Callable[[], bool] = lambda: False,
    auth_token: str = "",
) -> bool:
    """Ping ``endpoint`` until the server answers (True) or its process has ``exited()``
    (False); raises :class:`ServerUnavailableError` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    with Client(endpoint, timeout=0.5, auth_token=auth_token) as probe:
        while True:
            if exited():
                return False
            try:
                probe.ping(timeout=0.5)
                return True
            except ServerUnavailableError:
                if time.monotonic() > deadline:
                    raise
