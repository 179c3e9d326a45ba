"""Real external services for tier tests: a `redis-server` process and a moto S3 server.

Both listen on loopback only, on a free port, with their state in a temporary directory, and
are stopped when the test ends. Use the fixtures from a test module with::

    from support.services import redis_server, redis_service  # noqa: F401

``redis_server`` / ``s3_server`` give the URL; ``redis_service`` / ``s3_service`` give the
controlling object, for tests that stop and restart the server. A missing ``redis-server``
fails the test (``make test`` installs it through ``scripts/ensure-system-deps.sh``).

``slots`` gives tier tests real pool memory: a fresh shared-memory pool (``ShmPool``) with a
bump allocator handing out slot views, the same kind of views the server passes to tiers;
``store_random`` / ``load_into`` do a tier's batch round trip through such slots.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest

from support.httputil import free_port
from support.stuck import describe_stuck
from tierkv.demo.local_process import stop_process
from tierkv.pool import ShmPool
from tierkv.tiers.base import LoadStatus, Tier

START_TIMEOUT = 30.0
REPO = Path(__file__).resolve().parents[2]


def _stop(proc: subprocess.Popen[bytes] | None, timeout: float = 10.0) -> None:
    if proc is not None:
        stop_process(proc, timeout)


def _log_tail(path: Path, lines: int = 30, errors: int = 20) -> str:
    """The log's last ``lines`` lines, after the first ``errors`` lines before them that
    name an error (a child's root cause is often far above the traceback that ends a log)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    head, tail = text[:-lines], text[-lines:]
    named = [line for line in head if "Error" in line or "error:" in line][:errors]
    if not named:
        return "\n".join(tail)
    return "\n".join(["(error lines above the tail:)", *named, "(the tail:)", *tail])


_ServiceT = TypeVar("_ServiceT", bound="_Service")


class _Service:
    """A server subprocess on 127.0.0.1 with its log in ``workdir``; ``stop``/``start`` keep
    the port. Subclasses say how to run it (``_argv``, ``_env``) and what answer shows it is
    ready (``_probe``: request bytes, expected reply prefix)."""

    what = "server"
    log_name = "server.log"
    poll_interval = 0.05
    start_timeout = START_TIMEOUT
    _probe: tuple[bytes, bytes] = (b"", b"")

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / self.log_name

    def _argv(self, port: int) -> list[str]:
        raise NotImplementedError

    def _env(self) -> dict[str, str] | None:
        return None

    def start(self: _ServiceT) -> _ServiceT:
        """Start (or restart, on the same port) and wait until it answers the probe."""
        attempts = 1 if self.port else 5  # a fresh port may be taken between probe and bind
        for _ in range(attempts):
            port = self.port or free_port()
            log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the process
            self.proc = subprocess.Popen(
                self._argv(port),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                env=self._env(),
            )
            log.close()
            if self._wait_ready(port):
                self.port = port
                return self
            if self.proc.poll() is None:  # running, but no answer within start_timeout
                state = describe_stuck(self.proc, self.log_path)
                wait = self.start_timeout
                raise RuntimeError(f"{self.what} did not answer in {wait} s:\n{state}")
        raise RuntimeError(f"{self.what} did not start:\n{_log_tail(self.log_path)}")

    def _wait_ready(self, port: int) -> bool:
        assert self.proc is not None
        request, answer = self._probe
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
                    s.sendall(request)
                    if s.recv(64).startswith(answer):
                        return True
            except OSError:
                pass
            time.sleep(self.poll_interval)
        return False

    def stop(self) -> None:
        _stop(self.proc)


def _running(service: type[_ServiceT], prefix: str) -> Iterator[_ServiceT]:
    """A started ``service`` in a fresh temporary directory, stopped (and removed) after."""
    with tempfile.TemporaryDirectory(prefix=prefix) as workdir:
        server = service(Path(workdir))
        try:
            yield server.start()
        finally:
            server.stop()


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


# -- tier round trips ------------------------------------------------------------------------
def new_key() -> bytes:
    """A fresh random 32-byte chunk key."""
    return os.urandom(32)


def store_random(tier: Tier, slots: Slots, sizes: list[int]) -> tuple[list[bytes], list[bytes]]:
    """Store one random chunk of each size under fresh keys (all must be stored): keys, data."""
    keys = [new_key() for _ in sizes]
    chunks = [slots.random(n) for n in sizes]
    results = tier.store([(k, view) for k, (view, _) in zip(keys, chunks, strict=True)])
    assert results == [True] * len(sizes)
    return keys, [data for _, data in chunks]


def load_into(
    tier: Tier, slots: Slots, keys: list[bytes], sizes: list[int]
) -> tuple[list[LoadStatus], list[memoryview]]:
    """Load ``keys`` into fresh slots of ``sizes``: the statuses and the slots."""
    views = [slots.take(n) for n in sizes]
    return tier.load(list(zip(keys, views, strict=True))), views


# -- redis -----------------------------------------------------------------------------------
def redis_server_binary() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    for candidate in ("/usr/bin/redis-server", "/usr/sbin/redis-server"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


class RedisServer(_Service):
    """A `redis-server` on 127.0.0.1 without persistence; ``stop``/``start`` keep the port."""

    what = "redis-server"
    log_name = "redis.log"
    poll_interval = 0.02
    _probe = (b"PING\r\n", b"+PONG")

    def __init__(self, workdir: Path) -> None:
        binary = redis_server_binary()
        if binary is None:
            pytest.fail(
                "redis-server is not installed: run scripts/ensure-system-deps.sh "
                "(`make test` runs it for you)",
                pytrace=False,
            )
        super().__init__(workdir)
        self.binary = binary

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _argv(self, port: int) -> list[str]:
        return [
            self.binary,
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--daemonize", "no",
            "--protected-mode", "yes",
        ]  # fmt: skip

    def command(self, *args: str | bytes) -> bytes:
        """Send one command over a fresh connection, return the raw reply (test setup)."""
        parts = [a.encode() if isinstance(a, str) else a for a in args]
        wire = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
        with socket.create_connection(("127.0.0.1", self.port), timeout=5.0) as s:
            s.sendall(wire)
            return s.recv(1 << 16)


class RedisTlsServer(RedisServer):
    """A `redis-server` that also serves TLS (a self-signed certificate for ``localhost``,
    made here) on a second port; the plain port stays for the readiness probe."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.tls_port = free_port()
        self.cert, self.key = workdir / "cert.pem", workdir / "key.pem"
        _self_signed(self.cert, self.key)

    @property
    def url(self) -> str:
        return f"rediss://localhost:{self.tls_port}/0?ssl_ca_certs={self.cert}"

    def _argv(self, port: int) -> list[str]:
        return [
            *super()._argv(port),
            "--tls-port", str(self.tls_port),
            "--tls-cert-file", str(self.cert),
            "--tls-key-file", str(self.key),
            "--tls-ca-cert-file", str(self.cert),
            "--tls-auth-clients", "no",
        ]  # fmt: skip


def _self_signed(cert_path: Path, key_path: Path) -> None:
    """Write a self-signed certificate for ``localhost`` and its key (PEM)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


@pytest.fixture
def redis_tls_server() -> Iterator[str]:
    """URL (``rediss://``) of a running real redis-server that speaks TLS."""
    for server in _running(RedisTlsServer, "tierkv-redis-tls-"):
        yield server.url


@pytest.fixture
def redis_service() -> Iterator[RedisServer]:
    """A running real redis-server, stopped (and its files removed) after the test."""
    yield from _running(RedisServer, "tierkv-redis-")


@pytest.fixture
def redis_server(redis_service: RedisServer) -> str:
    """URL of a running real redis-server (``redis://127.0.0.1:PORT/0``)."""
    return redis_service.url


# -- S3 (moto server mode) -----------------------------------------------------------------
class S3Server(_Service):
    """moto's S3-compatible HTTP server as a subprocess on 127.0.0.1 (state in memory)."""

    access_key_id = "testing"
    secret_access_key = "testing"
    region = "us-east-1"
    what = "moto server"
    log_name = "moto.log"
    _probe = (b"GET /moto-api/ HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", b"HTTP/1.")

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _argv(self, port: int) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]

    def _env(self) -> dict[str, str]:
        return {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}

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
    yield from _running(S3Server, "tierkv-s3-")


@pytest.fixture(scope="module")
def s3_server(s3_service: S3Server) -> str:
    """Endpoint URL of a running moto S3 server (``http://127.0.0.1:PORT``)."""
    return s3_service.endpoint_url


@pytest.fixture
def s3_service_private() -> Iterator[S3Server]:
    """A moto S3 server for one test only (for tests that stop it)."""
    yield from _running(S3Server, "tierkv-s3-")
