"""The shared-memory pool: one named POSIX segment that the server owns and engines attach to.

The server creates the segment (mode 0600), after checking that /dev/shm can hold it, holds
an exclusive ``flock`` on it while it lives (the kernel drops it when the process dies), and
unlinks it on close (unless the name now belongs to a newer segment). A segment of the same
name that nobody holds, left by a crashed server, is unlinked and recreated; one that a live
server holds (another server given the same instance or pool name) is refused: replacing it
would hand that server's engines a segment other than the one its slots are in. Engines
attach by name, check the size and never unlink: this module talks to ``shm_open`` directly
instead of using ``multiprocessing.shared_memory.SharedMemory``, whose resource tracker
(Python < 3.13) unlinks every segment a process attached when it exits.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import shutil
import stat
from typing import Any

import numpy as np
import numpy.typing as npt

try:  # CPython's own binding of shm_open/shm_unlink (the one SharedMemory uses).
    import _posixshmem  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - non-POSIX platforms
    _posixshmem = None

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
# madvise(2) advice that write-faults a range in without changing it (Linux >= 5.14).
MADV_POPULATE_WRITE: int = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class PoolError(Exception):
    """The pool cannot be created or attached."""


class ShmCapacityError(PoolError):
    """/dev/shm is too small for the configured pool."""


class PoolNotFoundError(PoolError, FileNotFoundError):
    """No segment of that name: the server is not running or uses another name."""


class PoolSizeMismatchError(PoolError, ValueError):
    """The segment exists but is not the size the server announced."""


def _posix_name(name: str) -> str:
    """``name`` as shm_open wants it: one leading slash, no other slash, not empty."""
    bare = name.lstrip("/")
    if not bare or "/" in bare or "\0" in bare or bare in (".", "..") or len(bare) > 200:
        raise PoolError(f"invalid shared-memory segment name {name!r}")
    return "/" + bare


def _shm_open(name: str, flags: int, mode: int) -> int:
    if _posixshmem is not None:
        fd: int = _posixshmem.shm_open(name, flags, mode)
        return fd
    return os.open(os.path.join(SHM_DIR, name.lstrip("/")), flags, mode)  # pragma: no cover


def _shm_unlink(name: str) -> None:
    if _posixshmem is not None:
        _posixshmem.shm_unlink(name)
    else:  # pragma: no cover
        os.unlink(os.path.join(SHM_DIR, name.lstrip("/")))


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def check_shm_capacity(required: int, shm_dir: str = SHM_DIR) -> None:
    """Fail fast, with an actionable message, when ``shm_dir`` cannot hold ``required`` bytes."""
    if not os.path.isdir(shm_dir):
        return
    free = shutil.disk_usage(shm_dir).free
    if free < required:
        # 25% headroom over the pool, rounded *up* to whole GiB.
        suggest_gib = max(1, -(-(required * 5) // (4 * 2**30)))
        raise ShmCapacityError(
            f"not enough shared memory for the pool: need {format_bytes(required)}, "
            f"{shm_dir} has {format_bytes(free)} free. Make the pool smaller (--pool-size), "
            f"or give the container more shared memory: Docker `--shm-size={suggest_gib}g`, "
            f"Kubernetes an `emptyDir` volume with `medium: Memory` (and a sizeLimit) "
            f"mounted at {shm_dir}."
        )


class ShmPool:
    """A mapped shared-memory segment; ``owner`` pools unlink it on close."""

    def __init__(
        self,
        name: str,
        size: int,
        mm: mmap.mmap,
        owner: bool,
        identity: tuple[int, int] | None = None,
        lock_fd: int | None = None,
    ) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self._mm: mmap.mmap | None = mm
        # The owner's descriptor of the segment, holding its flock until close().
        self._lock_fd = lock_fd
        # (st_dev, st_ino) of the segment this handle created: close() unlinks the name only
        # while it still refers to that segment, never a newer server's replacement.
        self._identity = identity
        self.buf = memoryview(mm)

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def create(cls, name: str, size: int, prefault: bool = False) -> ShmPool:
        """Create (or recreate, if stale) the segment ``name`` of ``size`` bytes, mode 0600.

        With ``prefault`` every page is allocated up front (so a full /dev/shm fails here, not
        as SIGBUS later) and mapped into this process, so the first store pays no page faults.
        """
        if size <= 0:
            raise PoolError(f"pool size must be positive, got {size}")
        posix = _posix_name(name)
        flags = os.O_CREAT | os.O_EXCL | os.O_RDWR
        try:
            fd = _shm_open(posix, flags, 0o600)
        except FileExistsError:
            _remove_if_stale(posix)
            fd = _shm_open(posix, flags, 0o600)
        try:
            # Another server cannot take the name from now on (a stale check fails on this).
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.fchmod(fd, 0o600)
            check_shm_capacity(size, SHM_DIR)
            os.ftruncate(fd, size)
            if prefault:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                        # No fallocate on this filesystem: MAP_POPULATE below still faults
                        # the pages in, it just cannot report a full /dev/shm.
                        log.debug("posix_fallocate unsupported for %s: %s", posix, exc)
                    else:
                        raise ShmCapacityError(
                            f"could not reserve {format_bytes(size)} in {SHM_DIR}: {exc}. "
                            "Give the container more shared memory (Docker --shm-size, "
                            "Kubernetes emptyDir.medium: Memory) or make the pool smaller."
                        ) from exc
            mm = _map(fd, size, populate=prefault)
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                _shm_unlink(posix)
            raise
        return cls(posix, size, mm, owner=True, identity=(st.st_dev, st.st_ino), lock_fd=fd)

    @classmethod
    def attach(cls, name: str, expected_size: int | None = None, populate: bool = False) -> ShmPool:
        """Map an existing segment; never unlinks it, not even at interpreter exit."""
        posix = _posix_name(name)
        try:
            fd = _shm_open(posix, os.O_RDWR, 0)
        except FileNotFoundError:
            raise PoolNotFoundError(
                f"shared-memory segment {posix} does not exist: is `tierkv server` running "
                "on this node, and does this process see the same /dev/shm (same container "
                "or pod, shared IPC namespace)?"
            ) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise PoolError(f"{posix} is not a shared-memory segment")
            if expected_size is not None and st.st_size != expected_size:
                raise PoolSizeMismatchError(
                    f"shared-memory segment {posix} is {st.st_size} bytes, the server "
                    f"announced {expected_size}: another server may own this name"
                )
            if st.st_size == 0:
                raise PoolError(
                    f"shared-memory segment {posix} is empty: its server is still creating it "
                    "or failed while creating it"
                )
            mm = _map(fd, st.st_size, populate=populate)
        finally:
            os.close(fd)
        return cls(posix, st.st_size, mm, owner=False)

    # -- access ----------------------------------------------------------------------------
    def view(self, offset: int, length: int) -> memoryview:
        """Zero-copy bytes view of ``[offset, offset + length)``."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise IndexError(f"range [{offset}, {offset + length}) outside pool of {self.size}")
        return self.buf[offset : offset + length]

    def array(
        self, offset: int, length: int, dtype: npt.DTypeLike = np.uint8, shape: Any = None
    ) -> npt.NDArray[Any]:
        """Zero-copy numpy view of a slot, optionally typed and shaped."""
        arr: npt.NDArray[Any] = np.frombuffer(self.view(offset, length), dtype=dtype)
        return arr if shape is None else arr.reshape(shape)

    def prefault(self) -> None:
        """Fault every page of the pool in (allocating it) and map it into this process.

        Contents are left untouched, so this is safe while other processes use the pool.
        """
        mm = self._mm
        if mm is None:
            raise PoolError(f"pool {self.name} is closed")
        madvise = getattr(mm, "madvise", None)
        if madvise is not None:
            try:
                madvise(MADV_POPULATE_WRITE)  # Linux >= 5.14: write-fault every page, no writes
                return
            except (OSError, ValueError):
                pass
        # A read fault on a shared-memory page allocates it too. (Assigning a slice to itself
        # is not a fallback: numpy skips the copy when source and destination are the same.)
        arr = np.frombuffer(self.buf, dtype=np.uint8)
        int(arr[:: mmap.PAGESIZE].sum(dtype=np.uint64))

    # -- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        """Unmap; the owner also unlinks the segment. Idempotent."""
        mm, self._mm = self._mm, None
        if mm is None:
            return
        lock_fd, self._lock_fd = self._lock_fd, None
        try:
            self._unmap_and_unlink(mm)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # the name is free for the next server only now

    def _unmap_and_unlink(self, mm: mmap.mmap) -> None:
        try:
            self.buf.release()
            mm.close()
        except BufferError:
            # Views into the pool are still alive somewhere; the mapping goes with the process.
            log.debug("pool %s still has live views; leaving it mapped", self.name)
        if self.owner:
            if not self._still_ours():
                log.warning(
                    "shared-memory segment %s was removed or replaced; not unlinking it", self.name
                )
                return
            try:
                _shm_unlink(self.name)
            except FileNotFoundError:
                log.warning("shared-memory segment %s was already removed", self.name)

    def _still_ours(self) -> bool:
        """Whether ``self.name`` still names the segment this owner created."""
        if self._identity is None:
            return True
        try:
            fd = _shm_open(self.name, os.O_RDONLY, 0)
        except FileNotFoundError:
            return False
        except PermissionError:
            return False  # another user's segment now: certainly not ours
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        return (st.st_dev, st.st_ino) == self._identity

    @property
    def closed(self) -> bool:
        return self._mm is None

    def __enter__(self) -> ShmPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def segment_exists(name: str) -> bool:
    """Whether a segment of that name exists (for tests and operators)."""
    try:
        fd = _shm_open(_posix_name(name), os.O_RDONLY, 0)
    except FileNotFoundError:
        return False
    except PermissionError:
        return True  # it exists, another user owns it
    os.close(fd)
    return True


def _remove_if_stale(posix: str) -> None:
    """Unlink the existing segment ``posix`` if no live server holds it (its creator crashed);
    raise :class:`PoolError` if one does."""
    try:
        fd = _shm_open(posix, os.O_RDONLY, 0)
    except FileNotFoundError:
        return  # gone meanwhile
    except PermissionError:
        raise PoolError(
            f"shared-memory segment {posix} exists and belongs to another user: give this "
            "server another --instance or --pool-name"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PoolError(
                f"shared-memory segment {posix} belongs to a running server (one started with "
                "the same --instance or --pool-name, perhaps with another --runtime-dir): give "
                "this server another --instance or --pool-name, or stop that one"
            ) from None
        log.warning("removing stale shared-memory segment %s (crashed server?)", posix)
        with contextlib.suppress(FileNotFoundError):
            _shm_unlink(posix)
    finally:
        os.close(fd)


def _map(fd: int, size: int, populate: bool) -> mmap.mmap:
    flags = mmap.MAP_SHARED
    if populate:
        flags |= getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
