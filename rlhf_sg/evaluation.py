"""Held-out evaluation's estimators.

``pass_at_k``: the unbiased pass@k of n samples of which c are correct, ``1 - C(n-c, k) / C(n, k)`` (the
probability that k samples drawn without replacement from the n hold a correct one), computed as a product so
that large n does not overflow. Taking the best of k bootstrap draws with replacement instead is biased low.
"""

from __future__ import annotations

import os


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` correct (``0 <= c <= n``, ``1 <= k <= n``)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k holds a correct sample
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):  # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
        miss *= 1.0 - k / i
    return 1.0 - miss


# ---- evaluation during training --------------------------------------------------------------------------------
#: added to the run seed for evaluation's sampling: its own seed namespace, never the training draws'
EVAL_SEED_OFFSET = 0x5EED_E7A1


def evaluation_steps(max_steps: int, interval: int, before_train: bool, after_train: bool) -> list[int]:
    """The steps after which an evaluation runs (0: before the first step): every ``interval`` steps, before
    the first and after the last as asked."""
    steps = {0} if before_train else set()
    if interval > 0:
        steps.update(range(interval, max_steps + 1, interval))
    if after_train:
        steps.add(max_steps)
    return sorted(steps)


def load_eval_prompts(cfg, tokenizer) -> list:
    """``--eval.prompt_data``'s prompts (the first ``--eval.max_prompts``), read as the training data is: a bad row
    stops the run before anything starts, naming the file and row."""
    from rlhf_sg.data import load_run_prompts

    e = cfg.eval
    prompts, _ = load_run_prompts(cfg, e.prompt_data, tokenizer)  # a vision-language policy's with their images
    return prompts[: e.max_prompts] if e.max_prompts else prompts


class Evaluator:
    """Held-out evaluation through the training's rollout path (the engines' ``generate``, the reward function)
    with its own prompts, sampling settings and seed namespace: no reference, critic or training forward, and
    nothing it does reaches the prompt stream, dynamic filtering, the KL controller or the async queue.

    ``engines``: the trainer's engine list (the same object, so restarted engines are used); ``reward_fn``: the
    reward function (the evaluation's own with ``--eval.reward_function``); ``restart``: how an engine that died
    is restarted."""

    def __init__(self, cfg, tokenizer, prompts: list, engines: list, eos_ids: tuple[int, ...], pad_id: int,
                 reward_fn, restart=None):
        import copy

        from rlhf_sg.trainer.rollout import RolloutMaker

        e, r = cfg.eval, cfg.rollout
        self.prompts = prompts
        self.cfg, self.tokenizer, self.reward_fn = cfg, tokenizer, reward_fn
        self.steps = evaluation_steps(cfg.train.max_steps, e.interval, e.before_train, e.after_train)

        def maker(n: int, temperature: float):
            own = copy.deepcopy(cfg)
            own.rollout.n_samples_per_prompt, own.rollout.temperature = n, temperature
            own.rollout.max_new_tokens = e.max_new_tokens or r.max_new_tokens
            own.train.seed = (cfg.train.seed + EVAL_SEED_OFFSET) % 2**31
            return RolloutMaker(own, engines, None, eos_ids, pad_id, score=None, restart=restart, tokenizer=tokenizer)

        temperature = r.temperature if e.temperature is None else e.temperature
        self._sampled = maker(e.n_samples, temperature)
        self._greedy = maker(1, 0.0) if e.greedy else None
        self.agent_metrics: dict[str, float] = {}

    def due(self, step: int, resumed_from: int = -1) -> bool:
        """Whether an evaluation runs after ``step`` (0: before training); a resumed run skips the steps up to
        its checkpoint's, which the run before it evaluated."""
        return step in self.steps and step > resumed_from

    def run(self, step: int, weight_version: int, out_dir: str) -> dict[str, float]:
        """Evaluate the engines' current weights (``weight_version``): metrics ``eval/...``, and every sample to
        ``out_dir/eval/step{step}.jsonl``."""
        import json
        import time

        e, start = self.cfg.eval, time.perf_counter()
        records: list[dict] = []
        scored = self._score(self._sampled, step, e.n_samples, weight_version, records, greedy=False)
        correct = [[s >= e.threshold for s in scored[i * e.n_samples:(i + 1) * e.n_samples]]
                   for i in range(len(self.prompts))]
        metrics = {"eval/score_mean": sum(scored) / len(scored)}
        for k in e.k:
            if k <= e.n_samples:
                metrics[f"eval/pass@{k}"] = sum(pass_at_k(e.n_samples, sum(c), k) for c in correct) / len(correct)
        if self._greedy is not None:
            greedy = self._score(self._greedy, step, 1, weight_version, records, greedy=True)
            metrics["eval/greedy_accuracy"] = sum(s >= e.threshold for s in greedy) / len(greedy)
        sampled = [r for r in records if not r["greedy"]]
        metrics["eval/response_len"] = sum(r["tokens"] for r in sampled) / len(sampled)
        metrics["eval/truncated_frac"] = sum(r["finish_reason"] == "length" for r in sampled) / len(sampled)
        metrics["eval/prompts"] = float(len(self.prompts))
        metrics.update(self.agent_metrics)  # multi-turn: turns, tool calls and errors, finish reasons
        metrics["eval/time_s"] = time.perf_counter() - start
        os.makedirs(os.path.join(out_dir, "eval"), exist_ok=True)
        with open(os.path.join(out_dir, "eval", f"step{step}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        return metrics

    def _score(self, maker, step: int, n: int, weight_version: int, records: list, greedy: bool) -> list[float]:
        from rlhf_sg.agent import Trajectory, agent_metrics, completion_text
        from rlhf_sg.rewards import score_with_function

        cfg = self.cfg
        completions = maker.generate(self.prompts, step, draw=1 if greedy else 0)
        texts = [completion_text(self.tokenizer, c) for c in completions]  # multi-turn: the model's text
        prompts = [self.prompts[i // n] for i in range(len(completions))]
        name = cfg.eval.reward_function or cfg.reward.function or "reward function"
        scores, _ = score_with_function(self.reward_fn, name, [p.text for p in prompts], texts,
                                        [p.label for p in prompts], on_error=cfg.reward.on_error,
                                        timeout_s=cfg.reward.timeout_s or cfg.train.timeout_s)
        if not greedy:
            self.agent_metrics = agent_metrics(completions, "eval/agent/") if isinstance(
                completions[0], Trajectory) else {}
        for i, (p, c, text, s) in enumerate(zip(prompts, completions, texts, scores)):
            if c.weight_version != weight_version:
                raise RuntimeError(f"evaluation after step {step}: a completion came from weight version "
                                   f"{c.weight_version}, not the synced {weight_version}")
            records.append({"step": step, "prompt": p.text, "label": p.label, "sample": i % n, "greedy": greedy,
                            "completion": text, "tokens": len(c.token_ids), "finish_reason": c.finish_reason,
                            "score": float(s), "correct": bool(s >= cfg.eval.threshold),
                            "weight_version": c.weight_version})
        return [float(s) for s in scores]


# ---- evaluation of a saved model (``rlhf-sg eval``) --------------------------------------------------------------
def eval_argv(argv: list[str]) -> list[str]:
    """``rlhf-sg eval``'s flags as the trainer's: ``--data FILE`` is ``--eval.prompt_data`` (and, as the config
    asks for a training file, ``--data.prompt_data``), ``--eval.reward_function`` also the ``--reward.function``
    the config asks for; every ``--section.key`` flag passes through."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--data" or arg.startswith("--data="):
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in arg else 2
            out += ["--eval.prompt_data", value]
            if not any(a.split("=", 1)[0] in ("--data.prompt_data", "--prompt-data") for a in argv):
                out += ["--data.prompt_data", value]
            continue
        out.append(arg)
        i += 1
    flags = [a.split("=", 1)[0] for a in out]
    if "--eval.reward_function" in flags and "--reward.function" not in flags:  # the config asks for one
        at = flags.index("--eval.reward_function")
        out += ["--reward.function", out[at].split("=", 1)[1] if "=" in out[at] else out[at + 1]]
    return out


def evaluate_model(cfg, reward_fn=None) -> dict[str, float]:
    """The held-out evaluation of ``--model.pretrain`` as it is saved (an exported checkpoint, any backend):
    the prompts, tokenizer and reward function are read and checked first, then Ray (the caller's, or a local
    one) and the engines start, the evaluation runs as during training (``--eval.*``, its samples to
    ``<output_dir>/eval/step0.jsonl``), and everything started is stopped. No training group starts."""
    from rlhf_sg.data import load_tokenizer
    from rlhf_sg.rewards import load_reward_function
    from rlhf_sg.trainer.cluster import Cluster
    from rlhf_sg.trainer.rollout import eos_token_ids

    tokenizer = load_tokenizer(cfg.model.pretrain)
    prompts = load_eval_prompts(cfg, tokenizer)
    if reward_fn is None:
        reward_fn = load_reward_function(cfg.eval.reward_function or cfg.reward.function)
    eos_ids = eos_token_ids(cfg.model.pretrain, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    os.makedirs(cfg.log.output_dir, exist_ok=True)
    cluster = Cluster(cfg)
    try:
        engines = cluster.start_engines()
        evaluator = Evaluator(cfg, tokenizer, prompts, engines, eos_ids, pad_id, reward_fn)
        return evaluator.run(0, 0, cfg.log.output_dir)
    finally:
        cluster.shutdown()


def format_table(metrics: dict[str, float]) -> str:
    """An evaluation's metrics as a two-column table."""
    width = max(len(k) for k in metrics)
    return "\n".join(f"{k.removeprefix('eval/'):<{width}}  {v:.4f}" for k, v in metrics.items())
