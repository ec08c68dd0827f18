"""The stages before RL, on the trainer's own machinery: supervised fine-tuning, reward-model training and DPO.

    from rlhf_sg.stages import StageConfig, train_sft, train_rm, train_dpo
    cfg = StageConfig(stage="sft"); cfg.model.pretrain = "base"; cfg.data.train_data = "sft.jsonl"
    train_sft(cfg)                       # or: rlhf-sg train-sft --model base --data sft.jsonl

Rooms: :mod:`~rlhf_sg.stages.render` (ids and loss mask from provenance), :mod:`~rlhf_sg.stages.data` (rows read,
checked and rendered), :mod:`~rlhf_sg.stages.losses` (pure math), :mod:`~rlhf_sg.stages.steps` (the batch, step
plans, micro-batch losses, update loop), :mod:`~rlhf_sg.stages.ranks` (an in-process rank or the trainer's Ray ZeRO-3
workers), :mod:`~rlhf_sg.stages.run` (the controller), :mod:`~rlhf_sg.stages.config` (flags and YAML).
"""

from __future__ import annotations

from rlhf_sg.stages.config import StageConfig, parse_stage_args


def _run(stage: str, cfg: StageConfig | list[str]):
    from rlhf_sg.stages.run import run_stage

    if not isinstance(cfg, StageConfig):
        cfg = parse_stage_args(stage, list(cfg))
    if cfg.stage != stage:
        raise ValueError(f"train-{stage} was given a config of stage {cfg.stage!r}")
    return run_stage(cfg)


def train_sft(cfg: StageConfig | list[str]) -> list[dict[str, float]]:
    """Supervised fine-tuning (``rlhf-sg train-sft``): a config, or the command's flags. Returns the logged records."""
    return _run("sft", cfg)


def train_rm(cfg: StageConfig | list[str]) -> list[dict[str, float]]:
    """Reward-model training (``rlhf-sg train-rm``); the export loads as train-ppo's ``--reward.kind model``."""
    return _run("rm", cfg)


def train_dpo(cfg: StageConfig | list[str]) -> list[dict[str, float]]:
    """DPO / IPO against a frozen reference (``rlhf-sg train-dpo``)."""
    return _run("dpo", cfg)


__all__ = ["StageConfig", "parse_stage_args", "train_dpo", "train_rm", "train_sft"]
