"""The operations kit in deploy/ as tests read it: its files, the PromQL expressions of the
dashboard and the alert rules, and `tierkv` command lines parsed by the real CLI."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from tierkv.cli import build_parser
from tierkv.config import ServerConfig, load_as
from tierkv.controller.config import ControllerConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "tierkv-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "tierkv-alerts.yaml"
KUBERNETES = DEPLOY / "kubernetes"
SYSTEMD = DEPLOY / "systemd"


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def alert_rules() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(ALERTS.read_text())
    return data


def panels(dash: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    out: list[dict[str, Any]] = []
    for panel in dash["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def dashboard_exprs(dash: Mapping[str, Any]) -> dict[str, str]:
    """Every query of the dashboard, by where it is (panel title and refId, or variable)."""
    out = {
        f"panel {p['title']!r} {t['refId']}": t["expr"]
        for p in panels(dash)
        for t in p.get("targets", [])
    }
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]
            out[f"variable {var['name']}"] = query["query"] if isinstance(query, dict) else query
    return out


def alert_exprs(rules: Mapping[str, Any]) -> dict[str, str]:
    """Every alert's expression, by alert name."""
    return {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"]}


def parse_command(argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` (after ``tierkv``) parsed by the real CLI, without accepting abbreviations:
    a flag that was renamed fails even where it is the prefix of the new name."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for choice in sub.choices.values():
        choice.allow_abbrev = False
    try:
        return parser.parse_args(list(argv))
    except SystemExit as exc:
        raise AssertionError(f"tierkv refuses {list(argv)} (see stderr)") from exc


def command_config(
    argv: Sequence[str], env: Mapping[str, str] | None = None
) -> ServerConfig | ControllerConfig:
    """The configuration `tierkv server ...` or `tierkv controller ...` would run with, from
    the real parser and loader (the same checks as at start: ConfigError if refused)."""
    args = parse_command(argv)
    cls = ServerConfig if args.command == "server" else ControllerConfig
    config: ServerConfig | ControllerConfig = load_as(cls, args, dict(env or {}))
    return config


def manifests() -> dict[str, list[dict[str, Any]]]:
    """The Kubernetes manifests (kustomization.yaml aside): file name -> documents."""
    return {
        path.name: [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
        for path in sorted(KUBERNETES.glob("*.yaml"))
        if path.name != "kustomization.yaml"
    }
