"""A child that does not start in time is described, not just reported silent: its state in
the kernel, the machine's load and, for a Python child, every thread's stack."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.stuck import FAULTHANDLER, describe_stuck, gone, wait_gone

pytestmark = pytest.mark.processes

STUCK = """
import sys, time
def waiting_for_something_that_never_comes():
    print("started", flush=True)
    time.sleep(600)
waiting_for_something_that_never_comes()
"""


def _start(tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    log_path = tmp_path / "child.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, *FAULTHANDLER, "-c", STUCK], stdout=log, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + 30
    while "started" not in log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.02)
    return proc, log_path


def test_a_stuck_python_child_is_described_with_its_stacks(tmp_path: Path) -> None:
    proc, log_path = _start(tmp_path)
    text = describe_stuck(proc, log_path)
    assert proc.poll() is not None  # ended by the SIGABRT
    assert f"process {proc.pid}: state S (sleeping)" in text
    assert "load average" in text and "busiest processes" in text
    assert "most recent call first" in text
    assert "waiting_for_something_that_never_comes" in text


def test_a_child_that_takes_no_signal_is_killed_and_said_so(tmp_path: Path) -> None:
    proc, log_path = _start(tmp_path)
    proc.send_signal(signal.SIGSTOP)  # takes no signal but SIGKILL until continued
    text = describe_stuck(proc, log_path)
    assert proc.returncode == -signal.SIGKILL
    assert "state T (stopped)" in text
    assert "did not take SIGABRT within 5 s" in text


def test_a_child_that_exited_is_described_by_its_exit_code(tmp_path: Path) -> None:
    log_path = tmp_path / "child.log"
    log_path.write_text("bad option\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    assert describe_stuck(proc, log_path) == "the process exited with 3\nbad option\n"


PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", %r])
print("started", flush=True)
time.sleep(600)
"""


def test_the_children_of_a_stuck_child_are_described_and_do_not_outlive_it(
    tmp_path: Path,
) -> None:
    log_path = tmp_path / "child.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, *FAULTHANDLER, "-c", PARENT % STUCK],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 30
    while log_path.read_text().count("started") < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    assert len(children) == 1
    grandchild = int(children[0])
    text = describe_stuck(proc, log_path)
    assert f"process {grandchild}: state S (sleeping)" in text
    assert "waiting_for_something_that_never_comes" in text  # the grandchild's stack
    wait_gone([grandchild], 10)
    assert gone(grandchild)
