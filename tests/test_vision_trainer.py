"""A vision-language policy through the trainer: real Ray, a 2-rank DeepSpeed ZeRO-3 actor, the embedded engine, two
GRPO steps on prompts with images (and text-only ones: a rank whose micro-batch holds no image still calls the
partitioned vision tower, or ZeRO-3's gathers pair up wrongly and the step hangs).

After the sync the engine's log-probs of step 2's samples are the trainer's own (the backend contract's 1e-4): the
images reached both sides with the same M-RoPE positions, and the engine holds the trained weights. The frozen vision
tower is bit for bit the checkpoint's after training; the language model moved."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)

from test_family_loop import family_config, train_recording_gaps  # noqa: E402

pytestmark = pytest.mark.slow


def _prompts(path: str, images_dir: str) -> str:
    """Five prompts: two with an image (two sizes, so the image-token counts differ), three text-only."""
    from PIL import Image

    os.makedirs(images_dir, exist_ok=True)
    rows = []
    for k in range(5):
        if k < 2:
            g = torch.Generator().manual_seed(k)
            side = 28 * (2 + k % 2)
            pixels = torch.randint(0, 256, (side, side, 3), generator=g, dtype=torch.uint8).numpy()
            Image.fromarray(pixels).save(os.path.join(images_dir, f"{k}.png"))
            rows.append({"prompt": f"What is shown {k}? <image>", "images": [f"img/{k}.png"], "answer": str(k)})
        else:
            rows.append({"prompt": f"Say a number {k}.", "answer": str(k)})
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def test_a_vision_language_policy_trains_and_the_engine_holds_its_weights(ray_cluster, tmp_path):
    from safetensors.torch import load_file

    from rlhf_sg.vision import save_tiny_vision_model

    model_path = save_tiny_vision_model(str(tmp_path / "qwen2-vl"), "qwen2-vl")
    prompts = _prompts(str(tmp_path / "prompts.jsonl"), str(tmp_path / "img"))
    cfg = family_config("qwen2-vl", model_path, prompts, str(tmp_path / "run"))
    cfg.data.max_prompt_len = 32
    cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt, cfg.rollout.max_model_len = 5, 3, 96
    # micro-batches of two or three sequences, 3 samples a prompt: the token budget's split then gives one rank a
    # text-only micro-batch where the other's has an image (a tower call unpaired on gloo fails within the timeout)
    cfg.train.max_tokens_per_microbatch, cfg.train.timeout_s = 36, 300
    cfg.log.export_hf = True
    cfg.eval.prompt_data, cfg.eval.interval, cfg.eval.n_samples, cfg.eval.k = prompts, 0, 2, [1]  # before and after
    history, gaps = train_recording_gaps(cfg)
    assert [h["weight_version"] for h in history] == [1, 2]
    assert history[0]["reward/std"] > 0, history[0]
    assert max(gaps) <= 1e-4, gaps

    for step in (0, 2):  # the held-out prompts generated with their images, by the weights just synced
        records = [json.loads(line) for line in open(os.path.join(cfg.log.output_dir, "eval", f"step{step}.jsonl"))]
        assert len(records) == 5 * 2 and {r["weight_version"] for r in records} == {step}, records[:2]

    before = load_file(os.path.join(model_path, "model.safetensors"))
    exported = [os.path.join(root, f) for root, _, files in os.walk(cfg.log.output_dir) for f in files
                if f == "model.safetensors"]
    assert exported, os.listdir(cfg.log.output_dir)
    after = load_file(sorted(exported)[-1])
    tower = [k for k in before if ".visual." in k or k.startswith("visual.")]
    text = [k for k in before if k not in tower and "layers" in k]
    assert tower and text
    assert all(torch.equal(before[k], after[k]) for k in tower)
    assert any(not torch.equal(before[k], after[k]) for k in text)
