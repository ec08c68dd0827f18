"""The model-family matrix: every training layout gives what each row gives alone, or falls back to one that does.

Tiny random-weight float32 models of each family (:data:`rlhf_sg.tiny.FAMILIES`, built from config classes),
a rollout batch whose sequences are longer than the families' window (4) and two of which share a packed row.
On 877c2e3's packing code this failed: Mistral/Mixtral/Phi-3 max |Δlogp| 0.078/0.14/0.076 (window ignored),
Qwen3.5 4e-4 packed / 2e-3 shared and Qwen3-Next 2e-3 / 1.3e-2 (recurrent state across sequences), Gemma-3 and
windowed Qwen2 refused, Bloom crashed.
"""

from __future__ import annotations

import functools
import logging
import re

import pytest
from torch import nn

from rlhf_sg.bench.models import LAYOUTS, TOLERANCE, check_family
from rlhf_sg.packing import _FALLBACKS_LOGGED, one_sequence_per_row_reason
from rlhf_sg.tiny import FAMILIES

#: families that cannot hold two sequences in a row: recurrent layers (Qwen3.5, Qwen3-Next) or ALiBi (Bloom)
ONE_PER_ROW = {"qwen3.5", "qwen3-next", "bloom"}
#: families refused on the matrix batch: LongRoPE whose sequences lie on both sides of its original length
REFUSED = {"phi-3-longrope": "its longrope RoPE takes one set of frequencies per forward from the longest sequence "
                             "(20 tokens, over original_max_position_embeddings=16), which a sequence of 8 tokens "
                             "alone would not use"}


@functools.cache
def _matrix(family: str):
    return check_family(family)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_layout_equals_rows_alone(family, layout):
    """Log-probs, entropy, critic values and log-prob gradients of the layout equal each row run alone through
    the model's own forward (float32 rounding), exactly where the family can pack, by falling back where not."""
    verdict, delta_logp, delta = _matrix(family)[layout]
    if family in REFUSED:
        assert verdict.startswith("refused: ") and REFUSED[family] in verdict, verdict
        return
    assert verdict == ("fell back" if family in ONE_PER_ROW else "exact"), (verdict, delta_logp, delta)
    assert delta <= TOLERANCE


#: layers of each 2-layer family that compute shared-prompt rows block by block: every layer of the plain
#: full-attention families; none where every layer is windowed (Mistral, Mixtral, Phi-3, Starcoder2, windowed Qwen2),
#: softcapped (Gemma-2) or has sinks (gpt-oss), or the model takes one sequence per row; the full layer of the
#: sliding/full pairs (Gemma-3, Cohere2)
BLOCK_LAYERS = {"llama-3": 2, "qwen2": 2, "qwen3": 2, "qwen3-moe": 2, "gpt-2": 2, "olmo-2": 2, "gemma-3": 1,
                "cohere2": 1}


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in REFUSED])
def test_the_blocks_take_the_layers_whose_attention_they_describe(family):
    """The ``blocks`` layout is exact for every family (above); this says where it saves the mask's square."""
    taken, layers, _ = _matrix(family)["block layers"]
    assert (int(taken), int(layers)) == (BLOCK_LAYERS.get(family, 0), 2)


@pytest.mark.parametrize("lengths", [(12, 16, 9, 14), (17, 20, 18, 23)], ids=["within", "beyond"])
def test_longrope_is_exact_when_every_sequence_is_on_one_side_of_its_original_length(lengths):
    """LongRoPE's frequencies follow the forward's longest sequence: a batch all within original_max_position_embeddings
    (short factors) or all beyond it (long factors) gives each row what it gives alone, packed and shared."""
    import torch

    from rlhf_sg.bench.models import alone
    from rlhf_sg.packing import response_logprobs
    from rlhf_sg.tiny import LONGROPE_ORIGINAL, tiny_family_model

    model = tiny_family_model("phi-3-longrope")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (5,), generator=gen), torch.randint(3, 128, (7,), generator=gen)]
    rows = [(prompts[b // 2], n - len(prompts[b // 2])) for b, n in enumerate(lengths)]
    width = max(n for _, n in rows)
    sequences = torch.zeros(4, 7 + width, dtype=torch.long)
    mask = torch.zeros_like(sequences)
    for b, (prompt, n) in enumerate(rows):
        sequences[b, 7 - len(prompt) : 7] = prompt
        sequences[b, 7 : 7 + n] = torch.randint(3, 128, (n,), generator=gen)
        mask[b, 7 - len(prompt) : 7 + n] = 1
    assert (min(lengths) > LONGROPE_ORIGINAL) == (max(lengths) > LONGROPE_ORIGINAL)
    with torch.no_grad():
        ref, _, _ = alone(model, sequences, mask, width)
        for share in (False, True):
            got = response_logprobs(model, sequences, mask, width, share_prompts=share)
            assert (got - ref).abs().max() <= TOLERANCE, share


def test_fallback_is_logged_once_with_its_reason(caplog):
    """A recurrent model's fallback names the layer type that forced it, once per model class and layout."""
    from rlhf_sg.bench.models import rollout_batch
    from rlhf_sg.packing import response_logprobs
    from rlhf_sg.tiny import tiny_family_model

    _FALLBACKS_LOGGED.clear()
    model = tiny_family_model("qwen3.5")
    sequences, mask, width = rollout_batch()
    with caplog.at_level(logging.WARNING, logger="rlhf_sg.packing"):
        for _ in range(2):
            response_logprobs(model, sequences, mask, width, share_prompts=True)
    messages = [r.getMessage() for r in caplog.records if "falls back" in r.getMessage()]
    reason = "Qwen3_5ForCausalLM: config.layer_types holds 'linear_attention' layers"
    assert messages == [f"{reason}, so share_prompts falls back to one sequence per row",
                        f"{reason}, so packing falls back to one sequence per row"]


def test_recurrent_mixer_found_in_the_module_tree():
    """Without layer_types, a token mixer that is not attention is found by its module class."""

    class Config:
        model_type = "hybrid"

    class JambaMambaMixer(nn.Module):
        pass

    class Hybrid(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = Config()
            self.layers = nn.ModuleList([nn.Linear(2, 2), JambaMambaMixer()])

    class FalconH1Mixer(nn.Module):
        pass

    class GptOssMLP(nn.Module):  # "ssm" inside "GptOssMLP": not a state-space layer
        pass

    assert one_sequence_per_row_reason(Hybrid()) == "layers.1 is a JambaMambaMixer (not attention)"
    plain = Hybrid()
    plain.layers = nn.ModuleList([nn.Linear(2, 2), GptOssMLP()])
    assert one_sequence_per_row_reason(plain) is None
    plain.layers.append(FalconH1Mixer())
    assert one_sequence_per_row_reason(plain) == "layers.2 is a FalconH1Mixer (not attention)"


@pytest.mark.parametrize("share_prompts", [False, True])
def test_one_mask_storage_reaches_every_layer_in_the_model_dtype(monkeypatch, share_prompts):
    """The packed and shared-prompt forwards build the dense mask once: every layer's sdpa call gets the same
    storage, additive in the model's dtype (no per-layer bool -> float conversion), its key axis padded to a
    multiple of 16 (torch's memory-efficient kernel would copy an unaligned mask on every call)."""
    import torch

    from rlhf_sg.bench.models import rollout_batch
    from rlhf_sg.packing import response_logprobs
    from rlhf_sg.tiny import tiny_family_model

    model = tiny_family_model("qwen2").to(torch.bfloat16)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    seen = []

    def recording_sdpa(query, key, value, attn_mask=None, **kwargs):
        seen.append(attn_mask)
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    sequences, mask, width = rollout_batch()
    response_logprobs(model, sequences, mask, width, share_prompts=share_prompts)
    assert len(seen) == model.config.num_hidden_layers
    assert len({m.data_ptr() for m in seen}) == 1
    for m in seen:
        assert m.dtype == torch.bfloat16
        assert m.stride(-2) % 16 == 0 and m.shape[-1] % 16 != 0  # aligned although the rows are not
        assert set(m.unique().tolist()) == {0.0, torch.finfo(torch.bfloat16).min}


@pytest.mark.gpu
def test_a_packed_backward_holds_one_mask_not_one_per_layer():
    """On CUDA (sdpa's memory-efficient kernel, bf16): forward + backward of packed rows of 2001 slots on an
    8-layer model raise peak memory by less than 3 masks, where a mask converted or padded per layer and kept for
    backward would take 8. Proves the one-storage mask on the kernel that used to copy it."""
    import torch

    from rlhf_sg.packing import response_logprobs
    from rlhf_sg.tiny import tiny_family_model

    model = tiny_family_model("qwen2").to("cuda", torch.bfloat16)
    layers = model.model.layers
    model.config.num_hidden_layers, model.config.layer_types = 8, ["full_attention"] * 8
    while len(layers) < 8:  # 8 layers of the same shape, without a new config
        layers.append(type(layers[0])(model.config, len(layers)).to("cuda", torch.bfloat16))
    lengths = [2001, 1000, 1001]  # rows [2001] and [1000, 1001]: 2 rows of 2001 slots, a mask between sequences
    width = max(lengths) - 1
    sequences = torch.zeros(len(lengths), 1 + width, dtype=torch.long, device="cuda")
    mask = torch.zeros_like(sequences)
    for b, n in enumerate(lengths):
        sequences[b, :n] = torch.randint(3, 128, (n,), device="cuda")
        mask[b, :n] = 1
    mask_bytes = 2 * 2016 * 2001 * 2  # R x L_padded x L, bf16
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    logp = response_logprobs(model, sequences, mask, width)
    logp.sum().backward()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < 3 * mask_bytes


def test_a_recurrent_model_under_flash_attention_gets_one_sequence_per_row_and_no_varlen_arguments():
    """flash varlen would lay every sequence into one row, and the recurrent layers would run across them: a
    model with linear-attention layers gets one row per sequence and no cu_seqlens, as a padded batch."""
    import torch
    from test_packing_spec import _Recorder  # tests/ is on the path: the model that records its arguments

    from rlhf_sg.bench.models import rollout_batch
    from rlhf_sg.packing import _pack_for, packed_forward

    model = _Recorder("flash_attention_2", layer_types=["linear_attention", "full_attention"])
    sequences, mask, _ = rollout_batch()
    batch = _pack_for(model, "flash_attention_2", sequences, mask)
    packed_forward(model, batch)
    (kwargs,) = model.calls
    assert kwargs["input_ids"].shape[0] == sequences.shape[0]
    assert not {"cu_seq_lens_q", "cu_seq_lens_k", "attention_mask"} & set(kwargs)
    for b in range(sequences.shape[0]):  # each row: its own tokens from column 0, positions 0, 1, ...
        n = int(mask[b].sum())
        assert torch.equal(kwargs["input_ids"][b, :n], sequences[b][mask[b].bool()])
        assert torch.equal(kwargs["position_ids"][b, :n], torch.arange(n))


# ---- the embedded engine on every family ---------------------------------------------------------------------
ENGINE_NEW_TOKENS = 12


@pytest.mark.parametrize("family", FAMILIES)
def test_embedded_engine_greedy_tokens_and_logprobs_equal_the_models_own(family, tmp_path):
    """Prompts of 2, 4 and 6 tokens decoded together (left-padded in one batch), 12 greedy tokens each, rows longer
    than the windowed families' window: token for token what ``model.generate`` gives each prompt alone, and every
    sampled token's log-prob equal to the model's own forward over that prompt and completion."""
    import torch

    from backends.base import BackendConfig, SamplingParams
    from backends.embedded import EmbeddedBackend
    from rlhf_sg.tiny import LONGROPE_ORIGINAL, save_tiny_model, tiny_family_model

    model = tiny_family_model(family)
    path = save_tiny_model(str(tmp_path / family), model=model)
    engine = EmbeddedBackend(BackendConfig(model_path=path, max_model_len=64, seed=0, num_threads=1))
    prompts = [[5, 6, 7, 8, 9, 10][:n] for n in (2, 4, 6)]
    out = engine.generate(prompts, SamplingParams(n=1, max_new_tokens=ENGINE_NEW_TOKENS, temperature=0.0))
    for prompt, completion in zip(prompts, out):
        if family == "phi-3-longrope":
            # LongRoPE switches every row of a forward to its long factors once the batch's longest row passes its
            # original length (as transformers' generate and vLLM do): compare the steps before the longest
            # prompt's row gets there
            keep = LONGROPE_ORIGINAL - max(len(p) for p in prompts)
            completion.token_ids, completion.logprobs = completion.token_ids[:keep], completion.logprobs[:keep]
        ids = torch.tensor([prompt])
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=ENGINE_NEW_TOKENS,
                                  min_new_tokens=ENGINE_NEW_TOKENS, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(prompt):]
        # the engine stops on the model's end-of-sequence ids; the reference runs on: compare up to the engine's stop
        assert completion.token_ids == expected[: len(completion.token_ids)].tolist(), f"prompt of {len(prompt)}"
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion.token_ids])).logits[0, len(prompt) - 1 : -1]
        own = logits.float().log_softmax(-1).gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(completion.logprobs), own, atol=1e-4), (family, len(prompt))


def test_a_longrope_model_whose_sequences_may_cross_its_original_length_is_refused_before_ray(tmp_path):
    from rlhf_sg.config import Config, ConfigError, validate
    from rlhf_sg.tiny import save_tiny_model, tiny_family_model

    cfg = Config()
    cfg.model.pretrain = save_tiny_model(str(tmp_path / "longrope"), model=tiny_family_model("phi-3-longrope"))
    cfg.data.max_prompt_len, cfg.rollout.max_new_tokens = 8, 9
    with pytest.raises(ConfigError, match=r"--model.pretrain: .* has a longrope RoPE, .* Sequences here reach 17 "
                                          r"tokens; set --data.max_prompt_len \+ --rollout.max_new_tokens <= 16"):
        validate(cfg)
    cfg.rollout.max_new_tokens = 8
    try:
        validate(cfg)
    except ConfigError as e:  # whatever else this minimal config lacks, not the RoPE
        assert "RoPE" not in str(e)


def test_an_adapter_wrapper_gets_its_models_logit_transform_and_an_unknown_wrapper_is_refused():
    """A wrapper that names its model (``get_base_model``, as PEFT's) gets Gemma-2's softcap from the model's own
    forward; a wrapper whose forward does not compute the head itself cannot be read, so a softcap is refused."""
    import torch

    from rlhf_sg.bench.models import rollout_batch
    from rlhf_sg.packing import response_logprobs
    from rlhf_sg.tiny import tiny_family_model

    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        @property
        def base_model(self):
            return self.inner.base_model

        def get_output_embeddings(self):
            return self.inner.get_output_embeddings()

        def forward(self, **kwargs):
            return self.inner(**kwargs)

    class Adapter(Wrapper):
        def get_base_model(self):
            return self.inner

    model = tiny_family_model("gemma-2")
    sequences, mask, width = rollout_batch()
    with torch.no_grad():
        torch.testing.assert_close(response_logprobs(Adapter(model), sequences, mask, width),
                                   response_logprobs(model, sequences, mask, width), rtol=0, atol=0)
        with pytest.raises(ValueError, match="Wrapper: config.final_logit_softcapping=0.5 and the forward's source "
                                             "cannot be read"):
            response_logprobs(Wrapper(model), sequences, mask, width)


def test_a_dynamic_ntk_rope_is_refused_on_a_batch_past_its_length():
    """Dynamic NTK rescales its frequencies for the forward's longest sequence past max_position_embeddings: a
    batch mixing lengths past it is refused (unchecked, the rows here differ from their own by 2.6e-5)."""
    import torch
    import transformers

    from rlhf_sg.bench.models import rollout_batch
    from rlhf_sg.packing import response_logprobs

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                      rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    sequences, mask, width = rollout_batch()
    with pytest.raises(ValueError, match=r"LlamaForCausalLM: its dynamic RoPE takes one set of frequencies per forward "
                                         r"from the longest sequence \(20 tokens, over original_max_position_embeddings"
                                         r"=16\), which a sequence of 8 tokens alone would not use"):
        response_logprobs(model, sequences, mask, width)


# ---- a family the masks cannot express --------------------------------------------------------------------


@functools.cache
def _tiny_llama4():
    """A random-weight float32 Llama-4 text model: chunked attention (blocks of 4 tokens) in its first layer, full
    attention in its second."""
    import torch
    import transformers

    config = transformers.Llama4TextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256, num_local_experts=1,
        interleave_moe_layer_step=1, attention_chunk_size=4, no_rope_layers=[1, 0])
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("share_prompts", [False, True], ids=["packed", "shared"])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [0, 3], [2]], ids=["rows-pack", "one-per-row", "one-row"])
def test_a_chunked_attention_model_is_refused_by_name_in_every_layout(rows, share_prompts):
    """Whatever rows the batch packs into, log-probs and critic values of a chunked-attention model stop with its
    class and layer type (the packed layout crashed with an IndexError where the batch packed one sequence per
    row)."""
    from rlhf_sg.bench.models import rollout_batch
    from rlhf_sg.models import ValueHeadModel
    from rlhf_sg.packing import critic_values, response_logprobs

    model = _tiny_llama4()
    sequences, mask, width = rollout_batch(model.config.vocab_size)
    sequences, mask = sequences[rows], mask[rows]
    refusal = "config.layer_types holds 'chunked_attention' layers (attention_chunk_size=4)"
    with pytest.raises(ValueError, match=rf"^Llama4ForCausalLM: {re.escape(refusal)}"):
        response_logprobs(model, sequences, mask, width, share_prompts=share_prompts)
    with pytest.raises(ValueError, match=rf"^Llama4TextModel: {re.escape(refusal)}"):
        critic_values(ValueHeadModel(model.model), sequences, mask, width, share_prompts=share_prompts)
