"""Forward + backward throughput on packed rows against the padded batch, alternated in one run.

``python -m rlhf_sg.bench packing [--size 25m] [--batch 16] [--rounds 2] [--mix rlhf|equal|both] [--group-size G]``

Both sides compute the same thing: the response log-probs of a rollout batch (fp32 log-softmax) and
a token-mean policy-gradient loss, then backward, on a tiny causal LM in train mode. The baseline is
the usual padded path (one forward over [B, P + T] with a 2D mask, logits for every position); the
candidate is :func:`rlhf_sg.packing.response_logprobs` (padding removed, lm_head only at response
positions). Throughput counts REAL tokens per second; both sides' losses are printed as a check that
they computed the same thing.

Length mixes:

* ``rlhf``: prompts uniform in 16..256 tokens, responses log-normal (median 64, sigma 1.0) clipped to
  1..512, the long tail of RL rollouts; padded to the widest prompt + widest response.
* ``equal``: every prompt 128 and every response 256 tokens. There is no padding to remove, so this
  is where packing can only lose: it measures packing's own overhead.

``--group-size G`` (default 1) gives every G consecutive rollouts one prompt (GRPO's groups: the prompt's
length and tokens are the group's first row's), and adds a third side, ``shared``: the packed path with
``share_prompts=True`` (:func:`rlhf_sg.packing.pack_shared_prompts`, each prompt computed once per segment) on the
tree mask, printed as shared / packed and shared / padded; and with ``--attn sdpa`` a fourth, ``blocks``: the same
with the model switched to the shared-prompt attention as the trainer's ranks switch it
(:func:`rlhf_sg.packing.use_shared_prompt_attention`: blocks instead of the mask's square, a group per segment),
printed as blocks / shared and blocks / packed.

The sides alternate round by round (A B, then B A, ...) so drifting machine load hits both alike,
after one untimed warm-up of each. Each side's figure is from its fastest round: other processes on
the machine only ever add time, so the minimum is the least disturbed measurement (every round's time
is printed too).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch


def _lengths(mix: str, batch: int, gen: torch.Generator, group: int = 1) -> tuple[list[int], list[int]]:
    if mix == "equal":
        return [128] * batch, [256] * batch
    prompts = torch.randint(16, 257, (batch,), generator=gen).tolist()
    responses = torch.exp(math.log(64) + 1.0 * torch.randn(batch, generator=gen)).round().clamp(1, 512)
    return [prompts[b - b % group] for b in range(batch)], responses.long().tolist()


def _rollout_batch(prompt_lens, response_lens, vocab: int, gen: torch.Generator, group: int = 1):
    """sequences / attention_mask [B, P + T] in the trainer's layout, and T; every ``group`` rows one prompt."""
    prompt_width, response_width = max(prompt_lens), max(response_lens)
    mask = torch.zeros(len(prompt_lens), prompt_width + response_width, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        mask[b, prompt_width - p : prompt_width + r] = 1
    sequences = torch.zeros_like(mask)
    sequences[mask.bool()] = torch.randint(3, vocab, (int(mask.sum()),), generator=gen)
    for b in range(len(prompt_lens)):
        sequences[b, :prompt_width] = sequences[b - b % group, :prompt_width]
    return sequences, mask, response_width


def _padded_logprobs(model, sequences, mask, response_width):
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(sequences, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
    prompt_width = sequences.shape[1] - response_width
    logp_all = logits[:, prompt_width - 1 : -1].float().log_softmax(-1)
    return logp_all.gather(-1, sequences[:, prompt_width:, None]).squeeze(-1)


def _run_mix(args, model, mix: str, gen: torch.Generator) -> None:
    from rlhf_sg.packing import (
        pack,
        response_logprobs,
        stop_shared_prompt_attention,
        use_shared_prompt_attention,
    )

    group = args.group_size
    prompt_lens, response_lens = _lengths(mix, args.batch, gen, group)
    sequences, mask, width = _rollout_batch(prompt_lens, response_lens, model.config.vocab_size, gen, group)
    sequences, mask = sequences.to(args.device), mask.to(args.device)
    action = mask[:, -width:].float()
    advantages = torch.randn(action.shape, generator=gen).to(args.device)
    real_tokens = int(mask.sum())
    longest = int(mask.sum(1).max())
    rows = pack(
        sequences, mask, row_tokens=None if args.attn.startswith("flash") else longest
    ).input_ids.shape

    def step(logprobs_fn) -> float:
        model.zero_grad(set_to_none=True)
        logp = logprobs_fn(model, sequences, mask, width)
        loss = -(logp * advantages * action).sum() / action.sum()
        loss.backward()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return loss.item()

    def on_blocks(*a):
        use_shared_prompt_attention(model)  # config only; the backward after it needs nothing of it
        try:
            return response_logprobs(*a, share_prompts=True)
        finally:
            stop_shared_prompt_attention(model)

    sides = {"padded": _padded_logprobs, "packed": response_logprobs}
    if group > 1:
        sides["shared"] = lambda *a: response_logprobs(*a, share_prompts=True)
        if model.config._attn_implementation == "sdpa":
            sides["blocks"] = on_blocks
    losses = {name: step(fn) for name, fn in sides.items()}  # warm-up, untimed
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.rounds):
        for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            start = time.perf_counter()
            step(sides[name])
            seconds[name].append(time.perf_counter() - start)

    padded_slots = mask.numel()
    print(
        f"\nmix={mix}: {args.batch} rollouts, prompts {min(prompt_lens)}..{max(prompt_lens)} "
        f"(mean {statistics.mean(prompt_lens):.0f}), responses {min(response_lens)}..{max(response_lens)} "
        f"(mean {statistics.mean(response_lens):.0f})" + (f", {group} rollouts a prompt" if group > 1 else "")
    )
    print(
        f"  real tokens {real_tokens}; padded [B, S] = {list(mask.shape)} = {padded_slots} slots "
        f"({100 * (1 - real_tokens / padded_slots):.0f}% padding); packed rows [R, L] = {list(rows)} = "
        f"{rows[0] * rows[1]} slots"
    )
    print("  loss " + "  ".join(f"{name} {loss:.6f}" for name, loss in losses.items()))
    rate = {name: real_tokens / min(s) for name, s in seconds.items()}
    for name in sides:
        times = ", ".join(f"{t:.2f}" for t in seconds[name])
        print(f"  {name:7s} {rate[name]:9.0f} real tokens/s  (fwd+bwd s per round: {times})")
    print(f"  ratio packed / padded: {rate['packed'] / rate['padded']:.2f}x")
    if "shared" in rate:
        print(f"  ratio shared / packed: {rate['shared'] / rate['packed']:.2f}x; shared / padded: "
              f"{rate['shared'] / rate['padded']:.2f}x")
    if "blocks" in rate:
        print(f"  ratio blocks / shared: {rate['blocks'] / rate['shared']:.2f}x; blocks / packed: "
              f"{rate['blocks'] / rate['packed']:.2f}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rlhf_sg.bench packing", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--arch", default="qwen2", choices=["qwen2", "llama"])
    parser.add_argument("--size", default="25m", help="rlhf_sg.tiny size preset (25m: ~25M parameters)")
    parser.add_argument("--batch", type=int, default=16, help="rollouts per batch")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per side (alternating)")
    parser.add_argument("--mix", default="both", choices=["rlhf", "equal", "both"])
    parser.add_argument("--group-size", type=int, default=1, help="rollouts per prompt (> 1 adds the shared side)")
    parser.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa, eager, flash_attention_2)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.group_size < 1:
        parser.error(f"--group-size must be >= 1, got {args.group_size}")

    from rlhf_sg.tiny import build_tiny_model

    torch.set_num_threads(args.threads)
    model = build_tiny_model(args.arch, args.size, seed=args.seed).to(args.device).train()
    model.set_attn_implementation(args.attn)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"packing benchmark: {args.arch} {args.size} ({params / 1e6:.1f}M parameters, fp32, {args.attn}) on "
        f"{args.device}, {args.threads} threads, {args.rounds} rounds per side, forward + backward"
    )
    gen = torch.Generator().manual_seed(args.seed)
    for mix in ["rlhf", "equal"] if args.mix == "both" else [args.mix]:
        _run_mix(args, model, mix, gen)


if __name__ == "__main__":
    main()
