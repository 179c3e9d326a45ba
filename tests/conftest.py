"""Fixtures for every test: real `tierkv server` processes, real services, and the
``processes`` marker.

Tests that start processes (a server, redis-server, an S3 server, engine processes) are
marked ``processes`` (automatically when they use one of the fixtures below, explicitly with
``pytestmark`` otherwise); ``make test-fast`` runs the others, with process creation turned
into an error (``TIERKV_TEST_FAST=1``), so an unmarked test that starts one fails there
instead of slowing the fast loop down.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from support.controllers import ControllerProcess, running_controller
from support.servers import ServerProcess, stop_and_clean

pytest_plugins = ["support.services"]

# Fixtures that start processes: a test using one is marked "processes".
PROCESS_FIXTURES = frozenset(
    {
        "server",
        "server_factory",
        "controller",
        "redis_service",
        "redis_server",
        "s3_service",
        "s3_server",
        "s3_service_private",
    }
)

os.environ.setdefault("TIERKV_TEST", "1")

# Property-based tests are reproducible in `make test`: the same examples every run, no
# example database replaying earlier failures. `make fuzz` explores with fresh seeds
# (`--hypothesis-profile explore`); a failure it finds becomes an @example or a fix.
settings.register_profile("deterministic", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile("deterministic")


def pytest_report_header() -> list[str]:
    """The machine, at the top of every run's output: timings and a failure read with it."""
    model = "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [ln for ln in cpuinfo.read_text().splitlines() if ln.startswith("model name")]
        model = names[0].split(":", 1)[1].strip() if names else model
    flags = cpuinfo.read_text() if cpuinfo.exists() else ""
    isa = [f for f in ("avx512f", "amx_tile", "avx2") if f" {f}" in flags]
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    return [
        f"machine: {os.cpu_count()} cores, {model} ({' '.join(isa)}), OMP_NUM_THREADS {threads}"
    ]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.processes)


@pytest.fixture(autouse=True)
def _no_processes_in_fast_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """In ``make test-fast`` (TIERKV_TEST_FAST=1) starting a process is an error."""
    if os.environ.get("TIERKV_TEST_FAST") != "1":
        return

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(
            "this test starts a process: mark it `processes` (pytestmark) so that "
            "`make test-fast` leaves it to `make test`"
        )

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Start real servers: ``server_factory(pool_size="64MiB", extra=[...])``."""
    servers: list[ServerProcess] = []

    def start(pool_size: str = "64MiB", extra: list[str] | None = None) -> ServerProcess:
        instance = uuid.uuid4().hex[:10]
        runtime_dir = tmp_path / f"run-{instance}"
        srv = ServerProcess(instance, runtime_dir, pool_size, list(extra or []))
        servers.append(srv)
        return srv.start()

    yield start
    for srv in servers:
        stop_and_clean(srv)


@pytest.fixture
def server(server_factory: Callable[..., ServerProcess]) -> ServerProcess:
    """One real server with a 64 MiB pool."""
    return server_factory()


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[ControllerProcess]:
    """A real `tierkv controller` (no HTTP); tests that want its HTTP define their own."""
    with running_controller(tmp_path) as ctl:
        yield ctl
