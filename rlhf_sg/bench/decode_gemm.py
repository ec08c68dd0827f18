"""What a decode step's matmuls can reach on this CPU, against the ceiling the roofline divides by.

``python -m rlhf_sg.bench decode-gemm [--size 25m] [--rows 64 256 1024] [--threads N]``

The accounting's matmul ceiling (:func:`rlhf_sg.flops.measure_cpu_ceiling`, what ``perf/*_of_peak`` and
``perf/generate_of_roofline`` divide by) is a 1024-row GEMM of the model's MLP shape, the fastest of five timings.
Training runs its matmuls at about that many rows; a decode step runs them at as many rows as sequences decode
together (the e2e bench's 64), and reads each layer's weights from memory once a step. Printed per row count, for
the model's own linears (a layer's q, k, v, o, gate, up and down projections, no bias, float32), timed as the ceiling
is:

- **one layer**: one layer's weights, called again and again, so they stay in the CPU's caches;
- **every layer**: each layer's weights in turn (the whole model's, as a decode step reads them), so they stream from
  memory;

each as TFLOP/s and as a fraction of the ceiling. The "every layer" fraction at a decode's rows bounds the share of
the roofline generation can reach while its time is in these matmuls (the rest of a decode step, the attention's
batched matmuls over the KV cache and the elementwise ops, only lowers it).
"""

from __future__ import annotations

import argparse
import os

import torch

from rlhf_sg.flops import _best_seconds, matmul_params, measure_cpu_ceiling
from rlhf_sg.memory import ModelShape


def model_shape(arch: str, size: str) -> ModelShape:
    """The :class:`rlhf_sg.memory.ModelShape` of a tiny preset in float32 (the e2e bench's model)."""
    from rlhf_sg.tiny import tiny_config

    return ModelShape.from_hf_config({**tiny_config(arch, size).to_dict(), "model_type": arch}, dtype="float32")


def layer_linears(shape: ModelShape) -> list[tuple[int, int]]:
    """(in, out) features of one decoder layer's matmuls: q, k, v, o, gate, up, down (what
    :func:`rlhf_sg.flops.matmul_params` counts, layer by layer)."""
    h, q, kv = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    inter = shape.intermediate_size
    return [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]


def linears_tflops(shape: ModelShape, rows: int, layers: int, min_total_s: float, repeats: int) -> float:
    """TFLOP/s of ``layers`` distinct layers' linears (:func:`layer_linears`, float32) on ``rows`` rows, each layer's
    weights its own tensors, timed as the ceiling is (the fastest of ``repeats``)."""
    shapes = layer_linears(shape)
    weights = [[torch.randn(out, inp) for inp, out in shapes] for _ in range(layers)]
    inputs = {inp: torch.randn(rows, inp) for inp, _ in shapes}

    def step():
        for layer in weights:
            for w in layer:
                torch.nn.functional.linear(inputs[w.shape[1]], w)

    seconds = _best_seconds(step, min_total_s, repeats)
    return 2 * rows * layers * sum(inp * out for inp, out in shapes) / seconds / 1e12


def rows_table(shape: ModelShape, rows: list[int], threads: int, min_total_s: float = 0.5,
               repeats: int = 5) -> list[tuple[int, float, float]]:
    """Per row count: (rows, one layer's TFLOP/s, every layer's TFLOP/s), with ``threads`` torch threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        return [(m, linears_tflops(shape, m, 1, min_total_s, repeats),
                 linears_tflops(shape, m, shape.num_layers, min_total_s, repeats)) for m in rows]
    finally:
        torch.set_num_threads(before)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlhf_sg.bench decode-gemm", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="qwen2")
    parser.add_argument("--size", default="25m", help="tiny model size from rlhf_sg.tiny.SIZES (the e2e bench's)")
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256, 1024],
                        help="rows a matmul takes: sequences decoding together, or a training micro-batch's tokens")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (the engine's)")
    parser.add_argument("--min-seconds", type=float, default=0.5, help="timing per measurement (the ceiling's)")
    args = parser.parse_args(argv)
    if any(m < 1 for m in args.rows) or args.threads < 1 or args.min_seconds <= 0:
        parser.error("--rows and --threads must be >= 1, --min-seconds > 0")

    shape = model_shape(args.arch, args.size)
    weights_mb = matmul_params(shape) * 4 / 1e6
    ceiling = measure_cpu_ceiling(shape, "float32", args.threads, min_total_s=args.min_seconds)
    print(f"decode-gemm: {args.arch}/{args.size}, {shape.num_layers} layers of linears ({weights_mb:.0f} MB in "
          f"float32), {args.threads} thread(s); the accounting's ceiling: {ceiling.tflops:.3f} TFLOP/s "
          f"({ceiling.source})", flush=True)
    print(f"{'rows':>6} {'one layer TF/s':>15} {'of ceiling':>11} {'every layer TF/s':>17} {'of ceiling':>11}")
    for m, cached, streamed in rows_table(shape, args.rows, args.threads, args.min_seconds):
        print(f"{m:>6} {cached:>15.3f} {cached / ceiling.tflops:>10.1%} {streamed:>17.3f} "
              f"{streamed / ceiling.tflops:>10.1%}", flush=True)
    print("every layer: the weights stream from memory as a decode step reads them; at a decode's rows that fraction "
          "bounds gen %roof while the step's time is in these matmuls")


if __name__ == "__main__":
    main()
