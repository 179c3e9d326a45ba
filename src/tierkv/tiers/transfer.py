"""How long a network tier's transfer may take as a whole: its timeout plus its bytes at a
minimum rate (``min_rate``, bytes per second).

A socket's timeout bounds each wait for the peer, not a transfer: a peer that takes or sends
a few bytes at a time, each within the timeout, held a tier thread for (bytes / few) x
timeout (a trickling S3 body; a Redis reading a store's values slowly). One timeout for a
whole transfer instead failed every large batch over a link merely slower than its bytes /
timeout (a 64 MiB Redis pipeline under 13 MB/s with 5 s). A deadline of the timeout plus
the bytes at ``min_rate`` bounds the first and passes the second, down to ``min_rate``.
"""

from __future__ import annotations

import time

MIN_RATE = 256 * 1024  # bytes per second: a transfer slower than this fails


def transfer_time(nbytes: int, min_rate: int) -> float:
    """Seconds ``nbytes`` may take at ``min_rate`` (bytes per second, > 0)."""
    return nbytes / min_rate


def transfer_deadline(nbytes: int, timeout: float, min_rate: int) -> float:
    """The ``time.monotonic()`` by which a transfer of ``nbytes`` starting now must end:
    ``timeout`` (seconds) plus :func:`transfer_time`."""
    return time.monotonic() + timeout + transfer_time(nbytes, min_rate)


__all__ = ["MIN_RATE", "transfer_deadline", "transfer_time"]
