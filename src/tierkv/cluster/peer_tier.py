"""The peer tier: other servers' pools, as one more tier of the prefetch (named "peer").

``contains`` resolves keys through the directory (one batched round trip per owner) and
remembers where each found key lives for the ``load`` that follows; ``load`` fetches the
chunks from their holders straight into the reserved slots, every holder in parallel,
preferring a holder that has the chunk in its pool over one that must promote it from
disk, and trying the next holder of a chunk whose first holder failed. So the existing
LOOKUP / QUERY_PREFETCH flow serves remote chunks with no engine change; a chunk that is
gone is a miss that ends the prefix, never an error. A holder whose fetch failed outright
(connection lost, timed out) is reported to :class:`Health`, which makes it suspect until it
answers a probe; suspect holders are skipped, so a silent holder costs one timeout, not one
per lookup.

``store`` is how this node's own chunks become visible to the cluster: the write-behind
hands it every committed engine chunk (views of pinned pool slots); it records their
checksums and publishes them. Chunks this node fetched from a peer are published too, right
after their commit: the prefetcher hands the checksums that :meth:`load_verified` returned
back to :meth:`loaded_and_committed` (so a chunk read on several nodes has several holders,
readers spread over them, and it outlives its first holder). ``delete`` withdraws them.

The tier gets the collaborators it uses (directory, membership, data plane, and the
node's record of what it published); it owns none of them, so closing it closes nothing.
"""

from __future__ import annotations

import random
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from tierkv.cluster.directory import Directory, Location, Where
from tierkv.cluster.messages import MemberInfo
from tierkv.cluster.transport import Transport
from tierkv.tiers.base import LoadStatus, Tier, TierUsage

NAME = "peer"
CACHE_ENTRIES = 65536
CACHE_SECONDS = 30.0


class Publisher(Protocol):
    """What this node has published to the directory (the cluster node keeps it)."""

    def publish_local(self, items: Sequence[tuple[bytes, memoryview]]) -> None: ...

    def publish_known(self, sums: Sequence[tuple[bytes, bytes, int]]) -> int: ...

    def withdraw(self, keys: Sequence[bytes]) -> int: ...

    def published_usage(self) -> tuple[int, int]: ...


class Health(Protocol):
    """Which holders to skip: the node tracks them (suspect until they answer a probe)."""

    def holder_suspect(self, node_id: str) -> bool: ...

    def holder_failed(self, node_id: str) -> None: ...


class Members(Protocol):
    """Where a holder's data plane is: the membership (ring mode) or the controller
    directory (controller mode) knows."""

    def get(self, node_id: str) -> MemberInfo | None: ...


class PeerTier(Tier):
    name = NAME

    def __init__(
        self,
        node_id: str,
        directory: Directory,
        membership: Members,
        transport: Transport,
        publisher: Publisher,
        health: Health | None = None,
    ) -> None:
        self.node_id = node_id
        self.directory = directory
        self.membership = membership
        self.transport = transport
        self.publisher = publisher
        self.health = health
        self._where: OrderedDict[bytes, tuple[float, list[Location]]] = OrderedDict()
        self._lock = threading.Lock()
        self.resolved = 0
        self.found = 0
        self.skipped = 0  # holders left out of a lookup: suspect

    # -- lookups ---------------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        locations = self._resolve(keys)
        return [bool(locs) for locs in locations]

    def _resolve(self, keys: Sequence[bytes]) -> list[list[Location]]:
        me = self.node_id
        # Holders with the chunk in their pool first, then those that must promote it from
        # disk; within each, in an order drawn at random once per call (so readers spread
        # over the holders, while one call's chunks go to as few holders as possible).
        draw: dict[str, float] = {}

        def preference(loc: Location) -> tuple[int, float]:
            return int(loc.where), draw.setdefault(loc.holder, random.random())

        suspect: dict[str, bool] = {}

        def usable(holder: str) -> bool:
            if holder == me:
                return False
            if self.health is None:
                return True
            skip = suspect.get(holder)
            if skip is None:
                skip = suspect[holder] = self.health.holder_suspect(holder)
                self.skipped += skip
            return not skip

        found = [
            sorted((loc for loc in locs if usable(loc.holder)), key=preference)
            for locs in self.directory.resolve(keys)
        ]
        now = time.monotonic()
        with self._lock:
            cache = self._where
            for key, locs in zip(keys, found, strict=True):
                if locs:
                    cache[key] = (now, locs)
                    cache.move_to_end(key)
                else:
                    cache.pop(key, None)
            while len(cache) > CACHE_ENTRIES:
                cache.popitem(last=False)
        self.resolved += len(keys)
        self.found += sum(1 for locs in found if locs)
        return found

    def _locations(self, keys: Sequence[bytes]) -> list[list[Location]]:
        """Where each key lives: from the last ``contains`` if fresh, else resolved now."""
        now = time.monotonic()
        out: list[list[Location] | None] = []
        with self._lock:
            for key in keys:
                hit = self._where.pop(key, None)
                out.append(hit[1] if hit and now - hit[0] < CACHE_SECONDS else None)
        todo = [i for i, locs in enumerate(out) if locs is None]
        if todo:
            for i, locs in zip(todo, self._resolve([keys[i] for i in todo]), strict=True):
                out[i] = locs
        return [locs or [] for locs in out]

    # -- loads -----------------------------------------------------------------------------
    def load(self, items: Sequence[tuple[bytes, memoryview]]) -> list[LoadStatus]:
        return self.load_verified(items)[0]

    def load_verified(
        self, items: Sequence[tuple[bytes, memoryview]]
    ) -> tuple[list[LoadStatus], dict[bytes, bytes]]:
        """Fetch from the holders; the checksums are those each chunk was verified against
        as it arrived (the prefetcher hands them back to :meth:`loaded_and_committed`)."""
        verified: dict[bytes, bytes] = {}
        statuses = [LoadStatus.MISSING] * len(items)
        choices = self._locations([key for key, _ in items])
        attempt = 0
        todo = [i for i in range(len(items)) if choices[i]]
        while todo:
            by_holder: dict[str, list[int]] = {}
            for i in todo:
                by_holder.setdefault(choices[i][attempt].holder, []).append(i)
            batches = []
            order: list[list[int]] = []
            for holder, idx in by_holder.items():
                info = self.membership.get(holder)
                if info is None:
                    for i in idx:
                        statuses[i] = LoadStatus.MISSING
                    continue
                batches.append((info, [items[i] for i in idx]))
                order.append(idx)
            fetched = self.transport.fetch_many(batches, verified)
            for (info, _), idx, results in zip(batches, order, fetched, strict=True):
                for i, st in zip(idx, results, strict=True):
                    statuses[i] = st
                if self.health is not None and all(st is LoadStatus.ERROR for st in results):
                    self.health.holder_failed(info.node_id)
            attempt += 1
            todo = [
                i for i in todo if statuses[i] is not LoadStatus.OK and attempt < len(choices[i])
            ]
        intact = {
            key: verified[key]
            for (key, _), st in zip(items, statuses, strict=True)
            if st is LoadStatus.OK and key in verified
        }
        return statuses, intact

    def loaded_and_committed(self, chunks: Sequence[tuple[bytes, bytes, int]]) -> None:
        """Chunks fetched from peers are in this node's pool now: this node is one more
        holder of them (readers spread over the holders; a chunk outlives its first one)."""
        self.publisher.publish_known(chunks)

    # -- this node's chunks ----------------------------------------------------------------
    def store(self, items: Sequence[tuple[bytes, memoryview]]) -> list[bool]:
        self.publisher.publish_local(items)
        return [True] * len(items)

    def delete(self, keys: Sequence[bytes]) -> int:
        return self.publisher.withdraw(keys)

    def usage(self) -> TierUsage:
        objects, nbytes = self.publisher.published_usage()
        return TierUsage(objects, nbytes, 0)

    def stats(self) -> dict[str, int]:
        return {"resolved": self.resolved, "found": self.found, "skipped": self.skipped}

    def copies(self) -> str:
        return (
            "store: none (publishes a directory entry; the holder's pool is the source); "
            "load: none on the reader (recv_into the reserved slot), none on the holder "
            "(sendmsg from its pool)"
        )


__all__ = ["NAME", "PeerTier", "Where"]
