"""Prefix reuse in multi-turn rollouts: the engine's prefix-cache hit fraction with every turn of a trajectory on
one engine, against a control that flushes the cache before every turn.

``python -m rlhf_sg.bench agent [--backend sglang|vllm|embedded] [--prompts 8] [--samples 4] [--turns 3]``

A tiny Qwen2 model (``--size``, heads of 32), ``--prompts`` random prompts of ``--prompt-len`` tokens,
``--samples`` trajectories each, ``--turns`` model turns of ``--turn-tokens`` tokens (no stop token: every turn
runs to its cap) with an observation of ``--obs-tokens`` tokens between them (:func:`rlhf_sg.agent.run_agent_rollout`,
the trainer's loop, one engine in-process). Printed per side: the prompt tokens the generate calls sent, how many
the engine served from its prefix cache (its own counters: SGLang ``cached_tokens``, vLLM
``num_cached_tokens``), the hit fraction over turns 2.. and over every turn, the hits over what turns 2.. could
reuse (their previous context and sampled tokens: everything but the new observation), the prefill tokens saved,
and each turn's generate time. The embedded engine keeps no prefix cache and reports none. The flushed control
still hits where the samples of one prompt share it within a call (vLLM); vLLM caches whole KV blocks only
(``--block-size``; its CPU attention takes multiples of 32), so the partial last block of every turn's context is
computed again: at short contexts (``--prompt-len 128``) that alone keeps its hit fraction under 0.9.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

ENGINES = {"embedded": "hf", "hf": "hf", "sglang": "sglang", "vllm": "vllm"}


def run_side(backend, tokenizer, prompts, args, flush: bool) -> dict:
    from backends.base import SamplingParams
    from rlhf_sg.agent import Environment, StepResult, run_agent_rollout
    from rlhf_sg.config import AgentConfig

    obs = [7 + (i % 50) for i in range(args.obs_tokens)]

    class Observe(Environment):
        def reset(self, prompt):
            self.turns = 0

        def step(self, turn_ids, turn_text, finish_reason):
            self.turns += 1
            return StepResult(observation_ids=obs, done=self.turns >= args.turns)

    calls: list[dict] = []

    def generate_many(batch):
        out = []
        for _, ps, params in batch:
            if flush:
                backend.reset_prefix_cache()
            start = time.perf_counter()
            completions = backend.generate(ps, params)
            # what an engine could have cached: the context of the trajectory's previous call and the tokens it
            # sampled; the new observation it cannot have
            reusable = 0 if not calls else sum(len(p) - args.obs_tokens for p in ps) * params.n
            calls.append({"turn": len(calls), "seconds": time.perf_counter() - start, "reusable": reusable,
                          "sent": sum(len(p) for p in ps) * params.n,
                          "cached": [c.cached_tokens for c in completions]})
            out.append(completions)
        return out

    backend.reset_prefix_cache()
    budget = args.turns * (args.turn_tokens + args.obs_tokens)
    params = SamplingParams(n=args.samples, temperature=1.0, max_new_tokens=budget, seed=args.seed)
    cfg = AgentConfig(env="-", max_turns=args.turns, max_turn_tokens=args.turn_tokens,
                      max_observation_tokens=args.obs_tokens)
    trajectories = run_agent_rollout(prompts, args.samples, params, generate_many, Observe, tokenizer, cfg, 1,
                                     args.max_model_len, lambda e, t, b: args.seed + t)
    reported = all(x is not None for c in calls for x in c["cached"])
    cached = [sum(c["cached"]) if reported else 0 for c in calls]
    later = range(1, len(calls))
    return {
        "turns": sum(t.turns for t in trajectories) / len(trajectories),
        "sent": sum(c["sent"] for c in calls), "cached": sum(cached), "reported": reported,
        "hit_later": sum(cached[i] for i in later) / max(1, sum(calls[i]["sent"] for i in later)),
        "hit_all": sum(cached) / max(1, sum(c["sent"] for c in calls)),
        "hit_reusable": sum(cached[i] for i in later) / max(1, sum(calls[i]["reusable"] for i in later)),
        "turn_seconds": [c["seconds"] for c in calls],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlhf_sg.bench agent", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="sglang", choices=sorted(ENGINES))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    # a tool-use prompt: its system prompt and tool descriptions alone run to hundreds of tokens
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--turn-tokens", type=int, default=16)
    parser.add_argument("--obs-tokens", type=int, default=8)
    parser.add_argument("--size", default="tiny", help="tiny model size from rlhf_sg.tiny.SIZES")
    parser.add_argument("--max-model-len", type=int, default=640)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--block-size", type=int, default=32,
                        help="vLLM's KV block size (its prefix cache hits are whole blocks); 0: vLLM's default")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    import backends
    from backends.base import BackendConfig
    from rlhf_sg.data import Prompt, load_tokenizer
    from rlhf_sg.tiny import save_tiny_model, tiny_config

    name = ENGINES[args.backend]
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp:
        # heads of 32: a head size vLLM's CPU attention takes
        config = tiny_config("qwen2", args.size)
        config.num_attention_heads = config.hidden_size // 32
        config.num_key_value_heads = max(1, config.num_attention_heads // 2)
        torch.manual_seed(args.seed)
        save_tiny_model(tmp, model=AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())
        tokenizer = load_tokenizer(tmp)
        extra = {"gpu_memory_utilization": 0.05} if name == "vllm" and args.device == "cpu" else {}
        if name == "vllm":  # prefix caching on; it reuses whole KV blocks only (--block-size)
            extra["enable_prefix_caching"] = True
            if args.block_size:
                extra["engine_kwargs"] = {"block_size": args.block_size}
        backend = backends.create_backend(name, BackendConfig(model_path=tmp, max_model_len=args.max_model_len,
                                                              seed=args.seed, device=args.device, num_threads=1,
                                                              extra=extra))
        try:
            rng = random.Random(args.seed)
            prompts = [Prompt([1] + [rng.randrange(3, 90) for _ in range(args.prompt_len - 1)], "")
                       for _ in range(args.prompts)]
            run_side(backend, tokenizer, prompts, args, flush=False)  # warm-up (compiles, first allocations)
            sides = {"affinity": run_side(backend, tokenizer, prompts, args, flush=False),
                     "flushed": run_side(backend, tokenizer, prompts, args, flush=True)}
        finally:
            backend.shutdown()
    print(f"agent bench: backend {args.backend}, {args.prompts} prompts x {args.samples} samples x {args.turns} "
          f"turns, prompt {args.prompt_len}, turn {args.turn_tokens}, observation {args.obs_tokens} tokens")
    print(f"{'side':<10} {'turns':>6} {'prompt tok':>11} {'cached':>8} {'hit turns2+':>12} {'hit all':>8} "
          f"{'of reusable':>12} {'median turn s':>14}")
    for side, r in sides.items():
        hit = (f"{r['hit_later']:>12.3f} {r['hit_all']:>8.3f} {r['hit_reusable']:>12.3f}" if r["reported"]
               else f"{'n/a':>12} {'n/a':>8} {'n/a':>12}")
        print(f"{side:<10} {r['turns']:>6.2f} {r['sent']:>11d} {r['cached']:>8d} {hit} "
              f"{statistics.median(r['turn_seconds']):>14.4f}")
        print(f"{'':<10} per-turn generate s: " + ", ".join(f"{s:.4f}" for s in r["turn_seconds"]))
    a, f = sides["affinity"], sides["flushed"]
    if a["reported"]:
        print(f"prefill tokens saved by affinity: {a['cached'] - f['cached']} of {a['sent']} "
              f"({(a['cached'] - f['cached']) / max(1, a['sent']):.1%}); generate time flushed / affinity: "
              f"{sum(f['turn_seconds']) / max(1e-9, sum(a['turn_seconds'])):.2f}x")
    else:
        print(f"backend {args.backend} reports no prefix-cache counters (no prefix cache)")


if __name__ == "__main__":
    main()
