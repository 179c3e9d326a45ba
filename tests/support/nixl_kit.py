"""Helpers for the NIXL data-plane tests: a holder's real pool (shared memory + index) as a
chunk source, UCX settings that stand in for a cross-node path, and a holder process.

Run as a script (``python -m support.nixl_kit HOLDER_ARGS``) it is a holder process: a
NixlTransport serving a PoolSource with ``--chunks`` chunks derived from ``--seed``; it
prints one JSON line (its data address, the keys), then obeys commands on stdin, one a line:
``unregister`` (unregister its pool from NIXL), ``clear`` (drop every chunk from the index),
``quit``. Each command is answered with a line ``ok``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest

from tierkv.allocator import Allocator
from tierkv.checksums import checksum
from tierkv.cluster import messages as m
from tierkv.cluster.nixl_agent import unavailable
from tierkv.cluster.transport import Served
from tierkv.index import Holder, ObjectIndex
from tierkv.pool import ShmPool

SHM_DIR = Path("/dev/shm")

TOKEN = "nixl-test-secret"
# UCX over TCP on loopback: what a cross-node path uses (cma, one host's shortcut, is off).
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
WHY_NOT = unavailable()
needs_nixl = pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "nixl")
WRITER = 7  # the engine-like holder that stores test chunks
MARK = b"@holder "  # the holder process's lines for the test (others are NIXL's logs)


def chunk_bytes(seed: int, i: int, size: int) -> bytes:
    """Deterministic bytes of chunk ``i``."""
    import numpy as np

    return np.random.default_rng([seed, i]).integers(0, 256, size, dtype=np.uint8).tobytes()


def chunk_key(seed: int, i: int) -> bytes:
    return seed.to_bytes(16, "little") + i.to_bytes(16, "little")


class PoolSource:
    """A holder's pool: a real shared-memory segment and index; acquire/release read-lock
    chunks as a cluster node does (only committed chunks, at their own slots)."""

    def __init__(self, size: int, name: str = "") -> None:
        self.pool = ShmPool.create(name or f"tierkv-nixl-test-{uuid.uuid4().hex[:10]}", size)
        self.index = ObjectIndex(Allocator(size, 4096))
        self.sums: dict[bytes, bytes] = {}

    def put(self, key: bytes, data: bytes) -> int:
        """Store and commit one chunk; its slot's offset."""
        res = self.index.reserve_write([key], [len(data)], WRITER)
        ((_, offset, length),) = res.slots
        self.pool.view(offset, length)[:] = data
        self.index.commit(res.lease_id, WRITER)
        self.sums[key] = checksum(data)
        return offset

    def offset_of(self, key: bytes) -> int | None:
        lock = self.index.pin([key], WRITER)
        if not lock.slots:
            return None
        self.index.unpin(lock.lease_id, WRITER)
        return lock.slots[0][1]

    def acquire(self, keys: Sequence[bytes], lengths: Sequence[int]) -> Served:
        lock = self.index.lock_read(keys, Holder.PEER_SERVE, prefix=False)
        views: list[memoryview | None] = [None] * len(keys)
        sums = [b""] * len(keys)
        for i, offset, length in lock.slots:
            views[i] = self.pool.view(offset, length).toreadonly()
            sums[i] = self.sums[keys[i]]
        return Served(views, sums, lock.lease_id)

    def release(self, served: Served) -> None:
        served.views.clear()
        if served.handle:
            self.index.release_read(served.handle, Holder.PEER_SERVE)

    def locked(self) -> int:
        return self.index.stats().read_leases

    def close(self) -> None:
        self.pool.close()


def sigstop(pid: int, timeout: float = 20.0) -> None:
    """SIGSTOP ``pid`` and wait (bounded) until every thread of it is stopped: the signal is
    asynchronous, and a thread still running for a moment could answer one more READ."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError):
                stat = Path(f"/proc/{pid}/task/{task}/stat").read_text()
                states.append(stat.rpartition(")")[2].split()[0])
        if states and all(s in ("T", "t") for s in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop: {states}"
        time.sleep(0.005)


def member(address: str, incarnation: int = 1) -> m.MemberInfo:
    return m.MemberInfo(address, address, address, incarnation)


class HolderProcess:
    """A holder in its own process (see the module docstring)."""

    def __init__(self, tmp: Path, seed: int, chunks: int, size: int, *extra: str) -> None:
        env = {**os.environ, **UCX_ENV}
        tests = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([tests, env.get("PYTHONPATH", "")])
        self.log_path = tmp / f"holder-{seed}-{uuid.uuid4().hex[:6]}.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the process
        # Named here, so that stop() can remove the segment of a holder that was killed.
        self.pool_name = f"tierkv-nixl-test-{uuid.uuid4().hex[:10]}"
        cmd = [sys.executable, "-m", "support.nixl_kit", "--seed", str(seed),
               "--chunks", str(chunks), "--size", str(size), "--pool-name", self.pool_name,
               *extra]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env
        )
        assert self.proc.stdout is not None
        line = self._line()
        if not line:
            self.proc.wait(10)
            raise RuntimeError(f"holder exited at start:\n{self.log_path.read_text()}")
        hello = json.loads(line)
        self.address: str = hello["address"]
        self.keys = [bytes.fromhex(k) for k in hello["keys"]]
        self.seed, self.size = seed, size

    def _line(self) -> bytes:
        """The holder's next line for us (NIXL logs to stdout too: those are skipped)."""
        assert self.proc.stdout is not None
        while line := self.proc.stdout.readline():
            if line.startswith(MARK):
                return line[len(MARK) :].strip()
        return b""

    def data(self, i: int) -> bytes:
        return chunk_bytes(self.seed, i, self.size)

    def command(self, what: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(what.encode() + b"\n")
        self.proc.stdin.flush()
        assert self._line() == b"ok"

    def stop(self) -> None:
        """Kill the holder; remove its pool's segment, which a killed process leaves."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.log.close()
        with contextlib.suppress(FileNotFoundError):
            (SHM_DIR / self.pool_name).unlink()


def _holder_main() -> None:
    from tierkv.cluster.nixl_transport import NixlTransport

    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--chunks", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--pool-name", required=True)
    ap.add_argument("--lease-ttl", type=float, default=10.0)
    ap.add_argument("--bad-metadata", action="store_true")
    args = ap.parse_args()
    source = PoolSource(args.chunks * args.size + (4 << 20), args.pool_name)
    keys = [chunk_key(args.seed, i) for i in range(args.chunks)]
    for i, key in enumerate(keys):
        source.put(key, chunk_bytes(args.seed, i, args.size))
    hook = (lambda md: md[: len(md) // 2] + bytes(8)) if args.bad_metadata else None
    transport = NixlTransport(
        "127.0.0.1", 0, "127.0.0.1", TOKEN, "holder", region=source.pool.buf,
        fence=source.index, lease_ttl=args.lease_ttl, metadata_hook=hook, timeout=2.0,
    )  # fmt: skip
    transport.serve(source)
    transport.node_id = transport.address.encode()  # the member member() names
    hello = json.dumps({"address": transport.address, "keys": [k.hex() for k in keys]})
    print(MARK.decode() + hello, flush=True)
    for line in sys.stdin:
        what = line.strip()
        if what == "unregister":
            transport.unregister()
        elif what == "clear":
            source.index.clear()
        elif what == "quit":
            break
        print(MARK.decode() + "ok", flush=True)
    transport.close()
    source.close()


if __name__ == "__main__":
    _holder_main()
