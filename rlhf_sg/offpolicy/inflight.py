"""The async producer's samples in flight, admitted one prompt group at a time (:class:`InFlight`).

A step's batch is ``prompts_per_step`` groups of ``n`` samples, drawn from the prompt stream when its first group
starts. Groups start in order (step, then index) as soon as :class:`~rlhf_sg.offpolicy.admission.Admission`'s
capacity holds them, whether or not the groups before them have finished: while a long sample of step ``s`` is still
decoding, the groups of steps ``s + 1 .. v + max_staleness`` already generate. A batch is handed out once all its
groups have finished, and a group stays in its batch however long it runs (nothing is discarded and drawn again, so
long samples are never starved by short ones).

Groups start strictly in order, so when a group starts every group before it is running, finished or trained, and
the capacity rule puts it in a step at most ``max_staleness`` versions ahead of the engines' weights: a batch is
trained at most ``max_staleness`` versions after the weights that sampled its first tokens. This holds after a resume
too, where the finished groups of later steps come back before the earlier groups that were still generating: those
start first, and the finished ones count as accepted.

:meth:`InFlight.state_dict` is what a checkpoint holds: the admission counters, and for every step drawn but not
trained the stream's position before its draw and each finished group's completions (token ids, log-probs, weight
version per token). A group still generating is kept as its prompt only and generates again after a resume; the
finished ones are trained at the steps they were admitted for, so a resume brings no burst of stale samples."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from rlhf_sg.offpolicy.admission import Admission

#: the fields of a finished completion a checkpoint holds (those a text rollout's batch is built from)
COMPLETION_FIELDS = ("token_ids", "logprobs", "finish_reason", "weight_version", "prompt_index", "token_versions")


@dataclasses.dataclass(eq=False)
class Group:
    """One prompt's ``n`` samples: ``step`` and ``index`` (its place in that step's batch), the prompt, and once all
    its samples have finished, their completions."""

    step: int
    index: int
    prompt: Any
    samples: list | None = None
    running: bool = False


class InFlight:
    """The groups of every step drawn and not yet trained, in admission order, and the admission counters.

    ``draw(step) -> (stream position before the draw, prompts)`` draws a step's ``prompts_per_step`` prompts; it is
    called when the step's first group starts. Steps ``first_step .. last_step - 1`` are made. Not thread-safe: its
    user holds its own lock."""

    def __init__(self, prompts_per_step: int, n: int, max_staleness: int, first_step: int, last_step: int,
                 draw: Callable[[int], tuple[dict, list]]):
        self.n, self.prompts_per_step, self.max_staleness = n, prompts_per_step, max_staleness
        self.admission = Admission(prompts_per_step * n, max_staleness, version=first_step)
        self.first_step, self.last_step, self._draw = first_step, last_step, draw
        self._steps: dict[int, list[Group]] = {}  # drawn steps not yet trained -> their groups
        self._drawn_from: dict[int, dict] = {}  # step -> the stream's position before its draw
        self._handed_out: set[int] = set()  # steps whose batch has been handed out
        self._next_draw = first_step  # the first step not drawn yet

    # ---- admission ----------------------------------------------------------------------------------------
    def _next_waiting(self) -> Group | tuple[int, int] | None:
        """The next group to start: a drawn one not running and not finished, else (step, 0) of the first step not
        drawn yet, else None (every step made)."""
        for groups in self._steps.values():
            for g in groups:
                if not g.running and g.samples is None:
                    return g
        return (self._next_draw, 0) if self._next_draw < self.last_step else None

    def can_admit(self, version: int) -> bool:
        """Whether a group may start with the engines at ``version``."""
        return self._next_waiting() is not None and self.admission.capacity(version) >= self.n

    def version_needed(self) -> int | None:
        """The engines' version from which the next group may start (None: every group has started)."""
        return None if self._next_waiting() is None else self.admission.version_needed(self.n)

    def admit(self, version: int) -> list[Group]:
        """Start every group that fits with the engines at ``version``, in order (drawing steps as their first
        group starts); they count as running."""
        started = []
        while (nxt := self._next_waiting()) is not None:
            if not self.admission.admit(self.n, version):
                break
            if not isinstance(nxt, Group):
                step = nxt[0]
                position, prompts = self._draw(step)
                if len(prompts) != self.prompts_per_step:
                    raise ValueError(f"InFlight: step {step} drew {len(prompts)} prompts, expected "
                                     f"{self.prompts_per_step}")
                self._drawn_from[step] = position
                self._steps[step] = [Group(step, i, p) for i, p in enumerate(prompts)]
                self._next_draw = step + 1
                nxt = self._steps[step][0]
            nxt.running = True
            started.append(nxt)
        return started

    def finish(self, group: Group, samples: list) -> None:
        """All ``n`` samples of a running ``group`` have finished."""
        if not group.running or len(samples) != self.n:
            raise ValueError(f"InFlight.finish: group {group.index} of step {group.step} is "
                             f"{'running' if group.running else 'not running'} with {len(samples)} samples, expected "
                             f"a running group and {self.n}")
        self.admission.finish(self.n)
        group.samples, group.running = list(samples), False

    # ---- batches ------------------------------------------------------------------------------------------
    def ready(self) -> list[tuple[int, list[Group]]]:
        """The batches complete since the last call, (step, groups) each, in step order; each is handed out once."""
        out = []
        for step, groups in sorted(self._steps.items()):
            if step not in self._handed_out and all(g.samples is not None for g in groups):
                self._handed_out.add(step)
                out.append((step, groups))
        return out

    def trained(self, step: int) -> None:
        """The trainer took the batch of ``step``: its groups leave the buffer."""
        self._steps.pop(step, None)
        self._drawn_from.pop(step, None)
        self._handed_out.discard(step)

    # ---- checkpoints --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """JSON-ready: the counters and, per step drawn and not trained, its stream position and each group's
        finished completions (None for a group not finished)."""
        return {"accepted": self.admission.accepted, "running": self.admission.running,
                "prompts_per_step": self.prompts_per_step, "n": self.n,
                "steps": {str(step): {"drawn_from": self._drawn_from[step],
                                      "groups": [None if g.samples is None else
                                                 [{f: getattr(c, f) for f in COMPLETION_FIELDS} for c in g.samples]
                                                 for g in groups]}
                          for step, groups in sorted(self._steps.items())}}

    def load_state_dict(self, state: dict, prompts_at: Callable[[dict], list], completion: Callable[..., Any]) -> None:
        """Bring back a checkpoint's buffer: ``prompts_at(stream position)`` draws a step's prompts again from
        where its draw started, ``completion(**fields)`` rebuilds a completion. Groups that were generating start
        again (they count as neither accepted nor running); the accepted count comes back as saved and must be the
        samples trained before ``first_step`` plus those finished in the buffer."""
        if (state["prompts_per_step"], state["n"]) != (self.prompts_per_step, self.n):
            raise ValueError(f"the checkpoint's in-flight samples are batches of {state['prompts_per_step']} prompts "
                             f"x {state['n']} samples; this run's are {self.prompts_per_step} x {self.n}: resume with "
                             "the same --rollout.prompts_per_step and --rollout.n_samples_per_prompt")
        self._steps, self._drawn_from, self._handed_out = {}, {}, set()
        self._next_draw, finished = self.first_step, 0
        for key, saved in sorted(state["steps"].items(), key=lambda kv: int(kv[0])):
            step = int(key)
            prompts = prompts_at(saved["drawn_from"])
            groups = [Group(step, i, p) for i, p in enumerate(prompts)]
            for g, samples in zip(groups, saved["groups"], strict=True):
                if samples is not None:
                    g.samples = [completion(**fields) for fields in samples]
                    finished += len(g.samples)
            self._steps[step], self._drawn_from[step] = groups, saved["drawn_from"]
            self._next_draw = max(self._next_draw, step + 1)
        expected = self.first_step * self.admission.batch_size + finished
        if state["accepted"] != expected:
            raise ValueError(f"the checkpoint's admission count, {state['accepted']} samples accepted, does not match "
                             f"its buffer ({self.first_step} steps trained x {self.admission.batch_size} + {finished} "
                             "finished); the checkpoint is damaged")
        self.admission.accepted, self.admission.running = state["accepted"], 0
