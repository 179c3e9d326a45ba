"""A client's mapping of its server's shared-memory pool: mapped at registration, mapped
again when a registration names another segment (a restarted server recreates it, under the
same name too), with the engine's hook run on each mapping (``on_pool``: a GPU engine
page-locks it) and undone before the mapping closes."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from tierkv.pool import SHM_DIR, ShmPool

log = logging.getLogger(__name__)

OnPool = Callable[[ShmPool], Callable[[], None] | None]


class PoolMapping:
    """The pool mapped now (``pool``; None before a registration and after :meth:`close`)."""

    def __init__(self, populate: bool = False, on_pool: OnPool | None = None) -> None:
        self.populate = populate
        self.pool: ShmPool | None = None
        self._on_pool = on_pool
        self._undo: Callable[[], None] | None = None  # what on_pool returned
        self._segment: tuple[int, int] | None = None

    def map(self, name: str, size: int) -> ShmPool:
        """The pool a registration names: the one mapped if it is that segment still, else
        a new mapping of it (the old one closed)."""
        pool = self.pool
        if (
            pool is None
            or pool.name != name
            or pool.closed
            # The server restarted and recreated the segment under the same name.
            or segment_id(name) != self._segment
        ):
            self.close()
            pool = self.pool = ShmPool.attach(name, size, populate=self.populate)
            self._segment = segment_id(name)
            if self._on_pool is not None:
                self._undo = self._on_pool(pool)
        return pool

    def close(self) -> None:
        old, self.pool = self.pool, None
        undo, self._undo = self._undo, None
        if undo is not None:
            try:
                undo()
            except Exception:  # the mapping is closed either way
                log.exception("undoing on_pool before closing the pool mapping failed")
        if old is not None:
            old.close()


def segment_id(name: str) -> tuple[int, int] | None:
    """Identity (device, inode) of the segment a name refers to now, to notice that a
    restarted server recreated it under the same name."""
    try:
        st = os.stat(os.path.join(SHM_DIR, name.lstrip("/")))
    except OSError:
        return None
    return st.st_dev, st.st_ino
