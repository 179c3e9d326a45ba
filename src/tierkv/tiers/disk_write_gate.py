"""Whether the disk tier may write: writes are disabled while the medium refuses them, and
one store at a time is let through as a probe.

A write that fails because the medium cannot take writes (ENOSPC, EDQUOT, EROFS, EACCES,
EPERM, ENOTDIR) disables *writes* with one log line at ERROR: stores return False at once,
while chunks already on disk stay readable (a full disk still holds a valid cache). Every
``retry_interval`` seconds one store is let through as a probe; when it succeeds writes are
enabled again. A directory that cannot be created at start disables the tier the same way
instead of failing the server.

:class:`WriteGate` holds no lock: :class:`tierkv.tiers.disk.DiskTier` calls its state
methods under its own lock, and its ``report_*`` methods (which log) outside it. Lines are
logged under the disk tier's logger (``tierkv.tiers.disk``), as before the split.
"""

from __future__ import annotations

import errno
import logging
import time

log = logging.getLogger("tierkv.tiers.disk")

# The medium refuses writes (full, read-only, no permission, path not a directory): disable
# writes and re-probe later instead of failing (and logging) every chunk.
DEGRADE_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR}
)


def refusal(exc: Exception) -> str | None:
    """Why writes must be disabled after ``exc`` (the medium refuses writes), or None for a
    failure of this write alone."""
    if isinstance(exc, OSError) and exc.errno in DEGRADE_ERRNOS:
        return f"{exc.strerror or exc} ({errno.errorcode.get(exc.errno or 0, '?')})"
    return None


class WriteGate:
    """The disk tier's write state: enabled, or disabled for a reason with a probe due."""

    __slots__ = ("_next_probe", "_probing", "path", "reason", "retry_interval")

    def __init__(self, path: str, retry_interval: float) -> None:
        self.path = path
        self.retry_interval = retry_interval
        self.reason = ""  # why writes are disabled ("" = enabled)
        self._next_probe = 0.0
        self._probing = False

    @property
    def disabled(self) -> bool:
        return bool(self.reason)

    def may_write(self) -> bool:
        """Whether a store may write now; while writes are disabled, claims the one probe."""
        if not self.reason:
            return True
        if self._probing or time.monotonic() < self._next_probe:
            return False
        self._probing = True
        return True

    def release_probe(self) -> None:
        """The store that held the probe did not reach the medium's verdict."""
        self._probing = False

    def disable(self, reason: str) -> bool:
        """Disable writes (again) for ``reason``; whether they were enabled until now."""
        first = not self.reason
        self.reason = reason
        self._next_probe = time.monotonic() + self.retry_interval
        self._probing = False
        return first

    def written(self, probe: bool) -> bool:
        """A store wrote its file; whether that re-enabled writes (it was the probe)."""
        if probe and self.reason:
            self.reason, self._probing = "", False
            return True
        return False

    def report_disabled(self, reason: str, first: bool) -> None:
        if first:
            log.error(
                "disk tier %s: writes disabled: %s. Chunks already on disk stay readable; "
                "new chunks are not kept on disk. Retrying every %gs.",
                self.path,
                reason,
                self.retry_interval,
            )
        else:
            log.debug("disk tier %s: write probe failed: %s", self.path, reason)

    def report_enabled(self) -> None:
        log.info("disk tier %s: writes work again; re-enabled", self.path)
