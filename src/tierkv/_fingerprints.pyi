"""Types of the C helper ``_fingerprints.c`` (see :mod:`tierkv.controller.keytable`)."""

from typing import Any

def fill(keys: Any, out: Any, /) -> bool: ...
