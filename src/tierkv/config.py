"""Server configuration: one typed struct, filled from defaults, a YAML file, ``TIERKV_*``
environment variables and command-line flags (later sources win).

Every field's help text and section live next to it (:func:`tierkv.options.option`), and the
command line is generated from the struct, so ``tierkv server --help`` documents every option
with its default, section by section.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Protocol, TypeVar

import msgspec
import yaml

from tierkv.options import MAX_SIZE, OptionError, Size, convert, option, option_help, parse_size
from tierkv.redaction import HIDDEN, redacted_options
from tierkv.runtime_dir import default_runtime_dir
from tierkv.tiers.base import TierError
from tierkv.tiers.registry import tier_options


class ConfigError(OptionError):
    """A configuration value is invalid; the message names the option."""


class TierSpec(msgspec.Struct, forbid_unknown_fields=True):
    """One tier below the pool: its registered name and the options of its factory."""

    name: str
    options: dict[str, Any] = msgspec.field(default_factory=dict)


def parse_tier_spec(value: str | Mapping[str, Any] | TierSpec) -> TierSpec:
    """``disk:path=/var/cache/tierkv,capacity=100GiB`` or a YAML mapping with ``name``."""
    if isinstance(value, TierSpec):
        return value
    if isinstance(value, Mapping):
        opts = {str(k).replace("-", "_"): v for k, v in value.items()}
        name = opts.pop("name", None)
        if not isinstance(name, str) or not name:
            raise ConfigError(f"tier {dict(value)!r} needs a name")
        nested = opts.pop("options", None)
        if isinstance(nested, Mapping):
            opts.update(nested)
        return TierSpec(name, opts)
    name, _, rest = str(value).partition(":")
    options: dict[str, Any] = {}
    for part in filter(None, rest.split(",")):
        key, eq, val = part.partition("=")
        if not eq or not key:
            raise ConfigError(f"tier option {part!r} in {value!r}: expected key=value")
        options[key.strip().replace("-", "_")] = val.strip()
    if not name.strip():
        raise ConfigError(f"tier {value!r}: expected NAME[:key=value,...]")
    return TierSpec(name.strip(), options)


# The sections of `tierkv server --help`, in order.
GENERAL = "general"
RPC_AND_HTTP = "RPC and HTTP"
POOL = "pool"
CLIENTS = "clients"
TIERS = "tiers"
CLUSTER = "cluster"
QUOTAS = "quotas"
LOGGING = "logging"


# The logging options of every process (server, controller), checked alike.
LogLevel = Annotated[str, option(LOGGING, "debug, info, warning or error")]
LogFormat = Annotated[str, option(LOGGING, "text or json")]
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def check_logging(level: str, fmt: str) -> None:
    """ConfigError unless ``level`` is a log level and ``fmt`` a log format."""
    if fmt not in ("text", "json"):
        raise ConfigError("log_format must be 'text' or 'json'")
    if level.lower() not in LOG_LEVELS:
        raise ConfigError(f"log_level {level!r}: use debug, info, warning, error or critical")


class ServerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A server's configuration; each field's help and section are beside it."""

    # -- general
    instance: Annotated[
        str,
        option(
            GENERAL, "name of this server on the node; sets the default pool name and runtime dir"
        ),
    ] = "default"
    runtime_dir: Annotated[
        str,
        option(
            GENERAL,
            "directory for the RPC socket (mode 0700; default "
            "$XDG_RUNTIME_DIR/tierkv/INSTANCE or /tmp/tierkv-UID/tierkv/INSTANCE)",
        ),
    ] = ""
    # -- rpc and http
    rpc_tcp: Annotated[
        str,
        option(
            RPC_AND_HTTP,
            "serve RPC on TCP HOST:PORT instead of the local ipc socket; a non-loopback "
            "host requires --auth-token",
        ),
    ] = ""
    auth_token: Annotated[
        str,
        option(
            RPC_AND_HTTP,
            "shared secret clients must present (required for non-loopback TCP and HTTP; "
            "HTTP admin requests send it as 'Authorization: Bearer TOKEN')",
        ),
    ] = ""
    http_host: Annotated[
        str,
        option(
            RPC_AND_HTTP,
            "address of the HTTP server (health, status, metrics, dashboard); a "
            "non-loopback address requires --auth-token",
        ),
    ] = "127.0.0.1"
    http_port: Annotated[int, option(RPC_AND_HTTP, "port of the HTTP server; 0 disables it")] = 8791
    max_message_bytes: Annotated[
        Size,
        option(
            RPC_AND_HTTP,
            "largest request accepted (a bigger one gets a too_large error and its "
            "connection is closed)",
        ),
    ] = 64 * 2**20
    max_chunks_per_request: Annotated[
        int, option(RPC_AND_HTTP, "most chunks one request may name")
    ] = 16384
    max_connections: Annotated[
        int,
        option(
            RPC_AND_HTTP,
            "open RPC connections at most (each engine process opens one or two); one more "
            "is closed at once",
        ),
    ] = 8192
    connection_buffer_bytes: Annotated[
        Size,
        option(
            RPC_AND_HTTP,
            "bytes all RPC connections together may hold in large requests being received, "
            "and again in replies not yet sent (past it a large request gets a limit error; "
            "the client holding the most unsent replies is disconnected)",
        ),
    ] = 2**30
    workers: Annotated[int, option(RPC_AND_HTTP, "threads for requests that may block")] = 4
    # -- pool
    pool_name: Annotated[
        str, option(POOL, "name of the shared-memory segment (default tierkv-UID-INSTANCE)")
    ] = ""
    pool_size: Annotated[
        Size, option(POOL, "size of the shared-memory pool, e.g. 512MiB, 8GiB")
    ] = 2 * 2**30
    prefault: Annotated[
        bool, option(POOL, "allocate and map every page of the pool at start-up")
    ] = False
    chunk_size: Annotated[int, option(POOL, "tokens per chunk")] = 256
    alignment: Annotated[Size, option(POOL, "slot alignment in bytes (a power of two)")] = 4096
    high_watermark: Annotated[
        float, option(POOL, "pool usage fraction above which eviction starts")
    ] = 0.8
    low_watermark: Annotated[
        float, option(POOL, "pool usage fraction eviction brings the pool down to")
    ] = 0.7
    eviction_interval: Annotated[
        float, option(POOL, "seconds between eviction and lock-expiry passes")
    ] = 0.1
    # -- clients
    write_ttl: Annotated[
        float,
        option(
            CLIENTS,
            "seconds an uncommitted store reservation lasts (its slots come back once its "
            "client ends it or goes away, one write TTL later at the latest: the client may "
            "still be copying into them)",
        ),
    ] = 600.0
    read_ttl: Annotated[
        float,
        option(
            CLIENTS,
            "seconds before an unreleased read lock expires (a copy that outlasts it counts "
            "as a miss)",
        ),
    ] = 300.0
    session_ttl: Annotated[float, option(CLIENTS, "seconds an idle lookup session is kept")] = 300.0
    client_idle_ttl: Annotated[
        float,
        option(
            CLIENTS,
            "seconds after which a client the server cannot watch (another host or pid "
            "namespace, pid 0) is dropped, with its locks, if it sent nothing",
        ),
    ] = 3600.0
    max_clients: Annotated[
        int, option(CLIENTS, "registered clients at most; REGISTER beyond it is refused")
    ] = 4096
    client_reservation_share: Annotated[
        float,
        option(
            CLIENTS,
            "fraction of the pool one client's open store reservations may hold; chunks "
            "beyond it are refused like a full pool",
        ),
    ] = 0.5
    chunk_feed_events: Annotated[
        int,
        option(
            CLIENTS,
            "events the chunk feed keeps for engines that read it late (KV events for "
            "routers); one further behind reads a snapshot instead",
        ),
    ] = 65536
    # -- tiers
    tiers: Annotated[
        list[TierSpec],
        option(
            TIERS,
            "a tier below the pool, NAME[:key=value,...], in lookup order; repeat the "
            "flag for several (e.g. disk:path=/var/cache/tierkv,capacity=100GiB or "
            "redis:url=redis://h:6379)",
        ),
    ] = msgspec.field(default_factory=list)
    tier_workers: Annotated[
        int, option(TIERS, "threads doing tier I/O (write-behind and prefetch)")
    ] = 4
    write_behind_max_bytes: Annotated[
        Size,
        option(TIERS, "most bytes queued for tier writes; beyond it new chunks skip the tiers"),
    ] = 2**30
    prefetch_max_inflight: Annotated[
        int, option(TIERS, "most prefetches from the tiers running at once")
    ] = 16
    prefetch_timeout: Annotated[
        float, option(TIERS, "seconds after which an unfinished prefetch is reported as done")
    ] = 10.0
    # -- cluster
    cluster_seeds: Annotated[
        str,
        option(
            CLUSTER,
            "join a cluster of servers: HOST:PORT,... of some members' cluster ports (the"
            " first server may list itself); empty: no cluster",
        ),
    ] = ""
    controller: Annotated[
        str,
        option(
            CLUSTER,
            "join a cluster through a `tierkv controller` at HOST:PORT (its control port)"
            " instead of the servers' consistent-hash ring; exclusive with cluster_seeds",
        ),
    ] = ""
    cluster_host: Annotated[
        str,
        option(
            CLUSTER,
            "address the cluster control and data ports bind; a non-loopback address "
            "requires --auth-token (the cluster's shared secret)",
        ),
    ] = "127.0.0.1"
    cluster_port: Annotated[
        int, option(CLUSTER, "port of the cluster control traffic (membership, directory)")
    ] = 8792
    cluster_data_port: Annotated[
        int,
        option(CLUSTER, "port of the cluster data plane (chunk transfers); 0: cluster_port + 1"),
    ] = 0
    cluster_advertise: Annotated[
        str,
        option(
            CLUSTER,
            "host peers reach this server at (default: cluster_host, or this host's "
            "address when binding all interfaces)",
        ),
    ] = ""
    heartbeat_interval: Annotated[float, option(CLUSTER, "seconds between cluster heartbeats")] = (
        1.0
    )
    member_ttl: Annotated[
        float,
        option(
            CLUSTER, "seconds without a heartbeat after which a cluster member is declared dead"
        ),
    ] = 5.0
    directory_replicas: Annotated[
        int, option(CLUSTER, "cluster members holding each directory entry")
    ] = 2
    ring_vnodes: Annotated[
        int, option(CLUSTER, "virtual nodes per member on the directory's consistent-hash ring")
    ] = 160
    directory_repair_interval: Annotated[
        float,
        option(
            CLUSTER,
            "in ring mode, seconds between a node's checks that every directory owner "
            "lists exactly the chunks it published (a summary per owner; entries an owner"
            " lost or lists wrong are sent again); 0: never",
        ),
    ] = 5.0
    peer_connections: Annotated[int, option(CLUSTER, "most data-plane connections to one peer")] = (
        16
    )
    peer_timeout: Annotated[
        float,
        option(
            CLUSTER, "seconds a cluster request or transfer may stall before it counts as failed"
        ),
    ] = 2.0
    peer_transport: Annotated[
        str,
        option(
            CLUSTER,
            "how peers read chunks from this server's pool and it from theirs: tcp, or nixl "
            "(one-sided NIXL/UCX READs under leases, scripts/install-nixl.sh; per peer, TCP "
            "where either side lacks NIXL or it fails; UCX_TLS and UCX_NET_DEVICES choose "
            "the UCX transports)",
        ),
    ] = "tcp"
    peer_lease_ttl: Annotated[
        float,
        option(
            CLUSTER,
            "with peer_transport nixl, seconds a peer's lease on chunk slots lasts unless "
            "released (the slots stay locked meanwhile; a reader never reads past it)",
        ),
    ] = 10.0
    commit_publish_timeout: Annotated[
        float,
        option(
            CLUSTER,
            "in a cluster, seconds a store's commit waits until the directory has its "
            "chunks, so that a lookup on any other node finds them as soon as the store "
            "returns (read-your-writes, what prefill/decode disaggregation needs); 0: "
            "reply at once, the chunks reach the directory moments later",
        ),
    ] = 2.0
    # -- quotas
    quotas: Annotated[
        dict[str, int],
        option(
            QUOTAS,
            "a tenant's pool quota, NAME=SIZE (NAME: the engine's tenant salt, or the "
            "cache salt of engines without one; ~default: chunks without any salt); "
            "repeat the flag for several",
        ),
    ] = msgspec.field(default_factory=dict)
    default_quota: Annotated[
        str, option(QUOTAS, "pool quota of every tenant without its own: unlimited or a size")
    ] = "unlimited"
    disk_quotas: Annotated[
        dict[str, int],
        option(
            QUOTAS,
            "a tenant's disk-tier quota, NAME=SIZE (names as for --quota); repeat the "
            "flag for several",
        ),
    ] = msgspec.field(default_factory=dict)
    default_disk_quota: Annotated[
        str, option(QUOTAS, "disk-tier quota of every tenant without its own: unlimited or a size")
    ] = "unlimited"
    quota_mode: Annotated[
        str,
        option(
            QUOTAS,
            "soft: a tenant over its quota loses its own oldest chunks; hard: its stores "
            "beyond the quota are refused (skipped like a full pool)",
        ),
    ] = "soft"
    quota_file: Annotated[
        str,
        option(
            QUOTAS,
            "where quotas changed live (HTTP /quota, tierkv quota) are kept across "
            "restarts (default: RUNTIME_DIR/quotas.json)",
        ),
    ] = ""
    # -- logging
    log_level: LogLevel = "info"
    log_format: LogFormat = "text"

    # -- derived ---------------------------------------------------------------------------
    @property
    def resolved_runtime_dir(self) -> str:
        return self.runtime_dir or default_runtime_dir(self.instance)

    @property
    def resolved_pool_name(self) -> str:
        return self.pool_name or f"tierkv-{os.getuid()}-{self.instance}"

    @property
    def resolved_quota_file(self) -> str:
        return self.quota_file or os.path.join(self.resolved_runtime_dir, "quotas.json")

    @property
    def default_quota_bytes(self) -> int | None:
        """The default pool quota in bytes (None: unlimited)."""
        return _quota_bytes(self.default_quota)

    @property
    def default_disk_quota_bytes(self) -> int | None:
        """The default disk quota in bytes (None: unlimited)."""
        return _quota_bytes(self.default_disk_quota)

    @property
    def rpc_endpoint(self) -> str:
        """The RPC endpoint the server binds and clients connect to (``ipc://PATH`` or
        ``tcp://HOST:PORT``)."""
        if self.rpc_tcp:
            return f"tcp://{self.rpc_tcp}"
        return f"ipc://{os.path.join(self.resolved_runtime_dir, 'rpc.sock')}"

    def validate(self) -> ServerConfig:
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.instance):
            raise ConfigError(f"instance {self.instance!r}: use letters, digits, '_', '.', '-'")
        if self.pool_size < self.alignment:
            raise ConfigError(f"pool_size {self.pool_size} is smaller than one aligned slot")
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise ConfigError(f"alignment {self.alignment} is not a power of two")
        if self.chunk_size <= 0:
            raise ConfigError("chunk_size must be positive")
        if not 0.0 < self.low_watermark <= self.high_watermark <= 1.0:
            raise ConfigError("watermarks must satisfy 0 < low_watermark <= high_watermark <= 1")
        for name in (
            "eviction_interval",
            "write_ttl",
            "read_ttl",
            "session_ttl",
            "client_idle_ttl",
            "prefetch_timeout",
        ):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):  # NaN and inf too
                raise ConfigError(f"{name} must be a positive number of seconds, got {value}")
        if self.max_clients < 1:
            raise ConfigError("max_clients must be at least 1")
        if not 0.0 < self.client_reservation_share <= 1.0:
            raise ConfigError("client_reservation_share must be in (0, 1]")
        if self.workers < 1 or self.tier_workers < 1:
            raise ConfigError("workers and tier_workers must be at least 1")
        if self.chunk_feed_events < 1:
            raise ConfigError("chunk_feed_events must be at least 1")
        if self.prefetch_max_inflight < 0:
            raise ConfigError("prefetch_max_inflight must be >= 0 (0: no prefetch)")
        if self.write_behind_max_bytes < 0:
            raise ConfigError("write_behind_max_bytes must be >= 0 (0: no write-behind)")
        if self.max_message_bytes < 4096 or self.max_chunks_per_request < 1:
            raise ConfigError("max_message_bytes >= 4096 and max_chunks_per_request >= 1")
        if self.max_connections < 1:
            raise ConfigError("max_connections must be at least 1")
        if self.connection_buffer_bytes < self.max_message_bytes:
            raise ConfigError(
                "connection_buffer_bytes must be at least max_message_bytes (or a request of "
                "the largest size could never be received)"
            )
        check_logging(self.log_level, self.log_format)
        self._validate_tiers()
        self._validate_quotas()
        if self.cluster_seeds and self.controller:
            raise ConfigError(
                "cluster_seeds and controller are two directory modes: set one of them "
                "(the consistent-hash ring among the servers, or a `tierkv controller`)"
            )
        if self.controller and _host_of(self.controller) is None:
            raise ConfigError(f"controller {self.controller!r} is not HOST:PORT")
        if self.cluster_seeds or self.controller:
            self._validate_cluster()
        if self.rpc_tcp:
            host = _host_of(self.rpc_tcp)
            if host is None:
                raise ConfigError(f"rpc_tcp {self.rpc_tcp!r}: expected HOST:PORT (port 1-65535)")
            if not is_loopback(host) and not self.auth_token:
                raise ConfigError(
                    f"rpc_tcp {self.rpc_tcp!r} is reachable from other hosts: set auth_token "
                    "(--auth-token or TIERKV_AUTH_TOKEN) or bind a loopback address"
                )
        if not 0 <= self.http_port < 65536:
            raise ConfigError(f"http_port {self.http_port}: use 1-65535, or 0 to disable HTTP")
        if self.http_port and not self.http_host:
            raise ConfigError("http_host must name an address to bind (e.g. 127.0.0.1)")
        if self.http_port and not is_loopback(self.http_host) and not self.auth_token:
            raise ConfigError(
                f"http_host {self.http_host!r} is reachable from other hosts: set auth_token "
                "(--auth-token or TIERKV_AUTH_TOKEN; POST endpoints then need 'Authorization: "
                "Bearer TOKEN') or bind a loopback address"
            )
        return self

    @property
    def http_url(self) -> str:
        """Where the HTTP server listens ("" when disabled)."""
        return http_url(self.http_host, self.http_port)

    def _validate_tiers(self) -> None:
        """Each tier's options checked and typed now, before anything is opened."""
        seen: set[str] = set()
        for spec in self.tiers:
            if spec.name in seen:
                raise ConfigError(
                    f"tiers: {spec.name!r} is configured twice (each tier name once: tiers "
                    "are reported and found by name)"
                )
            seen.add(spec.name)
            try:
                spec.options = tier_options(spec.name, spec.options)
            except TierError as exc:
                raise ConfigError(f"tiers: {exc}") from None

    def _validate_quotas(self) -> None:
        if self.quota_mode not in ("soft", "hard"):
            raise ConfigError(f"quota_mode {self.quota_mode!r}: use soft or hard")
        for field, text in (
            ("default_quota", self.default_quota),
            ("default_disk_quota", self.default_disk_quota),
        ):
            try:
                _quota_bytes(text)
            except OptionError as exc:
                raise ConfigError(
                    f"{field}: {exc}; use 'unlimited' or a size such as 8GiB"
                ) from None
        for field, quotas in (("quotas", self.quotas), ("disk_quotas", self.disk_quotas)):
            for name, limit in quotas.items():
                if not name or len(name) > 1024:
                    raise ConfigError(f"{field}: a tenant name is 1 to 1024 characters")
                if not 0 <= limit <= MAX_SIZE:
                    raise ConfigError(f"{field}: {name}={limit}: a quota is 0 to 8 EiB")
        if "~other" in self.disk_quotas:
            raise ConfigError(
                "disk_quotas: ~other holds the disk chunks whose tenant is not known yet: it "
                "takes no disk quota"
            )

    def _validate_cluster(self) -> None:
        for seed in self.cluster_seeds.split(","):
            if seed.strip() and _host_of(seed.strip()) is None:
                raise ConfigError(f"cluster_seeds: {seed.strip()!r} is not HOST:PORT")
        for name in ("cluster_port", "cluster_data_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ConfigError(f"{name} must be 0-65535")
        if not (0 < self.heartbeat_interval < self.member_ttl and math.isfinite(self.member_ttl)):
            raise ConfigError("need 0 < heartbeat_interval < member_ttl (seconds)")
        if not (self.peer_timeout > 0 and math.isfinite(self.peer_timeout)):
            raise ConfigError("peer_timeout must be a positive number of seconds")
        if self.peer_transport not in ("tcp", "nixl"):
            raise ConfigError(f"peer_transport must be tcp or nixl, not {self.peer_transport!r}")
        if not (0.01 <= self.peer_lease_ttl <= 86400):  # sent in ms, as 32 bits
            raise ConfigError("peer_lease_ttl must be 0.01 to 86400 seconds")
        if not (self.commit_publish_timeout >= 0 and math.isfinite(self.commit_publish_timeout)):
            raise ConfigError("commit_publish_timeout must be >= 0 seconds (0: do not wait)")
        if not (
            self.directory_repair_interval >= 0 and math.isfinite(self.directory_repair_interval)
        ):
            raise ConfigError("directory_repair_interval must be >= 0 seconds (0: never)")
        if self.directory_replicas < 1 or self.ring_vnodes < 1 or self.peer_connections < 1:
            raise ConfigError("directory_replicas, ring_vnodes and peer_connections must be >= 1")
        if not is_loopback(self.cluster_host) and not self.auth_token:
            raise ConfigError(
                f"cluster_host {self.cluster_host!r} is reachable from other hosts: set "
                "auth_token (--auth-token or TIERKV_AUTH_TOKEN), the cluster's shared secret"
            )


def _host_of(address: str) -> str | None:
    """The host of ``HOST:PORT`` (port 1-65535), or None when it is not one."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def http_url(host: str, port: int) -> str:
    """The URL of an HTTP server on ``host``:``port`` ("" for port 0: no HTTP server)."""
    if not port:
        return ""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _tier_specs(raw: Any) -> list[Any]:
    """``tiers`` from flags (a list of specs), the environment (one string, specs separated
    by ';') or YAML (a list of specs or mappings), as TierSpec builtins."""
    if isinstance(raw, str):
        raw = [part for part in raw.split(";") if part.strip()]
    if not isinstance(raw, list):
        raise ConfigError("tiers must be a list of NAME[:key=value,...] or mappings")
    return [msgspec.to_builtins(parse_tier_spec(item)) for item in raw]


def _quota_bytes(text: str) -> int | None:
    """A default quota's bytes: None for ``unlimited``."""
    text = text.strip()
    return None if text.lower() == "unlimited" else parse_size(text)


def _quota_specs(raw: Any) -> dict[str, Any]:
    """``quotas`` from flags (a list of NAME=SIZE), the environment (one string, entries
    separated by ';') or YAML (a mapping of name: size), as a mapping of name -> bytes."""
    if isinstance(raw, str):
        raw = [part for part in raw.split(";") if part.strip()]
    if isinstance(raw, list):
        pairs: dict[str, Any] = {}
        for item in raw:
            name, eq, size = str(item).rpartition("=")
            if not eq or not name.strip():
                raise ConfigError(f"quota {item!r}: expected NAME=SIZE (e.g. acme=8GiB)")
            pairs[name.strip()] = size.strip()
        raw = pairs
    if not isinstance(raw, Mapping):
        raise ConfigError("quotas must be a mapping of tenant: size, or NAME=SIZE entries")
    out: dict[str, Any] = {}
    for name, size in raw.items():
        try:
            out[str(name)] = parse_size(size) if isinstance(size, str) else size
        except OptionError as exc:
            raise ConfigError(f"quotas: {name}: {exc}") from None
    return out


class _Validating(Protocol):
    def validate(self) -> Any: ...


C = TypeVar("C", bound=_Validating)


def env_var(name: str) -> str:
    """The environment variable of the configuration field ``name`` (``TIERKV_POOL_SIZE``)."""
    return f"TIERKV_{name.upper()}"


def _fields(cls: type = ServerConfig) -> list[tuple[str, Any, Any]]:
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    return [(f.name, f.type, f.default) for f in info.fields]


def add_arguments(
    parser: argparse.ArgumentParser, cls: type = ServerConfig, what: str = "server"
) -> None:
    """One flag per field of ``cls`` (a configuration struct whose fields carry their
    section and help, :func:`tierkv.options.option`), in a group per section, defaulting to
    None so unset flags do not override other sources."""
    top = parser.add_argument_group(f"{what} configuration (flags > TIERKV_* env > --config)")
    top.add_argument("--config", metavar="FILE", help="YAML file with any of the options below")
    groups: dict[str, Any] = {}
    for name, typ, default in _fields(cls):
        section, helps = option_help(typ)
        if not helps:
            raise TypeError(f"{cls.__name__}.{name} has no help: annotate it with option()")
        group = groups.get(section)
        if group is None:
            group = groups[section] = parser.add_argument_group(f"{what}: {section}")
        if isinstance(typ, msgspec.inspect.Metadata):
            typ = typ.type
        flag = "--" + name.replace("_", "-")
        shown = "none" if default is msgspec.NODEFAULT else (default if default != "" else '""')
        help_text = f"{helps} (default: {shown}; env {env_var(name)})"
        if name == "tiers":
            group.add_argument(
                "--tier",
                dest=name,
                action="append",
                default=None,
                metavar="NAME[:K=V,...]",
                help=help_text.replace("env TIERKV_TIERS", "env TIERKV_TIERS, ';'-separated"),
            )
        elif name in ("quotas", "disk_quotas"):
            env_name = f"env {env_var(name)}"
            group.add_argument(
                "--" + name[:-1].replace("_", "-"),
                dest=name,
                action="append",
                default=None,
                metavar="NAME=SIZE",
                help=help_text.replace(env_name, f"{env_name}, ';'-separated"),
            )
        elif isinstance(typ, msgspec.inspect.BoolType):
            group.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            group.add_argument(flag, dest=name, default=None, metavar=name.upper(), help=help_text)


def load(
    args: argparse.Namespace | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> ServerConfig:
    """Build the configuration: defaults < YAML file < environment < flags < overrides."""
    return load_as(ServerConfig, args, env, overrides)


def load_as(
    cls: type[C],
    args: argparse.Namespace | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> C:
    """A configuration struct ``cls``: defaults < YAML < environment < flags < overrides."""
    env = os.environ if env is None else env
    merged: dict[str, Any] = {}
    path = getattr(args, "config", None) or env.get("TIERKV_CONFIG")
    if path:
        try:
            with open(path, encoding="utf-8") as fh:
                data = yaml.safe_load(fh) or {}
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of option: value")
        merged.update({str(k).replace("-", "_"): v for k, v in data.items()})
    names = [name for name, _, _ in _fields(cls)]
    for name in names:
        value = env.get(env_var(name))
        if value is not None:
            merged[name] = value
    if args is not None:
        for name in names:
            value = getattr(args, name, None)
            if value is not None:
                merged[name] = value
    merged.update(overrides or {})
    return from_mapping_as(cls, merged)


def from_mapping(values: Mapping[str, Any]) -> ServerConfig:
    return from_mapping_as(ServerConfig, values)


def from_mapping_as(cls: type[C], values: Mapping[str, Any]) -> C:
    given = dict(values)
    if "tiers" in given:
        given["tiers"] = _tier_specs(given["tiers"])
    for name in ("quotas", "disk_quotas"):
        if name in given:
            given[name] = _quota_specs(given[name])
    try:
        cfg: C = convert(given, cls, what="invalid configuration")  # type: ignore[type-var]
    except OptionError as exc:
        raise ConfigError(str(exc)) from None
    cfg.validate()
    return cfg


def as_dict(cfg: ServerConfig, redact: Sequence[str] = ("auth_token",)) -> dict[str, Any]:
    """The effective configuration, secrets redacted (for /status and logs): the auth
    token, and the tiers' credentials (by option name, and the userinfo of URLs)."""
    out: dict[str, Any] = msgspec.to_builtins(cfg)
    for name in redact:
        if out.get(name):
            out[name] = HIDDEN
    for tier in out.get("tiers", []):
        tier["options"] = redacted_options(tier.get("options", {}))
    return out
