"""Packaging: `python -m build` makes an sdist and a wheel of tierkv; both install into a
fresh virtual environment where no C compiler works (CC=/bin/false): the wheel carries the C
helpers built here, the sdist installs without them (they are optional) and tierkv then
hashes the same keys in Python and copies with numpy. And `tierkv --version` states the
wire protocol version.

The fresh environment installs tierkv's dependencies from the package index (about 20 s),
with this environment's pip (``pip --python``: the fresh one has no pip of its own); the
wheel is built without build isolation, with this environment's setuptools.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import tierkv
from tierkv import keys
from tierkv.protocol import PROTOCOL_VERSION

pytestmark = pytest.mark.processes
ROOT = Path(__file__).resolve().parents[2]
VERSION_LINE = f"tierkv {tierkv.__version__} (wire protocol {PROTOCOL_VERSION})"
# Printed by the fresh environment's Python: which native helpers it has, and a key chain.
PROBE = """
import numpy as np
import tierkv.arraycopy, tierkv.keys, tierkv.server.app, tierkv.controller.app, tierkv.client
packed = np.arange(1024, dtype="<u4").tobytes()
keys = tierkv.keys.chunk_keys(bytes(range(16)), packed, 256)
print(tierkv.keys.NATIVE_CHAIN, tierkv.arraycopy.STREAMING, b"".join(keys).hex())
"""


def run(cmd: list[str], cwd: Path, **env: str) -> str:
    """Run outside the repository, without this test's PYTHONPATH (it would shadow the
    installed tierkv with the sources)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out = subprocess.run(
        cmd, cwd=cwd, env={**clean, **env}, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, f"{cmd}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def expected_probe() -> str:
    """The key chain PROBE prints, computed here (with the C helper where it is built)."""
    import numpy as np

    packed = np.arange(1024, dtype="<u4").tobytes()
    return b"".join(keys.chunk_keys(bytes(range(16)), packed, 256)).hex()


def test_tierkv_version_states_the_wire_protocol(tmp_path: Path) -> None:
    out = run(
        [sys.executable, "-m", "tierkv.cli", "--version"], tmp_path, PYTHONPATH=str(ROOT / "src")
    )
    assert out.strip() == VERSION_LINE
    assert f"wire protocol {PROTOCOL_VERSION}" in VERSION_LINE


def test_sdist_and_wheel_install_without_a_c_compiler(tmp_path: Path) -> None:
    # The sources as a clean checkout has them (no built helpers, no caches).
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    ignore = shutil.ignore_patterns("*.so", "__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "src", source / "src", ignore=ignore)
    dist = tmp_path / "dist"
    run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(source)],
        tmp_path,
    )
    (sdist,) = dist.glob("tierkv-*.tar.gz")
    (wheel,) = dist.glob("tierkv-*.whl")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for needed in ("setup.py", "src/tierkv/_keychain.c", "src/tierkv/_streamcopy.c",
                   "src/tierkv/web/dashboard.html", "src/tierkv/controller/dashboard.html",
                   "src/tierkv/py.typed"):  # fmt: skip
        assert needed in names, needed
    with zipfile.ZipFile(wheel) as whl:
        files = set(whl.namelist())
    assert {"tierkv/web/dashboard.html", "tierkv/controller/dashboard.html"} <= files

    # A fresh environment without pip of its own (installing it costs seconds): this
    # environment's pip installs into it (``--python``).
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path)
    python = str(venv / "bin" / "python")
    pip = [sys.executable, "-m", "pip", "--python", python]
    no_compiler = {"CC": "/bin/false", "CXX": "/bin/false"}
    # The wheel: nothing to compile; its dependencies come from the index.
    run([*pip, "install", "-q", str(wheel)], tmp_path, **no_compiler)
    assert run([str(venv / "bin" / "tierkv"), "--version"], tmp_path).strip() == VERSION_LINE
    native, streaming, chain = run([python, "-c", PROBE], tmp_path).split()
    built_here = any(n.startswith("tierkv/_keychain.") and n.endswith(".so") for n in files)
    assert native == str(built_here) and chain == expected_probe()

    # The sdist, where the compiler fails: tierkv installs without its C helpers.
    run(
        [*pip, "install", "-q", "--force-reinstall", "--no-deps", str(sdist)],
        tmp_path,
        **no_compiler,
    )
    site = run(
        [python, "-c", "import tierkv, os; print(os.path.dirname(tierkv.__file__))"], tmp_path
    )
    assert list(Path(site.strip()).glob("*.so")) == []
    assert run([str(venv / "bin" / "tierkv"), "--version"], tmp_path).strip() == VERSION_LINE
    native, streaming, chain = run([python, "-c", PROBE], tmp_path).split()
    assert (native, streaming) == ("False", "False")
    assert chain == expected_probe()  # the Python fallback hashes the same keys
