"""A tier kept in a dict, for what a real medium cannot be made to do on demand: raise,
report a chunk corrupt or missing, answer with the wrong number of results, or block until
the test lets it go. Used beside the real tiers, never instead of them."""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from tierkv.tiers.base import LoadStatus, Tier, TierUsage

CHUNK = 64 * 1024  # bytes per chunk (a multiple of the 4 KiB alignment)
WAIT = 15.0  # bound of every wait for an asynchronous effect
NAMESPACE = hashlib.blake2b(b"tier-controllers", digest_size=16).digest()


def key(i: int | str) -> bytes:
    return NAMESPACE + hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def payload(k: bytes, n: int = CHUNK) -> np.ndarray:
    """The deterministic bytes of chunk ``k``."""
    return np.random.default_rng(int.from_bytes(k[16:24], "little")).integers(
        0, 256, n, dtype=np.uint8
    )


# -- a tier for failure injection ----------------------------------------------------------
class MemTier(Tier):
    """Chunks in a dict, with knobs for failures and for blocking."""

    def __init__(self, name: str = "mem") -> None:
        self.name = name
        self.data: dict[bytes, bytes] = {}
        self.phantom: set[bytes] = set()  # contains() says yes, load() says MISSING
        self.load_status: dict[bytes, LoadStatus] = {}  # forced per-key load results
        self.store_ok: Callable[[bytes], bool] = lambda k: True
        self.raise_on_store = False
        self.raise_on_load = False
        self.short_answers = False  # answer one result fewer than asked (a broken tier)
        self.gate: threading.Event | None = None  # load/store block until it is set
        self.entered = threading.Event()  # set when a load or store starts
        self.loads: Counter[bytes] = Counter()
        self.stores: Counter[bytes] = Counter()
        self._lock = threading.Lock()

    def hold(self) -> threading.Event:
        """Make the next loads and stores block until the returned event is set."""
        self.gate = threading.Event()
        self.entered.clear()
        return self.gate

    def _enter(self) -> None:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(WAIT), "the test never released the tier"

    def put(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self.data[k] = payload(k).tobytes()

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [k in self.data or k in self.phantom for k in keys]

    def store(self, items: Sequence[tuple[bytes, memoryview]]) -> list[bool]:
        self._enter()
        if self.raise_on_store:
            raise OSError("injected store failure")
        out = []
        for k, view in items:
            ok = self.store_ok(k)
            if ok:
                with self._lock:
                    self.data[k] = bytes(view)
                    self.stores[k] += 1
            out.append(ok)
        return out[:-1] if self.short_answers else out

    def load(self, items: Sequence[tuple[bytes, memoryview]]) -> list[LoadStatus]:
        self._enter()
        if self.raise_on_load:
            raise ConnectionError("injected load failure")
        out = []
        for k, view in items:
            with self._lock:
                self.loads[k] += 1
            status = self.load_status.get(k)
            if status is None:
                status = LoadStatus.OK if k in self.data else LoadStatus.MISSING
            if status is LoadStatus.OK:
                view[:] = self.data[k]
            elif status is LoadStatus.CORRUPT:
                view[:] = b"\xee" * len(view)  # garbage in the slot must never be served
            out.append(status)
        return out[:-1] if self.short_answers else out

    def delete(self, keys: Sequence[bytes]) -> int:
        return sum(self.data.pop(k, None) is not None for k in keys)

    def usage(self) -> TierUsage:
        return TierUsage(len(self.data), sum(map(len, self.data.values())), 0)
