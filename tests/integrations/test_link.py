"""The engine integrations' server link (circuit breaker around a registered client), against
a real server: needs no engine."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from support.servers import ServerProcess, register
from tierkv.client import Client
from tierkv.integrations.link import ServerLink
from tierkv.integrations.vllm.settings import ConnectorSettings


def test_a_wrong_auth_token_backs_off_instead_of_registering_again(
    server_factory: Callable[..., ServerProcess], caplog: pytest.LogCaptureFixture
) -> None:
    srv = server_factory(extra=["--auth-token", "right"])
    settings = ConnectorSettings.from_extra_config(
        {"endpoint": srv.endpoint, "auth_token": "wrong", "retry_interval": 600}
    )

    def register_engine(client: Client) -> None:
        register(client)

    link = ServerLink(settings, register_engine, "worker rank 0", logging.getLogger("engine"))
    caplog.set_level(logging.DEBUG, logger="engine")
    try:
        for _ in range(5):
            assert link.call("lookup", lambda c: 1, 0) == 0  # a miss, never an exception
    finally:
        link.close()
    assert link.failures == 1  # one refused REGISTER, then plain misses: no retry loop
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "refused this engine's auth token" in warnings[0], warnings
    assert "TIERKV_AUTH_TOKEN" in warnings[0]
    with Client(srv.endpoint, auth_token="right") as admin:
        assert admin.stats().errors.get("unauthorized") == 1
