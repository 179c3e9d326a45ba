"""Real `tierkv server` processes for tests (each with its own pool, socket and runtime dir),
and the small chunk layout most tests store."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from support.stuck import FAULTHANDLER, describe_stuck
from tierkv.client import Client, Registration, ServerUnavailableError, wait_for_server
from tierkv.config import ServerConfig, from_mapping
from tierkv.pool import segment_exists


@dataclass
class ServerProcess:
    """A `tierkv server` subprocess started by a test."""

    instance: str
    runtime_dir: Path
    pool_size: str
    extra: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def pool_name(self) -> str:
        return f"tierkv-test-{self.instance}"

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.runtime_dir / 'rpc.sock'}"

    def command(self) -> list[str]:
        return [
            sys.executable, *FAULTHANDLER, "-m", "tierkv.cli", "server",
            "--instance", self.instance,
            "--runtime-dir", str(self.runtime_dir),
            "--pool-name", self.pool_name,
            "--pool-size", self.pool_size,
            "--log-level", "debug",
            "--http-port", "0",  # tests that want HTTP pass a free port in extra
            *self.extra,
        ]  # fmt: skip

    def start(self, timeout: float = 20.0) -> ServerProcess:
        self.log_path = self.runtime_dir.parent / f"{self.instance}-{time.monotonic_ns()}.log"
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        proc = self.proc
        try:
            if not wait_for_server(self.endpoint, timeout, lambda: proc.poll() is not None):
                raise RuntimeError(f"server exited at start-up:\n{self.log()}")
        except ServerUnavailableError:
            state = describe_stuck(proc, self.log_path)
            raise RuntimeError(f"server did not answer in {timeout} s:\n{state}") from None
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def kill(self) -> None:
        """SIGKILL: a crash, leaving the pool segment and socket file behind."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def client(self, **kwargs: object) -> Client:
        return Client(self.endpoint, **kwargs)  # type: ignore[arg-type]


def stop_and_clean(srv: ServerProcess) -> None:
    """Stop a test's server and unlink its pool segment if it left one behind."""
    try:
        srv.stop()
    finally:
        if segment_exists(srv.pool_name):
            from tierkv.pool import _posix_name, _shm_unlink

            _shm_unlink(_posix_name(srv.pool_name))


# Small layout used by most tests: 2 x 256 tokens x 16 float32 = 32 KiB per chunk.
CHUNK_SIZE = 256
CHUNK_SHAPE = (2, CHUNK_SIZE, 16)
CHUNK_DTYPE = "float32"
CHUNK_BYTES = 2 * CHUNK_SIZE * 16 * 4


def register(client: Client, model: str = "test-model", **kwargs: object) -> Registration:
    return client.register(model, CHUNK_SHAPE, CHUNK_DTYPE, token_axis=1, **kwargs)  # type: ignore[arg-type]


def chunk_data(tokens: list[int] | range, chunk: int) -> object:
    """Deterministic KV for a chunk, derived from its tokens (byte-exact checks)."""
    import numpy as np

    toks = np.asarray(tokens[chunk * CHUNK_SIZE : (chunk + 1) * CHUNK_SIZE], dtype=np.float32)
    base = np.broadcast_to(toks[None, :, None], CHUNK_SHAPE)
    return (base * 1.5 + np.arange(16, dtype=np.float32) + chunk).astype(np.float32)


def in_process_config(tmp_path: Path, **settings: object) -> ServerConfig:
    """The configuration of an in-process server (``Server(cfg).start_background()``) of its
    own instance, pool and runtime dir under ``tmp_path``: an 8 MiB pool, HTTP off, unless
    ``settings`` say otherwise."""
    instance = uuid.uuid4().hex[:10]
    mapping: dict[str, object] = {
        "instance": instance,
        "runtime_dir": str(tmp_path / "run"),
        "pool_name": f"tierkv-test-{instance}",
        "pool_size": "8MiB",
        "http_port": 0,
        **settings,
    }
    return from_mapping(mapping)
