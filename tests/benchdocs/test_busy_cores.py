"""benchmarks/busy_cores.py: ``--busy-cores N`` keeps N processes spinning for exactly the
measurement's duration, and names the summary line apart from ordinary runs."""

from __future__ import annotations

import argparse
import os
import time

import pytest

from busy_cores import add_option, kept_busy, line_name
from support.proc_tree import children


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.processes
def test_spinners_run_for_the_block_and_are_gone_after() -> None:
    before = children(os.getpid())
    with kept_busy(1):
        spinners = children(os.getpid()) - before
        assert len(spinners) == 1
        (pid,) = spinners
        deadline = time.monotonic() + 10
        while _cpu_seconds(pid) < 0.2:  # it spins: CPU time, not sleep
            assert time.monotonic() < deadline, "the spinner used no CPU"
            time.sleep(0.05)
    assert children(os.getpid()) == before and not os.path.exists(f"/proc/{pid}")  # killed, reaped


def test_no_spinner_for_zero_and_a_clear_error_for_less() -> None:
    before = children(os.getpid())
    with kept_busy(0):
        assert children(os.getpid()) == before
    with pytest.raises(SystemExit, match="--busy-cores"), kept_busy(-1):
        pass


def test_option_and_line_name() -> None:
    ap = argparse.ArgumentParser()
    add_option(ap)
    assert ap.parse_args([]).busy_cores == 0
    assert ap.parse_args(["--busy-cores", "2"]).busy_cores == 2
    assert line_name("peers", 0) == "peers"
    assert line_name("peers", 1) == "peers_busy"
