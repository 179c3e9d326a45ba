"""Tests for tierkv._piecewise, the C helper that runs tierkv.piecewise_io's loops without the
GIL: it writes chunk files, reads page-cached ones into the pool with one streaming copy and
moves chunks over sockets, hashing them on the way. It is built here; what it writes and
sends, and its checksums, equal the bytes and a one-shot XXH3; socket failures are the
errors Python's sockets raise;
what it reads equals os.preadv's; it leaves files that are not in the page cache to
os.preadv; a file that shrinks during the copy makes it give up (None, the process alive)
instead of ending the process with SIGBUS; write errors are OSErrors."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tierkv import piecewise_io as pieces
from tierkv.checksums import checksum

try:
    from tierkv import _piecewise
except ImportError:  # the first test fails and says why; the others skip
    _piecewise = None  # type: ignore[assignment]
built = pytest.mark.skipif(_piecewise is None, reason="tierkv._piecewise was not built")

HEADER = 64  # the payload's offset in a disk-tier record file
SIZES = [1, 255, 256, 4096 - HEADER, pieces.PIECE - 1, pieces.PIECE, 3 * pieces.PIECE + 12345]


def _payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed + n).integers(0, 256, n, dtype=np.uint8).tobytes()


def _record(path: Path, payload: bytes) -> int:
    """A file of HEADER bytes and ``payload`` (page-cached: just written); its descriptor."""
    path.write_bytes(b"\xee" * HEADER + payload)
    return os.open(path, os.O_RDONLY)


def _evict(fd: int) -> None:
    """Drop the file's clean pages from the page cache."""
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def test_page_cached_files_are_read_by_the_c_helper() -> None:
    """`make test` installs what the helper needs (a C compiler, libxxhash's headers); a build
    that silently fell back to os.preadv reads page-cached chunks a third slower."""
    assert pieces.NATIVE, (
        "tierkv._piecewise was not built: a C compiler, Python's headers and libxxhash-dev must "
        "be present when tierkv is installed (scripts/ensure-system-deps.sh installs them)"
    )


@built
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("misalign", [0, 1, 17])
def test_bytes_and_checksum_equal_a_plain_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int, misalign: int
) -> None:
    payload = _payload(n)
    fd = _record(tmp_path / "chunk", payload)
    preadv_calls: list[int] = []
    real_preadv = os.preadv
    monkeypatch.setattr(
        os, "preadv", lambda *a: preadv_calls.append(1) or real_preadv(*a)
    )  # only the fallback calls it
    buf = bytearray(n + misalign + 64)
    dst = memoryview(buf)[misalign : misalign + n]
    try:
        got, digest = pieces.read_hashed(fd, dst, HEADER)
    finally:
        os.close(fd)
    assert (got, digest) == (n, checksum(payload))
    assert bytes(dst) == payload
    assert not any(buf[:misalign]) and not any(buf[misalign + n :])  # nothing else written
    assert preadv_calls == []  # the mapped way, not the fallback


# Around XXH3's boundaries: its long path (> 240 bytes), a stripe (64), a block (1024), the
# last stripe that overlaps the one before, and pieces.
FUSED_SIZES = [241, 255, 256, 1023, 1024, 1025, 1088, 1089, 2047, 2048, 2049, 4096 + 63]
FUSED_SIZES += [pieces.PIECE - 1, pieces.PIECE + 1, 3 * pieces.PIECE + 12345, 8 << 20]


@built
@pytest.mark.parametrize("n", FUSED_SIZES)
@pytest.mark.parametrize("offset", [HEADER, 4096, 1])
def test_a_slot_aligned_copy_hashes_as_it_copies_bit_for_bit(
    tmp_path: Path, n: int, offset: int
) -> None:
    """Into a destination aligned like a pool slot, on a CPU with AVX2, a page-cached read
    copies and computes XXH3-128 in one pass (``_xxh3_copy.h``): the checksum must be
    libxxhash's, bit for bit, for every length and source alignment."""
    payload = _payload(n, seed=offset)
    path = tmp_path / "chunk"
    path.write_bytes(b"\xee" * offset + payload)
    fd = os.open(path, os.O_RDONLY)
    room = np.zeros(n + 128, np.uint8)
    start = (-room.ctypes.data) % 64
    dst = memoryview(room[start : start + n])
    try:
        got, digest = pieces.read_hashed(fd, dst, offset)
    finally:
        os.close(fd)
    assert (got, digest) == (n, checksum(payload))
    assert bytes(dst) == payload
    assert not room[:start].any() and not room[start + n :].any()


@built
@pytest.mark.parametrize("n", [0, *SIZES])
@pytest.mark.parametrize("offset", [0, HEADER, pieces.PIECE + 5])
@pytest.mark.parametrize("with_head", [False, True])
def test_writes_hold_the_bytes_and_return_their_checksum(
    tmp_path: Path, n: int, offset: int, with_head: bool
) -> None:
    payload = _payload(n)
    path = tmp_path / "chunk"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    head = b"\xdd" * offset if with_head else b""
    try:
        if not with_head:
            os.pwrite(fd, b"\xee" * offset, 0)
        assert pieces.write_hashed(fd, memoryview(payload), offset, head) == checksum(payload)
    finally:
        os.close(fd)
    assert path.read_bytes() == (head or b"\xee" * offset) + payload


@built
def test_preallocate_reserves_a_whole_file_or_says_it_cannot(tmp_path: Path) -> None:
    path = tmp_path / "chunk"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        assert pieces.preallocate(fd, 3 * pieces.FILE_PIECE + 100)  # a filesystem that can
        assert os.fstat(fd).st_size == 3 * pieces.FILE_PIECE + 100
        assert os.pread(fd, 4096, 0) == bytes(4096)
        payload = _payload(pieces.FILE_PIECE + 7)
        assert pieces.write_hashed(fd, memoryview(payload), HEADER, b"\xdd" * HEADER) == (
            checksum(payload)
        )
        assert os.pread(fd, HEADER + len(payload), 0) == b"\xdd" * HEADER + payload
        assert not pieces.preallocate(fd, 0)  # nothing to reserve
    finally:
        os.close(fd)
    for name in ("/dev/null", "/dev/zero"):  # not a file: nothing done, no error
        dev = os.open(name, os.O_WRONLY)
        try:
            assert pieces.preallocate(dev, 4096) is False
        finally:
            os.close(dev)
    read_end, write_end = os.pipe()
    try:
        assert pieces.preallocate(write_end, 4096) is False
    finally:
        os.close(read_end)
        os.close(write_end)
    ro = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as refused:
            pieces.preallocate(ro, 4096)
        assert refused.value.errno == errno.EBADF
    finally:
        os.close(ro)
    with pytest.raises(TypeError):
        _piecewise.preallocate("3", 4096)  # type: ignore[arg-type]


@built
def test_a_failed_write_is_an_oserror_with_its_errno(tmp_path: Path) -> None:
    path = tmp_path / "chunk"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as failed:
            _piecewise.write_hashed(fd, 0, b"x" * 1000, 4096, False, b"")
        assert failed.value.errno == errno.EBADF
        with pytest.raises(ValueError, match="offset"):
            _piecewise.write_hashed(fd, -1, b"x", 4096, False, b"")
        with pytest.raises(ValueError, match="piece"):
            _piecewise.write_hashed(fd, 0, b"x", 0, False, b"")
        with pytest.raises(ValueError, match="head"):
            _piecewise.write_hashed(fd, 64, b"x", 4096, False, b"h" * 63)
        with pytest.raises(ValueError, match="head"):
            pieces.write_hashed(fd, memoryview(b"x"), 64, b"h" * 65)
    finally:
        os.close(fd)
    full = os.open("/dev/full", os.O_WRONLY)
    try:
        with pytest.raises(OSError) as failed:
            _piecewise.write_hashed(full, 0, b"x" * 1000, 4096, True, b"")
        assert failed.value.errno == errno.ENOSPC
    finally:
        os.close(full)


@built
def test_a_file_not_in_the_page_cache_is_left_to_preadv(tmp_path: Path) -> None:
    payload = _payload(3 * pieces.PIECE)
    fd = _record(tmp_path / "chunk", payload)
    try:
        _evict(fd)
        dst = bytearray(len(payload))
        assert _piecewise.read_hashed(fd, HEADER, dst, pieces.PIECE, True, False) is None
        # Without the residency check the pages are read from the device while mapped.
        assert _piecewise.read_hashed(fd, HEADER, dst, pieces.PIECE, False, False) == checksum(
            payload
        )
        assert bytes(dst) == payload
        # read_hashed then takes the os.preadv way for it, with the same result.
        _evict(fd)
        back = bytearray(len(payload))
        assert pieces.read_hashed(fd, memoryview(back), HEADER) == (len(payload), checksum(payload))
        assert bytes(back) == payload
    finally:
        os.close(fd)


_PARTLY_CACHED = """
import os, sys
from tierkv import _piecewise
from tierkv.checksums import checksum
if sys.argv[2] == "mincore":
    _piecewise.use_mincore()
assert _piecewise.residency() == sys.argv[2]
fd, head = os.open(sys.argv[1], os.O_RDONLY), int(sys.argv[3])
dst = bytearray(os.fstat(fd).st_size - head)
assert _piecewise.read_hashed(fd, head, dst, 1 << 19, True, False) is not None  # all cached
os.fsync(fd)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # out of the cache, then one page back
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # (no readahead)
os.pread(fd, 4096, 1 << 20)
assert _piecewise.read_hashed(fd, head, dst, 1 << 19, True, False) is None
assert _piecewise.read_hashed(fd, head, dst, 1 << 19, False, False) == checksum(dst)
print("ok")
"""


@built
@pytest.mark.processes
@pytest.mark.parametrize("check", ["cachestat", "mincore"])
def test_a_file_partly_in_the_page_cache_is_left_to_preadv(tmp_path: Path, check: str) -> None:
    """Both residency checks (cachestat, and mincore where the kernel lacks cachestat) see a
    file of which one page is cached; each runs in its own process (use_mincore() lasts)."""
    if check == "cachestat" and _piecewise.residency() != "cachestat":
        pytest.skip("this kernel has no cachestat(2) (Linux 6.5), or it is filtered")
    path = tmp_path / "chunk"
    path.write_bytes(b"\xee" * HEADER + _payload(3 * pieces.PIECE))
    run = subprocess.run(
        [sys.executable, "-c", _PARTLY_CACHED, str(path), check, str(HEADER)],
        capture_output=True,
        text=True,
    )
    assert (run.returncode, run.stdout) == (0, "ok\n"), run.stderr


@built
def test_a_file_shorter_than_asked_is_left_to_preadv(tmp_path: Path) -> None:
    payload = _payload(pieces.PIECE)
    fd = _record(tmp_path / "chunk", payload)
    try:
        for extra in (1, 4096, 3 * pieces.PIECE):  # within the last page, and beyond it
            dst = bytearray(len(payload) + extra)
            assert _piecewise.read_hashed(fd, HEADER, dst, pieces.PIECE, False, False) is None
            got, digest = pieces.read_hashed(fd, memoryview(dst), HEADER)
            assert (got, digest) == (len(payload), checksum(payload))
    finally:
        os.close(fd)


@built
def test_a_file_that_shrinks_during_the_copy_cuts_it_short_without_ending_the_process(
    tmp_path: Path,
) -> None:
    """A truncation while the file is mapped turns the next touch of a dropped page into a
    SIGBUS: the guard ends that copy (None) and counts it. Round by round, a copy of a 64 MiB
    file starts and another thread shrinks the file some time later (from a tenth to nine
    tenths of a copy's time), then restores it once the copy has returned; a copy that
    completes returns the checksum of the bytes it delivered. (A shrink while the pages are
    being populated, before the copy, gives None without a fault; one after the copy, a
    whole copy.) Rounds go on until three copies were cut short by a fault."""
    n = 64 << 20
    path = tmp_path / "chunk"
    payload = _payload(n)
    fd = _record(path, payload)
    wfd = os.open(path, os.O_WRONLY)
    dst = bytearray(n)
    t0 = time.perf_counter()
    assert _piecewise.read_hashed(fd, HEADER, dst, 64 << 10, False, True) is not None
    copy_s = time.perf_counter() - t0  # to schedule the shrinks, not to check anything
    delays = [copy_s * k / 10 for k in range(1, 10)]
    started, returned, regrown = threading.Event(), threading.Event(), threading.Event()
    stop = False

    def shrink_each_copy() -> None:
        rounds = 0
        while started.wait() and not stop:
            started.clear()
            time.sleep(delays[rounds % len(delays)])
            rounds += 1
            os.ftruncate(wfd, HEADER + n // 4)
            returned.wait()
            returned.clear()
            os.pwrite(wfd, payload[n // 4 :], HEADER + n // 4)
            regrown.set()

    before = _piecewise.faults()
    worker = threading.Thread(target=shrink_each_copy, daemon=True)
    worker.start()
    results = {"cut short": 0, "whole": 0}
    try:
        for _ in range(300):
            regrown.clear()
            started.set()
            digest = _piecewise.read_hashed(fd, HEADER, dst, 64 << 10, False, True)
            returned.set()
            regrown.wait()
            if digest is None:
                results["cut short"] += 1
            else:
                assert digest == checksum(dst)
                results["whole"] += 1
            if _piecewise.faults() - before >= 3:
                break
    finally:
        stop = True
        started.set()
        returned.set()
        worker.join()
        os.close(wfd)
        os.close(fd)
    faults = _piecewise.faults() - before
    assert faults > 0, results
    assert results["cut short"] >= faults


@built
def test_bad_arguments_are_refused_and_the_helper_keeps_working(tmp_path: Path) -> None:
    payload = _payload(1000)
    fd = _record(tmp_path / "chunk", payload)
    try:
        with pytest.raises(ValueError, match="offset"):
            _piecewise.read_hashed(fd, -1, bytearray(10), 4096, True, False)
        with pytest.raises(ValueError, match="piece"):
            _piecewise.read_hashed(fd, 0, bytearray(10), 0, True, False)
        with pytest.raises(TypeError):  # read-only destination
            _piecewise.read_hashed(fd, 0, b"0123456789", 4096, True, False)
        with pytest.raises(TypeError):  # not contiguous
            _piecewise.read_hashed(fd, 0, np.zeros((8, 8), np.uint8)[:, ::2], 4096, True, False)
        assert _piecewise.read_hashed(-1, 0, bytearray(10), 4096, True, False) is None  # bad fd
        assert _piecewise.read_hashed(fd, 0, bytearray(0), 4096, True, False) is None  # nothing
        os.mkdir(tmp_path / "dir")
        dfd = os.open(tmp_path / "dir", os.O_RDONLY)
        try:
            assert _piecewise.read_hashed(dfd, 0, bytearray(10), 4096, True, False) is None
        finally:
            os.close(dfd)
        dst = bytearray(len(payload))
        assert _piecewise.read_hashed(fd, HEADER, dst, 4096, True, False) == checksum(payload)
        assert bytes(dst) == payload
    finally:
        os.close(fd)


@built
def test_threads_read_at_once(tmp_path: Path) -> None:
    n = 2 * pieces.PIECE + 7
    files = [_payload(n, seed) for seed in range(8)]
    fds = [_record(tmp_path / f"chunk{i}", p) for i, p in enumerate(files)]
    out: dict[int, tuple[bytes, bytes | None]] = {}

    def read(i: int) -> None:
        for _ in range(20):
            dst = bytearray(n)
            digest = _piecewise.read_hashed(fds[i], HEADER, dst, 64 << 10, True, True)
            out[i] = (bytes(dst), digest)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(files))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for fd in fds:
            os.close(fd)
    assert out == {i: (p, checksum(p)) for i, p in enumerate(files)}


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    for s in (a, b):
        s.settimeout(10)
    return a, b


@built
@pytest.mark.parametrize("n", SIZES)
def test_chunks_cross_a_socket_whole_with_their_checksum(n: int) -> None:
    """send_all and recv_hashed on plain sockets go through the C loops; with the header, an
    empty part and the payload in many parts (more than one sendmsg can take), every byte
    arrives in order and the checksum equals a one-shot XXH3."""
    payload = _payload(n)
    parts = [b"head", b"", *[memoryview(payload)[i : i + 97] for i in range(0, n, 97)]]
    a, b = _tcp_pair()
    try:
        sender = threading.Thread(target=pieces.send_all, args=(a, parts))
        sender.start()
        head = bytearray(4)
        pieces.recv_exact(b, memoryview(head))
        dst = bytearray(n)
        assert pieces.recv_hashed(b, memoryview(dst)) == checksum(payload)
        sender.join()
        assert head == b"head" and bytes(dst) == payload
    finally:
        a.close()
        b.close()


@built
def test_socket_failures_are_the_errors_python_sockets_raise() -> None:
    a, b = _tcp_pair()
    try:
        b.settimeout(0.05)  # nothing comes: the socket's own timeout applies
        with pytest.raises(TimeoutError):
            pieces.recv_hashed(b, memoryview(bytearray(100)))
        a.sendall(b"x" * 10)
        a.close()  # the peer hangs up before the chunk is whole
        with pytest.raises(ConnectionError, match="closed"):
            pieces.recv_hashed(b, memoryview(bytearray(100)))
        b.settimeout(10)
        with pytest.raises(OSError):  # the peer is gone: EPIPE or ECONNRESET, no SIGPIPE
            for _ in range(100):
                pieces.send_all(b, [b"y" * 65536])
    finally:
        a.close()
        b.close()
    with pytest.raises(OSError) as failed:
        _piecewise.recv_hashed(-1, bytearray(10), 4096, False, None)
    assert failed.value.errno == errno.EBADF
    with pytest.raises(ValueError):
        _piecewise.send_pieces(0, [b"x"], 0, False, None)
    with pytest.raises(TypeError):
        _piecewise.send_pieces(0, [1, 2], 4096, False, None)


def test_a_deadline_holds_on_a_socket_without_a_timeout() -> None:
    """A blocking socket (no timeout) with a deadline: the C loop polls instead of blocking
    in recv, so the deadline ends the wait; a NaN timeout is refused."""
    a, b = _tcp_pair()
    try:
        b.settimeout(None)
        with pytest.raises(TimeoutError):
            pieces.recv_hashed(b, memoryview(bytearray(100)), deadline=time.monotonic() + 0.2)
        with pytest.raises(ValueError):
            _piecewise.recv_hashed(b.fileno(), bytearray(10), 4096, False, float("nan"))
    finally:
        a.close()
        b.close()


SIGBUS_ELSEWHERE = """
import faulthandler, mmap, os, signal, sys
import numpy as np
from tierkv import _piecewise
d = sys.argv[1]
with open(os.path.join(d, "f"), "wb") as f:
    f.write(os.urandom(1 << 16))
fd = os.open(os.path.join(d, "f"), os.O_RDONLY)
_piecewise.read_hashed(fd, 0, np.empty(4096, np.uint8), 4096, False, False)  # the guard
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGBUS)
else:
    faulthandler.enable()  # over the guard (its previous handler: the guard)
    _piecewise.read_hashed(fd, 0, np.empty(4096, np.uint8), 4096, False, False)  # the guard again
    with open(os.path.join(d, "g"), "wb") as f:
        f.write(b"x" * 8192)
    g = open(os.path.join(d, "g"), "r+b")
    m = mmap.mmap(g.fileno(), 8192)
    os.truncate(os.path.join(d, "g"), 0)
    m[4096]  # a SIGBUS outside any guarded copy
print("survived")
"""


@pytest.mark.processes
@pytest.mark.parametrize("how", ["kill", "fault-with-faulthandler"])
def test_a_sigbus_outside_a_guarded_copy_ends_the_process(tmp_path: Path, how: str) -> None:
    """The guard handles only SIGBUS from its own copies: any other ends the process, once
    (before, a SIGBUS sent by kill() was lost, and with faulthandler enabled after the guard
    the two handlers passed a fault back and forth for ever, dumping tracebacks)."""
    script = tmp_path / "sigbus.py"
    script.write_text(SIGBUS_ELSEWHERE)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path), how.split("-")[0]],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == -7, (proc.returncode, proc.stderr[-2000:])  # SIGBUS
    assert "survived" not in proc.stdout
    assert proc.stderr.count("Fatal Python error: Bus error") <= 1


SIGNALLED_WAIT = """
import signal, socket, time
from tierkv import piecewise_io as pieces
a, b = socket.socketpair()
a.settimeout(1.0)
signal.signal(signal.SIGALRM, lambda *_: None)
signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)  # a profiler's timer, SIGCHLDs...
for name, call in (
    ("send", lambda: pieces.send_all(a, [bytes(8 << 20)], deadline=time.monotonic() + 0.3)),
    ("recv", lambda: pieces.recv_hashed(a, memoryview(bytearray(1 << 20)),
                                        deadline=time.monotonic() + 0.3)),
):
    try:
        call()
        print(name, "returned")
    except TimeoutError:
        print(name, "timed out")
"""


@pytest.mark.processes
def test_a_wait_interrupted_by_signals_still_ends_by_its_deadline() -> None:
    """A signal interrupting the C helpers' wait for the socket started the wait again in
    full, and the deadline was only looked at between waits: under a signal more often
    than the socket timeout, a send or receive with a deadline never ended. (In a child
    process: the parent's bound turns a hang into a failure.)"""
    done = subprocess.run(
        [sys.executable, "-c", SIGNALLED_WAIT], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.split("\n")[:2] == ["send timed out", "recv timed out"], done
