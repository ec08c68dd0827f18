"""The ranks a stage trains on: one in this process (no Ray, no DeepSpeed: a whole model and a torch AdamW that
clips and skips a non-finite step as ZeRO's optimizer does), or a Ray group of the trainer's own workers
(:class:`rlhf_sg.workers.ModelWorker`: ZeRO-3 ranks, or one unpartitioned rank) with the stage's methods added.
Both answer the same calls (``stage_train``, ``stage_score``, ``set_reward_stats``, ``save_checkpoint``,
``load_checkpoint``, ``export_hf``) through ``call``, as a :class:`rlhf_sg.workers.ModelGroup` does, so the
controller and :mod:`rlhf_sg.trainer.checkpoint` drive either one alike.

With ``--lora.rank`` the trained model is a PEFT model (:func:`rlhf_sg.lora.apply_lora`): only the adapters (and a
reward model's value head) train, checkpoints hold those alone, and the export is the merged model
(:func:`rlhf_sg.lora.merged_state_dict`), which loads where the stage's model is used next as any model does."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from rlhf_sg.experience import OptimizerStep
from rlhf_sg.packing import unwrap_adapters
from rlhf_sg.stages.steps import StageBatch, StageLoss, run_updates, score_rows
from rlhf_sg.workers import ModelGroup, ModelWorker, WorkerSpec, lr_schedule, skipping

log = logging.getLogger("rlhf_sg")


def export_merged(module: torch.nn.Module, spec: WorkerSpec, path: str | None) -> str | None:
    """Write a LoRA model's merged weights as its base model saves them (a causal LM, or a value model with its head
    and statistics) to ``path``; every rank calls it (the gathers are collective), ``path`` None on all but the
    writer."""
    from rlhf_sg.lora import LoraSpec, merged_state_dict

    merged = merged_state_dict(module, LoraSpec.from_config(spec.lora), keep=path is not None)
    if path is None:
        return None
    os.makedirs(path, exist_ok=True)
    unwrap_adapters(module).save_pretrained(path, state_dict=merged, safe_serialization=True)
    return path


class PlainEngine:
    """A whole model and its optimizer behind the calls :func:`rlhf_sg.stages.steps.run_updates` makes of a
    DeepSpeed engine. The optimizer is a :class:`rlhf_sg.workers.NonFiniteSkip` one: a non-finite gradient norm
    skips the step (counted in ``skipped_steps``) and leaves the LR schedule where it was."""

    def __init__(self, module: torch.nn.Module, optimizer, scheduler):
        self.module, self.optimizer, self.scheduler = module, optimizer, scheduler
        self.skipped_steps = 0

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()

    def set_gradient_accumulation_boundary(self, boundary: bool) -> None:
        """Gradients accumulate in ``.grad`` until :meth:`step`; nothing to mark."""

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = False) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()
        if self.optimizer.overflow:
            self.skipped_steps += 1
        else:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float:
        return self.optimizer._global_grad_norm


class LocalRank:
    """One rank in this process, for ``spec`` (float32; ``spec.train`` or forward-only)."""

    def __init__(self, spec: WorkerSpec):
        from rlhf_sg.probe import check_packing
        from rlhf_sg.workers import load_worker_model

        self.spec = spec
        torch.manual_seed(spec.seed)
        cuda = spec.device == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.model = load_worker_model(spec).to(self.device)
        self.engine = None
        if spec.train:
            params = [p for p in self.model.parameters() if p.requires_grad]
            optimizer = skipping(torch.optim.AdamW, spec.max_grad_norm)(
                params, lr=spec.lr, weight_decay=spec.weight_decay, betas=(0.9, 0.95))
            scheduler = lr_schedule(spec.lr_scheduler, spec.lr_warmup_steps, spec.lr_total_steps)(optimizer)
            self.engine = PlainEngine(self.model, optimizer, scheduler)
        self.model.eval()
        self.packing_probe = check_packing(self.model, False) if spec.packing_probe else {}

    @property
    def module(self) -> torch.nn.Module:
        return self.model

    def call(self, method: str, *args, what: str | None = None, per_rank: list[tuple] | None = None, **kwargs):
        """As :meth:`rlhf_sg.workers.ModelGroup.call`: the results of the (one) rank, in a list."""
        return [getattr(self, method)(*(per_rank[0] if per_rank is not None else args), **kwargs)]

    def stage_train(self, batch: StageBatch, steps: list[OptimizerStep], spec: StageLoss) -> dict[str, float]:
        return run_updates(self.engine, self.model, batch, steps, spec, self.device, self.spec.timeout_s)

    def stage_score(self, batch: StageBatch, plan: list[list[int]], what: str) -> tuple[list[int], torch.Tensor]:
        self.model.eval()
        return score_rows(self.model, batch, plan, what)

    def set_reward_stats(self, mean: float, std: float) -> None:
        model = unwrap_adapters(self.model)
        model.reward_mean, model.reward_std = float(mean), float(std)

    def _trained_names(self) -> set[str]:
        return {n for n, p in self.model.named_parameters() if p.requires_grad}

    def save_checkpoint(self, path: str, tag: str, client_state: dict[str, Any]) -> None:
        os.makedirs(os.path.join(path, tag), exist_ok=True)
        weights = self.model.state_dict()
        if self.spec.lora is not None:  # the adapters (and a value head), not the frozen base (--model.pretrain)
            trained = self._trained_names()
            weights = {k: v for k, v in weights.items() if k in trained}
        state = {"model": weights, "client_state": client_state, "torch_rng": torch.get_rng_state()}
        if self.engine is not None:
            state.update(optimizer=self.engine.optimizer.state_dict(), scheduler=self.engine.scheduler.state_dict(),
                         skipped_steps=self.engine.skipped_steps)
        torch.save(state, os.path.join(path, tag, "rank0.pt"))

    def load_checkpoint(self, path: str, tag: str) -> dict[str, Any]:
        file = os.path.join(path, tag, "rank0.pt")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{self.spec.role}: no in-process checkpoint {file}; it was written by another "
                                    "layout (--train.num_ranks / --train.in_process) or is missing")
        state = torch.load(file, map_location=self.device, weights_only=False)
        missing, unexpected = self.model.load_state_dict(state["model"], strict=self.spec.lora is None)
        trained = self._trained_names()
        if unexpected or trained & set(missing):
            raise RuntimeError(f"{self.spec.role}: the checkpoint {file} does not fit this model's trained weights "
                               f"(missing {sorted(trained & set(missing))[:3]}, unexpected {unexpected[:3]}); it "
                               "was written with other --lora.* settings")
        if self.engine is not None:
            self.engine.optimizer.load_state_dict(state["optimizer"])
            self.engine.scheduler.load_state_dict(state["scheduler"])
            self.engine.skipped_steps = state["skipped_steps"]
        torch.set_rng_state(state["torch_rng"])
        return state["client_state"]

    def export_hf(self, path: str) -> str:
        if self.spec.lora is not None:
            return export_merged(self.model, self.spec, path)
        os.makedirs(path, exist_ok=True)
        self.model.save_pretrained(path, safe_serialization=True)
        return path

    def shutdown(self) -> None:
        self.model = self.engine = None


class StageWorker(ModelWorker):
    """A ZeRO-3 (or unpartitioned) rank of :class:`rlhf_sg.workers.ModelWorker` with the stage's calls."""

    def stage_train(self, batch: StageBatch, steps: list[OptimizerStep], spec: StageLoss) -> dict[str, float]:
        return run_updates(self.engine, self.engine, batch, steps, spec, self.device, self.spec.timeout_s)

    def stage_score(self, batch: StageBatch, plan: list[list[int]], what: str) -> tuple[list[int], torch.Tensor]:
        self.engine.eval()
        return score_rows(self.engine, batch, plan, what)

    def set_reward_stats(self, mean: float, std: float) -> None:
        model = unwrap_adapters(self.module)
        model.reward_mean, model.reward_std = float(mean), float(std)

    def export_hf(self, path: str) -> str | None:
        """The gathered model as an HF checkpoint from rank 0; a LoRA model merged (not the actor's adapter
        directory of :meth:`rlhf_sg.workers.ModelWorker.export_hf`: a stage's export is loaded as a model)."""
        if self.spec.lora is None:
            return super().export_hf(path)
        return export_merged(self.module, self.spec, path if self.rank == 0 else None)


class StageGroup(ModelGroup):
    """A :class:`rlhf_sg.workers.ModelGroup` of :class:`StageWorker` ranks."""

    worker = StageWorker


def start_ranks(spec: WorkerSpec, in_process: bool):
    """The ranks of ``spec``: a :class:`LocalRank` (``in_process``, one rank) or a :class:`StageGroup` on Ray
    (started here when no Ray runs yet, as the trainer starts it)."""
    if in_process:
        return LocalRank(spec)
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, spec.world_size), include_dashboard=False,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false",
                                           "PYTHONPATH": os.pathsep.join([os.getcwd(),
                                                                          os.environ.get("PYTHONPATH", "")])}})
    log.info("starting %d %s rank(s) on Ray (%s)", spec.world_size, spec.role,
             "ZeRO-3" if spec.zero_stage == 3 else "unpartitioned")
    return StageGroup(spec, num_cpus=1.0, num_gpus=1.0 if spec.device == "cuda" else 0.0)
