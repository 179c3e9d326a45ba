"""A lookup answer's columns (:mod:`tierkv.cluster.found_columns`): built from rows or per
holder, read back grouped by (holder, tier), with rows that point nowhere left out and
columns that are not whole rows refused."""

from __future__ import annotations

import random

import numpy as np

from tierkv.cluster import found_columns as fc

Row = tuple[int, int, int]


def grouped(columns: tuple[bytes, bytes, bytes], keys: int, holders: int) -> set[Row]:
    groups = fc.groups(*columns, keys, holders)
    assert groups is not None
    return {(int(p), h, t) for h, t, at in groups for p in at.tolist()}


def test_rows_come_back_grouped_whatever_their_order() -> None:
    rng = random.Random(5)
    rows = {(rng.randrange(512), rng.randrange(3), rng.randrange(2)) for _ in range(900)}
    shuffled = list(rows)
    rng.shuffle(shuffled)
    columns = fc.of_lists(*(list(col) for col in zip(*shuffled, strict=True)))
    assert grouped(columns, 512, 3) == rows
    groups = fc.groups(*columns, 512, 3)
    assert groups is not None
    assert len(groups) == len({(h, t) for _, h, t in rows})  # one group per (holder, tier)


def test_one_holder_one_tier_is_one_group() -> None:
    columns = fc.of_lists(list(range(512)), [0] * 512, [1] * 512)
    groups = fc.groups(*columns, 512, 1)
    assert groups is not None and len(groups) == 1
    h, t, at = groups[0]
    assert (h, t) == (0, 1) and at.tolist() == list(range(512))


def test_per_holder_arrays_make_the_same_columns_as_rows() -> None:
    a_pos, a_tiers = np.array([0, 3, 7]), np.array([0, 1, 0], np.int8)
    b_pos, b_tiers = np.array([3]), np.array([1], np.int8)
    columns = fc.of_arrays([(0, a_pos, a_tiers), (1, b_pos, b_tiers)])
    assert columns == fc.of_lists([0, 3, 7, 3], [0, 0, 0, 1], [0, 1, 0, 1])
    assert fc.of_arrays([]) == (b"", b"", b"")
    assert fc.groups(b"", b"", b"", 10, 0) == []


def test_rows_past_the_request_or_the_holders_are_left_out() -> None:
    columns = fc.of_lists([0, 1, 99, 2], [0, 5, 0, 1], [0, 0, 0, 1])
    assert grouped(columns, keys=3, holders=2) == {(0, 0, 0), (2, 1, 1)}
    assert grouped(fc.of_lists([5], [0], [0]), keys=3, holders=1) == set()


def test_columns_that_are_not_whole_rows_are_refused() -> None:
    positions, holder_of, tiers = fc.of_lists([0, 1], [0, 0], [0, 0])
    for broken in (
        (positions[:-1], holder_of, tiers),
        (positions, holder_of[:-1], tiers),
        (positions, holder_of, tiers[:-1]),
        (positions + bytes(4), holder_of, tiers),
        (b"\x00" * 3, b"\x00", b""),
    ):
        assert fc.groups(*broken, 10, 1) is None, broken
