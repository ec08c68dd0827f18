"""The RL algorithm core: KL estimators, reward shaping, advantages and losses.

Pure torch, batched and masked; nothing here knows about Ray, DeepSpeed or engines.

Conventions. Per-token tensors are ``[B, T]`` over the *response* block of a rollout batch:
row ``b``, column ``j`` is the ``j``-th generated token of sample ``b`` (responses are
right-padded; prompts, left-padded, are not part of these tensors). ``action_mask`` ``[B, T]``
(bool or 0/1) marks the tokens the policy chose; it may also have holes (e.g. tool output in a
multi-turn rollout), which the recursions below skip over in time. Masked positions never
influence any output, even when they hold NaN or inf: every reduction selects with
``torch.where`` instead of multiplying by the mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ActorLossConfig",
    "AdaptiveKLController",
    "FixedKLController",
    "GROUP_KINDS",
    "KL_KINDS",
    "LOSS_CLIP_DEFAULTS",
    "LOSS_RATIO_LEVELS",
    "POLICY_LOSSES",
    "RATIO_LEVELS",
    "actor_loss",
    "approx_kl",
    "approx_kl_straight_through",
    "cispo_loss",
    "decoupled_policy_loss",
    "discounted_returns",
    "distill_advantages",
    "gae",
    "gmpo_loss",
    "group_advantages",
    "log_importance_ratio",
    "masked_aggregate",
    "masked_mean",
    "masked_whiten",
    "normalize_advantages",
    "overlong_penalty",
    "policy_loss",
    "reinforce_baseline_advantages",
    "sapo_loss",
    "shape_rewards",
    "value_loss",
]

KL_KINDS = ("k1", "k2", "k3")
GROUP_KINDS = ("grpo", "dr_grpo", "rloo", "reinforce_baseline")
#: every estimator the trainer accepts; "gae" needs a critic, "reinforce" (REINFORCE++) does not
ADVANTAGE_ESTIMATORS = ("gae", "reinforce") + GROUP_KINDS
#: token_mean: the step's token mean; seq_mean: the mean of each row's token mean; seq_mean_token_sum: the mean of
#: each row's token sum (verl); seq_mean_token_sum_norm: that over a constant token budget (Dr.GRPO)
AGGREGATIONS = ("token_mean", "seq_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
#: how the whitened estimators (gae, reinforce, reinforce_baseline) normalise their advantages over the batch's
#: tokens: whiten (mean 0, std 1), center (mean 0 only: OpenRLHF's no_std_norm), none
ADVANTAGE_NORMS = ("whiten", "center", "none")
#: truncated importance sampling: truncate clamps the weight into [low, cap]; mask zeroes the tokens whose
#: weight falls outside (ICEPOP)
TIS_MODES = ("truncate", "mask")
#: the policy losses: ppo (PPO's clipped surrogate), gspo (that clip on the sequence ratio), cispo (the clipped ratio
#: as a stop-gradient weight on log pi), sapo (a soft gate instead of the clip), gmpo (the geometric mean of the
#: token ratios, clipped in log space); :func:`actor_loss` picks one
POLICY_LOSSES = ("ppo", "gspo", "cispo", "sapo", "gmpo")
#: the importance ratio pi / pi_old of each token, or of its whole sequence (:func:`log_importance_ratio`)
RATIO_LEVELS = ("token", "sequence")
#: the ratio levels each loss takes, its own first: gspo and gmpo are sequence losses by definition, and PPO's
#: clip on a sequence ratio is gspo (whose clip range fits one)
LOSS_RATIO_LEVELS = {"ppo": ("token",), "gspo": ("sequence",), "cispo": ("token", "sequence"),
                     "sapo": ("token", "sequence"), "gmpo": ("sequence",)}
#: each loss's own (clip_low, clip_high): PPO's 0.2; GSPO's paper 3e-4 / 4e-4 (a sequence ratio moves two orders
#: less than a token's); CISPO without a lower bound (clip_low 1: the weight's floor is 0) and an upper bound of 6
#: (NeMo-RL's clamp [0, 6]); GMPO's paper (e^-0.4, e^0.4), bounds of the log-ratio. SAPO has no clip
LOSS_CLIP_DEFAULTS = {"ppo": (0.2, 0.2), "gspo": (3e-4, 4e-4), "cispo": (1.0, 5.0), "gmpo": (0.4, 0.4)}
#: SAPO's gate temperatures for positive and negative advantages (verl's compute_policy_loss_sapo)
SAPO_TAU_POS = 1.0
SAPO_TAU_NEG = 1.05

_KL_CLAMP = 10.0
#: the cap of the straight-through KL's importance weight pi_theta / pi_old (OpenRLHF's KL_IS_WEIGHT_CLIP)
KL_IS_WEIGHT_CAP = 10.0
_LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: large enough to never bind in practice, small enough to stay finite
_WHITEN_EPS = 1e-8
_GROUP_STD_EPS = 1e-6


# ---- validation ------------------------------------------------------------------------------


def _check_same_shape(fn: str, **tensors: torch.Tensor) -> None:
    items = [(k, v) for k, v in tensors.items() if v is not None]
    ref_name, ref = items[0]
    for name, t in items[1:]:
        if t.shape != ref.shape:
            raise ValueError(
                f"{fn}: {name} has shape {tuple(t.shape)} but {ref_name} has shape {tuple(ref.shape)}; "
                "they must match"
            )


def _as_bool_mask(fn: str, mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask
    if mask.dtype.is_floating_point or mask.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        return mask != 0
    raise ValueError(f"{fn}: mask must be bool or 0/1 numbers, got dtype {mask.dtype}")


def _check_2d(fn: str, name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{fn}: {name} must be [B, T], got shape {tuple(t.shape)}")


def _check_rows_nonempty(fn: str, mask: torch.Tensor, name: str = "action_mask") -> None:
    empty = (~mask.any(dim=-1)).nonzero().flatten()
    if empty.numel():
        rows = empty[:8].tolist()
        more = "" if empty.numel() <= 8 else f" (and {empty.numel() - 8} more)"
        raise ValueError(f"{fn}: {name} has no token set in row(s) {rows}{more}; every sample needs >= 1 action token")


def _check_kind(fn: str, arg: str, kind: str, allowed: tuple[str, ...]) -> None:
    if kind not in allowed:
        raise ValueError(f"{fn}: unknown {arg} {kind!r}; expected one of {list(allowed)}")


# ---- masked statistics -------------------------------------------------------------------------


def engine_vs_trainer_metrics(rollout_logp: torch.Tensor, trainer_logp: torch.Tensor,
                              mask: torch.Tensor) -> dict[str, float]:
    """How far the trainer's log-probs of the sampled tokens are from the engine's: ``rollout_logp``,
    ``trainer_logp``, ``mask`` [B, T]. The mean |Δ log p|; k3's estimate of KL(engine || trainer) on the engine's
    samples, mean of exp(r) - 1 - r with r = log p_trainer - log p_engine; and the fraction of tokens with
    |Δ log p| > ln 2 (a token one side finds over twice as likely as the other: an expert flip in a MoE model)."""
    r = trainer_logp - rollout_logp
    return {
        "rollout/logp_gap_engine_vs_trainer": masked_mean(r.abs(), mask).item(),
        "rollout/k3_kl_engine_vs_trainer": masked_mean(torch.expm1(r) - r, mask).item(),
        "rollout/frac_logp_gap_over_ln2": masked_mean((r.abs() > math.log(2)).float(), mask).item(),
    }


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is set.

    x, mask: the same shape. dim=None -> a scalar over everything; dim=d -> reduce that dimension,
    every slice along it must hold at least one set position.
    Raises ValueError on shape mismatch or an empty mask (slice).
    """
    _check_same_shape("masked_mean", x=x, mask=mask)
    m = _as_bool_mask("masked_mean", mask)
    total = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if dim is None:
        count = m.sum()
        if count.item() == 0:
            raise ValueError("masked_mean: mask is empty (no position set); nothing to average")
        return total.sum() / count
    count = m.sum(dim=dim)
    if (count == 0).any():
        bad = (count == 0).nonzero().flatten()[:8].tolist()
        raise ValueError(f"masked_mean: mask is empty along dim {dim} at index {bad}; nothing to average there")
    return total.sum(dim=dim) / count


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise ``x`` to zero mean, unit variance over the masked positions.

    Statistics are the masked mean and the (biased) masked variance over all set positions;
    ``out = (x - mean) / sqrt(max(var, 1e-8))``. shift_mean=False keeps the original mean (only the
    scale changes). Masked-out positions are 0.
    """
    _check_same_shape("masked_whiten", x=x, mask=mask)
    m = _as_bool_mask("masked_whiten", mask)
    mean = masked_mean(x, m)
    var = masked_mean((torch.where(m, x, mean) - mean) ** 2, m)
    out = (x - mean) * torch.rsqrt(var.clamp(min=_WHITEN_EPS))
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, torch.zeros((), dtype=out.dtype, device=out.device))


def normalize_advantages(x: torch.Tensor, mask: torch.Tensor, norm: str = "whiten") -> torch.Tensor:
    """Advantages normalised over the masked positions: ``whiten`` (:func:`masked_whiten`), ``center``
    (``x - mean``) or ``none`` (``x``, 0 where masked out). x, mask: [B, T]."""
    _check_kind("normalize_advantages", "norm", norm, ADVANTAGE_NORMS)
    _check_same_shape("normalize_advantages", x=x, mask=mask)
    m = _as_bool_mask("normalize_advantages", mask)
    if norm == "whiten":
        return masked_whiten(x, m)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    out = x - masked_mean(x, m) if norm == "center" else x
    return torch.where(m, out, zero)


# ---- KL and rewards ------------------------------------------------------------------------------


def approx_kl(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs.

    logp, ref_logp: [B, T] (any matching shape). With d = ref_logp - logp:
      k1 = -d = logp - ref_logp                 (unbiased, can be negative)
      k2 = d^2 / 2                              (>= 0, biased)
      k3 = exp(d) - 1 - d                       (>= 0, unbiased)
    The result is clamped to [-10, 10]; d is clamped to +-20 before exp so k3 stays finite.
    """
    _check_same_shape("approx_kl", logp=logp, ref_logp=ref_logp)
    _check_kind("approx_kl", "kind", kind, KL_KINDS)
    d = ref_logp.float() - logp.float()
    if kind == "k1":
        kl = -d
    elif kind == "k2":
        kl = 0.5 * d.square()
    else:
        d = d.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        kl = torch.expm1(d) - d
    return kl.clamp(-_KL_CLAMP, _KL_CLAMP)


def approx_kl_straight_through(
    logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3", old_logp: torch.Tensor | None = None
) -> torch.Tensor:
    """The ``kind`` estimate's value with k2's gradient, importance-weighted: a KL loss term whose expected
    gradient is that of KL(policy || ref) whatever the estimator and however stale the samples.

    logp, ref_logp, old_logp: [B, T]; old_logp is the policy that sampled the tokens (None: this one).
    Value: :func:`approx_kl` (kind). Gradient w.r.t. logp: ``w * (logp - ref_logp)`` with
    ``w = min(exp(logp - old_logp), 10)`` detached. Why: the expected gradient of k1 under the sampling policy
    is 0 and that of k3 is the gradient of the forward KL(ref || policy); ``(logp - ref) * grad log pi`` has
    expectation grad KL(policy || ref) under the policy, and ``w`` carries that to tokens drawn by an older
    policy (a later minibatch or epoch). As OpenRLHF's ``compute_approx_kl(..., unbiased_gradient=True)``.
    """
    _check_same_shape("approx_kl_straight_through", logp=logp, ref_logp=ref_logp, old_logp=old_logp)
    value = approx_kl(logp, ref_logp, kind).detach()
    log_ratio = logp.float() - ref_logp.float()
    k2 = 0.5 * log_ratio.square()
    if old_logp is None:
        weight = torch.ones_like(log_ratio)
    else:
        is_log = (logp.float() - old_logp.float()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        weight = torch.exp(is_log).clamp(max=KL_IS_WEIGHT_CAP)
    return value + weight.detach() * (k2 - k2.detach())


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer_len: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to each completion's score.

    lengths: [B] completion lengths in tokens. With ``expected = max_new_tokens - buffer_len``:
    ``min(-(length - expected) / buffer_len * factor, 0)``: 0 up to ``expected``, falling linearly to ``-factor``
    at ``max_new_tokens``. Returns [B] float32.
    """
    if not 0 < buffer_len <= max_new_tokens:
        raise ValueError(f"overlong_penalty: buffer_len must be in (0, max_new_tokens = {max_new_tokens}], "
                         f"got {buffer_len}")
    exceed = lengths.float() - (max_new_tokens - buffer_len)
    return (-exceed / buffer_len * factor).clamp(max=0.0)


def _last_action_index(fn: str, mask: torch.Tensor) -> torch.Tensor:
    """[B] column of the last set position of each row of a bool [B, T] mask."""
    _check_rows_nonempty(fn, mask)
    cols = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask, cols, torch.full_like(cols, -1)).amax(dim=1)


def shape_rewards(
    score: torch.Tensor,
    kl: torch.Tensor,
    action_mask: torch.Tensor,
    kl_coef: float,
    score_clip: float | None = None,
) -> torch.Tensor:
    """Per-token rewards: ``-kl_coef * kl`` on every action token, plus the sequence score
    (clipped to ``[-score_clip, score_clip]`` when given) on the last action token of each row.

    score: [B]; kl, action_mask: [B, T]. Returns [B, T] float32, 0 where action_mask is 0.
    """
    _check_2d("shape_rewards", "kl", kl)
    _check_same_shape("shape_rewards", kl=kl, action_mask=action_mask)
    if score.shape != (kl.shape[0],):
        raise ValueError(f"shape_rewards: score must be [B] = [{kl.shape[0]}], got shape {tuple(score.shape)}")
    if score_clip is not None and score_clip <= 0:
        raise ValueError(f"shape_rewards: score_clip must be > 0 or None, got {score_clip}")
    m = _as_bool_mask("shape_rewards", action_mask)
    last = _last_action_index("shape_rewards", m)
    s = score.float()
    if score_clip is not None:
        s = s.clamp(-score_clip, score_clip)
    rewards = torch.where(m, -kl_coef * kl.float(), torch.zeros((), device=kl.device))
    rows = torch.arange(kl.shape[0], device=kl.device)
    rewards[rows, last] += s
    return rewards


# ---- advantages ------------------------------------------------------------------------------------


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    action_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over action tokens.

    rewards, values, action_mask: [B, T]; values[b, t] is V(state before token t).
    Returns (advantages, returns), both [B, T] float32 and 0 where action_mask is 0;
    returns = advantages + values. The value after a row's last action token is 0 (terminal).
    Masked positions inside a row are skipped: the next action token's value and advantage carry
    across them, so a hole changes nothing.
    """
    _check_2d("gae", "rewards", rewards)
    _check_same_shape("gae", rewards=rewards, values=values, action_mask=action_mask)
    m = _as_bool_mask("gae", action_mask)
    r = torch.where(m, rewards.float(), 0.0)
    v = torch.where(m, values.float(), 0.0)
    B, T = r.shape
    advantages = torch.zeros_like(r)
    next_value = torch.zeros(B, device=r.device)
    running = torch.zeros(B, device=r.device)
    for t in reversed(range(T)):
        mt = m[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        candidate = delta + gamma * lam * running
        running = torch.where(mt, candidate, running)
        next_value = torch.where(mt, v[:, t], next_value)
        advantages[:, t] = torch.where(mt, candidate, 0.0)
    returns = torch.where(m, advantages + v, 0.0)
    return advantages, returns


def discounted_returns(rewards: torch.Tensor, action_mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Reward-to-go ``G_t = r_t + gamma * G_{t+1}`` over action tokens (REINFORCE++, no critic).

    rewards, action_mask: [B, T]. Returns [B, T] float32, 0 where action_mask is 0; holes are
    skipped as in :func:`gae`.
    """
    _check_2d("discounted_returns", "rewards", rewards)
    _check_same_shape("discounted_returns", rewards=rewards, action_mask=action_mask)
    m = _as_bool_mask("discounted_returns", action_mask)
    r = torch.where(m, rewards.float(), 0.0)
    returns = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], device=r.device)
    for t in reversed(range(r.shape[1])):
        running = torch.where(m[:, t], r[:, t] + gamma * running, running)
        returns[:, t] = torch.where(m[:, t], running, 0.0)
    return returns


def group_advantages(scores: torch.Tensor, group_size: int, kind: str = "grpo",
                     scored: torch.Tensor | None = None) -> torch.Tensor:
    """Sequence-level advantages from the scores of groups of samples of the same prompt.

    scores: [B] with B = num_prompts * group_size and each prompt's samples contiguous.
    kind:
      grpo                (s - mean_g) / (std_g + 1e-6), std unbiased
      dr_grpo             s - mean_g                  (no std: no length/difficulty bias)
      rloo                s - mean of the other group_size - 1 samples
      reinforce_baseline  s - mean_g (the baselined score; :func:`reinforce_baseline_advantages`
                          adds the KL penalty, takes returns and whitens over the batch's tokens)
    Returns [B] float32; a group of equal scores gets 0 everywhere. Broadcast to tokens with
    ``adv[:, None] * action_mask``. ``scored`` ([B] bool, None: all): the samples that have a score; the others
    (an agent harness that returned None, failed or timed out) are left out of their group's statistics and get 0.
    """
    _check_kind("group_advantages", "kind", kind, GROUP_KINDS)
    if scores.dim() != 1:
        raise ValueError(f"group_advantages: scores must be [B], got shape {tuple(scores.shape)}")
    if not isinstance(group_size, int) or group_size < 2:
        raise ValueError(
            f"group_advantages: group_size must be an int >= 2 (samples per prompt), got {group_size!r}"
        )
    if scores.numel() % group_size:
        raise ValueError(
            f"group_advantages: group_size {group_size} does not divide the batch of {scores.numel()} scores; "
            "each prompt needs exactly group_size samples"
        )
    s = scores.float().view(-1, group_size)
    if scored is not None:
        return _scored_group_advantages(s, scored.bool().view(-1, group_size), kind).reshape(-1)
    mean = s.mean(dim=1, keepdim=True)
    if kind == "grpo":
        adv = (s - mean) / (s.std(dim=1, keepdim=True) + _GROUP_STD_EPS)
    elif kind == "dr_grpo":
        adv = s - mean
    elif kind == "rloo":
        adv = s - (s.sum(dim=1, keepdim=True) - s) / (group_size - 1)
    else:
        adv = s - mean
    return adv.reshape(-1)


def _scored_group_advantages(s: torch.Tensor, scored: torch.Tensor, kind: str) -> torch.Tensor:
    """:func:`group_advantages` over each group's scored samples only ([G, n] scores and mask); 0 elsewhere. A group
    with too few scored samples for its statistic (one for grpo's std or rloo's others, none for a mean) gets 0."""
    m = scored.float()
    k = m.sum(dim=1, keepdim=True)
    total = (s * m).sum(dim=1, keepdim=True)
    mean = total / k.clamp(min=1)
    if kind == "grpo":
        var = (((s - mean) * m) ** 2).sum(dim=1, keepdim=True) / (k - 1).clamp(min=1)
        adv = torch.where(k > 1, (s - mean) / (var.sqrt() + _GROUP_STD_EPS), torch.zeros_like(s))
    elif kind == "rloo":
        adv = torch.where(k > 1, s - (total - s) / (k - 1).clamp(min=1), torch.zeros_like(s))
    else:
        adv = s - mean
    return adv * m


def reinforce_baseline_advantages(
    scores: torch.Tensor,
    kl: torch.Tensor,
    action_mask: torch.Tensor,
    group_size: int,
    kl_coef: float,
    gamma: float = 1.0,
    score_clip: float | None = None,
    norm: str = "whiten",
) -> torch.Tensor:
    """REINFORCE++ with a group baseline, per token.

    scores: [B] (each prompt's ``group_size`` samples contiguous); kl, action_mask: [B, T].
    1. each score (clipped to ``[-score_clip, score_clip]`` when given) minus its group's mean;
    2. token rewards: that on the last action token, ``- kl_coef * kl`` on every action token;
    3. returns ``G_t = r_t + gamma * G_{t+1}``;
    4. whitened with the mean and (biased) variance over every action token of the batch (``norm``: see
       :func:`normalize_advantages`).
    Returns [B, T] float32, 0 where action_mask is 0.
    """
    clipped = _clip_scores("reinforce_baseline_advantages", scores, score_clip)
    baselined = group_advantages(clipped, group_size, "reinforce_baseline")
    rewards = shape_rewards(baselined, kl, action_mask, kl_coef)
    return normalize_advantages(discounted_returns(rewards, action_mask, gamma), action_mask, norm)


def distill_advantages(
    teacher_logp: torch.Tensor,
    logp: torch.Tensor,
    action_mask: torch.Tensor,
    coef: float = 1.0,
    base: torch.Tensor | None = None,
) -> torch.Tensor:
    """On-policy distillation's per-token advantage: ``coef * (teacher_logp - logp)`` on each action token, plus
    ``base`` (the reward estimator's advantages) where given.

    teacher_logp, logp: [B, T] the teacher's and the sampling policy's (old) log-probs of the sampled tokens;
    action_mask: [B, T]; base: [B, T] or None. ``logp - teacher_logp`` is the single-sample estimate of the reverse
    KL(policy || teacher) at that token, so each token's advantage is its own negative reverse KL: discount 0, no
    sum over the tokens after it (the teacher already judged each next token given everything before it).
    Returns [B, T] float32, 0 where action_mask is 0.
    """
    _check_2d("distill_advantages", "teacher_logp", teacher_logp)
    _check_same_shape("distill_advantages", teacher_logp=teacher_logp, logp=logp, action_mask=action_mask,
                      base=base)
    m = _as_bool_mask("distill_advantages", action_mask)
    advantages = coef * (teacher_logp.float() - logp.float())
    if base is not None:
        advantages = advantages + base.float()
    return torch.where(m, advantages, 0.0)


def _clip_scores(fn: str, scores: torch.Tensor, score_clip: float | None) -> torch.Tensor:
    if score_clip is None:
        return scores.float()
    if score_clip <= 0:
        raise ValueError(f"{fn}: score_clip must be > 0 or None, got {score_clip}")
    return scores.float().clamp(-score_clip, score_clip)


# ---- losses ------------------------------------------------------------------------------------------


def masked_aggregate(
    per_token: torch.Tensor,
    action_mask: torch.Tensor,
    aggregation: str = "token_mean",
    normalizer: float | None = None,
    token_budget: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss term to a scalar, as every loss term of a PPO step is reduced.

    per_token, action_mask: [B, T]. With N = ``normalizer`` (default: the action tokens for token_mean, the
    rows otherwise):
      token_mean               sum over action tokens / N
      seq_mean                 sum over rows of each row's token mean / N
      seq_mean_token_sum       sum over rows of each row's token sum / N                  (verl)
      seq_mean_token_sum_norm  the same / ``token_budget``, a constant (--rollout.max_new_tokens) (Dr.GRPO)
    With the normalizer of the whole optimizer step, micro-batches of any split add up to the same value.
    """
    fn = "masked_aggregate"
    _check_2d(fn, "per_token", per_token)
    _check_same_shape(fn, per_token=per_token, action_mask=action_mask)
    _check_normalizer(fn, normalizer)
    m = _as_bool_mask(fn, action_mask)
    _check_rows_nonempty(fn, m)
    return _aggregate(fn, per_token, m, aggregation, normalizer, token_budget)


def _aggregate(fn: str, per_token: torch.Tensor, m: torch.Tensor, aggregation: str, normalizer: float | None,
               token_budget: int | None = None):
    _check_kind(fn, "aggregation", aggregation, AGGREGATIONS)
    if aggregation == "seq_mean_token_sum_norm" and not (token_budget and token_budget > 0):
        raise ValueError(f"{fn}: seq_mean_token_sum_norm divides by a constant token budget; pass token_budget > 0 "
                         f"(the run's --rollout.max_new_tokens), got {token_budget}")
    per_token = torch.where(m, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    if aggregation == "token_mean":
        denom = m.sum() if normalizer is None else normalizer
        return per_token.sum() / denom
    per_seq = per_token.sum(dim=1)
    if aggregation == "seq_mean":
        per_seq = per_seq / m.sum(dim=1)
    elif aggregation == "seq_mean_token_sum_norm":
        per_seq = per_seq / token_budget
    denom = per_seq.numel() if normalizer is None else normalizer
    return per_seq.sum() / denom


def _check_normalizer(fn: str, normalizer: float | None) -> None:
    if normalizer is not None and not normalizer > 0:
        raise ValueError(f"{fn}: normalizer must be > 0 or None, got {normalizer}")


def log_importance_ratio(
    logp: torch.Tensor, old_logp: torch.Tensor, action_mask: torch.Tensor, level: str = "token"
) -> torch.Tensor:
    """log(pi_theta / pi_old) at every action token, [B, T] float32, 0 where masked out.

    logp: [B, T] current policy (carries the gradient); old_logp, action_mask: [B, T]. A token's log-ratio is
    clamped to +-20.
      token     log r_t = logp_t - old_logp_t
      sequence  GSPO's (Zheng et al. 2025, arXiv 2507.18071; the GSPO-token form): log s_i = the mean of
                log r_t over sequence i's own action tokens (row i of the response block: one sample's tokens,
                wherever packing or a shared prompt put them), standing at each of them as
                  log s_{i,t} = sg(log s_i) + logp_t - sg(logp_t)
                Its value is log s_i; the gradient of s_{i,t} is s_i * grad log pi_t, so the sequence's token mean
                of s_{i,t} * A_i has the gradient of s_i * A_i, GSPO's sequence objective.
    """
    fn = "log_importance_ratio"
    _check_2d(fn, "logp", logp)
    _check_same_shape(fn, logp=logp, old_logp=old_logp, action_mask=action_mask)
    _check_kind(fn, "level", level, RATIO_LEVELS)
    m = _as_bool_mask(fn, action_mask)
    _check_rows_nonempty(fn, m)
    return _log_ratio(logp, old_logp, m, level)[0]


def _token_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    return torch.where(m, logp.float() - old_logp.float(), zero).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)


def _sequence_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, 1]: each row's mean over its own action tokens (a row of the response block is one sample)."""
    return masked_mean(x, m, dim=1)[:, None]


def _log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, m: torch.Tensor,
               level: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the log-ratio at ``level``, the token log-ratio), both [B, T] and 0 where masked out."""
    token = _token_log_ratio(logp, old_logp, m)
    if level == "token":
        return token, token
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    live = logp.float() - logp.float().detach()
    return torch.where(m, _sequence_mean(token, m).detach() + live, zero), token


def _check_tis(fn: str, rollout_logp: torch.Tensor | None, tis_cap: float | None, tis_low: float | None,
               tis_mode: str) -> None:
    if (rollout_logp is None) != (tis_cap is None):
        raise ValueError(f"{fn}: rollout_logp and tis_cap go together; pass both for truncated IS or neither")
    if tis_cap is not None and tis_cap <= 0:
        raise ValueError(f"{fn}: tis_cap must be > 0, got {tis_cap}")
    if tis_low is not None and (tis_cap is None or not 0 <= tis_low < tis_cap):
        raise ValueError(f"{fn}: tis_low needs tis_cap and 0 <= tis_low < tis_cap, got {tis_low}, {tis_cap}")
    _check_kind(fn, "tis_mode", tis_mode, TIS_MODES)


def _check_surrogate_inputs(fn: str, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                            action_mask: torch.Tensor, rollout_logp: torch.Tensor | None) -> None:
    _check_2d(fn, "logp", logp)
    _check_same_shape(
        fn, logp=logp, old_logp=old_logp, advantages=advantages, action_mask=action_mask, rollout_logp=rollout_logp
    )


def _surrogate_mask(fn: str, action_mask: torch.Tensor, normalizer: float | None) -> torch.Tensor:
    _check_normalizer(fn, normalizer)
    m = _as_bool_mask(fn, action_mask)
    _check_rows_nonempty(fn, m)
    return m


def _finish_surrogate(
    fn: str, loss_tok: torch.Tensor, m: torch.Tensor, token_log_ratio: torch.Tensor, ratio: torch.Tensor,
    clipped: torch.Tensor, old_logp: torch.Tensor, rollout_logp: torch.Tensor | None, tis_cap: float | None,
    tis_low: float | None, tis_mode: str, aggregation: str, normalizer: float | None, token_budget: int | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """What every policy loss does after its per-token loss: the TIS weight, the reduction, the metrics."""
    metrics: dict[str, torch.Tensor] = {}
    if rollout_logp is not None:
        zero = torch.zeros((), dtype=torch.float32, device=loss_tok.device)
        is_log = torch.where(m, old_logp.float() - rollout_logp.float(), zero)
        is_log = is_log.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        raw = torch.exp(is_log).detach()
        if tis_mode == "truncate":
            weight = raw.clamp(min=tis_low, max=tis_cap)
        else:
            inside = (raw <= tis_cap) & (raw >= (tis_low if tis_low is not None else 0.0))
            weight = torch.where(inside, raw, zero)
            metrics["tis_masked_frac"] = masked_mean((~inside).float(), m).detach()
        loss_tok = loss_tok * weight
        metrics["tis_weight_mean"] = masked_mean(weight, m).detach()
    loss = _aggregate(fn, loss_tok, m, aggregation, normalizer, token_budget)
    with torch.no_grad():
        metrics["clip_frac"] = masked_mean(clipped.float(), m)
        metrics["ppo_kl"] = masked_mean(-token_log_ratio, m)
        metrics["ratio_mean"] = masked_mean(ratio, m)
    return loss, metrics


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    rollout_logp: torch.Tensor | None = None,
    tis_cap: float | None = None,
    aggregation: str = "token_mean",
    normalizer: float | None = None,
    tis_low: float | None = None,
    tis_mode: str = "truncate",
    token_budget: int | None = None,
    ratio_level: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped PPO surrogate, with clip-higher, dual clip and truncated importance sampling; on the sequence
    ratio, GSPO.

    logp: [B, T] current policy (carries the gradient); old_logp: [B, T] the policy that the
    advantages belong to (the trainer's recomputation at rollout time); advantages, action_mask: [B, T].
    ratio = exp(logp - old_logp) (log-ratio clamped to +-20), per token
      loss = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
    ratio_level sequence: ratio is the sequence's, s_i (:func:`log_importance_ratio`), and the loss GSPO's
    (Zheng et al. 2025, arXiv 2507.18071: -min(s_i A, clip(s_i, 1 - clip_low, 1 + clip_high) A), a sequence
    mean with aggregation seq_mean; its clip range is 3e-4 / 4e-4, not 0.2).
    dual_clip = c > 1: for A < 0 the loss is also capped at -c * A (Ye et al. 2020).
    rollout_logp + tis_cap: multiply each token's loss by w = exp(old_logp - rollout_logp), detached, to
    correct for the engine sampling from slightly different numerics (or older weights) than the trainer:
    tis_mode truncate uses clamp(w, tis_low, tis_cap); tis_mode mask uses w inside [tis_low, tis_cap] and 0
    outside (ICEPOP); tis_low None is no lower bound.
    aggregation: "token_mean" (sum over tokens / number of action tokens) or "seq_mean" (mean over
    rows of each row's token mean). normalizer overrides the denominator (action tokens or rows)
    so that micro-batches of one optimizer step add up to one exact mean.
    Returns (loss scalar, metrics of detached scalars: clip_frac, dual_clip_frac, ppo_kl, ratio_mean,
    and tis_weight_mean when TIS is on).
    """
    fn = "policy_loss"
    _check_surrogate_inputs(fn, logp, old_logp, advantages, action_mask, rollout_logp)
    _check_ppo_clip(fn, clip_low, clip_high, dual_clip)
    _check_tis(fn, rollout_logp, tis_cap, tis_low, tis_mode)
    _check_kind(fn, "ratio_level", ratio_level, RATIO_LEVELS)
    m = _surrogate_mask(fn, action_mask, normalizer)

    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    log_ratio, token_log_ratio = _log_ratio(logp, old_logp, m, ratio_level)
    ratio = torch.exp(log_ratio)
    loss_tok, clipped, dual_active = _ppo_token_loss(ratio, torch.where(m, advantages.float(), zero), clip_low,
                                                     clip_high, dual_clip)
    loss, metrics = _finish_surrogate(fn, loss_tok, m, token_log_ratio, ratio, clipped, old_logp, rollout_logp,
                                      tis_cap, tis_low, tis_mode, aggregation, normalizer, token_budget)
    metrics["dual_clip_frac"] = masked_mean(dual_active.float(), m).detach()
    return loss, metrics


def _check_ppo_clip(fn: str, clip_low: float, clip_high: float, dual_clip: float | None) -> None:
    if clip_low < 0 or clip_low >= 1 or clip_high < 0:
        raise ValueError(
            f"{fn}: need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={clip_low}, clip_high={clip_high}"
        )
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"{fn}: dual_clip must be > 1 (or None), got {dual_clip}")


def _ppo_token_loss(ratio: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float,
                    dual_clip: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token: (loss [B, T], clipped [B, T] bool, dual-clip active [B, T] bool)."""
    surr1 = ratio * adv
    surr2 = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    loss_tok = -torch.minimum(surr1, surr2)
    dual_active = torch.zeros_like(adv, dtype=torch.bool)
    if dual_clip is not None:
        cap = -dual_clip * adv
        dual_active = (adv < 0) & (loss_tok > cap)
        loss_tok = torch.where(dual_active, cap, loss_tok)
    return loss_tok, surr2 < surr1, dual_active


def decoupled_policy_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    behav_weight_cap: float | None = None,
    aggregation: str = "token_mean",
    normalizer: float | None = None,
    token_budget: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AReaL's decoupled PPO objective (Fu et al. 2025, arXiv 2505.24298) for samples of older weights, per token
      r = pi_theta / pi_prox                      the trust region is taken around the proximal policy
      w = pi_prox / pi_behav   (detached)         the behaviour policy's importance weight
      loss = -w * min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)    (dual clip on the min as in policy_loss)
    pi_behav is the policy that sampled the token: the engine's log-probs recorded at generation (a token of a partial
    rollout carries the weights that sampled it); pi_prox is the trainer's recompute of the old log-probs at the start
    of the step (the weights about to be trained). The clip then bounds one update's move from recent weights however
    stale the samples, and w corrects for where they came from. behav_weight_cap c: tokens with w > c count 0 in the
    loss (AReaL's ``behav_imp_weight_cap``); None: w unbounded. With pi_behav = pi_prox, w = 1 and this is
    :func:`policy_loss` exactly.

    logp: [B, T] the current policy (carries the gradient); prox_logp, behav_logp, advantages, action_mask: [B, T].
    Aggregation and normalizer as in :func:`policy_loss` (the masked tokens stay in the normaliser, as AReaL's).
    Returns (loss, metrics: clip_frac, dual_clip_frac, ppo_kl, ratio_mean (all against pi_prox), behav_weight_mean
    (of the weights applied), behav_kl (mean log pi_prox - log pi_behav), behav_masked_frac (tokens over the cap)).
    """
    fn = "decoupled_policy_loss"
    _check_2d(fn, "logp", logp)
    _check_same_shape(fn, logp=logp, prox_logp=prox_logp, behav_logp=behav_logp, advantages=advantages,
                      action_mask=action_mask)
    _check_ppo_clip(fn, clip_low, clip_high, dual_clip)
    if behav_weight_cap is not None and behav_weight_cap <= 0:
        raise ValueError(f"{fn}: behav_weight_cap must be > 0 (or None), got {behav_weight_cap}")
    m = _surrogate_mask(fn, action_mask, normalizer)

    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    token_log_ratio = _token_log_ratio(logp, prox_logp, m)
    ratio = torch.exp(token_log_ratio)
    loss_tok, clipped, dual_active = _ppo_token_loss(ratio, torch.where(m, advantages.float(), zero), clip_low,
                                                     clip_high, dual_clip)
    behav_log = _token_log_ratio(prox_logp.detach(), behav_logp, m)
    weight = torch.exp(behav_log)
    kept = m if behav_weight_cap is None else m & (weight <= behav_weight_cap)
    weight = torch.where(kept, weight, zero)
    loss = _aggregate(fn, loss_tok * weight, m, aggregation, normalizer, token_budget)
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean(clipped.float(), m),
            "dual_clip_frac": masked_mean(dual_active.float(), m),
            "ppo_kl": masked_mean(-token_log_ratio, m),
            "ratio_mean": masked_mean(ratio, m),
            "behav_weight_mean": masked_mean(weight, m),
            "behav_kl": masked_mean(behav_log, m),
            "behav_masked_frac": masked_mean((m & ~kept).float(), m),
        }
    return loss, metrics


def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    clip_low: float = LOSS_CLIP_DEFAULTS["cispo"][0],
    clip_high: float = LOSS_CLIP_DEFAULTS["cispo"][1],
    *,
    ratio_level: str = "token",
    rollout_logp: torch.Tensor | None = None,
    tis_cap: float | None = None,
    tis_low: float | None = None,
    tis_mode: str = "truncate",
    aggregation: str = "token_mean",
    normalizer: float | None = None,
    token_budget: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): the clip moves from the update onto its weight, per token
      loss = -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log pi_theta
    so every token keeps a gradient, -w * A * grad log pi with w the clipped ratio (PPO's clip zeroes it outside
    the trust region, and with it the rare "fork" tokens); only the weight is bounded. clip_low 1 (the default)
    puts no lower bound on it; clip_high 5 bounds it at 6. r is the token's ratio, or with ratio_level sequence
    its sequence's (:func:`log_importance_ratio`). Tensors, TIS and aggregation as in :func:`policy_loss`.
    Returns (loss, metrics: clip_frac (tokens whose weight was clipped), ppo_kl, ratio_mean, and TIS's).
    """
    fn = "cispo_loss"
    _check_surrogate_inputs(fn, logp, old_logp, advantages, action_mask, rollout_logp)
    if not 0 <= clip_low <= 1 or clip_high < 0:
        raise ValueError(f"{fn}: need 0 <= clip_low <= 1 (1: no lower bound) and clip_high >= 0, got "
                         f"clip_low={clip_low}, clip_high={clip_high}")
    _check_tis(fn, rollout_logp, tis_cap, tis_low, tis_mode)
    _check_kind(fn, "ratio_level", ratio_level, RATIO_LEVELS)
    m = _surrogate_mask(fn, action_mask, normalizer)

    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    log_ratio, token_log_ratio = _log_ratio(logp, old_logp, m, ratio_level)
    ratio = torch.exp(log_ratio).detach()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    adv = torch.where(m, advantages.float(), zero)
    loss_tok = -weight * adv * torch.where(m, logp.float(), zero)
    return _finish_surrogate(fn, loss_tok, m, token_log_ratio, ratio, weight != ratio, old_logp, rollout_logp,
                             tis_cap, tis_low, tis_mode, aggregation, normalizer, token_budget)


def sapo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    tau_pos: float = SAPO_TAU_POS,
    tau_neg: float = SAPO_TAU_NEG,
    *,
    ratio_level: str = "token",
    rollout_logp: torch.Tensor | None = None,
    tis_cap: float | None = None,
    tis_low: float | None = None,
    tis_mode: str = "truncate",
    aggregation: str = "token_mean",
    normalizer: float | None = None,
    token_budget: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (arXiv 2511.20347): a soft gate instead of PPO's hard clip, per token
      loss = -f(r) * A,   f(r) = sigmoid(tau * (r - 1)) * 4 / tau,   tau = tau_pos where A > 0, else tau_neg
    The gate's slope df/dr = 4 sigmoid (1 - sigmoid) is 1 on policy (r = 1: PPO's gradient there) and fades
    smoothly as r leaves 1, the faster the larger tau; nothing is cut off, so clip_frac is 0. r is the token's
    ratio, or with ratio_level sequence its sequence's (:func:`log_importance_ratio`). Tensors, TIS and
    aggregation as in :func:`policy_loss`. Returns (loss, metrics: clip_frac, ppo_kl, ratio_mean, and TIS's).
    """
    fn = "sapo_loss"
    _check_surrogate_inputs(fn, logp, old_logp, advantages, action_mask, rollout_logp)
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"{fn}: the gate's temperatures must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
    _check_tis(fn, rollout_logp, tis_cap, tis_low, tis_mode)
    _check_kind(fn, "ratio_level", ratio_level, RATIO_LEVELS)
    m = _surrogate_mask(fn, action_mask, normalizer)

    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    log_ratio, token_log_ratio = _log_ratio(logp, old_logp, m, ratio_level)
    ratio = torch.exp(log_ratio)
    adv = torch.where(m, advantages.float(), zero)
    tau = torch.where(adv > 0, tau_pos, tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    return _finish_surrogate(fn, -gate * adv, m, token_log_ratio, ratio, torch.zeros_like(m), old_logp, rollout_logp,
                             tis_cap, tis_low, tis_mode, aggregation, normalizer, token_budget)


def gmpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    clip_low: float = LOSS_CLIP_DEFAULTS["gmpo"][0],
    clip_high: float = LOSS_CLIP_DEFAULTS["gmpo"][1],
    *,
    rollout_logp: torch.Tensor | None = None,
    tis_cap: float | None = None,
    tis_low: float | None = None,
    tis_mode: str = "truncate",
    aggregation: str = "token_mean",
    normalizer: float | None = None,
    token_budget: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO (Zhao et al. 2025, arXiv 2507.20673): the geometric mean of each sequence's token ratios, each
    clipped in log space on the side that the sign of the sequence's advantage makes pessimistic:
      A_i    = the mean advantage over sequence i's action tokens (GMPO takes one advantage per sequence)
      l_t    = sgn(A_i) * min(sgn(A_i) * log r_t, sgn(A_i) * clip(log r_t, -clip_low, clip_high))
      R_i    = exp(mean of l_t over sequence i's own action tokens)
      loss_i = -A_i * R_i
    For A > 0 log r is capped at clip_high, for A < 0 floored at -clip_low (the paper's range (e^-0.4, e^0.4));
    a clipped token has no gradient. loss_i stands at each of the sequence's tokens, so aggregation seq_mean is the
    sequences' mean, the paper's (token_mean weighs each sequence by its length); a TIS weight is per token.
    Tensors and TIS as in :func:`policy_loss`. Returns (loss, metrics: clip_frac (tokens whose log-ratio was
    clipped), ppo_kl, ratio_mean (of R_i, over tokens), and TIS's).
    """
    fn = "gmpo_loss"
    _check_surrogate_inputs(fn, logp, old_logp, advantages, action_mask, rollout_logp)
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"{fn}: the log-space bounds must be >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    _check_tis(fn, rollout_logp, tis_cap, tis_low, tis_mode)
    m = _surrogate_mask(fn, action_mask, normalizer)

    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    token_log_ratio = _token_log_ratio(logp, old_logp, m)
    adv = _sequence_mean(torch.where(m, advantages.float(), zero), m)
    sign = torch.sign(adv)
    clipped_log = token_log_ratio.clamp(-clip_low, clip_high)
    pessimistic = sign * torch.minimum(sign * token_log_ratio, sign * clipped_log)
    ratio = torch.exp(_sequence_mean(pessimistic, m)).expand_as(token_log_ratio)
    loss_tok = -adv * ratio
    clipped = (pessimistic != token_log_ratio) & (sign != 0)  # a zero advantage has no side to clip on
    return _finish_surrogate(fn, loss_tok, m, token_log_ratio, ratio, clipped, old_logp,
                             rollout_logp, tis_cap, tis_low, tis_mode, aggregation, normalizer, token_budget)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    action_mask: torch.Tensor,
    clip: float | None = None,
    aggregation: str = "token_mean",
    normalizer: float | None = None,
    token_budget: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Critic loss ``0.5 * max((v - R)^2, (v_clip - R)^2)`` with
    ``v_clip = old_values + clamp(v - old_values, -clip, clip)`` (clip=None: plain 0.5 * (v - R)^2).

    values: [B, T] current critic (carries the gradient); old_values, returns, action_mask: [B, T].
    aggregation / normalizer as in :func:`policy_loss`. Returns (loss, metrics: clip_frac, value_mean).
    """
    fn = "value_loss"
    _check_2d(fn, "values", values)
    _check_same_shape(fn, values=values, old_values=old_values, returns=returns, action_mask=action_mask)
    if clip is not None and clip <= 0:
        raise ValueError(f"{fn}: clip must be > 0 or None, got {clip}")
    _check_normalizer(fn, normalizer)
    m = _as_bool_mask(fn, action_mask)
    _check_rows_nonempty(fn, m)
    zero = torch.zeros((), dtype=torch.float32, device=values.device)
    v = torch.where(m, values.float(), zero)
    old = torch.where(m, old_values.float(), zero)
    ret = torch.where(m, returns.float(), zero)
    unclipped = (v - ret).square()
    if clip is None:
        loss_tok = 0.5 * unclipped
        clipped_active = torch.zeros_like(m)
    else:
        v_clip = old + (v - old).clamp(-clip, clip)
        clipped = (v_clip - ret).square()
        loss_tok = 0.5 * torch.maximum(unclipped, clipped)
        clipped_active = clipped > unclipped
    loss = _aggregate(fn, loss_tok, m, aggregation, normalizer, token_budget)
    with torch.no_grad():
        metrics = {"clip_frac": masked_mean(clipped_active.float(), m), "value_mean": masked_mean(v, m)}
    return loss, metrics


@dataclass(frozen=True)
class ActorLossConfig:
    """What the actor's micro-batch loss needs besides tensors (see :func:`actor_loss`).

    kl_coef is the coefficient of the KL term *in the loss* (0 when the KL penalty goes into the rewards).
    """

    #: the surrogate (:data:`POLICY_LOSSES`) and its ratio level (None: the loss's own, :data:`LOSS_RATIO_LEVELS`)
    policy_loss: str = "ppo"
    ratio_level: str | None = None
    #: None: the loss's own (:data:`LOSS_CLIP_DEFAULTS`); sapo has no clip, its gate's temperatures are sapo_tau_*
    clip_low: float | None = None
    clip_high: float | None = None
    dual_clip: float | None = None
    sapo_tau_pos: float = SAPO_TAU_POS
    sapo_tau_neg: float = SAPO_TAU_NEG
    tis_cap: float | None = None
    tis_low: float | None = None
    tis_mode: str = "truncate"
    #: PPO's loss decoupled (:func:`decoupled_policy_loss`): old_logp is the proximal policy, rollout_logp the
    #: behaviour policy; tokens whose weight pi_prox / pi_behav exceeds decoupled_weight_cap count 0 (None: no cap)
    decoupled: bool = False
    decoupled_weight_cap: float | None = None
    aggregation: str = "token_mean"
    #: the constant divisor of seq_mean_token_sum_norm (--rollout.max_new_tokens)
    token_budget: int | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    #: the KL term's gradient is k2's, importance-weighted (:func:`approx_kl_straight_through`)
    kl_straight_through: bool = False
    entropy_coef: float = 0.0


def actor_loss(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    cfg: ActorLossConfig,
    normalizer: float,
    rollout_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's share of the actor loss: the surrogate ``cfg.policy_loss`` (PPO's clip, GSPO, CISPO, SAPO
    or GMPO: :func:`policy_loss`, :func:`cispo_loss`, :func:`sapo_loss`, :func:`gmpo_loss`; with ``cfg.decoupled``,
    :func:`decoupled_policy_loss` against old_logp as the proximal and rollout_logp as the behaviour policy), plus
    ``kl_coef`` x KL(policy || ref), minus ``entropy_coef`` x entropy, every term reduced by :func:`masked_aggregate`
    with the step's ``normalizer``, so that the micro-batches of one optimizer step add up to the same loss (and
    gradient) whatever the split.

    logp, entropy: [B, T] of the current policy (carry the gradient); old_logp, advantages, action_mask,
    rollout_logp (needed with tis_cap), ref_logp (needed with kl_coef > 0): [B, T].
    Returns (loss, metrics: per-token means of this micro-batch, detached).
    """
    fn = "actor_loss"
    if cfg.kl_coef > 0 and ref_logp is None:
        raise ValueError(f"{fn}: kl_coef > 0 puts a KL term in the loss; pass ref_logp")
    m = _as_bool_mask(fn, action_mask)
    loss, metrics = _surrogate(logp, old_logp, advantages, m, cfg, normalizer, rollout_logp)
    if cfg.kl_coef > 0:
        if cfg.kl_straight_through:
            kl = approx_kl_straight_through(logp, ref_logp, cfg.kl_estimator, old_logp)
        else:
            kl = approx_kl(logp, ref_logp, cfg.kl_estimator)
        loss = loss + cfg.kl_coef * masked_aggregate(kl, m, cfg.aggregation, normalizer, cfg.token_budget)
        metrics["kl_loss"] = masked_mean(kl.detach(), m)
    if cfg.entropy_coef > 0:
        loss = loss - cfg.entropy_coef * masked_aggregate(entropy, m, cfg.aggregation, normalizer, cfg.token_budget)
    metrics["entropy"] = masked_mean(entropy.detach(), m)
    return loss, metrics


def _surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, m: torch.Tensor,
               cfg: ActorLossConfig, normalizer: float,
               rollout_logp: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss that ``cfg`` names, with its own ratio level and clip range where ``cfg`` leaves them None."""
    fn = "actor_loss"
    kind = cfg.policy_loss
    _check_kind(fn, "policy_loss", kind, POLICY_LOSSES)
    level = cfg.ratio_level or LOSS_RATIO_LEVELS[kind][0]
    if level not in LOSS_RATIO_LEVELS[kind]:
        raise ValueError(f"{fn}: policy_loss {kind!r} takes ratio_level {list(LOSS_RATIO_LEVELS[kind])}, "
                         f"got {level!r}")
    if cfg.dual_clip is not None and kind != "ppo":
        raise ValueError(f"{fn}: dual_clip caps PPO's token loss; policy_loss {kind!r} has none")
    if kind == "sapo" and (cfg.clip_low, cfg.clip_high) != (None, None):
        raise ValueError(f"{fn}: policy_loss 'sapo' has no clip (its gate's temperatures are sapo_tau_pos and "
                         f"sapo_tau_neg); got clip_low={cfg.clip_low}, clip_high={cfg.clip_high}")
    low, high = LOSS_CLIP_DEFAULTS.get(kind, (None, None))
    low = low if cfg.clip_low is None else cfg.clip_low
    high = high if cfg.clip_high is None else cfg.clip_high
    if cfg.decoupled:
        if kind != "ppo" or cfg.tis_cap is not None or rollout_logp is None:
            raise ValueError(f"{fn}: the decoupled loss is PPO's (policy_loss 'ppo', got {kind!r}), weighs by the "
                             f"behaviour policy itself (tis_cap must be None, got {cfg.tis_cap}) and needs the "
                             f"engine's log-probs (rollout_logp {'missing' if rollout_logp is None else 'given'})")
        return decoupled_policy_loss(logp, old_logp, rollout_logp, advantages, m, low, high, cfg.dual_clip,
                                     cfg.decoupled_weight_cap, cfg.aggregation, normalizer, cfg.token_budget)
    common = dict(rollout_logp=rollout_logp if cfg.tis_cap is not None else None, tis_cap=cfg.tis_cap,
                  tis_low=cfg.tis_low, tis_mode=cfg.tis_mode, aggregation=cfg.aggregation, normalizer=normalizer,
                  token_budget=cfg.token_budget)
    if kind in ("ppo", "gspo"):
        return policy_loss(logp, old_logp, advantages, m, low, high, cfg.dual_clip, ratio_level=level, **common)
    if kind == "cispo":
        return cispo_loss(logp, old_logp, advantages, m, low, high, ratio_level=level, **common)
    if kind == "sapo":
        return sapo_loss(logp, old_logp, advantages, m, cfg.sapo_tau_pos, cfg.sapo_tau_neg, ratio_level=level,
                         **common)
    return gmpo_loss(logp, old_logp, advantages, m, low, high, **common)


# ---- KL coefficient controllers ------------------------------------------------------------------------


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Proportional control of the KL coefficient toward ``target`` (Ziegler et al. 2019):
    ``value *= 1 + clip(current / target - 1, -0.2, 0.2) * n_steps / horizon``."""

    def __init__(self, kl_coef: float, target: float, horizon: int):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"AdaptiveKLController: target and horizon must be > 0, got {target}, {horizon}")
        self.value = float(kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
