"""Which processes run below a given one, read from /proc (Linux): for tests that check a
process's children were started, and stopped, and for tearing a process tree down."""

from __future__ import annotations

import os
from pathlib import Path


def parents() -> dict[int, int]:
    """Every process's parent: pid -> ppid (a process gone while reading is left out)."""
    found: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # The command name (in parentheses) may hold spaces: the fields follow its ")".
        found[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return found


def children(pid: int) -> set[int]:
    """The processes whose parent is ``pid``."""
    return {child for child, parent in parents().items() if parent == pid}


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children, theirs, ...), parents before their children."""
    below: dict[int, list[int]] = {}
    for child, parent in parents().items():
        below.setdefault(parent, []).append(child)
    found: list[int] = []
    todo = [pid]
    while todo:
        more = below.get(todo.pop(0), [])
        found += more
        todo += more
    return found
