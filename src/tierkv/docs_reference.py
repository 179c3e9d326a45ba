"""The documentation's configuration reference, generated from the code so it cannot drift.

:func:`render` writes the Markdown page ``reference/configuration.md`` (the site's build adds
it through ``scripts/mkdocs_hooks.py``): every option of ``tierkv server``
(:class:`tierkv.config.ServerConfig`) and ``tierkv controller``
(:class:`tierkv.controller.config.ControllerConfig`) with the flags the command line really
has (the parser :func:`tierkv.config.add_arguments` builds), its environment variable
(:func:`tierkv.config.env_var`), YAML key, default and help (:func:`tierkv.options.option`);
the options of every tier (``--tier NAME:key=value,...``) with the defaults their constructors
declare (:func:`tierkv.tiers.registry.tier_factories`) and the help their docstrings list;
and every key of the vLLM connector's and the SGLang backend's extra config with its default
and the help their settings modules document.
"""

from __future__ import annotations

import argparse
import inspect
import re
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import msgspec

from tierkv.config import ServerConfig, add_arguments, env_var
from tierkv.controller.config import ControllerConfig
from tierkv.integrations import link
from tierkv.integrations.sglang import settings as sglang_settings
from tierkv.integrations.vllm import settings as vllm_settings
from tierkv.options import option_help, signature_struct
from tierkv.tiers.registry import tier_factories

PAGE = "reference/configuration.md"


@dataclass(frozen=True)
class Option:
    """One documented option: its key (YAML, or the extra config's), its flags and
    environment variable where it has them, its default and help, and its section."""

    key: str
    flags: tuple[str, ...]
    env: str
    default: str
    help: str
    section: str = ""


def command_options(cls: type[msgspec.Struct], what: str) -> list[Option]:
    """The options of a command's configuration struct ``cls``, as its command line has
    them (``what``: ``server`` or ``controller``)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser, cls, what)
    flags = {a.dest: tuple(a.option_strings) for a in parser._actions}
    repeated = {a.dest for a in parser._actions if isinstance(a, argparse._AppendAction)}
    out = []
    for field in _struct_fields(cls):
        section, help_text = option_help(field.type)
        env = env_var(field.name)
        if field.name in repeated:
            help_text += " (repeat the flag; in the environment, separate entries with ';')"
        out.append(Option(field.name, flags[field.name], env, _default(field), help_text, section))
    return out


def settings_options(cls: type[msgspec.Struct], module: ModuleType) -> list[Option]:
    """The keys of an integration's settings struct ``cls``, with the help its settings
    ``module`` documents for each (a key without help is an error: it must be documented)."""
    helps = docstring_keys(module.__doc__ or "")
    out = []
    for field in _struct_fields(cls):
        if field.name not in helps:
            raise ValueError(f"{module.__name__}: {field.name} is not documented")
        env = link.ENV_DEFAULTS.get(field.name, "")
        out.append(Option(field.name, (), env, _default(field), helps[field.name]))
    return out


def tier_options(name: str, factory: Any) -> list[Option]:
    """The options of the tier ``name``: its constructor's keyword parameters (defaults
    included) with the help its class docstring lists for each, or a base class's (one
    missing is an error)."""
    helps: dict[str, str] = {}
    for klass in reversed(inspect.getmro(factory) if inspect.isclass(factory) else [factory]):
        helps.update(docstring_keys(inspect.cleandoc(klass.__doc__ or "")))
    out = []
    for field in _struct_fields(signature_struct(factory, f"{name}_options")):
        if field.name not in helps:
            raise ValueError(f"tier {name}: option {field.name} is not documented")
        default = "required" if field.required else _default(field)
        out.append(Option(field.name, (), "", default, helps[field.name]))
    return out


def docstring_keys(doc: str) -> dict[str, str]:
    """``key: help`` from a settings module's docstring, where each key starts a line
    indented by four spaces and its help follows on that line or on lines indented deeper."""
    keys: dict[str, str] = {}
    current = ""
    for line in doc.splitlines():
        m = re.match(r"^    ([a-z_0-9]+)(?:\s{2,}(\S.*))?$", line)
        if m:
            current = m.group(1)
            keys[current] = (m.group(2) or "").strip()
        elif current and line.startswith("     ") and line.strip():
            keys[current] = f"{keys[current]} {line.strip()}".strip()
        else:
            current = ""
    return keys


def render() -> str:
    """The configuration reference page, in Markdown."""
    parts = [
        "# Configuration reference\n",
        "Generated from tierkv's code when the documentation is built: every option below "
        "is exactly what the command line, the environment and the YAML file accept. "
        "Flags win over the environment, which wins over the YAML file (`--config FILE` or "
        "`TIERKV_CONFIG`). See [Configuration](../configuration.md) for how to use them.\n",
        "## tierkv server\n",
        _command_table(command_options(ServerConfig, "server")),
        "## tierkv controller\n",
        _command_table(command_options(ControllerConfig, "controller")),
        "## Tiers: `--tier NAME:key=value,...`\n",
        "A tier's options follow its name on the command line (`--tier "
        "disk:path=/var/cache/tierkv,capacity=200GiB`; `TIERKV_TIERS` separates tiers with "
        "`;`) or sit beside `name:` in a YAML `tiers:` entry.\n",
        *(
            f"### {' / '.join(f'`{n}`' for n in names)}\n\n{_settings_table(opts, env=False)}"
            for names, opts in _tiers()
        ),
        "## vLLM connector: `kv_connector_extra_config`\n",
        "Keys of the JSON object given as `kv_connector_extra_config` in vLLM's "
        "`--kv-transfer-config`. Every key is optional; an unknown key is an error.\n",
        _settings_table(settings_options(vllm_settings.ConnectorSettings, vllm_settings)),
        "## SGLang backend: `--hicache-storage-backend-extra-config`\n",
        "tierkv's keys of SGLang's extra config (SGLang's own keys, such as "
        f"{_codes(sorted(sglang_settings.SGLANG_KEYS))}, stay SGLang's). Every key is "
        "optional; an unknown key is an error.\n",
        _settings_table(settings_options(sglang_settings.BackendSettings, sglang_settings)),
    ]
    return "\n".join(parts)


# -- internals ---------------------------------------------------------------------------
def _struct_fields(cls: type[msgspec.Struct]) -> list[msgspec.inspect.Field]:
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    return list(info.fields)


def _is_size(kind: msgspec.inspect.Type) -> bool:
    if isinstance(kind, msgspec.inspect.UnionType):
        return any(_is_size(member) for member in kind.types)
    return isinstance(kind, msgspec.inspect.Metadata) and (
        (kind.extra or {}).get("unit") == "bytes" or _is_size(kind.type)
    )


def _default(field: msgspec.inspect.Field) -> str:
    value: Any = field.default
    if value is msgspec.NODEFAULT:
        value = field.default_factory() if field.default_factory is not msgspec.NODEFAULT else None
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and _is_size(field.type):
        return _size(value)
    if value == "" or value == [] or value == {}:
        return "empty"
    return str(value)


def _size(n: int) -> str:
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n and n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)


def _cell(text: str) -> str:
    return text.replace("``", "`").replace("|", "\\|").replace("\n", " ")


def _codes(items: Iterable[str]) -> str:
    return ", ".join(f"`{item}`" for item in items)


def _command_table(options: list[Option]) -> str:
    rows: list[str] = []
    section = None
    for opt in options:
        if opt.section != section:
            section = opt.section
            rows += ["", f"### {section[:1].upper()}{section[1:]}", ""]
            rows += [
                "| YAML key | flag | environment | default | help |",
                "| --- | --- | --- | --- | --- |",
            ]
        rows.append(
            f"| `{opt.key}` | {_codes(opt.flags)} | `{opt.env}` | `{_cell(opt.default)}` | "
            f"{_cell(opt.help)} |"
        )
    return "\n".join(rows) + "\n"


def _settings_table(options: list[Option], env: bool = True) -> str:
    if not env:
        rows = ["| key | default | help |", "| --- | --- | --- |"]
        rows += [f"| `{o.key}` | `{_cell(o.default)}` | {_cell(o.help)} |" for o in options]
        return "\n".join(rows) + "\n"
    rows = ["| key | default | unset: from | help |", "| --- | --- | --- | --- |"]
    for opt in options:
        source = f"`{opt.env}`" if opt.env else ""
        rows.append(f"| `{opt.key}` | `{_cell(opt.default)}` | {source} | {_cell(opt.help)} |")
    return "\n".join(rows) + "\n"


def _tiers() -> list[tuple[list[str], list[Option]]]:
    """Each tier factory with its names (an alias shares its factory) and options."""
    names: dict[Any, list[str]] = {}
    for name, factory in sorted(tier_factories().items()):
        names.setdefault(factory, []).append(name)
    return [(n, tier_options(n[0], factory)) for factory, n in names.items()]


__all__ = [
    "PAGE",
    "Option",
    "command_options",
    "docstring_keys",
    "render",
    "settings_options",
    "tier_options",
]
