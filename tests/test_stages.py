"""The stages before RL (rlhf_sg.stages): each rule the issue names, held by a test that fails under its mutant.

All in process (no Ray, no DeepSpeed): a real tiny Qwen2 model and the byte-level BPE chat tokenizer with the
Qwen-style template, a real in-process rank and the controller end to end."""

from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

from rlhf_sg.config import ConfigError
from rlhf_sg.data import DataError
from rlhf_sg.models import REWARD_NORMALIZATION_FILE, ValueHeadModel
from rlhf_sg.stages import StageConfig, losses, parse_stage_args, train_dpo, train_rm, train_sft
from rlhf_sg.stages.data import load_stage_rows
from rlhf_sg.stages.render import Rendered, eos_ids, fit, render_messages, render_text
from rlhf_sg.stages.run import reference_cache_key, reference_logps
from rlhf_sg.stages.steps import StageLoss, make_batch, microbatch_loss, score_rows, step_plans
from rlhf_sg.tiny import build_chat_tokenizer, build_tiny_model

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12+34?"},
                {"role": "assistant", "content": "46"}, {"role": "user", "content": "And 250-75?"},
                {"role": "assistant", "content": "The answer is 175."}]


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer()


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, tok):
    path = str(tmp_path_factory.mktemp("base"))
    build_tiny_model("qwen2", "tiny", seed=1, vocab_size=len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def _prefs(n=12):
    return [{"prompt": f"What is {a}+{b}?", "chosen": f"The answer is {a + b}.",
             "rejected": f"The answer is {a + b + 1}."} for a in range(4) for b in range(4)][:n]


def _cfg(stage, model, data, out, **train):
    cfg = StageConfig(stage=stage)
    cfg.model.pretrain, cfg.data.train_data, cfg.log.output_dir = model, data, str(out)
    cfg.data.apply_chat_template = True
    cfg.log.progress_bar = cfg.log.tensorboard = False
    cfg.train.packing_probe = False
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


def _sft_cfg(tmp_path, base_dir, lr):
    """SFT on 25 chat rows "What is a+b?" -> "The answer is a+b." (a, b < 5), 8 a step, 3 epochs, a fifth held out."""
    rows = [{"messages": [{"role": "user", "content": f"What is {a}+{b}?"},
                          {"role": "assistant", "content": f"The answer is {a + b}."}]}
            for a in range(5) for b in range(5)]
    cfg = _cfg("sft", base_dir, _write(tmp_path / "sft.jsonl", rows), tmp_path / "sft", batch_size=8, epochs=3, lr=lr)
    cfg.data.eval_fraction = 0.2
    return cfg


def _data(settings):
    from rlhf_sg.stages.config import StageDataConfig

    return StageDataConfig(apply_chat_template=True, **settings)


# ---- masks from provenance ------------------------------------------------------------------------------------


def test_every_assistant_turn_is_trained_through_its_end_token_and_nothing_else(tok):
    row = render_messages(tok, CONVERSATION, eos_ids(tok), "f line 1")
    spans, current = [], []
    for i, m in zip(row.ids, row.loss_mask):
        if m:
            current.append(i)
        elif current:
            spans.append(tok.decode(current))
            current = []
    assert spans == ["46<|im_end|>", "The answer is 175.<|im_end|>"]
    assert row.ids == list(tok(tok.apply_chat_template(CONVERSATION, tokenize=False),
                               add_special_tokens=False)["input_ids"])


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_row(tok):
    template = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n"
                "{%- if m.role == 'assistant' and not loop.last %}[earlier]{% else %}{{ m.content }}{% endif %}"
                "<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
    rewriting = build_chat_tokenizer()
    rewriting.chat_template = template
    with pytest.raises(DataError, match=r"data\.jsonl line 7: the chat template renders .* assistant turn 2"):
        render_messages(rewriting, CONVERSATION, eos_ids(rewriting), "data.jsonl line 7")


def test_a_truncated_row_is_cut_and_marked_never_given_an_eos(tok):
    eos = tok.eos_token_id
    row = render_text(tok, "What is 12+34?", "The answer is 46.", {eos}, "f line 1")
    assert row.ids[-1] == eos
    cut = fit(row, len(row.ids) - 2, "truncate", "f line 1")
    assert cut.truncated and cut.ids == row.ids[:-2] and eos not in cut.ids
    assert cut.loss_mask == row.loss_mask[:-2]
    assert fit(row, len(row.ids) - 2, "drop", "f line 1") is None
    with pytest.raises(DataError, match="f line 1: .* over --data.max_len"):
        fit(row, len(row.ids) - 2, "error", "f line 1")


def test_plain_completions_are_tokenized_alone_after_their_prompt(tok):
    row = render_text(tok, "The quick brown", " fox jumps", {tok.eos_token_id}, "f line 1")
    p, c = tok("The quick brown", add_special_tokens=False)["input_ids"], tok(" fox jumps",
                                                                              add_special_tokens=False)["input_ids"]
    assert row.ids == p + c + [tok.eos_token_id]
    assert row.loss_mask == [False] * len(p) + [True] * (len(c) + 1)


# ---- preference data, checked up front ---------------------------------------------------------------------------


@pytest.mark.parametrize("row, message", [
    ({"prompt": "hi", "rejected": "b"}, r"pref\.jsonl line 2: key 'chosen' missing .* set --data\.chosen_key"),
    ({"prompt": "hi", "chosen": "a", "rejected": "a"}, r"line 2: chosen and rejected render to the same tokens"),
    ({"chosen": "a", "rejected": "b"}, r"line 2: no 'prompt', so 'chosen' must be a whole conversation"),
    ({"prompt": "hi", "chosen": 3, "rejected": "b"}, r"line 2: 'chosen' must be a string or a list of"),
])
def test_bad_preference_rows_are_named_with_file_and_row(tmp_path, tok, row, message):
    path = _write(tmp_path / "pref.jsonl", [_prefs(1)[0], row])
    with pytest.raises(DataError, match=message):
        load_stage_rows(path, "dpo", tok, eos_ids(tok), _data({}))


def test_preferences_as_whole_conversations_or_parquet(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    user = [{"role": "user", "content": "What is 1+1?"}]
    rows = [{"chosen": user + [{"role": "assistant", "content": "2"}],
             "rejected": user + [{"role": "assistant", "content": "3"}], "margin": 0.5}]
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "p.parquet"))
    data = load_stage_rows(str(tmp_path / "p.parquet"), "rm", tok, eos_ids(tok), _data({"margin_key": "margin"}))
    assert data.num_units == 1 and data.margins == [0.5]
    assert tok.decode([i for i, m in zip(data.rows[1].ids, data.rows[1].loss_mask) if m]) == "3<|im_end|>"


# ---- one normaliser per optimizer step ---------------------------------------------------------------------------


def _grads(model, batch, steps, spec):
    model.zero_grad()
    for step in steps:
        for micro in step.plan:
            loss, _, _ = microbatch_loss(model, batch.rows(micro), spec, step.normalizer)
            loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_a_steps_gradient_is_the_mean_over_all_its_tokens_however_it_is_split(tok):
    """Rows of 2 to 20 trained tokens, split into several micro-batches and over two ranks (gradients averaged, as
    ZeRO's reduction does): every split gives the one-batch token mean's gradient."""
    rows = [render_text(tok, "What is 1+1?", " ".join(["two"] * k), {tok.eos_token_id}, "r") for k in (1, 9, 2, 6)]
    batch = make_batch(SimpleNamespace(rows=rows, margins=None), tok.pad_token_id)
    model = build_tiny_model("qwen2", "tiny", seed=0, vocab_size=len(tok)).train()
    spec = StageLoss("sft")
    whole = _grads(model, batch, step_plans(batch, [0, 1, 2, 3], False, 10_000, 1), spec)
    split = step_plans(batch, [0, 1, 2, 3], False, 40, 1)
    assert len(split[0].plan) > 1
    torch.testing.assert_close(_grads(model, batch, split, spec), whole)
    two_ranks = step_plans(batch, [0, 1, 2, 3], False, 40, 2)
    assert two_ranks[0].normalizer == two_ranks[1].normalizer == float(batch.loss_mask.sum()) / 2
    averaged = sum(_grads(model, batch, [s], spec) for s in two_ranks) / 2
    torch.testing.assert_close(averaged, whole)


# ---- reward models -------------------------------------------------------------------------------------------


def test_the_reward_is_read_at_the_last_response_token_when_pad_is_eos(tok):
    """pad == eos (<|im_end|>), which also closes the prompt's turns: the score is the value at the response's own
    <|im_end|>, not at the first pad-id token (inside the prompt) nor at the template's newline after it."""
    pad_is_eos = build_chat_tokenizer()
    pad_is_eos.pad_token = pad_is_eos.eos_token
    rows = [render_messages(pad_is_eos, CONVERSATION[:3], eos_ids(pad_is_eos), "r"),
            render_messages(pad_is_eos, CONVERSATION, eos_ids(pad_is_eos), "r")]
    batch = make_batch(SimpleNamespace(rows=rows, margins=None), pad_is_eos.pad_token_id)
    backbone = build_tiny_model("qwen2", "tiny", seed=0, vocab_size=len(tok)).model
    rm = ValueHeadModel(backbone).eval()
    _, scores = score_rows(rm, batch, [[0, 1]], "score")
    for row, got in zip(rows, scores):
        end = row.last_response_index
        assert row.ids[end] == pad_is_eos.eos_token_id and row.ids[end + 1] != pad_is_eos.eos_token_id
        alone = rm(torch.tensor([row.ids[: end + 1]]))[0, -1]
        torch.testing.assert_close(got, alone, atol=1e-5, rtol=0)


def test_bradley_terry_with_margin_and_ties_counted_wrong():
    chosen, rejected, margin = torch.tensor([1.0, 0.5, 2.0]), torch.tensor([0.0, 0.5, 3.0]), torch.tensor([0.5, 0, 0])
    expected = -(math.log(1 / (1 + math.exp(-0.5))) + math.log(0.5) + math.log(1 / (1 + math.exp(1.0)))) / 3
    assert float(losses.bradley_terry_loss(chosen, rejected, 3.0, margin)) == pytest.approx(expected, rel=1e-6)
    assert losses.pair_accuracy(chosen, rejected).tolist() == [1.0, 0.0, 0.0]


def test_a_trained_reward_model_loads_as_a_reward_group_scoring_normalised(tmp_path, base_dir, tok):
    """train-rm's export: the score statistics beside the head; a reward group's forward (the worker's own code)
    scores (value - mean) / std, which over the training responses has mean 0 and std 1."""
    from rlhf_sg.workers import ModelWorker

    cfg = _cfg("rm", base_dir, _write(tmp_path / "p.jsonl", _prefs()), tmp_path / "rm", batch_size=4, lr=1e-3)
    history = train_rm(cfg)
    out = os.path.join(cfg.log.output_dir, "final_hf")
    with open(os.path.join(out, REWARD_NORMALIZATION_FILE)) as f:
        stats = json.load(f)
    assert stats == {"mean": history[-1]["rm/score_mean"], "std": history[-1]["rm/score_std"]}
    rm = ValueHeadModel.from_pretrained(out).eval()
    assert (rm.reward_mean, rm.reward_std) == (stats["mean"], stats["std"])
    data = load_stage_rows(cfg.data.train_data, "rm", tok, eos_ids(tok), cfg.data)
    batch = make_batch(data, tok.pad_token_id)
    # the PPO layout: prompt | completion through its end token, read at the row's last real token
    ends = [r.last_response_index + 1 for r in data.rows]
    seqs = torch.full((len(ends), max(ends)), tok.pad_token_id)
    attn = torch.zeros_like(seqs)
    for i, (r, e) in enumerate(zip(data.rows, ends)):
        seqs[i, :e], attn[i, :e] = torch.tensor(r.ids[:e]), 1
    rollout = SimpleNamespace(sequences=seqs, attention_mask=attn, response_width=1,
                              rows=lambda idx: SimpleNamespace(sequences=seqs[idx], attention_mask=attn[idx]))
    worker = SimpleNamespace(engine=rm, module=rm, spec=SimpleNamespace(role="reward", lora=None),
                             sequence_parallel=None)
    _, scores = ModelWorker.forward(worker, rollout, [list(range(len(ends)))])
    _, raw = score_rows(rm, batch, [list(range(batch.batch_size))], "score")
    torch.testing.assert_close(scores, (raw - stats["mean"]) / stats["std"], atol=1e-5, rtol=0)
    assert float(scores.mean()) == pytest.approx(0.0, abs=1e-4) and float(scores.std()) == pytest.approx(1.0, 1e-4)


# ---- DPO -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_dpo_starts_at_ln2_with_zero_margins(tmp_path, base_dir, lora_rank):
    """The first step's loss (its forward before the update, in train mode, the model's dropout zeroed) and the
    held-out loss before training are ln 2 with every margin 0: the reference's log-probs are the policy's. With
    LoRA the separate reference (the base) scores as the policy with its fresh adapters does."""
    cfg = _cfg("dpo", base_dir, _write(tmp_path / "p.jsonl", _prefs()), tmp_path / "dpo", batch_size=4, max_steps=1)
    cfg.data.eval_fraction = 0.25
    cfg.lora.rank = lora_rank
    first, step1 = train_dpo(cfg)
    for record, prefix in ((first, "eval"), (step1, "train")):
        assert record[f"{prefix}/loss"] == pytest.approx(losses.LN2, abs=1e-6)
        assert record[f"{prefix}/margin"] == pytest.approx(0.0, abs=1e-6)
        assert record[f"{prefix}/rewards_chosen"] == pytest.approx(0.0, abs=1e-6)


def test_reference_log_probs_are_eval_mode_and_cached_by_rows_dtype_and_truncation(tmp_path, tok, base_dir):
    """A reference with dropout (not disabled) scores as in eval mode, twice alike; the cache key changes with the
    rows, the dtype and the truncation settings, and a second call reads the cache."""
    dropout_dir = str(tmp_path / "dropout")
    model = build_tiny_model("qwen2", "tiny", seed=1, vocab_size=len(tok))
    model.config.attention_dropout = 0.5
    model.save_pretrained(dropout_dir)
    tok.save_pretrained(dropout_dir)
    cfg = _cfg("dpo", dropout_dir, _write(tmp_path / "p.jsonl", _prefs(4)), tmp_path / "ref", disable_dropout=False)
    data = load_stage_rows(cfg.data.train_data, "dpo", tok, eos_ids(tok), cfg.data)
    batch = make_batch(data, tok.pad_token_id)
    (ref,) = reference_logps(cfg, [batch], [data.fingerprint()])
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(dropout_dir).eval()
    _, expected = score_rows(reloaded, batch, [list(range(batch.batch_size))], "logp")
    torch.testing.assert_close(ref, expected, atol=1e-5, rtol=0)
    key = reference_cache_key(cfg, [data.fingerprint()])
    assert os.path.isfile(os.path.join(cfg.log.output_dir, "ref_logp", key + ".pt"))
    torch.save([torch.full_like(ref, 7.0)], os.path.join(cfg.log.output_dir, "ref_logp", key + ".pt"))
    assert float(reference_logps(cfg, [batch], [data.fingerprint()])[0][0]) == 7.0  # read, not recomputed
    keys = {key}
    for change in ("dtype", "max_len", "overlong", "rows"):
        other = _cfg("dpo", dropout_dir, cfg.data.train_data, tmp_path / "ref", disable_dropout=False)
        fingerprints = [data.fingerprint()]
        if change == "dtype":
            other.model.dtype = "bfloat16"
        elif change == "max_len":
            other.data.max_len = 512
        elif change == "overlong":
            other.data.overlong = "truncate"
        else:
            fingerprints = [data.select([0]).fingerprint()]
        keys.add(reference_cache_key(other, fingerprints))
    assert len(keys) == 5


def test_dpo_and_ipo_losses_on_hand_values():
    pc, pr, rc, rr = (torch.tensor([v]) for v in (-1.0, -3.0, -2.0, -2.0))  # logits = 2 - 0
    loss, m = losses.dpo_loss(pc, pr, rc, rr, beta=0.5, normalizer=1.0)
    assert float(loss) == pytest.approx(math.log(1 + math.exp(-1.0)))
    assert float(m["margin"]) == pytest.approx(1.0) and float(m["accuracy"]) == 1.0
    ipo, _ = losses.dpo_loss(pc, pr, rc, rr, beta=0.5, normalizer=1.0, ipo=True)
    assert float(ipo) == pytest.approx((2.0 - 1.0) ** 2)
    smooth, _ = losses.dpo_loss(rc, rr, rc, rr, beta=0.5, normalizer=1.0, label_smoothing=0.2)
    assert float(smooth) == pytest.approx(losses.LN2)
    logp, mask = torch.tensor([[-1.0, -3.0, 0.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    assert float(losses.sequence_logp(logp, mask, True)) == -2.0
    assert float(losses.sequence_logp(logp, mask, False)) == -4.0


# ---- the runs and their config -----------------------------------------------------------------------------------


def test_sft_lowers_the_held_out_loss_and_exports_a_causal_lm(tmp_path, base_dir):
    cfg = _sft_cfg(tmp_path, base_dir, lr=3e-3)
    history = train_sft(cfg)
    assert history[0]["data/rows"] == 20 and history[-1]["eval/loss"] < history[0]["eval/loss"] - 0.5
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(os.path.join(cfg.log.output_dir, "final_hf"))
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    moved = [n for n, p in exported.named_parameters() if not torch.equal(p, base.get_parameter(n))]
    assert moved, "the export holds the base model's weights, not the trained ones"
    with open(os.path.join(cfg.log.output_dir, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == list(range(len(history)))


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_resume_repeats_the_uninterrupted_run(tmp_path, base_dir, lora_rank):
    """Also with LoRA, whose checkpoints hold the adapters and their optimizer state alone."""
    data = _write(tmp_path / "p.jsonl", _prefs())

    def cfg(out, steps):
        c = _cfg("dpo", base_dir, data, tmp_path / out, batch_size=4, max_steps=steps, lr=1e-3)
        c.lora.rank = lora_rank
        return c

    whole = train_dpo(cfg("a", 4))
    first = cfg("b", 2)
    first.log.save_steps = 1
    train_dpo(first)
    # the first run's last checkpoint is step 1 (step 2 was its end); a resume with 4 steps goes on from there
    resumed = cfg("b", 4)
    resumed.log.resume = True
    history = train_dpo(resumed)
    assert [h["step"] for h in history] == [2, 3, 4]
    for got, want in zip(history, whole[2:]):
        assert got["train/loss"] == pytest.approx(want["train/loss"], abs=1e-6)


@pytest.mark.parametrize("argv, message", [
    (["--rm.center_coef", "1"], r"unknown flag --rm\.center_coef"),
    (["--dpo.loss", "ipo"], r"--dpo\.loss must be one of dpo_summed, dpo_length_normalized"),
    (["--dpo.loss", "ipo_summed", "--dpo.label_smoothing", "0.1"], r"label_smoothing applies to the sigmoid"),
    (["--model.dtype", "bfloat16"], r"bfloat16 trains under DeepSpeed"),
    (["--data.overlong", "cut"], r"--data\.overlong must be one of drop, error, truncate"),
])
def test_stage_flags_are_checked_before_anything_loads(tmp_path, base_dir, argv, message):
    data = _write(tmp_path / "p.jsonl", _prefs(2))
    with pytest.raises(ConfigError, match=message):
        parse_stage_args("dpo", ["--model", base_dir, "--data", data] + argv)


# ---- LoRA ------------------------------------------------------------------------------------------------------


@pytest.fixture
def kept_ranks(monkeypatch):
    """The ranks each stage run starts, kept alive after the run (their shutdown skipped) for a test to read."""
    from rlhf_sg.stages import run
    from rlhf_sg.stages.ranks import LocalRank

    started = []

    def start(spec, in_process):
        started.append(real(spec, in_process))
        return started[-1]

    real = run.start_ranks
    monkeypatch.setattr(run, "start_ranks", start)
    monkeypatch.setattr(LocalRank, "shutdown", lambda self: None)
    return started


def _frozen_weights_unchanged(trained, base):
    """Every parameter of the PEFT model ``trained`` but the adapters (and a value head) equals ``base``'s, bit for
    bit; returns the names compared."""
    from rlhf_sg.lora import merged_name

    names = []
    for name, param in trained.named_parameters():
        if "lora_" in name or "value_head" in name:
            continue
        assert torch.equal(param, base.get_parameter(merged_name(name))), name
        names.append(name)
    return names


def test_lora_sft_trains_the_adapters_alone_and_exports_the_merged_causal_lm(tmp_path, base_dir, kept_ranks):
    """--lora.rank: the held-out loss falls, every base weight stays bit-identical, and final_hf is a plain causal LM
    (no PEFT names: train-ppo's --model.pretrain loads it) whose logits are the trained adapter model's."""
    from transformers import AutoModelForCausalLM

    from rlhf_sg.config import _check_model_dir

    cfg = _sft_cfg(tmp_path, base_dir, lr=1e-2)
    cfg.lora.rank, cfg.lora.alpha, cfg.lora.target_modules = 8, 16.0, "q_proj,v_proj,up_proj,down_proj"
    history = train_sft(cfg)
    assert history[-1]["eval/loss"] < history[0]["eval/loss"] - 0.5
    (rank,) = kept_ranks
    trained = rank.model.eval()
    assert {n for n, p in trained.named_parameters() if p.requires_grad} == {
        n for n, _ in trained.named_parameters() if ".lora_A." in n or ".lora_B." in n}
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    assert len(_frozen_weights_unchanged(trained, base)) == len(list(base.parameters()))
    out = os.path.join(cfg.log.output_dir, "final_hf")
    _check_model_dir("--model.pretrain", out)
    exported, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not os.path.exists(os.path.join(out, "adapter_config.json"))
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    with torch.no_grad():
        want = trained(input_ids=ids).logits
        torch.testing.assert_close(exported.eval()(input_ids=ids).logits, want, atol=1e-5, rtol=0)
        assert not torch.allclose(base.eval()(input_ids=ids).logits, want, atol=1e-3)


def test_lora_reward_model_trains_adapters_and_head_and_exports_the_merged_value_model(tmp_path, base_dir, tok,
                                                                                        kept_ranks):
    """train-rm --lora.rank: the adapters and the value head train (the head gets no adapter), the backbone stays
    bit-identical; the export loads as --reward.kind model does (ValueHeadModel.from_pretrained) and scores as the
    trained model, with its statistics."""
    cfg = _cfg("rm", base_dir, _write(tmp_path / "p.jsonl", _prefs()), tmp_path / "rm", batch_size=4, lr=1e-2)
    cfg.lora.rank = 4
    cfg.train.packing_probe = True  # the start-up probe reads the value model inside the adapters' wrapper
    history = train_rm(cfg)
    (rank,) = kept_ranks
    trained = rank.model.eval()
    names = {n for n, p in trained.named_parameters() if p.requires_grad}
    head = {n for n in names if "value_head" in n}
    assert head == {"base_model.model.value_head.weight"}
    assert names - head == {n for n, _ in trained.named_parameters() if ".lora_A." in n or ".lora_B." in n}
    base = ValueHeadModel.from_pretrained(base_dir)
    assert len(_frozen_weights_unchanged(trained, base)) == len(list(base.model.parameters()))
    out = os.path.join(cfg.log.output_dir, "final_hf")
    rm = ValueHeadModel.from_pretrained(out).eval()
    assert (rm.reward_mean, rm.reward_std) == (history[-1]["rm/score_mean"], history[-1]["rm/score_std"])
    data = load_stage_rows(cfg.data.train_data, "rm", tok, eos_ids(tok), cfg.data)
    batch = make_batch(data, tok.pad_token_id)
    plan = [list(range(batch.batch_size))]
    _, want = score_rows(trained, batch, plan, "score")
    torch.testing.assert_close(score_rows(rm, batch, plan, "score")[1], want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("argv, message", [
    (["--lora.use_dora", "true"], r"--lora\.use_dora: DoRA .* is not supported"),
    (["--lora.rank", "4", "--lora.target_modules", "q_proj,lm_head"], r"--lora\.target_modules names \['lm_head'\]"),
    (["--lora.rank", "4", "--lora.alpha", "0"], r"--lora\.alpha must be > 0"),
    (["--lora.sync_mode", "adapter"], r"--lora\.sync_mode is how train-ppo's rollout engines get the adapter; a "
                                      r"stage has no engines"),
    (["--lora.init_adapter", "a"], r"--lora\.init_adapter is not read by the stages"),
])
def test_lora_flags_are_checked_as_train_ppo_checks_them(tmp_path, base_dir, argv, message):
    data = _write(tmp_path / "p.jsonl", _prefs(2))
    with pytest.raises(ConfigError, match=message):
        parse_stage_args("rm", ["--model", base_dir, "--data", data] + argv)


def test_the_cli_names_the_bad_row(tmp_path, base_dir, capsys):
    from rlhf_sg.cli import main

    data = _write(tmp_path / "p.jsonl", _prefs(2) + [{"prompt": "x", "chosen": "a"}])
    with pytest.raises(SystemExit, match=r"rlhf-sg train-rm: .*p\.jsonl line 3: key 'rejected' missing"):
        main(["train-rm", "--model", base_dir, "--data", data, "--data.apply_chat_template", "true",
              "--output-dir", str(tmp_path / "o")])
    assert not os.path.exists(tmp_path / "o")  # stopped before the output directory or any model


def test_rendered_rows_carry_their_truncation_into_the_fingerprint():
    a = SimpleNamespace(rows=[Rendered([1, 2, 3], [False, True, True])], pairs=False)
    from rlhf_sg.stages.data import StageRows

    full = StageRows([Rendered([1, 2, 3], [False, True, True])], False)
    cut = StageRows([Rendered([1, 2, 3], [False, True, True], truncated=True)], False)
    assert full.fingerprint() != cut.fingerprint() and a.rows[0].last_response_index == 2


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_a_reward_model_on_two_zero3_ranks_steps_as_one_rank_and_exports_its_statistics(ray_cluster, tmp_path,
                                                                                          base_dir, tok, lora_rank):
    """train-rm on the trainer's ZeRO-3 workers (2 ranks): the step-0 held-out metrics and the first step's loss (one
    normaliser over both ranks) are the in-process rank's, and the gathered export loads with its statistics and
    scores the training responses as the trained ranks did (their mean and std are the logged statistics). With LoRA
    (adapters and the head trained) the export is the merged model, no adapter tensor in it."""
    data = _write(tmp_path / "p.jsonl", _prefs())
    runs = []
    for ranks in (1, 2):
        cfg = _cfg("rm", base_dir, data, tmp_path / f"rm{ranks}", batch_size=4, max_steps=1, lr=1e-3,
                   num_ranks=ranks)
        cfg.data.eval_fraction = 0.25
        cfg.lora.rank = lora_rank
        runs.append(train_rm(cfg))
    (first1, step1), (first2, step2) = runs
    assert first2["eval/accuracy"] == first1["eval/accuracy"]
    assert first2["eval/loss"] == pytest.approx(first1["eval/loss"], abs=1e-5)
    assert step2["train/loss"] == pytest.approx(step1["train/loss"], abs=1e-5)
    assert step2["train/grad_norm"] == pytest.approx(step1["train/grad_norm"], rel=1e-4)
    rm = ValueHeadModel.from_pretrained(str(tmp_path / "rm2" / "final_hf"))
    assert (rm.reward_mean, rm.reward_std) == (step2["rm/score_mean"], step2["rm/score_std"])
    from rlhf_sg.stages.run import load_data

    batch = make_batch(load_data(cfg, tok)[0], tok.pad_token_id)  # the training pairs (the held-out ones left out)
    _, scores = score_rows(rm.eval(), batch, [list(range(batch.batch_size))], "score")
    assert float(scores.mean()) == pytest.approx(step2["rm/score_mean"], abs=1e-5)
    assert float(scores.std()) == pytest.approx(step2["rm/score_std"], abs=1e-5)
    exported, base = _safetensors(str(tmp_path / "rm2" / "final_hf")), _safetensors(base_dir)
    assert not any("lora" in k for k in exported)
    assert not torch.equal(exported["layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])


def test_a_held_out_set_smaller_than_the_ranks_is_refused_before_any_rank_starts(tmp_path, base_dir):
    from rlhf_sg.config import ConfigError

    rows = [{"messages": [{"role": "user", "content": f"What is {a}+1?"},
                          {"role": "assistant", "content": f"{a + 1}."}]} for a in range(10)]
    cfg = _cfg("sft", base_dir, _write(tmp_path / "sft.jsonl", rows), tmp_path / "sft", num_ranks=2)
    cfg.data.eval_fraction = 0.1  # one held-out row for two ranks
    with pytest.raises(ConfigError, match=r"--data.eval_data / --data.eval_fraction: 1 usable rows for "
                                          r"--train.num_ranks 2"):
        train_sft(cfg)
    assert not os.path.exists(os.path.join(cfg.log.output_dir, "config.json"))  # nothing started or written


def test_a_dpo_reference_with_another_tokenizer_is_refused_before_anything_loads(tmp_path, base_dir, tok):
    from rlhf_sg.config import ConfigError
    from rlhf_sg.stages.config import validate_stage

    other = str(tmp_path / "other")
    build_tiny_model("qwen2", "tiny", seed=1, vocab_size=len(tok) + 8).save_pretrained(other)
    tok.save_pretrained(other)
    cfg = _cfg("dpo", base_dir, _write(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}]),
               tmp_path / "dpo")
    cfg.model.ref_pretrain = other
    with pytest.raises(ConfigError, match=r"--model.ref_pretrain: .*padded vocab size .* in the reference's"):
        validate_stage(cfg)
    cfg.model.ref_pretrain = base_dir
    validate_stage(cfg)


def _safetensors(path):
    from safetensors.torch import load_file

    return {k: v for f in sorted(os.listdir(path)) if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(path, f)).items()}


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_a_resumed_run_on_two_zero3_ranks_repeats_the_uninterrupted_run(ray_cluster, tmp_path, base_dir, lora_rank):
    """train-rm on the Ray group (2 ZeRO-3 ranks): a run resumed from the step-2 checkpoint (what a run stopped after
    step 2 leaves; copied into a fresh output directory) to step 4 logs the uninterrupted 4-step run's step 3 and 4
    metrics (the steps cross an epoch: 9 training pairs, 4 a step) and the same held-out metrics, and exports the same
    weights, head and score statistics. With LoRA the checkpoint holds the adapters and the head alone."""
    import shutil

    data = _write(tmp_path / "p.jsonl", _prefs())

    def run(out, save_steps=0, resume=False):
        cfg = _cfg("rm", base_dir, data, tmp_path / out, batch_size=4, max_steps=4, lr=1e-3, num_ranks=2)
        cfg.data.eval_fraction = 0.25
        cfg.log.save_steps, cfg.log.resume = save_steps, resume
        cfg.lora.rank = lora_rank
        return train_rm(cfg)

    whole = run("a", save_steps=2)  # its only checkpoint: step 2 (step 4 is the export)
    shutil.copytree(tmp_path / "a" / "checkpoints", tmp_path / "b" / "checkpoints")
    if lora_rank:  # smaller than the base's weights alone: no frozen weight in it
        saved = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tmp_path / "b" / "checkpoints")
                    for f in fs)
        assert saved < os.path.getsize(os.path.join(base_dir, "model.safetensors"))
    assert sorted(f for f in os.listdir(tmp_path / "b" / "checkpoints") if f.endswith(".trainer.json")) == [
        "step2.trainer.json"]
    resumed = run("b", resume=True)
    assert [h["step"] for h in resumed] == [3, 4]
    for got, want in zip(resumed, whole[3:]):
        for key in ("train/loss", "train/accuracy", "train/margin", "train/grad_norm"):
            assert got[key] == pytest.approx(want[key], abs=1e-6), key
    for key in ("eval/loss", "eval/accuracy", "eval/reward_mean", "rm/score_mean", "rm/score_std"):
        assert resumed[-1][key] == pytest.approx(whole[-1][key], abs=1e-6), key
    got, want = (_safetensors(str(tmp_path / out / "final_hf")) for out in ("b", "a"))
    assert got.keys() == want.keys() and "value_head.weight" in got
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=0, msg=name)
