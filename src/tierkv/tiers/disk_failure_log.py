"""How the disk tier logs its failures without flooding the log: a failure that recurs with
every chunk (a full disk, a bad view, corrupt files) is logged the first time at WARNING and
its repeats at DEBUG; the disk tier's counters (:mod:`tierkv.tiers.disk_stats`) count every
one. Lines are logged under the disk tier's logger (``tierkv.tiers.disk``).
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("tierkv.tiers.disk")

CORRUPT_LOG_LIMIT = 10  # corrupt files logged at WARNING; later ones at DEBUG (see stats)
_REFUSED = ("store", -2)  # the kind of a store refused before any I/O


class DiskFailureLog:
    """The kinds of failure one disk tier has logged at WARNING already."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._seen: set[tuple[str, int]] = set()

    def _first(self, kind: tuple[str, int]) -> bool:
        with self._lock:
            first = kind not in self._seen
            self._seen.add(kind)
        return first

    def error(self, op: str, exc: Exception, key: bytes) -> None:
        """Log the first error of each kind per operation at WARNING, repeats at DEBUG."""
        code = exc.errno if isinstance(exc, OSError) and exc.errno is not None else -1
        first = self._first((op, code))
        level = logging.WARNING if first else logging.DEBUG
        suffix = " (repeats are logged at DEBUG)" if first else ""
        log.log(level, "disk tier %s: %s of %s failed: %s%s", self.path, op, key.hex(), exc, suffix)

    def refused(self, message: str) -> None:
        """A store refused before any I/O (a malformed key or view)."""
        level = logging.WARNING if self._first(_REFUSED) else logging.DEBUG
        log.log(level, "disk tier: %s", message)

    def corrupt(self, path: str, why: str, count: int) -> None:
        """The ``count``-th corrupt chunk since start, at ``path``, was removed."""
        level = logging.WARNING if count <= CORRUPT_LOG_LIMIT else logging.DEBUG
        log.log(level, "disk tier: corrupt chunk %s (%s); removed", path, why)
        if count == CORRUPT_LOG_LIMIT:
            log.warning("disk tier: further corrupt chunks are logged at DEBUG (see stats)")
