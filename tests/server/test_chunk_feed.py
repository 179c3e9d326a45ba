"""The chunk feed as a structure, fed by a real pool index: noted chunks announced once
committed, withdrawn by every way the pool lets go of them, bounded, and a reader that
fell behind or meets another server resyncs from a snapshot and converges."""

from __future__ import annotations

import random

import pytest

from tierkv import protocol as p
from tierkv.allocator import Allocator
from tierkv.chunk_follower import ChunkFollower
from tierkv.index import Holder, ObjectIndex
from tierkv.server.chunk_feed import AWAY_ENTRY_BYTES, PAGE_CHUNKS, ChunkFeed, SnapshotPages

NS_A, NS_B = b"A" * 16, b"B" * 16
LEN = 4096


def key(ns: bytes, i: int) -> bytes:
    return ns + i.to_bytes(16, "big")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fed_index(slots: int = 64, max_events: int = 1000) -> tuple[ObjectIndex, ChunkFeed, Clock]:
    clock = Clock()
    index = ObjectIndex(Allocator(slots * LEN, LEN), write_ttl=5, read_ttl=5, clock=clock)
    feed = ChunkFeed(max_events)
    index.on_stored, index.on_removed = feed.stored, feed.removed
    index.notes_of = feed.notes_of
    return index, feed, clock


def store(index: ObjectIndex, keys: list[bytes], notes: list[bytes] | None = None) -> None:
    res = index.reserve_write(keys, LEN, holder=1, notes=notes)
    if res.lease_id:  # 0: all present already
        index.commit(res.lease_id, 1)


class Reader(ChunkFollower):
    """An engine following ``feed`` for ``namespaces`` (as the server's RPC would)."""

    def __init__(self, feed: ChunkFeed, namespaces: set[bytes]) -> None:
        self.feed = feed
        super().__init__(self._events, self._snapshot)
        self.namespaces = namespaces

    def _events(self, after: int, limit: int) -> p.ChunkEvents:
        batch = self.feed.read(self.namespaces, after, limit)
        return p.ChunkEvents(0, self.feed.epoch, batch.events, batch.last, batch.resync)

    def _snapshot(self) -> tuple[int, int, list[p.ChunkEvent]]:
        return (self.feed.epoch, *self.feed.snapshot(self.namespaces))

    def catch_up(self, limit: int = 7) -> None:
        self.limit = limit
        self.poll()


def test_noted_commits_are_announced_to_their_namespace_only() -> None:
    index, feed, _ = fed_index()
    a = [key(NS_A, i) for i in range(3)]
    store(index, a, [b"a0", b"a1", b""])  # the third has no note: nothing to announce
    store(index, [key(NS_B, 0)], [b"b0"])
    batch = feed.read({NS_A}, 0, 100)
    assert [(e.kind, e.key, e.note) for e in batch.events] == [
        (p.CHUNK_STORED, a[0], b"a0"),
        (p.CHUNK_STORED, a[1], b"a1"),
    ]
    assert not batch.resync and batch.last == feed.seq == 3
    assert [e.note for e in feed.read({NS_B}, 0, 100).events] == [b"b0"]
    assert feed.read({NS_A, NS_B}, 2, 100).events[0].note == b"b0"


def test_an_uncommitted_store_is_never_announced() -> None:
    index, feed, clock = fed_index()
    aborted = index.reserve_write([key(NS_A, 1)], LEN, holder=1, notes=[b"x"])
    index.abort(aborted.lease_id, 1)
    index.reserve_write([key(NS_A, 2)], LEN, holder=1, notes=[b"y"])  # never committed
    clock.now = 10.0  # its write lease expires
    index.expire()
    partial = index.reserve_write([key(NS_A, 3), key(NS_A, 4)], LEN, holder=1, notes=[b"3", b"4"])
    index.commit(partial.lease_id, 1, only=[1])  # the first is aborted
    assert [e.note for e in feed.read({NS_A}, 0, 100).events] == [b"4"]


@pytest.mark.parametrize("how", ["delete", "clear_ns", "clear_all", "evict", "quota"])
def test_every_way_the_pool_lets_go_withdraws_the_chunk(how: str) -> None:
    index, feed, _ = fed_index()
    ks = [key(NS_A, i) for i in range(4)]
    store(index, ks, [b"n%d" % i for i in range(4)])
    store(index, [key(NS_B, 0)], [b"other"])
    if how == "delete":
        index.delete([ks[1], ks[1], key(NS_A, 99)])  # twice, and one never stored
        gone = [ks[1]]
    elif how == "clear_ns":
        index.clear(NS_A)
        gone = ks
    elif how == "clear_all":
        index.clear()
        gone = ks
    elif how == "evict":
        index.evict(2 * LEN)  # the two least recently used (the batch's last chunks)
        gone = ks[2:]
    else:
        index.tenants.by_digest[NS_A] = 5  # NS_A's chunks belong to tenant 5 from now on
        for k in ks:  # (re-stored so that they are charged to it)
            index.delete([k])
        store(index, ks, [b"n%d" % i for i in range(4)])
        index.set_quotas({5: 2 * LEN}, None, hard=False)
        index.evict_over_quota()
        gone = ks[2:]
    assert index.contains(gone) == [False] * len(gone)
    reader = Reader(feed, {NS_A})
    reader.catch_up()
    assert set(reader.held) == set(ks) - set(gone)
    assert reader.held == dict((ev.key, ev.note) for ev in feed.snapshot({NS_A})[1]), (
        "the events and the snapshot agree"
    )


def test_a_read_locked_chunk_that_is_cleared_is_withdrawn_at_once() -> None:
    """The pool stops offering it when it is cleared, although a reader still holds it."""
    index, feed, _ = fed_index()
    k = key(NS_A, 0)
    store(index, [k], [b"n"])
    lock = index.lock_read([k], holder=2)
    index.clear(NS_A)
    assert [e.kind for e in feed.read({NS_A}, 0, 10).events] == [p.CHUNK_STORED, p.CHUNK_REMOVED]
    index.release_read(lock.lease_id, 2)
    assert feed.read({NS_A}, 2, 10).events == []


def test_a_reader_behind_what_was_dropped_resyncs_and_converges() -> None:
    """Random stores, deletes and evictions with a log of 16 events; readers at different
    paces (one reads only at the end) all end at what the pool holds."""
    index, feed, _ = fed_index(slots=40, max_events=16)
    rng = random.Random(7)
    eager, late = Reader(feed, {NS_A}), Reader(feed, {NS_A})
    for step in range(600):
        i = rng.randrange(80)
        op = rng.random()
        if op < 0.6:
            index.evict(LEN) if index.capacity - index.used < LEN else None
            store(index, [key(NS_A, i)], [b"note-%d-%d" % (i, step)])
        elif op < 0.8:
            index.delete([key(NS_A, i)])
        else:
            index.evict(LEN * rng.randrange(1, 4))
        if step % 5 == 0:
            eager.catch_up(limit=3)
    for reader in (eager, late):
        reader.catch_up()
        truth = {ev.key: ev.note for ev in feed.snapshot({NS_A})[1]}
        assert reader.held == truth
        assert set(truth) == {k for k in truth if index.contains([k])[0]}
    assert late.resyncs >= 1 and feed.figures()["log_events"] <= 16


def test_a_poll_stops_once_its_room_is_queued_and_the_next_goes_on() -> None:
    """A poller reads only while fewer than its maximum of changes wait: a feed that
    refills as fast as it is read no longer keeps one poll reading (and queueing) for ever."""
    index, feed, _ = fed_index(slots=64)
    keys = [key(NS_A, i) for i in range(50)]
    store(index, keys, [b"n%d" % i for i in range(50)])
    reader = Reader(feed, {NS_A})
    reader.limit = 7
    reader.epoch, reader.after = feed.epoch, 0  # following from the start: no snapshot
    first = reader.poll(room=10)
    assert 10 <= first < 10 + 7  # it stops after the read that filled the room
    assert reader.poll() == 50 - first  # the next poll goes on from there
    assert reader.held == {k: b"n%d" % i for i, k in enumerate(keys)}
    assert [c.key for c in reader.take()] == keys


def test_a_feed_that_asks_for_a_resync_every_time_costs_one_snapshot_a_poll() -> None:
    """A reader whose namespaces keep changing (a new cache salt at every request) is
    told to resync at every read: each poll reads one snapshot, then returns."""
    index, feed, _ = fed_index()
    store(index, [key(NS_A, 1)], [b"n"])
    reads = 0

    class Restless(Reader):
        def _events(self, after: int, limit: int) -> p.ChunkEvents:
            nonlocal reads
            reads += 1
            assert reads < 100, "the poll never returned"
            return p.ChunkEvents(0, self.feed.epoch, [], after, True)

    reader = Restless(feed, {NS_A})
    assert reader.poll() == 1 and reader.resyncs == 1
    assert reader.poll() == 0 and reader.resyncs == 2


def test_another_server_means_a_resync() -> None:
    _, old, _ = fed_index()
    index, new, _ = fed_index()
    store(index, [key(NS_A, 1)], [b"n"])
    reader = Reader(old, {NS_A})
    reader.held = {key(NS_A, 0): b"gone with the old server"}
    reader.epoch, reader.after = old.epoch, 5
    reader.feed = new  # the server restarted: a new feed (another epoch)
    reader.catch_up()
    assert reader.held == {key(NS_A, 1): b"n"} and reader.resyncs == 1
    # A cursor ahead of this feed is another server's too, whatever the epoch says.
    assert new.read({NS_A}, 99, 10).resync


@pytest.mark.parametrize("holder", [Holder.PREFETCH, Holder.PEER_PROMOTE])
def test_a_chunk_back_from_a_tier_is_announced_again_with_its_note(holder: int) -> None:
    """A noted chunk evicted (its copy on disk) and brought back by a prefetch or a
    promotion for a peer (which reserve it with no note) was loadable but never announced
    again: routers, told it was removed, never heard it was back."""
    index, feed, _ = fed_index()
    ks = [key(NS_A, i) for i in range(3)]
    store(index, ks, [b"n0", b"n1", b""])
    index.evict(3 * LEN)
    back = index.reserve_write([*ks, key(NS_A, 9)], LEN, holder, tier="disk")
    index.commit(back.lease_id, holder)
    reader = Reader(feed, {NS_A})
    reader.catch_up()
    assert reader.held == {ks[0]: b"n0", ks[1]: b"n1"}  # the one without a note stays so
    kinds = [(e.kind, e.note) for e in feed.read({NS_A}, 4, 10).events]
    assert kinds == [(p.CHUNK_STORED, b"n0"), (p.CHUNK_STORED, b"n1")]
    assert feed.figures()["away_chunks"] == 0  # taken back


def test_the_notes_of_chunks_away_are_bounded_oldest_first() -> None:
    index, _, _ = fed_index(slots=64)
    feed = ChunkFeed(max_away_note_bytes=3 * (1000 + AWAY_ENTRY_BYTES))
    index.on_stored, index.on_removed, index.notes_of = feed.stored, feed.removed, feed.notes_of
    ks = [key(NS_A, i) for i in range(5)]
    store(index, ks, [bytes([i]) * 1000 for i in range(5)])
    index.clear(NS_A)
    figures = feed.figures()
    assert figures["away_chunks"] == 3 and figures["away_note_bytes"] == 3000
    assert feed.notes_of(ks) == [b"", b""] + [bytes([i]) * 1000 for i in (2, 3, 4)]
    assert feed.notes_of([key(NS_B, 0)]) is None


def test_the_log_is_bounded_by_events_and_by_note_bytes() -> None:
    index, _, _ = fed_index(slots=64)
    feed = ChunkFeed(max_events=1000, max_log_note_bytes=10_000)
    index.on_stored, index.on_removed = feed.stored, feed.removed
    store(index, [key(NS_A, i) for i in range(30)], [bytes(1000)] * 30)
    figures = feed.figures()
    assert figures["log_note_bytes"] <= 10_000 and figures["log_events"] == 10
    assert figures["held_chunks"] == 30 and figures["held_note_bytes"] == 30_000
    assert feed.read({NS_A}, 0, 100).resync and not feed.read({NS_A}, 20, 100).resync


def test_a_read_looks_at_a_bounded_part_of_the_log_and_the_reader_reads_on() -> None:
    """Reads are served on the RPC loop: one looks at ``read_scan`` events at most, found
    by sequence number (a reader asking from the far end of a full log again and again
    cost a walk of the whole log each time), and returns ``read_note_bytes`` of notes at
    most; a batch that ends short, even with no events of the reader's, is read on from."""
    index, _, _ = fed_index(slots=64)
    feed = ChunkFeed(max_events=1000, read_scan=10, read_note_bytes=2500)
    index.on_stored, index.on_removed = feed.stored, feed.removed
    store(index, [key(NS_B, i) for i in range(40)], [b"b"] * 40)
    store(index, [key(NS_A, i) for i in range(5)], [bytes([i]) * 1000 for i in range(5)])
    first = feed.read({NS_A}, 0, 100)
    assert (first.events, first.last, first.resync) == ([], 10, False)
    assert feed.read({NS_A}, 38, 100).last == 42  # 2 of B, then 2 notes of A: 2000 bytes
    assert [e.seq for e in feed.read({NS_A}, 38, 100).events] == [41, 42]
    assert [e.seq for e in feed.read({NS_A}, 38, 1).events] == [41]
    big = ChunkFeed(read_note_bytes=10)
    big.stored([(key(NS_A, 0), bytes(100))])
    assert [e.seq for e in big.read({NS_A}, 0, 10).events] == [1]  # one event at least
    reader = Reader(feed, {NS_A})
    reader.epoch, reader.after = feed.epoch, 0  # following from the start: no snapshot
    assert reader.poll() == 5 and reader.after == 45
    assert reader.held == {key(NS_A, i): bytes([i]) * 1000 for i in range(5)}


def test_reads_from_any_place_return_the_log_in_order_as_it_is_trimmed() -> None:
    """Against a model of every event: reads from random places, with random limits and
    bounds, return exactly the namespace's events after the place while the log keeps
    them (past the point where dropped entries are cut off the log's front)."""
    rng = random.Random(11)
    feed = ChunkFeed(max_events=300, read_scan=37, read_note_bytes=50)
    logged: list[tuple[int, bytes]] = []  # (seq, namespace) of every event
    for step in range(4000):
        ns = rng.choice((NS_A, NS_B))
        k = key(ns, rng.randrange(100))
        if rng.random() < 0.6:
            feed.stored([(k, b"x" * rng.randrange(1, 20))])
        else:
            feed.removed([k])
        logged += [(feed.seq, ns)] if feed.seq > len(logged) else []
        if step % 97:
            continue
        oldest = feed.seq - feed.figures()["log_events"]
        after = rng.randrange(oldest, feed.seq + 1)
        want = [seq for seq, ns in logged if seq > after and ns == NS_A]
        got: list[int] = []
        while True:
            batch = feed.read({NS_A}, after, rng.randrange(1, 9))
            assert not batch.resync and batch.last >= after
            got += [e.seq for e in batch.events]
            if batch.last == after:
                break
            after = batch.last
        assert got == want and after == feed.seq
    assert feed.read({NS_A}, feed.seq - 301, 5).resync


def test_snapshot_pages() -> None:
    clock = Clock()
    pages = SnapshotPages(ttl=5.0)
    chunks = [p.ChunkEvent(0, p.CHUNK_STORED, key(NS_A, i), b"") for i in range(PAGE_CHUNKS + 5)]
    first = pages.first(client=1, seq=42, chunks=chunks, now=clock.now)
    assert len(first.chunks) == PAGE_CHUNKS and first.next_page == 1 and first.seq == 42
    assert pages.next(1, 2, clock.now) is None  # not the next page
    assert pages.next(2, 1, clock.now) is None  # not this client's
    last = pages.next(1, 1, clock.now)
    assert last is not None and len(last.chunks) == 5 and last.next_page == 0
    assert len(pages) == 0  # read to the end: nothing kept
    # Large notes: a page holds at most 1 MiB of them, but always one chunk.
    big = [p.ChunkEvent(0, p.CHUNK_STORED, key(NS_A, i), bytes(600_000)) for i in range(3)]
    got = pages.first(1, 1, big, clock.now)
    assert len(got.chunks) == 1 and got.next_page == 1
    clock.now = 10.0
    assert pages.expire(clock.now, lambda c: True) == 1 and pages.next(1, 1, clock.now) is None
    pages.first(1, 1, big, clock.now)
    pages.first(2, 1, big, clock.now)
    assert pages.expire(clock.now, lambda c: c == 2) == 1 and len(pages) == 1  # 1 went away


def test_notes_must_match_the_keys() -> None:
    index, _, _ = fed_index()
    with pytest.raises(ValueError, match="2 keys but 1 notes"):
        index.reserve_write([key(NS_A, 0), key(NS_A, 1)], LEN, holder=1, notes=[b"x"])
    assert index.used == 0


def test_the_changes_to_announce_converge_whatever_was_missed() -> None:
    """What an engine announces is the sum of the changes it took; after a resync the
    changes carry the removed chunks' old notes (the server's removals carry keys only)."""
    index, feed, _ = fed_index(slots=64, max_events=4)
    reader = Reader(feed, {NS_A})
    announced: dict[bytes, bytes] = {}

    def publish() -> None:
        reader.catch_up()
        for change in reader.take():
            if change.held:
                announced[change.key] = change.note
            else:
                assert announced.pop(change.key) == change.note

    store(index, [key(NS_A, i) for i in range(3)], [b"a", b"b", b"c"])
    publish()
    assert announced == {key(NS_A, 0): b"a", key(NS_A, 1): b"b", key(NS_A, 2): b"c"}
    index.delete([key(NS_A, 0)])
    store(index, [key(NS_A, i) for i in range(3, 9)], [b"%d" % i for i in range(3, 9)])
    index.delete([key(NS_A, 1)])
    store(index, [key(NS_A, 1)], [b"b again"])  # re-stored with another note
    publish()  # far behind: a resync
    assert reader.resyncs == 2
    assert announced == {ev.key: ev.note for ev in feed.snapshot({NS_A})[1]}
    assert announced[key(NS_A, 1)] == b"b again"
    assert reader.forget() == len(announced)
    gone = reader.take()
    assert {c.key for c in gone} == set(announced) and not any(c.held for c in gone)
    assert reader.take() == [] and reader.held == {}
    for change in gone:
        assert announced.pop(change.key) == change.note
    publish()  # starts afresh
    assert reader.resyncs == 3 and announced == {ev.key: ev.note for ev in feed.snapshot({NS_A})[1]}
