"""A small GRPO run in its own process, for the fault tests: ``python tests/fault_run.py OUT POLICY PROMPTS STEPS
[--kill step|checkpoint] [--resume]``.

Every step's prompts go to ``OUT/prompts_seen.jsonl`` (appended: a killed and resumed run shows what each
attempt trained on). ``--kill step`` SIGKILLs the process at the end of step 3, after the step-2 checkpoint;
``--kill checkpoint`` SIGKILLs it while the step-4 checkpoint is half written (the actor's files saved, the
trainer's state not yet). Before the kill, the pids of every process the run started go to ``OUT/pids.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "recipes"))

import arith_task  # noqa: E402

from rlhf_sg.trainer import PPOTrainer, train  # noqa: E402


def descendants(pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


def die(out: str) -> None:
    with open(os.path.join(out, "pids.json"), "w") as f:
        json.dump(descendants(os.getpid()), f)
    os.kill(os.getpid(), signal.SIGKILL)


class _KillAfterActorSave:
    """Stands in the checkpoint's group list after the actor: the actor's files are written, then the process dies
    before the trainer's state is."""

    def __init__(self, out: str):
        self.out = out

    def call(self, *args, **kwargs):
        die(self.out)


def make_trainer(out: str, kill: str | None):
    class Run(PPOTrainer):
        def on_step_end(self, step, metrics):
            with open(os.path.join(out, "prompts_seen.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, "prompts": [p.text for p in self.prompts]}) + "\n")
            if kill == "step" and step == 3:
                die(out)

        def _checkpointed_groups(self):
            groups = super()._checkpointed_groups()
            if kill == "checkpoint" and self.step == 4:
                groups["zz_kill"] = _KillAfterActorSave(out)
            return groups

    return Run


def main() -> None:
    from quickstart_cpu import make_config

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("policy")
    parser.add_argument("prompts")
    parser.add_argument("steps", type=int)
    parser.add_argument("--kill", choices=["step", "checkpoint"])
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    cfg = make_config(args.policy, args.prompts, os.path.join(args.out, "run"), args.steps, "grpo", "hf")
    cfg.train.actor_num_ranks = 1
    cfg.train.kl_coef = 0.0
    cfg.rollout.prompts_per_step = 4
    cfg.rollout.n_samples_per_prompt = 2
    cfg.log.save_steps = 2
    cfg.log.resume = args.resume
    cfg.log.progress_bar = cfg.log.tensorboard = cfg.log.export_hf = False
    train(cfg, trainer_cls=make_trainer(args.out, args.kill), reward_fn=arith_task.addition_reward)


if __name__ == "__main__":
    main()
