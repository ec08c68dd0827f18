"""End-to-end step throughput on CPU: our trainer (GRPO, sync and async, and PPO) against TRL's GRPOTrainer at
its fastest setting, on the same work.

``python -m rlhf_sg.bench e2e [--steps 3] [--warmup 1] [--sides trl,grpo,ppo] [--rounds 1] [--backend hf]
[--placement shared|split] [--actor-ranks N] [--worker-threads N] [--engine-threads N] [--no-share-prompts]
[--trl-search/--no-trl-search] [--trl-setting MB,ACCUM,on|off]``

Every side trains the same ~25M-parameter Qwen2-style model (random weights: this measures
throughput, not learning) on the same prompt file with the same rule reward (the fraction of digits
in a completion), 8 prompts x 8 samples a step, at most 64 new tokens, temperature 1, one optimizer
step per rollout batch, fp32 on CPU. The tokenizer's end-of-sequence token is an id past the model's
vocabulary and the model has no EOS id of its own, so no side can sample a stop token: every
completion runs to exactly ``--max-new-tokens`` and all sides generate the same number of tokens.

Sides:

* ``grpo`` (candidate): :class:`rlhf_sg.trainer.PPOTrainer` with ``advantage_estimator="grpo"`` and
  ``kl_coef=0`` (no reference model, like TRL's default ``beta=0``): the rollout engine in a Ray actor,
  the DeepSpeed ZeRO-3 actor (``--actor-ranks``, default the config's), packed forwards in which the 8 samples
  of a prompt compute it once (``--train.share_prompts``, the default; ``--no-share-prompts`` turns it off:
  the same loss and gradients up to float rounding, more tokens), the weight sync into the engine after every
  step. ``train_step()`` is called directly; its ``time/<phase>`` metrics
  give the phase shares.
* ``grpo-async``: the same with ``--rollout.mode async`` (``max_staleness=1``, partial rollout): the engine
  generates the next step's batch while the trainer trains. Compare it with ``grpo`` on ``--placement
  split``, where engine and trainer compute on separate cores.
* ``grpo-async-k4``: the same with ``max_staleness=4`` and AReaL's decoupled loss (``--train.decoupled_loss``, no
  weight cap): the engine may run up to four batches ahead, so a batch with a long sample delays no step as long as
  the ones before it were short. Compare it with ``grpo-async`` and ``grpo`` on ``--length-mix long-tail``.
* ``ppo`` (for information): the same with ``advantage_estimator="gae"``: a critic and a reference
  model (``kl_coef=0.01``) as well, so it does more work than either GRPO side.
* ``trl`` (baseline): ``trl.GRPOTrainer`` in its own Python process (so Ray is not involved and the
  two sides' threads never meet) with ``num_generations=8``, ``use_vllm=False`` (transformers'
  ``generate``), ``beta=0``, ``bf16=False``, at the fastest of TRL's own batch knobs: before the rounds,
  ``--trl-search`` (on by default) tries ``per_device_train_batch_size`` 8, 16, 32 and 64 with
  ``gradient_accumulation_steps`` = 64 / that (one optimizer step over the step's 64 samples) and
  ``gradient_checkpointing`` off and on, each for ``--trl-probe-steps`` timed steps after ``--warmup`` untimed
  ones of its own (a fresh model and trainer pays its first step's allocations), all in one process; then the
  fastest of those again with the Trainer's ``torch_compile`` on, in a process of its own (our side may compile
  fused kernels, ``--fused-kernels``, so TRL gets its compile knob too), and keeps the fastest of all
  (it prints every setting's time and the one kept; ``--trl-setting 8,8,off`` or ``16,4,off,compile`` pins one
  and skips the search). After the TRL side in each round, TRL alone: the same setting as a plain script that
  imports nothing of this project (``rlhf_sg/bench/_trl_alone.py``, whose ``GRPOConfig`` and reward the TRL side
  uses too); the ``baseline:`` line says whether the bench's TRL side is within 5 % of it (``--no-trl-alone`` skips it).
  TRL's ``steps_per_generation`` defaults to the accumulation, so its generation batch is
  micro-batch x accumulation = 64 completions in every setting: one ``generate`` over 64, then the
  accumulated micro-batches, then one optimizer step, and no separate old-log-prob forward
  (``num_iterations=1``), as on our side. Its step time runs from ``on_step_begin`` to ``on_step_end`` of
  a TrainerCallback (one optimizer step); ``generate`` is the time inside the model's ``generate``,
  ``reward`` inside the reward function, ``other`` the rest of TRL's rollout preparation (tokenising,
  decoding, padding, advantages) and ``train`` everything after it (forwards, backwards, optimizer step).

Length mix: ``fixed`` (default) as above. ``long-tail`` (our sides only): ``--tail-stop-ids`` characters of the
vocabulary stop a completion (``--rollout.stop_token_ids``), so with the random model's near-uniform next-token
distribution the lengths are about geometric with mean vocabulary / that count, cut at ``--max-new-tokens``: most
completions short, a few run to the budget, and a batch takes as long as its longest. The sides generate different
tokens then (the reward per step still compares them at equal samples).

Placement (our sides): ``shared`` (default): the CPU is one device, so the actor is one ZeRO-3 rank, and as
a sync step's phases take turns, the engine and the actor rank each compute with every core (what
``Layout.worker_threads`` / ``engine_threads`` give a run that sets no thread counts); ``split`` puts the
engine on one Ray CPU with one thread and the actor on one rank with one thread, so generation and
training compute on separate cores (the placement async rollout is for). ``--actor-ranks``, ``--worker-threads`` and
``--engine-threads`` override either. TRL runs one process with ``--trl-threads`` (default: every core)
torch threads. The thread counts each side actually runs with are printed. Each of our runs starts its
own Ray instance (``RAY_ADDRESS=local``) and shuts it down before the next side starts.

Reading the table: samples/s is samples per step over the mean measured step time (``--warmup``
steps of each side are not measured). A step's time is wall-clock on every side: for ours, around each
``train_step()`` call, so an async step, whose generation overlaps the previous step's training and is
not inside its ``time/step``, is charged the time it really holds the loop. The phase columns are each
phase's share of the mean step (an async run's ``generate`` runs beside training: its share is of time
that overlaps; ``wait_roll`` is the trainer waiting for a batch). ``reward`` is the mean reward of the
measured steps; the per-step rewards of every side (warm-up steps included, averaged over rounds) are
printed below the table, step k having trained on k x 64 samples, so the sides' reward trajectories are
compared at equal samples. The ratio ours-grpo / trl-grpo >= 1.0 means our GRPO step is at least as
fast as TRL's fastest setting on this machine; ours-grpo-async / ours-grpo is async over sync.
Each side is a separate run with its own start-up, so sides cannot alternate step by step; instead
``--rounds`` repeats the whole set, round r in the order of ``--sides`` when r is even and reversed
when odd (A B C, C B A, ...), and each side's measured steps are pooled across rounds, so drifting
machine load hits both ends alike. With one round (the default, to keep the run short) the order is
``--sides``: state it with the result.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf_sg.bench import _trl_alone, load_average

#: phase columns of the table, in step order (TRL's side fills generate, reward, train and other; an async
#: run's trainer waits for its batch in wait_rollout)
PHASE_COLUMNS = ("generate", "wait_rollout", "reward", "reference", "critic", "actor_logprob", "train", "weight_sync",
                 "other")
SIDES = ("trl", "grpo", "grpo-async", "grpo-async-k4", "ppo", "grpo-eval")
#: our sides: result name, advantage estimator, --rollout.mode (grpo-eval: grpo with held-out evaluation on)
OURS = {"grpo": ("ours-grpo", "grpo", "sync"), "grpo-async": ("ours-grpo-async", "grpo", "async"),
        "grpo-async-k4": ("ours-grpo-async-k4", "grpo", "async"),
        "ppo": ("ours-ppo", "gae", "sync"), "grpo-eval": ("ours-grpo-eval", "grpo", "sync")}
#: --rollout.max_staleness of the async sides (above 1 with --train.decoupled_loss)
MAX_STALENESS = {"grpo-async": 1, "grpo-async-k4": 4}
#: the table's row order
ROW_ORDER = ("ours-grpo", "ours-grpo-eval", "ours-grpo-async", "ours-grpo-async-k4", "ours-ppo", "trl-grpo")
#: --length-mix long-tail: the characters that stop a completion are picked from these, in order (no digit: the
#: reward counts digits)
TAIL_STOP_CHARS = "~`|^"
#: the evaluation overhead may exceed the evaluation's share of generated tokens by this much
EVAL_OVERHEAD_SLACK = 0.10
#: TRL's ``per_device_train_batch_size`` values the search tries (those that divide the step's samples)
TRL_MICRO_BATCHES = (8, 16, 32, 64)
#: the line prefix the TRL process puts before its JSON result (the rest of its stdout is TRL's)
RESULT_MARKER = "E2E_TRL_RESULT "
#: this module's import name (``__name__`` is ``__main__`` when it runs as a script)
MODULE = "rlhf_sg.bench.e2e"
#: the end-of-sequence token added to the tokenizer, past the model's vocabulary
END_TOKEN = "<end>"

_WORDS = (
    "the", "a", "river", "number", "seven", "write", "count", "list", "small", "green", "quiet", "city",
    "table", "of", "and", "three", "digits", "story", "about", "why", "how", "many", "apples", "train",
    "morning", "sum", "twelve", "ocean", "letter", "short", "answer", "please", "explain", "stone",
)


# ---- the task: prompts and a rule reward ------------------------------------------------------------------


def digit_reward(prompts: list[str], completions: list[str], labels: list) -> list[float]:
    """The fraction of digit characters in each completion: cheap, deterministic, and it varies
    between samples of one prompt, so group advantages are not all zero."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


#: :func:`digit_reward` with TRL's reward-function signature (the plain TRL script's own, so both TRL runs score alike)
trl_digit_reward = _trl_alone.digit_reward


def make_prompts(num_prompts: int, min_chars: int, max_chars: int, seed: int) -> list[str]:
    """Short text prompts of varied lengths in [min_chars, max_chars] (one character is one token)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        target = rng.randint(min_chars, max_chars)
        text = rng.choice(_WORDS).capitalize()
        while len(text) < target:
            text += " " + rng.choice(_WORDS)
        prompts.append(text[: target - 1].rstrip() + ":")
    return prompts


def prepare(tmp: str, args: argparse.Namespace) -> tuple[str, str, int]:
    """Save the model and tokenizer, write the prompt file; returns (model dir, prompt file, parameters)."""
    from rlhf_sg.tiny import build_tiny_model, build_tokenizer

    model = build_tiny_model(args.arch, args.size, seed=args.seed)
    # No EOS anywhere the model could sample it: the model has none, and the tokenizer's is an id
    # past the vocabulary, so every completion runs to max_new_tokens on every side.
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None
    model_path = os.path.join(tmp, "model")
    model.save_pretrained(model_path, safe_serialization=True)
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"eos_token": END_TOKEN})
    if tokenizer.eos_token_id < model.config.vocab_size:
        raise RuntimeError(f"{END_TOKEN} got id {tokenizer.eos_token_id}, inside the model's vocabulary")
    tokenizer.save_pretrained(model_path)
    num_params = sum(p.numel() for p in model.parameters())

    prompt_file = os.path.join(tmp, "prompts.jsonl")
    min_chars, max_chars = (int(x) for x in args.prompt_chars.split(","))
    num_prompts = max(64, args.prompts * (args.warmup + args.steps))
    with open(prompt_file, "w") as f:
        for text in make_prompts(num_prompts, min_chars, max_chars, args.seed):
            f.write(json.dumps({"prompt": text}) + "\n")
    with open(eval_prompt_file(tmp), "w") as f:  # the grpo-eval side's held-out prompts: another seed
        for text in make_prompts(args.eval_prompts, min_chars, max_chars, args.seed + 1):
            f.write(json.dumps({"prompt": text}) + "\n")
    return model_path, prompt_file, num_params


def eval_prompt_file(tmp: str) -> str:
    return os.path.join(tmp, "eval_prompts.jsonl")


# ---- results ----------------------------------------------------------------------------------------------


@dataclass
class SideResult:
    """The measured steps of one side: seconds per step, seconds per phase per step, response lengths and mean
    rewards; ``trajectories``: each run's mean reward per step, warm-up steps included (one list per round)."""

    name: str
    samples_per_step: int
    step_s: list[float] = field(default_factory=list)
    phase_s: dict[str, list[float]] = field(default_factory=dict)
    response_len: list[float] = field(default_factory=list)
    reward: list[float] = field(default_factory=list)
    trajectories: list[list[float]] = field(default_factory=list)
    threads: str = ""
    wall_s: float = 0.0
    #: tokens generated by the measured steps' rollouts and by the evaluations that ran within them
    generated_tokens: float = 0.0
    eval_tokens: float = 0.0
    #: per measured step, its ``perf/*`` accounting (:mod:`rlhf_sg.flops`), and the ceiling it is held to
    perf: list[dict[str, float]] = field(default_factory=list)
    ceiling: str = ""
    #: per measured step, the ceiling its ``perf/*`` were computed against: (TFLOP/s, GB/s) per rank, the reading
    #: its process took (None: none); :func:`hold_to_ceiling` rescales them to the bench's held ceiling
    step_ceilings: list[tuple[float, float] | None] = field(default_factory=list)
    #: torch threads per rank the side computes with (the ceiling is measured with as many)
    rank_threads: int = 0
    #: async sides, over the measured steps: the largest sample staleness and the mean token staleness per step
    staleness_max: list[float] = field(default_factory=list)
    token_staleness_mean: list[float] = field(default_factory=list)

    def add_step(self, seconds: float, phases: dict[str, float], response_len: float,
                 reward: float = float("nan"), perf: dict[str, float] | None = None,
                 ceiling: tuple[float, float] | None = None) -> None:
        self.perf.append(dict(perf or {}))
        self.step_ceilings.append(ceiling)
        self.step_s.append(seconds)
        for name, value in phases.items():
            self.phase_s.setdefault(name, []).append(value)
        self.response_len.append(response_len)
        self.reward.append(reward)

    def merge(self, other: SideResult) -> None:
        """Pool ``other``'s measured steps and reward trajectories (another round of the same side) into these."""
        for i, seconds in enumerate(other.step_s):
            self.add_step(seconds, {p: v[i] for p, v in other.phase_s.items()}, other.response_len[i],
                          other.reward[i], other.perf[i] if i < len(other.perf) else None,
                          other.step_ceilings[i] if i < len(other.step_ceilings) else None)
        self.ceiling = self.ceiling or other.ceiling
        self.rank_threads = self.rank_threads or other.rank_threads
        self.trajectories += other.trajectories
        self.wall_s += other.wall_s
        self.generated_tokens += other.generated_tokens
        self.eval_tokens += other.eval_tokens

    @property
    def mean_step_s(self) -> float:
        return statistics.mean(self.step_s)

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_s)

    @property
    def samples_per_s(self) -> float:
        """Samples over the mean step."""
        return self.samples_per_step / self.mean_step_s

    @property
    def median_samples_per_s(self) -> float:
        """Samples over the median step (steps slowed by other work on the machine weigh less)."""
        return self.samples_per_step / self.median_step_s

    def mean_perf(self, key: str) -> float | None:
        """The mean of a ``perf/*`` metric over the measured steps that logged it (None: none did)."""
        values = [p[key] for p in self.perf if key in p]
        return statistics.mean(values) if values else None

    def share(self, phase: str) -> float | None:
        """The phase's share of the mean step, or None where this side has no such phase."""
        if not any(self.phase_s.get(phase, ())):
            return None
        return sum(self.phase_s[phase]) / sum(self.step_s)

    def mean_trajectory(self) -> list[float]:
        """Mean reward per step over the runs (rounds), as far as every run went."""
        if not self.trajectories:
            return []
        steps = min(len(t) for t in self.trajectories)
        return [statistics.mean(t[k] for t in self.trajectories) for k in range(steps)]


def ratio_line(numerator: SideResult, denominator: SideResult, note: str) -> str:
    """The printed ratio of two sides' samples/s (above 1: the numerator's side is faster): over the median step of
    each side, then over the mean step of each (the same statistic on both sides of each ratio)."""
    median = numerator.median_samples_per_s / denominator.median_samples_per_s
    mean = numerator.samples_per_s / denominator.samples_per_s
    return f"ratio {numerator.name} / {denominator.name} samples/s: {median:.2f} median, {mean:.2f} mean ({note})"


#: the accounting table's columns: (perf metric, header, scale, format)
PERF_COLUMNS = (
    ("perf/generate_tokens_per_s", "gen tok/s", 1.0, "{:>9.0f}"),
    ("perf/generate_GBps", "gen GB/s", 1.0, "{:>8.2f}"),
    ("perf/generate_of_peak_bw", "gen %bw", 100.0, "{:>7.1f}%"),
    ("perf/generate_of_roofline", "gen %roof", 100.0, "{:>9.1f}%"),
    ("perf/reference_of_peak", "ref %pk", 100.0, "{:>7.1f}%"),
    ("perf/critic_of_peak", "crit %pk", 100.0, "{:>7.1f}%"),
    ("perf/actor_logprob_of_peak", "logp %pk", 100.0, "{:>7.1f}%"),
    ("perf/train_TFLOPs", "train TF/s", 1.0, "{:>10.4f}"),
    ("perf/train_of_peak", "train %pk", 100.0, "{:>8.1f}%"),
    ("perf/weight_sync_GBps", "sync GB/s", 1.0, "{:>9.3f}"),
    ("perf/weight_sync_over_engine_load", "sync/load", 1.0, "{:>9.2f}"),
)


def perf_lines(results: list[SideResult]) -> list[str]:
    """Each side's phases against its ceiling, means over the measured steps (README: "Each phase against the
    machine's limit"), and the ceiling each side is held to."""
    columns = [c for c in PERF_COLUMNS if any(r.mean_perf(c[0]) is not None for r in results)]
    if not columns:
        return []
    lines = ["each phase against the ceiling (means over measured steps; %pk: model FLOP/s over the matmul ceiling "
             "x ranks; %bw: bytes read over the bandwidth ceiling x engines):",
             f"{'side':<16} " + " ".join(f"{header:>{max(len(header), 8)}}" for _, header, _, _ in columns)]
    for r in results:
        cells = []
        for key, header, scale, fmt in columns:
            value = r.mean_perf(key)
            width = max(len(header), 8)
            cells.append(f"{'-':>{width}}" if value is None else f"{fmt.format(scale * value):>{width}}")
        lines.append(f"{r.name:<16} " + " ".join(cells))
    lines += [f"  ceiling of {r.name}: {r.ceiling}" for r in results if r.ceiling]
    return lines


def remeasure_ceilings(shape, results: list[SideResult]) -> dict[int, tuple[float, float]]:
    """The ceiling measured again by the bench once every side has finished (their processes gone): ``{threads:
    (TFLOP/s, GB/s)}`` for each thread count a side computed with. Not the per-process cached reading."""
    from rlhf_sg.flops import measure_cpu_ceiling

    out = {}
    for threads in sorted({r.rank_threads for r in results if r.rank_threads and any(r.step_ceilings)}):
        c = measure_cpu_ceiling.__wrapped__(shape, "float32", threads)
        out[threads] = (c.tflops, c.gbs)
    return out


def hold_to_ceiling(results: list[SideResult], remeasured: dict[int, tuple[float, float]]) -> list[str]:
    """Hold every side to one ceiling: per thread count, the highest of every reading the sides' processes took
    (each measures once, at its start, when the last side's processes may still be exiting, or another process
    loads the machine) and ``remeasured`` (the bench's own, after the sides: ``{threads: (TFLOP/s, GB/s)}``).
    A low reading makes a phase look closer to the machine's limit than it is; the highest is what the machine
    did. Rescales each step's ``*_of_peak``, ``*_of_peak_bw`` and ``generate_of_roofline`` in place; returns the
    report's lines."""
    held: dict[int, list[float]] = {}
    readings: dict[int, list[str]] = {}
    for r in results:
        for figures in r.step_ceilings:
            if figures is None:
                continue
            best = held.setdefault(r.rank_threads, [0.0, 0.0])
            best[0], best[1] = max(best[0], figures[0]), max(best[1], figures[1])
        seen = sorted({f[0] for f in r.step_ceilings if f is not None})
        if seen:
            readings.setdefault(r.rank_threads, []).append(f"{r.name} {'/'.join(f'{x:.3g}' for x in seen)}")
    for threads, (tflops, gbs) in remeasured.items():
        if threads in held:
            best = held[threads]
            best[0], best[1] = max(best[0], tflops), max(best[1], gbs)
            readings[threads].append(f"the bench after the sides {tflops:.3g}")
    for r in results:
        target = held.get(r.rank_threads)
        for perf, figures in zip(r.perf, r.step_ceilings):
            if target is None or figures is None:
                continue
            own_tf, own_gbs = figures
            for key in list(perf):
                if key.endswith("_of_peak"):
                    perf[key] *= own_tf / target[0]
                elif key.endswith("_of_peak_bw"):
                    perf[key] *= own_gbs / target[1]
            if "perf/generate_of_roofline" in perf and "perf/generate_GBps" in perf and "perf/generate_TFLOPs" in perf:
                gbps, tfs = perf["perf/generate_GBps"], perf["perf/generate_TFLOPs"]
                own = max(gbps / own_gbs, tfs / own_tf)
                if own > 0:
                    perf["perf/generate_of_roofline"] *= max(gbps / target[1], tfs / target[0]) / own
    return [f"  every side at {threads} thread(s) per rank is held to {tf:.3g} TFLOP/s and {gbs:.4g} GB/s, the highest "
            f"reading (TFLOP/s: {', '.join(readings.get(threads, []))})" for threads, (tf, gbs) in sorted(held.items())]


def eval_overhead_line(evaluated: SideResult, plain: SideResult) -> str:
    """The wall time held-out evaluation adds to training (same measured steps, pooled), against the evaluation's
    share of generated tokens plus :data:`EVAL_OVERHEAD_SLACK`: generation costs about the same per token
    whether it trains or evaluates, and an evaluation does nothing else but score."""
    if not evaluated.eval_tokens:
        return (f"evaluation overhead: no evaluation ran in {evaluated.name}'s measured steps; measure at least "
                "--eval-interval steps")
    overhead = sum(evaluated.step_s) / len(evaluated.step_s) / (sum(plain.step_s) / len(plain.step_s)) - 1
    token_ratio = evaluated.eval_tokens / evaluated.generated_tokens
    bound = token_ratio + EVAL_OVERHEAD_SLACK
    return (f"evaluation overhead: wall time per step +{100 * overhead:.1f} % ({evaluated.name} over {plain.name}), "
            f"evaluation / training generated tokens {100 * token_ratio:.1f} %, bound {100 * bound:.1f} %: "
            f"{'within' if overhead <= bound else 'OVER'}")


def reward_lines(results: list[SideResult]) -> list[str]:
    """Each side's mean reward per step (warm-up steps included, averaged over rounds): step k has trained on k
    batches, so the columns compare the sides at equal samples."""
    lines = []
    for r in results:
        trajectory = r.mean_trajectory()
        if trajectory:
            cells = " ".join(f"{x:.4f}" for x in trajectory)
            lines.append(f"  {r.name:<16} {cells}")
    if not lines:
        return []
    samples = results[0].samples_per_step
    return [f"reward per step (mean over the step's samples; step k after k x {samples} samples):"] + lines


# ---- TRL's settings ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrlSetting:
    """One setting of TRL's knobs: ``per_device_train_batch_size``, ``gradient_accumulation_steps``,
    ``gradient_checkpointing`` and ``torch_compile`` (transformers' Trainer compiles the model it trains). TRL's
    ``steps_per_generation`` defaults to the accumulation, so the generation batch is ``micro_batch x
    accumulation`` completions, generated at once, and one optimizer step trains on all of them: every setting
    with the same product does the same work."""

    micro_batch: int
    accumulation: int
    checkpointing: bool
    compile: bool = False

    @property
    def knobs(self) -> list:
        """What the TRL processes take: [micro_batch, accumulation, checkpointing, compile]."""
        return [self.micro_batch, self.accumulation, self.checkpointing, self.compile]

    @property
    def samples(self) -> int:
        return self.micro_batch * self.accumulation

    @property
    def flag(self) -> str:
        """The setting as ``--trl-setting`` takes it."""
        flag = f"{self.micro_batch},{self.accumulation},{'on' if self.checkpointing else 'off'}"
        return flag + (",compile" if self.compile else "")

    def describe(self) -> str:
        return (f"per_device_train_batch_size {self.micro_batch} x gradient_accumulation_steps {self.accumulation}, "
                f"gradient_checkpointing {'on' if self.checkpointing else 'off'}, "
                f"torch_compile {'on' if self.compile else 'off'}")


def trl_settings(samples: int, micro_batches: tuple[int, ...] = TRL_MICRO_BATCHES) -> list[TrlSetting]:
    """The settings the search tries for ``samples`` samples an optimizer step: every micro-batch size of
    ``micro_batches`` that divides ``samples`` (none does: the whole batch as one), with the accumulation that
    makes up ``samples``, checkpointing off, then the same with it on."""
    sizes = [mb for mb in micro_batches if 0 < mb <= samples and samples % mb == 0] or [samples]
    return [TrlSetting(mb, samples // mb, checkpointing) for checkpointing in (False, True) for mb in sizes]


_SWITCH = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}


def parse_trl_setting(text: str, samples: int) -> TrlSetting:
    """``--trl-setting MB,ACCUM,on|off[,compile]`` as a :class:`TrlSetting`; ``MB x ACCUM`` must be the step's
    samples."""
    parts = [p.strip().lower() for p in text.split(",")]
    usage = "give micro_batch,accumulation,checkpointing[,compile], e.g. --trl-setting 8,8,off or 16,4,off,compile"
    if len(parts) not in (3, 4) or parts[2] not in _SWITCH or parts[3:] not in ([], ["compile"]):
        raise ValueError(f"--trl-setting {text!r}: {usage}")
    try:
        micro_batch, accumulation = int(parts[0]), int(parts[1])
    except ValueError:
        raise ValueError(f"--trl-setting {text!r}: micro_batch and accumulation must be integers; {usage}") from None
    if micro_batch < 1 or accumulation < 1 or micro_batch * accumulation != samples:
        raise ValueError(
            f"--trl-setting {text!r}: {micro_batch} x {accumulation} samples an optimizer step, but a step has "
            f"{samples} (--prompts x --samples); choose the two so their product is {samples}"
        )
    return TrlSetting(micro_batch, accumulation, _SWITCH[parts[2]], compile=len(parts) == 4)


def fastest_setting(probes: list[tuple[TrlSetting, float | None]]) -> TrlSetting:
    """The setting with the least seconds a step (None: it failed); the earlier one of a tie."""
    finished = [(setting, seconds) for setting, seconds in probes if seconds is not None]
    if not finished:
        tried = ", ".join(setting.flag for setting, _ in probes) or "none"
        raise RuntimeError(f"trl search: no setting finished a step (tried {tried}); see the TRL output above, or "
                           "pin one with --trl-setting")
    return min(finished, key=lambda pair: pair[1])[0]


def search_lines(probes: list[tuple[TrlSetting, float | None]], kept: TrlSetting) -> list[str]:
    """The search's report: every setting's seconds a step, the one kept marked."""
    lines = []
    for setting, seconds in probes:
        time_s = "failed" if seconds is None else f"{seconds:6.2f} s/step"
        mark = "  <- kept" if setting == kept else ""
        lines.append(f"  trl {setting.flag:<10} {time_s}{mark}")
    return lines


# ---- our trainer --------------------------------------------------------------------------------------------


def _torch_threads(_actor_instance: Any) -> int:
    """Run inside a Ray actor through ``__ray_call__``: the torch threads it computes with."""
    return torch.get_num_threads()


def tail_stop_ids(count: int) -> list[int]:
    """--length-mix long-tail: the ids of the first ``count`` characters of :data:`TAIL_STOP_CHARS`."""
    from rlhf_sg.tiny import char_vocab

    if not 1 <= count <= len(TAIL_STOP_CHARS):
        raise ValueError(f"--tail-stop-ids must be in [1, {len(TAIL_STOP_CHARS)}], got {count}")
    vocab = char_vocab()
    return [vocab[ch] for ch in TAIL_STOP_CHARS[:count]]


def make_config(algo: str, args: argparse.Namespace, model_path: str, prompt_file: str, out: str,
                mode: str = "sync", max_staleness: int = 1):
    from rlhf_sg.config import Config

    cfg = Config()
    cfg.model.pretrain = model_path
    cfg.model.attn_implementation = "sdpa"
    cfg.data.prompt_data = prompt_file
    cfg.rollout.backend = args.backend
    cfg.rollout.prompts_per_step = args.prompts
    cfg.rollout.n_samples_per_prompt = args.samples
    cfg.rollout.max_new_tokens = args.max_new_tokens
    cfg.rollout.temperature = 1.0
    if mode != "sync":
        if not hasattr(cfg.rollout, "mode"):
            raise RuntimeError("grpo-async: this rlhf_sg has no --rollout.mode (RolloutConfig.mode); drop the "
                               "side from --sides")
        cfg.rollout.mode = mode
        cfg.rollout.partial_rollout = True
        cfg.rollout.max_staleness = max_staleness
        cfg.train.decoupled_loss = max_staleness > 1
    cfg.rollout.stop_token_ids = list(args.stop_token_ids)
    cfg.train.advantage_estimator = algo
    if args.actor_ranks is not None:
        cfg.train.actor_num_ranks = args.actor_ranks
    cfg.train.kl_coef = 0.0 if algo == "grpo" else 0.01
    cfg.train.actor_lr = args.lr
    cfg.train.critic_lr = args.critic_lr
    cfg.train.max_steps = args.warmup + args.steps
    cfg.train.seed = args.seed
    if args.worker_threads is not None:
        cfg.train.worker_threads = args.worker_threads
    cfg.train.share_prompts = args.share_prompts
    cfg.model.fused_kernels = args.fused_kernels
    cfg.rollout.engine_threads = args.engine_threads
    cfg.reward.kind = "function"
    cfg.reward.function = f"{MODULE}:digit_reward"
    cfg.log.output_dir = out
    cfg.log.tensorboard = False
    cfg.log.progress_bar = False
    cfg.log.export_hf = False
    return cfg


def apply_placement(args: argparse.Namespace, cores: int) -> None:
    """Our sides' ranks and threads (a flag given explicitly wins). ``split``: the engine on one Ray CPU with one
    thread, the actor one rank with one thread. ``shared``: the CPU is one device, so the actor is one ZeRO-3 rank
    (no collectives between ranks) and, as the step's phases take turns, its rank and the engine each compute
    with every core (the engine's count is the product's default)."""
    if args.placement == "split":
        for name in ("actor_ranks", "worker_threads", "engine_threads"):
            if getattr(args, name) is None:
                setattr(args, name, 1)
        return
    if args.actor_ranks is None:
        args.actor_ranks = 1
    if args.worker_threads is None:
        args.worker_threads = max(1, cores // args.actor_ranks)


def run_ours(side: str, args: argparse.Namespace, model_path: str, prompt_file: str, out: str) -> SideResult:
    """Set up our trainer, run the warm-up steps, time the measured ones, shut everything down. A step's time is
    the wall clock around its ``train_step()`` call (async rollout overlaps generation with the step before,
    outside the trainer's ``time/step``)."""
    import ray

    from rlhf_sg.trainer import PPOTrainer

    name, estimator, mode = OURS[side]
    cfg = make_config(estimator, args, model_path, prompt_file, os.path.join(out, name), mode=mode,
                      max_staleness=MAX_STALENESS.get(side, 1))
    if side == "grpo-eval":  # held-out evaluation inside the measured steps, none before or after them
        cfg.eval.prompt_data = eval_prompt_file(os.path.dirname(prompt_file))
        cfg.eval.interval, cfg.eval.n_samples = args.eval_interval, args.eval_samples
        cfg.eval.before_train = cfg.eval.after_train = False
        cfg.eval.threshold = 0.5
    if args.profile_dir is not None:  # the first measured step's traces and the run's metrics, kept after the bench
        cfg.log.output_dir = os.path.join(args.profile_dir, name)
        cfg.log.profile_step = args.warmup
    result = SideResult(name, args.prompts * args.samples)
    trajectory: list[float] = []
    start = time.perf_counter()
    trainer = PPOTrainer(cfg, reward_fn=digit_reward)
    try:
        trainer.setup()
        result.threads = _describe_ours_threads(trainer)
        accounting = getattr(trainer, "accounting", None)  # None: --perf.accounting off
        ceiling = accounting.ceiling if accounting else None
        result.ceiling = f"{ceiling.describe()} per rank" if ceiling else ""
        figures = (ceiling.tflops, ceiling.gbs) if ceiling else None
        result.rank_threads = cfg.train.worker_threads or 0
        for _ in range(args.warmup):
            trajectory.append(trainer.train_step()["reward/mean"])
        for _ in range(args.steps):
            t0 = time.perf_counter()
            metrics = trainer.train_step()
            seconds = time.perf_counter() - t0
            phases = {k[len("time/"):]: v for k, v in metrics.items() if k.startswith("time/") and k != "time/step"}
            if "generate" not in phases and "rollout_time/generate" in metrics:
                # async: the batch was generated beside the step before; its generation time overlaps training
                phases["generate"] = metrics["rollout_time/generate"]
            result.add_step(seconds, phases, metrics["rollout/response_len"], metrics["reward/mean"],
                            {k: v for k, v in metrics.items() if k.startswith("perf/")}, figures)
            result.generated_tokens += metrics["rollout/response_len"] * result.samples_per_step
            if "eval/response_len" in metrics:  # an evaluation ran after this step, inside its wall time
                result.eval_tokens += metrics["eval/response_len"] * metrics["eval/prompts"] * args.eval_samples
            trajectory.append(metrics["reward/mean"])
            if "rollout/staleness_max" in metrics:
                result.staleness_max.append(metrics["rollout/staleness_max"])
                result.token_staleness_mean.append(metrics.get("rollout/token_staleness_mean", float("nan")))
    finally:
        trainer.shutdown()
        ray.shutdown()
        # Ray's node processes and workers outlive ray.shutdown() by seconds: the next side (TRL's process, or
        # ours) must not start while they still use the cores
        left = wait_for_children(60.0)
        if left:
            print(f"  {name}: {left} process(es) of its Ray instance still ran 60 s after shutdown", flush=True)
    result.trajectories.append(trajectory)
    result.wall_s = time.perf_counter() - start
    return result


def wait_for_children(timeout_s: float) -> int:
    """Wait until every process this one started has exited, at most ``timeout_s``; returns how many still run."""
    import psutil

    children = psutil.Process().children(recursive=True)
    _, alive = psutil.wait_procs(children, timeout=timeout_s)
    return len(alive)


def _describe_ours_threads(trainer) -> str:
    import ray

    parts = []
    engines = ray.get([e.__ray_call__.remote(_torch_threads) for e in trainer.engines])
    parts.append(f"{len(engines)} engine x {engines[0]} thread(s)")
    cluster = trainer.cluster
    for role, group in (("actor", cluster.actor), ("critic", cluster.critic), ("ref", cluster.ref)):
        if group is not None:
            threads = ray.get([w.__ray_call__.remote(_torch_threads) for w in group.workers])
            parts.append(f"{role} {len(threads)} rank(s) x {max(threads)} thread(s)")
    parts.append(f"driver {torch.get_num_threads()} thread(s)")
    return ", ".join(parts)


# ---- TRL's GRPOTrainer, in its own process ------------------------------------------------------------------


def _trl_spec(args: argparse.Namespace, model_path: str, prompt_file: str, output_dir: str,
              steps: int) -> dict[str, Any]:
    """What both TRL runs (the bench's TRL side and TRL alone) are given: the model, the prompts, the work, the
    threads and the seed."""
    return {"model_path": model_path, "prompt_file": prompt_file, "output_dir": output_dir, "samples": args.samples,
            "max_new_tokens": args.max_new_tokens, "lr": args.lr, "warmup": args.warmup, "steps": steps,
            "threads": args.trl_threads, "seed": args.seed}


def _trl_env(args: argparse.Namespace) -> dict[str, str]:
    """Both TRL processes' environment: ``--trl-threads`` OpenMP threads, no tokenizer threads, no GPU."""
    return dict(os.environ, OMP_NUM_THREADS=str(args.trl_threads), TOKENIZERS_PARALLELISM="false",
                CUDA_VISIBLE_DEVICES="")


def run_trl(args: argparse.Namespace, model_path: str, prompt_file: str, out: str, settings: list[TrlSetting],
            steps: int) -> list[tuple[TrlSetting, SideResult | None]]:
    """Run :func:`_trl_child` in a fresh Python process: each of ``settings`` in turn, a fresh model and trainer
    each, ``args.warmup`` untimed and ``steps`` timed steps.
    Returns each setting's result, None for one that failed (the reason printed); all None if the process
    failed."""
    spec = {**_trl_spec(args, model_path, prompt_file, os.path.join(out, "trl"), steps), "prompts": args.prompts,
            "settings": [s.knobs for s in settings]}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", MODULE, "--trl-child", json.dumps(spec)],
        env=_trl_env(args), capture_output=True, text=True, check=False,
    )
    wall = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        print(f"trl: the TRL process failed (exit {proc.returncode}); its last lines:\n{tail}", flush=True)
        return [(setting, None) for setting in settings]
    payload = json.loads(lines[-1][len(RESULT_MARKER):])
    results: list[tuple[TrlSetting, SideResult | None]] = []
    for setting, run in zip(settings, payload["runs"]):
        if run.get("error"):
            print(f"trl {setting.flag}: failed: {run['error']}", flush=True)
            results.append((setting, None))
            continue
        result = SideResult("trl-grpo", args.prompts * args.samples, threads=payload["threads"],
                            wall_s=wall / len(settings), ceiling=payload.get("ceiling", ""),
                            rank_threads=args.trl_threads)
        shape, ceiling = _trl_shape_and_ceiling(model_path, payload)
        for step in run["steps"]:
            result.add_step(step["seconds"], step["phases"], step["response_len"], step["reward"],
                            trl_perf(shape, ceiling, step), (ceiling.tflops, ceiling.gbs) if ceiling else None)
        result.trajectories.append(run["rewards"])
        results.append((setting, result))
    return results


def run_trl_alone(args: argparse.Namespace, model_path: str, prompt_file: str, out: str, setting: TrlSetting,
                  steps: int, timeout_s: float = 3600.0) -> list[float] | None:
    """TRL alone: :mod:`rlhf_sg.bench._trl_alone` run by path, a plain script importing nothing of this project, on
    the bench's model, prompts and ``setting`` with the TRL side's threads and environment; each timed step's
    seconds, None if it failed (its last lines printed)."""
    spec = {**_trl_spec(args, model_path, prompt_file, os.path.join(out, "trl-alone"), steps),
            "setting": setting.knobs}
    try:
        proc = subprocess.run([sys.executable, _trl_alone.__file__, json.dumps(spec)], env=_trl_env(args),
                              capture_output=True, text=True, check=False, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"trl alone: the plain TRL script did not finish within {timeout_s:.0f} s", flush=True)
        return None
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_trl_alone.RESULT_MARKER)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        print(f"trl alone: the plain TRL script failed (exit {proc.returncode}); its last lines:\n{tail}", flush=True)
        return None
    return [float(x) for x in json.loads(lines[-1][len(_trl_alone.RESULT_MARKER):])["steps"]]


def baseline_line(bench_steps: list[float], alone_steps: list[float], tolerance: float = 0.05) -> str:
    """Whether the bench's TRL side runs as TRL does for a user: its median step against the plain script's, run
    with the same setting in the same rounds. Outside ``tolerance`` the ratios against TRL measure the bench's TRL
    side, not TRL."""
    bench, alone = statistics.median(bench_steps), statistics.median(alone_steps)
    ratio = bench / alone
    within = abs(ratio - 1.0) <= tolerance
    pct = f"{100 * tolerance:.0f} %"
    verdict = (f"within {pct}: the ratios against TRL below are against TRL as its users run it" if within
               else f"NOT within {pct}: the ratios against TRL below measure the bench's TRL side, not TRL")
    return (f"baseline: the bench's TRL side {bench:.2f} s a step (median of {len(bench_steps)}) against TRL alone "
            f"{alone:.2f} s (a plain script, `python rlhf_sg/bench/_trl_alone.py`, median of {len(alone_steps)}): "
            f"{ratio:.3f}x, {verdict}")


def alone_ratio_lines(ours: SideResult, ours_by_round: list[list[float]], alone_by_round: list[list[float]]
                      ) -> list[str]:
    """Our side against TRL alone (the plain script), samples/s over median steps: in each round (the two run one
    after the other, so they meet the same machine) and pooled; the median of the rounds' ratios is the figure
    (the rounds alternate the order of the sides)."""
    per_round = [statistics.median(a) / statistics.median(o)
                 for o, a in zip(ours_by_round, alone_by_round) if o and a]
    if not per_round:
        return []
    pooled = statistics.median([s for a in alone_by_round for s in a]) / ours.median_step_s
    return [f"ratio {ours.name} / TRL alone samples/s: {statistics.median(per_round):.2f} median of {len(per_round)} "
            f"round(s) ({', '.join(f'{r:.2f}' for r in per_round)}); pooled medians {pooled:.2f} (TRL alone: the "
            f"plain script at the kept setting, run in the same rounds)"]


def _trl_shape_and_ceiling(model_path: str, payload: dict[str, Any]):
    """The bench model's shape (float32, as TRL runs it) and the ceiling the TRL process measured."""
    import dataclasses

    from rlhf_sg.flops import Ceiling
    from rlhf_sg.memory import load_shape

    shape = dataclasses.replace(load_shape(model_path), dtype="float32")
    c = payload.get("ceiling_figures")
    return shape, (Ceiling(c[0], c[1], payload.get("ceiling", "")) if c else None)


def trl_perf(shape, ceiling, step: dict[str, Any]) -> dict[str, float]:
    """TRL's step against the ceiling, from what it generated and trained: each completion with its prompt as one
    sequence (TRL shares no prompt), the lm_head at the completion's tokens; training 3 x that forward (TRL runs no
    separate old-log-prob forward with ``num_iterations=1`` and no reference model with ``beta=0``); generation's
    bytes as for ours, on one process (``engines=1``)."""
    from rlhf_sg import flops

    prompts, completions = step.get("prompt_lens", []), step.get("completion_lens", [])
    if not completions:
        return {}
    segments = [flops.Segment(p, (r,)) for p, r in zip(prompts, completions)]
    return flops.phase_metrics(ceiling, step["phases"], {"train": (flops.train_flops(shape, segments), 1)},
                               generated_tokens=sum(completions),
                               generate_bytes=flops.decode_bytes(shape, prompts, completions, 1),
                               generate_flops=flops.decode_flops(shape, prompts, completions))


def search_trl(args: argparse.Namespace, model_path: str, prompt_file: str, out: str) -> TrlSetting:
    """TRL's fastest setting for this work: every :func:`trl_settings` setting for ``--trl-probe-steps`` timed steps
    after its own warm-up, in one process; prints each one's time and the one kept."""
    settings = trl_settings(args.prompts * args.samples)
    print(f"trl search: {len(settings)} settings, {args.warmup} warm-up and {args.trl_probe_steps} timed step(s) "
          f"each, in one process; load average {load_average()}", flush=True)
    start = time.perf_counter()
    runs = run_trl(args, model_path, prompt_file, os.path.join(out, "trl-search"), settings, args.trl_probe_steps)
    probes = [(setting, None if r is None else r.mean_step_s) for setting, r in runs]
    kept = fastest_setting(probes)
    # then the fastest with the Trainer's torch_compile (our side compiles its fused kernels when it is asked to):
    # a process of its own, as a user would run it, with its warm-up paying the compile
    compiled = dataclasses.replace(kept, compile=True)
    runs = run_trl(args, model_path, prompt_file, os.path.join(out, "trl-search-compile"), [compiled],
                   args.trl_probe_steps)
    probes += [(compiled, None if runs[0][1] is None else runs[0][1].mean_step_s)]
    kept = fastest_setting(probes)
    for line in search_lines(probes, kept):
        print(line, flush=True)
    print(f"trl search: keeps {kept.describe()} ({time.perf_counter() - start:.0f} s)", flush=True)
    return kept


class _Clock:
    """Seconds spent inside wrapped callables, per name, since the last reset."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    def reset(self) -> None:
        self.totals = {}

    def wrap(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0

        return timed


def _trl_child(spec: dict[str, Any]) -> None:
    """The TRL side: GRPOTrainer on ``spec``'s model and prompts, once per setting of ``spec["settings"]``
    (micro-batch, accumulation, checkpointing, compile), each with a fresh model; prints one result line as JSON."""
    torch.set_num_threads(spec["threads"])
    import dataclasses

    from rlhf_sg.flops import measure_cpu_ceiling
    from rlhf_sg.memory import load_shape

    ceiling = measure_cpu_ceiling(dataclasses.replace(load_shape(spec["model_path"]), dtype="float32"), "float32",
                                  torch.get_num_threads())
    runs = []
    for micro_batch, accumulation, checkpointing, compile_model in spec["settings"]:
        try:  # each setting's own warm-up: a fresh model and trainer pays its first step's allocations
            runs.append(_trl_run(spec, micro_batch, accumulation, checkpointing, spec["warmup"], compile_model))
        except Exception as e:  # one setting failing (e.g. out of memory) leaves the others to compare
            runs.append({"error": f"{type(e).__name__}: {e}"})
    threads = f"1 process x {torch.get_num_threads()} thread(s)"
    print(RESULT_MARKER + json.dumps({"runs": runs, "threads": threads, "ceiling": ceiling.describe(),
                                      "ceiling_figures": [ceiling.tflops, ceiling.gbs]}), flush=True)


def _trl_run(spec: dict[str, Any], micro_batch: int, accumulation: int, checkpointing: bool,
             warmup: int, compile_model: bool = False) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOConfig, GRPOTrainer

    # AutoTokenizer would attach Qwen2's pre-tokenizer to the character tokenizer and drop spaces.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(spec["model_path"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32, attn_implementation="sdpa")
    with open(spec["prompt_file"]) as f:
        dataset = Dataset.from_list([{"prompt": json.loads(line)["prompt"]} for line in f if line.strip()])

    clock = _Clock()
    model.generate = clock.wrap("generate", model.generate)
    timed_reward = clock.wrap("reward", trl_digit_reward)
    lengths: dict[str, list[int]] = {"prompt_lens": [], "completion_lens": []}

    def reward(prompts, completions, completion_ids=None, **kwargs):
        # what this step generated and trains on, in tokens (the prompts as TRL tokenised them for generate)
        lengths["prompt_lens"] += [len(tokenizer(p, add_special_tokens=False).input_ids) for p in prompts]
        lengths["completion_lens"] += [len(ids) for ids in completion_ids or []]
        return timed_reward(prompts, completions, **kwargs)

    reward.__name__ = trl_digit_reward.__name__
    config = GRPOConfig(**_trl_alone.grpo_config_kwargs(spec, micro_batch, accumulation, checkpointing, warmup,
                                                        compile_model))
    if config.generation_batch_size != spec["prompts"] * spec["samples"]:
        raise RuntimeError(f"TRL's generation batch is {config.generation_batch_size} completions, not "
                           f"{spec['prompts'] * spec['samples']}: the setting does not do the bench's work")
    steps: list[dict[str, Any]] = []
    logged: dict[int, dict[str, float]] = {}

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.reset()
            lengths["prompt_lens"], lengths["completion_lens"] = [], []
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds = time.perf_counter() - self.t0
            inside = dict(clock.totals)
            rollout = inside.get("rollout", 0.0)
            generate, reward_s = inside.get("generate", 0.0), inside.get("reward", 0.0)
            phases = {"generate": generate, "reward": reward_s, "other": max(0.0, rollout - generate - reward_s),
                      "train": max(0.0, seconds - rollout)}
            steps.append({"step": state.global_step, "seconds": seconds, "phases": phases, **lengths})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                logged[state.global_step] = {"reward": float(logs["reward"]),
                                             "response_len": float(logs.get("completions/mean_length", "nan"))}

    trainer = GRPOTrainer(
        model=model, reward_funcs=[reward], args=config, train_dataset=dataset, processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer._generate_and_score_completions = clock.wrap("rollout", trainer._generate_and_score_completions)
    trainer.train()
    nan = {"reward": float("nan"), "response_len": float("nan")}
    for step in steps:
        step.update(logged.get(step["step"], nan))
    return {"steps": steps[warmup:], "rewards": [step["reward"] for step in steps]}


# ---- the table ----------------------------------------------------------------------------------------------


def table_phases(results: list[SideResult]) -> list[str]:
    """The phase columns: :data:`PHASE_COLUMNS`, then any other phase a side reported, in first-seen order."""
    extra = [p for r in results for p in r.phase_s if p not in PHASE_COLUMNS]
    return list(PHASE_COLUMNS) + list(dict.fromkeys(extra))


def print_table(results: list[SideResult]) -> None:
    short = {"actor_logprob": "act_logp", "weight_sync": "w_sync", "reference": "ref", "wait_rollout": "wait_rol",
             "wait_generate": "wait_gen"}
    phases = [p for p in table_phases(results) if any(r.share(p) is not None for r in results)]
    head = f"{'side':<16} {'samples/s':>9} {'s/step':>7} {'median':>7} {'resp_len':>8} {'reward':>7}  "
    head += " ".join(f"{short.get(p, p)[:8]:>8}" for p in phases)
    print(head)
    for r in results:
        rewards = [x for x in r.reward if x == x]
        reward = f"{statistics.mean(rewards):>7.4f}" if rewards else f"{'-':>7}"
        row = (f"{r.name:<16} {r.samples_per_s:>9.3f} {r.mean_step_s:>7.2f} {r.median_step_s:>7.2f} "
               f"{statistics.mean(r.response_len):>8.1f} {reward}  ")
        cells = []
        for p in phases:
            share = r.share(p)
            cells.append(f"{'-':>8}" if share is None else f"{100 * share:>7.1f}%")
        print(row + " ".join(cells))


def _trl_missing_hint() -> str:
    return ("trl: not installed, so the baseline is skipped. Install it next to this CPU torch with "
            '`pip install "torch==2.13.0" trl` (pinning torch keeps pip from replacing it).')


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlhf_sg.bench e2e", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sides", default="trl,grpo,ppo", help=f"comma-separated, of {list(SIDES)}, in run order")
    parser.add_argument("--steps", type=int, default=3, help="measured steps of each side (per round)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps of each side before the measured ones")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the sides, order reversed every other round")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompt-chars", default="20,60", help="min,max prompt length in characters (= tokens)")
    parser.add_argument("--length-mix", choices=("fixed", "long-tail"), default="fixed",
                        help="fixed: every completion runs to --max-new-tokens; long-tail (our sides only): "
                             "--tail-stop-ids characters stop a completion, lengths about geometric")
    parser.add_argument("--tail-stop-ids", type=int, default=2,
                        help="long-tail: how many characters stop a completion (mean length about vocabulary / it)")
    parser.add_argument("--size", default="25m", help="tiny model size from rlhf_sg.tiny.SIZES")
    parser.add_argument("--arch", default="qwen2")
    parser.add_argument("--backend", default="hf", help="our rollout backend")
    parser.add_argument("--placement", choices=("shared", "split"), default="shared",
                        help="our sides: shared (1 actor rank; engine and actor each on every core, by turns) or split "
                             "(engine 1 CPU x 1 thread, actor 1 rank x 1 thread: generation and training on separate "
                             "cores)")
    parser.add_argument("--actor-ranks", type=int, default=None,
                        help="our --train.actor_num_ranks (default: the placement's, else the config's)")
    parser.add_argument("--worker-threads", type=int, default=None,
                        help="our --train.worker_threads: torch threads per model-worker rank (default: the "
                             "placement's, else the config's)")
    parser.add_argument("--engine-threads", type=int, default=None,
                        help="our --rollout.engine_threads (default: the placement's, else the product's)")
    parser.add_argument("--fused-kernels", action=argparse.BooleanOptionalAction, default=True,
                        help="our sides' training ranks run their norms, gated-MLP products and rotary embeddings as "
                             "fused kernels "
                             "(--model.fused_kernels; each rank compiles them in its warm-up)")
    parser.add_argument("--share-prompts", action=argparse.BooleanOptionalAction, default=True,
                        help="our sides: the samples of a prompt compute it once in the training forwards")
    parser.add_argument("--eval-interval", type=int, default=10,
                        help="grpo-eval side: evaluate every this many steps (measure at least that many steps)")
    parser.add_argument("--eval-prompts", type=int, default=64, help="grpo-eval side: held-out prompts")
    parser.add_argument("--eval-samples", type=int, default=4, help="grpo-eval side: samples per held-out prompt")
    parser.add_argument("--trl-threads", type=int, default=os.cpu_count() or 1, help="torch threads of TRL's process")
    parser.add_argument("--trl-alone", action=argparse.BooleanOptionalAction, default=True,
                        help="after the bench's TRL side in each round, run TRL as a plain script (rlhf_sg/bench/"
                             "_trl_alone.py) with the same setting and print whether the two agree within 5 %%")
    parser.add_argument("--trl-search", action=argparse.BooleanOptionalAction, default=True,
                        help="try TRL's micro-batch / accumulation / gradient-checkpointing settings first and keep "
                             "the fastest (--no-trl-search: the whole batch in one micro-batch, checkpointing off)")
    parser.add_argument("--trl-setting", default=None, metavar="MB,ACCUM,on|off",
                        help="pin TRL's per_device_train_batch_size, gradient_accumulation_steps and "
                             "gradient_checkpointing (MB x ACCUM = the step's samples); skips the search")
    parser.add_argument("--trl-probe-steps", type=int, default=1, help="timed steps per setting in the TRL search")
    parser.add_argument("--lr", type=float, default=1e-6, help="actor learning rate, both trainers")
    parser.add_argument("--critic-lr", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile-dir", default=None, metavar="DIR",
                        help="our sides: profile the first measured step (--log.profile_step) and keep each side's "
                             "run directory, its metrics.jsonl and its ranks' traces (DIR/SIDE/profile), after the "
                             "bench; the profiler slows that step (`python -m rlhf_sg.bench train-profile` reads it)")
    parser.add_argument("--trl-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.trl_child is not None:
        _trl_child(json.loads(args.trl_child))
        return

    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = [s for s in sides if s not in SIDES]
    if unknown or not sides:
        parser.error(f"--sides: unknown or no side(s) {unknown}; choose from {list(SIDES)}")
    samples = args.prompts * args.samples
    args.stop_token_ids = []
    if args.length_mix == "long-tail":
        if "trl" in sides:
            parser.error("--length-mix long-tail: our sides only (TRL's side stops on its EOS alone); drop trl from "
                         "--sides")
        try:
            args.stop_token_ids = tail_stop_ids(args.tail_stop_ids)
        except ValueError as e:
            parser.error(str(e))
    if args.profile_dir is not None:
        if args.rounds != 1:
            parser.error(f"--profile-dir: one round (--rounds {args.rounds}: each round's run would write over the "
                         "last one's traces)")
        if os.path.isdir(args.profile_dir) and os.listdir(args.profile_dir):
            parser.error(f"--profile-dir {args.profile_dir}: not empty; name a new or empty directory (nothing in "
                         "it is overwritten)")
    pinned = None
    if args.trl_setting is not None:
        try:
            pinned = parse_trl_setting(args.trl_setting, samples)
        except ValueError as e:
            parser.error(str(e))
    if "trl" in sides and importlib.util.find_spec("trl") is None:
        print(_trl_missing_hint(), flush=True)
        sides = [s for s in sides if s != "trl"]
        if not sides:
            return
    apply_placement(args, os.cpu_count() or 1)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Ray starts its workers at nice 15 by default; TRL's process runs at nice 0.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Our trainer starts a Ray instance of its own for each run: never join a cluster already running here.
    os.environ["RAY_ADDRESS"] = "local"

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        model_path, prompt_file, num_params = prepare(tmp, args)
        from rlhf_sg.memory import load_shape

        shape = dataclasses.replace(load_shape(model_path), dtype="float32")
        ours = ", ".join(f"{k} {v}" for k, v in (("actor ranks", args.actor_ranks), ("worker threads",
                         args.worker_threads), ("engine threads", args.engine_threads)) if v is not None)
        print(
            f"e2e: {args.arch}/{args.size} ({num_params / 1e6:.1f}M parameters), {args.prompts} prompts x "
            f"{args.samples} samples x {args.max_new_tokens} new tokens = {samples} samples a step, CPU "
            f"({os.cpu_count()} cores), length mix {args.length_mix}"
            f"{f' (stop ids {args.stop_token_ids})' if args.stop_token_ids else ''}, "
            f"ours: backend {args.backend}, placement {args.placement}"
            f"{' (' + ours + ')' if ours else ''}, shared prompts {'on' if args.share_prompts else 'off'}, "
            f"fused kernels {'on' if args.fused_kernels else 'off'}; "
            f"{args.warmup} warm-up + {args.steps} measured step(s) per side, "
            f"{args.rounds} round(s); load average {load_average()} (other work on the machine slows whichever side it "
            "overlaps)",
            flush=True,
        )
        trl_setting = None
        if "trl" in sides:
            if pinned is not None:
                trl_setting = pinned
            elif args.trl_search:
                trl_setting = search_trl(args, model_path, prompt_file, tmp)
            else:
                trl_setting = TrlSetting(samples, 1, False)
            print(f"trl: {trl_setting.describe()}" + (" (pinned)" if pinned is not None else ""), flush=True)
        results: dict[str, SideResult] = {}
        alone: list[float] = []  # TRL alone's timed steps, every round
        by_round: dict[str, list[list[float]]] = {}  # per side, each round's timed steps (TRL alone as "trl-alone")
        for r in range(args.rounds):
            order = sides if r % 2 == 0 else sides[::-1]
            print(f"round {r + 1}: {' -> '.join(order)}", flush=True)
            for side in order:
                out = os.path.join(tmp, f"round{r}")
                if side == "trl":
                    got = run_trl(args, model_path, prompt_file, out, [trl_setting], args.steps)[0][1]
                    if args.trl_alone:  # right after it, so both TRL runs meet the same machine
                        steps_alone = run_trl_alone(args, model_path, prompt_file, out, trl_setting, args.steps)
                        if steps_alone is not None:
                            alone += steps_alone
                            by_round.setdefault("trl-alone", [[] for _ in range(args.rounds)])[r] = steps_alone
                            print(f"  trl alone: steps {', '.join(f'{s:.2f}' for s in steps_alone)} s", flush=True)
                else:
                    got = run_ours(side, args, model_path, prompt_file, out)
                if got is None:
                    continue
                rewards = " ".join(f"{x:.4f}" for x in got.trajectories[-1])
                if got.staleness_max:
                    rewards += (f"; staleness max per step {' '.join(f'{x:.0f}' for x in got.staleness_max)}, token "
                                f"staleness mean {' '.join(f'{x:.2f}' for x in got.token_staleness_mean)}")
                print(f"  {got.name}: steps {', '.join(f'{s:.2f}' for s in got.step_s)} s; reward per step "
                      f"(warm-up first) {rewards}; {got.threads}; {got.wall_s:.0f} s with start-up", flush=True)
                results.setdefault(got.name, SideResult(got.name, got.samples_per_step, threads=got.threads)).merge(got)
                by_round.setdefault(got.name, [[] for _ in range(args.rounds)])[r] = list(got.step_s)

    print()
    table = [results[n] for n in ROW_ORDER if n in results]
    if not table:
        print("no side finished")
        return
    print_table(table)
    held_lines = hold_to_ceiling(table, remeasure_ceilings(shape, table))
    for line in perf_lines(table) + held_lines:
        print(line)
    for line in reward_lines(table):
        print(line)
    for r in table if args.length_mix == "fixed" else []:
        if not all(abs(length - args.max_new_tokens) < 1e-6 for length in r.response_len):
            print(f"warning: {r.name} mean response length {statistics.mean(r.response_len):.1f}, "
                  f"not {args.max_new_tokens}: the sides did not generate the same work")
    trl = results.get("trl-grpo")
    if trl is not None and alone:
        print(baseline_line(trl.step_s, alone))
    if "ours-grpo" in results and "trl-alone" in by_round:
        for line in alone_ratio_lines(results["ours-grpo"], by_round["ours-grpo"], by_round["trl-alone"]):
            print(line)
    if trl is not None:
        kept = f"TRL at {trl_setting.flag}" + (", the fastest it tried" if pinned is None and args.trl_search else "")
        for name, note in (("ours-grpo", f">= 1.0: ours at least as fast; {kept}"),
                           ("ours-grpo-async", f"async rollout against {kept}"),
                           ("ours-ppo", "for information: PPO also runs a critic and a reference model")):
            if name in results:
                print(ratio_line(results[name], trl, note))
    elif "trl" in args.sides:
        print("no TRL baseline in this run, so no ratio against it")
    if "ours-grpo" in results and "ours-grpo-eval" in results:
        print(eval_overhead_line(results["ours-grpo-eval"], results["ours-grpo"]))
    if "ours-grpo" in results and "ours-grpo-async" in results:
        print(ratio_line(results["ours-grpo-async"], results["ours-grpo"],
                         f"async over sync rollout, placement {args.placement}; wall-clock steps on both"))
    for base in ("ours-grpo", "ours-grpo-async"):
        if base in results and "ours-grpo-async-k4" in results:
            print(ratio_line(results["ours-grpo-async-k4"], results[base],
                             f"max_staleness 4 over {base.removeprefix('ours-')}, length mix {args.length_mix}, "
                             f"placement {args.placement}"))
    print(f"total wall time {time.perf_counter() - t_start:.0f} s; load average now {load_average()}")


if __name__ == "__main__":
    main()
