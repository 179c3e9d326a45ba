"""The refusals of a control port are one WARNING, then a summary with the counts at most
every ``interval`` (of a clock the test moves), never a line each."""

from __future__ import annotations

import logging

import pytest

from tierkv.cluster.control_server import RefusalLog

LOGGER = "tierkv.test.refusals"


def test_refusals_are_summarised_once_an_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [1000.0]
    refusals = RefusalLog("port 1", logging.getLogger(LOGGER), 60.0, clock=lambda: now[0])
    caplog.set_level(logging.DEBUG, LOGGER)
    for i in range(1000):
        refusals.failed("request", "wrong signature" if i % 2 else "no request signature")
        now[0] += 0.05  # 50 s in all
    now[0] += 11.0
    refusals.failed("request", "replayed")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "port 1: refused a request: no request signature; further refusals are logged at "
        "DEBUG and summarised at most every 60s",
        "port 1: 1001 requests refused in 61s; the last: replayed",
    ]
    assert len([r for r in caplog.records if r.levelno == logging.DEBUG]) == 999
    assert refusals.total_failures == 1001
