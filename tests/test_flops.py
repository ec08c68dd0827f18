"""The per-phase accounting of :mod:`rlhf_sg.flops`: FLOP and byte counts against numbers worked by hand (the formula
beside each), against torch's own FLOP counter on a real tiny model, the device table, and the layout rules (real
tokens only; a shared prompt once per segment)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rlhf_sg import flops
from rlhf_sg.memory import ModelShape, kv_bytes_per_token, weight_bytes

#: a hand-sized shape: 2 layers, hidden 8, 2 query heads and 1 KV head of 4, MLP 16, vocabulary 10
SHAPE = ModelShape(num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16,
                   vocab_size=10, dtype="float32")


def test_segment_tokens_and_attention_pairs_by_hand():
    # prompt of 3 sees 1 + 2 + 3 = 6 keys; a response of 2 sees 4 + 5 = 9; a response of 4 sees 4 + 5 + 6 + 7 = 22
    seg = flops.Segment(3, (2, 4))
    assert seg.tokens == 3 + 2 + 4
    assert seg.context_pairs == 6 + 9 + 22
    assert flops.Segment(5, (0,)).context_pairs == 15  # 1 + 2 + 3 + 4 + 5


def test_forward_and_training_flops_by_hand():
    # per layer: q 8x8 + k, v 8x4 each + o 8x8 + MLP 3 x 8x16 = 64 + 64 + 64 + 384 = 576; two layers 1152
    assert flops.matmul_params(SHAPE) == 1152
    seg = flops.Segment(3, (2, 4))
    body = 2 * 1152 * 9  # 2 N_body T = 20736
    lm_head = 2 * 10 * 8 * 6  # 2 x vocab x hidden x 6 response tokens = 960
    attention = 4 * 2 * 8 * 37  # 4 x layers x d_q x pairs = 2368
    assert flops.forward_flops(SHAPE, [seg], "lm") == body + lm_head + attention == 24064
    assert flops.train_flops(SHAPE, [seg], "lm") == 3 * 24064
    assert flops.forward_flops(SHAPE, [seg], "value") == body + 2 * 8 * 6 + attention
    assert flops.forward_flops(SHAPE, [seg], "score") == body + 2 * 8 * 2 + attention
    with pytest.raises(ValueError, match="head must be"):
        flops.forward_flops(SHAPE, [seg], "logits")


def _layout(rows: list[tuple[list[int], list[int]]], prompt_width: int, response_width: int):
    """A rollout batch: each row's prompt ids (left-padded to prompt_width) and response ids (right-padded)."""
    B = len(rows)
    seq = torch.zeros(B, prompt_width + response_width, dtype=torch.long)
    mask = torch.zeros_like(seq)
    for b, (prompt, response) in enumerate(rows):
        seq[b, prompt_width - len(prompt):prompt_width] = torch.tensor(prompt)
        mask[b, prompt_width - len(prompt):prompt_width] = 1
        seq[b, prompt_width:prompt_width + len(response)] = torch.tensor(response)
        mask[b, prompt_width:prompt_width + len(response)] = 1
    return seq, mask


def test_padded_rows_count_only_their_real_tokens():
    # widths 6 + 5, but row 0 has 3 + 2 real tokens and row 1 has 2 + 4: padding is never counted
    seq, mask = _layout([([5, 6, 7], [1, 2]), ([8, 9], [1, 2, 3, 4])], prompt_width=6, response_width=5)
    segs = flops.microbatch_segments(seq, mask, 5, [[0, 1]], share_prompts=False, segment_tokens=64)
    assert segs == [flops.Segment(3, (2,)), flops.Segment(2, (4,))]
    assert sum(s.tokens for s in segs) == 11
    # the same rows packed without padding: what the forward computes
    assert flops.forward_flops(SHAPE, segs) == sum(flops.forward_flops(SHAPE, [s]) for s in segs)


def test_a_shared_prompt_counts_once_per_micro_batch_and_segment():
    same = [5, 6, 7]
    seq, mask = _layout([(same, [1, 2]), (same, [1, 2, 3, 4]), ([8, 9], [3])], prompt_width=4, response_width=4)
    shared = flops.microbatch_segments(seq, mask, 4, [[0, 1, 2]], share_prompts=True, segment_tokens=64)
    assert shared == [flops.Segment(3, (2, 4)), flops.Segment(2, (1,))]
    assert sum(s.tokens for s in shared) == 3 + 2 + 4 + 2 + 1
    unshared = flops.microbatch_segments(seq, mask, 4, [[0, 1, 2]], share_prompts=False, segment_tokens=64)
    assert sum(s.tokens for s in unshared) == 5 + 7 + 3  # the prompt twice
    # rows of one prompt in different micro-batches each compute it
    split = flops.microbatch_segments(seq, mask, 4, [[0], [1, 2]], share_prompts=True, segment_tokens=64)
    assert split == [flops.Segment(3, (2,)), flops.Segment(3, (4,)), flops.Segment(2, (1,))]
    # a segment budget of 7 tokens cannot hold 3 + 2 + 4: the group is cut, each part with its prompt
    cut = flops.microbatch_segments(seq, mask, 4, [[0, 1]], share_prompts=True, segment_tokens=7)
    assert cut == [flops.Segment(3, (2,)), flops.Segment(3, (4,))]
    # a vision-language batch: equal ids with other images are another prompt (the forward shares only equal images)
    from rlhf_sg.vision import ImageInputs

    image = ImageInputs(torch.zeros(4, 6), torch.tensor([[1, 2, 2]]))
    other = ImageInputs(torch.ones(4, 6), torch.tensor([[1, 2, 2]]))
    apart = flops.microbatch_segments(seq, mask, 4, [[0, 1, 2]], share_prompts=True, segment_tokens=64,
                                      images=[image, other, None])
    assert apart == [flops.Segment(3, (2,)), flops.Segment(3, (4,)), flops.Segment(2, (1,))]
    together = flops.microbatch_segments(seq, mask, 4, [[0, 1, 2]], share_prompts=True, segment_tokens=64,
                                         images=[image, ImageInputs(image.pixel_values.clone(), image.image_grid_thw),
                                                 None])
    assert together == shared


def test_the_count_cuts_segments_at_the_size_the_ranks_use():
    """A role's segment size is what its ranks reported (the shared-prompt attention keeps a group whole), else its
    hidden size (the tree mask's default): here 8 tokens cut the group of 3 + 2 + 4, each part with its prompt."""
    from types import SimpleNamespace

    same = [5, 6, 7]
    seq, mask = _layout([(same, [1, 2]), (same, [1, 2, 3, 4])], prompt_width=4, response_width=4)
    experience = SimpleNamespace(sequences=seq, attention_mask=mask, response_width=4)
    counted = {}
    for reported in ({}, {"actor": 4096}):
        accounting = flops.StepAccounting({"actor": SHAPE}, None, engines=1)
        accounting.segment_tokens = reported
        accounting.start_step()
        accounting.count("train", "actor", experience, [[[0, 1]]], share_prompts=True, train=True)
        counted[bool(reported)] = accounting.flops["train"]["actor"][0]
    cut = [flops.Segment(3, (2,)), flops.Segment(3, (4,))]
    whole = [flops.Segment(3, (2, 4))]
    assert counted[False] == flops.train_flops(SHAPE, cut, "lm")
    assert counted[True] == flops.train_flops(SHAPE, whole, "lm") < counted[False]


def test_the_count_agrees_with_torchs_flop_counter_on_a_real_model():
    """A tiny Qwen2 forward over one unpadded sequence, the lm_head on every position (as transformers computes it):
    torch counts the matmuls of q/k/v/o, the MLP and lm_head; ours is 2 N_body T + 2 V h T. Attention (eager, so
    ``Q K^T`` and ``A V`` are batched matmuls torch counts): the full T x T square, as a dense kernel computes it;
    ours counts the causal pairs, the work a causal kernel needs."""
    from torch.utils.flop_counter import FlopCounterMode

    from rlhf_sg.tiny import build_tiny_model

    model = build_tiny_model("qwen2").eval()
    model.set_attn_implementation("eager")
    cfg = model.config.to_dict()
    cfg["model_type"] = "qwen2"
    shape = ModelShape.from_hf_config(cfg, dtype="float32")
    numel = sum(m.weight.numel() for name, m in model.named_modules()
                if isinstance(m, torch.nn.Linear) and ".layers." in name)
    assert flops.matmul_params(shape) == numel
    T = 11
    ids = torch.randint(0, shape.vocab_size, (1, T))
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(input_ids=ids)
    counts = counter.get_flop_counts()["Global"]
    matmul = sum(v for op, v in counts.items() if str(op) in ("aten.mm", "aten.addmm"))
    attention = counts[torch.ops.aten.bmm]
    assert matmul == 2 * numel * T + 2 * shape.vocab_size * shape.hidden_size * T
    d_q = shape.num_heads * shape.head_dim
    assert attention == 4 * shape.num_layers * d_q * T * T
    # ours: every position through the lm_head is the "value"-like head count with the vocabulary's weights
    ours = flops.forward_flops(shape, [flops.Segment(T, ())], "lm")
    assert ours == 2 * numel * T + 4 * shape.num_layers * d_q * (T * (T + 1) // 2)


def test_decode_bytes_by_hand():
    kv = kv_bytes_per_token(SHAPE)
    w = weight_bytes(SHAPE)
    # one row, prompt 3, 2 decoded tokens: they read 3 and 4 tokens of KV; 2 decode steps read the weights
    assert flops.decode_bytes(SHAPE, [3], [2]) == 2 * w + kv * (3 + 4)
    # two rows on 2 engines: the longest response sets the steps; KV (3+4) + (5+6+7)
    assert flops.decode_bytes(SHAPE, [3, 5], [2, 3], engines=2) == 2 * 3 * w + kv * (7 + 18)
    assert flops.decode_bytes(SHAPE, [], []) == 0.0
    # a vision tower reads its weights on the prompt's images, not at each decode step
    vl = dataclasses.replace(SHAPE, vision_params=10**6)
    assert weight_bytes(vl) > w and flops.decode_bytes(vl, [3], [2]) == 2 * w + kv * (3 + 4)


def test_decode_flops_by_hand():
    body = flops.matmul_params(SHAPE)  # 2 x (8*8 + 2*8*4 + 8*8 + 3*8*16)
    assert body == 1152
    d_q = SHAPE.num_heads * SHAPE.head_dim
    # prompt 3, 2 decoded tokens: each a forward of the body and the lm_head; attention over 3 and 4 tokens
    assert flops.decode_flops(SHAPE, [3], [2]) == 2 * (body + 10 * 8) * 2 + 4 * 2 * d_q * (3 + 4)
    # the prompt's prefill is not counted: a longer prompt adds only the attention it feeds
    assert flops.decode_flops(SHAPE, [30], [2]) - flops.decode_flops(SHAPE, [3], [2]) == 4 * 2 * d_q * 27 * 2
    assert flops.decode_flops(SHAPE, [], []) == 0.0


@pytest.mark.parametrize("bytes_, flops_, fraction, bound", [
    (8e9, 1e12, 0.4 / 4.0, "bandwidth"),  # 8 GB over 2 x 10 GB/s = 0.4 s > 1 TFLOP over 2 x 4 TFLOP/s
    (8e9, 8e12, 1.0 / 4.0, "compute"),  # 8 TFLOP over 2 x 4 TFLOP/s = 1 s > 0.4 s
])
def test_the_generation_roofline_is_the_larger_of_its_bounds(bytes_, flops_, fraction, bound):
    ceiling = flops.Ceiling(tflops=4.0, gbs=10.0, source="test")
    out = flops.phase_metrics(ceiling, {"generate": 4.0}, {}, generated_tokens=100, generate_bytes=bytes_,
                              engines=2, generate_flops=flops_)
    assert out["perf/generate_of_roofline"] == pytest.approx(fraction), bound
    assert out["perf/generate_TFLOPs"] == pytest.approx(flops_ / 4.0 / 1e12)
    assert "perf/generate_of_roofline" not in flops.phase_metrics(None, {"generate": 4.0}, {}, generated_tokens=100,
                                                                  generate_bytes=bytes_, generate_flops=flops_)


@pytest.mark.parametrize("name, dtype, tflops, gbs", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989.0, 3350.0),
    ("NVIDIA H100 PCIe", "bfloat16", 756.0, 2000.0),
    ("NVIDIA H100 80GB HBM3", "float32", 67.0, 3350.0),
    ("NVIDIA H200", "bfloat16", 989.0, 4800.0),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", 312.0, 2039.0),
    ("NVIDIA A100-SXM4-40GB", "float32", 19.5, 1555.0),
    ("NVIDIA L40S", "bfloat16", 362.0, 864.0),
    ("NVIDIA B200", "bfloat16", 2250.0, 8000.0),
])
def test_the_device_table(name, dtype, tflops, gbs):
    ceiling = flops.gpu_ceiling(name, dtype)
    assert (ceiling.tflops, ceiling.gbs) == (tflops, gbs)
    assert name in ceiling.source


def test_flags_override_the_table_and_stand_in_for_unknown_devices():
    assert flops.gpu_ceiling("Tesla T4", "bfloat16") is None
    assert flops.gpu_ceiling("Tesla T4", "bfloat16", peak_tflops=65.0) is None  # no bandwidth for it
    t4 = flops.gpu_ceiling("Tesla T4", "bfloat16", 65.0, 300.0)
    assert (t4.tflops, t4.gbs) == (65.0, 300.0)
    h100 = flops.gpu_ceiling("NVIDIA H100 80GB HBM3", "bfloat16", peak_tflops=500.0)
    assert (h100.tflops, h100.gbs) == (500.0, 3350.0)
    assert "--perf flags" in h100.source


def test_the_cpu_probe_measures_something_finite():
    ceiling = flops.measure_cpu_ceiling(SHAPE, "float32", threads=1, tokens=64, copy_bytes=1 << 20,
                                        min_total_s=0.01)
    assert math.isfinite(ceiling.tflops) and ceiling.tflops > 0
    assert math.isfinite(ceiling.gbs) and ceiling.gbs > 0
    assert "1 thread" in ceiling.source


def test_phase_metrics_by_hand():
    ceiling = flops.Ceiling(tflops=4.0, gbs=10.0, source="test")
    out = flops.phase_metrics(
        ceiling, {"train": 2.0, "reference": 0.5, "generate": 4.0},
        {"train": (6e12, 2), "reference": (1e12, 1)},
        generated_tokens=100, generate_bytes=8e9, engines=2, sync_bytes=3e9, sync_s=1.5, engine_load_s=1.0)
    assert out["perf/train_TFLOPs"] == pytest.approx(3.0)  # 6 TFLOP in 2 s
    assert out["perf/train_of_peak"] == pytest.approx(3.0 / (2 * 4.0))  # two ranks' ceilings
    assert out["perf/reference_of_peak"] == pytest.approx(2.0 / 4.0)
    assert out["perf/generate_tokens_per_s"] == pytest.approx(25.0)
    assert out["perf/generate_bytes_per_token"] == pytest.approx(8e7)
    assert out["perf/generate_of_peak_bw"] == pytest.approx(2.0 / (2 * 10.0))  # 2 GB/s over two engines' 10
    assert "perf/generate_of_roofline" not in out  # no FLOPs given
    assert out["perf/weight_sync_GBps"] == pytest.approx(2.0)
    assert out["perf/weight_sync_over_engine_load"] == pytest.approx(1.5)
    assert "perf/train_of_peak" not in flops.phase_metrics(None, {"train": 2.0}, {"train": (6e12, 2)})


def test_the_cpu_ceiling_is_measured_before_the_cluster_starts(tmp_path, monkeypatch, no_ray):
    """The trainer measures a CPU's ceiling before its cluster starts (loading ranks and engines would lower it),
    and needs no group for it."""
    import json

    from rlhf_sg.config import parse_args
    from rlhf_sg.tiny import save_tiny_model
    from rlhf_sg.trainer.ppo import PPOTrainer

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(8)))
    cfg = parse_args(["--model", save_tiny_model(str(tmp_path / "m")), "--prompt-data", str(prompts),
                      "--reward.function", "exact_match", "--data.label_key", "label",
                      "--log.output_dir", str(tmp_path / "out")])
    events = []

    class Started(Exception):
        pass

    def start():
        events.append("cluster starts")
        raise Started

    monkeypatch.setattr(flops.StepAccounting, "for_run", classmethod(
        lambda cls, cfg, layout, actor_group=None: events.append(f"ceiling measured, group {actor_group}")))
    trainer = PPOTrainer(cfg)
    monkeypatch.setattr(trainer.cluster, "start", start)
    with pytest.raises(Started):
        trainer.setup()
    assert events == ["ceiling measured, group None", "cluster starts"]


def test_an_sp_groups_plan_is_counted_once_on_all_its_ranks():
    """Under sequence parallelism a data-parallel rank's plan runs on the N ranks of an SP group, which share its
    FLOPs: the same FLOPs, N x the ranks (what the phase's ceiling is taken over)."""
    from types import SimpleNamespace

    seq, mask = _layout([([5, 6, 7], [1, 2]), ([5, 6], [1, 2, 3, 4])], prompt_width=4, response_width=4)
    experience = SimpleNamespace(sequences=seq, attention_mask=mask, response_width=4)
    counted = {}
    for size in (1, 2):
        accounting = flops.StepAccounting({"actor": SHAPE}, None, engines=1)
        accounting.start_step()
        accounting.count("train", "actor", experience, [[[0]], [[1]]], share_prompts=False, train=True,
                         sequence_parallel=size)
        counted[size] = accounting.flops["train"]["actor"]
    assert counted[2] == (counted[1][0], 2 * counted[1][1]) and counted[1][1] == 2


def test_the_decode_gemm_bench_times_the_linears_the_accounting_counts(capsys):
    """``bench decode-gemm`` times each layer's q, k, v, o, gate, up and down projections: their weights, over the
    layers, are the decoder's matmul weights the FLOP accounting counts (so its TFLOP/s compare with the ceiling the
    accounting divides by); it prints a row per row count, one layer's and every layer's rate."""
    from rlhf_sg.bench import decode_gemm

    for arch, size in (("qwen2", "tiny"), ("qwen2", "25m"), ("llama", "small")):
        shape = decode_gemm.model_shape(arch, size)
        assert shape.num_layers * sum(i * o for i, o in decode_gemm.layer_linears(shape)) == flops.matmul_params(shape)
    decode_gemm.main(["--size", "tiny", "--rows", "4", "16", "--threads", "1", "--min-seconds", "0.02"])
    out = capsys.readouterr().out
    assert "qwen2/tiny, 2 layers of linears" in out
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [r[0] for r in rows] == ["4", "16"]
    assert all(float(r[1]) > 0 and float(r[3]) > 0 for r in rows)
