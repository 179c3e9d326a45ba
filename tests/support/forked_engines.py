"""Engine processes forked from a zygote that has vLLM imported (``engine_zygote.py``).

:class:`Zygote` starts the zygote process and asks it for engines; each one is a
:class:`ForkedProcess`, which a test waits for, polls and kills like a ``subprocess.Popen``
(the zygote, not the test, is its parent: its exit code comes back in a file).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from support.httputil import wait_for


class ForkedProcess:
    """An engine the zygote forked: ``pid`` (its own process group), ``returncode`` once the
    zygote has reaped it (read from ``rc_path``)."""

    def __init__(self, pid: int, rc_path: Path) -> None:
        self.pid = pid
        self.rc_path = rc_path
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self.rc_path.exists():
            self.returncode = int(self.rc_path.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"engine {self.pid}", timeout or 0.0)
            time.sleep(0.05)
        return code


class Zygote:
    """The zygote process (``runner``: engine_zygote.py), listening on a socket of its own."""

    def __init__(self, runner: Path, log_path: Path, start_timeout: float = 300.0) -> None:
        # Short: a Unix socket's path must fit 107 characters.
        self.dir = Path(tempfile.mkdtemp(prefix="tierkv-zygote-"))
        self.socket_path = self.dir / "zygote.sock"
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(runner), str(self.socket_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                # OpenMP reads its thread count once, in the zygote: one thread per engine
                # whatever the caller's environment says (engines run side by side here).
                env={**os.environ, "TMPDIR": str(self.dir), "OMP_NUM_THREADS": "1"},
            )
        self.log_path = log_path
        wait_for(
            "the engine zygote to import vLLM",
            lambda: self.socket_path.exists() or self.proc.poll() is not None,
            start_timeout,
        )
        if not self.socket_path.exists():
            self.close()
            raise RuntimeError(f"the engine zygote did not start:\n{log_path.read_text()}")

    def fork(self, config: Path, log: Path, env: dict[str, str]) -> ForkedProcess:
        """An engine running ``engine_run.main(config)``, its output in ``log``."""
        rc = config.with_suffix(".rc")
        request = {"config": str(config), "log": str(log), "rc": str(rc), "env": env}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(60.0)
            conn.connect(str(self.socket_path))
            with conn.makefile("rwb") as stream:
                stream.write(json.dumps(request).encode() + b"\n")
                stream.flush()
                line = stream.readline()
        if not line:
            raise RuntimeError(f"the engine zygote did not fork:\n{self.log_path.read_text()}")
        return ForkedProcess(int(json.loads(line)["pid"]), rc)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        # The socket, and whatever the engines left in their TMPDIR (torch's compile caches).
        shutil.rmtree(self.dir, ignore_errors=True)
