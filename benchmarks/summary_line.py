"""Parse the summary lines the benchmark scripts print last.

Each script in ``benchmarks/`` ends its output with one or more summary lines: an optional
name, then ``key=value`` pairs (``shm_path store_vs_memcpy=1.33 ...``;
``hash_128k_tokens_ms=0.487`` has no name; ``load.py`` prints a ``floor ...`` line before its
``load ...`` line). :func:`parse_output` takes the trailing block of such lines; values become
ints or floats where they read as numbers (``nan`` becomes ``None``), strings otherwise.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

Value = int | float | str | None
Summary = dict[str, dict[str, Value]]

_NAME = re.compile(r"[A-Za-z_][\w\[\]]*\Z")
_PAIR = re.compile(r"([A-Za-z_][\w\[\]]*)=(\S+)\Z")


def parse_value(text: str) -> Value:
    """``"3"`` -> 3, ``"0.47"`` -> 0.47, ``"nan"`` -> None, ``"tcp"`` -> ``"tcp"``."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        number = float(text)
    except ValueError:
        return text
    return number if math.isfinite(number) else None


def parse_line(line: str, default_name: str) -> tuple[str, dict[str, Value]] | None:
    """The line's name (``default_name`` when it has none) and its pairs, or None when the
    line is not a summary line (every token after the optional name must be ``key=value``,
    and there must be at least one)."""
    tokens = line.split()
    if not tokens:
        return None
    name = default_name
    if "=" not in tokens[0]:
        if not _NAME.match(tokens[0]):
            return None
        name, tokens = tokens[0], tokens[1:]
    pairs: dict[str, Value] = {}
    for token in tokens:
        match = _PAIR.match(token)
        if match is None:
            return None
        pairs[match.group(1)] = parse_value(match.group(2))
    return (name, pairs) if pairs else None


def parse_output(lines: Iterable[str], default_name: str) -> Summary:
    """The trailing block of summary lines in a script's output, by name (blank lines at
    the end are skipped; a later line of the same name wins). Empty when the last line
    is not a summary line."""
    block: list[tuple[str, dict[str, Value]]] = []
    for line in reversed([line for line in lines if line.strip()] or []):
        parsed = parse_line(line, default_name)
        if parsed is None:
            break
        block.append(parsed)
    return dict(reversed(block))
