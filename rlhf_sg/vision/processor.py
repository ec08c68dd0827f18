"""The model's own processor, built locally: its image processor, our tokenizer with the vision tokens, a chat
template that renders image content parts.

transformers' Qwen-VL processors take a video processor too, which needs torchvision; the image-only subclass
(:func:`image_only`) accepts its absence and is otherwise the model's own class, so the expanded ids, the
``pixel_values`` and ``image_grid_thw`` are exactly what that class makes.
"""

from __future__ import annotations

import functools
import os

#: processor class in transformers per vision-language ``config.model_type``
PROCESSOR_CLASSES = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor",
                     "qwen3_vl": "Qwen3VLProcessor", "llava": "LlavaProcessor"}

#: Qwen-VL's chat format: a string content as text, a list of content parts with each image part (``{"type":
#: "image"}``) as ``<|vision_start|><|image_pad|><|vision_end|>`` (``image_placeholder`` where the template is given
#: one: LLaVA's ``<image>``), which the processor expands per image
VISION_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- image_placeholder | default('<|vision_start|><|image_pad|><|vision_end|>') }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def is_vision_config(config) -> bool:
    """True for a vision-language model's config (one with a vision tower)."""
    return getattr(config, "vision_config", None) is not None


@functools.cache
def image_only(class_name: str) -> type:
    """The transformers processor ``class_name`` that takes no video processor (None where it wants one)."""
    import transformers

    base = getattr(transformers, class_name)

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return base.check_argument_for_proper_class(self, argument_name, argument)

    return type(class_name, (base,), {"check_argument_for_proper_class": check_argument_for_proper_class,
                                      "__module__": __name__})


def _image_processor_class(model_type: str):
    """The PIL-backend image processor class of a vision-language model type (no torchvision needed)."""
    if model_type == "llava":
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        return CLIPImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil


def tiny_image_processor(config, min_tokens: int = 4, max_tokens: int = 16):
    """The image processor (PIL backend) for ``config``'s vision tower: Qwen-VL's, sized so an image becomes between
    ``min_tokens`` and ``max_tokens`` merged tokens (a small tower, small images); LLaVA's CLIP processor, resizing
    and cropping to the tower's ``image_size``."""
    vision = config.vision_config
    if config.model_type == "llava":
        side = vision.image_size
        return _image_processor_class("llava")(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    unit = (vision.patch_size * vision.spatial_merge_size) ** 2  # pixels per merged token
    return Qwen2VLImageProcessorPil(size={"shortest_edge": unit * min_tokens, "longest_edge": unit * max_tokens},
                                    patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                                    temporal_patch_size=vision.temporal_patch_size)


def build_processor(config, tokenizer, image_processor, chat_template: str | None = None):
    """The model's own processor class (:data:`PROCESSOR_CLASSES`) around ``image_processor`` and ``tokenizer``."""
    name = PROCESSOR_CLASSES.get(getattr(config, "model_type", None))
    if name is None:
        raise ValueError(f"no processor for model type {getattr(config, 'model_type', None)!r}; vision-language "
                         f"models supported: {sorted(PROCESSOR_CLASSES)}")
    extra = {}
    if config.model_type == "llava":  # its processor expands <image> to the tower's patches, +1 for CLIP's CLS
        extra = dict(patch_size=config.vision_config.patch_size, image_token="<image>", num_additional_image_tokens=1,
                     vision_feature_select_strategy=config.vision_feature_select_strategy)
    processor = image_only(name)(image_processor=image_processor, tokenizer=tokenizer,
                                 chat_template=chat_template or getattr(tokenizer, "chat_template", None), **extra)
    #: one image in a prompt's text before the processor expands it
    processor.image_placeholder = (processor.image_token if config.model_type == "llava"
                                   else "<|vision_start|>" + processor.image_token + "<|vision_end|>")
    return processor


def save_tiny_vision_model(path: str, family: str, seed: int = 0, model=None, head_dim: int | None = None) -> str:
    """Build (or take) a tiny vision-language model of ``family`` and save it under ``path`` with its tokenizer
    (:data:`VISION_CHAT_TEMPLATE` as chat template) and image processor, as :func:`load_processor` reads them
    (``head_dim``: see :func:`rlhf_sg.tiny.tiny_vision_model`)."""
    from rlhf_sg.tiny import build_vision_tokenizer, tiny_vision_model

    os.makedirs(path, exist_ok=True)
    tokenizer = build_vision_tokenizer()
    tokenizer.chat_template = VISION_CHAT_TEMPLATE
    model = model if model is not None else tiny_vision_model(family, tokenizer, seed, head_dim=head_dim)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    tiny_image_processor(model.config).save_pretrained(path)
    return path


def load_processor(path: str, flag: str = "--model.pretrain"):
    """(config, processor) of the vision-language model directory ``path``; processor None for a text-only model.

    The image processor is read from ``preprocessor_config.json`` (its PIL class: no torchvision needed), the
    tokenizer as :func:`rlhf_sg.data.load_tokenizer` loads it, the chat template from the tokenizer."""
    from transformers import AutoConfig

    from rlhf_sg.config import ConfigError
    from rlhf_sg.data import load_tokenizer

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{flag}: no model config loads from {path!r} ({e})") from None
    if not is_vision_config(config):
        return config, None
    if not os.path.isfile(os.path.join(path, "preprocessor_config.json")):
        raise ConfigError(f"{flag}: {path!r} is a vision-language model ({config.model_type}) without an image "
                          "processor (preprocessor_config.json); save it next to the model "
                          "(image_processor.save_pretrained)")
    image_processor = _image_processor_class(config.model_type).from_pretrained(path)
    return config, build_processor(config, load_tokenizer(path, flag), image_processor)
