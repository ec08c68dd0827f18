"""The PPO step, top to bottom, and the loop around it.

One step::

    prompts -> engines.generate (n samples each) -> reward -> [reference log-probs, critic values,
    actor log-probs] on packed rows -> advantages -> PPO epochs (actor, critic) -> weight sync

Each arrow is a phase of :class:`rlhf_sg.timing.StepTimer`; a phase ends only when every remote
call it launched has returned, and workers synchronise their device before returning, so no
phase is charged another's time.

Extend by subclassing :class:`PPOTrainer`: override :meth:`compute_rewards`, :meth:`compute_advantages`,
or the hooks :meth:`on_step_start`, :meth:`on_experience`, :meth:`on_step_end`; or register an advantage
estimator by name (:func:`rlhf_sg.advantages.register_advantage_estimator`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import time

import torch

from rlhf_sg import algorithms as algo
from rlhf_sg.advantages import AdvantageInputs, advantage_estimator
from rlhf_sg.config import (
    Config,
    TrainConfig,
    check_devices,
    check_gpu_install,
    clip_range,
    distill_only,
    kl_estimator,
    loss_aggregation,
    microbatch_tokens,
    offload_states,
    ratio_level,
    rollout_is_async,
    shares_prompts,
    tis_cap,
    validate,
)
from rlhf_sg.data import Prompt, PromptStream, load_run_prompts, load_tokenizer
from rlhf_sg.experience import ActorUpdate, CriticUpdate, Experience, OptimizerStep
from rlhf_sg.offpolicy.versions import token_staleness
from rlhf_sg.parallel.groups import rank_plans
from rlhf_sg.timing import StepTimer
from rlhf_sg.trainer import checkpoint
from rlhf_sg.trainer.async_rollout import AsyncRollout
from rlhf_sg.trainer.cluster import Cluster
from rlhf_sg.trainer.layout import Layout
from rlhf_sg.trainer.rollout import EngineFailure, RolloutMaker, check_staleness, eos_token_ids
from rlhf_sg.trainer.run_log import RunLog
from rlhf_sg.workers import wait_ranks

log = logging.getLogger("rlhf_sg")


def microbatch_plans(experience: Experience, world: int, max_tokens: int,
                     rows: list[int] | None = None, share_prompts: bool = False) -> list[list[list[int]]]:
    """``rows`` (default: all) split over ``world`` ranks into token-budget micro-batches of global row indices,
    the same number on every rank (:func:`rlhf_sg.packing.token_budget_microbatches`); with ``share_prompts``
    the rows of one prompt kept together where the budget allows and its tokens counted once
    (:func:`rlhf_sg.packing.shared_prompt_microbatches`)."""
    from rlhf_sg.packing import prompt_groups, shared_prompt_microbatches, token_budget_microbatches

    rows = list(range(experience.batch_size)) if rows is None else rows
    mask = experience.attention_mask[rows]
    lengths = mask.sum(dim=1).tolist()
    if share_prompts:
        width = experience.response_width
        images = None if experience.images is None else [experience.images[i] for i in rows]
        groups = prompt_groups(experience.sequences[rows], mask, width, images)
        prompt_lengths = mask[:, : mask.shape[1] - width].sum(dim=1).tolist()
        local = shared_prompt_microbatches(groups, prompt_lengths, lengths, max_tokens, world)
    else:
        local = token_budget_microbatches(lengths, max_tokens, world)
    return [[[rows[i] for i in micro] for micro in rank] for rank in local]


def update_plans(experience: Experience, world: int, t: TrainConfig, rng: random.Random,
                 normalize_rows: bool = False, share_prompts: bool = False,
                 max_tokens: int | None = None) -> list[list[OptimizerStep]]:
    """Per rank, its part of every optimizer step of the ``ppo_epochs`` epochs: each epoch shuffles the rows
    (with ``rng``) into ``num_minibatches`` minibatches, one optimizer step each. The normaliser is the
    minibatch's action tokens (rows with ``normalize_rows``) over ``world``, counting only the rows in
    :attr:`Experience.loss_rows` (1 when none counts: the loss is then 0). ``share_prompts``: the samples of
    one prompt are shuffled as one unit, so a minibatch holds whole groups wherever the minibatch size allows
    (the prompt is then computed once for all of them), and micro-batches are as :func:`microbatch_plans`
    makes them for shared-prompt forwards. ``max_tokens``: a micro-batch's real tokens (default
    ``--train.max_tokens_per_microbatch``; an SP group's, :func:`rlhf_sg.config.microbatch_tokens`)."""
    from rlhf_sg.packing import prompt_groups

    B = experience.batch_size
    per_rank: list[list[OptimizerStep]] = [[] for _ in range(world)]
    # a filtered batch (dynamic sampling) may hold fewer rows than num_minibatches x ranks: then fewer,
    # larger optimizer steps; the split is as even as it can be and drops no row
    num_mb = max(1, min(t.num_minibatches, B // world))
    # shuffled units: single rows, or with shared prompts each prompt's rows (shuffling B single rows draws
    # the same permutation as shuffling range(B))
    units = (prompt_groups(experience.sequences, experience.attention_mask, experience.response_width,
                           experience.images) if share_prompts and num_mb > 1 else [[b] for b in range(B)])
    for _ in range(t.ppo_epochs):
        shuffled = list(units)
        rng.shuffle(shuffled)
        order = [b for unit in shuffled for b in unit]
        for k in range(num_mb):
            rows = sorted(order[k * B // num_mb : (k + 1) * B // num_mb])
            counted = rows if experience.loss_rows is None else [b for b in rows if experience.loss_rows[b]]
            tokens = len(counted) if normalize_rows else float(experience.action_mask[counted].sum())
            tokens = tokens or 1.0
            for rank, plan in enumerate(microbatch_plans(experience, world, max_tokens or t.max_tokens_per_microbatch,
                                                         rows, share_prompts)):
                per_rank[rank].append(OptimizerStep(plan=plan, normalizer=tokens / world))
    return per_rank


def group_update_steps(experience: Experience, layout: Layout, role: str, t: TrainConfig, rng: random.Random,
                       normalize_rows: bool = False,
                       share_prompts: bool = False) -> tuple[list[list[OptimizerStep]], list[list[OptimizerStep]]]:
    """``role``'s optimizer steps: (per data-parallel rank, per rank of the group). The batch is split over the
    data-parallel ranks only, so the normaliser is the minibatch's tokens over the data-parallel ranks
    (:func:`update_plans`), and every rank of an SP group takes its data-parallel rank's steps
    (:func:`rlhf_sg.parallel.rank_plans`); with the loss scale of :mod:`rlhf_sg.parallel.groups` ZeRO-3's mean over
    all the group's ranks then gives each token the one-rank weight. An SP group's micro-batches hold N x
    ``--train.max_tokens_per_microbatch`` tokens, each rank 1 / N of them (:func:`rlhf_sg.config.microbatch_tokens`)."""
    steps = update_plans(experience, layout.data_parallel_ranks(role), t, rng, normalize_rows=normalize_rows,
                         share_prompts=share_prompts,
                         max_tokens=microbatch_tokens(layout.cfg, role))
    return steps, rank_plans(steps, layout.sequence_parallel_size(role))


class PPOTrainer:
    """PPO / GRPO / Dr.GRPO / RLOO / REINFORCE++ (and registered estimators) over Ray actor groups and
    rollout engines."""

    def __init__(self, cfg: Config, reward_fn=None):
        self.cfg = validate(cfg)
        self.reward_fn = reward_fn
        self.layout = Layout(cfg)
        self.estimator = advantage_estimator(cfg.train.advantage_estimator)
        self.cluster = Cluster(cfg)
        self.run_log = RunLog(cfg)
        self.step = 0
        self.weight_version = 0  # the version the engines hold (the step of the last sync)
        self.kl_ctl = (
            algo.AdaptiveKLController(cfg.train.kl_coef, cfg.train.kl_target, cfg.train.kl_horizon)
            if cfg.train.kl_target
            else algo.FixedKLController(cfg.train.kl_coef)
        )
        self.rng = random.Random(cfg.train.seed)
        self.prompts: list[Prompt] = []  # the prompts of the step in progress (for hooks)
        self.nonfinite_steps = 0  # steps in a row whose updates were all skipped for NaN / Inf
        self.reward_errors = 0  # completions of the step in progress the reward function failed on
        self.evaluator = None  # held-out evaluation (--eval.prompt_data)
        self.eval_prompts: list = []
        self.eval_reward_fn = None
        self.eval_history: list[tuple[int, dict[str, float]]] = []  # (step, metrics) of each evaluation
        self._resumed_from = -1  # the checkpoint step a resumed run went on from
        self._inflight_state: dict | None = None  # a resumed checkpoint's in-flight async samples
        self.async_rollout: AsyncRollout | None = None  # the producer of async rollout (--rollout.mode async)
        self._errors_reported = 0  # async: reward errors already put in a step's metrics
        self.accounting = None  # per-phase FLOP / bandwidth accounting (--perf.accounting), made at setup
        if distill_only(cfg):
            log.info("--distill.only: the advantages are --distill.coef x (teacher log-prob - old log-prob) per "
                     "token; --train.advantage_estimator %s is not run and the reward is logged only",
                     cfg.train.advantage_estimator)
        if cfg.train.share_prompts and not shares_prompts(cfg):
            log.info("--train.share_prompts: %s takes no tree mask, so every row computes its own prompt",
                     cfg.model.attn_implementation)

    # ---- what the run does ---------------------------------------------------------------------------
    @property
    def uses_critic(self) -> bool:
        return self.layout.uses_critic

    @property
    def uses_ref(self) -> bool:
        return self.layout.uses_ref

    @property
    def engines(self) -> list:
        return self.cluster.engines

    @property
    def share_prompts(self) -> bool:
        """Whether the log-prob and value forwards compute each prompt once for the rows that share it
        (``--train.share_prompts``; masked attention only, see :func:`rlhf_sg.config.shares_prompts`)."""
        return shares_prompts(self.cfg)

    @property
    def recomputes_old_logp(self) -> bool:
        """Whether a step runs the actor's separate old-log-prob forward. It is needed when the batch gets
        more than one update (later updates must compare against the sampling policy) and when the KL
        penalty goes into the rewards or a teacher's log-ratio into the advantages (they are needed before the
        advantages); otherwise the single update's own forward gives them, as the policy being trained is the
        one that sampled."""
        t = self.cfg.train
        if t.recompute_old_logp is not None:
            return t.recompute_old_logp
        return (t.ppo_epochs > 1 or t.num_minibatches > 1 or (self.uses_ref and t.kl_mode == "reward")
                or self.layout.uses_teacher)

    def setup(self) -> None:
        """Everything that can fail on the user's input first (devices, tokenizer, reward, prompts, output
        directory), then Ray, every group and the engines."""
        cfg = self.cfg
        check_devices(cfg)
        check_gpu_install(cfg)
        self.load_data()
        trained = [self.layout.model_path(r) for r in ("actor", "critic") if r == "actor" or self.uses_critic]
        checkpoint.check_output_dir(cfg.log.output_dir, trained)
        with open(os.path.join(cfg.log.output_dir, "config.json"), "w") as f:
            json.dump(cfg.to_dict(), f, indent=2)
        # the CPU ceiling is measured before the cluster starts, while nothing of the run loads the machine; a GPU's
        # comes from the table, by the name of the device actor rank 0 sees
        from rlhf_sg.flops import StepAccounting

        measure_first = cfg.perf.accounting and cfg.train.device != "cuda"
        if measure_first:
            self.accounting = StepAccounting.for_run(cfg, self.layout)
        self.cluster.start()
        if cfg.perf.accounting:
            if not measure_first:
                self.accounting = StepAccounting.for_run(cfg, self.layout, self.cluster.actor)
            groups = {"actor": self.cluster.actor, "ref": self.cluster.ref, "teacher": self.cluster.teacher,
                      "critic": self.cluster.critic}
            self.accounting.ask_segments({role: group for role, group in groups.items()
                                          if group is not None and role in self.accounting.shapes}, cfg.train.timeout_s)
            ceiling = self.accounting.ceiling
            log.info("per-phase ceiling of one rank: %s", ceiling.describe() if ceiling else
                     "unknown device: set --perf.peak_tflops and --perf.peak_bandwidth_gbs (perf/*_of_peak)")
        eos_ids = eos_token_ids(cfg.model.pretrain, self.tokenizer)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos_ids[0]
        self.rollout = RolloutMaker(cfg, self.cluster.engines, self.stream, eos_ids, pad_id, self.compute_rewards,
                                    restart=self._restart_engine, tokenizer=self.tokenizer)
        if cfg.eval.prompt_data:
            from rlhf_sg.evaluation import Evaluator

            self.evaluator = Evaluator(cfg, self.tokenizer, self.eval_prompts, self.cluster.engines, eos_ids, pad_id,
                                       self.eval_reward_fn, restart=self._restart_engine)
        if cfg.log.resume:
            self._resume()
        if cfg.rollout.mode == "async" and not rollout_is_async(cfg):
            log.warning("--rollout.mode async: with --train.colocate_all the engines and the trainer share the "
                        "devices, so generation cannot overlap training; this run's rollout stays sync")
        if rollout_is_async(cfg):
            self._start_async_rollout()

    def load_data(self) -> None:
        """The tokenizer, the reward function and the prompt stream (no process is started)."""
        cfg = self.cfg
        self.tokenizer = load_tokenizer(cfg.model.pretrain)
        if self.reward_fn is None and cfg.reward.kind == "function" and cfg.reward.function is not None:
            from rlhf_sg.rewards import load_reward_function

            self.reward_fn = load_reward_function(cfg.reward.function)
        if cfg.eval.prompt_data:  # held-out evaluation: its prompts and reward function, checked before start
            from rlhf_sg.evaluation import load_eval_prompts
            from rlhf_sg.rewards import load_reward_function

            self.eval_prompts = load_eval_prompts(cfg, self.tokenizer)
            self.eval_reward_fn = (self.reward_fn if cfg.eval.reward_function is None
                                   else load_reward_function(cfg.eval.reward_function))
        prompts, skipped = load_run_prompts(cfg, cfg.data.prompt_data, self.tokenizer)
        if skipped:
            log.warning("%s: skipped %d malformed rows (--data.skip_bad_rows)", cfg.data.prompt_data, skipped)
        self.skipped_rows = skipped
        self.stream = PromptStream(prompts, cfg.rollout.prompts_per_step, cfg.train.seed, cfg.data.shuffle)

    # ---- one step ------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        timer = StepTimer(sync=lambda: None)  # every phase below waits on its remote calls itself
        timer.start_step()
        self.on_step_start(self.step)
        if self.accounting:
            self.accounting.start_step()
        profiling = self.cfg.log.profile_step == self.step
        if profiling:
            self.cluster.actor.call("start_profile")
        self.cluster.offload_training_states(timer)  # with offloading: only the first step has any on the device
        self.prompts, experience, metrics = self._rollout(timer)  # generate and score (async: made meanwhile)
        reloaded = self.cluster.hand_device_to_trainer(timer)  # engines sleep, then training states come back
        if offload_states(self.cfg):
            metrics["offload/device_GB"] = reloaded / 1e9

        with self._trainer_calls():  # async: an engine restart waits until the new weights are synced
            metrics.update(self.score(experience, timer))  # reference log-probs, values, old log-probs, KL
            self.compute_advantages(experience)
            metrics.update(self.mask_truncated(experience))
            self.on_experience(experience)
            with timer.phase("train"):
                # a KL the scoring forwards measured (the sampling policy's) stands over the one the update's saw
                metrics = {**self.update(experience), **metrics}
            self._check_finite(metrics)

            self.step += 1
            # states off, engine weights on, sync, KV cache on (colocated; otherwise the sync alone)
            push = lambda: self.cluster.hand_device_to_engines(timer, self.step)  # noqa: E731
            sync_stats = self.async_rollout.sync(push, self.step, timer) if self.async_rollout else push()
            self.weight_version = self.step
        if metrics.get("kl") is not None and math.isfinite(metrics["kl"]):
            self.kl_ctl.update(metrics["kl"], experience.batch_size)
        times = timer.end_step()
        metrics.update({
            "weight_sync/GBps": float(sync_stats[0].get("GBps", 0.0)) if sync_stats else 0.0,
            "rollout/response_len": experience.action_mask.sum(dim=1).float().mean().item(),
            "rollout/samples": experience.batch_size,
            "kl_coef": self.kl_ctl.value,
            "throughput/tokens_per_s": float(experience.attention_mask.sum()) / times["step"],
            "throughput/samples_per_s": experience.batch_size / times["step"],
        })
        if self.accounting:
            metrics.update(self.accounting.report(times, experience, sync_stats))
        return self._finish_step(metrics, times, profiling)

    def _restart_engine(self, index: int, version: int | None = None) -> None:
        """Restart engine ``index`` with the trainer's weights as ``version`` (default: the version the engines
        hold; async rollout passes the one its last sync recorded)."""
        self.cluster.restart_engine(index, self.weight_version if version is None else version)

    def _evaluate(self) -> dict[str, float]:
        """Held-out evaluation of the engines' weights after this step (0: before training) when it is due
        (``--eval.*``); its metrics (empty when none ran), also kept in :attr:`eval_history`."""
        if self.evaluator is None or not self.evaluator.due(self.step, self._resumed_from):
            return {}
        metrics = self.evaluator.run(self.step, self.weight_version, self.cfg.log.output_dir)
        self.eval_history.append((self.step, metrics))
        log.info("evaluation after step %d: %s", self.step,
                 ", ".join(f"{k.removeprefix('eval/')} {v:.4g}" for k, v in metrics.items()))
        return metrics

    def _trainer_calls(self):
        """Async rollout: while the trainer calls the groups' ranks, an engine restart in the producer thread waits
        (its weight push is a collective on the actor's ranks too)."""
        return self.async_rollout.trainer_calls() if self.async_rollout is not None else contextlib.nullcontext()

    def _rollout(self, timer: StepTimer) -> tuple[list[Prompt], Experience, dict[str, float]]:
        """The step's samples, scored (with dynamic sampling, as many rounds as the batch needs). An engine that
        keeps dying stops the run with a checkpoint from which this step's prompts are drawn again."""
        if self.async_rollout is not None:
            return self._take_async(timer)
        data_state, self.reward_errors = self.stream.state(), 0
        try:
            prompts, experience, metrics = self.rollout.make(timer, self.step, self.weight_version)
        except EngineFailure:
            self.save_checkpoint(data_state)
            raise
        metrics["reward/errors"] = self.reward_errors
        return prompts, experience, metrics

    def _take_async(self, timer: StepTimer) -> tuple[list[Prompt], Experience, dict[str, float]]:
        """Async rollout: the batch the producer made for this step, its staleness checked and logged."""
        try:
            with timer.phase("wait_rollout"):
                prompts, experience, metrics = self.async_rollout.take(self.step)
        except EngineFailure:
            self.save_checkpoint(self.async_rollout.data_state(self.step))
            raise
        staleness = check_staleness(experience.weight_version.tolist(), self.step, self.cfg.rollout.max_staleness)
        # reward errors are counted by the producer as it scores; report those counted since the last step
        errors, self._errors_reported = self.reward_errors - self._errors_reported, self.reward_errors
        metrics.update({"rollout/staleness_mean": sum(staleness) / len(staleness),
                        "rollout/staleness_max": max(staleness), "reward/errors": errors})
        if experience.token_versions is not None:  # a sample's later tokens (partial rollout) are fresher
            metrics.update(token_staleness(experience.token_versions, experience.action_mask, self.step))
        return prompts, experience, metrics

    def _start_async_rollout(self) -> None:
        """The producer thread of async rollout, from the current step on."""
        cluster, r = self.cluster, self.cfg.rollout
        abortable = cluster.abortable_engines
        if abortable and not all(d["supports_abort"] for d in cluster.engines_call("describe")):
            log.warning("--rollout.partial_rollout: backend %r cannot cut a running generate short; a weight sync "
                        "waits for the generates in flight instead", r.backend)
        self.rollout.on_policy = False
        self.async_rollout = AsyncRollout(
            self.rollout, self.step, self.cfg.train.max_steps, self.weight_version, r.max_staleness,
            self.cfg.train.timeout_s, self.stream.state,
            abort=cluster.abort_generation if abortable else None,
            resume=(lambda: cluster.engines_call("resume_generation")) if abortable else None,
            batch_size=r.prompts_per_step * r.n_samples_per_prompt,
            per_sample=self.rollout.per_sample, restore=self._inflight_state,
        )
        self._inflight_state = None
        self.async_rollout.start()

    def score(self, experience: Experience, timer: StepTimer) -> dict[str, float]:
        """The scoring forwards, in eval mode: reference and teacher log-probs, critic values and (when the step
        needs them, :attr:`recomputes_old_logp`) the actor's old log-probs, the KL of the sampling policy from the
        reference and its reverse KL from the teacher. Fills ``experience``; returns metrics."""
        B = experience.batch_size
        if not (self.uses_ref or self.uses_critic or self.recomputes_old_logp):
            return {}  # nothing to score: the actor's update measures the log-prob gap itself
        temperature = self.cfg.rollout.temperature or 1.0
        ref = _put(experience)
        if self.uses_ref:
            with timer.phase("reference"):
                if self.layout.ref_in_actor:  # a LoRA actor with its adapter disabled is the base model
                    plans = microbatch_plans(experience, self.layout.data_parallel_ranks("actor"),
                                             microbatch_tokens(self.cfg, "actor"), share_prompts=self.share_prompts)
                    experience.ref_logp = self.cluster.actor.forward(ref, plans, B, temperature, self.share_prompts,
                                                                     without_adapter=True)
                    self._count("reference", "actor", experience, plans)
                else:
                    plans = microbatch_plans(experience, self.layout.data_parallel_ranks("ref"),
                                             microbatch_tokens(self.cfg, "ref"), share_prompts=self.share_prompts)
                    experience.ref_logp = self.cluster.ref.forward(ref, plans, B, temperature, self.share_prompts)
                    self._count("reference", "ref", experience, plans)
        if self.layout.uses_teacher:
            with timer.phase("teacher"):  # the teacher scores the policy's samples as the reference does
                plans = microbatch_plans(experience, self.layout.data_parallel_ranks("teacher"),
                                         microbatch_tokens(self.cfg, "teacher"), share_prompts=self.share_prompts)
                experience.teacher_logp = self.cluster.teacher.forward(ref, plans, B, temperature, self.share_prompts)
                self._count("teacher", "teacher", experience, plans)
        if self.uses_critic:
            with timer.phase("critic"):
                plans = microbatch_plans(experience, self.layout.data_parallel_ranks("critic"),
                                         microbatch_tokens(self.cfg, "critic"), share_prompts=self.share_prompts)
                experience.values = self.cluster.critic.forward(ref, plans, B, share_prompts=self.share_prompts)
                self._count("critic", "critic", experience, plans)
        if not self.recomputes_old_logp:
            return {}  # the actor's update measures the log-prob gap (and the KL in the loss) itself
        with timer.phase("actor_logprob"):
            plans = microbatch_plans(experience, self.layout.data_parallel_ranks("actor"),
                                     microbatch_tokens(self.cfg, "actor"), share_prompts=self.share_prompts)
            experience.old_logp = self.cluster.actor.forward(ref, plans, B, temperature, self.share_prompts)
            self._count("actor_logprob", "actor", experience, plans)
        mask = experience.action_mask
        trained = mask if experience.scored is None else mask & experience.scored[:, None]  # harness filler out
        metrics = algo.engine_vs_trainer_metrics(experience.rollout_logp, experience.old_logp, trained)
        if self.uses_ref:
            kl = algo.approx_kl(experience.old_logp, experience.ref_logp, kl_estimator(self.cfg))
            experience.kl = torch.where(mask, kl, 0.0)
            metrics["kl"] = algo.masked_mean(experience.kl, mask).item()
        if experience.teacher_logp is not None:
            # the reverse KL(policy || teacher) per token, estimated on the policy's own samples: what distillation
            # drives down
            metrics["distill/reverse_kl"] = algo.masked_mean(experience.old_logp - experience.teacher_logp,
                                                             mask).item()
            metrics["distill/teacher_logp"] = algo.masked_mean(experience.teacher_logp, mask).item()
        return metrics

    def _count(self, phase: str, role: str, experience: Experience, plans: list, train: bool = False) -> None:
        """Charge ``phase`` the model FLOPs of ``role``'s micro-batches ``plans`` (per data-parallel rank) for the
        perf/* metrics."""
        if self.accounting:
            self.accounting.count(phase, role, experience, plans, self.share_prompts, train,
                                  self.layout.sequence_parallel_size(role))

    def compute_advantages(self, experience: Experience) -> None:
        """Fill ``experience.advantages`` (and ``.returns`` with a critic) with the run's advantage estimator.

        Scores are clipped to ``--train.score_clip``; with ``--train.kl_mode reward`` the estimator's token
        rewards carry the KL penalty at the current coefficient. With a teacher (``--distill.teacher``) each
        token's advantage also gets ``--distill.coef`` x (its teacher log-prob - its old log-prob); with
        ``--distill.only`` that term is the advantage, the estimator is not run and the KL penalty of the rewards is
        added token by token (:func:`rlhf_sg.algorithms.distill_advantages`). Override to change the whole
        computation; to add an estimator, register it (:mod:`rlhf_sg.advantages`)."""
        t, d = self.cfg.train, self.cfg.distill
        kl_in_reward = experience.kl is not None and t.kl_mode == "reward"
        scores = experience.scores if t.score_clip is None else experience.scores.clamp(-t.score_clip, t.score_clip)
        inputs = AdvantageInputs(
            scores=scores.float(), action_mask=experience.action_mask,
            kl=experience.kl if kl_in_reward else torch.zeros_like(experience.rollout_logp),
            kl_coef=self.kl_ctl.value if kl_in_reward else 0.0, group_size=self.cfg.rollout.n_samples_per_prompt,
            gamma=t.gamma, lam=t.lam, values=experience.values, norm=t.advantage_norm, scored=experience.scored,
        )
        if distill_only(self.cfg):  # the scores are logged, not trained on; the KL penalty stays per token
            base, experience.returns = inputs.token_rewards(torch.zeros_like(inputs.scores)), None
        else:
            base, experience.returns = self.estimator(inputs)
        if experience.teacher_logp is None:
            experience.advantages = base
            return
        experience.require("old_logp", why="distillation's advantages need the policy's old log-probs")
        experience.advantages = algo.distill_advantages(experience.teacher_logp, experience.old_logp,
                                                        experience.action_mask, d.coef, base)

    def mask_truncated(self, experience: Experience) -> dict[str, float]:
        """Log the share of completions the engines cut at ``--rollout.max_new_tokens``; with
        ``--train.mask_truncated`` take them out of the actor's and critic's losses and their normaliser (their
        scores still count in their group's baseline, as TRL's ``mask_truncated_completions``)."""
        if experience.truncated is None:
            return {}
        truncated = experience.truncated.bool()
        if self.cfg.train.mask_truncated:
            rows = torch.ones_like(truncated) if experience.loss_rows is None else experience.loss_rows.bool()
            experience.loss_rows = rows & ~truncated
        return {"rollout/truncated_frac": truncated.float().mean().item()}

    def actor_update(self) -> ActorUpdate:
        """This step's policy-update settings (the KL coefficient is the controller's current value)."""
        t = self.cfg.train
        kl_in_loss = self.uses_ref and t.kl_mode == "loss"
        clip_low, clip_high = clip_range(self.cfg)
        return ActorUpdate(
            loss=algo.ActorLossConfig(
                policy_loss=t.policy_loss, ratio_level=ratio_level(self.cfg), clip_low=clip_low, clip_high=clip_high,
                dual_clip=t.dual_clip, sapo_tau_pos=t.sapo_tau_pos, sapo_tau_neg=t.sapo_tau_neg,
                tis_cap=tis_cap(self.cfg), tis_low=t.tis_low, tis_mode=t.tis_mode,
                decoupled=t.decoupled_loss, decoupled_weight_cap=t.decoupled_weight_cap,
                token_budget=self.cfg.rollout.max_new_tokens, aggregation=loss_aggregation(self.cfg),
                kl_coef=self.kl_ctl.value if kl_in_loss else 0.0,
                kl_estimator=kl_estimator(self.cfg), kl_straight_through=t.kl_straight_through,
                entropy_coef=t.entropy_coef,
            ),
            temperature=self.cfg.rollout.temperature or 1.0,
            old_logp_from_update=not self.recomputes_old_logp,
            share_prompts=self.share_prompts,
            router_aux_loss_coef=t.router_aux_loss_coef,
        )

    def update(self, experience: Experience) -> dict[str, float]:
        """The PPO epochs: the critic's and the actor's updates, run at the same time (they share nothing).
        The actor sits out the critic's warmup steps. Returns their metrics."""
        t, cluster = self.cfg.train, self.cluster
        ref, calls = _put(experience), []
        if self.uses_critic:
            plans, steps = group_update_steps(experience, self.layout, "critic", t, self.rng,
                                              share_prompts=self.share_prompts)
            update = CriticUpdate(value_clip=t.value_clip, share_prompts=self.share_prompts)
            self._count("train", "critic", experience, [[mb for s in rank for mb in s.plan] for rank in plans], True)
            calls += [("critic", i, w.train_critic.remote(ref, steps[i], update))
                      for i, w in enumerate(cluster.critic.workers)]
        if not (self.uses_critic and self.step < t.critic_warmup_steps):
            update = self.actor_update()
            plans, steps = group_update_steps(experience, self.layout, "actor", t, self.rng,
                                              normalize_rows=update.loss.aggregation != "token_mean",
                                              share_prompts=self.share_prompts)
            self._count("train", "actor", experience, [[mb for s in rank for mb in s.plan] for rank in plans], True)
            calls += [("actor", i, w.train_actor.remote(ref, steps[i], update))
                      for i, w in enumerate(cluster.actor.workers)]
        results = wait_ranks(calls, f"step {self.step + 1} updates", t.timeout_s)
        metrics: dict[str, float] = {}
        for r in results:  # every rank returns the group's all-reduced metrics: take the first
            for k, v in r.items():
                metrics.setdefault(k, v)
        # without the separate old-log-prob pass the actor's update measured these
        for name in ("logp_gap_engine_vs_trainer", "k3_kl_engine_vs_trainer", "frac_logp_gap_over_ln2"):
            if f"actor/{name}" in metrics:
                metrics[f"rollout/{name}"] = metrics.pop(f"actor/{name}")
        if "actor/kl_loss" in metrics:
            metrics["kl"] = metrics["actor/kl_loss"]
        return metrics

    def _check_finite(self, metrics: dict[str, float]) -> None:
        """Count the steps whose optimizer updates were all skipped for a NaN / Inf (DeepSpeed drops such an
        update: the weights stay as they were); stop after ``max_nonfinite_steps`` in a row."""
        updates = sum(metrics.get(f"{role}/updates", 0.0) for role in ("actor", "critic"))
        skipped = sum(metrics.get(f"{role}/skipped_updates", 0.0) for role in ("actor", "critic"))
        if skipped:
            log.warning("step %d: %d of %d optimizer updates skipped: NaN or Inf in the loss or gradients",
                        self.step + 1, skipped, updates)
        self.nonfinite_steps = self.nonfinite_steps + 1 if updates and skipped >= updates else 0
        if self.nonfinite_steps >= self.cfg.train.max_nonfinite_steps:
            latest = checkpoint.latest_checkpoint(checkpoint.checkpoint_root(self.cfg.log.output_dir))
            raise checkpoint.CheckpointError(
                f"step {self.step + 1}: {self.nonfinite_steps} steps in a row had every optimizer update skipped for "
                "NaN or Inf in the loss or gradients (--train.max_nonfinite_steps); the weights are those of the "
                f"last finite update. Last checkpoint: {latest or 'none yet'}. Lower the learning rate, check the "
                "rewards and the data, then resume from it with --log.resume true"
            )

    def compute_rewards(self, prompts: list[Prompt], completions: list, experience: Experience) -> torch.Tensor:
        """Scores [B], one per completion (all 0 in a ``--distill.only`` run without a reward function). Override for
        custom scoring."""
        from rlhf_sg.agent import completion_text
        from rlhf_sg.rewards import remote_reward, score_with_function

        cfg, t = self.cfg, self.cfg.train
        if cfg.reward.kind == "function" and self.reward_fn is None:  # validate let only --distill.only through
            return torch.zeros(len(completions), dtype=torch.float32)
        timeout_s = cfg.reward.timeout_s or t.timeout_s
        n = cfg.rollout.n_samples_per_prompt
        if cfg.reward.kind == "model":
            plans = microbatch_plans(experience, self.layout.data_parallel_ranks("reward"),
                                     microbatch_tokens(cfg, "reward"))
            return self.cluster.reward_model.forward(_put(experience), plans, len(completions))
        texts_p = [prompts[i // n].text for i in range(len(completions))]
        texts_c = [completion_text(self.tokenizer, c) for c in completions]  # multi-turn: the model's text
        labels = [prompts[i // n].label for i in range(len(completions))]
        if cfg.reward.kind == "remote":
            scores = remote_reward(cfg.reward.url, texts_p, texts_c, labels, timeout_s,
                                   token_env=cfg.reward.token_env, ca_file=cfg.reward.ca_file,
                                   retries=cfg.reward.retries)
        else:
            name = cfg.reward.function or getattr(self.reward_fn, "__qualname__", repr(self.reward_fn))
            scores, errors = score_with_function(self.reward_fn, name, texts_p, texts_c, labels,
                                                 on_error=cfg.reward.on_error, timeout_s=timeout_s)
            self.reward_errors += errors
        return torch.tensor(scores, dtype=torch.float32)

    def _finish_step(self, metrics: dict[str, float], times: dict[str, float], profiling: bool) -> dict[str, float]:
        """Metrics, hooks, logs and the checkpoint of a finished step (``self.step`` already advanced)."""
        cfg = self.cfg
        if profiling:
            paths = self.cluster.actor.call("stop_profile", os.path.join(cfg.log.output_dir, "profile"),
                                            f"step{self.step}")
            log.info("torch profiler traces of step %d (open in Perfetto or chrome://tracing): %s", self.step,
                     ", ".join(paths))
        metrics["weight_version"] = self.weight_version
        metrics.update({f"time/{k}": v for k, v in times.items()})
        # the share of the step spent pushing weights into the engines: the cost weight sync exists to keep small
        metrics["perf/weight_sync_share"] = times.get("weight_sync", 0.0) / times["step"] if times.get("step") else 0.0
        metrics.update(self._evaluate())
        self.on_step_end(self.step, metrics)
        self.run_log.write(self.step, metrics)
        if cfg.log.save_steps and self.step % cfg.log.save_steps == 0:
            self.save_checkpoint()
        return metrics

    # ---- hooks -------------------------------------------------------------------------------------
    def on_step_start(self, step: int) -> None:
        """Called before a step generates."""

    def on_experience(self, experience: Experience) -> None:
        """Called with the finished experience (advantages filled) before training."""

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        """Called after a step with its metrics (add keys to log them)."""

    # ---- loop and checkpoints --------------------------------------------------------------------------
    def fit(self) -> list[dict[str, float]]:
        from tqdm import tqdm

        history = []
        bar = tqdm(total=self.cfg.train.max_steps, initial=self.step, disable=not self.cfg.log.progress_bar,
                   desc="ppo", dynamic_ncols=True)
        before = self._evaluate()  # before the first step, when asked
        if before:
            self.run_log.write(self.step, before)
        while self.step < self.cfg.train.max_steps:
            metrics = self.train_step()
            history.append(metrics)
            bar.update(1)
            held_out = {"eval": f"{self.eval_history[-1][1]['eval/pass@1']:.3f}"} if self.eval_history and (
                "eval/pass@1" in self.eval_history[-1][1]) else {}
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", kl=f"{metrics.get('kl', 0.0):.4f}",
                            tok_s=f"{metrics.get('throughput/tokens_per_s', 0.0):.0f}", **held_out)
        bar.close()
        state = self.cluster.actor.call("optimizer_state_bytes", what="optimizer state size")
        log.info("actor optimizer state: %d bytes over %d ranks (%d trained parameters)",
                 sum(s["moments"] + s["master"] for s in state), len(state), state[0]["trainable"])
        if not self.cfg.log.save_steps or self.step % self.cfg.log.save_steps:
            self.save_checkpoint()
        if self.cfg.log.export_hf:
            self.export_hf(os.path.join(self.cfg.log.output_dir, "final_hf"))
        return history

    def _checkpointed_groups(self) -> dict:
        return {"actor": self.cluster.actor, "critic": self.cluster.critic}

    def save_checkpoint(self, data_state: dict | None = None) -> str:
        """Checkpoint the run as of the last finished step; ``data_state``: the prompt stream's position to
        record, when it has moved since (a step that failed after drawing its prompts)."""
        inflight = None
        if self.async_rollout is not None:  # the stream has moved on to batches not yet trained
            saved, inflight = self.async_rollout.checkpoint_state(self.step)
            data_state = saved if inflight is not None or data_state is None else data_state
        elif data_state is None:
            data_state = self.stream.state()
        state = {"data": data_state, "rng": self.rng.getstate(), "kl_coef": self.kl_ctl.value}
        if inflight is not None:  # samples made and not trained, and the admission counters: no burst on resume
            state["inflight"] = inflight
        if self.cfg.lora.rank > 0:  # the checkpoint holds the adapter only: name the base it was trained on
            state["lora_base"] = self._lora_base()
        with self._trainer_calls():
            return checkpoint.save_checkpoint(checkpoint.checkpoint_root(self.cfg.log.output_dir), self.step,
                                              self._checkpointed_groups(), state)

    def _resume(self) -> None:
        root = checkpoint.checkpoint_root(self.cfg.log.output_dir)
        state = checkpoint.load_checkpoint(root, self._checkpointed_groups())
        dropped = self.run_log.resume_at(0 if state is None else int(state["step"]))
        if dropped:
            log.info("--log.resume: %d metric records after the checkpoint will be logged again", dropped)
        if state is None:
            return
        if self.cfg.lora.rank > 0 and state.get("lora_base") != self._lora_base():
            raise checkpoint.CheckpointError(
                f"{state['tag']}: its LoRA adapter was trained on base {state.get('lora_base')}, this run's is "
                f"{self._lora_base()}: resume with the same --model.pretrain (same weights)")
        self.step = int(state["step"])
        self._resumed_from = self.step  # the run before this one evaluated up to here
        self.stream.load_state(state["data"])
        self._inflight_state = state.get("inflight")
        if self._inflight_state is not None and not (rollout_is_async(self.cfg) and self.rollout.per_sample):
            raise checkpoint.CheckpointError(
                f"{state['tag']}: it holds samples of async rollout made and not trained; resume with "
                "--rollout.mode async (and the rollout settings it was saved with)")
        self.rng.setstate(checkpoint.rng_state_from_json(state["rng"]))
        self.kl_ctl.value = float(state["kl_coef"])
        # engines started from the initial weights: give them the checkpoint's
        self.cluster.actor.call("sync_weights", self.step, what=f"weight sync after resume (version {self.step})")
        self.weight_version = self.step
        log.info("resumed from %s at step %d", state["tag"], self.step)

    def _lora_base(self) -> dict:
        """The base model a LoRA checkpoint belongs to: its path and a hash of its weight files (computed once)."""
        if getattr(self, "_lora_base_cache", None) is None:
            from rlhf_sg.lora import base_hash

            path = self.cfg.model.pretrain
            self._lora_base_cache = {"path": os.path.abspath(path), "sha256": base_hash(path)}
        return self._lora_base_cache

    def export_hf(self, path: str) -> str:
        if self.cfg.lora.rank > 0:  # a PEFT adapter directory (and the merged model on request)
            merged = os.path.join(path, "merged") if self.cfg.lora.export_merged else None
            self.cluster.actor.call("export_lora", path, merged, what="LoRA export")
            if merged is not None:
                self.tokenizer.save_pretrained(merged)
            self.tokenizer.save_pretrained(path)
            return path
        self.cluster.actor.call("export_hf", path, what="HF export")
        self.tokenizer.save_pretrained(path)
        return path

    def shutdown(self) -> None:
        if self.async_rollout is not None:
            self.async_rollout.stop()
        self.cluster.shutdown()
        self.run_log.close()


def _put(experience: Experience):
    """The experience in Ray's object store, once for every rank of a phase."""
    import ray

    return ray.put(experience)


def train(cfg: Config, trainer_cls: type[PPOTrainer] = PPOTrainer, **kwargs) -> list[dict[str, float]]:
    """Validate, start, train, shut down. Returns the per-step metrics."""
    trainer = trainer_cls(cfg, **kwargs)
    t0 = time.time()
    try:
        trainer.setup()
        history = trainer.fit()
    finally:
        trainer.shutdown()
    log.info("training finished in %.0f s; logs and checkpoints in %s", time.time() - t0, cfg.log.output_dir)
    return history
