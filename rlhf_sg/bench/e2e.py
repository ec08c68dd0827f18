"""End-to-end step throughput on CPU: our trainer (GRPO and PPO) against TRL's GRPOTrainer on the same work.

``python -m rlhf_sg.bench e2e [--steps 3] [--warmup 1] [--sides trl,grpo,ppo] [--rounds 1] [--backend hf]
[--actor-ranks 2] [--worker-threads N] [--engine-threads N]``

Every side trains the same ~25M-parameter Qwen2-style model (random weights: this measures
throughput, not learning) on the same prompt file with the same rule reward (the fraction of digits
in a completion), 8 prompts x 8 samples a step, at most 64 new tokens, temperature 1, one optimizer
step per rollout batch, fp32 on CPU. The tokenizer's end-of-sequence token is an id past the model's
vocabulary and the model has no EOS id of its own, so no side can sample a stop token: every
completion runs to exactly ``--max-new-tokens`` and all sides generate the same number of tokens.

Sides:

* ``grpo`` (candidate): :class:`rlhf_sg.trainer.PPOTrainer` with ``advantage_estimator="grpo"`` and
  ``kl_coef=0`` (no reference model, like TRL's default ``beta=0``): the rollout engine in a Ray actor,
  a ``--actor-ranks`` DeepSpeed ZeRO-3 actor, packed forwards, the weight sync into the engine after
  every step. ``train_step()`` is called directly; its ``time/<phase>`` metrics give the phase shares.
* ``ppo`` (for information): the same with ``advantage_estimator="gae"``: a critic and a reference
  model (``kl_coef=0.01``) as well, so it does more work than either GRPO side.
* ``trl`` (baseline): ``trl.GRPOTrainer`` in its own Python process (so Ray is not involved and the
  two sides' threads never meet) with ``num_generations=8``, ``per_device_train_batch_size=64`` and
  ``gradient_accumulation_steps=1``: the generation batch is 64 completions (8 prompts x 8) and one
  training step is one generation round, one forward/backward over all 64 and one optimizer step,
  as on our side. ``use_vllm=False`` (transformers' ``generate``), ``beta=0``, ``bf16=False`` and
  ``gradient_checkpointing=False`` (GRPOConfig turns it on by default; our trainer does not
  recompute activations, so leaving it on would charge TRL work we do not do). Its step time runs
  from ``on_step_begin`` to ``on_step_end`` of a TrainerCallback; ``generate`` is the time inside
  the model's ``generate``, ``reward`` inside the reward function, ``other`` the rest of TRL's
  rollout preparation (tokenising, decoding, padding, advantages) and ``train`` everything after it
  (log-prob forward, backward, optimizer step).

Threads: each of our model-worker ranks runs ``--train.worker_threads`` (default 1) torch threads on
the one Ray CPU it holds and the engine ``--rollout.engine_threads`` (default on CPU: the machine's
cores, since phases take turns), as the product sets them: the 2 actor ranks use both cores while
training and the engine both while generating. ``--actor-ranks 1 --worker-threads 2`` runs the actor
as one rank on both cores, and ``--engine-threads N`` sets the engine's count.
TRL runs one process with ``--trl-threads`` (default: every core) torch threads. The thread counts
each side actually runs with are printed. Each of our runs starts its own Ray instance
(``RAY_ADDRESS=local``) and shuts it down before the next side starts.

Reading the table: samples/s is samples per step over the mean measured step time (``--warmup``
steps of each side are not measured); the phase columns are each phase's share of the mean step.
The ratio ours-grpo / trl >= 1.0 means our GRPO step is at least as fast as TRL's on this machine.
Each side is a separate run with its own start-up, so sides cannot alternate step by step; instead
``--rounds`` repeats the whole set, round r in the order of ``--sides`` when r is even and reversed
when odd (A B C, C B A, ...), and each side's measured steps are pooled across rounds, so drifting
machine load hits both ends alike. With one round (the default, to keep the run short) the order is
``--sides``: state it with the result.
"""

from __future__ import annotations

import argparse
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

#: phase columns of the table, in step order (TRL's side fills generate, reward, train and other)
PHASE_COLUMNS = ("generate", "reward", "reference", "critic", "actor_logprob", "train", "weight_sync", "other")
SIDES = ("trl", "grpo", "ppo")
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


def trl_digit_reward(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    """:func:`digit_reward` with TRL's reward-function signature."""
    return digit_reward(prompts, completions, [None] * len(completions))


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
    return model_path, prompt_file, num_params


# ---- results ----------------------------------------------------------------------------------------------


@dataclass
class SideResult:
    """The measured steps of one side: seconds per step, seconds per phase per step, response lengths."""

    name: str
    samples_per_step: int
    step_s: list[float] = field(default_factory=list)
    phase_s: dict[str, list[float]] = field(default_factory=dict)
    response_len: list[float] = field(default_factory=list)
    threads: str = ""
    wall_s: float = 0.0

    def add_step(self, seconds: float, phases: dict[str, float], response_len: float) -> None:
        self.step_s.append(seconds)
        for name, value in phases.items():
            self.phase_s.setdefault(name, []).append(value)
        self.response_len.append(response_len)

    @property
    def mean_step_s(self) -> float:
        return statistics.mean(self.step_s)

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_step / self.mean_step_s

    def share(self, phase: str) -> float | None:
        """The phase's share of the mean step, or None where this side has no such phase."""
        if not any(self.phase_s.get(phase, ())):
            return None
        return sum(self.phase_s[phase]) / sum(self.step_s)


# ---- our trainer --------------------------------------------------------------------------------------------


def _torch_threads(_actor_instance: Any) -> int:
    """Run inside a Ray actor through ``__ray_call__``: the torch threads it computes with."""
    return torch.get_num_threads()


def make_config(algo: str, args: argparse.Namespace, model_path: str, prompt_file: str, out: str):
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
    cfg.train.advantage_estimator = algo
    cfg.train.actor_num_ranks = args.actor_ranks
    cfg.train.kl_coef = 0.0 if algo == "grpo" else 0.01
    cfg.train.actor_lr = args.lr
    cfg.train.critic_lr = args.critic_lr
    cfg.train.max_steps = args.warmup + args.steps
    cfg.train.seed = args.seed
    if args.worker_threads is not None:
        cfg.train.worker_threads = args.worker_threads
    cfg.rollout.engine_threads = args.engine_threads
    cfg.reward.kind = "function"
    cfg.reward.function = f"{MODULE}:digit_reward"
    cfg.log.output_dir = out
    cfg.log.tensorboard = False
    cfg.log.progress_bar = False
    cfg.log.export_hf = False
    return cfg


def run_ours(algo: str, args: argparse.Namespace, model_path: str, prompt_file: str, out: str) -> SideResult:
    """Set up our trainer, run the warm-up steps, time the measured ones, shut everything down."""
    import ray

    from rlhf_sg.trainer import PPOTrainer

    name = f"ours-{algo}"
    estimator = "grpo" if algo == "grpo" else "gae"
    cfg = make_config(estimator, args, model_path, prompt_file, os.path.join(out, name))
    result = SideResult(name, args.prompts * args.samples)
    start = time.perf_counter()
    trainer = PPOTrainer(cfg, reward_fn=digit_reward)
    try:
        trainer.setup()
        result.threads = _describe_ours_threads(trainer)
        for _ in range(args.warmup):
            trainer.train_step()
        for _ in range(args.steps):
            metrics = trainer.train_step()
            phases = {p: metrics[f"time/{p}"] for p in PHASE_COLUMNS}
            result.add_step(metrics["time/step"], phases, metrics["rollout/response_len"])
    finally:
        trainer.shutdown()
        ray.shutdown()
    result.wall_s = time.perf_counter() - start
    return result


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


def run_trl(args: argparse.Namespace, model_path: str, prompt_file: str, out: str) -> SideResult | None:
    """Run :func:`_trl_child` in a fresh Python process; None (with the reason printed) if it failed."""
    spec = {
        "model_path": model_path, "prompt_file": prompt_file, "output_dir": os.path.join(out, "trl"),
        "prompts": args.prompts, "samples": args.samples, "max_new_tokens": args.max_new_tokens,
        "lr": args.lr, "warmup": args.warmup, "steps": args.steps, "threads": args.trl_threads, "seed": args.seed,
    }
    env = dict(os.environ, OMP_NUM_THREADS=str(args.trl_threads), TOKENIZERS_PARALLELISM="false",
               CUDA_VISIBLE_DEVICES="")
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", MODULE, "--trl-child", json.dumps(spec)],
        env=env, capture_output=True, text=True, check=False,
    )
    wall = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        print(f"trl: the TRL process failed (exit {proc.returncode}); its last lines:\n{tail}", flush=True)
        return None
    payload = json.loads(lines[-1][len(RESULT_MARKER):])
    result = SideResult("trl-grpo", args.prompts * args.samples, threads=payload["threads"], wall_s=wall)
    for step in payload["steps"]:
        result.add_step(step["seconds"], step["phases"], step["response_len"])
    return result


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
    """The TRL side: GRPOTrainer on ``spec``'s model and prompts; prints one result line as JSON."""
    torch.set_num_threads(spec["threads"])
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
    reward = clock.wrap("reward", trl_digit_reward)
    samples = spec["prompts"] * spec["samples"]
    config = GRPOConfig(
        output_dir=spec["output_dir"],
        # one step = one generation round of `samples` completions, one forward/backward, one optimizer step
        per_device_train_batch_size=samples,
        gradient_accumulation_steps=1,
        num_generations=spec["samples"],
        max_completion_length=spec["max_new_tokens"],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        use_vllm=False,
        learning_rate=spec["lr"],
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        max_steps=spec["warmup"] + spec["steps"],
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=spec["seed"],
    )
    steps: list[dict[str, Any]] = []
    lengths: dict[int, float] = {}

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.reset()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds = time.perf_counter() - self.t0
            inside = dict(clock.totals)
            rollout = inside.get("rollout", 0.0)
            generate, reward_s = inside.get("generate", 0.0), inside.get("reward", 0.0)
            phases = {"generate": generate, "reward": reward_s, "other": max(0.0, rollout - generate - reward_s),
                      "train": max(0.0, seconds - rollout)}
            steps.append({"step": state.global_step, "seconds": seconds, "phases": phases})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                lengths[state.global_step] = float(logs["completions/mean_length"])

    trainer = GRPOTrainer(
        model=model, reward_funcs=[reward], args=config, train_dataset=dataset, processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer._generate_and_score_completions = clock.wrap("rollout", trainer._generate_and_score_completions)
    trainer.train()
    measured = steps[spec["warmup"]:]
    for step in measured:
        step["response_len"] = lengths.get(step["step"], float("nan"))
    threads = f"1 process x {torch.get_num_threads()} thread(s)"
    print(RESULT_MARKER + json.dumps({"steps": measured, "threads": threads}), flush=True)


# ---- the table ----------------------------------------------------------------------------------------------


def print_table(results: list[SideResult]) -> None:
    short = {"actor_logprob": "act_logp", "weight_sync": "w_sync", "reference": "ref"}
    head = f"{'side':<10} {'samples/s':>9} {'s/step':>7} {'resp_len':>8}  "
    head += " ".join(f"{short.get(p, p):>8}" for p in PHASE_COLUMNS)
    print(head)
    for r in results:
        row = f"{r.name:<10} {r.samples_per_s:>9.3f} {r.mean_step_s:>7.2f} {statistics.mean(r.response_len):>8.1f}  "
        cells = []
        for p in PHASE_COLUMNS:
            share = r.share(p)
            cells.append(f"{'-':>8}" if share is None else f"{100 * share:>7.1f}%")
        print(row + " ".join(cells))


def _load() -> str:
    """The 1-minute load average: well above the number of cores, other work competed with the sides."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "n/a"


def _trl_missing_hint() -> str:
    return ("trl: not installed, so the baseline is skipped. Install it next to this CPU torch with "
            '`pip install "torch==2.13.0" trl` (pinning torch keeps pip from replacing it).')


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlhf_sg.bench e2e", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {list(SIDES)}, in run order")
    parser.add_argument("--steps", type=int, default=3, help="measured steps of each side (per round)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps of each side before the measured ones")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the sides, order reversed every other round")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompt-chars", default="20,60", help="min,max prompt length in characters (= tokens)")
    parser.add_argument("--size", default="25m", help="tiny model size from rlhf_sg.tiny.SIZES")
    parser.add_argument("--arch", default="qwen2")
    parser.add_argument("--backend", default="hf", help="our rollout backend")
    parser.add_argument("--actor-ranks", type=int, default=2, help="our ZeRO-3 actor ranks")
    parser.add_argument("--worker-threads", type=int, default=None,
                        help="our --train.worker_threads: torch threads per model-worker rank (default: the config's)")
    parser.add_argument("--engine-threads", type=int, default=None,
                        help="our --rollout.engine_threads (default: the product's, the cores on CPU)")
    parser.add_argument("--trl-threads", type=int, default=os.cpu_count() or 1, help="torch threads of TRL's process")
    parser.add_argument("--lr", type=float, default=1e-6, help="actor learning rate, both trainers")
    parser.add_argument("--critic-lr", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trl-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.trl_child is not None:
        _trl_child(json.loads(args.trl_child))
        return

    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = [s for s in sides if s not in SIDES]
    if unknown or not sides:
        parser.error(f"--sides: unknown or no side(s) {unknown}; choose from {list(SIDES)}")
    if "trl" in sides and importlib.util.find_spec("trl") is None:
        print(_trl_missing_hint(), flush=True)
        sides = [s for s in sides if s != "trl"]
        if not sides:
            return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Ray starts its workers at nice 15 by default; TRL's process runs at nice 0.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Our trainer starts a Ray instance of its own for each run: never join a cluster already running here.
    os.environ["RAY_ADDRESS"] = "local"

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        model_path, prompt_file, num_params = prepare(tmp, args)
        samples = args.prompts * args.samples
        print(
            f"e2e: {args.arch}/{args.size} ({num_params / 1e6:.1f}M parameters), {args.prompts} prompts x "
            f"{args.samples} samples x {args.max_new_tokens} new tokens = {samples} samples a step, CPU "
            f"({os.cpu_count()} cores), ours: backend {args.backend}, {args.actor_ranks} actor rank(s); "
            f"{args.warmup} warm-up + {args.steps} measured step(s) per side, {args.rounds} round(s); "
            f"load average {_load()} (other work on the machine slows whichever side it overlaps)",
            flush=True,
        )
        results: dict[str, SideResult] = {}
        for r in range(args.rounds):
            order = sides if r % 2 == 0 else sides[::-1]
            print(f"round {r + 1}: {' -> '.join(order)}", flush=True)
            for side in order:
                out = os.path.join(tmp, f"round{r}")
                got = run_trl(args, model_path, prompt_file, out) if side == "trl" else run_ours(
                    side, args, model_path, prompt_file, out)
                if got is None:
                    continue
                print(f"  {got.name}: steps {', '.join(f'{s:.2f}' for s in got.step_s)} s; {got.threads}; "
                      f"{got.wall_s:.0f} s with start-up", flush=True)
                merged = results.setdefault(got.name, SideResult(got.name, got.samples_per_step, threads=got.threads))
                for i, seconds in enumerate(got.step_s):
                    merged.add_step(seconds, {p: v[i] for p, v in got.phase_s.items()}, got.response_len[i])
                merged.wall_s += got.wall_s

    print()
    table = [results[n] for n in ("ours-grpo", "ours-ppo", "trl-grpo") if n in results]
    print_table(table)
    for r in table:
        if not all(abs(length - args.max_new_tokens) < 1e-6 for length in r.response_len):
            print(f"warning: {r.name} mean response length {statistics.mean(r.response_len):.1f}, "
                  f"not {args.max_new_tokens}: the sides did not generate the same work")
    trl = results.get("trl-grpo")
    if trl is not None:
        for name, note in (("ours-grpo", ">= 1.0: ours at least as fast"),
                           ("ours-ppo", "for information: PPO also runs a critic and a reference model")):
            if name in results:
                print(f"ratio {name} / trl-grpo samples/s: {results[name].samples_per_s / trl.samples_per_s:.2f} "
                      f"({note})")
    elif "trl" in args.sides:
        print("no TRL baseline in this run, so no ratio")
    print(f"total wall time {time.perf_counter() - t_start:.0f} s; load average now {_load()}")


if __name__ == "__main__":
    main()
