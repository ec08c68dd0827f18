"""Staleness beyond one step: admission by capacity (AReaL's rule, counted in samples) as a unit and inside the async
producer (a maker at the engine boundary, no Ray), its restart at a resume without a burst, and the weight version
of every token through partial rollouts and multi-turn trajectories. Fast."""

import copy
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


# ---- admission one prompt group at a time, and the in-flight buffer in checkpoints --------------------------------
def _prompts(count: int):
    from rlhf_sg.data import Prompt

    return [Prompt(token_ids=[i + 1, i + 2], text=f"p{i}") for i in range(count)]


def _inflight(P=2, n=2, k=1, first_step=0, last_step=20, stream=None):
    from rlhf_sg.data import PromptStream
    from rlhf_sg.offpolicy import InFlight

    stream = stream or PromptStream(_prompts(40), P, seed=3)
    return InFlight(P, n, k, first_step, last_step, lambda step: (stream.state(), stream.next_batch())), stream


def _done(group, version, length=1):
    return [Completion([7] * length, [-0.5] * length, "stop", version, j) for j in range(2)]


def test_groups_of_later_steps_start_while_a_long_group_of_an_earlier_step_is_still_running():
    """The unit is a prompt group, not a batch: with the trainer at version 0 and max_staleness 1, every group of
    steps 0 and 1 starts at once, a long group of step 0 keeps running while step 1 finishes and is handed out, and
    that long group stays in its batch (nothing discarded and drawn again: two batches drawn in all)."""
    flight, stream = _inflight()
    started = flight.admit(0)
    assert [(g.step, g.index) for g in started] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    long = started[1]
    for g in started:
        if g is not long:
            flight.finish(g, _done(g, 0))
    assert [step for step, _ in flight.ready()] == [1]
    assert flight.admit(0) == [] and not flight.can_admit(0)
    assert flight.version_needed() == 1
    flight.finish(long, _done(long, 0, length=50))
    ((step, groups),) = flight.ready()
    assert step == 0 and groups[1] is long and groups[1].samples[0].token_ids == [7] * 50
    assert stream.position == 4  # two batches drawn, none again


@pytest.mark.parametrize("k", [1, 2, 4])
def test_a_group_of_step_s_starts_only_with_the_engines_at_version_s_minus_max_staleness_or_newer(k):
    """At version v exactly the groups of steps v .. v + k may start (capacity (v + k + 1) batches); the first group
    of step v + k + 1 waits for version v + 1, and starts as soon as the trainer has trained one more step."""
    flight, _ = _inflight(k=k)
    started = flight.admit(0)
    assert sorted({g.step for g in started}) == list(range(k + 1)) and len(started) == 2 * (k + 1)
    assert not flight.can_admit(0) and flight.version_needed() == 1
    for g in started:
        flight.finish(g, _done(g, 0))
    assert [s for s, _ in flight.ready()] == list(range(k + 1))
    flight.trained(0)
    assert flight.admit(0) == []  # the trainer's version has not moved: nothing more may start
    assert [(g.step, g.index) for g in flight.admit(1)] == [(k + 1, 0), (k + 1, 1)]


@pytest.mark.parametrize("seed", range(4))
def test_long_tailed_groups_are_each_trained_once_in_their_step_within_max_staleness(seed):
    """A random run: groups finish in any order (a long tail), the trainer trains each step once its batch is
    complete and the engines follow. Every drawn prompt is trained once, in the step it was drawn for, at most
    max_staleness versions after the version its group started with, and the bound is reached."""
    rng = random.Random(seed)
    k = rng.choice([1, 2, 4])
    flight, _ = _inflight(k=k, last_step=12)
    version, running, started_at, trained, complete = 0, [], {}, [], {}
    while version < 12:
        for g in flight.admit(version):
            started_at[g] = version
            running.append(g)
        if running and rng.random() < 0.7:
            g = running.pop(rng.randrange(len(running)))
            flight.finish(g, _done(g, started_at[g]))
        complete.update(flight.ready())
        if version in complete:
            trained += [(version, g.step, started_at[g], g.prompt.text) for g in complete.pop(version)]
            flight.trained(version)
            version += 1
    assert all(step == at for at, step, _, _ in trained)
    assert max(at - start for at, _, start, _ in trained) == k
    assert all(at - start <= k for at, _, start, _ in trained)
    assert len({text for *_, text in trained}) == len(trained) == 12 * 2


def test_the_buffer_and_counters_come_back_from_a_checkpoint_and_the_first_steps_after_stay_within_the_bound():
    """Saved with the trainer at version 3 (max_staleness 2): step 3 done but for one running group, step 4 done,
    step 5 half done. After a JSON round trip the finished completions (token versions included) and the accepted
    count are back; the groups that were running start again at the resume's version; nothing of steps 6.. starts
    before version 4; and every batch trained after the resume is within 2 versions of its oldest token."""
    import json

    flight, stream = _inflight(k=2, first_step=3)
    started = flight.admit(3)
    assert [(g.step, g.index) for g in started] == [(s, i) for s in (3, 4, 5) for i in (0, 1)]
    for g in started[:1] + started[2:5]:
        samples = _done(g, 3)
        samples[0] = Completion([7, 8], [-0.5, -0.25], "stop", 3, 0, token_versions=[3, 3])
        flight.finish(g, samples)
    state = json.loads(json.dumps(flight.state_dict()))
    assert (state["accepted"], state["running"]) == (3 * 4 + 8, 4)

    back, _ = _inflight(k=2, first_step=3, stream=copy.copy(stream))
    from rlhf_sg.data import PromptStream

    def prompts_at(position):
        s = PromptStream(stream.prompts, 2, seed=3)
        s.load_state(position)
        return s.next_batch()

    back.load_state_dict(state, prompts_at, Completion)
    assert (back.admission.accepted, back.admission.running) == (20, 0)
    for step, groups in flight._steps.items():
        again = back._steps[step]
        assert [g.prompt for g in again] == [g.prompt for g in groups]
        assert [g.samples for g in again] == [g.samples for g in groups]
    restarted = back.admit(3)
    assert [(g.step, g.index) for g in restarted] == [(3, 1), (5, 1)]  # no step beyond 3 + 2, no burst
    assert not back.can_admit(3)
    version = 3
    for g in restarted:
        back.finish(g, _done(g, 3))
    for step, groups in back.ready():
        assert step == version
        oldest = min(v for g in groups for c in g.samples for v in (c.token_versions or [c.weight_version]))
        assert version - oldest <= 2
        back.trained(step)
        version += 1
        assert all(g.step <= version + 2 for g in back.admit(version))


def test_a_checkpoint_of_other_batch_shapes_or_a_damaged_count_is_refused():
    flight, stream = _inflight()
    for g in flight.admit(0):
        flight.finish(g, _done(g, 0))
    state = flight.state_dict()
    other, _ = _inflight(P=2, n=4)
    with pytest.raises(ValueError, match="batches of 2 prompts x 2 samples; this run's are 2 x 4"):
        other.load_state_dict(state, lambda _: _prompts(2), Completion)
    same, _ = _inflight()
    with pytest.raises(ValueError, match="admission count, 9 samples accepted, does not match its buffer"):
        same.load_state_dict({**state, "accepted": 9}, lambda _: _prompts(2), Completion)


class _GroupMaker:
    """The RolloutMaker surface the per-sample producer uses, its engines replaced (the boundary: no engine; the
    signatures are checked against RolloutMaker's below). Each ``generate_ids`` call is recorded with the prompts it
    carries and the engines' version; the prompts of ``cut`` come back cut short after one token (a sync's abort) the
    first time."""

    def __init__(self, stream, n=2, cut=()):
        from rlhf_sg.config import Config

        self.cfg, self.stream = Config(), stream
        self.cfg.rollout.n_samples_per_prompt = n
        self.restart, self.restarts = None, 0
        self.before_generate = self.after_generate = None
        self.calls: list[tuple] = []
        self.version, self.cut = 0, set(cut)

    def sampling_params(self):
        from backends.base import SamplingParams

        return SamplingParams(n=self.cfg.rollout.n_samples_per_prompt, max_new_tokens=4)

    def generate_ids(self, prompts, params, step, draw, segment=0, images=None):
        self.before_generate()
        try:
            self.calls.append((step, draw, segment, [tuple(p) for p in prompts], params.n, self.version))
            out = []
            for i, p in enumerate(prompts):
                cut = tuple(p) in self.cut
                self.cut.discard(tuple(p))
                out += [Completion([9] if cut else [9, 9], [-0.5] * (1 if cut else 2), "abort" if cut else "stop",
                                   self.version, i) for _ in range(params.n)]
            return out
        finally:
            self.after_generate()

    def score_batch(self, prompts, completions):
        return completions, {"reward/mean": 0.0}


def _producer(maker, first_step, k=2, restore=None, version=None, last_step=None):
    from rlhf_sg.trainer.async_rollout import AsyncRollout

    return AsyncRollout(maker, first_step=first_step, last_step=last_step or first_step + 10,
                        engine_version=first_step if version is None else version, max_staleness=k, timeout_s=30,
                        data_state=maker.stream.state, batch_size=2 * maker.cfg.rollout.n_samples_per_prompt,
                        per_sample=True, restore=restore)


def _sync(producer, maker, version):
    from rlhf_sg.timing import StepTimer

    timer = StepTimer(sync=lambda: None)
    timer.start_step()
    producer.sync(lambda: setattr(maker, "version", version), version=version, timer=timer)


def test_the_fake_maker_keeps_the_signatures_of_rolloutmaker():
    import inspect

    from rlhf_sg.trainer.rollout import RolloutMaker

    for name in ("sampling_params", "generate_ids", "score_batch"):
        assert (list(inspect.signature(getattr(_GroupMaker, name)).parameters)
                == list(inspect.signature(getattr(RolloutMaker, name)).parameters)), name


def test_the_per_sample_producer_starts_every_admitted_group_of_several_steps_in_one_call_and_continues_cut_ones():
    """max_staleness 2, 2 prompts x 2 samples a step: one generate call carries the groups of steps 0, 1 and 2
    together (a long sample of step 0 decodes beside the samples of later steps); a completion cut short is continued
    from its tokens (n 1, its own segment) and keeps its batch; after the trainer's sync to version 1 the next call
    carries step 3's groups only, sampled with version 1."""
    from rlhf_sg.data import PromptStream

    stream = PromptStream(_prompts(40), 2, seed=3)
    first = PromptStream(_prompts(40), 2, seed=3).next_batch()
    maker = _GroupMaker(stream, cut={tuple(first[1].token_ids)})
    producer = _producer(maker, 0)
    producer.start()
    try:
        _wait(lambda: producer.waiting_for_version is not None, "wait for a version")
        assert producer.waiting_for_version == 1
        (step, draw, segment, prompts, n, version), cont = maker.calls[:2]
        assert (step, draw, segment, len(prompts), n, version) == (0, 0, 0, 6, 2, 0)
        assert cont[2:] == (1, [tuple(first[1].token_ids) + (9,)] * 2, 1, 0)
        got = producer.take(0)
        assert [p.text for p in got[0]] == [p.text for p in first]
        assert [c.token_ids for c in got[1]] == [[9, 9]] * 2 + [[9, 9, 9]] * 2 and got[1][2].token_versions == [0, 0, 0]
        _sync(producer, maker, 1)
        _wait(lambda: len(maker.calls) == 3, "the next call")
        assert maker.calls[2][0:2] == (3, 0) and len(maker.calls[2][3]) == 2 and maker.calls[2][5] == 1
        assert (producer.admission.accepted, producer.admission.running) == (16, 0)
    finally:
        producer.stop()


def test_a_producer_resumed_from_a_checkpoint_trains_the_saved_samples_and_draws_only_what_was_not_drawn():
    """A checkpoint taken after step 0 trained (max_staleness 2: steps 1 and 2 made, not trained) holds them; a
    producer resumed from it hands them out unchanged without generating them again, its first call carries step 3
    only (no burst), and step 3's prompts are those the uninterrupted producer drew."""
    import json

    from rlhf_sg.data import PromptStream

    maker = _GroupMaker(PromptStream(_prompts(40), 2, seed=3))
    producer = _producer(maker, 0)
    producer.start()
    try:
        _wait(lambda: producer.waiting_for_version == 1, "wait for version 1")
        producer.take(0)
        position, inflight = producer.checkpoint_state(1)
        inflight = json.loads(json.dumps(inflight))
        assert inflight["accepted"] == 12 and sorted(inflight["steps"]) == ["1", "2"]
        made = {s: producer.take(s) for s in (1, 2)}
        _sync(producer, maker, 1)
        _wait(lambda: len(maker.calls) == 2, "step 3's call")
        step3 = maker.calls[1][3]
    finally:
        producer.stop()

    stream = PromptStream(_prompts(40), 2, seed=3)
    stream.load_state(json.loads(json.dumps(position)))
    again = _GroupMaker(stream)
    again.version = 1
    resumed = _producer(again, 1, restore=inflight)
    assert (resumed.admission.accepted, resumed.admission.running) == (12, 0)
    resumed.start()
    try:
        _wait(lambda: resumed.waiting_for_version == 2, "wait for version 2")
        assert [c[0] for c in again.calls] == [3] and again.calls[0][3] == step3 and again.calls[0][5] == 1
        for s in (1, 2):
            prompts, completions, _ = resumed.take(s)
            assert [p.text for p in prompts] == [p.text for p in made[s][0]]
            assert completions == made[s][1]
    finally:
        resumed.stop()


def test_a_producer_resumed_with_every_step_left_made_hands_them_out_without_a_generate_call():
    """The run's last steps were all made before the checkpoint: the resumed producer has nothing to start and still
    hands out the saved batches."""
    import json

    from rlhf_sg.data import PromptStream

    maker = _GroupMaker(PromptStream(_prompts(40), 2, seed=3))
    producer = _producer(maker, 0, last_step=3)
    producer.start()
    try:
        _wait(lambda: 2 in producer._ready, "step 2's batch")
        producer.take(0)
        _, inflight = producer.checkpoint_state(1)
        inflight = json.loads(json.dumps(inflight))
        made = {s: producer.take(s) for s in (1, 2)}
    finally:
        producer.stop()
    stream = PromptStream(_prompts(40), 2, seed=3)
    again = _GroupMaker(stream)
    resumed = _producer(again, 1, restore=inflight, version=1, last_step=3)
    resumed.start()
    try:
        for s in (1, 2):
            assert resumed.take(s)[1] == made[s][1]
        assert again.calls == []
    finally:
        resumed.stop()


def test_an_engine_failure_in_the_per_sample_producer_is_raised_at_the_trainers_take():
    """The producer thread's failure (an engine's error in generate) is the trainer's: its next take raises it,
    rather than waiting out the time-out or naming a stopped thread."""
    from rlhf_sg.data import PromptStream

    class _FailingMaker(_GroupMaker):
        def generate_ids(self, prompts, params, step, draw, segment=0, images=None):
            raise RuntimeError("engine 0: generate failed")

    maker = _FailingMaker(PromptStream(_prompts(40), 2, seed=3))
    producer = _producer(maker, 0)
    producer.start()
    try:
        with pytest.raises(RuntimeError, match="engine 0: generate failed"):
            producer.take(0)
    finally:
        producer.stop()
