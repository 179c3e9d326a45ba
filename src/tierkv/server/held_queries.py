"""QUERY_PREFETCH replies that wait for the prefetch (``wait_ms``), held by the RPC loop.

An engine that waits for a lookup's prefetch (the SGLang backend, ``Client.wait_prefetch``)
used to poll: a request every 0.5 to 20 ms, each a wake-up of the server's control threads
in the middle of the prefetch's transfers, and an answer up to one poll interval late. A
held query is answered once: as soon as the lookup's prefetch lands (on the tier thread that
finished it, through the loop's reply queue), or when its wait runs out (on the loop), or
when the server's own ``prefetch_timeout`` has ended the prefetch, whichever comes first.
No thread waits for it. The request is counted once, when it arrives; re-reading its
progress is not another request. A connection holds at most :data:`MAX_HELD` queries until
their waits end (answered or not): past that one is answered at once with the progress so
far, so a client sending waiting queries in a loop cannot make the loop's memory grow.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from tierkv import protocol as p
from tierkv.server.service import CacheService

Conn = TypeVar("Conn")

MAX_HELD = 4096  # queries one connection has filed at most (until their waits end)


class HeldQuery(Generic[Conn]):
    """One held QUERY_PREFETCH: its connection and the request (when its wait ends is the
    key it is filed under)."""

    __slots__ = ("_answered", "_lock", "conn", "req")

    def __init__(self, conn: Conn, req: p.QueryPrefetch) -> None:
        self.conn = conn
        self.req = req
        self._answered = False
        self._lock = threading.Lock()

    @property
    def answered(self) -> bool:
        return self._answered

    def claim(self) -> bool:
        """True for the one caller that answers it (the prefetch's end or the wait's)."""
        with self._lock:
            if self._answered:
                return False
            self._answered = True
            return True


class HeldQueries(Generic[Conn]):
    """The held queries of one RPC loop. :meth:`hold` and :meth:`expire` run on the loop's
    thread; ``send_later(conn, reply)`` must be safe from any thread (it hands the reply to
    the loop)."""

    def __init__(
        self,
        service: CacheService,
        send_later: Callable[[Conn, Any], None],
        clock: Callable[[], float],
    ) -> None:
        self.service = service
        self.send_later = send_later
        self.clock = clock
        self._heap: list[tuple[float, int, HeldQuery[Conn]]] = []  # the loop's thread only
        self._filed: dict[Conn, int] = {}  # queries in the heap, by connection (likewise)
        # Queries in the heap answered already (as their prefetch landed, on tier threads).
        self._answered = 0
        self._answered_lock = threading.Lock()
        self._order = itertools.count()

    def hold(self, conn: Conn, req: p.QueryPrefetch) -> Any | None:
        """The reply to send now (an error, a prefetch that is done, ``wait_ms`` 0), or None
        when the reply is held."""
        reply = self.service.handle(req)
        if req.wait_ms <= 0 or not isinstance(reply, p.PrefetchStatus) or reply.done:
            return reply
        filed = self._filed.get(conn, 0)
        if filed >= MAX_HELD:
            # Queries answered already stay filed until due: dropped when they are half the
            # heap at least (a pass over it each time cost a capped client's every query).
            if 2 * self._answered >= len(self._heap):
                filed = self._prune(conn)
            if filed >= MAX_HELD:
                return reply
        waits_until = self.clock() + req.wait_ms / 1000
        held = HeldQuery(conn, req)
        over_by = self.service.watch_prefetch(req, lambda: self._landed(held))
        if over_by is None:  # it ended between the reply above and the watch
            held.claim()
            return self.service.reply_to(req)
        heapq.heappush(self._heap, (min(waits_until, over_by), next(self._order), held))
        self._filed[conn] = filed + 1
        return None

    def _prune(self, conn: Conn) -> int:
        """Drop the queries answered already from the heap; how many ``conn`` has left."""
        with self._answered_lock:  # (one answered meanwhile is counted once it is gone)
            kept = [item for item in self._heap if not item[2].answered]
            self._answered -= len(self._heap) - len(kept)
        heapq.heapify(kept)
        self._heap = kept
        self._filed = {}
        for _, _, held in kept:
            self._filed[held.conn] = self._filed.get(held.conn, 0) + 1
        return self._filed.get(conn, 0)

    def _landed(self, held: HeldQuery[Conn]) -> None:
        """On the tier thread that finished one of the lookup's prefetches: answer if the
        lookup's progress is final now (a group's other ranks may still be loading). A query
        answered already (its wait ran out) costs nothing more."""
        if held.answered:
            return
        reply = self.service.reply_to(held.req)
        if isinstance(reply, p.PrefetchStatus) and not reply.done:
            return
        if held.claim():
            with self._answered_lock:
                self._answered += 1
            self.send_later(held.conn, reply)

    def expire(self) -> list[tuple[Conn, Any]]:
        """The (connection, reply) of every query whose wait has run out: its progress now."""
        now, due = self.clock(), []
        while self._heap and self._heap[0][0] <= now:
            _, _, held = heapq.heappop(self._heap)
            left = self._filed.pop(held.conn) - 1
            if left:
                self._filed[held.conn] = left
            if held.claim():
                due.append((held.conn, self.service.reply_to(held.req)))
            else:
                with self._answered_lock:
                    self._answered -= 1
        return due

    def timeout(self, longest: float) -> float:
        """How long the loop may wait for events: ``longest``, or less if a wait ends
        sooner."""
        if not self._heap:
            return longest
        return max(0.0, min(longest, self._heap[0][0] - self.clock()))
