"""The data plane: moving chunk bytes from a holder's pool into a reader's reserved slots.

:class:`Transport` is the interface; :class:`TcpTransport` is the default, and
:class:`~tierkv.cluster.nixl_transport.NixlTransport` extends it with one-sided NIXL reads.

TCP wire format (little-endian, fixed-size headers):

- hello (a mutual challenge-response, see :mod:`tierkv.cluster.auth`; the secret never
  crosses the network): reader -> holder ``"TKVD"``, version, node id length, the reader's
  node id and a 16-byte nonce. Holder -> reader: a status byte (+7 padding), and when it is
  OK the holder's nonce and its proof (a MAC over both nonces); a wrong version gets VERSION
  and the connection closes. The reader checks the proof (an impostor holder is dropped
  here) and sends its own; the holder answers OK, or UNAUTHORIZED and closes. Nothing else is
  accepted before that OK. Each side's hello must be whole within one timeout (not one per
  byte), and a holder counts connections still in their hello apart from its members'
  (``max_serving``): at most :data:`MAX_HELLOS`, :data:`MAX_HELLOS_PER_HOST` from one address.
- request: ``"TKVR"``, chunk count (at most ``MAX_CHUNKS``), then per chunk its 32-byte key
  and the length the reader expects.
- reply, per chunk in request order: a 32-byte header (status, length, 16-byte XXH3-128
  checksum), then ``length`` payload bytes when the status is OK.
- other requests, same header: ``"TKVM"`` (count 0) asks for a holder's NIXL metadata; a
  TCP-only holder answers "no NIXL" (``META``, status NONE) so that a NIXL reader falls back
  to TCP. ``"TKVL"`` and ``"TKVU"`` (leases) are the NIXL transport's. Anything else closes
  the connection.

Holder side: every request read-locks the chunks in the pool (only committed chunks, only at
their own offsets and lengths: nothing else can be named), sends each header and payload
straight from the pool's memory (``sendmsg`` on a memoryview of the slot, no copy in user
space, in pieces: :mod:`tierkv.piecewise_io`), then releases the locks. The checksum it sends was
computed when the chunk was published, so bytes that changed in its pool since then fail
verification at the reader.

Reader side: a bounded pool of connections per peer (default 16), reused across requests
and returned only after a clean exchange; each request carries several chunks; a batch to
one peer is split into a few streams over separate connections, and streams to all peers
run in parallel. Payloads are received with ``recv_into`` straight into the reserved slot
views, in pieces, and verified with XXH3-128 as they land (which releases the GIL, so streams
hash in parallel). Any failure marks the affected chunks ERROR (or CORRUPT) and closes that
connection; nothing raises to the caller. Each wait for a peer lasts at most the socket
timeout, and one request's chunks at most ``transfer_limit`` in all (a holder that trickles
its bytes is cut off: the slots they land in are reserved only for the pool's write TTL); a
fetch returns only once every one of its streams has ended, so that nothing lands in a slot
after its caller gave it back.
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import logging
import math
import socket
import struct
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from tierkv.cluster import messages as m
from tierkv.cluster.auth import MAC_BYTES, NONCE_BYTES, derive_key, hello_proof, nonce
from tierkv.config import ConfigError
from tierkv.logs import FailureLog
from tierkv.piecewise_io import recv_exact, recv_hashed, send_all
from tierkv.priority import data_thread, moving_data
from tierkv.served_connections import AddressCounts
from tierkv.tiers.base import LoadStatus

log = logging.getLogger(__name__)
T = TypeVar("T")

VERSION = 3  # 3: hello proofs name the holder too
HELLO = struct.Struct("<4sHH8x")
HELLO_REPLY = struct.Struct("<B7x")
REQUEST = struct.Struct("<4sI")
ITEM = struct.Struct("<32sQ")
CHUNK = struct.Struct("<B7xQ16s")
# The NIXL transport's metadata request ("TKVM", count 0) and its reply: status, region
# generation, region base address, region size, metadata length (then the metadata).
META = struct.Struct("<B7xQQQQ")
META_OK, META_NONE = 0, 1
MAX_CHUNKS = 4096
MAX_NODE_ID = 256
# Connections in their hello (not yet shown to be members'), in all and from one address:
# each lasts one timeout at most; members' connections have max_serving places of their own.
MAX_HELLOS = 256
MAX_HELLOS_PER_HOST = 64
MAX_CHUNK_BYTES = 1 << 34
DEFAULT_STREAMS_PER_FETCH = 4  # connections one batch to one peer is split over
# Seconds one request's chunks may take in all (a holder that trickles its bytes): half the
# pool's default write TTL, for which the slots they land in stay reserved.
DEFAULT_TRANSFER_LIMIT = 300.0

HELLO_OK, HELLO_UNAUTHORIZED, HELLO_VERSION = 0, 1, 2
SENT_OK, SENT_MISSING, SENT_LENGTH, SENT_ERROR = 0, 1, 2, 3


class NoFreeConnection(TimeoutError):
    """Every pooled connection to the peer stayed busy for the whole timeout."""


class PeerRefused(Exception):
    """The hello failed: the holder refused us (another secret, or version), or could not
    prove it knows the cluster secret."""


@dataclass
class Served:
    """What a :class:`ChunkSource` hands out for one request: per chunk a read-only view of
    its pool slot and its checksum, or None where it is not served."""

    views: list[memoryview | None]
    checksums: list[bytes]
    handle: Any = None  # whatever release() needs (a lease id)


class ChunkSource(Protocol):
    """The holder's pool, as the data plane sees it."""

    def acquire(self, keys: Sequence[bytes], lengths: Sequence[int]) -> Served: ...

    def release(self, served: Served) -> None: ...


@dataclass
class PeerFigures:
    """Per-peer data-plane counters (reader side: received; holder side: sent)."""

    requests: int = 0
    chunks: int = 0
    bytes: int = 0
    missing: int = 0
    corrupt: int = 0
    errors: int = 0
    seconds: float = 0.0
    latencies: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=512)
    )
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(
        self,
        seconds: float,
        chunks: int,
        nbytes: int,
        missing: int = 0,
        corrupt: int = 0,
        errors: int = 0,
        requests: int = 1,
    ) -> None:
        with self.lock:
            self.requests += requests
            self.chunks += chunks
            self.bytes += nbytes
            self.missing += missing
            self.corrupt += corrupt
            self.errors += errors
            self.seconds += seconds
            if requests:
                self.latencies.append(seconds)

    def as_dict(self) -> dict[str, object]:
        with self.lock:
            lat = sorted(self.latencies)

        def pick(q: float) -> float | None:
            return round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3, 3) if lat else None

        return {
            "requests": self.requests,
            "chunks": self.chunks,
            "bytes": self.bytes,
            "missing": self.missing,
            "corrupt": self.corrupt,
            "errors": self.errors,
            "gbps": round(self.bytes / self.seconds / 1e9, 3) if self.seconds else 0.0,
            "latency_ms_p50": pick(0.5),
            "latency_ms_p99": pick(0.99),
        }


class Transport(ABC):
    """Moves chunks between pools of cluster members."""

    address: str  # HOST:PORT peers reach this node's data plane at (once bound)

    @abstractmethod
    def bind(self, node_id: str = "") -> None:
        """Open the listener peers connect to; ``node_id`` names this node to them."""

    @abstractmethod
    def serve(self, source: ChunkSource) -> None:
        """Start answering peers' fetches from ``source``."""

    @abstractmethod
    def fetch_many(
        self,
        batches: Sequence[tuple[m.MemberInfo, Sequence[tuple[bytes, memoryview]]]],
        verified: dict[bytes, bytes] | None = None,
    ) -> list[list[LoadStatus]]:
        """Fill each (key, writable view) from its batch's holder, all holders in parallel;
        a status per item, in order. ``verified``, if given, receives key -> checksum of
        every chunk that arrived intact (so it need not be hashed again to publish it)."""

    @abstractmethod
    def close(self) -> None: ...

    def stats(self) -> dict[str, object]:
        return {}


# -- socket helpers ----------------------------------------------------------------------
def _recv_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact(sock, memoryview(buf))
    return bytes(buf)


def _recv_by(sock: socket.socket, n: int, deadline: float, what: str = "a peer's hello") -> bytes:
    """``n`` bytes of ``what``, all of them by ``deadline`` (monotonic; TimeoutError after
    it). A timeout per ``recv`` alone let a peer sending a byte now and then keep a hello
    going for as many timeouts as the hello has bytes."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{what} was not whole in time ({got} of {n} bytes)")
        sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed by the peer")
        got += k
    return bytes(buf)


# A peer's connection that carries nothing for KEEPALIVE_IDLE seconds is probed, and closed
# after KEEPALIVE_PROBES unanswered probes KEEPALIVE_INTERVAL apart: a holder's served
# connections wait for the reader's next request with no timeout, and one whose reader's
# host vanished (no FIN, no RST) held its thread and its place among max_serving for the
# kernel's default of two hours and more.
KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_PROBES = 60, 10, 6


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # (Linux; elsewhere the system's defaults)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)


def every_result(futures: Sequence[Future[T]]) -> list[T | None]:
    """The futures' results once every one has ended (None for one that raised, logged):
    the streams of a fetch write into slots the caller frees when it returns, so it returns
    only when none is left running, whatever one of them raised."""
    wait(futures)
    out: list[T | None] = []
    for fut in futures:
        try:
            out.append(fut.result())
        except Exception:
            log.exception("a peer fetch failed")
            out.append(None)
    return out


def split_host_port(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


# -- the TCP transport -------------------------------------------------------------------
class _Conn:
    __slots__ = ("reused", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reused = False


class _PeerPool:
    """Bounded connections to one peer (one incarnation of it)."""

    def __init__(self, limit: int) -> None:
        self.slots = threading.BoundedSemaphore(limit)
        self.idle: list[_Conn] = []
        self.lock = threading.Lock()


class TcpTransport(Transport):
    def __init__(
        self,
        host: str,
        port: int,
        advertise_host: str,
        token: str,
        node_id: str,
        connections_per_peer: int = 16,
        streams_per_fetch: int = DEFAULT_STREAMS_PER_FETCH,
        timeout: float = 5.0,
        max_serving: int = 512,
        corrupt_hook: Callable[[bytes], bool] | None = None,
        transfer_limit: float = DEFAULT_TRANSFER_LIMIT,
    ) -> None:
        """``timeout``: each wait for a peer; ``transfer_limit``: seconds one request's
        chunks may take in all, however slowly a holder sends them (the slots they land in
        are reserved for the pool's write TTL: the limit must be well under it)."""
        self.key = derive_key(token)
        self.transfer_limit = transfer_limit
        self.node_id = node_id.encode()
        self.limit = connections_per_peer
        self.streams = max(1, min(streams_per_fetch, connections_per_peer))
        self.timeout = timeout
        self.max_serving = max_serving
        self.corrupt_hook = corrupt_hook  # tests only: flip sent bytes of chosen keys
        self.host, self.port = host, port  # port 0: the one bind() got
        self.advertise_host = advertise_host
        self.address = ""  # advertise_host:port, once bound
        self._listener: socket.socket | None = None
        self._pools: dict[tuple[str, int], _PeerPool] = {}
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(
            max(8, 4 * self.streams), thread_name_prefix="tierkv-peer-io", initializer=data_thread
        )
        self._source: ChunkSource | None = None
        self._stop = threading.Event()
        self._serving: set[socket.socket] = set()  # members' connections, after the hello
        self._hellos = AddressCounts()  # connections in their hello, per peer address
        self.hellos_refused = 0  # connections closed before their hello: too many in one
        self._refusals = FailureLog("cluster data port", log)
        self._accept_thread: threading.Thread | None = None
        self.received: dict[str, PeerFigures] = {}
        self.sent: dict[str, PeerFigures] = {}
        self.refused_hellos = 0
        self.refused_by_peers = 0
        self.connections_opened = 0  # reader side: pooled connections are reused

    # -- holder side -----------------------------------------------------------------------
    def bind(self, node_id: str = "") -> None:
        """Open the listening socket (once); :attr:`port` and :attr:`address` are known from
        then on. ``node_id`` replaces the one given at construction (a node learns its id
        when its control socket is bound)."""
        if node_id:
            self.node_id = node_id.encode()
        if self._listener is not None:
            return
        try:
            self._listener = socket.create_server((self.host, self.port), backlog=128)
        except OSError as exc:
            raise ConfigError(
                f"cannot bind the cluster data port {self.host}:{self.port}: {exc} (choose "
                "another --cluster-data-port, or stop the server using it)"
            ) from None
        self.port = self._listener.getsockname()[1]
        self.address = f"{self.advertise_host}:{self.port}"

    def serve(self, source: ChunkSource) -> None:
        """Bind (if not yet) and serve ``source``'s chunks to peers on a thread."""
        self.bind()
        assert self._listener is not None
        self._source = source
        self._listener.settimeout(0.2)
        self._accept_thread = threading.Thread(
            target=self._accept, name="tierkv-peer-accept", daemon=True
        )
        self._accept_thread.start()

    def _accept(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._stop.is_set():
            try:
                sock, addr = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.05)
                continue
            # From accept's answer: getpeername fails on a connection reset since.
            host = str(addr[0]) if isinstance(addr, tuple) else "?"
            with self._lock:
                why = self._no_room_for_hello(host)
                if not why:
                    self._hellos.add(host)
            if why:
                self.hellos_refused += 1
                self._refusals.failed("accepting a connection", why)
                sock.close()
                continue
            try:
                threading.Thread(
                    target=self._serve_conn,
                    args=(sock, host),
                    name="tierkv-peer-serve",
                    daemon=True,
                ).start()
            except BaseException:  # no thread to end its hello: it ends here
                self._hello_ended(host)
                sock.close()
                if self._stop.is_set():
                    return
                log.exception("could not serve a peer connection")

    def _no_room_for_hello(self, host: str) -> str:
        """Why a new connection from ``host`` is refused before its hello ("": it is not).
        Connections still in their hello are counted apart from the members' (a client
        without the secret must not take the places of authenticated readers), in all and
        per address."""
        if self._hellos.total() >= MAX_HELLOS:
            return f"{MAX_HELLOS} connections are in their hello already"
        if self._hellos.get(host, 0) >= MAX_HELLOS_PER_HOST:
            return f"{MAX_HELLOS_PER_HOST} connections from {host} are in their hello already"
        return ""

    def _hello_ended(self, host: str) -> None:
        with self._lock:
            self._hellos.remove(host)

    def _serve_conn(self, sock: socket.socket, host: str) -> None:
        """Serve one peer connection; ``host``: its address as accept gave it (its hello's
        place is counted under it)."""
        try:
            try:
                data_thread()
                _tune(sock)
                peer = self._handshake(sock, time.monotonic() + self.timeout)
            finally:
                self._hello_ended(host)
            if peer is None:
                return
            self._refusals.ok()
            with self._lock:
                full = len(self._serving) >= self.max_serving
                if not full:
                    self._serving.add(sock)
            if full:
                log.warning("refusing a peer connection: %d already open", self.max_serving)
                return
            sock.settimeout(None)  # pooled: idle until the reader's next request
            figures = self._figures(self.sent, peer)
            head = bytearray(REQUEST.size)
            while not self._stop.is_set():
                try:
                    recv_exact(sock, memoryview(head))
                except (ConnectionError, OSError):
                    return
                magic, count = REQUEST.unpack(head)
                sock.settimeout(self.timeout)
                if magic != b"TKVR":
                    if not self._other_request(sock, peer, magic, count):
                        return  # logged
                    sock.settimeout(None)
                    continue
                items = self._read_items(sock, peer, count)
                if items is None:
                    return
                with moving_data():
                    self._answer(sock, peer, figures, items)
                sock.settimeout(None)
        except (ConnectionError, OSError) as exc:
            log.debug("peer connection ended: %s", exc)
        except Exception:
            log.exception("serving a peer connection failed")
        finally:
            with self._lock:
                self._serving.discard(sock)
            with contextlib.suppress(OSError):
                sock.close()

    def _read_items(
        self, sock: socket.socket, peer: str, count: int
    ) -> list[tuple[bytes, int]] | None:
        """A request's (key, length) items; None (logged) when the request is malformed."""
        if not 0 < count <= MAX_CHUNKS:
            log.warning("closing a peer connection from %s: bad chunk count %d", peer, count)
            return None
        raw = _recv_bytes(sock, count * ITEM.size)
        items = [ITEM.unpack_from(raw, i * ITEM.size) for i in range(count)]
        if any(not 0 < n <= MAX_CHUNK_BYTES for _, n in items):
            log.warning("closing a peer connection from %s: bad chunk length", peer)
            return None
        return items

    def _other_request(self, sock: socket.socket, peer: str, magic: bytes, count: int) -> bool:
        """A request other than TKVR; False (logged) closes the connection. Here: TKVM (a
        NIXL transport's metadata request) is answered "no NIXL", so that a NIXL reader
        falls back to TCP with this holder."""
        if magic == b"TKVM" and count == 0:
            sock.sendall(META.pack(META_NONE, 0, 0, 0, 0))
            return True
        log.warning(
            "closing a peer connection from %s: bad request %r (count %d)", peer, magic, count
        )
        return False

    def _handshake(self, sock: socket.socket, deadline: float) -> str | None:
        """The holder's side of the hello, whole by ``deadline``; the reader's node id, or
        None (refused, counted)."""
        magic, version, node_len = HELLO.unpack(_recv_by(sock, HELLO.size, deadline))
        if magic != b"TKVD" or node_len > MAX_NODE_ID:
            self.refused_hellos += 1
            return None
        reader = _recv_by(sock, node_len, deadline)
        theirs = _recv_by(sock, NONCE_BYTES, deadline)
        node = reader.decode(errors="replace")
        if version != VERSION:
            self.refused_hellos += 1  # counted before the answer: a test may look at once
            sock.sendall(HELLO_REPLY.pack(HELLO_VERSION))
            return None
        mine = nonce()
        proof = hello_proof(self.key, b"holder", mine, theirs, reader, self.node_id)
        sock.sendall(HELLO_REPLY.pack(HELLO_OK) + mine + proof)
        expected = hello_proof(self.key, b"reader", theirs, mine, reader, self.node_id)
        try:
            answer = _recv_by(sock, MAC_BYTES, deadline)
        except (ConnectionError, OSError):
            # A reader with another secret cannot check our proof and hangs up here.
            # (Logged through _refusals, at WARNING once a minute at most: anyone who
            # reaches the port can do this, and a line each time flooded the log.)
            self.refused_hellos += 1
            self._refusals.failed("a hello", f"from {node!r}: abandoned (another secret?)")
            return None
        if not hmac.compare_digest(answer, expected):
            self.refused_hellos += 1
            self._refusals.failed("a hello", f"from {node!r}: a wrong secret")
            sock.sendall(HELLO_REPLY.pack(HELLO_UNAUTHORIZED))
            return None
        sock.sendall(HELLO_REPLY.pack(HELLO_OK))
        return node

    def _answer(
        self,
        sock: socket.socket,
        peer: str,
        figures: PeerFigures,
        items: list[tuple[bytes, int]],
    ) -> None:
        assert self._source is not None
        started = time.perf_counter()
        keys = [k for k, _ in items]
        served = self._source.acquire(keys, [n for _, n in items])
        sent_bytes = chunks = missing = 0
        try:
            for i, (key, want) in enumerate(items):
                view = served.views[i]
                if view is None:
                    missing += 1
                    send_all(sock, [CHUNK.pack(SENT_MISSING, 0, bytes(16))])
                elif len(view) != want:
                    missing += 1
                    send_all(sock, [CHUNK.pack(SENT_LENGTH, len(view), bytes(16))])
                else:
                    digest = served.checksums[i]
                    if self.corrupt_hook is not None and self.corrupt_hook(key):
                        digest = bytes(b ^ 0xFF for b in digest)
                    send_all(sock, [CHUNK.pack(SENT_OK, len(view), digest), view])
                    sent_bytes += len(view)
                    chunks += 1
                view = None
        finally:
            self._source.release(served)
        figures.add(time.perf_counter() - started, chunks, sent_bytes, missing=missing)

    # -- reader side -----------------------------------------------------------------------
    def _pool(self, peer: m.MemberInfo) -> _PeerPool:
        key = (peer.data, peer.incarnation)
        with self._lock:
            pool = self._pools.get(key)
            if pool is None:
                pool = self._pools[key] = _PeerPool(self.limit)
            return pool

    def forget(self, peer: m.MemberInfo) -> None:
        """Close pooled connections to a peer that left or restarted."""
        with self._lock:
            pools = [p for k, p in self._pools.items() if k[0] == peer.data]
            for k in [k for k in self._pools if k[0] == peer.data]:
                del self._pools[k]
        for pool in pools:
            with pool.lock:
                conns, pool.idle = pool.idle, []
            for conn in conns:
                with contextlib.suppress(OSError):
                    conn.sock.close()

    def _connect(self, peer: m.MemberInfo) -> _Conn:
        try:
            host, port = split_host_port(peer.data)
            if not 0 < port < 65536:
                raise ValueError(port)
        except ValueError:  # a member advertising nonsense: a failed fetch, like a dead one
            raise ConnectionError(
                f"peer {peer.node_id} advertises an unusable data address {peer.data!r}"
            ) from None
        try:
            sock = socket.create_connection((host, port), timeout=self.timeout)
        except (ValueError, TypeError) as exc:  # a host name the resolver cannot take
            raise ConnectionError(
                f"peer {peer.node_id} advertises an unusable data address {peer.data!r}: {exc}"
            ) from None
        try:
            _tune(sock)
            deadline = time.monotonic() + self.timeout  # for the whole hello
            mine = nonce()
            hello = HELLO.pack(b"TKVD", VERSION, len(self.node_id))
            sock.sendall(hello + self.node_id + mine)
            (status,) = HELLO_REPLY.unpack(_recv_by(sock, HELLO_REPLY.size, deadline))
            if status == HELLO_OK:
                theirs = _recv_by(sock, NONCE_BYTES, deadline)
                proof = _recv_by(sock, MAC_BYTES, deadline)
                holder = peer.node_id.encode()
                expected = hello_proof(self.key, b"holder", theirs, mine, self.node_id, holder)
                if not hmac.compare_digest(proof, expected):
                    self.refused_by_peers += 1
                    raise PeerRefused(
                        f"peer {peer.node_id} at {peer.data} could not prove the cluster "
                        "secret as that member (another --auth-token, not a member, or "
                        "another member at that address): not reading from it"
                    )
                proof = hello_proof(self.key, b"reader", mine, theirs, self.node_id, holder)
                sock.sendall(proof)
                (status,) = HELLO_REPLY.unpack(_recv_by(sock, HELLO_REPLY.size, deadline))
            sock.settimeout(self.timeout)
        except BaseException:
            sock.close()
            raise
        if status != HELLO_OK:
            sock.close()
            self.refused_by_peers += 1
            raise PeerRefused(
                f"peer {peer.node_id} refused our data-plane hello "
                f"({'another cluster secret' if status == HELLO_UNAUTHORIZED else 'version'})"
            )
        self.connections_opened += 1
        return _Conn(sock)

    def fetch_many(
        self,
        batches: Sequence[tuple[m.MemberInfo, Sequence[tuple[bytes, memoryview]]]],
        verified: dict[bytes, bytes] | None = None,
    ) -> list[list[LoadStatus]]:
        out: list[list[LoadStatus]] = [[LoadStatus.ERROR] * len(items) for _, items in batches]
        jobs = []
        for b, (peer, items) in enumerate(batches):
            if not items:
                continue
            total = sum(len(v) for _, v in items)
            streams = max(1, min(self.streams, len(items), math.ceil(total / (4 * 2**20))))
            bounds = [round(s * len(items) / streams) for s in range(streams + 1)]
            for s in range(streams):
                lo, hi = bounds[s], bounds[s + 1]
                for start in range(lo, hi, MAX_CHUNKS):
                    end = min(hi, start + MAX_CHUNKS)
                    jobs.append((b, start, peer, list(items[start:end])))
        if len(jobs) == 1:
            b, start, peer, part = jobs[0]
            out[b][start : start + len(part)] = self._stream(peer, part, verified)
            return out
        futures = [
            (b, start, len(part), self._executor.submit(self._stream, peer, part, verified))
            for b, start, peer, part in jobs
        ]
        results = every_result([f for *_, f in futures])
        for (b, start, n, _), got in zip(futures, results, strict=True):
            if got is not None:
                out[b][start : start + n] = got
        return out

    def _call(
        self,
        peer: m.MemberInfo,
        exchange: Callable[[socket.socket], T],
        may_retry: Callable[[], bool] = lambda: True,
    ) -> T:
        """One request-reply ``exchange`` on a pooled connection to ``peer``. A pooled
        connection the peer dropped while idle fails at once: the exchange is retried once on
        a fresh one when ``may_retry()`` says nothing was done yet (never after a timeout).
        Raises what failed: OSError, ConnectionError, PeerRefused, or
        :class:`NoFreeConnection`."""
        pool = self._pool(peer)
        if not pool.slots.acquire(timeout=self.timeout):
            raise NoFreeConnection(f"no free data-plane connection to {peer.node_id}")
        try:
            for attempt in range(2):
                conn: _Conn | None = None
                try:
                    with pool.lock:
                        conn = pool.idle.pop() if pool.idle else None
                    if conn is None:
                        conn = self._connect(peer)
                    conn.sock.settimeout(self.timeout)
                    result = exchange(conn.sock)
                    conn.reused = True
                    with pool.lock:
                        pool.idle.append(conn)
                    conn = None
                    return result
                except (OSError, ConnectionError) as exc:
                    # A timeout is a slow peer, not a dropped connection: the request may
                    # be under way there (a lease granted twice, twice the wait).
                    stale = (
                        conn is not None
                        and conn.reused
                        and attempt == 0
                        and not isinstance(exc, TimeoutError)
                        and may_retry()
                    )
                    if not stale:
                        raise
                finally:
                    if conn is not None:
                        with contextlib.suppress(OSError):
                            conn.sock.close()
            raise AssertionError("unreachable")
        finally:
            pool.slots.release()

    def _stream(
        self,
        peer: m.MemberInfo,
        items: list[tuple[bytes, memoryview]],
        verified: dict[bytes, bytes] | None = None,
    ) -> list[LoadStatus]:
        """One request on one pooled connection; a status per item."""
        figures = self._figures(self.received, peer.node_id)
        statuses = [LoadStatus.ERROR] * len(items)
        started = time.perf_counter()
        try:
            self._call(
                peer,
                lambda sock: self._exchange(sock, items, statuses, verified),
                may_retry=lambda: all(st is LoadStatus.ERROR for st in statuses),
            )
        except NoFreeConnection:
            figures.add(0.0, 0, 0, errors=len(items), requests=0)
            return statuses
        except PeerRefused as exc:
            log.error("%s", exc)
        except (OSError, ConnectionError) as exc:
            log.warning("fetch from %s failed: %s", peer.node_id, exc)
        except Exception:  # a failed fetch, whatever raised: its chunks are ERROR
            log.exception("fetch from %s failed", peer.node_id)
        ok = [len(v) for (_, v), st in zip(items, statuses, strict=True) if st is LoadStatus.OK]
        figures.add(
            time.perf_counter() - started,
            len(ok),
            sum(ok),
            missing=statuses.count(LoadStatus.MISSING),
            corrupt=statuses.count(LoadStatus.CORRUPT),
            errors=statuses.count(LoadStatus.ERROR),
        )
        if LoadStatus.CORRUPT in statuses:
            log.warning(
                "%d chunks from %s failed their checksum: dropped",
                statuses.count(LoadStatus.CORRUPT),
                peer.node_id,
            )
        return statuses

    def _figures(self, table: dict[str, PeerFigures], peer: str) -> PeerFigures:
        figures = table.get(peer)
        if figures is None:
            with self._lock:
                figures = table.setdefault(peer, PeerFigures())
        return figures

    def _exchange(
        self,
        sock: socket.socket,
        items: list[tuple[bytes, memoryview]],
        statuses: list[LoadStatus],
        verified: dict[bytes, bytes] | None = None,
    ) -> None:
        """Send one request, receive every chunk into its view and set its status (the
        connection is clean only if this returns normally)."""
        sock.settimeout(self.timeout)
        deadline = time.monotonic() + self.transfer_limit
        request = [REQUEST.pack(b"TKVR", len(items))]
        request += [ITEM.pack(key, len(view)) for key, view in items]
        send_all(sock, [b"".join(request)])
        head = bytearray(CHUNK.size)
        hview = memoryview(head)
        for i, (key, view) in enumerate(items):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the chunks took over {self.transfer_limit:g} s")
            recv_exact(sock, hview)
            status, length, digest = CHUNK.unpack(head)
            if status == SENT_OK:
                if length != len(view):
                    raise ConnectionError(f"peer sent {length} bytes for a {len(view)}-byte slot")
                target = view.cast("B") if view.format != "B" else view
                ok = recv_hashed(sock, target, deadline=deadline) == digest
                statuses[i] = LoadStatus.OK if ok else LoadStatus.CORRUPT
                if ok and verified is not None:
                    verified[key] = digest  # one dict store: atomic under the GIL
            else:
                statuses[i] = LoadStatus.MISSING

    # -- lifecycle and figures -------------------------------------------------------------
    def close(self) -> None:
        self._stop.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
        if self._accept_thread is not None:
            self._accept_thread.join(2.0)
        with self._lock:
            serving = list(self._serving)
            pools = list(self._pools.values())
            self._pools.clear()
        for sock in serving:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for pool in pools:
            for conn in pool.idle:
                with contextlib.suppress(OSError):
                    conn.sock.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict[str, object]:
        return {
            "address": self.address,
            "received": {peer: f.as_dict() for peer, f in list(self.received.items())},
            "sent": {peer: f.as_dict() for peer, f in list(self.sent.items())},
            "serving_connections": len(self._serving),
            "refused_hellos": self.refused_hellos,
            "hellos_refused_busy": self.hellos_refused,
            "refused_by_peers": self.refused_by_peers,
            "connections_opened": self.connections_opened,
        }
