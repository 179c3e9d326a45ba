"""A benchmark stopped by a signal cleans up as it does on an error.

By default SIGTERM (``kill``, ``pkill``, a job's timeout) and SIGHUP (its terminal closed) end
Python at once, skipping the ``finally`` and ``with`` blocks that stop the benchmark's tierkv
servers, kill its engines and spinners (``busy_cores.py``) and unlink its shared-memory
segments: those would outlive it, holding memory and cores. :func:`exit_on_stop_signals` turns
both signals into ``SystemExit`` (status 128 + the signal's number, as a shell reports it),
so those blocks run, and ignores them from then on, so that a second one cannot cut the
cleanup short; each script that starts processes or makes segments calls it first thing
in ``main``. The runner (``run.py``) passes them on to the script it runs
(:func:`pass_on_stop_signals`) and reads its output to the end, so that the script's
cleanup can still print.
"""

from __future__ import annotations

import signal
import subprocess
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _ignore(signum: int, frame: FrameType | None) -> None:
    pass


def exit_on_stop_signals() -> None:
    """From now on, SIGTERM and SIGHUP raise ``SystemExit(128 + signum)`` in the main thread."""

    def stop(signum: int, frame: FrameType | None) -> None:
        # Once: a second stop signal raised inside the cleanup would cut it short, leaving
        # servers and segments behind (``pkill -f`` matches the runner and the script, so
        # the script gets its own signal and the one the runner passes on). A handler that
        # does nothing, not SIG_IGN, which processes started meanwhile would inherit.
        for other in STOP_SIGNALS:
            signal.signal(other, _ignore)
        raise SystemExit(128 + signum)

    for signum in STOP_SIGNALS:
        signal.signal(signum, stop)


def pass_on_stop_signals(child: subprocess.Popen[str]) -> None:
    """From now on, SIGTERM and SIGHUP are sent on to ``child`` (and do nothing else here)."""

    def send(signum: int, frame: FrameType | None) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    for signum in STOP_SIGNALS:
        signal.signal(signum, send)
