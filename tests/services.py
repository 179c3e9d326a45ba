"""Real external services for tier tests: a `redis-server` process and a moto S3 server.

Both listen on loopback only, on a free port, with their state in a temporary directory, and
are stopped when the test ends. Use the fixtures from a test module with::

    from services import redis_server, redis_service  # noqa: F401

``redis_server`` / ``s3_server`` give the URL; ``redis_service`` / ``s3_service`` give the
controlling object, for tests that stop and restart the server. A missing ``redis-server``
fails the test (``make test`` installs it through ``scripts/ensure-system-deps.sh``).

``slots`` gives tier tests real pool memory: a fresh shared-memory pool (``ShmPool``) with a
bump allocator handing out slot views, the same kind of views the server passes to tiers.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tierkv.pool import ShmPool

START_TIMEOUT = 30.0
REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _stop(proc: subprocess.Popen[bytes] | None, timeout: float = 10.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# -- pool slots ------------------------------------------------------------------------------
class Slots:
    """Slot views carved out of a real shared-memory pool, front to back."""

    def __init__(self, pool: ShmPool, align: int = 64) -> None:
        self.pool = pool
        self.align = align
        self.offset = 0
        self.rng = np.random.default_rng()

    def take(self, size: int) -> memoryview:
        """A writable view of ``size`` fresh (zero) bytes."""
        view = self.pool.view(self.offset, size)
        self.offset += -(-size // self.align) * self.align
        return view

    def random(self, size: int) -> tuple[memoryview, bytes]:
        """A slot filled with random bytes, read-only as tiers get it, and its contents."""
        view = self.take(size)
        data = self.rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        view[:] = data
        return view.toreadonly(), data


@pytest.fixture
def slots() -> Iterator[Slots]:
    """A fresh 32 MiB shared-memory pool (unlinked afterwards) with a slot allocator."""
    pool = ShmPool.create(f"tierkv-test-tier-{os.getpid()}-{time.monotonic_ns()}", 32 << 20)
    try:
        yield Slots(pool)
    finally:
        pool.close()


# -- redis -----------------------------------------------------------------------------------
def redis_server_binary() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    for candidate in ("/usr/bin/redis-server", "/usr/sbin/redis-server"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


class RedisServer:
    """A `redis-server` on 127.0.0.1 without persistence; ``stop``/``start`` keep the port."""

    def __init__(self, workdir: Path) -> None:
        binary = redis_server_binary()
        if binary is None:
            pytest.fail(
                "redis-server is not installed: run scripts/ensure-system-deps.sh "
                "(`make test` runs it for you)",
                pytrace=False,
            )
        self.binary = binary
        self.workdir = workdir
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "redis.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Start (or restart, on the same port) and wait until it answers PING."""
        attempts = 1 if self.port else 5  # a fresh port may be taken between probe and bind
        for _ in range(attempts):
            port = self.port or free_port()
            log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the process
            argv = [
                self.binary,
                "--port", str(port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.workdir),
                "--daemonize", "no",
                "--protected-mode", "yes",
            ]  # fmt: skip
            self.proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
            )
            log.close()
            if self._wait_ready(port):
                self.port = port
                return self
            _stop(self.proc)
        raise RuntimeError(f"redis-server did not start:\n{_log_tail(self.log_path)}")

    def _wait_ready(self, port: int) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return True
            except OSError:
                pass
            time.sleep(0.02)
        return False

    def stop(self) -> None:
        _stop(self.proc)

    def command(self, *args: str | bytes) -> bytes:
        """Send one command over a fresh connection, return the raw reply (test setup)."""
        parts = [a.encode() if isinstance(a, str) else a for a in args]
        wire = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
        with socket.create_connection(("127.0.0.1", self.port), timeout=5.0) as s:
            s.sendall(wire)
            return s.recv(1 << 16)


@pytest.fixture
def redis_service() -> Iterator[RedisServer]:
    """A running real redis-server, stopped (and its files removed) after the test."""
    with tempfile.TemporaryDirectory(prefix="tierkv-redis-") as workdir:
        server = RedisServer(Path(workdir))
        try:
            yield server.start()
        finally:
            server.stop()


@pytest.fixture
def redis_server(redis_service: RedisServer) -> str:
    """URL of a running real redis-server (``redis://127.0.0.1:PORT/0``)."""
    return redis_service.url


# -- S3 (moto server mode) -----------------------------------------------------------------
class S3Server:
    """moto's S3-compatible HTTP server as a subprocess on 127.0.0.1 (state in memory)."""

    access_key_id = "testing"
    secret_access_key = "testing"
    region = "us-east-1"

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "moto.log"

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> S3Server:
        attempts = 1 if self.port else 5
        for _ in range(attempts):
            port = self.port or free_port()
            log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the process
            env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                env=env,
            )
            log.close()
            if self._wait_ready(port):
                self.port = port
                return self
            _stop(self.proc)
        raise RuntimeError(f"moto server did not start:\n{_log_tail(self.log_path)}")

    def _wait_ready(self, port: int) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
                    s.sendall(b"GET /moto-api/ HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                    if s.recv(64).startswith(b"HTTP/1."):
                        return True
            except OSError:
                pass
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        _stop(self.proc)

    def client(self) -> object:
        """A plain boto3 S3 client for this server (test setup and tampering)."""
        import boto3

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key,
        )

    def tier_options(self, bucket: str, **extra: object) -> dict[str, object]:
        """Options for ``create_tier("s3", ...)`` against this server."""
        return {
            "bucket": bucket,
            "endpoint_url": self.endpoint_url,
            "region": self.region,
            "access_key_id": self.access_key_id,
            "secret_access_key": self.secret_access_key,
            **extra,
        }


@pytest.fixture(scope="module")
def s3_service() -> Iterator[S3Server]:
    """A running moto S3 server shared by one test module (use a fresh bucket per test)."""
    with tempfile.TemporaryDirectory(prefix="tierkv-s3-") as workdir:
        server = S3Server(Path(workdir))
        try:
            yield server.start()
        finally:
            server.stop()


@pytest.fixture(scope="module")
def s3_server(s3_service: S3Server) -> str:
    """Endpoint URL of a running moto S3 server (``http://127.0.0.1:PORT``)."""
    return s3_service.endpoint_url


@pytest.fixture
def s3_service_private() -> Iterator[S3Server]:
    """A moto S3 server for one test only (for tests that stop it)."""
    with tempfile.TemporaryDirectory(prefix="tierkv-s3-") as workdir:
        server = S3Server(Path(workdir))
        try:
            yield server.start()
        finally:
            server.stop()
