"""The benchmark tooling's modules (``benchmarks/*.py``, run as scripts there) importable
by the tests of this directory."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
