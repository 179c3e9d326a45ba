"""Lookup sessions: what a LOOKUP locked, for the PREPARE_RETRIEVE that follows.

A session is keyed by (client token, request id). It holds the read lease over the pool's
hit prefix, the number of hits the engine was told, and the prefetch from the tiers if one
runs. Its life:

- ``open``: lock the hit prefix, start the prefetch of the rest (the lookup's outcome is
  counted now, or by the prefetch when it finishes);
- ``query``: has the prefetch finished (or timed out)? Its locks are folded into the session
  and the engine is told the new hit count (``watch`` calls back when it finishes, for a
  query whose reply waits for that);
- ``take``: PREPARE_RETRIEVE takes the session over with its lease (ended by
  FINISH_RETRIEVE); a prefetch landing later gives back whatever lease it made;
- ``drop``: END_SESSION, FREE_LOOKUP_LOCKS, a new lookup under the same request id, the
  client's unregistration: the locks are released;
- ``expire``: sessions idle for ``ttl`` seconds are dropped; past :data:`MAX_SESSIONS` open
  sessions of one client, its oldest are dropped as it opens more.

A scheduler's lookup opens a *group* session: one session per tensor-parallel rank, each
held by that rank's client (the rank retrieves by request id as if it had looked up itself),
answered with the smallest hit count. Thread-safe: prefetches finish on tier threads.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tierkv.index import LeaseNotFound, ObjectIndex
from tierkv.server.metrics import POOL
from tierkv.server.tiering import Tiering
from tierkv.server.tiering.lookups import LookupAccounting
from tierkv.server.tiering.prefetch import PrefetchJob

log = logging.getLogger(__name__)

# Open lookup sessions of one client at most (a scheduler's group sessions and a worker's
# own, each). An engine that never ends its lookups would otherwise grow the server's
# memory with its request rate for a whole session TTL.
MAX_SESSIONS = 16384


@dataclass(slots=True)
class Session:
    """One client's lookup, until its retrieve."""

    lease: int  # read lease over the locked prefix (0: none)
    available: int  # leading chunks locked under ``lease`` (grows when a prefetch lands)
    hits: int  # what the engine was told: a retrieve offers at most this many
    total: int
    touched: float
    prefetch: PrefetchJob | None = None
    handed_out: bool = False  # PREPARE_RETRIEVE took the lease
    # Where the chunks after the pool's hit prefix (``first``) came from, once a prefetch
    # landed: a tier's name, or "pool" for one the pool had by then.
    first: int = 0
    prefetched: tuple[str, ...] = ()
    scheduler: int = 0  # the scheduler whose group lookup this is a rank's part of (0: none)

    def source(self, position: int) -> str:
        """Where the hit chunk at ``position`` came from."""
        i = position - self.first
        return self.prefetched[i] if 0 <= i < len(self.prefetched) else POOL


@dataclass(slots=True)
class GroupSession:
    """A scheduler's lookup: one session per rank, each held by that rank's client."""

    members: list[tuple[int, Session]]  # (the rank's client token, its session)
    total: int
    touched: float


@dataclass(frozen=True, slots=True)
class Progress:
    """What QUERY_PREFETCH answers: whether the lookup is settled, and its hit count."""

    done: bool
    hits: int
    sources: tuple[tuple[str, int], ...] = ()  # (where, chunks) runs over the hits, once done


class LookupSessions:
    """The open lookup sessions of every client of one server."""

    def __init__(
        self,
        index: ObjectIndex,
        tiering: Tiering,
        lookups: LookupAccounting,
        clock: Callable[[], float],
        ttl: float,
    ) -> None:
        self.index = index
        self.tiering = tiering
        self.lookups = lookups
        self.clock = clock
        self.ttl = ttl
        self.max_sessions = MAX_SESSIONS
        self.ended_over_limit = 0  # sessions dropped because their client opened too many
        self._warned: set[int] = set()  # clients told so in the log
        self._lock = threading.Lock()
        self._single: dict[int, dict[str, Session]] = {}  # holder -> request id -> session
        self._groups: dict[int, dict[str, GroupSession]] = {}  # scheduler -> request id -> ..

    # -- opening ---------------------------------------------------------------------------
    def open(
        self,
        holder: int,
        request_id: str,
        keys: Sequence[bytes],
        lengths: list[int],
        on_found: Callable[[], None] | None = None,
    ) -> Session:
        """Replace any session of ``request_id``: lock the pool's hit prefix for ``holder``
        and start the prefetch of the rest; ``on_found`` is called (on a tier thread) if
        the prefetch brings chunks in."""
        self.drop(holder, request_id)
        self._make_room(holder)
        return self._open(holder, request_id, keys, lengths, on_found)

    def open_group(
        self,
        scheduler: int,
        request_id: str,
        ranks: Sequence[tuple[int, Sequence[bytes], list[int]]],
        on_found: Callable[[], None] | None = None,
    ) -> tuple[int, int, bool]:
        """A scheduler's lookup over its engine's ranks, each (token, keys, lengths):
        returns (hits, total, prefetching); ``on_found`` as for :meth:`open`."""
        self.drop(scheduler, request_id)
        self._make_room(scheduler)
        members: list[tuple[int, Session]] = []
        for token, keys, lengths in ranks:
            self.drop(token, request_id)
            self._make_room(token)
            members.append((token, self._open(token, request_id, keys, lengths, on_found)))
        hits = min(session.available for _, session in members)
        prefetching = False
        with self._lock:
            for _, session in members:
                session.hits = hits
                session.scheduler = scheduler
                prefetching |= session.prefetch is not None
            group = GroupSession(members, members[0][1].total, self.clock())
            self._groups.setdefault(scheduler, {})[request_id] = group
        return hits, group.total, prefetching

    def _make_room(self, holder: int) -> None:
        """Drop ``holder``'s oldest sessions while it has :attr:`max_sessions` or more (one
        is about to open)."""
        with self._lock:
            groups, singles = self._groups.get(holder, {}), self._single.get(holder, {})
            over = len(groups) + len(singles) + 1 - self.max_sessions
            if over <= 0:
                return
            oldest = [
                *((rid, 0) for rid in itertools.islice(groups, over)),
                *((rid, singles[rid].scheduler) for rid in itertools.islice(singles, over)),
            ][:over]
            self.ended_over_limit += len(oldest)
            first = holder not in self._warned
            self._warned.add(holder)
        if first:
            log.warning(
                "client %d holds %d open lookup sessions: its oldest are ended as it opens "
                "more (does the engine end its lookups?)",
                holder,
                self.max_sessions,
            )
        for request_id, scheduler in oldest:
            # A rank's part of a group lookup ends the whole group (a group whose rank
            # could no longer retrieve would still answer its full hit count).
            if scheduler:
                self.drop(scheduler, request_id)
            self.drop(holder, request_id)

    def _open(
        self,
        holder: int,
        request_id: str,
        keys: Sequence[bytes],
        lengths: list[int],
        on_found: Callable[[], None] | None = None,
    ) -> Session:
        lock = self.index.lock_read(keys, holder, prefix=True)
        hits = len(lock.slots)
        session = Session(lock.lease_id, hits, hits, len(keys), self.clock(), first=hits)
        with self._lock:
            self._single.setdefault(holder, {})[request_id] = session
        if hits < len(keys) and self.tiering.enabled:
            session.prefetch = self.tiering.prefetch(
                holder,
                keys,
                lengths,
                hits,
                lock.lease_id,
                lambda job: self._prefetch_done(holder, request_id, session, job, on_found),
            )
        else:
            self.lookups.record(keys, hits)  # with a prefetch, the tiering counts it when done
        return session

    def _prefetch_done(
        self,
        holder: int,
        request_id: str,
        session: Session,
        job: PrefetchJob,
        on_found: Callable[[], None] | None = None,
    ) -> None:
        """On a tier thread: hand a lease the prefetch created to its session, or give it
        back if nobody can use it any more (session ended, retrieved or timed out); then
        ``on_found()`` if it found chunks (brought them into the pool, where they stay even
        when nobody waited for them)."""
        try:
            self._hand_over(holder, request_id, session, job)
        finally:
            if on_found is not None and job.found:
                on_found()

    def _hand_over(self, holder: int, request_id: str, session: Session, job: PrefetchJob) -> None:
        new_lease = job.lease_id if job.lease_id != session.lease else 0
        if not new_lease:
            return  # nothing locked, or locks added to the session's own lease
        with self._lock:
            attach = (
                self._single.get(holder, {}).get(request_id) is session
                and session.lease == 0
                and not session.handed_out
                and not job.cancelled
            )
            if attach:
                session.lease = new_lease
        if not attach:
            with contextlib.suppress(LeaseNotFound):
                self.index.release_read(new_lease, holder)

    # -- progress and hand-over --------------------------------------------------------------
    def query(self, holder: int, request_id: str) -> Progress | None:
        """Settle the session's prefetch if it is over; None if there is no such session."""
        now = self.clock()
        with self._lock:
            group, members = self._members_locked(holder, request_id)
            if not members:
                return None
            if group is not None:
                group.touched = now
            for session in members:
                session.touched = now
        done = all([self._settle(session) for session in members])  # settle every member
        with self._lock:
            if not done:
                return Progress(False, min(m.hits for m in members))
            hits = min(m.available for m in members)
            for session in members:
                if not session.handed_out:
                    session.hits = hits
        return Progress(True, hits, _source_runs(members, hits))

    def watch(self, holder: int, request_id: str, wake: Callable[[], None]) -> float | None:
        """Call ``wake()`` (on a tier thread) each time a prefetch of the session (a group's:
        any rank's) finishes; returns the latest time by which every one of them is over
        (their deadlines), or None if none is running (the session's progress is final, or
        there is no such session)."""
        with self._lock:
            _, members = self._members_locked(holder, request_id)
            jobs = [m.prefetch for m in members if m.prefetch is not None]
        watched = [job.deadline for job in jobs if job.watch(wake)]
        return max(watched) if watched else None

    def _members_locked(
        self, holder: int, request_id: str
    ) -> tuple[GroupSession | None, list[Session]]:
        """The lookup's group session (a scheduler's) if it is one, and its sessions (none
        if there is no such lookup). Under ``_lock``."""
        group = self._groups.get(holder, {}).get(request_id)
        if group is not None:
            return group, [session for _, session in group.members]
        single = self._single.get(holder, {}).get(request_id)
        return None, [] if single is None else [single]

    def _settle(self, session: Session) -> bool:
        """Whether the session's prefetch is over; folds its result into ``available``."""
        job = session.prefetch
        if job is None:
            return True
        if not self.tiering.prefetcher.poll(job):
            return False
        with self._lock:
            if job.done.is_set() and not job.cancelled and not session.handed_out:
                session.available = max(session.available, job.hits)
                session.prefetched = tuple(job.sources[: job.loaded])
            session.prefetch = None
        return True

    def take(self, holder: int, request_id: str) -> tuple[int, Session] | None:
        """PREPARE_RETRIEVE: remove the session and hand over its lease (the retrieve's
        FINISH ends it); None if there is no such session."""
        with self._lock:
            session = self._single.get(holder, {}).pop(request_id, None)
            if session is None:
                return None
            lease, session.lease = session.lease, 0
            session.handed_out = True
        return lease, session

    # -- ending ----------------------------------------------------------------------------
    def drop(self, holder: int, request_id: str) -> int:
        """End a lookup session (a scheduler's: every rank's); returns locks released."""
        with self._lock:
            members: list[tuple[int, Session]] = []
            session = self._single.get(holder, {}).pop(request_id, None)
            if session is not None:
                members.append((holder, session))
            group = self._groups.get(holder, {}).pop(request_id, None)
            if group is not None:
                # A rank's session may already have been replaced or dropped by the rank.
                for token, member in group.members:
                    ranks = self._single.get(token, {})
                    if ranks.get(request_id) is member:
                        del ranks[request_id]
                        members.append((token, member))
        released = 0
        for owner, member in members:
            if member.lease:
                with contextlib.suppress(LeaseNotFound):
                    released += self.index.release_read(member.lease, owner)
        return released

    def drop_holder(self, holder: int) -> int:
        """End every session of a client that goes away; returns locks released."""
        with self._lock:
            request_ids = {*self._single.get(holder, {}), *self._groups.get(holder, {})}
        released = sum(self.drop(holder, rid) for rid in request_ids)
        with self._lock:
            self._single.pop(holder, None)
            self._groups.pop(holder, None)
            self._warned.discard(holder)
        return released

    def expire(self) -> int:
        """Drop sessions idle for longer than ``ttl``; returns how many."""
        cutoff = self.clock() - self.ttl
        with self._lock:
            stale = [
                (holder, rid)
                for table in (self._single, self._groups)
                for holder, sessions in table.items()
                for rid, s in sessions.items()
                if s.touched < cutoff
            ]
        for holder, rid in stale:
            self.drop(holder, rid)
        return len(stale)

    # -- figures ---------------------------------------------------------------------------
    def count_of(self, holder: int) -> int:
        """Open sessions of one client (a scheduler's group session counts once)."""
        with self._lock:
            return len(self._single.get(holder, ())) + len(self._groups.get(holder, ()))

    def count(self) -> int:
        """Open sessions of every client, counted as :meth:`count_of` does."""
        with self._lock:
            return sum(map(len, self._single.values())) + sum(map(len, self._groups.values()))


def _source_runs(members: Sequence[Session], hits: int) -> tuple[tuple[str, int], ...]:
    """Where the first ``hits`` chunks came from, as (source, chunks) runs in order: for a
    group, a chunk any rank had to fetch counts under that rank's source."""
    if not hits:
        return ()
    if not any(session.prefetched for session in members):
        return ((POOL, hits),)
    runs: list[tuple[str, int]] = []
    for position in range(hits):
        where = POOL
        for session in members:
            found = session.source(position)
            if found != POOL:
                where = found
                break
        if runs and runs[-1][0] == where:
            runs[-1] = (where, runs[-1][1] + 1)
        else:
            runs.append((where, 1))
    return tuple(runs)
