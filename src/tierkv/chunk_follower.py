"""An engine's view of what its server's pool holds, kept from the server's chunk feed
(:mod:`tierkv.server.chunk_feed`), and the changes to announce to routers.

:class:`ChunkFollower` reads the feed of one client's namespaces (:meth:`poll`), keeps the
noted chunks they hold (key -> note), and queues each change as a :class:`Change` for the
engine to publish (:meth:`take`): a chunk now held (with its note), or one no longer held
(with the note it had, which says what to withdraw: the server's removal events carry the
key alone). When the feed says the follower fell behind, or the server is another one (a
restart: another epoch), the follower reads a snapshot and queues the difference between
what it held and the snapshot, so that what was announced converges to what the pool holds
whatever was missed.

Not thread-safe by itself beyond :meth:`take`: one thread polls (the engine's connector
runs a poller), any thread takes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from tierkv import protocol as p

ReadEvents = Callable[[int, int], p.ChunkEvents]  # (after, limit) -> events
ReadSnapshot = Callable[[], tuple[int, int, list[p.ChunkEvent]]]  # -> (epoch, seq, chunks)


@dataclass(frozen=True, slots=True)
class Change:
    """``held``: the chunk is now held (True) or no longer (False); ``note``: its note."""

    held: bool
    key: bytes
    note: bytes


class ChunkFollower:
    """What a client's namespaces hold, from the chunk feed; the changes to announce."""

    def __init__(self, read_events: ReadEvents, read_snapshot: ReadSnapshot, limit: int = 4096):
        self._read_events = read_events
        self._read_snapshot = read_snapshot
        self.limit = limit
        self.held: dict[bytes, bytes] = {}
        self.epoch = 0  # the feed's; 0: none read yet
        self.after = 0
        self.resyncs = 0
        self._changes: list[Change] = []
        self._lock = threading.Lock()

    def poll(self, room: int | None = None) -> int:
        """Read the feed until caught up, or until ``room`` changes are queued (the next
        poll goes on from there), reading one snapshot at most (a second resync waits for
        the next poll: a feed whose namespaces keep changing never keeps it reading);
        returns the number of changes queued."""
        queued = 0
        resynced = False
        while room is None or queued < room:
            reply = self._read_events(self.after, self.limit) if self.epoch else None
            if reply is None or reply.resync or reply.epoch != self.epoch:
                if resynced:
                    break
                resynced = True
                queued += self._resync()
                continue
            changes = []
            before = self.after
            held = self.held
            for ev in reply.events:
                if ev.kind == p.CHUNK_STORED:
                    if held.get(ev.key) != ev.note:
                        held[ev.key] = ev.note
                        changes.append(Change(True, ev.key, ev.note))
                elif (note := held.pop(ev.key, None)) is not None:
                    changes.append(Change(False, ev.key, note))
            self.after = reply.last
            queued += self._queue(changes)
            if not reply.events and reply.last == before:
                break  # caught up (a batch without events may still move on: read on)
        return queued

    def _resync(self) -> int:
        self.resyncs += 1
        epoch, seq, chunks = self._read_snapshot()
        now = {ev.key: ev.note for ev in chunks}
        old = self.held
        changes = [Change(False, k, n) for k, n in old.items() if now.get(k) != n]
        changes += [Change(True, k, n) for k, n in now.items() if old.get(k) != n]
        self.held, self.epoch, self.after = now, epoch, seq
        return self._queue(changes)

    def _queue(self, changes: list[Change]) -> int:
        if changes:
            with self._lock:
                self._changes += changes
        return len(changes)

    @property
    def pending(self) -> int:
        """Changes queued and not taken yet."""
        with self._lock:
            return len(self._changes)

    def take(self) -> list[Change]:
        """The changes queued since the last take, in order."""
        with self._lock:
            changes, self._changes = self._changes, []
        return changes

    def forget(self) -> int:
        """The server is gone, or cannot serve (the engine shuts down, or its link to the
        server is down): every held chunk becomes a queued change to "no longer held" (for
        :meth:`take`); the next poll starts afresh from a snapshot. Returns the changes
        queued. Called by the polling thread."""
        changes = [Change(False, k, n) for k, n in self.held.items()]
        self.held, self.epoch, self.after = {}, 0, 0
        return self._queue(changes)
