"""The weights that sampled each token, and how far the trainer has moved since.

A completion of partial rollout is cut at a weight sync and continued with the new weights, and a multi-turn sample
has a turn per generate call: their tokens come from several weight versions. ``Experience.token_versions`` ``[B, T]``
holds each token's (:func:`rlhf_sg.experience.build_rollout_batch`); the engine's log-prob of each token
(``rollout_logp``) is that version's, the behaviour policy of :func:`rlhf_sg.algorithms.decoupled_policy_loss`."""

from __future__ import annotations

import torch


def token_staleness(token_versions: torch.Tensor, action_mask: torch.Tensor, trainer_version: int) -> dict[str, float]:
    """Per-token staleness of a batch the trainer trains at ``trainer_version``: metrics
    ``rollout/token_staleness_mean`` and ``_max`` over the sampled tokens, and ``rollout/multi_version_frac``, the
    share of samples whose tokens come from more than one version. token_versions: [B, T] int64; action_mask: [B, T]
    bool (observation tokens and padding out). Raises ValueError if a token is from weights the trainer does not
    have yet."""
    if token_versions.shape != action_mask.shape:
        raise ValueError(f"token_staleness: token_versions {tuple(token_versions.shape)} and action_mask "
                         f"{tuple(action_mask.shape)} must have one shape")
    m = action_mask.bool()
    staleness = (trainer_version - token_versions)[m]
    if staleness.numel() and int(staleness.min()) < 0:
        raise ValueError(f"token_staleness: tokens of weight version {int(token_versions[m].max())} in a batch the "
                         f"trainer trains at version {trainer_version}")
    big = torch.iinfo(token_versions.dtype).max
    newest = torch.where(m, token_versions, -1).amax(dim=1)
    oldest = torch.where(m, token_versions, big).amin(dim=1)
    return {"rollout/token_staleness_mean": staleness.float().mean().item() if staleness.numel() else 0.0,
            "rollout/token_staleness_max": float(staleness.max()) if staleness.numel() else 0.0,
            "rollout/multi_version_frac": (newest > oldest).float().mean().item()}
