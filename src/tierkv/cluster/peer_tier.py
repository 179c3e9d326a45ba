"""The peer tier: other servers' pools, as one more tier of the prefetch (named "peer").

``contains`` resolves keys through the directory (one batched round trip per owner) and
remembers where each found key lives for the ``load`` that follows; ``load`` fetches the
chunks from their holders straight into the reserved slots, every holder in parallel,
preferring a holder that has the chunk in its pool over one that must promote it from
disk, and trying the next holder of a chunk whose first holder failed. So the existing
LOOKUP / QUERY_PREFETCH flow serves remote chunks with no engine change; a chunk that is
gone is a miss that ends the prefix, never an error.

``store`` is how this node's own chunks become visible to the cluster: the write-behind
hands it every committed engine chunk (views of pinned pool slots); it records their
checksums and publishes them. Chunks this node fetched from a peer are published too, right
after their commit, with the checksums :meth:`take_verified` kept from their load (so a
chunk read on several nodes has several holders, readers spread over them, and it outlives
its first holder). ``delete`` withdraws them.
"""

from __future__ import annotations

import random
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tierkv.cluster.directory import Location, Where
from tierkv.tiers.base import LoadStatus, Tier, TierUsage

if TYPE_CHECKING:
    from tierkv.cluster.node import ClusterNode

NAME = "peer"
CACHE_ENTRIES = 65536
CACHE_SECONDS = 30.0


class PeerTier(Tier):
    name = NAME

    def __init__(self, node: ClusterNode) -> None:
        self.node = node
        self._where: OrderedDict[bytes, tuple[float, list[Location]]] = OrderedDict()
        self._lock = threading.Lock()
        self._local = threading.local()
        self.resolved = 0
        self.found = 0

    # -- lookups ---------------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        locations = self._resolve(keys)
        return [bool(locs) for locs in locations]

    def _resolve(self, keys: Sequence[bytes]) -> list[list[Location]]:
        me = self.node.node_id
        # Holders with the chunk in their pool first, then those that must promote it from
        # disk; within each, in an order drawn at random once per call (so readers spread
        # over the holders, while one call's chunks go to as few holders as possible).
        draw: dict[str, float] = {}

        def preference(loc: Location) -> tuple[int, float]:
            return int(loc.where), draw.setdefault(loc.holder, random.random())

        found = [
            sorted((loc for loc in locs if loc.holder != me), key=preference)
            for locs in self.node.directory.resolve(keys)
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
        # The checksums verified on arrival, for take_verified() after the commit; per
        # thread, replaced by each load, so they never outlive the load they came from.
        verified: dict[bytes, bytes] = {}
        self._local.verified = {}
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
                info = self.node.membership.get(holder)
                if info is None:
                    for i in idx:
                        statuses[i] = LoadStatus.MISSING
                    continue
                batches.append((info, [items[i] for i in idx]))
                order.append(idx)
            fetched = self.node.transport.fetch_many(batches, verified)
            for idx, results in zip(order, fetched, strict=True):
                for i, st in zip(idx, results, strict=True):
                    statuses[i] = st
            attempt += 1
            todo = [
                i for i in todo if statuses[i] is not LoadStatus.OK and attempt < len(choices[i])
            ]
        self._local.verified = {
            key: (verified[key], len(view))
            for (key, view), st in zip(items, statuses, strict=True)
            if st is LoadStatus.OK and key in verified
        }
        return statuses

    def take_verified(self, keys: Sequence[bytes]) -> list[tuple[bytes, bytes, int]]:
        """(key, checksum, length) of those of ``keys`` this thread's last :meth:`load`
        brought in intact (call it on the same thread, right after committing what that load
        brought in); forgets everything that load verified."""
        verified: dict[bytes, tuple[bytes, int]] = getattr(self._local, "verified", {})
        self._local.verified = {}
        return [(key, *verified[key]) for key in keys if key in verified]

    # -- this node's chunks ----------------------------------------------------------------
    def store(self, items: Sequence[tuple[bytes, memoryview]]) -> list[bool]:
        self.node.publish_local(items)
        return [True] * len(items)

    def delete(self, keys: Sequence[bytes]) -> int:
        return self.node.withdraw(keys)

    def usage(self) -> TierUsage:
        objects, nbytes = self.node.published_usage()
        return TierUsage(objects, nbytes, 0)

    def copies(self) -> str:
        return (
            "store: none (publishes a directory entry; the holder's pool is the source); "
            "load: none on the reader (recv_into the reserved slot), none on the holder "
            "(sendmsg from its pool)"
        )

    def close(self) -> None:
        self.node.close()


__all__ = ["NAME", "PeerTier", "Where"]
