"""The sft bench's own logic: the tokens each side is credited with (ours from train-sft's step metrics, TRL's from
its micro-batches), which TRL settings it tries and keeps, and the rate, token and loss checks it prints. TRL's
collator is used where TRL is installed (the ``bench`` extra); the rest needs no TRL."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from rlhf_sg.bench.sft import (
    SideRun,
    TrlSetting,
    batch_tokens,
    fastest_setting,
    loss_check,
    make_rows,
    parse_trl_setting,
    row_lengths,
    token_check,
    too_few_steps,
    trl_settings,
)
from rlhf_sg.stages import StageConfig, train_sft
from rlhf_sg.tiny import save_tiny_model


@pytest.fixture(scope="module")
def bench_data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft-bench")
    model = save_tiny_model(str(tmp / "model"), "qwen2", "tiny", seed=0)
    rows = make_rows(10, (5, 20), (3, 60), seed=1)
    data = tmp / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, str(data), rows


def _ours(model, data, out, batch_size=4, epochs=2):
    cfg = StageConfig(stage="sft")
    cfg.model.pretrain, cfg.data.train_data, cfg.log.output_dir = model, data, str(out)
    cfg.train.batch_size, cfg.train.epochs, cfg.train.lr = batch_size, epochs, 1e-3
    cfg.log.tensorboard = cfg.log.progress_bar = cfg.log.export_hf = False
    return [r for r in train_sft(cfg) if "time/step" in r]


def test_train_sft_credits_each_epoch_with_every_rows_tokens_and_its_completion_and_eos_as_trained(
        bench_data, tmp_path):
    model, data, rows = bench_data
    steps = _ours(model, data, tmp_path / "ours")
    assert len(steps) == 6 and all(s["time/step"] > 0 for s in steps)  # 10 rows, 4 a step: 3 steps an epoch
    lengths = row_lengths(data, model)
    completions = [len(r["completion"]) + 1 for r in rows]  # one character is one token, then the EOS
    for epoch in (steps[:3], steps[3:]):
        assert sum(s["train/real_tokens"] for s in epoch) == sum(lengths)
        assert sum(s["train/trained_tokens"] for s in epoch) == sum(completions)


def _trl_shaped(ids: list[list[int]], prompt_lens: list[int], padding_free: bool) -> dict[str, torch.Tensor]:
    """Micro-batches as SFTTrainer's collator lays them out: right-padded with a mask, or concatenated with no pad
    (padding-free); labels -100 on prompts and pads."""
    labels = [[-100] * p + row[p:] for row, p in zip(ids, prompt_lens)]
    if padding_free:
        return {"input_ids": torch.tensor([sum(ids, [])]), "labels": torch.tensor([sum(labels, [])])}
    width = max(map(len, ids))
    pad = lambda xs, v: [x + [v] * (width - len(x)) for x in xs]  # noqa: E731
    return {"input_ids": torch.tensor(pad(ids, 0)), "labels": torch.tensor(pad(labels, -100)),
            "attention_mask": torch.tensor(pad([[1] * len(x) for x in ids], 0))}


@pytest.mark.parametrize("padding_free", [False, True])
def test_a_trl_micro_batch_is_credited_its_rows_real_tokens_and_completion_tokens(bench_data, padding_free):
    model, data, rows = bench_data
    from rlhf_sg.data import load_tokenizer

    tok = load_tokenizer(model)
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows[:4]]
    ids = [p + tok(r["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
           for p, r in zip(prompts, rows[:4])]
    real, trained = batch_tokens(_trl_shaped(ids, [len(p) for p in prompts], padding_free))
    assert real == sum(row_lengths(data, model)[:4])
    assert trained == sum(len(r["completion"]) + 1 for r in rows[:4])


@pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                    reason="TRL is the bench extra (pip install -e '.[bench]'); without it its collator cannot run")
@pytest.mark.parametrize("padding_free", [False, True])
def test_trls_own_collator_batches_are_credited_what_train_sft_credits(bench_data, tmp_path, padding_free):
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    model, data, rows = bench_data
    from rlhf_sg.data import load_tokenizer

    tok = load_tokenizer(model)
    examples = []
    for r in rows:
        p = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        c = tok(r["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        # as SFTTrainer prepares a prompt / completion row with completion_only_loss: -100 on the prompt
        examples.append({"input_ids": p + c, "labels": [-100] * len(p) + c})
    collator = DataCollatorForLanguageModeling(pad_token_id=tok.pad_token_id, padding_free=padding_free)
    real, trained = batch_tokens(collator(examples))
    steps = _ours(model, data, tmp_path / "ours", batch_size=10, epochs=1)
    assert (real, trained) == (steps[0]["train/real_tokens"], steps[0]["train/trained_tokens"])


def test_the_settings_cover_every_dividing_micro_batch_padded_and_padding_free_then_packing():
    got = [s.flag for s in trl_settings(8)]
    assert got == ["2,4,pad", "4,2,pad", "8,1,pad", "2,4,free", "4,2,free", "8,1,free", "1,1,pack"]
    assert [s.flag for s in trl_settings(3)] == ["3,1,pad", "3,1,free", "1,1,pack"]


def test_a_pinned_setting_reads_back_and_must_make_up_the_step_unless_packed():
    assert parse_trl_setting("4, 4, FREE", 16) == TrlSetting(4, 4, "free")
    assert parse_trl_setting("1,1,pack", 16) == TrlSetting(1, 1, "pack")
    with pytest.raises(ValueError, match="make their product 16"):
        parse_trl_setting("4,2,pad", 16)
    with pytest.raises(ValueError, match="layout pad, free or pack"):
        parse_trl_setting("4,4,packed", 16)


def test_the_search_keeps_the_most_tokens_a_second_skips_failures_and_keeps_the_first_of_a_tie():
    a, b, c = TrlSetting(2, 8, "pad"), TrlSetting(4, 4, "free"), TrlSetting(1, 1, "pack")
    assert fastest_setting([(a, 100.0), (b, 300.0), (c, 200.0)]) == b
    assert fastest_setting([(a, 100.0), (b, None), (c, 200.0)]) == c
    assert fastest_setting([(a, 250.0), (b, 250.0)]) == a
    with pytest.raises(RuntimeError, match="no setting finished"):
        fastest_setting([(a, None)])


def _run(name, step_s, real, trained, loss, warmup=1):
    return SideRun(name, warmup, list(step_s), list(real), list(trained), list(loss))


def test_tokens_a_second_leaves_out_the_warm_up_steps():
    run = _run("ours", [10.0, 1.0, 3.0], [1000, 200, 600], [1, 1, 1], [1, 1, 1])
    assert run.tokens_per_s == pytest.approx(800 / 4.0)
    assert run.s_per_step == pytest.approx(2.0)
    assert too_few_steps(_run("trl", [1.0], [1], [1], [1])) is not None and too_few_steps(run) is None


def test_epoch_losses_weigh_steps_by_trained_tokens_and_split_epochs_by_cumulative_tokens():
    # 2 epochs of 40 trained tokens: ours in 2 steps each; a packed side's steps cut the epochs differently
    run = _run("x", [1] * 4, [1] * 4, [10, 30, 30, 10], [4.0, 2.0, 1.0, 3.0])
    assert run.epoch_losses(2) == pytest.approx([(40 + 60) / 40, (30 + 30) / 40])


def test_the_checks_flag_different_tokens_a_loss_that_does_not_fall_and_a_gap_over_tolerance():
    ours = _run("ours", [1] * 4, [50, 50, 50, 50], [20, 20, 20, 20], [3.0, 3.0, 2.0, 2.0])
    trl = _run("trl", [1] * 2, [100, 100], [40, 40], [3.1, 2.05])
    assert token_check(ours, trl)[0]
    assert not token_check(ours, _run("trl", [1] * 2, [100, 99], [40, 40], [3.1, 2.05]))[0]
    assert loss_check(ours, trl, 2, 0.05)[0]
    assert not loss_check(ours, trl, 2, 0.01)[0]  # 2.0 against 2.05: 2.4 %
    flat = _run("trl", [1] * 2, [100, 100], [40, 40], [2.0, 2.05])
    assert not loss_check(ours, flat, 2, 0.05)[0]


@pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                    reason="TRL is the bench extra (pip install -e '.[bench]'); without it SFTTrainer cannot run")
@pytest.mark.parametrize("layout", ["pad", "pack"])
def test_the_benchs_trl_run_trains_as_sfttrainer_run_alone(bench_data, tmp_path, layout):
    """The bench's clock and token counting change nothing TRL computes: the same losses step for step as a plain
    SFTTrainer with the same config, and every row's tokens once an epoch."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import SFTTrainer

    from rlhf_sg.bench.sft import _trl_run, pack_tokens, row_lengths, trl_config
    from rlhf_sg.data import load_tokenizer

    model, data, rows = bench_data
    spec = {"model_path": model, "data_file": data, "output_dir": str(tmp_path / "trl"), "epochs": 2, "lr": 1e-3,
            "seed": 0, "max_len": 512, "pack_tokens": pack_tokens(row_lengths(data, model), 4)}
    micro_batch = 1 if layout == "pack" else 2
    bench = _trl_run(spec, micro_batch, 1 if layout == "pack" else 2, layout)["steps"]
    losses = []

    class Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    alone = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32,
                                                                  attn_implementation="sdpa"),
                       args=trl_config({**spec, "output_dir": str(tmp_path / "alone")}, micro_batch,
                                       1 if layout == "pack" else 2, layout),
                       train_dataset=load_dataset("json", data_files=data, split="train"),
                       processing_class=load_tokenizer(model), callbacks=[Losses()])
    alone.train()
    assert [s["loss"] for s in bench] == pytest.approx(losses, rel=1e-6)
    assert sum(s["real_tokens"] for s in bench) == 2 * sum(row_lengths(data, model))
    assert sum(s["trained_tokens"] for s in bench) == 2 * sum(len(r["completion"]) + 1 for r in rows)
