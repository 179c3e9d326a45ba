"""The metric names a PromQL expression reads, and the names a Prometheus scrape exports.

Not a PromQL parser: a tokenizer good enough to tell metric names from functions,
aggregations, keywords, label names, strings, numbers, durations and Grafana variables in the
expressions of deploy/ (promtool is not available here).
"""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

# Operators and modifiers written as words, and the literals PromQL knows.
KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and",
     "or", "unless", "atan2", "inf", "nan", "start", "end"}
)  # fmt: skip
# Modifiers followed by a parenthesized list of label names (not an expression).
LABEL_LISTS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
# Series Prometheus makes itself for every scrape target (no exporter has them).
SYNTHETIC = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped"})

_TOKEN = re.compile(
    r"""
      (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
    | (?P<braces>\{[^{}]*\})
    | (?P<range>\[[^\[\]]*\])
    | (?P<variable>\$\{?\w+\}?)
    | (?P<number>(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)(?:[smhdwy]|ms)*)
    | (?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)
    | (?P<open>\()
    | (?P<other>\S)
    """,
    re.VERBOSE,
)
_GRAFANA_LABEL_VALUES = re.compile(r"^\s*label_values\((?P<expr>.*),\s*\w+\s*\)\s*$", re.S)


def metric_names(expr: str) -> set[str]:
    """Every metric name ``expr`` selects (Grafana's ``label_values(EXPR, label)`` too),
    those of :data:`SYNTHETIC` included."""
    grafana = _GRAFANA_LABEL_VALUES.match(expr)
    if grafana:
        expr = grafana["expr"]
    tokens = [(m.lastgroup, m.group()) for m in _TOKEN.finditer(expr)]
    names: set[str] = set()
    skip_list = False  # inside the label list of by/without/on/ignoring/group_*
    for i, (kind, text) in enumerate(tokens):
        if skip_list:
            skip_list = text != ")"
            continue
        if kind != "name":
            continue
        after = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if text.lower() in LABEL_LISTS and after == "(":
            skip_list = True
            continue
        if text.lower() in KEYWORDS:
            continue
        if after == "(" or after.lower() in ("by", "without"):
            continue  # a function, or an aggregation (`sum(...)`, `sum by (x) (...)`)
        names.add(text)
    return names


def exported_names(metrics_text: str) -> set[str]:
    """The series names a scrape offers: its samples' names, and for every family announced
    by HELP/TYPE (even one without samples yet: a labelled counter before its first use) the
    names its type gives it (a counter's ``_total``, a histogram's ``_bucket``, ``_sum``,
    ``_count``)."""
    out: set[str] = set()
    suffixes = {
        "counter": ("_total",),
        "histogram": ("_bucket", "_sum", "_count"),
        "summary": ("", "_sum", "_count"),
        "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
        "info": ("_info",),
    }
    for family in text_string_to_metric_families(metrics_text):
        out.update(sample.name for sample in family.samples)
        out.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return out
