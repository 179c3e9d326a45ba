#!/usr/bin/env bash
# The vLLM connector's copies between a KV cache on a GPU and pool memory, checked bit for bit
# and measured (benchmarks/gpu_copies.py: Llama-shaped, MLA and hybrid caches, and a hybrid's
# state layers), on a machine with a CUDA device and torch; vLLM is not needed. Installs
# tierkv and its dependencies into that Python (torch is not one of them: the machine's stays),
# building the C helpers, then runs the script. Takes a few minutes on an H100 or H200.
#
#   bash scripts/gpu-copies.sh                  # all kinds, full size
#   bash scripts/gpu-copies.sh --device cpu --small   # the same checks in host memory
#   PYTHON=/path/to/python bash scripts/gpu-copies.sh  # another interpreter (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "gpu-copies: $PY has no torch; install a CUDA build of torch first" >&2
    exit 1
fi
"$PY" -m pip install -q --disable-pip-version-check -e .
exec "$PY" benchmarks/gpu_copies.py "$@"
