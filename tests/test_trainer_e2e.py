"""The trainer end to end on CPU: real Ray, real DeepSpeed ZeRO-3 (2-rank actor), a real tiny model.

The task is the quickstart's (single-digit addition after a short warm start); the reward must rise.
"""

import os
import sys

import pytest

RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")
TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, RECIPES)

import arith_task  # noqa: E402

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow


def make_cfg(task, out, steps, algo="gae", backend="hf", **overrides):
    from quickstart_cpu import make_config

    policy, prompts = task
    cfg = make_config(policy, prompts, out, steps, algo, backend)
    cfg.log.progress_bar = False
    cfg.log.tensorboard = False
    cfg.log.export_hf = False
    # under pytest's 600 s limit, so a rank that never starts or answers is named by the trainer, not by a stack dump
    cfg.train.timeout_s = 400.0
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        setattr(getattr(cfg, section), key, value)
    return cfg


def mean(xs):
    return sum(xs) / len(xs)


def test_reward_rises(ray_cluster, task, tmp_path, algo="gae"):
    """PPO with a critic (GAE) learns the quickstart task; GRPO's learning through the trainer is
    test_async_rollout.py::test_async_run_learns_the_quickstart_task's, and each engine's, test_engine_e2e.py's."""
    from rlhf_sg.trainer import train

    steps = 16
    cfg = make_cfg(task, str(tmp_path / algo), steps=steps, algo=algo)
    history = train(cfg, reward_fn=arith_task.addition_reward)
    rewards = [h["reward/mean"] for h in history]
    assert len(history) == steps
    # 128 samples a step: the step mean's noise is ~0.04, the rise seen over 16 steps ~0.15
    assert mean(rewards[-4:]) > mean(rewards[:4]) + 0.05, rewards
    assert history[-1]["weight_version"] == steps
    # every phase of a PPO step was timed, and the parts add up to the step
    last = history[-1]
    phases = ["generate", "reward", "actor_logprob", "train", "weight_sync"] + (["critic"] if algo == "gae" else [])
    assert all(last[f"time/{p}"] > 0 for p in phases)
    parts = sum(v for k, v in last.items() if k.startswith("time/") and k not in ("time/step",))
    assert parts == pytest.approx(last["time/step"], rel=1e-6)
    assert os.path.isfile(tmp_path / algo / "metrics.jsonl")


def test_generation_delay_is_charged_to_generation(ray_cluster, task, tmp_path):
    """Also the per-phase accounting of those steps: the training FLOPs logged are those of the micro-batches the
    ranks ran (3 x the forward over the shared-prompt segments of each rank's plan), generation's bytes those of the
    step's real tokens, and the fractions are of the ceiling measured at start."""
    import dataclasses

    from rlhf_sg import flops
    from rlhf_sg.memory import load_shape
    from rlhf_sg.packing import UNCAPPED_SEGMENT_TOKENS
    from rlhf_sg.trainer import PPOTrainer, train
    from rlhf_sg.trainer.ppo import microbatch_plans

    experiences, segment_sizes = [], []

    class Keep(PPOTrainer):
        def on_experience(self, experience):
            experiences.append(experience)
            segment_sizes.append(dict(self.accounting.segment_tokens))

    cfg = make_cfg(task, str(tmp_path / "slow"), steps=2, algo="grpo", rollout__backend="slow_backend:SlowBackend",
                   train__kl_coef=0.0)
    history = train(cfg, Keep, reward_fn=arith_task.addition_reward)
    delay = float(os.environ.get("SLOW_BACKEND_DELAY_S", "2.0"))
    for h in history:
        assert h["time/generate"] >= delay
        assert h["time/reward"] < delay / 2
        assert h["time/actor_logprob"] < h["time/generate"]
    shape = dataclasses.replace(load_shape(cfg.model.pretrain), dtype=cfg.model.dtype)
    # the actor's ranks compute shared prompts block by block, so they keep each group whole: the accounting asked
    assert segment_sizes == [{"actor": UNCAPPED_SEGMENT_TOKENS}] * len(history)
    for h, exp in zip(history, experiences):
        # one epoch, one minibatch: each rank's update plan is the scoring plan of every row
        plans = microbatch_plans(exp, 2, cfg.train.max_tokens_per_microbatch, share_prompts=True)
        segments = [s for plan in plans for s in flops.microbatch_segments(
            exp.sequences, exp.attention_mask, exp.response_width, plan, True, UNCAPPED_SEGMENT_TOKENS)]
        assert sum(s.tokens for s in segments) < int(exp.attention_mask.sum())  # prompts counted once
        assert h["perf/train_TFLOP"] == pytest.approx(flops.train_flops(shape, segments) / 1e12, rel=1e-9)
        assert h["perf/train_TFLOPs"] == pytest.approx(h["perf/train_TFLOP"] / h["time/train"], rel=1e-9)
        assert 0 < h["perf/train_of_peak"] < 1
        prompt_len, response_len = flops.row_lengths(exp.attention_mask, exp.response_width)
        assert h["perf/generate_tokens_per_s"] == pytest.approx(sum(response_len) / h["time/generate"], rel=1e-9)
        assert h["perf/generate_bytes_per_token"] == pytest.approx(
            flops.decode_bytes(shape, prompt_len, response_len, cfg.rollout.num_engines) / sum(response_len))
        assert h["perf/generate_TFLOPs"] == pytest.approx(
            flops.decode_flops(shape, prompt_len, response_len) / h["time/generate"] / 1e12, rel=1e-9)
        # the roofline's bound is at least the bandwidth's; the slow backend's delay keeps generation far from it
        assert 0 < h["perf/generate_of_peak_bw"] <= h["perf/generate_of_roofline"] < 1
        assert h["perf/weight_sync_GB"] > 0 and h["perf/weight_sync_over_engine_load"] >= 1


def test_custom_trainer_recipe_replaces_estimator_reward_and_logs_from_hooks(ray_cluster, task, tmp_path):
    import json

    import torch
    from custom_trainer import MedianBaselineTrainer

    from rlhf_sg.trainer import train

    seen = []

    class Checked(MedianBaselineTrainer):
        def on_experience(self, experience):
            super().on_experience(experience)
            seen.append(experience)

    cfg = make_cfg(task, str(tmp_path / "custom"), steps=2, algo="median_baseline", train__kl_coef=0.0)
    history = train(cfg, trainer_cls=Checked, reward_fn=arith_task.addition_reward)
    n = cfg.rollout.n_samples_per_prompt
    for experience in seen:
        scores = experience.scores.view(-1, n)
        median = scores.median(dim=1, keepdim=True).values
        # the registered estimator's advantage: score minus the group median, on every response token
        expected = (scores - median).reshape(-1, 1) * experience.action_mask
        torch.testing.assert_close(experience.advantages, expected)
        # the override's reward: the rule's 1 / 0.1 / 0 minus the length penalty
        assert not set(experience.scores.tolist()) <= {0.0, 0.1, 1.0}
    logged = [json.loads(line) for line in open(tmp_path / "custom" / "metrics.jsonl")]
    assert [r["custom/solved_groups"] for r in logged] == [h["custom/solved_groups"] for h in history]
    assert all(0.0 <= r["custom/solved_groups"] <= 1.0 for r in logged)
