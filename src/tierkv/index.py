"""The L1 object index: key -> slot in the pool, object states, TTL leases, LRU order.

An object is absent, then *writing* (reserved by a write lease, invisible to readers), then
*ready*; a ready object may be read-locked by any number of read leases. Every lock belongs
to a lease: a batch of slots taken by one holder (an engine connection) in one request, with
one deadline. Leases expire (write 600 s, read 300 s by default): an expired write lease
gives its objects up, an expired read lease or pin makes its objects evictable again. The
holder of an expired write lease or pin may still be using its slots (a stopped engine
resumed mid-copy; a prefetch's tier read or a write-behind's tier write that outlasted the
TTL), so their slots are *held*: kept back like fenced ones (below), still charged to their
tenant and holder, until the holder ends the lease (commit, abort or unpin: refused as
expired) or goes away; an engine's hold also ends once one write TTL more has passed (a
holder that lost its lease id: a reply that never came). The server's own holders (negative
ids) always end their leases, and their tier I/O may still be running: no timer for them.
Freeing them at the deadline let a late write land on another store's committed chunk, and
a late tier write store another chunk's bytes under this key with a valid checksum. An
engine's read lock is not held back like that: the reader checks after its copy that it
ended before the lease's deadline (:meth:`tierkv.client.api.Client.retrieve`). Leases are
kept in dicts in creation order (a renewed lease moves last), and a TTL is constant per kind,
so each dict is in deadline order and expiry only ever looks at the oldest leases.

Two kinds of read-side holds, with different effects on recency:

- A *read lock* (:meth:`ObjectIndex.lock_read`) is a use: an engine's lookup or retrieve,
  or a peer node fetching the chunk over the cluster data plane (a hit from anywhere in the
  cluster is demand for the chunk, and chunks promoted from disk for a peer become most
  recent on commit anyway). The object leaves the LRU while locked and goes back as the
  most recently used when its last read lock ends.
- A *pin* (:meth:`ObjectIndex.pin`) is not a use: a background holder (the write-behind,
  which also carries the cluster's publishing through the peer tier) that needs the bytes
  to stay put. A pinned object can be neither evicted nor freed, but keeps its place in
  the LRU, and unpinning does not move it: its recency stays "when it was last used", not
  "when a tier finished writing it".

Ready objects that no read lock holds sit in an insertion-ordered dict used as an LRU list
(pinned ones included); the evictable ones are those of them that no pin holds. A batch is
(re)inserted last chunk first, so within a prefix the last chunks are the least recently
used and are evicted before the first ones. Eviction scans from the oldest and steps over
pinned objects, so one pass costs O(pinned + evicted). Only the write-behind pins, from a
commit until the tiers have the chunks, so the pinned objects are its queue, bounded in
bytes by ``write_behind_max_bytes`` (chunks beyond it are dropped, not pinned): the extra
scanning is bounded by that queue's size, whatever the size of the pool.

A lease is over at its deadline: every call that takes a lease id first expires overdue
leases, so committing or releasing a lease after its deadline raises LeaseNotFound, whether
or not anything had reclaimed it yet (and lets go of an expired write lease's or pin's hold).

Deleting or clearing an object that is locked or pinned removes it from the key map at once
(new lookups miss) and frees its slot when the last lease on it ends, so a reader never sees
its slot reused under it.

A *fence* (:meth:`ObjectIndex.fence`) keeps slots from being reused while something outside
the index may still use them: a one-sided READ that passed its deadline and was given up,
whose bytes can still land (:mod:`tierkv.cluster.late_reads`), or the holder of an expired
write lease or pin (above). The objects' leases end as
usual; a fenced slot that the index frees stays allocated (``fenced_free``) until its last
fence is lifted (:meth:`ObjectIndex.unfence`).

Every public method takes the index lock once per batch; nothing in here does I/O.
"""

from __future__ import annotations

import enum
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import msgspec

from tierkv.allocator import Allocator
from tierkv.keys import DIGEST_SIZE
from tierkv.tenants import OTHER_ID, TenantFigures, TenantIds, TenantTally

Clock = Callable[[], float]

DEFAULT_WRITE_TTL = 600.0
DEFAULT_READ_TTL = 300.0


class Holder(enum.IntEnum):
    """The server's own lease holders. Engine clients hold leases under their registration
    token (always positive); these background holders use negative ids, so the two never
    collide."""

    WRITE_BEHIND = -1  # pins of chunks being written to the tiers
    PREFETCH = -2  # reservations of chunks loaded from the tiers
    PEER_SERVE = -3  # read locks of chunks a peer node is fetching
    PEER_PROMOTE = -4  # reservations of disk chunks promoted for a peer


class LeaseError(Exception):
    """A request that refers to leases or slots the caller does not hold."""


class LeaseNotFound(LeaseError):
    """The lease id is unknown: never issued, already ended, or expired."""


class LeaseNotOwned(LeaseError):
    """The lease belongs to another holder."""


class SlotPositionError(LeaseError, IndexError):
    """``commit(only=...)`` named positions outside the lease (also a builtin IndexError)."""


class State(enum.IntEnum):
    WRITING = 1
    READY = 2


class Entry(msgspec.Struct, eq=False, gc=False):
    """One object in the pool. Identity-hashed: a key can be re-stored while an old,
    deleted entry of the same key is still held by a lease. Not tracked by Python's cycle
    collector (``gc=False``: it holds no containers, so it can be in no cycle): a pool of a
    million chunks would otherwise add ~0.3 s to every full collection, a pause in which the
    RPC loop answers nothing."""

    key: bytes
    offset: int
    length: int
    state: State
    readers: int = 0  # read locks (uses): while > 0 the entry is out of the LRU
    pins: int = 0  # pins (background holds): the entry keeps its LRU place, not evictable
    live: bool = True  # False once deleted/cleared/evicted from the key map
    tier: str = ""  # where the bytes came from ("" = written by an engine)
    tenant: int = OTHER_ID  # the tenant its slot is charged to (see tierkv.tenants)
    note: bytes = b""  # the storing engine's description of the chunk (tierkv.server.chunk_feed)


@dataclass(eq=False, slots=True)
class Lease:
    id: int
    holder: int
    deadline: float
    entries: list[Entry]
    write: bool
    pin: bool = False  # a read-side lease of pins rather than read locks


@dataclass(slots=True)
class _Hold:
    """The slots of an expired write lease or pin, kept from reuse (and still charged to
    their tenants and holder) until its holder ends it or goes away; an engine's, also once
    one more write TTL has passed."""

    holder: int
    write: bool
    slots: list[tuple[int, int]]  # (offset, length)


@dataclass(slots=True)
class WriteReservation:
    """Result of :meth:`ObjectIndex.reserve_write`, per chunk of the request."""

    lease_id: int
    # (request index, offset, length) of every reserved chunk, in request order.
    slots: list[tuple[int, int, int]] = field(default_factory=list)
    present: list[int] = field(default_factory=list)  # already ready or being written
    # Of present: being written by another reservation (an engine's, not a load from a
    # tier): not stored until that one commits, and never if it aborts.
    writing: list[int] = field(default_factory=list)
    no_space: list[int] = field(default_factory=list)  # did not fit; skipped
    over_quota: list[int] = field(default_factory=list)  # of no_space: refused by a hard quota
    quota_exceeded: bool = False  # a tenant is now above its (soft) quota: evict soon


@dataclass(slots=True)
class ReadLock:
    """Result of :meth:`ObjectIndex.lock_read`."""

    lease_id: int
    # (request index, offset, length) of every locked chunk, in request order.
    slots: list[tuple[int, int, int]] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)


@dataclass(slots=True)
class CommitResult:
    committed: int = 0
    aborted: int = 0
    cleared: int = 0  # reserved slots whose key was deleted meanwhile: freed, not committed
    committed_keys: list[bytes] = field(default_factory=list)
    committed_lengths: list[int] = field(default_factory=list)
    committed_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Evicted:
    key: bytes
    length: int
    tier: str


@dataclass(frozen=True, slots=True)
class IndexStats:
    capacity: int
    used: int
    largest_free: int
    objects: int
    writing: int
    ready: int
    read_locked: int  # ready but not evictable: held by a read lock or a pin
    pinned: int  # ready objects held by a pin (some may also be read-locked)
    evictable: int
    zombies: int  # deleted but still held by a lease
    write_leases: int
    read_leases: int  # read-lock and pin leases
    pin_leases: int  # of which pin leases
    expired_write_leases: int
    expired_read_leases: int  # read-lock and pin leases
    expired_write_slots: int
    expired_read_locks: int  # read locks and pins
    evictions: int
    evicted_bytes: int
    # Slots freed but kept back: a transfer, or the holder of an expired write lease or pin,
    # may still use them.
    fenced_free: int = 0
    expired_held: int = 0  # slots of expired write leases and pins their holders have not ended


def _written_by_another(entry: Entry, key: bytes, mine: set[bytes]) -> bool:
    """Whether a present ``entry`` is an engine's write still in progress under another
    reservation than the one being made (whose own keys are ``mine``): its bytes are not
    stored until that writer commits, and never if it aborts. A load from a tier or a peer
    (``entry.tier`` set) is of bytes held elsewhere already."""
    return entry.state is State.WRITING and not entry.tier and key not in mine


class ObjectIndex:
    """Thread-safe index of the objects in one pool."""

    def __init__(
        self,
        allocator: Allocator,
        write_ttl: float = DEFAULT_WRITE_TTL,
        read_ttl: float = DEFAULT_READ_TTL,
        clock: Clock = time.monotonic,
        tenants: TenantIds | None = None,
    ) -> None:
        if write_ttl <= 0 or read_ttl <= 0:
            raise ValueError("lock TTLs must be positive")
        self.allocator = allocator
        self.write_ttl = write_ttl
        self.read_ttl = read_ttl
        self.clock = clock
        self._lock = threading.Lock()
        self._entries: dict[bytes, Entry] = {}
        self._ready: set[bytes] = set()  # keys of the entries in state READY
        self._lru: dict[Entry, None] = {}
        self._write_leases: dict[int, Lease] = {}
        self._read_leases: dict[int, Lease] = {}
        self._holder_leases: dict[int, set[int]] = {}
        # Random per server start: a client that registered again with a restarted server
        # and still names a lease of the old one hits no lease of its own by chance.
        self._next_lease = secrets.randbits(48) + 1
        self._next_expiry = float("inf")  # lower bound of the oldest lease's deadline
        self._zombies = 0
        self._expired_write_leases = 0
        self._expired_read_leases = 0
        self._expired_write_slots = 0
        self._expired_read_locks = 0
        self._evictions = 0
        self._evicted_bytes = 0
        # Fences: slot offset -> how many fences hold it; the fenced slots the index has freed
        # meanwhile, given back to the allocator at the last unfence.
        self._fences: dict[int, int] = {}
        self._fenced_free: set[int] = set()
        # Expired write leases and pins not yet ended by their holder, by lease id; when the
        # engines' ones end at the latest (in that order: each lasts one write TTL; the
        # server's own holders, whose ids are negative, always end theirs); how many of them
        # hold each slot (slots they hold that the index frees are kept back like fenced
        # ones); and the freed ones' entries, still charged (to their tenant, aligned length).
        self._expired_holds: dict[int, _Hold] = {}
        self._hold_ends: dict[int, float] = {}
        self._holds: dict[int, int] = {}
        self._held_charges: dict[int, Entry] = {}
        # Tenants: what each one's slots hold (aligned bytes, charged at allocation, given
        # back at free), its own LRU (the global LRU's entries of that tenant, in the same
        # order), and its quota and figures (the tally).
        self.tenants = tenants if tenants is not None else TenantIds()
        self._tused: dict[int, int] = {}
        self._tlru: dict[int, dict[Entry, None]] = {}
        self._tally = TenantTally()
        # The entries charged to ~other because their namespace was bound to no tenant when
        # they were reserved, by namespace digest, as long as they are charged (held charges
        # included): a later binding moves their charge to the tenant (:meth:`rebind`)
        # without a scan of the pool. Only unattributed chunks are listed.
        self._unbound: dict[bytes, dict[Entry, None]] = {}
        self.tenants.watch(self.rebind)
        # Called, under the index lock, with the keys of objects whose store expired before
        # its commit (so that lookups can tell "expired" from "never stored"); must be cheap.
        self.on_write_expired: Callable[[list[bytes]], None] | None = None
        # Likewise with what an eviction took, before any lookup can miss it: a miss right
        # after is then "evicted", not "absent" (the eviction's listeners run after a pass).
        self.on_evicted: Callable[[list[Evicted]], None] | None = None
        # Likewise with the noted chunks that became ready, as (key, note), and the keys of
        # noted ready chunks the pool stopped offering (evicted, cleared, deleted): the
        # chunk feed's events (tierkv.server.chunk_feed), in the order the index saw them.
        self.on_stored: Callable[[list[tuple[bytes, bytes]]], None] | None = None
        self.on_removed: Callable[[list[bytes]], None] | None = None
        # Likewise with the keys of a reservation of chunks coming back from a tier (``tier``
        # given, no notes: a prefetch, a promotion): the notes they had when the pool last
        # offered them, or None (tierkv.server.chunk_feed.ChunkFeed.notes_of).
        self.notes_of: Callable[[Sequence[bytes]], list[bytes] | None] | None = None

    # -- writes ----------------------------------------------------------------------------
    def reserve_write(
        self,
        keys: Sequence[bytes],
        lengths: Sequence[int] | int,
        holder: int,
        tier: str = "",
        holder_limit: int = 0,
        notes: Sequence[bytes] | None = None,
    ) -> WriteReservation:
        """Reserve a slot for each new key. Present keys (ready, being written, or repeated
        within this batch) and keys that do not fit are skipped and reported; this never
        waits for eviction. With ``holder_limit`` (bytes), the holder's open reservations,
        this batch's included, never exceed it: chunks beyond it are reported as not
        fitting, like a full pool. Each slot is charged to the tenant of its key's namespace;
        under a hard quota, chunks beyond the tenant's limit are refused the same way (and
        listed in ``over_quota``). Raises ValueError, with nothing reserved, on a bad
        length."""
        if isinstance(lengths, int):
            if lengths <= 0 and keys:
                raise ValueError(f"chunk lengths must be positive, got {lengths}")
            lengths = [lengths] * len(keys)
        else:
            if len(lengths) != len(keys):
                raise ValueError(f"{len(keys)} keys but {len(lengths)} lengths")
            if lengths and min(lengths) <= 0:
                raise ValueError(f"chunk lengths must be positive, got {min(lengths)}")
        if notes is not None and len(notes) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(notes)} notes")
        with self._lock:
            if notes is None and tier and self.notes_of is not None:
                notes = self.notes_of(keys)  # announced again once they are back
            now = self.clock()
            self._expire(now)
            lease = Lease(self._new_lease_id(), holder, now + self.write_ttl, [], True)
            result = WriteReservation(lease.id)
            entries = self._entries
            allocate = self.allocator.allocate
            aligned = self.allocator.aligned
            room = holder_limit - self._reserved_by(holder) if holder_limit else -1
            by_digest = self.tenants.by_digest
            tused = self._tused
            # The tally's limit_of, inlined below (the index's tally has no unlimited ids).
            tally = self._tally
            hard, limits, default = tally.hard, tally.limits, tally.default
            ns = b""
            tid = OTHER_ID
            bound: int | None = None
            limit: int | None = None
            mine: set[bytes] = set()  # keys this reservation writes (repeats are its own)
            for i, key in enumerate(keys):
                if key in entries:
                    result.present.append(i)
                    if _written_by_another(entries[key], key, mine):
                        result.writing.append(i)
                    continue
                if key[:DIGEST_SIZE] != ns:
                    ns = key[:DIGEST_SIZE]
                    bound = by_digest.get(ns)
                    tid = OTHER_ID if bound is None else bound
                    limit = limits.get(tid, default)
                length = lengths[i]
                size = aligned(length)
                if hard and limit is not None and tused.get(tid, 0) + size > limit:
                    result.no_space.append(i)
                    result.over_quota.append(i)
                    tally.count_refusal(tid, size)
                    continue
                if room >= 0:
                    if length > room:
                        result.no_space.append(i)
                        continue
                    room -= length
                offset = allocate(length)
                if offset is None:
                    result.no_space.append(i)
                    continue
                used = tused[tid] = tused.get(tid, 0) + size
                if limit is not None and used > limit:
                    result.quota_exceeded = True
                entry = Entry(key, offset, length, State.WRITING, tier=tier, tenant=tid)
                if notes is not None:
                    entry.note = notes[i]
                if bound is None:  # ~other until its namespace is bound (see rebind)
                    self._unbound.setdefault(ns, {})[entry] = None
                entries[key] = entry
                mine.add(key)
                lease.entries.append(entry)
                result.slots.append((i, offset, length))
            if lease.entries:
                self._add_lease(lease)
            else:
                result.lease_id = 0
            return result

    def rebind(self, digest: bytes, tid: int) -> int:
        """Charge tenant ``tid`` with the objects of namespace ``digest`` (being written,
        ready, deleted but held, or freed but held) that were charged to ``~other`` because
        the namespace was bound to no tenant when they were reserved. Called by
        :meth:`TenantIds.bind` once :attr:`TenantIds.by_digest` has the binding, so every
        object reserved before it is listed by then, and every one after is charged to
        ``tid`` already. Returns how many objects moved.

        Those in the LRU become its most recently used, in the order they had (the
        binding, an engine registering or looking up, counts as their use; a chain's first
        chunks stay its newest), which their list keeps (:meth:`_lru_add`): each tenant's
        LRU then stays the global one's entries in order, at O(objects moved). Putting
        them back in their place cost a walk of the global LRU under the index lock (0.25 s
        for a million objects), finding their order a walk of ``~other``'s."""
        with self._lock:
            moving = self._unbound.pop(digest, None)
            if moving is None or tid == OTHER_ID:
                return 0
            aligned = self.allocator.aligned
            size = sum(aligned(e.length) for e in moving)
            self._uncharge(OTHER_ID, size)
            self._tused[tid] = self._tused.get(tid, 0) + size
            lru = self._lru
            in_lru = [e for e in moving if e in lru]  # in their LRU order (see _lru_add)
            for entry in in_lru:
                self._lru_remove(entry)
            for entry in moving:
                entry.tenant = tid
            for entry in in_lru:
                self._lru_add(entry)
            return len(moving)

    def _reserved_by(self, holder: int) -> int:
        """Pool bytes the holder's open write leases hold (cleared entries included: their
        slots are free only when the lease ends)."""
        leases = (self._write_leases.get(lid) for lid in self._holder_leases.get(holder, ()))
        held = sum(
            s[1] for h in self._expired_holds.values() if h.holder == holder for s in h.slots
        )
        return held + sum(e.length for lease in leases if lease for e in lease.entries)

    def commit(self, lease_id: int, holder: int, only: Iterable[int] | None = None) -> CommitResult:
        """Make the lease's objects ready; with ``only`` (positions within the lease's slots)
        commit those and abort the rest. The lease ends either way, unless the call is
        refused (unknown or foreign lease, positions out of range): then nothing changes."""
        with self._lock:
            self._expire(self.clock())
            self._end_expired(lease_id, holder, write=True)
            lease = self._lease(self._write_leases, lease_id, holder)
            selected = self._select(lease, only)
            self._remove_lease(lease)
            result = CommitResult()
            ready: list[Entry] = []
            for pos, entry in enumerate(lease.entries):
                if pos not in selected:
                    self._drop_writing(entry)
                    result.aborted += 1
                elif not entry.live:  # deleted meanwhile: frees the zombie's slot
                    self._drop_writing(entry)
                    result.cleared += 1
                else:
                    entry.state = State.READY
                    self._ready.add(entry.key)
                    ready.append(entry)
                    result.committed_keys.append(entry.key)
                    result.committed_lengths.append(entry.length)
                    result.committed_bytes += entry.length
            result.committed = len(ready)
            self._touch(ready)
            if self.on_stored is not None and (noted := [(e.key, e.note) for e in ready if e.note]):
                self.on_stored(noted)
            return result

    def abort(self, lease_id: int, holder: int) -> int:
        """Give back every slot of a write lease. Returns the number of slots freed."""
        with self._lock:
            self._expire(self.clock())
            self._end_expired(lease_id, holder, write=True)
            return self._end(self._lease(self._write_leases, lease_id, holder))

    # -- reads -----------------------------------------------------------------------------
    def lock_read(
        self, keys: Sequence[bytes], holder: int, prefix: bool = True, into_lease: int = 0
    ) -> ReadLock:
        """Read-lock ready objects. With ``prefix`` stop at the first key that is not ready
        (a lookup); otherwise lock every ready key and report the rest as missing. A read
        lock is a use: locked objects leave the LRU, and releasing the lease puts them back
        as most recently used (for a background hold that must not count as a use, see
        :meth:`pin`).

        With ``into_lease`` (a live read lease of ``holder``) the new locks are appended to
        that lease instead of a new one (a prefetch adding to its lookup's locks): the result
        carries its id, and its deadline is renewed if anything was locked. An unknown or
        foreign ``into_lease`` (or a pin lease) raises LeaseNotFound / LeaseNotOwned with
        nothing locked."""
        with self._lock:
            now = self.clock()
            self._expire(now)
            if into_lease:
                lease = self._read_lease(into_lease, holder, pin=False)
                before = len(lease.entries)
            else:
                lease = Lease(self._new_lease_id(), holder, now + self.read_ttl, [], False)
            result = ReadLock(lease.id)
            entries = self._entries
            lru_remove = self._lru_remove
            for i, key in enumerate(keys):
                entry = entries.get(key)
                if entry is None or entry.state is not State.READY:
                    if prefix:
                        result.missing.extend(range(i, len(keys)))
                        break
                    result.missing.append(i)
                    continue
                if entry.readers == 0:
                    lru_remove(entry)
                entry.readers += 1
                lease.entries.append(entry)
                result.slots.append((i, entry.offset, entry.length))
            if into_lease:
                if len(lease.entries) > before:
                    # Renewed: move it last, so the table stays in deadline order.
                    lease.deadline = now + self.read_ttl
                    del self._read_leases[lease.id]
                    self._read_leases[lease.id] = lease
            elif lease.entries:
                self._add_lease(lease)
            else:
                result.lease_id = 0
            return result

    def release_read(self, lease_id: int, holder: int) -> int:
        """End a read lease (not a pin lease: see :meth:`unpin`). Returns the number of
        locks released."""
        with self._lock:
            self._expire(self.clock())
            return self._end(self._read_lease(lease_id, holder, pin=False))

    def pin(self, keys: Sequence[bytes], holder: int) -> ReadLock:
        """Pin every ready key for a background holder and report the rest as missing.

        A pin is a hold that is not a use: like a read lock it keeps the object from being
        evicted and its slot from being freed or reused (a delete or clear defers the free
        until the last lock or pin ends), but the object keeps its place in the LRU order
        and :meth:`unpin` leaves it there. Pins are leases with the read TTL; they count in
        the read-lease figures. Returns a new pin lease (0 if nothing was pinned)."""
        with self._lock:
            now = self.clock()
            self._expire(now)
            lease = Lease(self._new_lease_id(), holder, now + self.read_ttl, [], False, True)
            result = ReadLock(lease.id)
            entries = self._entries
            for i, key in enumerate(keys):
                entry = entries.get(key)
                if entry is None or entry.state is not State.READY:
                    result.missing.append(i)
                    continue
                entry.pins += 1
                lease.entries.append(entry)
                result.slots.append((i, entry.offset, entry.length))
            if lease.entries:
                self._add_lease(lease)
            else:
                result.lease_id = 0
            return result

    def unpin(self, lease_id: int, holder: int) -> int:
        """End a pin lease; the objects stay where they were in the LRU order (a pinned
        object deleted meanwhile is freed now if nothing else holds it). Returns the number
        of pins released."""
        with self._lock:
            self._expire(self.clock())
            self._end_expired(lease_id, holder, write=False)
            return self._end(self._read_lease(lease_id, holder, pin=True))

    def lease_slots(
        self, lease_id: int, holder: int, renew: bool = False
    ) -> list[tuple[bytes, int, int]]:
        """(key, offset, length) of every slot a live read or pin lease holds; ``renew``:
        its deadline starts again (a retrieve of a lookup's locks: the copy gets a whole
        read TTL, whenever the lookup was)."""
        with self._lock:
            now = self.clock()
            self._expire(now)
            lease = self._lease(self._read_leases, lease_id, holder)
            if renew:  # moved last: the table stays in deadline order
                lease.deadline = now + self.read_ttl
                del self._read_leases[lease.id]
                self._read_leases[lease.id] = lease
            return [(e.key, e.offset, e.length) for e in lease.entries]

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is ready (LRU untouched)."""
        with self._lock:
            return list(map(self._ready.__contains__, keys))

    def ready_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are ready (LRU untouched)."""
        ready = self._ready
        with self._lock:
            if ready.issuperset(keys):
                return len(keys)
            return next(i for i, key in enumerate(keys) if key not in ready)

    def release_holder(self, holder: int) -> tuple[int, int]:
        """End every lease of a holder (it unregistered or was declared dead).
        Returns (write slots freed, read locks and pins released), not counting leases that
        had already expired (those count as expiries)."""
        with self._lock:
            self._expire(self.clock())
            for lease_id, hold in list(self._expired_holds.items()):
                if hold.holder == holder:
                    self._let_go(lease_id)
            freed = released = 0
            for lease_id in list(self._holder_leases.get(holder, ())):
                lease = self._write_leases.get(lease_id) or self._read_leases[lease_id]
                if lease.write:
                    freed += self._end(lease)
                else:
                    released += self._end(lease)
            return freed, released

    # -- fences ----------------------------------------------------------------------------
    def fence(self, offsets: Iterable[int]) -> None:
        """Keep these slots (offsets of allocated slots) from being reused until as many
        :meth:`unfence` calls lift the fence: whatever their objects' fate meanwhile, a slot
        the index frees stays allocated (its tenant is no longer charged for it)."""
        offsets = list(offsets)
        with self._lock:
            for offset in offsets:
                if self.allocator.size_of(offset) is None:
                    raise ValueError(f"fence of offset {offset}, which is not allocated")
            fences = self._fences
            for offset in offsets:
                fences[offset] = fences.get(offset, 0) + 1

    def unfence(self, offsets: Iterable[int]) -> int:
        """Lift one fence from each slot; a slot freed while fenced goes back to the
        allocator with its last fence. Returns how many slots were given back."""
        lifts = Counter(offsets)
        with self._lock:
            fences = self._fences
            for offset, n in lifts.items():
                if n > fences.get(offset, 0):
                    raise ValueError(f"unfence of offset {offset}, which is not fenced")
            return self._lift(fences, lifts.elements())

    # -- deletion, eviction, expiry --------------------------------------------------------
    def delete(self, keys: Iterable[bytes]) -> int:
        """Remove objects from the index. Returns how many keys were present."""
        with self._lock:
            entries = list(
                {e.key: e for key in keys if (e := self._entries.get(key)) is not None}.values()
            )
            for entry in entries:
                self._unmap(entry)
            self._announce_removed(entries)
            return len(entries)

    def clear(self, prefix: bytes = b"") -> int:
        """Remove every object (with ``prefix``: every object whose key starts with it, e.g.
        one namespace's digest). Locked ones vanish from lookups at once and free their slots
        when their leases end. Returns how many objects were removed."""
        return len(self.clear_keys(prefix))

    def clear_keys(self, prefix: bytes = b"") -> list[bytes]:
        """:meth:`clear`, returning the keys removed."""
        with self._lock:
            entries = [e for e in self._entries.values() if e.key.startswith(prefix)]
            for entry in entries:
                self._unmap(entry)
            self._announce_removed(entries)
            return [e.key for e in entries]

    def evict(self, nbytes: int, max_objects: int | None = None) -> list[Evicted]:
        """Evict least recently used unlocked, unpinned objects until ``nbytes`` (aligned) are
        freed, ``max_objects`` are evicted, or nothing evictable is left. Pinned objects in
        the LRU are stepped over, so a call costs O(evicted + pinned); the pins are the
        write-behind's queue, which is bounded (see the module docstring).

        Where some tenants have quotas, the objects of the tenants without one (unlimited)
        or above theirs go first, least recently used first; the objects of tenants within
        their quotas only when those are not enough. A quota is thus also a share of the
        pool its tenant keeps while the quotas fit in the pool."""
        if max_objects is not None and max_objects < 1:
            raise ValueError(f"max_objects must be at least 1, not {max_objects}")
        with self._lock:
            first = self._evict_first()
            if first is None:
                return self._evict(self._lru, nbytes, limit=max_objects)[0]
            lru, skip = first
            evicted, freed = self._evict(lru, nbytes, skip, max_objects)
            left = None if max_objects is None else max_objects - len(evicted)
            if freed < nbytes and left != 0:
                evicted += self._evict(self._lru, nbytes - freed, limit=left)[0]
            return evicted

    def _evict_first(self) -> tuple[dict[Entry, None], frozenset[int]] | None:
        """Where the watermark eviction starts when some tenants are within a quota: (an
        LRU, the tenants in it to step over); None: the global LRU, every tenant alike."""
        limit_of = self._tally.limit_of
        if not self._tally.limited:
            return None  # no quotas: every tenant is unlimited
        within = frozenset(
            tid
            for tid in self._tlru
            if (limit := limit_of(tid)) is not None and self._tused.get(tid, 0) <= limit
        )
        if not within or len(within) == len(self._tlru):
            return None
        if len(self._tlru) - len(within) == 1:  # one tenant first: its own LRU
            (tid,) = (t for t in self._tlru if t not in within)
            return self._tlru[tid], frozenset()
        return self._lru, within

    def evict_over_quota(self) -> list[Evicted]:
        """Evict, for every tenant above its quota, that tenant's own least recently used
        unlocked, unpinned objects until it is at or below its quota again (or has nothing
        evictable left); no other tenant's objects are touched."""
        with self._lock:
            evicted: list[Evicted] = []
            limit_of = self._tally.limit_of
            for tid, used in list(self._tused.items()):
                limit = limit_of(tid)
                if limit is not None and used > limit and tid in self._tlru:
                    evicted += self._evict(self._tlru[tid], used - limit)[0]
            return evicted

    def set_quotas(self, limits: dict[int, int], default: int | None, hard: bool) -> None:
        """The tenants' quotas (tenant id -> bytes), the quota of every other tenant (None:
        unlimited), and whether a store beyond a quota is refused (hard) or the tenant's
        own oldest objects are evicted afterwards (soft: :meth:`evict_over_quota`)."""
        if any(v < 0 for v in limits.values()) or (default is not None and default < 0):
            raise ValueError("quotas must be >= 0 bytes")
        with self._lock:
            self._tally.set_limits(limits, default, hard)

    def over_quota(self) -> bool:
        """Whether some tenant holds more than its quota (cheap: one pass over tenants)."""
        with self._lock:
            limit_of = self._tally.limit_of
            return any(
                used > lim
                for tid, used in self._tused.items()
                if (lim := limit_of(tid)) is not None
            )

    def tenant_figures(self, between: Callable[[], None] = lambda: None) -> list[TenantFigures]:
        """Every tenant with a slot, a quota or a figure, in tenant id order. The rows are
        built after the lock is released (copied under it): engines' requests that need
        the lock never wait for a pass over thousands of tenants. ``between``: called
        between tenants (a server's check point, :mod:`tierkv.server.engine_first`)."""
        with self._lock:
            tally, used = self._tally.copy(), dict(self._tused)
        return tally.figures(used, between)

    def expire(self) -> tuple[int, int]:
        """Expire overdue leases now. Returns (write slots freed, read locks and pins
        released)."""
        with self._lock:
            return self._expire(self.clock())

    # -- figures ---------------------------------------------------------------------------
    @property
    def used(self) -> int:
        return self.allocator.used

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def stats(self) -> IndexStats:
        """Figures, in time proportional to the number of leases (not of objects)."""
        with self._lock:
            writing = sum(
                1 for lease in self._write_leases.values() for e in lease.entries if e.live
            )
            objects = len(self._entries)
            ready = objects - writing
            pin_leases = [lease for lease in self._read_leases.values() if lease.pin]
            pinned = {e for lease in pin_leases for e in lease.entries if e.live}
            evictable = len(self._lru) - sum(1 for e in pinned if e.readers == 0)
            return IndexStats(
                capacity=self.allocator.capacity,
                used=self.allocator.used,
                largest_free=self.allocator.largest_free,
                objects=objects,
                writing=writing,
                ready=ready,
                read_locked=ready - evictable,
                pinned=len(pinned),
                evictable=evictable,
                zombies=self._zombies,
                write_leases=len(self._write_leases),
                read_leases=len(self._read_leases),
                pin_leases=len(pin_leases),
                expired_write_leases=self._expired_write_leases,
                expired_read_leases=self._expired_read_leases,
                expired_write_slots=self._expired_write_slots,
                expired_read_locks=self._expired_read_locks,
                evictions=self._evictions,
                evicted_bytes=self._evicted_bytes,
                fenced_free=len(self._fenced_free),
                expired_held=sum(len(hold.slots) for hold in self._expired_holds.values()),
            )

    def check(self) -> None:
        """Verify the accounting invariants (for tests): every allocated block belongs to
        exactly one live entry or held zombie, reader and pin counts match the leases, pins
        hold only committed objects, the LRU holds exactly the live ready objects without a
        read lock (pinned or not), the lease maps agree. Raises AssertionError on the
        first violation (explicitly, so it works under ``python -O`` too)."""

        def require(ok: bool, what: str) -> None:
            if not ok:
                raise AssertionError(what)

        with self._lock:
            alloc = self.allocator
            alloc.check()
            held: dict[Entry, int] = {}
            pinned: dict[Entry, int] = {}
            writing: set[Entry] = set()
            n_writing = 0
            holders: dict[int, set[int]] = {}
            for leases, write in ((self._write_leases, True), (self._read_leases, False)):
                deadline = float("-inf")
                for lease_id, lease in leases.items():
                    require(lease.id == lease_id, f"lease {lease_id} filed under a wrong id")
                    require(lease.write is write, f"lease {lease_id} in the wrong table")
                    require(not (write and lease.pin), f"write lease {lease_id} marked a pin")
                    require(bool(lease.entries), f"lease {lease_id} holds nothing")
                    require(lease.deadline >= deadline, "leases not in deadline order")
                    require(self._next_expiry <= lease.deadline, "next expiry too late")
                    deadline = lease.deadline
                    holders.setdefault(lease.holder, set()).add(lease_id)
                    if write:
                        writing.update(lease.entries)
                        n_writing += len(lease.entries)
                    else:
                        counts = pinned if lease.pin else held
                        for entry in lease.entries:
                            require(entry.state is State.READY, f"{entry.key!r} held unready")
                            counts[entry] = counts.get(entry, 0) + 1
            require(n_writing == len(writing), "an object is in two write leases")
            require(holders == self._holder_leases, "holder -> leases map out of sync")
            slots: dict[int, Entry] = {}
            for entry in [*self._entries.values(), *held, *pinned, *writing]:
                prev = slots.setdefault(entry.offset, entry)
                require(prev is entry, f"two objects share offset {entry.offset}")
            for key, entry in self._entries.items():
                require(entry.key == key and entry.live, f"key map wrong for {key!r}")
            require(
                self._ready == {k for k, e in self._entries.items() if e.state is State.READY},
                "ready-key set out of sync with the key map",
            )
            in_lru = 0
            for entry in slots.values():
                k = entry.key
                require(entry.readers == held.get(entry, 0), f"reader count of {k!r}")
                require(entry.pins == pinned.get(entry, 0), f"pin count of {k!r}")
                require((entry.state is State.WRITING) == (entry in writing), f"state of {k!r}")
                require(
                    alloc.size_of(entry.offset) == alloc.aligned(entry.length),
                    f"block of {k!r} missing or of the wrong size",
                )
                unlocked = entry.live and entry.state is State.READY and entry.readers == 0
                in_lru += unlocked
                require((entry in self._lru) == unlocked, f"LRU membership of {k!r}")
                if entry.live:
                    require(self._entries.get(k) is entry, f"live {k!r} not in the key map")
                else:
                    require(
                        entry in held or entry in pinned or entry in writing,
                        f"zombie {k!r} held by nothing",
                    )
            require(len(self._lru) == in_lru, "LRU holds objects that are not ready and unlocked")
            tused: dict[int, int] = {}
            for entry in slots.values():
                tused[entry.tenant] = tused.get(entry.tenant, 0) + alloc.aligned(entry.length)
            for offset, entry in self._held_charges.items():  # freed, still held
                require(offset in self._holds, f"slot {offset} charged, held by nothing")
                require(offset in self._fenced_free, f"slot {offset} charged, not freed")
                tused[entry.tenant] = tused.get(entry.tenant, 0) + alloc.aligned(entry.length)
            require(tused == self._tused, f"tenant usage {self._tused} != slots' {tused}")
            charged = {*slots.values(), *self._held_charges.values()}
            by_digest = self.tenants.by_digest
            listed: set[Entry] = set()
            for digest, waiting in self._unbound.items():
                require(bool(waiting), f"empty list of unbound entries of {digest!r}")
                for entry in waiting:
                    require(entry.key[:DIGEST_SIZE] == digest, f"{entry.key!r} listed wrong")
                    require(entry.tenant == OTHER_ID, f"unbound {entry.key!r} of a tenant")
                    require(entry in charged, f"unbound {entry.key!r} charged nowhere")
                listed.update(waiting)
            for entry in charged:
                if entry.key[:DIGEST_SIZE] not in by_digest:
                    require(entry in listed, f"{entry.key!r} of an unbound namespace unlisted")
            place = {entry: i for i, entry in enumerate(self._lru)}
            for digest, waiting in self._unbound.items():
                order = [place[e] for e in waiting if e in place]
                require(order == sorted(order), f"unbound list of {digest!r} not in LRU order")
            tlru: dict[int, list[Entry]] = {}
            for entry in self._lru:
                tlru.setdefault(entry.tenant, []).append(entry)
            require(
                {t: list(d) for t, d in self._tlru.items()} == tlru,
                "a tenant's LRU is not the global LRU's objects of that tenant, in its order",
            )
            for offset in self._fenced_free:
                require(
                    offset in self._fences or offset in self._holds,
                    f"slot {offset} kept back without a fence or hold",
                )
                require(offset not in slots, f"slot {offset} kept back and in use")
            for offset in self._fences:
                require(alloc.size_of(offset) is not None, f"fenced slot {offset} not allocated")
            holds = Counter(s[0] for h in self._expired_holds.values() for s in h.slots)
            require(holds == Counter(self._holds), "expired holds' slot counts out of sync")
            until = float("-inf")
            for lease_id, end in self._hold_ends.items():
                hold = self._expired_holds[lease_id]
                require(hold.holder > 0, f"hold {lease_id} of a server holder given an end")
                require(end >= until, "expired holds not in the order they end")
                require(self._next_expiry <= end, "next expiry after a hold's end")
                until = end
            for offset in self._holds:
                require(alloc.size_of(offset) is not None, f"held slot {offset} not allocated")
            require(
                alloc.allocations == len(slots) + len(self._fenced_free),
                "allocated blocks != objects and fenced slots kept back",
            )
            zombies = sum(1 for e in slots.values() if not e.live)
            require(zombies == self._zombies, f"zombie count {self._zombies} != {zombies}")

    # -- internals (index lock held) -------------------------------------------------------
    def _new_lease_id(self) -> int:
        lease_id = self._next_lease
        self._next_lease += 1
        return lease_id

    def _add_lease(self, lease: Lease) -> None:
        (self._write_leases if lease.write else self._read_leases)[lease.id] = lease
        if lease.deadline < self._next_expiry:
            self._next_expiry = lease.deadline
        self._holder_leases.setdefault(lease.holder, set()).add(lease.id)

    def _remove_lease(self, lease: Lease) -> None:
        del (self._write_leases if lease.write else self._read_leases)[lease.id]
        ids = self._holder_leases[lease.holder]
        ids.discard(lease.id)
        if not ids:
            del self._holder_leases[lease.holder]

    def _lease(self, leases: dict[int, Lease], lease_id: int, holder: int) -> Lease:
        lease = leases.get(lease_id)
        if lease is None:
            raise LeaseNotFound(f"lease {lease_id} does not exist (never issued, ended or expired)")
        if lease.holder != holder:
            raise LeaseNotOwned(f"lease {lease_id} belongs to another client")
        return lease

    def _read_lease(self, lease_id: int, holder: int, pin: bool) -> Lease:
        """A live read lease of the given kind (a pin lease, or a read-lock lease); a lease
        of the other kind is not found, whoever holds it (as with a write lease's id)."""
        lease = self._read_leases.get(lease_id)
        if lease is not None and lease.pin is not pin:
            kind = "a pin" if lease.pin else "a read-lock"
            raise LeaseNotFound(f"lease {lease_id} is {kind} lease")
        return self._lease(self._read_leases, lease_id, holder)

    @staticmethod
    def _select(lease: Lease, only: Iterable[int] | None) -> set[int]:
        n = len(lease.entries)
        if only is None:
            return set(range(n))
        selected = set(only)
        bad = [p for p in selected if not 0 <= p < n]
        if bad:
            raise SlotPositionError(f"slot positions {sorted(bad)} out of range for a lease of {n}")
        return selected

    def _evict(
        self,
        lru: dict[Entry, None],
        nbytes: int,
        skip: frozenset[int] = frozenset(),
        limit: int | None = None,
    ) -> tuple[list[Evicted], int]:
        """Evict from ``lru`` (the global LRU or one tenant's), oldest first, stepping over
        pinned objects and those of the tenants in ``skip``, until ``nbytes`` (aligned) are
        freed, ``limit`` objects are evicted, or nothing is left; returns what was evicted
        and the bytes freed."""
        victims: list[Entry] = []
        freed = 0
        size_of = self.allocator.size_of
        for entry in lru:  # oldest first; collect, then mutate
            if freed >= nbytes or len(victims) == limit:
                break
            if entry.pins or entry.tenant in skip:
                continue
            victims.append(entry)
            freed += size_of(entry.offset) or 0
        evicted: list[Evicted] = []
        tevictions, tevicted = self._tally.evictions, self._tally.evicted_bytes
        for entry in victims:
            self._lru_remove(entry)
            del self._entries[entry.key]
            self._ready.discard(entry.key)
            entry.live = False
            tid = entry.tenant
            tevictions[tid] = tevictions.get(tid, 0) + 1
            tevicted[tid] = tevicted.get(tid, 0) + self._free_slot(entry)
            evicted.append(Evicted(entry.key, entry.length, entry.tier))
        self._evictions += len(evicted)
        self._evicted_bytes += freed
        if evicted and self.on_evicted is not None:
            self.on_evicted(evicted)
        self._announce_removed(victims)
        return evicted, freed

    def _announce_removed(self, entries: list[Entry]) -> None:
        """Tell :attr:`on_removed` which of these entries, just taken out of the key map,
        were noted ready chunks (the others were never announced)."""
        if self.on_removed is not None and (
            keys := [e.key for e in entries if e.note and e.state is State.READY]
        ):
            self.on_removed(keys)

    def _free_slot(self, entry: Entry) -> int:
        """Give the entry's slot back to the allocator and its bytes back to its tenant's
        account; returns the aligned bytes freed."""
        size = self.allocator.aligned(entry.length)
        if entry.offset in self._holds:  # kept back, and still charged while it is held
            self._fenced_free.add(entry.offset)
            self._held_charges[entry.offset] = entry
            return size
        if entry.offset in self._fences:
            self._fenced_free.add(entry.offset)
        else:
            self.allocator.free(entry.offset)
        self._discharge(entry)
        return size

    def _discharge(self, entry: Entry) -> None:
        """Take the entry's slot off its tenant's account (and off the unbound lists)."""
        self._uncharge(entry.tenant, self.allocator.aligned(entry.length))
        if entry.tenant == OTHER_ID:
            digest = entry.key[:DIGEST_SIZE]
            waiting = self._unbound.get(digest)
            if waiting is not None:
                waiting.pop(entry, None)
                if not waiting:
                    del self._unbound[digest]

    def _uncharge(self, tenant: int, size: int) -> None:
        left = self._tused[tenant] - size
        if left:
            self._tused[tenant] = left
        else:
            del self._tused[tenant]

    def _lru_add(self, entry: Entry) -> None:
        """Make ``entry`` the most recently used (in the global and its tenant's LRU; an
        unbound one also the last of its namespace's list, which :meth:`rebind` reads as
        their order in the LRU)."""
        self._lru[entry] = None
        tlru = self._tlru.get(entry.tenant)
        if tlru is None:
            tlru = self._tlru[entry.tenant] = {}
        tlru[entry] = None
        if entry.tenant == OTHER_ID:
            waiting = self._unbound.get(entry.key[:DIGEST_SIZE])
            if waiting is not None and waiting.pop(entry, 0) is None:
                waiting[entry] = None

    def _lru_remove(self, entry: Entry) -> None:
        del self._lru[entry]
        tlru = self._tlru[entry.tenant]
        del tlru[entry]
        if not tlru:
            del self._tlru[entry.tenant]

    def _drop_writing(self, entry: Entry) -> None:
        if entry.live:
            del self._entries[entry.key]
            entry.live = False
        else:
            self._zombies -= 1
        self._free_slot(entry)

    def _end(self, lease: Lease) -> int:
        """Remove a lease from its table and give up what it holds (a write lease's slots,
        a read lease's locks or pins). Returns how many entries it held."""
        self._remove_lease(lease)
        if lease.write:
            for entry in lease.entries:
                self._drop_writing(entry)
        elif lease.pin:
            self._unpin(lease.entries)
        else:
            self._unlock(lease.entries)
        return len(lease.entries)

    def _end_into_hold(self, lease: Lease, now: float) -> int:
        """End an expiring write lease or pin, keeping its slots (charged to their tenants
        while the index frees them) until its holder ends it or goes away, or, an engine's,
        one write TTL more has passed. Returns how many entries it held."""
        slots = [(e.offset, e.length) for e in lease.entries]
        holds = self._holds
        for offset, _ in slots:
            holds[offset] = holds.get(offset, 0) + 1
        self._expired_holds[lease.id] = _Hold(lease.holder, lease.write, slots)
        if lease.holder > 0:  # the server's own holders always end their leases
            self._hold_ends[lease.id] = now + self.write_ttl
        return self._end(lease)  # the slots it frees are kept back

    def _end_expired(self, lease_id: int, holder: int, write: bool) -> None:
        """The holder ends an expired write lease (``write``) or pin: its slots are let go,
        and the call is refused as for any lease past its deadline. Nothing happens for a
        lease id that is not such a lease."""
        hold = self._expired_holds.get(lease_id)
        if hold is None or hold.write is not write:
            return
        if hold.holder != holder:
            raise LeaseNotOwned(f"lease {lease_id} belongs to another client")
        self._let_go(lease_id)
        raise LeaseNotFound(f"lease {lease_id} expired (its TTL passed before it was ended)")

    def _let_go(self, lease_id: int) -> None:
        """The end of an expired lease's hold: its slots go (with their charges) where
        nothing else holds or fences them."""
        hold = self._expired_holds.pop(lease_id)
        self._hold_ends.pop(lease_id, None)
        self._lift(self._holds, [offset for offset, _ in hold.slots])

    def _lift(self, counts: dict[int, int], offsets: Iterable[int]) -> int:
        """Take one off each slot's count in ``counts`` (fences or holds; each counted);
        a kept-back slot that nothing fences or holds any more goes back to the allocator.
        Returns the slots given back."""
        given = 0
        for offset in offsets:
            left = counts[offset] - 1
            if left:
                counts[offset] = left
                continue
            del counts[offset]
            held = None if offset in self._holds else self._held_charges.pop(offset, None)
            if held is not None:
                self._discharge(held)
            free = self._fenced_free
            if offset in free and offset not in self._fences and offset not in self._holds:
                free.discard(offset)
                self.allocator.free(offset)
                given += 1
        return given

    def _unlock(self, entries: list[Entry]) -> None:
        """Release one read lock on each entry; last chunk of the batch goes in LRU first."""
        for entry in reversed(entries):
            entry.readers -= 1
            if entry.readers == 0:
                if entry.live:
                    self._lru_add(entry)
                elif entry.pins == 0:
                    self._free_slot(entry)
                    self._zombies -= 1

    def _unpin(self, entries: list[Entry]) -> None:
        """Release one pin on each entry; the LRU order is left alone."""
        for entry in entries:
            entry.pins -= 1
            if entry.pins == 0 and entry.readers == 0 and not entry.live:
                self._free_slot(entry)
                self._zombies -= 1

    def _touch(self, entries: list[Entry]) -> None:
        lru = self._lru
        for entry in reversed(entries):
            if entry in lru:
                self._lru_remove(entry)
            self._lru_add(entry)

    def _unmap(self, entry: Entry) -> None:
        del self._entries[entry.key]
        self._ready.discard(entry.key)
        entry.live = False
        if entry.state is State.READY and entry.readers == 0:
            self._lru_remove(entry)
            if entry.pins == 0:
                self._free_slot(entry)
                return
        self._zombies += 1

    def _expire(self, now: float) -> tuple[int, int]:
        if now < self._next_expiry:
            return 0, 0
        freed = released = 0
        leases = self._write_leases
        while leases:
            lease = next(iter(leases.values()))
            if lease.deadline > now:
                break
            if self.on_write_expired is not None:
                self.on_write_expired([e.key for e in lease.entries if e.live])
            freed += self._end_into_hold(lease, now)
            self._expired_write_leases += 1
        leases = self._read_leases
        while leases:
            lease = next(iter(leases.values()))
            if lease.deadline > now:
                break
            released += self._end_into_hold(lease, now) if lease.pin else self._end(lease)
            self._expired_read_leases += 1
        ends = self._hold_ends
        while ends:  # in the order they end (each lasts one write TTL from its start)
            lease_id, end = next(iter(ends.items()))
            if end > now:
                break
            self._let_go(lease_id)
        self._expired_write_slots += freed
        self._expired_read_locks += released
        due = [
            next(iter(d.values())).deadline for d in (self._write_leases, self._read_leases) if d
        ]
        if ends:
            due.append(next(iter(ends.values())))
        self._next_expiry = min(due, default=float("inf"))
        return freed, released
