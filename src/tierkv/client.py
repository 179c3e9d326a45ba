"""The engine-side client: register, look up, store and retrieve KV chunks through the pool.

An engine process creates one :class:`Client` per KV layout (one per rank), registers, and
from then on moves KV with two RPCs per batch and exactly one copy per chunk:

- store: PREPARE_STORE reserves slots -> the engine writes each chunk straight into its slot
  (from an array, or with a ``gather`` callback that fills the slot view from the paged KV
  cache) -> COMMIT_STORE publishes them.
- retrieve: PREPARE_RETRIEVE read-locks slots -> the engine reads each slot view (into an
  array, or with a ``scatter`` callback straight into its paged KV cache) -> FINISH_RETRIEVE.

Slot views are zero-copy numpy arrays over the shared-memory pool (torch tensors with
:meth:`Client.slot_tensor` when torch is installed). A view is only valid until the request
that produced it finishes: never keep one.

A client is safe to use from several threads (requests are serialized on its socket); the
``*_async`` variants return futures so an engine can overlap KV movement with compute.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import numpy as np
import numpy.typing as npt

from tierkv import dtypes, framing, keys
from tierkv import protocol as p
from tierkv.arraycopy import copy_array, host_view
from tierkv.config import default_runtime_dir
from tierkv.copier import Copier
from tierkv.liveness import process_scope
from tierkv.pool import SHM_DIR, ShmPool

log = logging.getLogger(__name__)

T = TypeVar("T")
Tokens = Sequence[int] | npt.NDArray[np.integer] | bytes
Gather = Callable[[int, npt.NDArray[Any]], None]
Scatter = Callable[[int, npt.NDArray[Any]], None]

DEFAULT_TIMEOUT = 10.0
# A small request's reply comes 30 to 100 us after it is sent when the server's core is
# awake: spin that long before sleeping (see framing.Connection).
DEFAULT_REPLY_SPIN = 100e-6


# -- errors ------------------------------------------------------------------------------
class TierKVError(Exception):
    """Base of every error this client raises."""


class ServerUnavailableError(TierKVError):
    """The server did not answer in time (not running, overloaded, or restarting)."""


class ServerError(TierKVError):
    """The server answered with an error."""

    def __init__(self, code: p.ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message


class NotRegisteredError(ServerError):
    """The server does not know this client (it restarted?): call :meth:`Client.register`."""


class UnauthorizedError(ServerError):
    """The server refused this client's auth token (wrong or missing): registering again
    does not help; give the server's ``--auth-token`` (``auth_token=`` here, or
    ``TIERKV_AUTH_TOKEN``)."""

    def __init__(self, code: p.ErrorCode, message: str) -> None:
        super().__init__(
            code,
            f"{message} (the server has an --auth-token: pass the same token as "
            "auth_token= or TIERKV_AUTH_TOKEN)",
        )


class LeaseExpiredError(ServerError):
    """A lease or lookup session is gone (ended or expired)."""


class LayoutError(TierKVError, ValueError):
    """An array does not match the registered chunk layout."""


def _raise_for(reply: p.Error) -> None:
    cls: type[ServerError] = ServerError
    if reply.code is p.ErrorCode.NOT_REGISTERED:
        cls = NotRegisteredError
    elif reply.code is p.ErrorCode.UNAUTHORIZED:
        cls = UnauthorizedError
    elif reply.code is p.ErrorCode.NOT_FOUND:
        cls = LeaseExpiredError
    raise cls(reply.code, reply.message)


# -- results -----------------------------------------------------------------------------
@dataclass(slots=True)
class StoreResult:
    stored: list[int] = field(default_factory=list)  # chunk positions written and committed
    present: list[int] = field(default_factory=list)  # already in the cache
    no_space: list[int] = field(default_factory=list)  # skipped: the pool is full
    cleared: int = 0  # written but deleted (cleared) before the commit
    # False: the commit was sent without waiting for its answer (finish_store(confirm=
    # False)); ``stored`` is then what it commits if it succeeds (Client.settle says, and
    # Client.commit_shortfalls names this commit by ``commit_rid`` if it committed fewer).
    confirmed: bool = True
    commit_rid: int = 0


@dataclass(frozen=True, slots=True)
class PreparedStore:
    """A store's reserved slots (:meth:`Client.prepare_store`), until it finishes or aborts."""

    slots: p.StoreSlots
    first_chunk: int
    expected: int  # chunks from first_chunk on that the store names
    pool: ShmPool | None  # the mapping the slots are in (see Client._call_for_slots)


@dataclass(slots=True)
class RetrieveResult:
    retrieved: list[int] = field(default_factory=list)  # chunk positions copied out
    missing: list[int] = field(default_factory=list)  # not in the cache

    @property
    def complete(self) -> bool:
        return not self.missing


@dataclass(frozen=True, slots=True)
class Registration:
    client: int
    server_version: str
    pool_name: str
    pool_size: int
    chunk_size: int
    chunk_bytes: int
    namespace: bytes
    layout: p.Layout


def wait_for_server(
    endpoint: str,
    timeout: float,
    exited: Callable[[], bool] = lambda: False,
    auth_token: str = "",
) -> bool:
    """Ping ``endpoint`` until the server answers (True) or its process has ``exited()``
    (False); raises :class:`ServerUnavailableError` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    with Client(endpoint, timeout=0.5, auth_token=auth_token) as probe:
        while True:
            if exited():
                return False
            try:
                probe.ping(timeout=0.5)
                return True
            except ServerUnavailableError:
                if time.monotonic() > deadline:
                    raise


def default_endpoint(instance: str = "default") -> str:
    """The endpoint a server started with the same instance name listens on."""
    env = os.environ.get("TIERKV_ENDPOINT")
    if env:
        return env
    return f"ipc://{os.path.join(default_runtime_dir(instance), 'rpc.sock')}"


class Client:
    """A connection to one tierkv server, registered for one KV layout."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        auth_token: str = "",
        populate: bool = False,
        copy_threads: int | None = None,
        parallel_callbacks: bool = False,
        data_priority: bool = True,
        on_pool: Callable[[ShmPool], Callable[[], None] | None] | None = None,
        reply_spin: float = DEFAULT_REPLY_SPIN,
    ) -> None:
        """``copy_threads``: threads that copy a large batch (default: the cores, at most
        4). Arrays given as ``chunks``/``out`` are always copied by them; ``gather``/
        ``scatter`` callbacks only with ``parallel_callbacks`` (then they are called from
        several threads at once, each chunk once). ``data_priority``: the copy threads run
        at data priority (:mod:`tierkv.priority`) and the calling thread only waits, so the
        bulk copies of many engines never hold a core that a request's round trip needs;
        False: the calling thread copies a share (with ``copy_threads=1``, all of it).
        ``on_pool(pool)`` runs each time the client maps a pool (at registration, again
        after a server restart) and may return a function that runs before that mapping is
        closed (a GPU engine page-locks it: :mod:`tierkv.integrations.vllm.pinning`).
        ``reply_spin``: seconds the calling thread keeps reading for a reply before it
        sleeps (:class:`tierkv.framing.Connection`; 0: sleep at once)."""
        if reply_spin < 0:
            raise ValueError("reply_spin must be >= 0")
        self.reply_spin = reply_spin
        self.endpoint = endpoint or default_endpoint()
        self.timeout = timeout
        self.auth_token = auth_token
        self.populate = populate
        self._conn: framing.Connection | None = None
        self._pid = os.getpid()  # a forked child must not share its parent's connection
        self._closed = False
        # Held for each round trip, and across a registration and the pool mapping it brings
        # (reentrant: a registration's round trip runs inside it), so that every reply that
        # names slots is read while the pool it names them in is the one mapped.
        self._io = threading.RLock()
        self._rids = itertools.count(1)
        # Requests sent without waiting for their replies (a retrieve's release, an
        # unconfirmed commit), by rid, with their names and (commits) the chunks they commit:
        # the next call or settle() reads those replies first, and logs the ones that are
        # errors (counted in _failed_unanswered). Commits that committed fewer chunks (or
        # none: failed, or lost with the connection) go into _shortfalls, by rid.
        self._unanswered: dict[int, tuple[str, int]] = {}
        self._failed_unanswered = 0
        self._shortfalls: dict[int, int] = {}
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = p.reply_decoder.decode
        self._executor: ThreadPoolExecutor | None = None
        self._copier = Copier(copy_threads, data_priority=data_priority)
        self.parallel_callbacks = parallel_callbacks
        self.pool: ShmPool | None = None
        self._on_pool = on_pool
        self._pool_undo: Callable[[], None] | None = None  # what on_pool returned
        self.registration: Registration | None = None
        self._np_dtype: np.dtype[Any] | None = None
        self._segment: tuple[int, int] | None = None

    @property
    def copy_threads(self) -> int:
        """The threads that copy a large batch, the calling thread included where it joins."""
        return self._copier.threads

    # -- transport -------------------------------------------------------------------------
    def _disconnect(self) -> None:
        if self._conn is not None:
            self._conn.close()  # in a forked child: its copy only, the parent's stays open
            self._conn = None
        self._pid = os.getpid()
        for rid, (_, chunks) in self._unanswered.items():
            if chunks:  # its answer is lost with the connection: not known to be committed
                self._shortfalls[rid] = chunks
        self._unanswered.clear()

    def _connection(self, deadline: float) -> framing.Connection | None:
        """The connection to carry the next request: the current one if it is still good
        (nothing unexpected to read: no stale reply, no close by a restarted server), else a
        new one, waiting for a server that is (re)starting until ``deadline``."""
        conn = self._conn
        if conn is not None and (
            self._pid != os.getpid() or (conn.pending() and not self._read_unanswered(conn))
        ):
            self._disconnect()
            conn = None
        if conn is None:
            conn = self._conn = framing.Connection.open(self.endpoint, deadline, self.reply_spin)
        return conn

    def _call(
        self, req: Any, timeout: float | None = None, *, answered: bool = True, commits: int = 0
    ) -> Any:
        """Send ``req`` and return its reply (raising the error it is). ``answered=False``:
        return None once it is sent; the next call reads its reply (and logs it if it is an
        error): for a release whose outcome changes nothing for the caller, or a commit of
        ``commits`` chunks whose shortfall :meth:`commit_shortfalls` reports."""
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        with self._io:
            if self._closed:
                raise TierKVError("client is closed")
            try:
                conn = self._connection(deadline)
                if conn is None:
                    raise TimeoutError
                try:
                    conn.send(self._encode(req), deadline)
                except (BrokenPipeError, ConnectionResetError):
                    if not answered:
                        raise
                    # The server may have refused the request (too large) and closed: its
                    # reason is already here to read.
                    deadline = min(deadline, time.monotonic() + 0.1)
                if not answered:
                    self._unanswered[req.rid] = (p.request_name(req), commits)
                    return None
                reply = self._await_reply(conn, req.rid, deadline)
            except (OSError, framing.FrameTooLargeError) as exc:
                raise self._unavailable(exc, wait, p.request_name(req)) from None
        if isinstance(reply, p.Error):
            _raise_for(reply)
        return reply

    def _unavailable(self, exc: Exception, wait: float, what: str) -> ServerUnavailableError:
        """No reply, or a broken connection: disconnect (a late reply must not be mistaken
        for the answer to a later request, so the next call connects afresh) and return the
        error to raise, naming ``what`` waited."""
        self._disconnect()
        why = "no reply" if isinstance(exc, TimeoutError) else f"connection lost ({exc})"
        return ServerUnavailableError(
            f"{why} from tierkv server at {self.endpoint} within {wait:.1f} s ({what}): "
            "is it running?"
        )

    def _read_unanswered(self, conn: framing.Connection) -> bool:
        """Read what is there to read now, expecting only replies nobody waited for (False:
        something else came, or the server closed: the connection is not to be used)."""
        while self._unanswered and conn.pending():
            try:
                frames = conn.reader.read(conn.sock)
            except (OSError, framing.FrameTooLargeError):
                return False
            for frame in frames:
                if not self._took_unanswered(self._decode(frame)):
                    return False
        return not conn.pending()

    def _took_unanswered(self, reply: Any) -> bool:
        """Whether ``reply`` answers a request sent without waiting (then it is done with)."""
        sent = self._unanswered.pop(reply.rid, None)
        if sent is None:
            return False
        name, chunks = sent
        if isinstance(reply, p.Error):
            self._failed_unanswered += 1
            log.warning(
                "tierkv server: a %s this client did not wait for failed: %s", name, reply.message
            )
            if chunks:
                self._shortfalls[reply.rid] = chunks
        elif isinstance(reply, p.Committed) and reply.committed < chunks:
            self._shortfalls[reply.rid] = chunks - reply.committed
        return True

    def commit_shortfalls(self) -> dict[int, int]:
        """The commits sent without waiting (``finish_store(confirm=False)``) that committed
        fewer chunks than their results' ``stored``, by ``commit_rid``: how many fewer (all
        of them when the commit failed, or when its answer was lost with the connection and
        it is not known to have been carried out). Each is reported once, from when its
        answer was read (by :meth:`settle`, or any call) or lost; commits not named here
        committed all their chunks, once :meth:`settle` has returned."""
        with self._io:
            out, self._shortfalls = self._shortfalls, {}
        return out

    def settle(self, timeout: float | None = None) -> int:
        """Wait for the answers to every request sent without waiting (unconfirmed commits,
        releases): once it returns, the server has carried them out, and a commit's chunks
        are visible wherever a confirmed commit's would be (on this server; in a cluster,
        in the directory too). Returns how many of them failed since the last call (each is
        logged). Raises :class:`ServerUnavailableError` when the answers do not come (the
        connection is then closed: a server that lost it never carried out what it had not
        read)."""
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        with self._io:
            conn = self._conn
            try:
                while self._unanswered and conn is not None:
                    for frame in conn.receive(deadline):
                        if not self._took_unanswered(self._decode(frame)):
                            raise ConnectionError("a reply to no request sent")
            except (OSError, framing.FrameTooLargeError) as exc:
                raise self._unavailable(exc, wait, "requests sent without waiting") from None
            failed, self._failed_unanswered = self._failed_unanswered, 0
        return failed

    def _await_reply(self, conn: framing.Connection, rid: int, deadline: float) -> Any:
        while True:
            for frame in conn.receive(deadline):
                reply = self._decode(frame)
                if self._unanswered and self._took_unanswered(reply):
                    continue
                # rid 0: about the connection, not a request (the server refused a message
                # too large to read and closed the connection).
                if reply.rid == rid or (reply.rid == 0 and isinstance(reply, p.Error)):
                    if reply.rid == 0:
                        self._disconnect()
                    return reply

    def _rid(self) -> int:
        return next(self._rids)

    def _token(self) -> int:
        if self.registration is None:
            raise TierKVError("call register() first")
        return self.registration.client

    # -- registration ----------------------------------------------------------------------
    def register(
        self,
        model: str,
        chunk_shape: Sequence[int],
        dtype: str,
        *,
        token_axis: int = 0,
        world_size: int = 1,
        rank: int = 0,
        tenant_salt: str = "",
        name: str = "",
        engine_id: str = "",
        chunk_tokens: int = 0,
    ) -> Registration:
        """Declare the namespace and chunk layout; attaches the pool (once).

        Workers of one engine instance (one client per tensor-parallel rank) pass the same
        ``engine_id`` so that the instance's scheduler (:meth:`register_scheduler`) can look
        up for all of them at once. ``chunk_tokens``: 0 for chunks of the server's chunk
        size; N for chunks of N tokens (an engine's own page size) that the client always
        names by precomputed hashes."""
        return self._register(
            model, chunk_shape, dtype, token_axis, world_size, rank, tenant_salt, name,
            engine_id, p.ROLE_WORKER, chunk_tokens,
        )  # fmt: skip

    def register_scheduler(self, model: str, engine_id: str, name: str = "") -> Registration:
        """Register as the scheduler of engine ``engine_id``: lookups only. A LOOKUP then
        covers every rank registered with that engine id (the smallest hit count) and locks
        each rank's chunks for that rank's retrieve by request id."""
        return self._register(
            model, [1], "uint8", 0, 1, 0, "", name, engine_id, p.ROLE_SCHEDULER, 0
        )

    def _register(
        self,
        model: str,
        chunk_shape: Sequence[int],
        dtype: str,
        token_axis: int,
        world_size: int,
        rank: int,
        tenant_salt: str,
        name: str,
        engine_id: str,
        role: str,
        chunk_tokens: int,
    ) -> Registration:
        layout = p.Layout([int(d) for d in chunk_shape], str(dtype), token_axis)
        req = p.Register(
            self._rid(),
            p.PROTOCOL_VERSION,
            model,
            layout,
            world_size,
            rank,
            tenant_salt,
            name,
            os.getpid(),
            self.auth_token,
            engine_id,
            role,
            process_scope(),
            chunk_tokens,
        )
        with self._io:  # no other request between the answer and mapping its pool
            return self._registered(layout, self._call(req))

    def _registered(self, layout: p.Layout, reply: p.Registered) -> Registration:
        """Map the pool a REGISTER answer names (unless mapped already) and keep the
        registration."""
        if (
            self.pool is None
            or self.pool.name != reply.pool_name
            or self.pool.closed
            # The server restarted and recreated the segment under the same name.
            or _segment_id(reply.pool_name) != self._segment
        ):
            self._attach(reply.pool_name, reply.pool_size)
        self.registration = Registration(
            reply.client,
            reply.server_version,
            reply.pool_name,
            reply.pool_size,
            reply.chunk_size,
            reply.chunk_bytes,
            reply.namespace,
            layout,
        )
        self._np_dtype = dtypes.numpy_dtype(layout.dtype)
        return self.registration

    def _attach(self, name: str, size: int) -> None:
        self._close_pool()
        self.pool = ShmPool.attach(name, size, populate=self.populate)
        self._segment = _segment_id(name)
        if self._on_pool is not None:
            self._pool_undo = self._on_pool(self.pool)

    def _close_pool(self) -> None:
        old, self.pool = self.pool, None
        undo, self._pool_undo = self._pool_undo, None
        if undo is not None:
            try:
                undo()
            except Exception:  # the mapping is closed either way
                log.exception("undoing on_pool before closing the pool mapping failed")
        if old is not None:
            old.close()

    def unregister(self) -> None:
        if self.registration is None:
            return
        try:
            self._call(p.Unregister(self._rid(), self.registration.client), timeout=2.0)
        finally:
            self.registration = None

    # -- views -----------------------------------------------------------------------------
    def slot_view(self, slot: p.Slot, pool: ShmPool | None = None) -> npt.NDArray[Any]:
        """Zero-copy numpy view of a slot, shaped like the chunk (partial chunks: fewer
        tokens on the token axis), in ``pool`` (default: the pool mapped now)."""
        reg = self.registration
        pool = self.pool if pool is None else pool
        if reg is None or pool is None or self._np_dtype is None:
            raise TierKVError("call register() first")
        if pool.closed:
            raise _pool_gone()
        if slot.offset < 0 or slot.length <= 0 or slot.offset + slot.length > pool.size:
            raise TierKVError(f"server sent a slot outside the pool: {slot}")
        shape = list(reg.layout.shape)
        per_token = reg.chunk_bytes // reg.chunk_size
        if slot.length != reg.chunk_bytes:
            if slot.length % per_token:
                raise TierKVError(f"slot length {slot.length} is not a whole number of tokens")
            shape[reg.layout.token_axis] = slot.length // per_token
        return pool.array(slot.offset, slot.length, self._np_dtype, shape)

    def slot_tensor(self, slot: p.Slot) -> Any:
        """Zero-copy torch tensor over a slot (torch must be installed)."""
        import torch

        reg = self.registration
        assert reg is not None
        view = self.slot_view(slot)
        tensor = torch.from_numpy(view)
        if reg.layout.dtype == "bfloat16":
            tensor = tensor.view(torch.bfloat16)
        return tensor

    # -- lookup ----------------------------------------------------------------------------
    def _selector(
        self,
        tokens: Tokens | None,
        hashes: Sequence[bytes] | None,
        partial_last: bool = False,
        salt: str = "",
    ) -> p.ChunkSelector:
        if (tokens is None) == (hashes is None):
            raise ValueError("give exactly one of tokens or hashes")
        if tokens is not None:
            packed = tokens if isinstance(tokens, bytes) else keys.pack_tokens(tokens)
            return p.ChunkSelector(tokens=packed, partial_last=partial_last, salt=salt)
        return p.ChunkSelector(hashes=list(hashes or ()), partial_last=partial_last, salt=salt)

    def _num_chunks(self, sel: p.ChunkSelector) -> int:
        reg = self.registration
        if reg is None:
            raise TierKVError("call register() first")
        if sel.hashes is not None:
            return len(sel.hashes)
        n_tokens = len(sel.tokens or b"") // 4
        return keys.num_chunks(n_tokens, reg.chunk_size, sel.partial_last)

    def lookup(
        self,
        tokens: Tokens | None = None,
        *,
        hashes: Sequence[bytes] | None = None,
        request_id: str = "",
        wait: bool = False,
        salt: str = "",
    ) -> p.LookupResult:
        """How many leading chunks are cached (``hits`` of ``total``).

        With ``request_id`` they stay read-locked for a following :meth:`retrieve` with that
        id (or :meth:`free_lookup_locks`), and chunks in slower tiers are prefetched into the
        pool: with ``wait`` this returns the final count once the prefetch is done, otherwise
        what the pool holds now (poll :meth:`query_prefetch` for the rest)."""
        sel = self._selector(tokens, hashes, salt=salt)
        reply: p.LookupResult = self._call(p.Lookup(self._rid(), self._token(), sel, request_id))
        if wait and reply.prefetching:
            hits = self.wait_prefetch(request_id)
            return msgspec.structs.replace(reply, hits=hits, prefetching=False)
        return reply

    def query_prefetch(self, request_id: str) -> p.PrefetchStatus:
        """Whether the lookup's prefetch is done, and the hit count so far."""
        return self._call(p.QueryPrefetch(self._rid(), self._token(), request_id))  # type: ignore[no-any-return]

    def wait_prefetch(self, request_id: str, timeout: float | None = None) -> int:
        """Poll until the lookup's prefetch is done; returns the final hit count. The server
        bounds every prefetch (prefetch_timeout), so this ends even if a tier hangs; a
        prefetch still not done after ``timeout`` (the client's by default) is a miss for
        what it was fetching: the hits the pool had at the lookup are returned, never an
        error (the server finishes the prefetch in the background)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        delay = 0.0005
        while True:
            status = self.query_prefetch(request_id)
            if status.done:
                return status.hits
            if time.monotonic() >= deadline:
                log.debug("prefetch of %r not done in time: %d hits", request_id, status.hits)
                return status.hits
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    def free_lookup_locks(self, request_id: str) -> int:
        reply: p.Ok = self._call(p.FreeLookupLocks(self._rid(), self._token(), request_id))
        return reply.count

    def end_session(self, request_id: str) -> int:
        reply: p.Ok = self._call(p.EndSession(self._rid(), self._token(), request_id))
        return reply.count

    # -- store -----------------------------------------------------------------------------
    def store(
        self,
        tokens: Tokens | None = None,
        chunks: Sequence[Any] | None = None,
        *,
        hashes: Sequence[bytes] | None = None,
        gather: Gather | None = None,
        first_chunk: int = 0,
        partial_last: bool = False,
        salt: str = "",
        caller_copies: bool | None = None,
        notes: Sequence[bytes] | None = None,
    ) -> StoreResult:
        """Store chunks ``first_chunk..`` of a token sequence (or of precomputed hashes).

        Give the bytes either as ``chunks`` (``chunks[i]`` is chunk ``first_chunk + i``, a
        numpy array or torch tensor of the chunk's shape) or as ``gather(chunk, dst)``, which
        must fill the zero-copy slot view ``dst`` for chunk position ``chunk``.
        ``caller_copies``: this thread copies chunks too, beside the copy threads (default:
        only without ``data_priority``); for a thread that has nothing else to do meanwhile.
        ``notes``: see :meth:`prepare_store`.
        The same as :meth:`prepare_store` followed by :meth:`finish_store`.
        """
        if (chunks is None) == (gather is None):
            raise ValueError("give exactly one of chunks or gather")
        sel = self._selector(tokens, hashes, partial_last, salt)
        expected = self._num_chunks(sel) - first_chunk
        if chunks is not None and len(chunks) != expected:
            raise ValueError(_chunk_count_error(len(chunks), expected, first_chunk))
        prepared = self._prepare_store(sel, first_chunk, expected, notes)
        return self.finish_store(prepared, chunks, gather=gather, caller_copies=caller_copies)

    def prepare_store(
        self,
        tokens: Tokens | None = None,
        *,
        hashes: Sequence[bytes] | None = None,
        first_chunk: int = 0,
        partial_last: bool = False,
        salt: str = "",
        notes: Sequence[bytes] | None = None,
    ) -> PreparedStore:
        """The first phase of a store: reserve slots for the chunks ``first_chunk..`` the
        pool lacks. Follow with :meth:`finish_store` (copy and commit) or
        :meth:`abort_store`; a reservation neither finishes nor aborts is reclaimed after
        the server's ``write_ttl`` or when this client goes away. An engine reserves while
        its forward pass computes the chunks, so that only the copy and the commit are left
        for after it. ``notes``: one per chunk ``first_chunk..`` (b"": none), the engine's
        own description of each chunk, which every engine of its namespaces reads from the
        server's chunk feed (:meth:`read_chunk_events`) once the chunk is committed."""
        sel = self._selector(tokens, hashes, partial_last, salt)
        expected = self._num_chunks(sel) - first_chunk
        return self._prepare_store(sel, first_chunk, expected, notes)

    def _prepare_store(
        self,
        sel: p.ChunkSelector,
        first_chunk: int,
        expected: int,
        notes: Sequence[bytes] | None = None,
    ) -> PreparedStore:
        if notes is not None and len(notes) != expected:
            raise ValueError(f"{len(notes)} notes for {expected} chunks: give one per chunk")
        note_list = None if notes is None else [bytes(n) for n in notes]
        req = p.PrepareStore(self._rid(), self._token(), sel, first_chunk, note_list)
        slots, pool = self._call_for_slots(req)
        return PreparedStore(slots, first_chunk, expected, pool)

    def _call_for_slots(self, req: Any) -> tuple[Any, ShmPool | None]:
        """A request answered with slots, and the pool mapping they are in: the one mapped
        while the answer came (a registration maps a new pool under the same lock). Slots are
        only ever viewed in that mapping: after a server restart and a registration by
        another thread, the new pool at the old slots' offsets holds other chunks."""
        with self._io:
            return self._call(req), self.pool

    def finish_store(
        self,
        prepared: PreparedStore,
        chunks: Sequence[Any] | None = None,
        *,
        gather: Gather | None = None,
        caller_copies: bool | None = None,
        confirm: bool = True,
    ) -> StoreResult:
        """The second phase of a store: copy the reserved chunks in (``chunks`` or
        ``gather`` as for :meth:`store`) and commit them. Aborts the reservation if a copy
        raises. ``confirm=False``: return once the commit is sent, without waiting for the
        server's answer (the result says ``confirmed=False``; this client's next call or
        :meth:`settle` reads it, and a failure is logged and counted by :meth:`settle`): for
        an engine whose next forward pass would only wait for that answer, when nothing
        reads the chunks before it settles."""
        if (chunks is None) == (gather is None):
            raise ValueError("give exactly one of chunks or gather")
        if chunks is not None and len(chunks) != prepared.expected:
            self.abort_store(prepared)
            raise ValueError(
                _chunk_count_error(len(chunks), prepared.expected, prepared.first_chunk)
            )
        slots = prepared.slots
        result = StoreResult(present=slots.present, no_space=slots.no_space)
        if not slots.slots:
            return result
        if prepared.pool is not self.pool:
            raise _pool_gone()  # the server that reserved them is gone, and its leases
        try:
            self._each_slot(
                slots.slots,
                prepared.pool,
                gather,
                chunks,
                prepared.first_chunk,
                True,
                caller_copies,
            )
        except BaseException:
            self.abort_store(prepared)
            raise
        commit = p.CommitStore(self._rid(), self._token(), slots.lease)
        if not confirm:
            self._call(commit, answered=False, commits=len(slots.slots))
            result.stored = [s.chunk for s in slots.slots]
            result.confirmed = False
            result.commit_rid = commit.rid
            return result
        done: p.Committed = self._call(commit)
        result.cleared = done.cleared
        result.stored = [s.chunk for s in slots.slots[: done.committed]]
        return result

    def abort_store(self, prepared: PreparedStore) -> None:
        """Give a reservation back without writing (nothing to do when it reserved none)."""
        if prepared.slots.lease:
            self._call(p.AbortStore(self._rid(), self._token(), prepared.slots.lease))

    # -- retrieve --------------------------------------------------------------------------
    def retrieve(
        self,
        tokens: Tokens | None = None,
        out: Sequence[Any] | None = None,
        *,
        hashes: Sequence[bytes] | None = None,
        request_id: str = "",
        scatter: Scatter | None = None,
        first_chunk: int = 0,
        partial_last: bool = False,
        salt: str = "",
        caller_copies: bool | None = None,
        wait_release: bool = True,
    ) -> RetrieveResult:
        """Copy cached chunks out, once, then release their locks.

        Name the chunks with ``request_id`` (the locks a :meth:`lookup` took) or with
        ``tokens``/``hashes`` (from ``first_chunk`` on). Give destinations as ``out``
        (``out[i]`` receives chunk ``first_chunk + i``) or as ``scatter(chunk, src)``, which
        must consume the zero-copy slot view ``src`` before returning. Missing chunks are
        reported in the result, never raised; every lock is released either way.
        ``caller_copies`` as for :meth:`store`. ``wait_release=False``: return once the
        release is sent, without waiting for the server's answer (this client's next call
        reads it; the server releases before it serves that call, and an error is logged):
        for an engine waiting to run its forward pass, which the answer would only delay.
        """
        if (out is None) == (scatter is None):
            raise ValueError("give exactly one of out or scatter")
        if request_id:
            if tokens is not None or hashes is not None:
                raise ValueError("give request_id or tokens/hashes, not both")
            req = p.PrepareRetrieve(self._rid(), self._token(), request_id=request_id)
        else:
            sel = self._selector(tokens, hashes, partial_last, salt)
            req = p.PrepareRetrieve(self._rid(), self._token(), chunks=sel, first_chunk=first_chunk)
        slots: p.RetrieveSlots
        slots, pool = self._call_for_slots(req)
        result = RetrieveResult(missing=slots.missing)
        if not slots.slots:
            return result
        try:
            self._each_slot(slots.slots, pool, scatter, out, first_chunk, False, caller_copies)
            result.retrieved = [slot.chunk for slot in slots.slots]
        finally:
            finish = p.FinishRetrieve(self._rid(), self._token(), slots.lease)
            self._call(finish, answered=wait_release)
        return result

    def _each_slot(
        self,
        slots: Sequence[p.Slot],
        pool: ShmPool | None,
        callback: Callable[[int, npt.NDArray[Any]], None] | None,
        arrays: Sequence[Any] | None,
        first_chunk: int,
        into_slots: bool,
        caller_copies: bool | None,
    ) -> None:
        """For every slot, ``callback(chunk, view)`` or one copy between the view (in
        ``pool``, the mapping the slots were given in) and ``arrays[chunk - first_chunk]``
        (into the slots for a store). Array copies run on the copy threads, callbacks only
        with ``parallel_callbacks``; returns only when every call has ended."""
        if callback is None:
            assert arrays is not None

            def copy(chunk: int, view: npt.NDArray[Any]) -> None:
                array = arrays[chunk - first_chunk]
                if into_slots:
                    _copy_into(view, array)
                else:
                    _copy_into(array, view)

        views = [(slot.chunk, self.slot_view(slot, pool)) for slot in slots]
        fn = callback or copy
        if callback is not None and not self.parallel_callbacks:
            for chunk, view in views:
                fn(chunk, view)
            return
        self._copier.run(lambda cv: fn(*cv), views, [s.length for s in slots], caller_copies)

    # -- async variants --------------------------------------------------------------------
    def _submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="tierkv-client")
        return self._executor.submit(fn, *args, **kwargs)

    def store_async(self, *args: Any, **kwargs: Any) -> Future[StoreResult]:
        """:meth:`store` on the client's background thread."""
        return self._submit(self.store, *args, **kwargs)

    def retrieve_async(self, *args: Any, **kwargs: Any) -> Future[RetrieveResult]:
        """:meth:`retrieve` on the client's background thread."""
        return self._submit(self.retrieve, *args, **kwargs)

    def lookup_async(self, *args: Any, **kwargs: Any) -> Future[p.LookupResult]:
        return self._submit(self.lookup, *args, **kwargs)

    # -- the chunk feed --------------------------------------------------------------------
    def read_chunk_events(self, after: int, limit: int = 4096) -> p.ChunkEvents:
        """The server's chunk feed for this client's namespaces (its engine's): the noted
        chunks stored and removed after sequence number ``after``
        (:mod:`tierkv.server.chunk_feed`). ``resync`` in the reply, or an ``epoch`` other
        than before (a restarted server): read :meth:`read_chunk_snapshot` instead."""
        reply: p.ChunkEvents = self._call(
            p.ReadChunkEvents(self._rid(), self._token(), after, limit)
        )
        return reply

    def read_chunk_snapshot(self) -> tuple[int, int, list[p.ChunkEvent]]:
        """What this client's namespaces hold now, every page: (epoch, the sequence number
        to read events after, a stored event per noted chunk)."""
        chunks: list[p.ChunkEvent] = []
        page = 0
        while True:
            reply: p.ChunkSnapshot = self._call(
                p.ReadChunkSnapshot(self._rid(), self._token(), page)
            )
            chunks += reply.chunks  # (a server restarted meanwhile has no page N > 0)
            if not reply.next_page:
                return reply.epoch, reply.seq, chunks
            page = reply.next_page

    def router_lookup(self, query: p.RouterQuery) -> tuple[int, bytes]:
        """A router's ``POST /lookup`` (decoded and packed:
        :func:`tierkv.cluster.router_lookup.query_of`) answered by the server: (HTTP status,
        JSON body). Needs no registration; the auth token where the server has one."""
        reply: p.RouterAnswer = self._call(p.RouterLookup(self._rid(), self.auth_token, query))
        return reply.status, reply.body

    # -- administration --------------------------------------------------------------------
    def ping(self, timeout: float | None = None) -> None:
        self._call(p.Ping(self._rid()), timeout=timeout)

    def stats(self) -> p.Stats:
        client = self.registration.client if self.registration else 0
        return self._call(p.GetStats(self._rid(), client, self.auth_token))  # type: ignore[no-any-return]

    def clear(self, everything: bool = False) -> int:
        """Remove this client's chunks from the server's pool (its namespace, and those of
        the cache salts it used); returns how many. With ``everything`` (or when not
        registered) every tenant's chunks: that needs the auth token on a server that has
        one. Slower tiers keep their copies either way."""
        client = self.registration.client if self.registration else 0
        req = p.Clear(self._rid(), client, self.auth_token, everything)
        reply: p.Ok = self._call(req)
        return reply.count

    def close(self) -> None:
        """Unregister (best effort), close the socket and unmap the pool (never unlinks)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._copier.close()
        if self.registration is not None:
            with contextlib.suppress(TierKVError):
                self.unregister()
        with self._io:
            self._closed = True
            self._disconnect()
        self._close_pool()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _segment_id(name: str) -> tuple[int, int] | None:
    """Identity (device, inode) of the segment a name refers to now, to notice that a
    restarted server recreated it under the same name."""
    try:
        st = os.stat(os.path.join(SHM_DIR, name.lstrip("/")))
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _copy_into(dst: Any, src: Any) -> None:
    """One copy of a chunk between a numpy view and an array or tensor of the same shape:
    :func:`~tierkv.arraycopy.copy_array` when both are in host memory (a tensor through its
    numpy view), else torch's copy (to or from an accelerator)."""
    d, s = _host_array(dst), _host_array(src)
    if d is not None and s is not None:
        try:
            copy_array(d, s)
        except ValueError as exc:  # shapes or element sizes that do not match
            raise LayoutError(f"a chunk does not fit its slot: {exc}") from exc
        return
    import torch  # a tensor on an accelerator on one side

    dt = torch.from_numpy(dst) if isinstance(dst, np.ndarray) else dst
    st = torch.from_numpy(src) if isinstance(src, np.ndarray) else src
    if tuple(dt.shape) != tuple(st.shape) or dt.element_size() != st.element_size():
        raise LayoutError(
            f"chunk of shape {tuple(st.shape)} does not fit a slot of {tuple(dt.shape)}"
        )
    if dt.dtype != st.dtype:
        st = st.view(dt.dtype)
    dt.copy_(st)


def _host_array(chunk: Any) -> npt.NDArray[Any] | None:
    """A chunk as a numpy array when it is in host memory (None: a tensor elsewhere)."""
    if isinstance(chunk, np.ndarray):
        return chunk
    if not callable(getattr(chunk, "element_size", None)):
        raise LayoutError(
            f"a chunk must be a numpy array or a torch tensor, not {type(chunk).__name__}"
        )
    return host_view(chunk)


def _pool_gone() -> LeaseExpiredError:
    return LeaseExpiredError(
        p.ErrorCode.NOT_FOUND,
        "the slots were given in a pool this client no longer maps (the server restarted "
        "and the client registered again): store or retrieve again",
    )


def _chunk_count_error(given: int, expected: int, first_chunk: int) -> str:
    return f"{given} chunk arrays given for {expected} chunks (from chunk {first_chunk} on)"


__all__ = [
    "Client",
    "LayoutError",
    "LeaseExpiredError",
    "NotRegisteredError",
    "PreparedStore",
    "Registration",
    "RetrieveResult",
    "ServerError",
    "ServerUnavailableError",
    "StoreResult",
    "TierKVError",
    "UnauthorizedError",
    "default_endpoint",
]
