"""A real server process and a client: register, store, look up, retrieve byte-exact."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import msgspec
import numpy as np
import pytest

from support.servers import CHUNK_SHAPE, ServerProcess, chunk_data, register
from tierkv import protocol as p
from tierkv.client import LayoutError, ServerError


def test_store_lookup_retrieve_roundtrip(server: ServerProcess) -> None:
    tokens = list(range(1000, 1000 + 256 * 4 + 100))
    with server.client() as client:
        register(client)
        stored = client.store(tokens, [chunk_data(tokens, i) for i in range(4)])
        assert stored.stored == [0, 1, 2, 3] and not stored.no_space
        assert client.lookup(tokens, request_id="r1").hits == 4
        out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(4)]
        got = client.retrieve(request_id="r1", out=out)
        assert got.retrieved == [0, 1, 2, 3] and got.complete
        for i in range(4):
            np.testing.assert_array_equal(out[i], chunk_data(tokens, i))
        stats = client.stats()
        assert stats.read_locked == 0 and stats.write_leases == 0 and stats.read_leases == 0


@pytest.mark.parametrize(
    ("copy_threads", "parallel_callbacks"), [(1, False), (3, False), (3, True)]
)
def test_large_batches_roundtrip_with_any_number_of_copy_threads(
    server: ServerProcess, copy_threads: int, parallel_callbacks: bool
) -> None:
    """12 chunks of 1 MiB (above the copier's threshold): arrays and callbacks, byte-exact,
    whether the copies run on one thread or several."""
    shape = (2, 256, 512)  # float32: 1 MiB per chunk
    rng = np.random.default_rng(copy_threads)
    data = [rng.random(shape, dtype=np.float32) for _ in range(12)]
    tokens = list(range(7, 7 + 256 * 12))
    with server.client(copy_threads=copy_threads, parallel_callbacks=parallel_callbacks) as c:
        c.register("big-model", shape, "float32", token_axis=1)
        assert c.store(tokens[: 256 * 6], data[:6]).stored == list(range(6))

        def gather(chunk: int, dst: np.ndarray) -> None:  # type: ignore[type-arg]
            np.copyto(dst, data[chunk])

        assert c.store(tokens, gather=gather, first_chunk=6).stored == list(range(6, 12))
        out = [np.zeros(shape, np.float32) for _ in range(12)]
        got = c.retrieve(tokens, out)
        assert got.retrieved == list(range(12)) and got.complete
        scattered: dict[int, np.ndarray] = {}  # type: ignore[type-arg]
        c.retrieve(tokens, scatter=lambda chunk, src: scattered.__setitem__(chunk, src.copy()))
        for i in range(12):
            np.testing.assert_array_equal(out[i], data[i])
            np.testing.assert_array_equal(scattered[i], data[i])
        stats = c.stats()
        assert stats.read_locked == 0 and stats.write_leases == 0 and stats.read_leases == 0


def test_a_caller_that_copies_takes_chunks_beside_the_copy_threads(server: ServerProcess) -> None:
    """``caller_copies``: a thread that would only wait (a vLLM worker's forward thread)
    copies chunks too, byte-exact; by default (data priority) it only waits."""
    shape = (2, 256, 512)  # float32: 1 MiB per chunk, 12 above the copier's threshold
    data = [np.random.default_rng(i).random(shape, dtype=np.float32) for i in range(12)]
    tokens = list(range(11, 11 + 256 * 12))
    me = threading.current_thread().name
    with server.client(copy_threads=2, parallel_callbacks=True) as c:
        c.register("big-model", shape, "float32", token_axis=1)
        where: list[str] = []

        def gather(chunk: int, dst: np.ndarray) -> None:  # type: ignore[type-arg]
            where.append(threading.current_thread().name)
            np.copyto(dst, data[chunk])
            time.sleep(0.005)  # every thread gets some

        assert c.store(tokens[: 256 * 6], gather=gather).stored == list(range(6))
        assert me not in where
        where.clear()
        stored = c.store(tokens, gather=gather, first_chunk=6, caller_copies=True).stored
        assert stored == list(range(6, 12))
        assert me in where and set(where) - {me}
        out = [np.zeros(shape, np.float32) for _ in range(12)]
        where.clear()

        def scatter(chunk: int, src: np.ndarray) -> None:  # type: ignore[type-arg]
            where.append(threading.current_thread().name)
            np.copyto(out[chunk], src)
            time.sleep(0.005)

        assert c.retrieve(tokens, scatter=scatter, caller_copies=True).complete
        assert me in where and set(where) - {me}
        for i in range(12):
            np.testing.assert_array_equal(out[i], data[i])
        stats = c.stats()
        assert stats.read_locked == 0 and stats.write_leases == 0 and stats.read_leases == 0


def test_host_tensors_of_any_dtype_go_through_the_streaming_copy(server: ServerProcess) -> None:
    """bfloat16 tensors in host memory (numpy has no bfloat16) are stored from and retrieved
    into as they are, strided ones too; anything that is neither an array nor a tensor is a
    LayoutError that leaves nothing behind."""
    torch = pytest.importorskip("torch")
    shape = (2, 256, 64)
    tokens = list(range(256 * 3))
    gen = torch.Generator().manual_seed(4)
    chunks = [torch.randn((2, 64, 256), generator=gen).to(torch.bfloat16).transpose(1, 2)]
    chunks += [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(2)]
    with server.client(copy_threads=2) as c:
        c.register("bf16-model", shape, "bfloat16", token_axis=1)
        for bad in ([b"x" * 65536] * 3, [[0.0] * 4] * 3):
            with pytest.raises(LayoutError, match="numpy array or a torch tensor"):
                c.store(tokens, bad)
        assert c.stats().objects == 0 and c.stats().write_leases == 0
        assert c.store(tokens, chunks).stored == [0, 1, 2]
        out = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(3)]
        assert c.retrieve(tokens, out).complete
        for got, want in zip(out, chunks, strict=True):
            assert torch.equal(got, want)


def test_a_failing_copy_aborts_the_store_and_keeps_serving(server: ServerProcess) -> None:
    """One chunk of a parallel batch does not fit its slot: the store raises, nothing of it
    is committed, no lease stays behind, and the next store works."""
    shape = (2, 256, 512)
    tokens = list(range(256 * 8))
    good = [np.ones(shape, np.float32) for _ in range(8)]
    bad = list(good)
    bad[5] = np.ones((2, 256, 256), np.float32)
    with server.client(copy_threads=3) as c:
        c.register("big-model", shape, "float32", token_axis=1)
        with pytest.raises(LayoutError):
            c.store(tokens, bad)
        stats = c.stats()
        assert stats.objects == 0 and stats.write_leases == 0
        assert c.store(tokens, good).stored == list(range(8))


def test_a_store_reserved_ahead_finishes_aborts_or_is_refused_whole(server: ServerProcess) -> None:
    """prepare_store reserves (nothing is visible yet); finish_store copies and commits;
    abort_store gives the slots back; a wrong number of chunks aborts without writing; a
    reservation that was given back cannot be committed."""
    tokens = list(range(5000, 5000 + 256 * 3))
    data = [chunk_data(tokens, i) for i in range(3)]
    with server.client() as client:
        register(client)
        prepared = client.prepare_store(tokens)
        assert [s.chunk for s in prepared.slots.slots] == [0, 1, 2]
        stats = client.stats()
        assert stats.write_leases == 1 and stats.writing == 3 and stats.objects == 3
        assert client.lookup(tokens).hits == 0  # reserved, not stored
        client.abort_store(prepared)
        stats = client.stats()
        assert stats.write_leases == 0 and stats.objects == 0
        with pytest.raises(ServerError, match="lease"):
            client.finish_store(prepared, data)  # its slots may be someone else's by now
        assert client.stats().objects == 0

        prepared = client.prepare_store(tokens)
        with pytest.raises(ValueError, match="2 chunk arrays given for 3 chunks"):
            client.finish_store(prepared, data[:2])
        assert client.stats().write_leases == 0

        prepared = client.prepare_store(tokens, first_chunk=1)
        assert client.finish_store(prepared, data[1:]).stored == [1, 2]
        again = client.prepare_store(tokens)  # chunks 1 and 2 are there: only 0 is reserved
        assert again.slots.present == [1, 2] and [s.chunk for s in again.slots.slots] == [0]
        assert client.finish_store(
            again, gather=lambda i, dst: dst.__setitem__(..., data[i])
        ).stored == [0]
        out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(3)]
        assert client.retrieve(tokens, out).complete
        for i in range(3):
            np.testing.assert_array_equal(out[i], data[i])
        assert client.stats().write_leases == 0


def test_a_retrieve_that_does_not_wait_for_its_release(
    server: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """wait_release=False: the retrieve returns once the release is sent; the next call on
    the connection reads its answer (no reconnect) and finds the locks released. A release
    that fails is logged and the connection serves on."""
    tokens = list(range(7000, 7000 + 256 * 2))
    data = [chunk_data(tokens, i) for i in range(2)]
    with server.client() as client:
        register(client)
        client.store(tokens, data)
        assert client.lookup(tokens, request_id="r").hits == 2
        out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(2)]
        assert client.retrieve(request_id="r", out=out, wait_release=False).complete
        for i in range(2):
            np.testing.assert_array_equal(out[i], data[i])
        conn = client._channel.conn
        time.sleep(0.2)  # the release's answer is waiting on the connection
        stats = client.stats()
        assert stats.read_locked == 0 and stats.read_leases == 0 and stats.sessions == 0
        assert client._channel.conn is conn and not client._channel.unanswered

        bogus = p.FinishRetrieve(client._channel.rid(), client._token(), 999_999)
        with caplog.at_level(logging.WARNING, logger="tierkv.client"):
            client._channel.call(bogus, answered=False)
            assert client.lookup(tokens).hits == 2  # served on the same connection
        assert client._channel.conn is conn
        assert "a finish_retrieve this client did not wait for failed" in caplog.text


def test_a_commit_that_does_not_wait_for_its_answer(
    server: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """finish_store(confirm=False) returns once the commit is sent (unconfirmed, naming what
    it commits); settle() waits for the answer, after which another client sees the chunks.
    A commit that fails (a lease the server never gave) is logged and counted by settle(),
    and the connection serves on with committed data intact. commit_shortfalls() names, once,
    each commit that committed fewer chunks than it was sent for: failed, cleared before it
    committed, or lost with the connection."""
    tokens = list(range(9000, 9000 + 256 * 3))
    data = [chunk_data(tokens, i) for i in range(3)]
    with server.client() as client, server.client() as other:
        register(client)
        register(other)
        prepared = client.prepare_store(tokens)
        result = client.finish_store(prepared, data, confirm=False)
        assert result.stored == [0, 1, 2] and not result.confirmed
        assert len(client._channel.unanswered) == 1  # nobody read the answer yet
        conn = client._channel.conn
        assert client.settle() == 0
        assert not client._channel.unanswered and client._channel.conn is conn
        assert other.lookup(tokens).hits == 3  # at once: settled means committed
        assert client.settle() == 0  # nothing left to wait for
        assert client.commit_shortfalls() == {}  # it committed everything it was sent for

        # The next call reads an unconfirmed commit's answer on its way.
        more = list(range(20_000, 20_000 + 256))
        prepared = client.prepare_store(more)
        client.finish_store(prepared, [chunk_data(more, 0)], confirm=False)
        assert client.lookup(more).hits == 1 and not client._channel.unanswered

        third = list(range(30_000, 30_000 + 256))
        reserved = client.prepare_store(third)
        bogus = dataclasses.replace(
            reserved, slots=msgspec.structs.replace(reserved.slots, lease=999_999)
        )
        with caplog.at_level(logging.WARNING, logger="tierkv.client"):
            failed = client.finish_store(bogus, [chunk_data(third, 0)], confirm=False)
            assert not failed.confirmed and failed.stored == [0]
            assert client.settle() == 1
            assert client.settle() == 0  # counted once
        assert "a commit_store this client did not wait for failed" in caplog.text
        assert client.commit_shortfalls() == {failed.commit_rid: 1}
        assert client.commit_shortfalls() == {}  # reported once
        assert client._channel.conn is conn
        client.abort_store(reserved)
        assert client.lookup(third).hits == 0 and client.lookup(more).hits == 1
        out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(3)]
        assert client.retrieve(tokens, out).complete
        for i in range(3):
            np.testing.assert_array_equal(out[i], data[i])
        assert client.stats().write_leases == 0

        # Written, then cleared before the commit: it commits none of them.
        fourth = list(range(40_000, 40_000 + 256 * 2))
        reserved = client.prepare_store(fourth)
        client.clear()  # this namespace's chunks, those written under the lease included
        cleared = client.finish_store(
            reserved, [chunk_data(fourth, i) for i in range(2)], confirm=False
        )
        assert client.settle() == 0  # not an error: the commit says what it committed
        assert client.commit_shortfalls() == {cleared.commit_rid: 2}
        assert client.lookup(fourth).hits == 0

        # Sent, and the connection lost before the answer was read: not known to be done.
        fifth = list(range(50_000, 50_000 + 256))
        reserved = client.prepare_store(fifth)
        lost = client.finish_store(reserved, [chunk_data(fifth, 0)], confirm=False)
        client._channel.disconnect()  # what a broken connection does
        assert client.commit_shortfalls() == {lost.commit_rid: 1}
        assert client.settle() == 0 and client.commit_shortfalls() == {}


def test_a_client_clears_its_own_namespaces_and_only_an_admin_clears_all(
    server_factory: Callable[..., ServerProcess],
) -> None:
    srv = server_factory("64MiB", ["--auth-token", "admin-secret"])
    tokens = list(range(5000, 5000 + 256 * 3))
    with (
        srv.client(auth_token="admin-secret") as a,
        srv.client(auth_token="admin-secret") as b,
        srv.client() as outsider,
    ):
        register(a, model="tenant-a")
        register(b, model="tenant-b")
        chunks = [chunk_data(tokens, i) for i in range(3)]
        assert a.store(tokens, chunks).stored == [0, 1, 2]
        assert b.store(tokens, chunks).stored == [0, 1, 2]
        assert b.store(tokens, chunks, salt="user-7").stored == [0, 1, 2]
        assert a.clear() == 3  # a's chunks only
        assert a.lookup(tokens).hits == 0 and b.lookup(tokens).hits == 3
        assert b.clear() == 6  # its namespace and the salted one it used
        assert b.store(tokens, chunks).stored == [0, 1, 2]
        # The whole pool: an admin request, refused without the token, all tenants with it.
        with pytest.raises(ServerError, match="auth token"):
            outsider.clear()
        assert b.lookup(tokens).hits == 3
        assert a.store(tokens, chunks).stored == [0, 1, 2]
        assert a.clear(everything=True) == 6
        assert b.lookup(tokens).hits == 0


def test_copy_threads_below_one_are_refused(server: ServerProcess) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        server.client(copy_threads=0)


def test_a_client_with_its_own_chunk_size_names_chunks_by_hashes(server: ServerProcess) -> None:
    """An engine whose pages are not the server's chunk size (SGLang's 64-token pages on a
    server of 256-token chunks) registers ``chunk_tokens``: its chunks round-trip by
    hashes; token ids are refused with the reason; it shares no key with a client of the
    server's chunk size."""
    shape = (2, 64, 8)
    pages = [np.full(shape, i, np.float32) for i in range(3)]
    hashes = [bytes([i]) * 32 for i in range(3)]
    with server.client() as own, server.client() as plain:
        reg = own.register("paged", shape, "float32", token_axis=1, chunk_tokens=64)
        assert reg.chunk_size == 64 and reg.chunk_bytes == pages[0].nbytes
        assert own.store(hashes=hashes, chunks=pages).stored == [0, 1, 2]
        out = [np.zeros(shape, np.float32) for _ in range(3)]
        assert own.retrieve(hashes=hashes, out=out).complete
        for i in range(3):
            np.testing.assert_array_equal(out[i], pages[i])
        with pytest.raises(ServerError, match="name them by hashes"):
            own.lookup(list(range(128)))
        plain.register("paged", (2, 256, 8), "float32", token_axis=1)
        assert plain.lookup(hashes=hashes).hits == 0
