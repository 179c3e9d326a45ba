"""CPU priority of the threads that move bulk bytes, so the control path never waits behind them.

A server moves bulk data on its own threads (peer fetches and sends, the copy threads of a
disk tier and of an engine's client), and on a machine with few cores they can keep every
core busy: a LOOKUP that arrives then waits for a core behind them. These data threads
therefore run with a higher nice value than the RPC loop (Linux applies nice per thread),
so the scheduler runs a control request first as soon as it arrives; while nothing else
wants the CPU the data threads still get all of it.

Only threads that spend their time in calls that release the GIL (socket I/O, memcpy,
checksums) are data threads. The GIL knows no priorities: a lowered thread that runs Python
(and holds the GIL) and is preempted by a busier normal-priority process stalls every other
thread of its process that wants the GIL, the RPC loop included, until it runs again
(measured: lookups of 40 ms during transfers with the tier executor lowered, whose threads
resolve peers and commit chunks in Python). So the tier executor, and a vLLM worker's store
thread (a Python loop over blocks), keep the process's priority.

:func:`data_thread` is the initializer to give a data thread pool (or to call first thing
in a data thread). Where nice cannot be changed (another OS), it does nothing.

Nice alone does not get a woken control thread onto a core at once. Linux's EEVDF scheduler
(6.6 and later) lets the thread it just picked run to the end of its slice, however low its
priority: a LOOKUP's RPC thread, woken while data threads hold both cores, waited for the
next scheduler tick (4 ms at HZ=250) in about one lookup of a hundred (measured with ftrace
in ``benchmarks/load.py`` (b)). :func:`control_thread` asks for a short slice
(``sched_setattr`` with ``sched_runtime``, Linux 6.12 and later), which lets the thread
preempt a running thread with a longer one as soon as it wakes; it only ever shortens the
thread's own turns, so it needs no privilege and costs the other threads nothing. Older
kernels ignore it. (The other half of that wait is a data thread inside one long system
call: a kernel built without preemption, as most server kernels are, switches threads only
between system calls, so bulk I/O goes in pieces of at most :data:`tierkv.pieces.PIECE`.)
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import threading

DATA_NICE = 10  # added to the process's nice for data threads (Linux caps nice at 19)
CONTROL_SLICE_NS = 100_000  # a control thread's scheduler slice (the kernel's minimum)
_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}  # syscall numbers
_SCHED_OTHER = 0
# struct sched_attr (version 0, 48 bytes): size, policy, flags, nice, priority, runtime,
# deadline, period.
_SCHED_ATTR = struct.Struct("=IIQiIQQQ")


def _data_nice() -> int:
    """:data:`DATA_NICE`, or ``$TIERKV_DATA_NICE`` (0: data threads keep the priority)."""
    try:
        return max(0, int(os.environ.get("TIERKV_DATA_NICE", DATA_NICE)))
    except ValueError:
        return DATA_NICE


def data_thread() -> None:
    """Lower the calling thread's CPU priority by :data:`DATA_NICE` (once per thread)."""
    if getattr(_state, "lowered", False):
        return
    _state.lowered = True
    step = _data_nice()
    if not step:
        return
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + step))
    except (OSError, AttributeError):
        pass  # not Linux, or not allowed: the thread keeps the process's priority


def _control_slice() -> int:
    """:data:`CONTROL_SLICE_NS`, or ``$TIERKV_CONTROL_SLICE_US`` microseconds (0: the
    kernel's default slice)."""
    try:
        return max(0, int(os.environ["TIERKV_CONTROL_SLICE_US"]) * 1000)
    except (KeyError, ValueError):
        return CONTROL_SLICE_NS


def control_thread() -> bool:
    """Give the calling thread a short scheduler slice (see the module docstring), keeping
    its policy (normal) and nice; whether the kernel took it. Threads that answer requests
    (the RPC loop) call it once when they start."""
    number = _SCHED_SETATTR.get(platform.machine())
    runtime = _control_slice()
    if number is None or not runtime or os.sched_getscheduler(0) != _SCHED_OTHER:
        return False
    try:
        nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        attr = ctypes.create_string_buffer(
            _SCHED_ATTR.pack(_SCHED_ATTR.size, _SCHED_OTHER, 0, nice, 0, runtime, 0, 0)
        )
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(number, 0, attr, 0)) == 0
    except (OSError, AttributeError):
        return False


_state = threading.local()
