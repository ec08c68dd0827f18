#!/usr/bin/env bash
# Create a virtualenv for a CUDA machine with one rollout engine, installed exactly as that engine's release
# requires, then this project around it.
#
# Usage: bash recipes/install/gpu.sh sglang|vllm [VENV_DIR]
#   ENGINE    sglang (sglang==0.5.23) or vllm (vllm==0.32.0): the versions the backends are held to.
#   VENV_DIR  where to create the venv (default: .venv-<engine>-gpu at the repository root).
#   PYTHON    environment variable: the interpreter to build the venv from (default: python3).
#
# Steps:
#   1. the engine alone, with every dependency its wheel names (torch, transformers, its CUDA kernels): pip
#      resolves them from the engine's own pins, e.g. sglang 0.5.23 -> torch==2.14.1, transformers==5.19.0;
#   2. those pins read back from the installed engine's metadata (recipes/install/engine_pins.py) into a pip
#      constraints file, so that
#   3. this project (editable, test extra), deepspeed and ray install without moving anything the engine pinned;
#   4. a check that torch and transformers still satisfy the engine's requirements;
#   5. ninja, flash-attn when FLASH_ATTN=1 (recipes that set attn_implementation flash_attention_2 need it),
#      and DeepSpeed's FusedAdam (the GPU optimizer) built once now: it is JIT-compiled with nvcc, so a machine
#      without a CUDA toolkit (CUDA_HOME) stops here with what is missing, not at the first training step.
# Then `pytest -m gpu` runs the GPU acceptance suite (see the README).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
ENGINE="${1:-}"
case "${ENGINE}" in
    sglang) ENGINE_PIN="sglang==0.5.23"; DIST="sglang" ;;
    vllm) ENGINE_PIN="vllm==0.32.0"; DIST="vllm" ;;
    *) echo "usage: bash recipes/install/gpu.sh sglang|vllm [VENV_DIR] (got '${ENGINE}')" >&2; exit 2 ;;
esac
VENV_DIR="${2:-${REPO_ROOT}/.venv-${ENGINE}-gpu}"
PYTHON="${PYTHON:-python3}"
PINNED=(torch transformers)  # what the engine pins and this project also depends on

say() { echo "[gpu.sh ${ENGINE}] $*"; }

if [ ! -x "${VENV_DIR}/bin/python" ]; then
    say "creating venv ${VENV_DIR} with $(${PYTHON} --version 2>&1)"
    "${PYTHON}" -m venv "${VENV_DIR}"
else
    say "reusing venv ${VENV_DIR}"
fi
PY="${VENV_DIR}/bin/python"
PIP=("${PY}" -m pip install --progress-bar off)

say "installing ${ENGINE_PIN} with the dependencies its wheel requires"
"${PIP[@]}" "${ENGINE_PIN}"

CONSTRAINTS="${VENV_DIR}/engine-constraints.txt"
"${PY}" "${REPO_ROOT}/recipes/install/engine_pins.py" "${DIST}" "${PINNED[@]}" > "${CONSTRAINTS}"
say "${DIST}'s own pins, kept from here on: $(tr '\n' ' ' < "${CONSTRAINTS}")"

say "installing this project (editable, with its test extra), deepspeed and ray under those pins"
"${PIP[@]}" -c "${CONSTRAINTS}" "${ENGINE_PIN}" -e "${REPO_ROOT}[test]" deepspeed ray

say "checking torch and transformers against ${DIST}'s requirements"
"${PY}" "${REPO_ROOT}/recipes/install/engine_pins.py" --check "${DIST}" "${PINNED[@]}"
"${PY}" - "${DIST}" <<'PY'
import importlib.metadata as md
import sys

import torch

import backends
import rlhf_sg

dist = sys.argv[1]
print(f"[gpu.sh] {dist} {md.version(dist)}, torch {torch.__version__} (CUDA {torch.version.cuda}, "
      f"{torch.cuda.device_count()} device(s) visible), transformers {md.version('transformers')}, "
      f"deepspeed {md.version('deepspeed')}, ray {md.version('ray')}")
PY
export PATH="${VENV_DIR}/bin:${PATH}"  # ninja, as DeepSpeed's JIT build calls it
say "installing ninja${FLASH_ATTN:+ and flash-attn}"
"${PIP[@]}" -c "${CONSTRAINTS}" ninja
if [ "${FLASH_ATTN:-0}" = 1 ]; then
    "${PIP[@]}" -c "${CONSTRAINTS}" --no-build-isolation flash-attn
fi
say "checking the CUDA toolkit and building DeepSpeed's FusedAdam once"
"${PY}" - <<'PY'
import os
import shutil
import sys

from torch.utils.cpp_extension import CUDA_HOME

missing = []
if CUDA_HOME is None or not os.path.isfile(os.path.join(CUDA_HOME, "bin", "nvcc")):
    missing.append(f"nvcc (CUDA_HOME={CUDA_HOME!r}: install a CUDA toolkit matching torch's CUDA and set CUDA_HOME)")
if shutil.which("ninja") is None:
    missing.append("ninja (pip install ninja, with the venv's bin on PATH)")
if missing:
    sys.exit("[gpu.sh] DeepSpeed's FusedAdam cannot be built: missing " + "; ".join(missing))
from deepspeed.ops.op_builder import FusedAdamBuilder

FusedAdamBuilder().load()
print("[gpu.sh] FusedAdam built (torch extensions cache); run with the venv's bin on PATH")
PY
say "done: run the GPU acceptance suite with ${VENV_DIR}/bin/python -m pytest -m gpu"
