"""SFT throughput on CPU: ``rlhf-sg train-sft`` against TRL's ``SFTTrainer`` at its fastest setting, on the same
model, rows, epochs and lengths.

``python -m rlhf_sg.bench sft [--rows 64] [--batch-rows 16] [--epochs 2] [--warmup 1] [--size small]
[--threads N] [--trl-search/--no-trl-search] [--trl-setting MB,ACCUM,pad|free|pack] [--loss-tolerance 0.05]``

Both sides fine-tune the same Qwen2-style model (:mod:`rlhf_sg.tiny`, random weights) on the same prompt /
completion rows: short prompts and long-tailed completion lengths (most short, a few long), so a padded batch
wastes tokens a packed one does not. One character is one token and the completion ends with the tokenizer's EOS on
both sides; the loss is on the completion's tokens only (prompts are read, not trained on). Both run ``--epochs``
epochs of ``--rows`` rows, ``--batch-rows`` rows an optimizer step, AdamW (betas 0.9 / 0.95, no weight decay) at a
constant ``--lr``, gradients clipped at 1, float32.

Sides, one after the other (never at once), each with ``--threads`` torch threads (default: every core):

* ``ours``: :func:`rlhf_sg.stages.train_sft` in this process (one rank in-process, the command's default): packed
  micro-batches of at most ``--max-tokens-per-microbatch`` real tokens. A step's time is its ``time/step`` metric
  (the step's plans and updates).
* ``trl``: ``trl.SFTTrainer`` in its own Python process, as its users run it on a prompt / completion dataset
  (``completion_only_loss=True``, ``gradient_checkpointing`` off), at the fastest of its layouts: before the timed
  run, ``--trl-search`` (on by default) tries ``per_device_train_batch_size`` 2, 4, 8 and 16 (those dividing
  ``--batch-rows``) with the accumulation that makes up ``--batch-rows``, each padded (``pad``) and padding-free
  (``free``: the micro-batch's rows concatenated, no pad), then ``packing=True`` (``pack``: TRL's best-fit
  packing into sequences of ``max_length`` = the mean tokens of a step, one sequence a step), prints every
  setting's time and keeps the fastest (``--trl-setting`` pins one). A step's time runs from ``on_step_begin`` to
  ``on_step_end`` of a TrainerCallback (one optimizer step).

Reading the result: tokens/s is real tokens (prompt and completion, no pad) of the measured steps over their time
(the first ``--warmup`` steps of each side are not measured: a fresh model pays its first step's allocations);
s/step is the mean measured step (TRL's ``pack`` steps hold about as many tokens as ours but not the same rows).
The ratio ours / trl >= 1.0 means our SFT step is at least as fast as TRL's fastest setting on this machine. Two
checks follow: both sides trained the same real and trained tokens over the run (the same rows, each epoch), and the
loss per epoch (token-weighted mean of the steps' losses) falls on both sides and the last epoch's agrees within
``--loss-tolerance`` (relative): the sides see the rows in different orders, so their losses agree only closely.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf_sg.bench import load_average

#: TRL's ``per_device_train_batch_size`` values the search tries (those dividing --batch-rows)
TRL_MICRO_BATCHES = (2, 4, 8, 16)
#: TRL's layouts: padded micro-batches, padding-free ones, or packed sequences
LAYOUTS = ("pad", "free", "pack")
#: the line prefix the TRL process puts before its JSON result (the rest of its stdout is TRL's)
RESULT_MARKER = "SFT_TRL_RESULT "
#: this module's import name (``__name__`` is ``__main__`` when it runs as a script)
MODULE = "rlhf_sg.bench.sft"

_WORDS = ("the", "a", "river", "number", "seven", "write", "count", "list", "small", "green", "quiet", "city",
          "table", "of", "and", "three", "digits", "story", "about", "why", "how", "many", "apples", "train",
          "morning", "sum", "twelve", "ocean", "letter", "short", "answer", "please", "explain", "stone")


# ---- the data -------------------------------------------------------------------------------------------------


def _text(rng: random.Random, chars: int) -> str:
    text = rng.choice(_WORDS)
    while len(text) < chars:
        text += " " + rng.choice(_WORDS)
    return text[:chars]


def make_rows(num_rows: int, prompt_chars: tuple[int, int], completion_chars: tuple[int, int], seed: int
              ) -> list[dict[str, str]]:
    """``num_rows`` prompt / completion rows (one character is one token): prompt lengths uniform in
    ``prompt_chars``, completion lengths long-tailed in ``completion_chars`` (exponential with a mean of a sixth of
    the range above its minimum, cut at its maximum)."""
    rng = random.Random(seed)
    low, high = completion_chars
    rows = []
    for _ in range(num_rows):
        completion = min(high, low + int(rng.expovariate(6.0 / max(high - low, 1))))
        rows.append({"prompt": _text(rng, rng.randint(*prompt_chars)) + ":",
                     "completion": " " + _text(rng, completion)})
    return rows


def prepare(tmp: str, args: argparse.Namespace) -> tuple[str, str, int]:
    """Save the model and tokenizer and write the rows; returns (model dir, data file, parameters)."""
    from rlhf_sg.tiny import save_tiny_model

    model_path = save_tiny_model(os.path.join(tmp, "model"), args.arch, args.size, seed=args.seed)
    data_file = os.path.join(tmp, "sft.jsonl")
    with open(data_file, "w") as f:
        for row in make_rows(args.rows, _pair(args.prompt_chars), _pair(args.completion_chars), args.seed):
            f.write(json.dumps(row) + "\n")
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return model_path, data_file, sum(p.numel() for p in model.parameters())


def _pair(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split(","))
    return low, high


# ---- a side's steps ---------------------------------------------------------------------------------------------


@dataclass
class SideRun:
    """One side's optimizer steps, warm-up included: seconds, real tokens (prompt and completion, no pad), trained
    tokens (in the loss) and the loss (mean NLL per trained token) of each."""

    name: str
    warmup: int
    step_s: list[float] = field(default_factory=list)
    real_tokens: list[float] = field(default_factory=list)
    trained_tokens: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def measured_s(self) -> list[float]:
        return self.step_s[self.warmup:]

    @property
    def tokens_per_s(self) -> float:
        """Real tokens of the measured steps over their seconds."""
        return sum(self.real_tokens[self.warmup:]) / sum(self.measured_s)

    @property
    def s_per_step(self) -> float:
        return statistics.mean(self.measured_s)

    def epoch_losses(self, epochs: int) -> list[float]:
        """The loss of each epoch: the token-weighted mean of its steps' losses, a step counted in the epoch its
        first trained token falls in (every epoch trains the same tokens, so the cumulative count splits them)."""
        per_epoch = sum(self.trained_tokens) / epochs
        sums, weights = [0.0] * epochs, [0.0] * epochs
        before = 0.0
        for loss, tokens in zip(self.loss, self.trained_tokens):
            epoch = min(epochs - 1, int(before // per_epoch))
            sums[epoch] += loss * tokens
            weights[epoch] += tokens
            before += tokens
        return [s / w if w else float("nan") for s, w in zip(sums, weights)]


def too_few_steps(run: SideRun) -> str | None:
    """Why ``run`` cannot be measured (no step after its warm-up), or None."""
    if len(run.step_s) <= run.warmup:
        return (f"{run.name}: {len(run.step_s)} step(s), none after --warmup {run.warmup}; give more --rows or "
                "--epochs, or fewer --batch-rows")
    return None


def token_check(ours: SideRun, trl: SideRun) -> tuple[bool, str]:
    """Whether both sides trained the same real and trained tokens over the whole run, and the line saying so."""
    same = sum(ours.real_tokens) == sum(trl.real_tokens) and sum(ours.trained_tokens) == sum(trl.trained_tokens)
    return same, (f"tokens over the run: real {sum(ours.real_tokens):.0f} ours, {sum(trl.real_tokens):.0f} trl; "
                  f"trained {sum(ours.trained_tokens):.0f} ours, {sum(trl.trained_tokens):.0f} trl: "
                  f"{'equal' if same else 'DIFFERENT: the sides did not do the same work'}")


def loss_check(ours: SideRun, trl: SideRun, epochs: int, tolerance: float) -> tuple[bool, str]:
    """Whether the loss falls on both sides (last epoch below the first; with one epoch, last step below the first)
    and the last epochs' losses agree within ``tolerance`` relative to TRL's; and the line saying so."""
    a, b = ours.epoch_losses(epochs), trl.epoch_losses(epochs)
    if epochs > 1:
        falls = a[-1] < a[0] and b[-1] < b[0]
    else:
        falls = ours.loss[-1] < ours.loss[0] and trl.loss[-1] < trl.loss[0]
    gap = abs(a[-1] - b[-1]) / abs(b[-1])
    ok = falls and gap <= tolerance
    cells = lambda xs: " ".join(f"{x:.4f}" for x in xs)  # noqa: E731
    return ok, (f"loss per epoch: ours {cells(a)}; trl {cells(b)}; last epoch differs by {100 * gap:.2f} % "
                f"(tolerance {100 * tolerance:.1f} %), {'falls on both' if falls else 'does NOT fall on both'}: "
                f"{'comparable' if ok else 'NOT comparable'}")


# ---- TRL's settings ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrlSetting:
    """One setting of SFTTrainer's batch knobs: ``per_device_train_batch_size`` and
    ``gradient_accumulation_steps`` (rows, or packed sequences with ``pack``), and the layout: ``pad`` (padded
    micro-batches), ``free`` (``padding_free=True``) or ``pack`` (``packing=True``, TRL's best-fit packing)."""

    micro_batch: int
    accumulation: int
    layout: str

    @property
    def flag(self) -> str:
        return f"{self.micro_batch},{self.accumulation},{self.layout}"

    def describe(self) -> str:
        layout = {"pad": "padded", "free": "padding_free=True", "pack": "packing=True"}[self.layout]
        return (f"per_device_train_batch_size {self.micro_batch} x gradient_accumulation_steps {self.accumulation}, "
                f"{layout}, gradient_checkpointing off")


def trl_settings(batch_rows: int, micro_batches: tuple[int, ...] = TRL_MICRO_BATCHES) -> list[TrlSetting]:
    """The settings the search tries: every micro-batch of ``micro_batches`` dividing ``batch_rows`` (none does: the
    whole batch) with the accumulation making up ``batch_rows``, padded then padding-free; then one packed sequence
    a step."""
    sizes = [mb for mb in micro_batches if 0 < mb <= batch_rows and batch_rows % mb == 0] or [batch_rows]
    return ([TrlSetting(mb, batch_rows // mb, layout) for layout in ("pad", "free") for mb in sizes]
            + [TrlSetting(1, 1, "pack")])


def parse_trl_setting(text: str, batch_rows: int) -> TrlSetting:
    """``--trl-setting MB,ACCUM,pad|free|pack``; with pad / free, MB x ACCUM must be ``batch_rows``."""
    parts = [p.strip().lower() for p in text.split(",")]
    usage = "give micro_batch,accumulation,layout with layout pad, free or pack, e.g. --trl-setting 4,4,free"
    if len(parts) != 3 or parts[2] not in LAYOUTS:
        raise ValueError(f"--trl-setting {text!r}: {usage}")
    try:
        micro_batch, accumulation = int(parts[0]), int(parts[1])
    except ValueError:
        raise ValueError(f"--trl-setting {text!r}: micro_batch and accumulation must be integers; {usage}") from None
    if micro_batch < 1 or accumulation < 1:
        raise ValueError(f"--trl-setting {text!r}: micro_batch and accumulation must be >= 1")
    if parts[2] != "pack" and micro_batch * accumulation != batch_rows:
        raise ValueError(f"--trl-setting {text!r}: {micro_batch} x {accumulation} rows an optimizer step, but "
                         f"--batch-rows is {batch_rows}; make their product {batch_rows}")
    return TrlSetting(micro_batch, accumulation, parts[2])


def fastest_setting(probes: list[tuple[TrlSetting, float | None]]) -> TrlSetting:
    """The setting with the most real tokens a second (None: it failed); the earlier one of a tie."""
    finished = [(setting, rate) for setting, rate in probes if rate is not None]
    if not finished:
        tried = ", ".join(setting.flag for setting, _ in probes) or "none"
        raise RuntimeError(f"trl search: no setting finished (tried {tried}); see the TRL output above, or pin one "
                           "with --trl-setting")
    return max(finished, key=lambda pair: pair[1])[0]


def search_lines(probes: list[tuple[TrlSetting, SideRun | None]], kept: TrlSetting) -> list[str]:
    """The search's report: every setting's tokens/s and s/step, the one kept marked."""
    lines = []
    for setting, run in probes:
        figures = "failed" if run is None else f"{run.tokens_per_s:8.0f} tokens/s {run.s_per_step:6.3f} s/step"
        lines.append(f"  trl {setting.flag:<9} {figures}{'  <- kept' if setting == kept else ''}")
    return lines


def pack_tokens(lengths: list[int], batch_rows: int) -> int:
    """``packing=True``'s ``max_length`` for rows of ``lengths`` tokens: the mean real tokens of one of our steps (a
    packed sequence a step holds about as much as ours), at least the longest row (best-fit packing truncates a
    longer one)."""
    steps = -(-len(lengths) // batch_rows)
    return max(max(lengths), -(-sum(lengths) // steps))


def row_lengths(data_file: str, model_path: str) -> list[int]:
    """Each row's tokens as train-sft renders it: prompt, completion and EOS."""
    from rlhf_sg.data import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    with open(data_file) as f:
        rows = [json.loads(line) for line in f]
    return [len(tokenizer(r["prompt"], add_special_tokens=False)["input_ids"])
            + len(tokenizer(r["completion"], add_special_tokens=False)["input_ids"]) + 1 for r in rows]


# ---- our side ---------------------------------------------------------------------------------------------------


def run_ours(args: argparse.Namespace, model_path: str, data_file: str, out: str) -> SideRun:
    """``train-sft`` in this process on the bench's rows; each step's ``time/step``, tokens and loss."""
    from rlhf_sg.stages import StageConfig, train_sft

    cfg = StageConfig(stage="sft")
    cfg.model.pretrain = model_path
    cfg.data.train_data = data_file
    cfg.data.max_len = args.max_len
    cfg.data.overlong = "error"
    t = cfg.train
    t.batch_size, t.epochs, t.lr, t.lr_scheduler, t.seed = args.batch_rows, args.epochs, args.lr, "constant", args.seed
    t.max_tokens_per_microbatch = args.max_tokens_per_microbatch
    cfg.log.output_dir = out
    cfg.log.tensorboard = cfg.log.progress_bar = cfg.log.export_hf = False
    run = SideRun("ours", args.warmup)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    for record in train_sft(cfg):
        if "time/step" in record:
            run.step_s.append(record["time/step"])
            run.real_tokens.append(record["train/real_tokens"])
            run.trained_tokens.append(record["train/trained_tokens"])
            run.loss.append(record["train/loss"])
    run.wall_s = time.perf_counter() - start
    return run


# ---- TRL's side, in its own process -----------------------------------------------------------------------------


def run_trl(args: argparse.Namespace, model_path: str, data_file: str, out: str, settings: list[TrlSetting],
            lengths: list[int]) -> list[tuple[TrlSetting, SideRun | None]]:
    """Run :func:`_trl_child` in a fresh Python process, each of ``settings`` in turn with a fresh model and
    trainer (``lengths``: each row's tokens, :func:`row_lengths`); each setting's run, None for one that failed (the
    reason printed); all None if the process failed."""
    spec = {"model_path": model_path, "data_file": data_file, "output_dir": os.path.join(out, "trl"),
            "epochs": args.epochs, "lr": args.lr, "seed": args.seed, "threads": args.threads,
            "max_len": args.max_len, "pack_tokens": pack_tokens(lengths, args.batch_rows),
            "settings": [[s.micro_batch, s.accumulation, s.layout] for s in settings]}
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", MODULE, "--trl-child", json.dumps(spec)], env=env,
                          capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        print(f"trl: the TRL process failed (exit {proc.returncode}); its last lines:\n{tail}", flush=True)
        return [(setting, None) for setting in settings]
    results: list[tuple[TrlSetting, SideRun | None]] = []
    for setting, got in zip(settings, json.loads(lines[-1][len(RESULT_MARKER):])["runs"]):
        if got.get("error"):
            print(f"trl {setting.flag}: failed: {got['error']}", flush=True)
            results.append((setting, None))
            continue
        run = SideRun("trl", args.warmup, wall_s=wall / len(settings))
        for step in got["steps"]:
            run.step_s.append(step["seconds"])
            run.real_tokens.append(step["real_tokens"])
            run.trained_tokens.append(step["trained_tokens"])
            run.loss.append(step["loss"])
        results.append((setting, None if too_few_steps(run) else run))
    return results


def batch_tokens(inputs: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(real, trained) tokens of one SFTTrainer micro-batch: the attention mask's ones (padding-free and packed
    batches have no pad and no mask: every id) and the labels TRL does not ignore (-100)."""
    mask = inputs.get("attention_mask")
    real = int(mask.sum()) if mask is not None else inputs["input_ids"].numel()
    return real, int((inputs["labels"] != -100).sum())


def trl_config(spec: dict[str, Any], micro_batch: int, accumulation: int, layout: str):
    """SFTConfig as a user sets it for this work on CPU: the bench's epochs, LR and optimizer, the loss on the
    completion only, ``layout``'s padding / packing, one log line a step and no saving."""
    from trl import SFTConfig

    packed = layout == "pack"
    # padding-free without packing truncates nothing and TRL refuses a max_length then (no row exceeds --max-len)
    max_length = {"pack": spec["pack_tokens"], "free": None}.get(layout, spec["max_len"])
    return SFTConfig(
        output_dir=spec["output_dir"], per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=accumulation, num_train_epochs=spec["epochs"], learning_rate=spec["lr"],
        lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.0,
        max_grad_norm=1.0, seed=spec["seed"], use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0,
        completion_only_loss=True, max_length=max_length,
        packing=packed, padding_free=layout == "free" or packed,
    )


def _trl_run(spec: dict[str, Any], micro_batch: int, accumulation: int, layout: str) -> dict[str, Any]:
    """One SFTTrainer run over the bench's rows; each optimizer step's seconds, tokens and loss."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import SFTTrainer

    from rlhf_sg.data import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = load_tokenizer(spec["model_path"])
    dataset = load_dataset("json", data_files=spec["data_file"], split="train")
    counts = {"real": 0, "trained": 0}
    steps: list[dict[str, Any]] = []
    logged: dict[int, float] = {}

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            counts["real"] = counts["trained"] = 0
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            steps.append({"step": state.global_step, "seconds": time.perf_counter() - self.t0,
                          "real_tokens": counts["real"], "trained_tokens": counts["trained"]})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                logged[state.global_step] = float(logs["loss"])

    trainer = SFTTrainer(model=model, args=trl_config(spec, micro_batch, accumulation, layout),
                         train_dataset=dataset, processing_class=tokenizer, callbacks=[StepClock()])
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    compute_loss = trainer.compute_loss

    def counted(model, inputs, *a, **kw):  # inside the step: the dataloader may collate a batch ahead
        real, trained = batch_tokens(inputs)
        counts["real"] += real
        counts["trained"] += trained
        return compute_loss(model, inputs, *a, **kw)

    trainer.compute_loss = counted
    trainer.train()
    for step in steps:
        step["loss"] = logged.get(step["step"], float("nan"))
    return {"steps": steps}


def _trl_child(spec: dict[str, Any]) -> None:
    """The TRL side: one SFTTrainer run per setting of ``spec["settings"]``, each with a fresh model; prints one
    result line as JSON."""
    torch.set_num_threads(spec["threads"])
    runs = []
    for micro_batch, accumulation, layout in spec["settings"]:
        try:
            runs.append(_trl_run(spec, micro_batch, accumulation, layout))
        except Exception as e:  # one setting failing leaves the others to compare
            runs.append({"error": f"{type(e).__name__}: {e}"})
    print(RESULT_MARKER + json.dumps({"runs": runs}), flush=True)


# ---- the run ----------------------------------------------------------------------------------------------------


def side_line(run: SideRun, what: str) -> str:
    steps = ", ".join(f"{s:.3f}" for s in run.step_s)
    return (f"{run.name:<5} {run.tokens_per_s:9.0f} tokens/s {run.s_per_step:7.3f} s/step over "
            f"{len(run.measured_s)} measured step(s) ({what}); every step {steps} s; {run.wall_s:.0f} s with start-up")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlhf_sg.bench sft", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64, help="training rows")
    parser.add_argument("--batch-rows", type=int, default=16, help="rows per optimizer step (both sides)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1, help="first steps of each side not measured")
    parser.add_argument("--prompt-chars", default="10,60", help="min,max prompt length in characters (= tokens)")
    parser.add_argument("--completion-chars", default="8,400",
                        help="min,max completion length in characters (= tokens), long-tailed between them")
    parser.add_argument("--max-len", type=int, default=512, help="tokens a row may have (no row may exceed it)")
    parser.add_argument("--max-tokens-per-microbatch", type=int, default=4096,
                        help="ours: real tokens a packed micro-batch may hold")
    parser.add_argument("--size", default="small", help="tiny model size from rlhf_sg.tiny.SIZES")
    parser.add_argument("--arch", default="qwen2")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of each side")
    parser.add_argument("--trl-search", action=argparse.BooleanOptionalAction, default=True,
                        help="try TRL's micro-batch / padding-free / packing settings first and keep the fastest "
                             "(--no-trl-search: the whole step as one padded micro-batch)")
    parser.add_argument("--trl-setting", default=None, metavar="MB,ACCUM,pad|free|pack",
                        help="pin TRL's per_device_train_batch_size, gradient_accumulation_steps and layout; skips "
                             "the search")
    parser.add_argument("--loss-tolerance", type=float, default=0.05,
                        help="the last epoch's losses may differ by this much, relative to TRL's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trl-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trl_child is not None:
        _trl_child(json.loads(args.trl_child))
        return

    pinned = None
    if args.trl_setting is not None:
        try:
            pinned = parse_trl_setting(args.trl_setting, args.batch_rows)
        except ValueError as e:
            parser.error(str(e))
    for flag, value in (("--rows", args.rows), ("--batch-rows", args.batch_rows), ("--epochs", args.epochs),
                        ("--threads", args.threads)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if importlib.util.find_spec("trl") is None:
        print('trl: not installed, so there is no baseline; install it beside this CPU torch with `pip install '
              '"torch==2.13.0" -e ".[bench]"` (pinning torch keeps pip from replacing it)', flush=True)
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-sft-") as tmp:
        model_path, data_file, num_params = prepare(tmp, args)
        lengths = row_lengths(data_file, model_path)
        if max(lengths) > args.max_len:
            parser.error(f"--max-len {args.max_len}: the longest row has {max(lengths)} tokens; raise it or lower "
                         "--completion-chars")
        print(f"sft: {args.arch}/{args.size} ({num_params / 1e6:.1f}M parameters), {args.rows} rows of "
              f"{min(lengths)}..{max(lengths)} tokens (mean {statistics.mean(lengths):.0f}) x {args.epochs} "
              f"epoch(s), {args.batch_rows} rows a step, lr {args.lr}; {args.threads} torch thread(s) a side, one "
              f"side after the other; CPU ({os.cpu_count()} cores), load average {load_average()}", flush=True)
        if pinned is not None:
            setting = pinned
        elif args.trl_search:
            settings = trl_settings(args.batch_rows)
            print(f"trl search: {len(settings)} settings, each a whole run in one process; load average "
                  f"{load_average()}", flush=True)
            probes = run_trl(args, model_path, data_file, os.path.join(tmp, "search"), settings, lengths)
            setting = fastest_setting([(s, None if r is None else r.tokens_per_s) for s, r in probes])
            for line in search_lines(probes, setting):
                print(line, flush=True)
        else:
            setting = TrlSetting(args.batch_rows, 1, "pad")
        print(f"trl: {setting.describe()}" + (" (pinned)" if pinned else ""), flush=True)
        trl = run_trl(args, model_path, data_file, os.path.join(tmp, "timed"), [setting], lengths)[0][1]
        ours = run_ours(args, model_path, data_file, os.path.join(tmp, "ours"))
    problem = too_few_steps(ours) or (None if trl is not None else "trl: the timed run failed")
    if problem:
        print(problem)
        return
    print()
    print(side_line(ours, f"train-sft in-process, packed micro-batches of <= {args.max_tokens_per_microbatch} "
                          "tokens"))
    print(side_line(trl, f"SFTTrainer {setting.flag}"))
    print(f"ratio ours / trl tokens/s: {ours.tokens_per_s / trl.tokens_per_s:.2f} (>= 1.0: ours at least as fast; "
          f"TRL at {setting.flag}{', the fastest it tried' if pinned is None and args.trl_search else ''}; order: "
          "trl then ours)")
    print(token_check(ours, trl)[1])
    print(loss_check(ours, trl, args.epochs, args.loss_tolerance)[1])
    print(f"total wall time {time.perf_counter() - t_start:.0f} s; load average now {load_average()}")


if __name__ == "__main__":
    main()
