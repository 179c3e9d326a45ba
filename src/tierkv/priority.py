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

Nice alone does not get a woken control thread onto a core at once. Linux's scheduler
(EEVDF, 6.6 and later) lets the thread on a core run out a protected part of its time slice
(``RUN_TO_PARITY``; 1.4 ms by default on the 2-core CI machine type) before a woken thread
takes the core, whatever their nice values, and notices the slice's end only at the next
timer tick (4 ms at HZ=250) unless the running thread blocks or yields first; a thread
copying or hashing in user space does neither. Two measures remove that wait:

- A data thread's time slice is :data:`DATA_SLICE_NS` (3 ms), longer than the default, so
  that a woken thread of the default slice is the one with the shorter slice, and the
  kernel (``PREEMPT_SHORT``, Linux 6.12 and later) lets it preempt at once instead of
  honouring the data thread's protection. Set with ``sched_setattr`` (x86-64 and arm64;
  older kernels ignore the slice).
- After each piece of bulk I/O (:mod:`tierkv.piecewise_io`: about 0.1 ms of copying) a data
  thread yields (:func:`give_way`), so a thread that woke meanwhile runs then.

The other side of the same rule: a server's RPC loop and its request workers are control
threads (:func:`control_thread`) with a short slice, :data:`CONTROL_SLICE_NS` (0.2 ms), at the
process's nice value. Woken, such a thread preempts at once any thread whose slice is longer,
which includes every thread of the default slice: an engine's OpenMP threads spinning after
a forward pass, or any other busy process on the node, which the data threads' nice does
not cover. It gets no larger share of the CPU (that is the nice value's weight), only an
earlier turn. Measured (seventh session of 2026-11-26, CI machine type): 1500 lookups of
4096 tokens, one every 2 ms, while two normal-priority processes spin on the two cores:
p99 3.8 and 4.0 ms with the default slice, 0.22 and 0.25 ms with the short one (p50 0.11 to
0.13 ms in all four runs).

Measured with ``benchmarks/load.py`` on the CI machine type, three runs each (the hour was
noisy: the 8-thread memcpy bound ranged from 14 to 26 GB/s): the 8-engine lookup p99
(experiment (a)) 4.1 / 5.3 / 7.7 ms with neither, 4.1 / 3.7 / 3.3 with both; the lookup p99
while data moves (b) 5.3 / 13.9 / 8.3 ms with neither, 3.0 / 3.1 / 6.0 with both; aggregate
store and retrieve GB/s no lower (store 15.0 / 13.9 / 16.3 and 18.2 / 16.9 / 15.3, retrieve
9.5 / 8.7 / 11.2 and 11.1 / 11.5 / 13.1). Yielding in the engines' chunk copies as well took
(a) to 1.3-1.6 ms but cost a fifth of the retrieve throughput (8.7-9.2 GB/s), so the copy
threads rely on the slice alone.

A thread that wants the GIL while another holds it waits up to the interpreter's switch
interval before it forces a switch, 5 ms by default; the data threads take the GIL back after
each piece of I/O (:mod:`tierkv.piecewise_io`), and an RPC loop that came back from a system call
to find it taken waited out that interval (seen with ftrace in ``benchmarks/load.py`` (b):
lookups of 5 to 6 ms whose RPC thread slept until the timeout). While a process moves bulk
data (:func:`moving_data`) the interval is :data:`DATA_SWITCH_INTERVAL` (19 runs of (b),
alternating: the lookup p99 averaged 6.3 to 7.2 ms in three configurations with 1 ms, 7.0
to 9.8 in three with 5 ms). Only then: with no data threads, a short interval only
interrupts control work with other control work (8 engines on one server, ``load.py`` (a):
p99 5.7 to 6.6 ms with 1 ms throughout, 5.1 to 5.8 with 5 ms, three runs each).

Python work done for HTTP clients in the server's process (a router's ``POST /lookup``, a
``GET /quota`` listing) holds the GIL the same way, on uvicorn's threads. While any runs
(:func:`sharing_the_gil`) the interval is :data:`HTTP_SWITCH_INTERVAL`, shorter still: an
engine's LOOKUP takes the GIL several times on its way (the RPC loop's receive, a worker,
the loop's send), each a wait of up to one interval behind router work that never stops
while 50 routers keep sending (``benchmarks/router_load.py``; the figures in
:mod:`tierkv.web.lookup`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import struct
import sys
import threading
from collections.abc import Iterator

DATA_NICE = 10  # added to the process's nice for data threads (Linux caps nice at 19)
BACKGROUND_NICE = 10  # added for a background process (a server's HTTP front)
DATA_SLICE_NS = 3_000_000  # a data thread's time slice (Linux's default: 0.7 ms x 1+log2 cores)
DATA_SWITCH_INTERVAL = 0.001  # seconds a thread waits for the GIL while data moves
HTTP_SWITCH_INTERVAL = 0.0002  # seconds, while Python work for HTTP clients runs
CONTROL_SLICE_NS = 200_000  # the RPC loop's time slice (the kernel's minimum is 0.1 ms)


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
        nice = min(19, current + step)
        if not _set_nice_and_slice(tid, nice, DATA_SLICE_NS):
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except (OSError, AttributeError):
        pass  # not Linux, or not allowed: the thread keeps the process's priority


def background_process() -> None:
    """For a process that serves others with less urgency than the engines (a server's HTTP
    front, :mod:`tierkv.server.front`), called by its first thread before any other starts
    (they inherit it): nice raised by :data:`BACKGROUND_NICE` and the data threads' long time
    slice, :data:`DATA_SLICE_NS`. Any thread of the default slice that wakes (an engine's, a
    server's RPC loop) then takes its core at once, and while the node is busy it gets a
    smaller share of the CPU; while a core is free it gets all of it. It shares no GIL with
    anyone, so its lower priority cannot hold up another thread (unlike a lowered thread in
    a server process: see the module's docstring)."""
    tid = threading.get_native_id()
    with contextlib.suppress(OSError, AttributeError):
        nice = min(19, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE)
        if not _set_nice_and_slice(tid, nice, DATA_SLICE_NS):
            os.setpriority(os.PRIO_PROCESS, tid, nice)


def _control_slice_ns() -> int:
    """:data:`CONTROL_SLICE_NS`, or ``$TIERKV_CONTROL_SLICE_US`` microseconds (0: the
    kernel's default slice)."""
    try:
        return max(0, int(os.environ["TIERKV_CONTROL_SLICE_US"]) * 1000)
    except (KeyError, ValueError):
        return CONTROL_SLICE_NS


def control_thread() -> None:
    """Give the calling thread (a server's RPC loop or one of its request workers) a short
    time slice, :data:`CONTROL_SLICE_NS`, at the process's nice value: woken, it takes a
    core at once from a thread with a longer slice (``PREEMPT_SHORT``), engine threads of
    the default slice included, where it would otherwise wait for their protected slice to
    run out. It gets no larger share of the CPU. Unprivileged; does nothing where
    ``sched_setattr`` is unknown or refused, or on kernels without custom slices."""
    slice_ns = _control_slice_ns()
    if not slice_ns:
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError, AttributeError):
        _set_nice_and_slice(tid, os.getpriority(os.PRIO_PROCESS, tid), slice_ns)


_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}  # system call numbers


def _set_nice_and_slice(tid: int, nice: int, slice_ns: int) -> bool:
    """``sched_setattr``: the normal policy at ``nice`` with a time slice of ``slice_ns``.
    False where the call is unknown or refused (then only nice is set, by the caller)."""
    nr = _SCHED_SETATTR.get(platform.machine())
    if nr is None or sys.platform != "linux":
        return False
    # struct sched_attr, first version (48 bytes): size, policy (0: SCHED_OTHER), flags,
    # nice, priority, runtime (the slice, for SCHED_OTHER), deadline, period.
    attr = ctypes.create_string_buffer(struct.pack("IIQiIQQQ", 48, 0, 0, nice, 0, slice_ns, 0, 0))
    return bool(ctypes.CDLL(None, use_errno=True).syscall(nr, tid, attr, 0) == 0)


def is_data_thread() -> bool:
    """Whether the calling thread was lowered into a data thread (and gives way between
    pieces of its work: :func:`give_way`)."""
    return bool(getattr(_state, "lowered", False))


def give_way() -> None:
    """Between two pieces of bulk work on a data thread: a thread that woke meanwhile (an
    RPC loop, an engine's scheduler) gets this core now. On other threads this does nothing.
    A yield that no thread is waiting for costs one system call, about a microsecond."""
    if _sched_yield is not None and getattr(_state, "lowered", False):
        _sched_yield()


_sched_yield = getattr(os, "sched_yield", None)


@contextlib.contextmanager
def moving_data() -> Iterator[None]:
    """Around bulk data work on data threads (a tier load or store, serving a peer): while
    any runs in this process, a thread waiting for the GIL forces a switch after
    :data:`DATA_SWITCH_INTERVAL`; the interpreter's own interval comes back after the last."""
    with _short_switches(DATA_SWITCH_INTERVAL):
        yield


@contextlib.contextmanager
def sharing_the_gil() -> Iterator[None]:
    """Around Python work for HTTP clients (a router's lookup, a quota listing) on other
    threads than the RPC loop: while any runs, a thread waiting for the GIL forces a switch
    after :data:`HTTP_SWITCH_INTERVAL`, so an engine's request, which takes the GIL several
    times on its way through the RPC loop and its workers, waits at most that long each
    time (see :mod:`tierkv.web.lookup`)."""
    with _short_switches(HTTP_SWITCH_INTERVAL):
        yield


@contextlib.contextmanager
def _short_switches(interval: float) -> Iterator[None]:
    """The switch interval at most ``interval`` while the block runs: the shortest of the
    blocks running in this process applies; the interpreter's own comes back after the
    last."""
    with _moving.lock:
        if not _moving.active:
            _moving.restore = sys.getswitchinterval()
        _moving.active[interval] = _moving.active.get(interval, 0) + 1
        sys.setswitchinterval(min([_moving.restore, *_moving.active]))
    try:
        yield
    finally:
        with _moving.lock:
            _moving.active[interval] -= 1
            if not _moving.active[interval]:
                del _moving.active[interval]
            sys.setswitchinterval(min([_moving.restore, *_moving.active]))


class _Moving:
    """The intervals of the :func:`_short_switches` blocks running (interval -> blocks),
    and the interval to restore after them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active: dict[float, int] = {}
        self.restore = sys.getswitchinterval()


_moving = _Moving()
_state = threading.local()
