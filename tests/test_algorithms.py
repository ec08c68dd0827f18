"""The algorithm core: hand-computed cases, properties, and bad input."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_sg.algorithms import (
    ActorLossConfig,
    AdaptiveKLController,
    actor_loss,
    approx_kl,
    discounted_returns,
    gae,
    group_advantages,
    masked_mean,
    masked_whiten,
    policy_loss,
    reinforce_baseline_advantages,
    shape_rewards,
    value_loss,
)

T = torch.tensor


def approx_rows(rows, **kw):
    return [pytest.approx(r, **kw) for r in rows]


def right_padded_mask(lengths, width):
    return torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]


# ---- masked statistics -------------------------------------------------------------------------


def test_masked_mean_hand_cases():
    x = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = T([[1, 1, 0], [1, 0, 0]])
    assert masked_mean(x, m).item() == pytest.approx((1 + 2 + 4) / 3)
    assert masked_mean(x, m, dim=1).tolist() == pytest.approx([1.5, 4.0])


def test_masked_mean_empty_slice_is_an_error():
    x = T([[1.0, 2.0], [4.0, 5.0]])
    with pytest.raises(ValueError, match="empty along dim 0"):
        masked_mean(x, T([[1, 0], [1, 0]]), dim=0)
    with pytest.raises(ValueError, match="mask is empty"):
        masked_mean(x, torch.zeros(2, 2))


def test_masked_whiten_hand_case():
    x = T([[1.0, 3.0, 99.0]])
    m = T([[1, 1, 0]])
    out = masked_whiten(x, m)
    # mean 2, biased var 1 -> (-1, 1), masked position 0
    assert out.tolist() == approx_rows([[-1.0, 1.0, 0.0]], abs=1e-6)
    kept = masked_whiten(x, m, shift_mean=False)
    assert kept.tolist() == approx_rows([[1.0, 3.0, 0.0]], abs=1e-6)


# ---- KL ------------------------------------------------------------------------------------------


def test_approx_kl_hand_cases():
    logp = T([[-1.0, -2.0]])
    ref = T([[-2.0, -2.0]])
    assert approx_kl(logp, ref, "k1").tolist() == approx_rows([[1.0, 0.0]])
    assert approx_kl(logp, ref, "k2").tolist() == approx_rows([[0.5, 0.0]])
    # d = ref - logp = -1: exp(-1) - 1 + 1
    assert approx_kl(logp, ref, "k3").tolist() == approx_rows([[math.exp(-1), 0.0]], abs=1e-6)


def test_approx_kl_clamps_and_stays_finite():
    logp = T([[0.0, -100.0]])
    ref = T([[-100.0, 0.0]])
    for kind in ("k1", "k2", "k3"):
        kl = approx_kl(logp, ref, kind)
        assert torch.isfinite(kl).all()
        assert kl.abs().max() <= 10.0
    assert approx_kl(logp, ref, "k1").tolist() == [[10.0, -10.0]]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-30, 0), min_size=2, max_size=2), st.lists(st.floats(-30, 0), min_size=2, max_size=2))
def test_k2_k3_nonnegative(a, b):
    logp, ref = T([a]), T([b])
    assert (approx_kl(logp, ref, "k2") >= 0).all()
    assert (approx_kl(logp, ref, "k3") >= -1e-6).all()


def test_k3_is_unbiased_estimator_of_kl():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(6), 0)
    q = torch.softmax(torch.randn(6), 0)
    samples = torch.multinomial(p, 200_000, replacement=True)
    logp, ref = p.log()[samples][None], q.log()[samples][None]
    true_kl = (p * (p.log() - q.log())).sum()
    for kind in ("k1", "k3"):
        assert approx_kl(logp, ref, kind).mean().item() == pytest.approx(true_kl.item(), abs=0.01)


# ---- reward shaping -----------------------------------------------------------------------------


def test_shape_rewards_places_score_on_last_action_token():
    kl = T([[0.1, 0.2, 0.3], [0.5, 0.0, 0.0]])
    mask = right_padded_mask([3, 1], 3)
    r = shape_rewards(T([1.0, -2.0]), kl, mask, kl_coef=0.5)
    assert r.tolist() == approx_rows([[-0.05, -0.1, -0.15 + 1.0], [-0.25 - 2.0, 0.0, 0.0]])


def test_shape_rewards_clips_score_and_ignores_masked_kl():
    kl = T([[0.0, float("nan")]])
    r = shape_rewards(T([7.0]), kl, T([[1, 0]]), kl_coef=1.0, score_clip=5.0)
    assert r.tolist() == [[5.0, 0.0]]


def test_shape_rewards_bad_input():
    with pytest.raises(ValueError, match="score must be"):
        shape_rewards(T([1.0, 2.0, 3.0]), torch.zeros(2, 3), torch.ones(2, 3), 0.1)
    with pytest.raises(ValueError, match=r"no token set in row\(s\) \[1\]"):
        shape_rewards(T([1.0, 2.0]), torch.zeros(2, 3), T([[1, 0, 0], [0, 0, 0]]), 0.1)
    with pytest.raises(ValueError, match="action_mask has shape"):
        shape_rewards(T([1.0, 2.0]), torch.zeros(2, 3), torch.ones(2, 4), 0.1)


# ---- GAE and returns -------------------------------------------------------------------------------


def test_gae_hand_case():
    # one row, 2 tokens, gamma=0.5, lam=0.5
    r = T([[0.0, 1.0]])
    v = T([[0.2, 0.4]])
    adv, ret = gae(r, v, T([[1, 1]]), gamma=0.5, lam=0.5)
    d1 = 1.0 + 0.5 * 0 - 0.4  # 0.6
    d0 = 0.0 + 0.5 * 0.4 - 0.2  # 0.0
    a1 = d1
    a0 = d0 + 0.25 * a1
    assert adv.tolist() == approx_rows([[a0, a1]])
    assert ret.tolist() == approx_rows([[a0 + 0.2, a1 + 0.4]])


def test_gae_single_token_response_and_padding():
    r = T([[2.0, 9.0, 9.0]])
    v = T([[0.5, 9.0, 9.0]])
    adv, ret = gae(r, v, right_padded_mask([1], 3), gamma=0.9, lam=0.8)
    assert adv.tolist() == approx_rows([[1.5, 0.0, 0.0]])
    assert ret.tolist() == approx_rows([[2.0, 0.0, 0.0]])


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 7), st.integers(0, 10_000))
def test_gae_with_gamma_lam_one_is_returns_minus_values(B, Tn, seed):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(B, Tn, generator=g)
    v = torch.randn(B, Tn, generator=g)
    lengths = torch.randint(1, Tn + 1, (B,), generator=g).tolist()
    m = right_padded_mask(lengths, Tn)
    adv, ret = gae(r, v, m, 1.0, 1.0)
    expected = discounted_returns(r, m, 1.0) - torch.where(m, v, 0.0)
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, discounted_returns(r, m, 1.0), atol=1e-5, rtol=1e-5)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10_000))
def test_gae_matches_per_row_reference_loop(seed):
    g = torch.Generator().manual_seed(seed)
    B, Tn, gamma, lam = 3, 6, 0.93, 0.81
    r, v = torch.randn(B, Tn, generator=g), torch.randn(B, Tn, generator=g)
    lengths = torch.randint(1, Tn + 1, (B,), generator=g).tolist()
    adv, ret = gae(r, v, right_padded_mask(lengths, Tn), gamma, lam)
    for b, n in enumerate(lengths):
        running, expected = 0.0, [0.0] * Tn
        for t in reversed(range(n)):
            next_v = v[b, t + 1].item() if t + 1 < n else 0.0
            running = r[b, t].item() + gamma * next_v - v[b, t].item() + gamma * lam * running
            expected[t] = running
        assert adv[b].tolist() == pytest.approx(expected, abs=1e-5)
        assert ret[b, :n].tolist() == pytest.approx([e + v[b, t].item() for t, e in enumerate(expected[:n])], abs=1e-5)


def test_gae_hole_in_mask_is_skipped():
    # tokens 0 and 2 are actions, 1 is tool output: same as a 2-token row without it
    r = T([[0.3, 100.0, 1.0]])
    v = T([[0.1, -50.0, 0.7]])
    adv_hole, ret_hole = gae(r, v, T([[1, 0, 1]]), gamma=0.9, lam=0.95)
    adv_dense, ret_dense = gae(T([[0.3, 1.0]]), T([[0.1, 0.7]]), T([[1, 1]]), gamma=0.9, lam=0.95)
    assert adv_hole[0, [0, 2]].tolist() == pytest.approx(adv_dense[0].tolist())
    assert adv_hole[0, 1].item() == 0.0
    assert ret_hole[0, [0, 2]].tolist() == pytest.approx(ret_dense[0].tolist())


def test_discounted_returns_hand_case():
    r = T([[1.0, 0.0, 2.0, 5.0]])
    out = discounted_returns(r, right_padded_mask([3], 4), gamma=0.5)
    assert out.tolist() == approx_rows([[1.0 + 0.5 * 0 + 0.25 * 2, 1.0, 2.0, 0.0]])


@pytest.mark.parametrize("fn", ["gae", "returns", "policy", "value", "shape", "whiten"])
def test_masked_positions_never_influence_outputs(fn):
    g = torch.Generator().manual_seed(1)
    B, Tn = 3, 5
    m = right_padded_mask([5, 2, 1], Tn)
    base = [torch.randn(B, Tn, generator=g) for _ in range(4)]
    poisoned = [torch.where(m, x, torch.tensor(float("nan"))) for x in base]
    poisoned[1] = torch.where(m, base[1], torch.tensor(float("inf")))

    def run(a, b, c, d):
        if fn == "gae":
            return torch.cat(gae(a, b, m, 0.9, 0.9))
        if fn == "returns":
            return discounted_returns(a, m, 0.9)
        if fn == "policy":
            return policy_loss(a, b, c, m, 0.2, 0.3, dual_clip=3.0, rollout_logp=d, tis_cap=2.0)[0]
        if fn == "value":
            return value_loss(a, b, c, m, clip=0.2)[0]
        if fn == "shape":
            return shape_rewards(T([1.0, 2.0, 3.0]), a, m, 0.1)
        return masked_whiten(a, m)

    clean, dirty = run(*base), run(*poisoned)
    assert torch.isfinite(dirty).all()
    torch.testing.assert_close(clean, dirty)


# ---- group advantages ------------------------------------------------------------------------------


def test_group_advantages_hand_cases():
    s = T([1.0, 0.0, 0.0, 0.0, 3.0, 5.0])  # groups of 2: (1,0) (0,0) (3,5)
    assert group_advantages(s, 2, "dr_grpo").tolist() == pytest.approx([0.5, -0.5, 0, 0, -1, 1])
    # rloo: s - other
    assert group_advantages(s, 2, "rloo").tolist() == pytest.approx([1, -1, 0, 0, -2, 2])
    std1 = math.sqrt(0.5)  # unbiased std of (1, 0)
    grpo = group_advantages(s, 2, "grpo").tolist()
    assert grpo[:2] == pytest.approx([0.5 / (std1 + 1e-6), -0.5 / (std1 + 1e-6)])
    assert grpo[2:4] == [0.0, 0.0]
    # reinforce_baseline's sequence part is the group-mean baseline; the batch whitening is per token
    # (reinforce_baseline_advantages)
    assert group_advantages(s, 2, "reinforce_baseline").tolist() == pytest.approx([0.5, -0.5, 0, 0, -1, 1])


def _reinforce_baseline_by_hand(scores, kl, lengths, n, kl_coef, gamma, score_clip=None):
    """REINFORCE++-baseline from its definition, in plain Python: clip, minus the group mean, the KL
    penalty on every action token and the score on the last, reward-to-go, then whitening over every
    action token of the batch (mean and biased variance, 1 / sqrt(max(var, 1e-8)))."""
    if score_clip is not None:
        scores = [min(max(x, -score_clip), score_clip) for x in scores]
    means = [sum(scores[g * n : (g + 1) * n]) / n for g in range(len(scores) // n)]
    returns = []
    for b, length in enumerate(lengths):
        rewards = [-kl_coef * kl[b][t] for t in range(length)]
        rewards[-1] += scores[b] - means[b // n]
        row, running = [0.0] * length, 0.0
        for t in reversed(range(length)):
            running = rewards[t] + gamma * running
            row[t] = running
        returns.append(row)
    flat = [x for row in returns for x in row]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / len(flat)
    scale = 1 / math.sqrt(max(var, 1e-8))
    width = len(kl[0])
    return [[(x - mean) * scale for x in row] + [0.0] * (width - len(row)) for row in returns]


@pytest.mark.parametrize("gamma, score_clip", [(1.0, None), (0.9, None), (1.0, 1.5)])
def test_reinforce_baseline_is_group_baseline_kl_returns_then_token_whitening(gamma, score_clip):
    # two prompts, two samples each, responses of 3, 2, 1 and 3 tokens
    scores = [1.0, 0.0, 2.0, -1.0]
    kl = [[0.2, -0.1, 0.4], [0.3, 0.1, 9.0], [0.5, 9.0, 9.0], [-0.2, 0.0, 0.1]]
    lengths = [3, 2, 1, 3]
    expected = _reinforce_baseline_by_hand(scores, kl, lengths, 2, 0.1, gamma, score_clip)
    got = reinforce_baseline_advantages(T(scores), T(kl), right_padded_mask(lengths, 3), 2, kl_coef=0.1,
                                        gamma=gamma, score_clip=score_clip)
    assert got.tolist() == approx_rows(expected, abs=1e-5)


def test_score_clip_reaches_the_reinforce_baseline_advantages():
    mask = right_padded_mask([2, 2, 2, 2], 2)
    clipped = reinforce_baseline_advantages(T([5.0, 1.0, 0.0, 0.0]), torch.zeros(4, 2), mask, 2, 0.0, score_clip=1.0)
    by_hand = reinforce_baseline_advantages(T([1.0, 1.0, 0.0, 0.0]), torch.zeros(4, 2), mask, 2, 0.0)
    torch.testing.assert_close(clipped, by_hand)
    assert clipped.abs().max() == 0  # both groups are constant once clipped


def test_rloo_hand_case_group_of_three():
    out = group_advantages(T([3.0, 0.0, 0.0]), 3, "rloo")
    assert out.tolist() == pytest.approx([3.0, -1.5, -1.5])


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo", "reinforce_baseline"])
def test_constant_group_has_zero_advantage(kind):
    s = T([0.7] * 4 + [0.2, 0.9, 0.1, 0.4])
    # group baselines sum to zero per group, so batch whitening keeps a constant group at zero too
    assert group_advantages(s, 4, kind)[:4].abs().max().item() < 1e-6
    assert group_advantages(T([0.7] * 8), 4, kind).abs().max().item() == 0.0


def test_group_advantages_bad_input():
    with pytest.raises(ValueError, match="does not divide"):
        group_advantages(torch.zeros(6), 4, "grpo")
    with pytest.raises(ValueError, match="unknown kind 'ppo'"):
        group_advantages(torch.zeros(4), 2, "ppo")
    with pytest.raises(ValueError, match="group_size must be an int >= 2"):
        group_advantages(torch.zeros(4), 1, "rloo")
    with pytest.raises(ValueError, match=r"scores must be \[B\]"):
        group_advantages(torch.zeros(2, 2), 2, "grpo")


# ---- policy loss ------------------------------------------------------------------------------------


def test_policy_loss_hand_case():
    logp = T([[math.log(1.5), math.log(0.5), 0.0]])
    old = torch.zeros(1, 3)
    adv = T([[1.0, -1.0, 2.0]])
    loss, metrics = policy_loss(logp, old, adv, T([[1, 1, 1]]), clip_low=0.2, clip_high=0.28)
    # token 0: ratio 1.5, A>0 -> min(1.5, 1.28) = 1.28; token 1: ratio .5, A<0 -> min(-.5, -.8) = -.8
    # token 2: ratio 1 -> 2
    assert loss.item() == pytest.approx(-(1.28 - 0.8 + 2.0) / 3, abs=1e-6)
    assert metrics["clip_frac"].item() == pytest.approx(2 / 3)
    assert metrics["ppo_kl"].item() == pytest.approx(-(math.log(1.5) + math.log(0.5)) / 3, abs=1e-6)


def test_policy_loss_is_flat_outside_trust_region():
    old = torch.zeros(1, 2)
    adv = T([[1.0, -1.0]])
    logp = T([[math.log(1.5), math.log(0.5)]]).requires_grad_()
    loss, _ = policy_loss(logp, old, adv, T([[1, 1]]), 0.2, 0.2)
    loss.backward()
    assert logp.grad.abs().max().item() == 0.0
    # inside the region the gradient is -A * ratio / n
    inside = T([[math.log(1.1), math.log(0.9)]]).requires_grad_()
    policy_loss(inside, old, adv, T([[1, 1]]), 0.2, 0.2)[0].backward()
    assert inside.grad.tolist() == approx_rows([[-1.1 / 2, 0.9 / 2]], abs=1e-6)


def test_dual_clip_caps_negative_advantage_loss():
    old = torch.zeros(1, 1)
    logp = T([[math.log(10.0)]])
    adv = T([[-1.0]])
    plain, _ = policy_loss(logp, old, adv, T([[1]]), 0.2, 0.2)
    assert plain.item() == pytest.approx(10.0, abs=1e-5)
    capped, metrics = policy_loss(logp, old, adv, T([[1]]), 0.2, 0.2, dual_clip=3.0)
    assert capped.item() == pytest.approx(3.0)
    assert metrics["dual_clip_frac"].item() == 1.0


def test_truncated_importance_weights():
    logp = torch.zeros(1, 2)
    old = torch.zeros(1, 2)
    rollout = T([[math.log(0.5), math.log(4.0)]])  # weights exp(old - rollout) = 2, 0.25
    adv = T([[1.0, 1.0]])
    loss, metrics = policy_loss(logp, old, adv, T([[1, 1]]), rollout_logp=rollout, tis_cap=1.5)
    assert loss.item() == pytest.approx(-(1.5 + 0.25) / 2)
    assert metrics["tis_weight_mean"].item() == pytest.approx((1.5 + 0.25) / 2)


def test_seq_mean_and_normalizer():
    logp = torch.zeros(2, 3)
    adv = T([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    m = right_padded_mask([3, 1], 3)
    tok, _ = policy_loss(logp, logp, adv, m)
    seq, _ = policy_loss(logp, logp, adv, m, aggregation="seq_mean")
    assert tok.item() == pytest.approx(-7 / 4)
    assert seq.item() == pytest.approx(-(1 + 4) / 2)
    # two halves with a shared normalizer add up to the whole batch's token mean
    a, _ = policy_loss(logp[:1], logp[:1], adv[:1], m[:1], normalizer=4)
    b, _ = policy_loss(logp[1:], logp[1:], adv[1:], m[1:], normalizer=4)
    assert (a + b).item() == pytest.approx(tok.item())


def test_policy_loss_bad_input():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="old_logp has shape"):
        policy_loss(x, torch.zeros(2, 4), x, x)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(x, x, x, torch.ones(2, 3), dual_clip=0.5)
    with pytest.raises(ValueError, match="go together"):
        policy_loss(x, x, x, torch.ones(2, 3), rollout_logp=x)
    with pytest.raises(ValueError, match="unknown aggregation 'sum'"):
        policy_loss(x, x, x, torch.ones(2, 3), aggregation="sum")
    with pytest.raises(ValueError, match="no token set"):
        policy_loss(x, x, x, torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"must be \[B, T\]"):
        policy_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.ones(3))


# ---- value loss ----------------------------------------------------------------------------------------


def test_value_loss_hand_case():
    v = T([[1.0, 0.0]])
    old = T([[0.0, 0.0]])
    ret = T([[0.0, 1.0]])
    plain, _ = value_loss(v, old, ret, T([[1, 1]]))
    assert plain.item() == pytest.approx(0.5 * (1 + 1) / 2)
    # clip 0.5: token 0 v_clip = 0.5 -> max(1, 0.25) = 1; token 1 v_clip = 0 -> 1
    clipped, metrics = value_loss(v, old, ret, T([[1, 1]]), clip=0.5)
    assert clipped.item() == pytest.approx(0.5)
    # v moved toward the target beyond the clip: the clipped error is larger and wins
    v2 = T([[0.0]])
    old2 = T([[2.0]])
    l2, m2 = value_loss(v2, old2, T([[0.0]]), T([[1]]), clip=0.5)
    assert l2.item() == pytest.approx(0.5 * 1.5**2)
    assert m2["clip_frac"].item() == 1.0


def test_value_loss_bad_input():
    with pytest.raises(ValueError, match="clip must be > 0"):
        value_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), clip=0.0)
    with pytest.raises(ValueError, match="returns has shape"):
        value_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2))


def test_approx_kl_bad_kind():
    with pytest.raises(ValueError, match="unknown kind 'k4'"):
        approx_kl(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


def test_adaptive_kl_controller_moves_toward_target():
    c = AdaptiveKLController(0.1, target=1.0, horizon=10)
    c.update(current_kl=5.0, n_steps=1)  # error clipped to +0.2
    assert c.value == pytest.approx(0.1 * 1.02)
    c.update(current_kl=0.0, n_steps=1)
    assert c.value == pytest.approx(0.1 * 1.02 * 0.98)


# ---- the actor loss does not depend on the micro-batch split ---------------------------------------------


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_actor_loss_and_gradient_do_not_depend_on_the_micro_batch_split(aggregation):
    """The whole actor loss (surrogate, KL term, entropy bonus) over one optimizer step: micro-batches of
    1 row, 2 rows and the whole batch, each reduced with the step's normalizer as the trainer plans them,
    add up to the same loss and the same gradient (rows of different lengths, so a token mean over a
    micro-batch is not the mean of its rows' means)."""
    g = torch.Generator().manual_seed(3)
    B, Tn, V = 4, 5, 7
    lengths = [5, 1, 3, 2]
    mask = right_padded_mask(lengths, Tn)
    tokens = torch.randint(0, V, (B, Tn), generator=g)
    old_logp = torch.randn(B, Tn, generator=g) * 0.1 - 2
    ref_logp = torch.randn(B, Tn, generator=g) * 0.1 - 2
    advantages = torch.randn(B, Tn, generator=g)
    base_logits = torch.randn(B, Tn, V, generator=g)
    cfg = ActorLossConfig(aggregation=aggregation, kl_coef=0.3, kl_estimator="k3", entropy_coef=0.05)
    normalizer = float(B) if aggregation == "seq_mean" else float(mask.sum())

    def step_loss(split):
        logits = base_logits.clone().requires_grad_()
        logprobs = torch.log_softmax(logits, dim=-1)
        logp = logprobs.gather(-1, tokens[..., None]).squeeze(-1)
        entropy = -(logprobs.exp() * logprobs).sum(-1)
        total = torch.zeros(())
        for start in range(0, B, split):
            rows = slice(start, start + split)
            loss, _ = actor_loss(logp[rows], entropy[rows], old_logp[rows], advantages[rows], mask[rows], cfg,
                                 normalizer, ref_logp=ref_logp[rows])
            total = total + loss
        total.backward()
        return total.detach(), logits.grad

    whole, grad_whole = step_loss(B)
    for split in (1, 2):
        loss, grad = step_loss(split)
        assert abs(loss.item() - whole.item()) <= 1e-6, (split, loss.item(), whole.item())
        assert (grad - grad_whole).abs().max().item() <= 1e-6, split
