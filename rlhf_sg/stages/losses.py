"""The stages' losses, pure torch. Every loss is a SUM over its micro-batch divided by ``normalizer``, the optimizer
step's count (trained tokens for SFT, pairs for reward models and DPO) over all its micro-batches and ranks, divided
by the world size (gradients are averaged over ranks): micro-batch losses then add up to the step's mean however
the step is split, as :class:`rlhf_sg.experience.OptimizerStep` defines it for PPO."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

#: DPO's loss at step 0 (policy = reference, so every logit is 0): -log sigmoid(0)
LN2 = math.log(2.0)


def sft_loss(logp: torch.Tensor, loss_mask: torch.Tensor, normalizer: float) -> torch.Tensor:
    """Negative log-likelihood of the trained tokens. logp, loss_mask: [B, T]; returns a 0-d tensor,
    ``-sum(logp * mask) / normalizer``."""
    return -(logp * loss_mask).sum() / normalizer


def sequence_logp(logp: torch.Tensor, loss_mask: torch.Tensor, length_normalized: bool) -> torch.Tensor:
    """Per-row log-prob of the trained tokens [B]: their sum, or with ``length_normalized`` their mean."""
    total = (logp * loss_mask).sum(dim=1)
    return total / loss_mask.sum(dim=1).clamp(min=1) if length_normalized else total


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, normalizer: float,
                       margin: torch.Tensor | None = None, center_coef: float = 0.0) -> torch.Tensor:
    """``sum(-log sigmoid(r_c - r_r - m)) / normalizer``, plus ``center_coef * sum((r_c + r_r)^2) / normalizer``
    (keeps the rewards centred at 0). chosen, rejected, margin: [N] float32 scores of N pairs."""
    diff = chosen - rejected - (margin if margin is not None else 0.0)
    loss = -F.logsigmoid(diff).sum()
    if center_coef:
        loss = loss + center_coef * ((chosen + rejected) ** 2).sum()
    return loss / normalizer


def pair_accuracy(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """[N] float: 1 where the chosen score is strictly higher; a tie counts as wrong."""
    return (chosen > rejected).float()


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float, normalizer: float, ipo: bool = False,
             label_smoothing: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO (sigmoid) or IPO (squared) loss over N pairs of sequence log-probs [N] (summed or length-normalised by
    the caller, :func:`sequence_logp`), summed and divided by ``normalizer``.

    logits = (pi_c - pi_r) - (ref_c - ref_r); DPO: ``-(1 - eps) log sigmoid(beta logits) - eps log sigmoid(-beta
    logits)`` (eps = ``label_smoothing``, conservative DPO); IPO: ``(logits - 1 / (2 beta))^2``. Returns the loss and
    per-pair tensors [N]: ``rewards_chosen`` / ``rewards_rejected`` (beta x the log-ratio to the reference),
    ``margin`` (their difference) and ``accuracy`` (margin > 0; a tie counts as wrong)."""
    chosen_ratio, rejected_ratio = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    logits = chosen_ratio - rejected_ratio
    if ipo:
        per_pair = (logits - 1.0 / (2.0 * beta)) ** 2
    else:
        per_pair = (-(1.0 - label_smoothing) * F.logsigmoid(beta * logits)
                    - label_smoothing * F.logsigmoid(-beta * logits))
    rewards_chosen, rewards_rejected = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    margin = rewards_chosen - rewards_rejected
    return per_pair.sum() / normalizer, {"rewards_chosen": rewards_chosen, "rewards_rejected": rewards_rejected,
                                         "margin": margin, "accuracy": (margin > 0).float(),
                                         "loss": per_pair.detach()}
