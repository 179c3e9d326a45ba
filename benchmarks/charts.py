"""PNG charts of the benchmark figures: one per script, one panel per figure.

Each panel shows the figure's runs in run order (dots), the median of the last three (a
line across them), its goal (dashed) and its bound: the bound's own value per run where the
summary prints it, 1.0 for a ratio against its bound. Matplotlib's Agg canvas (no pyplot),
fixed sizes and no metadata that changes (no software version, no date), so that the same
data gives the same bytes.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure as Canvas

from aggregate import LAST_RUNS, runs_of, summarize
from figures import Figure
from results_file import Record

COLUMNS = 3
PANEL = (4.0, 2.8)  # inches
DPI = 80


def chart_name(script: str) -> str:
    return f"bench-{script.removesuffix('.py')}.png"


def render_script(figures: list[Figure], records: list[Record], path: Path) -> None:
    """One PNG of the figures (of one script) that have runs; none when none has."""
    with_runs = [f for f in figures if runs_of(f, records)]
    if not with_runs:
        return
    cols = min(COLUMNS, len(with_runs))
    rows = math.ceil(len(with_runs) / cols)
    with matplotlib.rc_context({"font.size": 8}):
        fig = Canvas(figsize=(PANEL[0] * cols, PANEL[1] * rows), dpi=DPI)
        FigureCanvasAgg(fig)
        axes = fig.subplots(rows, cols, squeeze=False)
        for ax, figure in zip(axes.flat, with_runs, strict=False):
            _panel(ax, figure, records)
        for ax in list(axes.flat)[len(with_runs) :]:
            ax.set_visible(False)
        fig.suptitle(with_runs[0].script, fontsize=10)
        fig.tight_layout()
        fig.savefig(path, format="png", metadata={"Software": None})


def _panel(ax: Axes, figure: Figure, records: list[Record]) -> None:
    runs = runs_of(figure, records)
    summary = summarize(figure, records)
    assert summary is not None
    xs = list(range(1, len(runs) + 1))
    ax.plot(xs, [r.value for r in runs], "o-", color="tab:blue", label=figure.title)
    last = xs[-LAST_RUNS:]
    ax.hlines(summary.median, last[0] - 0.2, last[-1] + 0.2, color="tab:blue", linewidth=3,
              alpha=0.4, label=f"median of last {len(last)}")  # fmt: skip
    bounds = [(x, r.bound) for x, r in zip(xs, runs, strict=True) if r.bound is not None]
    if bounds:
        ax.plot(*zip(*bounds, strict=True), "s", color="tab:gray", label="bound (same run)")
    elif figure.unit == "x" and figure.per is None:
        ax.axhline(1.0, color="tab:gray", linewidth=1, label="bound = 1")
    if figure.goal is not None:
        ax.axhline(figure.goal.value, color="tab:red", linestyle="--", linewidth=1,
                   label=f"goal {figure.goal}")  # fmt: skip
    ax.set_title(figure.title)
    ax.set_ylabel(figure.unit)
    ax.set_xlabel("run")
    ax.set_xticks(xs)
    ax.legend(fontsize=6, loc="best")
    ax.grid(True, alpha=0.3)
