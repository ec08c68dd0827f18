"""``bench train-profile``: a training step's trace split by kind of op, its matmuls' FLOPs counted from shapes."""

import json

import pytest
import torch
from torch.profiler import profile, record_function
from torch.utils.flop_counter import FlopCounterMode

from rlhf_sg.bench import train_profile
from rlhf_sg.tiny import build_tiny_model
from rlhf_sg.workers import UPDATE_SPAN_PREFIX

TOKENS = 24


def _update(model, optimizer, ids):
    """One training step as a rank runs it: forward, backward, optimizer step."""
    logits = model(input_ids=ids).logits
    logits.float().log_softmax(-1).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.fixture(scope="module")
def step_trace(tmp_path_factory):
    """A tiny Qwen2 model's update (sdpa attention, AdamW) profiled in the span a ModelWorker holds it in, with the
    run's metrics record beside it (RUN/profile/step3.rank0.json, RUN/metrics.jsonl); and the matmul FLOPs torch's
    own counter gives for the same step."""
    torch.manual_seed(0)
    model = build_tiny_model("qwen2").train()
    model.set_attn_implementation("sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(3, model.config.vocab_size, (1, TOKENS))
    _update(model, optimizer, ids)  # the first step allocates the optimizer's states
    counter = FlopCounterMode(display=False)
    with counter:
        _update(model, optimizer, ids)
    counts = counter.get_flop_counts()["Global"]
    matmuls = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm")
    matmul_flops = sum(v for op, v in counts.items() if str(op) in matmuls)
    run = tmp_path_factory.mktemp("run")
    (run / "profile").mkdir()
    with profile(record_shapes=True) as prof:
        with record_function(f"{UPDATE_SPAN_PREFIX}actor"):
            _update(model, optimizer, ids)
        model(input_ids=ids)  # after the span: not counted
    path = run / "profile" / "step3.rank0.json"
    prof.export_chrome_trace(str(path))
    records = [{"step": s, "time/train": 0.5 * s, "perf/train_TFLOP": 1e-6 * s} for s in (2, 3, 4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path, matmul_flops


def test_the_update_span_is_split_by_kind_and_its_matmul_flops_are_torchs_count(step_trace):
    path, matmul_flops = step_trace
    phase = train_profile.read_phase(str(path))
    assert matmul_flops > 0 and phase.matmul_flops == matmul_flops  # forward, backward, every linear and lm_head
    # each op's own time counted once, in one kind; with the time no op ran, the span's whole time
    assert sum(phase.seconds.values()) + phase.idle_s == pytest.approx(phase.span_s, rel=1e-6)
    for kind in ("matmuls", "attention", "optimizer", "other ops"):
        assert phase.seconds[kind] > 0, kind
    assert phase.seconds["communication"] == 0 and phase.seconds["fused kernels"] == 0
    assert phase.other and sum(phase.other.values()) == pytest.approx(phase.seconds["other ops"])
    # AdamW's own ops (CPU's single-tensor path), under its step: the optimizer's, none in the other ops
    assert not {"aten::addcdiv_", "aten::lerp_", "aten::addcmul_"} & set(phase.other)
    assert train_profile.step_metrics(str(path)) == {"step": 3, "time/train": 1.5, "perf/train_TFLOP": 3e-6}


def test_the_report_holds_the_phase_to_the_ceiling_and_its_matmuls_to_the_same_shapes_timed_hot(step_trace):
    path, _ = step_trace
    phase = train_profile.read_phase(str(path))
    hot = train_profile.time_hot(phase, threads=1, min_total_s=0.01)
    assert hot.shapes >= 1 and hot.flops >= 0.99 * phase.matmul_flops and hot.hot_s > 0
    assert 0 < hot.step_s <= phase.seconds["matmuls"] * (1 + 1e-9)  # the step's own seconds in those shapes
    lines = train_profile.report(phase, 0.5, hot, train_profile.step_metrics(str(path)))
    text = "\n".join(lines)
    matmul_row = next(line for line in lines if line.strip().startswith("matmuls"))
    rate = phase.matmul_flops / phase.seconds["matmuls"] / 1e12
    assert f"{rate:.3f}" in matmul_row and f"{rate / 0.5:.1%}" in matmul_row
    # the metrics' 3e-6 TFLOP in 1.5 s against a 0.5 TFLOP/s ceiling
    assert f"{3e-6 / 1.5 / 0.5:.1%} of the ceiling" in text
    assert f"{3e-6 / phase.seconds['matmuls'] / 0.5:.1%} of the ceiling" in text  # if only the matmuls took time
    assert "timed as the ceiling is" in text and "other ops, the largest:" in text
    assert "back to back" not in text  # no sustained reading given: no line
    sustained = train_profile.report(phase, 0.5, hot, None, sustained=(0.4, 2.5))
    assert any(f"back to back for 2.50 s (the span: {phase.span_s:.2f} s): 0.400 TFLOP/s, 80.0% of the ceiling" in line
               for line in sustained)


def test_the_sustained_gemm_runs_for_the_span_and_counts_every_call():
    """The ceiling's GEMM called back to back for the span's length: it runs that long, and its rate counts every
    call (a rate from one call over the whole time would be a small fraction of the ceiling's)."""
    import time

    from rlhf_sg.bench.decode_gemm import model_shape
    from rlhf_sg.flops import measure_cpu_ceiling

    shape = model_shape("qwen2", "tiny")
    start = time.perf_counter()
    rate = train_profile.sustained_gemm(shape, threads=1, seconds=0.2, tokens=64)
    assert time.perf_counter() - start >= 0.2
    best = measure_cpu_ceiling.__wrapped__(shape, "float32", 1, tokens=64, min_total_s=0.1).tflops
    assert 0.2 * best < rate < 1.5 * best


def test_main_reads_a_trace_and_prints_its_table(step_trace, capsys):
    path, _ = step_trace
    train_profile.main(["--trace", str(path), "--size", "tiny", "--threads", "1", "--min-seconds", "0.02"])
    out = capsys.readouterr().out
    assert "the accounting's ceiling for qwen2/tiny" in out
    for kind in train_profile.CLASSES:
        assert f"  {kind} " in out
    assert "if only the matmuls took time" in out
    phase = train_profile.read_phase(str(path))
    assert f"the ceiling's GEMM back to back for {phase.span_s:.2f} s (the span: {phase.span_s:.2f} s)" in out


def test_a_trace_without_the_span_or_without_shapes_is_refused_by_name(tmp_path):
    x = torch.randn(8, 8)
    bare = tmp_path / "bare.json"
    with profile(record_shapes=True) as prof:
        x @ x
    prof.export_chrome_trace(str(bare))
    with pytest.raises(ValueError, match=rf"{bare}: no rlhf_sg.update/actor span \(found: none\)"):
        train_profile.read_phase(str(bare))
    shapeless = tmp_path / "shapeless.json"
    with profile(record_shapes=False) as prof, record_function(f"{UPDATE_SPAN_PREFIX}actor"):
        x @ x
    prof.export_chrome_trace(str(shapeless))
    with pytest.raises(ValueError, match="record_shapes=True"):
        train_profile.read_phase(str(shapeless))
    with pytest.raises(ValueError, match=r"no rlhf_sg.update/critic span \(found: \['rlhf_sg.update/actor'\]\)"):
        train_profile.read_phase(str(shapeless), role="critic")
    with pytest.raises(SystemExit, match="2"):
        train_profile.main(["--trace", str(tmp_path / "missing.json")])


def test_the_ceiling_is_the_higher_of_readings_before_and_after_and_a_moving_cpu_is_named(step_trace, capsys,
                                                                                          monkeypatch):
    """The CPU's speed can move during a run: the ceiling is read before and after, the higher held to (as the e2e
    bench holds each side to its highest reading), and readings far apart are named."""
    from rlhf_sg.flops import Ceiling

    path, _ = step_trace
    for after, warned in ((0.4, True), (0.48, False)):
        readings = iter([Ceiling(0.5, 20.0, "before"), Ceiling(after, 20.0, "after")])
        measure = type("Measure", (), {"__wrapped__": staticmethod(lambda *a, it=readings, **k: next(it))})
        monkeypatch.setattr(train_profile, "measure_cpu_ceiling", measure)
        train_profile.main(["--trace", str(path), "--size", "tiny", "--threads", "1", "--min-seconds", "0.02"])
        out = capsys.readouterr().out
        assert f"0.500 TFLOP/s, the higher of its readings before (0.500) and after ({after:.3f})" in out
        matmuls = next(line for line in out.splitlines() if line.strip().startswith("matmuls"))
        phase = train_profile.read_phase(str(path))
        assert f"{phase.matmul_flops / phase.seconds['matmuls'] / 1e12 / 0.5:.1%}" in matmuls
        assert ("20% apart: this CPU's speed moved" in out) == warned
