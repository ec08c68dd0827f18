"""The algorithm core as a specification: asymmetric hand cases that cannot cancel, boundaries of every
validation rule (one failing and one passing input each), and the exact error message of each rule
(every message starts with the function's name and names the argument at fault)."""

import math
import re

import pytest
import torch

from rlhf_sg.algorithms import (
    ActorLossConfig,
    AdaptiveKLController,
    actor_loss,
    approx_kl,
    discounted_returns,
    gae,
    group_advantages,
    masked_aggregate,
    masked_mean,
    masked_whiten,
    policy_loss,
    reinforce_baseline_advantages,
    shape_rewards,
    value_loss,
)

T = torch.tensor
ONES = torch.ones(2, 3)
ZEROS = torch.zeros(2, 3)


def raises_exactly(message: str):
    """pytest.raises(ValueError) whose message is exactly ``message``."""
    return pytest.raises(ValueError, match="^" + re.escape(message) + "$")


# ---- every error names its function and the argument at fault -----------------------------------------
SHAPE_ERRORS = [
    (lambda: masked_mean(ZEROS, torch.ones(2, 2)), "masked_mean: mask has shape (2, 2) but x has shape (2, 3)"),
    (lambda: masked_whiten(ZEROS, torch.ones(3, 3)), "masked_whiten: mask has shape (3, 3) but x has shape (2, 3)"),
    (lambda: approx_kl(ZEROS, torch.zeros(2, 4)), "approx_kl: ref_logp has shape (2, 4) but logp has shape (2, 3)"),
    (lambda: shape_rewards(T([1.0, 2.0]), ZEROS, torch.ones(2, 4), 0.1),
     "shape_rewards: action_mask has shape (2, 4) but kl has shape (2, 3)"),
    (lambda: masked_aggregate(ZEROS, torch.ones(2, 4)),
     "masked_aggregate: action_mask has shape (2, 4) but per_token has shape (2, 3)"),
    (lambda: policy_loss(ZEROS, ZEROS, torch.zeros(2, 4), ONES),
     "policy_loss: advantages has shape (2, 4) but logp has shape (2, 3)"),
    (lambda: policy_loss(ZEROS, ZEROS, ZEROS, torch.ones(2, 4)),
     "policy_loss: action_mask has shape (2, 4) but logp has shape (2, 3)"),
    (lambda: policy_loss(ZEROS, ZEROS, ZEROS, ONES, rollout_logp=torch.zeros(2, 4), tis_cap=2.0),
     "policy_loss: rollout_logp has shape (2, 4) but logp has shape (2, 3)"),
    (lambda: value_loss(torch.zeros(2, 4), ZEROS, ZEROS, ONES),
     "value_loss: old_values has shape (2, 3) but values has shape (2, 4)"),
    (lambda: value_loss(ZEROS, torch.zeros(2, 4), ZEROS, ONES),
     "value_loss: old_values has shape (2, 4) but values has shape (2, 3)"),
    (lambda: value_loss(ZEROS, ZEROS, ZEROS, torch.ones(2, 4)),
     "value_loss: action_mask has shape (2, 4) but values has shape (2, 3)"),
    (lambda: gae(ZEROS, torch.zeros(2, 4), ONES), "gae: values has shape (2, 4) but rewards has shape (2, 3)"),
    (lambda: gae(ZEROS, ZEROS, torch.ones(3, 3)), "gae: action_mask has shape (3, 3) but rewards has shape (2, 3)"),
    (lambda: gae(torch.zeros(2, 4), ZEROS, ONES), "gae: values has shape (2, 3) but rewards has shape (2, 4)"),
    (lambda: discounted_returns(ZEROS, torch.ones(2, 4)),
     "discounted_returns: action_mask has shape (2, 4) but rewards has shape (2, 3)"),
    (lambda: discounted_returns(torch.zeros(3, 3), ONES),
     "discounted_returns: action_mask has shape (2, 3) but rewards has shape (3, 3)"),
]


@pytest.mark.parametrize("call, message", SHAPE_ERRORS, ids=[m.split(":")[0] + str(i) for i, (_, m) in
                                                            enumerate(SHAPE_ERRORS)])
def test_a_shape_mismatch_names_the_function_and_both_arguments(call, message):
    with raises_exactly(message + "; they must match"):
        call()


NOT_2D = [
    (lambda: shape_rewards(T([1.0]), torch.zeros(3), torch.ones(3), 0.1), "shape_rewards: kl", (3,)),
    (lambda: masked_aggregate(torch.zeros(3), torch.ones(3)), "masked_aggregate: per_token", (3,)),
    (lambda: policy_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.ones(3)), "policy_loss: logp", (3,)),
    (lambda: value_loss(torch.zeros(1, 1, 2), *[torch.zeros(1, 1, 2)] * 3), "value_loss: values", (1, 1, 2)),
    (lambda: gae(torch.zeros(3), torch.zeros(3), torch.ones(3)), "gae: rewards", (3,)),
    (lambda: discounted_returns(torch.zeros(3), torch.ones(3)), "discounted_returns: rewards", (3,)),
]


@pytest.mark.parametrize("call, who, shape", NOT_2D, ids=[w.split(":")[0] for _, w, _ in NOT_2D])
def test_a_tensor_that_is_not_b_by_t_is_named(call, who, shape):
    with raises_exactly(f"{who} must be [B, T], got shape {shape}"):
        call()


MASK_USERS = {
    "masked_mean": lambda m: masked_mean(ZEROS, m),
    "masked_whiten": lambda m: masked_whiten(ZEROS, m),
    "shape_rewards": lambda m: shape_rewards(T([0.0, 0.0]), ZEROS, m, 0.1),
    "masked_aggregate": lambda m: masked_aggregate(ZEROS, m),
    "policy_loss": lambda m: policy_loss(ZEROS, ZEROS, ZEROS, m),
    "value_loss": lambda m: value_loss(ZEROS, ZEROS, ZEROS, m),
    "actor_loss": lambda m: actor_loss(ZEROS, ZEROS, ZEROS, ZEROS, m, ActorLossConfig(), 1.0),
    "gae": lambda m: gae(ZEROS, ZEROS, m),
    "discounted_returns": lambda m: discounted_returns(ZEROS, m),
}


@pytest.mark.parametrize("fn", sorted(MASK_USERS))
def test_a_mask_of_complex_numbers_is_refused_naming_the_function(fn):
    with raises_exactly(f"{fn}: mask must be bool or 0/1 numbers, got dtype torch.complex64"):
        MASK_USERS[fn](torch.ones(2, 3, dtype=torch.complex64))


@pytest.mark.parametrize("fn", ["shape_rewards", "masked_aggregate", "policy_loss", "value_loss", "actor_loss"])
def test_an_action_mask_row_without_tokens_is_named_by_row(fn):
    mask = torch.ones(2, 3)
    mask[1] = 0
    named = "policy_loss" if fn == "actor_loss" else fn  # the actor loss checks through the surrogate
    with raises_exactly(f"{named}: action_mask has no token set in row(s) [1]; every sample needs >= 1 action token"):
        MASK_USERS[fn](mask)


@pytest.mark.parametrize("empty_rows, listed", [(8, "[0, 1, 2, 3, 4, 5, 6, 7]"),
                                                (9, "[0, 1, 2, 3, 4, 5, 6, 7] (and 1 more)"),
                                                (11, "[0, 1, 2, 3, 4, 5, 6, 7] (and 3 more)")])
def test_empty_rows_list_the_first_eight_and_count_the_rest(empty_rows, listed):
    mask = torch.zeros(empty_rows + 1, 2)
    mask[-1] = 1
    x = torch.zeros_like(mask)
    with raises_exactly(f"policy_loss: action_mask has no token set in row(s) {listed}; "
                        "every sample needs >= 1 action token"):
        policy_loss(x, x, x, mask)


def test_masked_mean_empty_mask_and_empty_slices_are_named():
    with raises_exactly("masked_mean: mask is empty (no position set); nothing to average"):
        masked_mean(ZEROS, torch.zeros(2, 3))
    mask = torch.ones(12, 2)
    mask[[1, 3, 4, 5, 6, 7, 8, 9, 10]] = 0  # nine empty rows: the first eight are listed
    with raises_exactly("masked_mean: mask is empty along dim 1 at index [1, 3, 4, 5, 6, 7, 8, 9]; "
                        "nothing to average there"):
        masked_mean(torch.zeros(12, 2), mask, dim=1)


def test_masked_statistics_keep_the_input_dtype():
    x = T([[1.0 + 2**-40, 3.0]], dtype=torch.float64)
    m = T([[1, 0]])
    assert masked_mean(x, m).dtype == torch.float64 and masked_mean(x, m).item() == 1.0 + 2**-40
    assert masked_whiten(x, torch.ones(1, 2)).dtype == torch.float64
    assert masked_aggregate(x, T([[1, 1]])).dtype == torch.float64


# ---- shape_rewards, group advantages, REINFORCE++ with a baseline ------------------------------------------
def test_shape_rewards_validation_boundaries():
    kl, m = torch.zeros(2, 5), torch.ones(2, 5)
    with raises_exactly("shape_rewards: score must be [B] = [2], got shape (5,)"):
        shape_rewards(torch.zeros(5), kl, m, 0.1)
    with raises_exactly("shape_rewards: score_clip must be > 0 or None, got 0"):
        shape_rewards(torch.zeros(2), kl, m, 0.1, score_clip=0)
    # a clip below 1 is a clip like any other; both signs are clipped
    out = shape_rewards(T([3.0, -3.0]), kl, m, 0.1, score_clip=0.5)
    assert out[:, -1].tolist() == [0.5, -0.5]


def test_group_advantages_default_is_grpo_and_bad_group_sizes_are_named():
    scores = T([1.0, 3.0, 2.0, 2.0])
    # grpo: (s - mean) / (unbiased std + 1e-6); group 1: mean 2, std sqrt(2)
    expected = [-1 / (math.sqrt(2) + 1e-6), 1 / (math.sqrt(2) + 1e-6), 0.0, 0.0]
    assert group_advantages(scores, 2).tolist() == pytest.approx(expected)
    with raises_exactly("group_advantages: group_size 3 does not divide the batch of 4 scores; "
                        "each prompt needs exactly group_size samples"):
        group_advantages(scores, 3)
    with raises_exactly("group_advantages: unknown kind 'ppo'; expected one of "
                        "['grpo', 'dr_grpo', 'rloo', 'reinforce_baseline']"):
        group_advantages(scores, 2, "ppo")


def test_reinforce_baseline_defaults_to_undiscounted_returns_and_clips_both_signs():
    # one group of two one-token samples, no KL: baselined scores after clipping to [-1, 1]
    mask = torch.ones(2, 2)
    kl = torch.zeros(2, 2)
    # scores 5 and -5 clip to 1 and -1: baselined 1, -1; rewards on the last token; returns with gamma 1:
    # [[1, 1], [-1, -1]]; whitened: mean 0, var 1 -> unchanged. With gamma 2 the first column would double.
    adv = reinforce_baseline_advantages(T([5.0, -5.0]), kl, mask, group_size=2, kl_coef=0.1, score_clip=1.0)
    assert adv.tolist() == [[1.0, 1.0], [-1.0, -1.0]]
    with raises_exactly("reinforce_baseline_advantages: score_clip must be > 0 or None, got 0"):
        reinforce_baseline_advantages(T([5.0, -5.0]), kl, mask, 2, 0.1, score_clip=0)


# ---- masked_aggregate -------------------------------------------------------------------------------------
def test_masked_aggregate_default_normalizer_and_its_rules():
    x = T([[1.0, 2.0, 100.0], [4.0, 100.0, 100.0]])
    m = T([[1, 1, 0], [1, 0, 0]])
    assert masked_aggregate(x, m).item() == pytest.approx(7 / 3)  # default: token_mean
    assert masked_aggregate(x, m, "seq_mean").item() == pytest.approx((1.5 + 4) / 2)
    assert masked_aggregate(x, m, normalizer=0.5).item() == pytest.approx(14.0)  # below 1 is allowed
    for bad in (0, -1.0):
        with raises_exactly(f"masked_aggregate: normalizer must be > 0 or None, got {bad}"):
            masked_aggregate(x, m, normalizer=bad)
    with raises_exactly("masked_aggregate: unknown aggregation 'sum'; expected one of ['token_mean', 'seq_mean', "
                        "'seq_mean_token_sum', 'seq_mean_token_sum_norm']"):
        masked_aggregate(x, m, "sum")


# ---- policy loss --------------------------------------------------------------------------------------------
def test_policy_loss_asymmetric_hand_case_with_a_nonzero_old_policy():
    """clip_low 0.1, clip_high 0.3, old log-probs not zero, tokens whose errors cannot cancel."""
    old = T([[-1.0, -2.0, -0.5, -1.5]])
    log_ratio = T([[math.log(1.5), math.log(0.5), math.log(1.1), math.log(0.8)]])
    adv = T([[2.0, -1.0, 1.0, 3.0]])
    loss, metrics = policy_loss(old + log_ratio, old, adv, torch.ones(1, 4), clip_low=0.1, clip_high=0.3)
    # token 0: A>0, ratio 1.5 -> min(1.5, 1.3) * 2 = 2.6
    # token 1: A<0, ratio 0.5 -> min(-0.5, -0.9) = -0.9
    # token 2: ratio 1.1 inside [0.9, 1.3] -> 1.1
    # token 3: A>0, ratio 0.8 below 0.9 -> min(2.4, 2.7) = 2.4 (unclipped side is smaller)
    assert loss.item() == pytest.approx(-(2.6 - 0.9 + 1.1 + 2.4) / 4, abs=1e-6)
    assert metrics["clip_frac"].item() == pytest.approx(2 / 4)
    assert metrics["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 1.1 + 0.8) / 4, abs=1e-6)
    # swapping the two clip widths changes the loss: token 0 -> 1.1 * 2, token 1 -> -0.7
    swapped, _ = policy_loss(old + log_ratio, old, adv, torch.ones(1, 4), clip_low=0.3, clip_high=0.1)
    assert swapped.item() == pytest.approx(-(2.2 - 0.7 + 1.1 + 2.4) / 4, abs=1e-6)


def test_policy_loss_log_ratio_is_clamped_to_twenty_both_ways():
    old = torch.zeros(1, 2)
    logp = T([[30.0, -30.0]])
    _, metrics = policy_loss(logp, old, torch.zeros(1, 2), torch.ones(1, 2))
    assert metrics["ratio_mean"].item() == pytest.approx((math.exp(20) + math.exp(-20)) / 2, rel=1e-6)
    assert metrics["ppo_kl"].item() == pytest.approx(0.0, abs=1e-6)  # -(20 - 20) / 2
    _, low = policy_loss(T([[-30.0]]), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1))
    assert low["ppo_kl"].item() == 20.0


def test_policy_loss_validation_boundaries():
    x, m = torch.zeros(1, 2), torch.ones(1, 2)
    rule = "policy_loss: need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={}, clip_high={}"
    for low, high in ((-0.1, 0.2), (1.0, 0.2), (1.5, 0.2), (0.2, -0.1)):
        with raises_exactly(rule.format(low, high)):
            policy_loss(x, x, x, m, clip_low=low, clip_high=high)
    policy_loss(x, x, x, m, clip_low=0.0, clip_high=0.0)  # both ends of the allowed ranges
    policy_loss(x, x, x, m, clip_low=0.99, clip_high=5.0)
    for bad in (1.0, 0.5):
        with raises_exactly(f"policy_loss: dual_clip must be > 1 (or None), got {bad}"):
            policy_loss(x, x, x, m, dual_clip=bad)
    policy_loss(x, x, x, m, dual_clip=1.5)
    for bad in (0.0, -1.0):
        with raises_exactly(f"policy_loss: tis_cap must be > 0, got {bad}"):
            policy_loss(x, x, x, m, rollout_logp=x, tis_cap=bad)
    policy_loss(x, x, x, m, rollout_logp=x, tis_cap=0.5)
    with raises_exactly("policy_loss: rollout_logp and tis_cap go together; pass both for truncated IS or neither"):
        policy_loss(x, x, x, m, tis_cap=2.0)
    with raises_exactly("policy_loss: normalizer must be > 0 or None, got 0"):
        policy_loss(x, x, x, m, normalizer=0)


def test_dual_clip_caps_only_negative_advantages_at_c_times_abs_a():
    c = 3.0
    #            A=-2 far out    A=-2 inside   A=+2 far out   A=+0.5 far out  A=0
    adv = T([[-2.0, -2.0, 2.0, 0.5, 0.0]])
    log_ratio = T([[math.log(4.0), 0.0, math.log(4.0), math.log(4.0), math.log(4.0)]])
    loss, metrics = policy_loss(log_ratio, torch.zeros(1, 5), adv, torch.ones(1, 5), dual_clip=c)
    # token 0: plain loss 4 * 2 = 8 > cap 3 * 2 = 6 -> 6; token 1: 2 (below the cap)
    # token 2: -min(8, 2.4) = -2.4; token 3: -min(2, 0.6) = -0.6; token 4: 0
    assert loss.item() == pytest.approx((6 + 2 - 2.4 - 0.6 + 0) / 5, abs=1e-6)
    assert metrics["dual_clip_frac"].item() == pytest.approx(1 / 5)


def test_dual_clip_at_exactly_the_cap_is_not_counted_as_clipped():
    x = T([[0.5]])
    c = torch.exp(x).item()  # the float32 ratio exactly: the loss equals the cap
    loss, metrics = policy_loss(x, torch.zeros(1, 1), T([[-1.0]]), torch.ones(1, 1), dual_clip=c)
    assert loss.item() == pytest.approx(c)
    assert metrics["dual_clip_frac"].item() == 0.0


def test_truncated_is_weight_log_is_clamped_at_minus_twenty():
    x = torch.zeros(1, 1)
    _, metrics = policy_loss(x, x, T([[1.0]]), torch.ones(1, 1), rollout_logp=T([[30.0]]), tis_cap=2.0)
    assert metrics["tis_weight_mean"].item() == pytest.approx(math.exp(-20), rel=1e-5)


# ---- value loss ---------------------------------------------------------------------------------------------
def test_value_loss_hand_case_with_nonzero_returns_and_clip_both_ways():
    v = T([[2.0, 0.0, 1.1]])
    old = T([[1.0, 1.0, 1.0]])
    ret = T([[1.5, 2.0, 1.0]])
    plain, metrics = value_loss(v, old, ret, torch.ones(1, 3))
    # 0.5 * ((0.5)^2 + 2^2 + 0.1^2) / 3
    assert plain.item() == pytest.approx(0.5 * (0.25 + 4 + 0.01) / 3, abs=1e-6)
    assert metrics["value_mean"].item() == pytest.approx(3.1 / 3)
    assert metrics["clip_frac"].item() == 0.0
    clipped, metrics = value_loss(v, old, ret, torch.ones(1, 3), clip=0.2)
    # token 0: v_clip 1.2 -> max(0.25, 0.09) = 0.25; token 1: v_clip 0.8 -> max(4, 1.44) = 4
    # token 2: within the clip, v_clip = v -> 0.01 (equal errors: not counted as clipped)
    assert clipped.item() == pytest.approx(0.5 * (0.25 + 4 + 0.01) / 3, abs=1e-6)
    assert metrics["clip_frac"].item() == 0.0
    # moved past the target by more than the clip: the clipped error is the larger one
    moved, metrics = value_loss(T([[3.0]]), T([[1.0]]), T([[2.5]]), torch.ones(1, 1), clip=0.5)
    assert moved.item() == pytest.approx(0.5 * 1.0**2)  # v_clip 1.5: (1.5 - 2.5)^2 = 1 > 0.25
    assert metrics["clip_frac"].item() == 1.0
    half, _ = value_loss(v, old, ret, torch.ones(1, 3), normalizer=6.0)
    assert half.item() == pytest.approx(0.5 * (0.25 + 4 + 0.01) / 6, abs=1e-6)


def test_value_loss_validation():
    x, m = torch.zeros(1, 2), torch.ones(1, 2)
    with raises_exactly("value_loss: clip must be > 0 or None, got -0.5"):
        value_loss(x, x, x, m, clip=-0.5)
    with raises_exactly("value_loss: normalizer must be > 0 or None, got 0"):
        value_loss(x, x, x, m, normalizer=0)


# ---- actor loss ----------------------------------------------------------------------------------------------
def _actor_inputs():
    logp = T([[-1.0, -0.5, -2.0], [-0.3, -0.2, 0.0]])
    old = T([[-1.1, -0.4, -1.5], [-0.3, -1.0, 0.0]])
    adv = T([[1.0, -2.0, 0.5], [3.0, -1.0, 0.0]])
    ref = T([[-0.9, -0.8, -2.5], [-0.1, -1.2, 0.0]])
    rollout = T([[-1.0, -0.2, -1.5], [-0.6, -1.0, 0.0]])
    entropy = T([[1.0, 2.0, 0.5], [0.25, 4.0, 0.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    return logp, entropy, old, adv, mask, ref, rollout


def test_actor_loss_is_surrogate_plus_kl_minus_entropy_with_every_setting_passed_through():
    logp, entropy, old, adv, mask, ref, rollout = _actor_inputs()
    cfg = ActorLossConfig(clip_low=0.05, clip_high=0.1, dual_clip=1.5, tis_cap=1.2, aggregation="seq_mean",
                          kl_coef=0.5, kl_estimator="k2", entropy_coef=0.25)
    loss, metrics = actor_loss(logp, entropy, old, adv, mask, cfg, normalizer=4.0, rollout_logp=rollout,
                               ref_logp=ref)
    surrogate, _ = policy_loss(logp, old, adv, mask, 0.05, 0.1, 1.5, rollout, 1.2, "seq_mean", 4.0)
    kl = approx_kl(logp, ref, "k2")
    # seq_mean with normalizer 4: row sums of token means / 4
    kl_term = ((kl[0, :3].mean() + kl[1, :2].mean()) / 4).item()
    entropy_term = ((1.0 + 2.0 + 0.5) / 3 + (0.25 + 4.0) / 2) / 4
    assert loss.item() == pytest.approx(surrogate.item() + 0.5 * kl_term - 0.25 * entropy_term, abs=1e-6)
    assert metrics["kl_loss"].item() == pytest.approx(kl[mask.bool()].mean().item())
    assert metrics["entropy"].item() == pytest.approx((1.0 + 2.0 + 0.5 + 0.25 + 4.0) / 5)
    # every setting matters: the surrogate with the defaults instead would differ
    default_surrogate, _ = policy_loss(logp, old, adv, mask, normalizer=4.0)
    assert default_surrogate.item() != pytest.approx(surrogate.item(), abs=1e-4)


@pytest.mark.parametrize("field, value", [("clip_low", 0.5), ("clip_high", 0.01), ("dual_clip", 1.05),
                                          ("tis_cap", 0.3), ("aggregation", "token_mean")])
def test_actor_loss_passes_each_surrogate_setting(field, value):
    logp, entropy, old, adv, mask, _, rollout = _actor_inputs()
    base = dict(clip_low=0.05, clip_high=0.1, dual_clip=1.5, tis_cap=1.2, aggregation="seq_mean")
    changed = {**base, field: value}
    a, _ = actor_loss(logp, entropy, old, adv, mask, ActorLossConfig(**base), 4.0, rollout_logp=rollout)
    b, _ = actor_loss(logp, entropy, old, adv, mask, ActorLossConfig(**changed), 4.0, rollout_logp=rollout)
    assert a.item() != pytest.approx(b.item(), abs=1e-5), f"{field} did not reach the surrogate"


def test_actor_loss_small_coefficients_count_and_zero_coefficients_need_nothing():
    logp, entropy, old, adv, mask, ref, rollout = _actor_inputs()
    base, _ = actor_loss(logp, entropy, old, adv, mask, ActorLossConfig(), 5.0)
    with_kl, metrics = actor_loss(logp, entropy, old, adv, mask, ActorLossConfig(kl_coef=0.5), 5.0, ref_logp=ref)
    kl = approx_kl(logp, ref, "k3")  # the loss's default estimator (k1's expected gradient is 0)
    assert with_kl.item() == pytest.approx(base.item() + 0.5 * kl[mask.bool()].sum().item() / 5, abs=1e-6)
    assert "kl_loss" in metrics
    with_entropy, _ = actor_loss(logp, entropy, old, adv, mask, ActorLossConfig(entropy_coef=0.5), 5.0)
    assert with_entropy.item() == pytest.approx(base.item() - 0.5 * 7.75 / 5, abs=1e-6)
    # no KL term and no entropy term: no ref_logp needed, no kl metric, a non-finite entropy stays out
    bad_entropy = entropy.clone()
    bad_entropy[0, 0] = float("inf")
    loss, metrics = actor_loss(logp, bad_entropy, old, adv, mask, ActorLossConfig(), 5.0, rollout_logp=rollout)
    assert loss.item() == base.item() and "kl_loss" not in metrics
    with raises_exactly("actor_loss: kl_coef > 0 puts a KL term in the loss; pass ref_logp"):
        actor_loss(logp, entropy, old, adv, mask, ActorLossConfig(kl_coef=0.01), 5.0)


# ---- the adaptive KL controller ---------------------------------------------------------------------------
def test_adaptive_kl_controller_hand_case_off_unit_target_and_steps():
    c = AdaptiveKLController(0.1, target=2.0, horizon=100)
    c.update(current_kl=2.2, n_steps=2)  # error = 2.2 / 2 - 1 = 0.1 -> value *= 1 + 0.1 * 2 / 100
    assert c.value == pytest.approx(0.1 * 1.002, rel=1e-12)
    AdaptiveKLController(0.1, target=0.5, horizon=1)  # the smallest horizon
    for target, horizon in ((0.0, 10), (-1.0, 10), (1.0, 0), (1.0, -3)):
        with raises_exactly(f"AdaptiveKLController: target and horizon must be > 0, got {target}, {horizon}"):
            AdaptiveKLController(0.1, target=target, horizon=horizon)


def test_reinforce_baseline_clips_before_the_baseline_not_after_whitening():
    # two groups of two: clipped to [-1, 1] the scores are (1, -1), (0.5, -0.5), whose baselined values keep a 2:1
    # ratio after whitening; a score clipped on one side only would give (3, -3), (0.5, -0.5): 6:1
    mask, kl = torch.ones(4, 1), torch.zeros(4, 1)
    adv = reinforce_baseline_advantages(T([5.0, -5.0, 0.5, -0.5]), kl, mask, group_size=2, kl_coef=0.0,
                                        score_clip=1.0)
    assert adv[0, 0].item() == pytest.approx(2 * adv[2, 0].item())
    assert adv[1, 0].item() == pytest.approx(-adv[0, 0].item())


@pytest.mark.parametrize("fn", ["policy_loss", "value_loss"])
def test_a_loss_names_itself_for_an_unknown_aggregation(fn):
    x, m = torch.zeros(1, 2), torch.ones(1, 2)
    call = {"policy_loss": lambda: policy_loss(x, x, x, m, aggregation="mean"),
            "value_loss": lambda: value_loss(x, x, x, m, aggregation="mean")}[fn]
    with raises_exactly(f"{fn}: unknown aggregation 'mean'; expected one of ['token_mean', 'seq_mean', "
                        "'seq_mean_token_sum', 'seq_mean_token_sum_norm']"):
        call()


def test_fixed_kl_controller_keeps_its_value():
    from rlhf_sg.algorithms import FixedKLController

    c = FixedKLController(1)
    assert c.value == 1.0 and isinstance(c.value, float)
    c.update(current_kl=50.0, n_steps=10)
    assert c.value == 1.0


def test_returns_default_to_no_discount_and_no_trace_decay():
    rewards, values, mask = T([[0.0, 1.0]]), T([[0.5, 0.25]]), torch.ones(1, 2)
    # gamma = lam = 1: t=1: delta 1 - 0.25 = 0.75; t=0: delta 0.25 - 0.5 = -0.25, advantage -0.25 + 0.75 = 0.5
    adv, ret = gae(rewards, values, mask)
    assert adv.tolist() == [[0.5, 0.75]] and ret.tolist() == [[1.0, 1.0]]
    assert discounted_returns(rewards, mask).tolist() == [[1.0, 1.0]]


def test_approx_kl_names_itself_and_k3_stays_finite_for_a_zero_probability_token():
    with raises_exactly("approx_kl: unknown kind 'k4'; expected one of ['k1', 'k2', 'k3']"):
        approx_kl(ZEROS, ZEROS, "k4")
    # the policy gave the sampled token probability 0 (log-prob -inf): d = +inf is clamped to 20 before exp
    k3 = approx_kl(T([[float("-inf")]]), T([[-1.0]]), "k3")
    assert k3.item() == 10.0
