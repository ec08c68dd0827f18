"""Images for the engines that process them themselves (vLLM's ``multi_modal_data``): what one prompt's processor
output becomes on their side, without a second processor deciding anything.

Such an engine takes one image placeholder per image and raw images, runs the model's processor on them and
expands each placeholder to its feature count. The prompt we hold is the processor's output already: its image
tokens expanded, its ``pixel_values`` the resized, normalised patches. So the engine is given

* the ids with each image's run of placeholders collapsed to one (:func:`collapse_image_runs`; the engine's
  expansion gives our ids back, which its backend checks), and
* each image rebuilt at its processed size from ``pixel_values`` (:func:`images_from_pixels`): the engine's
  resize is then the identity and its normalisation returns our ``pixel_values``, which is checked before the
  images are handed over (re-processed with the model's image processor, they equal what the trainer uses).

Qwen-VL layout only (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): ``pixel_values`` rows are patches of
``channels · temporal_patch · patch²`` values, merged 2×2 blocks in order (the image processor's
``_preprocess``); a still image is its one frame repeated ``temporal_patch`` times.
"""

from __future__ import annotations

import torch

from rlhf_sg.vision.data import ImageInputs, image_token_counts

__all__ = ["QWEN_VL_TYPES", "collapse_image_runs", "engine_images", "images_from_pixels"]

#: model types whose ``pixel_values`` :func:`images_from_pixels` can turn back into images
QWEN_VL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
#: largest gap between the re-processed rebuilt images and the ``pixel_values`` sent (float32 round-off)
_PIXEL_TOLERANCE = 1e-5


def collapse_image_runs(ids: list[int], image_token_id: int, counts: list[int]) -> list[int]:
    """``ids`` with each image's run of ``image_token_id`` cut to one token; ``counts``: each image's token count, in
    order. ValueError when the runs are not exactly those counts (two images' runs touching, a cut run)."""
    runs: list[int] = []
    out: list[int] = []
    for t in ids:
        if t == image_token_id and out and out[-1] == image_token_id:
            runs[-1] += 1
            continue
        if t == image_token_id:
            runs.append(1)
        out.append(t)
    if runs != list(counts):
        raise ValueError(f"the prompt's image-token runs are {runs}, its images make {list(counts)} tokens "
                         "(each image one run between its own vision start and end)")
    return out


def images_from_pixels(inputs: ImageInputs, image_processor) -> list:
    """Each image of a Qwen-VL prompt as an RGB PIL image at its processed size, rebuilt from ``pixel_values``
    ([patches, C·T·p²]) and ``image_grid_thw`` ([images, 3]) by undoing the patch layout (frame 0), the
    normalisation and the rescale, rounded to bytes."""
    from PIL import Image

    p, m, temporal = image_processor.patch_size, image_processor.merge_size, image_processor.temporal_patch_size
    mean = torch.tensor(image_processor.image_mean, dtype=torch.float64).view(3, 1, 1)
    std = torch.tensor(image_processor.image_std, dtype=torch.float64).view(3, 1, 1)
    images, start = [], 0
    for t, h, w in inputs.image_grid_thw.tolist():
        rows = inputs.pixel_values[start:start + t * h * w].to(torch.float64)
        start += t * h * w
        # the processor's order: (t, h/m, w/m, m, m, C, T, p, p) -> frame 0 as (C, h/m, m, p, w/m, m, p)
        x = rows.reshape(t, h // m, w // m, m, m, 3, temporal, p, p)[0, ..., 0, :, :]
        x = x.permute(4, 0, 2, 5, 1, 3, 6).reshape(3, h * p, w * p)
        x = (x * std + mean) / image_processor.rescale_factor
        pixels = x.round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).contiguous()
        images.append(Image.fromarray(pixels.numpy(), mode="RGB"))
    return images


def engine_images(config, image_processor, ids: list[int], inputs: ImageInputs | None) -> tuple[list[int], list]:
    """(the ids an engine that expands placeholders itself takes, the images it takes) for one prompt of a
    Qwen-VL ``config``: runs collapsed, images rebuilt. ValueError, naming what differs, when the runs are not
    the images' token counts or the rebuilt images do not re-process to ``inputs.pixel_values``."""
    if inputs is None:
        if config.image_token_id in ids:
            raise ValueError("the prompt holds image tokens but no images were given with it")
        return list(ids), []
    if config.model_type not in QWEN_VL_TYPES:
        raise ValueError(f"{config.model_type} images cannot be handed to an engine that processes them itself; "
                         f"built for {list(QWEN_VL_TYPES)}")
    collapsed = collapse_image_runs(ids, config.image_token_id, image_token_counts(config, inputs))
    images = images_from_pixels(inputs, image_processor)
    again = image_processor(images=images, return_tensors="pt")
    if not torch.equal(again["image_grid_thw"], inputs.image_grid_thw.to(again["image_grid_thw"].dtype)):
        raise ValueError(f"the rebuilt images re-process to grids {again['image_grid_thw'].tolist()}, not "
                         f"{inputs.image_grid_thw.tolist()}: the pixel_values are not this image processor's")
    gap = (again["pixel_values"].float() - inputs.pixel_values.float()).abs().max().item()
    if gap > _PIXEL_TOLERANCE:
        raise ValueError(f"the rebuilt images re-process to pixel_values {gap:.2g} away from those given: the "
                         "pixel_values are not this image processor's")
    return collapsed, images
