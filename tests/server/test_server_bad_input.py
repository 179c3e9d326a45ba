"""Bad input against a real server: every request type, malformed and out-of-range messages.

Each bad request must get a clear error reply (the right ErrorCode and a message that says
what is wrong), change nothing, and leave the server serving everyone else; committed data
must come back byte-exact after the barrage. Malformed messages go through a raw ZMQ DEALER
socket, the way a buggy or hostile engine would send them.
"""

from __future__ import annotations

import contextlib
import os
import time
import typing
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest

from support.raw_rpc import Raw
from support.servers import (
    CHUNK_BYTES,
    CHUNK_SHAPE,
    CHUNK_SIZE,
    ServerProcess,
    chunk_data,
    register,
)
from tierkv import framing, keys
from tierkv import protocol as p
from tierkv.client import (
    Client,
    LayoutError,
    LeaseExpiredError,
    ServerError,
)
from tierkv.liveness import process_scope

MAX_CHUNKS = 8  # --max-chunks-per-request of the test server
MAX_MESSAGE = 2**20  # --max-message-bytes of the test server
POOL = "16MiB"
EC = p.ErrorCode


def expect_error(reply: Any, code: p.ErrorCode, *words: str, rid: int | None = None) -> p.Error:
    """``reply`` is an error of ``code`` whose message contains every one of ``words``."""
    assert isinstance(reply, p.Error), f"expected a {code.value} error, got {reply!r}"
    assert reply.code is code, reply
    for word in words:
        assert word.lower() in reply.message.lower(), (word, reply.message)
    if rid is not None:
        assert reply.rid == rid, reply
    return reply


def as_list(msg: msgspec.Struct) -> list[Any]:
    """The wire form of a request: [tag, field, ...]."""
    out: list[Any] = msgspec.msgpack.decode(p.encode(msg))
    return out


def toks(start: int, n_chunks: int, extra: int = 0) -> list[int]:
    return list(range(start, start + n_chunks * CHUNK_SIZE + extra))


def sel(tokens: list[int]) -> p.ChunkSelector:
    return p.ChunkSelector(tokens=keys.pack_tokens(tokens))


KEEP = toks(50_000, 4)  # committed at the start, checked byte-exact at the end


@pytest.fixture
def env(server_factory: Callable[..., ServerProcess]) -> Iterator[tuple[ServerProcess, Client]]:
    """A server with small limits and a client whose committed data must survive."""
    srv = server_factory(
        POOL,
        [
            "--max-chunks-per-request", str(MAX_CHUNKS),
            "--max-message-bytes", str(MAX_MESSAGE),
        ],
    )  # fmt: skip
    with srv.client(timeout=5.0) as keeper:
        register(keeper, model="keeper")
        res = keeper.store(KEEP, [chunk_data(KEEP, i) for i in range(4)])
        assert res.stored == [0, 1, 2, 3]
        yield srv, keeper
        check_intact(keeper)


def check_intact(keeper: Client) -> None:
    """The keeper's committed chunks come back byte-exact and nothing is left locked."""
    out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(4)]
    got = keeper.retrieve(KEEP, out)
    assert got.retrieved == [0, 1, 2, 3] and got.complete
    for i in range(4):
        np.testing.assert_array_equal(out[i], chunk_data(KEEP, i))
    s = keeper.stats()
    assert s.read_locked == 0 and s.read_leases == 0, s
    assert s.write_leases == 0 and s.writing == 0, s
    assert s.used == s.objects * CHUNK_BYTES, s


def raw_register(raw: Raw, rid: int = 1, model: str = "raw", **kw: Any) -> int:
    layout = kw.pop("layout", p.Layout(list(CHUNK_SHAPE), "float32", 1))
    reply = raw.call(p.Register(rid, p.PROTOCOL_VERSION, model, layout, **kw))
    assert isinstance(reply, p.Registered), reply
    return reply.client


# -- malformed messages, every request type ----------------------------------------------
def samples(token: int) -> dict[type, msgspec.Struct]:
    """One well-formed message of every request type."""
    s = sel(toks(1, 2))
    return {
        p.Register: p.Register(7, p.PROTOCOL_VERSION, "m", p.Layout(list(CHUNK_SHAPE), "f4", 1)),
        p.Unregister: p.Unregister(7, token),
        p.Lookup: p.Lookup(7, token, s, "req"),
        p.QueryPrefetch: p.QueryPrefetch(7, token, "req"),
        p.PrepareStore: p.PrepareStore(7, token, s, 0),
        p.CommitStore: p.CommitStore(7, token, 1, None),
        p.AbortStore: p.AbortStore(7, token, 1),
        p.PrepareRetrieve: p.PrepareRetrieve(7, token, "", s, 0),
        p.FinishRetrieve: p.FinishRetrieve(7, token, 1),
        p.FreeLookupLocks: p.FreeLookupLocks(7, token, "req"),
        p.EndSession: p.EndSession(7, token, "req"),
        p.Clear: p.Clear(7, token),
        p.Ping: p.Ping(7, token),
        p.GetStats: p.GetStats(7, token, ""),
        p.ReadChunkEvents: p.ReadChunkEvents(7, token, 0),
        p.ReadChunkSnapshot: p.ReadChunkSnapshot(7, token, 0),
        p.RouterLookup: p.RouterLookup(7, "", p.RouterQuery("m", b"", b"", None, 0)),
    }


REQUEST_TYPES = typing.get_args(p.Request)


def test_samples_cover_every_request_type() -> None:
    assert set(samples(1)) == set(REQUEST_TYPES)


def test_malformed_fields_of_every_request_type(env: tuple[ServerProcess, Client]) -> None:
    srv, keeper = env
    raw = Raw(srv.endpoint)
    try:
        token = raw_register(raw)
        for typ in REQUEST_TYPES:
            try:
                check_malformed(raw, token, typ)
            except AssertionError as exc:
                raise AssertionError(f"{typ.__name__}: {exc}") from exc
    finally:
        raw.close()
    keeper.ping()


def check_malformed(raw: Raw, token: int, typ: type) -> None:
    wire = as_list(samples(token)[typ])
    tag = wire[0]

    # Wrong field type: the first field after rid (rid itself for PING).
    pos = 2 if len(wire) > 2 else 1
    bad = list(wire)
    bad[pos] = 12345 if isinstance(wire[pos], str) else "wrong"
    expected_rid = 7 if pos > 1 else 0
    expect_error(raw.call(bad), EC.BAD_REQUEST, "expected", f"$[{pos}]", rid=expected_rid)

    # Missing fields: the tag alone (no rid either), then tag and rid only when more fields
    # are required.
    expect_error(raw.call([tag]), EC.BAD_REQUEST, "at least length", rid=0)
    if typ not in (p.Ping, p.GetStats):
        expect_error(raw.call([tag, 7]), EC.BAD_REQUEST, "at least length", rid=7)

    # Extra fields.
    expect_error(raw.call([*wire, "surplus"]), EC.BAD_REQUEST, "at most length", rid=7)

    # Nested structs (layout, chunk selector) with unknown keys or wrong types.
    for i, value in enumerate(wire):
        if isinstance(value, dict):
            nested = list(wire)
            nested[i] = {**value, "bogus": 1}
            expect_error(raw.call(nested), EC.BAD_REQUEST, "unknown field `bogus`", rid=7)
            nested[i] = {k: ("wrong" if k != "dtype" else 5) for k in value}
            expect_error(raw.call(nested), EC.BAD_REQUEST, "expected", rid=7)

    # The well-formed message is still served afterwards (not UNREGISTER or CLEAR: they
    # would end this raw client or empty the cache). Leases it opens are given back.
    if typ not in (p.Unregister, p.Clear):
        reply = raw.call(wire)
        assert reply.rid == 7
        assert not isinstance(reply, p.Error) or reply.code is EC.NOT_FOUND, reply
        if isinstance(reply, p.StoreSlots) and reply.lease:
            assert isinstance(raw.call(p.AbortStore(8, token, reply.lease)), p.Ok)
        if isinstance(reply, p.RetrieveSlots) and reply.lease:
            assert isinstance(raw.call(p.FinishRetrieve(8, token, reply.lease)), p.Ok)


def test_undecodable_payloads(env: tuple[ServerProcess, Client]) -> None:
    srv, keeper = env
    raw = Raw(srv.endpoint)
    try:
        # Not msgpack at all (0xc1 is never valid), truncated msgpack, an empty frame.
        expect_error(raw.call(b"\xc1\x00garbage"), EC.BAD_REQUEST, "malformed", rid=0)
        expect_error(raw.call(b"\x93\x01"), EC.BAD_REQUEST, "malformed", rid=0)
        expect_error(raw.call(b""), EC.BAD_REQUEST, "malformed", rid=0)
        # Valid msgpack of an unknown request type: named in the reply, rid echoed.
        expect_error(raw.call(["bogus", 42]), EC.BAD_REQUEST, "unknown request type", rid=42)
        expect_error(raw.call(["bogus", 43]), EC.BAD_REQUEST, "'bogus'", rid=43)
        # Valid msgpack that is not a request array at all.
        expect_error(raw.call({"rid": 1}), EC.BAD_REQUEST, "expected `array`", rid=0)
        expect_error(raw.call(17), EC.BAD_REQUEST, "expected `array`", rid=0)
        expect_error(raw.call([]), EC.BAD_REQUEST, "malformed", rid=0)
        # A reply type sent as a request.
        expect_error(raw.call(as_list(p.Ok(5))), EC.BAD_REQUEST, "unknown request type", rid=5)
        # Still serving, on the same connection and on others.
        assert isinstance(raw.call(p.Ping(9)), p.Ok)
    finally:
        raw.close()
    keeper.ping()
    s = keeper.stats()
    assert s.errors.get("bad_request", 0) >= 9


def test_oversized_message_drops_only_that_connection(env: tuple[ServerProcess, Client]) -> None:
    srv, keeper = env
    big = Raw(srv.endpoint)
    other = Raw(srv.endpoint)
    try:
        assert isinstance(other.call(p.Ping(1)), p.Ok)
        token = raw_register(big)
        huge = p.Lookup(2, token, p.ChunkSelector(tokens=bytes(2 * MAX_MESSAGE)))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            big.send(huge)  # the server may close before all of it is sent
        # The server read the length only: it says why and closes that connection.
        expect_error(big.recv(), EC.TOO_LARGE, "larger than max_message_bytes", rid=0)
        with pytest.raises(ConnectionError):
            big.recv(timeout=1.0)
        # Other connections are unaffected, and a new one works.
        assert isinstance(other.call(p.Ping(3)), p.Ok)
        check_intact(keeper)
        fresh = Raw(srv.endpoint)
        try:
            assert isinstance(fresh.call(p.Ping(4)), p.Ok)
        finally:
            fresh.close()
    finally:
        big.close()
        other.close()
    # The engine client gets the server's reason, and its next call connects afresh.
    with srv.client(timeout=5.0) as client:
        register(client, model="oversize")
        with pytest.raises(ServerError, match="larger than max_message_bytes") as refused:
            client.lookup(bytes(2 * MAX_MESSAGE))
        assert refused.value.code is EC.TOO_LARGE
        assert client.lookup(KEEP).hits == 0  # another namespace; the call itself works


def test_broken_framing_drops_only_that_connection(env: tuple[ServerProcess, Client]) -> None:
    """Connections that stop mid-message (a client killed while sending), announce a body
    they never send, or send bytes that are no framing at all: each is its own; the server
    keeps serving the others and a new one."""
    srv, keeper = env
    half_header, half_body, no_body = Raw(srv.endpoint), Raw(srv.endpoint), Raw(srv.endpoint)
    payload = msgspec.msgpack.encode(p.Ping(5))
    half_header.send_bytes(framing.HEADER.pack(len(payload))[:2])
    half_body.send_bytes(framing.HEADER.pack(len(payload)) + payload[:3])
    no_body.send_bytes(framing.HEADER.pack(MAX_MESSAGE - 1))  # then 1 MiB that never comes
    other = Raw(srv.endpoint)
    try:
        assert isinstance(other.call(p.Ping(1)), p.Ok)
        keeper.ping()
        # Finishing a message that arrived in pieces still works.
        half_body.send_bytes(payload[3:])
        assert isinstance(half_body.recv(), p.Ok)
        for raw in (half_header, no_body):
            raw.close()  # the client dies mid-message
        assert isinstance(other.call(p.Ping(2)), p.Ok)
        check_intact(keeper)
    finally:
        for raw in (half_header, half_body, no_body, other):
            raw.close()


def test_a_forked_child_gets_its_own_connection(env: tuple[ServerProcess, Client]) -> None:
    """A process forked after its parent connected (an engine's worker) must not read the
    parent's replies or send on its connection: its first call connects afresh."""
    srv, keeper = env
    with srv.client() as client:
        register(client, model="forked")
        pid = os.fork()
        if pid == 0:  # the child: exit code 0 when its calls worked
            code = 1
            try:
                client.ping()
                code = 0 if client.lookup(KEEP).hits == 0 else 2
            finally:
                os._exit(code)
        client.ping()  # the parent carries on on its connection meanwhile
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
        assert client.lookup(KEEP).hits == 0
    check_intact(keeper)


# -- chunk selectors ---------------------------------------------------------------------
def selector_requests(token: int, chunks: p.ChunkSelector) -> list[msgspec.Struct]:
    return [
        p.Lookup(11, token, chunks),
        p.Lookup(11, token, chunks, "with-session"),
        p.PrepareStore(11, token, chunks),
        p.PrepareRetrieve(11, token, chunks=chunks),
    ]


def test_bad_chunk_selectors(env: tuple[ServerProcess, Client]) -> None:
    srv, keeper = env
    raw = Raw(srv.endpoint)
    try:
        token = raw_register(raw)
        packed = keys.pack_tokens(toks(1, 2))
        h16 = [bytes(16), bytes([1] * 16)]
        cases: list[tuple[p.ChunkSelector, p.ErrorCode, tuple[str, ...]]] = [
            (p.ChunkSelector(tokens=packed + b"\x01"), EC.BAD_REQUEST, ("uint32",)),
            (p.ChunkSelector(tokens=b"\x01\x02\x03"), EC.BAD_REQUEST, ("uint32",)),
            (p.ChunkSelector(tokens=packed, hashes=h16), EC.BAD_REQUEST, ("exactly one",)),
            (p.ChunkSelector(), EC.BAD_REQUEST, ("exactly one",)),
            (p.ChunkSelector(hashes=[b""]), EC.BAD_REQUEST, ("1..64 bytes", "got 0")),
            (p.ChunkSelector(hashes=[bytes(65)]), EC.BAD_REQUEST, ("1..64 bytes", "got 65")),
            (p.ChunkSelector(hashes=h16, partial_last=True), EC.BAD_REQUEST, ("partial_last",)),
            (
                p.ChunkSelector(tokens=keys.pack_tokens(toks(1, MAX_CHUNKS + 1))),
                EC.TOO_LARGE,
                (f"more than {MAX_CHUNKS}",),
            ),
            (
                p.ChunkSelector(hashes=[bytes(16)] * (MAX_CHUNKS + 1)),
                EC.TOO_LARGE,
                (f"more than {MAX_CHUNKS}",),
            ),
        ]
        for chunks, code, words in cases:
            for req in selector_requests(token, chunks):
                expect_error(raw.call(req), code, *words, rid=11)
        # At the limit is fine (MAX_CHUNKS full chunks plus a partial tail that is not
        # stored); store nothing, just look up.
        ok = raw.call(p.Lookup(12, token, sel(toks(1, MAX_CHUNKS, extra=CHUNK_SIZE - 1))))
        assert isinstance(ok, p.LookupResult) and ok.total == MAX_CHUNKS
        # Hashes of 1..64 bytes other than 16 are accepted (folded).
        ok = raw.call(p.Lookup(13, token, p.ChunkSelector(hashes=[b"x", bytes(64)])))
        assert isinstance(ok, p.LookupResult) and ok.total == 2
        # Nothing was reserved or locked by any of the refused requests.
        s = keeper.stats()
        assert s.write_leases == 0 and s.read_leases == 0 and s.objects == 4 and s.sessions == 0
    finally:
        raw.close()


def test_first_chunk_out_of_range(env: tuple[ServerProcess, Client]) -> None:
    srv, _ = env
    raw = Raw(srv.endpoint)
    try:
        token = raw_register(raw)
        s2 = sel(toks(1, 2))
        for first in (-1, -(2**40)):
            for req in (
                p.PrepareStore(3, token, s2, first),
                p.PrepareRetrieve(3, token, chunks=s2, first_chunk=first),
            ):
                expect_error(raw.call(req), EC.BAD_REQUEST, "first_chunk", ">= 0", rid=3)
        for first in (3, 2**62):
            for req in (
                p.PrepareStore(4, token, s2, first),
                p.PrepareRetrieve(4, token, chunks=s2, first_chunk=first),
            ):
                expect_error(raw.call(req), EC.BAD_REQUEST, f"first_chunk {first}", rid=4)
        # first_chunk == number of chunks names nothing: an empty, successful reply.
        empty = raw.call(p.PrepareStore(5, token, s2, 2))
        assert isinstance(empty, p.StoreSlots) and empty.lease == 0 and not empty.slots
    finally:
        raw.close()


# -- client tokens, leases and sessions --------------------------------------------------
def test_unknown_client_token_for_every_request_that_names_one(
    env: tuple[ServerProcess, Client],
) -> None:
    srv, keeper = env
    raw = Raw(srv.endpoint)
    try:
        for typ, msg in samples(987654321).items():
            if typ in (p.Register, p.GetStats, p.RouterLookup):
                continue  # no client token (GetStats needs one only with --auth-token)
            expect_error(
                raw.call(msg), EC.NOT_REGISTERED, "unknown client", "register again", rid=7
            )
        # An unregistered token is unknown too.
        token = raw_register(raw)
        assert isinstance(raw.call(p.Unregister(8, token)), p.Ok)
        expect_error(raw.call(p.Lookup(9, token, sel(KEEP))), EC.NOT_REGISTERED, "unknown client")
        expect_error(raw.call(p.Unregister(10, token)), EC.NOT_REGISTERED, "unknown client")
        expect_error(raw.call(p.Ping(11, token)), EC.NOT_REGISTERED, "unknown client")
        assert isinstance(raw.call(p.Ping(12)), p.Ok)  # without a token: is the server up
    finally:
        raw.close()
    check_intact(keeper)  # CLEAR with a bad token cleared nothing


def test_store_leases_not_found_and_not_owned(env: tuple[ServerProcess, Client]) -> None:
    srv, keeper = env
    raw, thief = Raw(srv.endpoint), Raw(srv.endpoint)
    try:
        token = raw_register(raw)
        other = raw_register(thief)
        data = toks(70_000, 2)
        slots = raw.call(p.PrepareStore(1, token, sel(data)))
        assert isinstance(slots, p.StoreSlots) and len(slots.slots) == 2 and slots.lease
        lease = slots.lease

        # Never prepared.
        for req in (p.CommitStore(2, token, 999_999), p.AbortStore(2, token, 999_999)):
            expect_error(raw.call(req), EC.NOT_FOUND, "999999", rid=2)
        expect_error(raw.call(p.CommitStore(2, token, 0)), EC.NOT_FOUND, "never prepared")
        # Another client's lease: refused, and the lease is untouched.
        for req in (
            p.CommitStore(3, other, lease),
            p.AbortStore(3, other, lease),
            p.CommitStore(3, other, lease, [0]),
        ):
            expect_error(thief.call(req), EC.NOT_OWNED, "another client", rid=3)
        # A store lease is not a read lease.
        expect_error(raw.call(p.FinishRetrieve(4, token, lease)), EC.NOT_FOUND, str(lease))
        # `only` positions out of range: refused, nothing changes.
        for only in ([2], [-1], [0, 5], [2**40]):
            expect_error(
                raw.call(p.CommitStore(5, token, lease, only)), EC.BAD_REQUEST, "out of range"
            )
        assert keeper.stats().write_leases == 1

        # Write the slots, commit only the first; the second is aborted.
        pool = keeper.pool
        assert pool is not None
        for slot in slots.slots:
            pool.array(slot.offset, slot.length, np.float32, CHUNK_SHAPE)[:] = chunk_data(
                data, slot.chunk
            )
        done = raw.call(p.CommitStore(6, token, lease, [0]))
        assert isinstance(done, p.Committed) and (done.committed, done.aborted) == (1, 1)
        # Already finished: commit, abort and a second commit are NOT_FOUND.
        expect_error(raw.call(p.CommitStore(7, token, lease)), EC.NOT_FOUND, "not open", rid=7)
        expect_error(raw.call(p.AbortStore(7, token, lease)), EC.NOT_FOUND, "not exist", rid=7)

        # An aborted lease is finished too.
        slots2 = raw.call(p.PrepareStore(8, token, sel(toks(80_000, 1))))
        assert isinstance(raw.call(p.AbortStore(9, token, slots2.lease)), p.Ok)
        expect_error(raw.call(p.CommitStore(10, token, slots2.lease)), EC.NOT_FOUND, "not open")
        expect_error(raw.call(p.AbortStore(10, token, slots2.lease)), EC.NOT_FOUND, "not exist")

        # The committed chunk reads back exactly; the aborted one is missing.
        got = raw.call(p.PrepareRetrieve(11, token, chunks=sel(data)))
        assert isinstance(got, p.RetrieveSlots) and got.missing == [1]
        (slot,) = got.slots
        view = pool.array(slot.offset, slot.length, np.float32, CHUNK_SHAPE)
        np.testing.assert_array_equal(view, chunk_data(data, 0))
        assert isinstance(raw.call(p.FinishRetrieve(12, token, got.lease)), p.Ok)
    finally:
        raw.close()
        thief.close()


def test_read_leases_and_sessions(env: tuple[ServerProcess, Client]) -> None:
    srv, keeper = env
    raw, thief = Raw(srv.endpoint), Raw(srv.endpoint)
    try:
        token = raw_register(raw, model="keeper")  # the keeper's namespace: sees its chunks
        other = raw_register(thief, model="keeper")
        got = raw.call(p.PrepareRetrieve(1, token, chunks=sel(KEEP)))
        assert isinstance(got, p.RetrieveSlots) and len(got.slots) == 4

        expect_error(raw.call(p.FinishRetrieve(2, token, 424242)), EC.NOT_FOUND, "424242")
        expect_error(thief.call(p.FinishRetrieve(3, other, got.lease)), EC.NOT_OWNED, "another")
        expect_error(raw.call(p.CommitStore(4, token, got.lease)), EC.NOT_FOUND, "not open")
        expect_error(raw.call(p.AbortStore(4, token, got.lease)), EC.NOT_FOUND, "not exist")
        assert isinstance(raw.call(p.FinishRetrieve(5, token, got.lease)), p.Ok)
        expect_error(raw.call(p.FinishRetrieve(6, token, got.lease)), EC.NOT_FOUND, "not exist")

        # PREPARE_RETRIEVE: request_id and chunks together, neither, an unknown request id.
        expect_error(
            raw.call(p.PrepareRetrieve(7, token, "r", sel(KEEP))), EC.BAD_REQUEST, "not both"
        )
        expect_error(raw.call(p.PrepareRetrieve(7, token)), EC.BAD_REQUEST, "request_id or chunks")
        expect_error(raw.call(p.PrepareRetrieve(7, token, "nope")), EC.NOT_FOUND, "'nope'")
        expect_error(raw.call(p.QueryPrefetch(7, token, "nope")), EC.NOT_FOUND, "'nope'")
        # Sessions are per client: another client's request id is unknown to this one.
        looked = raw.call(p.Lookup(8, token, sel(KEEP), "mine"))
        assert isinstance(looked, p.LookupResult) and looked.hits == 4
        expect_error(thief.call(p.PrepareRetrieve(9, other, "mine")), EC.NOT_FOUND, "'mine'")
        # The session's locks are used once: a second retrieve of the same lookup is refused
        # (it must not claim success with nothing copied).
        first = raw.call(p.PrepareRetrieve(10, token, "mine"))
        assert isinstance(first, p.RetrieveSlots) and len(first.slots) == 4 and not first.missing
        expect_error(raw.call(p.PrepareRetrieve(11, token, "mine")), EC.NOT_FOUND, "look up again")
        assert isinstance(raw.call(p.FinishRetrieve(12, token, first.lease)), p.Ok)
        # Freeing or ending an unknown session is idempotent: nothing to release, no error.
        for req in (p.FreeLookupLocks(13, token, "nope"), p.EndSession(13, token, "nope")):
            reply = raw.call(req)
            assert isinstance(reply, p.Ok) and reply.count == 0
        assert isinstance(raw.call(p.EndSession(14, token, "mine")), p.Ok)
        # A request id the server would keep for a session TTL is bounded (ids of 2 MiB
        # made 100 lookups hold 200 MiB): every request that names one refuses it.
        long_id = "x" * (p.MAX_REQUEST_ID + 1)
        for req in (
            p.Lookup(15, token, sel(KEEP), long_id),
            p.QueryPrefetch(15, token, long_id),
            p.PrepareRetrieve(15, token, long_id),
            p.FreeLookupLocks(15, token, long_id),
            p.EndSession(15, token, long_id),
        ):
            expect_error(raw.call(req), EC.BAD_REQUEST, f"at most {p.MAX_REQUEST_ID} characters")
        looked = raw.call(p.Lookup(16, token, sel(KEEP), "y" * p.MAX_REQUEST_ID))
        assert isinstance(looked, p.LookupResult) and looked.hits == 4
        assert isinstance(raw.call(p.EndSession(17, token, "y" * p.MAX_REQUEST_ID)), p.Ok)
    finally:
        raw.close()
        thief.close()
    s = keeper.stats()
    assert s.read_leases == 0 and s.read_locked == 0 and s.sessions == 0


def test_client_side_session_reuse_is_an_error(env: tuple[ServerProcess, Client]) -> None:
    _, keeper = env
    assert keeper.lookup(KEEP, request_id="once").hits == 4
    out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(4)]
    assert keeper.retrieve(request_id="once", out=out).complete
    with pytest.raises(LeaseExpiredError):
        keeper.retrieve(request_id="once", out=out)
    keeper.end_session("once")


# -- registration ------------------------------------------------------------------------
def test_bad_registrations(env: tuple[ServerProcess, Client]) -> None:
    srv, keeper = env
    raw = Raw(srv.endpoint)
    good = p.Layout(list(CHUNK_SHAPE), "float32", 1)

    def reg(**kw: Any) -> Any:
        fields: dict[str, Any] = {"protocol": p.PROTOCOL_VERSION, "model": "m", "layout": good}
        fields.update(kw)
        return raw.call(p.Register(rid=21, **fields))

    def layout(shape: list[int], dtype: str = "float32", axis: int = 1) -> p.Layout:
        return p.Layout(shape, dtype, axis)

    try:
        for version in (0, p.PROTOCOL_VERSION + 1, -1):
            expect_error(reg(protocol=version), EC.VERSION, f"protocol {version}", "upgrade")
        # "fp8" names no one format (e4m3? e5m2?): numpy cannot view it either, so it was
        # once registered and then unusable by the client; it is refused at REGISTER.
        for dtype in ("float33", "", "object", "O", "U10", "S", "a", "f4,i4", "f4,,", "(3,",
                      "datetime64", "V16", "[('a','f4')]", "fp8"):  # fmt: skip
            expect_error(reg(layout=layout(list(CHUNK_SHAPE), dtype)), EC.BAD_REQUEST, "dtype")
        expect_error(reg(layout=layout([2, 128, 16])), EC.BAD_REQUEST, "chunk size is 256")
        expect_error(reg(layout=layout([2, 256, 16], axis=0)), EC.BAD_REQUEST, "chunk size")
        expect_error(reg(layout=layout([2, 256, 16], axis=3)), EC.BAD_REQUEST, "token_axis 3")
        expect_error(reg(layout=layout([2, 256, 16], axis=-1)), EC.BAD_REQUEST, "token_axis")
        for shape in ([2, 256, 0], [0, 256], [-2, 256, 16], [], [256, *[1] * 8]):
            expect_error(reg(layout=layout(shape, axis=0 if shape[:1] == [256] else 1)),
                         EC.BAD_REQUEST, "shape")  # fmt: skip
        # A chunk larger than the whole pool (16 MiB), and absurd dimensions.
        expect_error(reg(layout=layout([64, 256, 1024])), EC.BAD_REQUEST, "larger than the pool")
        expect_error(reg(layout=layout([2**40, 256, 2**20])), EC.BAD_REQUEST, "larger than")
        for world, rank in ((0, 0), (2, 2), (2, -1), (-1, 0), (1, 5)):
            expect_error(reg(world_size=world, rank=rank), EC.BAD_REQUEST, "world size")
        expect_error(reg(model=""), EC.BAD_REQUEST, "model")
        # A client that cuts its own chunks (chunk_tokens) declares as many tokens as it has.
        for bad in (-1, 1 << 21):
            expect_error(reg(chunk_tokens=bad), EC.BAD_REQUEST, "chunk_tokens")
        expect_error(reg(layout=layout([2, 64, 16]), chunk_tokens=32), EC.BAD_REQUEST,
                     "64 tokens", "chunk_tokens is 32")  # fmt: skip
        # None of these registered anything.
        assert keeper.stats().clients == 1
        # Dtypes engines use that numpy lacks are fine.
        for dtype in ("bfloat16", "float8_e4m3fn", "float16", "int8", "uint8"):
            assert isinstance(reg(layout=layout(list(CHUNK_SHAPE), dtype)), p.Registered)
        # Pids and process scopes the server cannot watch register fine, unwatched (their
        # locks end by TTL); a pid that does not exist is never "reaped" by mistake either.
        before = keeper.stats().clients
        for pid, scope in ((0, process_scope()), (-5, process_scope()), (2**62, "x" * 10_000),
                           (2**31 - 1, process_scope()), (os.getpid(), "bad/scope")):  # fmt: skip
            assert isinstance(reg(pid=pid, process_scope=scope), p.Registered)
        time.sleep(1.5)  # the server looks for exited clients once a second
        s = keeper.stats()
        assert s.clients == before + 5 and s.clients_reaped == 0
    finally:
        raw.close()


# -- the engine client with arrays that do not fit the layout ----------------------------
def test_wrong_shapes_abort_the_store_and_release_the_read(
    env: tuple[ServerProcess, Client],
) -> None:
    srv, keeper = env
    before = keeper.stats()
    data = toks(90_000, 3)
    with srv.client() as client:
        register(client, model="shapes")
        wrong = [np.zeros((2, 128, 16), np.float32)] * 3
        with pytest.raises(LayoutError, match="does not fit"):
            client.store(data, wrong)
        wrong_dtype = [np.zeros(CHUNK_SHAPE, np.float64)] * 3
        with pytest.raises(LayoutError):
            client.store(data, wrong_dtype)

        def failing_gather(chunk: int, dst: np.ndarray[Any, Any]) -> None:
            raise RuntimeError("engine gather failed")

        with pytest.raises(RuntimeError, match="gather failed"):
            client.store(data, gather=failing_gather)
        s = keeper.stats()
        assert (s.write_leases, s.writing, s.objects, s.used) == (0, 0, before.objects, before.used)
        assert client.lookup(data).hits == 0

        # Stored properly, then read into buffers of the wrong shape: the read is released.
        assert client.store(data, [chunk_data(data, i) for i in range(3)]).stored == [0, 1, 2]
        with pytest.raises(LayoutError):
            client.retrieve(data, [np.zeros((2, 256, 8), np.float32)] * 3)
        s = keeper.stats()
        assert s.read_leases == 0 and s.read_locked == 0
        out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(3)]
        assert client.retrieve(data, out).complete
        for i in range(3):
            np.testing.assert_array_equal(out[i], chunk_data(data, i))
