"""Vision-language policies: the tiny families and their processors, image rows refused by name, M-RoPE
positions per sequence through packing (log-probs of packed image rows equal each row alone)."""

import base64
import io
import json

import pytest
import torch
from PIL import Image
from transformers import AutoConfig

from rlhf_sg.data import DataError
from rlhf_sg.packing import _pack_for, response_logprobs
from rlhf_sg.tiny import VISION_FAMILIES, build_vision_tokenizer, tiny_vision_model
from rlhf_sg.vision import ImageInputs, load_processor, load_vision_prompts, save_tiny_vision_model, vision_tower
from rlhf_sg.vision.processor import VISION_CHAT_TEMPLATE, build_processor, tiny_image_processor


def _image(width: int, height: int, seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


@pytest.fixture(scope="module", params=VISION_FAMILIES)
def family(request):
    tokenizer = build_vision_tokenizer()
    tokenizer.chat_template = VISION_CHAT_TEMPLATE
    model = tiny_vision_model(request.param, tokenizer)
    processor = build_processor(model.config, tokenizer, tiny_image_processor(model.config))
    return request.param, model, processor


def test_the_installed_transformers_builds_the_qwen_vl_families_and_llava():
    assert {"qwen2-vl", "qwen2.5-vl", "llava"} <= set(VISION_FAMILIES)


def test_one_processor_call_gives_the_image_tokens_the_model_makes_features_for(family):
    """Qwen-VL: grid t·h·w / merge²; LLaVA: (image_size / patch)² (its CLS feature dropped)."""
    name, model, processor = family
    unit = model.config.vision_config.patch_size * 2
    out = processor(images=[_image(3 * unit, 2 * unit, 0)], text=[f"a {processor.image_placeholder} b"],
                    return_tensors="pt")
    tokens = int((out["input_ids"] == model.config.image_token_id).sum())
    if name == "llava":
        assert "image_grid_thw" not in out and tokens == (28 // 14) ** 2
    else:
        assert out["image_grid_thw"].tolist() == [[1, 4, 6]] and tokens == 4 * 6 // 4
    features = model.model.get_image_features(**ImageInputs(out["pixel_values"], out.get("image_grid_thw"))
                                              .model_kwargs(), return_dict=True).pooler_output
    assert sum(f.shape[0] for f in features) == tokens


# ---- data rows ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen2_vl_dir(tmp_path_factory):
    return save_tiny_vision_model(str(tmp_path_factory.mktemp("qwen2vl")), "qwen2-vl")


def _write_rows(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def _png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_rows_with_paths_base64_and_content_parts_load_with_their_pixels(qwen2_vl_dir, tmp_path):
    config, processor = load_processor(qwen2_vl_dir)
    (tmp_path / "img").mkdir()
    _image(56, 84, 1).save(tmp_path / "img" / "a.png")
    b64 = base64.b64encode(_png_bytes(_image(84, 56, 2))).decode()
    path = _write_rows(tmp_path / "data.jsonl", [
        {"prompt": "How many? <image>", "images": ["img/a.png"], "label": "1"},
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Count."}]}],
         "images": [f"data:image/png;base64,{b64}"], "label": "2"},
        {"prompt": "No image here.", "label": "0"},
    ])
    prompts, skipped = load_vision_prompts(path, config, processor, label_key="label", apply_chat_template=True)
    assert skipped == 0 and [p.label for p in prompts] == ["1", "2", "0"]
    first, second, text_row = prompts
    assert first.images.image_grid_thw.tolist() == [[1, 6, 4]] and second.images.image_grid_thw.tolist() == [[1, 4, 6]]
    assert first.token_ids.count(config.image_token_id) == 6 and text_row.images is None
    # the ids are the processor's own, from one call on the rendered text and the image
    again = processor(images=[Image.open(tmp_path / "img" / "a.png").convert("RGB")], text=[first.text],
                      return_tensors="pt")
    assert again["input_ids"][0].tolist() == first.token_ids
    assert torch.equal(again["pixel_values"], first.images.pixel_values)


def _refusal(path, config, processor, **kw) -> str:
    with pytest.raises(DataError) as e:
        load_vision_prompts(path, config, processor, **kw)
    return str(e.value)


def test_bad_image_rows_are_refused_naming_file_row_and_image(qwen2_vl_dir, tmp_path):
    config, processor = load_processor(qwen2_vl_dir)
    (tmp_path / "broken.png").write_bytes(b"not a png")
    good = {"prompt": "ok <image>",
            "images": [f"data:image/png;base64,{base64.b64encode(_png_bytes(_image(56, 56, 3))).decode()}"]}
    cases = {
        "missing.png": ({"prompt": "x <image>", "images": ["missing.png"]},
                        "image 0: image file 'missing.png' not found"),
        "broken": ({"prompt": "x <image> <image>", "images": [good["images"][0], "broken.png"]}, "image 1: unreadable"),
        "url": ({"prompt": "x <image>", "images": ["https://example.com/a.png"]}, "--data.allow_image_urls"),
        "markers": ({"prompt": "x", "images": [good["images"][0]]}, "places 0 image(s)"),
    }
    for name, (row, message) in cases.items():
        path = _write_rows(tmp_path / f"{name}.jsonl", [good, row])
        text = _refusal(path, config, processor)
        assert f"{path} line 2" in text and message in text, (name, text)


def test_an_image_for_a_text_only_model_is_refused(tmp_path):
    """By the vision loader, and by the text prompts' loader (the trainer's and evaluation's, before Ray)."""
    from transformers import Qwen2Config

    from rlhf_sg.data import load_prompts
    from rlhf_sg.tiny import build_chat_tokenizer

    path = _write_rows(tmp_path / "v.jsonl", [{"prompt": "x <image>", "images": ["a.png"]}])
    assert "line 1: the row has 1 image(s) but the model (qwen2) is text-only" in _refusal(path, Qwen2Config(), None)
    path = _write_rows(tmp_path / "d.jsonl", [{"prompt": "plain"}, {"prompt": "x <image>", "images": ["a.png"]}])
    with pytest.raises(DataError, match="d.jsonl line 2: the row has images .* but the model is text-only"):
        load_prompts(path, build_chat_tokenizer())


def test_a_processor_that_does_not_fit_the_model_is_refused(qwen2_vl_dir, tmp_path):
    config, processor = load_processor(qwen2_vl_dir)
    processor.image_processor.merge_size = 1  # 4x the image tokens the model's merger makes features for
    _image(56, 56, 4).save(tmp_path / "a.png")
    path = _write_rows(tmp_path / "d.jsonl", [{"prompt": "x <image>", "images": ["a.png"]}])
    assert "do not match the features the model makes of the images" in _refusal(path, config, processor)


def test_an_overlong_image_prompt_is_refused_or_dropped_never_truncated(qwen2_vl_dir, tmp_path):
    config, processor = load_processor(qwen2_vl_dir)
    _image(112, 112, 5).save(tmp_path / "a.png")
    path = _write_rows(tmp_path / "d.jsonl", [{"prompt": "x <image>", "images": ["a.png"]}, {"prompt": "short"}])
    text = _refusal(path, config, processor, max_prompt_len=10, overlong_prompts="truncate")
    assert "line 1" in text and "cut through its images" in text
    prompts, _ = load_vision_prompts(path, config, processor, max_prompt_len=10, overlong_prompts="drop")
    assert [p.text for p in prompts] == ["short"]


# ---- exactness: packed image rows against each row alone -------------------------------------------------


def _rollout_batch(model, processor, seed=0):
    """Two image prompts (two samples each, sharing the prompt's ImageInputs) and one long text prompt, in the
    rollout layout: left-padded prompts, right-padded responses. Returns sequences, mask, width, images."""
    unit = model.config.vision_config.patch_size * 2
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for k, (w, h) in enumerate([(2 * unit, 3 * unit), (4 * unit, 2 * unit)]):
        out = processor(images=[_image(w, h, 10 + k)], text=[f"q{k} {processor.image_placeholder} ?"],
                        return_tensors="pt")
        prompts.append((out["input_ids"][0].tolist(), ImageInputs(out["pixel_values"], out.get("image_grid_thw"))))
    prompts.append((torch.randint(3, 500, (40,), generator=g).tolist(), None))
    samples = [prompts[0], prompts[0], prompts[1], prompts[1], prompts[2]]
    responses = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 3, 6, 4, 5)]
    width_p, width_t = max(len(p) for p, _ in samples), max(len(r) for r in responses)
    seqs = torch.zeros(len(samples), width_p + width_t, dtype=torch.long)
    mask = torch.zeros_like(seqs)
    for b, ((p, _), r) in enumerate(zip(samples, responses)):
        seqs[b, width_p - len(p):width_p] = torch.tensor(p)
        seqs[b, width_p:width_p + len(r)] = torch.tensor(r)
        mask[b, width_p - len(p):width_p + len(r)] = 1
    return seqs, mask, width_t, [s[1] for s in samples]


def _alone(model, seqs, mask, width, images):
    """Each row alone through the model's own forward (its own get_rope_index): response log-probs [B, T]."""
    out = torch.zeros(seqs.shape[0], width)
    prompt_width = seqs.shape[1] - width
    for b in range(seqs.shape[0]):
        ids = seqs[b][mask[b].bool()][None]
        kwargs = {}
        if images[b] is not None:
            kwargs = images[b].model_kwargs()
            if images[b].image_grid_thw is not None:  # Qwen-VL computes its M-RoPE positions from these
                kwargs["mm_token_type_ids"] = (ids == model.config.image_token_id).long()
        logits = model(input_ids=ids, **kwargs).logits[0].float().log_softmax(-1)
        n_prompt = int(mask[b, :prompt_width].sum())
        n_resp = int(mask[b, prompt_width:].sum())
        targets = ids[0, n_prompt:n_prompt + n_resp]
        out[b, :n_resp] = logits[n_prompt - 1:n_prompt - 1 + n_resp].gather(-1, targets[:, None])[:, 0]
    return out


def test_packed_image_rows_equal_each_row_alone(family):
    name, model, processor = family
    seqs, mask, width, images = _rollout_batch(model, processor)
    batch = _pack_for(model, "sdpa", seqs, mask)
    assert batch.input_ids.shape[0] < seqs.shape[0]  # several sequences share a packed row
    with torch.no_grad():
        packed = response_logprobs(model, seqs, mask, width, images=images)
        alone = _alone(model, seqs, mask, width, images)
    assert (packed - alone).abs().max() <= 1e-5, (name, (packed - alone).abs().max())
    # the images matter: the same ids without them give other log-probs
    assert (_alone(model, seqs, mask, width, [None] * 5)[:4] - alone[:4]).abs().max() > 1e-3


def test_the_vision_tower_runs_once_per_prompt(family):
    _, model, processor = family
    seqs, mask, width, images = _rollout_batch(model, processor)
    patches = []
    tower = vision_tower(model.model)
    hook = tower.register_forward_hook(lambda _m, args, _out: patches.append(args[0].shape[0]))
    try:
        with torch.no_grad():
            response_logprobs(model, seqs, mask, width, images=images)
    finally:
        hook.remove()
    # one call on the two image prompts' patches, though four samples hold them
    assert patches == [images[0].pixel_values.shape[0] + images[2].pixel_values.shape[0]]


def test_parquet_image_columns_load(qwen2_vl_dir, tmp_path):
    """Parquet (as datasets) stores an image column as {"bytes", "path"} dicts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    config, processor = load_processor(qwen2_vl_dir)
    png = _png_bytes(_image(56, 84, 6))
    rows = [{"prompt": "what is <image>", "images": [{"bytes": png, "path": None}], "label": "x"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    (prompt,), _ = load_vision_prompts(str(tmp_path / "d.parquet"), config, processor, label_key="label")
    assert prompt.images.image_grid_thw.tolist() == [[1, 6, 4]]
    bad = [{"prompt": "what is <image>", "images": [{"bytes": b"\x89PNG broken", "path": None}]}]
    pq.write_table(pa.Table.from_pylist(rows + bad), tmp_path / "bad.parquet")
    assert f"{tmp_path / 'bad.parquet'} row 1 image 0: unreadable image" in _refusal(
        str(tmp_path / "bad.parquet"), config, processor)


def test_packed_positions_are_each_sequences_own(family):
    """The positions themselves (not only the log-probs, which RoPE's shift invariance would leave equal under a
    per-sequence offset): at each sequence's packed slots, the model's own get_rope_index of that sequence alone."""
    from rlhf_sg.vision import packed_positions

    name, model, processor = family
    if name == "llava":
        pytest.skip("LLaVA has 1-D positions: packing's own (tests/test_packing.py)")
    seqs, mask, _, images = _rollout_batch(model, processor)
    batch = _pack_for(model, "sdpa", seqs, mask)
    positions = packed_positions(model, batch, seqs, mask, images)
    assert positions.shape == (4, *batch.input_ids.shape)
    assert torch.equal(positions[0], batch.position_ids)
    flat = positions.reshape(4, -1)
    starts = batch.cu_seqlens.tolist()
    for b in range(seqs.shape[0]):
        ids = seqs[b][mask[b].bool()][None]
        if images[b] is None:
            own = torch.arange(ids.shape[1]).expand(3, -1)
        else:
            own = model.model.get_rope_index(ids, (ids == model.config.image_token_id).long(),
                                             image_grid_thw=images[b].image_grid_thw)[0][:, 0]
        assert torch.equal(flat[1:, batch.slots[starts[b]:starts[b + 1]]], own), b


def test_the_trainer_refuses_what_does_not_carry_images_yet_before_ray(qwen2_vl_dir, tmp_path):
    """A vision-language policy trains with GRPO-like estimators on the embedded engine; every setting whose path
    does not carry images yet is refused by its flag, and a vision-language critic, reward model or teacher too."""
    from rlhf_sg.config import Config, ConfigError, validate

    def cfg_with(**settings):
        cfg = Config()
        cfg.model.pretrain, cfg.data.prompt_data, cfg.reward.function = qwen2_vl_dir, _write_rows(
            tmp_path / "p.jsonl", [{"prompt": "1+1="}]), "m:f"
        cfg.train.advantage_estimator = "grpo"
        for key, value in settings.items():
            section, name = key.split("__")
            setattr(getattr(cfg, section), name, value)
        return cfg

    validate(cfg_with())  # GRPO on the embedded engine
    validate(cfg_with(rollout__backend="vllm"))  # and on vLLM (tests/test_vision_engines.py)
    with pytest.raises(ConfigError, match=r"--rollout.backend.*vision-language.*SGLang 0.5.23 cannot load a Qwen-VL"):
        validate(cfg_with(rollout__backend="sglang"))
    llava = save_tiny_vision_model(str(tmp_path / "llava"), "llava")
    with pytest.raises(ConfigError, match=r"--rollout.backend vllm.*Qwen2-VL and Qwen2.5-VL models only"):
        validate(cfg_with(rollout__backend="vllm", model__pretrain=llava))
    for settings, flag in (
                           ({"train__advantage_estimator": "gae"}, "--train.advantage_estimator"),
                           ({"rollout__mode": "async"}, "--rollout.mode"),
                           ({"lora__rank": 4}, "--lora.rank"),
                           ({"model__freeze_vision_tower": False, "train__actor_num_ranks": 2},
                            "--model.freeze_vision_tower"),
                           ({"model__critic_pretrain": qwen2_vl_dir}, "--model.critic_pretrain")):
        with pytest.raises(ConfigError, match=f"{flag}.*vision-language"):
            validate(cfg_with(**settings))
    validate(cfg_with(model__freeze_vision_tower=False, train__actor_num_ranks=1))  # a trained tower on one rank


def test_a_text_only_micro_batch_runs_a_partitioned_tower_once_and_changes_nothing(family, monkeypatch):
    """Under ZeRO-3 with several ranks every rank must call the tower as often as the others: a micro-batch
    without images runs it once on the placeholder image (output unused); its log-probs are the text forward's."""
    import rlhf_sg.vision.positions as positions

    name, model, processor = family
    seqs, mask, width, images = _rollout_batch(model, processor)
    text = [4]  # the text-only row
    calls = []
    hook = vision_tower(model.model).register_forward_hook(lambda *_: calls.append(1))
    try:
        with torch.no_grad():
            plain = response_logprobs(model, seqs[text], mask[text], width, images=[None])
            assert calls == []  # one process: no collective to keep in step
            monkeypatch.setattr(positions, "_partitioned", lambda tower: True)
            kept = response_logprobs(model, seqs[text], mask[text], width, images=[None])
            assert len(calls) == 1, name
            response_logprobs(model, seqs, mask, width, images=images)  # with images: the one real call
            assert len(calls) == 2, name
    finally:
        hook.remove()
    assert torch.equal(plain, kept)


def test_a_frozen_tower_stays_bit_identical_through_training_steps(family):
    """Three AdamW steps (weight decay on) of a policy-gradient-like loss on packed image rows: the language model
    moves, the frozen tower does not change by one bit; unfrozen, it moves (the loss reaches it)."""
    from rlhf_sg.vision import freeze_vision_tower

    name, model, processor = family
    seqs, mask, width, images = _rollout_batch(model, processor)

    def train(freeze: bool) -> tuple[bool, bool]:
        trained = tiny_vision_model(name, processor.tokenizer).train()
        if freeze:
            assert freeze_vision_tower(trained) == sum(p.numel() for p in vision_tower(trained.model).parameters())
        tower = {k: v.detach().clone() for k, v in vision_tower(trained.model).state_dict().items()}
        text = {k: v.detach().clone() for k, v in trained.model.language_model.state_dict().items()}
        optimizer = torch.optim.AdamW([p for p in trained.parameters() if p.requires_grad], lr=1e-2,
                                      weight_decay=0.1)
        for _ in range(3):
            logp = response_logprobs(trained, seqs, mask, width, images=images)
            (-logp.sum()).backward()
            optimizer.step()
            optimizer.zero_grad()
        tower_same = all(torch.equal(v, tower[k]) for k, v in vision_tower(trained.model).state_dict().items())
        text_same = all(torch.equal(v, text[k]) for k, v in trained.model.language_model.state_dict().items())
        return tower_same, text_same

    assert train(freeze=True) == (True, False)
    assert train(freeze=False) == (False, False)


# ---- images for the engines that process them themselves (rlhf_sg.vision.engines) ---------------------------


@pytest.mark.parametrize("name", [f for f in VISION_FAMILIES if f != "llava"])
def test_engine_images_collapse_each_run_and_rebuild_the_processors_pixels(name, tmp_path):
    """Each image's run becomes one placeholder (the processor, run on that text and the rebuilt images, expands
    it back to our ids), and the images rebuilt from pixel_values re-process to those pixel_values."""
    from rlhf_sg.vision.engines import engine_images

    _, processor = load_processor(save_tiny_vision_model(str(tmp_path / name), name))
    config = AutoConfig.from_pretrained(str(tmp_path / name))
    unit = config.vision_config.patch_size * 2
    text = f"a {processor.image_placeholder} b {processor.image_placeholder} c"
    pictures = [_image(3 * unit + 5, 2 * unit, 1), _image(90, 41, 2)]  # resized by the processor, other grids
    out = processor(images=pictures, text=[text], return_tensors="pt")
    ids, inputs = out["input_ids"][0].tolist(), ImageInputs(out["pixel_values"], out["image_grid_thw"])
    collapsed, rebuilt = engine_images(config, processor.image_processor, ids, inputs)
    tokens = len(inputs.pixel_values) // config.vision_config.spatial_merge_size ** 2
    assert collapsed.count(config.image_token_id) == 2 and len(collapsed) == len(ids) - tokens + 2
    again = processor(images=rebuilt, text=[processor.tokenizer.decode(collapsed)], return_tensors="pt")
    assert again["input_ids"][0].tolist() == ids
    assert [im.size for im in rebuilt] == [(w * config.vision_config.patch_size, h * config.vision_config.patch_size)
                                           for _, h, w in inputs.image_grid_thw.tolist()]
    assert (again["pixel_values"] - inputs.pixel_values).abs().max() <= 1e-6


def test_engine_images_refuse_ids_that_are_not_the_images_and_foreign_pixels(tmp_path):
    from rlhf_sg.vision.engines import collapse_image_runs, engine_images

    assert collapse_image_runs([1, 7, 7, 7, 2, 7, 7, 3], 7, [3, 2]) == [1, 7, 2, 7, 3]
    with pytest.raises(ValueError, match=r"image-token runs are \[3, 2\], its images make \[2, 2\]"):
        collapse_image_runs([1, 7, 7, 7, 2, 7, 7, 3], 7, [2, 2])
    with pytest.raises(ValueError, match=r"image-token runs are \[4\], its images make \[2, 2\]"):
        collapse_image_runs([1, 7, 7, 7, 7, 3], 7, [2, 2])  # two images' runs touching
    path = save_tiny_vision_model(str(tmp_path / "q"), "qwen2-vl")
    config, processor = AutoConfig.from_pretrained(path), load_processor(path)[1]
    out = processor(images=[_image(56, 56, 3)], text=[f"a {processor.image_placeholder}"], return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    with pytest.raises(ValueError, match="holds image tokens but no images"):
        engine_images(config, processor.image_processor, ids, None)
    shifted = ImageInputs(out["pixel_values"] + 0.5, out["image_grid_thw"])  # not this processor's normalisation
    with pytest.raises(ValueError, match="re-process to pixel_values .* away from those given"):
        engine_images(config, processor.image_processor, ids, shifted)


def test_vllm_refuses_a_vision_model_it_cannot_hand_images_to_by_name(tmp_path, monkeypatch):
    """Before vLLM starts: a LLaVA (its images are not rebuilt for vLLM), and a Qwen-VL where torchvision, which
    vLLM's Qwen-VL code imports, is missing, naming the install script."""
    import importlib.util

    from backends.base import BackendError
    from backends.vllm_backend import _vision_inputs

    with pytest.raises(BackendError, match=r"is a llava vision-language model.*--rollout.backend hf"):
        _vision_inputs(save_tiny_vision_model(str(tmp_path / "llava"), "llava"))
    path = save_tiny_vision_model(str(tmp_path / "q"), "qwen2-vl")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchvision"
                        else find_spec(name, *a))
    with pytest.raises(BackendError, match=r"needs torchvision.*recipes/install/vllm_cpu.sh"):
        _vision_inputs(path)
    monkeypatch.undo()
    if find_spec("torchvision") is not None:
        config, image_processor = _vision_inputs(path)
        assert config.model_type == "qwen2_vl" and image_processor.merge_size == 2
