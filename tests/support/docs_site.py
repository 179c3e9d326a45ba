"""The documentation site for the docs tests: built in-process by MkDocs into a directory of
the test's (the same ``mkdocs.yml``, strict, as ``make docs``), and read back: the tables of
a built page, the Mermaid diagrams of a page, rendered in headless Chromium.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

from support.browser import run_chromium

ROOT = Path(__file__).resolve().parents[2]
MERMAID = Path("assets/vendor/mermaid.min.js")  # in docs/ and in the built site

# Opened in each page before anything else: Material attaches each rendered diagram to a
# closed shadow root; this opens them and marks each diagram's host with what it became
# (the SVG's aria-roledescription: "flowchart-v2", "sequence", ..., "error").
PROBE = """
(function () {
  var attach = Element.prototype.attachShadow;
  Element.prototype.attachShadow = function (init) {
    return attach.call(this, Object.assign({}, init, { mode: "open" }));
  };
  setInterval(function () {
    document.querySelectorAll("div.mermaid").forEach(function (host) {
      var svg = host.shadowRoot && host.shadowRoot.querySelector("svg");
      if (svg) host.setAttribute("data-probe", svg.getAttribute("aria-roledescription") || "svg");
    });
  }, 100);
})();
"""


def build_site(site_dir: Path) -> Path:
    """Build the documentation into ``site_dir`` as ``make docs`` does (strict: a warning,
    such as a broken link or a page missing from the nav, raises)."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    config = load_config(str(ROOT / "mkdocs.yml"), site_dir=str(site_dir), strict=True)
    build(config)
    return site_dir


class Tables(HTMLParser):
    """Every table of a page as (the h2 heading above it, its body rows of cell texts)."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[tuple[str, list[list[str]]]] = []
        self._heading: list[str] | None = None
        self._h2 = ""
        self._row: list[str] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "h2":
            self._heading = []
        elif tag == "table":
            self.tables.append((self._h2, []))
        elif tag == "tr":
            self._row = []
        elif tag == "td" and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "h2" and self._heading is not None:
            self._h2 = "".join(self._heading).replace("¶", "").strip()
            self._heading = None
        elif tag == "td" and self._cell is not None and self._row is not None:
            self._row.append(" ".join("".join(self._cell).split()))
            self._cell = None
        elif tag == "tr" and self._row is not None:
            if self._row:  # header rows have th cells only
                self.tables[-1][1].append(self._row)
            self._row = None

    def handle_data(self, data: str) -> None:
        if self._heading is not None:
            self._heading.append(data)
        if self._cell is not None:
            self._cell.append(data)


def tables(page: Path) -> list[tuple[str, list[list[str]]]]:
    parser = Tables()
    parser.feed(page.read_text())
    return parser.tables


def diagram_count(page: Path) -> int:
    """The Mermaid diagrams a built page holds (before its scripts render them)."""
    return len(re.findall(r'<pre class="mermaid"', page.read_text()))


def rendered_diagrams(site: Path, page: Path, profile: Path) -> list[str]:
    """What each diagram of ``page`` became in headless Chromium with every network name
    unresolvable (so only what the site ships can render them), in page order."""
    probed = page.with_name(f"probed-{page.name}")
    (site / "probe.js").write_text(PROBE)
    prefix = "../" * (len(page.relative_to(site).parts) - 1)
    html = page.read_text().replace("<head>", f'<head><script src="{prefix}probe.js"></script>', 1)
    probed.write_text(html)
    done = run_chromium(
        profile, probed.as_uri(), "--dump-dom", "--host-resolver-rules=MAP * ~NOTFOUND"
    )
    return re.findall(r'<div class="mermaid" data-probe="([^"]*)"', done.stdout)
