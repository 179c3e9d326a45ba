"""The systemd unit of deploy/systemd: its ExecStart is a `tierkv server` command line the
real CLI accepts, with the configuration file next to it (loaded by the real loader), its
directories are the ones that configuration uses, and `systemd-analyze verify` finds nothing
to say about it (where systemd-analyze is installed)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.deploy_kit import SYSTEMD, command_config, parse_command
from tierkv.config import ServerConfig

UNIT = SYSTEMD / "tierkv.service"
CONFIG = SYSTEMD / "tierkv.yaml"
INSTALLED_CONFIG = "/etc/tierkv/tierkv.yaml"  # where the unit's comment installs CONFIG

Unit = dict[str, dict[str, list[str]]]


def parse_unit(text: str) -> Unit:
    """Section -> key -> values, in order: systemd allows a key more than once (and an empty
    assignment resets the list), and continues a line ending in a backslash."""
    unit: Unit = {}
    section: dict[str, list[str]] | None = None
    logical: list[str] = []
    for raw in text.splitlines():
        if raw.endswith("\\"):
            logical.append(raw[:-1])
            continue
        line = ("".join(logical) + raw).strip()
        logical = []
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = unit.setdefault(line[1:-1], {})
            continue
        assert section is not None, f"assignment outside a section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not KEY=VALUE: {line!r}"
        values = section.setdefault(key.strip(), [])
        if value.strip():
            values.append(value.strip())
        else:
            values.clear()
    return unit


def exec_start(unit: Unit) -> list[str]:
    (line,) = unit["Service"]["ExecStart"]
    return shlex.split(line.lstrip("-@:+!"))


def server_config(argv: list[str]) -> ServerConfig:
    """The configuration the unit's server runs with: its own flags, with the configuration
    file it names read from deploy/systemd."""
    args = parse_command(argv)
    assert args.config == INSTALLED_CONFIG
    argv = [str(CONFIG) if a == INSTALLED_CONFIG else a for a in argv]
    cfg = command_config(argv, {})
    assert isinstance(cfg, ServerConfig)
    return cfg


def test_the_unit_parser_keeps_repeated_keys() -> None:
    unit = parse_unit("[Service]\nEnvironment=A=1\nEnvironment=B=2\nX=1\nX=\nExecStart=a \\\n b\n")
    assert unit["Service"] == {"Environment": ["A=1", "B=2"], "X": [], "ExecStart": ["a  b"]}


def test_exec_start_is_a_server_command_line_the_cli_accepts() -> None:
    unit = parse_unit(UNIT.read_text())
    argv = exec_start(unit)
    assert Path(argv[0]).name == "tierkv" and argv[1] == "server"
    cfg = server_config(argv[1:])
    # The unit's directories are the configuration's: socket, disk tier, quotas.
    service = unit["Service"]
    (runtime,) = service["RuntimeDirectory"]
    assert cfg.resolved_runtime_dir.startswith(f"/run/{runtime}/")
    (cache,) = service["CacheDirectory"]
    assert all(str(t.options["path"]).startswith(f"/var/cache/{cache}/") for t in cfg.tiers)
    (state,) = service["StateDirectory"]
    assert cfg.resolved_quota_file.startswith(f"/var/lib/{state}/")
    assert service["RuntimeDirectoryMode"] == ["0700"]  # the socket's directory is private
    # Nothing that would hide the host's /dev/shm (the pool) from the engines.
    assert "PrivateIPC" not in service and "PrivateDevices" not in service
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def test_a_renamed_flag_fails_the_check() -> None:
    argv = exec_start(parse_unit(UNIT.read_text()))[1:]
    with pytest.raises(AssertionError, match="refuses"):
        server_config([a.replace("--runtime-dir", "--runtime-directory") for a in argv])
    with pytest.raises(AssertionError, match="refuses"):
        server_config([a.replace("--runtime-dir", "--runtime") for a in argv])  # no prefixes


@pytest.mark.processes
def test_systemd_analyze_verify_finds_nothing(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # verify also checks that ExecStart's program exists: point it at this tierkv.
    program = exec_start(parse_unit(UNIT.read_text()))[0]
    here = Path(sys.executable).parent / "tierkv"
    if not here.exists():
        pytest.skip(f"no tierkv command next to {sys.executable}")
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace(program, str(here)))
    out = subprocess.run(
        [analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert (out.returncode, out.stderr) == (0, "")
    # And it does complain about a broken unit (the check can fail).
    unit.write_text(unit.read_text().replace("Nice=-10", "Nice=-30\nRestartSecs=2"))
    out = subprocess.run(
        [analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert "Nice" in out.stderr and "RestartSecs" in out.stderr
