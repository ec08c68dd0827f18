"""Advantage estimators, by name: the built-in ones and any a user registers.

An estimator turns a step's scores (and, for PPO, the critic's values) into per-token advantages. The
trainer prepares an :class:`AdvantageInputs`: scores already clipped to ``--train.score_clip``, the
per-token KL of the sampling policy from the reference and the KL coefficient when the penalty goes
into the rewards (``--train.kl_mode reward``; otherwise a coefficient of 0). An estimator shapes its
sequence-level quantity into token rewards with :meth:`AdvantageInputs.token_rewards`, which adds the
KL penalty, so no estimator repeats the KL handling::

    from rlhf_sg.advantages import register_advantage_estimator
    from rlhf_sg import algorithms as algo

    @register_advantage_estimator("median_baseline", needs_groups=True)
    def median_baseline(inputs):
        scores = inputs.scores.view(-1, inputs.group_size)
        baselined = (scores - scores.median(dim=1, keepdim=True).values).reshape(-1)
        return algo.discounted_returns(inputs.token_rewards(baselined), inputs.action_mask, 1.0), None

then ``--train.advantage_estimator median_baseline`` (``--algo``) selects it (register it before the
config is validated, e.g. at the top of the recipe that builds the config).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlhf_sg import algorithms as algo

__all__ = [
    "AdvantageEstimator",
    "AdvantageInputs",
    "advantage_estimator",
    "advantage_estimators",
    "register_advantage_estimator",
]


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may use. ``B`` samples, each prompt's ``group_size`` samples contiguous.

    scores: [B] float32, clipped to ``score_clip`` when set; action_mask: [B, T] bool; kl: [B, T] the
    per-token KL estimate (zeros when the KL penalty is not in the rewards); kl_coef: its coefficient
    in the rewards (0 when the penalty is in the loss or off); values: [B, T] critic values (estimators
    registered with ``needs_critic``) or None; gamma, lam: the run's discount and GAE lambda; norm: how the
    whitened estimators normalise (``--train.advantage_norm``: whiten, center or none); scored: [B] bool, the
    samples with a score (None: all; an agent harness may leave a sample unscored), the group estimators' baselines
    are taken over these only.
    """

    scores: torch.Tensor
    action_mask: torch.Tensor
    kl: torch.Tensor
    kl_coef: float
    group_size: int
    gamma: float = 1.0
    lam: float = 1.0
    values: torch.Tensor | None = None
    norm: str = "whiten"
    scored: torch.Tensor | None = None

    def token_rewards(self, sequence_scores: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T] rewards: ``sequence_scores`` ([B], default :attr:`scores`) on each row's last action token
        and ``-kl_coef * kl`` on every action token (:func:`rlhf_sg.algorithms.shape_rewards`)."""
        s = self.scores if sequence_scores is None else sequence_scores
        return algo.shape_rewards(s, self.kl, self.action_mask, self.kl_coef)


#: ``inputs -> (advantages [B, T], returns [B, T] or None)``; returns are the critic's targets
EstimatorFn = Callable[[AdvantageInputs], "tuple[torch.Tensor, torch.Tensor | None]"]


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator. needs_critic: it reads ``values`` and returns the critic's targets (the
    run starts a critic); needs_groups: it compares samples of the same prompt (the run must draw more
    than one sample per prompt)."""

    name: str
    fn: EstimatorFn
    needs_critic: bool = False
    needs_groups: bool = False

    def __call__(self, inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.needs_critic and inputs.values is None:
            raise ValueError(f"advantage estimator {self.name!r} needs the critic's values; none were computed")
        advantages, returns = self.fn(inputs)
        if advantages.shape != inputs.action_mask.shape:
            raise ValueError(f"advantage estimator {self.name!r} returned advantages of shape "
                             f"{tuple(advantages.shape)}; expected [B, T] = {tuple(inputs.action_mask.shape)}")
        if self.needs_critic and returns is None:
            raise ValueError(f"advantage estimator {self.name!r} trains a critic but returned no returns")
        return advantages, returns


_REGISTRY: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(name: str, *, needs_critic: bool = False, needs_groups: bool = False):
    """Decorator: make ``fn(inputs) -> (advantages, returns | None)`` selectable as
    ``--train.advantage_estimator name``. Registering a taken name raises (pick another name)."""

    def register(fn: EstimatorFn) -> EstimatorFn:
        if name in _REGISTRY:
            raise ValueError(f"advantage estimator {name!r} is already registered ({_REGISTRY[name].fn!r}); "
                             "choose another name")
        _REGISTRY[name] = AdvantageEstimator(name, fn, needs_critic=needs_critic, needs_groups=needs_groups)
        return fn

    return register


def advantage_estimators() -> list[str]:
    """The names that ``--train.advantage_estimator`` accepts, built-in first."""
    return list(_REGISTRY)


def advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as ``name``, or a ValueError listing the registered ones."""
    if name not in _REGISTRY:
        raise ValueError(f"--train.advantage_estimator {name!r} unknown; choose one of {advantage_estimators()} "
                         "(or register your own with rlhf_sg.advantages.register_advantage_estimator)")
    return _REGISTRY[name]


# ---- the built-in estimators -------------------------------------------------------------------------------


@register_advantage_estimator("gae", needs_critic=True)
def _gae(inputs: AdvantageInputs):
    """PPO: GAE over the KL-shaped token rewards and the critic's values, whitened over the batch's tokens."""
    advantages, returns = algo.gae(inputs.token_rewards(), inputs.values, inputs.action_mask, inputs.gamma,
                                   inputs.lam)
    return algo.normalize_advantages(advantages, inputs.action_mask, inputs.norm), returns


@register_advantage_estimator("reinforce")
def _reinforce(inputs: AdvantageInputs):
    """REINFORCE++: discounted returns of the KL-shaped token rewards, whitened over the batch's tokens."""
    returns = algo.discounted_returns(inputs.token_rewards(), inputs.action_mask, inputs.gamma)
    return algo.normalize_advantages(returns, inputs.action_mask, inputs.norm), None


def _register_group(kind: str) -> None:
    # group estimators take gamma = 1: the baseline is a sequence-level quantity
    def group(inputs: AdvantageInputs):
        baselined = algo.group_advantages(inputs.scores, inputs.group_size, kind, inputs.scored)
        return algo.discounted_returns(inputs.token_rewards(baselined), inputs.action_mask, 1.0), None

    group.__doc__ = f"{kind}: :func:`rlhf_sg.algorithms.group_advantages` shaped into token rewards, returns (gamma 1)"
    register_advantage_estimator(kind, needs_groups=True)(group)


for _kind in ("grpo", "dr_grpo", "rloo"):
    _register_group(_kind)


@register_advantage_estimator("reinforce_baseline", needs_groups=True)
def _reinforce_baseline(inputs: AdvantageInputs):
    """REINFORCE++ with a group baseline (:func:`rlhf_sg.algorithms.reinforce_baseline_advantages`)."""
    advantages = algo.reinforce_baseline_advantages(inputs.scores, inputs.kl, inputs.action_mask, inputs.group_size,
                                                    inputs.kl_coef, 1.0, norm=inputs.norm)
    return advantages, None
