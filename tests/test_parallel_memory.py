"""The SP memory formulas (:mod:`rlhf_sg.parallel.memory`, what ``python -m rlhf_sg.bench memory --sp N`` prints) held
to the tensors the sharded path builds at small sizes, in one process: each rank's columns from
:func:`rlhf_sg.parallel.layout.shard_packed`, the full rows' mask from ``rlhf_sg.packing._block_causal_mask``, the
model run through the Ulysses wrapper on those columns. The all-to-all is the one boundary faked (one process cannot
run a group of two): the fake returns a new tensor of its input's shape, as DeepSpeed's ``_dim_zero_all_to_all``
does (``torch.empty_like`` filled by ``all_to_all_single``), so the shapes and storages are the real path's and only
the values differ."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf_sg import memory
from rlhf_sg.packing import _block_causal_mask, pack
from rlhf_sg.parallel import memory as sp_memory
from rlhf_sg.parallel import ulysses
from rlhf_sg.parallel.forward import _response_tokens
from rlhf_sg.parallel.layout import shard_packed
from rlhf_sg.parallel.ulysses import SequenceParallelGroup, use_ulysses_attention
from rlhf_sg.tiny import tiny_config


def _exchange_of_one_process(group, chunks: torch.Tensor) -> torch.Tensor:
    assert chunks.shape[0] == group.size  # the real exchange's contract: dim 0 is the group
    return chunks.clone()


def _model(heads: int, kv_heads: int, checkpointing: bool):
    config = tiny_config("qwen2")
    config = type(config)(**{**config.to_dict(), "num_hidden_layers": 3, "layer_types": None,
                             "num_attention_heads": heads, "num_key_value_heads": kv_heads})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    use_ulysses_attention(model, 2)
    shape = memory.ModelShape.from_hf_config({**config.to_dict(), "model_type": "qwen2"}, dtype="bfloat16")
    return model, shape


def _batch(several_per_row: bool):
    """Packed rows of 37 tokens (odd: N = 2 adds a pad column): two rows each packing two sequences, or one row
    of one sequence."""
    lengths = [[20, 17], [25, 12]] if several_per_row else [[37]]
    sequences = torch.randint(3, 90, (sum(map(len, lengths)), 37), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.zeros_like(sequences)
    for i, n in enumerate(n for row in lengths for n in row):
        attention_mask[i, :n] = 1
    batch = pack(sequences, attention_mask, row_tokens=37)
    assert batch.input_ids.shape == (len(lengths), 37)
    return batch


def _saved_by_a_rank(model, batch, size: int, rank: int, several_per_row: bool) -> tuple[int, int, tuple]:
    """The activation bytes autograd keeps for one rank's training forward of its columns (distinct storages,
    parameters and mask left out), the bytes of the full rows' mask the rank built, and its columns' shape."""
    rows = shard_packed(batch, size, rank)
    mask = _block_causal_mask(rows.full_position_ids, torch.bfloat16) if several_per_row else None
    group = SequenceParallelGroup(group=None, size=size, rank=rank, causal=not several_per_row)
    with memory.saved_for_backward(model) as saved:
        model.model(input_ids=rows.input_ids, position_ids=rows.position_ids, attention_mask=mask,
                    sequence_parallel=group, use_cache=False)
    mask_bytes = 0
    if mask is not None:  # the one storage every layer saves (with checkpointing the checkpoints' input)
        mask_bytes = mask.untyped_storage().nbytes()
        assert saved.pop(mask.untyped_storage().data_ptr(), mask_bytes) == mask_bytes
    return sum(saved.values()), mask_bytes, tuple(rows.input_ids.shape)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (8, 4)], ids=["kv-replicated-at-2", "kv-split-at-2"])
@pytest.mark.parametrize("several_per_row", [True, False], ids=["packed-mask", "one-sequence-causal"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["all-layers", "checkpointed"])
def test_a_ranks_activations_and_mask_are_the_formulas_bytes(monkeypatch, heads, kv_heads, several_per_row,
                                                             checkpointing):
    """Every rank of N = 1 and 2 keeps exactly the formula's bytes: its columns' norms and MLP, the whole padded rows
    for its heads after the all-to-all (key / value heads repeated where sdpa takes a mask, one replicated where
    fewer than N), o_proj's input back on its columns; and the full rows' mask on EVERY rank, not divided by N."""
    monkeypatch.setattr(ulysses, "_exchange", _exchange_of_one_process)
    model, shape = _model(heads, kv_heads, checkpointing)
    batch = _batch(several_per_row)
    rows, length = batch.input_ids.shape
    for size in (1, 2):
        for rank in range(size):
            activations, mask, columns = _saved_by_a_rank(model, batch, size, rank, several_per_row)
            assert columns == (rows, sp_memory.rank_columns(length, size))
            formula = sp_memory.saved_activation_bytes(shape, rows, length, size, checkpointing, several_per_row)
            assert activations == formula, (size, rank)
            assert mask == sp_memory.mask_bytes(shape, rows, length, size, several_per_row), (size, rank)
    # the mask is the full padded rows' on each rank (38 columns at N = 2, the key axis allocated to 48)
    if several_per_row:
        assert sp_memory.mask_bytes(shape, rows, length, 2, True) == rows * 38 * 48 * 2


def test_a_ranks_logits_are_one_chunk_of_its_response_columns():
    """The response tokens a rank projects (``_response_tokens``, what ``sp_response_logprobs`` chunks): one row of a
    1-token prompt and a 32-token response, 33 columns padded to 34 at N = 2; rank 0's 17 columns all predict a
    response token, so its largest chunk is ``min(chunk_tokens, columns)``, the formula's; at N = 1 one chunk of 8."""
    sequences = torch.randint(3, 90, (1, 33), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(sequences)
    batch = pack(sequences, attention_mask, row_tokens=33)
    for size, chunk in ((1, 8), (2, 8), (2, 32)):
        largest = 0
        for rank in range(size):
            local, labels, _ = _response_tokens(batch, shard_packed(batch, size, rank), attention_mask, 32)
            assert len(local) <= sp_memory.rank_columns(33, size)
            largest = max(largest, min(chunk, len(local)))
        assert largest == sp_memory.logits_tokens(33, size, chunk), (size, chunk)
    assert sp_memory.training_rank_bytes(memory.PRESETS["qwen2.5-7b"], 8, 1, 33, 2, False,
                                         chunk_tokens=32)["logits"] == memory.logits_chunk_bytes(
        memory.PRESETS["qwen2.5-7b"], 17)


def test_long_rows_per_rank_fall_with_n_but_the_mask_does_not():
    """Qwen2.5-32B, 128k tokens of packed sequences on sdpa with gradient checkpointing: the activations at N = 8 are
    about an eighth of N = 1's (N = 8 keeps one o_proj input more in the recomputed layer, and one key / value head
    where N = 1 repeats its 8 to 40), the mask 32 GiB on every rank whatever N; flash varlen has none."""
    shape = memory.PRESETS["qwen2.5-32b"]
    one, eight = (sp_memory.training_rank_bytes(shape, 64, 1, 131072, n, True) for n in (1, 8))
    assert 0.11 < eight["activations"] / one["activations"] < 0.14
    assert one["mask"] == eight["mask"] == 131072 * 131072 * 2 == 32 * 2**30
    assert sp_memory.training_rank_bytes(shape, 64, 1, 131072, 8, True, "flash_attention_2")["mask"] == 0
    assert not sp_memory.splits(memory.PRESETS["qwen2.5-7b"], 8)  # 28 heads: 8 ranks cannot split them


def test_bench_memory_prints_the_sp_table(capsys):
    """``--sp``: a row per N and length, the refusal where the heads cannot split."""
    from rlhf_sg.bench.memory import main

    main(["--model-config", "qwen2.5-7b", "--sp", "1", "8", "--sp-seq-len", "32768", "--gradient-checkpointing"])
    out = capsys.readouterr().out
    assert "| 32768 | 1 |" in out
    assert "| 32768 | 8 | refused: 28 query / 4 key-value heads split over 1, 2, 4, 28 |" in out


def test_bench_sp_memory_refuses_a_size_the_preset_cannot_split(capsys):
    from rlhf_sg.bench.sp_memory import main

    with pytest.raises(SystemExit):
        main(["--sizes", "1", "3"])
    assert "--sizes [3]: the tiny preset's heads split over 1, 2, 4" in capsys.readouterr().err


#: the row of the measured check: long enough that the per-row constants (token ids, one key / value head
#: replicated) are small beside what splits, short enough for seconds a rank
MEASURED_ROW = 2048


@pytest.mark.slow
def test_a_ranks_measured_activations_for_one_long_row_fall_as_one_over_n():
    """``python -m rlhf_sg.bench sp-memory``'s measurement: N = 1, 2 and 4 gloo ranks (spawned) run the forward and
    backward of one row of 2048 tokens; what each rank's autograd graph saves is at least 1 / N of one rank's and
    within 15 % above it (the parts that do not split: o_proj's input back on the rank's columns, the full row's
    token ids, a key / value head replicated at N = 4), and the formula's decoder bytes are the measurement's up to
    the log-prob head's inputs (under 4 %; under 0.1 % on rank 0, whose columns predict one response token)."""
    from rlhf_sg.bench import sp_memory

    measured = sp_memory.run("tiny", MEASURED_ROW, [1, 2, 4], timeout_s=120)
    print("\n".join(sp_memory.lines("tiny", MEASURED_ROW, measured)))
    (alone,) = measured[1]
    for size, per_rank in measured.items():
        formula = sp_memory.formula_bytes("tiny", MEASURED_ROW, size)
        assert 1 / size <= formula / sp_memory.formula_bytes("tiny", MEASURED_ROW, 1) < 1.15 / size, size
        for rank, got in enumerate(per_rank):
            assert 1 / size <= got / alone < 1.15 / size, (size, rank, got / alone)
            assert 1 <= got / formula < 1.04, (size, rank, got / formula)
        if size > 1:  # rank 0's columns are the prompt's first half: one response predictor, the last
            print(f"N = {size}, rank 0: measured - formula = {per_rank[0] - formula} bytes")
            assert per_rank[0] / formula < 1.001, (size, per_rank[0] - formula)
