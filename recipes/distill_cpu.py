"""On-policy distillation on a laptop CPU: the quickstart's student learns from a stronger teacher, against GRPO on
the reward alone.

What it does, top to bottom:
1. the student is the quickstart's warm-started policy (``quickstart_cpu.prepare``: a ~3M-parameter Qwen2-style
   model after 30 supervised steps on single-digit addition);
2. the teacher is the policy the quickstart's GRPO makes of it in ``--teacher-steps`` steps (default 40, another
   seed), or any model saved with the same tokenizer and vocab size (``--teacher DIR``, e.g. the quickstart's
   ``runs/quickstart/grpo/final_hf``);
3. the teacher's held-out pass@1, measured by the evaluation the runs use (``rlhf_sg.evaluation.evaluate_model``:
   the same engine, prompts, samples and seed);
4. two runs from the student with the quickstart's settings, held-out evaluation after every step:
   ``grpo`` (GRPO on the reward alone) and ``distill`` (``--distill.teacher`` with ``--distill.only``: each sampled
   token's advantage is log pi_teacher - log pi_old; the reward is logged, not trained on);
5. prints both held-out pass@1 curves and training rewards per step, and the first step at which each run reaches
   the teacher's held-out pass@1.

    python recipes/distill_cpu.py [--steps 30] [--teacher DIR | --teacher-steps 40] [--actor-lr 1e-4]
                                  [--out runs/distill]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import arith_task  # noqa: E402
import torch  # noqa: E402
from quickstart_cpu import held_out_accuracy, make_config, prepare  # noqa: E402

from rlhf_sg.config import Config  # noqa: E402
from rlhf_sg.trainer import train  # noqa: E402


def make_teacher(student: str, prompts: str, out: str, steps: int) -> str:
    """The quickstart's GRPO run of ``steps`` steps from the student (seed 1, the comparison runs have 42), exported
    with its tokenizer (reused when there)."""
    run = os.path.join(out, f"teacher_grpo{steps}")
    path = os.path.join(run, "final_hf")
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    cfg = make_config(student, prompts, run, steps, "grpo", "hf")
    cfg.train.seed, cfg.log.progress_bar = 1, False
    print(f"teacher: {steps} GRPO steps from the student ...", flush=True)
    train(cfg, reward_fn=arith_task.addition_reward)
    return path


def run_config(student: str, prompts: str, out: str, steps: int, samples: int, teacher: str | None = None,
               actor_lr: float | None = None) -> Config:
    """The quickstart's GRPO run with held-out evaluation after every step (``samples`` per held-out problem); with
    ``teacher``, distillation alone (``--distill.only``); ``actor_lr``: the policy's learning rate (None: the
    quickstart's)."""
    cfg = make_config(student, prompts, out, steps, "grpo", "hf", evaluate=True, actor_lr=actor_lr)
    cfg.eval.interval, cfg.eval.n_samples, cfg.eval.k, cfg.eval.greedy = 1, samples, [1], False
    cfg.log.progress_bar = False
    if teacher is not None:
        cfg.distill.teacher, cfg.distill.only = teacher, True
    return cfg


def teacher_pass1(teacher: str, cfg: Config) -> float:
    """The teacher's held-out pass@1 under the runs' own evaluation settings."""
    import dataclasses

    from rlhf_sg.evaluation import evaluate_model

    model = dataclasses.replace(cfg.model, pretrain=teacher)
    log = dataclasses.replace(cfg.log, output_dir=os.path.join(os.path.dirname(cfg.log.output_dir), "teacher_eval"))
    run = dataclasses.replace(cfg, model=model, log=log, distill=dataclasses.replace(cfg.distill, teacher=None,
                                                                                        only=False))
    return evaluate_model(run, reward_fn=arith_task.addition_reward)["eval/pass@1"]


def first_reaching(curve: list[tuple[int, float]], target: float) -> str:
    step = next((s for s, p in curve if p >= target), None)
    return "never" if step is None else f"step {step}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--teacher", default=None, help="a teacher model directory (default: built, --teacher-steps)")
    parser.add_argument("--teacher-steps", type=int, default=40, help="GRPO steps that make the teacher")
    parser.add_argument("--eval-samples", type=int, default=32, help="samples per held-out problem")
    parser.add_argument("--actor-lr", type=float, default=None, help="both runs' learning rate (default 1e-4)")
    parser.add_argument("--out", default="runs/distill")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    torch.set_num_threads(1)

    student, prompts = prepare(args.out, warm_start_steps=30)
    teacher = args.teacher or make_teacher(student, prompts, args.out, args.teacher_steps)
    runs = {name: run_config(student, prompts, os.path.join(args.out, name), args.steps, args.eval_samples,
                             teacher if name == "distill" else None, args.actor_lr) for name in ("grpo", "distill")}
    for cfg in runs.values():  # a run's metrics file is appended to: start the comparison afresh
        shutil.rmtree(cfg.log.output_dir, ignore_errors=True)
    target = teacher_pass1(teacher, runs["grpo"])
    rewards = {}
    for name, cfg in runs.items():
        rewards[name] = [h["reward/mean"] for h in train(cfg, reward_fn=arith_task.addition_reward)]
    curves = {name: [(s, p) for s, p, _ in held_out_accuracy(os.path.join(cfg.log.output_dir, "metrics.jsonl"))]
              for name, cfg in runs.items()}

    print(f"\nheld-out pass@1 ({arith_task.HELD_OUT} problems RL never trains on, {args.eval_samples} samples each); "
          f"teacher {teacher}: {target:.3f}")
    print(f"{'step':>4}  {'grpo':>6}  {'distill':>7}   training reward: {'grpo':>6}  {'distill':>7}")
    for (step, g), (_, d) in zip(curves["grpo"], curves["distill"]):
        rg = f"{rewards['grpo'][step - 1]:6.3f}" if step else f"{'':6}"
        rd = f"{rewards['distill'][step - 1]:7.3f}" if step else f"{'':7}"
        print(f"{step:>4}  {g:6.3f}  {d:7.3f}   {'':17}{rg}  {rd}")
    for name in ("grpo", "distill"):
        print(f"{name}: first at or above the teacher's {target:.3f}: {first_reaching(curves[name], target)}")
    print("(training reward: the mean reward of each step's samples; the distill run logs it but does not train on "
          "it)")


if __name__ == "__main__":
    main()
