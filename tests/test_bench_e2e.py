"""The e2e bench's own logic, on hand-written inputs: which TRL settings it tries, how it reads a pinned one, which
it keeps, how it times our steps (wall clock around ``train_step``, so an async step is charged the time it holds
the loop), and the ratio and reward lines it prints."""

from __future__ import annotations

import argparse
import time

import pytest

from rlhf_sg.bench import e2e
from rlhf_sg.bench.e2e import (
    SideResult,
    TrlSetting,
    apply_placement,
    eval_overhead_line,
    fastest_setting,
    parse_trl_setting,
    ratio_line,
    reward_lines,
    search_lines,
    table_phases,
    trl_settings,
)


def test_trl_settings_cover_every_micro_batch_that_divides_the_step_with_and_without_checkpointing():
    got = [(s.micro_batch, s.accumulation, s.checkpointing) for s in trl_settings(64)]
    assert got == [(8, 8, False), (16, 4, False), (32, 2, False), (64, 1, False),
                   (8, 8, True), (16, 4, True), (32, 2, True), (64, 1, True)]
    # 48 samples: 32 does not divide it and 64 is more than the step holds
    assert [(s.micro_batch, s.accumulation) for s in trl_settings(48)] == [(8, 6), (16, 3), (8, 6), (16, 3)]
    # no listed size divides 12: the whole batch as one micro-batch
    assert [(s.micro_batch, s.accumulation, s.checkpointing) for s in trl_settings(12)] == [(12, 1, False),
                                                                                           (12, 1, True)]
    assert all(s.samples == 48 for s in trl_settings(48))


def test_a_pinned_setting_reads_back_from_its_flag_and_must_make_up_the_step():
    assert parse_trl_setting("8,8,off", 64) == TrlSetting(8, 8, False)
    assert parse_trl_setting(" 16, 4, ON", 64) == TrlSetting(16, 4, True)
    assert parse_trl_setting("16,4,off,compile", 64) == TrlSetting(16, 4, False, compile=True)
    for setting in trl_settings(64) + [TrlSetting(16, 4, False, compile=True)]:
        assert parse_trl_setting(setting.flag, 64) == setting
    assert TrlSetting(16, 4, False, compile=True).knobs == [16, 4, False, True]
    assert "torch_compile on" in TrlSetting(16, 4, False, compile=True).describe()
    with pytest.raises(ValueError, match=r"--trl-setting '8,4,off'.*8 x 4.*64"):
        parse_trl_setting("8,4,off", 64)
    for bad in ("8,8", "8,8,maybe", "a,8,off", "0,64,off", "8,8,off,fast", "8,8,off,compile,x"):
        with pytest.raises(ValueError, match="--trl-setting"):
            parse_trl_setting(bad, 64)


@pytest.mark.parametrize("compiled_s, kept", [(9.5, "16,4,off,compile"), (14.0, "16,4,off"), (None, "16,4,off")])
def test_the_search_tries_its_fastest_setting_again_with_torch_compile(monkeypatch, capsys, compiled_s, kept):
    """After the grid (one process), the fastest setting once more with the Trainer's ``torch_compile``, in a process
    of its own; the faster of all is kept (a compiled run that failed is not)."""
    seconds = {(16, 4, False, False): 10.0, (16, 4, False, True): compiled_s}
    calls = []

    def run_trl(args, model_path, prompt_file, out, settings, steps):  # the TRL processes: timed steps per setting
        calls.append([s.flag for s in settings])
        results = []
        for setting in settings:
            step_s = seconds.get(tuple(setting.knobs), 12.0)
            result = None
            if step_s is not None:
                result = e2e.SideResult("trl-grpo", 64)
                result.add_step(step_s, {}, 64.0)
            results.append((setting, result))
        return results

    monkeypatch.setattr(e2e, "run_trl", run_trl)
    args = argparse.Namespace(prompts=8, samples=8, warmup=1, trl_probe_steps=1)
    assert e2e.search_trl(args, "m", "p", "o").flag == kept
    assert calls[0] == [s.flag for s in trl_settings(64)] and calls[1] == ["16,4,off,compile"]
    assert f"trl {kept:<10}" in capsys.readouterr().out.split("<- kept")[0].splitlines()[-1]


def test_the_search_keeps_the_fastest_setting_that_finished_and_the_first_of_a_tie():
    a, b, c, d = TrlSetting(64, 1, False), TrlSetting(8, 8, True), TrlSetting(8, 8, False), TrlSetting(16, 4, False)
    assert fastest_setting([(a, 12.9), (b, None), (c, 11.1), (d, 11.1)]) == c
    assert fastest_setting([(b, None), (a, 12.9)]) == a
    with pytest.raises(RuntimeError, match="--trl-setting"):
        fastest_setting([(a, None), (b, None)])
    lines = search_lines([(a, 12.9), (b, None), (c, 11.1)], kept=c)
    assert [line.endswith("<- kept") for line in lines] == [False, False, True]
    assert "failed" in lines[1] and "12.90 s/step" in lines[0]


def _side(name: str, step_s: list[float], samples: int = 64) -> SideResult:
    side = SideResult(name, samples)
    for seconds in step_s:
        side.add_step(seconds, {"train": seconds / 2}, 64.0, 0.5)
    return side


def test_the_ratio_is_samples_per_second_of_the_numerator_over_the_denominator():
    ours, trl = _side("ours-grpo", [2.0, 4.0]), _side("trl-grpo", [6.0])  # 64 / 3 s against 64 / 6 s
    assert ours.samples_per_s == pytest.approx(64 / 3)
    assert ratio_line(ours, trl, "note") == "ratio ours-grpo / trl-grpo samples/s: 2.00 median, 2.00 mean (note)"
    assert ratio_line(trl, ours, "x") == "ratio trl-grpo / ours-grpo samples/s: 0.50 median, 0.50 mean (x)"


def test_the_ratio_puts_median_over_median_and_mean_over_mean():
    # ours: steps 1, 1, 7 (median 1, mean 3); TRL: 2, 2, 8 (median 2, mean 4). A slow step (other work on the
    # machine) moves the mean, not the median; median over mean would give 4.00, mean over median 1.50
    ours, trl = _side("ours-grpo", [1.0, 1.0, 7.0]), _side("trl-grpo", [2.0, 2.0, 8.0])
    assert ours.median_samples_per_s == pytest.approx(64 / 1) and ours.samples_per_s == pytest.approx(64 / 3)
    assert ratio_line(ours, trl, "n") == "ratio ours-grpo / trl-grpo samples/s: 2.00 median, 1.33 mean (n)"


def test_trls_step_is_accounted_from_what_it_generated_and_trained():
    """Two completions of 4 and 2 tokens after prompts of 3 tokens: training is 3 x the forward of those two
    sequences, unshared (TRL computes each prompt with its completion), generation reads weights for the 4 decode
    steps of the longest and the KV before each decoded token."""
    from rlhf_sg import flops
    from rlhf_sg.memory import ModelShape, kv_bytes_per_token, weight_bytes

    shape = ModelShape(num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16,
                       vocab_size=10, dtype="float32")
    ceiling = flops.Ceiling(tflops=1e-9, gbs=1e-3, source="hand")
    step = {"phases": {"generate": 2.0, "train": 4.0}, "prompt_lens": [3, 3], "completion_lens": [4, 2]}
    perf = e2e.trl_perf(shape, ceiling, step)
    train = 3 * flops.forward_flops(shape, [flops.Segment(3, (4,)), flops.Segment(3, (2,))])
    assert perf["perf/train_TFLOP"] == pytest.approx(train / 1e12)
    assert perf["perf/train_of_peak"] == pytest.approx(train / 4.0 / 1e12 / 1e-9)
    read = 4 * weight_bytes(shape) + kv_bytes_per_token(shape) * ((3 + 4 + 5 + 6) + (3 + 4))
    assert perf["perf/generate_bytes_per_token"] == pytest.approx(read / 6)
    assert perf["perf/generate_tokens_per_s"] == pytest.approx(3.0)
    decode = flops.decode_flops(shape, [3, 3], [4, 2])  # its roofline as ours: the larger bound over 2 s
    assert perf["perf/generate_of_roofline"] == pytest.approx(max(read / 1e-3 / 1e9, decode / 1e-9 / 1e12) / 2.0)
    assert e2e.trl_perf(shape, ceiling, {"phases": {}}) == {}


def test_the_accounting_table_shows_each_sides_phases_and_ceilings():
    ours, trl = _side("ours-grpo", [1.0]), _side("trl-grpo", [2.0])
    ours.perf[0].update({"perf/train_of_peak": 0.25, "perf/weight_sync_GBps": 1.5})
    trl.perf[0].update({"perf/train_of_peak": 0.125})
    ours.ceiling, trl.ceiling = "1 TFLOP/s per rank", "2 TFLOP/s"
    lines = e2e.perf_lines([ours, trl])
    header = lines[1].split()
    assert header[:2] == ["side", "train"] and "sync" in header  # only the columns some side has
    assert lines[2].split()[1:] == ["25.0%", "1.500"] and lines[3].split()[1:] == ["12.5%", "-"]
    assert lines[4:] == ["  ceiling of ours-grpo: 1 TFLOP/s per rank", "  ceiling of trl-grpo: 2 TFLOP/s"]
    assert e2e.perf_lines([_side("x", [1.0])]) == []


def test_rounds_pool_their_steps_and_rewards_are_averaged_step_by_step():
    merged = SideResult("ours-grpo", 64)
    first, second = _side("ours-grpo", [1.0, 3.0]), _side("ours-grpo", [5.0])
    first.trajectories.append([0.1, 0.2, 0.3])
    second.trajectories.append([0.3, 0.4])
    merged.merge(first)
    merged.merge(second)
    assert merged.step_s == [1.0, 3.0, 5.0] and merged.phase_s["train"] == [0.5, 1.5, 2.5]
    assert merged.mean_step_s == pytest.approx(3.0)
    assert merged.mean_trajectory() == pytest.approx([0.2, 0.3])  # as far as both rounds went
    header, row = reward_lines([merged])
    assert "k x 64 samples" in header
    assert row.split() == ["ours-grpo", "0.2000", "0.3000"]


def test_the_evaluation_overhead_is_held_to_its_share_of_generated_tokens_plus_ten_percent():
    plain, evaluated = _side("ours-grpo", [2.0, 2.0]), _side("ours-grpo-eval", [2.0, 2.6])  # +15 % per step
    evaluated.generated_tokens, evaluated.eval_tokens = 1000.0, 50.0  # 5 %: bound 15 %
    line = eval_overhead_line(evaluated, plain)
    assert "+15.0 %" in line and "tokens 5.0 %" in line and "bound 15.0 %" in line and line.endswith("within")
    evaluated.eval_tokens = 40.0  # 4 %: bound 14 %
    assert eval_overhead_line(evaluated, plain).endswith("OVER")
    evaluated.eval_tokens = 0.0
    assert "no evaluation ran" in eval_overhead_line(evaluated, plain)


def test_split_placement_gives_engine_and_actor_one_thread_each_unless_a_flag_says_otherwise():
    args = argparse.Namespace(placement="split", actor_ranks=None, worker_threads=2, engine_threads=None)
    apply_placement(args, cores=8)
    assert (args.actor_ranks, args.worker_threads, args.engine_threads) == (1, 2, 1)


def test_shared_placement_runs_one_actor_rank_on_every_core():
    shared = argparse.Namespace(placement="shared", actor_ranks=None, worker_threads=None, engine_threads=None)
    apply_placement(shared, cores=8)
    assert (shared.actor_ranks, shared.worker_threads, shared.engine_threads) == (1, 8, None)
    two_ranks = argparse.Namespace(placement="shared", actor_ranks=2, worker_threads=None, engine_threads=3)
    apply_placement(two_ranks, cores=8)
    assert (two_ranks.actor_ranks, two_ranks.worker_threads, two_ranks.engine_threads) == (2, 4, 3)


def test_phases_a_side_reports_beyond_the_standard_columns_get_a_column():
    side = _side("ours-grpo-async", [1.0])
    side.phase_s["wait_generate"] = [0.2]
    assert table_phases([side]) == [*e2e.PHASE_COLUMNS, "wait_generate"]


class _OverlappingTrainer:
    """A trainer whose steps take longer than the ``time/step`` they report, as an async step does (its generation
    overlaps the step before and is outside its own timer)."""

    STEP_S = 0.05

    def __init__(self, cfg, reward_fn=None):
        self.cfg, self.rewards = cfg, iter([0.1, 0.2, 0.3])

    def setup(self):
        pass

    def train_step(self):
        time.sleep(self.STEP_S)
        return {"time/step": 0.001, "time/train": 0.001, "time/wait_rollout": 0.0, "rollout/response_len": 64.0,
                "reward/mean": next(self.rewards), "rollout_time/generate": 0.04}

    def shutdown(self):
        pass


def test_our_steps_are_timed_by_the_wall_clock_not_by_the_trainers_own_step_timer(monkeypatch, tmp_path):
    import rlhf_sg.trainer

    monkeypatch.setattr(rlhf_sg.trainer, "PPOTrainer", _OverlappingTrainer)
    monkeypatch.setattr(e2e, "_describe_ours_threads", lambda trainer: "")
    waits = []  # the side waits for its Ray processes; here the session's other children would hold it up
    monkeypatch.setattr(e2e, "wait_for_children", lambda timeout_s: waits.append(timeout_s) or 0)
    args = argparse.Namespace(backend="hf", prompts=8, samples=8, max_new_tokens=64, actor_ranks=1, lr=1e-6,
                              critic_lr=1e-5, warmup=1, steps=2, seed=0, worker_threads=None, engine_threads=None,
                              share_prompts=True, fused_kernels=False, stop_token_ids=[], profile_dir=None)
    got = e2e.run_ours("grpo-async", args, "model", "prompts.jsonl", str(tmp_path))
    assert got.name == "ours-grpo-async"
    assert len(got.step_s) == 2 and min(got.step_s) >= _OverlappingTrainer.STEP_S
    assert got.samples_per_s <= 64 / _OverlappingTrainer.STEP_S
    assert got.reward == [0.2, 0.3] and got.trajectories == [[0.1, 0.2, 0.3]]  # the warm-up step's reward first
    assert got.phase_s["wait_rollout"] == [0.0, 0.0]
    assert got.phase_s["generate"] == [0.04, 0.04]  # the batch's own generation, beside the step before
    assert waits == [60.0]


def test_profile_dir_profiles_the_first_measured_step_into_a_directory_the_bench_keeps(monkeypatch, tmp_path):
    import rlhf_sg.trainer

    configs = []
    monkeypatch.setattr(rlhf_sg.trainer, "PPOTrainer",
                        lambda cfg, reward_fn=None: configs.append(cfg) or _OverlappingTrainer(cfg))
    monkeypatch.setattr(e2e, "_describe_ours_threads", lambda trainer: "")
    monkeypatch.setattr(e2e, "wait_for_children", lambda timeout_s: 0)
    args = argparse.Namespace(backend="hf", prompts=8, samples=8, max_new_tokens=64, actor_ranks=1, lr=1e-6,
                              critic_lr=1e-5, warmup=1, steps=2, seed=0, worker_threads=None, engine_threads=None,
                              share_prompts=True, fused_kernels=False, stop_token_ids=[],
                              profile_dir=str(tmp_path / "traces"))
    e2e.run_ours("grpo", args, "model", "prompts.jsonl", str(tmp_path / "bench-tmp"))
    # the trainer's step counter is the steps done before: 1 after the warm-up, so the first measured step
    assert configs[0].log.profile_step == 1
    assert configs[0].log.output_dir == str(tmp_path / "traces" / "ours-grpo")


@pytest.mark.parametrize("flags, message", [
    (["--rounds", "2"], "--profile-dir: one round"),
    ([], "not empty; name a new or empty directory"),
])
def test_profile_dir_is_refused_before_any_work_where_it_would_write_over_traces(tmp_path, capsys, flags, message):
    (tmp_path / "earlier.json").write_text("{}")
    with pytest.raises(SystemExit):
        e2e.main(["--sides", "grpo", "--profile-dir", str(tmp_path), *flags])
    assert message in capsys.readouterr().err
    assert (tmp_path / "earlier.json").read_text() == "{}"


def test_the_next_side_waits_for_the_processes_the_last_one_left():
    """``wait_for_children`` returns once the processes this one started have exited (0 left), and counts those
    still running at its timeout. Run in a process of its own: a pytest session has children of its own."""
    import json
    import subprocess
    import sys

    # each child lives until its stdin closes: "quick" is let go just before the wait (which must then wait for
    # it to exit), "held" only after the wait's timeout
    script = """
import json, subprocess, sys
from rlhf_sg.bench import e2e
child = [sys.executable, "-c", "import sys; sys.stdin.read()"]
quick = subprocess.Popen(child, stdin=subprocess.PIPE)
quick.stdin.close()
left = e2e.wait_for_children(60.0)
exited = quick.poll() is not None
held = subprocess.Popen(child, stdin=subprocess.PIPE)
try:
    left_at_timeout = e2e.wait_for_children(0.2)
finally:
    held.stdin.close()
    held.wait(timeout=60)
print(json.dumps([left, exited, left_at_timeout]))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    left, exited, left_at_timeout = json.loads(out.stdout.strip().splitlines()[-1])
    assert (left, exited) == (0, True)
    assert left_at_timeout == 1


def test_the_k4_side_runs_ahead_by_four_with_the_decoupled_loss_and_the_long_tail_stops_on_non_digits():
    from rlhf_sg.tiny import char_vocab

    ids = e2e.tail_stop_ids(2)
    by_id = {i: ch for ch, i in char_vocab().items()}
    assert [by_id[i] for i in ids] == ["~", "`"] and not any(by_id[i].isdigit() for i in ids)
    args = argparse.Namespace(backend="hf", prompts=4, samples=4, max_new_tokens=64, actor_ranks=1, lr=1e-6,
                              critic_lr=1e-5, warmup=1, steps=2, seed=0, worker_threads=None, engine_threads=None,
                              share_prompts=True, fused_kernels=True, stop_token_ids=ids)
    k4 = e2e.make_config("grpo", args, "m", "p", "o", mode="async", max_staleness=e2e.MAX_STALENESS["grpo-async-k4"])
    k1 = e2e.make_config("grpo", args, "m", "p", "o", mode="async", max_staleness=e2e.MAX_STALENESS["grpo-async"])
    assert (k4.rollout.max_staleness, k4.train.decoupled_loss) == (4, True)
    assert (k1.rollout.max_staleness, k1.train.decoupled_loss) == (1, False)
    assert k4.rollout.stop_token_ids == ids
    assert k4.model.fused_kernels and k1.model.fused_kernels
    with pytest.raises(ValueError, match=r"--tail-stop-ids must be in \[1, 4\], got 5"):
        e2e.tail_stop_ids(5)


def test_the_baseline_line_says_whether_the_bench_trl_side_runs_as_trl_alone():
    """Within 5 % of TRL alone (medians) the ratios are against TRL; outside, the line says they are not."""
    line = e2e.baseline_line([10.0, 10.4, 9.9], [10.0, 9.8, 10.1])
    assert "10.00 s a step (median of 3) against TRL alone 10.00 s" in line and "1.000x, within 5 %" in line
    assert "1.220x, NOT within 5 %" in e2e.baseline_line([12.2, 12.2], [10.0, 10.0])
    assert "0.940x, NOT within 5 %" in e2e.baseline_line([9.4], [10.0])
    assert "1.040x, within 5 %" in e2e.baseline_line([10.4], [10.0])


def test_trl_alone_is_a_plain_script_scoring_as_the_bench():
    """The baseline script imports nothing of this project (a user's script), and the bench's TRL side scores with
    its reward, which is the bench's own reward for ours."""
    import ast

    from rlhf_sg.bench import _trl_alone

    tree = ast.parse(open(_trl_alone.__file__).read())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"rlhf_sg", "backends", "recipes"}, imported
    assert e2e.trl_digit_reward is _trl_alone.digit_reward
    completions = ["12 ab", "", "abc", "9"]
    assert _trl_alone.digit_reward(["p"] * 4, completions) == e2e.digit_reward(["p"] * 4, completions, [None] * 4)


def test_every_side_is_held_to_the_highest_ceiling_reading_at_its_thread_count():
    """A side's process reads the ceiling once, at its start, maybe while the last side's processes still exit: the
    bench holds every side to the highest reading at its thread count (the bench's own after the sides included)
    and rescales each step's fractions to it: the FLOP fractions by TFLOP/s, bandwidth by GB/s, the roofline by
    whichever bound it takes."""
    ours = e2e.SideResult("ours-grpo", 64, rank_threads=2)
    ours.add_step(5.0, {}, 64.0, perf={"perf/train_of_peak": 0.6, "perf/generate_of_peak_bw": 0.2,
                                       "perf/generate_GBps": 4.0, "perf/generate_TFLOPs": 0.09,
                                       "perf/generate_of_roofline": 0.45}, ceiling=(0.2, 20.0))
    trl = e2e.SideResult("trl-grpo", 64, rank_threads=2)
    trl.add_step(9.0, {}, 64.0, perf={"perf/train_of_peak": 0.9}, ceiling=(0.1, 10.0))
    other_round = e2e.SideResult("trl-grpo", 64, rank_threads=2)
    other_round.add_step(9.0, {}, 64.0, perf={"perf/train_of_peak": 0.3}, ceiling=(0.3, 25.0))
    trl.merge(other_round)
    one_thread = e2e.SideResult("ours-split", 64, rank_threads=1)
    one_thread.add_step(5.0, {}, 64.0, perf={"perf/train_of_peak": 0.5}, ceiling=(0.15, 12.0))
    lines = e2e.hold_to_ceiling([ours, trl, one_thread], {2: (0.25, 30.0), 4: (9.0, 99.0)})
    assert ours.perf[0]["perf/train_of_peak"] == pytest.approx(0.6 * 0.2 / 0.3)
    assert ours.perf[0]["perf/generate_of_peak_bw"] == pytest.approx(0.2 * 20.0 / 30.0)
    # bytes bound before (4/20 > 0.09/0.2) and after (4/30 > 0.09/0.3): the roofline scales as the bandwidth
    assert ours.perf[0]["perf/generate_of_roofline"] == pytest.approx(0.45 * (4.0 / 30.0) / (4.0 / 20.0))
    assert [p["perf/train_of_peak"] for p in trl.perf] == pytest.approx([0.9 * 0.1 / 0.3, 0.3])
    assert one_thread.perf[0]["perf/train_of_peak"] == pytest.approx(0.5)  # its own thread count: its own reading
    assert len(lines) == 2 and "0.3 TFLOP/s and 30 GB/s" in lines[1]
    assert "trl-grpo 0.1/0.3" in lines[1] and "the bench after the sides 0.25" in lines[1]


def test_the_ratio_against_trl_alone_is_the_median_of_the_rounds():
    """Each round's ratio pairs our steps with the TRL-alone steps of the same round; a round where either side did
    not finish drops out."""
    ours = e2e.SideResult("ours-grpo", 64)
    for step_s in (5.0, 5.2, 6.0, 6.4, 5.5):
        ours.add_step(step_s, {}, 64.0)
    lines = e2e.alone_ratio_lines(ours, [[5.0, 5.2], [6.0, 6.4], [5.5], []],
                                  [[9.0, 10.0], [9.6, 10.0], [], [9.0]])
    # round 1: 9.5 / 5.1; round 2: 9.8 / 6.2; rounds 3 and 4 lack a side
    assert "1.72 median of 2 round(s) (1.86, 1.58)" in lines[0]
    assert "pooled medians 1.75" in lines[0]  # 9.6 / 5.5
    assert e2e.alone_ratio_lines(ours, [[5.0]], [[]]) == []
