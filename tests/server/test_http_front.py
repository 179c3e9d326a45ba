"""The HTTP front process of a server (tierkv.server.front): it owns the HTTP port, yields
the CPU to the server and engines (nice +10, a long time slice), answers routers' lookups over RPC,
is started again when it dies, and goes with the server; the RPC request it uses refuses
bad input."""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from support.clusterkit import TOKEN, start_node
from support.httputil import free_port, get_json, request
from support.servers import CHUNK_SIZE, ServerProcess, chunk_data, register
from tierkv import protocol as p
from tierkv.client import Client, UnauthorizedError
from tierkv.priority import BACKGROUND_NICE, DATA_SLICE_NS

pytestmark = pytest.mark.processes

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def fronts_of(server_pid: int) -> list[int]:
    """The pids of the HTTP front processes of a server."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"tierkv.server.front" in argv and str(server_pid).encode() in argv:
            found.append(int(entry.name))
    return found


def slice_of(pid: int) -> int | None:
    """The time slice of a process's main thread (None: the kernel does not say)."""
    for line in (Path("/proc") / str(pid) / "sched").read_text().splitlines():
        if line.startswith("se.slice"):
            return int(line.split(":")[1])
    return None


def wait_until(cond: Callable[[], object], what: str, timeout: float = 30.0) -> object:
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return got


def lookup(base: str, tokens: list[int]) -> dict[str, object]:
    body = json.dumps({"model": "test-model", "tokens": tokens}).encode()
    reply = request("POST", base + "/lookup", body, {**AUTH, "Content-Type": "application/json"})
    assert reply.status == 200, reply.body[:300]
    assert reply.headers["cache-control"] == "no-store"
    return reply.json()  # type: ignore[no-any-return]


def test_the_front_serves_the_port_at_a_lower_priority_and_comes_back_when_killed(
    server_factory: Callable[..., ServerProcess],
) -> None:
    port = free_port()
    node = start_node(server_factory, [], seed_self=True, extra=["--http-port", str(port)])
    srv = node.server
    assert srv.proc is not None
    base = f"http://127.0.0.1:{port}"
    (front,) = fronts_of(srv.proc.pid)
    if slice_of(front) is not None:  # it yields its core to the server and the engines
        assert slice_of(front) == DATA_SLICE_NS > slice_of(srv.proc.pid)  # type: ignore[operator]
    server_nice = os.getpriority(os.PRIO_PROCESS, srv.proc.pid)
    assert os.getpriority(os.PRIO_PROCESS, front) == min(19, server_nice + BACKGROUND_NICE)
    tokens = list(range(5, 5 + 3 * CHUNK_SIZE))
    with srv.client(auth_token=TOKEN) as c:
        register(c)
        c.store(tokens, [chunk_data(tokens, i) for i in range(3)])
    (row,) = lookup(base, tokens)["instances"]  # type: ignore[misc]
    assert row["chunks"] == 3 and row["tiers"]["pool"] == 3
    assert get_json(base + "/status")["objects"]["total"] == 3  # passed on to the server
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/status")
    reply = conn.getresponse()
    reply.read()
    assert reply.status == 200 and len(reply.headers.get_all("date") or []) == 1  # (were 2)
    conn.close()

    os.kill(front, signal.SIGKILL)
    again = wait_until(lambda: [p for p in fronts_of(srv.proc.pid) if p != front], "a new front")
    assert isinstance(again, list) and len(again) == 1
    wait_until(lambda: request("GET", base + "/healthcheck").status == 200, "HTTP again")
    assert lookup(base, tokens)["instances"][0]["chunks"] == 3  # type: ignore[index]
    assert "the HTTP front" in srv.log() and "starting another" in srv.log()
    assert "HTTP Request:" not in srv.log()  # no log line per request passed on


def test_the_front_goes_with_the_server(server_factory: Callable[..., ServerProcess]) -> None:
    port = free_port()
    srv = server_factory(extra=["--http-port", str(port)])
    assert srv.proc is not None
    (front,) = fronts_of(srv.proc.pid)
    srv.kill()  # SIGKILL: no shutdown of the server's own
    wait_until(lambda: not Path(f"/proc/{front}").exists(), "the front to exit")
    srv.start()  # the same port is free again
    assert srv.proc is not None and len(fronts_of(srv.proc.pid)) == 1
    assert request("GET", f"http://127.0.0.1:{port}/healthcheck").status == 200
    srv.stop()  # SIGTERM: the front is stopped too
    assert not Path(f"/proc/{front}").exists() and not fronts_of(srv.proc.pid)


def test_router_lookups_over_rpc_refuse_bad_input(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """ROUTER_LOOKUP from any RPC client, not only a well-behaved front: each bad query gets
    its 4xx answer; a wrong token is refused; the server serves on, its chunks intact."""
    node = start_node(server_factory, [], seed_self=True)
    tokens = list(range(9, 9 + 2 * CHUNK_SIZE))
    packed = np.asarray(tokens, "<u4").tobytes()
    with Client(node.server.endpoint, auth_token=TOKEN) as c:
        register(c)
        c.store(tokens, [chunk_data(tokens, i) for i in range(2)])
        status, body = c.router_lookup(p.RouterQuery("test-model", b"", packed, None, 0))
        assert status == 200 and json.loads(body)["instances"][0]["chunks"] == 2
        for bad, code, words in (
            (p.RouterQuery("test-model", b"", packed[:-1], None, 0), 400, "4 bytes each"),
            (p.RouterQuery("", b"", packed, None, 0), 400, "exactly one of model or namespace"),
            (p.RouterQuery("m", b"\0" * 16, packed, None, 0), 400, "exactly one of model"),
            (p.RouterQuery("test-model", b"", None, None, 0), 400, "exactly one of tokens"),
            (p.RouterQuery("", b"\0" * 15, packed, None, 0), 400, "32 hex digits"),
            (p.RouterQuery("", b"\0" * 16, packed, None, 2**40), 400, "chunk_tokens"),
            (p.RouterQuery("test-model", b"", None, [b""], 0), 400, "1-64 bytes"),
            (p.RouterQuery("nobody", b"", packed, None, 0), 404, "no engine of model"),
            (p.RouterQuery("", b"\1" * 16, packed, None, 0), 404, "not registered here"),
        ):
            status, body = c.router_lookup(bad)
            assert status == code and words in json.loads(body)["error"], (bad, body)
    with (
        Client(node.server.endpoint, auth_token="wrong") as thief,
        pytest.raises(UnauthorizedError, match="auth token"),
    ):
        thief.router_lookup(p.RouterQuery("test-model", b"", packed, None, 0))
    with Client(node.server.endpoint, auth_token=TOKEN) as c:
        register(c)
        assert c.lookup(tokens).hits == 2  # the server serves on, its chunks intact


def test_a_server_outside_a_cluster_answers_lookups_with_404(server: ServerProcess) -> None:
    with server.client() as c:
        status, body = c.router_lookup(p.RouterQuery("m", b"", b"", None, 0))
    assert status == 404 and "cluster" in json.loads(body)["error"]
