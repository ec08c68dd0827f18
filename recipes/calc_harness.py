"""The calculator task of ``recipes/calc_task.py``, driven by an agent harness written with the ``openai`` client.

No ``Environment`` here: the agent is an ordinary OpenAI tool-calling loop (:func:`solve`) that sends
``tools=[calculator]``, reads ``message.tool_calls``, runs the calculator, sends the result back as a ``tool``
message and returns the reward. The trainer serves the policy behind an OpenAI-compatible endpoint
(``--agent.harness calc_harness:solve``) and trains on the token ids the engine prefilled and sampled::

    user        417*38=
    assistant   <tool_call>{"name": "calculator", "arguments": {"expression": "417*38"}}</tool_call>
    tool        15846                  (rendered by the chat template: mask 0, never trained on)
    assistant   15846                  (reward 1 when it is the product)

What it does, top to bottom:
1. builds a tiny Qwen2-style model over the byte-level BPE chat tokenizer (Qwen2.5's chat template and
   ``<tool_call>`` tokens), locally;
2. a short supervised warm start on the endpoint's own renderings: tool conversations (a third) and direct
   answers (the right product, which a model this size cannot compute): the policy calls the tool some of
   the time and, greedily, answers directly (and wrongly);
3. held-out evaluation through the same harness against an endpoint on the embedded engine: pass@1 (sampled,
   temperature 1) and greedy accuracy, before and after;
4. GRPO with ``--agent.harness calc_harness:solve`` (evaluation during training does not run harnesses, so the
   recipe evaluates the warm-started and the exported policy itself).

    python recipes/calc_harness.py [--steps 10] [--out runs/calc_harness]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import openai  # noqa: E402
import torch  # noqa: E402
from calc_task import calculate, problems, supervised_step, write_prompts  # noqa: E402

from rlhf_sg.agent import ToolError  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "a*b, a+b or a-b of two integers",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
MAX_TURNS = 3  # model calls per run
TURN_TOKENS = 32  # sampled tokens per call at most (a call is about 25)
BUDGET_TOKENS = 48  # sampled tokens per run (the session's budget: --rollout.max_new_tokens)
MAX_CONTEXT = 192  # prompt + completion of one call (a run's first prompt is about 40 tokens)


# ---- the harness: what a user writes, the openai client only -----------------------------------------------------


def run_tool(call) -> str:
    """The tool message's content for one of ``message.tool_calls``: the result, or an error the model reads."""
    if call.function.name != "calculator":
        return f"error: no tool named {call.function.name!r}"
    try:
        expression = json.loads(call.function.arguments)["expression"]
        return str(calculate(str(expression)))
    except (json.JSONDecodeError, KeyError, TypeError):
        return "error: arguments must be {\"expression\": \"INT*INT\"}"
    except ToolError as e:
        return f"error: {e}"


async def solve_at(base_url: str, api_key: str, prompt, temperature: float) -> float:
    """One episode: ask, run every tool call the model makes and send the results back, until it answers; 1.0 when
    the answer is the product, else 0.0 (also when the session's token budget or the turns run out)."""
    messages = [{"role": "user", "content": prompt.text}]
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300) as client:
        for _ in range(MAX_TURNS):
            try:
                out = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                           temperature=temperature, max_tokens=TURN_TOKENS)
            except openai.BadRequestError as e:
                if e.code in ("budget_exhausted", "context_length_exceeded"):
                    return 0.0  # the episode ran out of tokens without an answer
                raise
            message = out.choices[0].message
            if not message.tool_calls:
                return float((message.content or "").strip() == str(prompt.label))
            messages.append(message.model_dump(exclude_none=True))
            messages += [{"role": "tool", "tool_call_id": c.id, "content": run_tool(c)} for c in message.tool_calls]
    return 0.0


async def solve(base_url: str, api_key: str, prompt) -> float:
    """``--agent.harness calc_harness:solve``: sampled at temperature 1."""
    return await solve_at(base_url, api_key, prompt, 1.0)


async def solve_greedy(base_url: str, api_key: str, prompt) -> float:
    return await solve_at(base_url, api_key, prompt, 0.0)


# ---- the chat template, and the warm start on the endpoint's own renderings -----------------------------------


def compact_template() -> str:
    """Qwen2.5's chat template as :func:`rlhf_sg.tiny.build_chat_tokenizer` has it, the tools' system turn cut to
    their names (``<tools>calculator</tools>``): the full signatures are about 220 tokens of every row, which a CPU
    run would spend its time on."""
    from rlhf_sg.tiny import QWEN_STYLE_CHAT_TEMPLATE

    head, sep, tail = QWEN_STYLE_CHAT_TEMPLATE.partition("{%- elif messages[0]['role'] == 'system' %}")
    assert sep, "the chat template changed: update compact_template"
    tools = ("{%- if tools %}{{- '<|im_start|>system\\n' }}"
             "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
             "{{- '<tools>' }}"
             "{%- for tool in tools %}{{- tool.function.name if tool.function is defined else tool.name }}"
             "{%- endfor %}{{- '</tools><|im_end|>\\n' }}")
    return tools + sep + tail


def rendered(renderer, prompt: str, answer: str, tool: bool) -> list[tuple[list[int], bool]]:
    """One warm-start conversation as (ids, trained) segments, the ids the endpoint prefills for it: the prompt
    (with the tools' system prompt), then the assistant's turns (trained) and the tool's message (not)."""
    enc = lambda text: list(renderer.tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    eos = renderer.tokenizer.eos_token
    question = [{"role": "user", "content": prompt}]
    head = renderer.render(question, TOOLS)
    if not tool:
        return [(head, False), (enc(answer + eos), True)]
    expression = prompt.rstrip("=")
    call = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'
    reply = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0", "type": "function", "function": {
        "name": "calculator", "arguments": json.dumps({"expression": expression})}}]}
    messages = question + [reply, {"role": "tool", "tool_call_id": "call_0", "content": answer}]
    glue = renderer.extend(messages, TOOLS, 1, renderer.tokenizer.eos_token_id)
    return [(head, False), (enc(call + eos), True), (glue, False), (enc(answer + eos), True)]


def warm_start(model, renderer, rows, steps: int, tool_frac: float, lr: float = 3e-3, batch_size: int = 16,
               seed: int = 0) -> None:
    rng = random.Random(seed)
    pad = renderer.tokenizer.pad_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        ids, labels = [], []
        for prompt, answer in (rng.choice(rows) for _ in range(batch_size)):
            x, y = [], []
            for seg, trained in rendered(renderer, prompt, answer, rng.random() < tool_frac):
                x, y = x + seg, y + (seg if trained else [-100] * len(seg))
            ids.append(x)
            labels.append(y)
        supervised_step(model, opt, ids, labels, pad)
    model.eval()


def prepare(out: str, warm_start_steps: int, tool_frac: float = 0.3, seed: int = 0) -> tuple[str, str, list]:
    """The warm-started policy, the training prompts file and the held-out rows (the policy reused when there)."""
    from rlhf_sg.serve.renderer import renderer_for
    from rlhf_sg.tiny import build_chat_tokenizer, build_tiny_model

    os.makedirs(out, exist_ok=True)
    held_out = problems(seed + 1, 64)  # calc_task's held-out problems
    train_rows = problems(seed, 2048, exclude={p for p, _ in held_out})
    prompts = write_prompts(os.path.join(out, "prompts.jsonl"), train_rows)
    policy = os.path.join(out, "policy_sft")
    if not os.path.isfile(os.path.join(policy, "model.safetensors")):
        tokenizer = build_chat_tokenizer()
        tokenizer.chat_template = compact_template()
        model = build_tiny_model("qwen2", "tiny", vocab_size=len(tokenizer), seed=seed, max_len=512)
        print(f"warm start: {warm_start_steps} supervised steps, {tool_frac:.0%} tool conversations ...", flush=True)
        warm_start(model, renderer_for(tokenizer), train_rows, warm_start_steps, tool_frac, seed=seed)
        model.save_pretrained(policy, safe_serialization=True)
        tokenizer.save_pretrained(policy)
    return policy, prompts, held_out


# ---- evaluation through the harness, and training --------------------------------------------------------------


def evaluate(policy: str, held_out: list[tuple[str, str]], n: int = 4, seed: int = 0) -> dict[str, float]:
    """The harness on every held-out problem against an endpoint on the embedded engine serving ``policy``:
    ``pass@1`` (the mean reward of ``n`` runs at temperature 1), ``greedy`` accuracy and tool calls per run."""
    from transformers import AutoTokenizer

    from backends.base import BackendConfig
    from backends.embedded import EmbeddedBackend
    from rlhf_sg.data import Prompt
    from rlhf_sg.serve.endpoint import Endpoint
    from rlhf_sg.serve.harness import serve_and_run

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    backend = EmbeddedBackend(BackendConfig(model_path=policy, max_model_len=MAX_CONTEXT, num_threads=1, seed=seed))
    try:
        endpoint = Endpoint([backend], tokenizer, "policy")
        prompts = [Prompt([], p, a) for p, a in held_out]
        runs = {}
        for name, harness, k in (("sampled", solve, n), ("greedy", solve_greedy, 1)):
            runs[name] = serve_and_run(endpoint, harness, prompts, k, workers=4, budget_tokens=BUDGET_TOKENS,
                                       max_context=MAX_CONTEXT, timeout_s=600)
            failed = [r.error for r in runs[name] if r.error]
            if failed:
                raise RuntimeError(f"evaluation: {len(failed)} harness runs failed, the first: {failed[0]}")
    finally:
        backend.shutdown()
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"pass@1": mean([r.reward for r in runs["sampled"]]), "greedy": mean([r.reward for r in runs["greedy"]]),
            "tool_calls": mean([r.tool_calls for r in runs["sampled"]])}


def make_config(policy: str, prompts: str, out: str, steps: int, backend: str = "hf"):
    from rlhf_sg.config import Config

    cfg = Config()
    cfg.model.pretrain = policy
    cfg.data.prompt_data, cfg.data.label_key, cfg.data.max_prompt_len = prompts, "answer", 16
    cfg.rollout.backend = backend
    cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt = 16, 8
    cfg.rollout.max_new_tokens = BUDGET_TOKENS  # each run's session: sampled tokens over all its calls
    cfg.rollout.max_model_len = MAX_CONTEXT
    cfg.agent.harness, cfg.agent.harness_workers, cfg.agent.harness_timeout_s = "calc_harness:solve", 8, 600.0
    cfg.reward.kind, cfg.reward.function = "function", None  # the harness returns the reward
    cfg.train.advantage_estimator = "grpo"
    cfg.train.actor_num_ranks = 1
    cfg.train.max_steps = steps
    cfg.train.actor_lr = 1e-3  # the tiny model (calc_task's is 16 times larger: 3e-4)
    cfg.train.kl_coef = 0.0
    cfg.train.max_tokens_per_microbatch = 4096
    cfg.log.output_dir = out
    cfg.log.progress_bar = False
    return cfg


def train(cfg) -> tuple[str, list[dict[str, float]]]:
    """GRPO on harness runs; the exported policy and the per-step metrics."""
    from rlhf_sg.trainer.ppo import PPOTrainer

    trainer = PPOTrainer(cfg)
    try:
        trainer.setup()
        history = trainer.fit()
    finally:
        trainer.shutdown()
    return os.path.join(cfg.log.output_dir, "final_hf"), history


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="runs/calc_harness")
    parser.add_argument("--backend", default="hf")
    parser.add_argument("--warm-start-steps", type=int, default=800)
    parser.add_argument("--eval-samples", type=int, default=4, help="sampled runs per held-out problem (pass@1)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the openai client's line per request
    torch.set_num_threads(1)
    policy, prompts, held_out = prepare(args.out, args.warm_start_steps)
    before = evaluate(policy, held_out, args.eval_samples)
    print(f"before: held-out pass@1 {before['pass@1']:.3f}, greedy {before['greedy']:.3f}, tool calls / run "
          f"{before['tool_calls']:.2f}", flush=True)
    final, history = train(make_config(policy, prompts, os.path.join(args.out, "grpo"), args.steps, args.backend))
    after = evaluate(final, held_out, args.eval_samples)
    first, last = history[0], history[-1]
    print(f"\ncalculator harness (openai client, --agent.harness): held-out pass@1 {before['pass@1']:.3f} -> "
          f"{after['pass@1']:.3f}; greedy {before['greedy']:.3f} -> {after['greedy']:.3f}")
    print(f"tool calls / run {before['tool_calls']:.2f} -> {after['tool_calls']:.2f}; reward {first['reward/mean']:.3f}"
          f" -> {last['reward/mean']:.3f}; calls forked {sum(h['agent/calls_forked'] for h in history):.0f}, "
          f"harness errors {sum(h['agent/harness_errors'] for h in history):.0f}", flush=True)


if __name__ == "__main__":
    main()
