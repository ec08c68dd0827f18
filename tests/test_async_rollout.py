"""Async rollout and partial rollout: generation overlapping training, staleness bounded, aborted generations
continued across a weight sync with the tokens before and after kept.

The specifications first (no process started): how a cut completion and its continuation join, the staleness
check. Then a real embedded engine in a real Ray actor, cut short by ``abort_generation`` from another thread and
continued after new weights came in, checked token by token against two transformers models. Then the trainer
(real Ray, DeepSpeed ZeRO-3, the embedded engine) in async mode: the staleness bound on every sample, and the
quickstart task learned as in sync mode.
"""

import os
import sys
import threading
import time

import pytest
import torch

from backends.base import Completion
from rlhf_sg.config import ASYNC_TIS_CAP, Config, ConfigError, rollout_is_async, tis_cap
from rlhf_sg.trainer.rollout import check_staleness, continue_completion, rollout_seed

RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")
TESTS = os.path.dirname(os.path.abspath(__file__))


# ---- specifications ---------------------------------------------------------------------------------------
def test_a_cut_completion_and_its_continuation_keep_every_token_and_the_oldest_version():
    before = Completion([5, 6], [-0.5, -0.25], "abort", weight_version=3, prompt_index=1)
    after = Completion([7, 8, 9], [-1.0, -2.0, -3.0], "stop", weight_version=4, prompt_index=0)
    joined = continue_completion(before, after, budget=6)
    assert joined.token_ids == [5, 6, 7, 8, 9]
    assert joined.logprobs == [-0.5, -0.25, -1.0, -2.0, -3.0]
    assert (joined.finish_reason, joined.weight_version, joined.prompt_index) == ("stop", 3, 1)


def test_a_continuation_longer_than_the_budget_is_cut_to_it_and_ends_by_length():
    before = Completion([5, 6], [-0.5, -0.25], "abort", 3, 0)
    after = Completion([7, 8, 9], [-1.0, -2.0, -3.0], "length", 4, 0)  # asked for the longest room of its batch
    joined = continue_completion(before, after, budget=4)
    assert joined.token_ids == [5, 6, 7, 8] and joined.logprobs == [-0.5, -0.25, -1.0, -2.0]
    assert joined.finish_reason == "length"
    # exactly the room left: the continuation's own ending stands
    exact = continue_completion(before, Completion([7, 8], [-1.0, -2.0], "stop", 4, 0), budget=4)
    assert exact.finish_reason == "stop" and exact.token_ids == [5, 6, 7, 8]


def test_a_completion_cut_before_its_first_token_takes_the_version_of_its_continuation():
    joined = continue_completion(Completion([], [], "abort", 3, 2), Completion([7], [-1.0], "stop", 4, 0), budget=5)
    assert (joined.token_ids, joined.weight_version, joined.prompt_index) == ([7], 4, 2)


def test_staleness_is_checked_against_the_bound_and_never_ahead_of_the_trainer():
    assert check_staleness([5, 4, 4], trainer_version=5, max_staleness=1) == [0, 1, 1]
    with pytest.raises(RuntimeError, match=r"1 completion\(s\).*\[2\].*weight version\(s\) \[3\].*max_staleness"):
        check_staleness([5, 4, 3], trainer_version=5, max_staleness=1)
    with pytest.raises(RuntimeError, match="version"):
        check_staleness([6], trainer_version=5, max_staleness=2)  # from weights the trainer does not have yet
    assert check_staleness([3], trainer_version=5, max_staleness=2) == [2]


def test_continuation_segments_get_their_own_seed_and_segment_zero_keeps_the_old_one():
    assert rollout_seed(1, 2, 0, 3, segment=0) == rollout_seed(1, 2, 0, 3)
    seeds = {rollout_seed(1, 2, 0, 3, segment=s) for s in range(4)}
    assert len(seeds) == 4


def _cfg(**rollout):
    cfg = Config()
    cfg.model.pretrain = "unused"
    for k, v in rollout.items():
        setattr(cfg.rollout, k, v)
    return cfg


def test_async_mode_rules():
    from rlhf_sg.config import _validate_rollout_mode

    with pytest.raises(ConfigError, match=r"--rollout.mode must be one of \['sync', 'async'\], got 'asnyc'"):
        _validate_rollout_mode(_cfg(mode="asnyc"))
    with pytest.raises(ConfigError, match="--rollout.max_staleness must be >= 1"):
        _validate_rollout_mode(_cfg(mode="async", max_staleness=0))
    with pytest.raises(ConfigError, match="engines cannot sleep"):
        _validate_rollout_mode(_cfg(mode="async", sleep_engines_while_training=True))
    offloading = _cfg(mode="async")
    offloading.train.offload_states_while_generating = True
    with pytest.raises(ConfigError, match="training states cannot leave the device"):
        _validate_rollout_mode(offloading)
    _validate_rollout_mode(_cfg(mode="async", max_staleness=2))
    # colocated placement stays sync; TIS is on by default only where samples can be stale
    colocated = _cfg(mode="async")
    colocated.train.colocate_all = True
    assert not rollout_is_async(colocated) and tis_cap(colocated) is None
    assert rollout_is_async(_cfg(mode="async")) and tis_cap(_cfg(mode="async")) == ASYNC_TIS_CAP
    assert tis_cap(_cfg(mode="sync")) is None
    given = _cfg(mode="async")
    given.train.tis_cap = 5.0
    assert tis_cap(given) == 5.0


# ---- an engine restart in the producer against the trainer's calls ----------------------------------------
class _RestartingMaker:
    """The RolloutMaker hooks AsyncRollout uses (a boundary: no engine): making a batch, one engine dies after its
    generate returned and is restarted, as RolloutMaker._generate does."""

    def __init__(self, restarted: list, reached: threading.Event):
        self.restart = lambda index, version=None: restarted.append((index, version))
        self.before_generate = self.after_generate = None
        self.reached = reached

    def make(self, timer, step, version):
        self.before_generate()
        self.after_generate()
        self.reached.set()
        self.restart(0)
        return [], None, {}


def test_an_engine_restart_waits_for_the_trainers_calls_and_takes_the_synced_version():
    """A restart pushes weights through the actor's ranks, so it must not run while the trainer calls them (two
    threads' collectives on one group interleave differently on each rank), and the weights it pushes are the ones
    the trainer's sync just sent: it waits for the trainer's calls and their sync, and takes that sync's version."""
    from rlhf_sg.timing import StepTimer
    from rlhf_sg.trainer.async_rollout import AsyncRollout

    restarted, reached = [], threading.Event()
    producer = AsyncRollout(_RestartingMaker(restarted, reached), first_step=0, last_step=1, engine_version=0,
                            max_staleness=1, timeout_s=30, data_state=dict)
    timer = StepTimer(sync=lambda: None)
    timer.start_step()
    try:
        with producer.trainer_calls():  # the trainer scores, updates and syncs
            producer.start()
            assert reached.wait(30)  # the producer's engine died: its restart is due
            pushed = []
            producer.sync(lambda: pushed.append(list(restarted)), version=1, timer=timer)
        producer.take(0)
        assert pushed == [[]]  # nothing restarted while the trainer held its calls
        assert restarted == [(0, 1)]  # then with the version of the sync that ran meanwhile
    finally:
        producer.stop()


# ---- a real engine cut short and continued ----------------------------------------------------------------
ray = pytest.importorskip("ray")


def _poll(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.01)


def _wait_for_decoding(engine, min_steps: int = 2) -> None:
    """Until the engine's generate runs and has decoded ``min_steps`` tokens a row, as the engine counts them
    (``decode_steps``: the embedded engine's decode steps, the fewest tokens vLLM's output processor holds for a
    request, the same in SGLang's tokenizer manager, which its tokens reach every 50)."""

    def decoding() -> bool:
        running, done = ray.get(engine.generate_progress.options(concurrency_group="abort").remote(), timeout=60)
        assert done is not None, "the engine does not report its progress (decode_steps)"
        return running and done >= min_steps

    _poll(decoding, "generate under way")


def _teacher_forced_logp(model, prompt: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per completion token: its log-prob under ``model`` (temperature 1) and the model's greedy choice there."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits, -1)
    return logp.gather(1, torch.tensor(tokens)[:, None])[:, 0], logits.argmax(-1)


def _two_models(backend: str):
    """Models A and B of one architecture (different seeds) the engine runs, without an end-of-sequence id of
    their own (only the maker's stop id ends a completion). vLLM's CPU attention needs heads of 32."""
    from transformers import AutoModelForCausalLM

    from rlhf_sg.tiny import tiny_config

    config = tiny_config("qwen2", "tiny")
    if backend == "vllm":
        config.num_attention_heads, config.num_key_value_heads = 2, 1
    models = []
    for seed in (0, 1):
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            m = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        m.config.eos_token_id = m.generation_config.eos_token_id = None
        models.append(m)
    return models


def _engine_config(backend: str, path: str):
    from backends.base import BackendConfig

    extra = {"gpu_memory_utilization": 0.05} if backend == "vllm" else {}
    return BackendConfig(model_path=path, dtype="float32", max_model_len=1024, seed=0, num_threads=1, extra=extra)


ENGINE_BACKENDS = {"hf": None, "sglang": "bash recipes/install/sglang_cpu.sh",
                   "vllm": "bash recipes/install/vllm_cpu.sh"}


@pytest.mark.slow
@pytest.mark.parametrize("backend", sorted(ENGINE_BACKENDS))
def test_partial_rollout_continues_a_generation_across_a_weight_sync_keeping_the_tokens_before_and_after(
        ray_cluster, tmp_path, backend):
    """One engine starts on model A and greedily generates 2 x 2 long completions; from another thread the test
    aborts it mid-generation, loads model B as version 1 and resumes. Every completion must be A's greedy tokens
    (with A's log-probs) up to the cut and B's greedy continuation of prompt + those tokens after it, carry
    version 0 (its oldest tokens), and the cut must fall strictly inside it. SGLang and vLLM run in their venvs."""
    import importlib.util

    if ENGINE_BACKENDS[backend] and importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed here ({ENGINE_BACKENDS[backend]} builds its venv)")
    import backends
    from rlhf_sg.engine_actor import start_engine_actors
    from rlhf_sg.tiny import save_tiny_model
    from rlhf_sg.trainer.rollout import RolloutMaker

    if not backends.get_backend_class(backend).supports_abort:
        pytest.skip(f"backend {backend!r} cannot abort a running generate (supports_abort is False)")
    a, b = _two_models(backend)
    path_a, path_b = save_tiny_model(str(tmp_path / "a"), model=a), save_tiny_model(str(tmp_path / "b"), model=b)
    (engine,) = start_engine_actors(backend, _engine_config(backend, path_a), 1, abortable=True)

    cfg = Config()
    cfg.rollout.n_samples_per_prompt, cfg.rollout.temperature, cfg.rollout.max_new_tokens = 2, 0.0, 600
    vocab = a.config.vocab_size
    maker = RolloutMaker(cfg, [engine], stream=None, eos_id=vocab - 1, pad_id=0, score=None, on_policy=False)
    calls, synced = [], threading.Event()

    def before_generate():  # the second call (the continuation) waits for the sync, as async rollout's does
        calls.append(time.monotonic())
        if len(calls) > 1:
            assert synced.wait(120)

    maker.before_generate = before_generate

    def trainer():
        _wait_for_decoding(engine)  # generation well under way
        cut = ray.get(engine.abort_generation.options(concurrency_group="abort").remote(), timeout=120)
        # while the abort holds, a generate returns at once with nothing
        held = ray.get(engine.generate.remote([[3, 4]], maker.sampling_params()), timeout=60)
        ray.get(engine.update_weights_from_disk.remote(path_b), timeout=120)
        ray.get(engine.finish_weight_update.remote(1), timeout=60)
        ray.get(engine.resume_generation.remote(), timeout=60)
        results.update(cut=cut, held=held)
        synced.set()

    results = {}
    prompts = [type("P", (), {"token_ids": [5, 6, 7]})(), type("P", (), {"token_ids": [8, 9]})()]
    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        completions = maker.generate(prompts, step=0)
        thread.join(120)
        assert results["cut"] is True
        assert [(c.finish_reason, c.token_ids) for c in results["held"]] == [("abort", [])] * 2
        assert maker.continued == 4 and len(calls) >= 2  # the first call, then one per remaining budget
        for k, c in enumerate(completions):
            prompt = prompts[k // 2].token_ids
            assert len(c.token_ids) == len(c.logprobs) and c.weight_version == 0
            # to the budget, or to the stop token (the maker's end-of-sequence id), which is then the last token
            assert (c.finish_reason, len(c.token_ids)) == ("length", 600) or (
                c.finish_reason == "stop" and c.token_ids[-1] == vocab - 1 and len(c.token_ids) < 600)
            logp_a, greedy_a = _teacher_forced_logp(a, prompt, c.token_ids)
            logp_b, greedy_b = _teacher_forced_logp(b, prompt, c.token_ids)
            engine_logp, tokens = torch.tensor(c.logprobs), torch.tensor(c.token_ids)
            from_a = (engine_logp - logp_a).abs() < 1e-2
            cut = int(from_a.logical_not().nonzero()[0]) if not from_a.all() else len(tokens)
            assert 0 < cut < len(tokens), f"completion {k}: the cut at {cut} is not inside it"
            assert torch.equal(tokens[:cut], greedy_a[:cut])  # A's tokens before the sync, kept
            assert torch.equal(tokens[cut:], greedy_b[cut:])  # B's continuation after it
            assert torch.allclose(engine_logp[cut:], logp_b[cut:], atol=1e-2)
    finally:
        ray.get(engine.shutdown.remote(), timeout=120)
        ray.kill(engine)


@pytest.mark.slow
def test_the_producer_runs_ahead_by_the_staleness_bound_only_and_stops_mid_generation(ray_cluster, tmp_path):
    """AsyncRollout on a real engine: with max_staleness 2 and the engines at version 0 it makes the batches of
    steps 0, 1 and 2 and no more until a sync raises the engines' version; a sync cuts a long generate short and
    the batch still comes out whole (continued); stop() during a long generate ends the thread at once. First, on
    the same engine: an abort when no generate runs cuts nothing, and generate runs again after resume."""
    from backends.base import SamplingParams
    from rlhf_sg.data import Prompt, PromptStream
    from rlhf_sg.engine_actor import start_engine_actors
    from rlhf_sg.timing import StepTimer
    from rlhf_sg.tiny import save_tiny_model
    from rlhf_sg.trainer.async_rollout import AsyncRollout
    from rlhf_sg.trainer.rollout import RolloutMaker

    model, _ = _two_models("hf")
    path = save_tiny_model(str(tmp_path / "m"), model=model)
    (engine,) = start_engine_actors("hf", _engine_config("hf", path), 1, abortable=True)
    assert ray.get(engine.abort_generation.options(concurrency_group="abort").remote(), timeout=60) is False
    ray.get(engine.resume_generation.remote(), timeout=60)
    (c,) = ray.get(engine.generate.remote([[3, 4]], SamplingParams(n=1, temperature=0.0, max_new_tokens=5)),
                   timeout=60)
    assert c.finish_reason != "abort" and len(c.token_ids) > 0
    cfg = Config()
    cfg.rollout.n_samples_per_prompt, cfg.rollout.prompts_per_step, cfg.rollout.max_new_tokens = 2, 2, 4
    stream = PromptStream([Prompt([5 + i, 6], f"p{i}") for i in range(8)], 2, seed=0)
    # a stop id past the vocabulary: no completion ends before its budget or a cut
    maker = RolloutMaker(cfg, [engine], stream, eos_id=model.config.vocab_size + 1, pad_id=0,
                         score=lambda prompts, completions, exp: torch.zeros(len(completions)), on_policy=False)
    abort = lambda: ray.get(engine.abort_generation.options(concurrency_group="abort").remote(), timeout=60)  # noqa: E731
    resume = lambda: ray.get(engine.resume_generation.remote(), timeout=60)  # noqa: E731
    producer = AsyncRollout(maker, first_step=0, last_step=10, engine_version=0, max_staleness=2, timeout_s=60,
                            data_state=stream.state, abort=abort, resume=resume)
    producer.start()
    try:
        for step in range(3):
            producer.take(step)
        _poll(lambda: producer.waiting_for_version == 1, "the producer to wait for version 1")
        assert producer._ready == {} and producer._next_step == 3  # step 3 needs version 1: nothing more made
        timer = StepTimer(sync=lambda: None)
        timer.start_step()
        synced = []
        cfg.rollout.max_new_tokens = 800  # from step 3 on, batches are long: the second sync cuts one short
        def push(version):  # a sync without new weights: the engine records the version
            return lambda: synced.append(ray.get(engine.finish_weight_update.remote(version), timeout=60))

        producer.sync(push(1), version=1, timer=timer)
        _wait_for_decoding(engine)  # step 3's batch under way with version 1
        producer.sync(push(2), version=2, timer=timer)
        prompts, experience, metrics = producer.take(3)
        assert synced == [1, 2] and experience.batch_size == 4
        # cut by the second sync: the samples keep the version of their first tokens
        assert 1 in experience.weight_version.tolist() and maker.continued > 0
        assert set(experience.weight_version.tolist()) <= {1, 2}
        _wait_for_decoding(engine)  # the next batch (800 tokens) is under way: stop cuts it and the thread ends
        start = time.monotonic()
        producer.stop()
        assert not producer._thread.is_alive() and time.monotonic() - start < 30
    finally:
        producer.stop()
        ray.kill(engine)


# ---- the trainer in async mode ------------------------------------------------------------------------------


def _async_cfg(task, out, steps, algo="grpo", **rollout):
    sys.path.insert(0, RECIPES)
    from quickstart_cpu import make_config

    cfg = make_config(*task, out, steps, algo, "hf", rollout_mode="async")
    cfg.log.progress_bar = cfg.log.tensorboard = cfg.log.export_hf = False
    for k, v in rollout.items():
        setattr(cfg.rollout, k, v)
    return cfg


def _run_recording_versions(cfg) -> tuple[list[dict], list[tuple[int, list[int]]]]:
    """Train ``cfg`` on the quickstart reward; the history and, per step, the weight version of every sample."""
    import arith_task

    from rlhf_sg.trainer import PPOTrainer

    versions = []

    class Recording(PPOTrainer):
        def on_experience(self, experience):
            versions.append((self.step, experience.weight_version.tolist()))

    trainer = Recording(cfg, reward_fn=arith_task.addition_reward)
    try:
        trainer.setup()
        history = trainer.fit()
    finally:
        trainer.shutdown()
    return history, versions


def _check_staleness_bound(history, versions, steps, max_staleness):
    assert len(history) == steps and history[-1]["weight_version"] == steps
    for step, vs in versions:
        assert all(0 <= step - v <= max_staleness for v in vs), (step, vs)
    assert max(h["rollout/staleness_max"] for h in history) >= 1  # generation did run ahead of training
    assert all(h["rollout/staleness_max"] <= max_staleness for h in history)
    assert all("time/wait_rollout" in h for h in history)


@pytest.mark.slow
def test_async_run_learns_the_quickstart_task(ray_cluster, task, tmp_path):
    """GRPO in async mode with its defaults (staleness bound 1, partial rollout) learns the task, and every
    sample keeps within the bound (the checks the resume test below makes at bound 2 without partial rollout)."""
    steps = 16
    cfg = _async_cfg(task, str(tmp_path / "learn"), steps)
    assert cfg.rollout.max_staleness == 1 and cfg.rollout.partial_rollout
    history, versions = _run_recording_versions(cfg)
    rewards = [h["reward/mean"] for h in history]
    # the sync-mode test's margin (128 samples a step: the step mean's noise is ~0.04)
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.05, rewards
    _check_staleness_bound(history, versions, steps, max_staleness=1)


@pytest.mark.slow
def test_async_run_with_the_decoupled_loss_at_staleness_4_learns_the_quickstart_task(ray_cluster, task, tmp_path):
    """max_staleness 4 with AReaL's decoupled loss (no TIS weight on top): the task is learned as at bound 1, every
    sample and every token keeps within the bound, and the loss reports the behaviour weight it applied."""
    steps = 16
    cfg = _async_cfg(task, str(tmp_path / "learn"), steps, max_staleness=4)
    cfg.train.decoupled_loss = True
    assert tis_cap(cfg) is None
    history, versions = _run_recording_versions(cfg)
    rewards = [h["reward/mean"] for h in history]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.05, rewards
    _check_staleness_bound(history, versions, steps, max_staleness=4)
    assert all(0 <= h["rollout/token_staleness_max"] <= 4 for h in history)
    assert all(h["rollout/token_staleness_mean"] <= h["rollout/staleness_max"] for h in history)
    weights = [h["actor/behav_weight_mean"] for h in history]
    assert all(0.5 < w < 2.0 for w in weights), weights


@pytest.mark.slow
def test_async_resume_sees_the_prompts_an_uninterrupted_run_saw(ray_cluster, task, tmp_path, max_staleness=2):
    """A checkpoint of an async run is taken while the producer has already drawn the prompts of later steps; it
    must record where the first untrained batch started drawing, so a run resumed from it trains on the same
    prompts as the run that went on.

    The uninterrupted run (without partial rollout, bound 2) also keeps every sample within the bound: each batch's
    samples come from weights at most ``max_staleness`` versions behind the trainer's (the trainer checks each
    sample; here also from the logged metrics), batches do get stale (the overlap is real), and the weight version
    advances once per step.

    The checkpoint holds the samples made and not trained and the admission counters (per-sample admission): the
    resumed run trains those very samples (the weight versions they were sampled with, older than the checkpoint's),
    within the bound, and its admission count goes on from the saved one (no burst)."""
    import json

    import arith_task

    from rlhf_sg.trainer import PPOTrainer, train
    from rlhf_sg.trainer.checkpoint import checkpoint_root

    seen: dict[str, list] = {}
    versions: dict[str, list[tuple[int, list[int], list]]] = {}
    counts: list[tuple[int, int]] = []

    def recorder(name):
        class Recording(PPOTrainer):
            def on_experience(self, experience):
                versions.setdefault(name, []).append((self.step, experience.weight_version.tolist(),
                                                      experience.sequences.tolist()))
                if name == "resumed" and self.step == 2:
                    admission = self.async_rollout.admission
                    counts.append((admission.accepted, admission.running))

            def on_step_end(self, step, metrics):
                seen.setdefault(name, []).append((step, [p.text for p in self.prompts]))

        return Recording

    out = str(tmp_path / "run")
    settings = dict(max_staleness=max_staleness, partial_rollout=False, max_new_tokens=8)
    cfg = _async_cfg(task, out, 4, **settings)
    cfg.log.save_steps = 2
    cfg.train.actor_num_ranks, cfg.train.kl_coef = 1, 0.0  # the prompt order and the bound need no more groups
    history = train(cfg, trainer_cls=recorder("full"), reward_fn=arith_task.addition_reward)
    _check_staleness_bound(history, [(s, v) for s, v, _ in versions["full"]], 4, max_staleness)
    root = checkpoint_root(out)
    with open(os.path.join(root, "step2.trainer.json")) as f:
        inflight = json.load(f)["inflight"]
    made = {int(s) for s, saved in inflight["steps"].items() if all(g is not None for g in saved["groups"])}
    assert 2 in made and set(map(int, inflight["steps"])) <= {2, 3, 4}
    finished = sum(len(g) for saved in inflight["steps"].values() for g in saved["groups"] if g is not None)
    assert inflight["accepted"] == 2 * 16 * 8 + finished
    with open(os.path.join(root, "latest"), "w") as f:  # back to the checkpoint after step 2
        f.write("step2")
    os.remove(os.path.join(root, "step4.trainer.json"))
    resumed = _async_cfg(task, out, 4, **settings)
    resumed.log.save_steps, resumed.log.resume = 2, True
    resumed.train.actor_num_ranks, resumed.train.kl_coef = 1, 0.0
    train(resumed, trainer_cls=recorder("resumed"), reward_fn=arith_task.addition_reward)
    assert [s for s, _ in seen["resumed"]] == [3, 4]
    assert seen["resumed"] == seen["full"][2:]
    for (step, vs, rows), full in zip(versions["resumed"], versions["full"][2:], strict=True):
        assert all(0 <= step - v <= max_staleness for v in vs), (step, vs)
        if step in made:  # trained from the checkpoint's buffer: the very samples of the run that went on
            assert (step, vs, rows) == full
    assert min(versions["resumed"][0][1]) < 2  # sampled before the checkpoint
    assert counts and counts[0][0] >= inflight["accepted"]
