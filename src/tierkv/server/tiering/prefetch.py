"""Prefetch: on LOOKUP, load the chunks that follow the pool's hit prefix from the tiers.

A job runs on a tier thread: it asks the pool which of the following chunks it already has
ready (a chunk after the first miss may be there: not yet written to any tier, or dropped by
one), then the tiers, in configured order, about the rest, and takes the longest contiguous
run of chunks found somewhere (each from the pool if it is there, else from the first tier
that has it). It reserves pool slots for the run's tier chunks, loads the bytes straight
into them, verifies them (the tiers check checksums), commits the ones that arrived intact
and read-locks the prefix (pool chunks included) for the engine under the lookup's lease.
The first chunk that is missing, does not fit, or fails to load ends the prefix there: the
engine gets fewer hits, never wrong bytes. A chunk found nowhere because a tier failed to
answer whether it holds it (:meth:`Tier.presence` gave None) ends it as an ``error``, not
as a chunk known to be absent.

At most ``max_inflight`` jobs run at once (a lookup beyond that just skips the prefetch), and
a job that takes longer than ``timeout`` is reported to the engine as finished with what the
pool had; when it completes later its chunks stay in the pool, unlocked, for the next lookup.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tierkv.index import Holder, LeaseNotFound, ObjectIndex
from tierkv.pool import ShmPool
from tierkv.priority import moving_data
from tierkv.tiers.base import LoadStatus, Tier
from tierkv.workers import Submit

log = logging.getLogger(__name__)

_NOWHERE = object()  # a chunk neither the pool nor any tier holds

Verified = tuple[bytes, bytes, int]  # (key, checksum verified on the way in, length)


@dataclass
class PrefetchStats:
    started: int = 0
    rejected: int = 0  # too many in flight
    timed_out: int = 0
    loaded_chunks: dict[str, int] = field(default_factory=dict)
    loaded_bytes: dict[str, int] = field(default_factory=dict)
    failed: dict[str, dict[str, int]] = field(default_factory=dict)  # tier -> reason -> n
    inflight: int = 0


class PrefetchJob:
    """One lookup's prefetch. ``hits`` is final once ``done`` is set.

    ``into_lease`` is the lookup's own read lease (0 if it locked nothing): loaded chunks
    are locked into it. ``lease_id`` is a lease the job *created* because the lookup had
    none; it is 0 when the locks went into ``into_lease`` or nothing was locked, so a
    completion callback never mistakes the lookup's lease (which a retrieve may be using
    by then) for one it has to hand over or give back.
    """

    def __init__(
        self,
        first: int,
        deadline: float,
        on_done: Callable[[PrefetchJob], None] | None,
        into_lease: int = 0,
    ) -> None:
        self.first = first
        self.on_done = on_done
        self.deadline = deadline
        self.loaded = 0
        # The prefix the job found in the pool once it had loaded what it could, cancelled
        # or not: chunks it brought in stay in the pool even if nobody waits for them.
        self.found = 0
        self.into_lease = into_lease
        self.lease_id = 0
        self.done = threading.Event()
        self.cancelled = False
        # For lookup accounting: where each chunk of the loaded prefix came from (a tier's
        # name, or "pool" if it was there already), and why the prefix ended early when the
        # job knows ("corrupt", "error", "expired"; "" otherwise).
        self.sources: list[str] = []
        self.miss_reason = ""
        self._watchers: list[Callable[[], None]] = []
        self._watch_lock = threading.Lock()

    @property
    def hits(self) -> int:
        return self.first + self.loaded

    def watch(self, callback: Callable[[], None]) -> bool:
        """Call ``callback()`` (on the tier thread) once the job is done; False, and no
        call, if it is done already."""
        with self._watch_lock:
            if self.done.is_set():
                return False
            self._watchers.append(callback)
            return True

    def finish(self) -> None:
        """Mark the job done and call its watchers."""
        with self._watch_lock:
            self.done.set()
            watchers, self._watchers = self._watchers, []
        for callback in watchers:
            try:
                callback()
            except Exception:
                log.exception("prefetch watcher failed")


class Prefetcher:
    def __init__(
        self,
        index: ObjectIndex,
        pool: ShmPool,
        tiers: Sequence[Tier],
        executor: Submit,
        max_inflight: int,
        timeout: float,
        on_committed: Callable[[Tier, list[bytes], list[Verified]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        on_reserved: Callable[[], None] | None = None,
    ) -> None:
        self.index = index
        self.pool = pool
        self.tiers = list(tiers)
        self.executor = executor
        self.max_inflight = max_inflight
        self.timeout = timeout
        self.on_committed = on_committed
        self.on_reserved = on_reserved  # e.g. wake the eviction thread: the pool just filled
        self.clock = clock
        self.stats = PrefetchStats()
        self._lock = threading.Lock()
        self._loading: dict[bytes, PrefetchJob] = {}  # key -> the job bringing it in

    def start(
        self,
        holder: int,
        keys: Sequence[bytes],
        lengths: Sequence[int],
        first: int,
        lease_id: int,
        on_done: Callable[[PrefetchJob], None] | None = None,
    ) -> PrefetchJob | None:
        """Prefetch ``keys[first:]`` for ``holder``, locking into ``lease_id`` (0: a new
        lease). ``on_done(job)`` runs on the tier thread just before ``job.done`` is set.
        None when there is nothing to do or too much in flight."""
        if not self.tiers or first >= len(keys):
            return None
        with self._lock:
            if self.stats.inflight >= self.max_inflight:
                self.stats.rejected += 1
                return None
            self.stats.inflight += 1
            self.stats.started += 1
        job = PrefetchJob(first, self.clock() + self.timeout, on_done, lease_id)
        self.executor.submit(self._run, job, holder, keys, list(lengths))
        return job

    def poll(self, job: PrefetchJob) -> bool:
        """Whether the engine should treat the job as finished (done, or past its deadline)."""
        if job.done.is_set():
            return True
        if self.clock() >= job.deadline:
            with self._lock:
                if not job.cancelled:
                    job.cancelled = True
                    self.stats.timed_out += 1
            return True
        return False

    # -- the job ---------------------------------------------------------------------------
    def _run(
        self, job: PrefetchJob, holder: int, lazy_keys: Sequence[bytes], lengths: list[int]
    ) -> None:
        claimed: list[bytes] = []
        try:
            head = self._first_chunk(lazy_keys[job.first], job)
            if head is _NOWHERE:
                return  # the usual miss, a new prompt: its other keys are never hashed
            keys = list(lazy_keys)
            # Chunks another job is already loading (concurrent lookups of one prefix) are
            # awaited, not loaded twice; jobs only wait for older jobs, so never in a cycle.
            claimed, older = self._claim(keys[job.first :], job)
            for other in older:
                other.done.wait(max(0.0, job.deadline - self.clock()))
            run, unchecked = self._locate(
                keys[job.first :], head if isinstance(head, Tier) else None
            )
            loaded = job.found = self._load(keys, lengths, job.first, run, job)
            if unchecked and loaded == len(run):
                job.miss_reason = "error"  # the prefix ended at a chunk no tier could check
            if loaded and not job.cancelled:
                want = keys[job.first : job.first + loaded]
                lock = self.index.lock_read(want, holder, prefix=True, into_lease=job.into_lease)
                job.lease_id = 0 if job.into_lease else lock.lease_id
                job.loaded = len(lock.slots)
        except LeaseNotFound:
            job.miss_reason = "expired"
            log.debug("lookup lease ended before its prefetch finished")
        except Exception:
            job.miss_reason = "error"
            log.exception("prefetch failed")
        finally:
            with self._lock:
                self.stats.inflight -= 1
                for key in claimed:
                    if self._loading.get(key) is job:
                        del self._loading[key]
            if job.on_done is not None:
                try:
                    job.on_done(job)
                except Exception:
                    log.exception("prefetch completion callback failed")
            job.finish()

    def _first_chunk(self, key: bytes, job: PrefetchJob) -> Tier | object | None:
        """Where ``key``, the first chunk the lookup lacked, is: the first tier that has it,
        None if the pool has it now (stored since the lookup), or :data:`_NOWHERE` (then
        ``job.miss_reason`` is "error" if a tier could not tell). A prefetch that finds it
        nowhere ends there, without hashing the lookup's other keys."""
        if self.index.contains([key])[0]:
            return None
        found: list[Tier | None] = [None]
        unchecked: set[int] = set()
        if not self._ask_tiers([key], [0], found, unchecked):
            return found[0]
        if unchecked:
            job.miss_reason = "error"
        return _NOWHERE

    def _claim(self, keys: list[bytes], job: PrefetchJob) -> tuple[list[bytes], list[PrefetchJob]]:
        claimed: list[bytes] = []
        older: dict[int, PrefetchJob] = {}
        with self._lock:
            for key in keys:
                other = self._loading.get(key)
                if other is None:
                    self._loading[key] = job
                    claimed.append(key)
                elif other is not job:
                    older[id(other)] = other
        return claimed, list(older.values())

    def _locate(self, keys: list[bytes], head: Tier | None) -> tuple[list[Tier | None], bool]:
        """For the longest run of ``keys`` that the pool or some tier holds: None for a
        chunk ready in the pool (no tier is asked about it), else the tier to load it from;
        and whether the run ends at a chunk that some tier failed to check (the tier is
        down, not the chunk known absent). ``head``: the tier :meth:`_first_chunk` found
        ``keys[0]`` in (None: it asked none, the pool had it).

        The tiers are asked about the first chunk the pool lacks on its own, and about the
        others only if some tier has it: a run ends at the first chunk found nowhere, so a
        lookup of a new prompt (the usual miss) costs the tiers one key, not all of them
        (for the peer tier, a directory resolution of every key of a long prompt)."""
        found: list[Tier | None] = [None] * len(keys)
        in_pool = self.index.contains(keys)  # LRU untouched
        pending = [i for i, ready in enumerate(in_pool) if not ready]
        unchecked: set[int] = set()
        if pending and pending[0] == 0 and head is not None:
            found[0] = head  # asked already
            pending = pending[1:]
            missing = []
        else:
            missing = self._ask_tiers(keys, pending[:1], found, unchecked)
            pending = pending[1:]
        if not missing:
            missing = self._ask_tiers(keys, pending, found, unchecked)
        end = missing[0] if missing else len(keys)  # the first chunk found nowhere
        return found[:end], end in unchecked

    def _ask_tiers(
        self, keys: list[bytes], pending: list[int], found: list[Tier | None], unchecked: set[int]
    ) -> list[int]:
        """Ask the tiers, fastest first, where ``keys[i]`` (i in ``pending``) are: each one
        found goes into ``found``; returns those found nowhere (adding to ``unchecked`` the
        ones some tier could not check)."""
        for tier in self.tiers:
            if not pending:
                break
            try:
                present = tier.presence([keys[i] for i in pending])
            except Exception as exc:  # a tier should report failures, not raise them
                tier.outage.failed("contains", exc, len(pending), exc_info=True)
                present = [None] * len(pending)
            still: list[int] = []
            for i, has in zip(pending, present, strict=True):
                if has:
                    found[i] = tier
                else:
                    still.append(i)
                    if has is None:
                        unchecked.add(i)
            pending = still
        return pending

    def _load(
        self,
        keys: list[bytes],
        lengths: list[int],
        first: int,
        run: list[Tier | None],
        job: PrefetchJob,
    ) -> int:
        """Load the run (see :meth:`_locate`) into the pool; returns the length of the
        prefix now in the pool. Each group is the chunks of one tier with the pool's chunks
        among and before them, loaded in one batch."""
        done = 0
        pos = 0
        while pos < len(run):
            tier: Tier | None = None
            end = pos
            while end < len(run) and (run[end] is None or tier is None or run[end] is tier):
                if tier is None:
                    tier = run[end]
                end += 1
            if tier is None:  # only chunks the pool has: the final lock_read checks them
                got = end - pos
                job.sources.extend(["pool"] * got)
            else:
                got = self._load_group(
                    tier, keys[first + pos : first + end], lengths[first + pos : first + end], job
                )
            done += got
            if got < end - pos:
                break
            pos = end
        return done

    def _load_group(
        self, tier: Tier, keys: list[bytes], lengths: list[int], job: PrefetchJob
    ) -> int:
        """Load consecutive chunks from one tier; returns the intact prefix length. Chunks
        the pool has (reserve_write reports them present) are not loaded and count as the
        pool's; one that left the pool since it was located gets a slot and is asked of the
        tier like the others (if the tier lacks it, it ends the prefix as a miss)."""
        res = self.index.reserve_write(keys, lengths, Holder.PREFETCH, tier=tier.name)
        if self.on_reserved is not None:
            self.on_reserved()
        stop = res.no_space[0] if res.no_space else len(keys)
        reserved = [(i, off, n) for i, off, n in res.slots if i < stop]
        items = [(keys[i], self.pool.view(off, n)) for i, off, n in reserved]
        sums: dict[bytes, bytes] = {}
        try:
            with moving_data():
                statuses, sums = tier.load_verified(items) if items else ([], {})
        except Exception as exc:  # a tier should report failures, not raise them
            tier.outage.failed("load", exc, len(items), exc_info=True)
            statuses = [LoadStatus.ERROR] * len(items)
        if len(statuses) != len(items):  # a broken tier: never leave the slots reserved
            tier.outage.failed("load", f"answered {len(statuses)} of the loads", len(items))
            statuses = [LoadStatus.ERROR] * len(items)
        del items
        # The intact prefix: present-in-pool chunks count, the first failure ends it.
        status_of = {i: st for (i, _, _), st in zip(reserved, statuses, strict=True)}
        prefix = 0
        for i in range(stop):
            st = status_of.get(i, LoadStatus.OK)  # not reserved = already in the pool
            if st is not LoadStatus.OK:
                self._count_failure(tier.name, st)
                if st is not LoadStatus.MISSING:
                    job.miss_reason = st.name.lower()
                break
            prefix += 1
            job.sources.append(tier.name if i in status_of else "pool")
        if prefix == stop < len(keys):
            job.miss_reason = "error"  # no room in the pool to load the rest into
        commit_pos = [p for p, (i, _, _) in enumerate(reserved) if i < prefix]
        nbytes = sum(reserved[p][2] for p in commit_pos)
        if res.lease_id:
            result = self.index.commit(res.lease_id, Holder.PREFETCH, commit_pos)
            if self.on_committed and result.committed_keys:
                length_of = {keys[i]: n for i, _, n in reserved}
                verified = [
                    (key, sums[key], length_of[key]) for key in result.committed_keys if key in sums
                ]
                self.on_committed(tier, result.committed_keys, verified)
        with self._lock:
            s = self.stats
            s.loaded_chunks[tier.name] = s.loaded_chunks.get(tier.name, 0) + len(commit_pos)
            s.loaded_bytes[tier.name] = s.loaded_bytes.get(tier.name, 0) + nbytes
        return prefix

    def _count_failure(self, tier: str, status: LoadStatus) -> None:
        with self._lock:
            reasons = self.stats.failed.setdefault(tier, {})
            name = status.name.lower()
            reasons[name] = reasons.get(name, 0) + 1
