"""The embedded rollout engine: pure torch + transformers, on CPU or one GPU.

It is the default wherever no serving engine can run (a laptop, CI, a debugger), and it takes
weight updates through the same three transports as the serving engines, so the whole weight-sync
path is exercised without a GPU.

Generation is its own batched decode loop over a Hugging Face causal LM with a KV cache: prompts
are left-padded with matching ``position_ids`` and attention mask, each prompt is prefilled once and
its cache repeated for the ``n`` samples, every row stops on its own stop token, and finished rows
are dropped from the batch so the rest decode faster.

The KV cache: for models whose layers are all plain full attention run with ``sdpa`` (Llama, Qwen2 /
Qwen3, Mistral without sliding windows, ...), the engine runs the model with its own transformers
attention function (:func:`engine_attention`, registered as :data:`ENGINE_ATTENTION`) over
preallocated per-layer key / value buffers (:class:`KVBuffers`): each decode step writes one column
in place, and attention reads the grouped key / value heads as they are (no copy of the cache per
step, where transformers' ``DynamicCache`` concatenates and sdpa's masked path repeats the KV heads).
Any other model (sliding windows, linear attention, ``eager``) decodes through ``DynamicCache``.

Sampling and reproducibility: each completion row draws its random numbers from its own
``torch.Generator`` seeded from ``(seed, prompt index, sample index)``, where ``seed`` is
``SamplingParams.seed`` or, when that is ``None``, the next draw of an engine-wide stream seeded by
``BackendConfig.seed``. A row's draws therefore do not depend on the other prompts in the call,
on ``max_batch_size`` or on which rows finish first. Its *logits* can still differ in the last bits
when the padding width of its batch changes, which can flip a draw that lands on a probability
boundary; on the same prompts, params and weights, a call is reproducible exactly.

Memory: the KV cache of a decode batch takes ``rows x (prompt width + max_new_tokens) x
kv_bytes_per_token`` bytes (keys and values of every layer, and one mask column), allocated when the batch starts
and never grown. Its byte budget is fixed when the engine starts: ``BackendConfig.memory_fraction``
(``--rollout.memory_fraction``) of the device, less the weights, on CUDA (default 0.9 of
``torch.cuda.mem_get_info``'s total: like SGLang's ``mem_fraction_static`` the share covers weights and KV cache,
and activations come from the rest); on CPU that share (default 0.5) of the host memory available when the engine
starts (``MemAvailable``); or ``extra["kv_cache_bytes"]``. A ``generate`` call decodes as many rows at once as fit
the budget and the rest in later waves (the samples of one prompt split across waves if need be: each row's
draws do not depend on its batch); an engine whose budget cannot hold one row of ``max_model_len`` tokens
refuses to start. Models that decode through ``DynamicCache`` are cut into the same waves, but that cache grows
by concatenation, so only the buffers are held to the budget byte for byte.

Vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): ``generate(..., images=)`` takes each prompt's
processor output (:class:`rlhf_sg.vision.ImageInputs`) beside its expanded ids. The vision tower runs once per
prompt in its prefill (the ``n`` samples share the cache), the prefill's M-RoPE positions are each prompt's own
(the model's ``get_rope_index``), decoding continues from the prompt's largest position + 1, and the placeholder
tokens (image / video pad, vision start / end) are never sampled (a truncation, like top-k: the log-prob reported
is the untruncated one, as the trainer computes it).

Engine-specific keys in ``BackendConfig.extra``:

* ``max_batch_size`` (int, default 256): completion rows decoded together, at most;
* ``kv_cache_bytes`` (int): the KV cache's byte budget, in place of the one ``memory_fraction`` gives (below);
* ``attn_implementation`` (str, default transformers' choice): e.g. ``"sdpa"`` or ``"eager"``.
"""

from __future__ import annotations

import contextlib
import datetime
import glob
import logging
import math
import os
import random
import threading
from collections.abc import Iterable

import torch

from backends.base import (
    MEMORY_WEIGHTS,
    BackendConfig,
    BackendError,
    BucketManifest,
    Completion,
    RolloutBackend,
    SamplingParams,
    WeightGroupSpec,
    check_generate_args,
    memory_tags,
    wait_work,
)
from backends.checkpoint_names import checkpoint_views, saved_as

__all__ = ["ENGINE_ATTENTION", "EmbeddedBackend", "KVBuffers", "engine_attention", "open_weight_update_group",
           "sample_next_tokens"]

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_EXTRA_KEYS = {"max_batch_size", "attn_implementation", "kv_cache_bytes"}
#: a vision-language config's placeholder token ids, which the engine never samples
_PLACEHOLDER_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """One SplitMix64 step: a well-spread 64-bit hash, the same in every process."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The generator seed of one completion row; depends on nothing else in the call."""
    return _mix64(_mix64(_mix64(seed & _MASK64) ^ prompt_index) ^ sample_index)


def sample_next_tokens(
    logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_k: int, top_p: float,
    banned: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row by inverse-CDF lookup of a given uniform draw.

    logits: [B, V] (any float dtype); uniforms: [B] float32 in [0, 1).
    Returns tokens [B] int64 and logp [B] float32, where logp is the log-prob of the token under
    ``softmax(logits / temperature)`` *before* top-k / top-p truncation (the interface's
    convention). ``temperature == 0`` is greedy and its log-prob uses temperature 1.
    Top-k keeps the k most likely tokens; top-p then keeps the smallest prefix of those, by
    descending probability, whose renormalised mass reaches ``top_p``.
    ``banned`` [K] long: token ids never sampled (a vision-language model's image placeholders); like top-k / top-p
    a truncation of the sampling distribution, so the log-prob stays the untruncated one.
    """
    logits = logits.float()
    if temperature == 0:
        logp_all = torch.log_softmax(logits, dim=-1)
        tokens = (logits if banned is None else logits.index_fill(-1, banned, -math.inf)).argmax(dim=-1)
        return tokens, logp_all.gather(1, tokens[:, None]).squeeze(1)

    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    if banned is None:
        probs = logp_all.exp()
    else:  # renormalised in log space: the allowed tokens keep their odds even where the banned take all the mass
        probs = torch.softmax(logits.index_fill(-1, banned, -math.inf) / temperature, dim=-1)
    vocab = probs.shape[-1]
    if 0 < top_k < vocab or top_p < 1.0:
        if 0 < top_k < vocab:
            cand_probs, cand_ids = probs.topk(top_k, dim=-1)  # sorted, descending
        else:
            cand_probs, cand_ids = probs.sort(dim=-1, descending=True)
        if top_p < 1.0:
            mass = cand_probs.cumsum(dim=-1) / cand_probs.sum(dim=-1, keepdim=True)
            prior_mass = mass - cand_probs / cand_probs.sum(dim=-1, keepdim=True)
            cand_probs = cand_probs.masked_fill(prior_mass >= top_p, 0.0)
    else:
        cand_probs, cand_ids = probs, None
    cdf = cand_probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # Keep the target strictly below the total so the lookup lands on a token of positive mass.
    target = torch.minimum(uniforms[:, None].to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    pick = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1)
    tokens = pick.squeeze(1) if cand_ids is None else cand_ids.gather(1, pick).squeeze(1)
    return tokens, logp_all.gather(1, tokens[:, None]).squeeze(1)


#: the transformers attention implementation the engine runs eligible models with (:func:`engine_attention`)
ENGINE_ATTENTION = "rlhf_sg_engine"
#: attention keyword arguments that change the computation; a decode step given any of them (not None) takes
#: transformers' sdpa path over the buffers instead of :func:`decode_attention`
_SPECIAL_ATTENTION_KWARGS = ("softcap", "sliding_window", "s_aux", "sinks", "position_bias")


class KVBuffers:
    """The KV cache of one decode batch: per layer, keys and values ``[rows, kv_heads, capacity, head_dim]``
    allocated on the layer's first write and written in place, and an additive mask bias ``[rows, capacity]``
    (the smallest float on left padding, 0 elsewhere).

    Prefill (``prefill = (rows, column, n)``): a group of prompts runs through the model and its keys are
    written, each repeated ``n`` times (one row per sample), at ``column`` onwards of the row slice ``rows``.
    Decode: ``length`` columns are filled; a step writes column ``length`` of every row and attends over
    ``[0, length]``; the caller advances ``length`` after the step (:meth:`advance`).

    ``capacity`` is fixed when the batch starts (the prompts' width plus the tokens to generate) and
    :meth:`select` compacts the rows in place, so the buffers never grow or get copied whole: their storage is
    ``rows * capacity * kv_bytes_per_token`` bytes from the first write to the last. With ``budget_bytes`` an
    allocation that would take the storage past it raises ValueError instead.
    """

    def __init__(self, pad_mask: torch.Tensor, num_layers: int, capacity: int, dtype: torch.dtype,
                 n: int = 1, budget_bytes: int | None = None):
        """pad_mask: [prompts, width] 1 on the prompts' tokens (left-padded); every row is repeated ``n``
        times (prompt-major), so there are ``prompts * n`` rows."""
        rows, width = pad_mask.shape[0] * n, pad_mask.shape[1]
        if capacity < width:
            raise ValueError(f"KVBuffers: capacity {capacity} < the prompts' width {width}")
        self.capacity = capacity
        self.budget_bytes = budget_bytes
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.bias = torch.zeros((rows, self.capacity), dtype=dtype, device=pad_mask.device)
        self._check_budget(0)
        self.bias[:, :width].masked_fill_(pad_mask.repeat_interleave(n, dim=0) == 0, torch.finfo(dtype).min)
        self.length = width
        self.prefill: tuple[slice, int, int] | None = None

    @property
    def rows(self) -> int:
        return self.bias.shape[0]

    def storage_bytes(self) -> int:
        """Bytes of device memory the buffers hold (their storages, whatever rows are still live)."""
        tensors = [self.bias, *(t for t in self.keys + self.values if t is not None)]
        return sum(t.untyped_storage().nbytes() for t in tensors)

    def _check_budget(self, adding: int) -> None:
        if self.budget_bytes is not None and self.storage_bytes() + adding > self.budget_bytes:
            raise ValueError(
                f"KVBuffers: {self.rows} rows x {self.capacity} columns take {self.storage_bytes() + adding} bytes "
                f"or more, past the budget of {self.budget_bytes} bytes"
            )

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a layer's new keys / values ([batch, kv_heads, q_len, head_dim]); returns what its attention
        reads: during prefill the group's own, during decode the layer's columns ``[0, length]``."""
        if self.keys[layer] is None:
            shape = (self.rows, key.shape[1], self.capacity, key.shape[3])
            value_shape = (*shape[:3], value.shape[3])
            self._check_budget(key.element_size() * math.prod(shape) + value.element_size() * math.prod(value_shape))
            self.keys[layer] = key.new_zeros(shape)  # zeros, not empty: masked columns must stay finite
            self.values[layer] = value.new_zeros(value_shape)
        if self.prefill is not None:
            rows, column, n = self.prefill
            end = column + key.shape[2]
            self.keys[layer][rows, :, column:end] = key.repeat_interleave(n, dim=0)
            self.values[layer][rows, :, column:end] = value.repeat_interleave(n, dim=0)
            return key, value
        if key.shape[2] != 1:
            raise ValueError(f"KVBuffers: a decode step writes one column, got {key.shape[2]}")
        self.keys[layer][:, :, self.length] = key[:, :, 0]
        self.values[layer][:, :, self.length] = value[:, :, 0]
        return self.keys[layer][:, :, : self.length + 1], self.values[layer][:, :, : self.length + 1]

    def step_mask(self) -> torch.Tensor:
        """The additive 4-D mask of the next decode step, ``[rows, 1, 1, length + 1]``."""
        if self.length >= self.capacity:
            raise ValueError(f"KVBuffers: column {self.length} is past the capacity {self.capacity}")
        return self.bias[:, None, None, : self.length + 1]

    def advance(self) -> None:
        self.length += 1

    def select(self, keep: torch.Tensor) -> None:
        """Keep only the rows ``keep`` (indices into the current rows), moved to the front of the same storage;
        a layer at a time, so the only extra memory is one layer's kept rows."""
        count = keep.shape[0]
        self.bias[:count] = self.bias.index_select(0, keep)
        self.bias = self.bias[:count]
        for cache in (self.keys, self.values):
            for i, t in enumerate(cache):
                if t is not None:
                    t[:count] = t.index_select(0, keep)
                    cache[i] = t[:count]


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor | None,
                     scaling: float | None) -> tuple[torch.Tensor, None]:
    """One decode step's attention over grouped KV heads, without repeating them.

    query [B, H, 1, D]; key / value [B, H_kv, L, D] with H a multiple of H_kv (query head h reads KV head
    h // (H / H_kv), as transformers' ``repeat_kv`` pairs them); bias: an additive mask broadcastable to
    [B, 1, 1, L], or a boolean one (True = attend). Scores and softmax in float32. Returns
    ([B, 1, H, D], None), the layout transformers' attention functions return.
    """
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    scale = dim**-0.5 if scaling is None else scaling
    q = query.reshape(batch, kv_heads, heads // kv_heads, dim) * scale
    scores = torch.matmul(q, key.transpose(-1, -2)).float()  # [B, H_kv, group, L]
    if bias is not None:
        scores = scores.masked_fill(~bias, float("-inf")) if bias.dtype == torch.bool else scores + bias.float()
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [B, H_kv, group, D]
    return out.reshape(batch, 1, heads, value.shape[-1]), None


def engine_attention(module, query, key, value, attention_mask, kv_buffers: KVBuffers | None = None, **kwargs):
    """The engine's transformers attention function (``AttentionInterface``, name :data:`ENGINE_ATTENTION`).

    With ``kv_buffers`` (passed through the model's forward as a keyword), the layer's new keys / values go
    into the buffers; a plain decode step (one query token, no softcap / window / sinks / bias, no dropout)
    then runs :func:`decode_attention` over the layer's buffered columns. Everything else, and any call
    without buffers, is transformers' own sdpa attention.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kv_buffers is not None:
        key, value = kv_buffers.write(module.layer_idx, key, value)
        plain = not kwargs.get("dropout") and all(kwargs.get(k) is None for k in _SPECIAL_ATTENTION_KWARGS)
        if kv_buffers.prefill is None and plain and query.shape[1] % key.shape[1] == 0:
            return decode_attention(query, key, value, attention_mask, kwargs.get("scaling"))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register_engine_attention() -> None:
    """Register :func:`engine_attention` under :data:`ENGINE_ATTENTION`, with sdpa's mask builder (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ENGINE_ATTENTION, engine_attention)
    AttentionMaskInterface.register(ENGINE_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def open_weight_update_group(spec: WeightGroupSpec, rank: int) -> torch.distributed.ProcessGroup:
    """Join (rank > 0) or host (rank 0, the TCP store master) a weight-update side group.

    The group is built straight on a ``TCPStore`` at ``spec.master_address:spec.master_port``
    and never touches the default process group, so trainer and engines can each have their own.
    The trainer's sender calls this with ``rank=0``; every rank must call it concurrently.
    Returns the backend group object (``ProcessGroupGloo`` or ``ProcessGroupNCCL``).
    """
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=spec.timeout_s)
    where = (
        f"weight-update group {spec.group_name!r} ({spec.backend}) at "
        f"{spec.master_address}:{spec.master_port} as rank {rank} of {spec.world_size}"
    )
    if spec.backend not in ("gloo", "nccl"):
        raise BackendError(f"{where}: backend must be 'gloo' or 'nccl', got {spec.backend!r}")
    try:
        store = dist.TCPStore(
            spec.master_address, spec.master_port, spec.world_size, is_master=rank == 0, timeout=timeout
        )
        if spec.backend == "gloo":
            return dist.ProcessGroupGloo(store, rank, spec.world_size, timeout)
        if not hasattr(dist, "ProcessGroupNCCL"):
            raise BackendError(f"{where}: this torch build has no NCCL; use backend='gloo'")
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, spec.world_size, options)
    except BackendError:
        raise
    except Exception as exc:  # store connect / rendezvous failures come as several types
        raise BackendError(
            f"joining {where} failed within timeout_s={spec.timeout_s}: {type(exc).__name__}: {exc}. "
            "Is the trainer's sender (rank 0, the store master) started, and the port reachable?"
        ) from exc


class EmbeddedBackend(RolloutBackend):
    """A Hugging Face causal LM decoded in-process with a KV cache (see the module docstring)."""

    name = "hf"
    transports = frozenset({"collective", "tensor", "disk"})
    supports_abort = True
    supports_lora_adapter = True
    supports_routed_experts = True  # for a mixture-of-experts model (others refuse the request at generate)
    supports_images = True  # for a vision-language model (a text model refuses them at generate)

    def __init__(self, config: BackendConfig):
        super().__init__(config)
        unknown = sorted(set(config.extra) - _EXTRA_KEYS)
        if unknown:
            raise BackendError(
                f"BackendConfig.extra has key(s) {unknown} the embedded backend does not know; "
                f"known: {sorted(_EXTRA_KEYS)}"
            )
        if config.dtype not in _DTYPES:
            raise BackendError(f"BackendConfig.dtype must be one of {sorted(_DTYPES)}, got {config.dtype!r}")
        self._max_batch_size = int(config.extra.get("max_batch_size", 256))
        if self._max_batch_size < 1:
            raise BackendError(f"BackendConfig.extra['max_batch_size'] must be >= 1, got {self._max_batch_size}")
        self._device = torch.device(config.device)
        if self._device.type == "cuda" and not torch.cuda.is_available():
            raise BackendError(
                f"BackendConfig.device={config.device!r} but torch sees no CUDA device; use device='cpu'"
            )
        if self._device.type not in ("cpu", "cuda"):
            raise BackendError(f"BackendConfig.device must be 'cpu' or 'cuda[:i]', got {config.device!r}")
        if self._device.type == "cuda" and self._device.index is None:
            # torch.cuda.set_device refuses an index-less device; the current one is the process's own
            # (0 inside a one-GPU Ray actor)
            self._device = torch.device("cuda", torch.cuda.current_device())
        if not os.path.isdir(config.model_path):
            raise BackendError(f"BackendConfig.model_path {config.model_path!r} is not a directory")
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)

        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, DynamicCache
        from transformers.cache_utils import DynamicLayer

        load_kw = {}
        if "attn_implementation" in config.extra:
            load_kw["attn_implementation"] = config.extra["attn_implementation"]
        #: a vision-language model: generate takes each prompt's images (rlhf_sg.vision.ImageInputs)
        self.vision = getattr(AutoConfig.from_pretrained(config.model_path), "vision_config", None) is not None
        auto = AutoModelForImageTextToText if self.vision else AutoModelForCausalLM
        self.model = auto.from_pretrained(config.model_path, dtype=_DTYPES[config.dtype], **load_kw).to(self._device)
        self.model.eval().requires_grad_(False)
        self._checkpoint_renames = saved_as(self.model,
                                            [(n, p.shape, p.dtype) for n, p in self.model.named_parameters()])
        model_config = self.model.config
        text_config = model_config.get_text_config()
        self._vocab_size = int(text_config.vocab_size)
        self._pad_id = text_config.pad_token_id if text_config.pad_token_id is not None else 0
        self._eos_ids = _as_id_set(getattr(self.model.generation_config, "eos_token_id", None))
        self._eos_ids |= _as_id_set(text_config.eos_token_id)
        #: placeholder ids never sampled (image / video pads, vision start / end), None for a text model
        placeholders = sorted({getattr(model_config, key, None) for key in _PLACEHOLDER_KEYS} - {None})
        self._banned = torch.tensor(placeholders, device=self._device) if placeholders else None
        model_len = getattr(text_config, "max_position_embeddings", None)
        self._context_len = min(config.max_model_len, model_len) if model_len else config.max_model_len
        self._context_note = (
            f"BackendConfig.max_model_len={config.max_model_len}, model max_position_embeddings={model_len}"
        )
        self._mergeable_cache = all(type(layer) is DynamicLayer for layer in DynamicCache(config=model_config).layers)
        self._num_layers = int(model_config.get_text_config().num_hidden_layers)
        self._probe_kv_bytes_per_token: int | None = None  # measured by _use_engine_attention's probe
        #: decode over KVBuffers with engine_attention (else through DynamicCache)
        self.kv_buffers = (
            self._mergeable_cache and model_config._attn_implementation == "sdpa" and self._use_engine_attention()
        )
        self._kv_bytes_per_token = ((self._probe_kv_bytes_per_token if self.kv_buffers else None)
                                    or self._configured_kv_bytes_per_token())
        self.kv_budget_bytes, self._kv_budget_note, knob = self._kv_budget()
        longest = self._context_len * self._kv_bytes_per_token
        if longest > self.kv_budget_bytes:
            raise BackendError(
                f"the embedded engine's KV cache budget is {self.kv_budget_bytes} bytes ({self._kv_budget_note}); "
                f"one completion row of {self._context_len} tokens ({self._context_note}) needs {longest} bytes "
                f"({self._kv_bytes_per_token} bytes a token). Raise {knob}, or lower --rollout.max_model_len"
            )
        self._unseeded = random.Random(config.seed)
        self._group = None
        self._group_spec: WeightGroupSpec | None = None
        self._asleep = False  # some memory tag is released (generate refused)
        self._released: set[str] = set()  # memory tags released by sleep, not yet woken
        self._closed = False
        self._abort = threading.Event()  # set by abort_generation while a generate runs
        self._abort_lock = threading.Lock()
        self._generating = False
        self.decode_steps = 0  # decode steps the running (or last) generate has taken: its progress
        self._lora_hooks: list = []  # forward hooks serving the loaded LoRA adapter

    # ---- rollout -------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams, images: list | None = None
                 ) -> list[Completion]:
        """Sample ``params.n`` completions per prompt; prompt-major, ``len(prompts) * n`` of them.

        ``images``: for a vision-language model, each prompt's :class:`rlhf_sg.vision.ImageInputs` (None for a text
        prompt), the processor's output whose expanded image tokens the prompt holds. The vision tower runs once
        per prompt, each prompt's M-RoPE positions are its own, and decoding continues them."""
        self._check_usable("generate")
        check_generate_args(prompts, params, self._vocab_size, self._context_len, self._context_note,
                            routed_experts=True)
        self._check_images(prompts, images)
        if params.return_routed_experts and self._route_recorder() is None:
            raise BackendError(f"generate: SamplingParams.return_routed_experts, but the model "
                               f"({type(self.model).__name__}) has no mixture-of-experts router")
        seed = params.seed if params.seed is not None else self._unseeded.getrandbits(63)
        stop_ids = self._eos_ids | set(params.stop_token_ids)
        # Similar lengths share a batch, so little compute goes to padding.
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        waves = plan_waves([len(prompts[i]) for i in order], params.n, params.max_new_tokens, self._max_batch_size,
                           self.kv_budget_bytes, self._kv_bytes_per_token)
        results: dict[int, list[Completion]] = {i: [] for i in order}
        with self._abort_lock:
            self._abort.clear()
            self._generating = True
            self.decode_steps = 0
        try:
            for positions, samples in waves:
                chunk = [order[p] for p in positions]
                if self._abort.is_set():  # aborted: the waves not started yet get no tokens
                    for i in chunk:
                        results[i] += [Completion([], [], "abort", self._weight_version, i) for _ in samples]
                    continue
                for i, completions in zip(chunk, self._decode(prompts, chunk, samples, params, seed, stop_ids,
                                                              images)):
                    results[i] += completions
        finally:
            with self._abort_lock:
                self._generating = False
                self._abort.clear()
                self.decode_steps = 0
        return [c for i in range(len(prompts)) for c in results[i]]

    def _check_images(self, prompts: list[list[int]], images: list | None) -> None:
        """Images only for a vision-language model, one entry per prompt, each prompt's image tokens those its
        images' grids make (t·h·w / merge² per image)."""
        if images is None:
            return
        if not self.vision:
            raise BackendError(f"generate: images given, but the model ({type(self.model).__name__}) is text-only")
        if len(images) != len(prompts):
            raise BackendError(f"generate: {len(images)} image entries for {len(prompts)} prompts; give one (or None) "
                               "per prompt")
        from rlhf_sg.vision import image_token_counts

        config = self.model.config
        for i, (prompt, inputs) in enumerate(zip(prompts, images)):
            have = prompt.count(config.image_token_id)
            want = 0 if inputs is None else sum(image_token_counts(config, inputs))
            if have != want:
                raise BackendError(f"generate: prompt {i} holds {have} image tokens but the model makes {want} "
                                   "features of its images; pass the processor's expanded ids with its images")

    def abort_generation(self) -> None:
        """Stop the running ``generate`` before its next token (from another thread); a no-op when none runs."""
        with self._abort_lock:
            if self._generating:
                self._abort.set()

    def _configured_kv_bytes_per_token(self) -> int:
        """Keys and values of every layer and one mask column, from the model config (for the DynamicCache path,
        which the probe does not measure)."""
        text = self.model.config.get_text_config()
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        element = self.model.dtype.itemsize
        return (self._num_layers * 2 * kv_heads * head_dim + 1) * element

    def _kv_budget(self) -> tuple[int, str, str]:
        """The KV cache's byte budget, where it comes from, and the setting that raises it (module docstring)."""
        explicit = self.config.extra.get("kv_cache_bytes")
        if explicit is not None:
            if int(explicit) < 1:
                raise BackendError(f"BackendConfig.extra['kv_cache_bytes'] must be >= 1, got {explicit}")
            return int(explicit), "BackendConfig.extra['kv_cache_bytes']", "--rollout.engine_kwargs kv_cache_bytes"
        fraction = self.config.memory_fraction
        if self._device.type == "cuda":
            fraction = 0.9 if fraction is None else fraction
            _, total = torch.cuda.mem_get_info(self._device)
            weights = sum(t.nbytes for t in (*self.model.parameters(), *self.model.buffers()))
            return int(fraction * total) - weights, (
                f"--rollout.memory_fraction {fraction} of {total} bytes on {self._device}, less {weights} bytes "
                "of weights"), "--rollout.memory_fraction"
        fraction = 0.5 if fraction is None else fraction
        available = _host_available_bytes()
        return int(fraction * available), (
            f"--rollout.memory_fraction {fraction} of the {available} bytes of host memory available at start"
        ), "--rollout.memory_fraction"

    def _use_engine_attention(self) -> bool:
        """Switch the model to :func:`engine_attention` if every layer routes its attention through it (one
        probe forward: a prompt prefilled into buffers, one decode step); otherwise keep sdpa and say why."""
        ids = torch.tensor([[i % self._vocab_size for i in (1, 2, 3)]], device=self._device)
        self._probe_kv_bytes_per_token = None
        reason = None
        try:  # an older transformers without these interfaces, or a model whose attention takes another route
            _register_engine_attention()
            self.model.set_attn_implementation(ENGINE_ATTENTION)
            with torch.inference_mode():
                buffers = KVBuffers(torch.ones((1, 2), device=self._device), self._num_layers, 3, self.model.dtype)
                buffers.prefill = (slice(0, 1), 0, 1)
                self.model(input_ids=ids[:, :2], position_ids=torch.arange(2, device=self._device)[None],
                           use_cache=False, logits_to_keep=1, kv_buffers=buffers)
                buffers.prefill = None
                bypass = sum(k is None for k in buffers.keys)
                if bypass:
                    reason = f"{bypass} of {self._num_layers} layers bypass the attention interface"
                else:
                    logits = self.model(input_ids=ids[:, 2:], attention_mask=buffers.step_mask(),
                                        position_ids=torch.tensor([[2]], device=self._device), use_cache=False,
                                        kv_buffers=buffers).logits
                    if not torch.isfinite(logits).all():
                        reason = "the probe's logits are not finite"
                    # the probe's one row of 3 columns: its bytes a column, as the buffers allocate them
                    self._probe_kv_bytes_per_token = buffers.storage_bytes() // 3
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
        if reason is None:
            return True
        if self.model.config._attn_implementation != "sdpa":
            self.model.set_attn_implementation("sdpa")
        log.warning("embedded engine: %s decodes through transformers' DynamicCache (%s)",
                    type(self.model).__name__, reason)
        return False

    def _start_decode(self, prompts: list[list[int]], n: int, max_new: int,
                      prompt_routes: list | None = None, images: list | None = None
                      ) -> tuple[_DecodeState, torch.Tensor]:
        """Prefill the prompts (sorted by length), each for ``n`` sample rows; returns the decode state and the
        logits of every row's next token [len(prompts) * n, V]. ``prompt_routes``: a list to append each prompt's
        routes to (``[len(prompt), moe_layers, top_k]``), while the route recorder records.

        Prompts of similar length are prefilled together and left-padded into one cache, so little prefill
        compute goes to padding; models whose cache layers are not plain dynamic layers (sliding windows,
        linear attention) are prefilled as one padded batch. ``images``: each prompt's ImageInputs (or None) for a
        vision-language model (:meth:`_vision_prefill`).
        """
        groups = _length_groups([len(p) for p in prompts]) if self._mergeable_cache else [range(len(prompts))]
        width = len(prompts[-1])
        _, pad_mask = self._left_pad(prompts, width)
        buffers = (KVBuffers(pad_mask, self._num_layers, width + max_new, self.model.dtype, n=n,
                             budget_bytes=self.kv_budget_bytes) if self.kv_buffers else None)
        caches, logits = [], []
        next_position = pad_mask.sum(-1)
        for group in groups:
            group_prompts = [prompts[i] for i in group]
            input_ids, attention_mask = self._left_pad(group_prompts, len(group_prompts[-1]))
            extra = {}
            if buffers is not None:
                buffers.prefill = (slice(group.start * n, group.stop * n), width - input_ids.shape[1], n)
                extra["kv_buffers"] = buffers
            position_ids = (attention_mask.cumsum(-1) - 1).clamp_(min=0)
            if images is not None:
                position_ids, extra["mm_encoder_outputs"] = self._vision_prefill(
                    input_ids, attention_mask, [images[i] for i in group])
                next_position[group.start:group.stop] = position_ids.reshape(-1, *input_ids.shape).amax(dim=(0, 2)) + 1
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=buffers is None,
                logits_to_keep=1,
                **extra,
            )
            caches.append(out.past_key_values)
            logits.append(out.logits[:, -1, :])
            if prompt_routes is not None:
                (routes,) = self._recorder.take()
                routes = routes.reshape(len(group_prompts), input_ids.shape[1], *routes.shape[1:])
                prompt_routes += [routes[r, input_ids.shape[1] - len(p):] for r, p in enumerate(group_prompts)]
        logits = torch.cat(logits).repeat_interleave(n, dim=0)
        next_position = next_position.repeat_interleave(n, dim=0)
        if buffers is not None:
            buffers.prefill = None
            return _BufferedDecode(self.model, buffers, next_position), logits
        if len(caches) == 1:
            cache = caches[0]
        else:
            from transformers import DynamicCache

            layers = []
            for layer_idx in range(len(caches[0].layers)):
                keys = [c.layers[layer_idx].keys for c in caches]
                values = [c.layers[layer_idx].values for c in caches]
                pad = lambda t: torch.nn.functional.pad(t, (0, 0, width - t.shape[-2], 0))  # left, on seq dim
                layers.append((torch.cat([pad(k) for k in keys]), torch.cat([pad(v) for v in values])))
            cache = DynamicCache(layers)
        if n > 1:  # one prefill per prompt, its cache shared by the n samples
            _select_cache_rows(cache, torch.arange(len(prompts), device=self._device).repeat_interleave(n))
        return _CachedDecode(self.model, cache, pad_mask.repeat_interleave(n, dim=0), next_position), logits

    def _vision_prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, images: list):
        """A left-padded prefill group's ``position_ids``: M-RoPE [3, B, L] (each prompt's own, from the model's
        ``get_rope_index``; 0 on padding), or [B, L] for a model with 1-D positions (LLaVA); and its image encoder
        outputs, the vision tower run once per prompt."""
        from rlhf_sg.vision import image_features, sequence_positions, uses_mrope

        features = image_features(self.model, images, list(range(len(images))))
        if not uses_mrope(self.model):  # 1-D positions (LLaVA), as for text
            return (attention_mask.cumsum(-1) - 1).clamp_(min=0), None if features is None else {"image": features}
        position_ids = torch.zeros((3, *input_ids.shape), dtype=torch.long, device=self._device)
        for r in range(input_ids.shape[0]):
            real = attention_mask[r].bool()
            position_ids[:, r, real] = sequence_positions(self.model, input_ids[r, real], images[r])
        return position_ids, None if features is None else {"image": features}

    def _route_recorder(self):
        """The :class:`rlhf_sg.moe.RouteRecorder` of this model (made once), or None for a model without routers."""
        if not hasattr(self, "_recorder"):
            from rlhf_sg.moe import RouteRecorder, has_router

            self._recorder = RouteRecorder(self.model) if has_router(self.model) else None
        return self._recorder

    def _left_pad(self, prompts: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids and attention_mask, both [len(prompts), width] int64 on the engine's device."""
        input_ids = torch.full((len(prompts), width), self._pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, prompt in enumerate(prompts):
            input_ids[r, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[r, width - len(prompt) :] = 1
        return input_ids.to(self._device), attention_mask.to(self._device)

    @torch.inference_mode()
    def _decode(
        self, prompts: list[list[int]], chunk: list[int], samples: range, params: SamplingParams, seed: int,
        stop_ids: set[int], images: list | None = None,
    ) -> list[list[Completion]]:
        """Decode the rows ``samples`` (sample indices) of each prompt index in ``chunk``; one list per prompt."""
        recording = params.return_routed_experts
        with self._recorder.recording() if recording else contextlib.nullcontext():
            return self._decode_rows(prompts, chunk, samples, params, seed, stop_ids, recording, images)

    def _decode_rows(self, prompts, chunk, samples, params, seed, stop_ids, recording: bool,
                     images: list | None = None) -> list[list[Completion]]:
        device, n, max_new = self._device, len(samples), params.max_new_tokens
        prompt_routes: list | None = [] if recording else None
        state, logits = self._start_decode([prompts[i] for i in chunk], n, max_new, prompt_routes,
                                           None if images is None else [images[i] for i in chunk])

        num_rows = len(chunk) * n
        decode_routes = None  # [num_rows, max_new, moe_layers, top_k]: the routes of each fed sampled token
        if recording:  # on the engine's device, copied to the host once at the end
            decode_routes = torch.full((num_rows, max_new, *prompt_routes[0].shape[1:]), -1,
                                       dtype=prompt_routes[0].dtype, device=device)
        uniforms = torch.stack(
            [
                torch.rand(max_new, generator=torch.Generator().manual_seed(row_seed(seed, i, j)))
                for i in chunk
                for j in samples
            ]
        ).to(device)  # [num_rows, max_new]
        stop_tensor = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
        tokens = torch.zeros((num_rows, max_new), dtype=torch.long, device=device)
        logps = torch.zeros((num_rows, max_new), dtype=torch.float32, device=device)
        lengths = torch.full((num_rows,), max_new, dtype=torch.long, device=device)
        stopped = torch.zeros(num_rows, dtype=torch.bool, device=device)
        aborted = torch.zeros(num_rows, dtype=torch.bool, device=device)
        rows = torch.arange(num_rows, device=device)  # original row of each live batch position
        done = torch.zeros(num_rows, dtype=torch.bool, device=device)
        for step in range(max_new):
            if self._abort.is_set():  # abort_generation: the rows still running keep their tokens so far
                lengths[rows[~done]] = step
                aborted[rows[~done]] = True
                break
            token, logp = sample_next_tokens(
                logits, uniforms[rows, step], params.temperature, params.top_k, params.top_p, self._banned
            )
            self.decode_steps += 1
            # Rows already done also write here; everything past a row's length is ignored.
            tokens[rows, step] = token
            logps[rows, step] = logp
            hit = torch.isin(token, stop_tensor) & ~done
            lengths[rows[hit]] = step + 1
            stopped[rows[hit]] = True
            done |= hit
            num_done = int(done.sum())
            if num_done == len(rows) or step == max_new - 1:
                break
            if num_done >= max(1, len(rows) // 4):  # compact: finished rows stop costing compute
                keep = (~done).nonzero().squeeze(1)
                state.select(keep)
                rows, done, token = rows[keep], done[keep], token[keep]
            logits = state.step(token)
            if recording:
                (routes,) = self._recorder.take()
                decode_routes[rows, step] = routes

        tokens_l, logps_l = tokens.tolist(), logps.tolist()
        if recording:
            decode_routes, prompt_routes = decode_routes.cpu(), [r.cpu() for r in prompt_routes]
        lengths_l, stopped_l, aborted_l = lengths.tolist(), stopped.tolist(), aborted.tolist()
        version = self._weight_version
        completions: list[list[Completion]] = []
        for r, i in enumerate(chunk):
            per_prompt = []
            for row in range(r * n, (r + 1) * n):
                length = lengths_l[row]
                routed = None
                if recording:
                    fed = len(prompts[i]) + length - 1  # every token but the last went through the model
                    routed = torch.cat([prompt_routes[r], decode_routes[row, : max(length - 1, 0)]])[:fed]
                per_prompt.append(
                    Completion(
                        token_ids=tokens_l[row][:length],
                        logprobs=logps_l[row][:length],
                        finish_reason="stop" if stopped_l[row] else "abort" if aborted_l[row] else "length",
                        weight_version=version,
                        prompt_index=i,
                        routed_experts=routed,
                    )
                )
            completions.append(per_prompt)
        return completions

    # ---- weights -------------------------------------------------------------------------
    def _named_params(self) -> dict[str, torch.Tensor]:
        """Every tensor of the model's checkpoint by its checkpoint name, as a view of the parameter data that
        holds it (a fused mixture-of-experts parameter answers to its per-expert names; tied weights to every
        name they are saved under)."""
        return checkpoint_views(self.model, self._checkpoint_renames)

    def _check_names_and_shapes(self, specs: Iterable[tuple[str, tuple[int, ...]]], source: str) -> None:
        params = self._named_params()
        for name, shape in specs:
            if name not in params:
                close = [p for p in params if p.rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1]][:3]
                raise BackendError(
                    f"{source}: tensor {name!r} is not a parameter of this model "
                    f"({type(self.model).__name__}; e.g. {close or list(params)[:3]}); nothing was loaded"
                )
            if tuple(params[name].shape) != tuple(shape):
                raise BackendError(
                    f"{source}: tensor {name!r} has shape {tuple(shape)}, the model's parameter is "
                    f"{tuple(params[name].shape)}; nothing was loaded"
                )

    def _validate_manifest(self, manifest: BucketManifest, source: str) -> None:
        for spec in manifest.tensors:
            if spec.offset < 0 or spec.offset + spec.numel > manifest.numel:
                raise BackendError(
                    f"{source}: tensor {spec.name!r} spans elements [{spec.offset}, {spec.offset + spec.numel}) "
                    f"outside the bucket of {manifest.numel}; nothing was loaded"
                )
        self._check_names_and_shapes(((t.name, t.shape) for t in manifest.tensors), source)

    @torch.no_grad()
    def _load(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = self._named_params()
        for name, value in named:
            params[name].copy_(value)

    def init_weight_update_group(self, spec: WeightGroupSpec) -> None:
        """Join the trainer's side group as rank ``spec.rank_offset`` (this engine is one process)."""
        self._check_usable("init_weight_update_group")
        if self._group is not None:
            raise BackendError(
                f"already in weight-update group {self._group_spec.group_name!r}; "
                "call destroy_weight_update_group() first"
            )
        if not 1 <= spec.rank_offset < spec.world_size:
            raise BackendError(
                f"WeightGroupSpec.rank_offset={spec.rank_offset} must be in [1, world_size={spec.world_size}): "
                "rank 0 is the trainer's sender"
            )
        if spec.backend == "nccl" and self._device.type != "cuda":
            raise BackendError("WeightGroupSpec.backend='nccl' needs an engine on device='cuda'; use 'gloo' on CPU")
        if spec.backend == "nccl":
            torch.cuda.set_device(self._device)
        self._group = open_weight_update_group(spec, spec.rank_offset)
        self._group_spec = spec

    def update_weights_from_collective(self, manifest: BucketManifest, src_rank: int = 0) -> None:
        """Receive one flat bucket broadcast from ``src_rank`` and load it by HF name.

        The bucket is received even when its manifest does not match the model, so this rank stays
        in step with the sender for the next bucket; the error is raised after, and no weight changes.
        """
        self._check_usable("update_weights_from_collective")
        if self._group is None:
            raise BackendError(
                "update_weights_from_collective: no weight-update group; call init_weight_update_group first"
            )
        spec = self._group_spec
        buffer_device = self._device if spec.backend == "nccl" else torch.device("cpu")
        flat = torch.empty(manifest.numel, dtype=manifest.dtype, device=buffer_device)
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src_rank
        opts.rootTensor = 0
        opts.timeout = datetime.timedelta(seconds=spec.timeout_s)
        try:
            # Poll, then wait() without a timeout: on NCCL a wait whose timeout expires aborts the communicator.
            wait_work(self._group.broadcast([flat], opts), spec.timeout_s, what="the bucket")
        except Exception as exc:
            self._group_failed = True  # its destroy aborts: a graceful shutdown may wait on this broadcast
            raise BackendError(
                f"receiving a bucket of {len(manifest.tensors)} tensors ({flat.numel() * flat.element_size()} "
                f"bytes) from rank {src_rank} of weight-update group {spec.group_name!r} failed or timed out "
                f"after timeout_s={spec.timeout_s}: {type(exc).__name__}: {exc}"
            ) from exc
        self._validate_manifest(manifest, f"collective bucket from rank {src_rank}")
        self._load(manifest.unflatten(flat))

    def destroy_weight_update_group(self) -> None:
        """Leave the side group: ``abort()`` after a failed receive (NCCL's ncclCommAbort; a graceful
        ``shutdown()`` may wait on the broadcast that will never finish), ``shutdown()`` otherwise."""
        if self._group is not None:
            if getattr(self, "_group_failed", False):
                self._group.abort()
            else:
                self._group.shutdown()
        self._group = None
        self._group_spec = None
        self._group_failed = False

    def update_weights_from_tensor(self, manifest: BucketManifest, flat) -> None:
        """Load one flat bucket: a tensor (in-process) or the payload ``pack_tensor_bucket`` made of it.

        ``flat``: a 1-D tensor of ``manifest.dtype``, or the bytes of :func:`backends.shared_tensor.share`
        from the trainer process that owns the bucket (shared memory on CPU, CUDA IPC on GPU). The
        opened memory is only read, never re-shared.
        """
        self._check_usable("update_weights_from_tensor")
        self._validate_manifest(manifest, "tensor bucket")
        if not isinstance(flat, torch.Tensor):
            flat = _rebuild_ipc_tensor(flat)
        self._load(manifest.unflatten(flat))

    def update_weights_from_disk(self, path: str) -> None:
        """Reload every parameter from the ``*.safetensors`` files in directory ``path`` (HF names)."""
        self._check_usable("update_weights_from_disk")
        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise BackendError(f"update_weights_from_disk: no *.safetensors files in {path!r}")
        shapes: dict[str, tuple[int, ...]] = {}
        where: dict[str, str] = {}
        for file in files:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    shapes[key] = tuple(f.get_slice(key).get_shape())
                    where[key] = file
        self._check_names_and_shapes(shapes.items(), f"update_weights_from_disk({path!r})")
        missing = sorted(set(self._named_params()) - set(shapes) - self._tied_aliases(shapes))
        if missing:
            raise BackendError(
                f"update_weights_from_disk({path!r}): {len(missing)} parameter(s) missing from the "
                f"checkpoint, e.g. {missing[:3]}; nothing was loaded"
            )
        for file in files:
            with safe_open(file, framework="pt") as f:
                self._load((key, f.get_tensor(key)) for key in f.keys())

    @torch.no_grad()
    def load_lora_adapter(self, manifest: BucketManifest, flat, peft_config: dict) -> None:
        """Serve a LoRA adapter: each adapted linear layer's output gains ``scaling * (x A^T) B^T`` (a forward
        hook; the base weights stay as they are), replacing the adapter loaded before. Names as PEFT saves them
        (``base_model.model.<module>.lora_A.weight``); scaling ``lora_alpha / r`` (``/ sqrt(r)`` with
        ``use_rslora``). Checks every tensor before anything changes."""
        self._check_usable("load_lora_adapter")
        rank, alpha = int(peft_config["r"]), float(peft_config["lora_alpha"])
        for key in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern"):
            if peft_config.get(key):
                raise BackendError(f"load_lora_adapter: {key} is not supported by the embedded engine")
        scaling = alpha / (math.sqrt(rank) if peft_config.get("use_rslora") else rank)
        if not isinstance(flat, torch.Tensor):
            raise BackendError(f"load_lora_adapter: flat must be a tensor, got {type(flat).__name__}")
        modules = dict(self.model.named_modules())
        halves: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in manifest.unflatten(flat):
            module_name, sep, which = name.removeprefix("base_model.model.").rpartition(".lora_")
            if not sep or which not in ("A.weight", "B.weight"):
                raise BackendError(f"load_lora_adapter: tensor {name!r} is not a LoRA A / B weight "
                                   "(base_model.model.<module>.lora_A.weight); nothing was loaded")
            layer = modules.get(module_name)
            if not isinstance(layer, torch.nn.Linear):
                raise BackendError(f"load_lora_adapter: {name!r} names no linear layer of this model "
                                   f"({module_name!r}); nothing was loaded")
            want = (rank, layer.in_features) if which[0] == "A" else (layer.out_features, rank)
            if tuple(tensor.shape) != want:
                raise BackendError(f"load_lora_adapter: {name!r} has shape {tuple(tensor.shape)}, expected {want} "
                                   f"(r={rank}); nothing was loaded")
            halves.setdefault(module_name, {})[which[0]] = tensor.to(self._device, layer.weight.dtype, copy=True)
        for module_name, pair in halves.items():
            if set(pair) != {"A", "B"}:
                raise BackendError(f"load_lora_adapter: {module_name!r} has only lora_{''.join(pair)}; nothing was "
                                   "loaded")
        self.unload_lora_adapter()
        for module_name, pair in halves.items():
            a, b = pair["A"], pair["B"]

            def add_delta(_module, args, output, a=a, b=b):
                return output + scaling * torch.nn.functional.linear(torch.nn.functional.linear(args[0], a), b)

            self._lora_hooks.append(modules[module_name].register_forward_hook(add_delta))
        self.reset_prefix_cache()

    def unload_lora_adapter(self) -> None:
        """Serve the base weights alone again."""
        for hook in self._lora_hooks:
            hook.remove()
        self._lora_hooks = []

    def _tied_aliases(self, present: Iterable[str]) -> set[str]:
        """Names that share storage with a name in ``present`` (a tied lm_head, say)."""
        params = self._named_params()
        present_ptrs = {params[name].data_ptr() for name in present if name in params}
        return {name for name, p in params.items() if p.data_ptr() in present_ptrs}

    def get_weights_by_name(self, name: str) -> torch.Tensor:
        self._check_usable("get_weights_by_name")
        params = self._named_params()
        if name not in params:
            raise BackendError(f"get_weights_by_name: no parameter {name!r}; e.g. {list(params)[:3]}")
        return params[name].detach().to("cpu", copy=True)

    # ---- memory and lifetime ---------------------------------------------------------------
    def sleep(self, tags: tuple[str, ...] | None = None) -> None:
        """Release ``tags`` (None: all) and refuse to generate until :meth:`wake` brings every tag back.

        ``"weights"``: the model moves to host memory (on CUDA). ``"kv_cache"``: the KV cache lives only
        inside a ``generate`` call, so there is none to drop; the allocator's cached blocks are returned.
        Weight updates are accepted while the weights sleep and land in the host copy.
        """
        self._check_usable("sleep")
        wanted = [t for t in memory_tags(tags, "sleep") if t not in self._released]
        if not wanted:
            return
        if MEMORY_WEIGHTS in wanted and self._device.type == "cuda":
            self.model.to("cpu")
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
        self._released.update(wanted)
        self._asleep = True

    def wake(self, tags: tuple[str, ...] | None = None) -> None:
        """Bring back the released ``tags`` (None: all); the weights return to the device."""
        self._check_usable("wake")
        wanted = [t for t in memory_tags(tags, "wake") if t in self._released]
        if MEMORY_WEIGHTS in wanted and self._device.type == "cuda":
            self.model.to(self._device)
        self._released.difference_update(wanted)
        self._asleep = bool(self._released)

    def reset_prefix_cache(self) -> None:
        """Nothing to drop: the KV cache never outlives one ``generate`` call."""

    def shutdown(self) -> None:
        if self._closed:
            return
        self.destroy_weight_update_group()
        del self.model
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
        self._closed = True

    def _check_usable(self, what: str) -> None:
        if self._closed:
            raise BackendError(f"{what}: the embedded backend was shut down; create a new one")
        if self._asleep and what == "generate":
            raise BackendError(
                f"generate: the embedded backend is asleep (released: {sorted(self._released)}); call wake() first"
            )


class _DecodeState:
    """A decode batch's cache and positions: :meth:`step` feeds one token per live row and returns the logits
    of the next [rows, V]; :meth:`select` keeps the rows ``keep``."""

    def __init__(self, model, next_position: torch.Tensor):
        self.model = model
        self.next_position = next_position  # [rows] the position of each row's next token

    def select(self, keep: torch.Tensor) -> None:
        self.next_position = self.next_position[keep]

    def step(self, token: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class _BufferedDecode(_DecodeState):
    """Decode over :class:`KVBuffers` (the model runs :func:`engine_attention`)."""

    def __init__(self, model, buffers: KVBuffers, next_position: torch.Tensor):
        super().__init__(model, next_position)
        self.buffers = buffers

    def select(self, keep: torch.Tensor) -> None:
        super().select(keep)
        self.buffers.select(keep)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=token[:, None], attention_mask=self.buffers.step_mask(),
                         position_ids=self.next_position[:, None], use_cache=False, kv_buffers=self.buffers)
        self.buffers.advance()
        self.next_position = self.next_position + 1
        return out.logits[:, -1, :]


class _CachedDecode(_DecodeState):
    """Decode through transformers' ``DynamicCache`` and a 2-D attention mask grown a column per step."""

    def __init__(self, model, cache, attention_mask: torch.Tensor, next_position: torch.Tensor):
        super().__init__(model, next_position)
        self.cache = cache
        self.attention_mask = attention_mask

    def select(self, keep: torch.Tensor) -> None:
        super().select(keep)
        _select_cache_rows(self.cache, keep)
        self.attention_mask = self.attention_mask[keep]

    def step(self, token: torch.Tensor) -> torch.Tensor:
        mask = self.attention_mask
        self.attention_mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
        out = self.model(input_ids=token[:, None], attention_mask=self.attention_mask,
                         position_ids=self.next_position[:, None], past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        self.next_position = self.next_position + 1
        return out.logits[:, -1, :]


def _select_cache_rows(cache, rows: torch.Tensor) -> None:
    """Make ``cache`` hold the batch rows ``rows`` (indices into its rows; repeated to give prompts their sample rows,
    a subset to compact). Through ``reorder_cache``, which every cache layer class has: linear-attention and
    convolution states (Qwen3.5, Qwen3-Next) have no ``batch_repeat_interleave`` or ``batch_select_indices``."""
    cache.reorder_cache(rows)


def plan_waves(lengths: list[int], n: int, max_new: int, max_rows: int, budget_bytes: int,
               kv_bytes_per_token: int) -> list[tuple[range, range]]:
    """Split a generate call into decode batches whose KV buffers fit ``budget_bytes``.

    lengths: the prompts' lengths, ascending; each prompt has ``n`` sample rows of ``length + max_new`` columns.
    Returns ``(prompt positions, sample indices)`` per batch, in order: consecutive prompts with all their samples
    while ``rows <= max_rows`` and ``rows x (longest + max_new) x kv_bytes_per_token <= budget_bytes``, and
    where one prompt's ``n`` rows do not fit, that prompt alone, its samples split into as many as fit. Raises
    ValueError when one row does not fit.
    """
    waves: list[tuple[range, range]] = []
    start = 0
    while start < len(lengths):
        stop = start
        while (stop < len(lengths) and (stop - start + 1) * n <= max_rows
               and (stop - start + 1) * n * (lengths[stop] + max_new) * kv_bytes_per_token <= budget_bytes):
            stop += 1
        if stop > start:
            waves.append((range(start, stop), range(n)))
            start = stop
            continue
        row_bytes = (lengths[start] + max_new) * kv_bytes_per_token
        rows = min(max_rows, budget_bytes // row_bytes)
        if rows < 1:
            raise ValueError(f"one row of {lengths[start] + max_new} tokens needs {row_bytes} bytes of KV cache, "
                             f"past the budget of {budget_bytes} bytes")
        waves += [(range(start, start + 1), range(j, min(n, j + rows))) for j in range(0, n, rows)]
        start += 1
    return waves


def _host_available_bytes() -> int:
    """Host memory available for new allocations (``MemAvailable`` on Linux; free pages elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _length_groups(lengths: list[int], max_growth: float = 1.25) -> list[range]:
    """Split ascending ``lengths`` into runs whose longest is at most ``max_growth`` x the shortest."""
    groups, start = [], 0
    for i, length in enumerate(lengths):
        if length > lengths[start] * max_growth:
            groups.append(range(start, i))
            start = i
    groups.append(range(start, len(lengths)))
    return groups


def _as_id_set(ids) -> set[int]:
    if ids is None:
        return set()
    if isinstance(ids, int):
        return {ids}
    return {int(i) for i in ids}


def _rebuild_ipc_tensor(payload) -> torch.Tensor:
    """Open the tensor of a :func:`backends.shared_tensor.share` payload (shared memory or CUDA IPC)."""
    from backends.shared_tensor import open_shared

    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise BackendError(
            "update_weights_from_tensor: flat must be a torch.Tensor or the bytes of "
            f"EmbeddedBackend.pack_tensor_bucket (backends.shared_tensor.share), got {type(payload).__name__}"
        )
    flat = open_shared(payload)
    if not isinstance(flat, torch.Tensor):
        raise BackendError(f"update_weights_from_tensor: the payload holds a {type(flat).__name__}, not a tensor")
    return flat
