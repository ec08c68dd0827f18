#!/usr/bin/env bash
# The GPU acceptance run: every `gpu`-marked test on this node, then one line per test in a table.
#
# Usage (on a fresh GPU node, after `bash recipes/install/gpu.sh sglang|vllm`):
#   bash recipes/gpu/acceptance.sh [VENV_DIR] [extra pytest args]
#   VENV_DIR  the venv gpu.sh made (default: .venv-sglang-gpu at the repository root)
# Exit status: pytest's (0 when every selected test passed or was skipped with its reason).
set -uo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV_DIR="${1:-${REPO_ROOT}/.venv-sglang-gpu}"
shift || true
PY="${VENV_DIR}/bin/python"
[ -x "${PY}" ] || { echo "[acceptance] no python at ${PY}; run recipes/install/gpu.sh first" >&2; exit 2; }
export PATH="${VENV_DIR}/bin:${PATH}"  # ninja for DeepSpeed's JIT ops
REPORT="$(mktemp -d)/gpu-acceptance.xml"

cd "${REPO_ROOT}"
"${PY}" -c "import torch; n = torch.cuda.device_count(); print(f'[acceptance] torch {torch.__version__}, {n} CUDA device(s)'); raise SystemExit(0 if n else 1)" \
    || { echo "[acceptance] no CUDA device visible" >&2; exit 2; }
"${PY}" -m pytest -m gpu -p no:cacheprovider -q -rs --junitxml="${REPORT}" "$@" tests
STATUS=$?
"${PY}" - "${REPORT}" <<'PY'
import sys
import xml.etree.ElementTree as ET

rows = []
for case in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    outcome, why = "passed", ""
    for tag in ("failure", "error", "skipped"):
        node = case.find(tag)
        if node is not None:
            outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
            why = (node.get("message") or "").splitlines()[0][:70] if node.get("message") else ""
            break
    rows.append((f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}", outcome,
                 f"{float(case.get('time', 0)):.1f}", why))
width = max([len(r[0]) for r in rows] + [4])
print(f"\n{'test':<{width}}  {'outcome':<8}  {'s':>6}  reason")
for name, outcome, seconds, why in rows:
    print(f"{name:<{width}}  {outcome:<8}  {seconds:>6}  {why}")
counts = {o: sum(r[1] == o for r in rows) for o in ("passed", "FAILED", "ERROR", "skipped")}
print("  ".join(f"{k}: {v}" for k, v in counts.items()))
PY
exit "${STATUS}"
