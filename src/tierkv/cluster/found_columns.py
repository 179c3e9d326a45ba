"""A directory lookup's answer as three columns: one row per (key, holder) found.

The answers to ``Resolve`` (:class:`~tierkv.cluster.messages.Resolved` from a ring owner,
:class:`~tierkv.cluster.controller_messages.Located` from the controller) carry the rows as
three byte strings: ``positions`` (uint32, the key's position in the request), ``holder_of``
(uint16, an index into the answer's holders) and ``tiers`` (uint8, the
:class:`~tierkv.cluster.directory.Where` code), little-endian. Decoding them costs nothing
per key (the list of 512 ``(position, holder, tier)`` tuples they replace cost 57 us to
decode on the CI machine type), and :func:`groups` hands the reader the rows grouped by
(holder, tier) as arrays, so that it builds one location per group instead of one Python
step per row.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

POSITION = np.dtype("<u4")
HOLDER = np.dtype("<u2")
TIER = np.dtype("u1")
MAX_HOLDERS = 1 << 16


def of_lists(
    positions: list[int], holder_of: list[int], tiers: list[int]
) -> tuple[bytes, bytes, bytes]:
    """The columns of rows given as three lists of ints."""
    cols = (array("I", positions), array("H", holder_of), array("B", tiers))
    if sys.byteorder == "big":
        for col in cols:
            col.byteswap()
    return cols[0].tobytes(), cols[1].tobytes(), cols[2].tobytes()


def of_arrays(
    parts: Sequence[tuple[int, npt.NDArray[Any], npt.NDArray[Any]]],
) -> tuple[bytes, bytes, bytes]:
    """The columns of ``(holder index, positions, tiers)`` parts, one per holder."""
    if not parts:
        return b"", b"", b""
    positions = np.concatenate([p for _, p, _ in parts]).astype(POSITION)
    holder_of = np.concatenate([np.full(len(p), h, HOLDER) for h, p, _ in parts])
    tiers = np.concatenate([t for _, _, t in parts]).astype(TIER)
    return positions.tobytes(), holder_of.tobytes(), tiers.tobytes()


def groups(
    positions: bytes, holder_of: bytes, tiers: bytes, keys: int, holders: int
) -> list[tuple[int, int, npt.NDArray[np.intp]]] | None:
    """The rows grouped by (holder index, tier): ``[(holder, tier, positions)]``. Rows that
    point past the request's ``keys`` or the answer's ``holders`` are left out; None when
    the columns are not whole rows (a malformed answer: nothing in it is used)."""
    if len(positions) % POSITION.itemsize or len(holder_of) % HOLDER.itemsize:
        return None
    pos = np.frombuffer(positions, POSITION)
    hold = np.frombuffer(holder_of, HOLDER)
    tier = np.frombuffer(tiers, TIER)
    if not len(pos) == len(hold) == len(tier):
        return None
    if not len(pos):
        return []
    code = hold.astype(np.int64) * 256 + tier
    ok = (pos < keys) & (hold < holders)
    if not ok.all():
        pos, code = pos[ok], code[ok]
    first = int(code[0]) if len(code) else 0
    if len(code) and (code == first).all():  # the usual answer: one holder, one tier
        return [(first >> 8, first & 255, pos.astype(np.intp))]
    uniq, inverse = np.unique(code, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    bounds = np.searchsorted(inverse[order], np.arange(len(uniq) + 1))
    sorted_pos = pos[order].astype(np.intp)
    return [
        (int(c) >> 8, int(c) & 255, sorted_pos[bounds[i] : bounds[i + 1]])
        for i, c in enumerate(uniq.tolist())
    ]
