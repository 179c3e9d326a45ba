"""What a child process that did not start in time was doing, for the test's error message.

A server that neither answers nor logs a line within its start-up timeout leaves a test
with an empty log and no cause. :func:`describe_stuck` gathers what can still be seen: the
process's state in the kernel (run state, what it waits in, CPU seconds it used), the
machine's load, free memory and busiest processes (a start-up starved of the cores or of
memory, or one stuck in the kernel, reads differently), and, for a Python child started
with :data:`FAULTHANDLER`, every thread's stack: a SIGABRT makes ``faulthandler`` write
them to the child's stderr (its log) before it ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from support.proc_tree import descendants

# Arguments for the interpreter of a child whose stacks :func:`describe_stuck` may dump.
FAULTHANDLER = ["-X", "faulthandler"]
_TICKS = os.sysconf("SC_CLK_TCK")


def describe_stuck(proc: subprocess.Popen[bytes], log_path: Path | None) -> str:
    """The kernel's view of ``proc``, the machine's load, then (``proc`` ends here: SIGABRT)
    the stacks ``faulthandler`` wrote to ``log_path`` with whatever was logged before."""
    if proc.poll() is not None:
        return f"the process exited with {proc.returncode}\n{_read(log_path)}"
    tree = descendants(proc.pid)  # an engine's workers, a server's front process
    parts = [_process_state(pid) for pid in [proc.pid, *tree]]
    parts.append(_machine_load())
    size = log_path.stat().st_size if log_path is not None and log_path.exists() else 0
    for pid in tree:  # each dumps its own stacks where it runs faulthandler
        _signal(pid, signal.SIGABRT)
    proc.send_signal(signal.SIGABRT)
    try:
        proc.wait(5.0)
    except subprocess.TimeoutExpired:  # stuck where no signal is taken (the kernel: D state)
        proc.kill()
        proc.wait()
        parts.append("no stacks: the process did not take SIGABRT within 5 s")
    wait_gone(tree, 5.0)  # their stacks written
    for pid in tree:  # none may outlive the test
        _signal(pid, signal.SIGKILL)
    log = _read(log_path)
    parts.append(f"its log ({size} bytes before the SIGABRT), with the stacks:\n{log}")
    return "\n".join(parts)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def gone(pid: int) -> bool:
    """Whether ``pid`` has ended (no such process, or a zombie not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def wait_gone(pids: list[int], timeout: float) -> None:
    """Until every one of ``pids`` has ended (:func:`gone`), at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)


def _process_state(pid: int) -> str:
    proc = Path(f"/proc/{pid}")
    try:
        status = dict(
            line.split(":", 1) for line in (proc / "status").read_text().splitlines() if ":" in line
        )
        stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        wchan = (proc / "wchan").read_text().strip() or "-"
    except OSError as exc:
        return f"process {pid}: /proc unreadable ({exc})"
    cpu = (int(stat[11]) + int(stat[12])) / _TICKS  # utime + stime
    started = int(stat[19]) / _TICKS
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return (
        f"process {pid}: state {status.get('State', '?').strip()}, waiting in {wchan}, "
        f"{cpu:.2f} s of CPU in {uptime - started:.1f} s, "
        f"{status.get('Threads', '?').strip()} threads, RSS {status.get('VmRSS', '?').strip()}"
    )


def _machine_load() -> str:
    load = Path("/proc/loadavg").read_text().strip()
    try:
        top = subprocess.run(
            ["ps", "-eo", "pid,stat,pcpu,etime,args", "--sort=-pcpu", "--cols", "160"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout.splitlines()[:8]
    except (OSError, subprocess.TimeoutExpired) as exc:
        top = [f"(ps failed: {exc})"]
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    memory = ", ".join(f"{k} {meminfo[k].strip()}" for k in ("MemAvailable", "Shmem"))
    return "\n".join([f"load average {load}; {memory}; busiest processes:", *top])


def _read(path: Path | None) -> str:
    if path is None:
        return "(no log)"
    text = path.read_text(errors="replace") if path.exists() else ""
    return text or "(empty)"
