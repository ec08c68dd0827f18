"""Agent harnesses as rollouts: a user's ``async (base_url, api_key, prompt) -> reward | None`` run once per sample
against the endpoint, its recorded calls turned into training rows.

Each run gets a session of its own (:meth:`Endpoint.open_session`: its API key, the sample's token budget and
context), runs in a bounded pool (at most ``workers`` at once) within ``timeout_s``, and its session is closed at
its end, whatever happened (a later call with its key gets 401). The row of a run is the sample its last call
joined (:class:`rlhf_sg.serve.sessions.Sample`): its prompt ids as the engine prefilled them, then the completions
(mask 1, the engine's log-probs) and the ids between them (mask 0); samples a run forked away from are counted
(``HarnessResult.forked``) and left out, so every run gives at most one row; auxiliary calls (header
``X-RL-Auxiliary: true``: a title, a summary) join no sample and are counted (``HarnessResult.auxiliary``). The
reward is the function's return value, else what it posted to ``/v1/rl/reward``; ``None`` (or a harness that raised
or timed out: ``error``) marks the row unscored, to be left out of its group's baseline. A run that made no
(trained) call has no row.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from rlhf_sg.serve.endpoint import Endpoint
from rlhf_sg.serve.sessions import Sample

__all__ = ["HarnessResult", "load_harness", "run_harnesses"]


@dataclass
class HarnessResult:
    """One harness run: ``sample`` (its row; None when it made no call), ``reward`` (None: unscored), the session's
    ``calls`` (auxiliary ones aside), ``continued`` and ``forked`` counts, the tool calls parsed, ``error`` (why it
    failed, or None) and the ``auxiliary`` calls left out of training."""

    prompt_index: int
    sample: Sample | None
    reward: float | None
    calls: int
    continued: int
    forked: int
    tool_calls: int
    error: str | None = None
    auxiliary: int = 0


def load_harness(spec: str) -> Callable:
    """The async function ``module:function`` names; ValueError saying what is wrong otherwise."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--agent.harness {spec!r}: give module:function (an async function (base_url, api_key, "
                         "prompt) -> reward or None)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--agent.harness {spec!r}: cannot import {module_name!r} ({e}); put it on PYTHONPATH") from e
    fn = getattr(module, attr, None)
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"--agent.harness {spec!r}: {module_name}.{attr} is not an async function (async def "
                         f"{attr}(base_url, api_key, prompt) -> float | None)")
    return fn


async def _one(endpoint: Endpoint, base_url: str, harness: Callable, prompt, index: int, pool: asyncio.Semaphore,
               budget_tokens: int, max_context: int, timeout_s: float) -> HarnessResult:
    async with pool:
        session, key = endpoint.open_session(budget_tokens, max_context, ttl_s=timeout_s + 60, prompt_index=index)
        reward, error = None, None
        try:
            got = await asyncio.wait_for(harness(base_url, key, prompt), timeout_s)
            reward = float(got) if got is not None else session.reward  # returned, else posted to /v1/rl/reward
        except asyncio.TimeoutError:
            error = f"timeout: the harness ran past {timeout_s} s"
        except Exception as e:  # noqa: BLE001 - one harness's failure is its sample's, not the rollout's
            error = f"{type(e).__name__}: {e}"
        finally:
            record = endpoint.close_session(session.session_id)
    trained = [c for c in record.calls if not c.auxiliary]
    sample = record.samples[trained[-1].sample] if trained else None
    return HarnessResult(index, sample, reward, len(trained), record.continued, record.forked,
                         sum(c.tool_calls for c in trained), error, record.auxiliary)


def run_harnesses(endpoint: Endpoint, base_url: str, harness: Callable, prompts: list, n: int, workers: int,
                  budget_tokens: int, max_context: int, timeout_s: float) -> list[HarnessResult]:
    """``n`` runs of ``harness`` per prompt (prompt-major), at most ``workers`` at once, each within ``timeout_s``
    with a session of ``budget_tokens`` and ``max_context``; called from a thread with no running event loop."""
    if workers < 1:
        raise ValueError(f"run_harnesses: workers must be >= 1, got {workers}")

    async def main():
        pool = asyncio.Semaphore(workers)
        return await asyncio.gather(*(_one(endpoint, base_url, harness, p, j, pool, budget_tokens, max_context,
                                           timeout_s) for j, p in enumerate(prompts) for _ in range(n)))

    return list(asyncio.run(main()))


class ActorEngine:
    """A rollout engine actor (:class:`rlhf_sg.engine_actor.EngineActor`) seen as a backend by the endpoint:
    ``generate(prompts, params)`` waits for the actor at most ``timeout_s`` (then ``GetTimeoutError``, the call's
    500)."""

    def __init__(self, actor, timeout_s: float):
        self.actor, self.timeout_s = actor, timeout_s

    def generate(self, prompts: list[list[int]], params) -> list:
        import ray

        return ray.get(self.actor.generate.remote(prompts, params), timeout=self.timeout_s)


def serve_and_run(endpoint: Endpoint, harness: Callable, prompts: list, n: int, workers: int, budget_tokens: int,
                  max_context: int, timeout_s: float, host: str = "127.0.0.1") -> list[HarnessResult]:
    """One rollout of harness runs: the endpoint served on ``host`` (an ephemeral port) for the runs' time, then
    stopped; :func:`run_harnesses` in between."""
    from rlhf_sg.serve.endpoint import EndpointServer

    server = EndpointServer(endpoint, host=host)
    base_url = server.start()
    try:
        return run_harnesses(endpoint, base_url, harness, prompts, n, workers, budget_tokens, max_context, timeout_s)
    finally:
        server.stop()


def as_trajectory(result: HarnessResult, prompt_ids: list[int], filler_id: int):
    """A harness run as a training row (:class:`rlhf_sg.agent.Trajectory`): its sample's prompt ids as the engine
    prefilled them (``prompt_ids``, the dataset's, for a run that made no call), its response block with the
    engine's log-probs and the mask from provenance (completions 1, the ids between them 0), ``env_reward`` its
    reward (None: unscored). A run without a call gets one ``filler_id`` token (mask 1 with log-prob 0.0, since a
    row needs an action token; unscored, so out of the losses and of the engine-vs-trainer metrics)."""
    from rlhf_sg.agent import Trajectory

    s = result.sample
    if s is None:
        return Trajectory([filler_id], [0.0], [True], "stop", -1, result.prompt_index, env_reward=None,
                          turn_versions=[], prompt_ids=list(prompt_ids), info=[{"harness_error": result.error}])
    return Trajectory(
        token_ids=list(s.token_ids), logprobs=list(s.logprobs), action_mask=list(s.action_mask),
        finish_reason=s.finish_reason, weight_version=min(s.versions), prompt_index=result.prompt_index,
        turns=s.calls, turn_versions=list(s.versions), tool_calls=result.tool_calls, env_reward=result.reward,
        prompt_ids=list(s.prompt_ids), info=[{"harness_error": result.error}] if result.error else [])
