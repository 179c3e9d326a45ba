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

A client is safe to use from several threads (requests are serialized on its channel,
:mod:`tierkv.client.channel`); the ``*_async`` variants return futures so an engine can
overlap KV movement with compute.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import msgspec
import numpy as np
import numpy.typing as npt

from tierkv import dtypes, keys
from tierkv import protocol as p
from tierkv.client.channel import DEFAULT_REPLY_SPIN, RequestChannel
from tierkv.client.copies import copy_into
from tierkv.client.endpoints import default_endpoint
from tierkv.client.errors import LeaseExpiredError, ServerUnavailableError, TierKVError
from tierkv.client.pool_mapping import PoolMapping
from tierkv.client.results import PreparedStore, Registration, RetrieveResult, StoreResult
from tierkv.copier import Copier
from tierkv.liveness import process_scope
from tierkv.pool import ShmPool

log = logging.getLogger(__name__)

T = TypeVar("T")
Tokens = Sequence[int] | npt.NDArray[np.integer] | bytes
Gather = Callable[[int, npt.NDArray[Any]], None]
Scatter = Callable[[int, npt.NDArray[Any]], None]

DEFAULT_TIMEOUT = 10.0


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
        self._channel = RequestChannel(endpoint or default_endpoint(), timeout, reply_spin)
        self.auth_token = auth_token
        self._mapping = PoolMapping(populate, on_pool)
        self._executor: ThreadPoolExecutor | None = None
        self._copier = Copier(copy_threads, data_priority=data_priority)
        self.parallel_callbacks = parallel_callbacks
        self.registration: Registration | None = None
        self._np_dtype: np.dtype[Any] | None = None

    @property
    def endpoint(self) -> str:
        return self._channel.endpoint

    @property
    def timeout(self) -> float:
        """Seconds a request waits for its reply unless it says otherwise."""
        return self._channel.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._channel.timeout = value

    @property
    def reply_spin(self) -> float:
        return self._channel.reply_spin

    @property
    def pool(self) -> ShmPool | None:
        """The server's pool as mapped now (None before a registration)."""
        return self._mapping.pool

    @property
    def copy_threads(self) -> int:
        """The threads that copy a large batch, the calling thread included where it joins."""
        return self._copier.threads

    # -- requests sent without waiting ---------------------------------------------------
    def commit_shortfalls(self) -> dict[int, int]:
        """The commits sent without waiting (``finish_store(confirm=False)``) that committed
        fewer chunks than their results' ``stored``, by ``commit_rid``: how many fewer (all
        of them when the commit failed, or when its answer was lost with the connection and
        it is not known to have been carried out). Each is reported once, from when its
        answer was read (by :meth:`settle`, or any call) or lost; commits not named here
        committed all their chunks, once :meth:`settle` has returned."""
        return self._channel.commit_shortfalls()

    def settle(self, timeout: float | None = None) -> int:
        """Wait for the answers to every request sent without waiting (unconfirmed commits,
        releases): once it returns, the server has carried them out, and a commit's chunks
        are visible wherever a confirmed commit's would be (on this server; in a cluster,
        in the directory too). Returns how many of them failed since the last call (each is
        logged). Raises :class:`ServerUnavailableError` when the answers do not come (the
        connection is then closed: a server that lost it never carried out what it had not
        read)."""
        return self._channel.settle(timeout)

    def _ids(self) -> tuple[int, int]:
        """A new request id and this client's token (the first fields of most requests)."""
        return self._channel.rid(), self._token()

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
            self._channel.rid(),
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
        with self._channel.io:  # no other request between the answer and mapping its pool
            return self._registered(layout, self._channel.call(req))

    def _registered(self, layout: p.Layout, reply: p.Registered) -> Registration:
        """Map the pool a REGISTER answer names (unless mapped already) and keep the
        registration."""
        self._mapping.map(reply.pool_name, reply.pool_size)
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

    def unregister(self) -> None:
        if self.registration is None:
            return
        try:
            self._channel.call(
                p.Unregister(self._channel.rid(), self.registration.client), timeout=2.0
            )
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
        reply: p.LookupResult = self._channel.call(p.Lookup(*self._ids(), sel, request_id))
        if wait and reply.prefetching:
            hits = self.wait_prefetch(request_id)
            return msgspec.structs.replace(reply, hits=hits, prefetching=False)
        return reply

    def query_prefetch(self, request_id: str) -> p.PrefetchStatus:
        """Whether the lookup's prefetch is done, and the hit count so far."""
        return self._channel.call(p.QueryPrefetch(*self._ids(), request_id))  # type: ignore[no-any-return]

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
        reply: p.Ok = self._channel.call(p.FreeLookupLocks(*self._ids(), request_id))
        return reply.count

    def end_session(self, request_id: str) -> int:
        reply: p.Ok = self._channel.call(p.EndSession(*self._ids(), request_id))
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
        req = p.PrepareStore(*self._ids(), sel, first_chunk, note_list)
        slots, pool = self._call_for_slots(req)
        return PreparedStore(slots, first_chunk, expected, pool)

    def _call_for_slots(self, req: Any) -> tuple[Any, ShmPool | None]:
        """A request answered with slots, and the pool mapping they are in: the one mapped
        while the answer came (a registration maps a new pool under the same lock). Slots are
        only ever viewed in that mapping: after a server restart and a registration by
        another thread, the new pool at the old slots' offsets holds other chunks."""
        with self._channel.io:
            return self._channel.call(req), self.pool

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
        commit = p.CommitStore(*self._ids(), slots.lease)
        if not confirm:
            self._channel.call(commit, answered=False, commits=len(slots.slots))
            result.stored = [s.chunk for s in slots.slots]
            result.confirmed = False
            result.commit_rid = commit.rid
            return result
        done: p.Committed = self._channel.call(commit)
        result.cleared = done.cleared
        result.stored = [s.chunk for s in slots.slots[: done.committed]]
        return result

    def abort_store(self, prepared: PreparedStore) -> None:
        """Give a reservation back without writing (nothing to do when it reserved none)."""
        if prepared.slots.lease:
            self._channel.call(p.AbortStore(*self._ids(), prepared.slots.lease))

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
            req = p.PrepareRetrieve(*self._ids(), request_id=request_id)
        else:
            sel = self._selector(tokens, hashes, partial_last, salt)
            req = p.PrepareRetrieve(*self._ids(), chunks=sel, first_chunk=first_chunk)
        slots: p.RetrieveSlots
        slots, pool = self._call_for_slots(req)
        result = RetrieveResult(missing=slots.missing)
        if not slots.slots:
            return result
        try:
            self._each_slot(slots.slots, pool, scatter, out, first_chunk, False, caller_copies)
            result.retrieved = [slot.chunk for slot in slots.slots]
        finally:
            finish = p.FinishRetrieve(*self._ids(), slots.lease)
            self._channel.call(finish, answered=wait_release)
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
                    copy_into(view, array)
                else:
                    copy_into(array, view)

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
        reply: p.ChunkEvents = self._channel.call(p.ReadChunkEvents(*self._ids(), after, limit))
        return reply

    def read_chunk_snapshot(self) -> tuple[int, int, list[p.ChunkEvent]]:
        """What this client's namespaces hold now, every page: (epoch, the sequence number
        to read events after, a stored event per noted chunk)."""
        chunks: list[p.ChunkEvent] = []
        page = 0
        while True:
            reply: p.ChunkSnapshot = self._channel.call(p.ReadChunkSnapshot(*self._ids(), page))
            chunks += reply.chunks  # (a server restarted meanwhile has no page N > 0)
            if not reply.next_page:
                return reply.epoch, reply.seq, chunks
            page = reply.next_page

    def router_lookup(self, query: p.RouterQuery) -> tuple[int, bytes]:
        """A router's ``POST /lookup`` (decoded and packed:
        :func:`tierkv.cluster.router_lookup.query_of`) answered by the server: (HTTP status,
        JSON body). Needs no registration; the auth token where the server has one."""
        reply: p.RouterAnswer = self._channel.call(
            p.RouterLookup(self._channel.rid(), self.auth_token, query)
        )
        return reply.status, reply.body

    # -- administration --------------------------------------------------------------------
    def ping(self, timeout: float | None = None) -> None:
        self._channel.call(p.Ping(self._channel.rid()), timeout=timeout)

    def check_registered(self) -> None:
        """One round trip: :class:`NotRegisteredError` if the server no longer knows this
        client (it restarted since the registration)."""
        self._channel.call(p.Ping(*self._ids()))

    def stats(self) -> p.Stats:
        client = self.registration.client if self.registration else 0
        return self._channel.call(p.GetStats(self._channel.rid(), client, self.auth_token))  # type: ignore[no-any-return]

    def clear(self, everything: bool = False) -> int:
        """Remove this client's chunks from the server's pool (its namespace, and those of
        the cache salts it used); returns how many. With ``everything`` (or when not
        registered) every tenant's chunks: that needs the auth token on a server that has
        one. Slower tiers keep their copies either way."""
        client = self.registration.client if self.registration else 0
        req = p.Clear(self._channel.rid(), client, self.auth_token, everything)
        reply: p.Ok = self._channel.call(req)
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
        self._channel.close()
        self._mapping.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def _pool_gone() -> LeaseExpiredError:
    return LeaseExpiredError(
        p.ErrorCode.NOT_FOUND,
        "the slots were given in a pool this client no longer maps (the server restarted "
        "and the client registered again): store or retrieve again",
    )


def _chunk_count_error(given: int, expected: int, first_chunk: int) -> str:
    return f"{given} chunk arrays given for {expected} chunks (from chunk {first_chunk} on)"
