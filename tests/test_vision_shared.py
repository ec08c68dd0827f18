"""Shared-prompt rows with images: a prompt (its images included) once per segment, each response after it.

On the tiny Qwen2-VL, Qwen2.5-VL, Qwen3-VL (M-RoPE) and LLaVA (1-D positions): log-probs and entropy equal each
sequence run alone through the model's own forward (which computes its own positions and image features), on the
tree mask and on the shared-prompt blocks; the M-RoPE positions at every sequence's slots are the model's own
``get_rope_index`` of that sequence alone; the vision tower runs once per forward, on each prompt group's images
once. Two prompts of equal text and image size (equal token ids) but different pixels never share a segment."""

import pytest
import torch
from PIL import Image

from rlhf_sg.packing import (
    _shared_groups,
    blocks_whatever_they_cost,
    counting_block_layers,
    pack_shared_prompts,
    response_logprobs,
    stop_shared_prompt_attention,
    use_shared_prompt_attention,
)
from rlhf_sg.tiny import VISION_FAMILIES, build_vision_tokenizer, tiny_vision_model
from rlhf_sg.vision import ImageInputs, shared_positions, vision_tower
from rlhf_sg.vision.processor import VISION_CHAT_TEMPLATE, build_processor, tiny_image_processor

TOL = 2e-5  # as tests/test_shared_prompts.py


@pytest.fixture(scope="module", params=VISION_FAMILIES)
def family(request):
    tokenizer = build_vision_tokenizer()
    tokenizer.chat_template = VISION_CHAT_TEMPLATE
    model = tiny_vision_model(request.param, tokenizer)
    processor = build_processor(model.config, tokenizer, tiny_image_processor(model.config))
    return request.param, model, processor


def _image(width: int, height: int, seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy())


def _prompt(processor, text: str, images: list[Image.Image]) -> tuple[list[int], ImageInputs]:
    out = processor(images=images, text=[text], return_tensors="pt")
    return out["input_ids"][0].tolist(), ImageInputs(out["pixel_values"], out.get("image_grid_thw"))


#: samples per prompt group: "a" (3 samples, one response much longer than its siblings'), "a_other" (the same
#: text and image size as "a", so the same token ids, other pixels: 2), "two" (two images, the second ending the
#: prompt: 1), "text" (no image: 2)
RESPONSES = {"a": (4, 17, 3), "a_other": (5, 2), "two": (6,), "text": (3, 5)}


def _rollout_batch(model, processor):
    """The rollout layout (left-padded prompts, right-padded responses) of :data:`RESPONSES`, rows interleaved so
    a group's rows are not adjacent. Returns sequences, mask, response width, images per row, group per row."""
    unit = model.config.vision_config.patch_size * 2
    ph = processor.image_placeholder
    g = torch.Generator().manual_seed(0)
    prompts = {
        "a": _prompt(processor, f"what colour {ph} ?", [_image(2 * unit, 3 * unit, 1)]),
        "a_other": _prompt(processor, f"what colour {ph} ?", [_image(2 * unit, 3 * unit, 2)]),
        "two": _prompt(processor, f"compare {ph} and {ph}",
                       [_image(4 * unit, 2 * unit, 3), _image(2 * unit, 2 * unit, 4)]),
        "text": (torch.randint(3, 500, (30,), generator=g).tolist(), None),
    }
    assert prompts["a"][0] == prompts["a_other"][0]  # equal ids: only the pixels tell them apart
    samples = [(name, n) for name, lengths in RESPONSES.items() for n in lengths]
    order = [0, 3, 5, 6, 1, 4, 7, 2]  # a, a_other, two, text, a, a_other, text, a
    samples = [samples[i] for i in order]
    responses = [torch.randint(3, 500, (n,), generator=g).tolist() for _, n in samples]
    width_p = max(len(prompts[name][0]) for name, _ in samples)
    width_t = max(n for _, n in samples)
    seqs = torch.zeros(len(samples), width_p + width_t, dtype=torch.long)
    mask = torch.zeros_like(seqs)
    for b, ((name, n), r) in enumerate(zip(samples, responses)):
        p = prompts[name][0]
        seqs[b, width_p - len(p):width_p] = torch.tensor(p)
        seqs[b, width_p:width_p + n] = torch.tensor(r)
        mask[b, width_p - len(p):width_p + n] = 1
    return seqs, mask, width_t, [prompts[name][1] for name, _ in samples], [name for name, _ in samples]


def _alone(model, seqs, mask, width, images):
    """Each row alone through the model's own forward (its own positions and image features): response log-probs
    and entropy [B, T]."""
    logp, entropy = torch.zeros(seqs.shape[0], width), torch.zeros(seqs.shape[0], width)
    prompt_width = seqs.shape[1] - width
    for b in range(seqs.shape[0]):
        ids = seqs[b][mask[b].bool()][None]
        kwargs = {}
        if images[b] is not None:
            kwargs = images[b].model_kwargs()
            if images[b].image_grid_thw is not None:
                kwargs["mm_token_type_ids"] = (ids == model.config.image_token_id).long()
        logits = model(input_ids=ids, **kwargs).logits[0].float().log_softmax(-1)
        p, n = int(mask[b, :prompt_width].sum()), int(mask[b, prompt_width:].sum())
        rows = logits[p - 1:p - 1 + n]
        logp[b, :n] = rows.gather(-1, ids[0, p:p + n, None])[:, 0]
        entropy[b, :n] = -(rows.exp() * rows).sum(-1)
    return logp, entropy


def _shared(model, seqs, mask, width, images, **kw):
    return response_logprobs(model, seqs, mask, width, with_entropy=True, share_prompts=True, images=images, **kw)


def test_image_prompts_group_by_their_pixels_too(family):
    _, model, processor = family
    seqs, mask, width, images, names = _rollout_batch(model, processor)
    groups = _shared_groups(model, True, seqs, mask, width, images)
    assert sorted(sorted(names[b] for b in g) for g in groups) == sorted(
        [[name] * len(lengths) for name, lengths in RESPONSES.items()])
    assert len(_shared_groups(model, True, seqs, mask, width)) == len(RESPONSES) - 1  # by the ids alone: one fewer


@pytest.mark.parametrize("segment_tokens", [None, 1], ids=["whole_groups", "split_groups"])
def test_shared_image_rows_equal_each_row_alone(family, segment_tokens):
    """Each group one segment (the model's default), and groups cut into several segments (each with its own copy
    of the prompt and its images)."""
    name, model, processor = family
    seqs, mask, width, images, _ = _rollout_batch(model, processor)
    groups = _shared_groups(model, True, seqs, mask, width, images)
    rows = pack_shared_prompts(seqs, mask, width, segment_tokens or 4096, groups=groups)
    # 1: no segment longer than the longest sequence, so the larger groups are cut
    assert (rows.num_segments > len(groups)) == (segment_tokens is not None), rows.segment_rows
    with torch.no_grad():
        logp, entropy = _shared(model, seqs, mask, width, images, segment_tokens=segment_tokens)
        ref_logp, ref_entropy = _alone(model, seqs, mask, width, images)
    assert (logp - ref_logp).abs().max() <= TOL, (name, (logp - ref_logp).abs().max())
    assert (entropy - ref_entropy).abs().max() <= TOL, (name, (entropy - ref_entropy).abs().max())
    # the images matter: the same ids without them give other log-probs
    assert (_alone(model, seqs, mask, width, [None] * len(images))[0] - ref_logp).abs().max() > 1e-3


def test_shared_image_rows_on_the_blocks_equal_each_row_alone(family):
    """The trainer switches an sdpa model that shares prompts to the block-wise attention: every layer of the
    language model takes the blocks, with the M-RoPE positions and image features the same."""
    name, model, processor = family
    seqs, mask, width, images, _ = _rollout_batch(model, processor)
    assert use_shared_prompt_attention(model)
    try:
        with torch.no_grad(), blocks_whatever_they_cost(), counting_block_layers() as counted:
            logp, entropy = _shared(model, seqs, mask, width, images)
    finally:
        stop_shared_prompt_attention(model)
    assert counted[0] == model.config.get_text_config().num_hidden_layers, counted
    with torch.no_grad():
        ref_logp, ref_entropy = _alone(model, seqs, mask, width, images)
    assert (logp - ref_logp).abs().max() <= TOL, (name, (logp - ref_logp).abs().max())
    assert (entropy - ref_entropy).abs().max() <= TOL


@pytest.mark.parametrize("segment_tokens", [4096, 1], ids=["whole_groups", "split_groups"])
def test_shared_positions_are_each_sequences_own(family, segment_tokens):
    """The positions themselves (RoPE's shift invariance could leave log-probs equal under a shift of a whole
    sequence): at a sequence's prompt slots and its response's slots, the model's own get_rope_index of that
    sequence alone; the text row is its 0..len-1."""
    name, model, processor = family
    if name == "llava":
        pytest.skip("LLaVA has 1-D positions: the shared rows' own (tests/test_shared_prompts.py)")
    seqs, mask, width, images, _ = _rollout_batch(model, processor)
    rows = pack_shared_prompts(seqs, mask, width, segment_tokens,
                               groups=_shared_groups(model, True, seqs, mask, width, images))
    positions = shared_positions(model, rows, seqs, mask, images)
    assert positions.shape == (4, *rows.input_ids.shape)
    assert torch.equal(positions[0], rows.position_ids)
    flat = positions.reshape(4, -1)
    branches, k, seen = rows.branches.tolist(), 0, []
    for members in rows.segment_rows:
        start, _, _, p = branches[k]
        for b in members:
            k += 1
            _, _, cursor, n = branches[k]
            slots = torch.cat([torch.arange(start, start + p), torch.arange(cursor, cursor + n)])
            ids = seqs[b][mask[b].bool()][None]
            if images[b] is None:
                own = torch.arange(ids.shape[1]).expand(3, -1)
            else:
                own = model.model.get_rope_index(ids, (ids == model.config.image_token_id).long(),
                                                 image_grid_thw=images[b].image_grid_thw)[0][:, 0]
            assert torch.equal(flat[1:, slots], own), (name, b)
            assert torch.equal(flat[0, slots], torch.arange(ids.shape[1])), (name, b)
            seen.append(b)
        k += 1
    assert sorted(seen) == list(range(seqs.shape[0]))


@pytest.mark.parametrize("segment_tokens", [None, 1], ids=["whole_groups", "split_groups"])
def test_the_vision_tower_runs_once_per_group_under_shared_prompts(family, segment_tokens):
    """One tower call per forward, on each image group's pixels once: three prompts with images hold six samples
    (and, split, more segments than groups), the tower sees three prompts' patches."""
    name, model, processor = family
    seqs, mask, width, images, names = _rollout_batch(model, processor)
    calls = []
    hook = vision_tower(model.model).register_forward_hook(lambda _m, args, _out: calls.append(args[0].shape[0]))
    try:
        with torch.no_grad():
            _shared(model, seqs, mask, width, images, segment_tokens=segment_tokens)
    finally:
        hook.remove()
    distinct = {names.index(n): images[names.index(n)] for n in ("a", "a_other", "two")}
    assert calls == [sum(i.pixel_values.shape[0] for i in distinct.values())], (name, calls)


def test_the_trainer_shares_a_vision_language_policys_prompts(tmp_path):
    """``--train.share_prompts`` (default on) holds for a vision-language policy: its config is accepted, the
    trainer's forwards and updates share prompts (``shares_prompts``: the actor's and reference's
    ``response_logprobs(..., share_prompts=True, images=)``, the path above) and its workers switch to the blocks."""
    from rlhf_sg.config import Config, shares_prompts, validate
    from rlhf_sg.trainer.layout import Layout
    from rlhf_sg.vision import save_tiny_vision_model

    cfg = Config()
    cfg.model.pretrain = save_tiny_vision_model(str(tmp_path / "qwen2-vl"), "qwen2-vl")
    cfg.data.prompt_data, cfg.reward.function = str(tmp_path / "p.jsonl"), "m:f"
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1="}\n')
    cfg.train.advantage_estimator = "grpo"
    validate(cfg)
    assert cfg.train.share_prompts and shares_prompts(cfg)
    assert Layout(cfg).worker_spec("actor").share_prompts and Layout(cfg).worker_spec("ref").share_prompts


def test_the_trainers_shared_micro_batches_count_each_image_prompt(family):
    """The trainer's token budget under shared prompts counts a prompt once per group: two prompts of equal ids
    but other images are two groups, each prompt computed (and counted) once. A budget that fits "a" and "a_other"
    only as one group (one prompt) must not put them in one micro-batch, whose forward computes both prompts."""
    from rlhf_sg.experience import Experience
    from rlhf_sg.trainer.ppo import microbatch_plans

    _, model, processor = family
    seqs, mask, width, images, names = _rollout_batch(model, processor)
    rows = [b for b, n in enumerate(names) if n in ("a", "a_other")]
    prompt_width = seqs.shape[1] - width
    prompt_len = int(mask[rows[0], :prompt_width].sum())
    budget = prompt_len + int(mask[rows, prompt_width:].sum())  # one prompt and all five responses
    exp = Experience(sequences=seqs, attention_mask=mask, action_mask=mask[:, prompt_width:].bool(),
                     rollout_logp=torch.zeros(seqs.shape[0], width), images=images)
    (plan,) = microbatch_plans(exp, 1, budget, rows=rows, share_prompts=True)
    for micro in plan:
        groups = _shared_groups(model, True, seqs[micro], mask[micro], width, [images[b] for b in micro]) or [
            [k] for k in range(len(micro))]
        computed = sum(prompt_len + sum(int(mask[micro[k], prompt_width:].sum()) for k in g) for g in groups)
        assert computed <= budget, (plan, computed, budget)
    assert sorted(b for micro in plan for b in micro) == rows
