"""The configuration reference of the built site lists every option of the server, the
controller, the vLLM connector and the SGLang backend, as the code defines them: the flags
the real command line has, the environment variable its help names, the struct's help."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import msgspec
import pytest

from support.docs_site import tables
from tierkv.cli import build_parser
from tierkv.config import ServerConfig
from tierkv.controller.config import ControllerConfig
from tierkv.integrations.sglang.settings import BackendSettings
from tierkv.integrations.vllm.settings import ConnectorSettings
from tierkv.options import option_help, signature_struct
from tierkv.tiers.registry import tier_factories

Rows = list[list[str]]


def fields(cls: type[msgspec.Struct]) -> list[msgspec.inspect.Field]:
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    return list(info.fields)


def command_actions(command: str) -> dict[str, argparse.Action]:
    """The options of ``tierkv COMMAND`` as its real parser has them, by field name."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices[command]._actions if a.dest not in ("help", "config")}


def section_rows(page: Path, heading: str) -> Rows:
    """Every table row under the h2 ``heading`` (a command's sections are several tables)."""
    found = [row for h2, rows in tables(page) if h2 == heading for row in rows]
    assert found, f"no table under {heading!r} on {page}"
    return found


def command_problems(rows: Rows, cls: type[msgspec.Struct], command: str) -> list[str]:
    """What the rows (YAML key, flags, environment, default, help) get wrong or leave out."""
    actions = command_actions(command)
    by_key = {row[0]: row for row in rows}
    problems = [f"{key}: listed, not an option" for key in by_key.keys() - set(actions)]
    for field in fields(cls):
        row = by_key.get(field.name)
        if row is None:
            problems.append(f"{field.name}: missing")
            continue
        key, flags, env, default, help_text = row
        action = actions[field.name]
        if flags != ", ".join(action.option_strings):
            problems.append(f"{key}: flags {flags!r}, the command line has {action.option_strings}")
        if not re.search(rf"\benv {re.escape(env)}\b", action.help or ""):
            problems.append(f"{key}: environment {env!r}, the command line's help says otherwise")
        if not default:
            problems.append(f"{key}: no default")
        expected = " ".join(option_help(field.type)[1].replace("`", "").split())
        if not help_text.startswith(expected):
            problems.append(f"{key}: help {help_text!r} is not the option's")
    return problems


def settings_problems(rows: Rows, cls: type[msgspec.Struct]) -> list[str]:
    """What the rows (key, default, environment, help) of an engine's settings leave out."""
    by_key = {row[0]: row for row in rows}
    names = {f.name for f in fields(cls)}
    problems = [f"{key}: listed, not a setting" for key in by_key.keys() - names]
    for name in sorted(names - by_key.keys()):
        problems.append(f"{name}: missing")
    problems += [f"{row[0]}: no help" for row in by_key.values() if not row[3] or not row[1]]
    return problems


def tier_problems(rows: Rows) -> list[str]:
    """What the rows (key, default, help) of the tiers' tables leave out: every option of
    every tier, as its constructor declares it, with a default and help."""
    options = {
        name: {f.name for f in fields(signature_struct(factory, f"{name}_options"))}
        for name, factory in tier_factories().items()
    }
    listed = {row[0] for row in rows}
    problems = [
        f"{key}: listed, no tier's option" for key in listed - set().union(*options.values())
    ]
    for name, keys in sorted(options.items()):
        problems += [f"{name}: {key} missing" for key in sorted(keys - listed)]
    problems += [f"{row[0]}: no default or help" for row in rows if not row[1] or not row[2]]
    return problems


SERVER = "tierkv server"
CONTROLLER = "tierkv controller"
VLLM = "vLLM connector: kv_connector_extra_config"
SGLANG = "SGLang backend: --hicache-storage-backend-extra-config"
TIERS = "Tiers: --tier NAME:key=value,..."


@pytest.fixture(scope="module")
def page(site: Path) -> Path:
    return site / "reference" / "configuration.html"


def test_every_server_option_is_on_the_page(page: Path) -> None:
    assert command_problems(section_rows(page, SERVER), ServerConfig, "server") == []


def test_every_controller_option_is_on_the_page(page: Path) -> None:
    rows = section_rows(page, CONTROLLER)
    assert command_problems(rows, ControllerConfig, "controller") == []


def test_every_engine_setting_is_on_the_page(page: Path) -> None:
    assert settings_problems(section_rows(page, VLLM), ConnectorSettings) == []
    assert settings_problems(section_rows(page, SGLANG), BackendSettings) == []


def test_every_tier_option_is_on_the_page(page: Path) -> None:
    rows = section_rows(page, TIERS)
    assert tier_problems(rows) == []
    assert {"path", "url", "bucket", "max_pipeline_bytes"} <= {row[0] for row in rows}
    assert tier_problems([row for row in rows if row[0] != "fsync"]) == ["disk: fsync missing"]


def test_the_checks_notice_an_option_left_out_or_wrong(page: Path) -> None:
    rows = section_rows(page, SERVER)
    dropped = [row for row in rows if row[0] != "pool_size"]
    assert command_problems(dropped, ServerConfig, "server") == ["pool_size: missing"]
    wrong = [[*row[:2], "TIERKV_POOL", *row[3:]] if row[0] == "pool_size" else row for row in rows]
    assert command_problems(wrong, ServerConfig, "server") == [
        "pool_size: environment 'TIERKV_POOL', the command line's help says otherwise"
    ]
    settings = [row for row in section_rows(page, VLLM) if row[0] != "store_decode"]
    assert settings_problems(settings, ConnectorSettings) == ["store_decode: missing"]
