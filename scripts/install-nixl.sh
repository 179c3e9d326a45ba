#!/usr/bin/env bash
# Install NIXL (the optional one-sided data plane, `--peer-transport nixl`, and its tests) into
# a virtual environment. `make test` runs this once per .venv.
#
#   bash scripts/install-nixl.sh [PYTHON]     (default: .venv/bin/python)
#
# The nixl-cu12 wheel works CPU-only (UCX over TCP or RDMA, no GPU needed), but its declared
# dependencies are some 3 GB of CUDA wheels a CPU node never loads: they are left out
# (--no-deps; numpy, the one it uses, is a tierkv dependency). Plain `nixl` would pull them in.
set -euo pipefail

PY="${1:-.venv/bin/python}"
"$PY" -m pip install -q --no-deps nixl-cu12==1.5.1
"$PY" -c "import nixl_cu12; nixl_cu12.nixl_agent_config()" \
  || { echo "nixl-cu12 installed but does not load" >&2; exit 1; }
echo "nixl-cu12 1.5.1 installed (without its CUDA dependencies)"
