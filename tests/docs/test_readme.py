"""The README stays a short overview: under 10 KB, the two commands first, the compact
benchmark table between the markers its generator rewrites; the user documentation points
to no internal log."""

from __future__ import annotations

import re

from support.docs_site import ROOT

README = ROOT / "README.md"
START, END = "<!-- benchmark-table:start -->", "<!-- benchmark-table:end -->"


def test_readme_is_short() -> None:
    assert len(README.read_bytes()) <= 10 * 1024


def test_readme_opens_with_the_two_commands() -> None:
    text = README.read_text()
    demo = "make demo   # creates .venv, installs tierkv, starts a server, runs a Long-Doc-QA demo"
    test = "make test   # creates .venv, installs everything the tests need, lint + types + all"
    assert text.startswith("# tierkv\n")
    assert demo in text and test in text
    assert text.index(demo) < text.index("## ")


def test_benchmark_table_sits_between_its_markers() -> None:
    text = README.read_text()
    assert text.count(START) == 1 and text.count(END) == 1
    table = text[text.index(START) + len(START) : text.index(END)].strip().splitlines()
    assert len(table) > 2 and set(table[1]) <= set("|-: ")  # a header, its rule, rows
    assert all(line.startswith("|") and line.endswith("|") for line in table)


def test_user_docs_link_no_internal_log() -> None:
    for page in [README, *sorted((ROOT / "docs").rglob("*.md"))]:
        text = page.read_text()
        assert "HISTORY.md" not in text, page
        assert not re.search(r"\b(this|that|the previous|the next) session\b", text, re.I), page
