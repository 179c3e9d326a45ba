"""The documentation site: every page loads only what the site ships (no CDN when it is
viewed), and every Mermaid diagram renders to an SVG in headless Chromium with the network
unreachable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support.docs_site import MERMAID, ROOT, diagram_count, rendered_diagrams

# Where a page would load something from another host.
EXTERNAL = re.compile(
    r"""<script[^>]*\ssrc=["'](?:https?:)?//"""
    r"""|<link[^>]*\shref=["'](?:https?:)?//[^"']*["'][^>]*>"""
    r"""|<img[^>]*\ssrc=["'](?:https?:)?//"""
    r"""|@import\s+url\(["']?(?:https?:)?//""",
    re.IGNORECASE,
)
CDN = re.compile(r"unpkg\.com|jsdelivr|cdnjs|googleapis|gstatic", re.IGNORECASE)


def pages(site: Path) -> list[Path]:
    return sorted(p for p in site.rglob("*.html") if not p.name.startswith("probed-"))


def loaded_from_elsewhere(html: str) -> list[str]:
    """The tags of ``html`` that load a script, stylesheet, image or font from another host
    (links a reader may follow are not loads)."""
    found = [m.group(0) for m in EXTERNAL.finditer(html)]
    return [tag for tag in found if not tag.lower().startswith("<link") or _loads(tag)]


def _loads(link: str) -> bool:
    rel = re.search(r"""rel=["']([^"']*)""", link, re.IGNORECASE)
    return bool(rel) and rel.group(1).lower() in ("stylesheet", "preload", "preconnect", "icon")


def test_pages_load_nothing_from_other_hosts(site: Path) -> None:
    for page in pages(site):
        html = page.read_text()
        assert loaded_from_elsewhere(html) == [], page
        assert not CDN.search(html), page
    for sheet in site.rglob("*.css"):
        assert not EXTERNAL.search(sheet.read_text()), sheet


def test_the_checks_notice_a_cdn_script() -> None:
    html = '<head><script src="https://unpkg.com/mermaid@11/dist/mermaid.min.js"></script>'
    assert loaded_from_elsewhere(html) != []
    styled = '<link rel="stylesheet" href="https://fonts.googleapis.com/css?family=Roboto">'
    assert loaded_from_elsewhere(styled) != []
    assert loaded_from_elsewhere('<a href="https://example.com/">a link</a>') == []


def test_every_page_with_a_diagram_ships_mermaid(site: Path) -> None:
    shipped = site / MERMAID
    assert shipped.exists(), f"{shipped} missing: run `make docs` (scripts/fetch-mermaid.sh)"
    with_diagrams = [p for p in pages(site) if diagram_count(p)]
    assert {p.stem for p in with_diagrams} >= {"architecture", "cluster", "prefill-decode"}
    for page in with_diagrams:
        assert f'src="{MERMAID}"' in page.read_text(), page


def test_readme_diagrams_are_on_the_site() -> None:
    """The README's diagram is rendered by GitHub; the same block on the site's home page
    is rendered (and so checked) by the test below."""
    block = re.compile(r"```mermaid\n(.*?)```", re.DOTALL)
    readme = block.findall((ROOT / "README.md").read_text())
    assert readme
    home = block.findall((ROOT / "docs" / "index.md").read_text())
    assert set(readme) <= set(home)


@pytest.mark.processes  # headless Chromium
def test_every_diagram_renders_offline(site: Path, tmp_path: Path) -> None:
    with_diagrams = [p for p in pages(site) if diagram_count(p)]
    assert len(with_diagrams) >= 4
    for page in with_diagrams:
        rendered = rendered_diagrams(site, page, tmp_path / "profile")
        assert len(rendered) == diagram_count(page), (page, rendered)
        assert "error" not in rendered, (page, rendered)
