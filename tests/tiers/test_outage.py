"""The outage log every tier reports its failures to: one WARNING per outage, a summary at
most every ``interval`` (of a clock the test moves), one INFO line with the count when the
tier works again, and a flapping tier held to the same bound."""

from __future__ import annotations

import logging
import threading

import pytest

from tierkv.tiers.outage import Outage

LOGGER = "tierkv.test.outage"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def outage(clock: Clock) -> Outage:
    return Outage("test tier", logging.getLogger(LOGGER), interval=60.0, clock=clock)


def lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


def test_one_warning_per_outage_and_one_line_when_it_ends(
    outage: Outage, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, LOGGER)
    outage.ok()  # works: nothing to say
    assert caplog.records == []
    for _ in range(400):
        outage.failed("contains", ConnectionError("refused"), items=4)
        clock.now += 0.01
    assert outage.down
    warnings = lines(caplog, logging.WARNING)
    assert len(warnings) == 1
    assert "test tier: contains failed (refused)" in warnings[0]
    assert len(lines(caplog, logging.DEBUG)) == 399
    outage.ok()
    outage.ok()
    assert not outage.down
    assert lines(caplog, logging.INFO) == [
        "test tier: works again after 4.0s; 1600 failures meanwhile"
    ]
    assert (outage.outages, outage.total_failures) == (1, 1600)


def test_a_long_outage_is_summarised_every_interval(
    outage: Outage, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    outage.failed("load", "timeout", items=2)
    clock.now += 59.0
    outage.failed("load", "timeout", items=2)
    assert len(lines(caplog, logging.WARNING)) == 1
    clock.now += 1.0
    outage.failed("store", "refused", items=0)  # a whole-tier request counts once
    warnings = lines(caplog, logging.WARNING)
    assert len(warnings) == 2
    assert (
        warnings[1]
        == "test tier: still failing: 5 failures in 60s; the last: store failed (refused)"
    )


def test_a_flapping_tier_logs_at_most_one_warning_per_interval(
    outage: Outage, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, LOGGER)
    for _ in range(50):
        outage.failed("SET", "OOM")
        outage.ok()
        clock.now += 0.5
    assert len(lines(caplog, logging.WARNING)) == 1
    assert len(lines(caplog, logging.INFO)) == 1  # only the end of the outage it announced
    assert outage.outages == 50
    clock.now += 60.0
    outage.failed("SET", "OOM")
    assert len(lines(caplog, logging.WARNING)) == 2


def test_concurrent_reports_count_every_failure(outage: Outage) -> None:
    def fail() -> None:
        for _ in range(1000):
            outage.failed("GET", "refused")

    threads = [threading.Thread(target=fail) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outage.total_failures == 8000 and outage.outages == 1
