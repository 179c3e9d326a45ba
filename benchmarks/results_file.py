"""The benchmark results file: one JSON object per benchmark run, one per line.

A record holds the script (``hashing.py``), the UTC time, the git commit, the machine
(cores, memory, CPU model), the command, the parsed summary lines (``summary``:
name -> key -> value, see ``summary_line.py``) and, for figures copied from an earlier
document, their ``source``. ``make bench`` appends to ``benchmarks/results.jsonl`` through
``benchmarks/run.py``; ``benchmarks/render_docs.py`` reads it. Standard library only (the
SGLang venv runs it too).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results.jsonl"

Record = dict[str, Any]


def load(path: Path = RESULTS) -> list[Record]:
    """The records in file order (run order); an absent file has none."""
    if not path.exists():
        return []
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def append(record: Record, path: Path = RESULTS) -> None:
    """Append one record as one line (keys in the order given)."""
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")


# The widest vector extension first: VMs sold as one type come with CPUs that differ in it
# (an AVX2-only AMD EPYC, one with AVX-512, an Intel Xeon with AMX tiles), and figures that
# copy or hash bytes, or run vLLM on the CPU, follow it.
VECTOR_FLAGS = ("amx_tile", "avx512f", "avx2")


def machine() -> dict[str, Any]:
    """This machine: usable cores, memory (GiB), CPU model, its widest vector extension
    (``vector``: one of :data:`VECTOR_FLAGS` or ``"none"``), kernel."""
    model = vector = memory_gib = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model is None:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and vector is None:
                flags = set(line.split(":", 1)[1].split())
                vector = next((f for f in VECTOR_FLAGS if f in flags), "none")
            if model is not None and vector is not None:
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_gib = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cores": cores,
        "memory_gib": memory_gib,
        "cpu": model or platform.processor() or platform.machine(),
        "vector": vector,
        "kernel": platform.release(),
    }


def git_commit(repo: Path) -> str | None:
    """HEAD's commit, with ``+dirty`` when tracked sources differ from it; None outside git."""

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, check=False
        )

    head = git("rev-parse", "HEAD")
    if head.returncode != 0:
        return None
    dirty = git("diff", "--quiet", "HEAD", "--", "src", "benchmarks", ":!benchmarks/results.jsonl")
    return head.stdout.strip() + ("+dirty" if dirty.returncode == 1 else "")
