"""The step options users of OpenRLHF and verl reach for, each against the reference recipe's formula written here
(not rlhf_sg's code): DAPO's overlong penalty, verl's and Dr.GRPO's loss aggregations, advantage normalisation
without the std (OpenRLHF's no_std_norm), TIS with a lower bound and ICEPOP's mask, dynamic filtering's score range
on clipped scores, truncated samples out of the loss, every EOS id of generation_config.json, and n completions a
prompt. Fast: a tiny model at most, no Ray, no DeepSpeed."""

import json

import pytest
import torch

from rlhf_sg.algorithms import (
    masked_aggregate,
    normalize_advantages,
    overlong_penalty,
    policy_loss,
)
from rlhf_sg.experience import ActorUpdate, Experience, build_rollout_batch
from rlhf_sg.trainer.rollout import check_completions_per_prompt, eos_token_ids, groups_with_signal, has_signal

T = torch.tensor


# ---- DAPO overlong reward shaping ----------------------------------------------------------------------------------
def dapo_overlong_reward(length: int, max_resp_len: int, buffer_len: int, factor: float) -> float:
    """verl recipe/dapo reward manager (DAPO, Yu et al. 2025, eq. 13):
    expected_len = max_resp_len - overlong_buffer_len
    exceed_len = valid_response_length - expected_len
    overlong_reward = min(-exceed_len / overlong_buffer_len * overlong_penalty_factor, 0)"""
    expected_len = max_resp_len - buffer_len
    exceed_len = length - expected_len
    return min(-exceed_len / buffer_len * factor, 0)


@pytest.mark.parametrize("max_new, buffer, factor", [(16, 4, 1.0), (10, 10, 0.5), (8, 3, 2.0)])
def test_overlong_penalty_is_dapos(max_new, buffer, factor):
    lengths = list(range(1, max_new + 1))
    got = overlong_penalty(T(lengths), max_new, buffer, factor).tolist()
    assert got == pytest.approx([dapo_overlong_reward(n, max_new, buffer, factor) for n in lengths])
    assert got[-1] == pytest.approx(-factor)
    assert all(g == 0.0 for g in got[: max_new - buffer])  # no penalty up to max_new - buffer tokens


def test_overlong_penalty_refuses_a_buffer_outside_the_budget():
    with pytest.raises(ValueError, match=r"buffer_len must be in \(0, max_new_tokens = 8\], got 9"):
        overlong_penalty(T([3]), 8, 9)


# ---- loss aggregation ------------------------------------------------------------------------------------------
def verl_agg_loss(loss_mat, loss_mask, mode, budget=None):
    """verl core_algos.agg_loss, for the whole step in one micro-batch:
    seq-mean-token-sum:      torch.mean(torch.sum(loss_mat * loss_mask, dim=-1))
    seq-mean-token-sum-norm: torch.sum(torch.sum(loss_mat * loss_mask, dim=-1)) / loss_mask.shape[-1]
    verl divides the last by the batch's response width and notes it "should ideally be constant"; Dr.GRPO
    (Liu et al. 2025, their masked_mean over a constant generation budget) divides by B x that budget, which is
    what we take: the per-row token sum over the constant budget, then the rows' mean."""
    seq = (loss_mat * loss_mask).sum(dim=-1)
    if mode == "seq_mean_token_sum":
        return seq.mean()
    return seq.sum() / (budget * loss_mat.shape[0])


LOSS = T([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0], [0.5, -1.0, 2.0, 0.25]])
MASK = T([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])


@pytest.mark.parametrize("mode", ["seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_sequence_aggregations_are_verls_and_dr_grpos(mode):
    expected = verl_agg_loss(LOSS, MASK, mode, budget=8).item()
    assert masked_aggregate(LOSS, MASK, mode, token_budget=8).item() == pytest.approx(expected)
    # micro-batches of one step add up to the step's value with the step's rows as the normaliser
    parts = [masked_aggregate(LOSS[rows], MASK[rows], mode, normalizer=3, token_budget=8) for rows in ([0, 2], [1])]
    assert sum(p.item() for p in parts) == pytest.approx(expected)


def test_the_normalised_sum_needs_its_constant():
    with pytest.raises(ValueError, match="pass token_budget > 0"):
        masked_aggregate(LOSS, MASK, "seq_mean_token_sum_norm")


# ---- advantage normalisation -----------------------------------------------------------------------------------------
def test_advantage_norm_center_is_openrlhfs_no_std_norm_and_none_keeps_the_values():
    """OpenRLHF experience_maker: mean = masked mean over all action tokens; with no_std_norm
    ``adv = adv - mean``; otherwise ``adv = (adv - mean) * rsqrt(max(var, 1e-8))``."""
    adv = T([[1.0, 3.0, 7.0], [2.0, 5.0, 0.0]])
    mask = T([[1, 1, 0], [1, 1, 1]]).bool()
    values = [1.0, 3.0, 2.0, 5.0, 0.0]
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    centered = normalize_advantages(adv, mask, "center")
    whitened = normalize_advantages(adv, mask, "whiten")
    assert centered[mask].tolist() == pytest.approx([v - mean for v in values])
    assert whitened[mask].tolist() == pytest.approx([(v - mean) / var ** 0.5 for v in values])
    assert normalize_advantages(adv, mask, "none")[mask].tolist() == values
    assert centered[0, 2] == 0 and normalize_advantages(adv, mask, "none")[0, 2] == 0


# ---- TIS: a lower bound and a mask -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_tis_weight_with_a_lower_bound_truncates_or_masks(mode):
    """truncate: w = clamp(exp(old - rollout), low, cap) (OpenRLHF 'tis', verl token-TIS with a floor);
    mask: w = exp(old - rollout) * 1[low <= w <= cap] (OpenRLHF 'icepop'). With A = 1 and ratio 1 the per-token
    loss is -w, so the token-mean loss is -mean(w)."""
    old = T([[0.0, 0.0, 0.0, 0.0]])
    rollout = T([[0.0, 1.5, -1.5, 0.2]])  # w = 1, e^-1.5 (0.22), e^1.5 (4.48), e^-0.2 (0.82)
    w = [torch.exp(old - rollout)[0, j].item() for j in range(4)]
    low, cap = 0.5, 2.0
    if mode == "truncate":
        ref = [min(max(x, low), cap) for x in w]
    else:
        ref = [x if low <= x <= cap else 0.0 for x in w]
    logp = old.clone()
    loss, metrics = policy_loss(logp, old, torch.ones(1, 4), torch.ones(1, 4), rollout_logp=rollout, tis_cap=cap,
                                tis_low=low, tis_mode=mode)
    assert loss.item() == pytest.approx(-sum(ref) / 4)
    if mode == "mask":
        assert metrics["tis_masked_frac"].item() == pytest.approx(0.5)


def test_tis_low_needs_a_cap_above_it():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="tis_low needs tis_cap and 0 <= tis_low < tis_cap"):
        policy_loss(x, x, x, torch.ones(1, 2), rollout_logp=x, tis_cap=1.0, tis_low=1.0)


# ---- dynamic filtering's range, on clipped scores -------------------------------------------------------------------
def test_a_score_range_drops_groups_whose_mean_is_outside():
    """OpenRLHF: a prompt's samples are kept when lo < mean(scores) < hi."""
    assert has_signal(T([0.0, 1.0, 1.0]), [0.0, 1.0])
    assert not has_signal(T([0.0, 1.0, 1.0]), [0.0, 0.5])  # mean 2/3
    assert not has_signal(T([1.0, 1.0]), [0.0, 2.0])  # no spread: no signal whatever the range
    # dynamic sampling judges on the clipped scores: with --train.score_clip 1, 5 and 9 both clip to 1
    groups = [T([5.0, 9.0]), T([0.0, 0.5]), T([0.25, 0.75])]
    assert groups_with_signal(groups, None) == [True, True, True]
    assert groups_with_signal(groups, 1.0) == [False, True, True]
    assert groups_with_signal(groups, 1.0, [0.3, 1.0]) == [False, False, True]


# ---- truncation ------------------------------------------------------------------------------------------------------
def test_the_finish_reason_becomes_truncated():
    batch = build_rollout_batch([[5], [6], [7], [8]], [[8, 9], [9], [1], [2]], [[0.0, 0.0], [0.0], [0.0], [0.0]],
                                0, finish_reasons=["length", "stop", "length", "abort"])
    assert batch.truncated.tolist() == [True, False, True, False]  # only the engine's "length" is truncation
    assert batch.rows([2, 1]).truncated.tolist() == [True, False]


def _trainer(tmp_path, **train):
    from rlhf_sg.config import Config, validate
    from rlhf_sg.tiny import save_tiny_model
    from rlhf_sg.trainer import PPOTrainer

    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1="}\n')
    cfg = Config()
    cfg.model.pretrain = save_tiny_model(str(tmp_path / "m"))
    cfg.data.prompt_data, cfg.reward.function = str(data), "m:f"
    cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt = 2, 2
    cfg.train.actor_num_ranks = cfg.train.critic_num_ranks = 1
    cfg.train.advantage_estimator = "grpo"
    cfg.log.output_dir = str(tmp_path / "run")
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return PPOTrainer(validate(cfg))


@pytest.mark.parametrize("mask", [False, True])
def test_truncated_samples_leave_the_loss_and_its_normaliser_only_when_asked(tmp_path, mask):
    from rlhf_sg.trainer.ppo import update_plans

    trainer = _trainer(tmp_path, mask_truncated=mask)
    batch = build_rollout_batch([[5], [5], [6], [6]], [[8, 9], [9], [1, 2, 3], [4]], [[0.0] * 2, [0.0], [0.0] * 3,
                                [0.0]], 0, finish_reasons=["length", "stop", "stop", "length"])
    batch.loss_rows = T([True, True, False, True])  # e.g. a filler group's row
    metrics = trainer.mask_truncated(batch)
    assert metrics == {"rollout/truncated_frac": 0.5}
    expected = [False, True, False, False] if mask else [True, True, False, True]
    assert batch.loss_rows.tolist() == expected
    (step,), = update_plans(batch, 1, trainer.cfg.train, trainer.rng)
    assert step.normalizer == sum(n for n, keep in zip([2, 1, 3, 1], expected) if keep)


def test_the_actor_loss_counts_only_the_loss_rows_and_a_rank_with_none_keeps_its_metric_names(tmp_path):
    """Rows outside ``loss_rows`` run through the forward but not into the loss: the loss equals the loss of the
    kept rows alone; a micro-batch with no kept row gives a zero loss (its backward still runs) and the same
    metric names, with no tokens behind them."""
    from transformers import AutoModelForCausalLM

    from rlhf_sg.algorithms import ActorLossConfig
    from rlhf_sg.tiny import save_tiny_model
    from rlhf_sg.workers import actor_microbatch_loss, loss_tokens

    model = AutoModelForCausalLM.from_pretrained(save_tiny_model(str(tmp_path / "m")))
    gen = torch.Generator().manual_seed(0)
    batch = build_rollout_batch([[5, 6], [7], [8, 9, 10]], [[11, 12, 13], [14, 15], [16]],
                                [[-1.0] * 3, [-1.0] * 2, [-1.0]], 0)
    batch.advantages = torch.randn(batch.rollout_logp.shape, generator=gen) * batch.action_mask
    update = ActorUpdate(loss=ActorLossConfig(entropy_coef=0.1), old_logp_from_update=True)
    batch.loss_rows = T([True, False, True])
    loss, metrics = actor_microbatch_loss(model, batch, update, normalizer=4.0)
    alone, _ = actor_microbatch_loss(model, dataclasses_replace(batch.rows([0, 2]), loss_rows=None), update, 4.0)
    assert loss.item() == pytest.approx(alone.item(), abs=1e-6)
    assert loss_tokens(batch).item() == 4
    batch.loss_rows = T([False, False, False])
    zero, none_metrics = actor_microbatch_loss(model, batch, update, normalizer=4.0)
    zero.backward()
    assert zero.item() == 0 and set(none_metrics) == set(metrics) and loss_tokens(batch).item() == 0


@pytest.mark.parametrize("train, expected", [
    ({}, dict(policy_loss="ppo", ratio_level="token", clip_low=0.2, clip_high=0.2, aggregation="token_mean")),
    ({"policy_loss": "gspo"},
     dict(policy_loss="gspo", ratio_level="sequence", clip_low=3e-4, clip_high=4e-4, aggregation="seq_mean")),
    ({"policy_loss": "cispo"},
     dict(policy_loss="cispo", ratio_level="token", clip_low=1.0, clip_high=5.0, aggregation="token_mean")),
    ({"policy_loss": "sapo", "sapo_tau_neg": 2.0}, dict(policy_loss="sapo", ratio_level="token", clip_low=None,
                                                        clip_high=None, sapo_tau_pos=1.0, sapo_tau_neg=2.0)),
    ({"policy_loss": "gmpo"},
     dict(policy_loss="gmpo", ratio_level="sequence", clip_low=0.4, clip_high=0.4, aggregation="seq_mean")),
    ({"policy_loss": "gspo", "clip_high": 1e-3, "loss_aggregation": "token_mean"},
     dict(ratio_level="sequence", clip_low=3e-4, clip_high=1e-3, aggregation="token_mean")),
    ({"policy_loss": "cispo", "ratio_level": "sequence", "clip_low": 0.5},
     dict(ratio_level="sequence", clip_low=0.5, clip_high=5.0)),
])
def test_the_policy_loss_flags_reach_the_workers_loss_configuration(tmp_path, train, expected):
    """What the actor workers get (the frozen ActorUpdate.loss): the loss, and its own ratio level, clip range and
    aggregation where the flags leave them unset; and the step's normaliser counts rows with a sequence mean."""
    from rlhf_sg.trainer.ppo import update_plans

    trainer = _trainer(tmp_path, **train)
    loss = trainer.actor_update().loss
    assert {k: getattr(loss, k) for k in expected} == expected
    batch = build_rollout_batch([[5], [5], [6], [6]], [[8, 9], [9], [1, 2, 3], [4]], [[0.0] * 2, [0.0], [0.0] * 3,
                                [0.0]], 0)
    (step,), = update_plans(batch, 1, trainer.cfg.train, trainer.rng,
                            normalize_rows=loss.aggregation != "token_mean")
    assert step.normalizer == (4 if loss.aggregation == "seq_mean" else 7)


def dataclasses_replace(experience: Experience, **changes) -> Experience:
    import dataclasses

    return dataclasses.replace(experience, **changes)


# ---- EOS ids and n completions a prompt ------------------------------------------------------------------------------
class _Tokenizer:
    eos_token_id = 2


@pytest.mark.parametrize("generation_config, expected", [
    ({"eos_token_id": [151645, 2, 151643]}, (2, 151645, 151643)),
    ({"eos_token_id": 128009}, (2, 128009)),
    ({"bos_token_id": 1}, (2,)),
    (None, (2,)),
])
def test_every_eos_id_of_generation_config_json_is_read(tmp_path, generation_config, expected):
    if generation_config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    assert eos_token_ids(str(tmp_path), _Tokenizer()) == expected


def test_the_engines_stop_on_every_eos_id(tmp_path):
    from rlhf_sg.trainer.rollout import RolloutMaker

    trainer = _trainer(tmp_path)
    trainer.cfg.rollout.stop_token_ids = [7, 2]
    maker = RolloutMaker(trainer.cfg, [], None, (2, 151645), 0, None)
    assert maker.sampling_params().stop_token_ids == (7, 2, 151645)


def test_a_prompt_without_exactly_n_completions_is_named():
    check_completions_per_prompt([2, 2], 2, [[1], [2]], [0, 1])
    with pytest.raises(RuntimeError, match=r"engine 1 returned 1 completion\(s\) for prompt 1 of the call \(token ids "
                                           r"\[4, 5\]\), expected --rollout.n_samples_per_prompt 2"):
        check_completions_per_prompt([2, 1], 2, [[3], [4, 5]], [0, 1])
    with pytest.raises(RuntimeError, match=r"engine 0 returned 3 completion\(s\) for prompt 0"):
        check_completions_per_prompt([3, 2], 2, [[3], [4, 5]], [0, 1])
