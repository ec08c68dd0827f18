"""A task a tiny model can learn on a laptop CPU: single-digit addition, "3+4=" -> "7".

Used by the quickstart recipe and the end-to-end tests:
- :func:`write_prompts` writes the prompt file (JSONL with "prompt" and "answer"),
- :func:`addition_reward` is the rule reward (``--reward.function arith_task:addition_reward``),
- :func:`warm_start` runs a short supervised warm start so that RL starts from a policy that is
  right some of the time (RL needs some correct samples to learn from).
"""

from __future__ import annotations

import json
import os
import random

import torch


def problems(seed: int = 0, max_digit: int = 4) -> list[tuple[str, str]]:
    """Every "a+b=" with 0 <= a, b <= max_digit and its answer, in a seeded order."""
    pairs = [(f"{a}+{b}=", str(a + b)) for a in range(max_digit + 1) for b in range(max_digit + 1)]
    random.Random(seed).shuffle(pairs)
    return pairs


#: how many of the problems are held out of RL training, for evaluation (the warm start sees every problem: it
#: stands for the pretrained model RL starts from)
HELD_OUT = 5


def write_prompts(path: str, seed: int = 0, part: str = "train") -> str:
    """The prompt file of ``part``: "train" (the RL prompts), "held_out" (the :data:`HELD_OUT` problems RL never
    sees) or "all"."""
    rows = problems(seed)
    rows = {"train": rows[HELD_OUT:], "held_out": rows[:HELD_OUT], "all": rows}[part]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        for prompt, answer in rows:
            f.write(json.dumps({"prompt": prompt, "answer": answer}) + "\n")
    return path


def addition_reward(prompts: list[str], completions: list[str], labels: list) -> list[float]:
    """1 for the exact answer, 0.1 for an answer made of digits only, 0 otherwise."""
    scores = []
    for completion, label in zip(completions, labels):
        text = completion.strip()
        if text == str(label):
            scores.append(1.0)
        elif text.isdigit():
            scores.append(0.1)
        else:
            scores.append(0.0)
    return scores


def warm_start(model, tokenizer, steps: int, lr: float = 3e-3, batch_size: int = 64, seed: int = 0,
               data: list[tuple[str, str]] | None = None) -> None:
    """Supervised steps on prompt + answer + EOS (loss on the answer tokens only); ``data``: (prompt, answer)
    pairs (default: this task's problems)."""
    rng = random.Random(seed)
    data = problems(seed) if data is None else data
    eos = tokenizer.eos_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        rows = [rng.choice(data) for _ in range(batch_size)]
        ids, labels = [], []
        for prompt, answer in rows:
            p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            a = tokenizer(answer, add_special_tokens=False)["input_ids"] + [eos]
            ids.append(p + a)
            labels.append([-100] * len(p) + a)
        width = max(len(x) for x in ids)
        input_ids = torch.tensor([x + [eos] * (width - len(x)) for x in ids])
        label_t = torch.tensor([y + [-100] * (width - len(y)) for y in labels])
        attn = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
        loss = model(input_ids=input_ids, attention_mask=attn, labels=label_t).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


@torch.no_grad()
def sample_accuracy(model, tokenizer, samples_per_problem: int = 4, temperature: float = 1.0, seed: int = 0,
                    data: list[tuple[str, str]] | None = None) -> float:
    """Fraction of sampled answers that are exactly right (the RL objective without shaping), over ``data``'s
    (prompt, answer) pairs (default: this task's problems)."""
    g = torch.Generator().manual_seed(seed)
    eos = tokenizer.eos_token_id
    correct = total = 0
    for prompt, answer in problems(seed) if data is None else data:
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]] * samples_per_problem)
        out = [[] for _ in range(samples_per_problem)]
        done = [False] * samples_per_problem
        for _ in range(3):
            logits = model(input_ids=ids).logits[:, -1, :] / temperature
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)
            for i, t in enumerate(nxt.flatten().tolist()):
                if not done[i]:
                    if t == eos:
                        done[i] = True
                    else:
                        out[i].append(t)
            ids = torch.cat([ids, nxt], dim=1)
        for o in out:
            correct += tokenizer.decode(o) == answer
            total += 1
    return correct / total
