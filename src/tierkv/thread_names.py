"""Thread names the operating system shows: ``top -H``, ``ps -L``, ``perf`` and py-spy name
a server's threads by what they do (``rpc-0``, ``copy_1``, ``eviction``) instead of
``python``.

Python before 3.14 names threads for Python only. :func:`name_os_threads`, called once by a
process tierkv owns (``tierkv server``, ``tierkv controller``; never inside an engine),
names the process (its main thread, which ``ps`` and ``pgrep`` show) and makes every thread
started afterwards set its kernel name (``PR_SET_NAME``, 15 bytes at most) from its Python
name, without the ``tierkv-`` prefix every thread of such a process shares. Python 3.14 and
later name threads themselves; elsewhere than Linux nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
from collections.abc import Callable

PR_SET_NAME = 15  # from <linux/prctl.h>
MAX_NAME = 15  # the kernel's TASK_COMM_LEN, less the terminating NUL
PREFIX = "tierkv-"

_prctl: Callable[..., int] | None = None


def os_name(name: str) -> bytes:
    """The kernel name for a thread called ``name``: without the shared prefix, at most
    :data:`MAX_NAME` bytes of UTF-8 (cut on a character boundary)."""
    short = name.removeprefix(PREFIX) or name
    raw = short.encode()[:MAX_NAME]
    return raw.decode(errors="ignore").encode()


def set_current(name: str) -> bool:
    """Give the calling thread the kernel name for ``name`` (False: not possible here)."""
    return _set_kernel_name(os_name(name))


def _set_kernel_name(raw: bytes) -> bool:
    global _prctl
    if not sys.platform.startswith("linux"):
        return False
    if _prctl is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _prctl = libc.prctl
    return _prctl(PR_SET_NAME, ctypes.c_char_p(raw[:MAX_NAME]), 0, 0, 0) == 0


def name_os_threads(process_name: str) -> None:
    """Name the calling (main) thread ``process_name``, which ``ps``, ``top`` and ``pgrep``
    show for the whole process, and from now on have every thread of this process set its
    kernel name when it starts (idempotent; Python 3.14+ does the latter itself)."""
    _set_kernel_name(process_name.encode())
    if sys.version_info >= (3, 14) or getattr(threading.Thread.run, "_names_os_thread", False):
        return
    plain_run = threading.Thread.run

    def run(self: threading.Thread) -> None:
        set_current(self.name)
        plain_run(self)

    run._names_os_thread = True  # type: ignore[attr-defined]
    threading.Thread.run = run  # type: ignore[method-assign]
