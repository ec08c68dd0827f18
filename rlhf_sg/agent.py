"""Multi-turn, tool-calling rollouts: the agent loop and the environment interface.

A user writes one file with an environment class and a factory, and sets ``--agent.env module:factory``.
The factory is called as ``factory(tokenizer)`` once per trajectory (never shared between the n samples of a
group). The loop::

    env.reset(prompt)
    repeat:  model turn = engine.generate(prompt ids + row so far)       (tokens in, tokens out; mask 1)
             result = env.step(turn ids, turn text, finish reason)         (a bounded thread pool, a timeout)
             result.done -> the trajectory ends ("env_done")
             result.observation_ids appended to the row as given            (mask 0)

A row holds exactly the token ids the engine sampled and the observation ids the engine was then given; the
decoded text serves tool parsing and the reward only, never the row. The stop token stays with the model's
turn (mask 1); template glue after it (Qwen's ``\\n`` after ``<|im_end|>``) belongs to the observation (mask 0).

Budgets (per trajectory): the total is ``--rollout.max_new_tokens`` (the row width of the response block, as
in single-turn runs: every token after the prompt, observations included); each turn may sample at most
``min(--agent.max_turn_tokens, total left, context left)``. An observation longer than
``--agent.max_observation_tokens`` is cut to it; one that does not fit the budget left (with room for one more
model token) is rolled back (not appended) or truncated to what fits, as ``--agent.overflow`` says, and the
trajectory ends ("overflow"). Every trajectory ends with one reason: stop (the model stopped and the
environment did not answer), length (the budget ran out), max_turns, env_done, overflow or abort.

Tool failures are observations: an environment raises :class:`ToolError` (malformed call, unknown tool) and
the loop asks it for :meth:`Environment.error_observation`; an exception from ``step`` counts as kind
``exception`` and a step slower than ``--agent.tool_timeout_s`` as ``timeout`` (the trajectory goes on with the
error observation). Each is counted per trajectory. Steps run in a :class:`ToolPool`: daemon threads, so a step
that never returns is left behind without holding the process at exit.

The reward sees the model's text only (``--agent.reward_text model``: the decoded model turns, concatenated)
unless ``all`` (the decoded response block, observations included) is asked; the score lands on the last
action token. An environment may return its own reward (``StepResult.reward``; summed over steps), used as
``--agent.env_reward`` says: ignore, add (to the reward function's score) or replace (the reward function is
not called).

Engines: every turn of a trajectory goes to the engine that served its first turn (its prefix, the earlier
turns, is then in that engine's prefix cache), which ``--rollout.routing`` picks per prompt group
(:mod:`rlhf_sg.serve.router`); each turn's generate call gets a seed derived from the run seed,
step, draw, engine, turn and budget, so a rerun repeats. Each turn's weight version is recorded; the sample
carries the oldest (sync mode checks that all are the trainer's).
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import importlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "FINISH_REASONS",
    "Environment",
    "StepResult",
    "ToolError",
    "ToolPool",
    "Trajectory",
    "agent_metrics",
    "check_turn_boundaries",
    "completion_text",
    "load_env_factory",
    "run_agent_rollout",
    "sampled_versions",
    "turn_glue",
    "turn_seed",
]

FINISH_REASONS = ("stop", "length", "max_turns", "env_done", "overflow", "abort")
TOOL_ERROR_KINDS = ("malformed", "unknown_tool", "exception", "timeout")


class ToolError(Exception):
    """Raised by :meth:`Environment.step` for a tool call that failed: ``kind`` is ``malformed`` (the call
    cannot be parsed), ``unknown_tool`` or ``exception`` (the tool raised); the loop turns it into
    :meth:`Environment.error_observation` and counts it."""

    def __init__(self, kind: str, message: str):
        if kind not in TOOL_ERROR_KINDS:
            raise ValueError(f"ToolError kind {kind!r}: use one of {TOOL_ERROR_KINDS}")
        super().__init__(message)
        self.kind = kind


@dataclass
class StepResult:
    """What :meth:`Environment.step` returns.

    observation_ids: token ids appended to the row after the model's turn (mask 0), as the engine will get them
    (template glue included); done: the trajectory ends here; reward: the environment's reward for this step
    (None: none); tool_call: the turn held a tool call (counted); info: free-form, kept on the trajectory."""

    observation_ids: list[int] = field(default_factory=list)
    done: bool = False
    reward: float | None = None
    tool_call: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Environment:
    """One trajectory's environment. Subclass it, implement :meth:`reset` and :meth:`step`; the factory named by
    ``--agent.env`` makes one per trajectory (``factory(tokenizer)``)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        """Observation ids for ``text`` (no BOS / EOS added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def reset(self, prompt) -> None:
        """Start a trajectory for ``prompt`` (:class:`rlhf_sg.data.Prompt`: ids, text, label)."""

    def step(self, turn_ids: list[int], turn_text: str, finish_reason: str) -> StepResult:
        """React to one model turn: ``turn_ids`` (exactly as sampled, the stop token included), their decoded
        ``turn_text`` and the engine's finish reason (``stop`` or ``length`` when the per-turn cap cut it)."""
        raise NotImplementedError

    def error_observation(self, kind: str, message: str) -> list[int]:
        """The observation a failed tool call gets (``kind`` of :data:`TOOL_ERROR_KINDS`)."""
        return self.encode(f"[error {kind}: {message}]")

    def close(self) -> None:
        """The trajectory ended (release what the environment holds)."""


class ToolPool:
    """Where environment steps run: at most ``workers`` threads at a time, started as steps arrive.

    The threads are daemons: ``concurrent.futures.ThreadPoolExecutor`` joins its threads when the interpreter
    exits, so a single tool that never returns would hold the process forever. A step that outlives its timeout
    is given up (:meth:`abandon`): a step still queued never runs; a running one keeps its thread until it
    returns (Python cannot stop a thread), but that thread no longer counts against ``workers`` and another takes
    its place. More than ``max_hung`` given-up steps still running at once is a fault of the run, not of one
    trajectory: :meth:`abandon` raises RuntimeError naming ``--agent.max_hung_steps``.
    """

    def __init__(self, workers: int, max_hung: int, name: str = "agent-env"):
        if workers < 1:
            raise ValueError(f"ToolPool: workers must be >= 1, got {workers}")
        self.workers, self.max_hung, self.name = workers, max_hung, name
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()  # (future, fn, args) not yet taken by a thread
        self._counted = 0  # threads counting against ``workers`` (idle or running a step not given up)
        self._idle = 0
        self._running: set[concurrent.futures.Future] = set()
        self._hung: set[concurrent.futures.Future] = set()  # given up, still running
        self._closed = False
        self._started = 0

    def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        """Run ``fn(*args)`` on a pool thread; the future holds its result or exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("ToolPool: submit after shutdown")
            self._queue.append((future, fn, args))
            self._cond.notify()
            self._grow()
        return future

    def abandon(self, future: concurrent.futures.Future) -> None:
        """Give up on ``future``'s step (its timeout passed): cancelled when still queued; when running, its thread
        is left to finish and a new one may start in its place."""
        with self._cond:
            if future.cancel() or future.done() or future not in self._running or future in self._hung:
                return
            self._hung.add(future)
            self._counted -= 1
            self._grow()
            if len(self._hung) > self.max_hung:
                raise RuntimeError(
                    f"agent: {len(self._hung)} environment steps are still running past --agent.tool_timeout_s, "
                    f"more than --agent.max_hung_steps {self.max_hung} allows: a tool does not return (each holds "
                    "a thread). Give the tool a deadline of its own (a subprocess with a timeout, a client "
                    "timeout), or raise --agent.max_hung_steps")

    @property
    def hung(self) -> int:
        """Steps given up on whose threads are still running."""
        with self._cond:
            return len(self._hung)

    def shutdown(self) -> None:
        """Idle threads end, queued steps are cancelled; running steps finish on their daemon threads."""
        with self._cond:
            self._closed = True
            while self._queue:
                self._queue.popleft()[0].cancel()
            self._cond.notify_all()

    def _grow(self) -> None:
        """A new thread when more steps wait than idle threads will take and ``workers`` allows (under the lock)."""
        if len(self._queue) > self._idle and self._counted < self.workers:
            self._counted += 1
            self._started += 1
            threading.Thread(target=self._work, name=f"{self.name}-{self._started}", daemon=True).start()

    def _work(self) -> None:
        while True:
            with self._cond:
                self._idle += 1
                self._cond.wait_for(lambda: self._queue or self._closed)
                self._idle -= 1
                if not self._queue:  # shut down
                    self._counted -= 1
                    return
                future, fn, args = self._queue.popleft()
                if not future.set_running_or_notify_cancel():
                    continue  # given up while queued
                self._running.add(future)
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the waiter, as concurrent.futures does
                future.set_exception(e)
            else:
                future.set_result(result)
            with self._cond:
                self._running.discard(future)
                if future in self._hung:  # given up: another thread has taken this one's place
                    self._hung.discard(future)
                    return


@dataclass
class Trajectory:
    """One multi-turn sample, in the shape of :class:`backends.base.Completion` plus the turn structure.

    token_ids: the response block (model turns and observations, as given to and taken from the engine);
    logprobs: the engine's log-prob of each sampled token, 0.0 on observation tokens; action_mask: 1 on sampled
    tokens; weight_version: the oldest of turn_versions; reward_text: what the reward function sees."""

    token_ids: list[int]
    logprobs: list[float]
    action_mask: list[bool]
    finish_reason: str
    weight_version: int
    prompt_index: int
    engine: int = -1
    turns: int = 0
    turn_versions: list[int] = field(default_factory=list)
    #: the weight version of each token of token_ids (an observation token: that of the model turn before it)
    token_versions: list[int] | None = None
    tool_calls: int = 0
    tool_errors: dict[str, int] = field(default_factory=dict)
    env_reward: float | None = None
    env_time_s: float = 0.0
    reward_text: str = ""
    prompt_tokens_sent: int = 0  #: prompt tokens of every turn's generate call, summed (prefill work asked)
    cached_tokens: int | None = None  #: of those, the engine's prefix-cache hits (None: the engine does not say)
    info: list[dict] = field(default_factory=list)
    #: the row's own prompt ids (an agent harness's, exactly as the engine prefilled them); None: the prompt's
    prompt_ids: list[int] | None = None


def sampled_versions(completions: list) -> list[int]:
    """Every weight version that sampled a token of these samples: each turn's of a trajectory, else the
    completion's (sync mode checks that all are the trainer's)."""
    return [v for c in completions for v in (c.turn_versions if isinstance(c, Trajectory) else [c.weight_version])]


def completion_text(tokenizer, completion) -> str:
    """What the reward function sees of one sample: a trajectory's ``reward_text``, else the decoded tokens."""
    if isinstance(completion, Trajectory):
        return completion.reward_text
    return tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def turn_glue(tokenizer) -> tuple[int, list[int]] | None:
    """What the tokenizer's chat template puts after an assistant message and before the next (tool, else user)
    message's content: (the end-of-turn special token id, the ids after it: Qwen's ``\n<|im_start|>tool\n``).
    None when the tokenizer has no chat template or the boundary does not start with a special token."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    said, seen = "\u2023MODEL\u2023", "\u2023OBSERVED\u2023"
    for role in ("tool", "user"):
        messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": said},
                    {"role": role, "content": seen}]
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False)
        except Exception:  # noqa: BLE001 - a template without this role raises; try the next one
            continue
        if said in text and seen in text:
            ids = list(tokenizer.encode(text[text.index(said) + len(said) : text.index(seen)],
                                        add_special_tokens=False))
            if ids and ids[0] in set(tokenizer.all_special_ids):
                return ids[0], ids[1:]
    return None


def check_turn_boundaries(trajectories: list[Trajectory], glue: tuple[int, list[int]], mode: str) -> int:
    """Every model turn that ends on the template's end-of-turn token and is followed by an observation: the
    observation starts with the template's glue (``turn_glue``), neither dropped nor counted twice. Returns the
    mismatches; ``warn`` logs each, ``strict`` raises ValueError naming the first."""
    import logging

    end_id, after = glue
    bad = 0
    for k, t in enumerate(trajectories):
        m = t.action_mask
        for i in range(len(m) - 1):
            if not (m[i] and not m[i + 1]) or t.token_ids[i] != end_id:
                continue
            obs = t.token_ids[i + 1 : i + 1 + len(after)]
            if obs == after:
                continue
            bad += 1
            message = (f"agent: sample {k}: the model's turn ends on token {end_id} at {i}, and the observation after "
                       f"it starts {t.token_ids[i + 1 : i + 1 + len(after) + 2]}, not the chat template's glue "
                       f"{after}; put the template's text after the end-of-turn token at the start of each "
                       "observation (or set --agent.template_check off)")
            if mode == "strict":
                raise ValueError(message)
            logging.getLogger("rlhf_sg").warning(message)
    return bad


def load_env_factory(spec: str) -> Callable:
    """The callable ``module:factory`` names; ValueError saying what is wrong otherwise."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--agent.env {spec!r}: give module:factory (e.g. recipes.calc_task:make_env)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--agent.env {spec!r}: cannot import {module_name!r} ({e}); put it on PYTHONPATH") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--agent.env {spec!r}: {module_name} has no callable {attr!r}")
    return factory


def turn_seed(run_seed: int, step: int, draw: int, engine: int, turn: int, budget: int) -> int:
    """The sampling seed of one turn's generate call on one engine (a 63-bit hash): turns, engines and budgets
    get unrelated random streams, and a rerun gets the same ones."""
    key = f"agent/{run_seed}/{step}/{draw}/{engine}/{turn}/{budget}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


#: ``[(engine index, prompts, params)] -> [completions of each call]``: the calls run concurrently across engines
GenerateMany = Callable[[list[tuple[int, list[list[int]], Any]]], list[list[Any]]]


@dataclass
class _State:
    prompt_ids: list[int]
    env: Any
    engine: int
    row: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    open_turn: list[int] = field(default_factory=list)  # this turn's tokens so far (partial rollout)
    model_ids: list[list[int]] = field(default_factory=list)  # each turn's ids, for the reward text
    versions: list[int] = field(default_factory=list)
    sampled_versions: list[int] = field(default_factory=list)  # one per sampled token, as logprobs
    turns: int = 0
    finish: str | None = None
    tool_calls: int = 0
    tool_errors: dict[str, int] = field(default_factory=dict)
    env_reward: float | None = None
    env_time_s: float = 0.0
    prompt_tokens_sent: int = 0
    cached_tokens: int | None = None
    info: list[dict] = field(default_factory=list)
    pending: tuple[list[int], str] | None = None  # the closed turn waiting for its environment step


def run_agent_rollout(
    prompts: list,
    n: int,
    params,
    generate_many: GenerateMany,
    env_factory: Callable,
    tokenizer,
    agent_cfg,
    num_engines: int,
    context_len: int,
    seed_of: Callable[[int, int, int], int],
    pool: ToolPool | None = None,
    router=None,
) -> list[Trajectory]:
    """``n`` trajectories per prompt, prompt-major (the order of single-turn completions).

    prompts: :class:`rlhf_sg.data.Prompt` s; params: the run's SamplingParams (``max_new_tokens`` is the total
    budget; the stop tokens those of the run and ``--agent.stop_token_ids``); generate_many: runs engine calls
    (:data:`GenerateMany`); env_factory(tokenizer): one environment; num_engines: the engines; context_len: the
    engines' context; seed_of(engine, turn, budget): the seed of that call; pool: where environment steps run (None:
    a :class:`ToolPool` of ``--agent.env_workers`` threads for this call, shut down at its end; a step that never
    returns is left on its daemon thread); router: a :class:`rlhf_sg.serve.router.Router` over the engines (None: a
    fresh round-robin one, prompt j's trajectories on engine j % num_engines). Each prompt's group of ``n``
    trajectories is one session of the router: it picks the group's engine once, and every turn goes there; the
    session is released, and each call's prefix-cache hits recorded, by the end of the rollout.
    """
    import dataclasses
    import uuid

    from rlhf_sg.serve.router import Router

    a = agent_cfg
    own_pool = pool is None
    if own_pool:
        pool = ToolPool(a.env_workers, a.max_hung_steps)
    total = params.max_new_tokens
    turn_cap = a.max_turn_tokens or total
    stops = tuple(dict.fromkeys(tuple(params.stop_token_ids) + tuple(a.stop_token_ids)))
    if router is None:
        router = Router(num_engines, "round_robin")
    rollout_key = uuid.uuid4().hex
    placed: list[tuple[str, int, int]] = []  # (session, engine, tokens) of each prompt's group
    states: list[_State] = []
    for j, p in enumerate(prompts):
        session, tokens = f"agent/{rollout_key}/{j}", n * (len(p.token_ids) + total)
        engine = router.acquire(session, tokens)
        placed.append((session, engine, tokens))
        for _ in range(n):
            env = env_factory(tokenizer)
            env.reset(p)
            states.append(_State(list(p.token_ids), env, engine))

    def budget(s: _State) -> int:
        used = len(s.row) + len(s.open_turn)
        return min(turn_cap - len(s.open_turn), total - used, context_len - len(s.prompt_ids) - used)

    try:
        turn = 0
        while True:
            live = [k for k, s in enumerate(states) if s.finish is None]
            if not live:
                break
            stepping: list[int] = []
            for k in live:
                s = states[k]
                if budget(s) <= 0:  # no room for another token in this turn
                    if s.open_turn:  # a turn cut at a weight sync that has reached its cap: it ends here
                        s.turns += 1
                        ids = _close_turn(s)
                        if min(total - len(s.row), context_len - len(s.prompt_ids) - len(s.row)) > 0:
                            stepping.append(k)
                            s.pending = (ids, "length")
                            continue
                    s.finish = "length"
            live = [k for k in live if states[k].finish is None and states[k].pending is None]
            if not live and not stepping:
                break
            # one call per (engine, budget); the first turn of a group with one context shares it (n per prompt)
            calls: dict[tuple[int, int], list[int]] = {}
            for k in live:
                calls.setdefault((states[k].engine, budget(states[k])), []).append(k)
            batch, members = [], []
            for (engine, room), ks in sorted(calls.items()):
                call_params = dataclasses.replace(params, max_new_tokens=room, stop_token_ids=stops,
                                                  seed=seed_of(engine, turn, room))
                if turn == 0 and n > 1 and all(not states[k].row and not states[k].open_turn for k in ks):
                    heads = ks[::n]
                    batch.append((engine, [states[k].prompt_ids for k in heads], dataclasses.replace(call_params, n=n)))
                else:
                    batch.append((engine, [states[k].prompt_ids + states[k].row + states[k].open_turn for k in ks],
                                  dataclasses.replace(call_params, n=1)))
                members.append(ks)
            results = generate_many(batch) if batch else []
            for ks, completions in zip(members, results):
                if len(completions) != len(ks):
                    raise RuntimeError(f"agent rollout: an engine returned {len(completions)} completion(s) for a "
                                       f"call of {len(ks)} trajectories; generate must return n per prompt")
                for k, c in zip(ks, completions):
                    s = states[k]
                    s.prompt_tokens_sent += len(s.prompt_ids) + len(s.row) + len(s.open_turn)
                    cached = getattr(c, "cached_tokens", None)
                    router.record_cache(s.engine, len(s.prompt_ids) + len(s.row) + len(s.open_turn), cached)
                    if cached is not None:
                        s.cached_tokens = (s.cached_tokens or 0) + int(cached)
                    s.open_turn += list(c.token_ids)
                    s.logprobs += [float(x) for x in c.logprobs]
                    s.versions.append(int(c.weight_version))
                    s.sampled_versions += [int(c.weight_version)] * len(c.token_ids)
                    if c.finish_reason == "abort":
                        continue  # partial rollout: the turn goes on from its tokens so far (next round)
                    s.turns += 1
                    reason = c.finish_reason
                    ids = _close_turn(s)
                    left = min(total - len(s.row), context_len - len(s.prompt_ids) - len(s.row))
                    if reason == "length" and left <= 0:
                        s.finish = "length"
                    else:
                        stepping.append(k)
                        s.pending = (ids, reason)
            _step_envs(states, stepping, tokenizer, a, pool, total, context_len)
            turn += 1
    finally:
        for s in states:
            try:
                s.env.close()
            except Exception:  # noqa: BLE001 - closing is best effort, the rollout is done
                pass
        if own_pool:
            pool.shutdown()
        for session, engine, tokens in placed:
            router.finish(session, engine, tokens)
            router.release(session)
    out = []
    for k, s in enumerate(states):
        if a.reward_text == "model":
            reward_text = "".join(tokenizer.decode(ids, skip_special_tokens=True) for ids in s.model_ids)
        else:
            reward_text = tokenizer.decode(s.row, skip_special_tokens=True)
        out.append(Trajectory(
            token_ids=s.row, logprobs=_row_logprobs(s), action_mask=s.mask, finish_reason=s.finish or "stop",
            weight_version=min(s.versions), prompt_index=k // n, engine=s.engine, turns=s.turns,
            turn_versions=s.versions, token_versions=_row_versions(s), tool_calls=s.tool_calls,
            tool_errors=s.tool_errors, env_reward=s.env_reward,
            env_time_s=s.env_time_s, reward_text=reward_text, prompt_tokens_sent=s.prompt_tokens_sent,
            cached_tokens=s.cached_tokens, info=s.info,
        ))
    return out


def _row_logprobs(s: _State) -> list[float]:
    """Engine log-probs on the row's action tokens, 0.0 on observation tokens."""
    it = iter(s.logprobs)
    return [next(it) if m else 0.0 for m in s.mask]


def _row_versions(s: _State) -> list[int]:
    """The weight version of each row token: a sampled token's own; an observation token's, the model turn's before
    it (the first turn's for observations ahead of any turn)."""
    it, last = iter(s.sampled_versions), min(s.versions)
    out = []
    for m in s.mask:
        last = next(it) if m else last
        out.append(last)
    return out


def _close_turn(s: _State) -> list[int]:
    """Move the open turn's sampled ids into the row (mask 1); return them."""
    ids = s.open_turn
    s.row += ids
    s.mask += [True] * len(ids)
    s.model_ids.append(ids)
    s.open_turn = []
    return ids


def _append_observation(s: _State, obs: list[int], agent_cfg, total: int, context_len: int) -> None:
    obs = obs[: agent_cfg.max_observation_tokens]
    room = min(total - len(s.row), context_len - len(s.prompt_ids) - len(s.row))
    if len(obs) + 1 <= room:  # the observation and at least one more model token
        s.row += obs
        s.mask += [False] * len(obs)
        return
    if agent_cfg.overflow == "truncate":
        cut = obs[: max(0, room)]
        s.row += cut
        s.mask += [False] * len(cut)
    s.finish = "overflow"


def _step_envs(states: list[_State], stepping: list[int], tokenizer, a, pool: ToolPool, total: int,
               context_len: int) -> None:
    """Every trajectory in ``stepping`` gets its environment's answer to its last turn, the steps running in
    ``pool`` concurrently, each within ``a.tool_timeout_s`` (then given up: :meth:`ToolPool.abandon`)."""
    started = time.monotonic()
    futures = {}
    for k in stepping:
        s = states[k]
        ids, reason = s.pending
        text = tokenizer.decode(ids, skip_special_tokens=True)
        futures[k] = (pool.submit(_timed_step, s.env, ids, text, reason), time.monotonic())
    for k in stepping:
        s = states[k]
        fut, _ = futures[k]
        remaining = a.tool_timeout_s - (time.monotonic() - started)
        error = None
        try:
            result, took = fut.result(timeout=max(0.0, remaining))
            s.env_time_s += took
        except concurrent.futures.TimeoutError:
            error = ("timeout", f"the tool did not answer within {a.tool_timeout_s} s")
            s.env_time_s += a.tool_timeout_s
            pool.abandon(fut)
        except ToolError as e:
            error = (e.kind, str(e))
        except Exception as e:  # noqa: BLE001 - a tool's own failure is an observation, not a fault of the run
            error = ("exception", f"{type(e).__name__}: {e}")
        if error is not None:
            kind, message = error
            s.tool_calls += 1
            s.tool_errors[kind] = s.tool_errors.get(kind, 0) + 1
            result = StepResult(observation_ids=list(s.env.error_observation(kind, message[: a.max_error_chars])),
                                tool_call=True, info={"tool_error": kind})
        if not isinstance(result, StepResult):
            raise TypeError(f"--agent.env: step returned {type(result).__name__}, expected agent.StepResult")
        s.tool_calls += int(result.tool_call and error is None)
        if result.reward is not None:
            s.env_reward = (s.env_reward or 0.0) + float(result.reward)
        if result.info:
            s.info.append(result.info)
        if result.done:
            s.finish = "env_done"
        elif s.turns >= a.max_turns:
            s.finish = "max_turns"
        elif not result.observation_ids:
            s.finish = "stop"  # the model ended its turn and the environment has nothing to say
        else:
            _append_observation(s, [int(t) for t in result.observation_ids], a, total, context_len)
        s.pending = None


def _timed_step(env, ids, text, reason):
    start = time.perf_counter()
    result = env.step(list(ids), text, reason)
    return result, time.perf_counter() - start


def agent_metrics(trajectories: list[Trajectory], prefix: str = "agent/") -> dict[str, float]:
    """Per-step means over the trajectories: turns, tool calls, tool-error fraction (errors per call), finish
    reasons, action and observation tokens, environment time, and the engines' prefix-cache hit fraction
    (cached prompt tokens / prompt tokens sent) where the engines report it."""
    B = len(trajectories)
    calls = sum(t.tool_calls for t in trajectories)
    errors = sum(sum(t.tool_errors.values()) for t in trajectories)
    action = sum(sum(t.action_mask) for t in trajectories)
    obs = sum(len(t.action_mask) - sum(t.action_mask) for t in trajectories)
    m = {
        f"{prefix}turns": sum(t.turns for t in trajectories) / B,
        f"{prefix}tool_calls": calls / B,
        f"{prefix}tool_error_frac": errors / calls if calls else 0.0,
        f"{prefix}action_tokens": action / B,
        f"{prefix}observation_tokens": obs / B,
        f"{prefix}env_time_s": sum(t.env_time_s for t in trajectories),
    }
    for reason in FINISH_REASONS:
        m[f"{prefix}finish_{reason}"] = sum(t.finish_reason == reason for t in trajectories) / B
    reported = [t for t in trajectories if t.cached_tokens is not None]
    if reported:
        m[f"{prefix}prefix_cache_hit"] = (sum(t.cached_tokens for t in reported)
                                          / max(1, sum(t.prompt_tokens_sent for t in reported)))
    return m
