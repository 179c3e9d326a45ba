"""The figures' summaries: the median of the last three runs, their spread, and the goal
met or not for each comparator."""

from __future__ import annotations

from typing import Any

import pytest

from aggregate import runs_of, summarize
from figures import FIGURES, Figure, Goal

FIG = Figure("s.py", "s", "k", "ms", "a thing", "a bound", Goal("<=", 5))


def rec(value: Any, script: str = "s.py", time: str = "2026-11-28", **more: Any) -> dict[str, Any]:
    return {"script": script, "time": time, "summary": {"s": {"k": value, **more}}}


def test_median_of_the_last_three_and_their_spread() -> None:
    records = [rec(100), rec(1), rec(9), rec(4), rec(2, script="other.py")]
    s = summarize(FIG, records)
    assert s is not None
    assert [r.value for r in s.runs] == [1, 9, 4]  # 100 is older than the last three
    assert (s.median, s.low, s.high) == (4, 1, 9)
    assert s.met is True


def test_fewer_runs_than_three() -> None:
    s = summarize(FIG, [rec(6), rec(8, time="2026-11-29T10:00:00Z")])
    assert s is not None and len(s.runs) == 2
    assert s.median == 7 and s.met is False
    assert s.dates == "2026-11-28 to 2026-11-29"
    assert summarize(FIG, [rec(None), {"script": "s.py", "summary": {}}]) is None


@pytest.mark.parametrize(
    ("comparator", "value", "met"),
    [
        (">=", 0.8, True),
        (">=", 0.81, False),
        ("<=", 0.8, True),
        ("<=", 0.79, False),
        ("<", 0.8, False),
        ("<", 0.81, True),
        ("==", 0.8, True),
        ("==", 1.0, False),
    ],
)
def test_goal_comparators(comparator: str, value: float, met: bool) -> None:
    assert Goal(comparator, value).met(0.8) is met
    fig = Figure("s.py", "s", "k", "x", "a", "b", Goal(comparator, value))
    s = summarize(fig, [rec(0.7), rec(0.8), rec(0.9)])
    assert s is not None and s.met is met


def test_no_goal_and_unknown_comparator() -> None:
    s = summarize(Figure("s.py", "s", "k", "x", "a", "b"), [rec(1)])
    assert s is not None and s.met is None
    with pytest.raises(ValueError):
        Goal("=>", 1)


def test_ratio_of_two_values_and_bound_values() -> None:
    fig = Figure("s.py", "s", "k", "x", "a", "b", per=("s", "of"), bound_key=("s", "bound"))
    runs = runs_of(fig, [rec(0.5, of=1.0, bound=2), rec(0.6, of=0.0), rec(0.3, of=0.6)])
    assert [(r.value, r.bound) for r in runs] == [(0.5, 2.0), (0.5, None)]  # 0.0: skipped


def test_catalogue_ids_are_unique() -> None:
    ids = [f.figure_id for f in FIGURES]
    assert len(ids) == len(set(ids))
