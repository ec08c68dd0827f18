"""Admission by capacity (AReaL's staleness manager, arXiv 2505.24298): a sample may start generating only while the
trainer's consumption keeps it within ``max_staleness`` weight versions of the weights it starts with.

Samples are trained in the order they are admitted, ``batch_size`` a step. With the trainer at version ``v`` (``v``
steps trained), the samples admitted or running so far, ``accepted + running``, will be trained by steps
``0 .. (accepted + running) / batch_size``; one more sample is trained at step ``(accepted + running) // batch_size``,
at most ``max_staleness`` versions after ``v`` exactly when

    accepted + running < (max_staleness + v + 1) * batch_size        (capacity: the difference)

Versions only grow, so a sample admitted under this rule is never trained more than ``max_staleness`` versions after
the weights it started with (its first token's); tokens a partial rollout samples later are fresher. A sample that
is dropped after it ran (a filtered group) frees its place (:meth:`Admission.finish` with fewer kept); nothing is
discarded to make room, so a long sample is never starved by short ones.

Counting from 0 after a resume at version ``v`` would admit ``v`` batches at once, each trained up to
``v + max_staleness`` versions late (AReaL's resume burst). Where the checkpoint holds the samples made and not
trained (:class:`rlhf_sg.offpolicy.InFlight`) the counts come back with them; where it does not, they restart from
the trainer's version (:meth:`Admission.resume`) and those samples' prompts are drawn again."""

from __future__ import annotations


class Admission:
    """The capacity rule's counters, in samples. ``accepted``: samples finished and kept for training (those trained
    included); ``running``: samples admitted and not finished. Not thread-safe: its user holds its own lock."""

    def __init__(self, batch_size: int, max_staleness: int, version: int = 0):
        if batch_size < 1 or max_staleness < 0 or version < 0:
            raise ValueError(f"Admission: need batch_size >= 1, max_staleness >= 0 and version >= 0, got "
                             f"{batch_size}, {max_staleness}, {version}")
        self.batch_size, self.max_staleness = batch_size, max_staleness
        self.accepted = self.running = 0
        self.resume(version)

    def capacity(self, version: int) -> int:
        """How many more samples may start now, with the trainer at weight ``version``."""
        return max(0, (self.max_staleness + version + 1) * self.batch_size - (self.accepted + self.running))

    def admit(self, n: int, version: int) -> bool:
        """Start ``n`` samples if the capacity at ``version`` holds them all (then they count as running)."""
        if n < 1:
            raise ValueError(f"Admission.admit: n must be >= 1, got {n}")
        if n > self.capacity(version):
            return False
        self.running += n
        return True

    def version_needed(self, n: int) -> int:
        """The trainer's version from which ``n`` more samples fit."""
        needed = -(-(self.accepted + self.running + n) // self.batch_size) - 1 - self.max_staleness
        return max(0, needed)

    def finish(self, n: int, kept: int | None = None) -> None:
        """``n`` running samples finished, ``kept`` of them (default all) kept for training; the others free their
        place."""
        kept = n if kept is None else kept
        if not (0 <= kept <= n <= self.running):
            raise ValueError(f"Admission.finish: need 0 <= kept <= n <= running ({self.running}), got n={n}, "
                             f"kept={kept}")
        self.running -= n
        self.accepted += kept

    def resume(self, version: int) -> None:
        """Restart the count at the trainer's ``version``: the samples of its ``version`` trained steps, none
        running."""
        self.accepted, self.running = version * self.batch_size, 0
