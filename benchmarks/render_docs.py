"""Render the benchmark documentation from the results file.

Usage: python benchmarks/render_docs.py [--results PATH] [--out DIR] [--readme PATH]

Writes ``docs/benchmarks.md`` (the page's prose from ``benchmarks/page_template.md``, with
the table of every catalogued figure that has runs and the charts put in), the charts
``docs/img/bench-<script>.png`` (``charts.py``), and the README's compact table between the
lines ``<!-- benchmark-table:start -->`` and ``<!-- benchmark-table:end -->``. Each figure
is the median of its last three runs in the results file (``aggregate.py``). The same
results give the same bytes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import charts
import results_file
from aggregate import LAST_RUNS, Summary, summarize
from figures import FIGURES, SCRIPTS, Figure

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = Path(__file__).resolve().parent / "page_template.md"
START = "<!-- benchmark-table:start -->"
END = "<!-- benchmark-table:end -->"


class MarkersMissing(Exception):
    """The README lacks the benchmark table's start or end marker line."""


def number(value: float) -> str:
    """Three significant digits, no exponent: 0.487, 5.69, 42.1, 1219, 0.004."""
    if abs(value) >= 100:
        return f"{value:.0f}"
    text = f"{value:.3g}"
    return text if "e" not in text else f"{value:.6f}".rstrip("0")


def goal_text(figure: Figure) -> str:
    if figure.goal is None:
        return "none"
    return f"{figure.goal}" + ("" if figure.unit == "x" else f" {figure.unit}")


def met_text(summary: Summary) -> str:
    return {None: "no goal", True: "met", False: "not met"}[summary.met]


def median_text(summary: Summary) -> str:
    n = len(summary.runs)
    unit = "" if summary.figure.unit == "x" else f" {summary.figure.unit}"
    return number(summary.median) + unit + (f" (n={n})" if n < LAST_RUNS else "")


def summaries(records: list[results_file.Record]) -> list[Summary]:
    found = (summarize(f, records) for f in FIGURES)
    return [s for s in found if s is not None]


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def docs_table(items: list[Summary]) -> str:
    lines = [
        _row(["script", "figure", "measures", "median", "spread", "runs", "bound", "goal", "met"]),
        _row(["---"] * 9),
    ]
    for s in items:
        f = s.figure
        lines.append(
            _row(
                [
                    f"`{f.script}`",
                    f"`{f.title}`",
                    f.measures,
                    median_text(s),
                    f"{number(s.low)} to {number(s.high)}",
                    f"{len(s.runs)}, {s.dates}",
                    f.bound,
                    goal_text(f),
                    met_text(s),
                ]
            )
        )
    return "\n".join(lines)


def readme_table(items: list[Summary]) -> str:
    lines = [_row(["figure", "median of 3", "bound", "goal", "met"]), _row(["---"] * 5)]
    for s in items:
        f = s.figure
        name = f"`{f.script[:-3]}` `{f.title}`"
        lines.append(_row([name, median_text(s), f.bound, goal_text(f), met_text(s)]))
    return "\n".join(lines)


def chart_links(items: list[Summary]) -> str:
    have = {s.figure.script for s in items}
    return "\n\n".join(
        f"![{script}](img/{charts.chart_name(script)})" for script in SCRIPTS if script in have
    )


def page(items: list[Summary], template: str) -> str:
    return template.replace("{{table}}", docs_table(items)).replace(
        "{{charts}}", chart_links(items)
    )


def replace_between_markers(text: str, table: str) -> str:
    """``text`` with the lines between the marker lines replaced by ``table``."""
    lines = text.split("\n")
    try:
        start, end = lines.index(START), lines.index(END)
    except ValueError:
        raise MarkersMissing(f"the lines {START!r} and {END!r} are needed") from None
    if end < start:
        raise MarkersMissing(f"{END!r} comes before {START!r}")
    return "\n".join([*lines[: start + 1], table, *lines[end:]])


def render(records: list[results_file.Record], out: Path, readme: Path | None) -> None:
    """Write ``out/benchmarks.md`` and ``out/img/*.png``; update ``readme``'s table."""
    items = summaries(records)
    text = replace_between_markers(readme.read_text(), readme_table(items)) if readme else None
    (out / "img").mkdir(parents=True, exist_ok=True)
    (out / "benchmarks.md").write_text(page(items, TEMPLATE.read_text()))
    for script in SCRIPTS:
        figures = [f for f in FIGURES if f.script == script]
        charts.render_script(figures, records, out / "img" / charts.chart_name(script))
    if readme is not None and text is not None:
        readme.write_text(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=results_file.RESULTS)
    ap.add_argument("--out", type=Path, default=ROOT / "docs", help="the docs directory")
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md")
    ap.add_argument("--no-readme", action="store_true", help="leave the README alone")
    ns = ap.parse_args(argv)
    try:
        render(results_file.load(ns.results), ns.out, None if ns.no_readme else ns.readme)
    except MarkersMissing as e:
        print(f"render_docs.py: {ns.readme}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
