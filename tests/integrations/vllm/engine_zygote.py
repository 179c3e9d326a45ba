"""A process that imports vLLM once and forks every ``engine_run.py`` engine from itself.

Importing vLLM costs about 12 s of CPU here, more than a tiny model's whole engine run; the
end-to-end tests start some 40 engines on 2 cores. ``python engine_zygote.py SOCKET`` imports
vLLM and the connector (nothing that starts a thread or uses torch's thread pools), then
listens on the Unix socket ``SOCKET``. Each connection asks for one engine with one JSON line,
``{"config": CONFIG.json, "log": LOG, "rc": RC, "env": {...}}``; the zygote forks, answers
``{"pid": PID}`` and goes on listening. The child starts its own session (its process group is
its pid: a test kills it and its rank workers with ``killpg``), writes stdout and stderr to
``LOG``, takes ``env`` as its whole environment (with ``engine_run``'s defaults) and runs
``engine_run.main(CONFIG)``. The zygote reaps its children and writes each one's exit code
(negative: the signal that ended it) to its ``RC`` file, written whole (a rename).

The zygote stays single-threaded: a fork copies only the forking thread, and a thread holding
a lock at that moment would leave the child's copy of that lock held forever.
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import tempfile
import traceback
from pathlib import Path

import engine_run  # sets the engine environment's defaults before vLLM is imported


def preload() -> None:
    """Import what every engine imports (engine_run.main's imports, the connector's modules)."""
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401
    from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401

    import tierkv.integrations.vllm.connector  # noqa: F401


def run_child(request: dict[str, str | dict[str, str]]) -> int:
    """In the forked child: become the engine process the request describes; its exit code."""
    os.setsid()
    log = os.open(str(request["log"]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    env = request["env"]
    assert isinstance(env, dict)
    os.environ.clear()
    os.environ.update(env)
    engine_run.set_environment_defaults()
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    config = str(request["config"])
    sys.argv = [engine_run.__file__, config]
    try:
        engine_run.main(config)
        return 0
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            return exit_.code or 0
        print(exit_.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def write_rc(path: str, code: int) -> None:
    tmp = f"{path}.tmp"
    Path(tmp).write_text(str(code))
    os.replace(tmp, path)


def serve(socket_path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path + ".tmp")
    listener.listen(16)
    os.replace(socket_path + ".tmp", socket_path)  # the socket appears once the zygote is ready
    rc_paths: dict[int, str] = {}
    while True:
        readable, _, _ = select.select([listener], [], [], 0.05)
        if readable:
            conn, _ = listener.accept()
            with conn, conn.makefile("rwb") as stream:
                request = json.loads(stream.readline())
                pid = os.fork()
                if pid == 0:  # the engine
                    listener.close()
                    code = 1
                    try:
                        code = run_child(request)
                    finally:
                        sys.stdout.flush()
                        sys.stderr.flush()
                        os._exit(code)
                rc_paths[pid] = str(request["rc"])
                stream.write(json.dumps({"pid": pid}).encode() + b"\n")
                stream.flush()
        while rc_paths:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            rc = rc_paths.pop(pid, None)
            if rc is not None:
                write_rc(rc, os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    preload()
    serve(sys.argv[1])
