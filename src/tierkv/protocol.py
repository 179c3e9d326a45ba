"""The wire protocol between engines and the server: typed msgspec structs over msgpack.

Every message is one msgpack array: a tag naming the type, then the fields in declaration
order (msgspec ``array_like`` structs). Every request carries ``rid``, a request id the reply
echoes, and, except REGISTER and PING, ``client``: the token REGISTER returned, which names
the caller (its leases, its namespace). KV bytes never travel here: store and retrieve
replies carry slot offsets into the shared-memory pool.

Chunks in a request are given either as token ids (``tokens``: little-endian uint32 bytes,
hashed by the server into prefix-chained keys) or as precomputed chunk hashes
(``hashes``). Replies refer to chunks by their position in that list.

Compatibility: fields are only ever appended, with defaults, and each change of fields is a
new ``PROTOCOL_VERSION``, checked at REGISTER: a client of another version is refused with a
clear error. Decoding is strict (a message with a field this side does not know is refused as
malformed), so two builds with different fields must never get past REGISTER.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

# 2: NOT_REGISTERED split from UNAUTHORIZED; 3: Register.chunk_tokens; 4: Stats.tenants, and
# salts equal to a reserved tenant name (~default, ~other) are refused; 5: chunk notes
# (PrepareStore.notes) and the chunk feed (ReadChunkEvents, ReadChunkSnapshot); RouterLookup;
# 6: QueryPrefetch.wait_ms (the server answers when the prefetch is done); 7: RetrieveSlots.
# lease_ms, CommitStore.wait_ms, StoreSlots.writing, Stats.expired_held, Stats.connections
PROTOCOL_VERSION = 7
MAX_NOTE_BYTES = 64 * 2**10  # one chunk's note (PrepareStore.notes) at most
MAX_PREFETCH_WAIT_MS = 60_000  # the longest QueryPrefetch.wait_ms
MAX_REQUEST_ID = 1024  # characters of a lookup's request id at most (the server keeps it)


class Struct(msgspec.Struct, array_like=True, tag=True, forbid_unknown_fields=True):
    """Base of every message."""


class Layout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Shape and dtype of one full chunk, as the engine stores it.

    ``token_axis`` says which axis of ``shape`` counts tokens (the chunk's token count),
    so a partial last chunk has the same shape with fewer tokens on that axis.
    """

    shape: list[int]
    dtype: str
    token_axis: int = 0

    def signature(self) -> str:
        return f"{self.dtype}:{'x'.join(map(str, self.shape))}:t{self.token_axis}"


class ChunkSelector(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Which chunks a request is about: token ids or precomputed hashes (exactly one)."""

    tokens: bytes | None = None
    hashes: list[bytes] | None = None
    partial_last: bool = False
    salt: str = ""  # per-request cache salt: part of the namespace, so keys never cross salts


# -- requests ----------------------------------------------------------------------------
ROLE_WORKER = "worker"
ROLE_SCHEDULER = "scheduler"


class Register(Struct, tag="register"):
    rid: int
    protocol: int
    model: str
    layout: Layout
    world_size: int = 1
    rank: int = 0
    tenant_salt: str = ""
    name: str = ""
    pid: int = 0
    auth_token: str = ""
    # Clients of one engine instance share ``engine_id``: its workers (one per rank) register
    # as "worker"; its scheduler registers as "scheduler" (no layout, lookups only) and its
    # LOOKUP covers every rank, locking each rank's chunks for that rank's retrieve.
    engine_id: str = ""
    role: str = "worker"
    # tierkv.liveness.process_scope() of the engine: where it equals the server's, the
    # server watches ``pid`` and drops the client's locks as soon as the process is gone.
    process_scope: str = ""
    # 0: the chunk holds the server's chunk size of tokens (``layout.shape[token_axis]`` must
    # equal it) and may be named by token ids or hashes. N > 0: this client's chunks hold N
    # tokens (an engine's own page size, e.g. SGLang's) and are named by precomputed hashes
    # only, since the server's token hashing cuts chunks of its own size.
    chunk_tokens: int = 0


class Unregister(Struct, tag="unregister"):
    rid: int
    client: int


class Lookup(Struct, tag="lookup"):
    """How many leading chunks are available; read-locks them under ``request_id``."""

    rid: int
    client: int
    chunks: ChunkSelector
    request_id: str = ""


class QueryPrefetch(Struct, tag="query_prefetch"):
    """Whether a lookup's prefetch is done. ``wait_ms`` > 0: the server holds the reply until
    the prefetch is done, or that many milliseconds have passed, or the server's
    ``prefetch_timeout`` has ended the prefetch, whichever comes first (at most
    ``MAX_PREFETCH_WAIT_MS``); 0 answers at once."""

    rid: int
    client: int
    request_id: str
    wait_ms: int = 0


class PrepareStore(Struct, tag="prepare_store"):
    """Reserve slots for the chunks from ``first_chunk`` on (earlier ones are only hashed)."""

    rid: int
    client: int
    chunks: ChunkSelector
    first_chunk: int = 0
    # One per chunk from first_chunk on (b"": none): the engine's description of the chunk,
    # announced to every engine of its namespaces once committed (tierkv.server.chunk_feed).
    notes: list[bytes] | None = None


class CommitStore(Struct, tag="commit_store"):
    """Publish a store. ``only``: positions within the reply's slots to commit; the rest are
    aborted. None commits all. ``wait_ms``: in a cluster, how long at most the reply may
    wait for the directory to have the chunks (the server's commit_publish_timeout caps
    it; -1: that timeout): a client asks for less than its own reply timeout, so that a
    slow directory owner never makes a commit look lost."""

    rid: int
    client: int
    lease: int
    only: list[int] | None = None
    wait_ms: int = -1


class AbortStore(Struct, tag="abort_store"):
    rid: int
    client: int
    lease: int


class PrepareRetrieve(Struct, tag="prepare_retrieve"):
    """Slots to read. Either the locks a LOOKUP took (``request_id``), or ``chunks`` to lock
    now (every chunk that is present is locked; the reply lists the missing ones)."""

    rid: int
    client: int
    request_id: str = ""
    chunks: ChunkSelector | None = None
    first_chunk: int = 0


class FinishRetrieve(Struct, tag="finish_retrieve"):
    rid: int
    client: int
    lease: int


class FreeLookupLocks(Struct, tag="free_lookup_locks"):
    rid: int
    client: int
    request_id: str


class EndSession(Struct, tag="end_session"):
    """The engine is done with ``request_id``: release whatever the server still holds."""

    rid: int
    client: int
    request_id: str


class Clear(Struct, tag="clear"):
    """Remove objects from the pool (tiers keep theirs). A registered client clears its own
    namespaces (its model/layout/rank/tenant, and the cache salts it used); ``everything``
    (or ``client`` 0, an admin tool) clears the whole pool and needs the server's auth token
    when it has one."""

    rid: int
    client: int
    auth_token: str = ""
    everything: bool = False


class ReadChunkEvents(Struct, tag="read_chunk_events"):
    """The chunk feed's events of the client's namespaces (its engine's: every rank, every
    cache salt) after sequence number ``after``."""

    rid: int
    client: int
    after: int
    limit: int = 4096


class ReadChunkSnapshot(Struct, tag="read_chunk_snapshot"):
    """What the client's namespaces hold now (noted chunks), one page at a time: ``page`` 0
    takes the snapshot, later pages continue it (the reply says which is next)."""

    rid: int
    client: int
    page: int = 0


class RouterQuery(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """A router's ``POST /lookup``, checked and packed by the server's HTTP front process
    (:mod:`tierkv.cluster.router_lookup`): the namespace by ``model`` or ``namespace`` (a
    16-byte digest); the prompt as ``tokens`` (little-endian uint32 ids) or ``hashes``."""

    model: str
    namespace: bytes
    tokens: bytes | None
    hashes: list[bytes] | None
    chunk_tokens: int


class RouterLookup(Struct, tag="router_lookup"):
    """A router's lookup, passed on by the server's HTTP front process
    (:mod:`tierkv.server.front`); answered like the HTTP request (a status and a JSON
    body). Needs the auth token on a server that has one."""

    rid: int
    auth_token: str
    query: RouterQuery


class Ping(Struct, tag="ping"):
    """Is the server up? With ``client`` (a registration's token), also: does it still know
    that client (NOT_REGISTERED once it restarted)?"""

    rid: int
    client: int = 0


class GetStats(Struct, tag="stats"):
    rid: int
    client: int = 0
    auth_token: str = ""


Request = (
    Register
    | Unregister
    | Lookup
    | QueryPrefetch
    | PrepareStore
    | CommitStore
    | AbortStore
    | PrepareRetrieve
    | FinishRetrieve
    | FreeLookupLocks
    | EndSession
    | Clear
    | Ping
    | GetStats
    | ReadChunkEvents
    | ReadChunkSnapshot
    | RouterLookup
)


# -- replies -----------------------------------------------------------------------------
class ErrorCode(str, enum.Enum):
    BAD_REQUEST = "bad_request"  # malformed, unknown type, fields out of range
    TOO_LARGE = "too_large"  # more chunks or tokens than the server accepts in one request
    UNAUTHORIZED = "unauthorized"  # wrong or missing auth token
    NOT_REGISTERED = "not_registered"  # unknown client token: register (again)
    VERSION = "version"  # protocol version mismatch
    NOT_FOUND = "not_found"  # lease or request id unknown (never issued, ended, expired)
    NOT_OWNED = "not_owned"  # lease of another client
    LIMIT = "limit"  # a server-wide limit is reached (registered clients)
    SHUTTING_DOWN = "shutting_down"
    INTERNAL = "internal"


class Error(Struct, tag="error"):
    rid: int
    code: ErrorCode
    message: str


class Registered(Struct, tag="registered"):
    rid: int
    client: int
    server_version: str
    protocol: int
    pool_name: str
    pool_size: int
    chunk_size: int
    chunk_bytes: int
    namespace: bytes


class Ok(Struct, tag="ok"):
    rid: int
    count: int = 0


class LookupResult(Struct, tag="lookup_result"):
    """``hits``: leading chunks available and read-locked now; ``prefetching``: true while
    following chunks are being loaded from slower tiers (poll with QUERY_PREFETCH)."""

    rid: int
    hits: int
    total: int
    prefetching: bool = False


class SourceRun(msgspec.Struct, array_like=True, frozen=True):
    """``chunks`` consecutive hit chunks found in one place: ``"pool"`` (in the pool when
    looked up) or the tier that was prefetched from (a tier's name, ``"peer"``)."""

    source: str
    chunks: int


class PrefetchStatus(Struct, tag="prefetch_status"):
    """``sources``: where the ``hits`` came from, in chunk order (once ``done``; empty while
    the prefetch runs, when every hit is the pool's)."""

    rid: int
    done: bool
    hits: int
    sources: list[SourceRun] = msgspec.field(default_factory=list)


class Slot(msgspec.Struct, array_like=True, frozen=True):
    """A chunk's place in the pool: position in the request, offset, byte length."""

    chunk: int
    offset: int
    length: int


class StoreSlots(Struct, tag="store_slots"):
    """``writing`` (version 7): the positions of ``present`` that another
    engine has only reserved, still being written; they are stored only once it commits,
    and never if it aborts. An older server never says: its ``present`` may include them."""

    rid: int
    lease: int  # 0 when nothing was reserved
    slots: list[Slot]
    present: list[int]  # chunk positions already stored or being written (nothing to do)
    no_space: list[int]  # chunk positions skipped: the pool is full
    writing: list[int] = msgspec.field(default_factory=list)  # of present: not committed yet


class Committed(Struct, tag="committed"):
    rid: int
    committed: int
    aborted: int
    cleared: int


class RetrieveSlots(Struct, tag="retrieve_slots"):
    rid: int
    lease: int  # 0 when nothing is locked
    slots: list[Slot]
    missing: list[int]
    # How long the locks hold from the server's answer on (ms; 0: not said). A copy that
    # ended later than that after the request was sent may have read reused slots.
    lease_ms: int = 0


CHUNK_STORED = 0
CHUNK_REMOVED = 1


class ChunkEvent(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One event of the chunk feed: ``kind`` CHUNK_STORED (with its note) or CHUNK_REMOVED."""

    seq: int
    kind: int
    key: bytes
    note: bytes


class ChunkEvents(Struct, tag="chunk_events"):
    rid: int
    epoch: int  # the feed's: another value than before means another server (resync)
    events: list[ChunkEvent]
    last: int  # read on after this
    resync: bool  # the events asked for are gone: read a snapshot


class ChunkSnapshot(Struct, tag="chunk_snapshot"):
    rid: int
    epoch: int
    seq: int  # the snapshot is current at this sequence number: read events after it
    chunks: list[ChunkEvent]  # stored events (seq 0) of what is held
    next_page: int  # 0: that was the last page


class RouterAnswer(Struct, tag="router_answer"):
    rid: int
    status: int  # the HTTP status of the answer
    body: bytes  # its JSON body


class TierStats(msgspec.Struct, forbid_unknown_fields=True):
    """One tier's figures: contents, chunks written by write-behind, chunks loaded by
    prefetch (the tier's hits) and load failures by reason (missing, corrupt, error)."""

    name: str
    objects: int
    bytes_used: int
    capacity: int
    written_chunks: int
    written_bytes: int
    write_failures: int
    loaded_chunks: int
    loaded_bytes: int
    load_failures: dict[str, int]
    usage_age_s: float = 0.0  # how old objects/bytes_used are (-1: not known yet)


class EngineInfo(msgspec.Struct):
    """A registered client as status reports show it. ``tenant`` is a short hash of the
    tenant salt ("" without one): it tells tenants apart without revealing the salt.
    ``namespace`` is the hex digest every key of this client starts with."""

    name: str
    pid: int
    role: str
    engine_id: str
    model: str
    dtype: str
    layout: str
    world_size: int
    rank: int
    tenant: str
    namespace: str
    chunk_bytes: int
    registered_s: float  # seconds since REGISTER
    idle_s: float  # seconds since its last request
    sessions: int  # open lookup sessions


class TenantTierInfo(msgspec.Struct):
    """One tenant's share of a tier below the pool that has quotas (the disk)."""

    used: int  # bytes of its chunks in the tier (files, headers included)
    limit: int  # its quota there in bytes, -1: unlimited
    evictions: int  # its chunks its quota evicted from the tier
    evicted_bytes: int
    refused_chunks: int  # its chunks a hard quota kept out of the tier
    refused_bytes: int


class TenantInfo(msgspec.Struct):
    """One tenant's share of the pool. ``tag`` is a short hash of its name; ``name`` is shown
    only where it is not a secret (a reserved name, or the name a quota was set under),
    else "". The row tagged ``rest`` sums the tenants beyond the rows shown."""

    tag: str
    name: str
    used: int  # pool bytes its slots hold
    limit: int  # its quota in bytes, -1: unlimited
    limit_source: str  # "quota" (its own), "default"
    evictions: int  # its chunks evicted (watermark or quota)
    evicted_bytes: int
    refused_chunks: int  # its stores refused by a hard quota
    refused_bytes: int
    tenants: int = 1  # tenants this row sums (more than one only in the rest row)
    tiers: dict[str, TenantTierInfo] = {}  # the tiers with quotas (the disk), by name


class Stats(Struct, tag="stats_result"):
    rid: int
    server_version: str
    uptime_s: float
    pool_name: str
    capacity: int
    used: int
    largest_free: int
    objects: int
    writing: int
    ready: int  # committed and not locked by any reader (evictable unless pinned)
    read_locked: int  # committed and held by readers or pins
    clients: int
    sessions: int  # open lookup sessions (a scheduler's group session counts once)
    write_leases: int
    read_leases: int
    expired_write_slots: int
    expired_read_locks: int
    evictions: int
    evicted_bytes: int
    requests: dict[str, int]
    errors: dict[str, int]
    tiers: list[TierStats] = []
    write_behind_queued: int = 0
    write_behind_dropped: int = 0
    prefetch_started: int = 0
    prefetch_rejected: int = 0
    prefetch_timed_out: int = 0
    prefetch_inflight: int = 0
    engines: list[EngineInfo] = []
    lookup_hits: dict[str, int] = {}  # chunks, by the tier that had them ("pool", tier names)
    lookup_misses: dict[str, int] = {}  # chunks, by reason (absent, evicted, expired, ...)
    stored_bytes: int = 0  # committed into the pool by engines
    retrieved_bytes: int = 0  # handed to engines to copy out of the pool
    http_url: str = ""  # the dashboard, "" when HTTP is off
    cluster: dict[str, Any] = {}  # the cluster node's figures ({} when not in a cluster)
    clients_reaped: int = 0  # clients dropped because their process exited
    pinned: int = 0  # of the read-locked objects: those the write-behind holds for the tiers
    pin_leases: int = 0
    clients_expired: int = 0  # unwatched clients dropped after client_idle_ttl
    stored_chunks: int = 0
    retrieved_chunks: int = 0
    request_outcomes: dict[str, dict[str, int]] = {}  # request type -> outcome -> count
    latency: dict[str, dict[str, float]] = {}  # request type -> count, mean_s
    recent_evictions: list[EvictionEvent] = []
    chunk_size: int = 0
    rpc_endpoint: str = ""
    time: float = 0.0  # unix time the figures were taken
    tenants: list[TenantInfo] = []  # by pool bytes, largest first; beyond the first 32: one row
    quota_mode: str = ""
    default_quota: int = -1  # bytes, -1: unlimited
    chunk_feed: dict[str, int] = {}  # the chunk feed's figures (tierkv.server.chunk_feed)
    # Slots of expired store reservations (and write-behind pins) kept from reuse until their
    # holder ends them or goes away: it may still be writing into (reading from) them.
    expired_held: int = 0
    # The RPC connections: open, bytes held, turned away (tierkv.served_connections).
    connections: dict[str, int] = {}


class EvictionEvent(msgspec.Struct):
    """The eviction passes of about one second, merged."""

    time: float  # unix time of the first pass
    objects: int
    bytes: int  # payload bytes
    passes: int


Reply = (
    Error
    | Registered
    | Ok
    | LookupResult
    | PrefetchStatus
    | StoreSlots
    | Committed
    | RetrieveSlots
    | Stats
    | ChunkEvents
    | ChunkSnapshot
    | RouterAnswer
)

_request_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)
encode = _request_encoder.encode


def request_name(req: object) -> str:
    """The wire tag of a message (for metrics and logs)."""
    return str(type(req).__struct_config__.tag)  # type: ignore[attr-defined]
