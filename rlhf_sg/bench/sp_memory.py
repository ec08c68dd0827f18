"""A rank's activation memory for one long row under sequence parallelism, measured on CPU against the formula.

``python -m rlhf_sg.bench sp-memory [--seq-len 4096] [--sizes 1 2 4] [--preset tiny] [--timeout-s 120]``

For each SP size N, N ranks in processes of their own (gloo, spawned) run the training forward of one row of
``--seq-len`` tokens (the tiny / small preset's Qwen2 in bfloat16, sdpa, the second half of the row a response)
through :func:`rlhf_sg.parallel.sp_response_logprobs`, then its backward. What is measured: the bytes autograd saves
for the backward during that forward (:func:`rlhf_sg.memory.saved_for_backward`: autograd's saved-tensor hooks, over
distinct storages, the parameters left out). That is a rank's activation memory at the backward's peak (the backward
only frees it), the quantity :func:`rlhf_sg.parallel.memory.activation_bytes` models; what it does not see is
transient (the all-to-all's buffers, each layer's intermediate results freed within the forward, the logits chunks
recomputed under checkpointing). Printed per rank: the measured bytes, their ratio against N = 1, and the formula's
bytes for the decoder (``saved_activation_bytes``: one row of one sequence takes causal sdpa, no mask) beside them;
the measurement also holds the log-prob head's few index tensors (8 bytes a response token), which the formula leaves
out.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import time

#: the SP sizes the presets' heads allow (4 query / 2 key-value heads on tiny, 8 / 4 on small)
PRESET_SIZES = {"tiny": (1, 2, 4), "small": (1, 2, 4, 8)}


def _model(preset: str):
    import torch

    from rlhf_sg.tiny import build_tiny_model

    model = build_tiny_model("qwen2", preset, seed=0).to(torch.bfloat16).train()
    model.set_attn_implementation("sdpa")
    return model


def model_shape(preset: str):
    """The :class:`rlhf_sg.memory.ModelShape` of the preset's bfloat16 Qwen2."""
    from rlhf_sg import memory
    from rlhf_sg.tiny import tiny_config

    return memory.ModelShape.from_hf_config({**tiny_config("qwen2", preset).to_dict(), "model_type": "qwen2"},
                                            dtype="bfloat16")


def saved_bytes(preset: str, seq_len: int, group) -> int:
    """This rank's bytes saved for the backward (module doc) in the log-prob forward of one row of ``seq_len``
    tokens by ``group`` (a :class:`rlhf_sg.parallel.SequenceParallelGroup`); runs the backward after it."""
    import torch

    from rlhf_sg.memory import saved_for_backward
    from rlhf_sg.parallel import sp_response_logprobs, use_ulysses_attention

    model = _model(preset)
    use_ulysses_attention(model, group.size)
    ids = torch.randint(3, 90, (1, seq_len), generator=torch.Generator().manual_seed(0))
    with saved_for_backward(model) as saved:
        logp = sp_response_logprobs(model, ids, torch.ones_like(ids), seq_len // 2, group)
    logp.sum().backward()
    if any(p.grad is None for p in model.parameters()):
        raise RuntimeError("sp-memory: a parameter took no gradient in the backward")
    return sum(saved.values())


def _rank(rank: int, size: int, port: int, preset: str, seq_len: int, timeout_s: float, results) -> None:
    os.environ["DS_ACCELERATOR"] = "cpu"
    import torch
    import torch.distributed as dist

    from rlhf_sg.distributed import init_torch_distributed
    from rlhf_sg.parallel import SequenceParallelGroup

    torch.set_num_threads(1)
    try:
        init_torch_distributed(rank, size, "127.0.0.1", port, timeout_s=timeout_s, local_rank=0)
        try:
            group = SequenceParallelGroup.of(dist.new_group(list(range(size))))
            results.put((rank, saved_bytes(preset, seq_len, group), None))
        finally:
            dist.destroy_process_group()
    except Exception as exc:  # the parent names the rank and its error
        results.put((rank, None, f"{type(exc).__name__}: {exc}"))


def measure(size: int, preset: str, seq_len: int, timeout_s: float) -> list[int]:
    """Each rank's saved bytes (:func:`saved_bytes`) of an SP group of ``size`` ranks, spawned for this call."""
    from rlhf_sg.distributed import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(rank, size, port, preset, seq_len, timeout_s, results), daemon=True)
             for rank in range(size)]
    for p in procs:
        p.start()
    seen: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(seen) < size:
            try:
                rank, nbytes, error = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"sp-memory: N = {size}: ranks {sorted(set(range(size)) - set(seen))} gave no "
                                   f"result within {timeout_s} s") from None
            if error is not None:
                raise RuntimeError(f"sp-memory: N = {size}, rank {rank}: {error}")
            seen[rank] = nbytes
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [seen[rank] for rank in range(size)]


def formula_bytes(preset: str, seq_len: int, size: int) -> int:
    """:func:`rlhf_sg.parallel.memory.saved_activation_bytes` for one row of one sequence (causal sdpa, no mask),
    without gradient checkpointing."""
    from rlhf_sg.parallel import memory as sp_memory

    return sp_memory.saved_activation_bytes(model_shape(preset), 1, seq_len, size, False, False)


def run(preset: str, seq_len: int, sizes: list[int], timeout_s: float) -> dict[int, list[int]]:
    """Each size's ranks' measured bytes."""
    return {size: measure(size, preset, seq_len, timeout_s) for size in sizes}


def lines(preset: str, seq_len: int, measured: dict[int, list[int]]) -> list[str]:
    """The table the bench prints; the ratio is against N = 1's measurement (the first size's when 1 is not run)."""
    shape = model_shape(preset)
    base_size = 1 if 1 in measured else min(measured)
    base = measured[base_size][0]
    out = [f"preset {preset} (Qwen2, {shape.num_layers} layers, hidden {shape.hidden_size}, {shape.num_heads} heads / "
           f"{shape.num_kv_heads} KV heads, bfloat16, sdpa), one row of {seq_len} tokens (half of it response), "
           "forward + backward on gloo; bytes autograd saves for the backward, parameters aside",
           "",
           f"| N | rank | measured | / N = {base_size} | x N | formula (decoder) | measured / formula |",
           "|---|---|---|---|---|---|---|"]
    for size, per_rank in measured.items():
        formula = formula_bytes(preset, seq_len, size)
        for rank, nbytes in enumerate(per_rank):
            out.append(f"| {size} | {rank} | {nbytes / 2**20:.2f} MiB | {nbytes / base:.3f} | "
                       f"{nbytes / base * size / base_size:.3f} | {formula / 2**20:.2f} MiB | {nbytes / formula:.4f} |")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlhf_sg.bench sp-memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens of the row")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4], metavar="N", help="SP sizes to run")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESET_SIZES), help="the tiny model's size")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="each size's ranks, and their collectives")
    args = parser.parse_args(argv)
    allowed = PRESET_SIZES[args.preset]
    bad = [n for n in args.sizes if n not in allowed]
    if bad:
        parser.error(f"--sizes {bad}: the {args.preset} preset's heads split over {', '.join(map(str, allowed))}")
    if args.seq_len < 2:
        parser.error("--seq-len must be >= 2")
    for line in lines(args.preset, args.seq_len, run(args.preset, args.seq_len, args.sizes, args.timeout_s)):
        print(line)


if __name__ == "__main__":
    main()
