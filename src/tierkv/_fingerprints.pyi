"""Types of the C helper ``_fingerprints.c`` (see :mod:`tierkv.controller.keytable` and
:mod:`tierkv.controller.holders`)."""

from typing import Any

def fill(keys: Any, out: Any, /) -> bool: ...
def match_slots(
    arr: Any, starts: Any, shift: int, want: Any, seen: Any, out: Any, count: int, /
) -> int: ...
def probe(slots: Any, shift: int, fps: Any, out: Any, /) -> None: ...
