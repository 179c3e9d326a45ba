"""`tierkv status` and `tierkv clear` against real servers, as an operator runs them."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from support.servers import CHUNK_SHAPE, CHUNK_SIZE, ServerProcess, chunk_data, register

Servers = Callable[..., ServerProcess]


def tierkv(*args: str, stdin: int | None = subprocess.DEVNULL) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tierkv.cli", *args],
        stdin=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def tierkv_on_tty(*args: str, answer: str) -> tuple[int, str]:
    """Run with stdin, stdout and stderr on a pseudo-terminal; type ``answer`` at the prompt."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierkv.cli", *args], stdin=slave, stdout=slave, stderr=slave
    )
    os.close(slave)
    out = b""
    answered = False
    while True:
        ready, _, _ = select.select([master], [], [], 30)
        assert ready, f"no output from tierkv: {out!r}"
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
        if not answered and b"[y/N]" in out:
            os.write(master, answer.encode() + b"\n")
            answered = True
    os.close(master)
    return proc.wait(30), out.decode(errors="replace")


def fill(client: object, n_docs: int = 3) -> int:
    """Store ``n_docs`` documents of 2 chunks; returns the number of chunks."""
    for d in range(n_docs):
        tokens = list(range(d * 10_000, d * 10_000 + 2 * CHUNK_SIZE))
        client.store(tokens, [chunk_data(tokens, i) for i in range(2)])  # type: ignore[attr-defined]
    return 2 * n_docs


def test_status_summarises_pool_lookups_tiers_and_engines(
    server_factory: Servers, tmp_path: Path
) -> None:
    srv = server_factory(extra=["--tier", f"disk:path={tmp_path / 'disk'}", "--http-port", "0"])
    with srv.client() as client:
        register(client, model="model-x", tenant_salt="secret-salt", name="engine-7")
        fill(client)
        tokens = list(range(2 * CHUNK_SIZE)) + list(range(10**6, 10**6 + CHUNK_SIZE))
        assert client.lookup(tokens, request_id="r", wait=True).hits == 2
        out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(3)]
        client.retrieve(request_id="r", out=out)
        done = tierkv("status", "--endpoint", srv.endpoint)
        assert done.returncode == 0, done.stderr
        text = done.stdout
        for line in (
            "pool      ",
            "objects   6 (6 ready",
            "clients   1 registered",
            "lookups   3 chunks, 66.7% hit (hits: pool 2; misses: absent 1)",
            "traffic   192.0 KiB stored, 64.0 KiB retrieved",
            "tier disk",
            "engines   1:",
            "engine-7 (pid ",
            "model-x, float32:2x256x16:t1, rank 0/1 tenant sha256:",
            f"namespace {client.registration.namespace.hex()}",  # type: ignore[union-attr]
        ):
            assert line in text, (line, text)
        assert "secret-salt" not in text and "dashboard" not in text  # HTTP is off here

        as_json = tierkv("status", "--endpoint", srv.endpoint, "--json")
        assert as_json.returncode == 0, as_json.stderr
        doc = json.loads(as_json.stdout)
        assert doc["objects"] == 6 and doc["engines"][0]["name"] == "engine-7"
        assert doc["lookup_hits"]["pool"] == 2 and doc["lookup_misses"]["absent"] == 1


def test_status_shows_the_dashboard_url(server_factory: Servers) -> None:
    from support.httputil import free_port

    port = free_port()
    srv = server_factory(extra=["--http-port", str(port)])
    done = tierkv("status", "--endpoint", srv.endpoint)
    assert done.returncode == 0, done.stderr
    assert f"dashboard http://127.0.0.1:{port}/" in done.stdout
    assert "engines   0" in done.stdout and "lookups   none yet" in done.stdout


@pytest.mark.processes
def test_status_without_a_server_fails_clearly(tmp_path: Path) -> None:
    done = tierkv("status", "--endpoint", f"ipc://{tmp_path}/nothing.sock", "--timeout", "0.5")
    assert done.returncode == 1
    assert "no reply from tierkv server" in done.stderr and "is it running?" in done.stderr


def test_clear_refuses_without_yes_when_not_on_a_terminal(server: ServerProcess) -> None:
    with server.client() as client:
        register(client)
        n = fill(client)
        done = tierkv("clear", "--endpoint", server.endpoint)
        assert done.returncode == 2
        assert "refusing without --yes" in done.stderr
        assert client.stats().objects == n


def test_clear_asks_on_a_terminal(server: ServerProcess) -> None:
    with server.client() as client:
        register(client)
        n = fill(client)
        code, out = tierkv_on_tty("clear", "--endpoint", server.endpoint, answer="n")
        assert code == 1 and "Remove every cached chunk" in out and "cancelled" in out
        assert client.stats().objects == n
        code, out = tierkv_on_tty("clear", "--endpoint", server.endpoint, answer="y")
        assert code == 0 and f"removed {n} objects" in out, out
        assert client.stats().objects == 0


def test_clear_with_yes_empties_the_pool(server: ServerProcess) -> None:
    with server.client() as client:
        register(client)
        n = fill(client)
        done = tierkv("clear", "--endpoint", server.endpoint, "--yes")
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"removed {n} objects"
        stats = client.stats()
        assert stats.objects == 0 and stats.used == 0
        assert client.lookup(list(range(2 * CHUNK_SIZE))).hits == 0
        assert "cleared the cache over RPC (6 objects)" in server.log()


def test_clear_and_status_need_the_token_when_the_server_has_one(
    server_factory: Servers,
) -> None:
    srv = server_factory(extra=["--auth-token", "sesame"])
    refused = tierkv("clear", "--endpoint", srv.endpoint, "--yes")
    assert refused.returncode == 1 and "unauthorized" in refused.stderr
    refused = tierkv("status", "--endpoint", srv.endpoint)
    assert refused.returncode == 1 and "unauthorized" in refused.stderr
    ok = tierkv("clear", "--endpoint", srv.endpoint, "--yes", "--auth-token", "sesame")
    assert ok.returncode == 0 and ok.stdout.strip() == "removed 0 objects"
    ok = tierkv("status", "--endpoint", srv.endpoint, "--auth-token", "sesame")
    assert ok.returncode == 0 and "engines   0" in ok.stdout
