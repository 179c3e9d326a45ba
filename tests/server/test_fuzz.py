"""Property-based fuzzing of real server processes (hypothesis).

- RPC: well-typed requests of every type with adversarial field values, and raw bytes /
  msgpack of random structure. Every message gets a protocol reply that is never INTERNAL,
  the server keeps answering PING, and a keeper client's committed chunks come back
  byte-exact at the end with no lease left behind once the fuzzer's clients are gone.
- Cluster control plane: correctly SIGNED but randomly-valued control messages of every
  type, and signed random payloads. The node answers each (a reply or Refused, never an
  internal error), keeps answering GetMembers, forgets the bogus members it was told about,
  and a chunk stored on it stays resolvable and retrievable.
- Data plane: random bytes, truncated hellos, and a valid hello followed by garbage requests
  on the node's TCP data port; a real fetch from another TcpTransport still works afterwards.

No timing assertions: waits are bounded polls; hypothesis deadlines are off.
"""

from __future__ import annotations

import contextlib
import socket
import typing
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from support.clusterkit import (
    TOKEN,
    Node,
    call,
    members,
    rows_of,
    start_node,
    status,
    wait_for,
)
from support.control_wire import RawControl
from support.raw_rpc import Raw
from support.servers import (
    CHUNK_BYTES,
    CHUNK_SHAPE,
    CHUNK_SIZE,
    ServerProcess,
    chunk_data,
    register,
    stop_and_clean,
)
from tierkv import keys as tk
from tierkv import protocol as p
from tierkv.cluster import messages as m
from tierkv.cluster.auth import MAC_BYTES, NONCE_BYTES, ControlSigner, derive_key, hello_proof
from tierkv.cluster.transport import HELLO, HELLO_REPLY, ITEM, REQUEST, VERSION, TcpTransport
from tierkv.tiers.base import LoadStatus

RPC_TOKEN = "fuzz-rpc-secret"
MAX_CHUNKS = 8
KEEP = list(range(70_000, 70_000 + 4 * CHUNK_SIZE))
FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# -- real servers shared by a module's examples ------------------------------------------
@pytest.fixture(scope="module")
def factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., ServerProcess]]:
    servers: list[ServerProcess] = []
    base: Path = tmp_path_factory.mktemp("fuzz")

    def start(pool_size: str = "32MiB", extra: list[str] | None = None) -> ServerProcess:
        instance = uuid.uuid4().hex[:10]
        srv = ServerProcess(instance, base / f"run-{instance}", pool_size, list(extra or []))
        servers.append(srv)
        return srv.start()

    yield start
    for srv in servers:
        stop_and_clean(srv)


class RpcEnv:
    def __init__(self, srv: ServerProcess) -> None:
        self.srv = srv
        self.keeper = srv.client(timeout=10.0, auth_token=RPC_TOKEN)
        register(self.keeper, model="keeper")
        res = self.keeper.store(KEEP, [chunk_data(KEEP, i) for i in range(4)])
        assert res.stored == [0, 1, 2, 3]
        self.raw = Raw(srv.endpoint)
        self.tokens: list[int] = []  # clients the fuzzer registered
        self.leases: list[int] = [1, 2]  # lease ids seen in replies

    def assert_alive(self) -> None:
        assert self.srv.proc is not None and self.srv.proc.poll() is None, self.srv.log()[-4000:]
        assert isinstance(self.raw.call(p.Ping(424242), timeout=10.0), p.Ok)

    def check(self, reply: Any) -> None:
        """A protocol reply (Raw.recv decoded it), never INTERNAL; remember what it issued."""
        assert not (isinstance(reply, p.Error) and reply.code is p.ErrorCode.INTERNAL), reply
        if isinstance(reply, p.Registered):
            self.tokens.append(reply.client)
        elif isinstance(reply, (p.StoreSlots, p.RetrieveSlots)) and reply.lease:
            self.leases.append(reply.lease)


@pytest.fixture(scope="module")
def rpc(factory: Callable[..., ServerProcess]) -> Iterator[RpcEnv]:
    srv = factory(
        "32MiB",
        ["--max-chunks-per-request", str(MAX_CHUNKS), "--auth-token", RPC_TOKEN],
    )
    env = RpcEnv(srv)
    try:
        yield env
    finally:
        env.raw.close()
        env.keeper.close()


# -- RPC strategies ----------------------------------------------------------------------
I64 = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([0, 1, -1, 2**31 - 1, 2**32, 2**63 - 1, -(2**63), 2**64 - 1]),
    st.integers(-3, 300),
)
TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", "x" * 100_000, "é🙂\x00\ud7ff", RPC_TOKEN, "req", "float32"]),
)
BLOB = st.one_of(st.binary(max_size=80), st.sampled_from([b"", bytes(16), bytes(32), bytes(65)]))


def _tokens_blob() -> st.SearchStrategy[bytes]:
    as_ints = st.lists(st.integers(0, 2**32 - 1), max_size=CHUNK_SIZE * 3).map(tk.pack_tokens)
    ranges = st.builds(
        lambda start, n: tk.pack_tokens(list(range(start, start + n))),
        st.sampled_from([0, 1, 70_000, 2**32 - 5000]),
        st.integers(0, CHUNK_SIZE * (MAX_CHUNKS + 1)),
    )
    return st.one_of(as_ints, ranges, BLOB, st.just(tk.pack_tokens(KEEP)))


SELECTOR = st.builds(
    p.ChunkSelector,
    tokens=st.none() | _tokens_blob(),
    hashes=st.none() | st.lists(BLOB, max_size=MAX_CHUNKS + 2),
    partial_last=st.booleans(),
    salt=TEXT,
)
LAYOUT = st.builds(
    p.Layout,
    shape=st.one_of(
        st.lists(I64, max_size=5),
        st.sampled_from([list(CHUNK_SHAPE), [CHUNK_SIZE], [2, CHUNK_SIZE, 2**40]]),
    ),
    dtype=st.one_of(TEXT, st.sampled_from(["float32", "bfloat16", "O", "V0", "f4,i4"])),
    token_axis=I64,
)


@st.composite
def client_token(draw: st.DrawFn, env: RpcEnv) -> int:
    choices = [*env.tokens[-8:], 0]
    if choices and draw(st.booleans()):
        return draw(st.sampled_from(choices))
    return draw(I64)


@st.composite
def lease_id(draw: st.DrawFn, env: RpcEnv) -> int:
    if draw(st.booleans()):
        return draw(st.sampled_from(env.leases[-16:]))
    return draw(I64)


def typed_requests(env: RpcEnv) -> dict[type, st.SearchStrategy[Any]]:
    """A strategy per request type."""
    tok, lease = client_token(env), lease_id(env)
    rid = I64
    only = st.none() | st.lists(I64, max_size=10)
    return {
        p.Register: st.builds(
            p.Register,
            rid=rid,
            protocol=st.one_of(st.just(p.PROTOCOL_VERSION), I64),
            model=TEXT,
            layout=st.one_of(LAYOUT, st.just(p.Layout(list(CHUNK_SHAPE), "float32", 1))),
            world_size=st.one_of(st.just(1), I64),
            rank=st.one_of(st.just(0), I64),
            tenant_salt=TEXT,
            name=TEXT,
            pid=I64,
            auth_token=st.one_of(st.just(RPC_TOKEN), TEXT),
            engine_id=TEXT,
            role=st.one_of(st.sampled_from([p.ROLE_WORKER, p.ROLE_SCHEDULER]), TEXT),
            process_scope=TEXT,
        ),
        p.Unregister: st.builds(p.Unregister, rid=rid, client=tok),
        p.Lookup: st.builds(p.Lookup, rid=rid, client=tok, chunks=SELECTOR, request_id=TEXT),
        p.QueryPrefetch: st.builds(p.QueryPrefetch, rid=rid, client=tok, request_id=TEXT),
        p.PrepareStore: st.builds(
            p.PrepareStore,
            rid=rid,
            client=tok,
            chunks=SELECTOR,
            first_chunk=I64,
            notes=st.none() | st.lists(st.binary(max_size=64), max_size=10),
        ),
        p.CommitStore: st.builds(p.CommitStore, rid=rid, client=tok, lease=lease, only=only),
        p.AbortStore: st.builds(p.AbortStore, rid=rid, client=tok, lease=lease),
        p.PrepareRetrieve: st.builds(
            p.PrepareRetrieve,
            rid=rid,
            client=tok,
            request_id=TEXT,
            chunks=st.none() | SELECTOR,
            first_chunk=I64,
        ),
        p.FinishRetrieve: st.builds(p.FinishRetrieve, rid=rid, client=tok, lease=lease),
        p.FreeLookupLocks: st.builds(p.FreeLookupLocks, rid=rid, client=tok, request_id=TEXT),
        p.EndSession: st.builds(p.EndSession, rid=rid, client=tok, request_id=TEXT),
        # Never the admin secret: a CLEAR with it empties the whole pool, by design.
        p.Clear: st.builds(
            p.Clear,
            rid=rid,
            client=tok,
            auth_token=TEXT.filter(lambda t: t != RPC_TOKEN),
            everything=st.booleans(),
        ),
        p.Ping: st.builds(p.Ping, rid=rid),
        p.GetStats: st.builds(
            p.GetStats, rid=rid, client=tok, auth_token=st.just(RPC_TOKEN) | TEXT
        ),
        p.ReadChunkEvents: st.builds(p.ReadChunkEvents, rid=rid, client=tok, after=I64, limit=I64),
        p.ReadChunkSnapshot: st.builds(p.ReadChunkSnapshot, rid=rid, client=tok, page=I64),
        p.RouterLookup: st.builds(
            p.RouterLookup,
            rid=rid,
            auth_token=st.just(RPC_TOKEN) | TEXT,
            query=st.builds(
                p.RouterQuery,
                model=TEXT,
                namespace=st.binary(max_size=20),
                tokens=st.none() | st.binary(max_size=2048),
                hashes=st.none() | st.lists(st.binary(max_size=70), max_size=8),
                chunk_tokens=I64,
            ),
        ),
    }


LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=40),
)
MSGPACK_ANY = st.recursive(
    LEAF,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)
RPC_TAGS = [t.__struct_config__.tag for t in typing.get_args(p.Request)]


def raw_payload(tags: list[str]) -> st.SearchStrategy[bytes]:
    tagged = st.builds(
        lambda tag, rest: msgspec.msgpack.encode([tag, *rest]),
        st.sampled_from(tags),
        st.lists(MSGPACK_ANY, max_size=14),
    )
    return st.one_of(st.binary(max_size=200), MSGPACK_ANY.map(msgspec.msgpack.encode), tagged)


# -- RPC tests ---------------------------------------------------------------------------
def test_rpc_samples_cover_every_request_type(rpc: RpcEnv) -> None:
    assert set(typed_requests(rpc)) == set(typing.get_args(p.Request))


@FUZZ
@given(data=st.data())
def test_rpc_typed_requests(rpc: RpcEnv, data: st.DataObject) -> None:
    strategies = typed_requests(rpc)
    typ = data.draw(st.sampled_from(sorted(strategies, key=lambda t: t.__name__)), label="type")
    msg = data.draw(strategies[typ], label="request")
    rpc.check(rpc.raw.call(msg, timeout=10.0))
    rpc.assert_alive()


@settings(FUZZ, max_examples=200)
@given(payload=raw_payload(RPC_TAGS))
@example(payload=b"\xc1")
@example(payload=msgspec.msgpack.encode([0, False]))  # regression: rid false echoed as a bool
@example(payload=b"\x92\xa1\xb0\x01")  # regression: a non-UTF-8 tag killed the server
@example(payload=msgspec.msgpack.encode(["lookup", 1, 2**64 - 1, {"tokens": None}]))
def test_rpc_raw_payloads(rpc: RpcEnv, payload: bytes) -> None:
    rpc.check(rpc.raw.call(payload, timeout=10.0))
    rpc.assert_alive()


def test_rpc_zz_keeper_intact_and_no_leaked_leases(rpc: RpcEnv) -> None:
    """Runs after the fuzzing above (same module-scoped server): the fuzzer's clients go
    away, then nothing is left locked and the keeper's chunks are byte-exact."""
    rpc.assert_alive()
    for token in set(rpc.tokens):
        reply = rpc.raw.call(p.Unregister(1, token), timeout=10.0)
        assert isinstance(reply, (p.Ok, p.Error)), reply
        assert not isinstance(reply, p.Error) or reply.code is p.ErrorCode.NOT_REGISTERED, reply
    out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(4)]
    got = rpc.keeper.retrieve(KEEP, out)
    assert got.retrieved == [0, 1, 2, 3] and got.complete
    for i in range(4):
        np.testing.assert_array_equal(out[i], chunk_data(KEEP, i))
    s = rpc.keeper.stats()
    assert s.clients == 1, s.engines
    assert s.write_leases == 0 and s.writing == 0, s
    assert s.read_leases == 0 and s.read_locked == 0 and s.sessions == 0, s
    assert s.used == s.objects * CHUNK_BYTES, s
    assert s.errors.get("internal", 0) == 0, s.errors


# -- cluster fixtures --------------------------------------------------------------------
class ClusterEnv:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.signer = ControlSigner(TOKEN)
        self.raw = RawControl(node.addr)
        with node.client() as c:
            register(c, model="cluster-keeper")
            res = c.store(KEEP, [chunk_data(KEEP, i) for i in range(4)])
            assert res.stored == [0, 1, 2, 3]
            assert c.registration is not None
            self.keys = tk.chunk_keys(c.registration.namespace, tk.pack_tokens(KEEP), CHUNK_SIZE)
        (me,) = [i for i in m_members(node) if i.node_id == node.node_id]
        self.me = me
        wait_for(self.resolvable)

    def signed_call(self, payload: bytes) -> Any:
        return self.raw.call([self.signer.sign_request(payload), payload])

    def assert_alive(self) -> None:
        proc = self.node.server.proc
        assert proc is not None and proc.poll() is None, self.node.server.log()[-4000:]
        assert self.node.node_id in members(self.node)

    def resolvable(self) -> bool:
        reply = call(self.node.addr, m.Resolve(0, self.keys))
        assert isinstance(reply, m.Resolved), reply
        held = [set() for _ in self.keys]  # type: list[set[str]]
        for pos, h, _ in rows_of(reply):
            held[pos].add(reply.holders[h])
        return all(self.node.node_id in h for h in held)

    def retrieve_ok(self) -> bool:
        with self.node.client() as c:
            register(c, model="cluster-keeper")
            out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(4)]
            got = c.retrieve(KEEP, out)
            assert got.retrieved == [0, 1, 2, 3] and got.complete, got
            for i in range(4):
                np.testing.assert_array_equal(out[i], chunk_data(KEEP, i))
        return True


def m_members(node: Node) -> list[m.MemberInfo]:
    reply = call(node.addr, m.GetMembers(0))
    assert isinstance(reply, m.MemberList), reply
    return list(reply.members)


@pytest.fixture(scope="module")
def cluster(factory: Callable[..., ServerProcess]) -> Iterator[ClusterEnv]:
    node = start_node(factory, [], pool_size="32MiB", seed_self=True)
    env = ClusterEnv(node)
    try:
        yield env
    finally:
        env.raw.close()


# -- cluster strategies ------------------------------------------------------------------
ADDR = st.one_of(
    st.sampled_from(["127.0.0.1:1", "garbage", "", "x:1", "é:1", "127.0.0.1:99999", "[::1]:1"]),
    st.text(max_size=20),
)


def control_request(env: ClusterEnv) -> st.SearchStrategy[msgspec.Struct]:
    node_id = st.one_of(st.sampled_from([env.node.node_id, "fuzz:1"]), st.text(max_size=20))
    info = st.one_of(
        st.builds(m.MemberInfo, node_id=node_id, control=ADDR, data=ADDR, incarnation=I64),
        st.just(env.me),
    )
    key = st.one_of(BLOB, st.sampled_from(env.keys))
    other_key = BLOB  # never a kept key: unpublishing those would be a legitimate removal
    where = st.one_of(st.sampled_from([0, 1]), I64)
    return st.one_of(
        st.builds(m.Heartbeat, rid=I64, sender=info, members=st.lists(info, max_size=4)),
        st.builds(m.Leave, rid=I64, sender=info),
        st.builds(m.GetMembers, rid=I64),
        st.builds(
            m.Publish,
            rid=I64,
            holder=node_id,
            incarnation=I64,
            entries=st.lists(st.tuples(key, where), max_size=6),
        ),
        st.builds(m.Unpublish, rid=I64, holder=node_id, keys=st.lists(other_key, max_size=6)),
        st.builds(
            m.Handoff,
            rid=I64,
            entries=st.lists(st.tuples(key, node_id, I64, where), max_size=6),
        ),
        st.builds(m.Resolve, rid=I64, keys=st.lists(key, max_size=8)),
        st.builds(
            m.Digest,
            rid=I64,
            holder=node_id,
            counts=st.lists(I64, min_size=16, max_size=16) | st.lists(I64, max_size=17),
            hashes=st.lists(I64, min_size=16, max_size=16) | st.lists(I64, max_size=17),
        ),
        st.builds(m.GetStatus, rid=I64),
    )


CONTROL_TAGS = [t.__struct_config__.tag for t in typing.get_args(m.Request)]


def check_control_reply(reply: Any) -> None:
    assert isinstance(reply, typing.get_args(m.Reply)), reply
    if isinstance(reply, m.Refused):
        assert "internal" not in reply.reason, reply


# -- cluster control-plane tests ---------------------------------------------------------
def test_control_heartbeat_with_unparseable_address(cluster: ClusterEnv) -> None:
    """Regression (found by the fuzzer below): a signed heartbeat naming a control address
    ZMQ cannot parse made every later heartbeat round raise before it expired anyone, so
    the bogus member stayed forever and the node stopped heartbeating its real members."""
    bad = m.MemberInfo("fuzz:bad", "garbage", "", 1)
    check_control_reply(cluster.signed_call(m.encode(m.Heartbeat(1, bad, [bad]))))
    assert "fuzz:bad" in members(cluster.node)
    wait_for(lambda: "fuzz:bad" not in members(cluster.node), timeout=15.0)
    cluster.assert_alive()


def test_control_entries_the_ring_cannot_place_are_dropped(cluster: ClusterEnv) -> None:
    """Regression (found by the fuzzer below): a signed PUBLISH / HANDOFF with a key that is
    not 32 bytes was stored, and every later rebalance of the directory failed on it; an
    unknown Where would fail a resolve. Such entries are dropped; valid ones still land."""
    good = bytes(range(32))
    bad = [(b"short", 0), (bytes(33), 0), (good, 7)]
    reply = cluster.signed_call(m.encode(m.Publish(1, "fuzz:2", 1, [*bad, (good, 1)])))
    assert isinstance(reply, m.Done) and reply.count == 1, reply
    reply = cluster.signed_call(m.encode(m.Handoff(2, [(k, "fuzz:2", 1, w) for k, w in bad])))
    assert isinstance(reply, m.Done) and reply.count == 0, reply
    resolved = call(cluster.node.addr, m.Resolve(0, [good, b"short", bytes(33)]))
    assert isinstance(resolved, m.Resolved) and len(rows_of(resolved)) == 1, resolved
    assert cluster.signed_call(m.encode(m.Unpublish(3, "fuzz:2", [good]))) == m.Done(3, 1)


def test_control_other_holders_do_not_push_the_nodes_entry_out(cluster: ClusterEnv) -> None:
    """Regression (found by the fuzzer below, one run in many): a shard remembered four
    holders per key, so signed PUBLISH / HANDOFF entries of four other holders for a chunk
    of the node pushed the node's own entry out, until the next membership change (or the
    republish, 300 s later). Every holder keeps its entry; a node's own entries cannot be
    written from outside; entries of holders that are no members go after a while."""
    key = cluster.keys[0]
    ghosts = [f"fuzz:ghost{i}" for i in range(6)]
    reply = cluster.signed_call(m.encode(m.Handoff(1, [(key, g, 1, 0) for g in ghosts])))
    assert reply == m.Done(1, 6), reply
    reply = cluster.signed_call(m.encode(m.Publish(2, "fuzz:ghost9", 1, [(key, 0)])))
    assert reply == m.Done(2, 1), reply
    assert cluster.resolvable()
    reply = cluster.signed_call(m.encode(m.Unpublish(3, cluster.node.node_id, [key])))
    assert isinstance(reply, m.Refused), reply
    assert cluster.resolvable()


@settings(FUZZ, max_examples=120)
@given(data=st.data())
def test_control_signed_random_messages(cluster: ClusterEnv, data: st.DataObject) -> None:
    msg = data.draw(control_request(cluster), label="request")
    check_control_reply(cluster.signed_call(m.encode(msg)))
    cluster.assert_alive()


@settings(FUZZ, max_examples=120)
@given(payload=raw_payload(CONTROL_TAGS))
@example(payload=b"\x92\xa1\xb0\x01")  # regression: a non-UTF-8 tag killed the control thread
def test_control_signed_random_payloads(cluster: ClusterEnv, payload: bytes) -> None:
    check_control_reply(cluster.signed_call(payload))
    cluster.assert_alive()


def test_control_zz_node_recovers(cluster: ClusterEnv) -> None:
    """After the fuzzing: the bogus members expire (the heartbeat loop still runs), and the
    chunk stored on the node stays resolvable and retrievable."""
    cluster.assert_alive()
    wait_for(lambda: members(cluster.node) == {cluster.node.node_id}, timeout=30.0)
    wait_for(cluster.resolvable, timeout=30.0)
    assert cluster.retrieve_ok()


# -- data plane --------------------------------------------------------------------------
def _hello(node_id: bytes, version: int = VERSION, claimed: int | None = None) -> bytes:
    n = len(node_id) if claimed is None else claimed
    return HELLO.pack(b"TKVD", version, n) + node_id + bytes(NONCE_BYTES)


def _handshake(sock: socket.socket, node_id: bytes, holder: bytes) -> None:
    """A real reader's hello (so the garbage that follows reaches the request parser)."""
    mine = bytes(range(NONCE_BYTES))
    sock.sendall(HELLO.pack(b"TKVD", VERSION, len(node_id)) + node_id + mine)
    head = _recv_n(sock, HELLO_REPLY.size + NONCE_BYTES + MAC_BYTES)
    assert head[0] == 0, head
    theirs = head[HELLO_REPLY.size : HELLO_REPLY.size + NONCE_BYTES]
    sock.sendall(hello_proof(derive_key(TOKEN), b"reader", mine, theirs, node_id, holder))
    assert _recv_n(sock, HELLO_REPLY.size)[0] == 0


def _recv_n(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise ConnectionError("closed")
        buf += got
    return buf


def _drain(sock: socket.socket) -> None:
    """Read whatever the node answers until it closes or goes quiet (bounded)."""
    sock.settimeout(0.3)
    with contextlib.suppress(OSError):
        for _ in range(64):
            if not sock.recv(1 << 16):
                return


ITEM_LEN = st.one_of(
    st.sampled_from([0, 1, CHUNK_BYTES, CHUNK_BYTES - 1, 1 << 34, (1 << 34) + 1, 2**64 - 1]),
    st.integers(0, 2**64 - 1),
)


@st.composite
def data_plane_garbage(draw: st.DrawFn, keys: list[bytes]) -> tuple[str, bytes]:
    kind = draw(st.sampled_from(["bytes", "hello", "request"]))
    if kind == "bytes":
        return kind, draw(st.binary(max_size=300))
    if kind == "hello":
        node_id = draw(st.binary(max_size=40))
        whole = _hello(node_id, draw(st.integers(0, 2**16 - 1)), draw(st.integers(0, 2**16 - 1)))
        return kind, whole[: draw(st.integers(0, len(whole)))] + draw(st.binary(max_size=40))
    count = draw(st.one_of(st.integers(0, 6), st.sampled_from([4096, 4097, 2**32 - 1])))
    items = draw(
        st.lists(
            st.tuples(
                st.one_of(st.binary(min_size=32, max_size=32), st.sampled_from(keys)), ITEM_LEN
            ),
            max_size=6,
        )
    )
    body = REQUEST.pack(draw(st.sampled_from([b"TKVR", b"TKVX"])), count)
    body += b"".join(ITEM.pack(k, n) for k, n in items)
    body = body[: draw(st.integers(0, len(body)))] if draw(st.booleans()) else body
    return kind, body + draw(st.binary(max_size=20))


@settings(FUZZ, max_examples=120)
@given(data=st.data())
def test_data_plane_garbage(cluster: ClusterEnv, data: st.DataObject) -> None:
    kind, payload = data.draw(data_plane_garbage(cluster.keys), label="garbage")
    host, _, port = cluster.me.data.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5.0) as sock:
        try:
            if kind == "request":
                _handshake(sock, b"fuzz:data", cluster.me.node_id.encode())
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the node may close first: that is an answer too
        _drain(sock)
    cluster.assert_alive()


def test_data_plane_zz_real_fetch_still_works(cluster: ClusterEnv) -> None:
    cluster.assert_alive()
    reader = TcpTransport("127.0.0.1", 0, "127.0.0.1", TOKEN, "fuzz-reader", timeout=5.0)
    try:
        views = [memoryview(bytearray(CHUNK_BYTES)) for _ in cluster.keys]
        out = reader.fetch_many([(cluster.me, list(zip(cluster.keys, views, strict=True)))])
        assert out == [[LoadStatus.OK] * len(cluster.keys)]
        for i, view in enumerate(views):
            got = np.frombuffer(view, np.float32).reshape(CHUNK_SHAPE)
            np.testing.assert_array_equal(got, chunk_data(KEEP, i))
    finally:
        reader.close()
    # Every garbage connection was closed by the node (none left half-served).
    wait_for(lambda: status(cluster.node)["transport"]["serving_connections"] == 0, timeout=30.0)
    assert cluster.retrieve_ok()
