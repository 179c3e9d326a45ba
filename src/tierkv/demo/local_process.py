"""A throw-away tierkv process of the demo (:class:`~tierkv.demo.local_server.LocalServer`,
:class:`~tierkv.demo.local_controller.LocalController`): started in its own session with
the built-in defaults (``TIERKV_*`` variables of the caller's environment are not passed
on), its log in a temporary directory; :meth:`LocalProcess.stop` sends SIGTERM and checks
that it exited with status 0.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> bool:
    """SIGTERM ``proc`` and wait ``timeout`` s for it, killing it after that; True unless it
    had to be killed (already exited: True)."""
    if proc.poll() is not None:
        return True
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False
    return True


class LocalServerError(RuntimeError):
    """A process did not start, or did not stop cleanly; the message includes its log."""


class LocalProcess:
    """One subprocess, named ``what`` in messages (``server``, ``controller``)."""

    what = "process"

    def __init__(self) -> None:
        self.tmpdir = tempfile.mkdtemp(prefix=f"tierkv-demo-{self.what}-")
        self.log_path = os.path.join(self.tmpdir, f"{self.what}.log")
        self.proc: subprocess.Popen[bytes] | None = None

    def spawn(self, command: list[str], env: dict[str, str] | None = None) -> None:
        base = {k: v for k, v in os.environ.items() if not k.startswith("TIERKV_")}
        with open(self.log_path, "wb") as log:
            # Its own session: a Ctrl-C of the demo reaches the engines, and the demo then
            # stops this process itself, last.
            self.proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**base, **(env or {})},
                start_new_session=True,
            )

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM, then check for exit status 0."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if not stop_process(proc, timeout):
            raise LocalServerError(
                f"the {self.what} did not stop within {timeout:.0f} s of SIGTERM (killed):"
                f"\n{self.log_tail()}"
            )
        if proc.returncode != 0:
            raise LocalServerError(
                f"the {self.what} exited with status {proc.returncode}:\n{self.log_tail()}"
            )

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                return "".join(fh.readlines()[-lines:])
        except OSError:
            return f"(no {self.what} log)"

    def cleanup(self) -> None:
        """Remove the temporary directory (log, sockets)."""
        shutil.rmtree(self.tmpdir, ignore_errors=True)
