"""Generation throughput: each rollout backend against its engine's direct API, alternated in one run.

``python -m rlhf_sg.bench generate [--rows embedded] [--num-prompts 64] [--max-new-tokens 128]``

Each row of the table runs the same work (the same prompts, sampling at temperature 1 with no
truncation, exactly ``max_new_tokens`` per completion) two ways and prints tokens/s of both and
their ratio (candidate / baseline; >= 1.0 means ours is at least as fast). The two sides alternate
round by round (A B, B A, ...) so drifting machine load hits both alike; one untimed warm-up run of
each side comes first. The ratio printed is the median of the ratios of pairs of rounds (quartiles and
the ratio of totals beside it), and the machine's load average is printed with it. The tiny model is
saved with no EOS id so no row stops early and both sides generate the same number of tokens.

Rows:

* ``embedded``: transformers' ``generate`` (baseline) vs ``EmbeddedBackend.generate`` (candidate).
* ``vllm``: ``vllm.LLM.generate`` in this process (baseline) vs ``VLLMBackend.generate`` in a Ray
  engine actor (candidate); run it in the vLLM venv (``recipes/install/vllm_cpu.sh``).
* ``sglang``: ``sglang.Engine.generate`` in this process (baseline) vs ``SGLangBackend.generate`` in a
  Ray engine actor (candidate); run it in the SGLang venv (``recipes/install/sglang_cpu.sh``).

To add a row (e.g. an engine's direct API vs our backend of it running in a Ray actor), write a
builder ``(args, model_path, prompts) -> BenchRow`` and register it in :data:`ROW_BUILDERS`.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class BenchRow:
    """One comparison. ``baseline`` and ``candidate`` run the whole work once and return the number
    of tokens they generated; ``close`` frees what the row started."""

    name: str
    baseline_name: str
    baseline: Callable[[], int]
    candidate_name: str
    candidate: Callable[[], int]
    close: Callable[[], None] = field(default=lambda: None)


def _embedded_row(args: argparse.Namespace, model_path: str, prompts: list[list[int]]) -> BenchRow:
    from transformers import AutoModelForCausalLM

    from backends.base import BackendConfig, SamplingParams
    from backends.embedded import EmbeddedBackend

    device = torch.device(args.device)
    hf_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)

    def hf_generate() -> int:
        with torch.inference_mode():
            out = hf_model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.max_new_tokens,
                pad_token_id=0,
                eos_token_id=None,
            )
        _sync(device)
        return (out.shape[1] - width) * out.shape[0]

    backend = EmbeddedBackend(
        BackendConfig(model_path=model_path, device=args.device, extra={"max_batch_size": len(prompts)})
    )
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)

    def embedded_generate() -> int:
        completions = backend.generate(prompts, params)
        _sync(device)
        return sum(len(c.token_ids) for c in completions)

    return BenchRow(
        "embedded", "transformers generate", hf_generate, "EmbeddedBackend", embedded_generate, backend.shutdown
    )


def _vllm_row(args: argparse.Namespace, model_path: str, prompts: list[list[int]]) -> BenchRow:
    """vLLM's own API in this process (baseline) vs our VLLMBackend in a Ray engine actor (candidate).

    Both sides start vLLM with the same engine keywords (``vllm_engine_kwargs``) and ask for the
    sampled token's log-prob, so the ratio is the cost of our layer: the Ray hop, per-request
    seeds, and turning vLLM's outputs into completions.
    """
    import ray
    import vllm

    from backends.base import BackendConfig, SamplingParams
    from backends.vllm_backend import vllm_engine_kwargs
    from rlhf_sg.engine_actor import start_engine_actors

    config = BackendConfig(model_path=model_path, device=args.device, max_model_len=2048, num_threads=args.threads)
    direct = vllm.LLM(**vllm_engine_kwargs(config))
    direct_prompts = [vllm.TokensPrompt(prompt_token_ids=p) for p in prompts]
    direct_params = vllm.SamplingParams(
        temperature=1.0, top_p=1.0, top_k=0, max_tokens=args.max_new_tokens, logprobs=0, detokenize=False
    )

    def vllm_generate() -> int:
        outputs = direct.generate(direct_prompts, direct_params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    # Ray starts its workers at nice 15 by default; the baseline runs in this process at nice 0, and on a
    # loaded machine that gap in scheduling priority, not our layer, would dominate the ratio.
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(num_cpus=args.threads + 1, include_dashboard=False, log_to_driver=False)
    (actor,) = start_engine_actors("vllm", config, 1, num_cpus=args.threads, num_gpus=1 if args.device == "cuda" else 0)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)

    def backend_generate() -> int:
        completions = ray.get(actor.generate.remote(prompts, params), timeout=3600)
        return sum(len(c.token_ids) for c in completions)

    def close() -> None:
        ray.shutdown()
        direct.llm_engine.engine_core.shutdown()

    return BenchRow("vllm", "vllm.LLM.generate", vllm_generate, "VLLMBackend (Ray actor)", backend_generate, close)


def _sglang_row(args: argparse.Namespace, model_path: str, prompts: list[list[int]]) -> BenchRow:
    """SGLang's offline engine called directly vs our backend of it behind a Ray engine actor.

    Both sides ask for the same work: token ids in, the same explicit sampling dict, the sampled
    token's log-prob out. The ratio is the cost of our layer: the Ray hop, the per-call checks and
    turning SGLang's outputs into completions.
    """
    import ray

    from backends.base import BackendConfig, SamplingParams
    from backends.sglang_backend import sglang_engine_kwargs, sglang_sampling_params
    from rlhf_sg.engine_actor import start_engine_actors

    config = BackendConfig(model_path=model_path, device=args.device, max_model_len=2048, num_threads=args.threads)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    # The engine kwargs first: on CPU they set the switches SGLang reads when it is imported.
    engine_kwargs = sglang_engine_kwargs(config)
    from sglang.srt.entrypoints.engine import Engine

    direct = Engine(**engine_kwargs)
    direct_sampling = sglang_sampling_params(params)

    def sglang_generate() -> int:
        outputs = direct.generate(
            input_ids=prompts, sampling_params=direct_sampling, return_logprob=True, logprob_start_len=-1
        )
        return sum(len(o["output_ids"]) for o in outputs)

    # Ray starts its workers at nice 15 by default; the baseline runs in this process at nice 0, and on a
    # loaded machine that gap in scheduling priority, not our layer, would dominate the ratio.
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(num_cpus=args.threads + 1, include_dashboard=False, log_to_driver=False)
    (actor,) = start_engine_actors(
        "sglang", config, 1, num_cpus=args.threads, num_gpus=1 if args.device == "cuda" else 0
    )

    def backend_generate() -> int:
        completions = ray.get(actor.generate.remote(prompts, params), timeout=3600)
        return sum(len(c.token_ids) for c in completions)

    def close() -> None:
        ray.get(actor.shutdown.remote(), timeout=300)
        ray.shutdown()
        direct.shutdown()

    return BenchRow(
        "sglang", "sglang.Engine.generate", sglang_generate, "SGLangBackend (Ray actor)", backend_generate, close
    )


#: row name -> builder ``(args, model_path, prompts) -> BenchRow``
ROW_BUILDERS: dict[str, Callable[[argparse.Namespace, str, list[list[int]]], BenchRow]] = {
    "embedded": _embedded_row,
    "vllm": _vllm_row,
    "sglang": _sglang_row,
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_prompts(num_prompts: int, min_len: int, max_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random prompts of random lengths in [min_len, max_len], BOS first, no special ids after it."""
    rng = random.Random(seed)
    return [
        [1] + [rng.randrange(3, vocab_size) for _ in range(rng.randint(min_len, max_len) - 1)]
        for _ in range(num_prompts)
    ]


def run_row(row: BenchRow, rounds: int, min_seconds: float = 0.0) -> dict[str, float]:
    """Warm both sides up, then time them alternately; returns tokens/s of each and the ratio.

    At least ``rounds`` rounds, and more until each side has run ``min_seconds`` in all: short work
    (a few tokens per completion) takes a fraction of a second per call, and a handful of such calls
    on a shared machine gives a ratio that swings by 10-20 % from run to run.

    ``ratio`` is the median, over pairs of rounds (A B, B A: each side once after the other side and once
    after itself, so neither gains from order), of the pair's ratio (candidate tokens/s over baseline
    tokens/s), with its quartiles: a burst of load from other processes slows the one or two calls it
    meets and moves a ratio of totals by its whole length, a median of paired ratios hardly. The rounds
    are made even. ``total_ratio`` is the ratio of the totals.
    """
    row.baseline()
    row.candidate()
    seconds = {"baseline": [], "candidate": []}
    tokens = {"baseline": 0, "candidate": 0}
    r = 0
    while r < rounds or r % 2 or min(sum(v) for v in seconds.values()) < min_seconds:
        order = ("baseline", "candidate") if r % 2 == 0 else ("candidate", "baseline")
        for side in order:
            fn = row.baseline if side == "baseline" else row.candidate
            start = time.perf_counter()
            tokens[side] += fn()
            seconds[side].append(time.perf_counter() - start)
        r += 1
    rate = {side: tokens[side] / sum(seconds[side]) for side in seconds}
    # Both sides make the same tokens each call, so a ratio is baseline time over candidate time. Rounds go in
    # pairs (A B, B A): in each pair each side runs once right after the other side and once after itself.
    b, c = seconds["baseline"], seconds["candidate"]
    paired = sorted((b[i] + b[i + 1]) / (c[i] + c[i + 1]) for i in range(0, r - 1, 2))
    return {
        "baseline_tok_s": rate["baseline"],
        "candidate_tok_s": rate["candidate"],
        "ratio": statistics.median(paired),
        "ratio_q1": paired[len(paired) // 4],
        "ratio_q3": paired[(3 * len(paired)) // 4],
        "total_ratio": rate["candidate"] / rate["baseline"],
        "baseline_median_s": statistics.median(seconds["baseline"]),
        "candidate_median_s": statistics.median(seconds["candidate"]),
        "rounds": r,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlhf_sg.bench generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="embedded", help=f"comma-separated, of {sorted(ROW_BUILDERS)}")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", default="16,64", help="min,max prompt length in tokens")
    parser.add_argument("--size", default="25m", help="tiny model size from rlhf_sg.tiny.SIZES")
    parser.add_argument("--arch", default="qwen2")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs of each side, at least")
    parser.add_argument(
        "--min-seconds", type=float, default=30.0, help="more rounds until each side ran this long (short work swings)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads for this process")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROW_BUILDERS]
    if unknown:
        parser.error(f"--rows: unknown row(s) {unknown}; available: {sorted(ROW_BUILDERS)}")
    min_len, max_len = (int(x) for x in args.prompt_len.split(","))
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    from rlhf_sg.tiny import build_tiny_model, save_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-generate-") as tmp:
        model = build_tiny_model(args.arch, args.size, seed=args.seed)
        # No EOS: every completion runs to max_new_tokens, so both sides do identical work.
        model.config.eos_token_id = None
        model.generation_config.eos_token_id = None
        model_path = save_tiny_model(tmp, model=model)
        prompts = make_prompts(args.num_prompts, min_len, max_len, model.config.vocab_size, args.seed)
        del model
        print(
            f"generate: {args.num_prompts} prompts (len {min_len}-{max_len}) x {args.max_new_tokens} new tokens, "
            f"model {args.arch}/{args.size}, device {args.device}, {args.threads} thread(s), "
            f">= {args.rounds} rounds and >= {args.min_seconds:g} s a side"
        )
        print(f"{'row':<10} {'baseline':<24} {'tok/s':>9} {'candidate':<24} {'tok/s':>9} {'ratio':>6}")
        for name in names:
            row = ROW_BUILDERS[name](args, model_path, prompts)
            try:
                result = run_row(row, args.rounds, args.min_seconds)
            finally:
                row.close()
            print(
                f"{row.name:<10} {row.baseline_name:<24} {result['baseline_tok_s']:>9.1f} "
                f"{row.candidate_name:<24} {result['candidate_tok_s']:>9.1f} {result['ratio']:>6.2f} "
                f"(quartiles {result['ratio_q1']:.2f}-{result['ratio_q3']:.2f}, totals {result['total_ratio']:.2f}, "
                f"{result['rounds']} rounds, load {os.getloadavg()[0]:.1f})"
            )


if __name__ == "__main__":
    main()
