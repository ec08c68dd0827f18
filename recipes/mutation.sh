#!/usr/bin/env bash
# Mutation testing of the library's core with mutmut, one module at a time.
#
#   pip install -e '.[test,mutation]'
#   bash recipes/mutation.sh packing                       # one module, with only the tests that import it
#   bash recipes/mutation.sh transports 'rlhf_sg.sync.transports.x_DiskTransport*'   # some of its mutants (mutmut globs)
#   bash recipes/mutation.sh all                           # every module in turn
#
# Modules (the file mutated; the tests run against each mutant):
#   algorithms  rlhf_sg/algorithms.py    tests/test_algorithms.py tests/test_algorithms_spec.py
#   advantages  rlhf_sg/advantages.py    tests/test_advantages_spec.py
#   packing     rlhf_sg/packing.py       tests/test_packing.py tests/test_packing_spec.py tests/test_shared_prompts.py
#   engine      backends/embedded.py     tests/test_engine_kv.py (the KV buffers and decode attention: pass their
#                                        mutant globs, e.g. 'backends.embedded.xǁKVBuffersǁ*')
#   config      rlhf_sg/config.py        tests/test_config_data.py tests/test_config_rules.py
#   plan, syncer, gather, transports     rlhf_sg/sync/<name>.py   tests/test_weight_sync.py tests/test_sync_spec.py
#                                        (less the source scan test_no_code_passes_a_timeout_to_a_collectives_wait)
#
# mutmut rewrites source files, so it never runs in this tree: the repository (without .git, runs/, virtual
# environments) is copied to $MUTATION_DIR/<module> (MUTATION_DIR default: a new temporary directory) and
# mutmut runs there with [tool.mutmut] of pyproject.toml, its only_mutate and test selection replaced by the
# module's. Re-running with the same MUTATION_DIR keeps earlier results: only mutants of functions that
# changed since, and those not yet decided, run again. One worker process (MUTATION_WORKERS to change).
# Prints killed / total for the module and the run's time; equivalent mutants (no behaviour change) are
# listed in tests/mutation_equivalents.md.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
BASE="${MUTATION_DIR:-$(mktemp -d -t rlhf_sg-mutation-XXXXXX)}"
WORKERS="${MUTATION_WORKERS:-1}"
MODULES="algorithms advantages packing config plan syncer gather transports engine"

usage() {
    echo "usage: bash recipes/mutation.sh MODULE [MUTANT_GLOB ...]; MODULE is one of: $MODULES, all" >&2
    exit 2
}
[ $# -ge 1 ] || usage
module="$1"
shift
if [ "$module" = all ]; then
    [ $# -eq 0 ] || { echo "mutant globs go with one module, not with 'all'" >&2; exit 2; }
    for m in $MODULES; do MUTATION_DIR="$BASE" bash "$0" "$m"; done
    exit 0
fi

case "$module" in
    algorithms) mutate=rlhf_sg/algorithms.py; tests="tests/test_algorithms.py tests/test_algorithms_spec.py" ;;
    advantages) mutate=rlhf_sg/advantages.py; tests="tests/test_advantages_spec.py" ;;
    packing) mutate=rlhf_sg/packing.py; tests="tests/test_packing.py tests/test_packing_spec.py tests/test_shared_prompts.py" ;;
    config) mutate=rlhf_sg/config.py; tests="tests/test_config_data.py tests/test_config_rules.py" ;;
    engine) mutate=backends/embedded.py; tests="tests/test_engine_kv.py" ;;
    plan | syncer | gather | transports)
        # less the scan of the source tree for waits with a timeout: it reads files and runs no sync code
        mutate="rlhf_sg/sync/$module.py"; tests="tests/test_weight_sync.py tests/test_sync_spec.py --deselect
            tests/test_weight_sync.py::test_no_code_passes_a_timeout_to_a_collectives_wait" ;;
    *) echo "unknown module '$module'" >&2; usage ;;
esac

if ! "$PYTHON" -c "import mutmut" 2>/dev/null; then
    echo "mutmut is not installed for $PYTHON: pip install -e '.[mutation]'" >&2
    exit 1
fi
MUTMUT="$(dirname "$("$PYTHON" -c 'import sys; print(sys.executable)')")/mutmut"

WORK="$BASE/$module"
mkdir -p "$WORK"
# copy the tree; keep mutmut's earlier results (mutants/) in $WORK
(cd "$REPO" && tar --exclude=./.git --exclude=./runs --exclude='./.venv*' --exclude=./mutants \
    --exclude='__pycache__' --exclude=./.hypothesis -cf - .) | tar -xf - -C "$WORK"
# the copy's [tool.mutmut]: this module only, and only the tests that import it
"$PYTHON" - "$WORK/pyproject.toml" "$mutate" $tests <<'EOF'
import re
import sys

path, mutate, tests = sys.argv[1], sys.argv[2], sys.argv[3:]
text = open(path).read()
start = text.index("[tool.mutmut]")
end = text.find("\n[", start + 1)
end = len(text) if end < 0 else end
section = text[start:end]
section, n1 = re.subn(r"(?m)^only_mutate\s*=\s*\[[^\]]*\]", f"only_mutate = [{mutate!r}]".replace("'", '"'), section)
section, n2 = re.subn(r"(?ms)^pytest_add_cli_args_test_selection\s*=\s*\[[^\]]*\]",
                      "pytest_add_cli_args_test_selection = [" + ", ".join(f'"{t}"' for t in tests) + "]", section)
if (n1, n2) != (1, 1):
    sys.exit(f"{path}: [tool.mutmut] needs one only_mutate and one pytest_add_cli_args_test_selection list")
open(path, "w").write(text[:start] + section + text[end:])
EOF
echo "mutation run of $mutate in $WORK (source: $REPO; tests: $tests)"

cd "$WORK"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" RAY_ADDRESS="${RAY_ADDRESS:-local}"
start=$(date +%s)
"$MUTMUT" run --max-children "$WORKERS" "$@" || true  # mutmut's exit status is not the score
seconds=$(( $(date +%s) - start ))

"$PYTHON" - "$mutate" "$seconds" <<'EOF'
"""killed / total for the module, from mutmut's per-file results (mutants/<file>.meta)."""
import json
import sys
from collections import Counter

mutate, seconds = sys.argv[1], int(sys.argv[2])
# mutmut's exit codes (mutmut.stats.status_by_exit_code): 1, 3 a test failed (killed); 0 survived; 5, 33 no
# test ran it; None not run yet; timed out (36, 24, -24, 152, 255) or crashed the test process (-9, -11): the
# tests did not pass with the mutant, counted as killed
KILLED = {1, 3, 36, 24, -24, 152, 255, -9, -11}
codes = list(json.load(open(f"mutants/{mutate}.meta"))["exit_code_by_key"].values())
c = Counter(codes)
killed = sum(n for code, n in c.items() if code in KILLED)
total = len(codes)
print(f"{'module':26} {'killed':>7} {'total':>6} {'score':>7}  survived  no-tests  not-run  run time")
print(f"{mutate:26} {killed:7d} {total:6d} {100 * killed / max(total, 1):6.1f}%  {c[0]:8d}  {c[33] + c[5]:8d}  "
      f"{c[None]:7d}  {seconds // 60} min {seconds % 60} s")
EOF
echo "survivors: cd $WORK && $MUTMUT results; one mutant's diff: $MUTMUT show <name>"
