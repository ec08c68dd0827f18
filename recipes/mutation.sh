#!/usr/bin/env bash
# Mutation testing of the library's core (rlhf_sg/algorithms.py, packing.py, config.py, sync/*.py) with mutmut.
#
#   pip install -e '.[test,mutation]'
#   bash recipes/mutation.sh            # every mutant; about 1.5 h on 2 shared CPU cores
#   bash recipes/mutation.sh 'rlhf_sg.sync.plan*'   # only mutants whose names match (mutmut globs)
#
# mutmut rewrites source files, so it never runs in this tree: the repository (without .git, runs/, virtual
# environments) is copied to $MUTATION_DIR (default: a new temporary directory) and mutmut runs there, with
# the settings of [tool.mutmut] in pyproject.toml (the modules, the tests that import them). Re-running with the
# same MUTATION_DIR keeps earlier results: only mutants not yet decided (or those named) run again.
# One worker process (MUTATION_WORKERS to change). Prints killed / total per module at the end; equivalent
# mutants (no behaviour change) are listed in tests/mutation_equivalents.md.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
WORK="${MUTATION_DIR:-$(mktemp -d -t rlhf_sg-mutation-XXXXXX)}"
WORKERS="${MUTATION_WORKERS:-1}"

if ! "$PYTHON" -c "import mutmut" 2>/dev/null; then
    echo "mutmut is not installed for $PYTHON: pip install -e '.[mutation]'" >&2
    exit 1
fi
MUTMUT="$(dirname "$("$PYTHON" -c 'import sys; print(sys.executable)')")/mutmut"

mkdir -p "$WORK"
# copy the tree; keep mutmut's earlier results (mutants/) in $WORK
(cd "$REPO" && tar --exclude=./.git --exclude=./runs --exclude='./.venv*' --exclude=./mutants \
    --exclude='__pycache__' --exclude=./.hypothesis -cf - .) | tar -xf - -C "$WORK"
echo "mutation run in $WORK (source: $REPO)"

cd "$WORK"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" RAY_ADDRESS="${RAY_ADDRESS:-local}"
start=$(date +%s)
"$MUTMUT" run --max-children "$WORKERS" "$@" || true  # mutmut's exit status is not the score
echo "mutmut took $(( $(date +%s) - start )) s"

"$PYTHON" - <<'EOF'
"""killed / total per mutated module, from mutmut's per-file results (mutants/<file>.meta)."""
import glob
import json
from collections import Counter

# mutmut's exit codes (mutmut.stats.status_by_exit_code): 1, 3 a test failed (killed); 0 survived; 5, 33 no
# test ran it; None not run yet; timed out (36, 24, -24, 152, 255) or crashed the test process (-9, -11): the
# tests did not pass with the mutant, counted as killed
KILLED = {1, 3, 36, 24, -24, 152, 255, -9, -11}
print(f"{'module':32} {'killed':>7} {'total':>6} {'score':>7}  survived  no-tests  not-run")
for meta in sorted(glob.glob("mutants/rlhf_sg/**/*.py.meta", recursive=True)):
    codes = list(json.load(open(meta))["exit_code_by_key"].values())
    if not codes:
        continue
    c = Counter(codes)
    killed = sum(n for code, n in c.items() if code in KILLED)
    total = len(codes)
    module = meta[len("mutants/"):-len(".meta")]
    print(f"{module:32} {killed:7d} {total:6d} {100 * killed / total:6.1f}%  {c[0]:8d}  {c[33] + c[5]:8d}  {c[None]:7d}")
EOF
echo "survivors: cd $WORK && $MUTMUT results; one mutant's diff: $MUTMUT show <name>"
