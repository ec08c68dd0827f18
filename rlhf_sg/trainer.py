"""The controller: one process drives the PPO loop over Ray actor groups.

One step::

    prompts -> engines.generate (n samples each) -> reward -> [reference log-probs, critic values,
    actor log-probs] on packed rows -> advantages -> PPO epochs (actor, critic) -> weight sync

Each arrow is a phase of :class:`rlhf_sg.timing.StepTimer`; a phase ends only when every remote
call it launched has returned, and workers synchronise their device before returning, so no
phase is charged another's time.

Extend by subclassing :class:`PPOTrainer`: override :meth:`compute_rewards`,
:meth:`compute_advantages`, or the hooks :meth:`on_step_start`, :meth:`on_experience`,
:meth:`on_step_end`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import time
from typing import Any

import torch

from rlhf_sg import algorithms as algo
from rlhf_sg.config import Config, lr_warmup_steps, offload_states, optimizer_steps, sleep_engines, validate
from rlhf_sg.data import Prompt, PromptStream, load_prompts
from rlhf_sg.timing import StepTimer

log = logging.getLogger("rlhf_sg")

GROUP_ESTIMATORS = algo.GROUP_KINDS


def load_tokenizer(path: str):
    """The model's tokenizer. A plain ``tokenizer.json`` saved as PreTrainedTokenizerFast is loaded as
    such: AutoTokenizer would attach the architecture's own pre-tokenizer to it."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cfg_path = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            if json.load(f).get("tokenizer_class") in ("PreTrainedTokenizerFast", "TokenizersBackend"):
                return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def rollout_seed(run_seed: int, step: int, draw: int, engine_index: int) -> int:
    """The sampling seed of one generate call: a 63-bit hash of (run seed, step, draw within the step,
    engine). Engines, steps and draws get unrelated random streams (the k-th prompt of two engines does not
    draw the same numbers), and a repeated run gets the same ones."""
    import hashlib

    key = f"{run_seed}/{step}/{draw}/{engine_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def check_weight_versions(versions: list[int], expected: int) -> None:
    """On-policy (synchronous) training: every completion must come from the weights the trainer holds.
    Raises RuntimeError naming the completions and versions otherwise."""
    stale = [i for i, v in enumerate(versions) if v != expected]
    if stale:
        found = sorted({versions[i] for i in stale})
        raise RuntimeError(
            f"on-policy step: {len(stale)} completion(s) (e.g. {stale[:4]}) were sampled with weight version(s) "
            f"{found}, but the trainer's policy is version {expected}; an engine missed a weight sync (check the "
            "engine logs, and that every wake after a sleep is followed by a sync)"
        )


def build_rollout_batch(
    prompts: list[list[int]],
    responses: list[list[int]],
    rollout_logps: list[list[float]],
    pad_id: int,
    weight_versions: list[int] | None = None,
) -> dict[str, torch.Tensor]:
    """Left-padded prompts + right-padded responses.

    Returns sequences [B, P + T] int64, attention_mask [B, P + T], action_mask [B, T] bool,
    rollout_logp [B, T] float32 (0 on padding), and with ``weight_versions`` weight_version [B] int64:
    the engine weights each completion was sampled with.
    """
    B = len(prompts)
    P = max(len(p) for p in prompts)
    T = max(len(r) for r in responses)
    sequences = torch.full((B, P + T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + T), dtype=torch.long)
    action_mask = torch.zeros((B, T), dtype=torch.bool)
    rollout_logp = torch.zeros((B, T), dtype=torch.float32)
    for i, (p, r, lp) in enumerate(zip(prompts, responses, rollout_logps)):
        if not r:
            raise ValueError(f"rollout sample {i}: the engine returned an empty completion")
        sequences[i, P - len(p) : P] = torch.as_tensor(p)
        sequences[i, P : P + len(r)] = torch.as_tensor(r)
        attention_mask[i, P - len(p) : P + len(r)] = 1
        action_mask[i, : len(r)] = True
        rollout_logp[i, : len(r)] = torch.as_tensor(lp, dtype=torch.float32)
    batch = {
        "sequences": sequences,
        "attention_mask": attention_mask,
        "action_mask": action_mask,
        "rollout_logp": rollout_logp,
    }
    if weight_versions is not None:
        batch["weight_version"] = torch.as_tensor(weight_versions, dtype=torch.long)
    return batch


def has_signal(group_scores: torch.Tensor) -> bool:
    """Whether a group's scores ([n], one prompt's samples) differ: a group of equal scores gets zero
    advantage from every group estimator, so it costs training compute and teaches nothing."""
    return bool((group_scores.max() - group_scores.min()) > 0)


def select_groups(signal: list[bool], want: int) -> tuple[list[int], int]:
    """Dynamic sampling's choice of the step's groups from all drawn so far (in draw order).

    signal[g]: whether group g has signal. Returns (the indices of the ``want`` groups to train on: the
    first groups with signal, then, when there are too few, the first groups without; the number of
    groups without signal among them).
    """
    kept = [g for g, s in enumerate(signal) if s][:want]
    filler = [g for g, s in enumerate(signal) if not s][: want - len(kept)]
    return kept + filler, len(filler)


class PPOTrainer:
    """PPO / GRPO / Dr.GRPO / RLOO / REINFORCE++ over Ray actor groups and rollout engines."""

    def __init__(self, cfg: Config, reward_fn=None):
        self.cfg = validate(cfg)
        self.reward_fn = reward_fn
        self.step = 0
        self.weight_version = 0  # the version the engines hold (the step of the last sync)
        self.actor = self.critic = self.ref = self.reward_model = None
        self.engines: list = []
        self._shared: list = []  # placement groups several groups share (colocated layouts)
        self.kl_ctl = (
            algo.AdaptiveKLController(cfg.train.kl_coef, cfg.train.kl_target, cfg.train.kl_horizon)
            if cfg.train.kl_target
            else algo.FixedKLController(cfg.train.kl_coef)
        )
        self.rng = random.Random(cfg.train.seed)
        self.prompts: list[Prompt] = []  # the prompts of the step in progress (for hooks)
        self._writer = None
        self._metrics_file = None

    # ---- set-up ------------------------------------------------------------------------------------
    @property
    def uses_critic(self) -> bool:
        return self.cfg.train.advantage_estimator == "gae"

    @property
    def uses_ref(self) -> bool:
        return self.cfg.train.kl_coef > 0

    @property
    def recomputes_old_logp(self) -> bool:
        """Whether a step runs the actor's separate old-log-prob forward. It is needed when the batch gets
        more than one update (later updates must compare against the sampling policy) and when the KL
        penalty goes into the rewards (it is needed before the advantages); otherwise the single update's
        own forward gives them, as the policy being trained is the one that sampled."""
        t = self.cfg.train
        if t.recompute_old_logp is not None:
            return t.recompute_old_logp
        return t.ppo_epochs > 1 or t.num_minibatches > 1 or (self.uses_ref and t.kl_mode == "reward")

    def setup(self) -> None:
        """Load data (errors surface here, before any process starts), then start Ray and every group."""
        cfg = self.cfg
        self.tokenizer = load_tokenizer(cfg.model.pretrain)
        if self.reward_fn is None and cfg.reward.kind == "function":
            from rlhf_sg.rewards import load_reward_function

            self.reward_fn = load_reward_function(cfg.reward.function)
        prompts, skipped = load_prompts(
            cfg.data.prompt_data,
            self.tokenizer,
            input_key=cfg.data.input_key,
            label_key=cfg.data.label_key,
            apply_chat_template=cfg.data.apply_chat_template,
            max_prompt_len=cfg.data.max_prompt_len,
            skip_bad_rows=cfg.data.skip_bad_rows,
        )
        if skipped:
            log.warning("%s: skipped %d malformed rows (--data.skip_bad_rows)", cfg.data.prompt_data, skipped)
        self.skipped_rows = skipped
        self.stream = PromptStream(prompts, cfg.rollout.prompts_per_step, cfg.train.seed, cfg.data.shuffle)
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        os.makedirs(cfg.log.output_dir, exist_ok=True)
        with open(os.path.join(cfg.log.output_dir, "config.json"), "w") as f:
            json.dump(cfg.to_dict(), f, indent=2)
        self._start_ray()
        self._start_groups()
        if cfg.log.resume:
            self._resume()

    def _start_ray(self) -> None:
        import ray

        if not ray.is_initialized():
            # Workers and engines must import what the driver can (a user's module:Class backend or reward).
            paths = [os.getcwd(), os.path.dirname(os.path.abspath(sys.argv[0])), os.environ.get("PYTHONPATH", "")]
            if (os.environ.get("RAY_ADDRESS") or "local") != "local":  # a cluster the user started: join it
                ray.init(runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false",
                                                   "PYTHONPATH": os.pathsep.join(p for p in paths if p)}})
                return
            # otherwise a fresh local instance, never one that happens to run on this machine already; its
            # workers do all the computing, so they run at normal priority (Ray's default is nice 15)
            os.environ.setdefault("RAY_worker_niceness", "0")
            ray.init(
                address="local",
                num_cpus=max(os.cpu_count() or 1, self._cpus_needed()),
                include_dashboard=False,
                log_to_driver=True,
                runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false",
                                          "PYTHONPATH": os.pathsep.join(p for p in paths if p)}},
            )

    def _group_sizes(self) -> dict[str, int]:
        """Ranks of every group this run starts (engines included)."""
        t = self.cfg.train
        sizes = {"actor": t.actor_num_ranks, "engines": self.cfg.rollout.num_engines}
        if self.uses_critic:
            sizes["critic"] = t.critic_num_ranks
        if self.uses_ref:
            sizes["ref"] = t.ref_num_ranks
        if self.cfg.reward.kind == "model":
            sizes["reward"] = self.cfg.reward.num_ranks
        return sizes

    def colocation(self) -> list[list[str]]:
        """The sets of groups that share devices: rank i of each group in a set on bundle i."""
        t, sizes = self.cfg.train, self._group_sizes()
        if t.colocate_all:
            return [[g for g in ("actor", "ref", "critic", "reward", "engines") if g in sizes]]
        sets = []
        if t.colocate_actor_ref:
            sets.append(["actor", "ref"])
        if t.colocate_critic_reward:
            sets.append(["critic", "reward"])
        return sets

    def engine_threads(self) -> int:
        """Torch threads per engine. The step is synchronous: while the engines generate, every model rank
        waits, so on CPU the engines may share all the cores (one thread each left them idle: measured with
        ``python -m rlhf_sg.bench e2e``, generation took 1.3x longer than with the cores shared)."""
        r = self.cfg.rollout
        if r.engine_threads is not None:
            return r.engine_threads
        if self.cfg.train.device != "cpu":
            return 1
        return max(1, (os.cpu_count() or 1) // r.num_engines)

    def _cpus_needed(self) -> int:
        """One Ray CPU per bundle: a rank or engine of its own, or a bundle a colocated set shares."""
        sizes = self._group_sizes()
        shared = self.colocation()
        alone = sum(n for g, n in sizes.items() if not any(g in s for s in shared))
        return alone + sum(max(sizes[g] for g in s) for s in shared)

    def _worker_spec(self, role: str, path: str, world: int, train: bool, lr: float = 0.0):
        from rlhf_sg.distributed import free_port
        from rlhf_sg.workers import WorkerSpec

        t, m = self.cfg.train, self.cfg.model
        return WorkerSpec(
            role=role, model_path=path, world_size=world, master_addr="127.0.0.1", master_port=free_port(),
            train=train, dtype=m.dtype, attn_implementation=m.attn_implementation, lr=lr,
            lr_scheduler=t.lr_scheduler, lr_warmup_steps=lr_warmup_steps(self.cfg, role),
            lr_total_steps=optimizer_steps(self.cfg, role),
            weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm, offload=(role == "ref" and t.ref_offload),
            gradient_checkpointing=train and t.gradient_checkpointing,
            seed=t.seed, threads=t.worker_threads, device=t.device, timeout_s=t.timeout_s,
        )

    def _group(self, spec, shared=None):
        from rlhf_sg.workers import ModelGroup

        gpus = 1.0 if self.cfg.train.device == "cuda" else 0.0
        # On CPU every rank asks for one Ray CPU (a colocated one a share of one); Ray is started with at
        # least as many CPUs as bundles, and each worker runs `worker_threads` OpenMP threads, so phases
        # never oversubscribe the cores.
        return ModelGroup(spec, num_cpus=1.0, num_gpus=gpus, strategy=self.cfg.train.placement_strategy, shared=shared)

    def _start_shared_bundles(self) -> dict[str, object]:
        """One shared placement group per colocated set; returns group name -> its bundles."""
        from rlhf_sg.workers import SharedBundles

        t, sizes, placed = self.cfg.train, self._group_sizes(), {}
        for names in self.colocation():
            bundles = SharedBundles.create(max(sizes[g] for g in names), len(names), t.device,
                                           t.placement_strategy, t.timeout_s)
            self._shared.append(bundles)
            placed.update(dict.fromkeys(names, bundles))
            log.info("colocated on %d shared devices: %s", bundles.size, ", ".join(names))
        return placed

    def _start_groups(self) -> None:
        cfg, t = self.cfg, self.cfg.train
        from backends.base import BackendConfig
        from rlhf_sg.engine_actor import start_engine_actors

        r = cfg.rollout
        engine_config = BackendConfig(
            model_path=cfg.model.pretrain, dtype=cfg.model.dtype, max_model_len=r.max_model_len, seed=t.seed,
            device=t.device, tensor_parallel_size=r.tensor_parallel_size, extra=dict(r.engine_kwargs),
            num_threads=self.engine_threads(),
        )
        gpus = float(r.tensor_parallel_size) if t.device == "cuda" else 0.0
        placed = self._start_shared_bundles()
        self.engines = start_engine_actors(
            r.backend, engine_config, r.num_engines, num_cpus=1.0, num_gpus=gpus, start_timeout_s=t.timeout_s,
            shared=placed.get("engines"),
        )
        self.actor = self._group(self._worker_spec("actor", cfg.model.pretrain, t.actor_num_ranks, True, t.actor_lr),
                                 placed.get("actor"))
        if self.uses_critic:
            critic_path = cfg.model.critic_pretrain or cfg.model.reward_pretrain or cfg.model.pretrain
            self.critic = self._group(self._worker_spec("critic", critic_path, t.critic_num_ranks, True, t.critic_lr),
                                      placed.get("critic"))
        if self.uses_ref:
            self.ref = self._group(self._worker_spec("ref", cfg.model.pretrain, t.ref_num_ranks, False),
                                   placed.get("ref"))
        if cfg.reward.kind == "model":
            self.reward_model = self._group(
                self._worker_spec("reward", cfg.model.reward_pretrain, cfg.reward.num_ranks, False),
                placed.get("reward"),
            )
        self.actor.call(
            "setup_weight_sync", self.engines, cfg.rollout.weight_transport, cfg.rollout.bucket_bytes, t.timeout_s,
            what="weight-sync set-up",
        )

    # ---- one step ------------------------------------------------------------------------------------
    def generate(self, prompts: list[Prompt], draw: int = 0) -> list:
        """Completions for every prompt, n each, prompt-major; prompts are spread over the engines, each
        call seeded by :func:`rollout_seed` (``draw``: the generation round within the step)."""
        import dataclasses

        from backends.base import SamplingParams
        from rlhf_sg.engine_actor import wait_engine_calls

        r = self.cfg.rollout
        params = SamplingParams(
            n=r.n_samples_per_prompt, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            max_new_tokens=r.max_new_tokens, stop_token_ids=tuple(r.stop_token_ids) + (self.eos_id,),
        )
        shards = [list(range(i, len(prompts), len(self.engines))) for i in range(len(self.engines))]
        calls = [
            (i, "generate", engine.generate.remote(
                [prompts[j].token_ids for j in shard],
                dataclasses.replace(params, seed=rollout_seed(self.cfg.train.seed, self.step, draw, i)),
            ))
            for i, (engine, shard) in enumerate(zip(self.engines, shards))
            if shard
        ]
        results = wait_engine_calls(calls, self.cfg.train.timeout_s)
        by_prompt: dict[int, list] = {}
        for shard, completions in zip([s for s in shards if s], results):
            for c in completions:
                by_prompt.setdefault(shard[c.prompt_index], []).append(c)
        return [c for j in range(len(prompts)) for c in by_prompt[j]]

    def _make_rollout(self, timer: StepTimer) -> tuple[list[Prompt], list, dict[str, torch.Tensor], dict[str, float]]:
        """Generate and score the step's samples: (prompts, completions, rollout batch with scores, metrics).

        With ``dynamic_filtering``, groups whose scores are all equal are dropped and more prompts are drawn
        and generated until ``prompts_per_step`` groups have signal, at most ``dynamic_filtering_max_draws``
        rounds; a batch still short is filled up with dropped groups. Every completion must come from the
        weights the trainer holds (:func:`check_weight_versions`)."""
        cfg, t = self.cfg, self.cfg.train
        n, want = cfg.rollout.n_samples_per_prompt, cfg.rollout.prompts_per_step
        groups: list[tuple[Prompt, list, torch.Tensor]] = []
        draws = 0
        while True:
            prompts = self.stream.next_batch()
            with timer.phase("generate"):
                completions = self.generate(prompts, draw=draws)
            draws += 1
            check_weight_versions([c.weight_version for c in completions], self.weight_version)
            batch = self._rollout_batch(prompts, completions)
            with timer.phase("reward"):
                scores = self.compute_rewards(prompts, completions, batch)
            groups += [(p, completions[g * n : (g + 1) * n], scores[g * n : (g + 1) * n])
                       for g, p in enumerate(prompts)]
            if not t.dynamic_filtering:
                batch["scores"] = scores
                return prompts, completions, batch, self._reward_metrics(scores)
            signal = [has_signal(sc) for _, _, sc in groups]
            if sum(signal) >= want or draws >= t.dynamic_filtering_max_draws:
                break
        chosen, filler = select_groups(signal, want)
        if filler:
            log.warning("step %d: %d of %d groups have signal after %d draws (--train.dynamic_filtering_max_draws);"
                        " %d groups without signal fill the batch", self.step, want - filler, want, draws, filler)
        prompts = [groups[g][0] for g in chosen]
        completions = [c for g in chosen for c in groups[g][1]]
        batch = self._rollout_batch(prompts, completions)
        batch["scores"] = torch.cat([groups[g][2] for g in chosen])
        metrics = self._reward_metrics(torch.cat([sc for _, _, sc in groups]))
        metrics.update({"rollout/sample_draws": draws, "rollout/groups_kept_frac": sum(signal) / len(signal),
                        "rollout/unfiltered_groups": filler})
        return prompts, completions, batch, metrics

    def _rollout_batch(self, prompts: list[Prompt], completions: list) -> dict[str, torch.Tensor]:
        n = self.cfg.rollout.n_samples_per_prompt
        return build_rollout_batch(
            [prompts[i // n].token_ids for i in range(len(completions))],
            [c.token_ids for c in completions],
            [c.logprobs for c in completions],
            self.pad_id,
            weight_versions=[c.weight_version for c in completions],
        )

    @staticmethod
    def _reward_metrics(scores: torch.Tensor) -> dict[str, float]:
        """Reward statistics over every sample generated in the step (filtered ones included)."""
        return {"reward/mean": scores.mean().item(), "reward/std": scores.std().item()}

    def _training_groups(self) -> list:
        return [g for g in (self.actor, self.critic) if g is not None]

    def _move_states(self, method: str, groups: list | None = None, **kwargs) -> int:
        """``offload_states`` / ``reload_states`` on every rank of ``groups`` (default: the training groups);
        returns the device bytes moved."""
        groups = self._training_groups() if groups is None else groups
        return sum(sum(g.call(method, what=f"{method} ({g.spec.role})", **kwargs)) for g in groups)

    def _engines_call(self, method: str, *args) -> list:
        from rlhf_sg.engine_actor import wait_engine_calls

        calls = [(i, method, getattr(e, method).remote(*args)) for i, e in enumerate(self.engines)]
        return wait_engine_calls(calls, self.cfg.train.timeout_s)

    # ---- the device between engines and trainer (colocated layouts) -------------------------------------
    # With engines asleep while the trainer trains and training states offloaded while the engines generate,
    # one step hands the device over in this order, so that engine weights, KV cache and training states are
    # never on it together (see backends.base):
    #   training states off -> engine weights on -> sync -> KV cache on -> generate -> engines off -> states on
    def _hand_device_to_engines(self, timer: StepTimer, version: int) -> list[dict]:
        """Push the trainer's weights as ``version`` and leave the engines ready to generate.

        1. training states off the device; the actor keeps its ZeRO-3 parameter shards, which the sync gathers;
        2. engine weights on (``wake(("weights",))``), the KV cache still released;
        3. the weight sync: after a release the engine's weights are stale or gone, so one always follows;
        4. the actor's parameter shards off;
        5. KV cache on (``wake(("kv_cache",))``): the engines can generate.

        Without sleeping engines or offloaded states only step 3 runs. Returns the sync's per-rank stats."""
        from backends.base import MEMORY_KV_CACHE, MEMORY_WEIGHTS

        offloading, sleeping = offload_states(self.cfg), sleep_engines(self.cfg)
        if offloading:
            with timer.phase("offload"):
                self._move_states("offload_states", [self.actor], keep_params=True)
                if self.critic is not None:
                    self._move_states("offload_states", [self.critic])
        with timer.phase("weight_sync"):
            if sleeping:
                self._engines_call("wake", (MEMORY_WEIGHTS,))
            stats = self.actor.call("sync_weights", version, what=f"weight sync to version {version}")
        if offloading:
            with timer.phase("offload"):
                self._move_states("offload_states", [self.actor])
        if sleeping:
            with timer.phase("weight_sync"):
                still = self._engines_call("wake", (MEMORY_KV_CACHE,))
            if any(still):
                raise RuntimeError(f"engines still hold released memory after waking every tag: {still}")
        return stats

    def _hand_device_to_trainer(self, timer: StepTimer) -> int:
        """After generation: the engines release weights and KV cache, then the training states come back.
        Returns the device bytes the training states took back (what they had left to the engines)."""
        if sleep_engines(self.cfg):
            with timer.phase("generate"):
                self._engines_call("sleep")
        if not offload_states(self.cfg):
            return 0
        with timer.phase("offload"):
            return self._move_states("reload_states")

    def compute_rewards(self, prompts: list[Prompt], completions: list, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Scores [B], one per completion. Override for custom scoring."""
        from rlhf_sg.rewards import check_scores, remote_reward

        cfg = self.cfg
        n = cfg.rollout.n_samples_per_prompt
        if cfg.reward.kind == "model":
            plans = self._plans(batch, cfg.reward.num_ranks)
            return self.reward_model.forward(self._put(batch), plans, len(completions))
        texts_p = [prompts[i // n].text for i in range(len(completions))]
        texts_c = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
        labels = [prompts[i // n].label for i in range(len(completions))]
        if cfg.reward.kind == "remote":
            scores = remote_reward(cfg.reward.url, texts_p, texts_c, labels, cfg.train.timeout_s)
        else:
            scores = check_scores(self.reward_fn(texts_p, texts_c, labels), len(completions), "reward function")
        return torch.tensor(scores, dtype=torch.float32)

    def compute_advantages(self, batch: dict[str, torch.Tensor]) -> None:
        """Fill batch["advantages"] (and batch["returns"] with a critic). Override for a custom estimator."""
        t = self.cfg.train
        mask = batch["action_mask"]
        est = t.advantage_estimator
        kl = batch.get("kl")
        kl_in_reward = kl is not None and t.kl_mode == "reward"
        kl_coef = self.kl_ctl.value if kl_in_reward else 0.0
        kl_term = kl if kl_in_reward else torch.zeros_like(batch["rollout_logp"])
        n = self.cfg.rollout.n_samples_per_prompt
        # group estimators take gamma = 1: the baseline is a sequence-level quantity
        if est == "reinforce_baseline":
            batch["advantages"] = algo.reinforce_baseline_advantages(
                batch["scores"], kl_term, mask, n, kl_coef, 1.0, t.score_clip
            )
            return
        if est in GROUP_ESTIMATORS:
            scores = batch["scores"] if t.score_clip is None else batch["scores"].clamp(-t.score_clip, t.score_clip)
            seq_adv = algo.group_advantages(scores, n, est)
            rewards = algo.shape_rewards(seq_adv, kl_term, mask, kl_coef)
            batch["advantages"] = algo.discounted_returns(rewards, mask, 1.0)
            return
        rewards = algo.shape_rewards(batch["scores"], kl_term, mask, kl_coef, t.score_clip)
        if est == "gae":
            adv, returns = algo.gae(rewards, batch["values"], mask, t.gamma, t.lam)
            batch["returns"] = returns
        else:
            adv = algo.discounted_returns(rewards, mask, t.gamma)
        batch["advantages"] = algo.masked_whiten(adv, mask)

    def _put(self, batch):
        import ray

        return ray.put(batch)

    def _plans(self, batch: dict[str, torch.Tensor], world: int, rows: list[int] | None = None):
        from rlhf_sg.packing import token_budget_microbatches

        rows = list(range(batch["sequences"].shape[0])) if rows is None else rows
        lengths = batch["attention_mask"][rows].sum(dim=1).tolist()
        local = token_budget_microbatches(lengths, self.cfg.train.max_tokens_per_microbatch, world)
        return [[[rows[i] for i in micro] for micro in rank] for rank in local]

    def _train_steps(self, batch, world: int, normalize_rows: bool = False) -> list[list[dict[str, Any]]]:
        """Per rank, the list of optimizer steps of all PPO epochs: {"plan", "normalizer"}."""
        t = self.cfg.train
        B = batch["sequences"].shape[0]
        per_rank: list[list[dict[str, Any]]] = [[] for _ in range(world)]
        # a filtered batch (dynamic_filtering) may hold fewer rows than num_minibatches x ranks: then fewer,
        # larger optimizer steps; the split is as even as it can be and drops no row
        num_mb = max(1, min(t.num_minibatches, B // world))
        for _ in range(t.ppo_epochs):
            order = list(range(B))
            self.rng.shuffle(order)
            for k in range(num_mb):
                rows = sorted(order[k * B // num_mb : (k + 1) * B // num_mb])
                if normalize_rows:
                    normalizer = len(rows) / world
                else:
                    normalizer = float(batch["action_mask"][rows].sum()) / world
                for rank, plan in enumerate(self._plans(batch, world, rows)):
                    per_rank[rank].append({"plan": plan, "normalizer": normalizer})
        return per_rank

    def train_step(self) -> dict[str, float]:
        cfg, t = self.cfg, self.cfg.train
        timer = StepTimer(sync=lambda: None)  # every phase below waits on its remote calls itself
        timer.start_step()
        self.on_step_start(self.step)
        profiling = cfg.log.profile_step is not None and cfg.log.profile_step == self.step
        if profiling:
            self.actor.call("start_profile")
        offloading = offload_states(cfg)
        if offloading:  # states still on the device only at the first step (or after a resume); else a no-op
            with timer.phase("offload"):
                self._move_states("offload_states")
        # generate and score (with dynamic filtering, as many rounds as the batch needs)
        self.prompts, _, batch, metrics = self._make_rollout(timer)
        reloaded = self._hand_device_to_trainer(timer)  # engines sleep, then training states come back
        if offloading:
            metrics["offload/device_GB"] = reloaded / 1e9

        batch_ref = self._put(batch)
        B = batch["sequences"].shape[0]
        temperature = cfg.rollout.temperature or 1.0
        if self.uses_ref:
            with timer.phase("reference"):
                batch["ref_logp"] = self.ref.forward(batch_ref, self._plans(batch, t.ref_num_ranks), B, temperature)
        if self.uses_critic:
            with timer.phase("critic"):
                batch["values"] = self.critic.forward(batch_ref, self._plans(batch, t.critic_num_ranks), B)
        if self.recomputes_old_logp:
            with timer.phase("actor_logprob"):
                batch["old_logp"] = self.actor.forward(batch_ref, self._plans(batch, t.actor_num_ranks), B,
                                                       temperature)

        mask = batch["action_mask"]
        if "old_logp" in batch:
            if self.uses_ref:
                kl = algo.approx_kl(batch["old_logp"], batch["ref_logp"], t.kl_estimator)
                batch["kl"] = torch.where(mask, kl, 0.0)
                metrics["kl"] = algo.masked_mean(batch["kl"], mask).item()
            metrics["rollout/logp_gap_engine_vs_trainer"] = algo.masked_mean(
                (batch["rollout_logp"] - batch["old_logp"]).abs(), mask
            ).item()
        self.compute_advantages(batch)
        self.on_experience(batch)

        hp = {
            "temperature": temperature, "clip_low": t.clip_low, "clip_high": t.clip_high, "dual_clip": t.dual_clip,
            "tis_cap": t.tis_cap, "loss_aggregation": t.loss_aggregation, "kl_mode": t.kl_mode,
            "kl_coef": self.kl_ctl.value, "kl_estimator": t.kl_estimator, "entropy_coef": t.entropy_coef,
            "value_clip": t.value_clip,
        }
        train_ref = self._put(batch)
        with timer.phase("train"):
            import ray

            refs = []
            if self.uses_critic:
                steps = self._train_steps(batch, t.critic_num_ranks)
                refs += [w.train_critic.remote(train_ref, steps[i], hp) for i, w in enumerate(self.critic.workers)]
            if not (self.uses_critic and self.step < t.critic_warmup_steps):
                steps = self._train_steps(batch, t.actor_num_ranks, normalize_rows=t.loss_aggregation == "seq_mean")
                refs += [w.train_actor.remote(train_ref, steps[i], hp) for i, w in enumerate(self.actor.workers)]
            try:
                results = ray.get(refs, timeout=t.timeout_s)
            except ray.exceptions.GetTimeoutError as e:
                raise TimeoutError(f"train: actor/critic updates did not finish within {t.timeout_s:.0f} s") from e
            for r in results:
                for k, v in r.items():
                    metrics.setdefault(k, v)
            # without the separate old-log-prob pass the actor's update measured these
            if "actor/logp_gap_engine_vs_trainer" in metrics:
                metrics["rollout/logp_gap_engine_vs_trainer"] = metrics.pop("actor/logp_gap_engine_vs_trainer")
            if "kl" not in metrics and "actor/kl_loss" in metrics:
                metrics["kl"] = metrics["actor/kl_loss"]

        self.step += 1
        # states off, engine weights on, sync, KV cache on (colocated; otherwise the sync alone)
        sync_stats = self._hand_device_to_engines(timer, self.step)
        self.weight_version = self.step
        metrics["weight_sync/GBps"] = float(sync_stats[0].get("GBps", 0.0)) if sync_stats else 0.0
        if metrics.get("kl") is not None:
            self.kl_ctl.update(metrics["kl"], B)
        times = timer.end_step()
        lengths = mask.sum(dim=1).float()
        metrics.update({
            "rollout/response_len": lengths.mean().item(),
            "rollout/samples": B,
            "kl_coef": self.kl_ctl.value,
            "throughput/tokens_per_s": float(batch["attention_mask"].sum()) / times["step"],
            "throughput/samples_per_s": B / times["step"],
        })
        return self._finish_step(metrics, times, profiling)

    def _finish_step(self, metrics: dict[str, float], times: dict[str, float], profiling: bool) -> dict[str, float]:
        """Metrics, hooks, logs and the checkpoint of a finished step (``self.step`` already advanced)."""
        cfg = self.cfg
        if profiling:
            paths = self.actor.call("stop_profile", os.path.join(cfg.log.output_dir, "profile"), f"step{self.step}")
            log.info("torch profiler traces of step %d (open in Perfetto or chrome://tracing): %s", self.step,
                     ", ".join(paths))
        metrics["weight_version"] = self.weight_version
        metrics.update({f"time/{k}": v for k, v in times.items()})
        # the share of the step spent pushing weights into the engines: the cost weight sync exists to keep small
        metrics["perf/weight_sync_share"] = times.get("weight_sync", 0.0) / times["step"] if times.get("step") else 0.0
        self.on_step_end(self.step, metrics)
        self._log(metrics)
        if cfg.log.save_steps and self.step % cfg.log.save_steps == 0:
            self.save_checkpoint()
        return metrics

    # ---- hooks -------------------------------------------------------------------------------------
    def on_step_start(self, step: int) -> None:
        """Called before a step generates."""

    def on_experience(self, batch: dict[str, torch.Tensor]) -> None:
        """Called with the finished experience (advantages filled) before training."""

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        """Called after a step with its metrics (add keys to log them)."""

    # ---- loop, logging, checkpoints -------------------------------------------------------------------
    def fit(self) -> list[dict[str, float]]:
        from tqdm import tqdm

        history = []
        bar = tqdm(total=self.cfg.train.max_steps, initial=self.step, disable=not self.cfg.log.progress_bar,
                   desc="ppo", dynamic_ncols=True)
        while self.step < self.cfg.train.max_steps:
            metrics = self.train_step()
            history.append(metrics)
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", kl=f"{metrics.get('kl', 0.0):.4f}",
                            tok_s=f"{metrics.get('throughput/tokens_per_s', 0.0):.0f}")
        bar.close()
        if not self.cfg.log.save_steps or self.step % self.cfg.log.save_steps:
            self.save_checkpoint()
        if self.cfg.log.export_hf:
            self.export_hf(os.path.join(self.cfg.log.output_dir, "final_hf"))
        return history

    def _log(self, metrics: dict[str, float]) -> None:
        out = self.cfg.log.output_dir
        if self._metrics_file is None:
            self._metrics_file = open(os.path.join(out, "metrics.jsonl"), "a")
            if self.cfg.log.tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(os.path.join(out, "tensorboard"))
            if self.cfg.log.wandb_project:
                import wandb

                wandb.init(project=self.cfg.log.wandb_project, config=self.cfg.to_dict())
        record = {"step": self.step, **metrics}
        self._metrics_file.write(json.dumps(record) + "\n")
        self._metrics_file.flush()
        if self._writer is not None:
            for k, v in metrics.items():
                self._writer.add_scalar(k, v, self.step)
            self._writer.flush()
        if self.cfg.log.wandb_project:
            import wandb

            wandb.log(metrics, step=self.step)

    def _ckpt_root(self) -> str:
        return os.path.join(self.cfg.log.output_dir, "checkpoints")

    def save_checkpoint(self) -> str:
        tag = f"step{self.step}"
        root = self._ckpt_root()
        state = {"step": self.step}
        self.actor.call("save_checkpoint", os.path.join(root, "actor"), tag, state, what="actor checkpoint")
        if self.critic is not None:
            self.critic.call("save_checkpoint", os.path.join(root, "critic"), tag, state, what="critic checkpoint")
        trainer_state = {
            "step": self.step,
            "data": self.stream.state(),
            "rng": self.rng.getstate(),
            "kl_coef": self.kl_ctl.value,
            "tag": tag,
        }
        with open(os.path.join(root, f"{tag}.trainer.json"), "w") as f:
            json.dump(trainer_state, f, default=list)
        with open(os.path.join(root, "latest"), "w") as f:
            f.write(tag)
        return os.path.join(root, tag)

    def _resume(self) -> None:
        root = self._ckpt_root()
        latest = os.path.join(root, "latest")
        if not os.path.isfile(latest):
            log.warning("--log.resume: no checkpoint under %s; starting from step 0", root)
            return
        with open(latest) as f:
            tag = f.read().strip()
        with open(os.path.join(root, f"{tag}.trainer.json")) as f:
            state = json.load(f)
        self.actor.call("load_checkpoint", os.path.join(root, "actor"), tag, what="actor checkpoint load")
        if self.critic is not None:
            self.critic.call("load_checkpoint", os.path.join(root, "critic"), tag, what="critic checkpoint load")
        self.step = int(state["step"])
        self.stream.load_state(state["data"])
        rng_state = state["rng"]
        self.rng.setstate((rng_state[0], tuple(rng_state[1]), rng_state[2]))
        self.kl_ctl.value = float(state["kl_coef"])
        # engines started from the initial weights: give them the checkpoint's
        self.actor.call("sync_weights", self.step, what=f"weight sync after resume (version {self.step})")
        self.weight_version = self.step
        log.info("resumed from %s at step %d", tag, self.step)

    def export_hf(self, path: str) -> str:
        self.actor.call("export_hf", path, what="HF export")
        self.tokenizer.save_pretrained(path)
        return path

    def shutdown(self) -> None:
        import ray

        for group in (self.actor, self.critic, self.ref, self.reward_model):
            if group is not None:
                group.shutdown()
        for e in self.engines:
            try:
                ray.get(e.shutdown.remote(), timeout=60)
            except Exception:  # the engine may already be gone; shutting down must not fail the run
                log.warning("an engine did not shut down cleanly", exc_info=True)
            ray.kill(e)
        self.engines = []
        for bundles in self._shared:
            bundles.remove()
        self._shared = []
        if self._metrics_file is not None:
            self._metrics_file.close()
        if self._writer is not None:
            self._writer.close()


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


__all__ = ["PPOTrainer", "build_rollout_batch", "check_weight_versions", "load_tokenizer",
           "rollout_seed", "train"]
