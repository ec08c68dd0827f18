"""M-RoPE positions per sequence, laid into packed rows; the vision tower once per prompt.

Models with 1-D positions (LLaVA) take packing's own positions; only their image features come from here.

Qwen-VL models rotate queries and keys by three position rows (temporal, height, width), which inside an image
follow its patch grid and after it jump ahead (``get_rope_index``). Packing rows of several sequences must give
each sequence the positions it has alone, so they are computed for each sequence alone, by the model's own
``get_rope_index``, and only then laid into the packed slots. The model takes ``position_ids`` [4, R, L]: the
packed text row (restarting at 0 per sequence, which the attention mask is built from) above the three M-RoPE rows.
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


def vision_forward_kwargs(module: nn.Module, batch, sequences: torch.Tensor, attention_mask: torch.Tensor,
                          images: list[ImageInputs | None]) -> dict:
    """What a forward on ``batch``'s packed rows needs besides ids and mask: ``position_ids`` [4, R, L]
    (:func:`packed_positions`) and the image encoder outputs in packed order (:func:`image_features`)."""
    if len(images) != sequences.shape[0]:
        raise ValueError(f"images: {len(images)} entries for {sequences.shape[0]} sequences")
    for b, inputs in enumerate(images):
        have = int((sequences[b][attention_mask[b].bool()] == module.config.image_token_id).sum())
        want = 0 if inputs is None else sum(image_token_counts(module.config, inputs))
        if have != want:
            raise ValueError(f"sequence {b}: {have} image tokens but the model makes {want} features of its images")
    kwargs = {}
    if uses_mrope(module):
        kwargs["position_ids"] = packed_positions(module, batch, sequences, attention_mask, images)
    features = image_features(module, images, packed_order(batch))
    if features is not None:
        kwargs["mm_encoder_outputs"] = {"image": features}
    return kwargs
