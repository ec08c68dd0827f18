"""Where every rank and engine goes: the groups a run starts, which of them share devices, and the
threads and Ray resources each gets. Pure arithmetic on the config; nothing here starts a process."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from rlhf_sg.config import (
    Config,
    engines_on_servers,
    lr_warmup_steps,
    optimizer_steps,
    ref_in_actor,
    rollout_is_async,
    sequence_parallel_size,
    shares_prompts,
    sleep_engines,
    uses_critic_model,
)


@dataclass(frozen=True)
class Layout:
    cfg: Config

    @property
    def uses_critic(self) -> bool:
        return uses_critic_model(self.cfg)

    @property
    def uses_ref(self) -> bool:
        return self.cfg.train.kl_coef > 0

    @property
    def ref_in_actor(self) -> bool:
        """The LoRA actor computes the reference log-probs with its adapter disabled; no reference group."""
        return ref_in_actor(self.cfg)

    @property
    def ref_group(self) -> bool:
        return self.uses_ref and not self.ref_in_actor

    @property
    def uses_teacher(self) -> bool:
        """On-policy distillation: a teacher group scores the samples (``--distill.teacher``)."""
        return self.cfg.distill.teacher is not None

    @property
    def uses_reward_model(self) -> bool:
        return self.cfg.reward.kind == "model"

    @property
    def engine_gpus(self) -> float:
        """GPUs Ray gives each engine actor: tensor_parallel_size on CUDA; none on CPU, nor for an engine that
        drives inference servers running elsewhere (it only talks HTTP, and a GPU asked for here would leave it
        unscheduled, or hold GPUs of the trainer's cluster idle)."""
        if self.cfg.train.device != "cuda" or engines_on_servers(self.cfg):
            return 0.0
        return float(self.cfg.rollout.tensor_parallel_size)

    def group_sizes(self) -> dict[str, int]:
        """Ranks of every group this run starts (engines included)."""
        t = self.cfg.train
        sizes = {"actor": t.actor_num_ranks, "engines": self.cfg.rollout.num_engines}
        if self.uses_critic:
            sizes["critic"] = t.critic_num_ranks
        if self.ref_group:
            sizes["ref"] = t.ref_num_ranks
        if self.uses_teacher:
            sizes["teacher"] = self.cfg.distill.num_ranks
        if self.uses_reward_model:
            sizes["reward"] = self.cfg.reward.num_ranks
        return sizes

    def colocation(self) -> list[list[str]]:
        """The sets of groups that share devices: rank i of each group in a set on bundle i. A teacher sits where
        the reference does (beside the actor with ``colocate_actor_ref``)."""
        t, sizes = self.cfg.train, self.group_sizes()
        if t.colocate_all:
            return [[g for g in ("actor", "ref", "teacher", "critic", "reward", "engines") if g in sizes]]
        sets = []
        if t.colocate_actor_ref:
            sets.append([g for g in ("actor", "ref", "teacher") if g in sizes])
        if t.colocate_critic_reward:
            sets.append(["critic", "reward"])
        return sets

    def cpus_needed(self) -> int:
        """One Ray CPU per bundle: a rank or engine of its own, or a bundle a colocated set shares."""
        sizes, shared = self.group_sizes(), self.colocation()
        alone = sum(n for g, n in sizes.items() if not any(g in s for s in shared))
        return alone + sum(max(sizes[g] for g in s) for s in shared)

    def overlaps_rollout(self) -> bool:
        """Whether the engines generate while the trainer trains (async rollout on separate placement)."""
        return rollout_is_async(self.cfg)

    def _cpu_share(self, processes: int) -> int:
        """Threads for each of ``processes`` processes that compute at the same time on this machine's cores."""
        return max(1, (os.cpu_count() or 1) // max(processes, 1))

    def engine_threads(self) -> int:
        """Torch threads per engine. A sync step takes turns: while the engines generate, every model rank
        waits, so on CPU the engines may share all the cores (one thread each left them idle: measured with
        ``python -m rlhf_sg.bench e2e``, generation took 1.3x longer than with the cores shared). With async
        rollout the engines generate while the actor (and critic) train: the cores are split among them all."""
        r = self.cfg.rollout
        if r.engine_threads is not None:
            return r.engine_threads
        if self.cfg.train.device != "cpu":
            return 1
        if self.overlaps_rollout():
            return self._cpu_share(r.num_engines + self._training_ranks())
        return self._cpu_share(r.num_engines)

    def _training_ranks(self) -> int:
        """The ranks that train at the same time: the actor's and, with a critic, the critic's (their updates run
        together)."""
        t = self.cfg.train
        return t.actor_num_ranks + (t.critic_num_ranks if self.uses_critic else 0)

    def worker_threads(self, role: str) -> int:
        """Torch threads per rank of ``role``: ``--train.worker_threads`` when set; on GPU 1 (the device
        computes); on CPU the cores shared among the ranks that compute at the same time. A sync step's phases
        take turns (generate, score, train, sync), so the actor and critic ranks, which train together, share
        every core, and a reference or reward-model group, whose forwards run alone, has every core to itself;
        with async rollout the engines generate during training and scoring, so every rank shares the cores
        with them."""
        t = self.cfg.train
        if t.worker_threads is not None:
            return t.worker_threads
        if t.device != "cpu":
            return 1
        engines = self.cfg.rollout.num_engines if self.overlaps_rollout() else 0
        if role in ("actor", "critic"):
            return self._cpu_share(self._training_ranks() + engines)
        return self._cpu_share(self.group_sizes()[role] + engines)

    def model_path(self, role: str) -> str:
        """The directory ``role``'s model starts from (the critic from the critic's, else the reward model's,
        else the policy's)."""
        m, teacher = self.cfg.model, self.cfg.distill.teacher
        return {"actor": m.pretrain, "ref": m.pretrain, "reward": m.reward_pretrain, "teacher": teacher,
                "critic": m.critic_pretrain or m.reward_pretrain or m.pretrain}[role]

    def worker_spec(self, role: str):
        """The :class:`rlhf_sg.workers.WorkerSpec` of ``role``'s group. Its rendezvous address is left empty:
        :class:`rlhf_sg.workers.ModelGroup` takes rank 0's node address and a port free there once placed."""
        from rlhf_sg.workers import WorkerSpec

        cfg, t, m = self.cfg, self.cfg.train, self.cfg.model
        world, train, lr = {
            "actor": (t.actor_num_ranks, True, t.actor_lr),
            "critic": (t.critic_num_ranks, True, t.critic_lr),
            "ref": (t.ref_num_ranks, False, 0.0),
            "teacher": (cfg.distill.num_ranks, False, 0.0),
            "reward": (cfg.reward.num_ranks, False, 0.0),
        }[role]
        return WorkerSpec(
            role=role, model_path=self.model_path(role), world_size=world, master_addr="",
            master_port=0,
            train=train, dtype=m.dtype, attn_implementation=m.attn_implementation, lr=lr,
            lr_scheduler=t.lr_scheduler, lr_warmup_steps=lr_warmup_steps(cfg, role),
            lr_total_steps=optimizer_steps(cfg, role),
            weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm, offload=(role == "ref" and t.ref_offload),
            gradient_checkpointing=train and t.gradient_checkpointing, disable_dropout=t.disable_dropout,
            freeze_vision_tower=m.freeze_vision_tower, fused_kernels=m.fused_kernels, seed=t.seed,
            threads=self.worker_threads(role),
            device=t.device, timeout_s=t.timeout_s,
            share_prompts=shares_prompts(cfg), packing_probe=t.packing_probe,
            lora=self.lora_of(role),
            zero_stage=self.zero_stage(role),
            sequence_parallel_size=self.sequence_parallel_size(role),
        )

    def sequence_parallel_size(self, role: str) -> int:
        """``role``'s SP group size: --train.<role>_sequence_parallel_size or --train.sequence_parallel_size
        (:func:`rlhf_sg.config.sequence_parallel_size`)."""
        return sequence_parallel_size(self.cfg, role)[1]

    def data_parallel_ranks(self, role: str) -> int:
        """The ranks of ``role``'s group a batch is split over: its ranks / its SP size (every rank of an SP group
        takes the same micro-batches)."""
        t = self.cfg.train
        world = {"actor": t.actor_num_ranks, "critic": t.critic_num_ranks, "ref": t.ref_num_ranks,
                 "teacher": self.cfg.distill.num_ranks, "reward": self.cfg.reward.num_ranks}[role]
        return world // self.sequence_parallel_size(role)

    def lora_of(self, role: str) -> dict | None:
        """--lora.* for the groups that carry the adapter: the actor, and a reference started from
        --lora.init_adapter (which holds it frozen)."""
        lora = self.cfg.lora
        if lora.rank == 0 or role not in ("actor", "ref") or (role == "ref" and lora.init_adapter is None):
            return None
        return dataclasses.asdict(lora)

    def zero_stage(self, role: str) -> int:
        """3 (ZeRO-3) for ``role``'s group of several ranks, or for one rank with ``--train.single_rank_zero3
        true``; 0 (unpartitioned) for a group of one rank by default. A reference model offloaded to CPU
        (``--train.ref_offload``) stays ZeRO-3, whose parameter offload it uses."""
        t = self.cfg.train
        world = {"actor": t.actor_num_ranks, "critic": t.critic_num_ranks, "ref": t.ref_num_ranks,
                 "teacher": self.cfg.distill.num_ranks, "reward": self.cfg.reward.num_ranks}[role]
        if t.single_rank_zero3 or world != 1 or (role == "ref" and t.ref_offload):
            return 3
        return 0

    def engine_config(self):
        """The :class:`backends.base.BackendConfig` every engine starts with."""
        from backends.base import BackendConfig

        cfg, r, t = self.cfg, self.cfg.rollout, self.cfg.train
        return BackendConfig(
            model_path=cfg.model.pretrain, dtype=cfg.model.dtype, max_model_len=r.max_model_len, seed=t.seed,
            device=t.device, tensor_parallel_size=r.tensor_parallel_size, extra=dict(r.engine_kwargs),
            num_threads=self.engine_threads(), memory_fraction=r.memory_fraction,
            sleeps_while_training=sleep_engines(cfg),
            lora_adapter_rank=cfg.lora.rank if cfg.lora.sync_mode == "adapter" else 0,
            routed_experts=t.routing_replay,
        )
