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
"""

from __future__ import annotations

import os
import threading

DATA_NICE = 10  # added to the process's nice for data threads (Linux caps nice at 19)


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


_state = threading.local()
