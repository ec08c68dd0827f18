"""Specification tests of rlhf_sg/advantages.py: each built-in estimator against hand-computed values.

One batch throughout: two samples of one prompt (group size 2), three token columns, the action tokens
at different places in each row (row 0: columns 0-1; row 1: columns 1-2), scores 3 and 1, per-token
KL 0.5, 1.0 (row 0) and 2.0, 0.5 (row 1) with coefficient 0.1, and 9.0 on the masked columns (a KL
value that must never be read). gamma 0.5 and lambda 0.5 wherever an estimator may use them, so that
one that ignores them, or uses them where it must not, gives other numbers.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_sg import advantages as adv
from rlhf_sg.advantages import AdvantageInputs, advantage_estimator, advantage_estimators

MASK = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)
KL = torch.tensor([[0.5, 1.0, 9.0], [9.0, 2.0, 0.5]])
SCORES = torch.tensor([3.0, 1.0])
VALUES = torch.tensor([[1.0, 2.0, 7.0], [7.0, 0.5, 1.0]])


def inputs(kl_coef=0.1, values=None, gamma=0.5, lam=0.5, scores=SCORES):
    return AdvantageInputs(scores=scores, action_mask=MASK, kl=KL, kl_coef=kl_coef, group_size=2, gamma=gamma,
                           lam=lam, values=values)


def whitened(rows):
    """Hand whitening over the action tokens: (x - mean) / sqrt(biased variance); rows hold the action
    tokens' values in column order, placed back at MASK's positions."""
    flat = [x for row in rows for x in row]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / len(flat))
    return at_actions([[(x - mean) / std for x in row] for row in rows])


def at_actions(rows):
    """[[row 0's two action values], [row 1's two]] -> the [2, 3] tensor, 0 on masked columns."""
    return torch.tensor([[rows[0][0], rows[0][1], 0.0], [0.0, rows[1][0], rows[1][1]]])


# ---- token rewards: the KL penalty on every action token, the score on the last one -------------------


def test_token_rewards_puts_scores_on_the_last_action_token_and_the_kl_penalty_everywhere():
    # row 0: -0.1*0.5, -0.1*1.0 + 3; row 1: -0.1*2.0, -0.1*0.5 + 1; the masked KL 9.0 is never read
    torch.testing.assert_close(inputs().token_rewards(), at_actions([[-0.05, 2.9], [-0.2, 0.95]]))


def test_token_rewards_of_given_sequence_scores_replace_the_inputs_scores():
    torch.testing.assert_close(inputs().token_rewards(torch.tensor([10.0, -20.0])),
                               at_actions([[-0.05, 9.9], [-0.2, -20.05]]))


def test_token_rewards_without_a_kl_coefficient_are_the_scores_alone():
    torch.testing.assert_close(inputs(kl_coef=0.0).token_rewards(), at_actions([[0.0, 3.0], [0.0, 1.0]]))


# ---- each built-in estimator -----------------------------------------------------------------------------


def test_reinforce_is_the_whitened_discounted_return_of_the_token_rewards():
    # returns with gamma 0.5: row 0: G1 = 2.9, G0 = -0.05 + 0.5 * 2.9 = 1.4; row 1: G2 = 0.95, G1 = -0.2 + 0.475
    a, returns = advantage_estimator("reinforce")(inputs())
    assert returns is None
    torch.testing.assert_close(a, whitened([[1.4, 2.9], [0.275, 0.95]]))


def test_gae_is_whitened_gae_of_the_token_rewards_and_returns_advantages_plus_values():
    # gamma = lam = 0.5. Row 0: A1 = 2.9 - 2 = 0.9; delta0 = -0.05 + 0.5 * 2 - 1 = -0.05, A0 = -0.05 + 0.25 * 0.9
    # = 0.175. Row 1: A2 = 0.95 - 1 = -0.05; delta1 = -0.2 + 0.5 * 1 - 0.5 = -0.2, A1 = -0.2 + 0.25 * -0.05
    # = -0.2125. Returns = A + V: 1.175, 2.9; 0.2875, 0.95.
    a, returns = advantage_estimator("gae")(inputs(values=VALUES))
    torch.testing.assert_close(returns, at_actions([[1.175, 2.9], [0.2875, 0.95]]))
    torch.testing.assert_close(a, whitened([[0.175, 0.9], [-0.2125, -0.05]]))


@pytest.mark.parametrize("name, baselined", [
    ("grpo", (1 / (math.sqrt(2) + 1e-6), -1 / (math.sqrt(2) + 1e-6))),  # (s - 2) / (unbiased std sqrt(2) + eps)
    ("dr_grpo", (1.0, -1.0)),                                            # s - 2
    ("rloo", (2.0, -2.0)),                                               # s - the other sample's score
])
@pytest.mark.parametrize("registered", ["at_import", "again"])
def test_group_estimators_are_undiscounted_returns_of_the_baselined_scores(monkeypatch, name, baselined, registered):
    # token rewards: row 0: -0.05, -0.1 + b0; row 1: -0.2, -0.05 + b1; returns with gamma 1 (inputs say 0.5:
    # a sequence-level baseline is not discounted); not whitened. "again": the estimator that registering the
    # kind now makes (the built-in ones are registered once, at import)
    if registered == "again":
        monkeypatch.setattr(adv, "_REGISTRY", {})
        adv._register_group(name)
        assert advantage_estimators() == [name]
    b0, b1 = baselined
    e = advantage_estimator(name)
    assert (e.name, e.needs_critic, e.needs_groups) == (name, False, True)
    a, returns = e(inputs())
    assert returns is None
    torch.testing.assert_close(a, at_actions([[b0 - 0.15, b0 - 0.1], [b1 - 0.25, b1 - 0.05]]))


def test_reinforce_baseline_is_whitened_undiscounted_returns_of_the_mean_baselined_scores():
    # s - mean = +1, -1; rewards row 0: -0.05, 0.9; row 1: -0.2, -1.05; returns (gamma 1, not the inputs' 0.5):
    # 0.85, 0.9; -1.25, -1.05; then whitened over the four action tokens
    a, returns = advantage_estimator("reinforce_baseline")(inputs())
    assert returns is None
    torch.testing.assert_close(a, whitened([[0.85, 0.9], [-1.25, -1.05]]))


def test_every_estimator_applies_the_kl_penalty_it_is_given():
    # the same inputs without the penalty give other advantages for every built-in estimator: none drops the KL
    for name in advantage_estimators()[:6]:
        with_kl, _ = advantage_estimator(name)(inputs(values=VALUES))
        without, _ = advantage_estimator(name)(inputs(kl_coef=0.0, values=VALUES))
        assert not torch.allclose(with_kl, without), name


# ---- the registry ----------------------------------------------------------------------------------------


def test_built_in_estimators_in_order_with_what_each_needs():
    assert advantage_estimators()[:6] == ["gae", "reinforce", "grpo", "dr_grpo", "rloo", "reinforce_baseline"]
    needs = {n: (advantage_estimator(n).needs_critic, advantage_estimator(n).needs_groups)
             for n in advantage_estimators()[:6]}
    assert needs == {"gae": (True, False), "reinforce": (False, False), "grpo": (False, True),
                     "dr_grpo": (False, True), "rloo": (False, True), "reinforce_baseline": (False, True)}
    assert all(advantage_estimator(n).name == n for n in needs)


def test_unknown_estimator_names_the_flag_and_the_choices():
    with pytest.raises(ValueError) as err:
        advantage_estimator("nope")
    assert str(err.value) == (f"--train.advantage_estimator 'nope' unknown; choose one of {advantage_estimators()} "
                              "(or register your own with rlhf_sg.advantages.register_advantage_estimator)")


def test_gae_without_values_says_it_needs_the_critic():
    with pytest.raises(ValueError, match="advantage estimator 'gae' needs the critic's values"):
        advantage_estimator("gae")(inputs())


@pytest.fixture
def registry(monkeypatch):
    """A copy of the registry, so estimators registered by a test disappear after it."""
    monkeypatch.setattr(adv, "_REGISTRY", dict(adv._REGISTRY))


def test_registered_estimator_is_selectable_and_called_with_the_inputs(registry):
    seen = []

    @adv.register_advantage_estimator("spec_constant", needs_groups=True)
    def constant(i):
        seen.append(i)
        return torch.ones_like(i.kl), None

    assert advantage_estimators()[-1] == "spec_constant"
    e = advantage_estimator("spec_constant")
    assert (e.fn, e.needs_critic, e.needs_groups) == (constant, False, True)
    x = inputs()
    a, _ = e(x)
    assert seen == [x] and torch.equal(a, torch.ones(2, 3))


def test_registering_a_taken_name_raises_and_keeps_the_first(registry):
    def other(i):
        return torch.zeros_like(i.kl), None

    first = advantage_estimator("grpo").fn
    with pytest.raises(ValueError) as err:
        adv.register_advantage_estimator("grpo")(other)
    assert str(err.value) == f"advantage estimator 'grpo' is already registered ({first!r}); choose another name"
    assert advantage_estimator("grpo").fn is first


def test_an_estimator_registered_without_options_needs_neither_critic_nor_groups(registry):
    adv.register_advantage_estimator("spec_plain")(lambda i: (torch.zeros_like(i.kl), None))
    e = advantage_estimator("spec_plain")
    assert (e.needs_critic, e.needs_groups) == (False, False)


def test_estimator_returning_the_wrong_shape_is_named(registry):
    adv.register_advantage_estimator("spec_rows")(lambda i: (torch.zeros(2), None))
    with pytest.raises(ValueError, match=r"'spec_rows' returned advantages of shape \(2,\); expected \[B, T\] = "
                                         r"\(2, 3\)"):
        advantage_estimator("spec_rows")(inputs())


def test_critic_estimator_returning_no_returns_is_named(registry):
    adv.register_advantage_estimator("spec_critic", needs_critic=True)(lambda i: (torch.zeros_like(i.kl), None))
    with pytest.raises(ValueError, match="'spec_critic' trains a critic but returned no returns"):
        advantage_estimator("spec_critic")(inputs(values=VALUES))
    # with returns it passes, and a critic-free estimator may return none
    adv.register_advantage_estimator("spec_critic2", needs_critic=True)(lambda i: (i.values, i.values))
    torch.testing.assert_close(advantage_estimator("spec_critic2")(inputs(values=VALUES))[1], VALUES)
