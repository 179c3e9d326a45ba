"""Watching engine processes: pid + start time, only within the server's own pid scope."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tierkv.liveness import Process, process_scope, start_time, trackable


def test_this_process_is_trackable_and_alive() -> None:
    assert process_scope()  # Linux: "<boot id>/<pid namespace inode>"
    me = trackable(os.getpid(), process_scope())
    assert me is not None and me.alive()


@pytest.mark.processes
def test_a_process_that_exited_is_gone_reaped_or_not() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    proc = trackable(child.pid, process_scope())
    assert proc is not None and proc.alive()
    child.kill()
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
    assert not proc.alive()  # a zombie counts as gone
    child.wait()
    assert not proc.alive() and start_time(child.pid) is None


def test_a_reused_pid_is_not_the_same_process() -> None:
    started = start_time(os.getpid())
    assert started is not None
    assert not Process(os.getpid(), started + 1).alive()


def test_other_scopes_and_bad_pids_are_not_tracked() -> None:
    assert trackable(os.getpid(), "") is None
    assert trackable(os.getpid(), "another-host/4026531836") is None
    for pid in (0, -1, 2**31 - 1, 2**62):
        assert trackable(pid, process_scope()) is None
