"""Tests of the shared-memory pool on real POSIX shared memory: create/attach/close lifecycle,
mode 0600, stale segments, the /dev/shm fail-fast check, attach errors, and (the key one)
client processes that attach, write and exit without the segment being unlinked."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from tierkv import pool as pool_mod
from tierkv.pool import (
    SHM_DIR,
    PoolError,
    PoolNotFoundError,
    PoolSizeMismatchError,
    ShmCapacityError,
    ShmPool,
    check_shm_capacity,
    format_bytes,
    segment_exists,
)

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm (Linux)")

MIB = 1 << 20
GIB = 1 << 30
SIZE = 4 * MIB
SRC_DIR = str(Path(pool_mod.__file__).resolve().parents[1])


def shm_path(name: str) -> str:
    return os.path.join(SHM_DIR, name.lstrip("/"))


def remove_segment(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(shm_path(name))


@pytest.fixture
def shm_name() -> Iterator[str]:
    """A fresh segment name; whatever the test leaves under it is removed afterwards."""
    name = f"tierkv-test-{uuid.uuid4().hex[:8]}"
    yield name
    remove_segment(name)


@pytest.fixture
def owner(shm_name: str) -> Iterator[ShmPool]:
    p = ShmPool.create(shm_name, SIZE)
    yield p
    p.close()


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll ``cond()`` until true or ``timeout`` (for effects of other processes, not timing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return bool(cond())


def run_python(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run ``python *argv`` with this checkout's tierkv importable, capturing the output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC_DIR, env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=120, env=env
    )


def run_code(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return run_python("-c", textwrap.dedent(code), *args)


# -- lifecycle -----------------------------------------------------------------------------


def test_create_attach_close_lifecycle(shm_name: str) -> None:
    assert not segment_exists(shm_name)
    owner = ShmPool.create(shm_name, SIZE)
    assert owner.owner and not owner.closed
    assert owner.name == "/" + shm_name
    assert owner.size == len(owner.buf) == SIZE
    assert segment_exists(shm_name)
    assert os.stat(shm_path(shm_name)).st_size == SIZE
    assert not any(owner.buf[:4096])  # a new segment reads as zeros

    client = ShmPool.attach(shm_name, expected_size=SIZE)
    assert not client.owner and client.size == SIZE

    owner.view(100, 5)[:] = b"hello"
    assert bytes(client.view(100, 5)) == b"hello"
    client.array(SIZE - 8, 8, dtype=np.uint64)[0] = 0xDEADBEEF
    assert owner.array(SIZE - 8, 8, dtype=np.uint64)[0] == 0xDEADBEEF
    shaped = owner.array(4096, 4096, dtype=np.float32, shape=(32, 32))
    shaped[:] = 1.5
    assert client.array(4096, 4096, dtype=np.float32).sum() == 1.5 * 1024

    client.close()
    assert client.closed
    assert segment_exists(shm_name), "a client's close must not unlink"
    assert bytes(owner.view(100, 5)) == b"hello"
    again = ShmPool.attach("/" + shm_name)  # attach by the POSIX spelling, size not checked
    assert bytes(again.view(100, 5)) == b"hello"
    again.close()

    owner.close()
    assert owner.closed
    assert not segment_exists(shm_name)
    with pytest.raises(PoolNotFoundError):
        ShmPool.attach(shm_name)


def test_context_manager_unlinks(shm_name: str) -> None:
    with ShmPool.create(shm_name, SIZE) as p:
        assert segment_exists(shm_name)
        with ShmPool.attach(shm_name, SIZE) as c:
            c.view(0, 1)[0] = 7
        assert p.buf[0] == 7
        assert segment_exists(shm_name)
    assert not segment_exists(shm_name)


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_segment_mode_is_0600(shm_name: str, umask: int) -> None:
    old = os.umask(umask)
    try:
        p = ShmPool.create(shm_name, SIZE)
    finally:
        os.umask(old)
    try:
        st = os.stat(shm_path(shm_name))
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.geteuid()
    finally:
        p.close()


def test_view_bounds(owner: ShmPool) -> None:
    assert len(owner.view(SIZE - 1, 1)) == 1
    assert len(owner.view(SIZE, 0)) == 0
    for offset, length in ((SIZE, 1), (-1, 1), (0, -1), (SIZE - 10, 11)):
        with pytest.raises(IndexError):
            owner.view(offset, length)


@pytest.mark.parametrize("madvise", [True, False], ids=["madvise", "read-fallback"])
def test_prefault_method_allocates_every_page(
    owner: ShmPool, madvise: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not madvise:  # an advice the kernel rejects, as a kernel older than 5.14 would
        monkeypatch.setattr(pool_mod, "MADV_POPULATE_WRITE", 0x7FFF)
    owner.view(0, 3)[:] = b"abc"
    assert os.stat(shm_path(owner.name)).st_blocks * 512 < SIZE
    owner.prefault()
    assert bytes(owner.view(0, 3)) == b"abc"  # touching preserves contents
    assert os.stat(shm_path(owner.name)).st_blocks * 512 >= SIZE


@pytest.mark.parametrize("populate", [False, True])
def test_create_with_prefault_allocates_every_page(shm_name: str, populate: bool) -> None:
    with ShmPool.create(shm_name, SIZE, prefault=True) as p:
        assert os.stat(shm_path(shm_name)).st_blocks * 512 >= SIZE
        assert not any(p.buf[::4096])
        with ShmPool.attach(shm_name, SIZE, populate=populate) as c:
            c.view(SIZE - 1, 1)[0] = 9
            assert p.buf[SIZE - 1] == 9


def test_create_without_prefault_is_sparse(shm_name: str) -> None:
    with ShmPool.create(shm_name, SIZE):
        assert os.stat(shm_path(shm_name)).st_blocks * 512 < SIZE


@pytest.mark.parametrize("bad", ["", "/", "//", "a/b", "/a/b", "x" * 201, "a\0b", ".."])
def test_invalid_names_are_rejected(bad: str) -> None:
    with pytest.raises(PoolError, match="invalid"):
        ShmPool.create(bad, SIZE)
    with pytest.raises(PoolError, match="invalid"):
        ShmPool.attach(bad)


def test_leading_slashes_name_the_same_segment(shm_name: str) -> None:
    with ShmPool.create("//" + shm_name, SIZE) as p:
        assert p.name == "/" + shm_name
        assert segment_exists(shm_name) and segment_exists("/" + shm_name)
        with ShmPool.attach(shm_name, SIZE) as c:
            assert c.name == p.name


@pytest.mark.parametrize("size", [0, -1])
def test_non_positive_size_is_rejected(shm_name: str, size: int) -> None:
    with pytest.raises(PoolError, match="positive"):
        ShmPool.create(shm_name, size)
    assert not segment_exists(shm_name)


# -- stale segments ------------------------------------------------------------------------


def test_stale_segment_left_by_os_level_shm_is_replaced(
    shm_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A segment made the way any other process would make one: open in /dev/shm, wrong size,
    # loose mode, garbage inside.
    fd = os.open(shm_path(shm_name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    try:
        os.ftruncate(fd, 3 * MIB)
        os.pwrite(fd, b"stale!" * 100, 0)
    finally:
        os.close(fd)
    old_ino = os.stat(shm_path(shm_name)).st_ino

    with caplog.at_level(logging.WARNING, logger="tierkv.pool"):
        p = ShmPool.create(shm_name, SIZE)
    try:
        assert "stale" in caplog.text
        st = os.stat(shm_path(shm_name))
        assert st.st_ino != old_ino
        assert st.st_size == SIZE
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert not any(p.buf[:4096])
        with ShmPool.attach(shm_name, SIZE) as c:
            c.view(0, 2)[:] = b"ok"
        assert bytes(p.view(0, 2)) == b"ok"
    finally:
        p.close()
    assert not segment_exists(shm_name)


@pytest.mark.processes
def test_stale_segment_left_by_a_crashed_server_is_replaced(shm_name: str) -> None:
    # The "server" creates the pool, writes, and dies without closing it (os._exit skips
    # every cleanup, as a SIGKILL would).
    crashed = run_code(
        """
        import os, sys
        from tierkv.pool import ShmPool
        p = ShmPool.create(sys.argv[1], int(sys.argv[2]))
        p.view(0, 5)[:] = b"crash"
        os._exit(0)
        """,
        shm_name,
        str(SIZE),
    )
    assert crashed.returncode == 0, crashed.stderr
    assert segment_exists(shm_name)
    with ShmPool.attach(shm_name, SIZE) as c:
        assert bytes(c.view(0, 5)) == b"crash"

    with ShmPool.create(shm_name, 2 * SIZE) as p:
        assert p.size == os.stat(shm_path(shm_name)).st_size == 2 * SIZE
        assert bytes(p.view(0, 5)) == bytes(5)
    assert not segment_exists(shm_name)


def test_a_segment_a_live_server_holds_is_refused_not_replaced(shm_name: str) -> None:
    """A second server given the same pool name (another runtime directory, same instance)
    must not take the segment from the first: that server's engines would then map a segment
    other than the one its slots are in."""
    first = ShmPool.create(shm_name, SIZE)
    try:
        first.view(0, 5)[:] = b"first"
        ino = os.stat(shm_path(shm_name)).st_ino
        with pytest.raises(PoolError, match=r"belongs to a running server.*--instance"):
            ShmPool.create(shm_name, SIZE)
        assert os.stat(shm_path(shm_name)).st_ino == ino
        with ShmPool.attach(shm_name, SIZE) as c:
            assert bytes(c.view(0, 5)) == b"first"
    finally:
        first.close()
    with ShmPool.create(shm_name, SIZE) as again:  # free once its owner closed it
        assert bytes(again.view(0, 5)) == bytes(5)
    assert not segment_exists(shm_name)


def test_old_owner_does_not_unlink_its_replacement(shm_name: str) -> None:
    old = ShmPool.create(shm_name, SIZE)
    os.unlink(shm_path(shm_name))  # someone removed the name: a new server may create it
    new = ShmPool.create(shm_name, SIZE)  # `old` keeps its now-unlinked mapping
    try:
        old.view(0, 3)[:] = b"old"
        new.view(0, 3)[:] = b"new"
        old.close()
        assert segment_exists(shm_name), "closing the replaced owner unlinked the new segment"
        with ShmPool.attach(shm_name, SIZE) as c:
            assert bytes(c.view(0, 3)) == b"new"
    finally:
        new.close()
    assert not segment_exists(shm_name)


# -- /dev/shm capacity ---------------------------------------------------------------------


def assert_actionable(msg: str, required: int, where: str) -> None:
    assert f"need {format_bytes(required)}" in msg
    assert re.search(rf"{re.escape(where)} has \d+(\.\d)? (B|KiB|MiB|GiB|TiB) free", msg), msg
    assert "--shm-size" in msg
    assert "emptyDir" in msg
    m = re.search(r"--shm-size=(\d+)g", msg)
    assert m, msg
    assert int(m.group(1)) * GIB >= required, "suggested --shm-size is smaller than the pool"


def test_capacity_check_fails_fast_on_dev_shm() -> None:
    required = 1 << 50  # 1 PiB
    with pytest.raises(ShmCapacityError) as info:
        check_shm_capacity(required)
    assert isinstance(info.value, PoolError)
    assert_actionable(str(info.value), required, SHM_DIR)


def test_capacity_check_on_another_directory(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    check_shm_capacity(1, str(tmp_path))  # fits: no error
    required = (free // GIB + 1) * GIB + GIB // 3  # not a whole number of GiB
    with pytest.raises(ShmCapacityError) as info:
        check_shm_capacity(required, str(tmp_path))
    assert_actionable(str(info.value), required, str(tmp_path))


def test_capacity_check_skips_a_missing_directory(tmp_path: Path) -> None:
    check_shm_capacity(1 << 50, str(tmp_path / "no-such-dir"))


def test_create_too_big_fails_before_allocating(shm_name: str) -> None:
    required = shutil.disk_usage(SHM_DIR).free + 64 * GIB
    with pytest.raises(ShmCapacityError) as info:
        ShmPool.create(shm_name, required)
    assert "--shm-size" in str(info.value) and "emptyDir" in str(info.value)
    assert not segment_exists(shm_name), "a failed create must not leave a segment behind"


# -- attach errors -------------------------------------------------------------------------


def test_attach_missing_segment(shm_name: str) -> None:
    with pytest.raises(PoolNotFoundError) as info:
        ShmPool.attach(shm_name)
    assert isinstance(info.value, FileNotFoundError)
    assert "tierkv server" in str(info.value)
    assert not segment_exists(shm_name)


def test_attach_size_mismatch(owner: ShmPool) -> None:
    with pytest.raises(PoolSizeMismatchError) as info:
        ShmPool.attach(owner.name, expected_size=SIZE + 4096)
    assert isinstance(info.value, ValueError)
    assert str(SIZE) in str(info.value)
    assert segment_exists(owner.name), "a failed attach must not unlink"
    with ShmPool.attach(owner.name, expected_size=SIZE):
        pass


def test_attach_empty_segment_is_a_clear_error(shm_name: str) -> None:
    fd = os.open(shm_path(shm_name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.close(fd)
    with pytest.raises(PoolError, match="empty"):
        ShmPool.attach(shm_name)
    assert segment_exists(shm_name)


# -- close ---------------------------------------------------------------------------------


def test_close_is_idempotent(shm_name: str) -> None:
    p = ShmPool.create(shm_name, SIZE)
    c = ShmPool.attach(shm_name, SIZE)
    c.close()
    c.close()
    assert segment_exists(shm_name)
    p.close()
    p.close()
    assert p.closed and c.closed
    assert not segment_exists(shm_name)


def test_closed_pool_refuses_access(shm_name: str) -> None:
    p = ShmPool.create(shm_name, SIZE)
    p.close()
    with pytest.raises(PoolError, match="closed"):
        p.prefault()
    with pytest.raises(ValueError):
        p.view(0, 1)


def test_owner_close_tolerates_an_already_removed_segment(
    shm_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    p = ShmPool.create(shm_name, SIZE)
    os.unlink(shm_path(shm_name))
    with caplog.at_level(logging.WARNING, logger="tierkv.pool"):
        p.close()
    assert "removed" in caplog.text
    assert p.closed


def test_owner_close_with_live_numpy_views_still_unlinks(shm_name: str) -> None:
    p = ShmPool.create(shm_name, SIZE)
    c = ShmPool.attach(shm_name, SIZE)
    slot = p.array(8192, 4096)  # a view of a slice of the pool
    whole = np.frombuffer(p.buf, dtype=np.uint8)  # a view of the pool's own memoryview
    client_view = c.array(0, 16)
    p.close()  # must not raise BufferError
    assert p.closed
    assert not segment_exists(shm_name)
    # The mapping lives as long as the views do, and is still shared with the client.
    slot[:3] = [1, 2, 3]
    assert list(whole[8192:8195]) == [1, 2, 3]
    assert list(c.array(8192, 3)) == [1, 2, 3]
    c.close()
    client_view[0] = 5  # the client's mapping survives its own close too
    del slot, whole, client_view


# -- client processes ----------------------------------------------------------------------

CLIENT_CODE = """
import sys
from multiprocessing import resource_tracker
import numpy as np
from tierkv.pool import ShmPool

resource_tracker.ensure_running()  # the tracker that would unlink a SharedMemory segment
name, size, payload = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3])
pool = ShmPool.attach(name, expected_size=size, populate=sys.argv[4] == "1")
pool.view(0, len(payload))[:] = payload
pool.array(size - 4096, 4096)[:] = 0xAB
if sys.argv[5] == "1":
    pool.close()
else:
    view = pool.array(0, 16)  # exit with the pool mapped and a view alive
print("client done")
"""


@pytest.mark.processes
@pytest.mark.parametrize(
    ("populate", "close"),
    [(False, True), (True, False)],
    ids=["close", "no-close-populate"],
)
def test_subprocess_client_writes_and_exits_without_unlinking(
    owner: ShmPool, populate: bool, close: bool
) -> None:
    payload = uuid.uuid4().bytes * 4
    r = run_code(
        CLIENT_CODE,
        owner.name,
        str(SIZE),
        payload.hex(),
        "1" if populate else "0",
        "1" if close else "0",
    )
    assert r.returncode == 0, r.stderr
    assert "client done" in r.stdout
    assert "leaked" not in r.stderr, r.stderr
    # Give any resource tracker every chance to act: it must not.
    time.sleep(0.2)
    assert segment_exists(owner.name)
    assert bytes(owner.view(0, len(payload))) == payload
    assert (owner.array(SIZE - 4096, 4096) == 0xAB).all()
    with ShmPool.attach(owner.name, SIZE) as again:
        assert bytes(again.view(0, len(payload))) == payload


def _spawned_client(name: str, size: int, payload: bytes) -> None:
    """Runs in a 'spawn' child: attach, write, return (normal interpreter exit)."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    pool = ShmPool.attach(name, expected_size=size)
    pool.view(0, len(payload))[:] = payload
    pool.array(size - 4096, 4096)[:] = 0xCD
    pool.close()


@pytest.mark.processes
def test_spawned_multiprocessing_client_does_not_unlink(owner: ShmPool) -> None:
    payload = uuid.uuid4().bytes * 4
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_spawned_client, args=(owner.name, SIZE, payload))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    time.sleep(0.2)
    assert segment_exists(owner.name)
    assert bytes(owner.view(0, len(payload))) == payload
    assert (owner.array(SIZE - 4096, 4096) == 0xCD).all()


SPAWN_HOST_CODE = """
import multiprocessing
import sys

from tierkv.pool import ShmPool


def client(name, size, payload):
    pool = ShmPool.attach(name, expected_size=size)
    pool.view(0, len(payload))[:] = payload
    pool.close()


if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    name, size, payload = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3])
    procs = [ctx.Process(target=client, args=(name, size, payload)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    sys.exit(max(p.exitcode for p in procs))
"""


@pytest.mark.processes
def test_spawned_clients_of_another_engine_process_do_not_unlink(
    owner: ShmPool, tmp_path: Path
) -> None:
    """Like a vLLM engine: a host process spawns workers that attach; then all of them exit,
    including the resource tracker they share (in the test above, pytest's tracker would only
    act when pytest itself exits)."""
    script = tmp_path / "engine.py"
    script.write_text(SPAWN_HOST_CODE)
    payload = uuid.uuid4().bytes
    r = run_python(str(script), owner.name, str(SIZE), payload.hex())
    assert r.returncode == 0, r.stderr
    assert "leaked" not in r.stderr, r.stderr
    time.sleep(0.2)
    assert segment_exists(owner.name)
    assert bytes(owner.view(0, len(payload))) == payload


@pytest.mark.processes
@pytest.mark.skipif(
    sys.version_info >= (3, 13),
    reason="Python 3.13 SharedMemory(track=...) no longer tracks segments it only attaches",
)
def test_contrast_shared_memory_attach_is_unlinked_by_resource_tracker(shm_name: str) -> None:
    """Why pool.py avoids SharedMemory: on Python < 3.13 a process that merely *attaches* with
    ``SharedMemory(name, create=False)`` registers the segment with its resource tracker,
    which unlinks it when that process exits, pulling the pool from under the server."""
    owner = ShmPool.create(shm_name, SIZE)
    try:
        r = run_code(
            """
            import sys
            from multiprocessing import shared_memory
            shm = shared_memory.SharedMemory(sys.argv[1], create=False)
            shm.buf[0] = 42
            shm.close()  # close, not unlink: a well-behaved client
            """,
            shm_name,
        )
        assert r.returncode == 0, r.stderr
        assert owner.buf[0] == 42  # the write happened...
        assert wait_for(lambda: not segment_exists(shm_name)), (
            "the resource tracker did not unlink the segment"
        )  # ...and then the client's resource tracker unlinked the server's segment
        with pytest.raises(PoolNotFoundError):
            ShmPool.attach(shm_name)
    finally:
        owner.close()  # logs that the segment was already removed
