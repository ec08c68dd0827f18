"""The controller of a stage run: data first (rendered and checked before any model loads), then the ranks, the
optimizer steps, held-out evaluation, checkpoints, the run log (``metrics.jsonl``, TensorBoard, W&B, as train-ppo
writes them) and the export.

Metrics, per optimizer step (``train/*``) and per evaluation (``eval/*``):

* SFT: ``loss`` (NLL per trained token);
* reward model: ``loss`` (Bradley-Terry, per pair), ``accuracy`` (chosen scored strictly higher; ties count
  wrong), ``margin`` (mean r_chosen - r_rejected), ``reward_chosen`` / ``reward_rejected``, and on held-out pairs
  ``reward_mean`` / ``reward_std`` over every response;
* DPO: ``loss``, ``accuracy``, ``margin``, ``rewards_chosen`` / ``rewards_rejected`` (beta x log-ratio to the
  reference);
* every stage: ``real_tokens`` (the step's rows' tokens, prompts included) and ``trained_tokens`` (those in the
  loss), and ``time/step`` (seconds of the step's plans and updates, evaluation excluded);
* ``data/rows``, ``data/dropped_overlong``, ``data/truncated`` once, at step 0.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import time

import torch

from rlhf_sg.config import ConfigError
from rlhf_sg.data import load_tokenizer
from rlhf_sg.packing import token_budget_microbatches
from rlhf_sg.stages import losses
from rlhf_sg.stages.config import StageConfig, validate_stage
from rlhf_sg.stages.data import StageRows, load_stage_rows, split_held_out
from rlhf_sg.stages.ranks import start_ranks
from rlhf_sg.stages.render import eos_ids
from rlhf_sg.stages.steps import StageBatch, StageLoss, make_batch, step_plans
from rlhf_sg.workers import WorkerSpec

log = logging.getLogger("rlhf_sg")

#: the role each stage's trained model loads as (a causal LM, or a value-head model)
ROLES = {"sft": "actor", "rm": "reward", "dpo": "actor"}


def load_data(cfg: StageConfig, tokenizer) -> tuple[StageRows, StageRows | None]:
    """The training and held-out rows, rendered and fitted (:mod:`rlhf_sg.stages.data`)."""
    eos = eos_ids(tokenizer, cfg.model.pretrain)
    train = load_stage_rows(cfg.data.train_data, cfg.stage, tokenizer, eos, cfg.data)
    if cfg.data.eval_data:
        return train, load_stage_rows(cfg.data.eval_data, cfg.stage, tokenizer, eos, cfg.data, "--data.eval_data")
    return split_held_out(train, cfg.data.eval_fraction, cfg.train.seed)


def worker_spec(cfg: StageConfig, role: str, model_path: str, train: bool, total_steps: int) -> WorkerSpec:
    """The ranks' spec: the trained model (``train``; LoRA adapters with --lora.rank) or DPO's frozen reference."""
    t, m = cfg.train, cfg.model
    lora = dataclasses.asdict(cfg.lora) if train and cfg.lora.rank > 0 else None
    return WorkerSpec(role=role, model_path=model_path, world_size=t.num_ranks, master_addr="", master_port=0,
                      train=train, dtype=m.dtype, attn_implementation=m.attn_implementation, lr=t.lr,
                      lr_scheduler=t.lr_scheduler, lr_warmup_steps=round(t.lr_warmup_ratio * total_steps),
                      lr_total_steps=total_steps, weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm,
                      gradient_checkpointing=t.gradient_checkpointing and train, disable_dropout=t.disable_dropout,
                      seed=t.seed, device=t.device, timeout_s=t.timeout_s, packing_probe=t.packing_probe,
                      zero_stage=3 if t.num_ranks > 1 else 0, lora=lora, fused_kernels=m.fused_kernels)


def _in_process(cfg: StageConfig) -> bool:
    return cfg.train.num_ranks == 1 and cfg.train.in_process


def _put(ranks, batch: StageBatch):
    """The batch as the ranks take it: itself in this process, a Ray object reference otherwise (sent once)."""
    if hasattr(ranks, "workers"):
        import ray

        return ray.put(batch)
    return batch


def score(ranks, batch: StageBatch, what: str, cfg: StageConfig) -> torch.Tensor:
    """[B] eval-mode results of every row (:func:`rlhf_sg.stages.steps.score_rows`), in row order."""
    world = cfg.train.num_ranks
    plans = token_budget_microbatches(batch.attention_mask.sum(dim=1).tolist(), cfg.train.max_tokens_per_microbatch,
                                      world)
    ref = _put(ranks, batch)
    out = torch.zeros(batch.batch_size)
    for order, values in ranks.call("stage_score", per_rank=[(ref, plans[i], what) for i in range(world)],
                                    what=f"{what} forward"):
        if order:
            out[torch.as_tensor(order)] = values
    return out


# ---- DPO's reference log-probs ---------------------------------------------------------------------------------


def _weights_identity(path: str) -> list:
    """What identifies a model directory's weights without reading them: each weight file's name, size and mtime."""
    return sorted((f, os.path.getsize(os.path.join(path, f)), os.stat(os.path.join(path, f)).st_mtime_ns)
                  for f in os.listdir(path) if f.endswith((".safetensors", ".bin")))


def reference_cache_key(cfg: StageConfig, fingerprints: list[str]) -> str:
    """The reference log-probs' cache key: the rendered rows' fingerprints (ids, masks, truncation marks), the
    reference's weights, dtype and attention, and the truncation settings."""
    ref = cfg.model.ref_pretrain or cfg.model.pretrain
    fields = {"rows": fingerprints, "ref": os.path.abspath(ref), "weights": _weights_identity(ref),
              "dtype": cfg.model.dtype, "attn": cfg.model.attn_implementation, "max_len": cfg.data.max_len,
              "overlong": cfg.data.overlong}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]


def reference_logps(cfg: StageConfig, batches: list[StageBatch | None], fingerprints: list[str]
                    ) -> list[torch.Tensor | None]:
    """Each batch's reference log-probs [B] (summed over the trained tokens), computed once by a frozen reference in
    eval mode, or read from ``<output_dir>/ref_logp/<key>.pt`` (:func:`reference_cache_key`) when
    ``--dpo.ref_cache`` found them there."""
    # A separate frozen reference, also for a LoRA policy (whose reference, unless --model.ref_pretrain, is the base
    # its fresh adapters start as): scored here once, before the policy's ranks start, and then shut down, so no
    # second copy of the model is held while training.
    path = None
    if cfg.dpo.ref_cache:
        path = os.path.join(cfg.log.output_dir, "ref_logp", reference_cache_key(cfg, fingerprints) + ".pt")
        if os.path.isfile(path):
            log.info("reference log-probs from the cache %s", path)
            return torch.load(path)
    ranks = start_ranks(worker_spec(cfg, "ref", cfg.model.ref_pretrain or cfg.model.pretrain, False, 0),
                        _in_process(cfg))
    try:
        out = [None if b is None else score(ranks, b, "logp", cfg) for b in batches]
    finally:
        ranks.shutdown()
    if path is not None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(out, path + ".tmp")
        os.replace(path + ".tmp", path)
    return out


# ---- evaluation --------------------------------------------------------------------------------------------


def evaluate(ranks, batch: StageBatch, cfg: StageConfig, spec: StageLoss) -> dict[str, float]:
    """Held-out metrics (eval mode; see the module doc)."""
    mask = batch.loss_mask.float()
    if cfg.stage == "sft":
        logp = score(ranks, batch, "logp", cfg)
        return {"eval/loss": float(-logp.sum() / mask.sum())}
    if cfg.stage == "rm":
        scores = score(ranks, batch, "score", cfg)
        chosen, rejected = scores[0::2], scores[1::2]
        margin = batch.margin[0::2] if batch.margin is not None else None
        n = chosen.numel()
        return {"eval/loss": float(losses.bradley_terry_loss(chosen, rejected, n, margin)),
                "eval/accuracy": float(losses.pair_accuracy(chosen, rejected).mean()),
                "eval/margin": float((chosen - rejected).mean()), "eval/reward_mean": float(scores.mean()),
                "eval/reward_std": float(scores.std()) if scores.numel() > 1 else 0.0}
    logp = score(ranks, batch, "logp", cfg)
    tokens = mask.sum(dim=1).clamp(min=1)
    policy, ref = (logp / tokens, batch.ref_logp / tokens) if spec.length_normalized else (logp, batch.ref_logp)
    loss, per_pair = losses.dpo_loss(policy[0::2], policy[1::2], ref[0::2], ref[1::2], spec.beta,
                                     policy.numel() // 2, ipo=spec.ipo, label_smoothing=spec.label_smoothing)
    return {"eval/loss": float(loss), **{f"eval/{k}": float(v.mean()) for k, v in per_pair.items() if k != "loss"}}


# ---- the run ----------------------------------------------------------------------------------------------------


def unit_order(num_units: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """Epoch ``epoch``'s order of the units (seeded by seed + epoch), the same on a resume."""
    order = list(range(num_units))
    if shuffle:
        random.Random(seed + epoch).shuffle(order)
    return order


def run_stage(cfg: StageConfig) -> list[dict[str, float]]:
    """Train ``cfg.stage`` ("sft" | "rm" | "dpo") as ``cfg`` says and return the logged records (one per step, the
    evaluations merged into theirs). The trained model is exported to ``<output_dir>/final_hf`` (with the
    tokenizer; a reward model with its score statistics: :data:`rlhf_sg.models.REWARD_NORMALIZATION_FILE`)."""
    from rlhf_sg.trainer.checkpoint import check_output_dir, checkpoint_root, load_checkpoint, save_checkpoint
    from rlhf_sg.trainer.run_log import RunLog

    validate_stage(cfg)
    t, lg = cfg.train, cfg.log
    tokenizer = load_tokenizer(cfg.model.pretrain)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        pad_id = 0  # pad slots are never read: positions come from the masks
    train_rows, held_rows = load_data(cfg, tokenizer)
    unit = "pairs" if cfg.stage in ("rm", "dpo") else "rows"
    for flag, rows in (("--data.train_data", train_rows),
                       ("--data.eval_data / --data.eval_fraction", held_rows)):
        if rows is not None and rows.num_units < t.num_ranks:
            raise ConfigError(f"{flag}: {rows.num_units} usable {unit} for --train.num_ranks {t.num_ranks}: every "
                              f"rank needs one; give more {unit} (a larger --data.eval_fraction for the held-out "
                              "set) or fewer ranks")
    batch = make_batch(train_rows, pad_id)
    held = make_batch(held_rows, pad_id) if held_rows is not None else None
    check_output_dir(lg.output_dir, [cfg.model.pretrain])
    with open(os.path.join(lg.output_dir, "config.json"), "w") as f:
        json.dump(cfg.to_dict(), f, indent=1)

    per_epoch = math.ceil(train_rows.num_units / t.batch_size)
    total = t.max_steps or t.epochs * per_epoch
    spec = StageLoss.from_config(cfg)
    if cfg.stage == "dpo":
        fingerprints = [train_rows.fingerprint()] + ([held_rows.fingerprint()] if held_rows is not None else [])
        refs = reference_logps(cfg, [batch, held], fingerprints)
        batch.ref_logp = refs[0]
        if held is not None:
            held.ref_logp = refs[1]
    ranks = start_ranks(worker_spec(cfg, ROLES[cfg.stage], cfg.model.pretrain, True, total), _in_process(cfg))
    run_log = RunLog(cfg)
    root = checkpoint_root(lg.output_dir)
    start = 0
    if lg.resume:
        state = load_checkpoint(root, {"model": ranks})
        if state is not None:
            start = state["step"]
            run_log.resume_at(start)
            log.info("resumed at step %d of %d", start, total)
    batch_ref = _put(ranks, batch)
    lengths = batch.attention_mask.sum(dim=1)
    history: list[dict[str, float]] = []
    bar = None
    if lg.progress_bar:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=start, desc=f"train-{cfg.stage}", unit="step")
    try:
        if start == 0:
            first = {"data/rows": float(train_rows.num_units), "data/dropped_overlong": float(train_rows.dropped),
                     "data/truncated": float(train_rows.truncated)}
            if held is not None:
                first.update(evaluate(ranks, held, cfg, spec))
            run_log.write(0, first)
            history.append({"step": 0, **first})
        for step in range(start, total):
            epoch, k = divmod(step, per_epoch)
            order = unit_order(train_rows.num_units, epoch, t.seed, cfg.data.shuffle)
            units = order[k * t.batch_size : (k + 1) * t.batch_size]
            if len(units) < t.num_ranks:  # an epoch's last few units, fewer than the ranks: the next epoch's first
                units = units + unit_order(train_rows.num_units, epoch + 1, t.seed, cfg.data.shuffle)[
                    : t.num_ranks - len(units)]
            step_start = time.perf_counter()
            plans = step_plans(batch, units, train_rows.pairs, t.max_tokens_per_microbatch, t.num_ranks)
            metrics = ranks.call("stage_train", per_rank=[(batch_ref, [plans[i]], spec) for i in range(t.num_ranks)],
                                 what=f"train-{cfg.stage} step {step + 1}")[0]
            metrics["time/step"] = time.perf_counter() - step_start
            rows = [r for u in units for r in train_rows.unit_rows(u)]
            metrics["train/real_tokens"] = float(lengths[rows].sum())
            metrics["train/trained_tokens"] = float(batch.loss_mask[rows].sum())
            metrics["train/epoch"] = step / per_epoch
            done = step + 1
            if held is not None and (done == total or (lg.eval_steps and done % lg.eval_steps == 0)):
                metrics.update(evaluate(ranks, held, cfg, spec))
            run_log.write(done, metrics)
            history.append({"step": done, **metrics})
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{metrics.get('train/loss', float('nan')):.4f}")
            if lg.save_steps and done % lg.save_steps == 0 and done < total:
                save_checkpoint(root, done, {"model": ranks}, {"stage": cfg.stage})
        if cfg.stage == "rm":
            # the statistics a reward group normalises with: the trained model's raw scores of every training response
            scores = score(ranks, batch, "score", cfg)
            mean, std = float(scores.mean()), float(scores.std()) if scores.numel() > 1 else 1.0
            ranks.call("set_reward_stats", mean, max(std, 1e-6))
            run_log.write(total, {"rm/score_mean": mean, "rm/score_std": std})
            history[-1].update({"rm/score_mean": mean, "rm/score_std": std})
        if lg.export_hf:
            out = os.path.join(lg.output_dir, "final_hf")
            ranks.call("export_hf", out, what="export")
            tokenizer.save_pretrained(out)
            log.info("exported the trained model to %s", out)
    finally:
        if bar is not None:
            bar.close()
        run_log.close()
        ranks.shutdown()
    return history
