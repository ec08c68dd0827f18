"""Model workers: one Ray actor per DeepSpeed ZeRO-3 rank of the actor, critic, reference or reward model.

A :class:`ModelGroup` starts ``world_size`` workers of one role in a placement group and calls them
together: under ZeRO-3 every forward gathers parameters collectively, so every rank must run the
same number of forwards. The controller guarantees it by giving each rank a plan with the same
number of token-budget micro-batches (:func:`rlhf_sg.packing.token_budget_microbatches`).

Batches travel as one :class:`rlhf_sg.experience.Experience` of padded CPU tensors through Ray's
object store (shared memory on a node); each rank takes the rows of its plan, moves them to its
device, packs them (no compute on padding) and returns its results by global row index.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from rlhf_sg.experience import ActorUpdate, CriticUpdate, Experience, OptimizerStep
from rlhf_sg.packing import counting_block_layers, stop_shared_prompt_attention, use_shared_prompt_attention
from rlhf_sg.probe import check_packing

log = logging.getLogger("rlhf_sg")

#: a profiled step's trace (``--log.profile_step``) holds each update phase of a rank in a span of this name and the
#: role's ("rlhf_sg.update/actor"), which ``python -m rlhf_sg.bench train-profile`` reads
UPDATE_SPAN_PREFIX = "rlhf_sg.update/"


@dataclass
class WorkerSpec:
    role: str
    model_path: str
    world_size: int
    master_addr: str
    master_port: int
    train: bool = False
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    lr: float = 1e-5
    #: a transformers ``get_scheduler`` name (constant, linear, cosine), warmup in optimizer steps, and the
    #: run's total optimizer steps (what linear / cosine decay over)
    lr_scheduler: str = "constant"
    lr_warmup_steps: int = 0
    lr_total_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    offload: bool = False
    gradient_checkpointing: bool = False
    #: a vision-language model's vision tower frozen (--model.freeze_vision_tower)
    freeze_vision_tower: bool = True
    disable_dropout: bool = True
    seed: int = 42
    threads: int = 1
    device: str = "cpu"
    timeout_s: float = 900.0
    #: the trainer's forwards share prompts (the layouts the start-up probe checks: packed, and shared with this)
    share_prompts: bool = False
    #: --model.fused_kernels: RMSNorms, gated-MLP products and rotary embeddings as fused kernels
    #: (:mod:`rlhf_sg.kernels`)
    fused_kernels: bool = False
    #: run the start-up packing probe (:mod:`rlhf_sg.probe`) at model load
    packing_probe: bool = True
    #: --lora.* (a :class:`rlhf_sg.config.LoraConfig` as a dict) when this model carries a LoRA adapter: the
    #: actor trains it; a reference started from --lora.init_adapter holds it frozen
    lora: dict | None = None
    #: 3: ZeRO-3 partitioning; 0: none (a group of one rank, --train.single_rank_zero3 false)
    zero_stage: int = 3
    #: --train.sequence_parallel_size: consecutive ranks form SP groups of this size (:mod:`rlhf_sg.parallel`); the
    #: controller gives every rank of one the same micro-batches
    sequence_parallel_size: int = 1


class NonFiniteSkip:
    """Mixed into a torch optimizer for an unpartitioned float32 rank: ``step`` does what ZeRO-3's optimizer does
    around it. The global gradient norm before clipping (``_global_grad_norm``, which DeepSpeed's engine reports);
    a non-finite norm drops the gradients and skips the step, setting ``overflow`` (DeepSpeed's engine then counts
    it in ``skipped_steps`` and leaves the LR schedule where it was); else clip to ``max_grad_norm`` and step."""

    max_grad_norm: float = 0.0
    overflow: bool = False
    _global_grad_norm: float = 0.0

    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.zeros(())
        self._global_grad_norm = float(norm)
        self.overflow = not math.isfinite(self._global_grad_norm)
        if self.overflow:
            for g in self.param_groups:
                for p in g["params"]:
                    p.grad = None
            return None
        if self.max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, norm)
        return super().step(closure)


def skipping(optimizer_cls: type, max_grad_norm: float):
    """``optimizer_cls`` with :class:`NonFiniteSkip`'s step."""
    return type(f"Skipping{optimizer_cls.__name__}", (NonFiniteSkip, optimizer_cls), {"max_grad_norm": max_grad_norm})


def lr_schedule(name: str, warmup_steps: int, total_steps: int):
    """``optimizer -> LR scheduler`` for DeepSpeed (which builds it on the optimizer it wraps), from
    transformers' ``get_scheduler``; the scheduler steps once per optimizer step. ``constant`` keeps the
    rate after the warmup; ``linear`` / ``cosine`` decay it to 0 at ``total_steps``."""
    from transformers import get_scheduler

    schedule = "constant_with_warmup" if name == "constant" else name
    return lambda optimizer: get_scheduler(
        schedule, optimizer, num_warmup_steps=warmup_steps, num_training_steps=max(total_steps, 1)
    )


def allreduce_weighted_means(
    sums: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], timeout_s: float, group=None
) -> dict[str, float]:
    """Means over every rank of the group: ``sum_r sums[k] / sum_r weights[k]`` for each metric ``k``.

    sums, weights: the same keys on every rank, 0-d tensors on this rank's device (a per-token metric is
    summed as ``mean x tokens`` with its tokens as the weight). One all-reduce for all metrics; it fails
    after ``timeout_s`` instead of hanging. Without a process group (or a group of one) the local means.
    """
    import torch.distributed as dist

    names = sorted(sums)
    if not names:
        return {}
    device = sums[names[0]].device
    packed = torch.stack([sums[k].float().to(device) for k in names] + [weights[k].float().to(device) for k in names])
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        work = dist.all_reduce(packed, group=group, async_op=True)
        deadline = time.monotonic() + timeout_s
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError(f"metric all-reduce did not finish within {timeout_s:.0f} s; a rank is stuck")
            time.sleep(0.001)
        work.wait()
    values = packed.tolist()
    n = len(names)
    return {k: values[i] / values[n + i] if values[n + i] > 0 else 0.0 for i, k in enumerate(names)}


def without_dropout(config) -> list[str]:
    """Set every dropout rate of a transformers config to 0 (attributes named ``*dropout`` or ``*pdrop`` holding a
    number, nested configs included): models read them when they build their layers, and some (attention
    dropout) apply them functionally, out of reach of ``nn.Dropout``. Returns the names it zeroed."""
    zeroed = []
    for name, value in list(vars(config).items()):
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a nested (text / vision) config
            zeroed += [f"{name}.{n}" for n in without_dropout(value)]
        elif (name.endswith("dropout") or name.endswith("pdrop")) and isinstance(value, float) and value:
            setattr(config, name, 0.0)
            zeroed.append(name)
    return zeroed


def actor_microbatch_loss(model, mb: Experience, update: ActorUpdate, normalizer: float,
                          replay=None, sequence_parallel=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's actor loss (:func:`rlhf_sg.algorithms.actor_loss`) and its per-token metrics.

    model: the policy (a DeepSpeed engine or a causal LM), in train mode; mb: the micro-batch on the model's
    device, with advantages (and old_logp unless ``update.old_logp_from_update``).

    With a router loss in force (:func:`router_aux_loss_coef`), the MoE load-balancing loss of the micro-batch's
    real tokens (:mod:`rlhf_sg.moe`) is added with that coefficient, weighted by the micro-batch's share of the
    step's ``normalizer`` (its action tokens, or rows with a per-sequence aggregation, that count in the loss): the
    step's term is then the micro-batches' weighted mean. Logged as ``router_aux_loss``.

    ``replay``: a :class:`rlhf_sg.moe.RouteReplay` in its active scope (routing replay): the micro-batch's
    ``routes`` are replayed in the forward. ``sequence_parallel``: this rank's
    :class:`rlhf_sg.parallel.SequenceParallelGroup`; the log-probs are then the group's (the whole micro-batch's on
    every rank: :mod:`rlhf_sg.parallel.forward`)."""
    from rlhf_sg.algorithms import actor_loss, masked_mean
    from rlhf_sg.moe import RouterLoad
    from rlhf_sg.packing import response_logprobs

    coef = router_aux_loss_coef(model, update.router_aux_loss_coef)
    router = RouterLoad(model) if coef > 0 else None
    if sequence_parallel is not None:
        from rlhf_sg.parallel import sp_response_logprobs

        _check_sequence_parallel(model, mb, router is not None or replay is not None)
        logp, entropy = sp_response_logprobs(model, mb.sequences, mb.attention_mask, mb.response_width,
                                             sequence_parallel, update.temperature, with_entropy=True,
                                             share_prompts=update.share_prompts)
    else:
        logp, entropy = response_logprobs(model, mb.sequences, mb.attention_mask, mb.response_width,
                                          update.temperature, with_entropy=True, share_prompts=update.share_prompts,
                                          router=router, routes=mb.routes if replay is not None else None,
                                          replay=replay, images=_images_of(model, mb))
    # a single update on fresh samples: the policy that sampled is the one being trained, so the old
    # log-probs are this forward's own
    old_logp = logp.detach() if update.old_logp_from_update else mb.old_logp
    keep, scale = _rows_in_loss(mb)
    if keep is not None:
        logp, entropy, old_logp, mb = logp[keep], entropy[keep], old_logp[keep], mb.rows(keep)
    loss, metrics = actor_loss(logp, entropy, old_logp, mb.advantages, mb.action_mask, update.loss, normalizer,
                               rollout_logp=mb.rollout_logp, ref_logp=mb.ref_logp)
    if update.old_logp_from_update:
        gap = old_logp - mb.rollout_logp  # as rlhf_sg.algorithms.engine_vs_trainer_metrics
        metrics["logp_gap_engine_vs_trainer"] = masked_mean(gap.abs(), mb.action_mask)
        metrics["k3_kl_engine_vs_trainer"] = masked_mean(torch.expm1(gap) - gap, mb.action_mask)
        metrics["frac_logp_gap_over_ln2"] = masked_mean((gap.abs() > math.log(2)).float(), mb.action_mask)
    if router is not None:
        aux = router.loss()
        units = mb.action_mask.sum() if update.loss.aggregation == "token_mean" else mb.action_mask.shape[0]
        loss = loss + coef * aux * (units / normalizer)
        metrics["router_aux_loss"] = aux.detach()
    return loss * scale, metrics


def _check_sequence_parallel(model, mb: Experience, routed: bool) -> None:
    """Refuse what the SP forwards do not run (config.py refuses the flags before Ray starts; this holds a direct
    caller to it)."""
    module = getattr(model, "module", model)
    refused = ("routing replay or a router loss" if routed
               else "a vision-language model's images" if _images_of(model, mb) is not None else None)
    if refused is not None:
        raise ValueError(f"{type(module).__name__}: sequence parallelism does not run {refused}; set "
                         "--train.sequence_parallel_size 1")


def _images_of(model, mb: Experience) -> list | None:
    """The micro-batch's per-row images for a vision-language policy's forward: its own, or every row None when it
    holds none (the forward then still runs the vision tower once, as ZeRO-3 needs of every rank:
    :func:`rlhf_sg.vision.vision_forward_kwargs`); None for a text model."""
    module = getattr(model, "module", model)
    if getattr(module.config, "vision_config", None) is None:
        return None
    return mb.images if mb.images is not None else [None] * mb.batch_size


def router_aux_loss_coef(model, coef: float | None) -> float:
    """The router loss coefficient in force for ``model``: ``coef`` (``--train.router_aux_loss_coef``), or when
    None the model's own training default (:func:`rlhf_sg.moe.default_router_aux_loss_coef`). Raises ValueError
    for a coefficient > 0 on a model without routers."""
    from rlhf_sg.moe import default_router_aux_loss_coef, has_router

    module = getattr(model, "module", model)
    if coef is None:
        coef = default_router_aux_loss_coef(module.config)
    if coef > 0 and not has_router(module):
        raise ValueError(f"--train.router_aux_loss_coef {coef}: {type(module).__name__} has no mixture-of-experts "
                         "router to balance; set it to 0")
    return float(coef)


def _rows_in_loss(mb: Experience) -> tuple[list[int] | None, float]:
    """The rows of a micro-batch that count in the loss (:attr:`Experience.loss_rows`; None: all) and the
    loss's scale: 0 when no row counts, the loss then computed over all rows so that every rank runs the same
    collective backward and reports the same metric names (with no tokens behind them)."""
    if mb.loss_rows is None or bool(mb.loss_rows.all()):
        return None, 1.0
    if not bool(mb.loss_rows.any()):
        return None, 0.0
    return mb.loss_rows.nonzero().flatten().tolist(), 1.0


def loss_tokens(mb: Experience) -> torch.Tensor:
    """The action tokens of a micro-batch that count in the loss: the weight of its metrics."""
    mask = mb.action_mask if mb.loss_rows is None else mb.action_mask & mb.loss_rows[:, None]
    return mask.sum().float()


def critic_microbatch_loss(model, mb: Experience, update: CriticUpdate, normalizer: float,
                           sequence_parallel=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's value loss (:func:`rlhf_sg.algorithms.value_loss`, token mean) and its metrics; with
    ``sequence_parallel`` the values are the SP group's (as :func:`actor_microbatch_loss`)."""
    from rlhf_sg.algorithms import value_loss
    from rlhf_sg.packing import critic_values

    if sequence_parallel is not None:
        from rlhf_sg.parallel import sp_critic_values

        _check_sequence_parallel(model, mb, False)
        values = sp_critic_values(model, mb.sequences, mb.attention_mask, mb.response_width, sequence_parallel,
                                  share_prompts=update.share_prompts)
    else:
        values = critic_values(model, mb.sequences, mb.attention_mask, mb.response_width,
                               share_prompts=update.share_prompts)
    keep, scale = _rows_in_loss(mb)
    if keep is not None:
        values, mb = values[keep], mb.rows(keep)
    loss, metrics = value_loss(values, mb.values, mb.returns, mb.action_mask, clip=update.value_clip,
                               aggregation="token_mean", normalizer=normalizer)
    metrics["loss"] = loss.detach() * normalizer / mb.action_mask.sum()
    return loss * scale, metrics


def load_worker_model(spec: WorkerSpec):
    """The model of a rank of ``spec``: a causal LM (actor, ref, teacher) or a :class:`rlhf_sg.models.ValueHeadModel`
    (critic, reward), in ``spec``'s dtype and attention, without dropout (``disable_dropout``), switched to
    shared-prompt attention, wrapped in LoRA, frozen or set for gradient checkpointing as ``spec`` says. Under a live
    ``HfDeepSpeedConfig`` transformers builds it partitioned; without one (an in-process rank) whole."""
    from transformers import AutoConfig

    dtype = torch.bfloat16 if spec.dtype == "bfloat16" else torch.float32
    config = AutoConfig.from_pretrained(spec.model_path)
    if spec.disable_dropout:
        without_dropout(config)
    from rlhf_sg.models import attention_implementation

    attn = attention_implementation(config, spec.attn_implementation)
    kwargs = dict(config=config, dtype=dtype, attn_implementation=attn)
    vision = getattr(config, "vision_config", None) is not None
    if spec.role in ("actor", "ref", "teacher"):
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        model = auto.from_pretrained(spec.model_path, **kwargs)
        model.config.use_cache = False
    else:
        from rlhf_sg.models import ValueHeadModel

        model = ValueHeadModel.from_pretrained(spec.model_path, **kwargs)
    if spec.disable_dropout:
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    if spec.share_prompts and spec.role != "reward":
        # shared-prompt forwards computed block by block (the start-up probe checks them against each row alone)
        use_shared_prompt_attention(model)
    if spec.fused_kernels:
        from rlhf_sg.kernels import describe, fuse_kernels

        print(f"{spec.role}: {describe(fuse_kernels(model))}", flush=True)
    if spec.lora is not None:
        from rlhf_sg.lora import LoraSpec, apply_lora

        model = apply_lora(model, LoraSpec.from_config(spec.lora), spec.disable_dropout, trainable=spec.train,
                           head=None if spec.role in ("actor", "ref", "teacher") else "value_head")
    if vision and spec.freeze_vision_tower:
        from rlhf_sg.vision import freeze_vision_tower

        freeze_vision_tower(model)
    if not spec.train:
        model.requires_grad_(False)
    elif spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def make_optimizer(model, spec: WorkerSpec):
    """AdamW over ``model``'s trained parameters. On GPU, DeepSpeed's FusedAdam: faster there, and the only optimizer
    whose states ZeRO-3 can move off the device while the engines generate (:meth:`ModelWorker.offload_states`).
    On CPU, torch's fused AdamW: one kernel over each parameter where the default runs a dozen ops per parameter
    (about a fifth of the default's time on the e2e bench's 25M model)."""
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = dict(lr=spec.lr, weight_decay=spec.weight_decay, betas=(0.9, 0.95))
    # an unpartitioned float32 rank: no DeepSpeed optimizer wraps this one, so it clips and skips itself
    wrap = ((lambda cls: skipping(cls, spec.max_grad_norm))
            if spec.zero_stage == 0 and spec.dtype == "float32" else (lambda cls: cls))
    if spec.device == "cuda":
        from deepspeed.ops.adam import FusedAdam

        return wrap(FusedAdam)(params, adam_w_mode=True, **kwargs)
    return wrap(torch.optim.AdamW)(params, fused=True, **kwargs)


class ModelWorker:
    """One ZeRO-3 rank. Created through :class:`ModelGroup`; every public method is a Ray call."""

    def __init__(self, spec: dict[str, Any], rank: int):
        self.spec = WorkerSpec(**spec)
        self.rank = rank
        # DeepSpeed's ZeRO-3 collectives call torch.distributed APIs that warn on every call.
        warnings.filterwarnings(
            "ignore", message=r".*is deprecated\. Please use `torch\.distributed", category=FutureWarning
        )
        torch.set_num_threads(self.spec.threads)
        if self.spec.device == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
            from rlhf_sg.kernels.host_memory import retain_freed_memory

            retain_freed_memory()  # each step's activations stay paged in (see the module)
        torch.manual_seed(self.spec.seed + rank)

        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig

        from rlhf_sg.distributed import init_torch_distributed, zero3_config
        from rlhf_sg.placement import export_gloo_interface, this_rank

        #: the GPU, LOCAL_RANK and node this rank was placed on
        self.placement = this_rank()
        export_gloo_interface(self.placement.node_address)  # the CPU default group and side groups
        if self.spec.device == "cuda":
            # before the default group: DeepSpeed binds it to this device
            torch.cuda.set_device(self.placement.local_device)
        init_torch_distributed(
            rank=rank,
            world_size=self.spec.world_size,
            master_addr=self.spec.master_addr,
            master_port=self.spec.master_port,
            backend="nccl" if self.spec.device == "cuda" else "gloo",
            timeout_s=self.spec.timeout_s,
            local_rank=self.placement.local_rank,
        )
        #: this rank's SP group (None without sequence parallelism) and the factor its backward's loss takes
        self.sequence_parallel, self._loss_scale = None, 1.0
        if self.spec.sequence_parallel_size > 1:
            from rlhf_sg.parallel import loss_scale, sequence_parallel_groups

            self.sequence_parallel = sequence_parallel_groups(self.spec.world_size, self.spec.sequence_parallel_size,
                                                              rank, self.spec.timeout_s)
            self._loss_scale = loss_scale(self.spec.sequence_parallel_size)
        #: where this rank's micro-batches go for the updates
        cuda = self.spec.device == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.ds_config = zero3_config(
            dtype=self.spec.dtype,
            offload=self.spec.offload,
            train=self.spec.train,
            max_grad_norm=self.spec.max_grad_norm,
            device=self.spec.device,
            stage=self.spec.zero_stage,
        )
        # Keep the reference alive while loading: transformers then builds the model partitioned (zero.Init)
        # instead of materialising it whole on every rank.
        self._hf_ds_config = HfDeepSpeedConfig(self.ds_config)
        model = self._load_model()
        optimizer = self._make_optimizer(model) if self.spec.train else None
        schedule = (lr_schedule(self.spec.lr_scheduler, self.spec.lr_warmup_steps, self.spec.lr_total_steps)
                    if self.spec.train else None)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule,
                                               config=self.ds_config)
        if self._plain_optimizer and self.spec.world_size == 1:
            # a group of one rank has no gradients to average, but DeepSpeed's stage-0 engine still flattens every
            # gradient into a bucket, all-reduces it alone and copies it back after each backward (a bfloat16 rank
            # is ZeRO stage 1, whose optimizer takes its gradients through that reduction: it keeps it)
            self.engine.enable_backward_allreduce = False
        if not self.spec.train:
            self.engine.eval()
        #: the start-up packing probe's max |Δ| per layout ({} when off); a model found wrong when packed now takes
        #: one sequence per row
        with counting_block_layers() as block_layers:
            self.packing_probe = (check_packing(self.module, self.spec.share_prompts and self.spec.role != "reward",
                                                reduce=self._max_over_ranks)
                                  if self.spec.packing_probe else {})
        layers = getattr(self.module.config.get_text_config(), "num_hidden_layers", None)  # a VLM's: its text model's
        if "shared" in self.packing_probe and (not layers or block_layers[0] < layers):
            # some layer of this model did not take the blocks in the probe's shared forward (windowed, softcapped,
            # with sinks, or handed a mask the model copied): its tree mask would then run at the blocks' long
            # segments, so the model keeps the tree mask and its segments
            stop_shared_prompt_attention(self.module)
        if self.sequence_parallel is not None:  # after the probe, which checks the packed forwards it wraps
            from rlhf_sg.parallel import use_ulysses_attention

            use_ulysses_attention(self.module, self.spec.sequence_parallel_size)
        self.syncer = None
        self._sync_setups = 0  # weight-sync set-ups so far (each gets group names of its own)
        self._profiler = None
        self._offloaded = False

    # ---- model -------------------------------------------------------------------------------------
    def _make_optimizer(self, model):
        return make_optimizer(model, self.spec)

    def _load_model(self):
        return load_worker_model(self.spec)

    @property
    def module(self):
        return self.engine.module

    def _max_over_ranks(self, values: list[float]) -> list[float]:
        """Each value's max over the group's ranks (one all-reduce; fails after the spec's timeout)."""
        import torch.distributed as dist

        packed = torch.tensor(values, dtype=torch.float64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            work = dist.all_reduce(packed, op=dist.ReduceOp.MAX, async_op=True)
            deadline = time.monotonic() + self.spec.timeout_s
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"packing-probe all-reduce did not finish within {self.spec.timeout_s:.0f} s")
                time.sleep(0.001)
            work.wait()
        return packed.tolist()

    def optimizer_state_bytes(self) -> dict[str, int]:
        """This rank's optimizer state: ``moments`` (the inner optimizer's per-parameter state: Adam's two
        moments) and ``master`` (ZeRO's fp32 partitions of the trained parameters), in bytes; ``trainable`` the
        trained parameters' element count (whole, all ranks)."""
        if not self.spec.train:
            return {"moments": 0, "master": 0, "trainable": 0}
        optimizer = self.engine.optimizer
        inner = getattr(optimizer, "optimizer", optimizer)
        moments = sum(t.nbytes for state in inner.state.values() for t in state.values() if torch.is_tensor(t)
                      and t.dim() > 0)
        # float32 masters: ZeRO-3's partition, or ZeRO stage 1's (an unpartitioned bfloat16 rank); an unpartitioned
        # float32 rank's torch optimizer steps the weights themselves and keeps none
        masters = (getattr(optimizer, "fp32_partitioned_groups_flat", None)
                   or getattr(optimizer, "single_partition_of_fp32_groups", []))
        master = sum(t.nbytes for t in masters)
        trainable = sum(math.prod(p.ds_shape) if hasattr(p, "ds_shape") else p.numel()
                        for p in self.module.parameters() if p.requires_grad)
        return {"moments": int(moments), "master": int(master), "trainable": int(trainable)}

    def ping(self) -> int:
        return self.rank

    def placement_seen(self) -> dict[str, Any]:
        """What this rank was placed on and what DeepSpeed took from it (for checks and logs)."""
        return {
            "rank": self.rank,
            "gpu_ids": list(self.placement.gpu_ids),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "local_device": self.placement.local_device,
            "local_rank_env": os.environ.get("LOCAL_RANK"),
            "deepspeed_local_rank": self.engine.local_rank,
            "node_address": self.placement.node_address,
            "master": (self.spec.master_addr, self.spec.master_port),
        }

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    # ---- forwards ------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, experience: Experience, plan: list[list[int]], temperature: float = 1.0,
                share_prompts: bool = False, without_adapter: bool = False):
        """Run this role's forward over the rows of ``plan`` (micro-batches of global row indices); with
        ``share_prompts`` rows with one prompt compute it once (log-probs and values).

        Returns (row indices, result): log-probs [n, T] (actor, ref, teacher), values [n, T] (critic) or
        scores [n] (reward), rows in the order of the flattened plan. Runs in eval mode: scoring forwards
        use no dropout, so old log-probs and values are the deterministic policy's (updates run in train mode).
        ``without_adapter`` (a LoRA actor): the base model's log-probs, the adapter disabled (the reference).
        """
        if without_adapter:
            from rlhf_sg.lora import adapter_disabled

            if self.spec.lora is None:
                raise ValueError(f"{self.spec.role} rank {self.rank}: without_adapter needs a LoRA model")
            with adapter_disabled(self.module):
                return self.forward(experience, plan, temperature, share_prompts)
        from rlhf_sg.packing import critic_values, response_logprobs, reward_scores

        self.engine.eval()
        width = experience.response_width
        outputs, order = [], []
        for micro in plan:
            mb = experience.rows(micro)
            if self.sequence_parallel is not None:
                outputs.append(self._sp_forward(mb, temperature, share_prompts).float().cpu())
                order.extend(micro)
                continue
            # routing replay: the policy's forwards; a LoRA actor's reference (the adapter off) routes live, as a
            # reference group of its own does
            if self.spec.role == "actor" and mb.routes is not None and not without_adapter:
                replay = self._route_replay()
                with replay.active():
                    out = response_logprobs(self.module, mb.sequences, mb.attention_mask, width, temperature,
                                            routes=mb.routes, replay=replay)
            elif self.spec.role in ("actor", "ref", "teacher"):
                out = response_logprobs(self.module, mb.sequences, mb.attention_mask, width, temperature,
                                        share_prompts=share_prompts, images=_images_of(self.module, mb))
            elif self.spec.role == "critic":
                out = critic_values(self.module, mb.sequences, mb.attention_mask, width, share_prompts=share_prompts)
            else:  # as a trained reward model was saved to score (rlhf_sg.models.REWARD_NORMALIZATION_FILE)
                out = self.module.normalize_rewards(reward_scores(self.module, mb.sequences, mb.attention_mask))
            outputs.append(out.float().cpu())
            order.extend(micro)
        result = torch.cat(outputs) if outputs else torch.empty(0)
        return order, result

    def _sp_forward(self, mb: Experience, temperature: float, share_prompts: bool) -> torch.Tensor:
        """A scoring forward of this rank's SP group: the whole micro-batch's log-probs, values or reward scores."""
        from rlhf_sg.parallel import sp_critic_values, sp_response_logprobs, sp_reward_scores

        _check_sequence_parallel(self.module, mb, mb.routes is not None and self.spec.role == "actor")
        if self.spec.role in ("actor", "ref", "teacher"):
            return sp_response_logprobs(self.module, mb.sequences, mb.attention_mask, mb.response_width,
                                        self.sequence_parallel, temperature, share_prompts=share_prompts)
        if self.spec.role == "critic":
            return sp_critic_values(self.module, mb.sequences, mb.attention_mask, mb.response_width,
                                    self.sequence_parallel, share_prompts=share_prompts)
        if self.spec.role == "reward":  # normalised, as the one-rank forward's
            return self.module.normalize_rewards(sp_reward_scores(self.module, mb.sequences, mb.attention_mask,
                                                                  self.sequence_parallel))
        raise ValueError(f"{self.spec.role}: this group does not run sequence parallelism; give it "
                         "sequence_parallel_size 1")

    # ---- training -----------------------------------------------------------------------------------
    def _route_replay(self):
        """This actor's :class:`rlhf_sg.moe.RouteReplay` (made once)."""
        if getattr(self, "_replay", None) is None:
            from rlhf_sg.moe import RouteReplay

            self._replay = RouteReplay(self.module)
        return self._replay

    def _run_updates(self, experience: Experience, steps: list[OptimizerStep], micro_loss,
                     prefix: str, scope=None) -> dict[str, float]:
        """The optimizer steps of one PPO phase: ``micro_loss(micro-batch on this rank's device, normalizer)
        -> (loss, metrics)``, metrics being per-token means of the micro-batch. Metrics are summed
        token-weighted on the device and reduced over the group's ranks once at the end (every rank returns
        the same values); ``{prefix}/lr`` is the rate of the last optimizer step. An optimizer step whose gradient
        norm is not finite (a NaN or Inf in the loss or gradients on any rank) is skipped by DeepSpeed's ZeRO-3
        optimizer on every rank, its gradients dropped and the LR schedule not advanced; ``{prefix}/skipped_updates``
        counts them, of ``{prefix}/updates``; ``{prefix}/grad_norm`` is the mean global gradient norm before
        clipping over the updates that were not skipped. Metrics weigh the tokens that count in the loss
        (:attr:`Experience.loss_rows`). ``scope``: a context manager that holds each micro-batch's forward and
        backward (routing replay's, whose recomputation under gradient checkpointing runs in the backward)."""
        with torch.profiler.record_function(f"{UPDATE_SPAN_PREFIX}{prefix}"):  # a profiled step's trace names it
            return self._run_update_steps(experience, steps, micro_loss, prefix, scope)

    def _run_update_steps(self, experience: Experience, steps: list[OptimizerStep], micro_loss, prefix: str,
                          scope) -> dict[str, float]:
        self.engine.train()
        device = self.device
        skipped_before = self.engine.skipped_steps
        sums: dict[str, torch.Tensor] = {}
        weights: dict[str, torch.Tensor] = {}
        lr, grad_norms = 0.0, []
        for step in steps:
            for i, micro in enumerate(step.plan):
                self.engine.set_gradient_accumulation_boundary(i == len(step.plan) - 1)
                mb = experience.rows(micro).to(device)
                with scope() if scope is not None else contextlib.nullcontext():
                    loss, metrics = micro_loss(mb, step.normalizer)
                    # x N under sequence parallelism: ZeRO-3 then sums the SP group (rlhf_sg.parallel.groups)
                    self.engine.backward(loss * self._loss_scale, scale_wrt_gas=False)
                tokens = loss_tokens(mb)
                for k, v in metrics.items():
                    sums[k] = sums[k] + v.detach() * tokens if k in sums else v.detach() * tokens
                    weights[k] = weights[k] + tokens if k in weights else tokens
            lr = float(self.engine.get_lr()[0])
            self.engine.step()
            # the global norm before clipping (the same on every rank); inf on a skipped step
            norm = self.engine.get_global_grad_norm()
            if norm is not None and math.isfinite(float(norm)):
                grad_norms.append(float(norm))
        means = allreduce_weighted_means(sums, weights, self.spec.timeout_s)
        if grad_norms:
            means["grad_norm"] = sum(grad_norms) / len(grad_norms)
        return {**{f"{prefix}/{k}": v for k, v in means.items()}, f"{prefix}/lr": lr,
                f"{prefix}/updates": float(len(steps)),
                f"{prefix}/skipped_updates": float(self.engine.skipped_steps - skipped_before)}

    def train_actor(self, experience: Experience, steps: list[OptimizerStep], update: ActorUpdate) -> dict[str, float]:
        """PPO policy updates over ``steps`` (this rank's part of each optimizer step)."""
        if not update.old_logp_from_update:
            experience.require("old_logp", why="the actor's update compares against the old log-probs; compute "
                                               "them with a scoring forward (or set old_logp_from_update)")
        experience.require("advantages", why="compute the advantages before the actor's update")
        replay = self._route_replay() if experience.routes is not None else None
        return self._run_updates(experience, steps,
                                 lambda mb, norm: actor_microbatch_loss(self.engine, mb, update, norm, replay,
                                                                        self.sequence_parallel),
                                 "actor", scope=replay.active if replay is not None else None)

    def train_critic(self, experience: Experience, steps: list[OptimizerStep],
                     update: CriticUpdate) -> dict[str, float]:
        """Value updates over ``steps`` (this rank's part of each optimizer step)."""
        experience.require("values", "returns", why="the critic's update needs its old values and the returns")
        return self._run_updates(experience, steps,
                                 lambda mb, norm: critic_microbatch_loss(self.engine, mb, update, norm,
                                                                         self.sequence_parallel), "critic")

    # ---- weight sync (actor) --------------------------------------------------------------------------
    def setup_weight_sync(self, engines: list, transport: str, bucket_bytes: int, timeout_s: float) -> None:
        """Set up the weight sync into ``engines``; called again after an engine restart, it first leaves the old
        side groups (an engine that died cannot answer: its part is skipped)."""
        from rlhf_sg.engine_actor import EngineCallError
        from rlhf_sg.sync import WeightSyncer

        if self.syncer is not None:
            try:
                self.syncer.close()
            except EngineCallError as e:
                warnings.warn(f"actor rank {self.rank}: leaving the old weight-sync groups: {e}", stacklevel=1)
        # torch.distributed keeps every group name a process has used: each set-up gets new names
        self._sync_setups += 1
        self.syncer = WeightSyncer(
            rank=self.rank,
            world_size=self.spec.world_size,
            engines=engines,
            transport=transport,
            bucket_bytes=bucket_bytes,
            timeout_s=timeout_s,
            group_name=f"weight-sync{self._sync_setups}",
            lora=self._lora_spec(),
        )
        self.syncer.setup()

    def _lora_spec(self):
        if self.spec.lora is None:
            return None
        from rlhf_sg.lora import LoraSpec

        return LoraSpec.from_config(self.spec.lora)

    def sync_weights(self, version: int, release_buffers: bool = False) -> dict[str, float]:
        """Push the weights as ``version``. ``release_buffers`` (colocated runs, before the engines' KV cache
        wakes): free the sync's buffers afterwards and return the cached device memory they took."""
        if self.syncer is None:
            raise RuntimeError(f"actor rank {self.rank}: setup_weight_sync was not called")
        # sleeping engines may have dropped their weights: an adapter sync sends the base first
        stats = self.syncer.sync(self.engine, version, with_base=release_buffers)
        if release_buffers:
            self.syncer.release_buffers()
            self.release_device_cache()
        return stats

    def release_device_cache(self) -> int:
        """Return the blocks torch's caching allocator holds unused on the device (the memory of freed forwards'
        activations, freed sync buffers) to the driver, so a colocated engine can map it; the bytes returned
        (0 on CPU)."""
        if self.spec.device != "cuda":
            return 0
        before = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        return before - torch.cuda.memory_reserved()

    # ---- device memory while the engines generate (colocated layouts) ----------------------------------
    def offload_states(self, keep_params: bool = False) -> int:
        """Move this rank's ZeRO-3 training states (parameters, gradients, optimizer) to host memory so a
        colocated engine can use the device; returns the device bytes freed. ``keep_params``: leave the
        parameter shards (DeepSpeed's ``lp_params``, the smallest part) on the device for a weight sync to
        gather; a later call without it moves them too. On CPU there is nothing to move (every state already
        lives in host memory) and it returns 0."""
        if self.spec.device != "cuda" or not self.spec.train:
            return 0
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

        keep = {OffloadStateTypeEnum.lp_params} if keep_params else set()
        before = torch.cuda.memory_allocated()
        if self._plain_optimizer:
            self._move_plain_states(torch.device("cpu"), keep_params)
        else:  # DeepSpeed skips the states already off the device
            self.engine.offload_states(include=[s for s in OffloadStateTypeEnum if s not in keep], pin_memory=True,
                                       non_blocking=False)
        torch.cuda.synchronize()
        self._offloaded = True
        return before - torch.cuda.memory_allocated()

    @property
    def _plain_optimizer(self) -> bool:
        """An unpartitioned float32 rank: the engine's optimizer is the torch one, with no state-moving API."""
        return self.spec.zero_stage == 0 and self.spec.dtype == "float32"

    def _move_plain_states(self, device: torch.device, keep_params: bool) -> None:
        """Move an unpartitioned rank's parameters (unless ``keep_params``), gradients and optimizer states to
        ``device``, in place (the optimizer and the engine keep the same parameter objects)."""
        for p in self.module.parameters():
            if not keep_params:
                p.data = p.data.to(device)
            if p.grad is not None:
                p.grad = p.grad.to(device)
        for state in self.engine.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    state[key] = value.to(device)

    def reload_states(self) -> int:
        """Bring back what :meth:`offload_states` moved; returns the device bytes taken again."""
        if not self._offloaded:
            return 0
        before = torch.cuda.memory_allocated()
        if self._plain_optimizer:
            self._move_plain_states(self.device, keep_params=False)
        else:
            self.engine.reload_states(non_blocking=False)
        torch.cuda.synchronize()
        self._offloaded = False
        return torch.cuda.memory_allocated() - before

    def resources(self) -> dict[str, Any]:
        """Where Ray placed this rank: node, pid, placement group and the resources it holds."""
        import ray

        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "pid": os.getpid(), "resources": ctx.get_assigned_resources(),
                "placement_group_id": ctx.get_placement_group_id(),
                "gradient_checkpointing": bool(getattr(self.module, "is_gradient_checkpointing", False))}

    # ---- checkpoints ----------------------------------------------------------------------------------
    def save_checkpoint(self, path: str, tag: str, client_state: dict[str, Any]) -> None:
        state = dict(client_state, torch_rng=torch.get_rng_state())
        if torch.cuda.is_available():
            state["cuda_rng"] = torch.cuda.get_rng_state_all()
        # a LoRA actor: the adapter and its optimizer state, not the frozen base (the run's --model.pretrain)
        self.engine.save_checkpoint(path, tag=tag, client_state=state,
                                    exclude_frozen_parameters=self.spec.lora is not None)

    def load_checkpoint(self, path: str, tag: str) -> dict[str, Any]:
        """Load ``path/tag`` (DeepSpeed's checkpoint of this group) and return its client state. One written under
        the other partitioning (ZeRO-3 or an unpartitioned rank: ``--train.single_rank_zero3`` switched between
        runs) is converted first, beside it (:mod:`rlhf_sg.checkpoint_convert`); a ZeRO-3 engine and a bfloat16
        unpartitioned one (ZeRO stage 1) load the conversion as DeepSpeed's universal checkpoint. The conversion is
        removed once loaded (the next checkpoint is written in this rank's own format; the original stays)."""
        from rlhf_sg.checkpoint_convert import is_universal, partitioning_of

        written = partitioning_of(os.path.join(path, tag))
        converted = written is not None and written != self._partitioning
        if converted:
            tag = self._convert_checkpoint(path, tag, written)
        config = self.engine._config
        loads_universal = config.load_universal_checkpoint
        config.load_universal_checkpoint = converted and is_universal(os.path.join(path, tag))
        try:
            load_path, client_state = self.engine.load_checkpoint(path, tag=tag,
                                                                  load_module_strict=self.spec.lora is None)
        finally:
            config.load_universal_checkpoint = loads_universal
            if converted:
                shutil.rmtree(os.path.join(path, tag), ignore_errors=True)
        if load_path is None:
            raise FileNotFoundError(f"{self.spec.role} rank {self.rank}: no DeepSpeed checkpoint {tag!r} in {path}")
        if "torch_rng" in client_state:
            torch.set_rng_state(client_state.pop("torch_rng"))
        cuda_rng = client_state.pop("cuda_rng", None)
        if cuda_rng is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda_rng)
        return client_state

    @property
    def _partitioning(self) -> str:
        """How this rank writes its checkpoints (:data:`rlhf_sg.checkpoint_convert.ZERO3` or ``PLAIN``)."""
        from rlhf_sg.checkpoint_convert import PLAIN, ZERO3

        return ZERO3 if self.spec.zero_stage == 3 else PLAIN

    def _convert_checkpoint(self, path: str, tag: str, written: str) -> str:
        """Convert ``path/tag``, written under the other partitioning, for this rank; returns the converted tag.
        Raises RuntimeError naming the flag for what the conversion does not cover."""
        from rlhf_sg.checkpoint_convert import conversion_refused, convert_checkpoint

        directory = os.path.join(path, tag)
        refused = conversion_refused(directory, written, self.spec.role, self.spec.world_size)
        if refused:
            raise RuntimeError(refused)
        shapes = {name: getattr(p, "ds_shape", p.shape) for name, p in self.module.named_parameters()
                  if p.requires_grad}
        converted = convert_checkpoint(path, tag, self._partitioning, shapes, self.spec.dtype)
        log.warning("%s rank %d: converted the %s checkpoint %s for this %s rank into %s", self.spec.role, self.rank,
                    written, directory, self._partitioning, os.path.join(path, converted))
        return converted

    def export_hf(self, path: str) -> str | None:
        """Gather the full weights one tensor at a time and save an HF checkpoint from rank 0. A LoRA actor writes
        a PEFT adapter directory there instead (:meth:`export_lora`)."""
        if self.spec.lora is not None:
            return self.export_lora(path)
        import deepspeed

        state = {}
        for name, param in self.module.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                if self.rank == 0:
                    state[name] = param.data.detach().to("cpu", copy=True)
        if self.rank != 0:
            return None
        os.makedirs(path, exist_ok=True)
        self.module.save_pretrained(path, state_dict=state, safe_serialization=True)
        return path

    def export_lora(self, path: str, merged_path: str | None = None) -> str | None:
        """A LoRA actor's adapter as PEFT saves one (adapter_model.safetensors, adapter_config.json) in ``path``,
        and with ``merged_path`` (--lora.export_merged) the merged model (``W + scaling * B @ A``, in fp32, cast
        to the base dtype) as an HF checkpoint there; gathered one tensor at a time, written by rank 0."""
        from rlhf_sg.lora import LoraSpec, adapter_name, merged_state_dict, split_lora, write_adapter_dir
        from rlhf_sg.sync import gathered, hf_name

        spec = LoraSpec.from_config(self.spec.lora)
        _, _, lora_named = split_lora([(hf_name(n), p) for n, p in self.module.named_parameters()])
        adapter = {}
        for name, param in lora_named:
            with gathered([param]):
                if self.rank == 0:
                    adapter[adapter_name(name)] = param.data.detach().to("cpu", copy=True)
        merged = merged_state_dict(self.module, spec, keep=self.rank == 0) if merged_path is not None else {}
        if self.rank != 0:
            return None
        write_adapter_dir(path, adapter, spec, self.spec.model_path)
        if merged_path is not None:
            os.makedirs(merged_path, exist_ok=True)
            self.module.get_base_model().save_pretrained(merged_path, state_dict=merged, safe_serialization=True)
        return path

    # ---- profiling ------------------------------------------------------------------------------------
    def start_profile(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        # shapes: `bench train-profile` counts each matmul's FLOPs from them
        self._profiler = profile(activities=activities, record_shapes=True)
        self._profiler.__enter__()

    def stop_profile(self, directory: str, name: str) -> str | None:
        """Stop the profiler and write this rank's Chrome trace, ``directory/name.rank{r}.json``."""
        if self._profiler is None:
            return None
        self._profiler.__exit__(None, None, None)
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{name}.rank{self.rank}.json")
        self._profiler.export_chrome_trace(path)
        self._profiler = None
        if not os.path.isfile(path):
            raise RuntimeError(f"{self.spec.role} rank {self.rank}: the profiler wrote no trace at {path}")
        return path


@dataclass
class SharedBundles:
    """A placement group whose bundles several groups share (colocation): rank ``i`` of every tenant
    group goes on bundle ``i`` and holds ``1 / tenants`` of its CPU (and GPU), so Ray puts, say, actor
    rank 0, reference rank 0 and engine 0 in one process slot on one device."""

    pg: Any
    size: int
    tenants: int
    device: str

    @classmethod
    def create(cls, size: int, tenants: int, device: str, strategy: str, timeout_s: float) -> SharedBundles:
        import ray
        from ray.util.placement_group import placement_group

        bundle = {"CPU": 1.0, **({"GPU": 1.0} if device == "cuda" else {})}
        pg = placement_group([dict(bundle) for _ in range(size)], strategy=strategy)
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise TimeoutError(
                f"colocated placement group ({size} bundles of {bundle}) not ready within {timeout_s:.0f} s: "
                "the Ray cluster lacks the CPUs/GPUs"
            ) from e
        return cls(pg=pg, size=size, tenants=tenants, device=device)

    @property
    def num_cpus(self) -> float:
        return 1.0 / self.tenants

    @property
    def num_gpus(self) -> float:
        return 1.0 / self.tenants if self.device == "cuda" else 0.0

    def strategy(self, bundle: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not 0 <= bundle < self.size:
            raise ValueError(f"bundle {bundle} outside the shared placement group of {self.size}")
        return PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle)

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.pg)


def wait_ranks(calls: list[tuple[str, int, Any]], phase: str, timeout_s: float) -> list[Any]:
    """Results of remote rank calls ``(group role, rank, object ref)``, in order. A call that fails is re-raised
    as soon as it fails, naming its group and rank (a rank whose process died as RuntimeError), without waiting
    for the others: they are often stuck waiting for it (a collective, a rendezvous) until their own timeout.
    Raises TimeoutError naming the phase and every rank that had not answered within ``timeout_s``
    (--train.timeout_s)."""
    import ray

    where = {ref: (role, rank) for role, rank, ref in calls}
    results: dict[Any, Any] = {}
    pending = list(where)
    deadline = time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            late = set(pending)
            stuck = ", ".join(f"{role} rank {rank}" for role, rank, ref in calls if ref in late)
            raise TimeoutError(
                f"{phase}: no answer within {timeout_s:.0f} s (--train.timeout_s) from {stuck}; that rank is stuck "
                "(a collective waiting for a rank that died, a hung reward or engine) or the cluster lacks the "
                "resources"
            )
        for ref in ready:
            role, rank = where[ref]
            try:
                results[ref] = ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError as e:
                raise RuntimeError(f"{phase}: {role} rank {rank} died: {e}") from e
            except Exception as e:  # the call raised: its own error, with where it came from
                e.add_note(f"{phase}: raised by {role} rank {rank}")
                raise
    return [results[ref] for _, _, ref in calls]


#: how many times a group starts its ranks when the rendezvous port it picked is taken before rank 0 binds it
RENDEZVOUS_TRIES = 3


class ModelGroup:
    """``world_size`` :class:`ModelWorker` ranks of one role, placed by a Ray placement group: its own
    (one bundle per rank), or ``shared`` bundles it holds a share of (colocation; not removed here)."""

    #: the rank class (a subclass adds methods: :mod:`rlhf_sg.stages`)
    worker: type = ModelWorker

    def __init__(self, spec: WorkerSpec, num_cpus: float = 1.0, num_gpus: float = 0.0, strategy: str = "PACK",
                 runtime_env: dict | None = None, shared: SharedBundles | None = None, wait: bool = True):
        """Start the ranks; with ``wait`` (the default) return once every rank has loaded its model, otherwise at
        once, and :meth:`wait_started` waits (groups then load their models at the same time)."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.spec = spec
        self.timeout_s = spec.timeout_s
        self.owns_pg = shared is None
        if shared is None:
            bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
            self.pg = placement_group([dict(bundle) for _ in range(spec.world_size)], strategy=strategy)
            self._get([self.pg.ready()], "placement group ready (not enough CPUs/GPUs in the Ray cluster?)")
            strategies = [PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i)
                          for i in range(spec.world_size)]
        else:
            if spec.world_size > shared.size:
                raise ValueError(f"{spec.role}: {spec.world_size} ranks do not fit {shared.size} shared bundles")
            self.pg = shared.pg
            num_cpus, num_gpus = shared.num_cpus, shared.num_gpus
            strategies = [shared.strategy(i) for i in range(spec.world_size)]
        env = {"env_vars": {"OMP_NUM_THREADS": str(spec.threads), "TOKENIZERS_PARALLELISM": "false"}}
        if spec.device == "cpu":
            env["env_vars"]["DS_ACCELERATOR"] = "cpu"
        if runtime_env:
            env["env_vars"].update(runtime_env.get("env_vars", {}))
        self._options = [dict(num_cpus=num_cpus, num_gpus=num_gpus, runtime_env=env, scheduling_strategy=strategy)
                         for strategy in strategies]
        #: the group picks its rendezvous (rank 0's node, a port free there) and picks again when the port is
        #: taken before rank 0 binds it; a rendezvous given in the spec is used as it is
        self.picks_rendezvous = not spec.master_addr
        self._launch()
        if wait:
            self.wait_started()

    def _launch(self) -> None:
        import ray

        if self.picks_rendezvous:
            # rank 0's node and a port free there: ranks on other nodes reach it, loopback they would not
            from rlhf_sg.placement import rendezvous_for_bundle

            host, port = rendezvous_for_bundle(self.pg, 0, self.timeout_s)
            self.spec = replace(self.spec, master_addr=host, master_port=port)
        cls = ray.remote(self.worker)
        self.workers = [cls.options(**options).remote(asdict(self.spec), i) for i, options in enumerate(self._options)]
        self._started = [w.ping.remote() for w in self.workers]

    def wait_started(self) -> None:
        """Wait until every rank has loaded its model and joined its process group (at most ``timeout_s``). When
        another process took the port the group picked before its rank 0 bound it
        (:class:`rlhf_sg.distributed.RendezvousPortTaken`), the ranks start again on another port, at most
        :data:`RENDEZVOUS_TRIES` times in all."""
        import ray

        for attempt in range(1, RENDEZVOUS_TRIES + 1):
            if not self._started:
                return
            refs, self._started = self._started, []
            try:
                self._get(refs, "start-up")
                return
            except Exception as e:
                if not (self.picks_rendezvous and "RendezvousPortTaken" in str(e) and attempt < RENDEZVOUS_TRIES):
                    raise
                log.warning("%s: rendezvous port %d on %s was taken by another process before rank 0 bound it; "
                            "starting the %d ranks again on another port (try %d of %d)", self.spec.role,
                            self.spec.master_port, self.spec.master_addr, self.spec.world_size, attempt + 1,
                            RENDEZVOUS_TRIES)
                for w in self.workers:  # the other ranks wait to meet at the taken port
                    ray.kill(w, no_restart=True)
                self._launch()

    def _get(self, refs, what: str):
        return wait_ranks([(self.spec.role, i, ref) for i, ref in enumerate(refs)], what, self.timeout_s)

    def call(self, method: str, *args, what: str | None = None, per_rank: list[tuple] | None = None, **kwargs):
        """Call ``method`` on every rank (the same args, or ``per_rank[i]`` for rank i) and wait."""
        refs = []
        for i, w in enumerate(self.workers):
            a = per_rank[i] if per_rank is not None else args
            refs.append(getattr(w, method).remote(*a, **kwargs))
        return self._get(refs, what or method)

    def forward(self, batch_ref, plans: list[list[list[int]]], batch_size: int, temperature: float = 1.0,
                share_prompts: bool = False, without_adapter: bool = False):
        """Results of every rank reassembled in global row order: [B, T] or [B]. ``plans``: one per data-parallel
        rank (every rank of an SP group runs its data-parallel rank's, :mod:`rlhf_sg.parallel.groups`).
        ``without_adapter``: a LoRA actor's base model (the reference)."""
        from rlhf_sg.parallel.groups import rank_plans

        size = self.spec.sequence_parallel_size
        if len(plans) * size != len(self.workers):
            raise ValueError(f"{self.spec.role}: {len(plans)} plans for {len(self.workers)} ranks in SP groups of "
                             f"{size}; give one plan per data-parallel rank")
        plans = rank_plans(plans, size)
        results = self.call("forward", per_rank=[(batch_ref, plans[i], temperature, share_prompts, without_adapter)
                                                 for i in range(len(plans))])
        out = None
        for order, tensor in results[::size]:  # an SP group's ranks each return the group's result
            if not order:
                continue
            if out is None:
                out = torch.zeros((batch_size, *tensor.shape[1:]), dtype=tensor.dtype)
            out[torch.as_tensor(order)] = tensor
        return out

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for w in self.workers:
            ray.kill(w)
        if self.owns_pg:
            remove_placement_group(self.pg)
