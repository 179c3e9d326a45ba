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

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import msgspec
import numpy.typing as npt

from tierkv import protocol as p
from tierkv.client.channel import DEFAULT_REPLY_SPIN
from tierkv.client.connection import DEFAULT_TIMEOUT, ServerConnection
from tierkv.client.errors import LeaseExpiredError, TierKVError
from tierkv.client.results import PreparedStore, RetrieveResult, StoreResult
from tierkv.client.selectors import Tokens, chunk_count_error, num_chunks, selector
from tierkv.client.slots import SlotCallback, copy_slots, pool_gone
from tierkv.copier import Copier
from tierkv.pool import ShmPool

log = logging.getLogger(__name__)

# The longest the server holds one QUERY_PREFETCH of wait_prefetch: an answer the moment the
# prefetch is done, 50 requests a second at most, and another thread of the client waits at
# most this long for the connection.
PREFETCH_WAIT_SLICE = 0.02

T = TypeVar("T")
Gather = SlotCallback  # (chunk, the slot's view to fill)
Scatter = SlotCallback  # (chunk, the slot's view to read before returning)


class Client(ServerConnection):
    """A connection to one tierkv server, registered for one KV layout, that moves KV."""

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
        wait_for_server: bool = True,
    ) -> None:
        """``copy_threads``: threads that copy a large batch (default: the cores, at most
        4). Arrays given as ``chunks``/``out`` are always copied by them; ``gather``/
        ``scatter`` callbacks only with ``parallel_callbacks`` (then they are called from
        several threads at once, each chunk once). ``data_priority``: the copy threads run
        at data priority (:mod:`tierkv.priority`) and the calling thread only waits, so the
        bulk copies of many engines never hold a core that a request's round trip needs;
        False: the calling thread copies a share (with ``copy_threads=1``, all of it).
        The other arguments are :class:`ServerConnection`'s."""
        super().__init__(
            endpoint,
            timeout=timeout,
            auth_token=auth_token,
            populate=populate,
            on_pool=on_pool,
            reply_spin=reply_spin,
            wait_for_server=wait_for_server,
        )
        self._executor: ThreadPoolExecutor | None = None
        self._copier = Copier(copy_threads, data_priority=data_priority)
        self.parallel_callbacks = parallel_callbacks

    @property
    def copy_threads(self) -> int:
        """The threads that copy a large batch, the calling thread included where it joins."""
        return self._copier.threads

    # -- views -----------------------------------------------------------------------------
    def slot_view(self, slot: p.Slot, pool: ShmPool | None = None) -> npt.NDArray[Any]:
        """Zero-copy numpy view of a slot, shaped like the chunk (partial chunks: fewer
        tokens on the token axis), in ``pool`` (default: the pool mapped now)."""
        pool = self.pool if pool is None else pool
        if self._slots is None or pool is None:
            raise TierKVError("call register() first")
        return self._slots.view(slot, pool)

    def slot_tensor(self, slot: p.Slot) -> Any:
        """Zero-copy torch tensor over a slot (torch must be installed)."""
        if self._slots is None or self.pool is None:
            raise TierKVError("call register() first")
        return self._slots.tensor(slot, self.pool)

    def _num_chunks(self, sel: p.ChunkSelector) -> int:
        reg = self.registration
        if reg is None:
            raise TierKVError("call register() first")
        return num_chunks(sel, reg.chunk_size)

    # -- lookup ----------------------------------------------------------------------------
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
        sel = selector(tokens, hashes, salt=salt)
        reply: p.LookupResult = self._channel.call(p.Lookup(*self._ids(), sel, request_id))
        if wait and reply.prefetching:
            hits = self.wait_prefetch(request_id)
            return msgspec.structs.replace(reply, hits=hits, prefetching=False)
        return reply

    def query_prefetch(self, request_id: str, wait: float = 0.0) -> p.PrefetchStatus:
        """Whether the lookup's prefetch is done, and the hit count so far. ``wait``: the
        server may hold the reply that many seconds, answering as soon as the prefetch is
        done (other threads' calls on this client wait meanwhile)."""
        wait_ms = max(0, min(round(wait * 1000), p.MAX_PREFETCH_WAIT_MS))
        req = p.QueryPrefetch(*self._ids(), request_id, wait_ms)
        return self._channel.call(req, timeout=self.timeout + wait_ms / 1000)  # type: ignore[no-any-return]

    def wait_prefetch(self, request_id: str, timeout: float | None = None) -> int:
        """Wait until the lookup's prefetch is done; returns the final hit count. The
        server answers the moment it is done (it holds each query up to
        ``PREFETCH_WAIT_SLICE`` seconds, so another thread of this client never waits
        longer for the connection). The server bounds every prefetch (prefetch_timeout), so
        this ends even if a tier hangs; a prefetch still not done after ``timeout`` (the
        client's by default) is a miss for what it was fetching: the hits the pool had at
        the lookup are returned, never an error (the server finishes the prefetch in the
        background)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            left = deadline - time.monotonic()
            status = self.query_prefetch(request_id, wait=min(PREFETCH_WAIT_SLICE, max(left, 0)))
            if status.done:
                return status.hits
            if time.monotonic() >= deadline:
                log.debug("prefetch of %r not done in time: %d hits", request_id, status.hits)
                return status.hits

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
        sel = selector(tokens, hashes, partial_last, salt)
        expected = self._num_chunks(sel) - first_chunk
        if chunks is not None and len(chunks) != expected:
            raise ValueError(chunk_count_error(len(chunks), expected, first_chunk))
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
        sel = selector(tokens, hashes, partial_last, salt)
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
        return PreparedStore(slots, first_chunk, expected, pool, req.client)

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
                chunk_count_error(len(chunks), prepared.expected, prepared.first_chunk)
            )
        slots = prepared.slots
        result = StoreResult(present=slots.present, no_space=slots.no_space, writing=slots.writing)
        if not slots.slots:
            return result
        if prepared.pool is not self.pool:
            raise pool_gone()  # the server that reserved them is gone, and its leases
        try:
            self._copy_slots(
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
        # A commit in a cluster waits for the directory: at most half this client's reply
        # timeout, so that a slow directory owner never makes it look lost.
        wait_ms = int(min(self.timeout, 86_400.0) * 500)
        rid = self._channel.rid()
        commit = p.CommitStore(rid, prepared.client, slots.lease, wait_ms=wait_ms)
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
            abort = p.AbortStore(self._channel.rid(), prepared.client, prepared.slots.lease)
            self._channel.call(abort)

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
            if first_chunk:
                raise ValueError("first_chunk names chunks by tokens/hashes, not by request_id")
            req = p.PrepareRetrieve(*self._ids(), request_id=request_id)
        else:
            sel = selector(tokens, hashes, partial_last, salt)
            req = p.PrepareRetrieve(*self._ids(), chunks=sel, first_chunk=first_chunk)
        slots: p.RetrieveSlots
        sent = time.monotonic()
        slots, pool = self._call_for_slots(req)
        result = RetrieveResult(missing=slots.missing)
        if not slots.slots:
            return result
        try:
            last = max(slot.chunk for slot in slots.slots) - first_chunk
            if out is not None and last >= len(out):
                raise ValueError(
                    f"out holds {len(out)} arrays; chunk {last + first_chunk} needs "
                    f"{last + 1} from first_chunk {first_chunk}"
                )
            self._copy_slots(slots.slots, pool, scatter, out, first_chunk, False, caller_copies)
            copied = [slot.chunk for slot in slots.slots]
            # The locks hold lease_ms from the server's answer, which came after `sent`: a
            # copy that ended sooner than that after `sent` read locked slots only.
            if slots.lease_ms and time.monotonic() - sent >= slots.lease_ms / 1000:
                log.warning(
                    "tierkv: a retrieve's copy of %d chunks ended after their read locks "
                    "(%g s): counted as missed, not retrieved",
                    len(copied),
                    slots.lease_ms / 1000,
                )
                result.late = True
                result.missing = sorted(result.missing + copied)
            else:
                result.retrieved = copied
        finally:
            # Under the token the locks were taken with (see PreparedStore.client).
            finish = p.FinishRetrieve(self._channel.rid(), req.client, slots.lease)
            try:
                self._channel.call(finish, answered=wait_release)
            except LeaseExpiredError:
                if not result.late:
                    raise
                # The locks ended before the copy did: the result says so already.
        return result

    def _copy_slots(
        self,
        slots: Sequence[p.Slot],
        pool: ShmPool | None,
        callback: SlotCallback | None,
        arrays: Sequence[Any] | None,
        first_chunk: int,
        into_slots: bool,
        caller_copies: bool | None,
    ) -> None:
        """:func:`tierkv.client.slots.copy_slots` with this client's layout and copier."""
        if self._slots is None or pool is None:
            raise TierKVError("call register() first")
        copy_slots(
            self._slots, self._copier, slots, pool, callback, arrays, first_chunk,
            into_slots, self.parallel_callbacks, caller_copies,
        )  # fmt: skip

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

    def close(self) -> None:
        """Stop the copy threads, then unregister (best effort), close the socket and unmap
        the pool (never unlinks)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._copier.close()
        super().close()
