"""Cores kept busy by other processes while a benchmark measures: the noisier machine whose
figures must still meet their goals with margin.

``--busy-cores N`` (:func:`add_option`) starts N processes that spin in Python (``while
True: pass``) at the default priority for the whole measurement (:func:`kept_busy`), as
another tenant of the node would. The summary line of such a run is named
``<name>_busy`` (:func:`line_name`): a record of it in ``results.jsonl`` stays apart from
the ordinary runs that the docs' tables are made of.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
from collections.abc import Iterator

SPIN = "while True: pass"


def add_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--busy-cores",
        type=int,
        default=0,
        metavar="N",
        help="keep N cores busy with spinning processes while measuring (default 0); the "
        "summary line is then named <name>_busy",
    )


@contextlib.contextmanager
def kept_busy(cores: int) -> Iterator[None]:
    """``cores`` spinning processes for the duration of the block (none for 0)."""
    if cores < 0:
        raise SystemExit(f"--busy-cores must be 0 or more, not {cores}")
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(cores)]
    if spinners:
        print(f"{cores} core(s) kept busy by processes spinning at the default priority "
              f"({sys.executable} -c '{SPIN}')", flush=True)  # fmt: skip
    try:
        yield
    finally:
        for proc in spinners:
            proc.kill()
        for proc in spinners:
            proc.wait()


def line_name(name: str, cores: int) -> str:
    """The summary line's name: ``name``, or ``name_busy`` with cores kept busy."""
    return f"{name}_busy" if cores else name
