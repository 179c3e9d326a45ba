"""Single use of signed control requests: a receiver's memory of the requests it served.

Every signed request carries its sender's id (random, drawn once per process: a restart or
a fork is a new sender), a counter that sender increments for each request it signs, and a
timestamp (:mod:`tierkv.cluster.auth`). ``(sender, counter)`` is thus never used twice by an
honest sender, and :class:`ReplayGuard` refuses a second use:

- per sender it keeps the highest counter served and a bitmap of which of the ``window``
  counters below it were served (a sliding window, as IPsec does for its sequence numbers).
  A counter already served, or older than the window, is refused. Threads of one sender
  sign and send concurrently on separate sockets, so requests arrive slightly out of order:
  any order within the window is accepted (``window`` requests of the sender, all its peers
  together: milliseconds of reordering at the busiest, where a real reorder is microseconds).
- a sender whose newest request is older than the clock window (``max_skew``) is forgotten:
  every request it ever signed is refused by the timestamp check from then on.
- at most ``max_senders`` senders are remembered. Only holders of the cluster secret can add
  one (the MAC is checked first), but a burst of short-lived processes (CLIs, tests) could
  fill the table: then the sender heard from least recently is dropped and its newest
  timestamp becomes a floor that any *unknown* sender's request must be newer than, so none
  of the dropped sender's requests can be replayed either.

Memory is bounded: at most ``max_senders`` x (``window`` / 8 bytes of bitmap + ~200 bytes),
about 5 MiB with the defaults. Thread-safe (one lock, held for a few integer operations).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

WINDOW = 8192  # requests of one sender that may arrive out of order
MAX_SENDERS = 4096  # senders remembered at once
FORGET_EVERY_NS = 10**9  # how often idle senders are looked for
REPLAYED = "replayed"  # how every reason of a refusal here begins


@dataclass
class _Served:
    high: int  # the highest counter served
    bits: int  # bit i: counter high - i was served (i < window)
    stamp: int  # the newest timestamp served (ns since the epoch, the sender's clock)


class ReplayGuard:
    """Which signed requests were served already, per sender (see the module docstring)."""

    def __init__(
        self,
        max_skew_ns: int,
        window: int = WINDOW,
        max_senders: int = MAX_SENDERS,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self.max_skew_ns = max_skew_ns
        self.window = window
        self.max_senders = max_senders
        self.clock_ns = clock_ns
        self._mask = (1 << window) - 1
        self._senders: dict[bytes, _Served] = {}
        self._floor = -(2**63)  # an unknown sender's request must be newer (see evictions)
        self._next_forget = 0
        self._lock = threading.Lock()
        self.refused = 0  # requests refused as already used (replays)

    def __len__(self) -> int:
        return len(self._senders)

    def first_use(self, sender: bytes, counter: int, stamp: int) -> str:
        """ "" (and remembered) the first time ``(sender, counter)`` comes; otherwise why it
        is refused. Call only for requests whose MAC and timestamp were checked."""
        with self._lock:
            why = self._check(sender, counter, stamp)
            if why:
                self.refused += 1
        return why

    def _check(self, sender: bytes, counter: int, stamp: int) -> str:
        now = self.clock_ns()
        if now >= self._next_forget:
            self._next_forget = now + FORGET_EVERY_NS
            self._forget_idle(now)
        served = self._senders.get(sender)
        if served is None:
            if stamp <= self._floor:
                return f"{REPLAYED} (a request of a sender forgotten to make room)"
            if len(self._senders) >= self.max_senders:
                self._evict_one()
            self._senders[sender] = _Served(counter, 1, stamp)
            return ""
        if counter > served.high:
            shift = counter - served.high
            served.bits = 1 if shift >= self.window else ((served.bits << shift) | 1) & self._mask
            served.high = counter
        else:
            age = served.high - counter
            if age >= self.window:
                return (
                    f"{REPLAYED}, or older than the last {self.window} requests of its sender "
                    "(delayed in transit)"
                )
            if served.bits >> age & 1:
                return f"{REPLAYED} (this request was served already)"
            served.bits |= 1 << age
        served.stamp = max(served.stamp, stamp)
        return ""

    def _forget_idle(self, now: int) -> None:
        horizon = now - self.max_skew_ns
        for sender in [s for s, v in self._senders.items() if v.stamp < horizon]:
            del self._senders[sender]

    def _evict_one(self) -> None:
        sender = min(self._senders, key=lambda s: self._senders[s].stamp)
        self._floor = max(self._floor, self._senders.pop(sender).stamp)


__all__ = ["MAX_SENDERS", "REPLAYED", "WINDOW", "ReplayGuard"]
