"""A consistent-hash ring with virtual nodes: which members own each key's directory entry.

Every member is placed on a 64-bit ring at ``vnodes`` points (blake2b of ``node_id#i``). A
key's point is taken from the key itself (keys are already uniform hashes: the first eight
bytes of the namespace digest xor the first eight of the chunk hash, so chunk hashes that
repeat across namespaces still spread), and its owners are the first ``replicas`` distinct
members found walking clockwise from it. Every node builds the same ring from the same
member list, so writers and readers agree on the owners without asking anyone.

Adding or removing a member moves only the keys whose owner set contains it (about
``replicas / members`` of them). A ring is immutable; membership changes build a new one.
Batch lookups use numpy (one ``searchsorted`` for a whole prefix of keys).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

DEFAULT_VNODES = 160


def point(name: str) -> int:
    """Ring position of a virtual node."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def key_points(keys: Sequence[bytes]) -> npt.NDArray[np.uint64]:
    """Ring positions of 32-byte keys (vectorised)."""
    if not keys:
        return np.zeros(0, dtype=np.uint64)
    raw = np.frombuffer(b"".join(keys), dtype="<u8")
    if raw.size != 4 * len(keys):
        raise ValueError("ring keys must be 32 bytes")
    words = raw.reshape(len(keys), 4)
    return np.asarray(words[:, 0] ^ words[:, 2], dtype=np.uint64)


class Ring:
    """An immutable ring over a set of member ids."""

    def __init__(self, members: Iterable[str], vnodes: int = DEFAULT_VNODES, replicas: int = 2):
        if vnodes < 1 or replicas < 1:
            raise ValueError("vnodes and replicas must be at least 1")
        self.members: tuple[str, ...] = tuple(sorted(set(members)))
        self.vnodes = vnodes
        self.replicas = min(replicas, len(self.members)) if self.members else 0
        placed = sorted(
            (point(f"{member}#{i}"), member) for member in self.members for i in range(vnodes)
        )
        self._points = np.array([p for p, _ in placed], dtype=np.uint64)
        # For each virtual node: the owner tuple of the arc ending at it, precomputed once.
        n = len(placed)
        owners: list[tuple[str, ...]] = []
        for start in range(n):
            found: list[str] = []
            j = start
            while len(found) < self.replicas:
                member = placed[j % n][1]
                if member not in found:
                    found.append(member)
                j += 1
            owners.append(tuple(found))
        self._owners = owners
        # The distinct owner tuples, and for each arc the index of its own among them: a
        # batch lookup groups keys by owners with numpy, not key by key.
        ids: dict[tuple[str, ...], int] = {}
        self._set_of_arc = np.array([ids.setdefault(o, len(ids)) for o in owners], np.intp)
        self.owner_sets: list[tuple[str, ...]] = list(ids)

    def __len__(self) -> int:
        return len(self.members)

    def __contains__(self, member: object) -> bool:
        return member in self.members

    def owners(self, key: bytes) -> tuple[str, ...]:
        """The members owning ``key``'s entry, primary first (empty if the ring is empty)."""
        return self.owners_many([key])[0] if self.members else ()

    def owners_many(self, keys: Sequence[bytes]) -> list[tuple[str, ...]]:
        """Owners of each key, in one vectorised pass."""
        if not self.members:
            return [()] * len(keys)
        owners = self._owners
        return [owners[i] for i in self.arcs(keys).tolist()]

    def arcs(self, keys: Sequence[bytes]) -> npt.NDArray[np.intp]:
        """The arc of each key: its index into :attr:`arc_owners` (a non-empty ring)."""
        pos = np.searchsorted(self._points, key_points(keys), side="left")
        pos[pos == len(self._points)] = 0
        return np.asarray(pos, dtype=np.intp)

    def owner_set_ids(self, keys: Sequence[bytes]) -> npt.NDArray[np.intp]:
        """Each key's owners as an index into :attr:`owner_sets` (a non-empty ring)."""
        return self._set_of_arc[self.arcs(keys)]

    @property
    def arc_owners(self) -> list[tuple[str, ...]]:
        """The owners of the keys of each arc (see :meth:`arcs`)."""
        return self._owners
