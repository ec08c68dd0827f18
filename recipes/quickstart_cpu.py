"""Quickstart: a real PPO run on a laptop CPU in a few minutes.

What it does, top to bottom:
1. builds a tiny Qwen2-style model (~3M parameters) and a character tokenizer, locally;
2. writes the task: single-digit addition prompts ("3+4=") with their answers;
3. a short supervised warm start, so the policy is right some of the time (RL learns from its
   own correct samples; a random model would almost never produce one);
4. PPO with Ray: a 2-rank DeepSpeed ZeRO-3 actor, a critic, a reference model, the embedded
   rollout engine (``--rollout.backend hf``) and a rule reward; weights sync into the engine
   after every step;
5. evaluates on held-out problems (ones RL never trains on) before the first step, every 10 steps and after
   the last, and prints held-out pass@1 before and after;
6. prints where logs and checkpoints went and draws ``quickstart.png``: reward, held-out pass@1 and KL per
   step, and a stacked bar of where each step's time went.

    python recipes/quickstart_cpu.py [--steps 40] [--algo gae|grpo|dr_grpo|rloo|reinforce|reinforce_baseline]
                                     [--backend hf|sglang|vllm] [--rollout-mode sync|async] [--out runs/quickstart]
                                     [--lora-rank 16 [--actor-lr 1e-3]]

``--lora-rank 16`` trains a LoRA adapter of that rank instead of every weight (at ``--actor-lr``, default 1e-3 for LoRA,
1e-4 otherwise); the run's log states the actor's optimizer state in bytes.

``--rollout-mode async`` generates the next step's batch while the trainer trains (one weight version stale at
most, generations cut short at a weight sync continue with the new weights).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import arith_task  # noqa: E402
import torch  # noqa: E402

from rlhf_sg.config import Config  # noqa: E402
from rlhf_sg.plot import plot_run  # noqa: E402
from rlhf_sg.tiny import build_tiny_model, build_tokenizer  # noqa: E402
from rlhf_sg.trainer import train  # noqa: E402


def prepare(out: str, warm_start_steps: int, seed: int = 0) -> tuple[str, str]:
    """The warm-started policy directory and the training prompt file (reused when already there); the
    held-out prompts go beside it (:func:`held_out_path`)."""
    policy = os.path.join(out, "policy_sft")
    prompts = arith_task.write_prompts(os.path.join(out, "prompts.jsonl"), seed=seed)
    arith_task.write_prompts(held_out_path(prompts), seed=seed, part="held_out")
    if os.path.isfile(os.path.join(policy, "model.safetensors")):
        return policy, prompts
    tokenizer = build_tokenizer()
    model = build_tiny_model("qwen2", "small", seed=seed)
    print(f"warm start: {warm_start_steps} supervised steps ...", flush=True)
    arith_task.warm_start(model, tokenizer, warm_start_steps, batch_size=32, seed=seed)
    print(f"warm start done: sampled accuracy {arith_task.sample_accuracy(model, tokenizer):.2f}", flush=True)
    model.save_pretrained(policy, safe_serialization=True)
    tokenizer.save_pretrained(policy)
    return policy, prompts


def held_out_path(prompts: str) -> str:
    """The held-out prompt file :func:`prepare` writes beside the training prompts."""
    return os.path.join(os.path.dirname(prompts), "held_out.jsonl")


def make_config(policy: str, prompts: str, out: str, steps: int, algo: str, backend: str,
                rollout_mode: str = "sync", evaluate: bool = False, lora_rank: int = 0,
                actor_lr: float | None = None) -> Config:
    """The quickstart's run; with ``evaluate``, held-out evaluation before the first step, every 10 steps and
    after the last (8 samples per held-out prompt and a greedy pass, scored by the training reward); with
    ``lora_rank``, a LoRA policy of that rank (``actor_lr``: its learning rate)."""
    cfg = Config()
    cfg.rollout.mode = rollout_mode
    cfg.model.pretrain = policy
    cfg.data.prompt_data = prompts
    cfg.data.label_key = "answer"
    cfg.data.max_prompt_len = 16
    cfg.rollout.backend = backend
    cfg.rollout.prompts_per_step = 16
    cfg.rollout.n_samples_per_prompt = 8
    cfg.rollout.max_new_tokens = 4
    cfg.rollout.max_model_len = 64
    cfg.train.advantage_estimator = algo
    cfg.train.actor_num_ranks = 2
    cfg.train.max_steps = steps
    cfg.train.actor_lr = actor_lr or (1e-3 if lora_rank else 1e-4)
    cfg.lora.rank, cfg.lora.alpha = lora_rank, 2.0 * lora_rank
    cfg.train.critic_lr = 1e-3
    # two critic-only steps first: a fresh value head would otherwise feed noise into the advantages
    cfg.train.critic_warmup_steps = 2
    cfg.train.kl_coef = 0.01
    cfg.train.max_tokens_per_microbatch = 512
    cfg.reward.kind = "function"
    cfg.reward.function = "arith_task:addition_reward"
    cfg.log.output_dir = out
    if evaluate:
        cfg.eval.prompt_data = held_out_path(prompts)
        cfg.eval.interval, cfg.eval.n_samples, cfg.eval.k, cfg.eval.greedy = 10, 8, [1, 8], True
    return cfg


def held_out_accuracy(metrics_path: str) -> list[tuple[int, float, float]]:
    """(step, pass@1, greedy accuracy) of each held-out evaluation the run logged."""
    from rlhf_sg.plot import read_metrics

    return [(r["step"], r["eval/pass@1"], r.get("eval/greedy_accuracy", float("nan")))
            for r in read_metrics(metrics_path) if "eval/pass@1" in r]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--algo", default="gae")
    parser.add_argument("--backend", default="hf")
    parser.add_argument("--rollout-mode", default="sync", choices=["sync", "async"])
    parser.add_argument("--out", default="runs/quickstart")
    parser.add_argument("--warm-start-steps", type=int, default=30)
    parser.add_argument("--lora-rank", type=int, default=0, help="train a LoRA adapter of this rank (0: every weight)")
    parser.add_argument("--actor-lr", type=float, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    torch.set_num_threads(1)

    policy, prompts = prepare(args.out, args.warm_start_steps)
    run_dir = os.path.join(args.out, args.algo)
    cfg = make_config(policy, prompts, run_dir, args.steps, args.algo, args.backend, args.rollout_mode,
                      evaluate=True, lora_rank=args.lora_rank, actor_lr=args.actor_lr)
    history = train(cfg, reward_fn=arith_task.addition_reward)

    first = sum(h["reward/mean"] for h in history[:5]) / min(5, len(history))
    last = sum(h["reward/mean"] for h in history[-5:]) / min(5, len(history))
    png = plot_run(os.path.join(run_dir, "metrics.jsonl"), os.path.join(args.out, f"quickstart_{args.algo}.png"),
                   title=f"{args.algo} on single-digit addition, backend {args.backend}, {args.rollout_mode} rollout")
    print(f"\nmean reward, first 5 steps: {first:.3f}   last 5 steps: {last:.3f}")
    evals = held_out_accuracy(os.path.join(run_dir, "metrics.jsonl"))
    if evals:
        (s0, p0, g0), (s1, p1, g1) = evals[0], evals[-1]
        print(f"held-out ({arith_task.HELD_OUT} problems RL never saw, {cfg.eval.n_samples} samples each): "
              f"pass@1 {p0:.3f} at step {s0} -> {p1:.3f} at step {s1}; greedy accuracy {g0:.2f} -> {g1:.2f}")
    print(f"metrics:      {os.path.join(run_dir, 'metrics.jsonl')}")
    print(f"tensorboard:  {os.path.join(run_dir, 'tensorboard')}")
    print(f"checkpoints:  {os.path.join(run_dir, 'checkpoints')}")
    print(f"final policy: {os.path.join(run_dir, 'final_hf')}")
    print(f"plot:         {png}")


if __name__ == "__main__":
    main()
