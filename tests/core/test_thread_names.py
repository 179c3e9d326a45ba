"""Kernel-level thread names: a server's threads show what they do in ``top -H``."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from support.controllers import running_controller
from support.servers import ServerProcess
from tierkv import thread_names
from tierkv.client import Client
from tierkv.config import ServerConfig

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")


def _comm(pid: int | str, tid: int | str) -> str:
    return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()


def test_os_names_drop_the_shared_prefix_and_fit_the_kernels_limit() -> None:
    assert thread_names.os_name("tierkv-rpc-3") == b"rpc-3"
    assert thread_names.os_name("tierkv-") == b"tierkv-"  # nothing would be left
    assert thread_names.os_name("engine-step") == b"engine-step"
    assert len(thread_names.os_name("tierkv-" + "x" * 40)) == thread_names.MAX_NAME
    # Cut on a character boundary: 7 two-byte characters fit, not 7.5.
    assert thread_names.os_name("é" * 10) == ("é" * 7).encode()


@pytest.mark.processes
def test_threads_started_after_the_call_carry_their_names() -> None:
    # In a child interpreter: the call changes every later thread of its process.
    code = (
        "import threading, time\n"
        "from tierkv.thread_names import name_os_threads\n"
        "name_os_threads('probe-main'); name_os_threads('probe-main')\n"  # idempotent
        "done = threading.Event()\n"
        "t = threading.Thread(target=done.wait, name='tierkv-probe-worker')\n"
        "t.start(); time.sleep(0.05)\n"
        "print(open(f'/proc/self/task/{t.native_id}/comm').read().strip())\n"
        "print(open('/proc/self/comm').read().strip())\n"
        "done.set(); t.join()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    expected = "probe-worker" if sys.version_info < (3, 14) else "tierkv-probe-w"
    assert out.stdout.split() == [expected, "probe-main"]


def test_this_process_is_left_alone_unless_asked() -> None:
    # tierkv imported into an engine never renames the engine's threads.
    done = threading.Event()
    t = threading.Thread(target=done.wait, name="tierkv-not-renamed")
    t.start()
    try:
        if sys.version_info < (3, 14):
            assert _comm("self", t.native_id) != "not-renamed"
    finally:
        done.set()
        t.join()


@pytest.mark.processes
def test_a_servers_threads_are_named_by_what_they_do(server: ServerProcess) -> None:
    with Client(server.endpoint) as client:
        client.ping()  # every part has started
    assert server.proc is not None
    pid = server.proc.pid
    names = [_comm(pid, task.name) for task in Path(f"/proc/{pid}/task").iterdir()]
    # The main thread (the RPC loop) names the process for ps, top and pgrep.
    assert _comm(pid, pid) == "tierkv-server"
    assert Path(f"/proc/{pid}/comm").read_text().strip() == "tierkv-server"
    workers = ServerConfig().workers
    assert sorted(n for n in names if n.startswith("rpc-")) == [
        f"rpc-{i}" for i in range(workers)
    ], names
    assert "eviction" in names, names
    assert "python" not in names, names  # no BLAS thread pool: the server never uses one


@pytest.mark.processes
def test_a_controllers_process_and_threads_are_named(tmp_path: Path) -> None:
    with running_controller(tmp_path) as controller:
        assert controller.proc is not None
        pid = controller.proc.pid
        assert Path(f"/proc/{pid}/comm").read_text().strip() == "tierkv-ctl"
        names = [_comm(pid, task.name) for task in Path(f"/proc/{pid}/task").iterdir()]
        assert {"cluster-ctl", "ctl-reaper"} <= set(names), names
