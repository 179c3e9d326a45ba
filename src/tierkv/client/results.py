"""What a client's calls return: a store's and a retrieve's outcome, a reservation between
the two phases of a store, and the registration the server answered."""

from __future__ import annotations

from dataclasses import dataclass, field

from tierkv import protocol as p
from tierkv.pool import ShmPool


@dataclass(slots=True)
class StoreResult:
    stored: list[int] = field(default_factory=list)  # chunk positions written and committed
    present: list[int] = field(default_factory=list)  # already in the cache
    # Of present: reserved by another writer, not committed yet (stored only once it
    # commits; an older server never says, its present may include them).
    writing: list[int] = field(default_factory=list)
    no_space: list[int] = field(default_factory=list)  # skipped: the pool is full
    cleared: int = 0  # written but deleted (cleared) before the commit
    # False: the commit was sent without waiting for its answer (finish_store(confirm=
    # False)); ``stored`` is then what it commits if it succeeds (Client.settle says, and
    # Client.commit_shortfalls names this commit by ``commit_rid`` if it committed fewer).
    confirmed: bool = True
    commit_rid: int = 0

    @property
    def held(self) -> set[int]:
        """The positions tierkv holds after this store: written now, or present and
        committed. One another writer has only reserved is not held yet (if it aborts,
        tierkv holds nothing), so an engine must not count it as backed up."""
        return set(self.stored) | (set(self.present) - set(self.writing))


@dataclass(frozen=True, slots=True)
class PreparedStore:
    """A store's reserved slots (:meth:`Client.prepare_store`), until it finishes or aborts."""

    slots: p.StoreSlots
    first_chunk: int
    expected: int  # chunks from first_chunk on that the store names
    pool: ShmPool | None  # the mapping the slots are in (see Client._call_for_slots)
    # The registration token the slots were reserved under: the commit or abort names it,
    # never a token registered since (after a server restart the lease number may be one
    # of the new registration's own reservations, whose slots hold no written bytes yet).
    client: int = 0


@dataclass(slots=True)
class RetrieveResult:
    retrieved: list[int] = field(default_factory=list)  # chunk positions copied out
    missing: list[int] = field(default_factory=list)  # not in the cache
    # The copy outlasted the chunks' read locks (a copy that stalled for the server's
    # read_ttl): their slots may have been reused under it, so none counts as retrieved
    # (they are in ``missing``) and what was written into the destinations is not KV.
    late: bool = False

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
