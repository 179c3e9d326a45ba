"""Server configuration: defaults, YAML < TIERKV_* env < flags, sizes, validation, security.

Unit tests of tierkv.config, then the real CLI and real servers: `tierkv server --help`
documents every option with its default; a TCP server with --auth-token refuses a wrong
token and accepts the right one; the ipc socket is 0600 in a 0700 directory; a /dev/shm too
small for the pool stops `tierkv server` with an actionable message.
"""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import pytest

from support.httputil import free_port
from support.servers import CHUNK_SHAPE, ServerProcess, chunk_data, register, stop_and_clean
from tierkv import config
from tierkv import protocol as p
from tierkv.cli import build_parser
from tierkv.client import Client, ServerError, UnauthorizedError
from tierkv.config import ConfigError, ServerConfig
from tierkv.options import OptionError, option_help, parse_size
from tierkv.pool import SHM_DIR, segment_exists
from tierkv.redaction import redacted_url

GIB = 2**30
MIB = 2**20


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["server", *argv])


def cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "120"}
    return subprocess.run(
        [sys.executable, "-m", "tierkv.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


# -- defaults and sources ----------------------------------------------------------------
def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    cfg = config.load(parse(), env={})
    assert cfg == ServerConfig()
    assert (cfg.instance, cfg.pool_size, cfg.chunk_size, cfg.alignment) == (
        "default", 2 * GIB, 256, 4096
    )  # fmt: skip
    assert (cfg.write_ttl, cfg.read_ttl, cfg.high_watermark, cfg.low_watermark) == (
        600.0, 300.0, 0.8, 0.7
    )  # fmt: skip
    assert cfg.max_message_bytes == 64 * MIB and cfg.rpc_tcp == "" and cfg.auth_token == ""
    assert cfg.prefault is False and cfg.log_level == "info" and cfg.log_format == "text"
    uid = os.getuid()
    assert cfg.resolved_pool_name == f"tierkv-{uid}-default"
    assert cfg.rpc_endpoint == f"ipc:///tmp/tierkv-{uid}/tierkv/default/rpc.sock"
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/4242")
    assert cfg.rpc_endpoint == "ipc:///run/user/4242/tierkv/default/rpc.sock"
    other = config.load(parse("--instance", "b"), env={})
    assert other.resolved_pool_name == f"tierkv-{uid}-b"
    assert other.rpc_endpoint == "ipc:///run/user/4242/tierkv/b/rpc.sock"


def test_yaml_then_env_then_flags(tmp_path: Path) -> None:
    yml = tmp_path / "tierkv.yaml"
    yml.write_text(
        "pool_size: 8MiB\n"
        "chunk_size: 128\n"
        "write_ttl: 5\n"
        "read-ttl: 6\n"  # dashes work too
        "log_level: debug\n"
        "max_chunks_per_request: 100\n"
    )
    env = {
        "TIERKV_CHUNK_SIZE": "64",
        "TIERKV_WRITE_TTL": "7",
        "TIERKV_LOG_LEVEL": "warning",
        "UNRELATED": "x",
    }
    cfg = config.load(parse("--config", str(yml), "--write-ttl", "9"), env=env)
    assert cfg.pool_size == 8 * MIB  # YAML only
    assert cfg.read_ttl == 6.0 and cfg.max_chunks_per_request == 100  # YAML only
    assert cfg.chunk_size == 64 and cfg.log_level == "warning"  # env beats YAML
    assert cfg.write_ttl == 9.0  # flag beats env and YAML
    assert cfg.high_watermark == 0.8  # untouched default

    # The file can come from TIERKV_CONFIG; --config wins over it.
    assert config.load(parse(), env={"TIERKV_CONFIG": str(yml)}).chunk_size == 128
    other = tmp_path / "other.yaml"
    other.write_text("chunk_size: 32\n")
    both = config.load(parse("--config", str(other)), env={"TIERKV_CONFIG": str(yml)})
    assert both.chunk_size == 32 and both.pool_size == 2 * GIB
    # Explicit overrides beat everything.
    overridden = config.load(parse("--write-ttl", "9"), env=env, overrides={"write_ttl": 3})
    assert overridden.write_ttl == 3
    # Booleans from flags and env.
    assert config.load(parse("--prefault"), env={}).prefault is True
    assert config.load(parse("--no-prefault"), env={"TIERKV_PREFAULT": "true"}).prefault is False
    assert config.load(parse(), env={"TIERKV_PREFAULT": "1"}).prefault is True


def test_yaml_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("pool_size: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        config.load(parse("--config", str(bad)), env={})
    bad.write_text("- a list\n- not a mapping\n")
    with pytest.raises(ConfigError, match="mapping"):
        config.load(parse("--config", str(bad)), env={})
    bad.write_text("pool_sise: 1GiB\n")
    with pytest.raises(ConfigError, match="pool_sise"):
        config.load(parse("--config", str(bad)), env={})
    with pytest.raises(ConfigError, match="cannot read config file"):
        config.load(parse("--config", str(tmp_path / "missing.yaml")), env={})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 * MIB),
        ("2GiB", 2 * GIB),
        ("1G", GIB),  # a bare unit letter is binary
        ("64k", 64 * 1024),
        ("2GB", 2 * 10**9),  # "B" after the letter: decimal
        ("1000000", 1_000_000),
        ("1.5GiB", 3 * GIB // 2),
        (" 8 MiB ", 8 * MIB),
        ("4096", 4096),
        (4096, 4096),
        ("9007199254740993", 2**53 + 1),  # exact: a float rounded it to 2**53
        ("9223372036854775807", 2**63 - 1),  # the largest (8 EiB)
        ("0.5KiB", 512),
        ("0." + "5" * 5000 + "KiB", 568),  # past 40 decimals no whole byte changes
        ("1." + "0" * 60 + "KiB", 1024),
    ],
)
def test_size_strings(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1.5", "not a whole number of bytes"),  # bytes come whole (1.5KiB is 1536)
        ("\u0661\u0662\u0663", "not a size"),  # digits, but not ASCII ones
        ("12\uff10", "not a size"),  # a fullwidth zero
        ("-1", "not a size"),
        ("1 GiBs", "not a size"),
        ("9223372036854775808", "more than 9223372036854775807 bytes"),
        ("9" * 400, "more than"),  # a float overflowed: OverflowError, not an option error
        ("9" * 5000, "more than"),  # int() of over 4,300 digits: ValueError
        ("1." + "0" * 60 + "1", "not a whole number of bytes"),
        ("8EiB", "not a size"),
    ],
)
def test_bad_size_strings(text: str, message: str) -> None:
    with pytest.raises(OptionError, match=message):
        parse_size(text)


def test_size_strings_in_every_source(tmp_path: Path) -> None:
    yml = tmp_path / "c.yaml"
    yml.write_text("max_message_bytes: 2MiB\n")
    cfg = config.load(
        parse("--config", str(yml), "--pool-size", "512MiB"),
        env={"TIERKV_ALIGNMENT": "8k"},
    )
    assert (cfg.pool_size, cfg.max_message_bytes, cfg.alignment) == (512 * MIB, 2 * MIB, 8192)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("pool_size", "lots"),
        ("pool_size", "-1"),
        ("pool_size", "0"),
        ("pool_size", "12XB"),
        ("max_message_bytes", "1KiB"),
        ("max_message_bytes", "much"),
        ("alignment", "3000"),
        ("alignment", "huge"),
        ("chunk_size", "abc"),
        ("chunk_size", "0"),
        ("high_watermark", "1.5"),
        ("low_watermark", "0.9"),  # above the default high watermark
        ("low_watermark", "nan"),
        ("write_ttl", "0"),
        ("write_ttl", "-1"),
        ("write_ttl", "nan"),
        ("read_ttl", "inf"),
        ("read_ttl", "soon"),
        ("session_ttl", "0"),
        ("eviction_interval", "0"),
        ("eviction_interval", "inf"),
        ("workers", "0"),
        ("workers", "2.5"),
        ("max_chunks_per_request", "0"),
        ("max_connections", "0"),
        ("max_connections", "many"),
        ("connection_buffer_bytes", "1MiB"),  # below max_message_bytes: none could arrive
        ("connection_buffer_bytes", "much"),
        ("log_format", "xml"),
        ("log_level", "verbose"),
        ("instance", "a/b"),
        ("instance", ""),
        ("rpc_tcp", "nohost"),
        ("rpc_tcp", "127.0.0.1:http"),
        ("rpc_tcp", "127.0.0.1:99999"),
        ("rpc_tcp", "127.0.0.1:0"),
        ("prefault", "maybe"),
        ("controller", "nohost"),
        ("controller", "127.0.0.1:99999"),
    ],
)
def test_invalid_values_name_the_option(option: str, value: str) -> None:
    with pytest.raises(ConfigError) as exc:
        config.load(env={f"TIERKV_{option.upper()}": value})
    assert option in str(exc.value), str(exc.value)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("tier_workers", "0"),
        ("prefetch_timeout", "0"),
        ("prefetch_timeout", "nan"),
        ("prefetch_max_inflight", "-1"),
        ("chunk_feed_events", "0"),
        ("chunk_feed_events", "many"),
        ("write_behind_max_bytes", "lots"),
        ("write_behind_max_bytes", "-5"),
        ("tiers", "disk:path"),
        ("tiers", ":x=1"),
        ("cluster_seeds", "nohost"),
        ("cluster_seeds", "127.0.0.1:0"),
        ("cluster_port", "70000"),
        ("heartbeat_interval", "0"),
        ("member_ttl", "0.5"),  # not above the default heartbeat interval
        ("peer_timeout", "nan"),
        ("directory_replicas", "0"),
        ("ring_vnodes", "0"),
        ("directory_repair_interval", "-1"),
        ("directory_repair_interval", "inf"),
        ("peer_connections", "0"),
        ("peer_transport", "rdma"),
        ("peer_lease_ttl", "0"),
        ("peer_lease_ttl", "inf"),
        ("peer_lease_ttl", "0.001"),
        ("peer_lease_ttl", "1e7"),
        ("cluster_host", "0.0.0.0"),  # beyond loopback without auth_token
    ],
)
def test_invalid_tier_and_cluster_values_name_the_option(option: str, value: str) -> None:
    env = {"TIERKV_CLUSTER_SEEDS": "127.0.0.1:8792", f"TIERKV_{option.upper()}": value}
    with pytest.raises(ConfigError) as exc:
        config.load(env=env)
    message = str(exc.value)
    assert option in message or option.rstrip("s") in message, message


BAD_TIERS = [
    ("floppy:size=1", "unknown tier 'floppy'"),
    ("disk", "missing required option 'path'"),
    ("disk:path=/tmp/tierkv-never,colour=blue", "unknown option 'colour'"),
    ("disk:path=/tmp/tierkv-never,capacity=lots", "capacity"),
    ("disk:path=/tmp/tierkv-never,fsync=perhaps", "fsync"),
    ("disk:path=/tmp/tierkv-never,threads=0", "threads"),
    ("redis:url=http://example.com", "bad url"),
    ("redis:url=redis://h:notaport", "bad url"),
    ("redis:ttl=-1", "ttl"),
    ("s3:bucket=b,endpoint_url=localhost:9000", "endpoint_url"),
    ("disk:path=/tmp/tierkv-a;disk:path=/tmp/tierkv-b", "configured twice"),
]


@pytest.mark.parametrize(("spec", "reason"), BAD_TIERS)
def test_bad_tier_specifications_fail_validation_before_anything_opens(
    spec: str, reason: str, tmp_path: Path
) -> None:
    yaml_file = tmp_path / "tiers.yaml"
    yaml_file.write_text("tiers:\n" + "".join(f"  - {part!r}\n" for part in spec.split(";")))
    for source in (
        {"env": {"TIERKV_TIERS": spec}},  # the environment: specs separated by ';'
        {"args": parse(*[f"--tier={part}" for part in spec.split(";")]), "env": {}},
        {"env": {"TIERKV_CONFIG": str(yaml_file)}},
    ):
        with pytest.raises(ConfigError) as exc:
            config.load(**source)  # type: ignore[arg-type]
        assert reason in str(exc.value) and "tiers" in str(exc.value), str(exc.value)
    assert not os.path.exists("/tmp/tierkv-never")  # validation opened nothing


def test_tier_options_are_typed_at_validation() -> None:
    cfg = config.from_mapping(
        {"tiers": ["disk:path=/tmp/tierkv-never,capacity=2GiB,fsync=yes,threads=none"]}
    )
    options = cfg.tiers[0].options
    assert options["capacity"] == 2 * GIB and options["fsync"] is True
    assert options["threads"] is None and options["retry_interval"] == 30.0
    mapping = config.from_mapping({"tiers": [{"name": "disk", "path": "/x", "capacity": 4096}]})
    assert mapping.tiers[0].options["capacity"] == 4096


def test_rpc_tcp_beyond_loopback_needs_an_auth_token() -> None:
    for addr in ("0.0.0.0:5555", "10.1.2.3:5555", "[::]:5555", "node7.example:5555"):
        with pytest.raises(ConfigError, match="auth_token"):
            config.from_mapping({"rpc_tcp": addr})
        cfg = config.from_mapping({"rpc_tcp": addr, "auth_token": "s3cret"})
        assert cfg.rpc_endpoint == f"tcp://{addr}"
    for addr in ("127.0.0.1:5555", "localhost:5555", "[::1]:5555", "127.1.2.3:5555"):
        assert config.from_mapping({"rpc_tcp": addr}).rpc_endpoint == f"tcp://{addr}"


def test_the_secret_is_redacted() -> None:
    cfg = config.from_mapping({"rpc_tcp": "0.0.0.0:5555", "auth_token": "s3cret"})
    out = config.as_dict(cfg)
    assert out["auth_token"] == "***" and "s3cret" not in str(out)


def test_tier_credentials_are_redacted() -> None:
    """/status shows the configuration without a token: the tiers' credentials (options
    named as secrets, a URL's userinfo) are hidden, everything else is shown."""
    cfg = config.from_mapping(
        {
            "tiers": [
                "redis:url=redis://:RedisPassw0rd@cache.example:6379/0",
                {
                    "name": "s3",
                    "bucket": "kv",
                    "endpoint_url": "https://s3.example",  # (userinfo refused: below)
                    "access_key_id": "AKIDEXAMPLE",
                    "secret_access_key": "S3SecretKeyXYZ",
                    "session_token": "SessionTok",
                },
            ]
        }
    )
    out = config.as_dict(cfg)
    text = str(out)
    for secret in ("RedisPassw0rd", "AKID", "S3Secret", "SessionTok"):
        assert secret not in text
    with pytest.raises(config.ConfigError, match="carries credentials") as refused:
        config.from_mapping(
            {"tiers": [{"name": "s3", "bucket": "kv", "endpoint_url": "https://AKID:S3@h"}]}
        )
    assert "AKID" not in str(refused.value)
    redis, s3 = (t["options"] for t in out["tiers"])
    assert redis["url"] == "redis://***@cache.example:6379/0"
    assert redacted_url("unix://user:Pw2@/run/redis.sock") == "unix://***@/run/redis.sock"
    assert redacted_url("redis://cache.example:6379/0") == "redis://cache.example:6379/0"
    # redis-py takes a password from the query too; the URL's text is otherwise kept.
    url = "unix:///run/redis.sock?db=1&password=Qu3ryPw&Ssl_Password=x%20y#f"
    assert redacted_url(url) == "unix:///run/redis.sock?db=1&password=***&Ssl_Password=***#f"
    # Parsers drop tabs and line breaks: "pass\tword" is the password too.
    assert redacted_url("redis://h/0?pass\tword=Tab3") == "redis://h/0?password=***"
    assert redacted_url("redis://:Pass\tw0rd@h/0") == "redis://***@h/0"
    assert s3["endpoint_url"] == "https://s3.example" and s3["bucket"] == "kv"
    assert s3["secret_access_key"] == s3["session_token"] == s3["access_key_id"] == "***"
    assert cfg.tiers[0].options["url"].endswith("RedisPassw0rd@cache.example:6379/0")


def test_a_redis_password_in_the_urls_query_is_redacted() -> None:
    """redis-py takes ``?password=`` as the password: /status showed it."""
    cfg = config.from_mapping({"tiers": ["redis:url=redis://cache.example/0?password=QueryPw0"]})
    [tier] = config.as_dict(cfg)["tiers"]
    assert tier["options"]["url"] == "redis://cache.example/0?password=***"


def test_a_bad_redis_url_is_reported_without_its_password() -> None:
    with pytest.raises(ConfigError) as err:
        config.from_mapping({"tiers": ["redis:url=redis://:Passw0rd@host:notaport/0"]})
    assert "Passw0rd" not in str(err.value) and "host:notaport" in str(err.value)


# -- the real CLI ------------------------------------------------------------------------
@pytest.mark.processes
def test_server_help_lists_every_option_with_its_default() -> None:
    res = cli("server", "--help")
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())
    flags = {a.dest: a.option_strings for a in server_parser()._actions}
    info = msgspec.inspect.type_info(ServerConfig)
    assert isinstance(info, msgspec.inspect.StructType)
    for field in info.fields:
        assert field.name in flags, f"no flag for {field.name}"
        assert any(flag in text for flag in flags[field.name]), field.name
        default = field.default  # NODEFAULT: a default factory (an empty list)
        shown = "none" if default is msgspec.NODEFAULT else str(default) if default != "" else '""'
        want = f"(default: {shown}; env TIERKV_{field.name.upper()}"
        assert want in text, f"{field.name}: {want!r} not in the help"
    assert "--config FILE" in text


def test_server_help_groups_the_flags_by_section_each_with_its_help() -> None:
    """`tierkv server --help` lists its flags section by section (pool, clients, RPC/HTTP,
    tiers, cluster, quotas, logging), in the sections' order, each flag in the section its
    field names and with the help written beside the field."""
    parser = server_parser()
    titles = [g.title for g in parser._action_groups]
    sections = [
        config.GENERAL, config.RPC_AND_HTTP, config.POOL, config.CLIENTS, config.TIERS,
        config.CLUSTER, config.QUOTAS, config.LOGGING,
    ]  # fmt: skip
    assert [t for t in titles if t and t.startswith("server: ")] == [
        f"server: {s}" for s in sections
    ]
    where = {a.dest: g.title for g in parser._action_groups for a in g._group_actions}
    info = msgspec.inspect.type_info(ServerConfig)
    assert isinstance(info, msgspec.inspect.StructType)
    for field in info.fields:
        section, help_text = option_help(field.type)
        assert section in sections and help_text, field.name
        assert where[field.name] == f"server: {section}", field.name
        action = next(a for a in parser._actions if a.dest == field.name)
        assert action.help is not None and action.help.startswith(help_text), field.name


def test_a_configuration_field_without_help_is_a_programming_error() -> None:
    class Bare(msgspec.Struct, kw_only=True):
        size: int = 1

    with pytest.raises(TypeError, match=r"Bare\.size has no help"):
        config.add_arguments(argparse.ArgumentParser(), Bare, "test")


def server_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    server: argparse.ArgumentParser = sub.choices["server"]
    return server


@pytest.mark.processes
def test_cli_refuses_tcp_beyond_loopback_without_a_token(tmp_path: Path) -> None:
    name = f"tierkv-test-{uuid.uuid4().hex[:10]}"
    res = cli("server", "--rpc-tcp", "0.0.0.0:5555", "--pool-name", name, "--pool-size", "4MiB",
              "--runtime-dir", str(tmp_path / "run"))  # fmt: skip
    assert res.returncode == 2
    assert "auth_token" in res.stderr and "0.0.0.0:5555" in res.stderr
    assert "Traceback" not in res.stderr
    assert not segment_exists(name)
    res = cli("server", "--pool-size", "lots")
    assert res.returncode == 2 and "pool_size" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.processes
def test_a_bad_tier_ends_the_server_with_one_line(tmp_path: Path) -> None:
    name = f"tierkv-test-{uuid.uuid4().hex[:10]}"
    yml = tmp_path / "server.yaml"
    yml.write_text("tiers:\n  - name: redis\n    url: 'http://nowhere'\n")
    common = ["--pool-name", name, "--pool-size", "4MiB", "--runtime-dir", str(tmp_path)]
    for argv, env in (
        (["--tier", "disk:path=/tmp/tierkv-never,capacity=lots"], {}),
        (["--config", str(yml)], {}),
        ([], {"TIERKV_TIERS": "floppy"}),
    ):
        res = subprocess.run(
            [sys.executable, "-m", "tierkv.cli", "server", *common, *argv],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **env},
        )
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2, res.stderr
        assert len(lines) == 1 and lines[0].startswith("tierkv server: "), res.stderr
        assert "tier" in lines[0]
        assert not segment_exists(name)


def test_env_and_yaml_reach_a_real_server(
    server_factory: Callable[..., ServerProcess],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    yml = tmp_path / "server.yaml"
    yml.write_text("chunk_size: 64\nmax_chunks_per_request: 4\n")
    monkeypatch.setenv("TIERKV_CHUNK_SIZE", "128")  # beats the YAML's 64
    srv = server_factory("8MiB", ["--config", str(yml)])
    with srv.client() as client:
        reg = client.register("m", (2, 128, 8), "float16", token_axis=1)
        assert reg.chunk_size == 128 and reg.chunk_bytes == 2 * 128 * 8 * 2
        assert client.lookup(list(range(4 * 128))).total == 4
        with pytest.raises(ServerError, match="more than 4"):  # the YAML's limit
            client.lookup(list(range(5 * 128)))


# -- security of the endpoints -----------------------------------------------------------
TOKEN = "correct horse battery staple"


@dataclass
class TcpServerProcess(ServerProcess):
    """A server on TCP: every interface, with an auth token; tests connect via loopback."""

    port: int = 0

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"


@pytest.fixture
def tcp_server(tmp_path: Path) -> Iterator[TcpServerProcess]:
    port = free_port()
    instance = uuid.uuid4().hex[:10]
    srv = TcpServerProcess(
        instance,
        tmp_path / f"run-{instance}",
        "8MiB",
        ["--rpc-tcp", f"0.0.0.0:{port}", "--auth-token", TOKEN],
        port=port,
    )
    try:
        yield srv.start()
    finally:
        stop_and_clean(srv)


@pytest.mark.processes
def test_tcp_auth_token(tcp_server: TcpServerProcess) -> None:
    srv = tcp_server
    assert not (srv.runtime_dir / "rpc.sock").exists()  # TCP only, no ipc socket
    data = list(range(3, 3 + 2 * 256))
    # Non-ASCII text too: compared as bytes, just a wrong token (not an internal error).
    for token in ("", "wrong", TOKEN[:-1], "pässwört-🔑"):
        with Client(srv.endpoint, auth_token=token, timeout=5.0) as client:
            client.ping()  # liveness needs no token
            # Its own error, not NotRegisteredError (which engines answer by registering
            # again: with a wrong token they would retry forever).
            with pytest.raises(UnauthorizedError, match="auth token") as exc:
                register(client)
            assert exc.value.code is p.ErrorCode.UNAUTHORIZED
            assert "TIERKV_AUTH_TOKEN" in str(exc.value)
            with pytest.raises(ServerError, match="auth token"):
                client.stats()
            assert client.pool is None  # never got to attach the pool
    with Client(srv.endpoint, auth_token=TOKEN, timeout=5.0) as client:
        register(client)
        assert client.store(data, [chunk_data(data, i) for i in range(2)]).stored == [0, 1]
        out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(2)]
        assert client.retrieve(data, out).complete
        for i in range(2):
            np.testing.assert_array_equal(out[i], chunk_data(data, i))
        s = client.stats()
        assert s.clients == 1 and s.errors.get("unauthorized", 0) == 8
        assert "internal" not in s.errors
    # The whole pool is an admin request: a wrong token, non-ASCII or not, is refused.
    for token in ("wrong", "пароль"):
        with (
            Client(srv.endpoint, auth_token=token, timeout=5.0) as admin,
            pytest.raises(ServerError, match="auth token"),
        ):
            admin.clear()


@pytest.mark.processes
def test_ipc_socket_and_pool_modes(tmp_path: Path) -> None:
    instance = uuid.uuid4().hex[:10]
    runtime_dir = tmp_path / f"run-{instance}"
    runtime_dir.mkdir(mode=0o755)  # too open: the server tightens it
    runtime_dir.chmod(0o755)
    srv = ServerProcess(instance, runtime_dir, "4MiB")
    try:
        srv.start()
        sock = runtime_dir / "rpc.sock"
        assert stat.S_ISSOCK(sock.stat().st_mode)
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        assert stat.S_IMODE(runtime_dir.stat().st_mode) == 0o700
        seg = Path(SHM_DIR) / srv.pool_name
        assert stat.S_IMODE(seg.stat().st_mode) == 0o600
        with srv.client() as client:
            register(client)
            client.ping()
    finally:
        stop_and_clean(srv)


@pytest.mark.processes
def test_dev_shm_too_small_is_refused_with_an_actionable_message(tmp_path: Path) -> None:
    free = shutil.disk_usage(SHM_DIR).free
    size = free + 4 * GIB
    name = f"tierkv-test-{uuid.uuid4().hex[:10]}"
    run = tmp_path / "run"
    res = cli("server", "--pool-name", name, "--pool-size", str(size), "--runtime-dir", str(run))
    assert res.returncode != 0
    err = " ".join(res.stderr.split())
    assert "Traceback" not in err
    for words in ("not enough shared memory", SHM_DIR, "--pool-size", "--shm-size=",
                  "emptyDir", "medium: Memory"):  # fmt: skip
        assert words in err, err
    assert not segment_exists(name)  # nothing left behind
    assert not (run / "rpc.sock").exists()


def test_the_ring_and_a_controller_are_one_choice() -> None:
    with pytest.raises(ConfigError, match="two directory modes"):
        config.load(
            env={"TIERKV_CLUSTER_SEEDS": "127.0.0.1:8792", "TIERKV_CONTROLLER": "127.0.0.1:8800"}
        )


def test_the_controller_takes_sizes_like_the_server() -> None:
    from tierkv.controller.config import ControllerConfig

    def controller(*argv: str) -> object:
        return config.load_as(ControllerConfig, build_parser().parse_args(["controller", *argv]))

    cfg = controller("--max-message-bytes", "64MiB")
    assert isinstance(cfg, ControllerConfig) and cfg.max_message_bytes == 64 * MIB
    with pytest.raises(ConfigError, match="max_message_bytes='much': not a size"):
        controller("--max-message-bytes", "much")
    # Below a server's largest report or sync part every full sync was refused.
    with pytest.raises(ConfigError, match="max_message_bytes must be at least"):
        controller("--max-message-bytes", "2MiB")
    # Below one sync part every full sync was refused; its size taken like the others.
    assert controller("--max-sync-bytes", "1GiB").max_sync_bytes == 1024 * MIB  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="max_sync_bytes must be at least"):
        controller("--max-sync-bytes", "1MiB")
    with pytest.raises(ConfigError, match="max_sync_bytes='-1': not a size"):
        controller("--max-sync-bytes", "-1")

    # Its logging options are the server's, checked alike.
    with pytest.raises(ConfigError, match="log_level 'verbose'"):
        controller("--log-level", "verbose")
    with pytest.raises(ConfigError, match="log_format"):
        controller("--log-format", "xml")
    assert controller("--log-level", "WARNING").log_level == "WARNING"
