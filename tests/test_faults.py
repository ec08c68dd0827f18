"""Faults: a run that is killed, or whose disk fails it, goes on from its last complete checkpoint or stops with a
message naming the path; nothing is lost or logged twice."""

import json
import os
import time

import pytest

from rlhf_sg.config import Config
from rlhf_sg.trainer import checkpoint
from rlhf_sg.trainer.run_log import RunLog

TESTS = os.path.dirname(os.path.abspath(__file__))
RECIPES = os.path.join(os.path.dirname(TESTS), "recipes")


class _FileGroup:
    """What :func:`checkpoint.save_checkpoint` asks of a model group, with files of a known content: ``call``
    writes ``<path>/<tag>/state.pt``."""

    def __init__(self, payload: bytes):
        self.payload = payload

    def call(self, method, path, tag, *args, what=None):
        assert method in ("save_checkpoint", "load_checkpoint"), method
        if method == "save_checkpoint":
            os.makedirs(os.path.join(path, tag), exist_ok=True)
            with open(os.path.join(path, tag, "state.pt"), "wb") as f:
                f.write(self.payload)


def test_resume_takes_the_newest_checkpoint_whose_files_are_whole(tmp_path, caplog):
    root = str(tmp_path / "checkpoints")
    group = {"actor": _FileGroup(b"x" * 100)}
    checkpoint.save_checkpoint(root, 2, group, {"data": 1})
    checkpoint.save_checkpoint(root, 4, group, {"data": 2})
    assert checkpoint.load_checkpoint(root, group)["step"] == 4
    with open(os.path.join(root, "actor", "step4", "state.pt"), "wb") as f:
        f.write(b"x" * 10)  # cut short (a disk that filled up, a copy that stopped)
    state = checkpoint.load_checkpoint(root, group)
    assert state["step"] == 2 and state["data"] == 1
    assert "step4 is incomplete" in caplog.text and "state.pt has 10 bytes" in caplog.text
    os.remove(os.path.join(root, "actor", "step2", "state.pt"))
    with pytest.raises(checkpoint.CheckpointError, match=r"no complete checkpoint .*step2/state.pt is missing"):
        checkpoint.load_checkpoint(root, group)


def test_a_failed_save_keeps_latest_on_the_last_complete_checkpoint(tmp_path):
    root = str(tmp_path / "checkpoints")
    checkpoint.save_checkpoint(root, 2, {"actor": _FileGroup(b"ok")}, {})
    os.makedirs(os.path.join(root, "step4.trainer.json"))  # the trainer state cannot be written there
    with pytest.raises(checkpoint.CheckpointError, match=r"checkpoint step4 could not be written under .*"
                                                         r"last complete checkpoint, step2, is intact"):
        checkpoint.save_checkpoint(root, 4, {"actor": _FileGroup(b"ok")}, {})
    with open(os.path.join(root, "latest")) as f:
        assert f.read() == "step2"
    assert [f for f in os.listdir(root) if ".tmp-" in f] == []


def test_unwritable_or_full_output_directory_is_refused_before_start(tmp_path, monkeypatch):
    from rlhf_sg.tiny import save_tiny_model

    model = save_tiny_model(str(tmp_path / "m"), arch="qwen2", size="tiny")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(checkpoint.CheckpointError, match=r"--log.output_dir '.*a_file/run' is not writable"):
        checkpoint.check_output_dir(str(blocker / "run"), [model])
    need = checkpoint.checkpoint_bytes(model)
    n_params = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(model)
                   .parameters())
    assert need > 12 * n_params  # the saved weights plus fp32 master weights and two Adam moments
    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=need - 1))
    with pytest.raises(checkpoint.CheckpointError, match=r"GB free, but one checkpoint .* takes about"):
        checkpoint.check_output_dir(str(tmp_path / "run"), [model])


def test_resume_drops_the_metrics_of_steps_that_will_run_again(tmp_path):
    cfg = Config()
    cfg.log.output_dir = str(tmp_path)
    lines = [json.dumps({"step": s, "reward/mean": s / 10}) + "\n" for s in (1, 2, 3, 4)] + ['{"step": 5, "rew']
    (tmp_path / "metrics.jsonl").write_text("".join(lines))
    assert RunLog(cfg).resume_at(2) == 3
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [1, 2]


# ---- a real run, killed ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_task(tmp_path_factory):
    from rlhf_sg.bench.faults import prepare

    return prepare(str(tmp_path_factory.mktemp("faults_task")))


def _alive(pids):
    from rlhf_sg.bench.faults import running

    return running(pids)


@pytest.mark.slow
def test_a_run_killed_mid_checkpoint_resumes_with_nothing_lost_or_repeated(tmp_path, small_task):
    """SIGKILL while the step-4 checkpoint is half written (the actor's files there, the trainer's state not; the
    last whole checkpoint: step 2, so steps 3 and 4 are lost as they are in a run killed mid-step); the rerun with
    --log.resume goes on from step 2, the half-written checkpoint never loaded. Steps 1-6 train on exactly the
    prompts an uninterrupted run draws (none skipped or seen twice), each step is in metrics.jsonl once, and the
    killed run leaves no process. The runs are ``python -m rlhf_sg.bench faults --child`` (the faults bench runs
    the same, and a kill mid-step as well)."""
    from rlhf_sg.bench.faults import expected_prompts, make_config, run_child

    model, prompts = small_task
    spec = {"out": str(tmp_path), "model": model, "prompts": prompts, "steps": 6}
    root = tmp_path / "run" / "checkpoints"
    killed = run_child({**spec, "kill": "checkpoint", "resume": False})
    assert killed.returncode == -9, killed.stderr[-3000:]
    pids = json.loads((tmp_path / "pids.json").read_text())
    assert pids  # the run had started Ray and its workers
    deadline = time.monotonic() + 10
    while _alive(pids) and time.monotonic() < deadline:  # the raylet, workers and engines go with the driver
        time.sleep(0.2)
    assert (root / "latest").read_text() == "step2"
    lingering = _alive(pids)  # ... Ray's node agents may linger: the next run in the directory stops them
    assert (root / "actor" / "step4").is_dir() and not (root / "step4.trainer.json").exists()

    resumed = run_child({**spec, "kill": None, "resume": True})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _alive(pids) == [], f"processes of the killed run still running (lingering after 10 s: {lingering})"
    seen = [json.loads(line) for line in open(tmp_path / "prompts_seen.jsonl")]
    by_step = {}
    for record in seen:  # the last attempt at a step is the one that counts
        by_step[record["step"]] = record["prompts"]
    assert [r["step"] for r in seen] == [1, 2, 3, 4] + [3, 4, 5, 6]
    cfg = make_config(model, prompts, str(tmp_path / "run"), 6)
    assert [by_step[s] for s in range(1, 7)] == expected_prompts(cfg, 6)
    metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert (root / "latest").read_text() == "step6"


# ---- NaN / Inf in the loss or gradients --------------------------------------------------------------------------


def _nonfinite_then_finite(model_path: str) -> dict:
    """A real ZeRO-3 actor rank: an update whose advantages hold a NaN, then one whose advantages are finite."""
    import torch
    import torch.distributed as dist
    from zero3_rank import PLAIN_UPDATE, actor_rank, one_step

    worker, batch, plan = actor_rank(model_path)
    try:
        batch.old_logp = before = worker.forward(batch, plan)[1]
        finite = batch.advantages.clone()
        batch.advantages[0, 0] = float("nan")
        nan_metrics = worker.train_actor(batch, one_step(plan, batch), PLAIN_UPDATE)
        after_nan = worker.forward(batch, plan)[1]
        batch.advantages = finite
        ok_metrics = worker.train_actor(batch, one_step(plan, batch), PLAIN_UPDATE)
        after_ok = worker.forward(batch, plan)[1]
        return {"nan": nan_metrics, "ok": ok_metrics, "before": before, "after_nan": after_nan,
                "after_ok": after_ok, "finite": bool(torch.isfinite(after_ok).all())}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_an_update_with_a_nan_is_skipped_and_counted_and_the_next_one_trains(tmp_path):
    """A NaN advantage makes the loss and every gradient NaN: ZeRO-3 drops that update (the weights are bit for
    bit those before it) and the worker reports it; the next, finite update trains normally."""
    import torch
    from zero3_rank import in_fresh_process

    from rlhf_sg.tiny import save_tiny_model

    path = save_tiny_model(str(tmp_path / "m"), arch="qwen2", size="tiny")
    out = in_fresh_process(_nonfinite_then_finite, path)
    assert out["nan"]["actor/skipped_updates"] == 1.0 and out["nan"]["actor/updates"] == 1.0
    assert torch.equal(out["after_nan"], out["before"])
    assert out["ok"]["actor/skipped_updates"] == 0.0
    assert out["finite"] and (out["after_ok"] - out["before"]).abs().max() > 1e-4


def test_the_run_stops_after_max_nonfinite_steps_in_a_row_naming_the_last_checkpoint(tmp_path):
    from rlhf_sg.tiny import save_tiny_model
    from rlhf_sg.trainer import PPOTrainer
    from rlhf_sg.trainer.checkpoint import CheckpointError, write_atomic

    cfg = Config()
    cfg.model.pretrain = save_tiny_model(str(tmp_path / "m"))
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1="}\n')
    cfg.data.prompt_data = str(tmp_path / "prompts.jsonl")
    cfg.reward.function = "arith_task:addition_reward"
    cfg.log.output_dir = str(tmp_path / "run")
    cfg.train.max_nonfinite_steps = 2
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    write_atomic(str(root / "latest"), "step4")
    trainer = PPOTrainer(cfg)
    all_skipped = {"actor/updates": 2.0, "actor/skipped_updates": 2.0, "critic/updates": 2.0,
                   "critic/skipped_updates": 2.0}
    trainer._check_finite(all_skipped)
    trainer._check_finite(dict(all_skipped, **{"critic/skipped_updates": 1.0}))  # one update went through
    trainer._check_finite({"actor/updates": 1.0, "actor/skipped_updates": 0.0})
    assert trainer.nonfinite_steps == 0
    trainer._check_finite(all_skipped)
    with pytest.raises(CheckpointError, match=r"2 steps in a row had every optimizer update skipped .*"
                                              r"Last checkpoint: .*checkpoints/step4"):
        trainer._check_finite(all_skipped)


# ---- a rank that never answers ---------------------------------------------------------------------------------


class _StandInRank:
    """A rank as the driver sees it (a Ray actor answering calls): one that answers, raises, dies, fails its
    start-up, or is stuck in an earlier call (as a rank blocked in a collective whose peer died)."""

    def __init__(self, fail_start: bool = False):
        if fail_start:
            raise OSError("rank 0 could not listen on its port")

    def ping(self):
        return "ok"

    def fail(self):
        raise ValueError("a bad micro-batch")

    def block(self, seconds):
        time.sleep(seconds)  # the stuck call itself; no test waits for it (the actor is killed)

    def die(self):
        os._exit(1)


@pytest.mark.slow
def test_a_stuck_rank_is_named_with_its_group_and_phase_after_the_timeout(ray_cluster):
    """Two Ray actors answer a call; one of them is stuck in an earlier call (as a rank blocked in a collective
    whose peer died). Waiting for both ends after the timeout with a message naming the stuck rank, its group
    and the phase, instead of hanging; a rank whose process died is named too."""
    ray = pytest.importorskip("ray")
    from rlhf_sg.workers import wait_ranks

    Rank = ray.remote(num_cpus=0)(_StandInRank)
    ranks = [Rank.remote(), Rank.remote()]
    try:
        assert wait_ranks([("actor", i, r.ping.remote()) for i, r in enumerate(ranks)], "warm-up", 60) == ["ok"] * 2
        ranks[1].block.remote(30)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"step 3 updates: no answer within 2 s \(--train.timeout_s\) from "
                                               r"actor rank 1;"):
            wait_ranks([("actor", i, r.ping.remote()) for i, r in enumerate(ranks)], "step 3 updates", 2)
        assert time.monotonic() - t0 < 10
        # the process dies inside the call (ray.kill is asynchronous: a call made right after it may still run)
        with pytest.raises(RuntimeError, match="weight sync: critic rank 0 died"):
            wait_ranks([("critic", 0, ranks[0].die.remote())], "weight sync", 30)
    finally:
        for rank in ranks:
            ray.kill(rank)  # rank 1 is still blocked


@pytest.mark.slow
def test_a_rank_that_fails_is_named_at_once_while_the_others_still_wait(ray_cluster):
    """A rank whose call fails (its start-up raised, or its process died) is named as soon as it fails: the other
    ranks are typically waiting for it (a rendezvous, a collective) and would answer only at their own timeout."""
    ray = pytest.importorskip("ray")
    from rlhf_sg.workers import wait_ranks

    Rank = ray.remote(num_cpus=0)(_StandInRank)
    waiting = Rank.remote()
    try:
        for calls, error, match in (
            ([("actor", 0, Rank.remote(fail_start=True).ping.remote()), ("actor", 1, waiting.block.remote(60))],
             RuntimeError,
             r"(?s)start-up: actor rank 0 died: .*rank 0 could not listen on its port"),
            ([("critic", 0, waiting.block.remote(60)), ("critic", 1, Rank.remote().fail.remote())], ValueError,
             "a bad micro-batch"),
        ):
            t0 = time.monotonic()
            with pytest.raises(error, match=match) as raised:
                wait_ranks(calls, "start-up", 120)
            assert time.monotonic() - t0 < 30  # not the 60 s the waiting rank takes, nor the 120 s timeout
            if error is ValueError:
                assert "start-up: raised by critic rank 1" in "".join(getattr(raised.value, "__notes__", []))
    finally:
        ray.kill(waiting)


# ---- an engine that dies while generating -------------------------------------------------------------------------


def _engine_run_cfg(small_task, out, **rollout):
    from rlhf_sg.bench.faults import make_config

    cfg = make_config(*small_task, str(out), 3, rollout__backend="slow_backend:SlowBackend",  # 2 s a generate
                      rollout__num_engines=2)
    for k, v in rollout.items():
        setattr(cfg.rollout, k, v)
    return cfg


def _killing_engine(index: int, at_steps: set[int]):
    """A trainer that SIGKILLs engine ``index``'s process 0.7 s into the generation of each step in ``at_steps``."""
    import signal
    import threading

    import ray

    from rlhf_sg.trainer import PPOTrainer

    class Killing(PPOTrainer):
        killed_pids: list = []

        def on_step_start(self, step):
            if step in at_steps:
                pid = ray.get(self.engines[index].resources.remote(), timeout=60)["pid"]
                self.killed_pids.append(pid)
                threading.Timer(0.7, os.kill, (pid, signal.SIGKILL)).start()

    return Killing


@pytest.mark.slow
def test_an_engine_killed_mid_generation_is_restarted_synced_and_its_prompts_generated_again(ray_cluster,
                                                                                            small_task, tmp_path):
    from rlhf_sg.trainer import train

    trainer_cls = _killing_engine(1, {1})
    history = train(_engine_run_cfg(small_task, tmp_path / "run"), trainer_cls=trainer_cls)
    assert [h["rollout/engine_restarts"] for h in history] == [0, 1, 0]
    assert all(h["rollout/samples"] == 8 for h in history)  # no prompt lost: the dead engine's were generated again
    assert [h["weight_version"] for h in history] == [1, 2, 3]  # every sample came from the trainer's weights
    assert len(trainer_cls.killed_pids) == 1


@pytest.mark.slow
def test_an_engine_that_keeps_dying_stops_the_run_with_a_checkpoint_naming_it(ray_cluster, small_task, tmp_path):
    from rlhf_sg.trainer import train
    from rlhf_sg.trainer.rollout import EngineFailure

    with pytest.raises(EngineFailure, match=r"engine 1 died 1 time\(s\) in a row while generating, more than "
                                            r"--rollout.max_engine_restarts 0 allows; last: engine 1: generate: "
                                            r"the engine actor died"):
        train(_engine_run_cfg(small_task, tmp_path / "run", max_engine_restarts=0),
              trainer_cls=_killing_engine(1, {1}))
    root = tmp_path / "run" / "checkpoints"
    assert (root / "latest").read_text() == "step1"  # the last finished step, ...
    state = json.loads((root / "step1.trainer.json").read_text())
    assert state["data"]["position"] == 4  # ... with the prompt stream where step 2 drew from: none skipped


# ---- the reward function and the remote scorer ---------------------------------------------------------------------

PROMPTS = ["1+1=", "2+2=", "3+3=", "4+4="]
COMPLETIONS = ["2", "4", "x", "8"]


def _raises_on_x(prompts, completions, labels):
    return [1.0 / (c != "x") for c in completions]  # ZeroDivisionError on "x"


def _none_for_x(prompts, completions, labels):
    return [None if c == "x" else 1.0 for c in completions]


def _drops_the_last(prompts, completions, labels):
    return [0.5] * max(1, len(completions) - 1) if len(completions) > 1 else [0.5]


@pytest.mark.parametrize("fn, what", [(_raises_on_x, r"raised ZeroDivisionError: float division by zero"),
                                      (_none_for_x, r"score None is not a number")])
def test_a_reward_function_failing_on_one_sample_is_named_or_scores_zero(fn, what):
    from rlhf_sg.rewards import RewardError, score_with_function

    with pytest.raises(RewardError, match=rf"reward function my_task:score: sample 2 \(prompt '3\+3=', completion "
                                          rf"'x'\): {what}; .*--reward.on_error zero"):
        score_with_function(fn, "my_task:score", PROMPTS, COMPLETIONS, [None] * 4)
    scores, errors = score_with_function(fn, "my_task:score", PROMPTS, COMPLETIONS, [None] * 4, on_error="zero")
    assert scores == [1.0, 1.0, 0.0, 1.0] and errors == 1


def test_a_reward_function_returning_the_wrong_number_of_scores_is_named_or_scored_one_by_one():
    from rlhf_sg.rewards import RewardError, score_with_function

    with pytest.raises(RewardError, match=r"a batch of 4 completions: returned 3 scores for 4 completions"):
        score_with_function(_drops_the_last, "f", PROMPTS, COMPLETIONS, [None] * 4)
    assert score_with_function(_drops_the_last, "f", PROMPTS, COMPLETIONS, [None] * 4, on_error="zero") == (
        [0.5] * 4, 0)


def test_a_reward_function_that_hangs_is_stopped_waiting_for_after_its_timeout():
    from rlhf_sg.rewards import RewardError, score_with_function

    def hangs(prompts, completions, labels):
        time.sleep(30)

    t0 = time.monotonic()
    with pytest.raises(RewardError, match=r"reward function slow:f: a batch of 4 completions: no answer within "
                                          r"0.5 s \(--reward.timeout_s\)"):
        score_with_function(hangs, "slow:f", PROMPTS, COMPLETIONS, [None] * 4, timeout_s=0.5)
    assert time.monotonic() - t0 < 5
    assert score_with_function(hangs, "slow:f", PROMPTS, COMPLETIONS, [None] * 4, on_error="zero",
                               timeout_s=0.5) == ([0.0] * 4, 4)


@pytest.fixture
def flaky_scorer():
    """A local scorer that answers 503 to its first ``failures`` requests (or always ``status``), counting them."""
    import http.server
    import threading

    state = {"failures": 0, "status": 503, "calls": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            state["calls"] += 1
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if state["calls"] <= state["failures"]:
                self.send_response(state["status"])
                self.end_headers()
                return
            out = json.dumps({"rewards": [1.0] * len(body["completions"])}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/score", state
    server.shutdown()


def test_a_remote_scorer_that_fails_is_asked_again_with_backoff_then_named(flaky_scorer):
    from rlhf_sg.rewards import RewardError, remote_reward

    url, state = flaky_scorer
    state["failures"] = 2
    assert remote_reward(url, PROMPTS, COMPLETIONS, [None] * 4, 5, retries=3, backoff_s=0.01) == [1.0] * 4
    assert state["calls"] == 3
    state.update(calls=0, failures=10)
    with pytest.raises(RewardError, match=r"answered 503 .*3 attempts"):
        remote_reward(url, PROMPTS, COMPLETIONS, [None] * 4, 5, retries=2, backoff_s=0.01)
    assert state["calls"] == 3
    state.update(calls=0, failures=10, status=400)  # a client error: asking again would not help
    with pytest.raises(RewardError, match=r"answered 400"):
        remote_reward(url, PROMPTS, COMPLETIONS, [None] * 4, 5, retries=3, backoff_s=0.01)
    assert state["calls"] == 1


def test_a_remote_scorer_that_is_down_is_named_after_the_retries():
    import socket

    from rlhf_sg.rewards import RewardError, remote_reward

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(RewardError, match=rf"remote reward http://127.0.0.1:{port}/score: request failed .*3 attempts; "
                                          r"is the server up"):
        remote_reward(f"http://127.0.0.1:{port}/score", PROMPTS, COMPLETIONS, [None] * 4, 5, retries=2,
                      backoff_s=0.01)


def test_processes_of_a_run_are_stopped_only_once_the_process_that_started_them_is_gone(tmp_path):
    """A driver process starts a worker and records it (as a run does after starting Ray). While the driver
    runs, the record stops nothing (a second run in the same directory); once the driver is killed, the next
    start stops the orphaned worker."""
    import subprocess as sp
    import sys

    import psutil

    from rlhf_sg.trainer.cluster import stop_recorded_processes

    record = str(tmp_path / ".processes.json")
    driver = sp.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "from rlhf_sg.trainer.cluster import record_processes\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"record_processes({record!r})\n"
        "print('recorded', flush=True)\n"
        "time.sleep(120)\n")], stdout=sp.PIPE, text=True)
    try:
        assert driver.stdout.readline().strip() == "recorded"
        worker = json.loads(open(record).read())["processes"][0]["pid"]
        assert stop_recorded_processes(record) == 0 and psutil.pid_exists(worker)
        driver.kill()
        driver.wait(timeout=10)
        assert stop_recorded_processes(record) == 1
        deadline = time.monotonic() + 10
        while _alive([worker]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _alive([worker]) == []
    finally:
        driver.kill()


def test_a_record_made_by_this_very_process_stops_nothing(tmp_path):
    """A second run in the same directory from the same Python session (a notebook, a test session) finds the
    first run's record naming itself as the driver: those processes are its own Ray's, in use."""
    import subprocess as sp
    import sys

    import psutil

    from rlhf_sg.trainer.cluster import stop_recorded_processes

    child = sp.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        me, proc = psutil.Process(), psutil.Process(child.pid)
        record = tmp_path / ".processes.json"
        record.write_text(json.dumps({"driver": {"pid": me.pid, "started": me.create_time()},
                                      "processes": [{"pid": child.pid, "started": proc.create_time()}]}))
        assert stop_recorded_processes(str(record)) == 0
        assert child.poll() is None
    finally:
        child.kill()


def _one_update_weights(model_path: str, zero_stage: int) -> dict:
    """One real actor rank (world size 1) at ``zero_stage``: a NaN update, then a finite one; the whole weights
    after it, the metrics of both, and the engine's ZeRO stage."""
    import deepspeed
    import torch.distributed as dist
    from zero3_rank import PLAIN_UPDATE, actor_rank, one_step

    worker, batch, plan = actor_rank(model_path, zero_stage=zero_stage)
    try:
        batch.old_logp = worker.forward(batch, plan)[1]
        finite = batch.advantages.clone()
        batch.advantages[0, 0] = float("nan")
        nan_metrics = worker.train_actor(batch, one_step(plan, batch), PLAIN_UPDATE)
        batch.advantages = finite
        ok_metrics = worker.train_actor(batch, one_step(plan, batch), PLAIN_UPDATE)
        from deepspeed.utils import safe_get_full_optimizer_state

        weights, exp_avg = {}, {}
        optimizer = worker.engine.optimizer
        for name, p in worker.module.named_parameters():
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                weights[name] = p.data.detach().clone()
            # Adam's first moment after one step: 0.1 x the clipped gradient
            moment = optimizer.state[p]["exp_avg"] if zero_stage == 0 else safe_get_full_optimizer_state(p, "exp_avg")
            exp_avg[name] = moment.detach().clone().reshape(weights[name].shape)
        partitioned = any(hasattr(p, "ds_id") for p in worker.module.parameters())
        return {"weights": weights, "exp_avg": exp_avg, "nan": nan_metrics, "ok": ok_metrics,
                "partitioned": partitioned,
                "stage": worker.engine.zero_optimization_stage()}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_single_rank_group_without_zero3_skips_the_same_update_and_lands_on_the_same_weights(tmp_path):
    """A one-rank actor unpartitioned (stage 0, float32: the optimizer clips and skips itself) against the same rank
    under ZeRO-3: a NaN update is skipped and counted on both; the next update has the same gradient norm, the same
    clipped gradients (Adam's first moment) to float rounding, and the same weights to float rounding wherever the
    gradient is well above Adam's eps (where it is not, Adam's first step ``g / (|g| + eps)`` turns rounding of g
    into differences up to lr: an element with |g| ~ 1e-8 moves by about lr x 1/2 either way)."""
    import torch
    from zero3_rank import in_fresh_process

    from rlhf_sg.tiny import build_tiny_model, save_tiny_model

    path = save_tiny_model(str(tmp_path / "m"), arch="qwen2", size="tiny")
    zero3 = in_fresh_process(_one_update_weights, path, 3)
    plain = in_fresh_process(_one_update_weights, path, 0)
    assert (zero3["stage"], zero3["partitioned"]) == (3, True)
    assert (plain["stage"], plain["partitioned"]) == (0, False)
    for out in (zero3, plain):
        assert out["nan"]["actor/skipped_updates"] == 1.0 and out["ok"]["actor/skipped_updates"] == 0.0
    assert plain["ok"]["actor/grad_norm"] == pytest.approx(zero3["ok"]["actor/grad_norm"], rel=1e-6)
    assert plain["ok"]["actor/entropy"] == pytest.approx(zero3["ok"]["actor/entropy"], rel=1e-6)
    before = dict(build_tiny_model("qwen2").named_parameters())
    assert plain["weights"].keys() == zero3["weights"].keys() == before.keys()
    compared = 0
    for name, w in zero3["weights"].items():
        m3, m0 = zero3["exp_avg"][name], plain["exp_avg"][name]
        scale = m3.abs().max().item()
        torch.testing.assert_close(m0, m3, rtol=1e-4, atol=1e-5 * scale + 1e-12, msg=name)
        clear = m3.abs() > 1e-5  # |g| > 1e-4, four orders above eps
        torch.testing.assert_close(plain["weights"][name][clear], w[clear], rtol=1e-5, atol=1e-6, msg=name)
        assert ((w - before[name].detach()).abs()[clear] > 1e-3).all(), name  # those moved (lr 1e-2)
        compared += int(clear.sum())
    assert compared > 10_000
