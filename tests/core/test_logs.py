"""Server logging: levels, the JSON format, and no per-chunk lines at INFO."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable

import numpy as np
import pytest

from support.httputil import free_port, request
from support.servers import CHUNK_SHAPE, CHUNK_SIZE, ServerProcess, chunk_data, register
from tierkv.logs import JsonFormatter

Servers = Callable[..., ServerProcess]
ROUNDS = 40


def workload(srv: ServerProcess, base: str) -> None:
    """ROUNDS documents of 4 chunks stored, looked up and retrieved; a clear; HTTP reads."""
    with srv.client() as client:
        register(client, name="log-test")
        out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(4)]
        for r in range(ROUNDS):
            tokens = list(range(r * 10_000, r * 10_000 + 4 * CHUNK_SIZE))
            client.store(tokens, [chunk_data(tokens, i) for i in range(4)])
            client.lookup(tokens + [1] * CHUNK_SIZE, request_id=f"r{r}")
            client.retrieve(request_id=f"r{r}", out=out)
        client.clear()
    for path in ("/", "/status", "/metrics", "/healthcheck"):
        assert request("GET", base + path).status == 200


def test_json_lines_at_info_and_nothing_per_chunk(server_factory: Servers) -> None:
    port = free_port()
    srv = server_factory(
        extra=["--log-format", "json", "--log-level", "info", "--http-port", str(port)]
    )
    workload(srv, f"http://127.0.0.1:{port}")
    assert srv.stop() == 0
    lines = srv.log().splitlines()
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    for rec in records:
        assert set(rec) >= {"ts", "level", "logger", "msg"}, rec
        assert rec["ts"].endswith("Z") and rec["level"] in ("info", "warning"), rec
    messages = [rec["msg"] for rec in records]
    # A handful of lifecycle lines, however many chunks moved (ROUNDS x 4 stored).
    assert len(records) < 12, messages
    for expected in ("serving", "HTTP on", "registered client log-test", "cleared 1 namespace "):
        assert any(expected in msg for msg in messages), (expected, messages)
    assert "stopped" in messages[-1]


def test_warning_level_keeps_the_log_quiet(server_factory: Servers) -> None:
    port = free_port()
    srv = server_factory(extra=["--log-level", "warning", "--http-port", str(port)])
    workload(srv, f"http://127.0.0.1:{port}")
    assert srv.stop() == 0
    assert srv.log() == ""


def test_debug_level_text_format(server_factory: Servers) -> None:
    srv = server_factory(extra=["--log-level", "debug", "--log-format", "text"])
    with srv.client() as client:
        register(client)
    assert srv.stop() == 0
    lines = srv.log().splitlines()
    assert any(" INFO tierkv.server.service: registered client" in line for line in lines)
    assert all(not line.startswith("{") for line in lines)


def test_json_formatter_carries_exceptions() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord(
            "tierkv.test", logging.ERROR, __file__, 1, "failed %s", ("x",), sys.exc_info()
        )
    rec = json.loads(JsonFormatter().format(record))
    assert rec["level"] == "error" and rec["msg"] == "failed x" and rec["logger"] == "tierkv.test"
    assert "ValueError: boom" in rec["exc"]


@pytest.mark.processes
@pytest.mark.parametrize("flag", [["--log-level", "loud"], ["--log-format", "xml"]])
def test_bad_logging_options_are_refused(flag: list[str]) -> None:
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "tierkv.cli", "server", *flag],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and flag[0][2:].replace("-", "_") in done.stderr
