"""benchmarks/stop_signals.py: a benchmark stopped by SIGTERM or SIGHUP, directly or through
the runner, still kills its spinners and unlinks its shared-memory segment, and exits with
128 + the signal's number; the runner records nothing for it. A second stop signal while it
cleans up (``pkill -f`` matches the runner and the script: the script gets its own and the
one the runner passes on) does not cut the cleanup short."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support.proc_tree import children, descendants

pytestmark = pytest.mark.processes  # real scripts, spinners and segments

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

SCRIPT = """
import sys, time
from busy_cores import kept_busy
from stop_signals import exit_on_stop_signals
from tierkv.pool import ShmPool

def main():
    exit_on_stop_signals()
    segment = ShmPool.create(sys.argv[1], 1 << 20)
    try:
        with kept_busy(1):
            print("ready", flush=True)
            time.sleep(60)
    finally:
        print("cleaning up", flush=True)
        if sys.argv[2:] == ["slow"]:
            time.sleep(1)  # as long as stopping a benchmark's servers takes
        segment.close()
        print("cleaned up", flush=True)

main()
"""


def _start(tmp_path: Path, segment: str, through_runner: bool, *args: str) -> subprocess.Popen[str]:
    script = tmp_path / "stoppable.py"
    script.write_text(SCRIPT)
    runner = [str(BENCHMARKS / "run.py"), "--results", str(tmp_path / "results.jsonl")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCHMARKS), *sys.path])}
    return subprocess.Popen(
        [sys.executable, *(runner if through_runner else []), str(script), segment, *args],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def _wait_for(proc: subprocess.Popen[str], wanted: str) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:  # the spinner's line, then ours
        if line.strip() == wanted:
            return
    pytest.fail(f"the script never printed {wanted!r}")


def _tear_down(proc: subprocess.Popen[str], spinners: set[int], segment: str) -> bool:
    """Kill what a test started, whatever happened, and unlink the segment; whether the
    segment was still there (the script's cleanup left it behind)."""
    for pid in [proc.pid, *spinners]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    leaked = Path(f"/dev/shm/{segment}").exists()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"/dev/shm/{segment}")
    return leaked


def _spinning(pids: set[int]) -> set[int]:
    """Those of ``pids`` running busy_cores' spin loop."""
    found = set()
    for pid in pids:
        try:
            if b"while True: pass" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.add(pid)
        except OSError:
            continue
    return found


@pytest.mark.parametrize(
    ("signum", "through_runner"),
    [(signal.SIGTERM, False), (signal.SIGHUP, False), (signal.SIGTERM, True)],
)
def test_stopped_benchmark_cleans_up(tmp_path: Path, signum: int, through_runner: bool) -> None:
    segment = f"tierkv-test-stop-{os.getpid()}-{signum}-{int(through_runner)}"
    proc = _start(tmp_path, segment, through_runner)
    assert proc.stdout is not None
    spinners: set[int] = set()
    try:
        _wait_for(proc, "ready")
        assert Path(f"/dev/shm/{segment}").exists()
        spinners = _spinning(set(descendants(proc.pid)))
        assert len(spinners) == 1
        proc.send_signal(signum)
        # A spinner left behind would hold the pipe open: no end of output, a timeout.
        rest, _ = proc.communicate(timeout=30)
    finally:
        _tear_down(proc, spinners, segment)
    assert proc.returncode == 128 + signum
    assert "cleaned up" in rest  # the script's finally ran (and could still print)
    assert not any(Path(f"/proc/{pid}").exists() for pid in spinners)  # killed and reaped
    assert not (tmp_path / "results.jsonl").exists()  # a stopped run records nothing


@pytest.mark.parametrize("through_runner", [False, True])
def test_a_second_stop_signal_does_not_cut_the_cleanup_short(
    tmp_path: Path, through_runner: bool
) -> None:
    segment = f"tierkv-test-stop-twice-{os.getpid()}-{int(through_runner)}"
    proc = _start(tmp_path, segment, through_runner, "slow")
    spinners: set[int] = set()
    try:
        _wait_for(proc, "ready")
        spinners = _spinning(set(descendants(proc.pid)))
        (script,) = children(proc.pid) if through_runner else (proc.pid,)
        os.kill(script, signal.SIGTERM)
        _wait_for(proc, "cleaning up")
        proc.send_signal(signal.SIGTERM)  # the runner passes it on to the script
        rest, _ = proc.communicate(timeout=30)
    finally:
        leaked = _tear_down(proc, spinners, segment)
    assert "cleaned up" in rest
    assert not leaked
    assert proc.returncode == 128 + signal.SIGTERM
    assert not any(Path(f"/proc/{pid}").exists() for pid in spinners)
