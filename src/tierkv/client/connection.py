"""A connection to one tierkv server and this process's registration with it: requests and
their answers (:mod:`tierkv.client.channel`), the server's pool as mapped
(:mod:`tierkv.client.pool_mapping`), the registration's slot layout, and the requests that
move no KV (the chunk feed, router lookups, statistics, clearing). :class:`tierkv.client.Client`
builds the KV movement (lookup, store, retrieve) on it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import TypeVar

from tierkv import protocol as p
from tierkv.client.channel import DEFAULT_REPLY_SPIN, RequestChannel
from tierkv.client.endpoints import default_endpoint
from tierkv.client.errors import TierKVError
from tierkv.client.pool_mapping import PoolMapping
from tierkv.client.results import Registration
from tierkv.client.slots import SlotLayout
from tierkv.liveness import process_scope
from tierkv.pool import ShmPool

DEFAULT_TIMEOUT = 10.0

C = TypeVar("C", bound="ServerConnection")


class ServerConnection:
    """A connection to one tierkv server, registered (once :meth:`register` has run) for one
    KV layout."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        auth_token: str = "",
        populate: bool = False,
        on_pool: Callable[[ShmPool], Callable[[], None] | None] | None = None,
        reply_spin: float = DEFAULT_REPLY_SPIN,
        wait_for_server: bool = True,
    ) -> None:
        """``populate``: map the pool with its pages faulted in. ``on_pool(pool)`` runs each
        time the client maps a pool (at registration, again after a server restart) and may
        return a function that runs before that mapping is closed (a GPU engine page-locks
        it: :mod:`tierkv.integrations.vllm.pinning`). ``reply_spin``: seconds the calling
        thread keeps reading for a reply before it sleeps (:class:`tierkv.framing.Connection`;
        0: sleep at once). ``wait_for_server``: when nothing listens at the endpoint (a
        server starting, restarting or gone), keep trying to connect until the request's
        timeout (True), or fail at once with ServerUnavailableError (False: an engine's
        link, which then serves misses and asks again after its retry interval, instead of
        holding the engine's thread for the timeout)."""
        self._channel = RequestChannel(
            endpoint or default_endpoint(), timeout, reply_spin, wait_for_server
        )
        self.auth_token = auth_token
        self._mapping = PoolMapping(populate, on_pool)
        self.registration: Registration | None = None
        self._registered_pid = 0  # the process that registered (a forked child did not)
        self._slots: SlotLayout | None = None

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

    def register_scheduler(
        self, model: str, engine_id: str, name: str = "", tenant_salt: str = ""
    ) -> Registration:
        """Register as the scheduler of engine ``engine_id``: lookups only. A LOOKUP then
        covers every rank registered with that engine id (the smallest hit count) and locks
        each rank's chunks for that rank's retrieve by request id. ``model`` and
        ``tenant_salt`` must be the workers' (their model may carry a format: see
        :func:`tierkv.keys.model_with_format`); the server refuses another engine's."""
        return self._register(
            model, [1], "uint8", 0, 1, 0, tenant_salt, name, engine_id, p.ROLE_SCHEDULER, 0
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
        self._registered_pid = os.getpid()
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
        self._slots = SlotLayout(layout, reply.chunk_size, reply.chunk_bytes)
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
            self._slots = None  # the registration's layout: slots are not viewed without one

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
        """Unregister (best effort), close the socket and unmap the pool (never unlinks). In
        a forked child the registration is the parent's: it is left alone."""
        if self.registration is not None and self._registered_pid == os.getpid():
            with contextlib.suppress(TierKVError):
                self.unregister()
        self._channel.close()
        self._mapping.close()

    def __enter__(self: C) -> C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
