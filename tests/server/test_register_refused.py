"""A REGISTER the server refuses changes nothing: in particular it binds no tenant (each
binding takes a tenant id and a namespace slot for good), in-process with a real server."""

from __future__ import annotations

from pathlib import Path

from support.raw_rpc import Raw
from support.servers import in_process_config
from tierkv import protocol as p
from tierkv.server.wiring import Server

LAYOUT = p.Layout([2, 4, 256, 64], "float16", token_axis=2)


def test_a_refused_register_binds_no_tenant(tmp_path: Path) -> None:
    with Server(in_process_config(tmp_path, max_clients=1)).start_background() as server:
        tenants = server.index.tenants
        channel = Raw(server.endpoint)
        try:
            first = channel.call(p.Register(1, p.PROTOCOL_VERSION, "m", LAYOUT, tenant_salt="a"))
            assert isinstance(first, p.Registered)
            bound = len(tenants.by_digest)
            refused = channel.call(
                p.Register(2, p.PROTOCOL_VERSION, "m", LAYOUT, tenant_salt="tenant-b")
            )
            assert isinstance(refused, p.Error) and refused.code is p.ErrorCode.LIMIT
            assert len(tenants.by_digest) == bound and tenants.find("tenant-b") is None
        finally:
            channel.close()
