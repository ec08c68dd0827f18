"""Extending the trainer: a custom advantage estimator, a custom reward, and hooks.

* ``median_baseline``, an advantage estimator registered by name: each sample's score minus the
  median score of its prompt's group (a baseline that one lucky or broken sample cannot drag), spread
  over the response tokens. ``inputs.token_rewards`` adds the run's KL penalty (in ``kl_mode reward``),
  so the estimator never handles the KL itself; ``--algo median_baseline`` selects it like a built-in;
* ``MedianBaselineTrainer`` subclasses :class:`rlhf_sg.trainer.PPOTrainer`:
  ``compute_rewards`` is the task's rule reward minus a small penalty per token beyond the answer;
  ``on_experience`` counts the groups where at least one sample was right, ``on_step_end`` logs that
  fraction as ``custom/solved_groups`` (it lands in metrics.jsonl and TensorBoard).

Run it on the quickstart's task:

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
from rlhf_sg.advantages import register_advantage_estimator  # noqa: E402
from rlhf_sg.trainer import PPOTrainer, train  # noqa: E402


@register_advantage_estimator("median_baseline", needs_groups=True)
def median_baseline(inputs):
    """Score minus the group's median, as the reward of each response's last token (plus the KL penalty on
    every token), summed to the end of the response: (advantages [B, T], no critic returns)."""
    scores = inputs.scores.view(-1, inputs.group_size)
    baselined = (scores - scores.median(dim=1, keepdim=True).values).reshape(-1)
    return algo.discounted_returns(inputs.token_rewards(baselined), inputs.action_mask, 1.0), None


class MedianBaselineTrainer(PPOTrainer):
    #: subtracted per completion token beyond the first two (the answer is one or two digits)
    length_penalty = 0.02
    _solved = float("nan")  # set by on_experience; a step that trains on nothing logs NaN

    def compute_rewards(self, prompts, completions, experience):
        scores = super().compute_rewards(prompts, completions, experience)
        extra = torch.tensor([max(0, len(c.token_ids) - 2) for c in completions], dtype=torch.float32)
        return scores - self.length_penalty * extra

    def on_experience(self, experience):
        n = self.cfg.rollout.n_samples_per_prompt
        right = experience.scores.view(-1, n) > 0.5  # the rule gives 1 for a right answer (minus the penalty)
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
    cfg = make_config(policy, prompts, os.path.join(args.out, "run"), args.steps, "median_baseline", "hf")
    history = train(cfg, trainer_cls=MedianBaselineTrainer, reward_fn=arith_task.addition_reward)
    for h in history:
        solved = h["custom/solved_groups"]
        print(f"step {h['weight_version']:3d}  reward {h['reward/mean']:.3f}  solved groups {solved:.2f}")
    return history


if __name__ == "__main__":
    main()
