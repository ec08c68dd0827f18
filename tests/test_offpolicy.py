"""Staleness beyond one step: admission by capacity (AReaL's rule, counted in samples) as a unit and inside the async
producer (a maker at the engine boundary, no Ray), its restart at a resume without a burst, and the weight version
of every token through partial rollouts and multi-turn trajectories. Fast."""

import random
import time

import pytest
import torch

from backends.base import Completion
from rlhf_sg.experience import build_rollout_batch
from rlhf_sg.offpolicy import Admission, token_staleness
from rlhf_sg.trainer.rollout import continue_completion, token_versions_of


# ---- the admission rule -------------------------------------------------------------------------------------------
def test_capacity_is_what_keeps_the_next_samples_within_the_bound_of_the_trainers_version():
    a = Admission(batch_size=4, max_staleness=2)
    assert a.capacity(0) == 12  # the samples of steps 0, 1 and 2: trained at most 2 versions after version 0
    assert a.admit(4, 0) and a.admit(4, 0) and a.admit(3, 0)
    assert a.capacity(0) == 1 and not a.admit(2, 0) and a.running == 11
    assert a.version_needed(2) == 1  # step 3's first sample needs the trainer at version 1
    a.finish(11)  # finishing moves nothing: the samples still have to be trained
    assert (a.accepted, a.running, a.capacity(0)) == (11, 0, 1)
    assert a.capacity(1) == 5 and a.admit(5, 1)


def test_a_dropped_sample_frees_its_place_and_nothing_is_discarded_to_make_room():
    a = Admission(batch_size=4, max_staleness=1)
    assert a.admit(8, 0) and a.capacity(0) == 0
    a.finish(4, kept=1)  # three samples of a filtered group dropped: three more may start
    assert a.capacity(0) == 3 and a.running == 4
    with pytest.raises(ValueError, match=r"Admission.finish: need 0 <= kept <= n <= running \(4\), got n=5, kept=5"):
        a.finish(5)


@pytest.mark.parametrize("seed", range(5))
def test_every_admitted_sample_is_trained_within_max_staleness_of_its_start_and_only_those_are_refused(seed):
    """A producer admitting one sample at a time and a trainer taking ``batch_size`` kept samples per step in
    admission order (as the async producer does), samples dropped at random: each kept sample is trained at most
    ``max_staleness`` versions after the version it started with, and every refusal was needed (had all the running
    samples been kept, the refused one would have been trained too late)."""
    rng = random.Random(seed)
    B, k = 3, rng.choice([1, 2, 4])
    a = Admission(B, k)
    version, started, finished, kept = 0, [], 0, []  # started: the version each admitted sample started with
    for _ in range(400):
        move = rng.random()
        if move < 0.5:
            rank_if_all_kept = a.accepted + a.running
            if a.admit(1, version):
                started.append(version)
            else:
                assert rank_if_all_kept // B > version + k
        elif move < 0.8 and finished < len(started):
            keep = rng.random() < 0.8
            a.finish(1, kept=int(keep))
            if keep:
                kept.append(started[finished])
            finished += 1
        elif len(kept) >= (version + 1) * B:  # the trainer trains step `version` on kept samples in order
            version += 1
    assert version >= 5  # the run went on
    for rank, start in enumerate(kept[: version * B]):
        assert rank // B - start <= k, (rank, start, k)
    assert max(rank // B - start for rank, start in enumerate(kept[: version * B])) == k  # the bound is reached


def test_a_resume_restarts_the_count_at_the_trainers_version_without_a_burst():
    """Samples made before a checkpoint and not trained are not in it: counted from 0 at version 10, the rule would
    admit 13 batches at once, the last trained 12 versions late."""
    a = Admission(batch_size=4, max_staleness=2, version=10)
    assert a.capacity(10) == 12 and a.version_needed(13) == 11
    a.admit(12, 10)
    a.resume(10)
    assert (a.accepted, a.running, a.capacity(10)) == (40, 0, 12)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="Admission: need batch_size >= 1"):
        Admission(0, 1)
    with pytest.raises(ValueError, match="Admission.admit: n must be >= 1, got 0"):
        Admission(2, 1).admit(0, 0)


# ---- the rule inside the async producer ---------------------------------------------------------------------------
class _Maker:
    """The RolloutMaker hooks AsyncRollout uses (a boundary: no engine): each batch is one generate call and comes
    back at once, recording its step and the engines' version."""

    def __init__(self):
        self.restart = None
        self.before_generate = self.after_generate = None
        self.made: list[tuple[int, int]] = []

    def make(self, timer, step, version):
        self.before_generate()
        self.after_generate()
        self.made.append((step, version))
        return [], step, {}


def _wait(cond, what, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.01)


@pytest.mark.parametrize("first_step", [0, 7])
def test_the_producer_admits_each_batch_by_capacity_and_runs_ahead_by_the_bound_only(first_step):
    """max_staleness 3, batches of 6 samples: from step s (the engines at version s) the producer makes steps s .. s+3
    and waits for version s + 1; a resume at step 7 starts the count there (no burst of 7 more batches)."""
    from rlhf_sg.timing import StepTimer
    from rlhf_sg.trainer.async_rollout import AsyncRollout

    maker = _Maker()
    producer = AsyncRollout(maker, first_step=first_step, last_step=first_step + 10, engine_version=first_step,
                            max_staleness=3, timeout_s=30, data_state=dict, batch_size=6)
    producer.start()
    try:
        _wait(lambda: producer.waiting_for_version is not None, "wait for a version")
        assert producer.waiting_for_version == first_step + 1
        assert maker.made == [(first_step + i, first_step) for i in range(4)]
        assert (producer.admission.accepted, producer.admission.running) == (6 * (first_step + 4), 0)
        timer = StepTimer(sync=lambda: None)
        timer.start_step()
        assert producer.take(first_step)[1] == first_step
        producer.sync(lambda: None, version=first_step + 1, timer=timer)
        _wait(lambda: len(maker.made) == 5, "fifth batch")
        assert maker.made[-1] == (first_step + 4, first_step + 1)
        _wait(lambda: producer.waiting_for_version == first_step + 2, "wait for the next version")
    finally:
        producer.stop()


# ---- the weight version of every token ----------------------------------------------------------------------------
def test_a_completion_cut_twice_keeps_the_version_of_each_of_its_tokens():
    first = Completion([5, 6], [-0.5, -0.25], "abort", weight_version=3, prompt_index=1)
    second = continue_completion(first, Completion([7], [-1.0], "abort", 4, 0), budget=6)
    third = continue_completion(second, Completion([8, 9, 10, 11], [-1.0] * 4, "length", 5, 0), budget=6)
    assert third.token_ids == [5, 6, 7, 8, 9, 10]
    assert third.token_versions == [3, 3, 4, 5, 5, 5] and third.weight_version == 3
    assert token_versions_of(Completion([1, 2], [0.0, 0.0], "stop", 9, 0)) == [9, 9]


def test_the_batch_lays_each_tokens_version_under_it_and_the_staleness_is_counted_per_token():
    exp = build_rollout_batch([[1, 2], [3]], [[5, 6, 7, 8], [9, 10]], [[0.0] * 4, [0.0] * 2], pad_id=0,
                              weight_versions=[3, 5], token_versions=[[3, 3, 4, 5], [5, 5]])
    assert exp.token_versions.tolist() == [[3, 3, 4, 5], [5, 5, 0, 0]]
    metrics = token_staleness(exp.token_versions, exp.action_mask, trainer_version=6)
    assert metrics["rollout/token_staleness_mean"] == pytest.approx((3 + 3 + 2 + 1 + 1 + 1) / 6)
    assert metrics["rollout/token_staleness_max"] == 3.0
    assert metrics["rollout/multi_version_frac"] == 0.5
    with pytest.raises(ValueError, match="token_staleness: tokens of weight version 5 in a batch the trainer trains "
                                         "at version 4"):
        token_staleness(exp.token_versions, exp.action_mask, trainer_version=4)
    with pytest.raises(ValueError, match="rollout sample 1: 1 token weight versions for 2 tokens"):
        build_rollout_batch([[1], [3]], [[5], [9, 10]], [[0.0], [0.0] * 2], 0, token_versions=[[3], [5]])


def test_a_multi_turn_row_gives_each_sampled_token_its_turns_version_and_observations_the_turn_befores():
    from rlhf_sg.agent import _row_versions, _State

    s = _State(prompt_ids=[1], env=None, engine=0)
    # turn 1: 2 tokens at version 3, cut and continued with 1 token at version 4; observation of 2; turn 2 at 5
    s.versions, s.sampled_versions = [3, 4, 5], [3, 3, 4, 5, 5]
    s.mask = [True, True, True, False, False, True, True]
    assert _row_versions(s) == [3, 3, 4, 4, 4, 5, 5]
    exp = build_rollout_batch([[1]], [[7] * 7], [[0.0] * 7], 0, action_masks=[s.mask],
                              token_versions=[_row_versions(s)])
    # the observation tokens are out of the count
    assert token_staleness(exp.token_versions, exp.action_mask, 5)["rollout/token_staleness_mean"] == \
        pytest.approx((2 + 2 + 1 + 0 + 0) / 5)
    assert torch.equal(exp.token_versions[0], torch.tensor([3, 3, 4, 4, 4, 5, 5]))
