"""Multi-turn rollouts through the trainer: real Ray, ZeRO-3, the embedded engine, the quickstart's policy, async
rollout (the producer thread, with partial rollout: the defaults of --rollout.mode async).

One environment (this module's :func:`make_env`) answers the model's first turn with an observation and ends the
trajectory after the second; two GRPO steps and a held-out evaluation run the agent loop. The producer makes the
batch of step 1 while step 0 trains: its environments answer the first turn only once the trainer has synced
weight version 1 (and the trainer syncs only once they are waiting), so each of those trajectories has a turn from
version 0 and a turn from version 1."""

import json
import os
import sys
import threading

import pytest

from rlhf_sg.agent import Environment, StepResult

RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")
sys.path.insert(0, RECIPES)

import arith_task  # noqa: E402

pytestmark = pytest.mark.slow

OBSERVATION = "=ok;"
WAIT_S = 240.0
#: the step whose batch the producer is making, seen by the environments made on its thread (evaluation's are made
#: on the trainer's thread)
making = threading.local()
first_turns_waiting = threading.Event()  # step 1's environments hold their first answer
synced = threading.Event()  # the trainer has synced weight version 1


class TwoTurns(Environment):
    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.across_a_sync = getattr(making, "step", None) == 1

    def reset(self, prompt):
        self.turns = 0

    def step(self, turn_ids, turn_text, finish_reason):
        self.turns += 1
        if self.turns == 1 and self.across_a_sync:
            first_turns_waiting.set()
            synced.wait(WAIT_S)  # (a timeout shows as the second turn's version below)
        return StepResult(done=self.turns == 2, observation_ids=self.encode(OBSERVATION), tool_call=self.turns == 1)


def make_env(tokenizer):
    return TwoTurns(tokenizer)


def test_trainer_steps_and_evaluation_run_multi_turn_through_the_async_producer(ray_cluster, task, tmp_path):
    import torch
    from quickstart_cpu import make_config

    from rlhf_sg.agent import load_env_factory
    from rlhf_sg.trainer.ppo import PPOTrainer

    assert load_env_factory("test_agent_e2e:make_env") is make_env  # the module whose events the trainer sees
    first_turns_waiting.clear()
    synced.clear()
    policy, prompts = task
    cfg = make_config(policy, prompts, str(tmp_path / "run"), 2, "grpo", "hf", rollout_mode="async")
    assert cfg.rollout.partial_rollout and cfg.rollout.max_staleness == 1
    cfg.log.progress_bar = cfg.log.tensorboard = cfg.log.export_hf = False
    cfg.train.actor_num_ranks, cfg.train.kl_coef = 1, 0.0
    cfg.train.recompute_old_logp = True  # the trainer's log-probs of every token on the experience
    cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt = 4, 4
    cfg.rollout.max_new_tokens = 16
    cfg.agent.env, cfg.agent.max_turn_tokens, cfg.agent.max_turns = "test_agent_e2e:make_env", 4, 3
    cfg.agent.tool_timeout_s = WAIT_S + 60
    cfg.eval.prompt_data, cfg.eval.max_prompts, cfg.eval.before_train = prompts, 4, False
    seen, made = [], {}

    class Trainer(PPOTrainer):
        def _start_async_rollout(self):
            generate = self.rollout.generate

            def recording(prompts, step, draw=0):  # on the producer's thread
                making.step = step
                try:
                    made[step] = generate(prompts, step, draw)
                finally:
                    making.step = None
                return made[step]

            self.rollout.generate = recording
            super()._start_async_rollout()

        def on_experience(self, experience):
            seen.append(experience)
            if self.step == 0:  # step 1's batch has its first turns from version 0 before this step syncs
                assert first_turns_waiting.wait(WAIT_S)

        def on_step_end(self, step, metrics):
            if self.weight_version >= 1:
                synced.set()

    trainer = Trainer(cfg, reward_fn=arith_task.addition_reward)
    try:
        trainer.setup()
        history = trainer.fit()
    finally:
        synced.set()
        trainer.shutdown()
    assert trainer.async_rollout is not None and sorted(made) == [0, 1] and len(seen) == 2
    # every turn's weight version, the sample's the oldest; step 1's trajectories span the sync after step 0
    assert all(t.turn_versions == [0, 0] and t.weight_version == 0 for t in made[0])
    assert all(t.turn_versions == [0, 1] and t.weight_version == 0 for t in made[1])
    assert [h["rollout/staleness_max"] for h in history] == [0, 1]
    assert [h["rollout/partial_samples"] for h in history] == [0, 16]  # samples with tokens of two versions
    for step, (h, exp) in enumerate(zip(history, seen)):
        assert h["agent/turns"] == 2 and h["agent/finish_env_done"] == 1.0 and h["agent/tool_calls"] == 1
        trajectories = made[step]
        # the rows the trainer got are the trajectories: ids, action masks, versions, engine log-probs
        assert exp.weight_version.tolist() == [t.weight_version for t in trajectories]
        T = exp.response_width
        assert exp.action_mask.tolist() == [t.action_mask + [False] * (T - len(t.action_mask)) for t in trajectories]
        response = exp.sequences[:, -T:]
        assert all(response[i, :len(t.token_ids)].tolist() == t.token_ids for i, t in enumerate(trajectories))
        assert torch.equal(exp.rollout_logp, torch.tensor([t.logprobs + [0.0] * (T - len(t.logprobs))
                                                           for t in trajectories]))
        holes = exp.attention_mask[:, -T:].bool() & ~exp.action_mask
        assert (holes.sum(dim=1) == len(OBSERVATION)).all()  # the observation, inside every row, mask 0
        assert (exp.advantages[holes] == 0).all()
        # the trainer (at version `step`) recomputes the engine's log-probs of the tokens that version sampled: all
        # of step 0's, the second turns of step 1's (rows with holes, packed)
        second_turn = torch.zeros_like(exp.action_mask)
        for i, t in enumerate(trajectories):
            second_turn[i, t.action_mask.index(False) + len(OBSERVATION):len(t.action_mask)] = True
        current = exp.action_mask if step == 0 else second_turn & exp.action_mask
        assert current.any() and (exp.rollout_logp - exp.old_logp).abs()[current].max().item() < 1e-4
    # evaluation ran the same loop; the reward saw the model's text only (no observation in it)
    assert trainer.eval_history[-1][1]["eval/agent/turns"] == 2
    records = [json.loads(line) for line in open(tmp_path / "run" / "eval" / "step2.jsonl")]
    assert records and all(OBSERVATION not in r["completion"] for r in records)
    assert all(r["tokens"] > len(OBSERVATION) for r in records)
