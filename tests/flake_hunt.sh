#!/usr/bin/env bash
# Flake hunt: the main suite (the README's test command) N times in a row (default 3) while another process keeps
# one core busy, as CI's is when the engine venvs build beside the suite. Any failure fails the hunt; nothing is
# retried. Prints each run's time and outcome.
#
#   bash tests/flake_hunt.sh [RUNS] [PYTEST ARGS...]     e.g. bash tests/flake_hunt.sh 3
#   PYTHON=.venv/bin/python (default) picks the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
runs="${1:-3}"
shift || true
python="${PYTHON:-.venv/bin/python}"
export OMP_NUM_THREADS=1

# the load: one busy process (a tight loop in its own interpreter), ended with the hunt
"$python" -c "while True: pass" &
load=$!
trap 'kill "$load" 2>/dev/null' EXIT
echo "== flake hunt: ${runs} runs of the main suite, one core kept busy (pid ${load})"

failed=0
times=()
for i in $(seq 1 "$runs"); do
    t0=$SECONDS
    # -v: every test's name and outcome as it ends, so a run cut short still names a failure
    if "$python" -m pytest -v -p no:cacheprovider "$@" > ".flake-hunt-run${i}.log" 2>&1; then outcome=passed
    else outcome=FAILED; failed=$((failed + 1)); fi
    times+=("run ${i}: $((SECONDS - t0)) s, ${outcome}: $(tail -n 1 ".flake-hunt-run${i}.log")")
    echo "${times[-1]}"
    [ "$outcome" = passed ] || grep -E "^(FAILED|ERROR)" ".flake-hunt-run${i}.log"
done
echo "== flake hunt: ${failed} of ${runs} runs failed (logs: .flake-hunt-run*.log)"
[ "$failed" -eq 0 ]
