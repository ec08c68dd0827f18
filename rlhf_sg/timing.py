"""Phase timers that charge each phase only its own time.

Device work and collectives run asynchronously: a timer that stops without waiting charges one
phase's work to the next. Every phase here ends with ``sync()`` — on a model worker, a device
synchronise and (where ranks matter) a barrier; in the controller, waiting on every remote call
the phase launched — and the step report lists each phase plus ``other``, the part of the step
no phase claimed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

#: the phases of one training step, in order
PHASES = ("generate", "reward", "reference", "teacher", "critic", "actor_logprob", "train", "weight_sync", "offload")


def synchronize_device() -> None:
    """Wait for queued device work (a no-op on CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class StepTimer:
    """Wall time per phase within one step.

    ``sync`` runs when a phase starts (so earlier pending work is not charged to it) and when
    it ends (so its own pending work is). Use one ``phase`` block per phase and step.
    """

    def __init__(self, sync: Callable[[], None] = synchronize_device):
        self.sync = sync
        self._times: dict[str, float] = {}
        self._step_start: float | None = None

    def start_step(self) -> None:
        self.sync()
        self._times = {}
        self._step_start = time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self._step_start is None:
            raise RuntimeError("StepTimer.phase called outside a step; call start_step() first")
        self.sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self._times[name] = self._times.get(name, 0.0) + time.perf_counter() - t0

    def end_step(self) -> dict[str, float]:
        """Seconds per phase, ``other`` and ``step`` (the total)."""
        if self._step_start is None:
            raise RuntimeError("StepTimer.end_step called outside a step")
        self.sync()
        total = time.perf_counter() - self._step_start
        self._step_start = None
        report = {name: self._times.get(name, 0.0) for name in PHASES}
        report.update({k: v for k, v in self._times.items() if k not in report})
        report["other"] = max(0.0, total - sum(self._times.values()))
        report["step"] = total
        return report
