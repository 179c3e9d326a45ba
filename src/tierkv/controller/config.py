"""`tierkv controller` configuration: one typed struct, filled like the server's (defaults,
a YAML file, ``TIERKV_*`` environment, flags; :mod:`tierkv.config`)."""

from __future__ import annotations

import math

import msgspec

from tierkv.config import ConfigError, http_url, is_loopback
from tierkv.options import Size


class ControllerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 8800
    auth_token: str = ""
    http_host: str = "127.0.0.1"
    http_port: int = 8801
    heartbeat_interval: float = 10.0
    dead_after: float = 30.0
    max_message_bytes: Size = 256 * 2**20
    log_level: str = "info"
    log_format: str = "text"

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
        if self.max_message_bytes < 4096:
            raise ConfigError("max_message_bytes must be at least 4096")
        if self.log_format not in ("text", "json"):
            raise ConfigError("log_format must be 'text' or 'json'")
        return self


FIELD_HELP: dict[str, str] = {
    "host": "address of the controller's control port (ZMQ); a non-loopback address "
    "requires --auth-token",
    "port": "the control port servers register, report and look up through",
    "auth_token": "the cluster's shared secret: control messages are signed with it; HTTP "
    "admin requests send it as 'Authorization: Bearer TOKEN'",
    "http_host": "address of the HTTP server (health, metrics, status); a non-loopback "
    "address requires --auth-token",
    "http_port": "port of the HTTP server; 0 disables it",
    "heartbeat_interval": "seconds between a server's heartbeats (servers are told by their "
    "own option of the same name; the controller checks liveness this often)",
    "dead_after": "seconds without a heartbeat after which a server is deregistered",
    "max_message_bytes": "largest control message accepted (a full sync part, a report)",
    "log_level": "debug, info, warning or error",
    "log_format": "text or json",
}
