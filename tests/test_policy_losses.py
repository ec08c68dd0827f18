"""The policy losses beyond PPO's token clip, each against its paper's formula on hand cases: GSPO (PPO's clip on the
sequence ratio), CISPO (a clipped stop-gradient weight on log pi), SAPO (a soft gate), GMPO (a geometric mean, clipped
in log space); their gradients where the gradient is the point; a sequence's mean over its own tokens inside packed
and shared-prompt rows (a real tiny model through the worker's loss); and how actor_loss picks one. Fast."""

import math
import re

import pytest
import torch

from rlhf_sg.algorithms import (
    LOSS_CLIP_DEFAULTS,
    ActorLossConfig,
    actor_loss,
    cispo_loss,
    gmpo_loss,
    log_importance_ratio,
    policy_loss,
    sapo_loss,
)

T = torch.tensor


def right_padded_mask(lengths, width):
    return torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]


def raises_exactly(message: str):
    return pytest.raises(ValueError, match="^" + re.escape(message) + "$")


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ---- the sequence ratio (GSPO) ------------------------------------------------------------------------------------
# three sequences of 2, 3 and 2 action tokens; old log-probs 0, so logp is the token log-ratio
GSPO_MASK = right_padded_mask([2, 3, 2], 3)
GSPO_LOG_RATIO = T([[0.3, -0.1, 9.0],                # mean 0.1: s = e^0.1, far outside 3e-4 / 4e-4
                    [-0.0006, -0.0004, -0.0005],     # mean -0.0005: s = e^-0.0005 < 1 - 3e-4
                    [0.0003, -0.0001, -7.0]])        # mean 0.0001: s = e^0.0001, inside; the 9 and -7 are padding
GSPO_ADV = T([[1.0, 1.0, 0.0], [-2.0, -2.0, -2.0], [3.0, 3.0, 0.0]])


def test_the_sequence_ratio_is_the_exp_of_each_sequences_mean_log_ratio():
    log_s = log_importance_ratio(GSPO_LOG_RATIO, torch.zeros(3, 3), GSPO_MASK, "sequence")
    expected = [[0.1, 0.1, 0.0], [-0.0005] * 3, [0.0001, 0.0001, 0.0]]
    torch.testing.assert_close(log_s, T(expected), atol=1e-7, rtol=0)
    token = log_importance_ratio(GSPO_LOG_RATIO, torch.zeros(3, 3), GSPO_MASK, "token")
    torch.testing.assert_close(token, torch.where(GSPO_MASK, GSPO_LOG_RATIO, 0.0))


def test_gspo_is_ppos_clip_on_the_sequence_ratio_with_its_own_range():
    """GSPO (arXiv 2507.18071): loss_i = -min(s_i A_i, clip(s_i, 1 - 3e-4, 1 + 4e-4) A_i), a sequence mean."""
    logp = GSPO_LOG_RATIO.clone().requires_grad_()
    low, high = LOSS_CLIP_DEFAULTS["gspo"]
    loss, metrics = policy_loss(logp, torch.zeros(3, 3), GSPO_ADV, GSPO_MASK, low, high, aggregation="seq_mean",
                                ratio_level="sequence")
    s2 = math.exp(0.0001)
    seq0 = -min(math.exp(0.1) * 1.0, 1.0004 * 1.0)               # clipped at 1 + 4e-4
    seq1 = -min(math.exp(-0.0005) * -2.0, 0.9997 * -2.0)          # A < 0: clipped at 1 - 3e-4
    seq2 = -s2 * 3.0                                              # inside
    assert loss.item() == pytest.approx((seq0 + seq1 + seq2) / 3, abs=1e-6)
    assert metrics["clip_frac"].item() == pytest.approx(5 / 7)   # the tokens of sequences 0 and 1
    loss.backward()
    # the clipped sequences get no gradient; an unclipped one gives each of its tokens the same -A s / (L rows),
    # whatever the token's own ratio (0.0003 and -0.0001 here): the gradient of s_i A_i itself
    expected = [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [-3.0 * s2 / 2 / 3, -3.0 * s2 / 2 / 3, 0.0]]
    torch.testing.assert_close(logp.grad, T(expected), atol=1e-7, rtol=0)


def test_the_sequence_ratio_skips_the_holes_of_a_multi_turn_mask():
    """Observation tokens (mask 0 inside the response) are not the policy's: they stay out of the sequence mean."""
    mask = T([[True, False, True, True]])
    log_s = log_importance_ratio(T([[0.2, 5.0, 0.1, 0.0]]), torch.zeros(1, 4), mask, "sequence")
    torch.testing.assert_close(log_s, T([[0.1, 0.0, 0.1, 0.1]]), atol=1e-7, rtol=0)


# ---- CISPO --------------------------------------------------------------------------------------------------------
def test_cispo_weighs_log_pi_by_the_clipped_ratio_without_a_lower_bound_and_passes_no_gradient_through_it():
    """CISPO (arXiv 2506.13585): loss_t = -sg(clip(r_t, 1 - 1, 1 + 5)) A_t log pi_t, a token mean."""
    probs, old_probs = [0.5, 0.2, 0.9, 0.6], [0.05, 0.4, 0.9, 0.3]   # r = 10, 0.5, 1, 2
    logp = T([[math.log(p) for p in probs]]).requires_grad_()
    old = T([[math.log(p) for p in old_probs]])
    adv = T([[1.0, -1.0, 2.0, -0.5]])
    loss, metrics = cispo_loss(logp, old, adv, torch.ones(1, 4))
    weight = [6.0, 0.5, 1.0, 2.0]  # 10 capped at 6; 0.5 kept: no lower bound
    expected = -sum(w * a * math.log(p) for w, a, p in zip(weight, [1.0, -1.0, 2.0, -0.5], probs)) / 4
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["clip_frac"].item() == pytest.approx(1 / 4)
    loss.backward()
    # every token keeps a gradient, the clipped one too (PPO's clip gives the r = 10, A > 0 token none)
    torch.testing.assert_close(logp.grad, T([[-6.0 / 4, 0.5 / 4, -2.0 / 4, 1.0 / 4]]), atol=1e-6, rtol=0)


def test_cispo_on_the_sequence_ratio_weighs_every_token_of_a_sequence_alike():
    logp = T([[math.log(2.0), math.log(0.5), 0.0]]).requires_grad_()   # token ratios 2 and 0.5: the sequence's 1
    loss, _ = cispo_loss(logp, torch.zeros(1, 3), T([[1.0, 1.0, 0.0]]), right_padded_mask([2], 3), 0.2, 0.2,
                         ratio_level="sequence")
    loss.backward()
    torch.testing.assert_close(logp.grad, T([[-0.5, -0.5, 0.0]]), atol=1e-6, rtol=0)


def test_cispo_bounds_are_checked():
    x, m = torch.zeros(1, 2), torch.ones(1, 2)
    for low, high in ((1.01, 1.0), (-0.1, 1.0), (0.5, -1.0)):
        with raises_exactly("cispo_loss: need 0 <= clip_low <= 1 (1: no lower bound) and clip_high >= 0, got "
                            f"clip_low={low}, clip_high={high}"):
            cispo_loss(x, x, x, m, low, high)
    cispo_loss(x, x, x, m, 1.0, 0.0)


# ---- SAPO ---------------------------------------------------------------------------------------------------------
def test_sapo_is_the_soft_gate_with_its_temperature_by_the_advantages_sign():
    """SAPO (arXiv 2511.20347): loss_t = -f(r_t) A_t, f(r) = sigmoid(tau (r - 1)) 4 / tau, tau 1.0 where A > 0 and
    1.05 where not; df/dr = 4 sigmoid (1 - sigmoid), so d loss / d log pi = -A 4 sigmoid (1 - sigmoid) r."""
    ratios, adv = [1.0, 2.0, 0.5], [1.0, 1.0, -1.0]
    logp = T([[math.log(r) for r in ratios]]).requires_grad_()
    loss, metrics = sapo_loss(logp, torch.zeros(1, 3), T([adv]), torch.ones(1, 3))
    taus = [1.0, 1.0, 1.05]
    gates = [sigmoid(t * (r - 1)) * 4 / t for r, t in zip(ratios, taus)]   # 2, 2.9242, 1.4159
    assert loss.item() == pytest.approx(-sum(g * a for g, a in zip(gates, adv)) / 3, abs=1e-6)
    assert metrics["clip_frac"].item() == 0.0
    loss.backward()
    slopes = [4 * sigmoid(t * (r - 1)) * (1 - sigmoid(t * (r - 1))) for r, t in zip(ratios, taus)]
    expected = [-a * s * r / 3 for a, s, r in zip(adv, slopes, ratios)]
    assert expected[0] == pytest.approx(-1 / 3)  # on policy the gate's gradient is PPO's
    torch.testing.assert_close(logp.grad, T([expected]), atol=1e-6, rtol=0)


def test_sapo_temperatures_must_be_positive():
    x, m = torch.zeros(1, 2), torch.ones(1, 2)
    with raises_exactly("sapo_loss: the gate's temperatures must be > 0, got tau_pos=0.0, tau_neg=1.05"):
        sapo_loss(x, x, x, m, tau_pos=0.0)


# ---- GMPO ---------------------------------------------------------------------------------------------------------
def test_gmpo_is_the_geometric_mean_of_the_token_ratios_clipped_in_log_space_on_the_pessimistic_side():
    """GMPO (arXiv 2507.20673): per sequence, log r clipped to (-0.4, 0.4) only on the side the advantage's
    sign makes optimistic, R_i = exp(mean of the clipped log-ratios), loss_i = -A_i R_i, a sequence mean."""
    mask = right_padded_mask([2, 3], 3)
    log_ratio = T([[0.6, -0.6, 0.0],      # A > 0: 0.6 capped at 0.4, -0.6 kept: mean -0.1
                   [-0.6, 0.6, 0.3]])     # A < 0: -0.6 floored at -0.4, 0.6 kept: mean 1/6
    # one advantage per sequence, its mean (1 and -2), whose sign picks the clip side for every token: the 0.6 of
    # sequence 1 stays unclipped though its own token's advantage is positive
    adv = T([[1.0, 1.0, 0.0], [-4.0, 1.0, -3.0]])
    logp = log_ratio.clone().requires_grad_()
    loss, metrics = gmpo_loss(logp, torch.zeros(2, 3), adv, mask, aggregation="seq_mean")
    r0, r1 = math.exp(-0.1), math.exp(1 / 6)
    assert loss.item() == pytest.approx((-1.0 * r0 + 2.0 * r1) / 2, abs=1e-6)
    assert metrics["clip_frac"].item() == pytest.approx(2 / 5)
    assert metrics["ratio_mean"].item() == pytest.approx((2 * r0 + 3 * r1) / 5, abs=1e-6)
    loss.backward()
    # a clipped token has no gradient; the others -A R / (L rows)
    expected = [[0.0, -1.0 * r0 / 2 / 2, 0.0], [0.0, 2.0 * r1 / 3 / 2, 2.0 * r1 / 3 / 2]]
    torch.testing.assert_close(logp.grad, T(expected), atol=1e-6, rtol=0)


def test_gmpo_counts_no_clipped_token_in_a_sequence_without_advantage():
    """A group whose samples all got one reward has advantage 0: no side to clip on, so none of its tokens counts as
    clipped (sign 0 made every one of them differ from its own log-ratio)."""
    mask = right_padded_mask([2, 3], 3)
    log_ratio = T([[0.6, 0.1, 0.0], [0.2, -0.1, 0.3]])
    adv = T([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    _, metrics = gmpo_loss(log_ratio, torch.zeros(2, 3), adv, mask, aggregation="seq_mean")
    assert metrics["clip_frac"].item() == pytest.approx(1 / 5)  # the 0.6 of the first sequence only


def test_gmpo_bounds_must_not_be_negative():
    x, m = torch.zeros(1, 2), torch.ones(1, 2)
    with raises_exactly("gmpo_loss: the log-space bounds must be >= 0, got clip_low=-0.1, clip_high=0.4"):
        gmpo_loss(x, x, x, m, -0.1)


# ---- masked positions ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gspo", "cispo", "sapo", "gmpo"])
def test_masked_positions_reach_neither_the_loss_nor_its_gradient(kind):
    g = torch.Generator().manual_seed(1)
    mask = right_padded_mask([5, 2, 1], 5)
    base = [torch.randn(3, 5, generator=g) * 0.3 for _ in range(4)]
    poisoned = [torch.where(mask, x, torch.tensor(float("nan"))) for x in base]
    poisoned[0] = torch.where(mask, base[0], torch.tensor(float("inf")))
    cfg = ActorLossConfig(policy_loss=kind, tis_cap=2.0, aggregation="seq_mean")

    def run(logp, old, adv, rollout):
        logp = logp.clone().requires_grad_()
        loss, _ = actor_loss(logp, torch.zeros(3, 5), old, adv, mask, cfg, 3.0, rollout_logp=rollout)
        loss.backward()
        return loss.detach(), logp.grad

    (clean, clean_grad), (dirty, dirty_grad) = run(*base), run(*poisoned)
    assert torch.isfinite(dirty) and torch.isfinite(dirty_grad).all()
    torch.testing.assert_close((clean, clean_grad), (dirty, dirty_grad))
    assert (dirty_grad[~mask] == 0).all()


# ---- actor_loss picks the loss, its ratio level and its clip range ------------------------------------------------
def _inputs():
    g = torch.Generator().manual_seed(7)
    mask = right_padded_mask([3, 1, 2], 3)
    logp = torch.randn(3, 3, generator=g) * 0.2 - 1.0
    old = logp + torch.randn(3, 3, generator=g) * 0.3
    adv = torch.randn(3, 1, generator=g).expand(3, 3).clone()
    return logp, torch.rand(3, 3, generator=g), old, adv, mask


@pytest.mark.parametrize("kind, direct", [
    ("ppo", lambda *a, **k: policy_loss(*a, 0.2, 0.2, **k)),
    ("gspo", lambda *a, **k: policy_loss(*a, 3e-4, 4e-4, ratio_level="sequence", **k)),
    ("cispo", lambda *a, **k: cispo_loss(*a, 1.0, 5.0, **k)),
    ("sapo", lambda *a, **k: sapo_loss(*a, 1.0, 1.05, **k)),
    ("gmpo", lambda *a, **k: gmpo_loss(*a, 0.4, 0.4, **k)),
])
def test_actor_loss_runs_each_loss_with_its_own_level_and_clip_range(kind, direct):
    logp, entropy, old, adv, mask = _inputs()
    got, metrics = actor_loss(logp, entropy, old, adv, mask, ActorLossConfig(policy_loss=kind,
                                                                             aggregation="seq_mean"), 3.0)
    want, want_metrics = direct(logp, old, adv, mask, aggregation="seq_mean", normalizer=3.0)
    assert got.item() == want.item()
    assert {k: v.item() for k, v in metrics.items() if k != "entropy"} == {k: v.item() for k, v in
                                                                         want_metrics.items()}


def test_the_losses_differ_from_each_other_on_the_same_batch():
    logp, entropy, old, adv, mask = _inputs()
    values = {kind: actor_loss(logp, entropy, old, adv, mask, ActorLossConfig(policy_loss=kind), 3.0)[0].item()
              for kind in ("ppo", "gspo", "cispo", "sapo", "gmpo")}
    assert len({round(v, 6) for v in values.values()}) == 5, values


@pytest.mark.parametrize("cfg, message", [
    (ActorLossConfig(policy_loss="gspo", ratio_level="token"),
     "actor_loss: policy_loss 'gspo' takes ratio_level ['sequence'], got 'token'"),
    (ActorLossConfig(ratio_level="sequence"),
     "actor_loss: policy_loss 'ppo' takes ratio_level ['token'], got 'sequence'"),
    (ActorLossConfig(policy_loss="gmpo", ratio_level="token"),
     "actor_loss: policy_loss 'gmpo' takes ratio_level ['sequence'], got 'token'"),
    (ActorLossConfig(policy_loss="cispo", dual_clip=3.0), "actor_loss: dual_clip caps PPO's token loss; policy_loss "
                                                          "'cispo' has none"),
    (ActorLossConfig(policy_loss="sapo", clip_high=0.2), "actor_loss: policy_loss 'sapo' has no clip (its gate's "
                                                         "temperatures are sapo_tau_pos and sapo_tau_neg); got "
                                                         "clip_low=None, clip_high=0.2"),
    (ActorLossConfig(policy_loss="grpo"), "actor_loss: unknown policy_loss 'grpo'; expected one of "
                                          "['ppo', 'gspo', 'cispo', 'sapo', 'gmpo']"),
])
def test_actor_loss_refuses_what_a_loss_does_not_have(cfg, message):
    logp, entropy, old, adv, mask = _inputs()
    with raises_exactly(message):
        actor_loss(logp, entropy, old, adv, mask, cfg, 3.0)


def test_cispo_and_sapo_take_the_sequence_ratio_too():
    logp, entropy, old, adv, mask = _inputs()
    for kind, direct in (("cispo", cispo_loss), ("sapo", sapo_loss)):
        got, _ = actor_loss(logp, entropy, old, adv, mask, ActorLossConfig(policy_loss=kind, ratio_level="sequence"),
                            3.0)
        want, _ = direct(logp, old, adv, mask, ratio_level="sequence", normalizer=3.0)
        token, _ = direct(logp, old, adv, mask, normalizer=3.0)
        assert got.item() == want.item() != pytest.approx(token.item(), abs=1e-6)


# ---- a sequence's mean is over its own tokens inside packed and shared-prompt rows ----------------------------------
@pytest.mark.parametrize("share_prompts", [False, True])
def test_the_sequence_ratio_of_a_packed_or_shared_prompt_row_is_each_samples_own(tmp_path, share_prompts):
    """Three samples through the worker's actor loss on a real tiny model: the short two share a packed row (rows
    are as long as the longest sequence) and, with shared prompts, one segment of one row. Their old log-probs are
    their own log-probs (each sample alone) minus per-token offsets, so each sequence ratio is exp(the mean of its
    offsets), written here by hand; a mean over the row (the two samples together) or over the padded width gives
    another ratio."""
    from transformers import AutoModelForCausalLM

    from rlhf_sg.experience import ActorUpdate, build_rollout_batch
    from rlhf_sg.packing import pack, response_logprobs
    from rlhf_sg.tiny import save_tiny_model
    from rlhf_sg.workers import actor_microbatch_loss

    model = AutoModelForCausalLM.from_pretrained(save_tiny_model(str(tmp_path / "m")))
    model.set_attn_implementation("sdpa")
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [11, 12]]
    responses = [[20, 21, 22, 23, 24, 25], [30, 31, 32], [40, 41]]
    batch = build_rollout_batch(prompts, responses, [[-1.0] * len(r) for r in responses], 0)
    lengths = batch.attention_mask.sum(dim=1)
    packed = pack(batch.sequences, batch.attention_mask, row_tokens=int(lengths.max()))
    row_of_token = packed.slots // packed.input_ids.shape[1]
    starts = packed.cu_seqlens.tolist()
    assert row_of_token[starts[1]] == row_of_token[starts[2]] != row_of_token[starts[0]]  # samples 1, 2 share a row

    offsets = [[0.1] * 6, [0.3, 0.1, 0.2], [-0.2, -0.4]]           # means 0.1, 0.2, -0.3
    with torch.no_grad():
        alone = torch.zeros_like(batch.rollout_logp)
        for b in range(3):
            one = batch.rows([b])
            alone[b, : len(responses[b])] = response_logprobs(model, one.sequences, one.attention_mask,
                                                              one.response_width)[0, : len(responses[b])]
    batch.old_logp = alone - torch.nn.utils.rnn.pad_sequence([T(o) for o in offsets], batch_first=True)
    batch.advantages = T([[1.0] * 6, [-2.0] * 6, [3.0] * 6]) * batch.action_mask
    update = ActorUpdate(loss=ActorLossConfig(policy_loss="gspo", clip_low=0.5, clip_high=0.5,
                                              aggregation="seq_mean"), share_prompts=share_prompts)
    loss, metrics = actor_microbatch_loss(model, batch, update, normalizer=3.0)
    s = [math.exp(0.1), math.exp(0.2), math.exp(-0.3)]   # inside 1 -+ 0.5: nothing clips
    assert loss.item() == pytest.approx(-(1.0 * s[0] - 2.0 * s[1] + 3.0 * s[2]) / 3, abs=1e-5)
    assert metrics["ratio_mean"].item() == pytest.approx((6 * s[0] + 3 * s[1] + 2 * s[2]) / 11, abs=1e-5)
