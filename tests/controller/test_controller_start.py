"""The controller's start-up order: its control endpoint (what servers and start-up
scripts wait for) answers only once HTTP serves too, and a port in use fails the start
before anything else runs."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from support.clusterkit import TOKEN
from support.controllers import ctl_call
from support.httputil import free_port, get_json
from tierkv.cluster import messages as m
from tierkv.config import ConfigError
from tierkv.controller.app import Controller
from tierkv.controller.config import ControllerConfig
from tierkv.web import serving


@pytest.fixture
def slow_http(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """HTTP's start takes half a second longer (the real start, after a wait); the event
    is set when the real start begins."""
    real_start = serving.HttpServer.start
    began = threading.Event()

    def start(self: serving.HttpServer, *args: Any, **kwargs: Any) -> None:
        time.sleep(0.5)
        began.set()
        real_start(self, *args, **kwargs)

    monkeypatch.setattr(serving.HttpServer, "start", start)
    yield began


def test_the_control_endpoint_answers_only_once_http_serves(
    slow_http: threading.Event,
) -> None:
    cfg = ControllerConfig(port=free_port(), http_port=free_port(), auth_token=TOKEN)
    addr = f"127.0.0.1:{cfg.port}"
    controller = Controller(cfg)
    starting = threading.Thread(target=controller.start)
    starting.start()
    deadline = time.monotonic() + 30
    try:
        while ctl_call(addr, m.GetStatus(0), timeout=0.2) is None:
            assert starting.is_alive() or controller.control.alive(), "the start failed"
            assert time.monotonic() < deadline, "the controller did not answer in 30 s"
        assert slow_http.is_set()
        # The first answer: HTTP must serve already (not refuse the connection).
        health = get_json(f"http://127.0.0.1:{cfg.http_port}/healthcheck")
        assert health["status"] == "ok", health
    finally:
        starting.join(10)
        controller.close()


def test_a_control_port_in_use_fails_the_start_before_http_binds() -> None:
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        port = taken.getsockname()[1]
        cfg = ControllerConfig(port=port, http_port=free_port(), auth_token=TOKEN)
        with pytest.raises(ConfigError, match="cannot bind"):
            Controller(cfg).start()
        # HTTP never bound: its port is free for the next start.
        socket.create_server(("127.0.0.1", cfg.http_port)).close()
    finally:
        taken.close()
