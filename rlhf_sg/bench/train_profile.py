"""Where a training phase's time goes, against the ceiling the accounting divides by.

``python -m rlhf_sg.bench train-profile [--trace FILE] [--arch qwen2] [--size 25m] [--threads N]``

Without ``--trace``, it runs the e2e bench's GRPO side for one warm-up and one profiled step
(``bench e2e --sides grpo --warmup 1 --steps 1 --profile-dir DIR``) and reads its actor rank 0's trace. With
``--trace``, it reads a trace a run wrote (``--log.profile_step K``: ``OUTPUT_DIR/profile/stepK+1.rankR.json``), and
the run's ``metrics.jsonl`` beside that folder when it is there.

A CPU rank's trace holds each update phase in a span (``rlhf_sg.update/actor``, ``rlhf_sg.update/critic``); the ops
inside it, by their own time (an op's time less the ops it called):

- **matmuls** (``mm``, ``addmm``, ``bmm``, ``baddbmm``): their FLOPs counted from the recorded shapes, and their rate;
- **attention**: the scaled-dot-product kernels, forward and backward;
- **fused kernels**: the compiled graphs (``--model.fused_kernels``);
- **optimizer**: every op under the optimizer's step;
- **communication**: gloo / NCCL calls;
- **other ops**: the rest (elementwise, copies, gathers, allocations);
- **idle**: the span's time with no op running on its thread (Python between ops).

Then the accounting's ceiling (:func:`rlhf_sg.flops.measure_cpu_ceiling`: a 1024-row GEMM of the model's MLP shape,
the fastest of five timings), and the step's own matmul shapes timed the same way, each called again and again on
the same tensors: in the step the matmuls read what the ops before them wrote, so the ratio of the two rates is what
that costs. Then the ceiling's GEMM called back to back for as long as the span (at most 30 s), over that whole
time: the ceiling is its fastest short window, and on a shared host the rate a CPU holds over seconds is lower by
however much its speed moves; the step's matmuls pay that too. "if only the matmuls took time" is the phase's model
FLOPs over the matmuls' seconds: what no change to the other ops can pass.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import glob
import json
import os
import re
import tempfile

import torch

from rlhf_sg.flops import _best_seconds, measure_cpu_ceiling
from rlhf_sg.workers import UPDATE_SPAN_PREFIX as SPAN_PREFIX  # the span a rank holds each update phase in

MATMULS = {"aten::mm": 0, "aten::addmm": 1, "aten::bmm": 0, "aten::baddbmm": 1}  # name -> where its operands start
#: the ceiling's readings before and after further apart than this: a warning that the fractions mix moments
MOVED_WARNING = 0.10
#: the longest the sustained GEMM runs (a long span's whole length would add minutes)
SUSTAINED_MAX_S = 30.0
CLASSES = ("matmuls", "attention", "fused kernels", "optimizer", "communication", "other ops")


@dataclasses.dataclass
class PhaseProfile:
    """One update span of a trace: its wall time, each class's own time, the matmuls by shape."""

    span_s: float
    seconds: dict[str, float]  # class -> seconds (CLASSES)
    idle_s: float  # the span's time with no op running on its thread
    matmuls: dict[tuple[int, int, int, int], list[float]]  # (batch, m, k, n) -> [calls, seconds]
    other: dict[str, float]  # the other ops' own seconds by name

    @property
    def matmul_flops(self) -> float:
        return sum(2.0 * b * m * k * n * calls for (b, m, k, n), (calls, _) in self.matmuls.items())


def _matmul_shape(name: str, dims: list) -> tuple[int, int, int, int]:
    """(batch, m, k, n) of a matmul op from its recorded input dims."""
    first = MATMULS[name]
    a, b = dims[first], dims[first + 1]
    if len(a) == 2:
        return 1, a[0], a[1], b[1]
    return a[0], a[1], a[2], b[2]


def _classify(name: str, ancestors: list[str]) -> str:
    if any(a.startswith("Optimizer.step") for a in ancestors) or name.startswith("Optimizer.step"):
        return "optimizer"
    if name in MATMULS:
        return "matmuls"
    if "scaled_dot_product" in name:  # the composite sdpa op and the CPU kernels it calls
        return "attention"
    if "CompiledFxGraph" in name:
        return "fused kernels"
    if name.startswith(("gloo:", "nccl:", "record_param_comms")):
        return "communication"
    return "other ops"


def read_phase(path: str, role: str = "actor") -> PhaseProfile:
    """The ``rlhf_sg.update/{role}`` span of the Chrome trace at ``path`` (a CPU rank's, with shapes recorded)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    if any(e.get("cat") == "kernel" for e in events):
        raise ValueError(f"{path}: a GPU rank's trace (it holds device kernels); this reads CPU ranks' op times. "
                         "Open it in Perfetto or chrome://tracing")
    ops = [e for e in events if e.get("ph") == "X" and "dur" in e]
    spans = [e for e in ops if e.get("name") == f"{SPAN_PREFIX}{role}"]
    if not spans:
        found = sorted({e["name"] for e in ops if str(e.get("name", "")).startswith(SPAN_PREFIX)})
        raise ValueError(f"{path}: no {SPAN_PREFIX}{role} span (found: {found or 'none'}); profile a step with "
                         f"--log.profile_step on a {role} rank of this version")
    span = spans[0]
    start, end = span["ts"], span["ts"] + span["dur"]
    inside = sorted((e for e in ops if e is not span and e["pid"] == span["pid"] and e["tid"] == span["tid"]
                     and start <= e["ts"] and e["ts"] + e["dur"] <= end),
                    key=lambda e: (e["ts"], -e["dur"]))
    seconds = dict.fromkeys(CLASSES, 0.0)
    other: dict[str, float] = collections.defaultdict(float)
    matmuls: dict[tuple[int, int, int, int], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    stack: list[dict] = []  # the ops open at the current one, outermost first
    own: dict[int, float] = {}  # id(event) -> its time less its children's
    top_level = 0.0
    for e in inside:
        while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
            stack.pop()
        if stack:
            own[id(stack[-1])] -= e["dur"]
        else:
            top_level += e["dur"]
        own[id(e)] = e["dur"]
        e["_ancestors"] = [s["name"] for s in stack]
        stack.append(e)
    for e in inside:
        kind = _classify(e["name"], e["_ancestors"])
        seconds[kind] += own[id(e)] / 1e6
        if kind == "other ops":
            other[e["name"]] += own[id(e)] / 1e6
        if kind == "matmuls":
            dims = e.get("args", {}).get("Input Dims")
            if dims is None:
                raise ValueError(f"{path}: its ops have no shapes; profile with record_shapes=True (this version's "
                                 "--log.profile_step does)")
            entry = matmuls[_matmul_shape(e["name"], dims)]
            entry[0] += 1
            entry[1] += own[id(e)] / 1e6
    return PhaseProfile(span_s=span["dur"] / 1e6, seconds=seconds, idle_s=(span["dur"] - top_level) / 1e6,
                        matmuls=dict(matmuls), other=dict(other))


@dataclasses.dataclass
class HotMatmuls:
    """The step's largest matmul shapes timed as the ceiling is: their FLOPs in the step, the seconds the step's calls
    of them would take at those rates, and the seconds they took in the step."""

    flops: float
    hot_s: float
    step_s: float
    shapes: int


def time_hot(phase: PhaseProfile, threads: int, min_total_s: float, share: float = 0.99) -> HotMatmuls:
    """Time the step's largest matmul shapes, up to ``share`` of its matmul FLOPs, each as the ceiling is timed (the
    fastest of five timings, the same tensors called again and again) with ``threads`` torch threads."""
    by_flops = sorted(phase.matmuls.items(), key=lambda kv: -kv[0][0] * kv[0][1] * kv[0][2] * kv[0][3] * kv[1][0])
    hot = HotMatmuls(0.0, 0.0, 0.0, 0)
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        for (b, m, k, n), (calls, step_s) in by_flops:
            if hot.flops >= share * phase.matmul_flops:
                break
            x, w = torch.randn(b, m, k), torch.randn(b, k, n)
            if b == 1:
                x, w = x[0], w[0]
            matmul = torch.mm if b == 1 else torch.bmm
            hot.hot_s += calls * _best_seconds(lambda: matmul(x, w), min_total_s, 5)  # noqa: B023 (called here)
            hot.step_s += step_s
            hot.flops += 2.0 * b * m * k * n * calls
            hot.shapes += 1
    finally:
        torch.set_num_threads(before)
    return hot


def sustained_gemm(shape, threads: int, seconds: float, tokens: int = 1024) -> float:
    """TFLOP/s of the ceiling's GEMM (:func:`rlhf_sg.flops.measure_cpu_ceiling`: ``[tokens, hidden] x [hidden,
    intermediate]``, float32) called back to back for ``seconds``, over that whole time: what this CPU holds over a
    phase, where the ceiling is the fastest of a few short windows. On a shared host the two differ by how much its
    speed moves."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        a, b = torch.randn(tokens, shape.hidden_size), torch.randn(shape.hidden_size, shape.intermediate_size)
        per_call = _best_seconds(lambda: torch.mm(a, b), seconds, repeats=1)  # one timing: the mean over it all
    finally:
        torch.set_num_threads(before)
    return 2.0 * tokens * shape.hidden_size * shape.intermediate_size / per_call / 1e12


def step_metrics(trace: str) -> dict | None:
    """The metrics.jsonl record of the step a trace profiled (``RUN/profile/stepS.rankR.json`` -> ``RUN/metrics.jsonl``,
    the record of step S), or None."""
    match = re.fullmatch(r"step(\d+)\.rank\d+\.json", os.path.basename(trace))
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(trace))), "metrics.jsonl")
    if match is None or not os.path.isfile(path):
        return None
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return next((r for r in records if r.get("step") == int(match.group(1))), None)


def report(phase: PhaseProfile, ceiling_tflops: float, hot: HotMatmuls | None, metrics: dict | None,
           sustained: tuple[float, float] | None = None) -> list[str]:
    """The printed lines: the table, the step's matmuls against the same shapes timed hot, the ceiling's GEMM
    sustained (``sustained``: its TFLOP/s and the seconds it ran), the phase against the ceiling."""
    mm_s, mm_flops = phase.seconds["matmuls"], phase.matmul_flops
    header = ("where the time goes", "seconds", "share", "TFLOP", "TFLOP/s", "of ceiling")
    lines = ["  {:<22} {:>8} {:>7} {:>7} {:>8} {:>11}".format(*header)]
    for kind in (*CLASSES, "idle"):
        s = phase.idle_s if kind == "idle" else phase.seconds[kind]
        row = f"  {kind:<22} {s:>8.3f} {s / phase.span_s:>7.1%}"
        if kind == "matmuls" and mm_s > 0:
            rate = mm_flops / mm_s / 1e12
            row += f" {mm_flops / 1e12:>7.3f} {rate:>8.3f} {rate / ceiling_tflops:>11.1%}"
        lines.append(row)
    lines.append(f"  {'the span':<22} {phase.span_s:>8.3f}")
    largest = sorted(phase.other.items(), key=lambda kv: -kv[1])[:6]
    if largest:
        lines.append("other ops, the largest: " + ", ".join(f"{name.removeprefix('aten::')} {s:.3f} s"
                                                            for name, s in largest))
    if hot is not None and hot.hot_s > 0 and hot.step_s > 0:
        hot_rate, step_rate = hot.flops / hot.hot_s / 1e12, hot.flops / hot.step_s / 1e12
        lines.append(f"the step's matmul shapes ({hot.shapes}, {hot.flops / mm_flops:.0%} of its matmul FLOPs) timed "
                     f"as the ceiling is, on the same tensors again and again: {hot_rate:.3f} TFLOP/s "
                     f"({hot_rate / ceiling_tflops:.1%} of the ceiling); in the step they ran at {step_rate:.3f} "
                     f"({step_rate / hot_rate:.1%} of that)")
    if sustained:
        rate, seconds = sustained
        lines.append(f"the ceiling's GEMM back to back for {seconds:.2f} s (the span: {phase.span_s:.2f} s): "
                     f"{rate:.3f} TFLOP/s, {rate / ceiling_tflops:.1%} of the ceiling (its fastest short window): what "
                     "this CPU holds over a phase, which the step's matmuls cannot pass either")
    if metrics and metrics.get("perf/train_TFLOP") and metrics.get("time/train"):
        model_tflop, train_s = metrics["perf/train_TFLOP"], metrics["time/train"]
        lines.append(f"the phase: {model_tflop:.3f} model TFLOP in {train_s:.3f} s (time/train, the driver's clock): "
                     f"{model_tflop / train_s:.3f} TFLOP/s, {model_tflop / train_s / ceiling_tflops:.1%} of the "
                     "ceiling")
        if mm_s > 0:
            lines.append(f"if only the matmuls took time: {model_tflop / mm_s / ceiling_tflops:.1%} of the ceiling "
                         f"(the model FLOPs over the matmuls' {mm_s:.3f} s)")
    return lines


def profile_e2e(args: argparse.Namespace, directory: str) -> str:
    """Run the e2e bench's GRPO side with one profiled step into ``directory``; its actor rank 0's trace."""
    from rlhf_sg.bench import e2e

    e2e.main(["--sides", "grpo", "--warmup", str(args.warmup), "--steps", "1", "--arch", args.arch,
              "--size", args.size, "--profile-dir", directory])
    traces = sorted(glob.glob(os.path.join(directory, "ours-grpo", "profile", "step*.rank0.json")))
    if not traces:
        raise SystemExit(f"train-profile: the e2e run wrote no actor trace under {directory}/ours-grpo/profile")
    return traces[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlhf_sg.bench train-profile",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=None, help="a CPU rank's trace (--log.profile_step); default: profile a "
                                                      "step of the e2e bench's GRPO side")
    parser.add_argument("--role", default="actor", choices=("actor", "critic"), help="the update span to read")
    parser.add_argument("--arch", default="qwen2", help="the model of the e2e run and of the ceiling")
    parser.add_argument("--size", default="25m", help="tiny model size from rlhf_sg.tiny.SIZES (the e2e bench's)")
    parser.add_argument("--warmup", type=int, default=1, help="e2e run: untimed steps before the profiled one")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads of the ceiling and of the hot matmuls (the rank's: e2e's shared "
                             "placement gives its one actor rank every core)")
    parser.add_argument("--min-seconds", type=float, default=0.5, help="timing per measurement (the ceiling's)")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.min_seconds <= 0 or args.warmup < 0:
        parser.error("--threads must be >= 1, --min-seconds > 0, --warmup >= 0")
    if args.trace is not None and not os.path.isfile(args.trace):
        parser.error(f"--trace {args.trace}: no such file")

    from rlhf_sg.bench.decode_gemm import model_shape

    shape = model_shape(args.arch, args.size)
    # measured afresh (the accounting's measurement is cached per process) before and after the rest
    measure = functools.partial(measure_cpu_ceiling.__wrapped__, shape, "float32", args.threads,
                                min_total_s=args.min_seconds)
    readings = [measure()]
    with tempfile.TemporaryDirectory(prefix="bench-train-profile-") as tmp:
        trace = args.trace or profile_e2e(args, tmp)
        try:
            phase = read_phase(trace, args.role)
        except ValueError as e:
            raise SystemExit(f"train-profile: {e}") from None
        metrics = step_metrics(trace)
    hot = time_hot(phase, args.threads, args.min_seconds)
    sustained_s = min(phase.span_s, SUSTAINED_MAX_S)
    sustained = sustained_gemm(shape, args.threads, sustained_s), sustained_s
    readings.append(measure())
    ceiling = max(readings, key=lambda c: c.tflops)
    source = trace if args.trace else f"the e2e run's {os.path.basename(trace)}"
    print(f"train-profile: the {args.role} update of {source}; the accounting's ceiling for {args.arch}/{args.size}: "
          f"{ceiling.tflops:.3f} TFLOP/s, the higher of its readings before ({readings[0].tflops:.3f}) and after "
          f"({readings[1].tflops:.3f}) ({ceiling.source})", flush=True)
    for line in report(phase, ceiling.tflops, hot, metrics, sustained):
        print(line)
    moved = 1 - min(r.tflops for r in readings) / ceiling.tflops
    if moved > MOVED_WARNING:
        print(f"the ceiling's two readings are {moved:.0%} apart: this CPU's speed moved during the run (load, or a "
              "shared host), so the fractions above mix moments; rerun on a quiet machine")


if __name__ == "__main__":
    main()
