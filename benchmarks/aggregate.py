"""Per figure of the catalogue: its values in the results file and their summary.

A figure's runs are the records of its script that hold it, in file (run) order; the table
shows the median of the last three (fewer where fewer exist), their spread (min to max) and
whether the median meets the figure's goal.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from figures import Figure

LAST_RUNS = 3


@dataclass(frozen=True)
class Run:
    value: float
    date: str  # the record's day, YYYY-MM-DD
    bound: float | None  # the bound's value in the same run, if the catalogue names it


@dataclass(frozen=True)
class Summary:
    figure: Figure
    runs: tuple[Run, ...]  # the last LAST_RUNS at most, in run order
    median: float
    low: float
    high: float
    met: bool | None  # None: the figure has no goal

    @property
    def dates(self) -> str:
        days = sorted({r.date for r in self.runs})
        return days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}"


def _number(record: dict[str, Any], where: tuple[str, str]) -> float | None:
    value = record.get("summary", {}).get(where[0], {}).get(where[1])
    return float(value) if isinstance(value, int | float) else None


def runs_of(figure: Figure, records: list[dict[str, Any]]) -> list[Run]:
    """Every run of the figure, in record order."""
    runs = []
    for record in records:
        if record.get("script") != figure.script:
            continue
        value = _number(record, (figure.line, figure.key))
        if value is None:
            continue
        if figure.per is not None:
            per = _number(record, figure.per)
            if not per:
                continue
            value /= per
        bound = _number(record, figure.bound_key) if figure.bound_key else None
        runs.append(Run(value, str(record.get("time", ""))[:10], bound))
    return runs


def summarize(figure: Figure, records: list[dict[str, Any]]) -> Summary | None:
    """The figure's last runs summarized, or None when no record holds it."""
    runs = runs_of(figure, records)[-LAST_RUNS:]
    if not runs:
        return None
    values = [r.value for r in runs]
    median = statistics.median(values)
    met = figure.goal.met(median) if figure.goal else None
    return Summary(figure, tuple(runs), median, min(values), max(values), met)
