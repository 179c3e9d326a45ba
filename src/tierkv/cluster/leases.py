"""Holder-side leases on the chunk slots a peer reads one-sided (NIXL READ).

A one-sided READ bypasses the holder's read locks, so the holder hands a slot's address
out only under a lease: the :class:`~tierkv.cluster.transport.Served` of the request (its
read locks in the index keep the slots from being evicted, freed or reused) is kept until
the lease is released, or until its deadline passes, when a reaper thread drops the locks.
The reader verifies every chunk's checksum, so bytes that changed after a lease expired are
never accepted.

A lease ends in one of three ways: the READ's completion notification (NIXL delivers the
reader's message to the holder once the transfer is done; the same thread that reaps
polls for them while leases are live, every :data:`POLL_INTERVAL`), an explicit release
over the control channel, only by the peer it was granted to (a reader whose READ failed),
or its deadline. A lease's id is 63 random bits, known only to the holder and the peer it
was sent to over the authenticated channel: a notification naming it is that peer's.
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

POLL_INTERVAL = 0.001  # seconds between polls for completion notifications, leases live


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
        notifications: Callable[[], list[int]] | None = None,
    ) -> None:
        """``notifications``: the ids of leases whose READ completed since the last call
        (polled by the reaper thread while leases are live)."""
        self.release_served = release
        self.notifications = notifications
        self.ttl = ttl
        self.max_leases = max_leases
        self.clock = clock
        self._leases: dict[int, Lease] = {}  # in deadline order (one ttl for all)
        self._cond = threading.Condition()
        self._closed = False
        self._reaper: threading.Thread | None = None
        self.granted = self.released = self.notified = self.expired = self.refused = 0

    def grant(self, peer: str, served: Served, chunks: int) -> Lease | None:
        """A new lease over ``served`` for ``peer``; None when too many are live (the
        caller releases ``served`` itself then)."""
        with self._cond:
            if self._closed or len(self._leases) >= self.max_leases:
                self.refused += 1
                return None
            lease_id = 0
            while not lease_id or lease_id in self._leases:
                lease_id = secrets.randbits(63)
            lease = Lease(lease_id, peer, self.clock() + self.ttl, served, chunks)
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

    def end_completed(self, lease_id: int) -> int:
        """Release a lease whose READ completed (its notification named it): the number of
        its chunks, 0 if it is not live (it expired or was released already)."""
        with self._cond:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return 0
            self.notified += 1
        self.release_served(lease.served)
        return lease.chunks

    def poll(self) -> int:
        """End the leases whose completion notifications arrived; how many."""
        if self.notifications is None:
            return 0
        try:
            ids = self.notifications()
        except Exception as exc:  # the agent closed under us, or NIXL failed: deadlines do
            log.debug("polling NIXL notifications failed: %s", exc)
            return 0
        return sum(1 for lease_id in ids if self.end_completed(lease_id))

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
                if first is None:
                    self._cond.wait()
                    continue
                wait = max(0.0, first.deadline - self.clock())
                if self.notifications is not None:
                    wait = min(wait, POLL_INTERVAL)
                if wait > 0:
                    self._cond.wait(wait)
            self.poll()
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
            "notified": self.notified,
            "expired": self.expired,
            "refused": self.refused,
        }
