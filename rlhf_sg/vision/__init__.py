"""Vision-language policies: images in prompts, from the data file to the model's forward.

- :mod:`rlhf_sg.vision.processor`: the model's own processor built locally (image processor, tokenizer with the
  vision tokens, chat template), saved with a tiny model and loaded back.
- :mod:`rlhf_sg.vision.data`: rows with images -> token ids, ``pixel_values`` and ``image_grid_thw`` from one
  processor call per prompt, every bad input refused by file, row and image.
- :mod:`rlhf_sg.vision.positions`: M-RoPE positions per sequence alone, laid into packed rows; the vision tower
  once per prompt.

Packing asks this package for the forward's extra arguments; nothing else knows an image.
"""

from __future__ import annotations

import logging

from rlhf_sg.vision.data import (
    IMAGE_MARKER,
    ImageInputs,
    VisionPrompt,
    image_token_counts,
    load_vision_prompts,
    process_prompt,
)
from rlhf_sg.vision.positions import (
    image_features,
    packed_order,
    packed_positions,
    sequence_positions,
    uses_mrope,
    vision_forward_kwargs,
    vision_tower,
)
from rlhf_sg.vision.processor import build_processor, is_vision_config, load_processor, save_tiny_vision_model

__all__ = ["IMAGE_MARKER", "ImageInputs", "VisionPrompt", "build_processor", "freeze_vision_tower", "image_features",
           "image_token_counts", "is_vision_config", "uses_mrope", "vision_tower",
           "load_processor", "load_vision_prompts", "packed_order", "packed_positions", "process_prompt",
           "refuse_shared_prompts", "save_tiny_vision_model", "sequence_positions", "vision_forward_kwargs"]

log = logging.getLogger("rlhf_sg")
_LOGGED: set[str] = set()


def refuse_shared_prompts(module) -> bool:
    """Shared-prompt rows (and blocks) do not carry M-RoPE rows yet: a batch with images is packed one sequence
    after another instead (exact), said once per model class. Returns the ``share_prompts`` to use: False."""
    name = type(module).__name__
    if name not in _LOGGED:
        _LOGGED.add(name)
        log.warning("%s: shared-prompt rows do not carry M-RoPE positions; batches with images are packed "
                    "(each sequence whole) instead of sharing their prompts", name)
    return False


def freeze_vision_tower(model) -> int:
    """Freeze the vision tower (Qwen-VL's ``model.model.visual``: patch embedding, blocks, merger; LLaVA's
    ``model.model.vision_tower``) of a vision-language model,
    so training moves only the language model; returns how many parameters were frozen. The tower's weights stay
    bit-identical through optimizer steps (no gradient reaches them, so no optimizer state or weight decay)."""
    from rlhf_sg.vision.positions import vision_core, vision_tower

    tower = vision_tower(vision_core(model))
    frozen = 0
    for param in tower.parameters():
        param.requires_grad_(False)
        frozen += param.numel()
    return frozen
