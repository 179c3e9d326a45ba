"""The tier interface: what a tier below the pool does (batches of stores, loads, presence
checks and deletes), the status a load reports per chunk, and a tier's usage.

A tier keeps chunks the pool evicted and gives them back on prefetch. Every operation is a
batch, runs on a tier thread (never on the RPC loop), and moves bytes straight between the
pool and the medium: ``store`` gets read-only ``memoryview`` slices of pool slots, ``load``
gets writable slices of freshly reserved slots. Tiers never raise for a single bad chunk:
they report it per item (``LoadStatus``) and count it. The bytes they keep are records of
:mod:`tierkv.tiers.records`; tiers are built by name from :mod:`tierkv.tiers.registry`.
"""

from __future__ import annotations

import enum
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tierkv.tiers.outage import Outage


class TierError(Exception):
    """A tier cannot be created or is unusable as configured."""


class LoadStatus(enum.IntEnum):
    OK = 0
    MISSING = 1  # not in this tier
    CORRUPT = 2  # present but failed verification (torn, truncated, bit rot, wrong key)
    ERROR = 3  # the medium failed (I/O error, connection lost, timeout)


@dataclass(frozen=True, slots=True)
class TierUsage:
    objects: int
    bytes_used: int
    capacity: int  # 0 = unbounded / unknown


class Tier(ABC):
    """A store of chunks below the pool. Implementations must be thread-safe."""

    name: str
    # Whether usage() walks the medium (a Redis SCAN, an S3 listing) rather than reading
    # counters: status reports then show a cached answer, refreshed off the request path.
    usage_scans: bool = False

    @abstractmethod
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is (probably) held; a later load may still miss."""

    def presence(self, keys: Sequence[bytes]) -> list[bool | None]:
        """:meth:`contains`, with None for a key the tier could not check (its medium
        failed), so that a caller can tell "not held" from "could not ask". Tiers whose
        checks can fail override it; the default trusts :meth:`contains`."""
        return [bool(held) for held in self.contains(keys)]

    @abstractmethod
    def store(self, items: Sequence[tuple[bytes, memoryview]]) -> list[bool]:
        """Write each (key, payload view); True where stored. Never keeps the views."""

    @abstractmethod
    def load(self, items: Sequence[tuple[bytes, memoryview]]) -> list[LoadStatus]:
        """Fill each writable view with the key's payload (same length), verified."""

    def load_verified(
        self, items: Sequence[tuple[bytes, memoryview]]
    ) -> tuple[list[LoadStatus], dict[bytes, bytes]]:
        """:meth:`load`, plus the checksum of each chunk the tier verified on the way in
        (key -> checksum), for a caller that would otherwise hash the bytes again. Tiers that
        do not hand their checksums out return an empty dict."""
        return self.load(items), {}

    def loaded_and_committed(self, chunks: Sequence[tuple[bytes, bytes, int]]) -> None:  # noqa: B027
        """Chunks this tier just loaded are now committed in the pool: (key, checksum,
        length) each, the checksum from :meth:`load_verified`. A hook for tiers that track
        what the pool holds (the peer tier publishes them); the default does nothing."""

    @abstractmethod
    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove keys; returns how many were held."""

    @abstractmethod
    def usage(self) -> TierUsage: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and files."""

    @classmethod  # noqa: B027 - optional hook
    def check_options(cls, **options: Any) -> None:
        """Refuse options that have the right types but cannot work (a malformed URL),
        with :class:`TierError`, before anything is opened; called with every option."""

    def copies(self) -> str:
        """What a store and a load cost in extra copies of the payload (for the documentation)."""
        return "unknown"

    @property
    def outage(self) -> Outage:
        """This tier's failure state (see :mod:`tierkv.tiers.outage`): every site that sees
        the tier fail or work reports here, so an outage is logged once, not per batch.
        Logged by the logger of the tier's module; created on first use."""
        found: Outage | None = self.__dict__.get("_outage")
        if found is None:
            new = Outage(self.outage_label(), logging.getLogger(type(self).__module__))
            found = self.__dict__.setdefault("_outage", new)  # atomic: one per tier
        return found

    def outage_label(self) -> str:
        """How the outage log lines name this tier (tiers add where their medium is)."""
        return f"{self.name} tier"
