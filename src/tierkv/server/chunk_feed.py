"""What the pool offers, as a stream of events that engines relay to KV-aware routers.

An engine may give each chunk it stores a *note*: its own description of the chunk (for
vLLM, the blocks' hashes and token ids in the form of vLLM's KV events), opaque to the
server. While the pool holds a noted chunk, every engine attached to the server whose
namespaces include the chunk's may announce it: the pool is shared, so an engine can load
what another one stored. The feed records, in one order shared by all namespaces:

- ``CHUNK_STORED`` (key, note) when a noted chunk is committed (it can be loaded from then on);
- ``CHUNK_REMOVED`` (key) when the pool stops offering it: eviction (watermark or quota), clear,
  delete. The note stays with the chunk until then, so a reader that missed the store can
  still learn it from a snapshot.

A chunk that comes back into the pool from a tier (prefetched, promoted for a peer) is
announced again with the note it had: the feed remembers the notes of the chunks it
announced removed, the most recent first, up to :data:`MAX_AWAY_NOTE_BYTES`
(:meth:`ChunkFeed.notes_of`; the index asks when it reserves them). A chunk that left the
pool longer ago than that comes back unannounced until an engine stores it again.

Readers pull: :meth:`ChunkFeed.read` returns the events of their namespaces after the last
sequence number they saw, in batches whose cost is bounded (reads are served on the RPC
loop): a read finds its place in the log by sequence number, looks at :data:`READ_SCAN`
events at most and returns :data:`READ_NOTE_BYTES` of notes at most; the reader reads on
after the batch's ``last``. The log is bounded (:data:`MAX_EVENTS` events,
:data:`MAX_LOG_NOTE_BYTES` of notes); a reader that fell behind what was dropped is told to
*resync*: it reads a :meth:`ChunkFeed.snapshot` of what its namespaces hold now (the chunks
with their notes and the sequence number they are current at), then reads on from there. A
reader compares the feed's ``epoch`` (random, per server process) with the one it saw: a
restarted server is a new feed, and the reader resyncs from its snapshot, which then removes
everything the old server held.

Called under the pool index's lock (:meth:`stored`, :meth:`removed`), so the events of one
chunk are in the order the index saw them; the feed's own lock is taken after the index's,
never the other way round, and :meth:`read` and :meth:`snapshot` take only the feed's.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import cast

from tierkv.protocol import CHUNK_REMOVED, CHUNK_STORED
from tierkv.protocol import ChunkEvent as Event

MAX_EVENTS = 65536  # events the log keeps for readers that are behind
MAX_LOG_NOTE_BYTES = 64 * 2**20  # notes the log keeps (each note is shared with the chunk)
MAX_AWAY_NOTE_BYTES = 64 * 2**20  # notes kept of chunks the pool no longer offers
AWAY_ENTRY_BYTES = 128  # what remembering one note costs beyond its bytes (dict slot, object)
READ_SCAN = 8192  # events one read looks at, at most (of any namespace)
READ_NOTE_BYTES = 4 * 2**20  # notes one read returns, at most (one event at least)


@dataclass(frozen=True, slots=True)
class Batch:
    """What :meth:`ChunkFeed.read` returns: ``events`` in order; ``last``: the sequence number
    the reader is complete up to (ask again after it: a batch may end before the newest
    event, with no events at all when none of those it looked at were the reader's);
    ``resync``: events the reader needed were dropped (it was too far behind), read a
    snapshot."""

    events: list[Event]
    last: int
    resync: bool


class ChunkFeed:
    """The stored/removed events of noted chunks, and what each namespace holds now."""

    def __init__(
        self,
        max_events: int = MAX_EVENTS,
        max_log_note_bytes: int = MAX_LOG_NOTE_BYTES,
        max_away_note_bytes: int = MAX_AWAY_NOTE_BYTES,
        read_scan: int = READ_SCAN,
        read_note_bytes: int = READ_NOTE_BYTES,
    ) -> None:
        if max_events < 1 or max_log_note_bytes < 0 or max_away_note_bytes < 0:
            raise ValueError("the feed must keep at least one event")
        if read_scan < 1 or read_note_bytes < 0:
            raise ValueError("a read must look at one event at least")
        self.epoch = secrets.randbits(63) | 1  # never 0: 0 is "no feed seen yet"
        self.max_events = max_events
        self.max_log_note_bytes = max_log_note_bytes
        self._lock = threading.Lock()
        self.read_scan = read_scan
        self.read_note_bytes = read_note_bytes
        self._seq = 0
        # (event, namespace) from _log[_head] on, of sequence numbers _dropped_upto + 1,
        # + 2, ... (every event is logged): a reader's place is found by its number. The
        # entries before _head were dropped (None), and are cut off now and then.
        self._log: list[tuple[Event, bytes] | None] = []
        self._head = 0
        self._log_note_bytes = 0
        self._dropped_upto = 0  # the highest sequence number no longer in the log
        self._held: dict[bytes, dict[bytes, bytes]] = {}  # namespace -> key -> note
        self.held_note_bytes = 0
        # key -> note of the chunks announced removed, the oldest first; what they cost
        # (their notes' bytes and AWAY_ENTRY_BYTES each), at most max_away_note_bytes.
        self.max_away_note_bytes = max_away_note_bytes
        self._away: dict[bytes, bytes] = {}
        self._away_cost = 0
        self.resyncs = 0  # reads answered "resync" (status, metrics)

    # -- writers (under the index's lock) --------------------------------------------------
    def stored(self, chunks: Iterable[tuple[bytes, bytes]]) -> None:
        """Noted chunks (key, note) were committed."""
        with self._lock:
            for key, note in chunks:
                ns = key[:16]
                held = self._held.get(ns)
                if held is None:
                    held = self._held[ns] = {}
                old = held.get(key)
                if old is not None:
                    self.held_note_bytes -= len(old)
                if (away := self._away.pop(key, None)) is not None:
                    self._away_cost -= len(away) + AWAY_ENTRY_BYTES
                held[key] = note
                self.held_note_bytes += len(note)
                self._append(Event(self._next(), CHUNK_STORED, key, note), ns)
            self._trim()

    def removed(self, keys: Iterable[bytes]) -> None:
        """The pool no longer offers these (noted, committed) chunks."""
        with self._lock:
            for key in keys:
                ns = key[:16]
                held = self._held.get(ns)
                note = held.pop(key, None) if held is not None else None
                if note is None:
                    continue  # never announced here (the feed started after its store)
                self.held_note_bytes -= len(note)
                if not held:
                    del self._held[ns]
                self._append(Event(self._next(), CHUNK_REMOVED, key, b""), ns)
                self._remember(key, note)
            self._trim()

    def _remember(self, key: bytes, note: bytes) -> None:
        """Keep the note of a chunk the pool stopped offering, for when it comes back;
        the oldest ones go past :attr:`max_away_note_bytes` (lock held)."""
        away = self._away
        away[key] = note  # (not there: stored() took it out when the chunk came back)
        self._away_cost += len(note) + AWAY_ENTRY_BYTES
        while self._away_cost > self.max_away_note_bytes:
            oldest = next(iter(away))
            self._away_cost -= len(away.pop(oldest)) + AWAY_ENTRY_BYTES

    def notes_of(self, keys: Sequence[bytes]) -> list[bytes] | None:
        """The notes chunks coming back into the pool had when it last offered them (b""
        for one the feed does not remember); None when it remembers none of them."""
        with self._lock:
            away = self._away
            if not away:
                return None
            notes = [away.get(key, b"") for key in keys]
        return notes if any(notes) else None

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _append(self, event: Event, ns: bytes) -> None:
        self._log.append((event, ns))
        self._log_note_bytes += len(event.note)

    def _trim(self) -> None:
        log = self._log
        while len(log) > self._head and (
            len(log) - self._head > self.max_events
            or self._log_note_bytes > self.max_log_note_bytes
        ):
            entry = log[self._head]
            assert entry is not None
            log[self._head] = None
            self._head += 1
            self._log_note_bytes -= len(entry[0].note)
            self._dropped_upto = entry[0].seq
        if self._head > 1024 and self._head * 2 > len(log):
            del log[: self._head]  # (amortized: at most once per _head entries dropped)
            self._head = 0

    # -- readers ---------------------------------------------------------------------------
    @property
    def seq(self) -> int:
        """The sequence number of the last event (0: none yet)."""
        return self._seq

    def read(
        self, namespaces: Sequence[bytes] | AbstractSet[bytes], after: int, limit: int
    ) -> Batch:
        """The events of ``namespaces`` with a sequence number above ``after``, the oldest
        first: at most ``limit`` of them, of those among the :attr:`read_scan` events after
        ``after``, with at most :attr:`read_note_bytes` of notes (one event at least)."""
        if limit < 1:
            raise ValueError("limit must be at least 1")
        wanted = namespaces if isinstance(namespaces, AbstractSet) else set(namespaces)
        with self._lock:
            if after > self._seq or after < self._dropped_upto:
                # Ahead of this feed: another server's numbers (a restart); behind what
                # was dropped: events are missing. Either way, start from a snapshot.
                self.resyncs += 1
                return Batch([], self._seq, True)
            start = self._head + after - self._dropped_upto
            looked_at = self._log[start : start + self.read_scan]
        newer: list[Event] = []
        size = 0
        last = after
        for event, ns in cast(list[tuple[Event, bytes]], looked_at):  # (from _head on)
            if ns in wanted:
                if len(newer) == limit or (size + len(event.note) > self.read_note_bytes and newer):
                    break
                newer.append(event)
                size += len(event.note)
            last = event.seq
        return Batch(newer, last, False)

    def holds_any(self, namespaces: Iterable[bytes]) -> bool:
        """Whether any of ``namespaces`` holds a noted chunk now. A chunk stored after
        this answer has an event after the reader's cursor, which its next read returns."""
        with self._lock:
            return any(self._held.get(ns) for ns in namespaces)

    def snapshot(self, namespaces: Iterable[bytes]) -> tuple[int, list[Event]]:
        """What ``namespaces`` hold now: (the sequence number it is current at, a stored
        event of sequence number 0 per noted chunk). Reading on after that number keeps it
        current."""
        with self._lock:
            held = [item for ns in namespaces for item in self._held.get(ns, {}).items()]
            seq = self._seq
        return seq, [Event(0, CHUNK_STORED, key, note) for key, note in held]

    def figures(self) -> dict[str, int]:
        """For status and metrics."""
        with self._lock:
            return {
                "epoch": self.epoch,
                "seq": self._seq,
                "log_events": len(self._log) - self._head,
                "log_note_bytes": self._log_note_bytes,
                "held_chunks": sum(len(h) for h in self._held.values()),
                "held_note_bytes": self.held_note_bytes,
                "away_chunks": len(self._away),
                "away_note_bytes": self._away_cost - AWAY_ENTRY_BYTES * len(self._away),
                "resyncs": self.resyncs,
            }


PAGE_CHUNKS = 4096  # chunks in one snapshot page at most
PAGE_NOTE_BYTES = 2**20  # notes in one snapshot page at most (a page holds one at least)
SNAPSHOT_TTL = 60.0  # seconds a snapshot waits for its next page


@dataclass(slots=True)
class _Open:
    seq: int
    chunks: list[Event]
    next_page: int
    start: int  # index in chunks of the next page's first chunk
    deadline: float


class SnapshotPages:
    """The snapshots clients are reading, one per client, in pages that fit a message.
    A snapshot whose next page is not asked for within :data:`SNAPSHOT_TTL` is dropped
    (:meth:`expire`), so a client that died reading one leaves nothing behind. Thread-safe
    (pages are served on the RPC loop's worker pool: taking a snapshot of a large pool is a
    walk over its noted chunks)."""

    def __init__(self, ttl: float = SNAPSHOT_TTL) -> None:
        self.ttl = ttl
        self._lock = threading.Lock()
        self._open: dict[int, _Open] = {}  # client token -> its snapshot

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def first(self, client: int, seq: int, chunks: list[Event], now: float) -> Page:
        """Page 0 of a new snapshot (replacing the client's previous one)."""
        with self._lock:
            self._open.pop(client, None)
            return self._page(client, _Open(seq, chunks, 0, 0, 0.0), now)

    def next(self, client: int, page: int, now: float) -> Page | None:
        """Page ``page`` of the client's snapshot; None: no such page open (never taken,
        expired, or not the next one)."""
        with self._lock:
            pages = self._open.get(client)
            if pages is None or pages.next_page != page or pages.deadline < now:
                return None
            return self._page(client, pages, now)

    def _page(self, client: int, pages: _Open, now: float) -> Page:
        chunks, start = pages.chunks, pages.start
        end, size = start, 0
        while end < len(chunks) and end - start < PAGE_CHUNKS:
            size += len(chunks[end].note)
            if size > PAGE_NOTE_BYTES and end > start:
                break
            end += 1
        if end >= len(chunks):
            self._open.pop(client, None)
            return Page(pages.seq, chunks[start:end], 0)
        pages.start, pages.next_page, pages.deadline = end, pages.next_page + 1, now + self.ttl
        self._open[client] = pages
        return Page(pages.seq, chunks[start:end], pages.next_page)

    def expire(self, now: float, registered: Callable[[int], bool]) -> int:
        """Drop snapshots nobody read on in time, and those of clients that are no longer
        ``registered`` (gone, or reaped); returns how many."""
        with self._lock:
            gone = [
                c for c, pages in self._open.items() if pages.deadline < now or not registered(c)
            ]
            for client in gone:
                del self._open[client]
            return len(gone)


@dataclass(frozen=True, slots=True)
class Page:
    """One page of a snapshot: ``seq``, the snapshot's sequence number."""

    seq: int
    chunks: list[Event]
    next_page: int  # 0: the last one
