"""Helpers of the tenant-quota tests: a server with HTTP, engines of a tenant, stores,
and the /quota API's writes."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from support.httputil import free_port, request
from support.servers import CHUNK_SIZE, ServerProcess, chunk_data, register
from tierkv.client import Client

Servers = Callable[..., ServerProcess]


def start(server_factory: Servers, *extra: str, pool: str = "16MiB") -> tuple[ServerProcess, str]:
    port = free_port()
    srv = server_factory(pool_size=pool, extra=["--http-port", str(port), *extra])
    return srv, f"http://127.0.0.1:{port}"


def tokens_of(seed: int, chunks: int) -> list[int]:
    return list(range(seed * 1_000_000, seed * 1_000_000 + chunks * CHUNK_SIZE))


def store(client: Client, tokens: list[int], salt: str = "") -> int:
    """Store every chunk; returns how many were skipped (no room / over a hard quota)."""
    n = len(tokens) // CHUNK_SIZE
    result = client.store(tokens, [chunk_data(tokens, i) for i in range(n)], salt=salt)
    return len(result.no_space)


def tenant_client(srv: ServerProcess, tenant: str) -> Client:
    client = srv.client()
    register(client, tenant_salt=tenant, name=f"engine-{tenant or 'none'}")
    return client


def put(base: str, path: str, doc: Any, headers: dict[str, str] | None = None) -> Any:
    body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    return request("PUT", base + path, body, headers)
