"""benchmarks/render_docs.py: the README's table between its markers, the same bytes from
the same results, every catalogued figure with runs in the tables, and the committed
docs/benchmarks.md and charts up to date with benchmarks/results.jsonl."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("matplotlib")  # the docs extra (make test installs it)

import charts
import render_docs
import results_file
from render_docs import END, START, MarkersMissing, replace_between_markers

ROOT = Path(__file__).resolve().parents[2]
OURS = ("benchmarks.md", "img/bench-")  # docs/ holds other pages too
README = f"# x\n\nbefore\n{START}\n| old | table |\n{END}\nafter\n"


def render_into(tmp: Path, records: list[results_file.Record]) -> tuple[Path, Path]:
    out, readme = tmp / "docs", tmp / "README.md"
    tmp.mkdir(parents=True, exist_ok=True)
    readme.write_text(README)
    render_docs.render(records, out, readme)
    return out, readme


def files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_replace_between_markers() -> None:
    text = replace_between_markers(README, "| new |")
    assert text == f"# x\n\nbefore\n{START}\n| new |\n{END}\nafter\n"
    assert replace_between_markers(text, "| new |") == text


@pytest.mark.parametrize(
    "text", ["# x\n| t |\n", f"# x\n{START}\n| t |\n", f"{END}\n| t |\n{START}\n"]
)
def test_markers_missing_fail_before_writing(tmp_path: Path, text: str) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(text)
    with pytest.raises(MarkersMissing):
        render_docs.render(results_file.load(), tmp_path / "docs", readme)
    assert readme.read_text() == text
    assert not (tmp_path / "docs").exists()
    assert render_docs.main(["--out", str(tmp_path / "d"), "--readme", str(readme)]) == 1


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The committed results rendered once (docs directory, README with the table)."""
    return render_into(tmp_path_factory.mktemp("rendered"), results_file.load())


def test_same_results_same_bytes(tmp_path: Path, rendered: tuple[Path, Path]) -> None:
    again, readme = render_into(tmp_path, results_file.load())
    assert files(again) == files(rendered[0])
    assert readme.read_text() == rendered[1].read_text()
    assert any(name.endswith(".png") for name in files(again))


def test_every_figure_with_runs_is_in_the_tables(rendered: tuple[Path, Path]) -> None:
    items = render_docs.summaries(results_file.load())
    assert items, "the results file has runs"
    out, readme = rendered
    page, table = (out / "benchmarks.md").read_text(), readme.read_text()
    for s in items:
        f = s.figure
        assert f"| `{f.script}` | `{f.title}` |" in page
        assert f"| `{f.script[:-3]}` `{f.title}` | {render_docs.median_text(s)} |" in table
        assert f"img/{charts.chart_name(f.script)}" in page
    assert page.count("\n| `") == table.count("\n| `") == len(items)


def test_median_cell_says_n_below_three() -> None:
    record = {"script": "hashing.py", "time": "2026-11-28", "summary": {}}
    record["summary"] = {"hashing": {"hash_128k_tokens_ms": 0.5}}
    (s,) = render_docs.summaries([record])
    assert render_docs.median_text(s) == "0.5 ms (n=1)"
    assert render_docs.number(1219.0) == "1219" and render_docs.number(0.004) == "0.004"


def test_committed_docs_are_up_to_date(rendered: tuple[Path, Path]) -> None:
    fresh = files(rendered[0])
    committed = {n: b for n, b in files(ROOT / "docs").items() if n.startswith(OURS)}
    stale = sorted(n for n in fresh.keys() | committed.keys() if fresh.get(n) != committed.get(n))
    assert not stale, f"run `make bench-docs` (stale or missing: {stale})"
    readme = (ROOT / "README.md").read_text()
    table = render_docs.readme_table(render_docs.summaries(results_file.load()))
    assert render_docs.replace_between_markers(readme, table) == readme, (
        "run `make bench-docs` (the README's benchmark table is stale)"
    )


@pytest.mark.parametrize("word", ["session", "eleventh", "today we"])
def test_page_is_written_for_users(word: str) -> None:
    assert word not in render_docs.TEMPLATE.read_text().lower()


def test_repository_readme_has_the_markers() -> None:
    text = (ROOT / "README.md").read_text()
    assert replace_between_markers(text, "| t |").count("| t |") == 1
