"""A task that needs a tool, on a laptop CPU: 3-digit x 2-digit products with a calculator.

A tiny model cannot multiply 417 by 38 in its head, but it can call the calculator and copy the answer::

    prompt  417*38=
    model   {417*38}           (the turn ends on "}")
    tool    =15846;            (observation: mask 0, never trained on)
    model   15846<eos>         (the final answer; reward 1 when it is the product)

What it does, top to bottom:
1. builds a tiny Qwen2-style model and the character tokenizer, locally;
2. a short supervised warm start on a mix of tool traces (a third) and direct answers (the right product,
   which a model this size cannot compute), observation tokens out of the loss: the policy calls the tool
   some of the time and, greedily, answers directly (and wrongly);
3. GRPO with multi-turn rollouts (``--agent.env calc_task:make_env``): RL finds that calling the tool pays;
4. held-out evaluation (``--eval.*``, the same agent loop) before and after training;
5. the control: the same run with a calculator that always answers an error (``calc_task:make_broken_env``),
   whose accuracy stays low.

    python recipes/calc_task.py [--steps 30] [--out runs/calc] [--runs tool,control] [--backend hf|sglang|vllm]
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import os
import random
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from rlhf_sg.agent import Environment, StepResult, ToolError  # noqa: E402

CALL_OPEN, CALL_CLOSE = "{", "}"


# ---- the environment (the interface example of the README) ------------------------------------------------------


def calculate(expression: str) -> int:
    """``a*b`` (or + / -) of two integers, parsed with ``ast`` (never ``eval``); ToolError when it is not."""
    try:
        tree = ast.parse(expression, mode="eval").body
    except SyntaxError as e:
        raise ToolError("malformed", f"cannot parse {expression!r}") from e
    ops = {ast.Mult: lambda a, b: a * b, ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b}
    if not (isinstance(tree, ast.BinOp) and type(tree.op) in ops
            and all(isinstance(x, ast.Constant) and type(x.value) is int for x in (tree.left, tree.right))):
        raise ToolError("malformed", f"{expression!r} is not INT*INT, INT+INT or INT-INT")
    if max(abs(tree.left.value), abs(tree.right.value)) >= 10**6:
        raise ToolError("malformed", "operands too large")
    return ops[type(tree.op)](tree.left.value, tree.right.value)


class CalcEnv(Environment):
    """One trajectory: a turn that ends on ``}`` is a calculator call ``{EXPR}`` answered ``=RESULT;``; a turn that
    ends otherwise (EOS) is the final answer and ends the trajectory."""

    def reset(self, prompt) -> None:
        self.calls = 0

    def step(self, turn_ids, turn_text, finish_reason):
        if finish_reason != "stop" or not turn_text.endswith(CALL_CLOSE):
            return StepResult(done=True)  # the final answer
        if CALL_OPEN not in turn_text:
            raise ToolError("malformed", "a call is {EXPR}")
        self.calls += 1
        expression = turn_text[turn_text.rindex(CALL_OPEN) + 1 : -1]
        return StepResult(observation_ids=self.encode(f"={self.tool(expression)};"), tool_call=True)

    def tool(self, expression: str) -> int:
        return calculate(expression)

    def error_observation(self, kind: str, message: str) -> list[int]:
        return self.encode("=error;")


class BrokenCalcEnv(CalcEnv):
    """The control: the calculator always fails."""

    def tool(self, expression: str) -> int:
        raise RuntimeError("calculator out of order")


def make_env(tokenizer) -> CalcEnv:
    """``--agent.env calc_task:make_env``: one environment per trajectory."""
    return CalcEnv(tokenizer)


def make_broken_env(tokenizer) -> BrokenCalcEnv:
    return BrokenCalcEnv(tokenizer)


def final_answer(text: str) -> str:
    """The model's answer: what follows its last calculator call (the model's text only: no observation)."""
    return text[text.rindex(CALL_CLOSE) + 1 :].strip() if CALL_CLOSE in text else text.strip()


def calc_reward(prompts: list[str], completions: list[str], labels: list) -> list[float]:
    """1 for the right product as the final answer, else 0."""
    return [float(final_answer(c) == str(label)) for c, label in zip(completions, labels)]


# ---- data and the warm start -------------------------------------------------------------------------------------


def problems(seed: int, count: int, exclude: set[str] = frozenset()) -> list[tuple[str, str]]:
    rng, out, seen = random.Random(seed), [], set(exclude)
    while len(out) < count:
        a, b = rng.randrange(100, 1000), rng.randrange(10, 100)
        prompt = f"{a}*{b}="
        if prompt not in seen:
            seen.add(prompt)
            out.append((prompt, str(a * b)))
    return out


def write_prompts(path: str, rows: list[tuple[str, str]]) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in rows)
    return path


def trace(prompt: str, answer: str, tool: bool) -> list[tuple[str, bool]]:
    """A warm-start example as (text, trained) segments: the tool's observation is not trained on."""
    if not tool:
        return [(answer, True)]
    return [(CALL_OPEN + prompt[:-1] + CALL_CLOSE, True), (f"={answer};", False), (answer, True)]


def warm_start(model, tokenizer, rows, steps: int, tool_frac: float, lr: float = 3e-3, batch_size: int = 32,
               seed: int = 0) -> None:
    rng = random.Random(seed)
    eos = tokenizer.eos_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    for _ in range(steps):
        ids, labels = [], []
        for prompt, answer in (rng.choice(rows) for _ in range(batch_size)):
            x, y = enc(prompt), [-100] * len(enc(prompt))
            for text, trained in trace(prompt, answer, rng.random() < tool_frac):
                t = enc(text)
                x, y = x + t, y + (t if trained else [-100] * len(t))
            x, y = x + [eos], y + [eos]
            ids.append(x)
            labels.append(y)
        supervised_step(model, opt, ids, labels, pad=eos)
    model.eval()


def supervised_step(model, opt, ids: list[list[int]], labels: list[list[int]], pad: int) -> None:
    """One optimizer step of the language-model loss on rows of ids (right-padded with ``pad``) and their labels
    (-100: not trained)."""
    width = max(map(len, ids))
    loss = model(input_ids=torch.tensor([x + [pad] * (width - len(x)) for x in ids]),
                 attention_mask=torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids]),
                 labels=torch.tensor([y + [-100] * (width - len(y)) for y in labels])).loss
    loss.backward()
    opt.step()
    opt.zero_grad()


def prepare(out: str, warm_start_steps: int, tool_frac: float = 0.3, seed: int = 0) -> tuple[str, str, str]:
    """The warm-started policy, the training prompts and the held-out prompts (reused when already there)."""
    from rlhf_sg.tiny import build_tiny_model, build_tokenizer

    os.makedirs(out, exist_ok=True)
    held_out = problems(seed + 1, 64)
    train_rows = problems(seed, 2048, exclude={p for p, _ in held_out})
    prompts = write_prompts(os.path.join(out, "prompts.jsonl"), train_rows)
    eval_prompts = write_prompts(os.path.join(out, "held_out.jsonl"), held_out)
    policy = os.path.join(out, "policy_sft")
    if not os.path.isfile(os.path.join(policy, "model.safetensors")):
        tokenizer = build_tokenizer()
        model = build_tiny_model("qwen2", "small", seed=seed)
        print(f"warm start: {warm_start_steps} supervised steps, {tool_frac:.0%} tool traces ...", flush=True)
        warm_start(model, tokenizer, train_rows, warm_start_steps, tool_frac, seed=seed)
        model.save_pretrained(policy, safe_serialization=True)
        tokenizer.save_pretrained(policy)
    return policy, prompts, eval_prompts


def make_config(policy: str, prompts: str, eval_prompts: str, out: str, steps: int, env: str, backend: str = "hf"):
    from rlhf_sg.config import Config
    from rlhf_sg.tiny import build_tokenizer

    cfg = Config()
    cfg.model.pretrain = policy
    cfg.data.prompt_data, cfg.data.label_key, cfg.data.max_prompt_len = prompts, "answer", 16
    cfg.rollout.backend = backend
    cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt = 16, 8
    cfg.rollout.max_new_tokens = 32  # the whole trajectory: turns and observations
    cfg.rollout.max_model_len = 64
    cfg.agent.env = env
    cfg.agent.max_turns = 3
    cfg.agent.max_turn_tokens = 12
    cfg.agent.stop_token_ids = [build_tokenizer().convert_tokens_to_ids(CALL_CLOSE)]
    cfg.agent.tool_timeout_s = 10.0
    cfg.train.advantage_estimator = "grpo"
    cfg.train.actor_num_ranks = 1
    cfg.train.max_steps = steps
    cfg.train.actor_lr = 3e-4
    cfg.train.kl_coef = 0.0
    cfg.train.max_tokens_per_microbatch = 2048
    cfg.reward.kind, cfg.reward.function = "function", "calc_task:calc_reward"
    cfg.eval.prompt_data, cfg.eval.n_samples, cfg.eval.k, cfg.eval.greedy = eval_prompts, 4, [1, 4], True
    cfg.log.output_dir = out
    return cfg


def run(cfg) -> dict[str, dict[str, float]]:
    """Train; the held-out metrics before (step 0) and after, and the agent metrics of the first and last steps."""
    from rlhf_sg.trainer.ppo import PPOTrainer

    trainer = PPOTrainer(cfg, reward_fn=calc_reward)
    try:
        trainer.setup()
        history = trainer.fit()
    finally:
        trainer.shutdown()
    evals = dict(trainer.eval_history)
    return {"before": evals[0], "after": evals[max(evals)], "first_step": history[0], "last_step": history[-1]}


def report(name: str, r: dict) -> None:
    b, a, f, last = r["before"], r["after"], r["first_step"], r["last_step"]
    print(f"\n{name}: held-out greedy accuracy {b['eval/greedy_accuracy']:.3f} -> {a['eval/greedy_accuracy']:.3f}; "
          f"pass@1 {b['eval/pass@1']:.3f} -> {a['eval/pass@1']:.3f}")
    print(f"{name}: tool calls / trajectory {f['agent/tool_calls']:.2f} -> {last['agent/tool_calls']:.2f}; "
          f"tool errors {last['agent/tool_error_frac']:.2f}; turns {last['agent/turns']:.2f}; "
          f"reward {f['reward/mean']:.3f} -> {last['reward/mean']:.3f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="runs/calc")
    parser.add_argument("--backend", default="hf")
    parser.add_argument("--warm-start-steps", type=int, default=800)
    parser.add_argument("--runs", default="tool,control",
                        help="comma-separated: tool (the calculator), control (a calculator that always errors)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    runs = {"tool": ("calculator", "calc_task:make_env"),
            "control": ("control (calculator always errors)", "calc_task:make_broken_env")}
    chosen = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not chosen or set(chosen) - set(runs):
        parser.error(f"--runs: choose from {sorted(runs)}, got {args.runs!r}")
    policy, prompts, eval_prompts = prepare(args.out, args.warm_start_steps)
    results = {}
    for key in chosen:
        name, env = runs[key]
        results[name] = run(make_config(policy, prompts, eval_prompts, os.path.join(args.out, key), args.steps, env,
                                        args.backend))
    for name, r in results.items():
        report(name, r)


if __name__ == "__main__":
    main()
