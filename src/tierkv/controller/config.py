"""`tierkv controller` configuration: one typed struct, filled like the server's (defaults,
a YAML file, ``TIERKV_*`` environment, flags; :mod:`tierkv.config`)."""

from __future__ import annotations

import math
from typing import Annotated

import msgspec

from tierkv.cluster.controller_directory import BATCH, MAX_PART_BYTES
from tierkv.config import (
    ConfigError,
    LogFormat,
    LogLevel,
    check_logging,
    http_url,
    is_loopback,
)
from tierkv.controller.service import MAX_SYNC_BYTES
from tierkv.options import Size, option

# The sections of `tierkv controller --help`, in order.
CONTROL = "control"
HTTP = "HTTP"
LIVENESS = "liveness"


class ControllerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The controller's configuration; each field's help and section are beside it."""

    # -- control
    host: Annotated[
        str,
        option(
            CONTROL,
            "address of the controller's control port (TCP); a non-loopback address "
            "requires --auth-token",
        ),
    ] = "127.0.0.1"
    port: Annotated[
        int, option(CONTROL, "the control port servers register, report and look up through")
    ] = 8800
    auth_token: Annotated[
        str,
        option(
            CONTROL,
            "the cluster's shared secret: control messages are signed with it; HTTP admin"
            " requests send it as 'Authorization: Bearer TOKEN'",
        ),
    ] = ""
    max_message_bytes: Annotated[
        Size, option(CONTROL, "largest control message accepted (a full sync part, a report)")
    ] = 256 * 2**20
    max_sync_bytes: Annotated[
        Size,
        option(
            CONTROL,
            "what the full syncs in progress may hold together, all servers' (a server "
            "syncs its keys, 33 bytes each, after it registers); a sync past it is deferred "
            "and its server syncs again later",
        ),
    ] = MAX_SYNC_BYTES
    # -- http
    http_host: Annotated[
        str,
        option(
            HTTP,
            "address of the HTTP server (health, metrics, status); a non-loopback address"
            " requires --auth-token",
        ),
    ] = "127.0.0.1"
    http_port: Annotated[int, option(HTTP, "port of the HTTP server; 0 disables it")] = 8801
    # -- liveness
    heartbeat_interval: Annotated[
        float,
        option(
            LIVENESS,
            "seconds between a server's heartbeats (servers are told by their own option "
            "of the same name; the controller checks liveness this often)",
        ),
    ] = 10.0
    dead_after: Annotated[
        float, option(LIVENESS, "seconds without a heartbeat after which a server is deregistered")
    ] = 30.0
    # -- logging
    log_level: LogLevel = "info"
    log_format: LogFormat = "text"

    @property
    def http_url(self) -> str:
        return http_url(self.http_host, self.http_port)

    def validate(self) -> ControllerConfig:
        if not 0 <= self.port < 65536 or not 0 <= self.http_port < 65536:
            raise ConfigError("port and http_port must be 0-65535 (http_port 0: no HTTP)")
        for name, host in (("host", self.host), ("http_host", self.http_host)):
            if not is_loopback(host) and not self.auth_token:
                raise ConfigError(
                    f"{name} {host!r} is reachable from other hosts: set auth_token "
                    "(--auth-token or TIERKV_AUTH_TOKEN, the cluster's shared secret) or bind "
                    "a loopback address"
                )
        if not (0 < self.heartbeat_interval < self.dead_after and math.isfinite(self.dead_after)):
            raise ConfigError("need 0 < heartbeat_interval < dead_after (seconds)")
        if self.max_message_bytes < MAX_PART_BYTES:
            raise ConfigError(
                f"max_message_bytes must be at least {MAX_PART_BYTES} (a server's report or "
                f"sync part of {BATCH} keys): less refused every full sync"
            )
        if self.max_sync_bytes < MAX_PART_BYTES:
            raise ConfigError(
                f"max_sync_bytes must be at least {MAX_PART_BYTES} (one sync part of {BATCH} "
                "keys): less refused every full sync"
            )
        check_logging(self.log_level, self.log_format)
        return self
