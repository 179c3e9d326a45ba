"""The directory: which node holds each chunk, and in which of its tiers (pool or disk).

:class:`Directory` is what a node needs from any directory, and :class:`PublishQueue` the
queue of publishes and withdrawals both implementations send from: the ring's
(:class:`tierkv.cluster.ring_directory.RingDirectory`: every member hosts a shard of it) and
the controller's (:class:`tierkv.cluster.controller_directory.ControllerDirectory`: one
registry process).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

from tierkv.cluster import messages as m

log = logging.getLogger(__name__)

Where = m.Where
WHERE_CODES = frozenset(int(w) for w in Where)  # the tier codes an entry may name


class Location(NamedTuple):
    holder: str
    where: Where


class Directory(ABC):
    """Where chunks live in the cluster."""

    @abstractmethod
    def publish(self, keys: Sequence[bytes], where: Where = Where.POOL) -> int:
        """Announce (asynchronously) that this node holds ``keys`` in ``where``; returns a
        ticket for :meth:`wait_published`."""

    @abstractmethod
    def wait_published(self, ticket: int, timeout: float) -> bool:
        """Wait until the publishes up to ``ticket`` have been sent to the keys' owners and
        answered (acknowledged, refused or timed out); False if ``timeout`` passed first.
        Owners that are suspect (silent since a timeout) are not waited for. After True, a
        resolve from any node whose view of the members agrees finds them."""

    @abstractmethod
    def unpublish(self, keys: Sequence[bytes]) -> None:
        """Withdraw (asynchronously) this node's entries for ``keys``."""

    @abstractmethod
    def resolve(self, keys: Sequence[bytes]) -> list[list[Location]]:
        """Live holders of each key (empty where none is known)."""

    def start(self) -> None:  # noqa: B027 - optional hook
        """Start background work."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop background work."""

    def namespaces_changed(self) -> None:  # noqa: B027 - optional hook
        """This server's engines' namespaces changed (a directory that lists them: tell)."""

    def stats(self) -> dict[str, object]:
        return {}


class PublishQueue:
    """A directory's queued publishes and withdrawals, and the tickets of :meth:`publish
    <Directory.publish>`: what a directory's sender thread takes in batches and reports as
    sent. Not thread-safe on its own: its directory calls it under its lock, and waits on
    its own condition for :meth:`done`."""

    def __init__(self) -> None:
        self.pending: dict[bytes, int] = {}  # key -> Where, or -1 to withdraw
        self.queued = 0  # publish calls so far (their tickets)
        self.sent = 0  # publish calls whose batch has been sent and answered

    def __bool__(self) -> bool:
        return bool(self.pending)

    def add(self, keys: Sequence[bytes], where: Where) -> int:
        """Queue ``keys`` as held in ``where``; returns the ticket (for no keys: the last)."""
        if keys:
            for key in keys:
                self.pending[key] = int(where)
            self.queued += 1
        return self.queued

    def withdraw(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.pending[key] = -1

    def take(self) -> tuple[dict[bytes, int], int]:
        """The queued changes, and the last ticket they cover; the queue is empty after."""
        pending, self.pending = self.pending, {}
        return pending, self.queued

    def mark_sent(self, ticket: int) -> None:
        """The batch that covers the tickets up to ``ticket`` was sent and answered."""
        self.sent = max(self.sent, ticket)

    def done(self, ticket: int) -> bool:
        return self.sent >= ticket
