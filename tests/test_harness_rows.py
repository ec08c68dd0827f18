"""``--agent.harness`` without Ray: the flag's checks before Ray, harness runs as rows (their own prompt ids, masks
from provenance, the engine's log-probs), unscored runs out of the group baseline and the losses, and the metrics.
The trainer end to end, with the real ``openai`` client: tests/test_harness_trainer.py (slow)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytest.importorskip("fastapi")

from rlhf_sg import algorithms as algo  # noqa: E402
from rlhf_sg.config import Config, ConfigError, validate  # noqa: E402
from rlhf_sg.data import Prompt  # noqa: E402
from rlhf_sg.serve.harness import HarnessResult, as_trajectory  # noqa: E402
from rlhf_sg.serve.sessions import Sample  # noqa: E402
from rlhf_sg.trainer.rollout import RolloutMaker, harness_metrics, harness_scores  # noqa: E402


async def scoring_harness(base_url, api_key, prompt):
    return 1.0


def plain_function(base_url, api_key, prompt):
    return 1.0


@pytest.fixture
def cfg_with(tmp_path):
    from rlhf_sg.tiny import save_tiny_model

    model = save_tiny_model(str(tmp_path / "m"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1="}) + "\n")

    def make(**agent):
        cfg = Config()
        cfg.model.pretrain, cfg.data.prompt_data = model, str(prompts)
        cfg.agent = dataclasses.replace(cfg.agent, **agent)
        return cfg

    return make


def test_harness_flags_are_checked_before_ray(cfg_with):
    ok = "test_harness_rows:scoring_harness"
    assert validate(cfg_with(harness=ok)).reward.function is None  # the harness scores: no reward function needed
    for agent, message in [
        (dict(harness="no_such_module_anywhere:run"), "--agent.harness 'no_such_module_anywhere:run': cannot import"),
        (dict(harness="test_harness_rows"), "give module:function"),
        (dict(harness="test_harness_rows:plain_function"), "is not an async function"),
        (dict(harness="test_harness_rows:nothing"), "is not an async function"),
        (dict(harness=ok, env="rlhf_sg.agent:Environment"), "--agent.harness and --agent.env are exclusive"),
        (dict(harness=ok, harness_workers=0), "--agent.harness_workers must be >= 1"),
        (dict(harness=ok, harness_timeout_s=0.0), "--agent.harness_timeout_s must be > 0"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate(cfg_with(**agent))
    cfg = cfg_with(harness=ok)
    cfg.rollout.mode = "async"
    with pytest.raises(ConfigError, match="--rollout.mode sync only"):
        validate(cfg)


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo"])
def test_unscored_samples_are_out_of_their_groups_baseline(kind):
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(16, generator=g)
    # groups of 3, 2, 1 and no scored samples
    scored = torch.tensor([1, 0, 1, 1, 0, 1, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0], dtype=torch.bool)
    adv = algo.group_advantages(scores, 4, kind, scored)
    for group in range(2):
        rows = [group * 4 + j for j in range(4) if scored[group * 4 + j]]
        alone = algo.group_advantages(scores[rows], len(rows), kind)  # the scored samples as a group alone
        assert torch.allclose(adv[rows], alone, atol=1e-6)
    assert adv[10].item() == 0.0  # one scored sample: no baseline to compare it with
    assert (adv[~scored] == 0).all()
    assert torch.allclose(algo.group_advantages(scores, 4, kind, torch.ones(16, dtype=torch.bool)),
                          algo.group_advantages(scores, 4, kind), atol=1e-6)


def result(index, prompt_ids, token_ids, logprobs, mask, reward, error=None, versions=(0, 0)):
    sample = Sample(list(prompt_ids), list(token_ids), list(logprobs), list(mask), list(versions), "stop",
                    len(versions))
    return HarnessResult(index, sample, reward, len(versions), len(versions) - 1, 0, 1, error)


def test_harness_runs_become_rows_with_their_own_prompt_ids_masks_and_logprobs():
    from rlhf_sg.experience import Experience

    cfg = Config()
    cfg.agent.harness = "test_harness_rows:scoring_harness"
    cfg.rollout.n_samples_per_prompt = 2
    maker = RolloutMaker(cfg, [], None, 2, 0, None, tokenizer=object())
    prompts = [Prompt([9, 9], "q0"), Prompt([8], "q1")]
    runs = [
        result(0, [5, 6, 7], [10, 11, 3, 4, 12], [-0.1, -0.2, 0.0, 0.0, -0.3], [1, 1, 0, 0, 1], 1.0),
        result(0, [5, 6], [13], [-0.4], [1], None, versions=(0,)),  # unscored
        result(1, [7], [14, 15], [-0.5, -0.6], [1, 1], 0.0, versions=(0,)),
        HarnessResult(1, None, None, 0, 0, 0, 0, "TimeoutError: ..."),  # no call at all
    ]
    rows = [as_trajectory(r, prompts[r.prompt_index].token_ids, maker.pad_id) for r in runs]
    maker.harness_results = runs
    exp: Experience = maker._experience(prompts, rows)
    T = exp.response_width
    P = exp.sequences.shape[1] - T
    # each row's prompt is the one the engine prefilled (not the dataset's), left-padded
    assert [exp.sequences[i, P - len(p):P].tolist() for i, p in enumerate([[5, 6, 7], [5, 6], [7], [8]])] == [
        [5, 6, 7], [5, 6], [7], [8]]
    assert exp.attention_mask[:, :P].sum(dim=1).tolist() == [3, 2, 1, 1]
    assert exp.sequences[0, P:].tolist() == [10, 11, 3, 4, 12]
    assert exp.action_mask.tolist() == [[True, True, False, False, True], [True] + [False] * 4,
                                        [True, True] + [False] * 3, [True] + [False] * 4]
    assert torch.allclose(exp.rollout_logp[0], torch.tensor([-0.1, -0.2, 0.0, 0.0, -0.3]))
    assert exp.scored.tolist() == [True, False, True, False] and exp.loss_rows.tolist() == exp.scored.tolist()
    # an unscored run counts as its group's scored mean (0 when none is) wherever the mask is not read
    assert harness_scores(rows, 2).tolist() == [1.0, 1.0, 0.0, 0.0]
    assert torch.equal(maker._agent_scores(prompts, rows, exp), harness_scores(rows, 2))
    assert rows[0].turn_versions == [0, 0] and rows[3].turn_versions == []  # no call: no version to check
    runs[0].auxiliary = 2  # a title and a summary, served aside: counted, not in the row
    m = harness_metrics(runs)
    assert (m["agent/unscored"], m["agent/harness_errors"], m["agent/calls_continued"]) == (2.0, 1.0, 1.0)
    assert m["agent/auxiliary_calls"] == 2.0
    assert m["agent/tool_calls_per_call"] == 3 / 4
    assert T == 5 and P == 3
