"""A GSM8K-style run on a laptop CPU: generated word problems, a verifiable math reward, held-out evaluation.

The loop users of math RL run, at a size a CPU trains in minutes:
1. writes word problems ("Q: Ana has 3 apples and gets 4 more. How many apples now? A:") with
   their numeric answers, and holds a tenth of them out (prompt files ``train.jsonl`` and ``held_out.jsonl``,
   JSONL with "prompt" and "answer", GSM8K's shape);
2. a short supervised warm start on worked answers ("3+4=7") for the training problems only, so the policy
   copies the numbers and sums some of the time;
3. GRPO through Ray (a ZeRO-3 actor, the embedded engine), rewarded by the built-in ``math_answer`` (math-verify:
   the completion's last number against the label, by value), with held-out evaluation before the first step,
   every 10 steps and after the last (pass@1 and pass@8 of 8 samples, greedy accuracy);
4. prints held-out accuracy before and after, and draws the run's plot.

    python recipes/word_problems.py [--steps 30] [--backend hf|sglang|vllm] [--out runs/word_problems]

With a real model and data, the same run is ``rlhf-sg train-ppo --reward.function math_answer
--eval.prompt_data held_out.jsonl ...`` (see the README's evaluation section).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import arith_task  # noqa: E402
import torch  # noqa: E402

from rlhf_sg.config import Config  # noqa: E402
from rlhf_sg.plot import plot_run, read_metrics  # noqa: E402
from rlhf_sg.tiny import build_tiny_model, build_tokenizer  # noqa: E402

NAMES = ("Ana", "Ben", "Eva", "Sam")
THINGS = ("apples", "pens", "books")
#: (question template, worked answer template, answer): a and b are at most 4, so a tiny model can learn them
TEMPLATES = (
    ("{n} has {a} {t} and gets {b} more. How many {t} now?", "{a}+{b}={r}", lambda a, b: a + b),
    ("{n} had {a} {t} and gave {b} away. How many are left?", "{a}-{b}={r}", lambda a, b: a - b),
)


def problems(seed: int = 0) -> list[dict]:
    """Every problem of :data:`TEMPLATES` over names, things and numbers (b <= a for the differences), each as
    {"prompt", "answer", "worked"}, in a seeded order."""
    rows = []
    for q, worked, op in TEMPLATES:
        for n in NAMES:
            for t in THINGS:
                for a in range(5):
                    for b in range(a + 1 if "-" in worked else 5):
                        r = op(a, b)
                        rows.append({"prompt": f"Q: {q.format(n=n, t=t, a=a, b=b)} A: ", "answer": str(r),
                                     "worked": worked.format(a=a, b=b, r=r)})
    random.Random(seed).shuffle(rows)
    return rows


def write_files(out: str, seed: int = 0, held_out_fraction: float = 0.1) -> tuple[str, str, list[dict]]:
    """``train.jsonl`` and ``held_out.jsonl`` under ``out``; returns their paths and the training rows."""
    rows = problems(seed)
    cut = int(len(rows) * held_out_fraction)
    paths = []
    for name, part in (("held_out.jsonl", rows[:cut]), ("train.jsonl", rows[cut:])):
        path = os.path.join(out, name)
        os.makedirs(out, exist_ok=True)
        with open(path, "w") as f:
            f.writelines(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in part)
        paths.append(path)
    return paths[1], paths[0], rows[cut:]


def prepare(out: str, warm_start_steps: int, seed: int = 0) -> tuple[str, str, str]:
    """The warm-started policy and the two prompt files (the policy is reused when already there)."""
    train_file, held_out, train_rows = write_files(out, seed)
    policy = os.path.join(out, "policy_sft")
    if not os.path.isfile(os.path.join(policy, "model.safetensors")):
        tokenizer, model = build_tokenizer(), build_tiny_model("qwen2", "small", seed=seed)
        print(f"warm start: {warm_start_steps} supervised steps on {len(train_rows)} training problems ...",
              flush=True)
        arith_task.warm_start(model, tokenizer, warm_start_steps, lr=1e-3, batch_size=32, seed=seed,
                              data=[(r["prompt"], r["worked"]) for r in train_rows])
        model.save_pretrained(policy, safe_serialization=True)
        tokenizer.save_pretrained(policy)
    return policy, train_file, held_out


def make_config(policy: str, train_file: str, held_out: str, out: str, steps: int, backend: str = "hf") -> Config:
    cfg = Config()
    cfg.model.pretrain = policy
    cfg.data.prompt_data, cfg.data.label_key, cfg.data.max_prompt_len = train_file, "answer", 80
    cfg.rollout.backend, cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt = backend, 16, 8
    cfg.rollout.max_new_tokens, cfg.rollout.max_model_len = 8, 96
    cfg.train.advantage_estimator, cfg.train.max_steps, cfg.train.actor_lr = "grpo", steps, 1e-4
    cfg.train.kl_coef, cfg.train.max_tokens_per_microbatch = 0.0, 2048
    cfg.reward.kind, cfg.reward.function = "function", "math_answer"
    cfg.eval.prompt_data, cfg.eval.interval, cfg.eval.n_samples, cfg.eval.k = held_out, 10, 8, [1, 8]
    cfg.eval.greedy = True
    cfg.log.output_dir = out
    return cfg


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--backend", default="hf")
    parser.add_argument("--out", default="runs/word_problems")
    parser.add_argument("--warm-start-steps", type=int, default=60)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    from rlhf_sg.trainer import train

    policy, train_file, held_out = prepare(args.out, args.warm_start_steps)
    run_dir = os.path.join(args.out, "grpo")
    cfg = make_config(policy, train_file, held_out, run_dir, args.steps, args.backend)
    history = train(cfg)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    evals = [r for r in read_metrics(metrics) if "eval/pass@1" in r]
    png = plot_run(metrics, os.path.join(args.out, "word_problems.png"),
                   title=f"GRPO on word problems, math_answer reward, backend {args.backend}")
    first = sum(h["reward/mean"] for h in history[:5]) / min(5, len(history))
    last = sum(h["reward/mean"] for h in history[-5:]) / min(5, len(history))
    print(f"\nmean reward (math_answer), first 5 steps: {first:.3f}   last 5 steps: {last:.3f}")
    for r in (evals[0], evals[-1]):
        print(f"held-out after step {r['step']:3d}: pass@1 {r['eval/pass@1']:.3f}  pass@8 {r['eval/pass@8']:.3f}  "
              f"greedy accuracy {r['eval/greedy_accuracy']:.3f}")
    print(f"evaluation samples: {os.path.join(run_dir, 'eval')}\nplot: {png}")


if __name__ == "__main__":
    main()
