"""The server's wiring (:mod:`tierkv.server.wiring`): a step that fails stops everything
that started before it, in-process and as the `tierkv server` process."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from support.clusterkit import free_ports
from support.servers import in_process_config
from tierkv import keys
from tierkv.config import ServerConfig
from tierkv.endpoints import EndpointInUseError
from tierkv.pool import segment_exists
from tierkv.server.wiring import Server

# Threads of the parts that start before HTTP: none may outlive a failed start.
PART_THREADS = ("tierkv-eviction", "tierkv-cluster", "tierkv-peer", "tierkv-tier", "tierkv-rpc")


def _config(
    tmp_path: Path, http_port: int, cluster_port: int | None = None
) -> tuple[ServerConfig, str]:
    """A server of an 8 MiB pool; with ``cluster_port``, also a cluster node and a disk tier."""
    cluster: dict[str, object] = {}
    if cluster_port is not None:
        cluster["cluster_seeds"] = f"127.0.0.1:{cluster_port}"
        cluster["cluster_port"] = cluster_port
        cluster["tiers"] = [{"name": "disk", "path": str(tmp_path / "disk"), "capacity": "4MiB"}]
    cfg = in_process_config(tmp_path, http_port=http_port, **cluster)
    return cfg, cfg.instance


def _part_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(PART_THREADS)]


@pytest.mark.processes  # its server's HTTP front is a process
def test_a_failed_start_stops_every_part_that_started(tmp_path: Path) -> None:
    """HTTP is the last part: with its port taken, the pool, eviction, disk tier, cluster
    node (control and data ports), tiering and RPC had all started, and all are stopped."""
    taken = socket.create_server(("127.0.0.1", 0))
    # free_ports: the data port (cluster_port + 1) is free too, so HTTP is what fails.
    cluster_port, http_port = free_ports(2)
    cfg, _ = _config(tmp_path, taken.getsockname()[1], cluster_port)
    before = _part_threads()
    server = Server(cfg)
    try:
        with pytest.raises(EndpointInUseError, match="cannot serve HTTP"):
            server.start()
    finally:
        taken.close()
    assert server.cluster is not None and server.rpc is not None  # they had started
    assert _part_threads() == before
    assert not segment_exists(cfg.resolved_pool_name)
    assert not Path(cfg.rpc_endpoint[len("ipc://") :]).exists()
    for port in (cluster_port, cluster_port + 1):  # control and data ports are free again
        socket.create_server(("127.0.0.1", port)).close()
    # The same configuration starts once the port is free (nothing was left behind).
    cfg2, _ = _config(tmp_path, http_port, cluster_port)
    with Server(cfg2).start_background() as again:
        assert again.cluster is not None and again.cluster.node_id.endswith(str(cluster_port))
    assert _part_threads() == before


@pytest.mark.processes
def test_the_server_process_exits_with_one_line_when_a_part_cannot_start(
    tmp_path: Path,
) -> None:
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    instance = uuid.uuid4().hex[:10]
    pool_name = f"tierkv-test-{instance}"
    (cluster_port,) = free_ports(1)
    try:
        argv = [
            sys.executable, "-m", "tierkv.cli", "server",
            "--instance", instance,
            "--runtime-dir", str(tmp_path / "run"),
            "--pool-name", pool_name,
            "--pool-size", "8MiB",
            "--http-port", str(port),
            "--cluster-seeds", f"127.0.0.1:{cluster_port}",
            "--cluster-port", str(cluster_port),
            "--tier", f"disk:path={tmp_path / 'disk'},capacity=4MiB",
            "--log-level", "error",
        ]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tierkv server: cannot serve HTTP"), lines
    assert not segment_exists(pool_name)
    assert not (tmp_path / "run" / "rpc.sock").exists()


@pytest.mark.parametrize("native", [True, False])
def test_a_server_says_when_it_hashes_token_ids_in_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, native: bool
) -> None:
    """Where tierkv._keychain was not built the server still serves, and says so once at
    start: an operator sees why its lookups of long prompts are slower."""
    monkeypatch.setattr(keys, "NATIVE_CHAIN", native)
    cfg, _ = _config(tmp_path, 0)
    with (
        caplog.at_level(logging.WARNING, logger="tierkv.server.wiring"),
        Server(cfg).start_background(),
    ):
        pass
    said = [r.getMessage() for r in caplog.records if "_keychain" in r.getMessage()]
    assert len(said) == (0 if native else 1)
