"""Faults on CPU: ``python -m rlhf_sg.bench faults [--only NAME,...] [--steps 4]``.

Each fault is put into a small real run (a tiny Qwen2 policy, a 1-rank ZeRO-3 actor, the embedded engine, GRPO,
4 prompts x 2 samples a step, on a local Ray) and the table says what the run did:

* outcome: ``survived`` (the run finished every step) or ``stopped cleanly`` (it stopped with a message naming
  the fault and left a resumable state), anything else is a failure and is printed as such;
* recover_s: the extra seconds the fault cost the run (the step it hit, over the median step; for a killed
  trainer, the resumed run's wall time up to its first new step);
* lost: prompts of the epoch that no finished step trained on or reported (must be 0);
* left: processes of the faulty run still running afterwards (must be 0).

The killed-trainer rows run the trainer in a child process (``--child``), which the tests use as well.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

FAULTS = ("engine-killed", "trainer-killed-mid-step", "trainer-killed-mid-checkpoint", "nan-update",
          "reward-raises", "rank-stuck", "scorer-down", "output-unwritable")
MODULE = "rlhf_sg.bench.faults"


def digit_reward(prompts: list[str], completions: list[str], labels: list) -> list[float]:
    """The fraction of digits in each completion (differs between samples, so groups have signal)."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def raises_on_a_digit(prompts: list[str], completions: list[str], labels: list) -> list[float]:
    """A reward function with a bug: it raises for a completion that starts with a digit."""
    return [1 / 0 if c[:1].isdigit() else digit_reward([p], [c], [None])[0] for p, c in zip(prompts, completions)]


def prepare(root: str) -> tuple[str, str]:
    """A tiny policy and a prompt file under ``root``; returns their paths."""
    from rlhf_sg.bench.e2e import make_prompts
    from rlhf_sg.tiny import save_tiny_model

    model = save_tiny_model(os.path.join(root, "model"), arch="qwen2", size="tiny")
    prompts = os.path.join(root, "prompts.jsonl")
    with open(prompts, "w") as f:
        for text in make_prompts(64, 6, 12, seed=0):
            f.write(json.dumps({"prompt": text}) + "\n")
    return model, prompts


def make_config(model: str, prompts: str, out: str, steps: int, **overrides: Any):
    """The small GRPO run every fault goes into; ``overrides``: ``section__key=value``."""
    from rlhf_sg.config import Config

    cfg = Config()
    cfg.model.pretrain, cfg.data.prompt_data, cfg.log.output_dir = model, prompts, out
    cfg.data.max_prompt_len = 16
    cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt, cfg.rollout.max_new_tokens = 4, 2, 4
    cfg.rollout.max_model_len = 64
    cfg.train.advantage_estimator, cfg.train.actor_num_ranks, cfg.train.kl_coef = "grpo", 1, 0.0
    cfg.train.max_steps, cfg.train.max_tokens_per_microbatch = steps, 256
    cfg.reward.function = f"{MODULE}:digit_reward"
    cfg.log.save_steps = 2
    cfg.log.progress_bar = cfg.log.tensorboard = cfg.log.export_hf = False
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        setattr(getattr(cfg, section), key, value)
    return cfg


def expected_prompts(cfg, steps: int) -> list[list[str]]:
    """The prompts an uninterrupted run trains on, step by step (the prompt stream's own order)."""
    from rlhf_sg.data import PromptStream, load_prompts, load_tokenizer

    prompts, _ = load_prompts(cfg.data.prompt_data, load_tokenizer(cfg.model.pretrain),
                              max_prompt_len=cfg.data.max_prompt_len)
    stream = PromptStream(prompts, cfg.rollout.prompts_per_step, cfg.train.seed, cfg.data.shuffle)
    return [[p.text for p in stream.next_batch()] for _ in range(steps)]


# ---- the trainer in a child process, killed on purpose -------------------------------------------------------------


def _die(out: str) -> None:
    import psutil

    with open(os.path.join(out, "pids.json"), "w") as f:
        json.dump([p.pid for p in psutil.Process().children(recursive=True)], f)
    os.kill(os.getpid(), signal.SIGKILL)


class _KillAfterActorSave:
    """Stands after the actor in a checkpoint's groups: the actor's files are written, then the process dies
    before the trainer's state is."""

    def __init__(self, out: str):
        self.out = out

    def call(self, *args: Any, **kwargs: Any) -> None:
        _die(self.out)


def child(spec: dict) -> None:
    """One run of the small GRPO job: every step's prompts go to ``out/prompts_seen.jsonl``; ``kill``: "step"
    (SIGKILL at the end of step 3) or "checkpoint" (SIGKILL while the step-4 checkpoint is half written); the
    pids the run started go to ``out/pids.json`` before the kill."""
    from rlhf_sg.trainer import PPOTrainer, train

    out, kill = spec["out"], spec.get("kill")

    class Run(PPOTrainer):
        def on_step_end(self, step, metrics):
            with open(os.path.join(out, "prompts_seen.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, "prompts": [p.text for p in self.prompts],
                                    "time": time.time()}) + "\n")
            if kill == "step" and step == 3:
                _die(out)

        def _checkpointed_groups(self):
            groups = super()._checkpointed_groups()
            if kill == "checkpoint" and self.step == 4:
                groups["zz_kill"] = _KillAfterActorSave(out)
            return groups

    cfg = make_config(spec["model"], spec["prompts"], os.path.join(out, "run"), spec["steps"],
                      log__resume=bool(spec.get("resume")))
    train(cfg, trainer_cls=Run)


def run_child(spec: dict, timeout_s: float = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, RAY_ADDRESS="local", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    return subprocess.run([sys.executable, "-m", MODULE, "--child", json.dumps(spec)], env=env, capture_output=True,
                          text=True, timeout=timeout_s)


def running(pids: list[int]) -> list[int]:
    import psutil

    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


# ---- the faults -------------------------------------------------------------------------------------------------


def _row(fault: str, outcome: str, recover_s: float | None, lost: int, left: int, note: str = "") -> dict:
    return {"fault": fault, "outcome": outcome, "recover_s": recover_s, "lost": lost, "left": left, "note": note}


def _lost(cfg, history_prompts: list[list[str]]) -> int:
    """Prompts an uninterrupted run trains on in these steps that none of the run's finished steps did."""
    expected = {p for step in expected_prompts(cfg, len(history_prompts)) for p in step}
    return len(expected - {p for step in history_prompts for p in step})


def _in_process(cfg, trainer_cls) -> tuple[list[dict], list[list[str]], Exception | None]:
    """Run ``cfg`` with ``trainer_cls``; (per-step metrics, per-step prompts, the exception that stopped it)."""
    seen: list[list[str]] = []

    class Recording(trainer_cls):
        def on_step_end(self, step, metrics):
            super().on_step_end(step, metrics)
            seen.append([p.text for p in self.prompts])

    trainer = Recording(cfg)
    history, error = [], None
    try:
        trainer.setup()
        while trainer.step < cfg.train.max_steps:
            history.append(trainer.train_step())
    except Exception as e:  # the fault under test: reported in the table
        error = e
    finally:
        trainer.shutdown()
    return history, seen, error


def _extra_s(history: list[dict], index: int) -> float:
    steps = [h["time/step"] for h in history]
    others = steps[:index] + steps[index + 1:]
    return steps[index] - statistics.median(others) if others else steps[index]


def trainer_killing_engine(index: int, at_step: int, trainer_cls=None) -> tuple[type, list[int]]:
    """A trainer class that SIGKILLs engine ``index``'s process (and so whatever it runs, such as SGLang's
    scheduler processes) before step ``at_step`` generates, and the list it fills with the killed pids."""
    import psutil
    import ray

    from rlhf_sg.trainer import PPOTrainer

    killed: list[int] = []

    class Killing(trainer_cls or PPOTrainer):
        def on_step_start(self, step):
            super().on_step_start(step)
            if step == at_step:
                pid = ray.get(self.engines[index].resources.remote(), timeout=60)["pid"]
                killed.extend([pid] + [p.pid for p in psutil.Process(pid).children(recursive=True)])
                os.kill(pid, signal.SIGKILL)

    return Killing, killed


def engine_killed(model: str, prompts: str, out: str, steps: int) -> dict:
    killing, killed = trainer_killing_engine(0, 1)
    cfg = make_config(model, prompts, out, steps)
    history, seen, error = _in_process(cfg, killing)
    if error is not None or len(history) != steps:
        return _row("engine process killed before a generate", f"FAILED: {error}", None, -1, len(running(killed)))
    restarts = [h["rollout/engine_restarts"] for h in history]
    return _row("engine process killed before a generate", "survived" if restarts[1] == 1 else "FAILED: no restart",
                _extra_s(history, 1), _lost(cfg, seen), len(running(killed)), f"restarts per step {restarts}")


def _trainer_killed(kill: str, model: str, prompts: str, out: str, steps: int) -> dict:
    name = f"trainer SIGKILLed {'mid-step' if kill == 'step' else 'mid-checkpoint'}"
    spec = {"out": out, "model": model, "prompts": prompts, "steps": steps, "kill": kill}
    first = run_child(spec)
    if first.returncode != -signal.SIGKILL:
        return _row(name, f"FAILED: the run was not killed (exit {first.returncode})", None, -1, -1)
    with open(os.path.join(out, "pids.json")) as f:
        pids = json.load(f)
    started = time.time()
    resumed = run_child({**spec, "kill": None, "resume": True})
    if resumed.returncode != 0:
        return _row(name, f"FAILED: resume exited {resumed.returncode}: {resumed.stderr[-300:]}", None, -1,
                    len(running(pids)))
    records = [json.loads(line) for line in open(os.path.join(out, "prompts_seen.jsonl"))]
    by_step = {r["step"]: r["prompts"] for r in records}  # the last attempt at a step counts
    first_new = min(r["time"] for r in records if r["time"] >= started)
    cfg = make_config(model, prompts, out, steps)
    with open(os.path.join(out, "run", "metrics.jsonl")) as f:
        logged = [json.loads(line)["step"] for line in f]
    note = f"metrics.jsonl steps {logged}"
    ok = logged == list(range(1, steps + 1)) and sorted(by_step) == list(range(1, steps + 1))
    return _row(name, "survived" if ok else "FAILED: steps missing or logged twice", first_new - started,
                _lost(cfg, [by_step[s] for s in sorted(by_step)]), len(running(pids)), note)


def nan_update(model: str, prompts: str, out: str, steps: int) -> dict:
    from rlhf_sg.advantages import _REGISTRY, advantage_estimator, register_advantage_estimator
    from rlhf_sg.trainer import PPOTrainer

    grpo = advantage_estimator("grpo")
    calls = {"n": 0}
    if "bench_nan_on_second_step" not in _REGISTRY:
        @register_advantage_estimator("bench_nan_on_second_step", needs_groups=True)
        def nan_on_second_step(inputs):
            calls["n"] += 1
            advantages, returns = grpo.fn(inputs)
            if calls["n"] == 2:
                advantages = advantages.clone()
                advantages[0, 0] = float("nan")
            return advantages, returns

    cfg = make_config(model, prompts, out, steps, train__advantage_estimator="bench_nan_on_second_step")
    history, seen, error = _in_process(cfg, PPOTrainer)
    if error is not None:
        return _row("NaN in the loss (one step)", f"FAILED: {error}", None, -1, 0)
    skipped = [h["actor/skipped_updates"] for h in history]
    ok = skipped == [0.0, 1.0] + [0.0] * (steps - 2)
    return _row("NaN in the loss (one step)", "survived" if ok else f"FAILED: skipped {skipped}", 0.0,
                _lost(cfg, seen), 0, f"skipped updates per step {skipped} (reported, weights kept)")


def reward_raises(model: str, prompts: str, out: str, steps: int) -> dict:
    from rlhf_sg.trainer import PPOTrainer

    cfg = make_config(model, prompts, out, steps, reward__function=f"{MODULE}:raises_on_a_digit",
                      reward__on_error="zero")
    history, seen, error = _in_process(cfg, PPOTrainer)
    if error is not None:
        return _row("reward function raises for some samples", f"FAILED: {error}", None, -1, 0)
    errors = [h["reward/errors"] for h in history]
    return _row("reward function raises for some samples", "survived", 0.0, _lost(cfg, seen), 0,
                f"--reward.on_error zero: reward/errors per step {errors}")


def rank_stuck(model: str, prompts: str, out: str, steps: int) -> dict:
    from rlhf_sg.trainer import PPOTrainer

    pids: list[int] = []
    hung_at: list[float] = []

    class Stuck(PPOTrainer):
        def on_step_start(self, step):
            if step == 1:
                actor = self.cluster.actor
                pids.extend(p["pid"] for p in actor.call("resources"))
                actor.timeout_s = self.cfg.train.timeout_s = 10.0
                actor.workers[0].__ray_call__.remote(lambda self_: time.sleep(120))  # a rank that hangs
                hung_at.append(time.monotonic())

    cfg = make_config(model, prompts, out, steps)
    history, _, error = _in_process(cfg, Stuck)
    detected = time.monotonic() - hung_at[0] if hung_at else None
    time.sleep(5)  # the shutdown's kills land
    message = str(error)
    ok = isinstance(error, TimeoutError) and "actor rank 0" in message
    return _row("a rank never answers", "stopped cleanly" if ok else f"FAILED: {error!r}", detected, 0,
                len(running(pids)), message[:90])


def scorer_down(model: str, prompts: str, out: str, steps: int) -> dict:
    import socket

    from rlhf_sg.rewards import RewardError
    from rlhf_sg.trainer import PPOTrainer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/score"
    cfg = make_config(model, prompts, out, steps, reward__kind="remote", reward__url=url, reward__function=None,
                      reward__retries=2)
    t0 = time.monotonic()
    _, _, error = _in_process(cfg, PPOTrainer)
    ok = isinstance(error, RewardError) and url in str(error) and "3 attempts" in str(error)
    return _row("remote scorer down", "stopped cleanly" if ok else f"FAILED: {error!r}", time.monotonic() - t0, 0, 0,
                str(error)[:90])


def output_unwritable(model: str, prompts: str, out: str, steps: int) -> dict:
    from rlhf_sg.trainer import PPOTrainer
    from rlhf_sg.trainer.checkpoint import CheckpointError

    blocker = os.path.join(out, "a_file")
    os.makedirs(out, exist_ok=True)
    open(blocker, "w").close()
    cfg = make_config(model, prompts, os.path.join(blocker, "run"), steps)
    _, _, error = _in_process(cfg, PPOTrainer)
    ok = isinstance(error, CheckpointError) and "not writable" in str(error)
    return _row("output directory not writable", "stopped cleanly" if ok else f"FAILED: {error!r}", 0.0, 0, 0,
                "refused before Ray started")


RUNS = {
    "engine-killed": engine_killed,
    "trainer-killed-mid-step": lambda *a: _trainer_killed("step", *a),
    "trainer-killed-mid-checkpoint": lambda *a: _trainer_killed("checkpoint", *a),
    "nan-update": nan_update,
    "reward-raises": reward_raises,
    "rank-stuck": rank_stuck,
    "scorer-down": scorer_down,
    "output-unwritable": output_unwritable,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlhf_sg.bench faults", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(FAULTS), help=f"comma-separated, of {list(FAULTS)}")
    parser.add_argument("--steps", type=int, default=6, help="steps of each run (the killed-trainer rows need >= 5)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(FAULTS))
    if unknown:
        raise SystemExit(f"unknown faults {unknown}; choose from {list(FAULTS)}")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import ray

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:
        model, prompts = prepare(tmp)
        ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False,
                 log_to_driver=False)
        try:
            for name in names:
                print(f"-- {name} ...", flush=True)
                rows.append(RUNS[name](model, prompts, os.path.join(tmp, name), args.steps))
        finally:
            ray.shutdown()
    print(f"\n{'fault':42} {'outcome':16} {'recover_s':>9} {'lost':>5} {'left':>5}  note")
    for r in rows:
        recover = f"{r['recover_s']:.1f}" if r["recover_s"] is not None else "-"
        print(f"{r['fault']:42} {r['outcome'][:16]:16} {recover:>9} {r['lost']:>5} {r['left']:>5}  {r['note']}")
    bad = [r for r in rows if r["outcome"] not in ("survived", "stopped cleanly") or r["lost"] or r["left"]]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} faults survived or stopped cleanly with nothing lost or left")
    if bad:
        for r in bad:
            print(f"  {r['fault']}: {r['outcome']}")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
