"""Experience making, first half: prompts -> engines -> completions -> rewards, as one :class:`Experience`.

With dynamic sampling (``--train.dynamic_filtering``, as DAPO does it) groups whose samples all score
the same are dropped and more prompts are drawn and generated until the batch is full; the extra
rounds belong to the same step."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Callable

import torch

from rlhf_sg.config import Config, row_token_limit
from rlhf_sg.data import Prompt, PromptStream
from rlhf_sg.experience import Experience, build_rollout_batch
from rlhf_sg.timing import StepTimer

log = logging.getLogger("rlhf_sg")

#: ``(prompts, completions, experience) -> scores [B]``: the trainer's reward hook
ScoreFn = Callable[[list[Prompt], list, Experience], torch.Tensor]


def rollout_seed(run_seed: int, step: int, draw: int, engine_index: int, segment: int = 0) -> int:
    """The sampling seed of one generate call: a 63-bit hash of (run seed, step, draw within the step,
    engine, and for the continuation of aborted completions in partial rollout, its segment). Engines, steps,
    draws and segments get unrelated random streams (the k-th prompt of two engines does not draw the same
    numbers), and a repeated run gets the same ones."""
    key = f"{run_seed}/{step}/{draw}/{engine_index}" + (f"/{segment}" if segment else "")
    key = key.encode()
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


def check_staleness(versions: list[int], trainer_version: int, max_staleness: int) -> list[int]:
    """Async rollout: every completion's weight version (the oldest weights that sampled any of its tokens) is at
    most ``max_staleness`` versions behind the trainer's and never ahead of it. Returns each completion's
    staleness; raises RuntimeError naming the completions otherwise."""
    staleness = [trainer_version - v for v in versions]
    bad = [i for i, s in enumerate(staleness) if not 0 <= s <= max_staleness]
    if bad:
        found = sorted({versions[i] for i in bad})
        raise RuntimeError(
            f"async step at weight version {trainer_version}: {len(bad)} completion(s) (e.g. {bad[:4]}) were sampled "
            f"with weight version(s) {found}, outside the {max_staleness} version(s) --rollout.max_staleness allows"
        )
    return staleness


def continue_completion(before, after, budget: int):
    """One completion of partial rollout: ``before`` (cut short at a weight sync, ``finish_reason == "abort"``)
    followed by ``after`` (generated from the prompt plus ``before``'s tokens), cut to ``budget`` new tokens in
    all. Tokens and log-probs of both are kept, and each token's weight version (``token_versions``); the weight
    version is the oldest that sampled a token."""
    from backends.base import Completion

    room = budget - len(before.token_ids)
    tokens, logprobs = after.token_ids[:room], after.logprobs[:room]
    finish = after.finish_reason if len(after.token_ids) <= room else "length"
    version = before.weight_version if before.token_ids else after.weight_version
    return Completion(before.token_ids + tokens, before.logprobs + logprobs, finish, version, before.prompt_index,
                      token_versions=token_versions_of(before) + token_versions_of(after)[:room])


def token_versions_of(completion) -> list[int]:
    """The weight version of each token of a completion or multi-turn trajectory (``token_versions``, or every
    token its ``weight_version``'s where none are recorded)."""
    versions = getattr(completion, "token_versions", None)
    return list(versions) if versions is not None else [completion.weight_version] * len(completion.token_ids)


def has_signal(group_scores: torch.Tensor, score_range: list[float] | None = None) -> bool:
    """Whether a group's scores ([n], one prompt's samples) differ: a group of equal scores gets zero
    advantage from every group estimator, so it costs training compute and teaches nothing. With
    ``score_range`` (lo, hi) the group's mean must also lie strictly inside it (OpenRLHF's
    ``dynamic_filtering_range``: e.g. drop prompts every sample solves or none does)."""
    if not bool((group_scores.max() - group_scores.min()) > 0):
        return False
    if score_range:
        lo, hi = score_range
        return lo < group_scores.float().mean().item() < hi
    return True


def groups_with_signal(group_scores: list[torch.Tensor], score_clip: float | None,
                       score_range: list[float] | None = None) -> list[bool]:
    """Dynamic sampling's verdict on each group ([n] scores, overlong-shaped), judged on the scores the
    advantages use: clipped to ``score_clip`` first, so a group whose scores all clip alike has no signal."""
    return [has_signal(sc if score_clip is None else sc.clamp(-score_clip, score_clip), score_range)
            for sc in group_scores]


def eos_token_ids(model_dir: str, tokenizer) -> tuple[int, ...]:
    """Every id that ends a completion: the tokenizer's EOS and each ``eos_token_id`` of the model's
    ``generation_config.json`` (often a list for chat models: ``<|im_end|>``, ``<|eot_id|>``), in that order."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids += [eos] if isinstance(eos, int) else [int(e) for e in eos or []]
    return tuple(dict.fromkeys(ids))


def check_completions_per_prompt(counts: list[int], n: int, prompts: list[list[int]], engine_of: list[int]) -> None:
    """Every prompt must come back with exactly ``n`` completions: the group estimators and dynamic sampling
    read each prompt's samples as one contiguous group of n."""
    for j, count in enumerate(counts):
        if count != n:
            head = prompts[j][:16]
            raise RuntimeError(
                f"engine {engine_of[j]} returned {count} completion(s) for prompt {j} of the call (token ids "
                f"{head}{'...' if len(prompts[j]) > 16 else ''}), expected --rollout.n_samples_per_prompt {n}; "
                "the backend's generate must return n completions per prompt, prompt-major"
            )


def select_groups(signal: list[bool], want: int) -> tuple[list[int], int]:
    """Dynamic sampling's choice of the step's groups from all drawn so far (in draw order).

    signal[g]: whether group g has signal. Returns (the indices of the ``want`` groups to train on: the
    first groups with signal, then, when there are too few, the first groups without; the number of
    groups without signal among them).
    """
    kept = [g for g, s in enumerate(signal) if s][:want]
    filler = [g for g, s in enumerate(signal) if not s][: want - len(kept)]
    return kept + filler, len(filler)


def reward_metrics(scores: torch.Tensor) -> dict[str, float]:
    """Reward statistics over every sample generated in the step (filtered ones included)."""
    return {"reward/mean": scores.mean().item(), "reward/std": scores.std().item()}


def harness_scores(trajectories: list, n: int) -> torch.Tensor:
    """The harness runs' rewards [B]; an unscored run (``env_reward`` None) gets its group's mean over the scored
    runs (0.0 when none is), so statistics that do not know ``Experience.scored`` (reward metrics, dynamic
    sampling, the non-group estimators) see it as neutral."""
    rewards = [t.env_reward for t in trajectories]
    out = []
    for g in range(0, len(rewards), n):
        group = rewards[g : g + n]
        got = [r for r in group if r is not None]
        fill = sum(got) / len(got) if got else 0.0
        out += [fill if r is None else float(r) for r in group]
    return torch.tensor(out, dtype=torch.float32)


def harness_metrics(results: list) -> dict[str, float]:
    """Per rollout: unscored runs (``agent/unscored``: None, an exception or a timeout), those that failed
    (``agent/harness_errors``), calls that continued a sample by token-id prefix and those that forked one (summed),
    auxiliary calls left out of training, and tool calls parsed per call."""
    calls = sum(r.calls for r in results)
    return {"agent/unscored": float(sum(r.reward is None for r in results)),
            "agent/harness_errors": float(sum(r.error is not None for r in results)),
            "agent/calls_continued": float(sum(r.continued for r in results)),
            "agent/calls_forked": float(sum(r.forked for r in results)),
            "agent/auxiliary_calls": float(sum(r.auxiliary for r in results)),
            "agent/tool_calls_per_call": sum(r.tool_calls for r in results) / calls if calls else 0.0}


def prompt_images(prompts: list[Prompt]) -> list | None:
    """Each prompt's image inputs (a vision-language policy's :class:`rlhf_sg.vision.VisionPrompt`), the samples of
    one prompt sharing its object; None when no prompt has images (text rows)."""
    images = [getattr(p, "images", None) for p in prompts]
    return images if any(i is not None for i in images) else None


class EngineFailure(RuntimeError):
    """An engine died more times in a row than ``--rollout.max_engine_restarts`` allows."""


#: ``(engine index) -> None``: replace the dead engine and give it the current weights
RestartFn = Callable[[int], None]


class RolloutMaker:
    """Draws the step's prompts, spreads them over the engines and scores the completions.

    An engine that dies while generating (its actor or process killed, a crash, out of memory) is restarted
    through ``restart`` and its prompts are generated again, with the same seed; ``restarts`` counts them.
    After ``--rollout.max_engine_restarts`` restarts of one engine in a row, :class:`EngineFailure`."""

    def __init__(self, cfg: Config, engines: list, stream: PromptStream, eos_id: int | tuple[int, ...], pad_id: int,
                 score: ScoreFn, restart: RestartFn | None = None, on_policy: bool = True, tokenizer=None):
        self.cfg, self.engines, self.stream, self.score = cfg, engines, stream, score
        #: multi-turn rollouts (--agent.env): the environment factory, the tokenizer the environments and the
        #: reward text use, and the bounded pool environment steps run in
        self.env_factory = self._env_pool = None
        self.tokenizer = tokenizer
        self.template_mismatches = 0  # turn boundaries unlike the chat template's in the last agent rollout
        if cfg.agent.env is not None:
            from rlhf_sg.agent import ToolPool, load_env_factory

            if tokenizer is None:
                raise ValueError("RolloutMaker: --agent.env needs the tokenizer (pass tokenizer=)")
            self.env_factory = load_env_factory(cfg.agent.env)
            self._env_pool = ToolPool(cfg.agent.env_workers, cfg.agent.max_hung_steps)
        #: agent harness rollouts (--agent.harness): the user's async function; the last rollout's runs
        self.harness, self.harness_results = None, []
        if cfg.agent.harness is not None:
            from rlhf_sg.serve.harness import load_harness

            if tokenizer is None:
                raise ValueError("RolloutMaker: --agent.harness needs the tokenizer (pass tokenizer=)")
            self.harness = load_harness(cfg.agent.harness)
        self.router = None  # which engine serves each prompt group of an agent rollout (made at the first one)
        #: every EOS id (:func:`eos_token_ids`), each a stop token of the engines
        self.eos_ids = (eos_id,) if isinstance(eos_id, int) else tuple(eos_id)
        self.pad_id, self.restart = pad_id, restart
        self.on_policy = on_policy  # every completion must come from the trainer's weights (sync rollout)
        self.restarts = 0  # engine restarts so far
        self.continued = 0  # completions cut short at a weight sync and continued after it (partial rollout)
        self._in_a_row = [0] * len(engines)
        #: async rollout's hooks: before engine generate calls go out / after they all returned
        self.before_generate: Callable[[], None] = lambda: None
        self.after_generate: Callable[[], None] = lambda: None

    def sampling_params(self):
        from backends.base import SamplingParams

        r = self.cfg.rollout
        return SamplingParams(
            n=r.n_samples_per_prompt, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            stop_token_ids=tuple(dict.fromkeys(tuple(r.stop_token_ids) + self.eos_ids)),
            return_routed_experts=self.cfg.train.routing_replay,
        )

    def generate(self, prompts: list[Prompt], step: int, draw: int = 0) -> list:
        """Completions for every prompt, n each, prompt-major; prompts are spread over the engines, each
        call seeded by :func:`rollout_seed` (``draw``: the generation round within the step).

        Partial rollout: completions a weight sync cut short (``finish_reason == "abort"``) are continued after
        it, each from its prompt plus its tokens so far, until none is left (:func:`continue_completion`).

        With ``--agent.env`` every sample is a multi-turn :class:`rlhf_sg.agent.Trajectory`
        (:func:`rlhf_sg.agent.run_agent_rollout`); a turn cut short at a weight sync continues there."""
        params = self.sampling_params()
        if self.env_factory is not None:
            return self._agent_generate(prompts, params, step, draw)
        if self.harness is not None:
            return self._harness_generate(prompts, params)
        images = prompt_images(prompts)
        completions = self._generate([p.token_ids for p in prompts], params, step, draw, images=images)
        calls, spanning = 0, set()
        while True:
            cut = [k for k, c in enumerate(completions) if c.finish_reason == "abort"]
            spanning.update(k for k in cut if completions[k].token_ids)  # tokens from two weight versions or more
            if not cut:
                self.continued += len(spanning)
                return completions
            # one call per remaining budget, so no continuation asks for more context than its completion had
            # (rows decoded together were cut at the same length: few calls)
            by_room: dict[int, list[int]] = {}
            for k in cut:
                by_room.setdefault(params.max_new_tokens - len(completions[k].token_ids), []).append(k)
            for room, rows in sorted(by_room.items()):
                heads = [prompts[k // params.n].token_ids + completions[k].token_ids for k in rows]
                calls += 1  # every continuation call gets a random stream of its own
                tails = self._generate(heads, dataclasses.replace(params, n=1, max_new_tokens=room), step, draw,
                                       calls, images=None if images is None else [images[k // params.n] for k in rows])
                for k, tail in zip(rows, tails):
                    completions[k] = continue_completion(completions[k], tail, params.max_new_tokens)

    def _agent_generate(self, prompts: list[Prompt], params, step: int, draw: int) -> list:
        from rlhf_sg.agent import check_turn_boundaries, run_agent_rollout, turn_glue, turn_seed
        from rlhf_sg.serve.router import Router

        if self.router is None:
            self.router = Router(len(self.engines), self.cfg.rollout.routing)
        seed = self.cfg.train.seed
        trajectories = run_agent_rollout(
            prompts, params.n, params, self._generate_on, self.env_factory, self.tokenizer, self.cfg.agent,
            len(self.engines), self.cfg.rollout.max_model_len,
            lambda engine, turn, budget: turn_seed(seed, step, draw, engine, turn, budget), self._env_pool,
            self.router)
        # partial rollout's count: samples with tokens from two weight versions or more (a turn cut by a sync and
        # continued after it, or turns on either side of one)
        self.continued += sum(len(set(t.turn_versions)) > 1 for t in trajectories)
        mode = self.cfg.agent.template_check
        if mode != "off":
            if not hasattr(self, "_glue"):
                self._glue = turn_glue(self.tokenizer)
            if self._glue is not None:
                self.template_mismatches = check_turn_boundaries(trajectories, self._glue, mode)
        return trajectories

    def _harness_generate(self, prompts: list[Prompt], params) -> list:
        """``n`` runs of the harness per prompt against the endpoint, served over the engines for this rollout and
        routed by ``--rollout.routing``; each run's sample as a :class:`rlhf_sg.agent.Trajectory` row (its prompt
        ids as prefilled, its reward in ``env_reward``, None when unscored)."""
        from rlhf_sg.serve.endpoint import Endpoint
        from rlhf_sg.serve.harness import ActorEngine, as_trajectory, serve_and_run
        from rlhf_sg.serve.router import Router

        a, r, t = self.cfg.agent, self.cfg.rollout, self.cfg.train
        if self.router is None:
            self.router = Router(len(self.engines), r.routing)
        endpoint = Endpoint([ActorEngine(e, t.timeout_s) for e in self.engines], self.tokenizer,
                            self.cfg.model.pretrain, router=self.router, stop_token_ids=params.stop_token_ids,
                            generate_timeout_s=t.timeout_s)
        context = row_token_limit(self.cfg)  # a row is its last call's prompt and completion
        self.harness_results = serve_and_run(endpoint, self.harness, prompts, params.n, a.harness_workers,
                                             params.max_new_tokens, context, a.harness_timeout_s)
        return [as_trajectory(res, prompts[res.prompt_index].token_ids, self.pad_id) for res in self.harness_results]

    def _generate_on(self, calls: list[tuple[int, list[list[int]], object]]) -> list[list]:
        """Each call ``(engine index, prompts, params)`` on that engine (affinity: never another), the engines
        working concurrently; an engine that dies is restarted and its calls made again."""
        from rlhf_sg.engine_actor import EngineDied, wait_engine_calls_or_died

        results: dict[int, list] = {}
        pending = list(range(len(calls)))
        while pending:
            self.before_generate()
            try:
                refs = [(calls[j][0], "generate", self.engines[calls[j][0]].generate.remote(calls[j][1], calls[j][2]))
                        for j in pending]
                got = wait_engine_calls_or_died(refs, self.cfg.train.timeout_s)
            finally:
                self.after_generate()
            died = {}
            for j, result in zip(pending, got):
                if isinstance(result, EngineDied):
                    died[calls[j][0]] = result
                else:
                    results[j] = result
                    self._in_a_row[calls[j][0]] = 0
            for engine, error in died.items():
                self._restart(engine, error)
            pending = [j for j in pending if j not in results]
        return [results[j] for j in range(len(calls))]

    @property
    def per_sample(self) -> bool:
        """Whether async rollout may admit this maker's samples one prompt group at a time
        (:class:`rlhf_sg.offpolicy.InFlight`): single-turn rollouts whose batch is its groups as drawn (no dynamic
        sampling, no multi-turn or harness runs, no routed experts to keep)."""
        return (self.env_factory is None and self.harness is None and not self.cfg.train.dynamic_filtering
                and not self.cfg.train.routing_replay)

    def generate_ids(self, prompts: list[list[int]], params, step: int, draw: int, segment: int = 0,
                     images: list | None = None) -> list:
        """``params.n`` completions per token-id prompt, prompt-major, over the engines (restarting any that dies),
        one call per engine seeded by :func:`rollout_seed` of (``step``, ``draw``, the engine, ``segment``)."""
        return self._generate(prompts, params, step, draw, segment, images)

    def score_batch(self, prompts: list[Prompt], completions: list) -> tuple[Experience, dict[str, float]]:
        """A step's batch from its prompts and their completions (n each, prompt-major), scored by the reward (the
        overlong penalty added): (experience with ``scores``, reward metrics)."""
        experience = self._experience(prompts, completions)
        experience.scores = self.shape_scores(self._agent_scores(prompts, completions, experience), experience)
        return experience, reward_metrics(experience.scores)

    def _generate(self, prompts: list[list[int]], params, step: int, draw: int, segment: int = 0,
                  images: list | None = None) -> list:
        """``params.n`` completions per token-id prompt, prompt-major, the prompts spread over the engines; an
        engine that dies is restarted and its prompts generated again. ``images``: each prompt's image inputs (a
        vision-language policy), sent with it."""
        from rlhf_sg.engine_actor import EngineDied, wait_engine_calls_or_died

        shards = {i: list(range(i, len(prompts), len(self.engines))) for i in range(len(self.engines))}
        pending = {i: shard for i, shard in shards.items() if shard}
        by_prompt: dict[int, list] = {}
        while pending:
            self.before_generate()
            try:
                calls = [(i, "generate", self.engines[i].generate.remote(
                    [prompts[j] for j in shard],
                    dataclasses.replace(params, seed=rollout_seed(self.cfg.train.seed, step, draw, i, segment)),
                    *(() if images is None else ([images[j] for j in shard],)),
                )) for i, shard in pending.items()]
                results = wait_engine_calls_or_died(calls, self.cfg.train.timeout_s)
            finally:
                self.after_generate()
            for (i, _, _), result in zip(calls, results):
                if isinstance(result, EngineDied):
                    self._restart(i, result)
                    continue
                self._in_a_row[i] = 0
                for c in result:
                    by_prompt.setdefault(pending[i][c.prompt_index], []).append(c)
                del pending[i]
        engine_of = {j: i for i, shard in shards.items() for j in shard}
        check_completions_per_prompt([len(by_prompt.get(j, [])) for j in range(len(prompts))], params.n, prompts,
                                     [engine_of[j] for j in range(len(prompts))])
        return [c for j in range(len(prompts)) for c in by_prompt[j]]

    def _restart(self, index: int, died: Exception) -> None:
        self._in_a_row[index] += 1
        if self.restart is None or self._in_a_row[index] > self.cfg.rollout.max_engine_restarts:
            raise EngineFailure(
                f"engine {index} died {self._in_a_row[index]} time(s) in a row while generating, more than "
                f"--rollout.max_engine_restarts {self.cfg.rollout.max_engine_restarts} allows; last: {died}. Check "
                "the engine's log (Ray's worker logs) for why: out of memory, a crash in the engine, a killed process"
            ) from died
        log.warning("%s; restarting it (restart %d in a row) and generating its prompts again", died,
                    self._in_a_row[index])
        self.restart(index)
        self.restarts += 1

    def make(self, timer: StepTimer, step: int, weight_version: int) -> tuple[list[Prompt], Experience, dict]:
        """Generate and score the step's samples: (prompts, experience with scores, metrics).

        With ``dynamic_filtering``, groups whose scores are all equal are dropped and more prompts are drawn
        and generated until ``prompts_per_step`` groups have signal, at most ``dynamic_filtering_max_draws``
        rounds; a batch still short is filled up with dropped groups. Every completion must come from
        ``weight_version``, the weights the trainer holds (:func:`check_weight_versions`)."""
        restarts_before, continued_before = self.restarts, self.continued
        prompts, experience, metrics = self._make(timer, step, weight_version)
        metrics["rollout/engine_restarts"] = self.restarts - restarts_before
        if not self.on_policy:
            metrics["rollout/partial_samples"] = self.continued - continued_before
        return prompts, experience, metrics

    def _make(self, timer: StepTimer, step: int, weight_version: int) -> tuple[list[Prompt], Experience, dict]:
        t, n, want = self.cfg.train, self.cfg.rollout.n_samples_per_prompt, self.cfg.rollout.prompts_per_step
        groups: list[tuple[Prompt, list, torch.Tensor]] = []
        draws = 0
        while True:
            prompts = self.stream.next_batch()
            with timer.phase("generate"):
                completions = self.generate(prompts, step, draw=draws)
            draws += 1
            if self.on_policy:  # every turn of a multi-turn sample
                from rlhf_sg.agent import sampled_versions

                check_weight_versions(sampled_versions(completions), weight_version)
            experience = self._experience(prompts, completions)
            with timer.phase("reward"):
                scores = self._agent_scores(prompts, completions, experience)
            scores = self.shape_scores(scores, experience)
            agent_stats = self._agent_stats(completions)
            if not t.dynamic_filtering:
                experience.scores = scores
                return prompts, experience, {**reward_metrics(scores), **agent_stats}
            groups += [(p, completions[g * n : (g + 1) * n], scores[g * n : (g + 1) * n])
                       for g, p in enumerate(prompts)]
            signal = groups_with_signal([sc for _, _, sc in groups], t.score_clip, t.dynamic_filtering_range)
            if sum(signal) >= want or draws >= t.dynamic_filtering_max_draws:
                break
        chosen, filler = select_groups(signal, want)
        if filler:
            log.warning("step %d: %d of %d groups have signal after %d draws (--train.dynamic_filtering_max_draws);"
                        " %d groups without signal fill the batch", step, want - filler, want, draws, filler)
        prompts = [groups[g][0] for g in chosen]
        experience = self._experience(prompts, [c for g in chosen for c in groups[g][1]])
        experience.scores = torch.cat([groups[g][2] for g in chosen])
        # filler groups run through the forwards but stay out of the losses and their normaliser
        signal_rows = torch.tensor([signal[g] for g in chosen for _ in range(n)])
        experience.loss_rows = signal_rows if experience.loss_rows is None else experience.loss_rows & signal_rows
        metrics = {**reward_metrics(torch.cat([sc for _, _, sc in groups])), **agent_stats}
        metrics.update({"rollout/sample_draws": draws, "rollout/groups_kept_frac": sum(signal) / len(signal),
                        "rollout/unfiltered_groups": filler})
        return prompts, experience, metrics

    def _experience(self, prompts: list[Prompt], completions: list) -> Experience:
        n = self.cfg.rollout.n_samples_per_prompt
        agent = self.env_factory is not None or self.harness is not None
        experience = build_rollout_batch(
            [getattr(c, "prompt_ids", None) or prompts[i // n].token_ids for i, c in enumerate(completions)],
            [c.token_ids for c in completions],
            [c.logprobs for c in completions],
            self.pad_id,
            weight_versions=[c.weight_version for c in completions],
            token_versions=[token_versions_of(c) for c in completions],
            finish_reasons=[c.finish_reason for c in completions],
            action_masks=[c.action_mask for c in completions] if agent else None,
            routed_experts=[c.routed_experts for c in completions] if self.cfg.train.routing_replay else None,
        )
        experience.images = prompt_images([prompts[i // n] for i in range(len(completions))])
        if self.harness is not None:  # unscored harness runs: out of the group baselines and the losses
            experience.scored = torch.tensor([c.env_reward is not None for c in completions])
            experience.loss_rows = experience.scored.clone()
        return experience

    def _agent_scores(self, prompts: list[Prompt], completions: list, experience: Experience) -> torch.Tensor:
        """The reward function's scores, with the environments' rewards as ``--agent.env_reward`` says."""
        if self.harness is not None:
            return harness_scores(completions, self.cfg.rollout.n_samples_per_prompt)
        how = self.cfg.agent.env_reward if self.env_factory is not None else "ignore"
        if how == "ignore":
            return self.score(prompts, completions, experience)
        env = torch.tensor([c.env_reward or 0.0 for c in completions], dtype=torch.float32)
        return env if how == "replace" else self.score(prompts, completions, experience).float() + env

    def _agent_stats(self, completions: list) -> dict[str, float]:
        from rlhf_sg.agent import agent_metrics

        if self.harness is not None:
            return {**agent_metrics(completions), **harness_metrics(self.harness_results), **self.router.metrics()}
        if self.env_factory is None:
            return {}
        return {**agent_metrics(completions), "agent/template_mismatch": float(self.template_mismatches),
                "agent/hung_steps": float(self._env_pool.hung), **(self.router.metrics() if self.router else {})}

    def shape_scores(self, scores: torch.Tensor, experience: Experience) -> torch.Tensor:
        """The reward's scores [B] with DAPO's overlong penalty added (``--reward.overlong_buffer_len``):
        :func:`rlhf_sg.algorithms.overlong_penalty` of each completion's length."""
        from rlhf_sg.algorithms import overlong_penalty

        rw = self.cfg.reward
        if rw.overlong_buffer_len is None:
            return scores
        lengths = experience.action_mask.sum(dim=1)
        return scores.float() + overlong_penalty(lengths, self.cfg.rollout.max_new_tokens, rw.overlong_buffer_len,
                                                 rw.overlong_penalty_factor)
