"""Headless Chromium for the dashboard tests: run it on a page, parse the figures it shows.

Chromium is the Debian ``chromium`` package, installed by scripts/ensure-system-deps.sh
(``make test``).
"""

from __future__ import annotations

import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError("chromium is not installed: run scripts/ensure-system-deps.sh (make test)")


def run_chromium(profile: Path, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        "--hide-scrollbars",
        "--force-device-scale-factor=1",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=5000",  # the page polls every (virtual) second
        "--window-size=1400,1000",
        *args,
        url,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def screenshot(profile: Path, url: str, shot: Path, min_bytes: int) -> None:
    """Save a PNG of the page at ``url`` to ``shot``; check it is one, of some substance."""
    shot.parent.mkdir(exist_ok=True)
    shot.unlink(missing_ok=True)
    run_chromium(profile, url, f"--screenshot={shot}")
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > min_bytes


class Figures(HTMLParser):
    """Every element's id -> data-value, plus the rows that identify tiers and engines."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, str] = {}
        self.ids: set[str] = set()
        self.namespaces: list[str] = []
        self.data: dict[str, list[str]] = {}  # every data-* attribute's values, in order
        self.polls = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if "id" in a:
            self.ids.add(a["id"])
            if "data-value" in a:
                self.values[a["id"]] = a["data-value"]
        if "data-namespace" in a:
            self.namespaces.append(a["data-namespace"])
        for k, v in a.items():
            if k.startswith("data-"):
                self.data.setdefault(k[5:], []).append(v)
        if tag == "body":
            self.polls = int(a.get("data-polls", "0"))

    def num(self, element: str) -> float:
        return float(self.values[element])
