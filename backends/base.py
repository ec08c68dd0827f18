"""The rollout-backend interface: the contract every inference engine meets.

A backend turns token-id prompts into completions and takes new weights from the trainer.
It knows nothing of the trainer; the trainer knows backends only through this module.

Log-prob convention (checked by ``tests/test_backend_contract.py`` for every backend):
``Completion.logprobs[i]`` is the log-probability of ``Completion.token_ids[i]`` under the
*temperature-scaled* distribution ``softmax(logits / temperature)``, taken *before* top-p / top-k
truncation, in fp32. That is exactly what the trainer recomputes from the same weights, so the
ratio between engine and trainer log-probs measures only numerical mismatch, never a
convention gap. With ``temperature == 0`` (greedy) the scale is 1.

Weights move as flat buckets (see :class:`TensorSpec` / :class:`BucketManifest`): one contiguous
1-D buffer of one dtype plus a manifest naming each tensor (Hugging Face parameter names) by
shape and element offset. Three transports carry them:

* collective — the engine's workers join a side process group with the trainer's sender rank
  (:class:`WeightGroupSpec`), and the sender broadcasts each flat bucket;
* tensor — a colocated hand-off of the bucket itself (shared memory on CPU, CUDA IPC on GPU): the
  trainer process that owns the bucket packs it (:meth:`RolloutBackend.pack_tensor_bucket`, resolved
  through the registry from the engine's backend name) and the engine opens the payload;
* disk — a directory of safetensors files, reloaded by the engine.

After the last bucket of a sync the trainer calls :meth:`RolloutBackend.finish_weight_update`,
which records the new ``weight_version`` and resets the prefix cache.

Memory (colocated engines). :meth:`RolloutBackend.sleep` and :meth:`RolloutBackend.wake` take the memory
tags to release or restore, ``None`` meaning all of them:

* ``"weights"`` (:data:`MEMORY_WEIGHTS`): the model's parameters;
* ``"kv_cache"`` (:data:`MEMORY_KV_CACHE`): the KV cache and what only generation needs (SGLang's CUDA
  graphs come back with it).

The names are SGLang's and vLLM's own (``sglang.srt.constants.GPU_MEMORY_TYPE_*``, vLLM's ``wake_up``
tags); ``tests/test_colocation.py`` holds them to the installed sources. An engine that cannot release one
tag alone may release more than asked (vLLM's ``sleep`` drops both); releasing a released tag or waking an
awake one does nothing. ``generate`` needs every tag awake; a weight update needs ``"weights"`` awake (the
embedded engine also takes one while asleep, into its host copy). Weights that come back after a release may
be stale or gone (engines that discard them), so a wake that restores ``"weights"`` is always followed by a
full weight sync before the next ``generate``. When the trainer shares the device, one step runs
(``PPOTrainer._hand_device_to_engines``)::

    training states off -> wake(("weights",)) -> sync -> wake(("kv_cache",)) -> generate
        -> sleep() -> training states on -> train

so weights, KV cache and training states are never on the device together.

Partial rollout (async mode). A backend whose ``supports_abort`` is true can have a running ``generate`` cut
short by :meth:`RolloutBackend.abort_generation`, called from another thread: the call returns what it has,
each completion with the tokens sampled so far and ``finish_reason == "abort"``. The trainer syncs the new
weights and sends ``prompt + tokens so far`` back with the remaining budget, so one long generation never holds
a weight sync back. Without it, the trainer waits for a running generate to finish before it syncs.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

__all__ = [
    "MEMORY_KV_CACHE",
    "MEMORY_TAGS",
    "MEMORY_WEIGHTS",
    "check_generate_args",
    "wait_work",
    "memory_tags",
    "BackendConfig",
    "BackendError",
    "BucketManifest",
    "Completion",
    "RolloutBackend",
    "SamplingParams",
    "TensorSpec",
    "WeightGroupSpec",
]


class BackendError(RuntimeError):
    """A backend could not do what was asked; the message says what and what to do."""


#: memory tag of :meth:`RolloutBackend.sleep` / :meth:`RolloutBackend.wake`: the model's weights
MEMORY_WEIGHTS = "weights"
#: memory tag of :meth:`RolloutBackend.sleep` / :meth:`RolloutBackend.wake`: the KV cache (and CUDA graphs)
MEMORY_KV_CACHE = "kv_cache"
#: every memory tag, in the order a full wake restores them (weights before the KV cache)
MEMORY_TAGS: tuple[str, ...] = (MEMORY_WEIGHTS, MEMORY_KV_CACHE)


def memory_tags(tags: Iterable[str] | None, what: str = "sleep/wake") -> tuple[str, ...]:
    """``tags`` checked and in :data:`MEMORY_TAGS` order; ``None`` is every tag. BackendError names a bad one."""
    if tags is None:
        return MEMORY_TAGS
    if isinstance(tags, str):
        tags = (tags,)  # a lone tag, not its letters
    tags = tuple(tags)
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown or not tags:
        raise BackendError(
            f"{what}: memory tags {list(tags)!r}: each must be one of {list(MEMORY_TAGS)} (or pass None for all)"
        )
    return tuple(t for t in MEMORY_TAGS if t in tags)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``n`` completions are returned per prompt, prompt-major.

    ``temperature == 0`` means greedy. ``top_k <= 0`` and ``top_p >= 1`` disable truncation.
    ``seed`` makes a call reproducible on the same backend and weights (same prompts, same params
    -> same tokens); ``None`` draws fresh randomness.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    #: return each completion's ``routed_experts`` (a backend whose ``supports_routed_experts`` is true)
    return_routed_experts: bool = False

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass
class Completion:
    """One sampled answer to one prompt.

    token_ids: the generated tokens (the stop token, when one ended the answer, is included).
    logprobs: one float per token in ``token_ids``, in the convention of this module's docstring.
    finish_reason: ``"stop"`` (a stop token or EOS), ``"length"`` (``max_new_tokens`` reached) or ``"abort"``
        (cut short by :meth:`RolloutBackend.abort_generation`; the tokens so far).
    weight_version: the engine's weight version when the answer was sampled.
    prompt_index: index of the prompt in the ``generate`` call that produced it.
    cached_tokens: how many of the prompt's tokens the engine took from its prefix cache (SGLang's
        ``meta_info["cached_tokens"]``, vLLM's ``RequestOutput.num_cached_tokens``); None where the engine has no
        prefix cache or does not say.
    routed_experts: with ``SamplingParams.return_routed_experts``, the experts every MoE layer's router chose for
        each token of the prompt and the completion but the last (the last is never fed to the model):
        ``[len(prompt) + len(token_ids) - 1, moe_layers, top_k]`` int16, layers in decoder order
        (:mod:`rlhf_sg.moe.replay`); else None.
    token_versions: the weight version of each token of ``token_ids``, where the completion joins generate calls
        of different weights (partial rollout's continuation after a weight sync; set by the trainer, never by a
        backend, whose one call samples with one version); None: every token is ``weight_version``'s.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int
    prompt_index: int
    cached_tokens: int | None = None
    routed_experts: torch.Tensor | None = None
    token_versions: list[int] | None = None


@dataclass(frozen=True)
class TensorSpec:
    """One tensor inside a flat bucket: its HF name, shape, dtype and element offset."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # in elements, into the bucket's 1-D buffer

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class BucketManifest:
    """What a flat bucket holds. All tensors share one dtype; ``numel`` is the buffer length."""

    tensors: tuple[TensorSpec, ...]
    dtype: torch.dtype
    numel: int

    def unflatten(self, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Views of ``flat`` ([numel] of ``dtype``) as (name, tensor) pairs; no copy."""
        if flat.dim() != 1 or flat.numel() != self.numel or flat.dtype != self.dtype:
            raise BackendError(
                f"bucket buffer is {tuple(flat.shape)} {flat.dtype}, manifest expects "
                f"[{self.numel}] {self.dtype}"
            )
        return [(t.name, flat[t.offset : t.offset + t.numel].view(t.shape)) for t in self.tensors]


def check_generate_args(
    prompts: list[list[int]], params: SamplingParams, vocab_size: int, context_len: int, context_note: str = "",
    routed_experts: bool = False,
) -> None:
    """The checks every backend runs before ``generate`` does any work; BackendError names the prompt.

    Prompts must be a non-empty list of non-empty token-id lists with ids in ``[0, vocab_size)``, and
    ``len(prompt) + params.max_new_tokens`` must fit ``context_len`` (``context_note`` says where that
    limit comes from). ``routed_experts``: whether the backend can return ``Completion.routed_experts``.
    """
    if not isinstance(params, SamplingParams):
        raise BackendError(f"generate: params must be a SamplingParams, got {type(params).__name__}")
    if params.return_routed_experts and not routed_experts:
        raise BackendError("generate: SamplingParams.return_routed_experts asks for the experts each token was "
                           "routed to, which this backend does not return (supports_routed_experts is False)")
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise BackendError("generate: prompts is empty; pass a non-empty list of token-id lists")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, (list, tuple)) or len(prompt) == 0:
            raise BackendError(f"generate: prompt {i} is empty or not a list of token ids")
        bad = next((t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab_size), None)
        if bad is not None:
            raise BackendError(f"generate: prompt {i} holds {bad!r}, not a token id in [0, {vocab_size})")
        if len(prompt) + params.max_new_tokens > context_len:
            note = f" ({context_note})" if context_note else ""
            raise BackendError(
                f"generate: prompt {i} has {len(prompt)} tokens; with max_new_tokens={params.max_new_tokens} "
                f"that is {len(prompt) + params.max_new_tokens} > the engine's context of {context_len}{note}; "
                "shorten the prompt or lower max_new_tokens"
            )


def wait_work(work: Any, timeout_s: float, poll: Callable[[], None] | None = None, what: str = "a collective") -> None:
    """Wait for a collective's ``work`` to complete, at most ``timeout_s``, without a timed ``wait``.

    Polls ``work.is_completed()`` (calling ``poll`` in between, e.g. to raise an engine's failure at
    once), then calls ``work.wait()`` without a timeout, on completed work only, which raises the
    collective's own error if it failed. Raises :class:`TimeoutError` after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    pause = 5e-5
    while not work.is_completed():
        if poll is not None:
            poll()
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not complete within timeout_s={timeout_s}")
        time.sleep(pause)
        pause = min(2 * pause, 2e-3)  # short transfers are seen at once, long ones cost little CPU
    work.wait()


@dataclass(frozen=True)
class WeightGroupSpec:
    """A side process group for the collective transport (never the default group).

    The trainer's sender is rank 0; the engine's workers take ranks ``rank_offset ..
    rank_offset + engine_world_size - 1``. ``backend`` is ``"gloo"`` on CPU, ``"nccl"`` on GPU.
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str = "gloo"
    timeout_s: float = 600.0


@dataclass
class BackendConfig:
    """What every backend needs to start. ``extra`` carries engine-specific keywords verbatim."""

    model_path: str
    dtype: str = "float32"  # "float32" | "bfloat16" | "float16"
    max_model_len: int = 4096
    seed: int = 0
    device: str = "cpu"  # "cpu" | "cuda"
    tensor_parallel_size: int = 1
    num_threads: int | None = None  # CPU threads for this engine process; None = leave as is
    #: share of each device the engine takes for weights and KV cache (SGLang's mem_fraction_static, vLLM's
    #: gpu_memory_utilization); None: the backend's default. Engine-specific keywords in ``extra`` win.
    memory_fraction: float | None = None
    #: the trainer puts the engine to sleep while it trains (colocated layouts): start it so that
    #: :meth:`RolloutBackend.sleep` frees device memory (SGLang's memory saver; vLLM's sleep mode)
    sleeps_while_training: bool = False
    #: the rank of the LoRA adapters the trainer will load (--lora.sync_mode adapter; 0: none): a backend that
    #: must start its engine ready for adapters (vLLM's enable_lora / max_lora_rank) does so
    lora_adapter_rank: int = 0
    #: start the engine ready to return ``Completion.routed_experts`` (--train.routing_replay): engines that capture
    #: routes only when started so (SGLang's enable_return_routed_experts) do
    routed_experts: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class RolloutBackend(abc.ABC):
    """An inference engine behind one interface. Subclass it to add an engine.

    Subclasses set ``name`` and implement the abstract methods. The weight-update methods a
    backend does not support raise :class:`BackendError` saying which transport to use instead.
    Methods are called from one thread, except :meth:`abort_generation`, which comes from another while
    ``generate`` runs; a backend may run its own processes underneath.
    """

    name: ClassVar[str] = ""
    #: transports this backend accepts, a subset of {"collective", "tensor", "disk"}
    transports: ClassVar[frozenset[str]] = frozenset()
    #: whether :meth:`abort_generation` can cut a running ``generate`` short (partial rollout); without it
    #: the trainer waits for a generate in flight to finish before a weight sync
    supports_abort: ClassVar[bool] = False
    #: ``generate`` returns ``Completion.routed_experts`` when asked (``SamplingParams.return_routed_experts``)
    supports_routed_experts: ClassVar[bool] = False
    #: whether :meth:`load_lora_adapter` serves a LoRA adapter sent as its own tensors (--lora.sync_mode adapter)
    supports_lora_adapter: ClassVar[bool] = False
    #: whether ``generate`` takes ``images=`` (each prompt's processor output) for a vision-language model
    supports_images: ClassVar[bool] = False
    #: which vision-language models, said by ``rlhf-sg backends``
    image_models: ClassVar[str] = "vision-language models"

    def __init__(self, config: BackendConfig):
        self.config = config
        self._weight_version = 0
        self._released: set[str] = set()  # memory tags sleep released and wake has not brought back

    # ---- rollout -------------------------------------------------------------------------
    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Sample ``params.n`` completions per prompt; prompt-major order, len = len(prompts) * n."""

    def abort_generation(self) -> None:
        """Called from another thread than the one running ``generate``: make the running ``generate`` return as
        soon as it can, every completion holding the tokens sampled so far and their log-probs with
        ``finish_reason="abort"`` (zero tokens is allowed). A no-op when no generate runs. Nothing but ``generate``
        runs concurrently with it. Backends that set ``supports_abort`` implement it."""
        raise BackendError(f"backend {self.name!r} cannot abort a running generate (supports_abort is False)")

    # ---- weights -------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._weight_version

    def init_weight_update_group(self, spec: WeightGroupSpec) -> None:
        raise BackendError(f"backend {self.name!r} has no collective transport; use one of {sorted(self.transports)}")

    def update_weights_from_collective(self, manifest: BucketManifest, src_rank: int = 0) -> None:
        """Receive one flat bucket broadcast from ``src_rank`` of the weight-update group and load it."""
        raise BackendError(f"backend {self.name!r} has no collective transport; use one of {sorted(self.transports)}")

    def destroy_weight_update_group(self) -> None:
        """Leave the weight-update group (a no-op when none was joined)."""

    @classmethod
    def open_sender_group(cls, spec: WeightGroupSpec, store: Any) -> Any:
        """Collective transport, sender side: the trainer's end (group rank 0) of a weight-update group.

        Runs in the trainer rank that hosts ``store`` (a ``torch.distributed.TCPStore`` it is master of,
        at ``spec.master_address:spec.master_port``) while this backend's engines join through
        :meth:`init_weight_update_group`; both sides must meet on the same store keys. Blocks until
        every rank has joined (at most ``spec.timeout_s``). The default builds the group straight on
        the store (``ProcessGroupGloo`` / ``ProcessGroupNCCL``, no key prefix); a backend whose engine
        joins another way (SGLang's prefixed keys) overrides it.
        """
        import datetime

        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=spec.timeout_s)
        if spec.backend == "gloo":
            return dist.ProcessGroupGloo(store, 0, spec.world_size, timeout)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, 0, spec.world_size, options)

    @classmethod
    def pack_tensor_bucket(cls, manifest: BucketManifest, flat: torch.Tensor, num_tp_ranks: int) -> Any:
        """Tensor transport, sender side: runs in the trainer process that owns ``flat``.

        ``flat`` ([manifest.numel] of manifest.dtype, on the sender's device) stays alive and unchanged
        until the engine's :meth:`update_weights_from_tensor` call for it has returned. The result is
        picklable and reaches ``update_weights_from_tensor(manifest, payload)`` in the engine process
        untouched: the engine side must never re-share memory it opened from a handle (CUDA IPC memory
        can only be shared by the process that owns it). ``num_tp_ranks``: the engine's tensor-parallel
        ranks, for engines whose ranks each need a payload of their own. Make the bytes ready first
        (on CUDA: synchronise the stream that wrote ``flat``).

        The default is one :func:`backends.shared_tensor.share` payload of ``flat``: shared memory by
        segment name on CPU, a CUDA IPC handle naming the device by UUID on GPU; the engine side opens
        it with :func:`backends.shared_tensor.open_shared`. Backends whose engines take another format
        (SGLang: serialized per-TP-rank buckets) override it.
        """
        from backends.shared_tensor import share

        if flat.is_cuda:
            torch.cuda.current_stream(flat.device).synchronize()
        return share(flat)

    def update_weights_from_tensor(self, manifest: BucketManifest, flat: Any) -> None:
        """Load one flat bucket: what :meth:`pack_tensor_bucket` made of it in the sender, or (in-process)
        the tensor itself. Never re-share memory opened from a payload."""
        raise BackendError(f"backend {self.name!r} has no tensor transport; use one of {sorted(self.transports)}")

    def update_weights_from_disk(self, path: str) -> None:
        """Reload all weights from a directory of safetensors files in HF naming."""
        raise BackendError(f"backend {self.name!r} has no disk transport; use one of {sorted(self.transports)}")

    def load_lora_adapter(self, manifest: BucketManifest, flat: torch.Tensor, peft_config: dict[str, Any]) -> None:
        """Serve the LoRA adapter in ``flat`` from now on, in place of any adapter loaded before (over the base
        weights the engine holds).

        manifest: the adapter's tensors in PEFT's saved naming (``base_model.model.<module>.lora_A.weight``,
        ``lora_B.weight``: A [r, in], B [out, r]); flat: [manifest.numel] of manifest.dtype (a CPU tensor);
        peft_config: ``r``, ``lora_alpha``, ``use_rslora``, ``target_modules`` as PEFT's adapter_config.json
        holds them. Every later ``generate`` uses the adapter, scaled ``lora_alpha / r`` (``/ sqrt(r)`` with
        rsLoRA); a backend whose engine caches KV drops the cache (:meth:`finish_weight_update` follows too).
        Backends that set ``supports_lora_adapter`` implement it."""
        raise BackendError(f"backend {self.name!r} cannot load a LoRA adapter (supports_lora_adapter is False); "
                           "use --lora.sync_mode merged")

    def finish_weight_update(self, version: int) -> None:
        """Close a sync: record ``version`` and reset the prefix cache (stale KV must not be reused)."""
        self.reset_prefix_cache()
        self._weight_version = int(version)

    def get_weights_by_name(self, name: str) -> torch.Tensor:
        """A CPU copy of one parameter as the engine holds it (for checks and debugging)."""
        raise BackendError(f"backend {self.name!r} cannot read its weights back")

    # ---- memory and lifetime ---------------------------------------------------------------
    def sleep(self, tags: tuple[str, ...] | None = None) -> None:
        """Release the engine memory named by ``tags`` (see the module docstring; None: all of it) while
        the trainer uses the device. ``generate`` is refused until every tag is awake again."""

    def wake(self, tags: tuple[str, ...] | None = None) -> None:
        """Restore the memory :meth:`sleep` released, the tags named (None: all of them). After
        ``"weights"`` comes back, push a full weight sync before the next ``generate``."""

    @property
    def released_memory(self) -> frozenset[str]:
        """The memory tags :meth:`sleep` released and :meth:`wake` has not brought back (empty: awake)."""
        return frozenset(self._released)

    def reset_prefix_cache(self) -> None:
        """Drop cached KV so nothing computed with old weights is reused."""

    def shutdown(self) -> None:
        """Stop the engine and free its resources; the object is unusable afterwards."""
