"""Quota settings from flags, the environment and YAML, and their bad values."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tierkv.config import ConfigError, add_arguments, load


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_quotas_from_flags_env_and_yaml(tmp_path: Path) -> None:
    cfg = load(parse("--quota", "acme=8GiB", "--quota", "a=b=1MiB", "--quota-mode", "hard"), {})
    assert cfg.quotas == {"acme": 8 * 2**30, "a=b": 2**20}  # the last "=" splits
    assert cfg.quota_mode == "hard" and cfg.default_quota_bytes is None
    cfg = load(None, {"TIERKV_QUOTAS": "x=1KiB;y=2048", "TIERKV_DEFAULT_QUOTA": "4GiB"})
    assert cfg.quotas == {"x": 1024, "y": 2048} and cfg.default_quota_bytes == 4 * 2**30
    path = tmp_path / "c.yaml"
    path.write_text('quotas:\n  "~default": 1GiB\n  team: 100\ndefault_quota: unlimited\n')
    cfg = load(parse("--config", str(path)), {})
    assert cfg.quotas == {"~default": 2**30, "team": 100}
    assert cfg.resolved_quota_file.endswith("quotas.json")


def test_disk_quotas_from_flags_env_and_yaml(tmp_path: Path) -> None:
    cfg = load(parse("--disk-quota", "acme=100GiB", "--default-disk-quota", "1GiB"), {})
    assert cfg.disk_quotas == {"acme": 100 * 2**30} and cfg.default_disk_quota_bytes == 2**30
    assert cfg.quotas == {} and cfg.default_quota_bytes is None  # the pool's are apart
    cfg = load(None, {"TIERKV_DISK_QUOTAS": "x=1KiB;y=2048"})
    assert cfg.disk_quotas == {"x": 1024, "y": 2048} and cfg.default_disk_quota_bytes is None
    path = tmp_path / "c.yaml"
    path.write_text("disk_quotas:\n  team: 8GiB\ndefault_disk_quota: 2GiB\n")
    cfg = load(parse("--config", str(path)), {})
    assert cfg.disk_quotas == {"team": 8 * 2**30} and cfg.default_disk_quota_bytes == 2 * 2**30


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--quota", "acme"], {}, "NAME=SIZE"),
        (["--quota", "=1GiB"], {}, "NAME=SIZE"),
        (["--quota", "acme=lots"], {}, "not a size"),
        (["--quota", "acme=-1"], {}, "not a size"),
        (["--quota-mode", "medium"], {}, "soft or hard"),
        (["--default-quota", "nan"], {}, "unlimited"),
        ([], {"TIERKV_DEFAULT_QUOTA": "-3GiB"}, "unlimited"),
        ([], {"TIERKV_QUOTAS": "inf=inf"}, "not a size"),
        (["--disk-quota", "acme"], {}, "NAME=SIZE"),
        (["--disk-quota", "acme=-1GiB"], {}, "not a size"),
        (["--default-disk-quota", "inf"], {}, "default_disk_quota: not a size: 'inf'"),
        # Past 8 EiB (a float overflowed on long numbers: a traceback, not a config error).
        (["--quota", "acme=" + "9" * 400], {}, "more than 9223372036854775807 bytes"),
        (["--default-quota", "9" * 400], {}, "default_quota: '9999.*more than"),
        ([], {"TIERKV_DISK_QUOTAS": "a=NaN"}, "not a size"),
        (["--disk-quota", "~other=1GiB"], {}, "takes no disk quota"),
    ],
)
def test_bad_quota_settings_are_refused(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load(parse(*argv), env)
