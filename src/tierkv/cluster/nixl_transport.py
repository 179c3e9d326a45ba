"""The NIXL data plane: peers read chunks one-sided (NIXL READ over UCX) straight from the
holder's registered pool into the reader's reserved slots, under leases the holder grants
over the authenticated TCP data channel. TCP stays the fallback, per peer.

:class:`NixlTransport` is a :class:`~tierkv.cluster.transport.TcpTransport` (same listener,
same authenticated hello, same TKVR requests) with three more request types on the same
connections, after the hello only (little-endian, fixed-size headers):

- ``"TKVM"``, count 0: the holder's NIXL metadata. Reply: status (OK, or NONE when it has no
  NIXL), the region's generation, base address and size, the metadata's length, then the
  metadata. It never travels outside this authenticated channel.
- ``"TKVL"``, count, per chunk its key and expected length (as TKVR): a lease. The holder
  read-locks the chunks (:meth:`ChunkSource.acquire`) and keeps the locks until the lease is
  released or expires (:mod:`tierkv.cluster.leases`). Reply: status (OK, NONE: no region,
  BUSY: too many leases), the lease's time to live (ms), its id (0: nothing leased), the
  region's generation; then per chunk status (OK, MISSING, LENGTH, OUTSIDE: not in the
  registered region), offset in the region, length and XXH3-128 checksum.
- ``"TKVU"``, count 1, a lease id: release it. Reply: status (OK, UNKNOWN: expired,
  released already, or another peer's) and the number of chunks it held.

A READ carries a completion notification for the holder: ``"TKVU"`` and the lease id
(:data:`COMPLETED`, 12 bytes), which NIXL delivers to the holder's agent once the transfer
is done; the holder then releases that lease (:mod:`tierkv.cluster.leases`). A reader
sends TKVU itself only when its READ did not complete.

A malformed request closes the connection with a warning, as a malformed TKVR does.

Reader: per peer (address and incarnation) it loads the holder's metadata once, then per
batch takes a lease, READs every leased chunk with one transfer into its slots (which must
lie in its own registered pool; others go over TCP), polls the transfer until a deadline of
its own (the peer timeout, and never past the lease's time to live) and verifies each
chunk's checksum; the READ's notification releases the lease. A deadline passed or a failed
READ makes the chunks ERROR: a miss, never a hang. NIXL cannot stop such a READ, so its
slots stay fenced in this node's pool, and nothing else is fetched into them, until it has
ended (:mod:`tierkv.cluster.late_reads`); the peer's agent is unloaded then. A holder without
NIXL, metadata NIXL refuses, a region the holder unregistered or a failed READ send that
peer's reads over TCP (one log line per event; retried after :data:`FALLBACK_RETRY` seconds,
except for a holder without NIXL).
"""

from __future__ import annotations

import itertools
import logging
import math
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tierkv.checksums import checksum
from tierkv.cluster import messages as m
from tierkv.cluster.late_reads import LateReads, SlotFence
from tierkv.cluster.leases import LeaseTable
from tierkv.cluster.nixl_agent import (
    DONE,
    REFUSED,
    TIMEOUT,
    Agent,
    NixlError,
    address_of,
    ucx_transports,
    unavailable,
)
from tierkv.cluster.transport import (
    ITEM,
    MAX_CHUNKS,
    META,
    META_NONE,
    META_OK,
    REQUEST,
    SENT_LENGTH,
    SENT_MISSING,
    SENT_OK,
    PeerFigures,
    PeerRefused,
    Served,
    TcpTransport,
    _recv_by,
    _recv_bytes,
    every_result,
)
from tierkv.piecewise_io import send_all
from tierkv.tiers.base import LoadStatus

log = logging.getLogger(__name__)

LEASE_HEAD = struct.Struct("<B3xIQQ")  # status, ttl ms, lease id, generation
LEASED = struct.Struct("<B7xQQ16s")  # status, offset, length, checksum
RELEASE = struct.Struct("<Q")  # lease id
RELEASED = struct.Struct("<B7xQ")  # status, chunks released
COMPLETED = struct.Struct("<4sQ")  # a READ's notification: b"TKVU", lease id
LEASE_OK, LEASE_NONE, LEASE_BUSY = 0, 1, 2
SENT_OUTSIDE = 4
RELEASE_OK, RELEASE_UNKNOWN = 0, 1
MAX_METADATA = 1 << 20
FALLBACK_RETRY = 30.0  # seconds a peer's reads stay on TCP after NIXL failed for it
MIN_LEASE_TTL, MAX_LEASE_TTL = 0.01, 86400.0  # seconds; sent in ms, as 32 bits
_ZERO = bytes(16)
EXPIRED = "EXPIRED"


@dataclass
class _Remote:
    """A holder's agent, loaded from its metadata. ``users``: fetches reading from it now
    (under the transport's ``_nixl_lock``); ``dropped``: taken out of use, to be unloaded
    once none uses it (and its given-up READs have ended)."""

    agent: str
    generation: int
    base: int
    size: int
    key: tuple[str, int] = ("", 0)
    users: int = 0
    dropped: bool = False


class NixlTransport(TcpTransport):
    """TCP plus one-sided NIXL reads under leases; see the module docstring."""

    def __init__(
        self,
        host: str,
        port: int,
        advertise_host: str,
        token: str,
        node_id: str,
        region: memoryview | None = None,
        lease_ttl: float = 10.0,
        max_leases: int = 1024,
        fence: SlotFence | None = None,
        honour_lease_deadline: bool = True,
        metadata_hook: Callable[[bytes], bytes] | None = None,
        before_read: Callable[[int], None] | None = None,
        **kwargs: object,
    ) -> None:
        """``region``: this node's pool mapping, registered with NIXL (peers READ from it,
        this node's READs land in it); ``fence``: the pool's index, which keeps the slots of
        a READ given up at its deadline from reuse until the READ has ended
        (:mod:`tierkv.cluster.late_reads`). The last three arguments are for tests only:
        read past a lease's deadline (a READ that lands late), alter the metadata handed
        out, call ``before_read(lease_id)`` between the lease and the READ."""
        super().__init__(host, port, advertise_host, token, node_id, **kwargs)  # type: ignore[arg-type]
        if not MIN_LEASE_TTL <= lease_ttl <= MAX_LEASE_TTL:
            raise ValueError(
                f"a lease's time to live must be {MIN_LEASE_TTL} to {MAX_LEASE_TTL} s, "
                f"not {lease_ttl}"
            )
        self.lease_ttl = lease_ttl
        self.honour_lease_deadline = honour_lease_deadline
        self.metadata_hook = metadata_hook
        self.before_read = before_read
        self.agent: Agent | None = None
        self.generation = 0
        why = unavailable()
        if not why:
            try:
                self.agent = Agent(f"tierkv-{uuid.uuid4().hex[:16]}")
                if region is not None:
                    self.agent.register(region)
                    self.generation = 1
            except NixlError as exc:
                why, self.agent = str(exc), None
        self.why_not_nixl = why
        self.late: LateReads | None = None
        if self.agent is not None:
            # A failed READ's slots stay fenced as long as a READ may take.
            grace = max(self.timeout, lease_ttl)
            self.late = LateReads(self.agent, self.agent.base, fence, grace)
        if why:
            log.warning("peer transport nixl: %s; peers read from this node over TCP", why)
        self.leases = LeaseTable(
            self._release_served, lease_ttl, max_leases, notifications=self._completed_reads
        ).start()
        self._remotes: dict[tuple[str, int], _Remote] = {}
        self._tcp_only: dict[tuple[str, int], float] = {}  # until (monotonic)
        # Holders whose agent waits to be unloaded: not loaded again until it is (loading
        # an agent's metadata again invalidates its READs still running).
        self._unloading: set[tuple[str, int]] = set()
        self._loading: dict[tuple[str, int], threading.Event] = {}  # set once loaded
        # Loads under way when membership forgot their holder: dropped once loaded.
        self._stale_loads: set[tuple[str, int]] = set()
        self._nixl_lock = threading.Lock()  # the tables above, remotes' users; no I/O under it
        self.nixl_received: dict[str, PeerFigures] = {}
        self._counts_lock = threading.Lock()  # the three READ counters below (_count)
        self.fallbacks = 0  # under _nixl_lock
        self.read_timeouts = 0
        self.read_errors = 0
        self.leases_expired_unread = 0

    # -- holder side -----------------------------------------------------------------------
    def unregister(self) -> None:
        """Stop offering the pool to NIXL reads (readers fall back to TCP)."""
        if self.agent is not None:
            self.agent.unregister()
            self.generation += 1

    def _completed_reads(self) -> list[int]:
        """The lease ids named by READ completion notifications since the last call."""
        agent = self.agent
        if agent is None:
            return []
        ids = []
        for msg in agent.notifications():
            if len(msg) == COMPLETED.size:
                magic, lease_id = COMPLETED.unpack(msg)
                if magic == b"TKVU":
                    ids.append(lease_id)
        return ids

    def _release_served(self, served: Served) -> None:
        if self._source is not None:
            self._source.release(served)

    def _other_request(self, sock: socket.socket, peer: str, magic: bytes, count: int) -> bool:
        if magic == b"TKVM" and count == 0:
            agent = self.agent
            if agent is None or not agent.registered:
                sock.sendall(META.pack(META_NONE, 0, 0, 0, 0))
                return True
            md = agent.metadata()
            if self.metadata_hook is not None:
                md = self.metadata_hook(md)
            head = META.pack(META_OK, self.generation, agent.base, agent.size, len(md))
            send_all(sock, [head, md])
            return True
        if magic == b"TKVL":
            items = self._read_items(sock, peer, count)
            if items is None:
                return False
            self._grant(sock, peer, items)
            return True
        if magic == b"TKVU" and count == 1:
            (lease_id,) = RELEASE.unpack(_recv_bytes(sock, RELEASE.size))
            n = self.leases.end(lease_id, peer)
            sock.sendall(RELEASED.pack(RELEASE_OK if n else RELEASE_UNKNOWN, n))
            return True
        return super()._other_request(sock, peer, magic, count)

    def _grant(self, sock: socket.socket, peer: str, items: list[tuple[bytes, int]]) -> None:
        """Answer a lease request (see the module docstring)."""
        agent, source = self.agent, self._source
        ttl_ms = int(self.lease_ttl * 1000)
        if agent is None or not agent.registered or source is None:
            entry = LEASED.pack(SENT_OUTSIDE, 0, 0, _ZERO)
            send_all(sock, [LEASE_HEAD.pack(LEASE_NONE, ttl_ms, 0, self.generation)])
            send_all(sock, [entry * len(items)])
            return
        served = source.acquire([k for k, _ in items], [n for _, n in items])
        entries: list[bytes] = []
        leased = 0
        for i, (key, want) in enumerate(items):
            view = served.views[i]
            if view is None:
                entries.append(LEASED.pack(SENT_MISSING, 0, 0, _ZERO))
                continue
            if len(view) != want:
                entries.append(LEASED.pack(SENT_LENGTH, 0, len(view), _ZERO))
                continue
            addr = address_of(view)
            if not agent.inside(addr, len(view)):
                entries.append(LEASED.pack(SENT_OUTSIDE, 0, 0, _ZERO))
                continue
            digest = served.checksums[i]
            if self.corrupt_hook is not None and self.corrupt_hook(key):
                digest = bytes(b ^ 0xFF for b in digest)
            entries.append(LEASED.pack(SENT_OK, addr - agent.base, len(view), digest))
            leased += 1
        status, lease_id = LEASE_OK, 0
        if leased:
            lease = self.leases.grant(peer, served, leased)
            if lease is None:
                status = LEASE_BUSY
            else:
                lease_id = lease.id
        if not lease_id:
            source.release(served)
            # No lease, no address: the chunks are read over TCP (as for a chunk outside).
            outside = LEASED.pack(SENT_OUTSIDE, 0, 0, _ZERO)
            entries = [e if LEASED.unpack(e)[0] != SENT_OK else outside for e in entries]
        head = LEASE_HEAD.pack(status, ttl_ms, lease_id, self.generation)
        send_all(sock, [head + b"".join(entries)])  # one buffer: sendmsg takes <= 1024

    # -- reader side -----------------------------------------------------------------------
    def fetch_many(
        self,
        batches: Sequence[tuple[m.MemberInfo, Sequence[tuple[bytes, memoryview]]]],
        verified: dict[bytes, bytes] | None = None,
    ) -> list[list[LoadStatus]]:
        late = self.late
        if late is None or not late.pending():
            return self._fetch_many(batches, verified)
        # Slots a given-up READ may still write into get nothing else meanwhile: ERROR.
        keep = [
            [i for i, (_, v) in enumerate(items) if not late.holds(address_of(v))]
            for _, items in batches
        ]
        sub = [
            (peer, [items[i] for i in k]) for (peer, items), k in zip(batches, keep, strict=True)
        ]
        out = [[LoadStatus.ERROR] * len(items) for _, items in batches]
        for b, (k, got) in enumerate(zip(keep, self._fetch_many(sub, verified), strict=True)):
            for i, st in zip(k, got, strict=True):
                out[b][i] = st
        return out

    def _fetch_many(
        self,
        batches: Sequence[tuple[m.MemberInfo, Sequence[tuple[bytes, memoryview]]]],
        verified: dict[bytes, bytes] | None,
    ) -> list[list[LoadStatus]]:
        agent = self.agent
        if agent is None or not agent.registered:
            return super().fetch_many(batches, verified)
        out: list[list[LoadStatus]] = [[LoadStatus.ERROR] * len(items) for _, items in batches]
        tcp: list[tuple[int, list[int]]] = []  # (batch, its items that go over TCP)
        # (batch, first item, holder, items): a batch is split as over TCP, into a few
        # leases and READs in parallel, none over MAX_CHUNKS chunks.
        jobs: list[tuple[int, int, m.MemberInfo, Sequence[tuple[bytes, memoryview]]]] = []
        for b, (peer, items) in enumerate(batches):
            if not items:
                continue
            if self._tcp_only_now(peer):
                tcp.append((b, list(range(len(items)))))
                continue
            total = sum(v.nbytes for _, v in items)
            parts = max(1, min(self.streams, len(items), math.ceil(total / (4 * 2**20))))
            bounds = [round(k * len(items) / parts) for k in range(parts + 1)]
            for lo, hi in itertools.pairwise(bounds):
                for start in range(lo, hi, MAX_CHUNKS):
                    jobs.append((b, start, peer, items[start : min(hi, start + MAX_CHUNKS)]))
        if len(jobs) == 1:
            results: list[tuple[list[LoadStatus], list[int]] | None]
            try:
                results = [self._nixl_batch(jobs[0][2], jobs[0][3], verified)]
            except Exception:
                log.exception("a NIXL fetch from %s failed", jobs[0][2].node_id)
                results = [None]
        else:
            # Every part ends before this returns (its caller frees the slots then).
            results = every_result(
                [
                    self._executor.submit(self._nixl_batch, peer, part, verified)
                    for _, _, peer, part in jobs
                ]
            )
        for (b, start, _, part), result in zip(jobs, results, strict=True):
            if result is None:
                continue  # ERROR already
            statuses, fallback = result
            out[b][start : start + len(part)] = statuses
            if fallback:
                tcp.append((b, [start + i for i in fallback]))
        if tcp:
            sub = [(batches[b][0], [batches[b][1][i] for i in idx]) for b, idx in tcp]
            for (b, idx), got in zip(tcp, super().fetch_many(sub, verified), strict=True):
                for i, st in zip(idx, got, strict=True):
                    out[b][i] = st
        return out

    def _nixl_batch(
        self,
        peer: m.MemberInfo,
        items: Sequence[tuple[bytes, memoryview]],
        verified: dict[bytes, bytes] | None,
    ) -> tuple[list[LoadStatus], list[int]]:
        """One batch from one holder over NIXL: (a status per item, the items to fetch
        over TCP instead)."""
        agent = self.agent
        assert agent is not None
        statuses = [LoadStatus.ERROR] * len(items)
        addrs = [address_of(v) for _, v in items]
        mine = [
            i
            for i, (_, v) in enumerate(items)
            if not v.readonly and agent.inside(addrs[i], v.nbytes)
        ]
        inside = set(mine)
        fallback = [i for i in range(len(items)) if i not in inside]
        if not mine:
            return statuses, fallback
        started = time.monotonic()
        figures = self._figures(self.nixl_received, peer.node_id)
        try:
            remote = self._remote(peer)
        except (PeerRefused, OSError, ConnectionError) as exc:
            self._call_failed(peer, exc, figures, started, len(items))
            return statuses, []
        if remote is None:
            return statuses, list(range(len(items)))
        try:
            return self._leased_read(
                peer, remote, items, verified, (addrs, mine, fallback), statuses, figures, started
            )
        finally:
            self._done_with(remote)

    @staticmethod
    def _call_failed(
        peer: m.MemberInfo, exc: Exception, figures: PeerFigures, started: float, items: int
    ) -> None:
        """A call to the holder failed: logged; a failure of the connection counts its
        ``items`` as errors (a refusal, logged as an error, does not)."""
        if isinstance(exc, PeerRefused):
            log.error("%s", exc)
            return
        log.warning("fetch from %s failed: %s", peer.node_id, exc)
        figures.add(time.monotonic() - started, 0, 0, errors=items, requests=0)

    def _leased_read(
        self,
        peer: m.MemberInfo,
        remote: _Remote,
        items: Sequence[tuple[bytes, memoryview]],
        verified: dict[bytes, bytes] | None,
        split: tuple[list[int], list[int], list[int]],
        statuses: list[LoadStatus],
        figures: PeerFigures,
        started: float,
    ) -> tuple[list[LoadStatus], list[int]]:
        """The part of :meth:`_nixl_batch` that runs with the holder's agent in use;
        ``split``: the items' addresses, those inside the registered pool, the others."""
        agent = self.agent
        assert agent is not None
        addrs, mine, fallback = split
        try:
            wanted = [(items[i][0], items[i][1].nbytes) for i in mine]
            head, entries = self._call(peer, lambda sock: self._lease(sock, wanted))
        except (PeerRefused, OSError, ConnectionError) as exc:
            self._call_failed(peer, exc, figures, started, len(items))
            return statuses, []
        status, ttl_ms, lease_id, generation = head
        if status != LEASE_OK or generation != remote.generation:
            if lease_id:
                self._release_lease(peer, lease_id)
            if status == LEASE_OK:
                self._fall_back(peer, "the holder registered its pool again", 0.0)
            elif status != LEASE_BUSY:  # BUSY: this batch only
                why = "the holder's pool is not registered with NIXL"
                self._fall_back(peer, why, FALLBACK_RETRY)
            return statuses, list(range(len(items)))
        reads: list[tuple[int, int, bytes]] = []  # (item, remote address, checksum)
        for i, (st, offset, length, digest) in zip(mine, entries, strict=True):
            view = items[i][1]
            if st == SENT_OK:
                if length == view.nbytes and offset + length <= remote.size:
                    reads.append((i, remote.base + offset, digest))
                # else: a holder naming bytes outside its region: ERROR
            elif st == SENT_OUTSIDE:
                fallback.append(i)
            elif st in (SENT_MISSING, SENT_LENGTH):
                statuses[i] = LoadStatus.MISSING
        state = DONE
        nbytes = chunks = corrupt = 0
        if reads:
            if self.before_read is not None:
                self.before_read(lease_id)
            deadline = started + self.timeout
            if self.honour_lease_deadline:
                deadline = min(deadline, started + ttl_ms / 1000)
            local = [(addrs[i], items[i][1].nbytes) for i, _, _ in reads]
            remote_descs = [(a, items[i][1].nbytes) for i, a, _ in reads]
            if time.monotonic() < deadline:
                done = COMPLETED.pack(b"TKVU", lease_id)  # ends the lease at the holder
                state, running = agent.read(local, remote_descs, remote.agent, deadline, done)
            else:  # the lease (or our patience) ran out before the READ could start
                state, running = EXPIRED, None
                self._count("leases_expired_unread")
            if state == DONE:
                for i, _, digest in reads:
                    view = items[i][1]
                    if checksum(view) == digest:
                        statuses[i] = LoadStatus.OK
                        chunks += 1
                        nbytes += view.nbytes
                        if verified is not None:
                            verified[items[i][0]] = digest
                    else:
                        statuses[i] = LoadStatus.CORRUPT
                        corrupt += 1
                if corrupt:
                    log.warning(
                        "%d chunks read from %s over NIXL failed their checksum: dropped",
                        corrupt,
                        peer.node_id,
                    )
            elif state == REFUSED:  # nothing was transferred: these go over TCP now
                fallback.extend(i for i, _, _ in reads)
                self._fall_back(peer, "NIXL refused the READ (wrong metadata?)", FALLBACK_RETRY)
            elif state != EXPIRED:
                # The READ may still land: its slots stay out of use until it has ended
                # (before _fall_back, which unloads the holder's agent once it has).
                late = self.late
                assert late is not None
                if state == TIMEOUT:
                    late.given_up(running, [a for a, _ in local], remote.agent)
                else:
                    late.failed([a for a, _ in local], remote.agent)
                self._count("read_timeouts" if state == TIMEOUT else "read_errors")
                self._fall_back(
                    peer,
                    "a READ passed its deadline (given up)"
                    if state == TIMEOUT
                    else "a READ failed",
                    FALLBACK_RETRY,
                )
        figures.add(
            time.monotonic() - started,
            chunks,
            nbytes,
            missing=statuses.count(LoadStatus.MISSING),
            corrupt=corrupt,
            errors=0 if state == REFUSED else len(reads) - chunks - corrupt,
        )
        # A completed READ's notification released the lease; a stalled holder's expires.
        # Nothing read (every entry refused: a holder naming bytes outside its region):
        # no notification will come, so the lease is released here.
        if lease_id and (not reads or state not in (DONE, TIMEOUT)):
            self._release_lease(peer, lease_id)
        return statuses, fallback

    def _count(self, name: str) -> None:
        with self._counts_lock:
            setattr(self, name, getattr(self, name) + 1)

    def _remote(self, peer: m.MemberInfo) -> _Remote | None:
        """The holder's agent, loaded once per incarnation, by one fetch at a time (the
        others wait for it); None: read it over TCP (its old agent waits to be unloaded, or
        it was dropped while it loaded)."""
        key = (peer.data, peer.incarnation)
        with self._nixl_lock:
            remote = self._remotes.get(key)
            if remote is not None:
                remote.users += 1
                return remote
            if key in self._unloading:
                return None
            loading = self._loading.get(key)
            mine = loading is None
            if loading is None:
                loading = self._loading[key] = threading.Event()
        if not mine:  # another part of the fetch loads it: its READs wait for that
            loading.wait(self.timeout)
            with self._nixl_lock:
                remote = self._remotes.get(key)
                if remote is not None:
                    remote.users += 1
                return remote
        try:
            return self._load(peer, key)
        finally:
            with self._nixl_lock:
                self._loading.pop(key, None)
                self._stale_loads.discard(key)
            loading.set()

    def _load(self, peer: m.MemberInfo, key: tuple[str, int]) -> _Remote | None:
        """Load the holder's agent (see :meth:`_remote`)."""
        head, md = self._call(peer, self._metadata)
        status, generation, base, size, _ = head
        if status != META_OK:
            self._fall_back(peer, "the holder has no NIXL", math.inf)
            return None
        agent = self.agent
        assert agent is not None
        try:
            name = agent.add_remote(md)
        except NixlError as exc:
            self._fall_back(peer, str(exc), FALLBACK_RETRY)
            return None
        if self.late is not None:
            self.late.keep_loaded(name)
        remote = _Remote(name, generation, base, size, key)
        with self._nixl_lock:
            # Sent over TCP, or forgotten, while it loaded: unloaded again, never used.
            stale = self._tcp_only_locked(key) or key in self._stale_loads
            if not stale:
                remote.users = 1
                self._remotes[key] = remote
        if stale:
            self._drop([remote])
            return None
        return remote

    def _done_with(self, remote: _Remote) -> None:
        """A fetch stopped using ``remote``: the last one unloads it if it was dropped."""
        with self._nixl_lock:
            remote.users -= 1
            unload = remote.dropped and remote.users == 0
        if unload:
            self._unload(remote)

    def _drop(self, remotes: list[_Remote]) -> None:
        """Take ``remotes`` (out of the table already) out of use: each is unloaded now if no
        fetch uses it, else by the last one that does (unloaded under a READ still running,
        NIXL fails the READ but not its transfer, which may still write into slots the
        failure gave back to the pool)."""
        idle = []
        with self._nixl_lock:
            for remote in remotes:
                remote.dropped = True
                self._unloading.add(remote.key)
                if remote.users == 0:
                    idle.append(remote)
        for remote in idle:
            self._unload(remote)

    # A holder's replies are whole within one timeout (a timeout per receive let a member
    # sending a byte now and then hold a fetch part for as many timeouts as bytes).
    def _metadata(self, sock: socket.socket) -> tuple[tuple[int, int, int, int, int], bytes]:
        deadline = time.monotonic() + self.timeout
        sock.sendall(REQUEST.pack(b"TKVM", 0))
        head = META.unpack(_recv_by(sock, META.size, deadline, "a holder's NIXL metadata"))
        if head[4] > MAX_METADATA:
            raise ConnectionError(f"a holder sent {head[4]} bytes of NIXL metadata")
        return head, _recv_by(sock, head[4], deadline, "a holder's NIXL metadata")

    def _lease(
        self, sock: socket.socket, wanted: list[tuple[bytes, int]]
    ) -> tuple[tuple[int, int, int, int], list[tuple[int, int, int, bytes]]]:
        deadline = time.monotonic() + self.timeout
        request = [REQUEST.pack(b"TKVL", len(wanted))]
        request += [ITEM.pack(key, n) for key, n in wanted]
        send_all(sock, [b"".join(request)])
        raw = _recv_by(sock, LEASE_HEAD.size + LEASED.size * len(wanted), deadline, "a lease")
        head = LEASE_HEAD.unpack_from(raw)
        entries = [
            LEASED.unpack_from(raw, LEASE_HEAD.size + j * LEASED.size) for j in range(len(wanted))
        ]
        return head, entries

    def _release_lease(self, peer: m.MemberInfo, lease_id: int) -> None:
        def release(sock: socket.socket) -> tuple[int, int]:
            deadline = time.monotonic() + self.timeout
            sock.sendall(REQUEST.pack(b"TKVU", 1) + RELEASE.pack(lease_id))
            reply = _recv_by(sock, RELEASED.size, deadline, "a lease's release")
            status, n = RELEASED.unpack(reply)
            return status, n

        try:
            self._call(peer, release)
        except (OSError, ConnectionError, PeerRefused) as exc:
            log.debug("releasing a NIXL lease at %s failed: %s (it expires)", peer.node_id, exc)

    def _tcp_only_count(self) -> int:
        """How many peers' reads go over TCP now."""
        now = time.monotonic()
        with self._nixl_lock:
            return sum(1 for until in self._tcp_only.values() if until > now)

    def _tcp_only_now(self, peer: m.MemberInfo) -> bool:
        with self._nixl_lock:
            return self._tcp_only_locked((peer.data, peer.incarnation))

    def _tcp_only_locked(self, key: tuple[str, int]) -> bool:
        """Whether reads from holder ``key`` go over TCP now (``_nixl_lock`` held)."""
        until = self._tcp_only.get(key)
        return until is not None and until > time.monotonic()

    def _fall_back(self, peer: m.MemberInfo, why: str, seconds: float) -> None:
        """Reads from ``peer`` go over TCP for ``seconds``: one log line."""
        key = (peer.data, peer.incarnation)
        now = time.monotonic()
        with self._nixl_lock:
            already = self._tcp_only.get(key, 0.0) > now  # another part of the same fetch
            self._tcp_only[key] = max(self._tcp_only.get(key, 0.0), now + seconds)
            remote = self._remotes.pop(key, None)
            if not already:
                self.fallbacks += 1
        if remote is not None:
            self._drop([remote])
        if not already:
            later = "" if math.isinf(seconds) else f" (NIXL again in {seconds:.0f} s)"
            log.warning("reads from %s go over TCP: %s%s", peer.node_id, why, later)

    def forget(self, peer: m.MemberInfo) -> None:
        super().forget(peer)
        with self._nixl_lock:
            self._stale_loads.update(k for k in self._loading if k[0] == peer.data)
            gone = [k for k in self._remotes if k[0] == peer.data]
            remotes = [self._remotes.pop(k) for k in gone]
            for k in [k for k in self._tcp_only if k[0] == peer.data]:
                del self._tcp_only[k]
        self._drop(remotes)

    def _unload(self, remote: _Remote) -> None:
        """Unload a holder's agent, once the READs given up on it have ended."""
        agent, late = self.agent, self.late

        def unload() -> None:
            if agent is not None:
                agent.remove_remote(remote.agent)
            with self._nixl_lock:
                self._unloading.discard(remote.key)

        if late is not None:
            late.unload_when_done(remote.agent, unload)
        else:
            unload()

    # -- lifecycle and figures -------------------------------------------------------------
    def close(self) -> None:
        super().close()
        self.leases.close()
        if self.late is not None:
            self.late.close()
        if self.agent is not None:
            self.agent.close()

    def stats(self) -> dict[str, object]:
        out = super().stats()
        agent = self.agent
        out["nixl"] = {
            "available": agent is not None,
            "why_not": self.why_not_nixl,
            "registered": agent is not None and agent.registered,
            "ucx_tls": ucx_transports(),
            "received": {peer: f.as_dict() for peer, f in list(self.nixl_received.items())},
            "leases": self.leases.stats(),
            "fallbacks": self.fallbacks,
            "read_timeouts": self.read_timeouts,
            "read_errors": self.read_errors,
            "leases_expired_unread": self.leases_expired_unread,
            "tcp_only": self._tcp_only_count(),
            "late_reads": self.late.stats() if self.late is not None else {},
        }
        return out
