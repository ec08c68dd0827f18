"""A vision-language policy learns to use the image: GRPO on CPU, with a control that cannot see it.

The task: each prompt shows one image, a square of one of four colours (with pixel noise), and asks which colour it
is; the answer is one digit, ``0``-``3``. The policy is a tiny Qwen2-VL (``rlhf_sg.vision``) with its vision tower
random and frozen (``--model.freeze_vision_tower``, the default), warm-started on the answer's format only: its
supervised answers are random digits, so before RL it answers at chance (about 0.25) whatever the image. RL (GRPO
through the Ray trainer, a 2-rank ZeRO-3 actor, the embedded engine) rewards the right digit; the held-out images
(other noise, never trained on) are evaluated before and after.

The control (``--control``) runs the same recipe with every image replaced by one grey square (the same image
tokens): only the image tells the colours apart, so the control's held-out pass@1 stays near chance while the
policy that sees the colours climbs above it.

    python recipes/vision_task.py [--steps 80] [--control] [--out runs/vision_task]

Measured here (2 CPU cores, seed 0, defaults): held-out pass@1 0.195 -> 0.711 (train reward, mean of the first and
last 5 steps, 0.300 -> 0.772); the control (grey images) 0.203 -> 0.258, chance being 0.25 (train reward
0.303 -> 0.263).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

#: the four colours and their answers
COLOURS = {"0": (220, 40, 40), "1": (40, 200, 60), "2": (40, 70, 220), "3": (230, 210, 40)}
GREY = (128, 128, 128)
QUESTION = "<image> Which colour? Answer 0-3: "


def colour_reward(prompts: list[str], completions: list[str], labels: list) -> list[float]:
    """1 when the completion's first character is the right digit."""
    return [float(c[:1] == str(label)) for c, label in zip(completions, labels)]


def write_images_and_prompts(out: str, part: str, count: int, seed: int, control: bool) -> str:
    """``count`` prompts, each with a noisy square of a random colour (a grey one for the control); the JSONL path."""
    from PIL import Image

    rng = random.Random(f"{seed}-{part}")
    images = os.path.join(out, f"images-{part}{'-control' if control else ''}")
    os.makedirs(images, exist_ok=True)
    path = os.path.join(out, f"{part}{'-control' if control else ''}.jsonl")
    with open(path, "w") as f:
        for k in range(count):
            answer = rng.choice(sorted(COLOURS))
            base = torch.tensor(GREY if control else COLOURS[answer], dtype=torch.float32)
            g = torch.Generator().manual_seed(rng.randrange(2**31))
            pixels = (base + 20 * torch.randn(56, 56, 3, generator=g)).clamp(0, 255).to(torch.uint8)
            Image.fromarray(pixels.numpy()).save(os.path.join(images, f"{k}.png"))
            row = {"prompt": QUESTION, "images": [os.path.join(os.path.basename(images), f"{k}.png")], "answer": answer}
            f.write(json.dumps(row) + "\n")
    return path


def warm_start(policy: str, prompts_path: str, steps: int, seed: int = 0) -> None:
    """Supervised steps on the answer's format only: each prompt (with its image) followed by a RANDOM digit and
    EOS, so the policy learns to answer with a digit, at chance."""
    from transformers import AutoModelForImageTextToText

    from rlhf_sg.vision import load_processor, load_vision_prompts

    config, processor = load_processor(policy)
    prompts, _ = load_vision_prompts(prompts_path, config, processor, label_key="answer", max_prompt_len=64)
    tokenizer = processor.tokenizer
    model = AutoModelForImageTextToText.from_pretrained(policy)
    from rlhf_sg.vision import freeze_vision_tower

    freeze_vision_tower(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    rng = random.Random(seed)
    eos = tokenizer.eos_token_id
    model.train()
    for _ in range(steps):
        batch = [rng.choice(prompts) for _ in range(16)]
        losses = []
        for prompt in batch:
            answer = tokenizer(rng.choice(sorted(COLOURS)), add_special_tokens=False)["input_ids"] + [eos]
            ids = torch.tensor([prompt.token_ids + answer])
            labels = torch.tensor([[-100] * len(prompt.token_ids) + answer])
            kwargs = prompt.images.model_kwargs()
            kwargs["mm_token_type_ids"] = (ids == config.image_token_id).long()
            losses.append(model(input_ids=ids, labels=labels, **kwargs).loss)
        torch.stack(losses).mean().backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(policy, safe_serialization=True)


def make_config(policy: str, train_path: str, held_out: str, out: str, steps: int, lr: float):
    """GRPO on the colour prompts through the Ray trainer (a 2-rank ZeRO-3 actor, the embedded engine), held-out
    evaluation before, every 10 steps and after."""
    from rlhf_sg.config import Config

    cfg = Config()
    cfg.model.pretrain = policy
    cfg.data.prompt_data, cfg.data.label_key, cfg.data.max_prompt_len = train_path, "answer", 64
    cfg.rollout.backend = "hf"
    cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt = 8, 8
    cfg.rollout.max_new_tokens, cfg.rollout.max_model_len = 2, 96
    cfg.train.advantage_estimator, cfg.train.kl_coef = "grpo", 0.0
    cfg.train.actor_num_ranks, cfg.train.max_steps, cfg.train.actor_lr = 2, steps, lr
    cfg.reward.kind, cfg.reward.function = "function", "vision_task:colour_reward"
    cfg.eval.prompt_data, cfg.eval.n_samples, cfg.eval.k, cfg.eval.interval = held_out, 4, [1], 10
    cfg.log.output_dir = out
    cfg.log.progress_bar = cfg.log.tensorboard = cfg.log.export_hf = False
    return cfg


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warm-start-steps", type=int, default=100)
    parser.add_argument("--control", action="store_true", help="every image one grey square: the policy cannot see")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default="runs/vision_task")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from rlhf_sg.trainer import train
    from rlhf_sg.vision import save_tiny_vision_model

    out = os.path.abspath(args.out + ("-control" if args.control else ""))
    os.makedirs(out, exist_ok=True)
    train_path = write_images_and_prompts(out, "train", 64, seed=0, control=args.control)
    held_out = write_images_and_prompts(out, "held_out", 32, seed=0, control=args.control)
    policy = os.path.join(out, "policy")
    if not os.path.isfile(os.path.join(policy, "model.safetensors")):
        save_tiny_vision_model(policy, "qwen2-vl", seed=0)
        print(f"warm start: {args.warm_start_steps} supervised steps on the answer's format (random digits) ...",
              flush=True)
        warm_start(policy, train_path, args.warm_start_steps)

    cfg = make_config(policy, train_path, held_out, os.path.join(out, "run"), args.steps, args.lr)
    history = train(cfg, reward_fn=colour_reward)
    evals = [json.loads(line) for line in open(os.path.join(cfg.log.output_dir, "metrics.jsonl"))
             if "eval/pass@1" in line]
    before, after = evals[0]["eval/pass@1"], evals[-1]["eval/pass@1"]
    rewards = [h["reward/mean"] for h in history]
    print(f"{'control (grey images)' if args.control else 'policy'}: held-out pass@1 {before:.3f} -> {after:.3f}; "
          f"train reward first 5 steps {sum(rewards[:5]) / 5:.3f}, last 5 {sum(rewards[-5:]) / 5:.3f}", flush=True)
    return {"before": before, "after": after, "rewards": rewards}


if __name__ == "__main__":
    main()
