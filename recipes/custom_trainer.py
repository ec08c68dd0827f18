"""Extending the trainer by subclassing: a custom advantage estimator, a custom reward, and hooks.

``MedianBaselineTrainer`` changes three things of :class:`rlhf_sg.trainer.PPOTrainer`:

* ``compute_advantages``: each sample's score minus the median score of its prompt's group (a
  baseline that one lucky or broken sample cannot drag), spread over the response tokens; the KL
  penalty and the rest of the PPO step are the library's own;
* ``compute_rewards``: the task's rule reward minus a small penalty per token beyond the answer;
* hooks: ``on_experience`` counts the groups where at least one sample was right, ``on_step_end``
  logs that fraction as ``custom/solved_groups`` (it lands in metrics.jsonl and TensorBoard).

Run it on the quickstart's task (critic-free, so ``--algo`` names a group estimator; the override
replaces its advantages):

    python recipes/custom_trainer.py [--steps 20] [--out runs/custom_trainer]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import arith_task  # noqa: E402
import torch  # noqa: E402

from rlhf_sg import algorithms as algo  # noqa: E402
from rlhf_sg.trainer import PPOTrainer, train  # noqa: E402


class MedianBaselineTrainer(PPOTrainer):
    #: subtracted per completion token beyond the first two (the answer is one or two digits)
    length_penalty = 0.02
    _solved = float("nan")  # set by on_experience; a step that trains on nothing logs NaN

    def compute_rewards(self, prompts, completions, batch):
        scores = super().compute_rewards(prompts, completions, batch)
        extra = torch.tensor([max(0, len(c.token_ids) - 2) for c in completions], dtype=torch.float32)
        return scores - self.length_penalty * extra

    def compute_advantages(self, batch):
        n = self.cfg.rollout.n_samples_per_prompt
        scores = batch["scores"].view(-1, n)
        seq_adv = (scores - scores.median(dim=1, keepdim=True).values).reshape(-1)
        mask = batch["action_mask"]
        kl = batch.get("kl")
        kl_coef = self.kl_ctl.value if kl is not None and self.cfg.train.kl_mode == "reward" else 0.0
        rewards = algo.shape_rewards(seq_adv, kl if kl is not None else torch.zeros_like(mask, dtype=torch.float32),
                                     mask, kl_coef)
        batch["advantages"] = algo.discounted_returns(rewards, mask, 1.0)

    def on_experience(self, batch):
        n = self.cfg.rollout.n_samples_per_prompt
        right = batch["scores"].view(-1, n) > 0.5  # the rule gives 1 for a right answer (minus the penalty)
        self._solved = right.any(dim=1).float().mean().item()

    def on_step_end(self, step, metrics):
        metrics["custom/solved_groups"] = self._solved


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    from quickstart_cpu import make_config, prepare

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="runs/custom_trainer")
    parser.add_argument("--warm-start-steps", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    policy, prompts = prepare(args.out, args.warm_start_steps)
    cfg = make_config(policy, prompts, os.path.join(args.out, "run"), args.steps, "dr_grpo", "hf")
    history = train(cfg, trainer_cls=MedianBaselineTrainer, reward_fn=arith_task.addition_reward)
    for h in history:
        solved = h["custom/solved_groups"]
        print(f"step {h['weight_version']:3d}  reward {h['reward/mean']:.3f}  solved groups {solved:.2f}")
    return history


if __name__ == "__main__":
    main()
