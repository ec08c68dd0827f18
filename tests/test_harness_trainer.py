"""``--agent.harness`` through the trainer: real Ray, ZeRO-3, the embedded engine, the quickstart's policy.

The harness is written with the real ``openai`` client: two ``/v1/completions`` calls per run, the second prompted
with the first's prompt and completion ids (as the endpoint returned them) plus two observation ids, so the row is
prompt, completion (mask 1), observation (mask 0), completion (mask 1). Every fourth run returns None and every
eighth from the seventh raises (one of each step's eight): those rows are unscored, out of the group baseline
and of the losses."""

import itertools

import pytest

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

seen_by_client: dict[str, list] = {}  # api key -> [(prompt_token_ids, token_ids)] of each call, as the client got them
_runs = itertools.count()


async def two_calls(base_url, api_key, prompt):
    k = next(_runs)  # runs start in the order the pool takes them: prompt-major
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    calls = seen_by_client.setdefault(api_key, [])
    # a prompt of the harness's own (one id more than the dataset's): the row must carry it, not the dataset's
    first = await client.completions.create(model="policy", prompt=prompt.token_ids[:1] + prompt.token_ids,
                                            max_tokens=3)
    c1 = first.choices[0].token_ids
    calls.append((first.prompt_token_ids, c1))
    second = await client.completions.create(model="policy", prompt=first.prompt_token_ids + c1 + prompt.token_ids[:2],
                                             max_tokens=3)
    calls.append((second.prompt_token_ids, second.choices[0].token_ids))
    if k % 8 == 6:
        raise RuntimeError("the sandbox died")
    if k % 4 == 3:
        return None
    return float(c1[0] % 2) + 0.5 * float(second.choices[0].token_ids[0] % 2)


def test_harness_rows_are_the_engines_records_with_masks_rewards_and_trainer_logprobs(ray_cluster, task, tmp_path):
    import torch
    from quickstart_cpu import make_config

    from rlhf_sg import algorithms as algo
    from rlhf_sg.trainer.ppo import PPOTrainer

    policy, prompts = task
    cfg = make_config(policy, prompts, str(tmp_path / "run"), 2, "grpo", "hf")
    cfg.log.progress_bar = cfg.log.tensorboard = cfg.log.export_hf = False
    cfg.train.actor_num_ranks, cfg.train.kl_coef = 1, 0.0
    cfg.train.recompute_old_logp = True  # the trainer's log-probs of every token on the experience
    cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt, cfg.rollout.max_new_tokens = 2, 4, 8
    cfg.reward.function = None  # the harness scores
    cfg.agent.harness, cfg.agent.harness_workers, cfg.agent.harness_timeout_s = "test_harness_trainer:two_calls", 3, 300
    seen, results = [], []

    class Trainer(PPOTrainer):
        def on_experience(self, experience):
            seen.append(experience)
            results.append(list(self.rollout.harness_results))

    trainer = Trainer(cfg)
    try:
        trainer.setup()
        history = trainer.fit()
    finally:
        trainer.shutdown()
    assert len(seen) == 2
    for step, (exp, runs, h) in enumerate(zip(seen, results, history)):
        T, B = exp.response_width, exp.batch_size
        P = exp.sequences.shape[1] - T
        assert B == 8 and [r.prompt_index for r in runs] == [0, 0, 0, 0, 1, 1, 1, 1]
        for i, r in enumerate(runs):
            (p1, c1), (p2, c2) = seen_by_client[next(k for k, v in seen_by_client.items() if v and _is(v, r))]
            obs = p2[len(p1) + len(c1):]
            assert p2[: len(p1) + len(c1)] == p1 + c1 and len(obs) == 2  # the second call continued the sample
            assert (r.calls, r.continued, r.forked) == (2, 1, 0)
            # the row: the prompt ids the engine prefilled, its completions and the observation, token-exact
            row = exp.sequences[i][exp.attention_mask[i].bool()].tolist()
            assert row == p1 + c1 + obs + c2
            assert exp.sequences[i, P - len(p1):P].tolist() == p1 and exp.attention_mask[i, :P].sum() == len(p1)
            mask = [True] * len(c1) + [False] * len(obs) + [True] * len(c2)
            assert exp.action_mask[i].tolist() == mask + [False] * (T - len(mask))
            assert exp.weight_version[i].item() == step
        # rewards: the harness's return value; None and the raised run unscored, out of the losses and the baseline
        rewards = [r.reward for r in runs]
        scored = torch.tensor([x is not None for x in rewards])
        assert [r.error for r in runs].count("RuntimeError: the sandbox died") == 1
        assert not scored.all() and scored.any()
        assert exp.scored.tolist() == scored.tolist() and exp.loss_rows.tolist() == scored.tolist()
        assert torch.equal(exp.scores[scored], torch.tensor([x for x in rewards if x is not None]))
        assert h["agent/unscored"] == float((~scored).sum())
        for g in range(2):
            rows = [g * 4 + j for j in range(4) if scored[g * 4 + j]]
            alone = algo.group_advantages(exp.scores[rows], len(rows), "grpo") if len(rows) > 1 else torch.zeros(
                len(rows))
            first = exp.action_mask[rows].float().argmax(dim=1)
            assert torch.allclose(exp.advantages[rows, first], alone, atol=1e-5)
        assert (exp.advantages[~scored] == 0).all()
        # the engine's log-probs as recorded; the trainer's forward on the harness rows gives them
        m = exp.action_mask
        assert torch.allclose(exp.rollout_logp[m], torch.tensor([x for r in runs for x, a in zip(
            r.sample.logprobs, r.sample.action_mask) if a]))
        assert (exp.rollout_logp - exp.old_logp).abs()[m].max().item() < 1e-4


def _is(calls, result) -> bool:
    """Whether the client's view of a run's calls is this result's sample."""
    (p1, c1), (p2, c2) = calls
    s = result.sample
    return s.prompt_ids == p1 and s.token_ids == c1 + p2[len(p1) + len(c1):] + c2
