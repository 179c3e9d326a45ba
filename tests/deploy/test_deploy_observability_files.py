"""The shape of the Grafana dashboard and the Prometheus alert rules of deploy/ (what Grafana
and Prometheus would refuse or show wrong), and the PromQL tokenizer the metric-name check
uses. That every metric they query is exported: test_deploy_metric_names.py."""

from __future__ import annotations

from typing import Any

import pytest

from support.deploy_kit import alert_exprs, alert_rules, dashboard, dashboard_exprs, panels
from support.promql import metric_names

# What the issue asks the dashboard to show, and a metric each must read.
DASHBOARD_TOPICS = {
    "hit rate by tier": "tierkv_lookup_chunks_total",
    "bytes in": "tierkv_stored_bytes_total",
    "bytes out": "tierkv_retrieved_bytes_total",
    "pool use": "tierkv_pool_used_bytes",
    "evictions": "tierkv_evictions_total",
    "lookup latency": "tierkv_request_duration_seconds_bucket",
    "peer fetches": "tierkv_cluster_peer_chunks_total",
    "quotas": "tierkv_tenant_refused_chunks_total",
    "controller lookups": "tierkv_controller_lookup_seconds_bucket",
}
# What the alert rules must cover, and a metric (or `up`) each reads.
ALERT_TOPICS = {
    "server down": "up",
    "pool full and evicting hot data": "tierkv_evictions_total",
    "tier outage": "tierkv_tier_write_failures_total",
    "peer errors": "tierkv_cluster_peer_errors_total",
    "quota refusals": "tierkv_tenant_refused_chunks_total",
}


def test_dashboard_panels_are_well_formed() -> None:
    dash = dashboard()
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    every = panels(dash)
    ids = [p["id"] for p in every]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "instance", "controller"} <= variables
    for p in every:
        grid = p["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["title"] and p.get("description"), p
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip(), (p["title"], t)
            assert t["expr"].count("(") == t["expr"].count(")"), (p["title"], t["expr"])


def test_dashboard_panels_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for p in dashboard()["panels"]:  # top level: a row's own panels are laid out when opened
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]


def test_dashboard_shows_what_operators_need() -> None:
    read = set().union(*(metric_names(e) for e in dashboard_exprs(dashboard()).values()))
    assert {topic: name for topic, name in DASHBOARD_TOPICS.items() if name not in read} == {}


def test_server_queries_filter_by_the_instance_variable() -> None:
    for where, expr in dashboard_exprs(dashboard()).items():
        if where.startswith("variable"):
            continue
        names = metric_names(expr) - {"up"}
        of_controller = all(n.startswith("tierkv_controller_") for n in names)
        variable = "$controller" if of_controller else "$instance"
        assert f'instance=~"{variable}"' in expr, (where, expr)


def rule_problems(rule: dict[str, Any]) -> list[str]:
    """What Prometheus would refuse in an alerting rule, or what leaves it unusable."""
    problems = []
    allowed = {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}
    if set(rule) - allowed:
        problems.append(f"unknown keys {sorted(set(rule) - allowed)}")
    if not isinstance(rule.get("alert"), str) or not rule["alert"].isidentifier():
        problems.append("alert must be a name")
    if not isinstance(rule.get("expr"), str) or not rule["expr"].strip():
        problems.append("expr missing")
    elif rule["expr"].count("(") != rule["expr"].count(")"):
        problems.append("unbalanced parentheses in expr")
    if "for" in rule and not (isinstance(rule["for"], str) and rule["for"][-1] in "smhdwy"):
        problems.append("for must be a duration")
    labels = rule.get("labels", {})
    if labels.get("severity") not in ("critical", "warning", "info"):
        problems.append("labels.severity must be critical, warning or info")
    if not all(isinstance(v, str) for v in labels.values()):
        problems.append("label values must be strings")
    notes = rule.get("annotations", {})
    if not (notes.get("summary") and notes.get("description")):
        problems.append("annotations need a summary and a description")
    return problems


def test_alert_rules_are_well_formed() -> None:
    rules = alert_rules()
    assert set(rules) == {"groups"}
    names = []
    for group in rules["groups"]:
        assert set(group) <= {"name", "interval", "rules", "limit"} and group["name"], group
        for rule in group["rules"]:
            assert rule_problems(rule) == [], rule.get("alert")
            names.append(rule["alert"])
    assert len(names) == len(set(names))


def test_alert_rule_check_catches_mistakes() -> None:
    good = alert_rules()["groups"][0]["rules"][0]
    assert rule_problems(good) == []
    assert rule_problems({**good, "expression": good["expr"]}) != []
    assert rule_problems({**good, "for": 5}) != []
    assert rule_problems({**good, "expr": "sum(rate(x[5m])"}) != []
    assert rule_problems({**good, "labels": {}}) != []


def test_alerts_cover_what_operators_need() -> None:
    read = {name for e in alert_exprs(alert_rules()).values() for name in metric_names(e)}
    assert {topic: name for topic, name in ALERT_TOPICS.items() if name not in read} == {}


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (tier) (rate(a_total{x="y", z=~"$v"}[$__rate_interval]))', {"a_total"}),
        ("sum(rate(b_bucket[5m])) by (le) / ignoring(le) group_left(t) c > 0.5", {"b_bucket", "c"}),
        ("histogram_quantile(0.9, sum without (pod) (rate(d_bucket[5m] offset 1h)))", {"d_bucket"}),
        ('up{job="x"} == 0 and on (instance) e unless f or bool g', {"up", "e", "f", "g"}),
        ('topk(3, h) + count_values("by", i) - 1e3 * 5m', {"h", "i"}),
        ("label_values(tierkv_build_info, instance)", {"tierkv_build_info"}),
        ('j{le="+Inf", quantile="0.99", s="on (x) by"}', {"j"}),
    ],
)
def test_metric_names_of_promql(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names
