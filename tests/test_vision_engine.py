"""The embedded engine with images: the vision tower once per prompt, M-RoPE prefill and decode positions equal
to the trainer's (log-probs of image rows within 1e-4), image placeholders never sampled."""

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from backends.base import BackendConfig, BackendError, SamplingParams
from backends.embedded import EmbeddedBackend
from rlhf_sg.packing import response_logprobs
from rlhf_sg.tiny import VISION_FAMILIES
from rlhf_sg.vision import ImageInputs, load_processor, save_tiny_vision_model, vision_tower


def _image(width, height, seed):
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy())


@pytest.fixture(scope="module", params=[(f, "sdpa") for f in VISION_FAMILIES] + [("qwen2-vl", "eager")],
                ids=lambda p: "-".join(p))
def engine(request, tmp_path_factory):
    """The engine on a tiny model of each family: over its KV buffers (sdpa), and through DynamicCache (eager)."""
    family, attention = request.param
    path = save_tiny_vision_model(str(tmp_path_factory.mktemp(family)), family)
    config, processor = load_processor(path)
    engine = EmbeddedBackend(BackendConfig(model_path=path, max_model_len=256, num_threads=1,
                                           extra={"attn_implementation": attention}))
    assert engine.kv_buffers == (attention == "sdpa")
    engine.trainer_model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    yield family, engine, config, processor
    engine.shutdown()


def _prompts(config, processor):
    """An image prompt, a two-image prompt (other grids) and a text prompt: (ids, ImageInputs | None) each."""
    unit = config.vision_config.patch_size * 2
    out = []
    for k, sizes in enumerate([[(3 * unit, 2 * unit)], [(2 * unit, 4 * unit), (2 * unit, 2 * unit)]]):
        parts = [{"type": "image"} for _ in sizes] + [{"type": "text", "text": f"count {k}"}]
        text = processor.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                             add_generation_prompt=True, image_placeholder=processor.image_placeholder)
        enc = processor(images=[_image(w, h, 10 * k + j) for j, (w, h) in enumerate(sizes)], text=[text],
                        return_tensors="pt")
        out.append((enc["input_ids"][0].tolist(), ImageInputs(enc["pixel_values"], enc.get("image_grid_thw"))))
    out.append((processor.tokenizer("just text, no image")["input_ids"], None))
    return out


def _rollout(prompts, completions, n):
    """The trainer's layout of the completions: sequences, mask, response width, images per row."""
    rows = [(prompts[c.prompt_index], c.token_ids) for c in completions]
    width_p = max(len(p[0]) for p, _ in rows)
    width_t = max(len(t) for _, t in rows)
    seqs = torch.zeros(len(rows), width_p + width_t, dtype=torch.long)
    mask = torch.zeros_like(seqs)
    for b, ((ids, _), tokens) in enumerate(rows):
        seqs[b, width_p - len(ids):width_p] = torch.tensor(ids)
        seqs[b, width_p:width_p + len(tokens)] = torch.tensor(tokens)
        mask[b, width_p - len(ids):width_p + len(tokens)] = 1
    return seqs, mask, width_t, [p[1] for p, _ in rows]


def test_engine_log_probs_of_image_rows_equal_the_trainers(engine):
    name, backend, config, processor = engine
    prompts = _prompts(config, processor)
    params = SamplingParams(n=3, max_new_tokens=12, temperature=1.0, seed=7)
    patches = []
    hook = vision_tower(backend.model.model).register_forward_hook(
        lambda _m, args, _out: patches.append(args[0].shape[0]))
    try:
        completions = backend.generate([p for p, _ in prompts], params, images=[i for _, i in prompts])
    finally:
        hook.remove()
    # each image prompt's patches through the tower once, not once per sample
    assert sum(patches) == sum(i.pixel_values.shape[0] for _, i in prompts if i is not None)
    seqs, mask, width, images = _rollout(prompts, completions, 3)
    with torch.no_grad():
        trainer = response_logprobs(backend.trainer_model, seqs, mask, width, images=images)
    engine_logp = torch.zeros_like(trainer)
    for b, c in enumerate(completions):
        engine_logp[b, :len(c.logprobs)] = torch.tensor(c.logprobs)
    gap = (trainer - engine_logp).abs().max()
    assert gap <= 1e-4, (name, gap)
    # the images reach the decode: without them (placeholders embedded as tokens) the engine's log-probs differ
    with torch.no_grad():
        blind = response_logprobs(backend.trainer_model, seqs, mask, width)
    assert (blind - engine_logp)[:6].abs().max() > 1e-3


def test_placeholders_are_never_sampled(engine, tmp_path):
    """A model whose logits favour the placeholders (the final norm keeps one hidden dimension, the placeholders'
    head rows point along it or against it; Qwen-VL's four favour one of them at every step, LLaVA's one wherever
    that dimension is positive): the engine samples none of them."""
    name, backend, config, processor = engine
    model = backend.model
    placeholders = [config.image_token_id] + [getattr(config, k) for k in ("video_token_id", "vision_start_token_id",
                                                                          "vision_end_token_id") if hasattr(config, k)]
    norm, head = model.model.language_model.norm.weight, model.lm_head.weight
    saved = norm.detach().clone(), head.detach().clone()
    try:
        with torch.no_grad():
            norm.zero_()[0] = 1.0
            head.zero_()
            for k, token in enumerate(placeholders):  # alternate signs: one favoured whichever the hidden's sign
                head[token, 0] = 1e4 if k % 2 == 0 else -1e4
        prompts = _prompts(config, processor)
        completions = backend.generate([p for p, _ in prompts], SamplingParams(n=4, max_new_tokens=8, seed=1),
                                       images=[i for _, i in prompts])
        sampled = {t for c in completions for t in c.token_ids}
        assert sampled and not sampled & set(placeholders), sampled & set(placeholders)
    finally:
        with torch.no_grad():
            norm.copy_(saved[0])
            head.copy_(saved[1])


def test_image_token_mismatch_and_text_only_images_are_refused(engine):
    _, backend, config, processor = engine
    (ids, images), *_ = _prompts(config, processor)
    with pytest.raises(BackendError, match="image tokens but the model makes"):
        backend.generate([ids[:-3] + [config.image_token_id] + ids[-3:]], SamplingParams(max_new_tokens=2),
                         images=[images])


def test_rlhf_sg_backends_says_which_engines_take_images():
    from backends import available_backends

    status = available_backends()
    assert status["hf"].endswith("; takes images (vision-language models)")
    if status["vllm"].startswith("available"):
        assert "; takes images (Qwen2-VL, Qwen2.5-VL; on CPU with torchvision" in status["vllm"], status["vllm"]
    assert all(s.endswith("; text only") for name, s in status.items() if name not in ("hf", "vllm") and
               s.startswith("available")), status


def test_a_trained_towers_weights_reach_the_engine(engine, tmp_path):
    """Train the whole model (tower included) a step on image rows, hand the weights to the engine (disk transport,
    HF names): the engine's tower equals the trainer's and its log-probs on image rows match the trained model's.
    (Runs last for each engine: it leaves the trained weights loaded.)"""
    name, backend, config, processor = engine
    prompts = _prompts(config, processor)
    params = SamplingParams(n=2, max_new_tokens=6, seed=3)
    completions = backend.generate([p for p, _ in prompts], params, images=[i for _, i in prompts])
    seqs, mask, width, images = _rollout(prompts, completions, 2)
    trained = AutoModelForImageTextToText.from_pretrained(backend.config.model_path, dtype=torch.float32).train()
    tower = vision_tower(trained.model)
    before = {k: v.clone() for k, v in tower.state_dict().items()}
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.5)
    (-response_logprobs(trained, seqs, mask, width, images=images).sum()).backward()
    optimizer.step()
    assert any(not torch.equal(v, before[k]) for k, v in tower.state_dict().items())  # the tower moved
    trained.eval().save_pretrained(str(tmp_path / "trained"))
    backend.update_weights_from_disk(str(tmp_path / "trained"))
    engine_tower = vision_tower(backend.model.model)
    assert all(torch.equal(v, tower.state_dict()[k]) for k, v in engine_tower.state_dict().items())
    completions = backend.generate([p for p, _ in prompts], params, images=[i for _, i in prompts])
    seqs, mask, width, images = _rollout(prompts, completions, 2)
    with torch.no_grad():
        trainer = response_logprobs(trained, seqs, mask, width, images=images)
    engine_logp = torch.zeros_like(trainer)
    for b, c in enumerate(completions):
        engine_logp[b, :len(c.logprobs)] = torch.tensor(c.logprobs)
    assert (trainer - engine_logp).abs().max() <= 1e-4, (name, (trainer - engine_logp).abs().max())
