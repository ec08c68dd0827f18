"""The same small GRPO run on each rollout backend, per-phase medians side by side.

``python -m rlhf_sg.bench engines [--backends hf,sglang,vllm] [--steps 30] [--algo grpo]``

Each backend runs the quickstart's work (``recipes/quickstart_cpu.py``: a ~3M-parameter Qwen2,
single-digit addition, a 2-rank ZeRO-3 actor, weights synced into the engine after every step) in
its own subprocess, with the Python of the venv its install script builds (``hf``: ``.venv``,
``sglang``: ``.venv-sglang``, ``vllm``: ``.venv-vllm``; ``--python sglang=/path/to/python``
overrides). The runs share one warm-started policy, so they differ only in the engine. The table
gives medians over steps ``--skip + 1`` .. ``--steps`` (start-up steps left out) of the step, its
generate and weight_sync phases, and weight_sync's share of the step, plus each phase's ratio to
the first backend's (``hf``, the embedded engine, by default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENVS = {"hf": ".venv", "sglang": ".venv-sglang", "vllm": ".venv-vllm"}
COLUMNS = ("step", "generate", "weight_sync")


def phase_medians(rows: list[dict], skip: int) -> dict[str, float]:
    """Median seconds of each of :data:`COLUMNS` and the median weight_sync share, over rows after ``skip``."""
    kept = [r for r in rows if r.get("step", 0) > skip] or rows
    if not kept:
        raise ValueError("no metrics rows to summarise")
    medians = {c: statistics.median(r.get(f"time/{c}", 0.0) for r in kept) for c in COLUMNS}
    shares = [r["time/weight_sync"] / r["time/step"] for r in kept if r.get("time/step")]
    medians["share"] = statistics.median(shares) if shares else 0.0
    medians["steps"] = len(kept)
    return medians


def format_table(results: dict[str, dict[str, float]]) -> str:
    """Rows per backend: medians in seconds, the share in %, and each phase's ratio to the first backend."""
    names = list(results)
    base = results[names[0]]
    lines = [
        f"{'backend':<8} {'step s':>8} {'generate s':>11} {'weight_sync s':>14} {'sync share':>11} "
        f"{'step x':>7} {'gen x':>6} {'sync x':>7}"
    ]
    for name in names:
        r = results[name]
        ratios = [r[c] / base[c] if base[c] else float("nan") for c in COLUMNS]
        lines.append(
            f"{name:<8} {r['step']:>8.3f} {r['generate']:>11.3f} {r['weight_sync']:>14.3f} "
            f"{100 * r['share']:>10.1f}% {ratios[0]:>7.2f} {ratios[1]:>6.2f} {ratios[2]:>7.2f}"
        )
    return "\n".join(lines)


def _python_for(backend: str, overrides: dict[str, str]) -> str:
    if backend in overrides:
        return overrides[backend]
    if backend not in VENVS:
        raise SystemExit(f"--backends: unknown backend {backend!r}; known: {sorted(VENVS)}")
    python = os.path.join(REPO, VENVS[backend], "bin", "python")
    if not os.path.exists(python):
        raise SystemExit(
            f"backend {backend!r} runs in {VENVS[backend]}, not found at {python}; build it with its "
            f"recipes/install script or pass --python {backend}=/path/to/python"
        )
    return python


def run_backend(backend: str, python: str, args: argparse.Namespace, out: str) -> dict[str, float]:
    """One quickstart run of ``backend`` in its own venv; returns its :func:`phase_medians`."""
    run_out = os.path.join(out, backend)
    os.makedirs(run_out, exist_ok=True)
    shared_policy = os.path.join(out, "policy_sft")
    if os.path.isdir(shared_policy) and not os.path.exists(os.path.join(run_out, "policy_sft")):
        os.symlink(shared_policy, os.path.join(run_out, "policy_sft"))
    cmd = [
        python,
        os.path.join(REPO, "recipes", "quickstart_cpu.py"),
        "--algo", args.algo, "--steps", str(args.steps), "--backend", backend, "--out", run_out,
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), DS_ACCELERATOR="cpu")
    env.setdefault("OMP_NUM_THREADS", "1")
    log_path = os.path.join(run_out, "run.log")
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout_s)
    if proc.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise SystemExit(f"backend {backend!r}: the quickstart run failed (rc {proc.returncode}); {log_path}:\n{tail}")
    if not os.path.isdir(shared_policy):
        os.symlink(os.path.join(run_out, "policy_sft"), shared_policy)
    with open(os.path.join(run_out, args.algo, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    medians = phase_medians(rows, args.skip)
    print(f"  {backend}: {len(rows)} steps in {time.perf_counter() - start:.0f} s ({log_path})", flush=True)
    return medians


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlhf_sg.bench engines", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="hf,sglang,vllm", help=f"comma-separated, of {sorted(VENVS)}")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=2, help="leading steps left out of the medians")
    parser.add_argument("--algo", default="grpo")
    parser.add_argument("--out", default="runs/bench_engines")
    parser.add_argument("--python", action="append", default=[], metavar="BACKEND=PATH", help="a venv's python")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="the longest one backend's run may take")
    args = parser.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    overrides = dict(item.split("=", 1) for item in args.python)
    pythons = {b: _python_for(b, overrides) for b in backends}  # all checked before the first run
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    print(f"engines: {args.algo} on the quickstart's work, {args.steps} steps, medians over steps {args.skip + 1}+")
    results = {b: run_backend(b, pythons[b], args, out) for b in backends}
    print(time.strftime("measured %Y-%m-%d", time.gmtime()))
    print(format_table(results))


if __name__ == "__main__":
    main(sys.argv[1:])
