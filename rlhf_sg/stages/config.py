"""The typed config of a stage run (``rlhf-sg train-sft | train-rm | train-dpo``), filled from YAML and flags the way
``train-ppo``'s is (:mod:`rlhf_sg.config`: dotted flags, YAML sections, flags win) and validated before any model,
data or process is touched."""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any

from rlhf_sg.config import (
    LORA_REFUSED,
    LR_SCHEDULERS,
    ConfigError,
    LoraConfig,
    _check_model_dir,
    _closest,
    _coerce,
    _need,
    _refused_lora_option,
    _validate_lora,
    load_yaml,
)
from rlhf_sg.stages.render import OVERLONG

STAGES = ("sft", "rm", "dpo")
#: --dpo.loss: each name says how the policy's and reference's sequence log-probs are normalised
#: (``_length_normalized``: the mean log-prob over the response's trained tokens; otherwise their sum)
DPO_LOSSES = ("dpo_summed", "dpo_length_normalized", "ipo_length_normalized", "ipo_summed")
#: help beyond the default, for the settings whose values need saying
HELP = {"dpo.loss": "dpo_summed: DPO's sigmoid loss on log-probs summed over the response's trained tokens; "
                    "dpo_length_normalized: on their mean per token; ipo_length_normalized: IPO's squared loss "
                    "(target margin 1/(2 beta)) on mean log-probs, as the IPO paper's results use; ipo_summed: IPO on "
                    "summed log-probs",
        "data.overlong": "drop | error | truncate (cut at max_len, marked; never given an EOS)"}


@dataclass
class StageModelConfig:
    #: the model to train: a local HF causal-LM directory (train-rm: its backbone gets a fresh value head, or
    #: keeps the one a saved value model has)
    pretrain: str = ""
    #: train-dpo's reference model (None: --model.pretrain, frozen)
    ref_pretrain: str | None = None
    dtype: str = "float32"  # "float32" | "bfloat16"
    attn_implementation: str = "sdpa"
    #: RMSNorms, gated-MLP products and rotary embeddings as fused torch.compile kernels (:mod:`rlhf_sg.kernels`)
    fused_kernels: bool = False


@dataclass
class StageDataConfig:
    #: JSONL / Parquet file or a datasets directory. train-sft: rows with a message list (--data.messages_key) or
    #: a prompt and a completion; train-rm / train-dpo: rows with chosen and rejected (strings or message lists) and
    #: a prompt (optional when chosen / rejected are whole conversations)
    train_data: str = ""
    #: held-out rows in the same format (None: --data.eval_fraction of the training rows, or no evaluation)
    eval_data: str | None = None
    #: with no --data.eval_data, hold out this fraction of the training rows (seeded)
    eval_fraction: float = 0.0
    messages_key: str = "messages"
    prompt_key: str = "prompt"
    completion_key: str = "completion"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    #: train-rm: a per-pair margin m in -log sigmoid(r_chosen - r_rejected - m) (None: no margin)
    margin_key: str | None = None
    #: render string prompts / completions as a user / assistant turn through the chat template (message lists
    #: always go through it)
    apply_chat_template: bool = False
    #: plain-text completions end with the tokenizer's EOS (trained on); never added to a truncated row
    append_eos: bool = True
    #: tokens a row (prompt and completion) may have
    max_len: int = 1024
    #: a row over max_len: "drop" (counted in the log), "error" (stop, naming it), "truncate" (cut, marked; no EOS)
    overlong: str = "drop"
    shuffle: bool = True


@dataclass
class StageTrainConfig:
    #: ranks: more than 1 start a Ray group of DeepSpeed ZeRO-3 ranks (the trainer's workers)
    num_ranks: int = 1
    #: with one rank, train in this process (no Ray, no DeepSpeed; float32); false: a Ray group of one
    #: unpartitioned DeepSpeed rank, as train-ppo runs a group of one
    in_process: bool = True
    device: str = "cpu"  # "cpu" | "cuda"
    lr: float = 1e-5
    lr_scheduler: str = "constant"  # constant | linear | cosine (to 0 at the last step)
    lr_warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    epochs: int = 1
    #: optimizer steps (0: as many as --train.epochs give)
    max_steps: int = 0
    #: rows (train-sft) or pairs (train-rm, train-dpo) per optimizer step
    batch_size: int = 32
    #: real tokens a micro-batch may hold (a pair's two rows stay in one micro-batch)
    max_tokens_per_microbatch: int = 4096
    seed: int = 42
    gradient_checkpointing: bool = False
    #: zero every dropout of the trained (and reference) model, so train-mode forwards equal eval-mode ones
    disable_dropout: bool = True
    #: the start-up packing probe at model load (as --train.packing_probe of train-ppo)
    packing_probe: bool = True
    timeout_s: float = 900.0


@dataclass
class StageLogConfig:
    output_dir: str = "runs/stage"
    #: a checkpoint every N optimizer steps (0: none until the end's export)
    save_steps: int = 0
    resume: bool = False
    #: held-out evaluation every N optimizer steps (0: before the first and after the last only)
    eval_steps: int = 0
    tensorboard: bool = True
    wandb_project: str | None = None
    progress_bar: bool = True
    #: write the trained model to <output_dir>/final_hf (train-rm: with its score statistics)
    export_hf: bool = True


@dataclass
class RewardModelConfig:
    #: TRL's centring term: coef * mean((r_chosen + r_rejected)^2) added to the loss (0: off)
    center_coef: float = 0.0


@dataclass
class DPOConfig:
    #: the KL strength beta (IPO: the target margin is 1 / (2 beta))
    beta: float = 0.1
    #: "dpo_summed" (sigmoid loss on summed log-probs), "dpo_length_normalized" (on the mean log-prob per trained
    #: token), "ipo_length_normalized" (IPO's squared loss on mean log-probs, as the IPO paper's results use),
    #: "ipo_summed" (IPO on summed log-probs)
    loss: str = "dpo_summed"
    #: conservative DPO: the chosen / rejected labels flipped with this probability (sigmoid losses only)
    label_smoothing: float = 0.0
    #: keep the reference log-probs on disk (<output_dir>/ref_logp), keyed by the rendered data's fingerprint, the
    #: reference's weights, dtype, attention and truncation settings: a rerun or resume reuses them
    ref_cache: bool = True


@dataclass
class StageConfig:
    stage: str = "sft"
    model: StageModelConfig = field(default_factory=StageModelConfig)
    data: StageDataConfig = field(default_factory=StageDataConfig)
    train: StageTrainConfig = field(default_factory=StageTrainConfig)
    log: StageLogConfig = field(default_factory=StageLogConfig)
    #: train-ppo's --lora.* (rank, alpha, dropout, target_modules, rslora): LoRA adapters on the trained model, the
    #: base frozen (train-rm: the value head trains whole beside them); the export is the merged model
    lora: LoraConfig = field(default_factory=LoraConfig)
    rm: RewardModelConfig = field(default_factory=RewardModelConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: the sections each stage reads (a flag of another stage's section is refused)
SECTIONS = {"sft": ("model", "data", "train", "log", "lora"), "rm": ("model", "data", "train", "log", "lora", "rm"),
            "dpo": ("model", "data", "train", "log", "lora", "dpo")}
#: train-ppo's --lora.* settings a stage has no use for, each with why (refused by name)
LORA_PPO_ONLY = {
    "sync_mode": "is how train-ppo's rollout engines get the adapter; a stage has no engines",
    "export_merged": "is train-ppo's; a stage's export (--log.export_hf) is always the merged model",
    "init_adapter": "is not read by the stages (they start a fresh adapter); train on the merged model instead: "
                    "give it as --model.pretrain",
}


def _lora_refusal(key: str, label: str, stage: str) -> ConfigError | None:
    """The error for a --lora.* key a stage refuses (PEFT options no LoRA here takes, train-ppo's own); else None."""
    if key in LORA_REFUSED:
        return _refused_lora_option(key, label)
    if key in LORA_PPO_ONLY:
        return ConfigError(f"{label}: --lora.{key} {LORA_PPO_ONLY[key]} (train-{stage} takes --lora.rank, "
                           "--lora.alpha, --lora.dropout, --lora.target_modules, --lora.rslora)")
    return None


ALIASES = {"--model": "model.pretrain", "--data": "data.train_data", "--output-dir": "log.output_dir",
           "--max-steps": "train.max_steps"}


def _classes() -> dict[str, type]:
    hints = typing.get_type_hints(StageConfig)
    return {name: hints[name] for name in ("model", "data", "train", "log", "lora", "rm", "dpo")}


def _fields(section: str) -> list[dataclasses.Field]:
    """The settings of ``section`` a stage takes (train-ppo's own --lora.* left out)."""
    return [f for f in dataclasses.fields(_classes()[section]) if section != "lora" or f.name not in LORA_PPO_ONLY]


def _keys(stage: str) -> list[str]:
    return [f"{s}.{f.name}" for s in SECTIONS[stage] for f in _fields(s)]


def apply_overrides(cfg: StageConfig, overrides: dict[str, Any], source: str) -> StageConfig:
    """Set dotted keys on ``cfg``; a key outside this stage's sections is an error naming ``source``."""
    classes = _classes()
    for dotted, raw in overrides.items():
        section, _, key = str(dotted).partition(".")
        label = f"--{dotted}" if source == "flag" else f"{source}: {dotted}"
        refused = _lora_refusal(key, label, cfg.stage) if section == "lora" else None
        if refused is not None:
            raise refused
        if section not in SECTIONS[cfg.stage] or key not in typing.get_type_hints(classes[section]):
            close = _closest(str(dotted), _keys(cfg.stage))
            hint = f" (did you mean {close!r}?)" if close else ""
            raise ConfigError(f"{label}: not a setting of train-{cfg.stage}{hint}; its sections are "
                              f"{', '.join(SECTIONS[cfg.stage])} (rlhf-sg train-{cfg.stage} --help lists them)")
        setattr(getattr(cfg, section), key, _coerce(label, typing.get_type_hints(classes[section])[key], raw))
    return cfg


def build_parser(stage: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"rlhf-sg train-{stage}",
        description={"sft": "Supervised fine-tuning: the loss on the assistant's (completion's) tokens only.",
                     "rm": "Reward-model training: a value head read at the last response token, Bradley-Terry "
                           "loss on chosen / rejected pairs; the export loads as train-ppo's --reward.kind model.",
                     "dpo": "Direct preference optimisation against a frozen reference (its log-probs computed "
                            "once, in eval mode)."}[stage]
        + " Every setting is a dotted flag (--section.key value); a YAML file (--config) fills the same keys; flags "
          "win over the file.")
    parser.add_argument("--config", help="YAML file with sections " + ", ".join(SECTIONS[stage]))
    for alias, dotted in ALIASES.items():
        parser.add_argument(alias, dest=dotted, default=argparse.SUPPRESS, help=f"alias of --{dotted}")
    for section in SECTIONS[stage]:
        cls = _classes()[section]
        group = parser.add_argument_group(section)
        for f in _fields(section):
            group.add_argument(f"--{section}.{f.name}", dest=f"{section}.{f.name}", default=argparse.SUPPRESS,
                               metavar="V", help=" ".join(filter(None, [HELP.get(f"{section}.{f.name}"),
                                                                         f"(default: {getattr(cls(), f.name)!r})"])))
    return parser


def parse_stage_args(stage: str, argv: list[str]) -> StageConfig:
    """The validated config of ``rlhf-sg train-{stage}`` from its flags (and ``--config`` YAML)."""
    if stage not in STAGES:
        raise ConfigError(f"unknown stage {stage!r}; one of {', '.join(STAGES)}")
    known, extra = build_parser(stage).parse_known_args(argv)
    if extra:
        flag = next((a for a in extra if a.startswith("-")), None)
        if flag is None:
            raise ConfigError(f"unexpected argument {extra[0]!r}: settings are given as --section.key value")
        name = flag.split("=", 1)[0]
        if name.startswith("--lora.") and (refused := _lora_refusal(name[len("--lora."):], name, stage)):
            raise refused
        close = _closest(name.lstrip("-"), _keys(stage) + [a.lstrip("-") for a in ALIASES])
        hint = f" (did you mean --{close}?)" if close else ""
        raise ConfigError(f"unknown flag {name}{hint}; `rlhf-sg train-{stage} --help` lists every setting")
    ns = vars(known)
    cfg = StageConfig(stage=stage)
    path = ns.pop("config", None)
    if path:
        apply_overrides(cfg, load_yaml(path), path)
    apply_overrides(cfg, ns, "flag")
    return validate_stage(cfg)


def validate_stage(cfg: StageConfig) -> StageConfig:
    """Everything checkable before a model or the data is loaded; raises ConfigError naming the flag."""
    m, d, t, lg = cfg.model, cfg.data, cfg.train, cfg.log
    _need(cfg.stage in STAGES, f"stage must be one of {', '.join(STAGES)}, got {cfg.stage!r}")
    _need(bool(m.pretrain), "--model.pretrain is required: a local Hugging Face model directory")
    for flag, path in (("--model.pretrain", m.pretrain), ("--model.ref_pretrain", m.ref_pretrain)):
        if path:
            _need(os.path.isfile(os.path.join(path, "config.json")),
                  f"{flag}: {path!r} is not a model directory (no config.json there); save the model with "
                  "save_pretrained or point at its directory")
            _check_model_dir(flag, path)
    _need(m.ref_pretrain is None or cfg.stage == "dpo", "--model.ref_pretrain is train-dpo's reference; drop it")
    if m.ref_pretrain and m.pretrain:
        from rlhf_sg.data import load_tokenizer
        from rlhf_sg.distill import padded_vocab_size, tokenizer_differences

        diffs = tokenizer_differences(load_tokenizer(m.pretrain),
                                      load_tokenizer(m.ref_pretrain, flag="--model.ref_pretrain"),
                                      padded_vocab_size(m.pretrain), padded_vocab_size(m.ref_pretrain),
                                      other="reference")
        _need(not diffs, f"--model.ref_pretrain: {m.ref_pretrain!r} does not share the tokenizer of --model.pretrain "
                         f"{m.pretrain!r}: {'; '.join(diffs)}. The reference scores the policy's token ids: give a "
                         "reference saved with the policy's tokenizer and vocab_size (or leave it unset: the policy)")
    _need(m.dtype in ("float32", "bfloat16"), f"--model.dtype must be float32 or bfloat16, got {m.dtype!r}")
    _need(bool(d.train_data), "--data.train_data is required: a JSONL / Parquet file or a datasets directory")
    for flag, path in (("--data.train_data", d.train_data), ("--data.eval_data", d.eval_data)):
        if path:
            _need(os.path.exists(path), f"{flag}: {path!r} does not exist; give a JSONL / Parquet file or a "
                                        "datasets directory")
    _need(0 <= d.eval_fraction < 1, f"--data.eval_fraction must be in [0, 1), got {d.eval_fraction}")
    _need(d.eval_data is None or d.eval_fraction == 0,
          "--data.eval_data and --data.eval_fraction both name held-out rows; give one")
    _need(d.max_len >= 2, f"--data.max_len must be >= 2 (a prompt token and a trained one), got {d.max_len}")
    _need(d.overlong in OVERLONG, f"--data.overlong must be one of {', '.join(OVERLONG)}, got {d.overlong!r}")
    _need(d.margin_key is None or cfg.stage == "rm", "--data.margin_key is train-rm's (a Bradley-Terry margin)")
    _need(t.num_ranks >= 1, f"--train.num_ranks must be >= 1, got {t.num_ranks}")
    _need(t.device in ("cpu", "cuda"), f"--train.device must be cpu or cuda, got {t.device!r}")
    _need(not (t.in_process and t.num_ranks == 1 and m.dtype != "float32"),
          f"--model.dtype {m.dtype} trains under DeepSpeed (float32 master weights): set --train.in_process false "
          "or --train.num_ranks >= 2, or use float32")
    if t.device == "cuda":
        import torch

        _need(torch.cuda.is_available(), "--train.device cuda: no CUDA device is visible (check "
                                         "CUDA_VISIBLE_DEVICES and the driver), or use --train.device cpu")
    _need(t.lr > 0, f"--train.lr must be > 0, got {t.lr}")
    _need(t.lr_scheduler in LR_SCHEDULERS, f"--train.lr_scheduler must be one of {', '.join(LR_SCHEDULERS)}, got "
                                           f"{t.lr_scheduler!r}")
    _need(0 <= t.lr_warmup_ratio < 1, f"--train.lr_warmup_ratio must be in [0, 1), got {t.lr_warmup_ratio}")
    _need(t.max_grad_norm >= 0, f"--train.max_grad_norm must be >= 0 (0: no clipping), got {t.max_grad_norm}")
    _need(t.epochs >= 1, f"--train.epochs must be >= 1, got {t.epochs}")
    _need(t.max_steps >= 0, f"--train.max_steps must be >= 0 (0: --train.epochs decides), got {t.max_steps}")
    unit = "rows" if cfg.stage == "sft" else "pairs"
    _need(t.batch_size >= t.num_ranks, f"--train.batch_size ({unit} per optimizer step) must be at least "
                                       f"--train.num_ranks {t.num_ranks}, got {t.batch_size}")
    _need(t.max_tokens_per_microbatch >= d.max_len * (1 if cfg.stage == "sft" else 2),
          f"--train.max_tokens_per_microbatch {t.max_tokens_per_microbatch} must hold the longest "
          f"{'row' if cfg.stage == 'sft' else 'pair (two rows)'} --data.max_len allows "
          f"({d.max_len * (1 if cfg.stage == 'sft' else 2)} tokens); raise it or lower --data.max_len")
    _need(t.timeout_s > 0, f"--train.timeout_s must be > 0, got {t.timeout_s}")
    _need(lg.save_steps >= 0 and lg.eval_steps >= 0, "--log.save_steps and --log.eval_steps must be >= 0")
    defaults = LoraConfig()
    for key in LORA_PPO_ONLY:  # set in a config built in code, past the flags' refusal
        if getattr(cfg.lora, key) != getattr(defaults, key):
            raise _lora_refusal(key, f"lora.{key} = {getattr(cfg.lora, key)!r}", cfg.stage)
    _validate_lora(cfg)
    if cfg.stage == "rm":
        _need(cfg.rm.center_coef >= 0, f"--rm.center_coef must be >= 0, got {cfg.rm.center_coef}")
    if cfg.stage == "dpo":
        p = cfg.dpo
        _need(p.beta > 0, f"--dpo.beta must be > 0, got {p.beta}")
        _need(p.loss in DPO_LOSSES, f"--dpo.loss must be one of {', '.join(DPO_LOSSES)}, got {p.loss!r}")
        _need(0 <= p.label_smoothing < 0.5, f"--dpo.label_smoothing must be in [0, 0.5), got {p.label_smoothing}")
        _need(p.label_smoothing == 0 or not p.loss.startswith("ipo"),
              f"--dpo.label_smoothing applies to the sigmoid losses; --dpo.loss {p.loss} has none")
    return cfg
