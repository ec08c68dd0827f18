"""Async rollout: the engines generate the batches of the next steps while the trainer trains.

A thread of the driver (the producer) makes the batches of later steps and keeps them until the trainer takes them
(:meth:`AsyncRollout.take`). With ``per_sample`` (single-turn rollouts, :attr:`RolloutMaker.per_sample`) it admits
one prompt group at a time (:class:`rlhf_sg.offpolicy.InFlight`): each round of generate calls continues the
completions a sync cut short and starts every group the capacity holds, of whichever steps, and a batch is scored as
soon as its last group finishes. Otherwise it runs :meth:`RolloutMaker.make` for step after step. Three rules hold
it::

    staleness   the producer starts a batch only when its samples are admitted by capacity
                (:class:`rlhf_sg.offpolicy.Admission`, AReaL's rule counted in samples): for the batch of step s,
                when the engines hold weights of version s - max_staleness or newer; versions only grow, so every
                token of that batch comes from a version at most max_staleness behind the trainer's when it trains
                step s
    sync        the trainer's weight sync (:meth:`AsyncRollout.sync`) has the engines to itself: no generate
                call goes out while it runs
    partial     with partial rollout the sync first cuts the generates in flight short (the engines'
                abort); the producer waits for the sync, then continues each cut completion from its tokens
                so far with the new weights (:meth:`RolloutMaker.generate`); without it, the sync waits for
                the generates in flight to finish

Every completion carries the oldest weight version that sampled one of its tokens, and the trainer checks
and logs the staleness of each batch (:func:`rlhf_sg.trainer.rollout.check_staleness`); the policy loss
corrects for it with truncated importance sampling against the engines' log-probs.

Engines that restart (one died while generating) are restarted under the same rule as a sync: no sync runs
meanwhile. A restart pushes the trainer's weights through the actor's ranks (a ZeRO-3 gather, collective on every
rank), so it also waits while the trainer calls those ranks (:meth:`AsyncRollout.trainer_calls`: scoring, update,
checkpoint): two threads' collectives on one group would interleave differently on different ranks. It labels the
weights with the version the engines hold, which only a sync changes.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from backends.base import Completion
from rlhf_sg.offpolicy.admission import Admission
from rlhf_sg.offpolicy.inflight import Group, InFlight
from rlhf_sg.timing import StepTimer
from rlhf_sg.trainer.rollout import RolloutMaker, continue_completion, prompt_images

log = logging.getLogger("rlhf_sg")


class RolloutStopped(Exception):
    """Raised in the producer thread at its next generate call once :meth:`AsyncRollout.stop` was called: it
    unwinds a batch in progress (a continuation loop included), which is dropped."""


class AsyncRollout:
    """The producer thread and what it shares with the trainer (under one condition variable).

    ``maker``: the rollout maker the producer runs (its ``before_generate`` / ``after_generate`` / ``restart``
    hooks are set here); ``first_step`` / ``last_step``: the steps to make batches for (``last_step``
    excluded); ``engine_version``: the weight version the engines hold now; ``abort``: cuts every engine's
    running generate short and holds the abort (None: no partial rollout); ``resume``: ends the held abort;
    ``data_state``: the prompt stream's position (recorded before each batch draws its prompts, for
    checkpoints); ``batch_size``: the samples of one step's batch, the unit the admission counts in (its counters
    start at ``first_step``: the batches made before and not trained are not carried over)."""

    def __init__(self, maker: RolloutMaker, first_step: int, last_step: int, engine_version: int,
                 max_staleness: int, timeout_s: float, data_state: Callable[[], dict],
                 abort: Callable[[], Any] | None = None, resume: Callable[[], Any] | None = None,
                 batch_size: int = 1, per_sample: bool = False, restore: dict | None = None):
        self.maker, self.max_staleness, self.timeout_s = maker, max_staleness, timeout_s
        self.batch_size = batch_size
        #: per_sample: groups admitted one at a time (:class:`InFlight`); else whole batches, one after another
        self.inflight: InFlight | None = None  # under self._cond
        if per_sample:
            n = maker.cfg.rollout.n_samples_per_prompt
            self.inflight = InFlight(batch_size // n, n, max_staleness, first_step, last_step, self._draw)
            if restore is not None:
                self.inflight.load_state_dict(restore, self._prompts_at, Completion)
            self.admission = self.inflight.admission
        else:
            if restore is not None:
                raise ValueError("AsyncRollout: a checkpoint's in-flight samples need per_sample admission")
            self.admission = Admission(batch_size, max_staleness, version=first_step)  # under self._cond
        self._abort, self._resume, self._data_state = abort, resume, data_state
        self._cond = threading.Condition()
        # held by a sync, an engine restart, and the trainer while it calls the ranks (re-entered by its sync)
        self._engine_control = threading.RLock()
        self._next_step, self._last_step = first_step, last_step
        self._engine_version = engine_version
        self._ready: dict[int, tuple] = {}  # step -> (prompts, experience, metrics)
        self._data_states: dict[int, dict] = {}  # step -> the stream's position before its prompts were drawn
        self._syncing = False  # a sync wants (or has) the engines
        self._generating = False  # generate calls of the producer are out
        self._stopping = False
        self._waiting_for: int | None = None  # the weight version the next batch waits for (staleness bound)
        self._error: BaseException | None = None
        restart = maker.restart
        if restart is not None:
            maker.restart = lambda i: self._exclusive(lambda: restart(i, self.engine_version))
        maker.before_generate, maker.after_generate = self._before_generate, self._after_generate
        self._thread = threading.Thread(target=self._run, name="rlhf_sg-rollout", daemon=True)

    # ---- the producer ----------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        if self.inflight is not None:
            return self._run_per_sample()
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(self._may_start_next)
                    if self._stopping:
                        return
                    step = self._next_step
                    self._data_states[step] = self._data_state()
                    version = self._engine_version
                    if not self.admission.admit(self.batch_size, version):
                        raise RuntimeError(f"step {step + 1}: its batch was not admitted at weight version {version}")
                timer = StepTimer(sync=lambda: None)
                timer.start_step()
                prompts, experience, metrics = self.maker.make(timer, step, version)
                times = timer.end_step()
                metrics.update({f"rollout_time/{k}": v for k, v in times.items()})
                with self._cond:
                    self.admission.finish(self.batch_size)
                    self._ready[step] = (prompts, experience, metrics)
                    self._next_step = step + 1
                    self._cond.notify_all()
        except RolloutStopped:
            return
        except BaseException as exc:
            self._hand_over(exc)

    def _hand_over(self, exc: BaseException) -> None:
        """A producer loop's failure, handed to the trainer at its next take."""
        with self._cond:
            self._error = exc
            self._cond.notify_all()

    def _may_start_next(self) -> bool:
        """The staleness bound: the next batch's samples fit the admission's capacity at the engines' version
        (the batch of step s: version s - max_staleness or newer). Under the condition's lock; records the version
        waited for, :attr:`waiting_for_version`."""
        if self._stopping:
            return True
        if self._next_step >= self._last_step:
            self._waiting_for = None
            return False
        fits = self.admission.capacity(self._engine_version) >= self.batch_size
        self._waiting_for = None if fits else self.admission.version_needed(self.batch_size)
        return fits

    # ---- the producer, one prompt group at a time ----------------------------------------------------------
    def _draw(self, step: int) -> tuple[dict, list]:
        """A step's prompts, drawn when its first group starts (under the condition's lock)."""
        position = self._data_state()
        self._data_states[step] = position
        return position, self.maker.stream.next_batch()

    def _prompts_at(self, position: dict) -> list:
        """The prompts a step drew from stream ``position`` (a resume's buffer)."""
        stream = copy.copy(self.maker.stream)
        stream.load_state(position)
        return stream.next_batch()

    def _run_per_sample(self) -> None:
        """Rounds of generate calls: the completions a sync cut short continue (partial rollout), then every group
        the capacity admits now starts, whichever steps they belong to; a batch is scored and handed out as soon
        as its last group finishes."""
        params = self.maker.sampling_params()
        n = params.n
        samples: dict[Group, list] = {}  # running group -> its n completions so far
        segment, restarts_before = 0, self.maker.restarts
        generate_s = 0.0  # generate calls' time since the last batch handed out (rounds serve several steps)
        try:
            while True:
                with self._cond:
                    ready = self.inflight.ready()  # a resume's buffer may hold whole batches already
                for step, groups in ready:
                    prompts = [g.prompt for g in groups]
                    completions = [c for g in groups for c in g.samples]
                    reward_start = time.perf_counter()
                    experience, metrics = self.maker.score_batch(prompts, completions)
                    metrics["rollout_time/reward"] = time.perf_counter() - reward_start
                    metrics["rollout_time/generate"], generate_s = generate_s, 0.0
                    metrics["rollout/engine_restarts"] = self.maker.restarts - restarts_before
                    restarts_before = self.maker.restarts
                    metrics["rollout/partial_samples"] = sum(len(set(c.token_versions or ())) > 1
                                                             for c in completions)
                    with self._cond:
                        self._ready[step] = (prompts, experience, metrics)
                        self._cond.notify_all()
                with self._cond:
                    self._cond.wait_for(lambda: self._stopping or self._may_admit_or_continue(samples))
                    if self._stopping:
                        return
                    fresh = self.inflight.admit(self._engine_version)
                round_start = time.perf_counter()
                cut = [(g, j) for g, got in samples.items() for j, c in enumerate(got) if c.finish_reason == "abort"]
                by_room: dict[int, list[tuple[Group, int]]] = {}
                for g, j in cut:  # one call per remaining budget (no continuation asks for more context than it had)
                    by_room.setdefault(params.max_new_tokens - len(samples[g][j].token_ids), []).append((g, j))
                for room, rows in sorted(by_room.items()):
                    segment += 1  # every continuation call gets a random stream of its own
                    images = prompt_images([g.prompt for g, _ in rows])
                    tails = self.maker.generate_ids([g.prompt.token_ids + samples[g][j].token_ids for g, j in rows],
                                                    dataclasses.replace(params, n=1, max_new_tokens=room),
                                                    rows[0][0].step, rows[0][0].index, segment, images=images)
                    for (g, j), tail in zip(rows, tails):
                        samples[g][j] = continue_completion(samples[g][j], tail, params.max_new_tokens)
                if fresh:
                    images = prompt_images([g.prompt for g in fresh])
                    out = self.maker.generate_ids([g.prompt.token_ids for g in fresh], params, fresh[0].step,
                                                  fresh[0].index, images=images)
                    for i, g in enumerate(fresh):
                        samples[g] = out[i * n : (i + 1) * n]
                generate_s += time.perf_counter() - round_start
                done = [g for g, got in samples.items() if all(c.finish_reason != "abort" for c in got)]
                with self._cond:
                    for g in done:
                        self.inflight.finish(g, samples.pop(g))
        except RolloutStopped:
            return
        except BaseException as exc:
            self._hand_over(exc)

    def _may_admit_or_continue(self, samples: dict) -> bool:
        """A round may go out: completions were cut short, or a group fits the capacity at the engines' version.
        Under the condition's lock; records the version waited for (:attr:`waiting_for_version`)."""
        if samples or self.inflight.can_admit(self._engine_version):
            self._waiting_for = None
            return True
        self._waiting_for = self.inflight.version_needed()
        return False

    def checkpoint_state(self, step: int) -> tuple[dict, dict | None]:
        """What a checkpoint taken before ``step`` trains holds of async rollout, at one moment: with per-sample
        admission the prompt stream's position (after every step drawn) and the in-flight buffer with its counters
        (:meth:`InFlight.state_dict`); else :meth:`data_state` and None (the batches not trained are drawn again)."""
        with self._cond:
            if self.inflight is None:
                return self.data_state(step), None
            return self._data_state(), self.inflight.state_dict()

    @property
    def waiting_for_version(self) -> int | None:
        """The weight version the producer waits for before it starts its next batch, or None when it is not
        held by the staleness bound."""
        with self._cond:
            return self._waiting_for

    def _before_generate(self) -> None:
        """Before generate calls go out: wait while a sync has the engines, then mark them out; after
        :meth:`stop`, raise :class:`RolloutStopped` instead."""
        with self._cond:
            self._cond.wait_for(lambda: not self._syncing or self._stopping)
            if self._stopping:
                raise RolloutStopped
            self._generating = True

    def _after_generate(self) -> None:
        with self._cond:
            self._generating = False
            self._cond.notify_all()

    def _exclusive(self, fn: Callable[[], Any]) -> Any:
        with self._engine_control:
            return fn()

    @property
    def engine_version(self) -> int:
        """The weight version the engines hold (set by :meth:`sync`)."""
        with self._cond:
            return self._engine_version

    @contextlib.contextmanager
    def trainer_calls(self) -> Iterator[None]:
        """Held by the trainer (one thread) while it calls the model groups' ranks, its sync included: an engine
        restart (which pushes weights through the actor's ranks) waits until it ends, then labels the weights
        with the version that sync recorded."""
        with self._engine_control:
            yield

    # ---- the trainer's side --------------------------------------------------------------------------
    def take(self, step: int) -> tuple[list, Any, dict[str, float]]:
        """The batch of ``step`` (prompts, experience, metrics), waiting for the producer; re-raises a failure of
        the producer (an engine failure, a reward error)."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while step not in self._ready:
                if self._error is not None:
                    raise self._error
                if not self._thread.is_alive():
                    raise RuntimeError(f"step {step + 1}: the rollout thread stopped without making its batch")
                if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())) and time.monotonic() > deadline:
                    raise TimeoutError(f"step {step + 1}: no rollout batch within --train.timeout_s "
                                       f"{self.timeout_s:.0f} s (engines or the reward function stuck?)")
            self._data_states.pop(step, None)
            if self.inflight is not None:
                self.inflight.trained(step)
            return self._ready.pop(step)

    def data_state(self, step: int) -> dict:
        """The prompt stream's position for a checkpoint taken before ``step`` trains: where the batch of ``step``
        started drawing, or, when the producer has not started it, where the stream is now."""
        with self._cond:
            state = self._data_states.get(step)
            return state if state is not None else self._data_state()

    def sync(self, push: Callable[[], Any], version: int, timer: StepTimer) -> Any:
        """Run the weight sync ``push`` with the engines to itself and record ``version`` as theirs.

        With partial rollout the generates in flight are cut short first (the producer continues them after);
        otherwise they are waited for (phase ``wait_generate``)."""
        with self._cond:
            self._syncing = True
        try:
            with self._engine_control:
                with timer.phase("wait_generate"):
                    if self._abort is not None:
                        self._abort()
                    with self._cond:
                        if not self._cond.wait_for(lambda: not self._generating or self._error is not None,
                                                   timeout=self.timeout_s):
                            raise TimeoutError(f"weight sync to version {version}: the engines' generate calls did "
                                               f"not return within --train.timeout_s {self.timeout_s:.0f} s")
                result = push()
                with self._cond:
                    self._engine_version = version
                if self._resume is not None:
                    with timer.phase("weight_sync"):
                        self._resume()
        finally:
            with self._cond:
                self._syncing = False
                self._cond.notify_all()
        return result

    def stop(self) -> None:
        """Stop the producer: a running generate is cut short (partial rollout) or finishes, and the batch in
        progress is dropped at its next generate call."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._abort is not None and self._thread.is_alive():
            try:
                self._abort()
            except Exception:  # engines may be gone already; stopping must not fail
                log.debug("abort at stop failed", exc_info=True)
        self._thread.join(timeout=self.timeout_s)
        if self._thread.is_alive():
            log.warning("the rollout thread did not stop within %.0f s; leaving it (a daemon thread)", self.timeout_s)
