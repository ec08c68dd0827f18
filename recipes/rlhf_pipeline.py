"""The RLHF pipeline end to end on a CPU, on single-digit addition (``arith_task.py``'s task over every "a+b=" with
a, b in 0..9: 100 problems, 20 of them held out of PPO by :func:`split_problems`):

1. **SFT** (``rlhf_sg.stages.train_sft``): a tiny base model learns the answer format from a few supervised steps, so it
   is right some of the time (the supervised policy RL starts from);
2. **reward model** (``train_rm``): Bradley-Terry on synthetic preferences, the right answer preferred over a wrong
   number, a malformed answer or one of the SFT policy's own wrong samples, with label noise (a fraction of the pairs
   flipped); held-out pair accuracy on a random 20 % of the pairs (over every problem) it never trains on;
3. **PPO against the learned reward model** (``--reward.kind model``, the critic started from it) on the training
   problems: the SFT and the PPO policy judged on the same problems with the same sampling seed
   (:func:`policy_figures`), by the reward model's score and by the *true* rule (the exact answer), on the training
   problems and on the held-out ones PPO never sees; and the run's own held-out pass@1 (``--eval.reward_function``).
   A reward model that is gamed raises only its score;
4. **DPO** on the same preferences from the same SFT policy, the alternative to 2 + 3: its held-out preference
   accuracy and its sampled rule accuracy on the held-out problems before and after.

    python recipes/rlhf_pipeline.py [--out runs/rlhf_pipeline] [--ppo-steps 30] [--seed 0]

Each stage writes its run under ``--out`` (``sft/``, ``rm/``, ``ppo/``, ``dpo/``) and the figures go to
``<out>/summary.json``; ``<out>/rlhf_pipeline.png`` draws the PPO run.
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

import arith_task  # noqa: E402
import torch  # noqa: E402
from quickstart_cpu import held_out_accuracy, make_config  # noqa: E402

from rlhf_sg.plot import plot_run  # noqa: E402
from rlhf_sg.stages import StageConfig, train_dpo, train_rm, train_sft  # noqa: E402
from rlhf_sg.tiny import build_tiny_model, build_tokenizer  # noqa: E402
from rlhf_sg.trainer import train  # noqa: E402

#: the wrong answers a preference pair may reject: every other number the task's sums can take, and malformed
#: answers a sampling policy produces (so the reward model has seen what PPO's samples can look like)
MALFORMED = ["+", "=", "1+", "4=", "00", "2 2"]

#: the pipeline's task: every "a+b=" with 0 <= a, b <= MAX_DIGIT (100 problems, sums 0 to 18), of which a
#: HELD_OUT_FRACTION (seeded, by problem) is held out of PPO: enough problems that what PPO learns on the training
#: ones can carry over to the held-out ones (on the quickstart's 25, RL memorises the 20 it trains on)
MAX_DIGIT = 9
HELD_OUT_FRACTION = 0.2


def split_problems(seed: int, max_digit: int = MAX_DIGIT,
                   held_out_fraction: float = HELD_OUT_FRACTION) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(training problems, held-out problems): the task's (prompt, answer) problems in their seeded order, the first
    ``held_out_fraction`` of them held out. PPO trains on the first part only and is judged on both."""
    problems = arith_task.problems(seed, max_digit)
    cut = round(len(problems) * held_out_fraction)
    return problems[cut:], problems[:cut]


def _write_jsonl(path: str, rows: list[dict]) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def write_data(out: str, seed: int, label_noise: float, held_out_fraction: float = 0.2,
               policy_samples: dict[str, list[str]] | None = None) -> dict[str, str]:
    """The stages' data files: SFT rows (every problem: the supervised data stands for pretraining), and preference
    pairs over every problem, split at random into training pairs (a ``label_noise`` fraction flipped, seeded) and
    held-out pairs (never flipped): the reward model is judged on pairs it never saw, as a preference dataset's
    held-out split judges it. The right answer is preferred over every other sum and two of the malformed answers, and
    over each wrong answer in ``policy_samples`` (prompt -> the SFT policy's sampled answers, repeats kept:
    preferences over the policy's own samples, weighted as often as it makes each mistake, which PPO will sample).
    The PPO prompt files split the problems by :func:`split_problems` (PPO never trains on the held-out problems)."""
    rng = random.Random(seed)
    train_problems, held_out_problems = split_problems(seed)
    problems = arith_task.problems(seed, MAX_DIGIT)
    sums = sorted({int(answer) for _, answer in problems})
    policy_samples = policy_samples or {}
    pairs = []
    for prompt, answer in problems:
        synthetic = [str(s) for s in sums if str(s) != answer] + rng.sample(MALFORMED, 2)
        # one pair per wrong sample, repeats kept: the mistakes the policy makes most weigh most
        sampled = [a for a in policy_samples.get(prompt, []) if a.strip() and a != answer]
        pairs += [{"prompt": prompt, "chosen": answer, "rejected": rejected} for rejected in synthetic + sampled]
    rng.shuffle(pairs)
    cut = int(len(pairs) * held_out_fraction)
    held_pairs, train_pairs = pairs[:cut], pairs[cut:]
    for row in train_pairs:
        if rng.random() < label_noise:
            row["chosen"], row["rejected"] = row["rejected"], row["chosen"]
    data = os.path.join(out, "data")
    return {
        "sft": _write_jsonl(os.path.join(data, "sft.jsonl"),
                            [{"prompt": p, "completion": a} for p, a in problems]),
        "prefs": _write_jsonl(os.path.join(data, "prefs.jsonl"), train_pairs),
        "prefs_held_out": _write_jsonl(os.path.join(data, "prefs_held_out.jsonl"), held_pairs),
        "prompts": _write_jsonl(os.path.join(data, "prompts.jsonl"),
                                [{"prompt": p, "answer": a} for p, a in train_problems]),
        "held_out": _write_jsonl(os.path.join(data, "held_out.jsonl"),
                                 [{"prompt": p, "answer": a} for p, a in held_out_problems]),
    }


def stage_config(stage: str, model: str, data: str, out: str, *, eval_data: str | None = None, lr: float,
                 epochs: int, batch_size: int, seed: int) -> StageConfig:
    cfg = StageConfig(stage=stage)
    cfg.model.pretrain, cfg.data.train_data, cfg.data.eval_data = model, data, eval_data
    cfg.data.max_len = 32
    cfg.train.lr, cfg.train.epochs, cfg.train.batch_size, cfg.train.seed = lr, epochs, batch_size, seed
    cfg.log.output_dir, cfg.log.progress_bar = out, False
    return cfg


@torch.no_grad()
def sample_answers(model_dir: str, seed: int, samples: int = 16) -> dict[str, list[str]]:
    """``samples`` answers (temperature 1, at most 3 tokens) the model at ``model_dir`` gives to every problem."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(seed)
    answers = {}
    for prompt, _ in arith_task.problems(seed, MAX_DIGIT):
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]] * samples)
        out, done = [[] for _ in range(samples)], [False] * samples
        for _ in range(3):
            nxt = torch.multinomial(torch.softmax(model(input_ids=ids).logits[:, -1, :], -1), 1, generator=g)
            for i, t in enumerate(nxt.flatten().tolist()):
                done[i] = done[i] or t == tokenizer.eos_token_id
                if not done[i]:
                    out[i].append(t)
            ids = torch.cat([ids, nxt], dim=1)
        answers[prompt] = [tokenizer.decode(o) for o in out]
    return answers


@torch.no_grad()
def policy_figures(model_dir: str, rm_dir: str, data: list[tuple[str, str]], seed: int, samples: int = 32,
                   max_new_tokens: int = 4) -> dict[str, float]:
    """The policy at ``model_dir`` sampled as PPO samples it (temperature 1, at most ``max_new_tokens`` tokens) on
    the (prompt, answer) problems ``data``, ``samples`` a problem: the exact-answer rate (the true rule) and the
    reward model's mean score (normalised with its saved statistics, read at each sample's last token, as
    ``--reward.kind model`` reads it). The same problems and sampling seed for every policy, so two policies'
    figures differ by the policy alone (a step's ``reward/mean`` also moves with the prompts that step drew)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_sg.models import ValueHeadModel
    from rlhf_sg.packing import reward_scores

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rm = ValueHeadModel.from_pretrained(rm_dir).eval()
    eos = tokenizer.eos_token_id
    g = torch.Generator().manual_seed(seed)
    right, scores = 0, []
    for prompt, answer in data:
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt_ids] * samples)
        out, done = [[] for _ in range(samples)], [False] * samples
        for _ in range(max_new_tokens):
            nxt = torch.multinomial(torch.softmax(model(input_ids=ids).logits[:, -1, :], -1), 1, generator=g)
            for i, t in enumerate(nxt.flatten().tolist()):
                if not done[i]:
                    out[i].append(t)  # the EOS too: the reward model reads the sample as the rollout has it
                    done[i] = t == eos
            ids = torch.cat([ids, nxt], dim=1)
        right += sum(tokenizer.decode([t for t in o if t != eos]) == answer and o[-1] == eos for o in out)
        width = len(prompt_ids) + max(len(o) for o in out)
        rows = [prompt_ids + o for o in out]
        seqs = torch.tensor([r + [eos] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        scores.append(rm.normalize_rewards(reward_scores(rm, seqs, mask)))
    return {"rule_accuracy": right / (samples * len(data)), "rm_score": float(torch.cat(scores).mean())}


@torch.no_grad()
def held_out_rule_accuracy(model_dir: str, seed: int, samples: int = 16) -> float:
    """The exact-answer rate of ``samples`` samples (temperature 1) per held-out problem."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    held_out = split_problems(seed)[1]
    return arith_task.sample_accuracy(model, tokenizer, samples_per_problem=samples, seed=seed, data=held_out)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/rlhf_pipeline")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft-epochs", type=int, default=60)
    parser.add_argument("--rm-epochs", type=int, default=30)
    parser.add_argument("--rm-lr", type=float, default=3e-4)
    parser.add_argument("--dpo-epochs", type=int, default=2)
    parser.add_argument("--dpo-lr", type=float, default=1e-4)
    parser.add_argument("--ppo-steps", type=int, default=30)
    parser.add_argument("--label-noise", type=float, default=0.1)
    parser.add_argument("--figure-samples", type=int, default=64,
                        help="samples a problem for the policies' before / after figures")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    out = args.out
    files = write_data(out, args.seed, args.label_noise)
    summary: dict = {"seed": args.seed, "label_noise": args.label_noise}

    # the base model: a tiny Qwen2 and a character tokenizer, built locally
    base = os.path.join(out, "base")
    if not os.path.isfile(os.path.join(base, "model.safetensors")):
        build_tiny_model("qwen2", "small", seed=args.seed).save_pretrained(base, safe_serialization=True)
        build_tokenizer().save_pretrained(base)

    print("== 1. SFT", flush=True)
    train_sft(stage_config("sft", base, files["sft"], os.path.join(out, "sft"), lr=3e-3, epochs=args.sft_epochs,
                           batch_size=32, seed=args.seed))
    sft = os.path.join(out, "sft", "final_hf")
    summary["sft_held_out_rule_accuracy"] = held_out_rule_accuracy(sft, args.seed)
    # the preferences compare the right answer with the SFT policy's own wrong samples too
    files = write_data(out, args.seed, args.label_noise, policy_samples=sample_answers(sft, args.seed))

    print("== 2. reward model", flush=True)
    rm = train_rm(stage_config("rm", sft, files["prefs"], os.path.join(out, "rm"), eval_data=files["prefs_held_out"],
                               lr=args.rm_lr, epochs=args.rm_epochs, batch_size=32, seed=args.seed))
    rm_evals = [r["eval/accuracy"] for r in rm if "eval/accuracy" in r]
    summary["rm_held_out_pair_accuracy"] = [rm_evals[0], rm_evals[-1]]

    print("== 3. PPO against the reward model", flush=True)
    ppo_dir = os.path.join(out, "ppo")
    cfg = make_config(sft, files["prompts"], ppo_dir, args.ppo_steps, "gae", "hf", evaluate=True)
    cfg.eval.prompt_data = files["held_out"]
    cfg.eval.reward_function = "arith_task:addition_reward"  # the true rule, not the reward model
    cfg.eval.interval, cfg.eval.n_samples = 10, 32
    cfg.reward.kind, cfg.reward.function = "model", None
    reward_model = cfg.model.reward_pretrain = os.path.join(out, "rm", "final_hf")
    history = train(cfg)
    rm_score = [h["reward/mean"] for h in history]
    evals = held_out_accuracy(os.path.join(ppo_dir, "metrics.jsonl"))
    summary["ppo_rm_score_first5_last5"] = [sum(rm_score[:5]) / 5, sum(rm_score[-5:]) / 5]
    summary["ppo_held_out_rule_pass@1"] = [evals[0][1], evals[-1][1]]
    # the SFT policy and the PPO policy on the same problems with the same sampling seed: the reward model's score
    # and the true rule's accuracy, on the training problems and on the held-out ones
    parts = dict(zip(("train", "held_out"), split_problems(args.seed)))
    for name, data in parts.items():
        before, after = (policy_figures(policy, reward_model, data, args.seed, samples=args.figure_samples)
                         for policy in (sft, os.path.join(ppo_dir, "final_hf")))
        summary[f"ppo_{name}_rm_score"] = [before["rm_score"], after["rm_score"]]
        summary[f"ppo_{name}_rule_accuracy"] = [before["rule_accuracy"], after["rule_accuracy"]]
    plot_run(os.path.join(ppo_dir, "metrics.jsonl"), os.path.join(out, "rlhf_pipeline.png"),
             title="PPO against the learned reward model (reward: its score; held-out pass@1: the true rule)")

    print("== 4. DPO on the same preferences (instead of 2 + 3)", flush=True)
    dpo = train_dpo(stage_config("dpo", sft, files["prefs"], os.path.join(out, "dpo"),
                                 eval_data=files["prefs_held_out"], lr=args.dpo_lr, epochs=args.dpo_epochs,
                                 batch_size=32, seed=args.seed))
    dpo_evals = [r["eval/accuracy"] for r in dpo if "eval/accuracy" in r]
    summary["dpo_held_out_pair_accuracy"] = [dpo_evals[0], dpo_evals[-1]]
    summary["dpo_held_out_rule_accuracy"] = [summary["sft_held_out_rule_accuracy"],
                                             held_out_rule_accuracy(os.path.join(out, "dpo", "final_hf"), args.seed)]

    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"\n== the pipeline's figures (held-out problems: the {len(parts['held_out'])} PPO never trains on; held-out "
          "pairs: a random 20 % of the preference pairs, over every problem)")
    print(f"SFT policy: held-out rule accuracy {summary['sft_held_out_rule_accuracy']:.3f}")
    print("reward model: held-out pair accuracy {:.3f} -> {:.3f}".format(*summary["rm_held_out_pair_accuracy"]))
    print("PPO: reward-model score per step (its training prompts, mean of the first / last 5 steps) {:.3f} -> "
          "{:.3f}; held-out rule pass@1 in the run {:.3f} -> {:.3f}".format(
              *summary["ppo_rm_score_first5_last5"], *summary["ppo_held_out_rule_pass@1"]))
    for name in ("train", "held_out"):
        print("PPO vs SFT on the {} problems ({} samples a problem): reward-model score {:.3f} -> {:.3f}; true rule "
              "accuracy {:.3f} -> {:.3f}".format(name, args.figure_samples, *summary[f"ppo_{name}_rm_score"],
                                                  *summary[f"ppo_{name}_rule_accuracy"]))
    print("DPO: held-out pair accuracy {:.3f} -> {:.3f}; held-out rule accuracy {:.3f} -> {:.3f}".format(
        *summary["dpo_held_out_pair_accuracy"], *summary["dpo_held_out_rule_accuracy"]))
    print(f"summary: {os.path.join(out, 'summary.json')}")
    return summary


if __name__ == "__main__":
    main()
