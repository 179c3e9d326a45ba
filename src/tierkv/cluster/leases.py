"""Holder-side leases on the chunk slots a peer reads one-sided (NIXL READ).

A one-sided READ bypasses the holder's read locks, so the holder hands a slot's address
out only under a lease: the :class:`~tierkv.cluster.transport.Served` of the request (its
read locks in the index keep the slots from being evicted, freed or reused) is kept until
the reader releases the lease, or until its deadline passes, when a reaper thread drops the
locks. A lease is released only by the peer it was granted to. The reader verifies every
chunk's checksum, so bytes that changed after a lease expired are never accepted.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tierkv.cluster.transport import Served

log = logging.getLogger(__name__)


@dataclass
class Lease:
    id: int
    peer: str
    deadline: float  # monotonic
    served: Served
    chunks: int


class LeaseTable:
    """Live leases; ``release`` (the chunk source's) drops a lease's read locks."""

    def __init__(
        self,
        release: Callable[[Served], None],
        ttl: float,
        max_leases: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.release_served = release
        self.ttl = ttl
        self.max_leases = max_leases
        self.clock = clock
        self._leases: dict[int, Lease] = {}  # in deadline order (one ttl for all)
        self._next = secrets.randbits(48) + 1
        self._cond = threading.Condition()
        self._closed = False
        self._reaper: threading.Thread | None = None
        self.granted = self.released = self.expired = self.refused = 0

    def grant(self, peer: str, served: Served, chunks: int) -> Lease | None:
        """A new lease over ``served`` for ``peer``; None when too many are live (the
        caller releases ``served`` itself then)."""
        with self._cond:
            if self._closed or len(self._leases) >= self.max_leases:
                self.refused += 1
                return None
            lease = Lease(self._next, peer, self.clock() + self.ttl, served, chunks)
            self._next += 1
            self._leases[lease.id] = lease
            self.granted += 1
            self._cond.notify()
        return lease

    def start(self) -> LeaseTable:
        """Start the reaper thread: it ends each lease at its deadline (without it, only
        :meth:`expire` does, as in tests that move a clock of their own). Idempotent."""
        with self._cond:
            if self._reaper is None and not self._closed:
                self._reaper = threading.Thread(
                    target=self._reap, name="tierkv-nixl-leases", daemon=True
                )
                self._reaper.start()
        return self

    def end(self, lease_id: int, peer: str) -> int:
        """Release a lease of ``peer``: the number of its chunks, 0 if it is not live (it
        expired, was released already, or belongs to another peer)."""
        with self._cond:
            lease = self._leases.get(lease_id)
            if lease is None or lease.peer != peer:
                return 0
            del self._leases[lease_id]
            self.released += 1
        self.release_served(lease.served)
        return lease.chunks

    def expire(self) -> int:
        """Drop the leases whose deadline passed; how many."""
        now = self.clock()
        gone: list[Lease] = []
        with self._cond:
            for lease in list(self._leases.values()):
                if lease.deadline > now:
                    break
                del self._leases[lease.id]
                gone.append(lease)
            self.expired += len(gone)
        for lease in gone:
            log.debug("a NIXL lease of %s expired (%d chunks)", lease.peer, lease.chunks)
            self.release_served(lease.served)
        return len(gone)

    def _reap(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                first = next(iter(self._leases.values()), None)
                wait = None if first is None else max(0.0, first.deadline - self.clock())
                if wait is None or wait > 0:
                    self._cond.wait(wait)
                    continue
            self.expire()

    def live(self) -> int:
        with self._cond:
            return len(self._leases)

    def close(self) -> None:
        """Release every lease (the holder stops serving)."""
        with self._cond:
            self._closed = True
            leases = list(self._leases.values())
            self._leases.clear()
            self._cond.notify_all()
        for lease in leases:
            self.release_served(lease.served)

    def stats(self) -> dict[str, int]:
        return {
            "live": self.live(),
            "granted": self.granted,
            "released": self.released,
            "expired": self.expired,
            "refused": self.refused,
        }
