"""A checkpoint written under the other partitioning (ZeRO-3, or an unpartitioned rank of a one-rank group) is
converted on resume: weights, Adam's moments and step, the LR schedule and the client state carry over."""

import hashlib
import os

import pytest
import torch

from rlhf_sg.checkpoint_convert import (
    PLAIN,
    PLAIN_FILE,
    ZERO3,
    ZERO3_FILE,
    conversion_refused,
    convert_checkpoint,
    is_universal,
    partitioning_of,
    read_plain,
    read_zero,
    write_plain,
    write_universal,
)

#: a small model's trained parameters in their optimizer order
SHAPES = {"embed.weight": torch.Size([5, 3]), "layer.weight": torch.Size([4, 3]), "layer.bias": torch.Size([4])}


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}


def _run_state() -> dict:
    """The entries DeepSpeed's engine writes besides the module and optimizer, with a client state."""
    return {"lr_scheduler": {"last_epoch": 3, "base_lrs": [0.01]}, "global_steps": 3, "skipped_steps": 1,
            "global_samples": 3, "dp_world_size": 1, "mp_world_size": 1, "buffer_names": [], "step": 3,
            "torch_rng": torch.get_rng_state()}


def _group() -> dict:
    return {"lr": 0.004, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0, "initial_lr": 0.01}


def _write_zero3(directory, weights, exp_avg, exp_avg_sq, step):
    """A ZeRO-3 checkpoint of one rank as DeepSpeed's engine writes it: empty partitions in the module, the shapes
    in ``param_shapes``, the flat fp32 partition and its flat moments in the optimizer-states file."""
    os.makedirs(directory)
    flat = {k: torch.cat([t[n].reshape(-1) for n in SHAPES]) for k, t in
            (("fp32", weights), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq))}
    torch.save(dict(_run_state(), module={n: torch.empty(0) for n in SHAPES}, optimizer=None,
                    param_shapes=[dict(SHAPES)], shared_params={}, frozen_param_shapes={},
                    frozen_param_fragments={}), os.path.join(directory, ZERO3_FILE))
    optim = {"zero_stage": 3, "partition_count": 1, "loss_scaler": None, "dynamic_loss_scale": False,
             "overflow": False, "fp32_flat_groups": [flat["fp32"]],
             "optimizer_state_dict": {"state": {0: {"step": step, "exp_avg": flat["exp_avg"],
                                                    "exp_avg_sq": flat["exp_avg_sq"]}},
                                      "param_groups": [dict(_group(), params=[0])]}}
    torch.save({"optimizer_state_dict": optim}, os.path.join(directory, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))


def _digest(directory) -> dict:
    return {f: hashlib.sha256(open(os.path.join(directory, f), "rb").read()).hexdigest()
            for f in sorted(os.listdir(directory))}


def test_a_zero3_checkpoint_reads_whole_and_writes_as_an_unpartitioned_one_in_the_optimizer_order(tmp_path):
    weights, exp_avg, exp_avg_sq = _tensors(0), _tensors(1), {n: t.abs() for n, t in _tensors(2).items()}
    step = torch.tensor(3.0)
    _write_zero3(str(tmp_path / "step3"), weights, exp_avg, exp_avg_sq, step)
    assert partitioning_of(str(tmp_path / "step3")) == ZERO3
    state = read_zero(str(tmp_path / "step3"), str(tmp_path / "scratch"))
    for name in SHAPES:
        assert torch.equal(state.weights[name], weights[name]), name
        assert torch.equal(state.moments[name]["exp_avg"], exp_avg[name]), name
        assert torch.equal(state.moments[name]["exp_avg_sq"], exp_avg_sq[name]), name
    assert float(state.step) == 3.0 and state.param_group == _group()
    assert state.run_state["lr_scheduler"] == {"last_epoch": 3, "base_lrs": [0.01]}
    assert torch.equal(state.run_state["torch_rng"], _run_state()["torch_rng"]) and state.run_state["step"] == 3

    order = ["layer.bias", "embed.weight", "layer.weight"]  # the target optimizer's order, not the checkpoint's
    write_plain(state, str(tmp_path / "plain"), order)
    saved = torch.load(tmp_path / "plain" / PLAIN_FILE, weights_only=False)
    assert saved["optimizer"]["param_groups"] == [dict(_group(), params=[0, 1, 2])]
    for index, name in enumerate(order):
        entry = saved["optimizer"]["state"][index]
        assert torch.equal(entry["exp_avg"], exp_avg[name]) and torch.equal(entry["exp_avg_sq"], exp_avg_sq[name])
        assert float(entry["step"]) == 3.0
        assert torch.equal(saved["module"][name], weights[name])
    assert saved["global_steps"] == 3 and saved["skipped_steps"] == 1 and saved["param_shapes"] is None

    back = read_plain(str(tmp_path / "plain"), order)
    assert back.param_group == _group() and float(back.step) == 3.0
    for name in SHAPES:
        assert torch.equal(back.moments[name]["exp_avg_sq"], exp_avg_sq[name]), name
    with pytest.raises(ValueError, match="parameter order differs"):
        read_plain(str(tmp_path / "plain"), ["embed.weight", "layer.bias", "layer.weight"])


def test_an_unpartitioned_checkpoint_writes_as_a_universal_one_per_parameter(tmp_path):
    weights, exp_avg = _tensors(0), _tensors(1)
    names = list(SHAPES)
    optimizer = {"state": {i: {"step": torch.tensor(2.0), "exp_avg": exp_avg[n], "exp_avg_sq": exp_avg[n].abs()}
                           for i, n in enumerate(names)}, "param_groups": [dict(_group(), params=[0, 1, 2])]}
    os.makedirs(tmp_path / "step2")
    torch.save(dict(_run_state(), module=dict(weights), optimizer=optimizer), tmp_path / "step2" / PLAIN_FILE)
    assert partitioning_of(str(tmp_path / "step2")) == PLAIN
    state = read_plain(str(tmp_path / "step2"), names)
    write_universal(state, str(tmp_path / "uni"))
    for name in names:
        folder = tmp_path / "uni" / "zero" / name
        assert torch.equal(torch.load(folder / "fp32.pt")["param"], weights[name])
        assert torch.equal(torch.load(folder / "exp_avg.pt")["param"], exp_avg[name])
        assert torch.equal(torch.load(folder / "exp_avg_sq.pt")["param"], exp_avg[name].abs())
    optim = torch.load(tmp_path / "uni" / "zero" / "optimizer_state.pt", weights_only=False)
    assert float(optim["optimizer_state_dict"]["state"][0]["step"]) == 2.0
    assert optim["optimizer_state_dict"]["param_groups"][0]["lr"] == 0.004
    assert is_universal(str(tmp_path / "uni")) and not is_universal(str(tmp_path / "step2"))
    run = torch.load(tmp_path / "uni" / ZERO3_FILE, weights_only=False)
    assert run["lr_scheduler"]["last_epoch"] == 3 and run["module"] is None and run["optimizer"] is None


def test_a_conversion_is_written_beside_the_checkpoint_and_leaves_it_as_it_was(tmp_path):
    _write_zero3(str(tmp_path / "step3"), _tensors(0), _tensors(1), _tensors(2), torch.tensor(3.0))
    before = _digest(tmp_path / "step3")
    assert convert_checkpoint(str(tmp_path), "step3", PLAIN, dict(SHAPES)) == "step3.converted-zero0"
    assert convert_checkpoint(str(tmp_path), "step3", PLAIN, dict(SHAPES)) == "step3.converted-zero0"  # again
    assert _digest(tmp_path / "step3") == before
    assert sorted(os.listdir(tmp_path)) == ["step3", "step3.converted-zero0"]  # no scratch left behind
    assert partitioning_of(str(tmp_path / "step3.converted-zero0")) == PLAIN
    with pytest.raises(ValueError, match="layer.bias has shape \\(4,\\) in the checkpoint and \\(5,\\)"):
        convert_checkpoint(str(tmp_path), "step3", PLAIN, dict(SHAPES, **{"layer.bias": torch.Size([5])}))


def test_what_is_not_converted_is_refused_naming_the_directory_the_world_size_and_the_flag(tmp_path):
    for rank in (0, 1):
        os.makedirs(tmp_path / "step4", exist_ok=True)
        (tmp_path / "step4" / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt").write_bytes(b"")
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / ZERO3_FILE).write_bytes(b"")
    assert conversion_refused(str(tmp_path / "one"), ZERO3, "actor") is None
    assert conversion_refused(str(tmp_path / "one"), PLAIN, "actor") is None
    message = conversion_refused(str(tmp_path / "step4"), ZERO3, "critic")
    assert str(tmp_path / "step4") in message and "world size 2" in message
    assert "--train.single_rank_zero3 true and --train.critic_num_ranks 2" in message
    message = conversion_refused(str(tmp_path / "one"), PLAIN, "actor", world_size=2)
    assert "runs ZeRO-3 over 2 ranks" in message and "--train.single_rank_zero3 false and one rank" in message
    assert partitioning_of(str(tmp_path / "missing")) is None


def _state(worker) -> dict:
    """A rank's whole training state: fp32 weights, Adam's moments and step, LR, LR schedule, engine counters."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    optimizer = worker.engine.optimizer
    zero = worker.engine.zero_optimization()  # ZeRO-3, or stage 1 (a bfloat16 unpartitioned rank)
    out = {"weights": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, p in worker.module.named_parameters():
        if not p.requires_grad:
            continue
        if zero:
            out["weights"][name] = safe_get_full_fp32_param(p).clone()
            for k in ("exp_avg", "exp_avg_sq"):
                out[k][name] = safe_get_full_optimizer_state(p, k).clone()
            with deepspeed.zero.GatheredParameters([p]):  # the module holds the master weights, in its dtype
                assert torch.equal(p.data, out["weights"][name].to(p.dtype)), name
        else:
            out["weights"][name] = p.data.clone()
            for k in ("exp_avg", "exp_avg_sq"):
                out[k][name] = optimizer.state[p][k].clone()
    inner = optimizer.optimizer if zero else optimizer
    out["steps"] = {float(s["step"]) for s in inner.state.values()}
    out["lr"] = optimizer.param_groups[0]["lr"]
    out["scheduler"] = worker.engine.lr_scheduler.state_dict()
    out["global_steps"] = worker.engine.global_steps
    return out


def _run(model_path: str, zero_stage: int, load: tuple | None, save: tuple | None, lora: dict | None,
         dtype: str = "float32") -> dict:
    """One ``dtype`` actor rank at ``zero_stage`` (with a LoRA adapter: ``lora``): load ``load`` (path, tag) or take
    a step; save as ``save``; the state then, the client state loaded, and the state after one more step on the same
    batch."""
    import torch.distributed as dist
    from zero3_rank import FRESH_UPDATE, actor_rank, one_step

    worker, batch, plan = actor_rank(model_path, zero_stage=zero_stage, lr_scheduler="linear", lr_warmup_steps=3,
                                     lr_total_steps=10, lora=lora, dtype=dtype)
    from rlhf_sg import checkpoint_convert

    universal = []  # whether the conversion the worker loads is a universal checkpoint (it is removed once loaded)
    convert = checkpoint_convert.convert_checkpoint

    def recording(path, tag, *args):
        converted = convert(path, tag, *args)
        universal.append(checkpoint_convert.is_universal(os.path.join(path, converted)))
        return converted

    checkpoint_convert.convert_checkpoint = recording  # this process is the test's own (in_fresh_process)
    try:
        client = worker.load_checkpoint(*load) if load else None
        if not load:
            worker.train_actor(batch, one_step(plan, batch), FRESH_UPDATE)
        if save:
            worker.save_checkpoint(*save, {"step": 1, "data": {"epoch": 0, "consumed": 4}})
        at_save = _state(worker)
        metrics = worker.train_actor(batch, one_step(plan, batch), FRESH_UPDATE)
        return {"at_save": at_save, "client": client, "after": _state(worker), "grad_norm": metrics["actor/grad_norm"],
                "stage": worker.engine.zero_optimization_stage(), "universal": universal == [True]}
    finally:
        dist.destroy_process_group()


def _assert_same_state(got: dict, want: dict, exact: bool, dtype: str = "float32") -> None:
    """``exact``: bit for bit. Otherwise to the rounding of ``dtype``'s gradients (in bfloat16, the two
    partitionings reduce a gradient in different orders, at 8 bits of mantissa)."""
    assert got["weights"].keys() == want["weights"].keys()
    assert got["steps"] == want["steps"] and got["lr"] == pytest.approx(want["lr"], rel=1e-12)
    assert got["scheduler"]["last_epoch"] == want["scheduler"]["last_epoch"]
    assert got["global_steps"] == want["global_steps"]
    compared = total = 0
    for name, w in want["weights"].items():
        if exact:
            for k in ("weights", "exp_avg", "exp_avg_sq"):
                assert torch.equal(got[k][name], want[k][name]), (k, name)
            continue
        m = want["exp_avg"][name]
        # bfloat16: a gradient off by its rounding moves Adam's update by a few percent of the LR
        rtol, weight_atol = (1e-4, 1e-6) if dtype == "float32" else (2e-2, want["lr"] / 10)
        scale = m.abs().max().item()
        torch.testing.assert_close(got["exp_avg"][name], m, rtol=rtol,
                                   atol=(rtol / 10 if dtype == "float32" else rtol) * scale + 1e-12)
        clear = m.abs() > 1e-5  # |g| well above Adam's eps: elsewhere rounding of g moves a weight by up to lr
        torch.testing.assert_close(got["weights"][name][clear], w[clear], rtol=1e-5, atol=weight_atol, msg=name)
        compared += int(clear.sum())
        total += clear.numel()
    assert exact or compared > total / 10


@pytest.mark.slow
@pytest.mark.parametrize(("lora", "dtype"), [(None, "float32"),
                                             ({"rank": 4, "alpha": 8.0, "target_modules": "all-linear"}, "float32"),
                                             (None, "bfloat16")], ids=["full", "lora", "full-bf16"])
def test_a_checkpoint_resumes_under_the_other_partitioning_and_takes_the_same_next_step(tmp_path, lora, dtype):
    """A one-rank actor saves under ZeRO-3 after a step; an unpartitioned rank resumes it (converted) and saves
    unpartitioned; a ZeRO-3 rank resumes that (converted). Each resume starts from the saved weights, Adam moments
    and step, LR schedule and client state exactly, and the next step on the same batch lands where the first
    rank's did (to float rounding). A LoRA actor's checkpoints hold the adapter alone (the frozen base is the
    pretrained model). In bfloat16 the unpartitioned rank is ZeRO stage 1, whose float32 masters and moments are in
    an optimizer file of DeepSpeed's, and both conversions are universal checkpoints."""
    from zero3_rank import in_fresh_process

    from rlhf_sg.tiny import save_tiny_model

    path = save_tiny_model(str(tmp_path / "m"), arch="qwen2", size="tiny")
    zero3_dir, plain_dir = str(tmp_path / "zero3"), str(tmp_path / "plain")
    first = in_fresh_process(_run, path, 3, None, (zero3_dir, "step1"), lora, dtype)
    plain = in_fresh_process(_run, path, 0, (zero3_dir, "step1"), (plain_dir, "step1"), lora, dtype)
    zero3 = in_fresh_process(_run, path, 3, (plain_dir, "step1"), None, lora, dtype)
    unpartitioned = 0 if dtype == "float32" else 1
    assert (first["stage"], plain["stage"], zero3["stage"]) == (3, unpartitioned, 3)
    assert first["at_save"]["steps"] == {1.0} and first["at_save"]["scheduler"]["last_epoch"] == 1
    for resumed in (plain, zero3):
        assert resumed["client"]["step"] == 1 and resumed["client"]["data"] == {"epoch": 0, "consumed": 4}
        _assert_same_state(resumed["at_save"], first["at_save"], exact=True)
        assert resumed["grad_norm"] == pytest.approx(first["grad_norm"], rel=1e-5 if dtype == "float32" else 1e-2)
        _assert_same_state(resumed["after"], first["after"], exact=False, dtype=dtype)
    for resumed in (plain, zero3):
        assert resumed["universal"] == (resumed["stage"] == 3 or dtype != "float32")
    for directory in (zero3_dir, plain_dir):  # each conversion removed once loaded; the originals stay
        assert sorted(d for d in os.listdir(directory) if os.path.isdir(os.path.join(directory, d))) == ["step1"]
