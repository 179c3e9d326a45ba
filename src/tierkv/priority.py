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

A thread that wants the GIL while another holds it waits up to the interpreter's switch
interval before it forces a switch, 5 ms by default; the data threads take the GIL back after
each piece of I/O (:mod:`tierkv.pieces`), and an RPC loop that came back from a system call
to find it taken waited out that interval (seen with ftrace in ``benchmarks/load.py`` (b):
lookups of 5 to 6 ms whose RPC thread slept until the timeout). While a process moves bulk
data (:func:`moving_data`) the interval is :data:`DATA_SWITCH_INTERVAL` (19 runs of (b),
alternating: the lookup p99 averaged 6.3 to 7.2 ms in three configurations with 1 ms, 7.0
to 9.8 in three with 5 ms). Only then: with no data threads, a short interval only
interrupts control work with other control work (8 engines on one server, ``load.py`` (a):
p99 5.7 to 6.6 ms with 1 ms throughout, 5.1 to 5.8 with 5 ms, three runs each).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator

DATA_NICE = 10  # added to the process's nice for data threads (Linux caps nice at 19)
DATA_SWITCH_INTERVAL = 0.001  # seconds a thread waits for the GIL while data moves


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


@contextlib.contextmanager
def moving_data() -> Iterator[None]:
    """Around bulk data work on data threads (a tier load or store, serving a peer): while
    any runs in this process, a thread waiting for the GIL forces a switch after
    :data:`DATA_SWITCH_INTERVAL`; the interpreter's own interval comes back after the last."""
    with _moving.lock:
        if not _moving.count:
            _moving.restore = sys.getswitchinterval()
            sys.setswitchinterval(min(_moving.restore, DATA_SWITCH_INTERVAL))
        _moving.count += 1
    try:
        yield
    finally:
        with _moving.lock:
            _moving.count -= 1
            if not _moving.count:
                sys.setswitchinterval(_moving.restore)


class _Moving:
    """How many :func:`moving_data` blocks run, and the interval to restore after them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.restore = sys.getswitchinterval()


_moving = _Moving()
_state = threading.local()
