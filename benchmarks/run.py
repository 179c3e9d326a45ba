"""Run one benchmark script and append its figures to the results file.

Usage: python benchmarks/run.py [--results PATH] [--command TEXT] SCRIPT [ARGS...]

Runs ``SCRIPT ARGS`` with this Python, passes its output through as it comes, parses the
summary lines it prints last (``summary_line.py``) and appends one record to the results
file (``benchmarks/results.jsonl`` by default; ``results_file.py``). A script that fails or
prints no summary line adds nothing; the runner then exits non-zero.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
from pathlib import Path

import results_file
import summary_line
from stop_signals import pass_on_stop_signals

ROOT = Path(__file__).resolve().parent.parent


def run(script: Path, args: list[str]) -> tuple[int, list[str]]:
    """Run the script, echoing its stdout line by line; its exit status and lines."""
    lines: list[str] = []
    with subprocess.Popen(
        [sys.executable, str(script), *args], stdout=subprocess.PIPE, text=True, bufsize=1
    ) as proc:
        pass_on_stop_signals(proc)  # a stopped run stops its script, which cleans up
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            lines.append(line.rstrip("\n"))
    return proc.returncode, lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=results_file.RESULTS)
    ap.add_argument("--command", help="how the run was started (default: the script and args)")
    ap.add_argument("script", type=Path)
    ap.add_argument("args", nargs=argparse.REMAINDER)
    ns = ap.parse_args(argv)
    started = datetime.datetime.now(datetime.timezone.utc)
    code, lines = run(ns.script, ns.args)
    if code != 0:
        print(f"run.py: {ns.script} exited with {code}; nothing recorded", file=sys.stderr)
        return code
    summary = summary_line.parse_output(lines, ns.script.stem)
    if not summary:
        print(f"run.py: {ns.script} printed no summary line; nothing recorded", file=sys.stderr)
        return 1
    record = {
        "script": ns.script.name,
        "time": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": results_file.git_commit(ROOT),
        "machine": results_file.machine(),
        "command": ns.command or " ".join(["python", str(ns.script), *ns.args]),
        "summary": summary,
    }
    results_file.append(record, ns.results)
    print(f"run.py: recorded in {ns.results}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
