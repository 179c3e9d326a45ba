"""One group of a prefetch (consecutive chunks loaded from one tier), committed as it lands.

The group is reserved in spans of about ``1/SPANS`` of its chunks, each span a write
reservation of its own. The tier reports each chunk as it lands intact
(``Tier.load_verified``'s ``landed``, on its transfer threads); once every chunk up to a
span's end is in place (landed, or in the pool already), the span is committed: the pool
offers its chunks from then on, and ``on_prefix(n)`` hears of the group's new intact prefix
(the prefetcher read-locks it for the lookup, so that the engine can copy those chunks out
while the rest are still on the way). :meth:`GroupLanding.settle`, once the load has
returned, commits what is intact of the spans still open and aborts the rest: the outcome
is that of a group committed in one piece, reached sooner. A span is committed only when
every chunk before its end is intact, so a failure later in the group never takes back a
chunk the pool already offers.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tierkv.index import CommitResult, Holder, ObjectIndex
from tierkv.pool import ShmPool

log = logging.getLogger(__name__)

SPANS = 16  # a group is reserved, and committed while it lands, in at most this many spans


@dataclass(slots=True)
class _Span:
    end: int  # one past its last chunk (a position in the group)
    lease: int  # its write reservation (0: it reserved nothing)
    positions: list[int]  # the group position of each slot it reserved, in lease order
    committed: bool = False


class GroupLanding:
    """The reservation, the landing and the commits of one group's chunks."""

    def __init__(
        self,
        index: ObjectIndex,
        keys: Sequence[bytes],
        on_prefix: Callable[[int], None],
    ) -> None:
        self.index = index
        self.keys = keys
        self.on_prefix = on_prefix
        self.stop = len(keys)  # the first chunk that found no room (len(keys): none)
        self.reserved: list[tuple[int, int, int]] = []  # (group position, offset, length)
        self.committed_keys: list[bytes] = []
        self.committed_bytes = 0
        self._spans: list[_Span] = []
        self._in_place: list[bool] = []
        self._item_position: list[int] = []  # load item -> group position
        self._intact = 0  # leading chunks in place
        self._open = 0  # the first span not committed
        self._broken = False  # a commit failed while landing: settle decides
        self._lock = threading.Lock()

    # -- before the load -------------------------------------------------------------------
    def reserve(
        self, pool: ShmPool, lengths: Sequence[int], tier: str
    ) -> list[tuple[bytes, memoryview]]:
        """Reserve the group's slots span by span, up to the first chunk that does not fit;
        returns the (key, slot view) items to load, in group order."""
        keys, n = self.keys, len(self.keys)
        size = max(1, math.ceil(n / SPANS))
        for start in range(0, n, size):
            end = min(n, start + size)
            res = self.index.reserve_write(
                keys[start:end], lengths[start:end], Holder.PREFETCH, tier=tier
            )
            positions = [start + i for i, _, _ in res.slots]
            self._spans.append(_Span(end, res.lease_id, positions))
            self.reserved += [(start + i, off, length) for i, off, length in res.slots]
            if res.no_space:
                self.stop = start + res.no_space[0]
                break
        loaded = {p for p, _, _ in self.reserved if p < self.stop}
        self._in_place = [p < self.stop and p not in loaded for p in range(n)]
        self._item_position = [p for p, _, _ in self.reserved if p < self.stop]
        prefix = self._advance()  # chunks the pool has may make a prefix already
        if prefix:
            self.on_prefix(prefix)
        return [(keys[p], pool.view(off, n)) for p, off, n in self.reserved if p < self.stop]

    # -- while it loads --------------------------------------------------------------------
    def landed(self, item: int) -> None:
        """On a transfer thread: load item ``item`` is in its slot, verified."""
        try:
            with self._lock:
                self._in_place[self._item_position[item]] = True
                prefix = self._advance()
            if prefix:
                self.on_prefix(prefix)
        except Exception:  # never into the transfer
            log.exception("committing a landed span failed")
            self._broken = True

    def _advance(self) -> int:
        """Commit the spans the intact prefix now covers (under ``_lock``, or before the
        load starts); returns the group's committed prefix if it grew, else 0."""
        while self._intact < self.stop and self._in_place[self._intact]:
            self._intact += 1
        grew = 0
        while not self._broken and self._open < len(self._spans):
            span = self._spans[self._open]
            if span.end > self._intact:
                break
            self._commit(span, None)
            self._open += 1
            grew = span.end
        return grew

    def _commit(self, span: _Span, only: list[int] | None) -> None:
        span.committed = True
        if not span.lease:
            return
        result: CommitResult = self.index.commit(span.lease, Holder.PREFETCH, only)
        self.committed_keys += result.committed_keys
        self.committed_bytes += result.committed_bytes

    # -- after the load --------------------------------------------------------------------
    def settle(self, prefix: int) -> None:
        """The load has returned and the group's intact prefix is ``prefix`` chunks: commit
        those of the open spans, abort the rest (raises what the index raises)."""
        with self._lock:
            for span in self._spans:
                if not span.committed:
                    self._commit(span, [k for k, p in enumerate(span.positions) if p < prefix])
