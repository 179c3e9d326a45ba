"""`tierkv demo --with-server --nodes 2`: node B's engines hit what node A's engines stored."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.processes
@pytest.mark.parametrize("directory", ["ring", "controller"])
def test_two_node_demo_prints_remote_hits(directory: str) -> None:
    cmd = [
        sys.executable, "-m", "tierkv.cli", "demo", "--with-server", "--nodes", "2",
        "--documents", "3", "--doc-tokens", "1500", "--engines", "2",
        "--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--pool-size", "64MiB",
        "--directory", directory,
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "===== node A =====" in done.stdout and "===== node B =====" in done.stdout
    match = re.search(r"node B's engines hit (\d+) chunks, (\d+) of them fetched", done.stdout)
    assert match, done.stdout
    hits, remote = int(match.group(1)), int(match.group(2))
    assert remote > 0 and hits >= remote
    assert "0 failures" in done.stdout and "FAILED" not in done.stdout
    stopped = "both servers and the controller" if directory == "controller" else "both servers"
    assert f"{stopped} stopped cleanly" in done.stdout


@pytest.mark.processes
def test_two_node_mode_needs_its_own_servers() -> None:
    cmd = [sys.executable, "-m", "tierkv.cli", "demo", "--nodes", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "--nodes 2 needs --with-server" in done.stderr


@pytest.mark.processes
def test_directory_needs_two_nodes() -> None:
    cmd = [sys.executable, "-m", "tierkv.cli", "demo", "--with-server", "--directory", "controller"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "--directory chooses the directory of --nodes 2" in done.stderr
