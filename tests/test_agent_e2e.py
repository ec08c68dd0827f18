"""Multi-turn rollouts through the trainer: real Ray, ZeRO-3, the embedded engine, the quickstart's policy.

One environment (this module's :func:`make_env`) answers the model's first turn with an observation and ends the
trajectory after the second; two GRPO steps and a held-out evaluation run the agent loop."""

import json
import os
import sys

import pytest

from rlhf_sg.agent import Environment, StepResult

RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")
sys.path.insert(0, RECIPES)

import arith_task  # noqa: E402

pytestmark = pytest.mark.slow

OBSERVATION = "=ok;"


class TwoTurns(Environment):
    def reset(self, prompt):
        self.turns = 0

    def step(self, turn_ids, turn_text, finish_reason):
        self.turns += 1
        return StepResult(done=self.turns == 2, observation_ids=self.encode(OBSERVATION), tool_call=self.turns == 1)


def make_env(tokenizer):
    return TwoTurns(tokenizer)


def test_trainer_steps_and_evaluation_run_multi_turn(ray_cluster, task, tmp_path):
    from quickstart_cpu import make_config

    from rlhf_sg.trainer.ppo import PPOTrainer

    policy, prompts = task
    cfg = make_config(policy, prompts, str(tmp_path / "run"), 2, "grpo", "hf")
    cfg.log.progress_bar = cfg.log.tensorboard = cfg.log.export_hf = False
    cfg.train.actor_num_ranks, cfg.train.kl_coef = 1, 0.0
    cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt = 4, 4
    cfg.rollout.max_new_tokens = 16
    cfg.agent.env, cfg.agent.max_turn_tokens, cfg.agent.max_turns = "test_agent_e2e:make_env", 4, 3
    cfg.eval.prompt_data, cfg.eval.max_prompts, cfg.eval.before_train = prompts, 4, False
    seen = []

    class Trainer(PPOTrainer):
        def on_experience(self, experience):
            seen.append(experience)

    trainer = Trainer(cfg, reward_fn=arith_task.addition_reward)
    try:
        trainer.setup()
        history = trainer.fit()
    finally:
        trainer.shutdown()
    for h, exp in zip(history, seen):
        assert h["agent/turns"] == 2 and h["agent/finish_env_done"] == 1.0 and h["agent/tool_calls"] == 1
        response = exp.attention_mask[:, -exp.response_width:].bool()
        holes = response & ~exp.action_mask
        assert (holes.sum(dim=1) == len(OBSERVATION)).all()  # the observation, inside every row, mask 0
        assert (exp.advantages[holes] == 0).all() and (exp.rollout_logp[holes] == 0).all()
        # the trainer's log-probs of the sampled tokens equal the engine's on rows with holes
        assert h["rollout/logp_gap_engine_vs_trainer"] < 1e-4
    # evaluation ran the same loop; the reward saw the model's text only (no observation in it)
    assert trainer.eval_history[-1][1]["eval/agent/turns"] == 2
    records = [json.loads(line) for line in open(tmp_path / "run" / "eval" / "step2.jsonl")]
    assert records and all(OBSERVATION not in r["completion"] for r in records)
    assert all(r["tokens"] > len(OBSERVATION) for r in records)
