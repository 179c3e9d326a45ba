"""Small HTTP helpers for tests of a server's HTTP endpoints, and Prometheus text parsing."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from support.ports import free_port as free_port  # where the tests have imported it from


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode()


def request(
    method: str,
    url: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 10.0,
) -> Reply:
    """One HTTP request; error statuses are returned, not raised."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return Reply(resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read())
    except urllib.error.HTTPError as exc:
        return Reply(exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read())


def get_json(url: str) -> Any:
    reply = request("GET", url)
    assert reply.status == 200, (reply.status, reply.body[:500])
    return reply.json()


def wait_for(what: str, probe: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Poll ``probe()`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(base: str) -> Samples:
    reply = request("GET", base + "/metrics")
    assert reply.status == 200, reply.body[:300]
    assert reply.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(reply.text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def val(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def declare_huge_body(
    base: str, method: str, path: str, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    """Send a request that declares a 10 GB body and sends 10 bytes of it: (the status and
    JSON error of the reply, which must come without the rest of the body, and the
    connection closed after it). A server that waits for the body fails this in 10 s."""
    head = {"Content-Length": "10737418240", **(headers or {})}
    return raw_request(base, method, path, head, b"0123456789")


def raw_request(
    base: str, method: str, path: str, headers: dict[str, str], body: bytes
) -> tuple[int, Any]:
    """One request written as is on a fresh connection (``headers`` and ``body`` exactly
    as given, e.g. a Content-Length that lies): the reply's status and JSON body, read up
    to its Content-Length or until the server closes the connection."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.partition(b"\r\n\r\n")[2]) < _length(reply):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, _, content = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(content)


def _length(reply: bytes) -> int:
    """The Content-Length of a reply whose head is in ``reply``."""
    for line in reply.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 1 << 62  # until closed
