"""What the trainer and the model workers pass each other: the step's experience and its update plan.

An :class:`Experience` is one step's rollout batch, filled in as the step goes: the engines' samples
(:func:`build_rollout_batch`), then the reward's ``scores``, the scoring forwards (``ref_logp``,
``teacher_logp``, ``values``, ``old_logp``, ``kl``) and the ``advantages`` / ``returns``. It travels to the workers
once per phase through Ray's object store; each rank takes the rows of its micro-batches with
:meth:`Experience.rows` and moves them to its device.

An :class:`OptimizerStep` is one rank's share of one optimizer step: its micro-batches (global row
indices) and the step's loss normaliser, the same on every rank. :class:`ActorUpdate` and
:class:`CriticUpdate` are the frozen settings of one step's updates.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rlhf_sg.algorithms import ActorLossConfig

__all__ = ["ActorUpdate", "CriticUpdate", "Experience", "OptimizerStep", "build_rollout_batch"]


@dataclass
class Experience:
    """One step's samples. ``B`` samples; ``P + T`` columns: left-padded prompts, right-padded responses.

    Per-token fields are ``[B, T]`` over the response block (column ``j``: the ``j``-th generated token),
    0 where ``action_mask`` is False; a field is ``None`` until the phase that makes it has run.
    """

    sequences: torch.Tensor  #: [B, P + T] int64, prompt and response token ids
    attention_mask: torch.Tensor  #: [B, P + T] int64, 1 on real tokens
    action_mask: torch.Tensor  #: [B, T] bool, the tokens the policy chose
    rollout_logp: torch.Tensor  #: [B, T] float32, the engine's log-probs of them
    weight_version: torch.Tensor | None = None  #: [B] int64, the engine weights that sampled each completion
    #: [B, T] int64, the engine weights that sampled each token (several in a sample continued after a weight sync
    #: or with turns on either side of one; rlhf_sg.offpolicy.versions)
    token_versions: torch.Tensor | None = None
    #: [B] bool, the engine stopped the completion at --rollout.max_new_tokens (finish reason "length")
    truncated: torch.Tensor | None = None
    #: [B] bool, the rows whose tokens count in the actor's and critic's losses and their normaliser (None: all);
    #: the others still run through every forward (--train.mask_truncated, dynamic sampling's filler groups)
    loss_rows: torch.Tensor | None = None
    #: [B, P + T, moe_layers, top_k] int16, the experts the engine routed each token to (--train.routing_replay),
    #: aligned with ``sequences``; -1 where none (padding, each sample's last token)
    routes: torch.Tensor | None = None
    #: [B] a vision-language policy's prompt images: each row's :class:`rlhf_sg.vision.ImageInputs` (None: a text
    #: row); the samples of one prompt share one object, so the vision tower runs once for them
    images: list | None = None
    scores: torch.Tensor | None = None  #: [B] float32, the reward of each completion
    #: [B] bool, the rows with a reward (None: all); the others (--agent.harness runs that returned None, failed or
    #: timed out) are out of their group's baseline and, through ``loss_rows``, out of the losses
    scored: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None  #: [B, T] reference model log-probs
    teacher_logp: torch.Tensor | None = None  #: [B, T] the distillation teacher's log-probs (--distill.teacher)
    values: torch.Tensor | None = None  #: [B, T] critic values before the update
    old_logp: torch.Tensor | None = None  #: [B, T] the actor's log-probs before the update (its own forward)
    kl: torch.Tensor | None = None  #: [B, T] KL(sampling policy || reference) estimate per token
    advantages: torch.Tensor | None = None  #: [B, T]
    returns: torch.Tensor | None = None  #: [B, T] value targets (with a critic)

    @property
    def batch_size(self) -> int:
        return self.sequences.shape[0]

    @property
    def response_width(self) -> int:
        return self.action_mask.shape[1]

    def rows(self, index: list[int]) -> Experience:
        """The samples at ``index`` (global row indices, in that order), every field that is set."""
        idx = torch.as_tensor(index, dtype=torch.long)
        return dataclasses.replace(self, **{
            f.name: [value[i] for i in index] if isinstance(value, list)
            else value.index_select(0, idx.to(value.device))
            for f in dataclasses.fields(self) if (value := getattr(self, f.name)) is not None
        })

    def to(self, device: torch.device | str) -> Experience:
        """Every set field on ``device`` (a no-op for fields already there); rows that shared one prompt's images
        still share them."""
        return dataclasses.replace(self, **{
            f.name: _list_to(value, device) if isinstance(value, list) else value.to(device)
            for f in dataclasses.fields(self) if (value := getattr(self, f.name)) is not None
        })

    def require(self, *names: str, why: str) -> None:
        """Raise naming the missing fields when any of ``names`` is not set yet."""
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(f"experience: {', '.join(missing)} not set; {why}")


def _list_to(items: list, device) -> list:
    """Per-row objects (images) on ``device``, each distinct object moved once."""
    moved: dict[int, object] = {}
    for item in items:
        if item is not None and id(item) not in moved:
            moved[id(item)] = item.to(device)
    return [None if item is None else moved[id(item)] for item in items]


@dataclass(frozen=True)
class OptimizerStep:
    """One rank's part of one optimizer step.

    plan: this rank's micro-batches, each a list of global row indices (every rank gets the same number,
    as ZeRO-3's forwards are collective); normalizer: the step's action tokens (or rows, for a
    ``seq_mean`` loss) over all ranks divided by the world size, so micro-batch losses add up to the
    step's mean whatever the split."""

    plan: list[list[int]]
    normalizer: float


@dataclass(frozen=True)
class ActorUpdate:
    """The settings of one step's policy updates.

    loss: the surrogate's clip, TIS, aggregation, and the KL / entropy terms in the loss; temperature: the
    sampling temperature, which the log-probs are computed at; old_logp_from_update: the batch gets a single
    update on fresh samples, so the policy that sampled is the one being trained and the old log-probs are the
    update's own forward (detached) instead of :attr:`Experience.old_logp` (which is then not computed);
    share_prompts: rows with one prompt compute it once (:func:`rlhf_sg.packing.pack_shared_prompts`);
    router_aux_loss_coef: the MoE router loss's coefficient (None: the model's own default; see
    :func:`rlhf_sg.workers.router_aux_loss_coef`)."""

    loss: ActorLossConfig
    temperature: float = 1.0
    old_logp_from_update: bool = False
    share_prompts: bool = False
    router_aux_loss_coef: float | None = None


@dataclass(frozen=True)
class CriticUpdate:
    """The settings of one step's value updates: ``value_clip`` (None: no clipping); ``share_prompts`` as in
    :class:`ActorUpdate`."""

    value_clip: float | None = None
    share_prompts: bool = False


def build_rollout_batch(
    prompts: list[list[int]],
    responses: list[list[int]],
    rollout_logps: list[list[float]],
    pad_id: int,
    weight_versions: list[int] | None = None,
    finish_reasons: list[str] | None = None,
    action_masks: list[list[bool]] | None = None,
    routed_experts: list[torch.Tensor] | None = None,
    token_versions: list[list[int]] | None = None,
) -> Experience:
    """The engines' samples as an :class:`Experience`: left-padded prompts and right-padded responses.

    prompts[i], responses[i], rollout_logps[i]: sample i's prompt ids, completion ids and the engine's
    log-prob of each completion token; weight_versions[i]: the engine weights that sampled it;
    finish_reasons[i]: why the engine stopped it ("length" marks it ``truncated``); action_masks[i]: for
    multi-turn samples, 1 on the tokens the engine sampled and 0 on the observations between them
    (None: every response token was sampled). Observation tokens are real tokens (attention mask 1) with
    rollout log-prob 0. routed_experts[i]: the engine's routes of sample i's prompt and completion tokens but the
    last (``Completion.routed_experts``), laid into ``routes``. token_versions[i]: the weights that sampled each
    token of responses[i] (observation tokens: those of the turn before), laid into ``token_versions``.
    """
    B = len(prompts)
    P = max(len(p) for p in prompts)
    T = max(len(r) for r in responses)
    sequences = torch.full((B, P + T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + T), dtype=torch.long)
    action_mask = torch.zeros((B, T), dtype=torch.bool)
    rollout_logp = torch.zeros((B, T), dtype=torch.float32)
    for i, (p, r, lp) in enumerate(zip(prompts, responses, rollout_logps)):
        if not r:
            raise ValueError(f"rollout sample {i}: the engine returned an empty completion")
        sequences[i, P - len(p) : P] = torch.as_tensor(p)
        sequences[i, P : P + len(r)] = torch.as_tensor(r)
        attention_mask[i, P - len(p) : P + len(r)] = 1
        if action_masks is None:
            action_mask[i, : len(r)] = True
        else:
            if len(action_masks[i]) != len(r) or not any(action_masks[i]):
                raise ValueError(f"rollout sample {i}: its action mask has {len(action_masks[i])} entries "
                                 f"({sum(map(bool, action_masks[i]))} set) for {len(r)} tokens; it needs one per "
                                 "token and at least one sampled token")
            action_mask[i, : len(r)] = torch.as_tensor(action_masks[i], dtype=torch.bool)
        rollout_logp[i, : len(r)] = torch.as_tensor(lp, dtype=torch.float32)
    versions = None
    if token_versions is not None:
        versions = torch.zeros((B, T), dtype=torch.long)
        for i, (r, v) in enumerate(zip(responses, token_versions)):
            if len(v) != len(r):
                raise ValueError(f"rollout sample {i}: {len(v)} token weight versions for {len(r)} tokens")
            versions[i, : len(r)] = torch.as_tensor(v, dtype=torch.long)
    routes = None
    if routed_experts is not None:
        missing = [i for i, e in enumerate(routed_experts) if e is None]
        if missing:
            raise ValueError(f"rollout sample {missing[0]}: the engine returned no routed experts (routing replay "
                             "needs them for every sample; is the backend's supports_routed_experts true?)")
        shapes = {tuple(e.shape[1:]) for e in routed_experts}
        if len(shapes) != 1:
            raise ValueError(f"rollout samples: routed experts of several shapes {sorted(shapes)}; the engine must "
                             "return [tokens, moe_layers, top_k] of one model")
        routes = torch.full((B, P + T, *shapes.pop()), -1, dtype=torch.int16)
        for i, (p, r, e) in enumerate(zip(prompts, responses, routed_experts)):
            if e.shape[0] != len(p) + len(r) - 1:
                raise ValueError(f"rollout sample {i}: the engine returned routes for {e.shape[0]} tokens, where its "
                                 f"prompt and completion ({len(p)} + {len(r)} tokens) need {len(p) + len(r) - 1} "
                                 "(every token but the last)")
            routes[i, P - len(p) : P + len(r) - 1] = e.to(torch.int16)
    return Experience(
        sequences=sequences, attention_mask=attention_mask, action_mask=action_mask, rollout_logp=rollout_logp,
        weight_version=None if weight_versions is None else torch.as_tensor(weight_versions, dtype=torch.long),
        truncated=None if finish_reasons is None else torch.tensor([f == "length" for f in finish_reasons]),
        routes=routes, token_versions=versions,
    )
