"""The chunk feed through a real server: engines (clients in processes of their own) that
share a namespace all read what any of them stored with a note, and every removal (clear,
eviction, quota); a reader that fell behind, or whose server restarted, resyncs and ends
at the truth; bad requests get clear errors; a reader killed mid-snapshot leaves nothing.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from support.httputil import free_port, get_json, request
from support.servers import CHUNK_BYTES, CHUNK_SIZE, ServerProcess, chunk_data, register
from tierkv import protocol as p
from tierkv.chunk_follower import ChunkFollower
from tierkv.client import Client, NotRegisteredError, ServerError
from tierkv.client.selectors import selector

pytestmark = pytest.mark.processes


def toks(start: int, n_chunks: int) -> list[int]:
    return list(range(start, start + n_chunks * CHUNK_SIZE))


def note(tokens: list[int], i: int) -> bytes:
    return f"chunk {i} of prompt {tokens[0]}".encode()


def store(client: Client, tokens: list[int], n: int, noted: bool = True) -> None:
    notes = [note(tokens, i) for i in range(n)] if noted else None
    got = client.store(tokens, [chunk_data(tokens, i) for i in range(n)], notes=notes)
    assert got.stored == list(range(n)), got


def store_all(client: Client, tokens: list[int], n: int) -> None:
    """:func:`store`, again for the chunks a full pool skipped (a store never waits for the
    eviction it wakes: on a busy machine the pass that makes room may come a little later),
    until every chunk is held (bounded)."""
    notes = [note(tokens, i) for i in range(n)]
    deadline = time.monotonic() + 10
    while True:
        got = client.store(tokens, [chunk_data(tokens, i) for i in range(n)], notes=notes)
        assert not got.cleared, got
        if sorted(got.stored + got.present) == list(range(n)):
            return
        assert got.no_space and time.monotonic() < deadline, got
        time.sleep(0.05)


class Follower(ChunkFollower):
    """An engine's view of the pool built only from the feed (what it would announce)."""

    def __init__(self, client: Client) -> None:
        super().__init__(client.read_chunk_events, client.read_chunk_snapshot, limit=5)

    def catch_up(self) -> dict[bytes, bytes]:
        self.poll()
        return self.held

    def notes(self) -> set[bytes]:
        return set(self.catch_up().values())


def test_every_engine_of_the_namespace_reads_what_any_stored(server: ServerProcess) -> None:
    with server.client() as a, server.client() as b, server.client() as other:
        register(a), register(b), register(other, model="another-model")
        fa, fb, fo = Follower(a), Follower(b), Follower(other)
        assert fa.notes() == fb.notes() == set()
        prompt = toks(10, 3)
        store(a, prompt, 3)
        store(b, toks(5000, 1), 1, noted=False)  # no note: nothing to announce
        want = {note(prompt, i) for i in range(3)}
        assert fa.notes() == fb.notes() == want
        assert fo.notes() == set()  # another model's namespace
        again = b.store(prompt, [chunk_data(prompt, i) for i in range(3)], notes=[b"?"] * 3)
        assert again.present == [0, 1, 2]  # already held: nothing new, notes unchanged
        assert fb.catch_up() and fb.after == fa.after
        assert b.clear() == 4
        assert fa.notes() == fb.notes() == set()
        assert fa.resyncs == fb.resyncs == 1  # the first read only


def test_a_reader_whose_namespaces_grow_learns_what_they_already_held(
    server: ServerProcess,
) -> None:
    """A reader's engine gains a namespace (its first request with a cache salt, a rank that
    joins): the chunks that namespace held before are announced too (its next read is a
    resync), not only those stored after."""
    with server.client() as a, server.client() as b:
        register(a), register(b)
        fb = Follower(b)
        assert fb.notes() == set()
        salted = toks(300, 2)
        notes = [note(salted, i) for i in range(2)]
        a.store(salted, [chunk_data(salted, i) for i in range(2)], notes=notes, salt="team-x")
        assert fb.notes() == set()  # b has never used that salt: not its namespace yet
        assert b.lookup(salted, salt="team-x").hits == 2  # now it is
        assert fb.notes() == set(notes)
        assert fb.resyncs == 2
        assert fb.notes() == set(notes) and fb.resyncs == 2  # unchanged: no resync again
        # A namespace gained that holds nothing yet (a new user's cache salt): no snapshot
        # of everything for it; what it stores later comes as events.
        fresh = toks(900, 1)
        assert b.lookup(fresh, salt="user-new").hits == 0
        assert fb.notes() == set(notes) and fb.resyncs == 2
        a.store(fresh, [chunk_data(fresh, 0)], notes=[note(fresh, 0)], salt="user-new")
        assert fb.notes() == {*notes, note(fresh, 0)} and fb.resyncs == 2


def test_evictions_reach_every_reader_and_the_view_equals_the_pool(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """A pool of 24 chunks takes 12 prompts of 4: the oldest go; the readers' views end
    equal to what lookups find, chunk for chunk."""
    srv = server_factory("1MiB")  # 32 slots of 32 KiB; eviction keeps some room free
    with srv.client() as a, srv.client() as b:
        register(a), register(b)
        fa, fb = Follower(a), Follower(b)
        prompts = {1000 * (i + 1): 4 for i in range(12)}
        for start, n in prompts.items():
            store_all(a, toks(start, n), n)
            fb.catch_up()  # b reads as it goes, a only at the end
        deadline = time.monotonic() + 10
        while a.stats().evictions == 0:
            assert time.monotonic() < deadline, "nothing was evicted"
            time.sleep(0.05)

        def in_the_pool() -> set[bytes]:
            """The notes of the chunks a retrieve finds, one chunk at a time."""
            found = set()
            for start, n in prompts.items():
                tokens = toks(start, n)
                for i in range(n):
                    out = [np.zeros_like(chunk_data(tokens, i))]  # type: ignore[call-overload]
                    got = a.retrieve(tokens[: (i + 1) * CHUNK_SIZE], out, first_chunk=i)
                    if got.retrieved == [i]:
                        found.add(note(tokens, i))
            return found

        # Eviction runs in passes beside the test: compare once it has settled (bounded).
        deadline = time.monotonic() + 15
        while (held := fa.notes()) != (truth := in_the_pool()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert held == fb.notes()
        assert 0 < len(held) < 48
        assert held == truth


def test_chunks_prefetched_back_from_disk_are_announced_again(
    server_factory: Callable[..., ServerProcess], tmp_path: Any
) -> None:
    """Noted chunks written behind to disk, then cleared from the pool: a lookup prefetches
    them back (loadable again), and the readers hear of them again, notes and all (the
    prefetch reserved them without notes: they were never announced again)."""
    srv = server_factory(extra=["--tier", f"disk:path={tmp_path / 'disk'}"])
    with srv.client() as a, srv.client() as b:
        register(a), register(b)
        reader = Follower(b)
        prompt = toks(10, 3)
        store(a, prompt, 3)
        deadline = time.monotonic() + 20
        while (s := a.stats()).write_behind_queued or s.tiers[0].written_chunks < 3:
            assert time.monotonic() < deadline, "not written behind"
            time.sleep(0.05)
        want = {note(prompt, i) for i in range(3)}
        assert reader.notes() == want
        assert a.clear() == 3
        assert reader.notes() == set()
        found = b.lookup(prompt, request_id="back", wait=True)
        assert found.hits == 3
        b.free_lookup_locks("back")
        assert reader.notes() == want


def test_a_store_that_never_commits_is_never_announced(
    server_factory: Callable[..., ServerProcess],
) -> None:
    srv = server_factory(extra=["--write-ttl", "0.5"])
    with srv.client() as a, srv.client() as b:
        register(a), register(b)
        fb = Follower(b)
        tokens = toks(1, 2)
        a.prepare_store(tokens, notes=[b"x", b"y"])  # reserved, never written
        deadline = time.monotonic() + 15
        while b.stats().write_leases:  # until the lease expires (bounded)
            assert time.monotonic() < deadline, "the write lease never expired"
            time.sleep(0.05)
        assert fb.notes() == set()


def test_a_reader_far_behind_resyncs(server_factory: Callable[..., ServerProcess]) -> None:
    srv = server_factory(extra=["--chunk-feed-events", "4"])
    with srv.client() as a, srv.client() as b:
        register(a), register(b)
        fb = Follower(b)
        fb.catch_up()
        for start in (100, 2000, 4000):
            store(a, toks(start, 3), 3)
        a.clear()
        store(a, toks(9000, 2), 2)
        assert fb.notes() == {note(toks(9000, 2), i) for i in range(2)}
        assert fb.resyncs == 2
        assert a.stats().chunk_feed["resyncs"] >= 1


def test_a_restarted_server_is_a_new_feed(server_factory: Callable[..., ServerProcess]) -> None:
    srv = server_factory()
    with srv.client(timeout=5.0) as a, srv.client(timeout=5.0) as b:
        register(a), register(b)
        fb = Follower(b)
        store(a, toks(1, 2), 2)
        assert len(fb.notes()) == 2
        old_epoch = fb.epoch
        srv.kill()
        srv.start()
        for c in (a, b):
            with pytest.raises(NotRegisteredError):
                c.read_chunk_events(0)
            register(c)
        store(a, toks(77, 1), 1)
        assert fb.notes() == {note(toks(77, 1), 0)}  # the old server's chunks are gone
        assert fb.epoch != old_epoch


def test_bad_feed_requests_get_clear_errors_and_change_nothing(server: ServerProcess) -> None:
    with server.client() as a:
        register(a)
        store(a, toks(1, 2), 2)
        tokens = toks(500, 2)
        data = [chunk_data(tokens, i) for i in range(2)]
        for notes, match in (
            ([b"one"], "1 notes for 2 chunks"),
            ([b"ok", bytes(65 * 1024)], "note is 66560 bytes"),
        ):
            with pytest.raises(ValueError if len(notes) == 1 else ServerError, match=match):
                a.store(tokens, data, notes=notes)
        # The same, past the client's own check: the server answers BAD_REQUEST.
        with pytest.raises(ServerError, match="1 notes for 2 chunks"):
            sel = selector(tokens, None)
            a._channel.call(p.PrepareStore(*a._ids(), sel, 0, [b"one"]))
        for after, limit in ((-1, 10), (0, 0)):
            with pytest.raises(ServerError, match="after must be >= 0 and limit >= 1"):
                a.read_chunk_events(after, limit)
        with pytest.raises(ServerError, match="no snapshot page 3"):
            a._channel.call(p.ReadChunkSnapshot(a._channel.rid(), a._token(), 3))
        s = a.stats()
        assert s.objects == 2 and s.used == 2 * CHUNK_BYTES and s.write_leases == 0
        assert Follower(a).notes() == {note(toks(1, 2), i) for i in range(2)}
        assert a.lookup(tokens).hits == 0


def read_first_page_and_hang(endpoint: str, ready: Any) -> None:
    client = Client(endpoint)
    register(client)
    reply = client._channel.call(p.ReadChunkSnapshot(client._channel.rid(), client._token(), 0))
    assert reply.next_page == 1
    ready.set()
    time.sleep(3600)


def test_a_reader_killed_mid_snapshot_leaves_nothing(server: ServerProcess) -> None:
    """Three pages of 60 KiB notes; the reader dies after the first: its snapshot goes
    with its registration (the server watches its process)."""
    with server.client() as a:
        register(a)
        tokens = toks(3, 40)
        notes = [bytes([i]) * (60 * 1024) for i in range(40)]
        a.store(tokens, [chunk_data(tokens, i) for i in range(40)], notes=notes)
        _, seq, chunks = a.read_chunk_snapshot()  # every page, in order
        assert sorted(ev.note for ev in chunks) == sorted(notes) and seq == 40
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        proc = ctx.Process(target=read_first_page_and_hang, args=(server.endpoint, ready))
        proc.start()
        try:
            assert ready.wait(60)
            assert a.stats().chunk_feed["open_snapshots"] == 1
        finally:
            os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
            proc.join(30)
        deadline = time.monotonic() + 15
        while a.stats().chunk_feed["open_snapshots"]:
            assert time.monotonic() < deadline, "the dead reader's snapshot was kept"
            time.sleep(0.1)
        assert a.stats().clients == 1


def test_the_feed_in_status_and_metrics(server_factory: Callable[..., ServerProcess]) -> None:
    port = free_port()
    srv = server_factory(extra=["--http-port", str(port)])
    with srv.client() as a:
        register(a)
        store(a, toks(1, 3), 3)
        a.clear()
        feed = get_json(f"http://127.0.0.1:{port}/status")["chunk_feed"]
        assert feed["seq"] == 6 and feed["held_chunks"] == 0 and feed["epoch"] > 0
        reply = request("GET", f"http://127.0.0.1:{port}/metrics")
        text = reply.body.decode()
        assert reply.status == 200
        assert "tierkv_chunk_feed_events_total 6.0" in text
        assert "tierkv_chunk_feed_held_chunks 0.0" in text
