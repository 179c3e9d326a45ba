"""One tier's outages, logged once each instead of once per failed batch.

A tier that goes down (Redis killed, an S3 endpoint unreachable) fails every batch that
reaches it: contains, load, store, delete, the background usage count. Each of those used to
log a WARNING, hundreds of lines in a few seconds. :class:`Outage` is the one place that
decides what to log instead: every site that sees a tier fail calls :meth:`Outage.failed`,
every site that sees it work calls :meth:`Outage.ok`.

- The first failure of an outage is logged at WARNING; the ones after it at DEBUG, counted.
- While the outage lasts, a WARNING with the failures so far is logged at most every
  ``interval`` seconds (when a failure comes in; there is no timer thread).
- The first success ends it with one INFO line: how long it lasted and how many failures.
- An outage that starts within ``interval`` of the last WARNING (a tier flapping) is logged
  at DEBUG, and so is its end: at most one WARNING per ``interval`` whatever the pattern.

Thread-safe; the lock is never held while logging.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

REPORT_INTERVAL = 60.0  # seconds between WARNINGs about one tier's failures


class Outage:
    """The failure state of one tier, and the log lines about it."""

    def __init__(
        self,
        what: str,
        logger: logging.Logger,
        interval: float = REPORT_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what = what  # e.g. "redis tier 127.0.0.1:6379/0"
        self.log = logger
        self.interval = interval
        self.clock = clock
        self._lock = threading.Lock()
        self._down = False
        self._since = 0.0  # when the current outage began
        self._failures = 0  # failures in the current outage
        self._reported = False  # whether the current outage was logged at WARNING
        self._last_warning = -float("inf")
        self.outages = 0  # since start
        self.total_failures = 0

    @property
    def down(self) -> bool:
        return self._down

    def failed(self, op: str, error: object, items: int = 1, *, exc_info: bool = False) -> None:
        """``op`` failed for ``items`` chunks (0: a whole-tier request) with ``error``."""
        now = self.clock()
        count = max(1, items)
        with self._lock:
            first = not self._down
            if first:
                self._down, self._since, self._failures = True, now, 0
                self._reported = False
                self.outages += 1
            self._failures += count
            self.total_failures += count
            warn = now - self._last_warning >= self.interval
            if warn:
                self._last_warning = now
                self._reported = True
            failures, lasted = self._failures, now - self._since
        if warn and first:
            self.log.warning(
                "%s: %s failed (%s); further failures are logged at DEBUG until it works again",
                self.what,
                op,
                error,
                exc_info=exc_info,
            )
        elif warn:
            self.log.warning(
                "%s: still failing: %d failures in %.0fs; the last: %s failed (%s)",
                self.what,
                failures,
                lasted,
                op,
                error,
                exc_info=exc_info,
            )
        else:
            self.log.debug("%s: %s failed (%s)", self.what, op, error, exc_info=exc_info)

    def ok(self) -> None:
        """A request to the tier worked: ends the outage, if there is one."""
        if not self._down:  # the common case, without the lock
            return
        now = self.clock()
        with self._lock:
            if not self._down:
                return
            self._down = False
            failures, lasted, reported = self._failures, now - self._since, self._reported
        self.log.log(
            logging.INFO if reported else logging.DEBUG,
            "%s: works again after %.1fs; %d failures meanwhile",
            self.what,
            lasted,
            failures,
        )
