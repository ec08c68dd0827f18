"""The KL term of the actor loss: each estimator's *expected* gradient, computed exactly on a small categorical
(every token enumerated and weighted by its sampling probability: no sampling noise), against the gradient of
the exact KL.

Reference formulas (written here, not taken from rlhf_sg). pi = softmax(theta), ref fixed, a token y drawn from
the sampling policy mu (mu = pi on-policy, an older pi_old off-policy), d(y) = log pi(y) - log ref(y):
  KL(pi || ref) = sum_y pi(y) d(y)                          reverse KL, the regulariser PPO/GRPO mean
  KL(ref || pi) = sum_y ref(y) (log ref(y) - log pi(y))     forward KL
  k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d                (Schulman's estimators; OpenRLHF compute_approx_kl)
  E_{y~pi}[grad k1] = sum_y pi grad log pi = grad sum_y pi = 0
  E_{y~pi}[grad k2] = sum_y pi d grad log pi = grad KL(pi || ref)
  E_{y~pi}[grad k3] = sum_y (pi - ref) grad log pi = grad KL(ref || pi)
  straight-through (OpenRLHF unbiased_gradient): value k_i, gradient w * d * grad log pi with
  w = min(pi / mu, 10) detached, so E_{y~mu}[w d grad log pi] = sum_y pi d grad log pi = grad KL(pi || ref)
  while pi / mu stays under the cap.
"""

import pytest
import torch

from rlhf_sg.algorithms import (
    KL_IS_WEIGHT_CAP,
    ActorLossConfig,
    actor_loss,
    approx_kl,
    approx_kl_straight_through,
)

V = 6
THETA = torch.tensor([0.3, -1.2, 0.8, 0.0, -0.4, 1.1], dtype=torch.float64)
REF_LOGITS = torch.tensor([-0.5, 0.4, 0.2, -1.0, 0.9, 0.1], dtype=torch.float64)
OLD_THETA = THETA + torch.tensor([0.2, -0.1, 0.3, -0.25, 0.15, -0.3], dtype=torch.float64)


def _exact_grad(divergence) -> torch.Tensor:
    """grad_theta of a closed-form divergence of pi = softmax(theta) and ref."""
    theta = THETA.clone().requires_grad_(True)
    logpi, logref = theta.log_softmax(-1), REF_LOGITS.log_softmax(-1)
    divergence(logpi, logref).backward()
    return theta.grad


def reverse_kl(logpi, logref):
    return (logpi.exp() * (logpi - logref)).sum()


def forward_kl(logpi, logref):
    return (logref.exp() * (logref - logpi)).sum()


def _expected_grad(per_token_term, sampler_logits: torch.Tensor) -> torch.Tensor:
    """E_{y ~ softmax(sampler_logits)}[grad_theta term(y)], exactly: every token as one row, the rows weighted
    by their (detached) sampling probability. per_token_term(logp, ref_logp, old_logp): [V, 1] -> [V, 1]."""
    theta = THETA.clone().requires_grad_(True)
    logp = theta.log_softmax(-1)[:, None]  # [V, 1]: row y holds log pi(y)
    ref_logp = REF_LOGITS.log_softmax(-1)[:, None]
    old_logp = sampler_logits.log_softmax(-1)[:, None]
    mu = old_logp.exp().detach()
    (mu * per_token_term(logp, ref_logp, old_logp)).sum().backward()
    return theta.grad


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_each_estimators_expected_gradient_on_policy(kind):
    got = _expected_grad(lambda lp, ref, old: approx_kl(lp, ref, kind).double(), THETA)
    if kind == "k1":
        torch.testing.assert_close(got, torch.zeros(V, dtype=torch.float64), atol=1e-7, rtol=0)
    elif kind == "k2":
        torch.testing.assert_close(got, _exact_grad(reverse_kl), atol=1e-6, rtol=1e-5)
    else:
        torch.testing.assert_close(got, _exact_grad(forward_kl), atol=1e-6, rtol=1e-5)
        # and k3 is not the reverse KL's gradient: the two differ on this categorical
        assert (got - _exact_grad(reverse_kl)).abs().max() > 1e-2


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_straight_through_gives_the_reverse_kl_gradient_on_policy(kind):
    got = _expected_grad(lambda lp, ref, old: approx_kl_straight_through(lp, ref, kind).double(), THETA)
    torch.testing.assert_close(got, _exact_grad(reverse_kl), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_straight_through_importance_weight_carries_the_gradient_to_older_samples(kind):
    """Tokens drawn by an older policy (a later minibatch or epoch): the weight pi / pi_old makes the expected
    gradient that of KL(pi || ref) at the current pi; without the weight it is off."""
    assert (THETA.log_softmax(-1) - OLD_THETA.log_softmax(-1)).exp().max() < KL_IS_WEIGHT_CAP
    got = _expected_grad(lambda lp, ref, old: approx_kl_straight_through(lp, ref, kind, old).double(), OLD_THETA)
    torch.testing.assert_close(got, _exact_grad(reverse_kl), atol=1e-6, rtol=1e-5)
    unweighted = _expected_grad(lambda lp, ref, old: approx_kl_straight_through(lp, ref, kind).double(), OLD_THETA)
    assert (unweighted - _exact_grad(reverse_kl)).abs().max() > 1e-2


def test_straight_through_keeps_the_estimators_value_and_caps_the_weight():
    logp = torch.tensor([[-0.5, -2.0, -0.1]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.5, -3.0]])
    old = torch.tensor([[-0.6, -5.0, -0.1]])  # pi / pi_old = e^0.1, e^3 (capped at 10), 1
    for kind in ("k1", "k2", "k3"):
        value = approx_kl_straight_through(logp, ref, kind, old)
        torch.testing.assert_close(value.detach(), approx_kl(logp, ref, kind).detach())
    logp.grad = None
    approx_kl_straight_through(logp, ref, "k3", old).sum().backward()
    d = logp.detach() - ref
    w = torch.minimum((logp.detach() - old).exp(), torch.tensor(10.0))
    torch.testing.assert_close(logp.grad, w * d)
    assert w[0, 1] == 10.0


def test_actor_loss_takes_the_straight_through_kl_with_old_logp():
    """In the actor's loss the straight-through term is weighted by pi / pi_old, old_logp being the loss's own."""
    logp = torch.tensor([[-0.5, -2.0], [-1.0, -0.3]], requires_grad=True)
    old = torch.tensor([[-0.7, -1.8], [-1.0, -0.6]])
    ref = torch.tensor([[-1.0, -1.5], [-0.2, -0.9]])
    zeros, mask = torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.bool)
    cfg = ActorLossConfig(kl_coef=0.5, kl_estimator="k3", kl_straight_through=True)
    loss, _ = actor_loss(logp, zeros, old, zeros, mask, cfg, 4.0, ref_logp=ref)
    loss.backward()
    # the surrogate's advantages are 0: only the KL term's gradient is left, 0.5 / 4 * w * (logp - ref)
    expected = 0.5 / 4 * (logp.detach() - old).exp() * (logp.detach() - ref)
    torch.testing.assert_close(logp.grad, expected)
