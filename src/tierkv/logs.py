"""Logging set-up (levels, plain text or one JSON object per line), and :class:`FailureLog`,
the one place that keeps a repeated failure from writing a line each time.

A failure that repeats (a tier that is down fails every batch; a port under attack refuses
every frame; a node with the wrong cluster token is refused every second) used to log one
line each: hundreds of lines in a few seconds. A :class:`FailureLog` counts them instead:

- The first failure of an episode is logged at WARNING with its cause; the ones after it at
  DEBUG, counted.
- While the episode lasts, a WARNING with the failures so far is logged at most every
  ``interval`` seconds (when a failure comes in; there is no timer thread).
- The first success (:meth:`FailureLog.ok`) ends the episode with one INFO line: how long it
  lasted and how many failures. Failures that never "work again" (refused requests) simply
  never call it: one WARNING, then a summary at most every ``interval``.
- An episode that starts within ``interval`` of the last WARNING (flapping) is logged at
  DEBUG, and so is its end: at most one WARNING per ``interval`` whatever the pattern.

The wording is in class attributes (``%(name)s`` formats over :meth:`FailureLog._fields`), so
a subclass says "refused" where a tier says "failed". Thread-safe; the lock is never held
while logging.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

REPORT_INTERVAL = 60.0  # seconds between WARNINGs about one repeated failure


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class FailureLog:
    """One thing's repeated failures, and the few log lines about them."""

    # Formats over: what, op, error, failures (this episode), lasted (s), interval (s).
    FIRST = (
        "%(what)s: %(op)s failed (%(error)s); further failures are logged at DEBUG until it "
        "works again"
    )
    STILL = (
        "%(what)s: still failing: %(failures)d failures in %(lasted).0fs; the last: %(op)s "
        "failed (%(error)s)"
    )
    EACH = "%(what)s: %(op)s failed (%(error)s)"
    AGAIN = "%(what)s: works again after %(lasted).1fs; %(failures)d failures meanwhile"
    REFUSED = (
        "%(what)s: %(op)s refused for %(failures)d items of a batch that otherwise worked "
        "(%(error)s); further refusals are logged at DEBUG for a while"
    )

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
        self._since = 0.0  # when the current episode began
        self._failures = 0  # failures in the current episode
        self._reported = False  # whether the current episode was logged at WARNING
        self._last_warning = -float("inf")
        self.outages = 0  # episodes since start
        self.total_failures = 0

    @property
    def down(self) -> bool:
        return self._down

    def failed(self, op: str, error: object, items: int = 1, *, exc_info: bool = False) -> None:
        """``op`` failed for ``items`` things (0: counts once) with ``error``."""
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
            fields = self._fields(op, error, self._failures, now - self._since)
        if warn:
            template = self.FIRST if first else self.STILL
            self.log.warning(template, fields, exc_info=exc_info)
        else:
            self.log.debug(self.EACH, fields, exc_info=exc_info)

    def refused(self, op: str, error: object, items: int) -> None:
        """``op`` was refused for ``items`` things of a batch whose other things worked (a
        Redis out of memory for some values): no outage, which the batch's success ends, but
        counted and logged at WARNING at most once an ``interval`` like one (ending an
        outage and starting another for every such batch counted an outage each time)."""
        now = self.clock()
        with self._lock:
            self.total_failures += items
            warn = now - self._last_warning >= self.interval
            if warn:
                self._last_warning = now
            fields = self._fields(op, error, items, 0.0)
        self.log.log(logging.WARNING if warn else logging.DEBUG, self.REFUSED, fields)

    def ok(self) -> None:
        """It worked: ends the episode, if there is one."""
        if not self._down:  # the common case, without the lock
            return
        now = self.clock()
        with self._lock:
            if not self._down:
                return
            self._down = False
            fields = self._fields("", "", self._failures, now - self._since)
            reported = self._reported
        self.log.log(logging.INFO if reported else logging.DEBUG, self.AGAIN, fields)

    def _fields(self, op: str, error: object, failures: int, lasted: float) -> dict[str, object]:
        return {
            "what": self.what,
            "op": op,
            "error": error,
            "failures": failures,
            "lasted": lasted,
            "interval": self.interval,
        }
