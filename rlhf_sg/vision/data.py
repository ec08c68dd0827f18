"""Prompt rows with images -> token ids, ``pixel_values`` and ``image_grid_thw`` from ONE processor call per prompt.

A row names its images in ``--data.image_key`` (default ``images``): a list whose items are a path (relative to the
data file's directory), raw bytes, a ``{"bytes": ..., "path": ...}`` dict (how Parquet and ``datasets`` store an
image column), a ``data:image/...;base64,`` URI or ``{"base64": ...}``. An http(s) URL is refused unless
``allow_urls``. The prompt places them with ``<image>`` markers in its text, or as ``{"type": "image"}`` content
parts of chat messages; rows without images stay text rows of the same dataset.

Every refusal is a :class:`rlhf_sg.data.DataError` naming the file, the row and the image, raised while the data
is read (before any cluster starts): a missing or unreadable image, markers that do not match the images, an image
for a text-only model, an image-token count that is not grid / merge², a prompt over ``max_prompt_len`` (never
truncated through an image: ``overlong_prompts="truncate"`` is refused for image rows).
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_sg.data import DataError, Prompt, _read_rows, check_prompt_row

__all__ = ["IMAGE_MARKER", "ImageInputs", "VisionPrompt", "image_token_counts", "load_vision_prompts",
           "process_prompt"]

log = logging.getLogger("rlhf_sg")

#: where a text prompt places its next image
IMAGE_MARKER = "<image>"


@dataclass(eq=False)
class ImageInputs:
    """One prompt's processor output for its images (what travels with every sample of the prompt).

    pixel_values: Qwen-VL: [patches, 3 * temporal_patch * patch²] float32, the images' patches one image after
        another; LLaVA: [images, 3, H, W].
    image_grid_thw: Qwen-VL: [images, 3] long, each image's (t, h, w) patch grid; None for LLaVA (fixed size).
    Identity is the prompt's: samples of one prompt share one object (the vision tower runs once for it).
    """

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor | None = None

    @property
    def num_images(self) -> int:
        return int((self.image_grid_thw if self.image_grid_thw is not None else self.pixel_values).shape[0])

    def to(self, device: torch.device | str) -> ImageInputs:
        """These inputs on ``device`` (itself when already there)."""
        if self.pixel_values.device == torch.device(device):
            return self
        grid = None if self.image_grid_thw is None else self.image_grid_thw.to(device)
        return ImageInputs(self.pixel_values.to(device), grid)

    def model_kwargs(self) -> dict[str, torch.Tensor]:
        """The model forward's image arguments (the processor's names)."""
        if self.image_grid_thw is None:
            return {"pixel_values": self.pixel_values}
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw}


def image_token_counts(config, inputs: ImageInputs) -> list[int]:
    """How many image tokens each image of ``inputs`` is in the prompt, as the model's ``config`` makes features:
    Qwen-VL t·h·w / merge² of its grid; LLaVA (image_size / patch)² (+1, the CLS feature, under the "full"
    strategy)."""
    vision = config.vision_config
    if inputs.image_grid_thw is not None:
        return (inputs.image_grid_thw.prod(-1) // vision.spatial_merge_size**2).tolist()
    per_image = (vision.image_size // vision.patch_size) ** 2 + (config.vision_feature_select_strategy == "full")
    return [per_image] * inputs.num_images


@dataclass
class VisionPrompt(Prompt):
    images: ImageInputs | None = None  # None: a text row


def _open_image(item: Any, base_dir: str, allow_urls: bool, where: str):
    """A PIL image (RGB) from one entry of a row's image list."""
    from PIL import Image, UnidentifiedImageError

    data: bytes | None = None
    path = None
    if isinstance(item, dict):
        if item.get("bytes") is not None:
            data = item["bytes"]
        elif item.get("base64") is not None:
            item = "data:;base64," + str(item["base64"])
        elif item.get("path") is not None:
            item = item["path"]
        else:
            raise DataError(f"{where}: an image dict needs 'bytes', 'base64' or 'path' (keys: {', '.join(item)})")
    if isinstance(item, (bytes, bytearray)):
        data = bytes(item)
    elif isinstance(item, str) and data is None:
        if item.startswith(("http://", "https://")):
            if not allow_urls:
                raise DataError(f"{where}: {item[:80]!r} is a URL; fetching images is off: download them next to "
                                "the data file, or set --data.allow_image_urls")
            import urllib.request

            try:
                with urllib.request.urlopen(item, timeout=30) as response:  # noqa: S310 (http(s) only, checked)
                    data = response.read()
            except OSError as e:
                raise DataError(f"{where}: cannot fetch {item[:80]!r} ({e})") from None
        elif item.startswith("data:"):
            try:
                data = base64.b64decode(item.split(",", 1)[1], validate=True)
            except (IndexError, binascii.Error, ValueError) as e:
                raise DataError(f"{where}: not valid base64 image data ({e})") from None
        else:
            path = item if os.path.isabs(item) else os.path.join(base_dir, item)
            if not os.path.isfile(path):
                raise DataError(f"{where}: image file {item!r} not found (looked for {path}; paths are relative to "
                                "the data file's directory)")
    elif data is None:
        raise DataError(f"{where}: an image must be a path, bytes, a data: URI or a dict with bytes / base64 / "
                        f"path, got {type(item).__name__}")
    try:
        with Image.open(io.BytesIO(data) if data is not None else path) as image:
            image.load()
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise DataError(f"{where}: unreadable image ({type(e).__name__}: {e})") from None


def _image_list(raw: dict, image_key: str, where: str) -> list:
    images = raw.get(image_key)
    if images is None:
        return []
    if not isinstance(images, (list, tuple)):
        images = [images]
    return list(images)


def _messages(content: Any, where: str, input_key: str) -> list[dict]:
    """Chat messages from a prompt: a string (``<image>`` markers become image parts) or a list of messages whose
    content is a string or a list of ``{"type": "text" | "image"}`` parts."""
    if isinstance(content, str):
        return [{"role": "user", "content": _parts(content)}]
    if isinstance(content, list) and content and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                     for m in content):
        out = []
        for m in content:
            body = m.get("content")
            if isinstance(body, str):
                out.append({"role": m["role"], "content": _parts(body)})
            elif isinstance(body, list) and all(isinstance(p, dict) and p.get("type") in ("text", "image")
                                                for p in body):
                out.append({"role": m["role"], "content": [{"type": "image"} if p["type"] == "image" else p
                                                           for p in body]})
            else:
                raise DataError(f"{where}: message content must be a string or a list of {{'type': 'text'|'image'}} "
                                f"parts (got {str(body)[:80]!r})")
        return out
    raise DataError(f"{where}: {input_key!r} must be a string or a list of {{'role', 'content'}} messages "
                    f"(got {str(content)[:80]!r})")


def _parts(text: str) -> list[dict]:
    pieces = text.split(IMAGE_MARKER)
    parts: list[dict] = []
    for i, piece in enumerate(pieces):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _count_images(messages: list[dict]) -> int:
    return sum(p["type"] == "image" for m in messages for p in m["content"])


def _text_of(messages: list[dict], processor, apply_chat_template: bool) -> str:
    mark = processor.image_placeholder  # set by rlhf_sg.vision.build_processor
    if apply_chat_template:
        return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             image_placeholder=mark)
    return "".join(p["text"] if p["type"] == "text" else mark for m in messages for p in m["content"])


def process_prompt(processor, config, text: str, images: list, where: str) -> tuple[list[int], ImageInputs | None]:
    """ONE processor call on a prompt's text and images -> (expanded token ids, its :class:`ImageInputs`), checked
    against the model's ``config``: each image's tokens = t·h·w / merge² of its grid, patch rows = Σ t·h·w with
    3·temporal_patch·patch² values each; a mismatch (a processor for another model) is a DataError at ``where``."""
    try:
        out = processor(images=images or None, text=[text], return_tensors="pt")
    except Exception as e:  # the processor's own checks (image sizes it refuses, ...) raise what they like
        raise DataError(f"{where}: the processor fails on this row ({type(e).__name__}: {e})") from None
    ids = out["input_ids"][0]
    if not images:
        return ids.tolist(), None
    vision = config.vision_config
    grid = out["image_grid_thw"].long() if "image_grid_thw" in out else None
    inputs = ImageInputs(pixel_values=out["pixel_values"].float(), image_grid_thw=grid)
    want = image_token_counts(config, inputs)
    runs = _runs(ids, config.image_token_id)
    if len(runs) != len(images) or runs != want:
        raise DataError(f"{where}: the prompt's image tokens ({runs}, one run per image) do not match the features "
                        f"the model makes of the images ({want}): the processor does not fit the model "
                        f"({type(processor.image_processor).__name__}, model {config.model_type}); save the model's "
                        "own image processor next to it")
    if grid is not None:
        shape = (int(grid.prod(-1).sum()), 3 * vision.temporal_patch_size * vision.patch_size**2)
    else:
        shape = (len(images), 3, vision.image_size, vision.image_size)
    if tuple(inputs.pixel_values.shape) != shape:
        raise DataError(f"{where}: pixel_values {tuple(inputs.pixel_values.shape)} do not fit the model's vision "
                        f"tower (it takes {shape}); the processor does not fit the model: save the model's own image "
                        "processor next to it")
    return ids.tolist(), inputs


def _runs(ids: torch.Tensor, token_id: int) -> list[int]:
    """Lengths of the runs of ``token_id`` in ``ids``, in order."""
    runs, current = [], 0
    for is_token in (ids == token_id).tolist():
        if is_token:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    if current:
        runs.append(current)
    return runs


def load_vision_prompts(
    path: str,
    config,
    processor,
    input_key: str = "prompt",
    label_key: str | None = None,
    image_key: str = "images",
    apply_chat_template: bool = False,
    max_prompt_len: int = 1024,
    overlong_prompts: str = "error",
    allow_urls: bool = False,
    skip_bad_rows: bool = False,
) -> tuple[list[VisionPrompt], int]:
    """Read ``path`` (JSONL / Parquet / datasets directory) into prompts with their images; (prompts, rows skipped).

    ``config``: the policy's model config; ``processor``: its processor (:func:`rlhf_sg.vision.load_processor`),
    None for a text-only model, where any row with images is refused."""
    rows, unit = _read_rows(path)
    base_dir = os.path.dirname(os.path.abspath(path)) if not os.path.isdir(path) else os.path.abspath(path)
    first = 1 if unit == "line" else 0
    prompts: list[VisionPrompt] = []
    skipped = dropped = 0
    for i, raw in enumerate(rows, start=first):
        if raw is None:
            continue
        where = f"{path} {unit} {i}"
        try:
            prompt = _vision_row(raw, where, base_dir, config, processor, input_key, label_key, image_key,
                                 apply_chat_template, allow_urls, i)
            if len(prompt.token_ids) > max_prompt_len:
                if overlong_prompts == "drop":
                    dropped += 1
                    continue
                if prompt.images is not None or overlong_prompts == "error":
                    what = (" (truncating would cut through its images: set --data.overlong_prompts drop)"
                            if prompt.images is not None and overlong_prompts == "truncate" else "")
                    raise DataError(f"{where}: prompt is {len(prompt.token_ids)} tokens (image tokens included), "
                                    f"over --data.max_prompt_len {max_prompt_len}{what}; raise it, make the images "
                                    "smaller, or set --data.overlong_prompts drop")
                prompt.token_ids = prompt.token_ids[-max_prompt_len:]
            prompts.append(prompt)
        except DataError:
            if not skip_bad_rows:
                raise
            skipped += 1
    if dropped:
        log.warning("%s: dropped %d prompts longer than --data.max_prompt_len %d", path, dropped, max_prompt_len)
    if not prompts:
        raise DataError(f"{path}: no usable prompt ({skipped} bad rows skipped, {dropped} over --data.max_prompt_len "
                        f"{max_prompt_len} dropped); fix the rows or the flags")
    return prompts, skipped


def _vision_row(raw, where, base_dir, config, processor, input_key, label_key, image_key, apply_chat_template,
                allow_urls, row) -> VisionPrompt:
    check_prompt_row(raw, where, input_key, label_key)
    items = _image_list(raw, image_key, where)
    messages = _messages(raw[input_key], where, input_key)
    marked = _count_images(messages)
    if processor is None:
        if items or marked:
            raise DataError(f"{where}: the row has {max(len(items), marked)} image(s) but the model "
                            f"({getattr(config, 'model_type', '?')}) is text-only; use a vision-language model "
                            "or drop the images")
        raise DataError(f"{where}: load_vision_prompts needs the processor of a vision-language model")
    if marked != len(items):
        raise DataError(f"{where}: the prompt places {marked} image(s) ({IMAGE_MARKER!r} markers or image parts) but "
                        f"{image_key!r} holds {len(items)}; give one marker per image")
    images = [_open_image(item, base_dir, allow_urls, f"{where} image {k}") for k, item in enumerate(items)]
    text = _text_of(messages, processor, apply_chat_template)
    ids, inputs = process_prompt(processor, config, text, images, where)
    return VisionPrompt(token_ids=ids, text=text, label=raw.get(label_key) if label_key else None, row=row,
                        images=inputs)
