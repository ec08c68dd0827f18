"""M-RoPE positions per sequence, laid into packed and shared-prompt rows; the vision tower once per prompt.

Models with 1-D positions (LLaVA) take packing's own positions; only their image features come from here.

Qwen-VL models rotate queries and keys by three position rows (temporal, height, width), which inside an image
follow its patch grid and after it jump ahead (``get_rope_index``). Packing rows of several sequences must give
each sequence the positions it has alone, so they are computed for each sequence alone, by the model's own
``get_rope_index``, and only then laid into the packed slots. The model takes ``position_ids`` [4, R, L]: the
packed text row (restarting at 0 per sequence, which the attention mask is built from) above the three M-RoPE rows.

Shared-prompt rows hold a prompt once and its responses after it: the prompt's positions are its own (computed once
per segment), and a response, which holds no image, continues from the prompt's largest position + 1 on all three
rows, the position the model itself gives it (``get_rope_index``'s text after the prompt; the ``rope_deltas`` it
decodes by). Rows share a prompt only when their images are the same too.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from rlhf_sg.vision.data import ImageInputs, image_token_counts

log = logging.getLogger("rlhf_sg")


def vision_core(module: nn.Module) -> nn.Module:
    """The model inside a ``...ForConditionalGeneration`` (``.model``): it has ``get_image_features`` and a vision
    tower (:func:`vision_tower`)."""
    core = getattr(module, "model", None)
    if core is None or not hasattr(core, "get_image_features") or vision_tower(core) is None:
        raise TypeError(f"{type(module).__name__} is not a vision-language model this package knows (no "
                        "model.get_image_features and model.visual / model.vision_tower)")
    return core


def vision_tower(core: nn.Module) -> nn.Module | None:
    """The image encoder of a vision-language core: Qwen-VL's ``visual`` (merger included), LLaVA's
    ``vision_tower`` (its projector is the language side's)."""
    return getattr(core, "visual", None) or getattr(core, "vision_tower", None)


def uses_mrope(module: nn.Module) -> bool:
    """Whether the model rotates by M-RoPE positions of its own (``get_rope_index``: Qwen-VL); else 1-D (LLaVA)."""
    return hasattr(vision_core(module), "get_rope_index")


def image_token_types(ids: torch.Tensor, config) -> torch.Tensor:
    """``mm_token_type_ids`` of ``ids`` as the processor makes them: 1 on image tokens, 0 on text."""
    return (ids == config.image_token_id).long()


def sequence_positions(module: nn.Module, ids: torch.Tensor, images: ImageInputs | None) -> torch.Tensor:
    """ids: [L] long, one sequence alone (prompt and response) -> its M-RoPE positions [3, L] long, from the
    model's own ``get_rope_index``; a sequence without images gets 0..L-1 on all three rows, as the model gives it."""
    if images is None:
        return torch.arange(ids.shape[0], device=ids.device).expand(3, -1)
    core = vision_core(module)
    grid = images.image_grid_thw.to(ids.device)
    positions, _ = core.get_rope_index(ids[None], mm_token_type_ids=image_token_types(ids[None], module.config),
                                       image_grid_thw=grid)
    return positions[:, 0]


def packed_positions(module: nn.Module, batch, sequences: torch.Tensor, attention_mask: torch.Tensor,
                     images: list[ImageInputs | None]) -> torch.Tensor:
    """The packed rows' ``position_ids`` [4, R, L]: row 0 ``batch.position_ids`` (text positions restarting per
    sequence), rows 1-3 each sequence's :func:`sequence_positions` at its slots (pad slots: the text row's)."""
    rows, width = batch.input_ids.shape
    text = batch.position_ids.to(sequences.device)
    mrope = text.reshape(1, -1).repeat(3, 1)
    mask = attention_mask.bool()
    starts = batch.cu_seqlens.tolist()
    slots = batch.slots.to(sequences.device)
    for b in range(sequences.shape[0]):
        own = sequence_positions(module, sequences[b][mask[b]], images[b])
        mrope[:, slots[starts[b]:starts[b + 1]]] = own.to(mrope.dtype)
    return torch.cat((text[None], mrope.view(3, rows, width)))


def same_images(a: ImageInputs | None, b: ImageInputs | None) -> bool:
    """Whether two rows' images are the same: one object (a prompt's samples share one), or equal pixels and grids."""
    if a is b:
        return True
    if a is None or b is None or a.pixel_values.shape != b.pixel_values.shape:
        return False
    grids = (a.image_grid_thw is None and b.image_grid_thw is None) or (
        a.image_grid_thw is not None and b.image_grid_thw is not None
        and torch.equal(a.image_grid_thw.cpu(), b.image_grid_thw.cpu()))
    return grids and torch.equal(a.pixel_values, b.pixel_values.to(a.pixel_values.device))


def image_groups(groups: list[list[int]], images: list[ImageInputs | None]) -> list[list[int]]:
    """Prompt groups (rows with equal prompt tokens) split by their images: two prompts of equal text and image
    sizes hold the same token ids, but only rows with the same images (:func:`same_images`) share a prompt."""
    out: list[list[int]] = []
    for group in groups:
        parts: list[list[int]] = []
        for b in group:
            part = next((q for q in parts if same_images(images[q[0]], images[b])), None)
            if part is None:
                parts.append([b])
            else:
                part.append(b)
        out.extend(parts)
    return out


def prompt_positions(module: nn.Module, ids: torch.Tensor, images: ImageInputs | None) -> tuple[torch.Tensor, int]:
    """ids: [p] long, a prompt alone -> its M-RoPE positions [3, p] (:func:`sequence_positions`) and the position
    its first response token takes: the prompt's largest position + 1 on all three rows, the ``rope_deltas`` rule
    the model itself decodes by (``get_rope_index``: text after an image continues past the image's largest
    position)."""
    positions = sequence_positions(module, ids, images)
    return positions, int(positions.max()) + 1


def shared_positions(module: nn.Module, rows, sequences: torch.Tensor, attention_mask: torch.Tensor,
                     images: list[ImageInputs | None]) -> torch.Tensor:
    """Shared-prompt rows' ``position_ids`` [4, R, L] (``rows``: a :class:`rlhf_sg.packing.SharedPromptRows`): row 0
    ``rows.position_ids`` (the text positions each sequence has alone), rows 1-3 per segment its prompt's
    :func:`prompt_positions` at the prompt's slots and, at each response's slots, the positions that continue the
    prompt's (one ``get_rope_index`` per segment: its responses hold no image); pad slots: the text row's."""
    num_rows, width = rows.input_ids.shape
    text = rows.position_ids
    mrope = text.reshape(1, -1).repeat(3, 1)
    mask = attention_mask.bool()
    branches = rows.branches.tolist()
    if len(branches) != sum(1 + len(members) for members in rows.segment_rows):
        raise ValueError("shared-prompt rows: every response needs a branch of its own (a response of 0 tokens?)")
    k = 0
    for members in rows.segment_rows:
        start, _, _, p = branches[k]
        own, after = prompt_positions(module, sequences[members[0]][mask[members[0]]][:p], images[members[0]])
        mrope[:, start:start + p] = own.to(mrope.dtype)
        for _ in members:
            k += 1
            _, _, cursor, n = branches[k]
            mrope[:, cursor:cursor + n] = torch.arange(after, after + n, device=mrope.device)
        k += 1
    return torch.cat((text[None], mrope.view(3, num_rows, width)))


def packed_order(batch) -> list[int]:
    """Sequence indices in the order their tokens come in the packed rows (row by row, left to right): the order
    the model fills image tokens with image features."""
    firsts = batch.slots[batch.cu_seqlens[:-1].long()].tolist()
    return sorted(range(len(firsts)), key=firsts.__getitem__)


def image_features(module: nn.Module, images: list[ImageInputs | None], order: list[int]):
    """The image encoder outputs for the sequences in ``order``, in that order; None when none has images.

    The vision tower runs once, on the distinct :class:`ImageInputs` (a prompt's samples share one) laid end to
    end, and each sequence gets its prompt's features: one call per forward whatever the images, so ranks that
    gather a partitioned tower (ZeRO-3) call it alike."""
    core = vision_core(module)
    tower = vision_tower(core)
    distinct: dict[int, int] = {}  # id of an ImageInputs -> its index among the distinct ones
    unique: list[ImageInputs] = []
    for b in order:
        if images[b] is not None and id(images[b]) not in distinct:
            distinct[id(images[b])] = len(unique)
            unique.append(images[b])
    if not unique:
        if _partitioned(tower):  # every rank gathers the tower's parameters as often as the others
            with torch.no_grad():
                core.get_image_features(**placeholder_image(module).to(next(tower.parameters()).device).model_kwargs())
        return None
    device = next(tower.parameters()).device
    kwargs = {"pixel_values": torch.cat([u.pixel_values for u in unique]).to(device)}
    if unique[0].image_grid_thw is not None:
        kwargs["image_grid_thw"] = torch.cat([u.image_grid_thw for u in unique]).to(device)
    out = core.get_image_features(**kwargs, return_dict=True)
    # per distinct prompt, the slice of the tower's per-image outputs that are its images
    bounds = torch.tensor([0] + [u.num_images for u in unique]).cumsum(0).tolist()

    def per_sequence(per_image) -> tuple:
        return tuple(t for b in order if images[b] is not None
                     for t in per_image[bounds[distinct[id(images[b])]]:bounds[distinct[id(images[b])] + 1]])

    merged = {"pooler_output": per_sequence(out.pooler_output)}
    deepstack = getattr(out, "deepstack_features", None)
    if deepstack is not None:  # Qwen3-VL: per tower layer, the features of each image
        merged["deepstack_features"] = [per_sequence(layer) for layer in deepstack]
    return type(out)(**merged)


def _partitioned(tower: nn.Module) -> bool:
    """Whether the tower's parameters are ZeRO-3 partitioned over several ranks (a forward gathers them: a
    collective every rank of the group must join)."""
    import torch.distributed as dist

    return (any(hasattr(p, "ds_id") for p in tower.parameters()) and dist.is_initialized()
            and dist.get_world_size() > 1)


def placeholder_image(module: nn.Module) -> ImageInputs:
    """The smallest input the vision tower takes (one image of zeros: Qwen-VL one merged token's patches, LLaVA the
    tower's image size). A micro-batch without images runs the tower on it, output unused, when the tower is
    partitioned over ranks: ZeRO-3 gathers its parameters in a collective, so a rank whose micro-batch has no image
    must still call it (a frozen tower; a trained one is refused there: rlhf_sg.config)."""
    vision = module.config.vision_config
    channels = getattr(vision, "in_channels", None) or getattr(vision, "in_chans", None) or 3
    if getattr(vision, "spatial_merge_size", None) is None:  # LLaVA: a fixed-size image
        side = vision.image_size
        return ImageInputs(torch.zeros(1, channels, side, side, dtype=module.dtype))
    merge = vision.spatial_merge_size
    width = channels * vision.temporal_patch_size * vision.patch_size ** 2
    return ImageInputs(torch.zeros(merge * merge, width, dtype=module.dtype), torch.tensor([[1, merge, merge]]))


def _check_image_tokens(module: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor,
                        images: list[ImageInputs | None]) -> None:
    if len(images) != sequences.shape[0]:
        raise ValueError(f"images: {len(images)} entries for {sequences.shape[0]} sequences")
    for b, inputs in enumerate(images):
        have = int((sequences[b][attention_mask[b].bool()] == module.config.image_token_id).sum())
        want = 0 if inputs is None else sum(image_token_counts(module.config, inputs))
        if have != want:
            raise ValueError(f"sequence {b}: {have} image tokens but the model makes {want} features of its images")


def vision_forward_kwargs(module: nn.Module, batch, sequences: torch.Tensor, attention_mask: torch.Tensor,
                          images: list[ImageInputs | None]) -> dict:
    """What a forward on ``batch``'s packed rows needs besides ids and mask: ``position_ids`` [4, R, L]
    (:func:`packed_positions`) and the image encoder outputs in packed order (:func:`image_features`)."""
    _check_image_tokens(module, sequences, attention_mask, images)
    kwargs = {}
    if uses_mrope(module):
        kwargs["position_ids"] = packed_positions(module, batch, sequences, attention_mask, images)
    features = image_features(module, images, packed_order(batch))
    if features is not None:
        kwargs["mm_encoder_outputs"] = {"image": features}
    return kwargs


def shared_vision_kwargs(module: nn.Module, rows, sequences: torch.Tensor, attention_mask: torch.Tensor,
                         images: list[ImageInputs | None]) -> dict:
    """What a forward on shared-prompt ``rows`` (:class:`rlhf_sg.packing.SharedPromptRows`) needs besides ids and
    mask: ``position_ids`` [4, R, L] (:func:`shared_positions`) and the image encoder outputs of each segment's
    prompt, in the order the segments lie (:func:`image_features`: the tower runs once on the distinct prompts'
    images, however many samples or segments hold them). Rows that share a segment must share its images
    (:func:`image_groups`)."""
    _check_image_tokens(module, sequences, attention_mask, images)
    for members in rows.segment_rows:
        if not all(same_images(images[members[0]], images[b]) for b in members):
            raise ValueError(f"shared-prompt rows {members}: one segment's rows hold different images; group them "
                             "by their images too (rlhf_sg.vision.image_groups)")
    kwargs = {}
    if uses_mrope(module):
        kwargs["position_ids"] = shared_positions(module, rows, sequences, attention_mask, images)
    features = image_features(module, images, [members[0] for members in rows.segment_rows])
    if features is not None:
        kwargs["mm_encoder_outputs"] = {"image": features}
    return kwargs
