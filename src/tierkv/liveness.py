"""Whether an engine process is still alive, so the server can drop a crashed engine's locks
at once instead of waiting for their leases to expire (minutes).

A process is named by its pid *and* its start time (``/proc/PID/stat`` field 22, in clock
ticks since boot): a pid reused by a later process has a different start time, so it is never
mistaken for the engine. That only means something where the server sees the same pids as
the engine: the same host boot and the same pid namespace. The engine sends
:func:`process_scope` (boot id + pid namespace) with its pid when it registers; the server
tracks the process only if the scope equals its own, and otherwise (an engine in another
container's pid namespace, or on another host over TCP) falls back to the lease TTLs.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple


@functools.cache
def process_scope() -> str:
    """``"<boot id>/<pid namespace inode>"`` of this process, or "" where Linux's /proc
    does not tell (then no process is ever tracked)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}/{ns}" if boot else ""


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), None if there is no such
    process, it has exited and only waits to be reaped (a zombie), or /proc cannot tell."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Field 2 (the command) is in parentheses and may contain anything: split after it.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        if fields[0] in (b"Z", b"X"):  # field 3, the state: exited
            return None
        return int(fields[19])  # field 22 overall
    except (IndexError, ValueError):
        return None


class Process(NamedTuple):
    pid: int
    started: int

    def alive(self) -> bool:
        """Whether the process still runs (an exited one not yet reaped does not)."""
        return start_time(self.pid) == self.started


def trackable(pid: int, scope: str) -> Process | None:
    """The process a client registering with ``pid`` and ``scope`` runs in, if this server
    can watch it (same host boot and pid namespace, and the process exists now)."""
    if not scope or scope != process_scope():
        return None
    started = start_time(pid)
    return Process(pid, started) if started is not None else None


__all__ = ["Process", "process_scope", "start_time", "trackable"]
