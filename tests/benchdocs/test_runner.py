"""benchmarks/run.py with trivial scripts: the output passes through, the summary lines
become one record in the results file given, and a failed or summary-less run adds none."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # the runner starts the script

RUN = Path(__file__).resolve().parents[2] / "benchmarks" / "run.py"


def run(tmp_path: Path, body: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    script = tmp_path / "trivial.py"
    script.write_text(body)
    results = tmp_path / "results.jsonl"
    proc = subprocess.run(
        [sys.executable, str(RUN), "--results", str(results), str(script), "--flag", "2"],
        capture_output=True,
        text=True,
        check=False,
    )
    return proc, results


def test_records_the_summary(tmp_path: Path) -> None:
    proc, results = run(
        tmp_path,
        "import sys\nprint('a table', sys.argv[1:])\nprint('floor p99_ms=4.5')\n"
        "print('trivial ratio=0.91 kind=tcp')\n",
    )
    assert proc.returncode == 0, proc.stderr
    assert "a table ['--flag', '2']" in proc.stdout  # streamed through, args passed
    (record,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert record["script"] == "trivial.py"
    assert record["summary"] == {
        "floor": {"p99_ms": 4.5},
        "trivial": {"ratio": 0.91, "kind": "tcp"},
    }
    assert record["time"].endswith("Z") and record["machine"]["cores"] >= 1
    assert record["machine"]["vector"] in ("amx_tile", "avx512f", "avx2", "none")
    assert record["command"].endswith("trivial.py --flag 2")
    assert "commit" in record


@pytest.mark.parametrize(
    ("body", "code"),
    [("print('no summary here')\n", 1), ("print('x k=1')\nraise SystemExit(3)\n", 3)],
)
def test_nothing_recorded(tmp_path: Path, body: str, code: int) -> None:
    proc, results = run(tmp_path, body)
    assert proc.returncode == code
    assert "nothing recorded" in proc.stderr
    assert not results.exists()
