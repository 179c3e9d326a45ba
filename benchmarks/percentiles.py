"""Percentiles of timing samples, one definition for every benchmark that prints them."""

from __future__ import annotations


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0 to 1) of ``values``: the sample nearest rank ``q * (n - 1)``."""
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]
