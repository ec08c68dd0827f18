"""Device memory of a run, as formulas: attention masks, the embedded engine's KV cache, sync buffers, ZeRO-3 shards.

One place for the byte counts that ``python -m rlhf_sg.bench memory`` prints and ``tests/test_memory.py`` holds
to real tensors at small sizes. Every count is per rank (one GPU), in bytes.

* Dense attention masks (packed rows with several sequences, shared-prompt segments): a boolean ``[R, 1, L, L]``
  mask handed to sdpa is converted to the model dtype on every call, and on CUDA its key axis padded to a
  multiple of 16 (torch's ``preprocess_mask``), and each layer saves its own converted copy for backward:
  ``layers x R x L x pad16(L) x dtype bytes``. Built once in the model dtype with the key axis allocated to a
  multiple of 16, every layer passes and saves the same storage: ``R x L x pad16(L) x dtype bytes`` in all.
* The embedded engine's KV cache (``backends.embedded``): ``rows x tokens x kv_bytes_per_token``, a token being the
  keys and values of every layer plus one mask column; its budget ``memory_fraction x device bytes - weights``.
* Weight sync on a sending rank: two bucket buffers (double buffering) and the gather staging buffer, each the
  size of the largest bucket (``bucket_bytes``, or the largest tensor where one is bigger).
* ZeRO-3 shards: ``ceil(numel / world)`` elements of every parameter, and as many of gradients, in the model
  dtype; Adam's two moments in float32, and with a 16-bit model its float32 master copy too.
* Shared-prompt blocks (:func:`shared_prompt_block_bytes`): what their sdpa calls keep for backward per layer (the
  gathered queries, keys and values, the outputs and log-sum-exp), and their slot indices once for all layers.
* A model rank at its peak (:func:`training_rank_bytes`, :func:`forward_rank_bytes`): its shards, the activations a
  micro-batch keeps for backward (every layer's, or with gradient checkpointing every layer's input and one layer
  recomputed), one log-prob chunk's logits, a dense mask, ZeRO-3's gather and reduce buffers.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer (Llama / Qwen2 layout) that set its memory."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype: str = "bfloat16"
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 (and Qwen2-MoE, Qwen2-VL and Qwen2.5-VL's text models) has q / k / v biases
    #: a vision-language model's parameters outside its language model (Qwen-VL's ``visual`` with its merger,
    #: LLaVA's ``vision_tower`` and projector: :func:`vision_tower_params`), counted whole: the engine holds them, a
    #: ZeRO-3 rank its shard of them; frozen in training (the default, ``--model.freeze_vision_tower``), so no
    #: gradients or optimizer states of them
    vision_params: int = 0

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @classmethod
    def from_hf_config(cls, config: dict, dtype: str | None = None) -> ModelShape:
        """From a Hugging Face ``config.json`` (as a dict); ``dtype`` overrides its ``torch_dtype``.

        Read through the family's own config class, so each family's key names count (GPT-2's and Bloom's
        ``n_head`` / ``n_layer`` through ``attribute_map``), and a multimodal config's text part is the one read.
        Without an intermediate size (GPT-2's ``n_inner`` unset, Bloom) the MLP is 4 x hidden."""
        from backends.checkpoint_names import text_config

        text = text_config(config)
        hidden = int(text.hidden_size)
        heads = int(text.num_attention_heads)
        intermediate = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden
        return cls(
            num_layers=int(text.num_hidden_layers), hidden_size=hidden, num_heads=heads,
            num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
            intermediate_size=int(intermediate), vocab_size=int(text.vocab_size),
            dtype=dtype or config.get("torch_dtype") or config.get("dtype") or "bfloat16",
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=text.model_type.startswith("qwen2") or bool(getattr(text, "attention_bias", False)),
            vision_params=vision_tower_params(config) if config.get("vision_config") else 0,
        )


def vision_tower_params(config: dict) -> int:
    """The parameters of a vision-language ``config.json`` (as a dict) outside its language model: the vision tower
    (Qwen-VL's merger included) and LLaVA's projector. Counted on the model built from the config on the meta device
    (no memory, no weights)."""
    import torch
    import transformers

    from rlhf_sg.vision.positions import vision_core

    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        core = vision_core(transformers.AutoModelForImageTextToText.from_config(hf_config))
    return sum(p.numel() for name, child in core.named_children() if name != "language_model"
               for p in child.parameters())


#: model shapes by name, for ``--model-config`` (no download: the sizes of the published config.json)
PRESETS = {
    "qwen2.5-7b": ModelShape(num_layers=28, hidden_size=3584, num_heads=28, num_kv_heads=4, head_dim=128,
                             intermediate_size=18944, vocab_size=152064, dtype="bfloat16", qkv_bias=True),
    # Qwen/Qwen2.5-VL-7B-Instruct's config.json: the text model is Qwen2.5-7B's shape; its vision_config (32 blocks of
    # 1280, SwiGLU MLP of 3420, 16 heads, a 2 x 2 patch merger to 3584) gives a tower of 676,550,144 parameters
    # (vision_tower_params on that config)
    "qwen2.5-vl-7b": ModelShape(num_layers=28, hidden_size=3584, num_heads=28, num_kv_heads=4, head_dim=128,
                                intermediate_size=18944, vocab_size=152064, dtype="bfloat16", qkv_bias=True,
                                vision_params=676_550_144),
    # Qwen/Qwen2.5-32B's config.json: 64 layers, hidden 5120, 40 heads / 8 key-value heads of 128, intermediate
    # 27648, vocab 152064, untied, bf16
    "qwen2.5-32b": ModelShape(num_layers=64, hidden_size=5120, num_heads=40, num_kv_heads=8, head_dim=128,
                              intermediate_size=27648, vocab_size=152064, dtype="bfloat16", qkv_bias=True),
    "llama-3.1-70b": ModelShape(num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, head_dim=128,
                                intermediate_size=28672, vocab_size=128256, dtype="bfloat16"),
}


def load_shape(name_or_path: str) -> ModelShape:
    """A preset name (:data:`PRESETS`), a model directory holding ``config.json``, or a JSON file: a Hugging Face
    ``config.json``, or :class:`ModelShape`'s own fields."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = os.path.join(name_or_path, "config.json") if os.path.isdir(name_or_path) else name_or_path
    if not os.path.isfile(path):
        raise ValueError(f"--model-config {name_or_path!r}: neither a preset ({', '.join(sorted(PRESETS))}) nor a "
                         "JSON file or model directory with config.json")
    with open(path) as f:
        config = json.load(f)
    if "num_layers" in config:
        return ModelShape(**config)
    return ModelShape.from_hf_config(config)


def pad16(n: int) -> int:
    """``n`` rounded up to a multiple of 16 (the key-axis alignment of torch's memory-efficient sdpa kernel)."""
    return -(-n // 16) * 16


def dense_mask_bytes_per_layer(rows: int, seq_len: int, dtype_bytes: int) -> int:
    """What one layer saves for backward from a boolean ``[rows, 1, L, L]`` mask: converted to the model dtype and
    (on CUDA) padded on the key axis to a multiple of 16."""
    return rows * seq_len * pad16(seq_len) * dtype_bytes


def dense_mask_bytes_before(shape: ModelShape, rows: int, seq_len: int) -> int:
    """Every layer's own converted copy of a boolean mask, held until backward."""
    return shape.num_layers * dense_mask_bytes_per_layer(rows, seq_len, shape.dtype_bytes)


def shared_mask_bytes(rows: int, seq_len: int, dtype_bytes: int) -> int:
    """One additive mask ``[rows, 1, L, L]`` in the model dtype whose key axis is allocated to a multiple of 16,
    passed to and saved by every layer as it is (the same storage)."""
    return rows * seq_len * pad16(seq_len) * dtype_bytes


def kv_bytes_per_token(shape: ModelShape) -> int:
    """One token of one row of the embedded engine's KV buffers: keys and values of every layer, one mask column."""
    return (shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim + 1) * shape.dtype_bytes


def kv_cache_bytes(shape: ModelShape, rows: int, tokens: int) -> int:
    """The embedded engine's KV buffers for ``rows`` rows of ``tokens`` columns (prompt width + new tokens)."""
    return rows * tokens * kv_bytes_per_token(shape)


def param_numels(shape: ModelShape) -> list[int]:
    """The element count of every parameter: embeddings, per layer the attention projections (and q / k / v biases),
    the MLP's three projections and two norms, the final norm, and lm_head unless tied."""
    h, kv = shape.hidden_size, shape.num_kv_heads * shape.head_dim
    q = shape.num_heads * shape.head_dim
    layer = [h * q, h * kv, h * kv, q * h, *((q, kv, kv) if shape.qkv_bias else ()),
             *(3 * [h * shape.intermediate_size]), h, h]
    lm_head = [] if shape.tie_word_embeddings else [shape.vocab_size * h]
    return [shape.vocab_size * h, *(shape.num_layers * layer), h, *lm_head]


def param_count(shape: ModelShape) -> int:
    """Every parameter: the language model's (:func:`param_numels`) and a vision tower's."""
    return sum(param_numels(shape)) + shape.vision_params


def weight_bytes(shape: ModelShape) -> int:
    return param_count(shape) * shape.dtype_bytes


def kv_budget_bytes(shape: ModelShape, device_bytes: int, memory_fraction: float) -> int:
    """The embedded engine's KV budget on CUDA: ``memory_fraction`` of the device, less the weights."""
    return int(memory_fraction * device_bytes) - weight_bytes(shape)


def largest_tensor_bytes(shape: ModelShape) -> int:
    """The largest single parameter: the embedding (or lm_head) matrix, or an MLP projection."""
    return max(shape.vocab_size, shape.intermediate_size) * shape.hidden_size * shape.dtype_bytes


def sync_bytes(shape: ModelShape, bucket_bytes: int) -> dict[str, int]:
    """Weight-sync buffers of a sending trainer rank: two bucket buffers and the gather staging."""
    bucket = max(bucket_bytes, largest_tensor_bytes(shape))
    return {"bucket_buffers": 2 * bucket, "gather_staging": bucket}


def zero3_shard_bytes(shape: ModelShape, world_size: int) -> dict[str, int]:
    """One rank's ZeRO-3 partition of parameters, gradients and Adam's states. DeepSpeed partitions every parameter
    on its own, padded to a multiple of the world size: ``ceil(numel / world)`` elements of each on every rank."""
    per_rank = sum(-(-n // world_size) for n in param_numels(shape))
    optimizer = per_rank * (8 if shape.dtype_bytes == 4 else 12)  # m, v (+ the float32 master of 16-bit weights)
    frozen = -(-shape.vision_params // world_size)  # the vision tower's shard: weights only (frozen)
    return {"params": (per_rank + frozen) * shape.dtype_bytes, "grads": per_rank * shape.dtype_bytes,
            "optimizer": optimizer}


# ---- a training rank at its peak ---------------------------------------------------------------------------------
# DeepSpeed's ZeRO-3 defaults the runs keep (rlhf_sg.distributed.zero3_config sets none of them), in elements.
ZERO3_PREFETCH_ELEMENTS = 50_000_000  # stage3_prefetch_bucket_size: parameters gathered ahead of their module
ZERO3_REDUCE_ELEMENTS = 500_000_000  # reduce_bucket_size: gradients reduced at once

#: response positions whose logits exist at once (``rlhf_sg.packing.response_logprobs``' chunk_tokens)
LOGPROB_CHUNK_TOKENS = 1024

#: what :func:`training_rank_bytes` and :func:`forward_rank_bytes` hold for the whole step; the rest comes and goes
RESIDENT = ("params", "grads", "optimizer")


def _norm_bytes_per_token(shape: ModelShape) -> int:
    """An RMSNorm under autograd: its float32 input and inverse RMS, its normed input in the model dtype (for the
    weight's gradient) and its output (the next projection's input)."""
    return 4 * shape.hidden_size + 4 + 2 * shape.dtype_bytes * shape.hidden_size


def layer_activation_bytes_per_token(shape: ModelShape) -> int:
    """What one decoder layer (Llama / Qwen2 layout) keeps for backward per token, nothing recomputed: two norms;
    the rotated queries and keys, the values, the attention output (o_proj's input: the fused kernels write it
    token-major, so the same storage) and its float32 log-sum-exp (sdpa's fused kernels and flash attention keep
    no L x L scores; a dense mask is counted apart); the MLP's gate and up projections, the activated gate and
    down_proj's input."""
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    attention = shape.dtype_bytes * (2 * q + 2 * kv) + 4 * shape.num_heads
    return outside_attention_bytes_per_token(shape) + attention


def outside_attention_bytes_per_token(shape: ModelShape) -> int:
    """The part of :func:`layer_activation_bytes_per_token` outside the attention call (its two norms and the MLP),
    which every token keeps on the rank that holds its column, with or without sequence parallelism."""
    return 2 * _norm_bytes_per_token(shape) + 4 * shape.dtype_bytes * shape.intermediate_size


def final_norm_bytes_per_token(shape: ModelShape) -> int:
    """The final norm's saved tensors per token (as :func:`saved_activation_bytes` counts them)."""
    return 4 * shape.hidden_size + 4 + shape.dtype_bytes * shape.hidden_size


def saved_activation_bytes(shape: ModelShape, tokens: int, gradient_checkpointing: bool) -> int:
    """What a forward of ``tokens`` tokens leaves for its backward: every layer's activations, or with gradient
    checkpointing only every layer's input; and the final norm's."""
    per_layer = (shape.dtype_bytes * shape.hidden_size if gradient_checkpointing
                 else layer_activation_bytes_per_token(shape))
    return tokens * (shape.num_layers * per_layer + final_norm_bytes_per_token(shape))


@contextlib.contextmanager
def saved_for_backward(model) -> Iterator[dict[int, int]]:
    """Measure what the formulas count: inside the block, every storage autograd saves for the backward (data
    pointer -> bytes, each storage once, ``model``'s parameters left out) goes into the dict it yields."""
    import torch

    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        yield saved


def activation_bytes(shape: ModelShape, tokens: int, gradient_checkpointing: bool) -> int:
    """Activations at the backward's peak: what the forward saved, and with gradient checkpointing the one layer
    whose activations the backward recomputes."""
    recomputed = tokens * layer_activation_bytes_per_token(shape) if gradient_checkpointing else 0
    return saved_activation_bytes(shape, tokens, gradient_checkpointing) + recomputed


def logits_chunk_bytes(shape: ModelShape, chunk_tokens: int = LOGPROB_CHUNK_TOKENS) -> int:
    """One chunk of response logits at its recomputation in the backward: in the model dtype, in float32, the softmax
    the entropy takes (float32), and the gradients of those two (float32)."""
    return chunk_tokens * shape.vocab_size * (shape.dtype_bytes + 16)


def zero3_buffer_bytes(shape: ModelShape, train: bool) -> int:
    """ZeRO-3's gathers and reductions: the largest parameter gathered whole, a prefetch bucket, and (training)
    one gradient reduce bucket, in the model dtype."""
    buffers = largest_tensor_bytes(shape) + ZERO3_PREFETCH_ELEMENTS * shape.dtype_bytes
    return buffers + (ZERO3_REDUCE_ELEMENTS * shape.dtype_bytes if train else 0)


def _value_model(shape: ModelShape) -> ModelShape:
    """A critic or reward model: the backbone with a scalar head, no lm_head."""
    return replace(shape, tie_word_embeddings=True)


def training_rank_bytes(shape: ModelShape, world_size: int, tokens: int, gradient_checkpointing: bool,
                        dense_mask: bool, lm_head: bool = True) -> dict[str, int]:
    """One rank of a trained ZeRO-3 group over ``world_size`` ranks in the backward of a ``tokens``-token
    micro-batch: its shards (:func:`zero3_shard_bytes`, :data:`RESIDENT`), the activations, one log-prob chunk's
    logits (``lm_head``; a critic has none), a packed row's dense mask as every layer keeps it (``dense_mask``:
    sdpa or eager on packed rows; flash attention takes none) and ZeRO-3's buffers."""
    if not lm_head:
        shape = _value_model(shape)
    return {
        **zero3_shard_bytes(shape, world_size),
        "activations": activation_bytes(shape, tokens, gradient_checkpointing),
        "logits": logits_chunk_bytes(shape) if lm_head else 0,
        "mask": dense_mask_bytes_before(shape, 1, tokens) if dense_mask else 0,
        "buffers": zero3_buffer_bytes(shape, train=True),
    }


def forward_rank_bytes(shape: ModelShape, world_size: int, tokens: int, offload: bool, dense_mask: bool,
                       lm_head: bool = True) -> dict[str, int]:
    """One rank of a forward-only ZeRO-3 group (reference, reward model) scoring a ``tokens``-token micro-batch: its
    parameter shard (none on the device with ``offload``), one layer's activations and mask at a time, one
    log-prob chunk's logits and the gather buffers."""
    if not lm_head:
        shape = _value_model(shape)
    params = 0 if offload else zero3_shard_bytes(shape, world_size)["params"]
    return {
        "params": params, "grads": 0, "optimizer": 0,
        "activations": tokens * layer_activation_bytes_per_token(shape),
        "logits": logits_chunk_bytes(shape) if lm_head else 0,
        "mask": dense_mask_bytes_per_layer(1, tokens, shape.dtype_bytes) if dense_mask else 0,
        "buffers": zero3_buffer_bytes(shape, train=False),
    }


# ---- shared-prompt blocks ------------------------------------------------------------------------------------------


def block_kv_heads(shape: ModelShape) -> int:
    """The key / value heads the shared-prompt blocks hand sdpa on CUDA: the model's own in 16 bits, which the flash
    kernel takes grouped (``rlhf_sg.packing._takes_grouped_heads``); in float32 (no flash kernel) the query heads,
    repeated."""
    return shape.num_kv_heads if shape.dtype_bytes == 2 else shape.num_heads


def shared_prompt_block_bytes(shape: ModelShape, prompt_len: int, group_size: int, response_len: int,
                              segments: int = 1, kv_heads: int | None = None) -> dict[str, int]:
    """What the shared-prompt blocks (``rlhf_sg.packing.SharedPromptBlocks``) keep for backward on one group: a prompt
    of ``prompt_len`` tokens and ``group_size`` responses of ``response_len``, in ``segments`` segments (1: the group
    whole, as on the blocks; ``group_size``: a segment a response, each with the prompt).

    ``layer``: what one layer's sdpa calls keep: for each segment's prompt (causal) and each response (over the keys
    of its prompt and itself), the gathered queries, keys and values and the output in the model dtype, and the
    float32 log-sum-exp; ``kv_heads`` key / value heads (:func:`block_kv_heads` by default). ``indices``: the int64
    slots they gather at (prompts, each response's queries and keys) and put back by, one storage for all layers.
    Without gradient checkpointing a micro-batch keeps ``layers x layer + indices``; with it one layer's at a time."""
    kv = kv_heads or block_kv_heads(shape)
    b, d = shape.dtype_bytes, shape.head_dim

    def call(queries: int, keys: int) -> int:  # one block of the batch sdpa is handed
        return queries * shape.num_heads * (2 * d * b + 4) + 2 * keys * kv * d * b

    layer = segments * call(prompt_len, prompt_len) + group_size * call(response_len, prompt_len + response_len)
    slots = segments * prompt_len + group_size * response_len
    indices = 8 * (segments * prompt_len + group_size * (2 * response_len + prompt_len) + slots)
    return {"layer": layer, "indices": indices}
