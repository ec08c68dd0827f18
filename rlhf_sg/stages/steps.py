"""What a stage's ranks run: the batch they are given, the optimizer steps' plans, one micro-batch's loss per stage,
the update loop and the scoring forwards. Used alike by the in-process rank and the Ray ZeRO-3 ranks
(:mod:`rlhf_sg.stages.ranks`); every forward goes through :mod:`rlhf_sg.packing` (padding removed, positions
restarting per sequence, attention kept inside each)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from rlhf_sg.experience import OptimizerStep, build_rollout_batch
from rlhf_sg.packing import response_logprobs, reward_scores, token_budget_microbatches
from rlhf_sg.stages import losses
from rlhf_sg.stages.data import StageRows


@dataclass
class StageBatch:
    """Rendered rows in the rollout layout the packing functions take: a left-padded prompt block (the tokens
    before each row's first trained token) and a right-padded response block of width T.

    sequences, attention_mask: [B, P + T] int64; loss_mask: [B, T] bool, the trained tokens (assistant turns);
    read_index: [B] int64, the column of each row's last trained token (where a reward model reads);
    truncated: [B] bool; margin: [B] float32, a pair's margin on both its rows (None: none); ref_logp: [B] float32,
    the reference's summed log-prob of each row's trained tokens (DPO; None until computed). Pairs are rows
    ``2i`` (chosen) and ``2i + 1`` (rejected)."""

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    read_index: torch.Tensor
    truncated: torch.Tensor
    margin: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.sequences.shape[0]

    @property
    def response_width(self) -> int:
        return self.loss_mask.shape[1]

    @property
    def action_mask(self) -> torch.Tensor:
        """The trained tokens under the name the workers' forwards read."""
        return self.loss_mask

    def rows(self, index: list[int]) -> StageBatch:
        idx = torch.as_tensor(index, dtype=torch.long)
        fields = [(f.name, v) for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None]
        return dataclasses.replace(self, **{name: v.index_select(0, idx.to(v.device)) for name, v in fields})

    def to(self, device) -> StageBatch:
        return dataclasses.replace(self, **{f.name: v.to(device) for f in dataclasses.fields(self)
                                            if (v := getattr(self, f.name)) is not None})


def make_batch(data: StageRows, pad_id: int) -> StageBatch:
    """``data``'s rows as a :class:`StageBatch` (built by :func:`rlhf_sg.experience.build_rollout_batch`, as the
    engines' samples are: the prompt block ends where the first trained token starts)."""
    prompts = [r.ids[: r.prompt_len] for r in data.rows]
    responses = [r.ids[r.prompt_len :] for r in data.rows]
    masks = [r.loss_mask[r.prompt_len :] for r in data.rows]
    exp = build_rollout_batch(prompts, responses, [[0.0] * len(x) for x in responses], pad_id, action_masks=masks)
    width = exp.sequences.shape[1] - exp.action_mask.shape[1]
    last = exp.action_mask.shape[1] - 1 - exp.action_mask.flip(1).int().argmax(dim=1)
    margin = None
    if data.margins is not None:
        margin = torch.tensor(data.margins, dtype=torch.float32).repeat_interleave(2)
    return StageBatch(exp.sequences, exp.attention_mask, exp.action_mask, width + last,
                      torch.tensor([r.truncated for r in data.rows]), margin)


def step_plans(batch: StageBatch, units: list[int], pairs: bool, max_tokens: int, world: int
               ) -> list[OptimizerStep]:
    """Each rank's part of one optimizer step over ``units`` (row indices, or pair indices for pairs): micro-batches
    of at most ``max_tokens`` real tokens (:func:`rlhf_sg.packing.token_budget_microbatches`; a pair's two rows in
    one), the same number on every rank. The normaliser, the same on every rank, is the step's trained tokens (SFT)
    or pairs over all ranks divided by ``world``."""
    lengths = batch.attention_mask.sum(dim=1)
    rows_of = (lambda u: [2 * u, 2 * u + 1]) if pairs else (lambda u: [u])
    unit_lengths = [int(sum(lengths[r] for r in rows_of(u))) for u in units]
    plan = token_budget_microbatches(unit_lengths, max_tokens, world)
    if pairs:
        total = float(len(units))
    else:
        total = float(batch.loss_mask[torch.as_tensor(units)].sum())
    return [OptimizerStep([[r for k in micro for r in rows_of(units[k])] for micro in rank_plan], total / world)
            for rank_plan in plan]


@dataclass(frozen=True)
class StageLoss:
    """A stage's loss settings, as the ranks get them: ``stage`` "sft" | "rm" | "dpo"; ``center_coef``
    (reward models); DPO's ``beta``, ``length_normalized``, ``ipo`` and ``label_smoothing``."""

    stage: str
    center_coef: float = 0.0
    beta: float = 0.1
    length_normalized: bool = False
    ipo: bool = False
    label_smoothing: float = 0.0

    @classmethod
    def from_config(cls, cfg) -> StageLoss:
        return cls(stage=cfg.stage, center_coef=cfg.rm.center_coef, beta=cfg.dpo.beta,
                   length_normalized=cfg.dpo.loss.endswith("length_normalized"), ipo=cfg.dpo.loss.startswith("ipo"),
                   label_smoothing=cfg.dpo.label_smoothing)


def _pair_sums(values: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per-pair metric tensors [N] as (sums, weights) for a pair-weighted mean."""
    n = next(iter(values.values())).new_tensor(float(next(iter(values.values())).numel()))
    return {k: v.detach().float().sum() for k, v in values.items()}, {k: n for k in values}


def microbatch_loss(model, mb: StageBatch, spec: StageLoss, normalizer: float
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One micro-batch's loss (its share of the step's mean, by ``normalizer``) and its metrics as sums and their
    weights (a token-weighted NLL for SFT, pair-weighted means for reward models and DPO), for
    :func:`rlhf_sg.workers.allreduce_weighted_means`. ``model``: the trained model or a DeepSpeed engine around it,
    in train mode."""
    mask = mb.loss_mask.float()
    if spec.stage == "sft":
        logp = response_logprobs(model, mb.sequences, mb.attention_mask, mb.response_width)
        loss = losses.sft_loss(logp, mask, normalizer)
        tokens = mask.sum()
        return loss, {"loss": -(logp.detach() * mask).sum()}, {"loss": tokens}
    if spec.stage == "rm":
        scores = reward_scores(model, mb.sequences, mb.attention_mask, read_index=mb.read_index)
        chosen, rejected = scores[0::2], scores[1::2]
        margin = mb.margin[0::2] if mb.margin is not None else None
        loss = losses.bradley_terry_loss(chosen, rejected, normalizer, margin, spec.center_coef)
        per_pair = losses.bradley_terry_loss(chosen.detach(), rejected.detach(), 1.0, margin, 0.0)
        sums, weights = _pair_sums({"accuracy": losses.pair_accuracy(chosen, rejected),
                                    "margin": (chosen - rejected).detach(), "reward_chosen": chosen.detach(),
                                    "reward_rejected": rejected.detach()})
        n = weights["accuracy"]
        return loss, {**sums, "loss": per_pair}, {**weights, "loss": n}
    logp = response_logprobs(model, mb.sequences, mb.attention_mask, mb.response_width)
    policy = losses.sequence_logp(logp, mask, spec.length_normalized)
    ref = mb.ref_logp / mask.sum(dim=1).clamp(min=1) if spec.length_normalized else mb.ref_logp
    loss, per_pair = losses.dpo_loss(policy[0::2], policy[1::2], ref[0::2], ref[1::2], spec.beta, normalizer,
                                     ipo=spec.ipo, label_smoothing=spec.label_smoothing)
    sums, weights = _pair_sums(per_pair)
    return loss, sums, weights


def run_updates(engine, model, batch: StageBatch, steps: list[OptimizerStep], spec: StageLoss, device,
                timeout_s: float, prefix: str = "train") -> dict[str, float]:
    """This rank's part of ``steps`` (optimizer steps): each micro-batch's loss backward, one optimizer step per
    plan. ``engine``: a DeepSpeed engine or :class:`rlhf_sg.stages.ranks.PlainEngine` (``backward``, ``step``,
    ``set_gradient_accumulation_boundary``, ``get_lr``, ``get_global_grad_norm``, ``skipped_steps``); ``model``:
    what the forwards call (the engine itself under DeepSpeed, so its hooks gather the parameters). Metrics are
    reduced over the group's ranks once at the end (every rank returns the same values)."""
    from rlhf_sg.workers import allreduce_weighted_means

    engine.train()
    skipped_before = engine.skipped_steps
    sums: dict[str, torch.Tensor] = {}
    weights: dict[str, torch.Tensor] = {}
    lr, norms = 0.0, []
    for step in steps:
        for i, micro in enumerate(step.plan):
            engine.set_gradient_accumulation_boundary(i == len(step.plan) - 1)
            mb = batch.rows(micro).to(device)
            loss, s, w = microbatch_loss(model, mb, spec, step.normalizer)
            engine.backward(loss, scale_wrt_gas=False)
            for k in s:
                sums[k] = sums[k] + s[k] if k in sums else s[k]
                weights[k] = weights[k] + w[k] if k in weights else w[k]
        lr = float(engine.get_lr()[0])
        engine.step()
        norm = engine.get_global_grad_norm()
        if norm is not None and math.isfinite(float(norm)):
            norms.append(float(norm))
    means = allreduce_weighted_means(sums, weights, timeout_s)
    if norms:
        means["grad_norm"] = sum(norms) / len(norms)
    return {**{f"{prefix}/{k}": v for k, v in means.items()}, f"{prefix}/lr": lr,
            f"{prefix}/skipped_updates": float(engine.skipped_steps - skipped_before)}


@torch.no_grad()
def score_rows(model, batch: StageBatch, plan: list[list[int]], what: str) -> tuple[list[int], torch.Tensor]:
    """Eval-mode forwards over ``plan``'s micro-batches (global row indices): ``what`` "logp" (each row's summed
    log-prob of its trained tokens, [n] float32) or "score" (a value model's raw score at ``read_index``, [n]).
    Returns (row order, values) with rows in the order of the flattened plan."""
    out, order = [], []
    for micro in plan:
        mb = batch.rows(micro)
        if what == "logp":
            logp = response_logprobs(model, mb.sequences, mb.attention_mask, mb.response_width)
            out.append((logp.float().cpu() * mb.loss_mask.float()).sum(dim=1))
        else:
            out.append(reward_scores(model, mb.sequences, mb.attention_mask, read_index=mb.read_index).float().cpu())
        order.extend(micro)
    return order, torch.cat(out) if out else torch.empty(0)
