"""Vision-language policies: images in prompts, from the data file to the model's forward.

- :mod:`rlhf_sg.vision.processor`: the model's own processor built locally (image processor, tokenizer with the
  vision tokens, chat template), saved with a tiny model and loaded back.
- :mod:`rlhf_sg.vision.data`: rows with images -> token ids, ``pixel_values`` and ``image_grid_thw`` from one
  processor call per prompt, every bad input refused by file, row and image.
- :mod:`rlhf_sg.vision.positions`: M-RoPE positions per sequence alone, laid into packed rows and shared-prompt
  rows (a prompt once, each response continuing its positions); the vision tower once per prompt.

Packing asks this package for the forward's extra arguments; nothing else knows an image.
"""

from __future__ import annotations

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
    image_groups,
    packed_order,
    packed_positions,
    prompt_positions,
    same_images,
    sequence_positions,
    shared_positions,
    shared_vision_kwargs,
    uses_mrope,
    vision_forward_kwargs,
    vision_tower,
)
from rlhf_sg.vision.processor import build_processor, is_vision_config, load_processor, save_tiny_vision_model

__all__ = ["IMAGE_MARKER", "ImageInputs", "VisionPrompt", "build_processor", "freeze_vision_tower", "image_features",
           "image_groups", "image_token_counts", "is_vision_config", "uses_mrope", "vision_tower",
           "load_processor", "load_vision_prompts", "packed_order", "packed_positions", "process_prompt",
           "prompt_positions", "same_images", "save_tiny_vision_model", "sequence_positions", "shared_positions",
           "shared_vision_kwargs", "vision_forward_kwargs"]


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
