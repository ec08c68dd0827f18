"""AReaL's decoupled PPO objective (``--train.decoupled_loss``): against its formula on a hand case (the clip taken
around the proximal policy, the loss weighted by pi_prox / pi_behav, the cap masking), equal to PPO's loss exactly
when the behaviour policy is the proximal one, equal to the TIS mask path where the two coincide, picked by
actor_loss, and its config rules checked before anything starts. Fast."""

import math
import re

import pytest
import torch

from rlhf_sg.algorithms import ActorLossConfig, actor_loss, decoupled_policy_loss, policy_loss
from rlhf_sg.config import Config, ConfigError, tis_cap, validate
from rlhf_sg.tiny import save_tiny_model

T = torch.tensor

# two samples of 3 and 2 action tokens; the last column of row 1 is padding (junk that must not count)
MASK = T([[True, True, True], [True, True, False]])
PROX = T([[-1.0, -0.5, -2.0], [-0.3, -0.7, 99.0]])
BEHAV = T([[-1.2, -0.5, -1.0], [-0.3, -2.0, -5.0]])
STEP = T([[0.1, 0.5, -0.3], [0.0, -0.4, 7.0]])  # log pi_theta - log pi_prox
ADV = T([[1.0, 1.0, -1.0], [2.0, -1.0, 0.0]])


def hand_token_losses(cap=None):
    """(per-token loss after the weight, its gradient wrt log pi_theta, masked by the cap) of the 5 action tokens,
    worked from the formula: r = e^step, w = e^(prox - behav), loss = -w * min(r A, clip(r, 0.8, 1.2) A)."""
    out = []
    for (b, t) in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]:
        r, a = math.exp(STEP[b, t].item()), ADV[b, t].item()
        w = math.exp(PROX[b, t].item() - BEHAV[b, t].item())
        masked = cap is not None and w > cap
        w = 0.0 if masked else w
        unclipped, clipped = r * a, min(max(r, 0.8), 1.2) * a
        grad = -w * r * a if unclipped <= clipped else 0.0  # d/dlogp of -w r A where the unclipped side is the min
        out.append((-w * min(unclipped, clipped), grad, masked))
    return out


@pytest.mark.parametrize("cap", [None, 2.0])
def test_the_decoupled_loss_clips_around_the_proximal_policy_and_weighs_by_prox_over_behav(cap):
    logp = (PROX + STEP).requires_grad_()
    loss, metrics = decoupled_policy_loss(logp, PROX, BEHAV, ADV, MASK, 0.2, 0.2, behav_weight_cap=cap)
    hand = hand_token_losses(cap)
    assert loss.item() == pytest.approx(sum(x for x, _, _ in hand) / 5, abs=1e-6)
    loss.backward()
    expected_grad = T([[hand[0][1], hand[1][1], hand[2][1]], [hand[3][1], hand[4][1], 0.0]]) / 5
    torch.testing.assert_close(logp.grad, expected_grad, atol=1e-6, rtol=0)
    # tokens (0, 1), (0, 2) and (1, 1) are clipped against pi_prox (against pi_behav, (0, 0) would be too: e^0.3)
    assert metrics["clip_frac"].item() == pytest.approx(3 / 5)
    assert metrics["behav_kl"].item() == pytest.approx((0.2 + 0.0 - 1.0 + 0.0 + 1.3) / 5, abs=1e-6)
    # w of token (1, 1) is e^1.3 = 3.67: over a cap of 2, it counts 0
    assert metrics["behav_masked_frac"].item() == pytest.approx(0.0 if cap is None else 1 / 5)
    weights = [math.exp(0.2), 1.0, math.exp(-1.0), 1.0, 0.0 if cap else math.exp(1.3)]
    assert metrics["behav_weight_mean"].item() == pytest.approx(sum(weights) / 5, abs=1e-6)


def test_the_weight_carries_no_gradient_into_the_proximal_log_probs():
    prox = PROX.clone().requires_grad_()
    loss, _ = decoupled_policy_loss(PROX + STEP, prox, BEHAV, ADV, MASK)
    loss.backward()
    # only r = pi_theta / pi_prox reaches pi_prox (the unclipped tokens (0, 0) and (1, 0)); w is a constant
    r00 = math.exp(0.1)
    expected = T([[math.exp(0.2) * r00 * 1.0, 0.0, 0.0], [2.0, 0.0, 0.0]]) / 5
    torch.testing.assert_close(prox.grad, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_with_behaviour_equal_to_proximal_it_is_ppos_loss_exactly(aggregation, dual_clip):
    g = torch.Generator().manual_seed(0)
    mask = torch.arange(6)[None, :] < T([6, 4, 1, 5])[:, None]
    old = -torch.rand(4, 6, generator=g) * 3
    step = torch.randn(4, 6, generator=g) * 0.4
    adv = torch.randn(4, 6, generator=g) * 2
    a, b = (old + step).requires_grad_(), (old + step).requires_grad_()
    ours, m1 = decoupled_policy_loss(a, old, old.clone(), adv, mask, 0.2, 0.28, dual_clip, behav_weight_cap=1.5,
                                     aggregation=aggregation, token_budget=8)
    ppo, m2 = policy_loss(b, old, adv, mask, 0.2, 0.28, dual_clip, aggregation=aggregation, token_budget=8)
    assert torch.equal(ours, ppo)
    ours.backward(), ppo.backward()
    assert torch.equal(a.grad, b.grad)
    for k in ("clip_frac", "dual_clip_frac", "ppo_kl", "ratio_mean"):
        assert torch.equal(m1[k], m2[k]), k
    assert m1["behav_weight_mean"].item() == 1.0 and m1["behav_masked_frac"].item() == 0.0


def test_with_a_cap_it_is_the_tis_mask_path_on_the_proximal_log_probs():
    """policy_loss's TIS in mask mode weighs by exp(old - rollout) and zeroes tokens over the cap: with old = pi_prox
    and rollout = pi_behav that is the decoupled objective; the two paths must agree."""
    a, b = (PROX + STEP).requires_grad_(), (PROX + STEP).requires_grad_()
    ours, _ = decoupled_policy_loss(a, PROX, BEHAV, ADV, MASK, behav_weight_cap=2.0)
    tis, _ = policy_loss(b, PROX, ADV, MASK, rollout_logp=BEHAV, tis_cap=2.0, tis_mode="mask")
    torch.testing.assert_close(ours, tis, atol=1e-7, rtol=0)
    ours.backward(), tis.backward()
    torch.testing.assert_close(a.grad, b.grad, atol=1e-7, rtol=0)


def test_masked_positions_reach_neither_the_loss_nor_its_gradient():
    junk = T([[0.0, 0.0, 0.0], [0.0, 0.0, float("nan")]])
    logp = (PROX + STEP + junk).requires_grad_()
    loss, metrics = decoupled_policy_loss(logp, PROX + junk, BEHAV + junk, ADV + junk, MASK)
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
    loss.backward()
    assert logp.grad[1, 2].item() == 0.0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match=re.escape("decoupled_policy_loss: behav_weight_cap must be > 0 (or None), "
                                                   "got 0.0")):
        decoupled_policy_loss(PROX, PROX, BEHAV, ADV, MASK, behav_weight_cap=0.0)
    with pytest.raises(ValueError, match=re.escape("decoupled_policy_loss: behav_logp has shape (2, 2) but logp has "
                                                   "shape (2, 3); they must match")):
        decoupled_policy_loss(PROX, PROX, BEHAV[:, :2], ADV, MASK)


def test_actor_loss_picks_the_decoupled_loss_with_old_as_proximal_and_rollout_as_behaviour():
    cfg = ActorLossConfig(decoupled=True, decoupled_weight_cap=2.0)
    ent = torch.zeros(2, 3)
    got, metrics = actor_loss(PROX + STEP, ent, PROX, ADV, MASK, cfg, normalizer=5.0, rollout_logp=BEHAV)
    want, _ = decoupled_policy_loss(PROX + STEP, PROX, BEHAV, ADV, MASK, behav_weight_cap=2.0, normalizer=5.0)
    assert torch.equal(got, want) and "behav_weight_mean" in metrics
    plain, _ = actor_loss(PROX + STEP, ent, PROX, ADV, MASK, ActorLossConfig(), normalizer=5.0, rollout_logp=BEHAV)
    assert plain.item() != pytest.approx(got.item())
    for bad, rollout in ((ActorLossConfig(decoupled=True, policy_loss="cispo"), BEHAV),
                         (ActorLossConfig(decoupled=True, tis_cap=2.0), BEHAV),
                         (ActorLossConfig(decoupled=True), None)):
        with pytest.raises(ValueError, match="actor_loss: the decoupled loss is PPO's"):
            actor_loss(PROX + STEP, ent, PROX, ADV, MASK, bad, normalizer=5.0, rollout_logp=rollout)


# ---- config ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def make_cfg(tmp_path_factory):
    model = save_tiny_model(str(tmp_path_factory.mktemp("m")))
    prompts = tmp_path_factory.mktemp("data") / "p.jsonl"
    prompts.write_text('{"prompt": "1+1="}\n')

    def make(**train) -> Config:
        cfg = Config()
        cfg.model.pretrain, cfg.data.prompt_data, cfg.reward.function = model, str(prompts), "m:f"
        for key, value in train.items():
            section, _, name = key.partition("__")
            setattr(getattr(cfg, section), name, value)
        return cfg

    return make


@pytest.mark.parametrize("overrides, message", [
    ({"train__decoupled_loss": True, "train__policy_loss": "gspo"},
     "--train.decoupled_loss is PPO's clipped loss decoupled (AReaL); --train.policy_loss gspo has no decoupled form "
     "here; use --train.policy_loss ppo, or drop --train.decoupled_loss"),
    ({"train__decoupled_loss": True, "train__tis_cap": 2.0},
     "--train.decoupled_loss weighs every token by pi_prox / pi_behav itself; --train.tis_cap 2.0 would weigh it "
     "twice; unset --train.tis_cap (cap the weight with --train.decoupled_weight_cap)"),
    ({"train__decoupled_loss": True, "train__decoupled_weight_cap": 0.0},
     "--train.decoupled_weight_cap must be > 0 (or unset: no cap), got 0.0"),
    ({"train__decoupled_weight_cap": 5.0},
     "--train.decoupled_weight_cap caps the weight of --train.decoupled_loss; set that too, or unset the cap"),
    ({"train__decoupled_loss": True, "rollout__top_p": 0.9},
     "--train.decoupled_loss needs the engines' log-probs of the behaviour policy, but with --rollout.top_p 0.9 / "
     "--rollout.top_k -1 the engines sample from a truncated distribution and record the log-probs before the "
     "truncation; set --rollout.top_p 1 --rollout.top_k -1, or drop --train.decoupled_loss"),
])
def test_config_refuses_what_the_decoupled_loss_cannot_do(make_cfg, overrides, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message) + "$"):
        validate(make_cfg(**overrides))


def test_an_async_run_with_the_decoupled_loss_has_no_tis_cap_in_force(make_cfg):
    cfg = validate(make_cfg(rollout__mode="async", rollout__max_staleness=4, train__decoupled_loss=True,
                            train__decoupled_weight_cap=5.0))
    assert tis_cap(cfg) is None
    assert tis_cap(validate(make_cfg(rollout__mode="async"))) == 2.0


def test_the_flags_reach_the_workers_loss_configuration(make_cfg, tmp_path):
    """What the actor workers get (the frozen ActorUpdate.loss) in an async run with the decoupled loss: the loss
    decoupled with its cap, and no TIS weight on top."""
    from rlhf_sg.trainer import PPOTrainer

    cfg = make_cfg(rollout__mode="async", rollout__max_staleness=4, train__decoupled_loss=True,
                   train__decoupled_weight_cap=5.0, train__advantage_estimator="grpo", train__actor_num_ranks=1,
                   rollout__prompts_per_step=2, rollout__n_samples_per_prompt=2, log__output_dir=str(tmp_path / "run"))
    loss = PPOTrainer(validate(cfg)).actor_update().loss
    assert (loss.decoupled, loss.decoupled_weight_cap, loss.tis_cap, loss.policy_loss) == (True, 5.0, None, "ppo")
