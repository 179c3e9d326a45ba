"""deploy/README.md names every file of the operations kit and the version line that
`tierkv --version` prints."""

from __future__ import annotations

from support.deploy_kit import DEPLOY
from tierkv.cli import VERSION

README = DEPLOY / "README.md"


def test_the_readme_names_every_file() -> None:
    text = README.read_text()
    files = [p.relative_to(DEPLOY).as_posix() for p in DEPLOY.rglob("*") if p.is_file()]
    assert sorted(f for f in files if f != "README.md" and f"`{f}`" not in text) == []


def test_the_readme_gives_the_version_line() -> None:
    assert f"`{VERSION}`" in README.read_text()
