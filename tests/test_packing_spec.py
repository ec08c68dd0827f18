"""Packing as a specification: the block-causal mask by hand, the model dtype of a plain module, the
attention convention passed by name (a custom attention function, the varlen one included), exact-fit budgets
and rows, token-budget micro-batches by hand, every refusal with its exact message, chunked log-probs that
keep no logits for backward."""

import pytest
import torch
from torch import nn

from rlhf_sg.models import ValueHeadModel
from rlhf_sg.packing import (
    _block_causal_mask,
    _model_dtype,
    critic_values,
    pack,
    packed_forward,
    response_logprobs,
    reward_scores,
    token_budget_microbatches,
    unpack,
)
from rlhf_sg.tiny import build_tiny_model

TOL = 1e-5


def test_block_causal_mask_by_hand():
    # one row: a sequence of 3 tokens then one of 2 (positions restart at 0)
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    allowed = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    mask = _block_causal_mask(pos, None)
    assert mask.dtype == torch.bool and mask.shape == (1, 1, 5, 5)
    assert torch.equal(mask[0, 0], allowed)
    for dtype in (torch.float32, torch.bfloat16):
        additive = _block_causal_mask(pos, dtype)
        assert additive.dtype == dtype
        lowest = torch.tensor(torch.finfo(dtype).min, dtype=dtype)
        expected = torch.where(allowed, torch.tensor(0.0, dtype=dtype), lowest)
        assert torch.equal(additive[0, 0], expected)


def test_the_dtype_of_a_module_without_one_is_its_parameters():
    assert _model_dtype(nn.Linear(2, 2, dtype=torch.bfloat16)) == torch.bfloat16

    class Declared(nn.Linear):
        dtype = torch.float16  # a module that declares its compute dtype: that one is used

    assert _model_dtype(Declared(2, 2)) == torch.float16


def _rollout():
    ids = torch.tensor([[0, 5, 6, 7, 8, 0], [9, 10, 11, 12, 13, 14], [0, 0, 15, 16, 0, 0]])
    mask = (ids != 0).long()
    return ids, mask, 3  # prompt width 3, response width 3


@pytest.fixture(scope="module")
def custom_attention():
    """A model whose attention function is registered under a name of its own that follows sdpa's convention."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("spec_custom_sdpa", sdpa_attention_forward)
    lm = build_tiny_model("llama", "tiny", seed=4)
    reference = build_tiny_model("llama", "tiny", seed=4)
    lm.set_attn_implementation("spec_custom_sdpa")
    reference.set_attn_implementation("sdpa")
    return lm, reference


def test_attn_implementation_names_the_convention_of_a_custom_attention_function(custom_attention):
    lm, reference = custom_attention
    ids, mask, T = _rollout()
    critic, critic_ref = ValueHeadModel(lm.model), ValueHeadModel(reference.model)
    critic_ref.value_head.load_state_dict(critic.value_head.state_dict())
    with torch.no_grad():
        with pytest.raises(ValueError, match="attn_implementation 'spec_custom_sdpa' is not supported on packed rows"):
            response_logprobs(lm, ids, mask, T)
        torch.testing.assert_close(
            response_logprobs(lm, ids, mask, T, attn_implementation="sdpa"), response_logprobs(reference, ids, mask, T),
            atol=TOL, rtol=0,
        )
        torch.testing.assert_close(
            critic_values(critic, ids, mask, T, attn_implementation="sdpa"), critic_values(critic_ref, ids, mask, T),
            atol=TOL, rtol=0,
        )
        with pytest.raises(ValueError, match="attn_implementation 'spec_custom_sdpa' is not supported on packed rows"):
            reward_scores(critic, ids, mask)
        torch.testing.assert_close(
            reward_scores(critic, ids, mask, attn_implementation="sdpa"), reward_scores(critic_ref, ids, mask),
            atol=TOL, rtol=0,
        )


def test_reward_scores_name_the_caller_when_the_model_has_no_value_head():
    ids, mask, _ = _rollout()
    with pytest.raises(TypeError, match=r"^reward_scores needs a rlhf_sg.models.ValueHeadModel .*got LlamaForCausalLM"):
        reward_scores(build_tiny_model("llama", "tiny"), ids, mask)


def test_exact_fit_rows_and_budgets():
    # rows of exactly the longest sequence: 4 + 2 fill one row of 6 exactly, 6 needs a row of its own
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    batch = pack(torch.ones_like(mask) * mask * 7, mask, row_tokens=6)
    assert batch.input_ids.shape == (2, 6)
    # the budget of one token is allowed: every sample of one token is its own micro-batch
    assert token_budget_microbatches([1, 1, 1, 1], 1, 2) == [[[0], [2]], [[1], [3]]]
    # a budget met exactly: 3 + 1 fills one micro-batch of 4, 2 + 2 the other
    assert token_budget_microbatches([3, 2, 2, 1], 4, 1) == [[[0, 3], [1, 2]]]
    with pytest.raises(ValueError, match="^max_tokens_per_microbatch must be >= 1, got 0$"):
        token_budget_microbatches([1], 0, 1)


# ---- token-budget micro-batches: the plan by hand, the order of micro-batches and ranks, each refusal -------


def test_microbatches_the_least_number_that_the_total_allows():
    # 6 tokens under a budget of 10: one micro-batch holds both samples, not two
    assert token_budget_microbatches([3, 3], 10, 1) == [[[0, 1]]]


def test_microbatches_are_filled_longest_sample_first():
    # 12 tokens, budget 6 -> 2 micro-batches. Longest first: 5 | 4, then 2 onto the 4, then 1 onto the 5: 6 and 6.
    # In index order (1, 5, 4, 2) the 2 would go onto 1 + 4 = 5 and not fit: a third micro-batch.
    assert token_budget_microbatches([1, 5, 4, 2], 6, 1) == [[[0, 1], [2, 3]]]


def test_a_ranks_microbatches_come_heaviest_first():
    # budget 6, 13 tokens -> 3 micro-batches: 4 | 3 | 3, then the last 3 onto the first 3 -> loads 4, 6, 3;
    # run heaviest first: [1, 3] (6), [0] (4), [2] (3)
    assert token_budget_microbatches([4, 3, 3, 3], 6, 1) == [[[1, 3], [0], [2]]]


def test_microbatches_go_to_the_rank_with_the_fewest_tokens_so_far():
    # one sample per micro-batch (loads 6, 6, 5, 4, 3, 2), 2 ranks x 3. Heaviest first, each to the rank with the
    # fewest tokens so far (ties: the lower rank): 6 -> r0, 6 -> r1, 5 -> r0 (11), 4 -> r1 (10), 3 -> r1 (13),
    # 2 -> r0 (13). Counting only the last micro-batch's tokens would send the 4 to r0 (5 < 6) instead.
    assert token_budget_microbatches([6, 6, 5, 4, 3, 2], 6, 2) == [[[0], [2], [5]], [[1], [3], [4]]]


def test_every_rank_gets_exactly_as_many_microbatches_as_the_others():
    # loads 5, 2, 2, 2 on 2 ranks x 2: 5 -> r0, 2 -> r1, 2 -> r1 (4 < 5) and r1 is full: the last 2 goes to r0
    # although r1 holds fewer tokens
    assert token_budget_microbatches([5, 2, 2, 2], 5, 2) == [[[0], [3]], [[1], [2]]]


def test_microbatch_refusals_say_what_is_wrong_and_what_to_do():
    cases = [
        (([1], 1, 0), "dp_size must be >= 1, got 0"),
        (([2, 0], 4, 1), "sample 1 has 0 tokens; every sample needs at least one"),
        (([5, 5, 30], 20, 1), "sample 2 has 30 tokens, more than max_tokens_per_microbatch=20; raise the budget to "
                              "at least the longest sequence (prompt + response)"),
        (([5, 5], 20, 3), "2 samples cannot give each of dp_size=3 ranks a micro-batch; use more samples per "
                          "optimizer step or fewer ranks"),
        (([20, 20, 20], 20, 2), "cannot split 3 samples into 2 ranks x 2 non-empty micro-batches of at most 20 "
                                "tokens; raise the budget"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError) as err:
            token_budget_microbatches(*args)
        assert str(err.value) == message


def test_critic_values_name_the_caller_when_the_model_has_no_value_head():
    ids, mask, T = _rollout()
    with pytest.raises(TypeError, match=r"^critic_values needs a rlhf_sg.models.ValueHeadModel .*got LlamaForCausalLM"):
        critic_values(build_tiny_model("llama", "tiny"), ids, mask, T)


# ---- the varlen (flash) convention, on CPU: an attention function that reads cu_seq_lens ---------------------


def _varlen_sdpa(module, query, key, value, attention_mask, **kwargs):
    """Attention following flash_attention_2's varlen convention: no mask, the packed sequences' boundaries in
    ``cu_seq_lens_q/k`` and ``max_length_q/k``; computed with sdpa and a block-causal mask built from them."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    assert attention_mask is None, "the varlen convention passes no mask"
    cu_q, cu_k = kwargs.pop("cu_seq_lens_q"), kwargs.pop("cu_seq_lens_k")
    max_q, max_k = kwargs.pop("max_length_q"), kwargs.pop("max_length_k")
    length = query.shape[2]
    assert query.shape[0] == 1 and torch.equal(cu_q, cu_k) and max_q == max_k
    assert cu_q[0] == 0 and cu_q[-1] == length and max_q == int((cu_q[1:] - cu_q[:-1]).max())
    seq = torch.bucketize(torch.arange(length), cu_q[1:], right=True)  # the sequence of each slot
    allowed = (seq[None, :] == seq[:, None]) & torch.ones(length, length, dtype=torch.bool).tril()
    return sdpa_attention_forward(module, query, key, value, allowed[None, None], **kwargs)


@pytest.fixture(scope="module")
def varlen_attention():
    from transformers import AttentionInterface

    AttentionInterface.register("spec_varlen_sdpa", _varlen_sdpa)
    lm = build_tiny_model("llama", "tiny", seed=5)
    reference = build_tiny_model("llama", "tiny", seed=5)
    lm.set_attn_implementation("spec_varlen_sdpa")
    reference.set_attn_implementation("sdpa")
    return lm, reference


def test_the_varlen_convention_gets_one_row_and_the_sequence_boundaries(varlen_attention):
    # every output with the flash convention equals the padded (sdpa) reference: one packed row, cu_seq_lens
    # = the sequences' cumulative lengths, max_length = the longest
    lm, reference = varlen_attention
    ids, mask, T = _rollout()
    critic, critic_ref = ValueHeadModel(lm.model), ValueHeadModel(reference.model)
    critic_ref.value_head.load_state_dict(critic.value_head.state_dict())
    flash = {"attn_implementation": "flash_attention_2"}
    with torch.no_grad():
        torch.testing.assert_close(response_logprobs(lm, ids, mask, T, **flash),
                                   response_logprobs(reference, ids, mask, T), atol=TOL, rtol=0)
        torch.testing.assert_close(critic_values(critic, ids, mask, T, **flash),
                                   critic_values(critic_ref, ids, mask, T), atol=TOL, rtol=0)
        torch.testing.assert_close(reward_scores(critic, ids, mask, **flash), reward_scores(critic_ref, ids, mask),
                                   atol=TOL, rtol=0)
        # rows of the longest sequence are refused: the varlen kernel takes one row
        with pytest.raises(ValueError, match="^flash_attention_3 takes one packed row, got 2; pack with "
                                             "row_tokens=None$"):
            packed_forward(lm, pack(ids, mask, row_tokens=6), "flash_attention_3")


def test_log_probs_at_temperature_two_are_those_of_the_halved_logits(varlen_attention):
    _, reference = varlen_attention
    ids, mask, T = _rollout()
    with torch.no_grad():
        logp, entropy = response_logprobs(reference, ids, mask, T, temperature=2.0, with_entropy=True)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = reference(ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits.float()
    P = ids.shape[1] - T
    predicted = (logits[:, P - 1 : -1] / 2.0).log_softmax(-1)  # the distribution of response token j at T = 2
    action = mask[:, P:].bool()
    torch.testing.assert_close(logp, predicted.gather(-1, ids[:, P:, None]).squeeze(-1) * action, atol=TOL, rtol=0)
    torch.testing.assert_close(entropy, -(predicted.exp() * predicted).sum(-1) * action, atol=TOL, rtol=0)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_dense_masks_are_built_over_rows_of_the_longest_sequence(varlen_attention, impl):
    # a dense [R, 1, L, L] mask costs L^2: rows are as long as the longest sequence (6 here), not the whole batch
    # (12 real tokens); the varlen convention takes them all in one row
    lm, reference = varlen_attention
    dense, varlen = ValueHeadModel(reference.model), ValueHeadModel(lm.model)
    ids, mask, T = _rollout()
    widths = []
    hooks = [model.register_forward_pre_hook(lambda m, args, kwargs: widths.append(kwargs["input_ids"].shape),
                                             with_kwargs=True) for model in (dense, varlen, reference, lm)]
    try:
        with torch.no_grad():
            critic_values(dense, ids, mask, T, attn_implementation=impl)
            reward_scores(dense, ids, mask, attn_implementation=impl)
            response_logprobs(reference, ids, mask, T, attn_implementation=impl)
            reward_scores(varlen, ids, mask, attn_implementation="flash_attention_2")
            response_logprobs(lm, ids, mask, T, attn_implementation="flash_attention_2")
    finally:
        for hook in hooks:
            hook.remove()
    assert widths == [(2, 6), (2, 6), (2, 6), (1, 12), (1, 12)]


def test_a_model_that_does_not_say_its_attention_is_asked_for_attn_implementation():
    ids, mask, _ = _rollout()
    batch = pack(ids, mask)
    expected = ("has no config._attn_implementation; pass attn_implementation= "
                "(one of ('flash_attention_2', 'flash_attention_3', 'sdpa', 'eager'))")
    no_config = nn.Linear(2, 2)
    with pytest.raises(ValueError) as err:
        packed_forward(no_config, batch)
    assert str(err.value) == "Linear " + expected
    no_field = nn.Linear(2, 2)
    no_field.config = type("Config", (), {})()  # a config without _attn_implementation
    with pytest.raises(ValueError) as err:
        packed_forward(no_field, batch)
    assert str(err.value) == "Linear " + expected


def test_unpack_refuses_values_that_are_not_one_per_real_token():
    ids, mask, _ = _rollout()  # 12 real tokens
    batch = pack(ids, mask)
    for wrong in (torch.zeros(13), torch.zeros(11, 2), torch.tensor(1.0)):
        with pytest.raises(ValueError) as err:
            unpack(wrong, batch)
        assert str(err.value) == (f"packed_values of shape {tuple(wrong.shape)} must have the batch's 12 real tokens "
                                  "in dim 0")


# ---- the rollout layout and response_logprobs' own refusals, each with its exact message ------------------------


def _refused(exc_type, call):
    with pytest.raises(exc_type) as err:
        call()
    return str(err.value)


def test_rollout_layout_refusals_name_the_row_and_the_columns():
    lm = build_tiny_model("llama", "tiny")
    ids, mask, T = _rollout()  # width 6, responses in columns 3..5
    for width, kind in ((True, "bool"), (2.0, "float")):
        assert _refused(TypeError, lambda width=width: response_logprobs(lm, ids, mask, width)) == \
            f"response_width must be an int, got {kind}"
    for width in (0, 6):
        assert _refused(ValueError, lambda width=width: response_logprobs(lm, ids, mask, width)) == (
            f"response_width={width} must be in [1, 5] for sequences of width 6 (at least one prompt column)")
    no_response = mask.clone()
    no_response[1, 3:] = 0
    assert _refused(ValueError, lambda: response_logprobs(lm, ids, no_response, T)) == (
        "attention_mask row 1 has no response token (response columns 3..5 start with padding); drop empty "
        "completions, or check response_width and that responses are right-padded")
    no_prompt = mask.clone()
    no_prompt[2, :3] = 0
    assert _refused(ValueError, lambda: response_logprobs(lm, ids, no_prompt, T)) == (
        "attention_mask row 2: the last prompt column (2) is padding; prompts must be non-empty and left-padded")


def test_one_response_column_and_one_prompt_column_are_enough():
    # the narrowest layouts: response_width 1 (prompt of 3) and response_width 3 (prompt of 1)
    lm = build_tiny_model("llama", "tiny", seed=4).eval()
    ids = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        logits = lm(ids, use_cache=False).logits.float().log_softmax(-1)
        for T in (1, 3):
            expected = logits[:, -T - 1 : -1].gather(-1, ids[:, -T:, None]).squeeze(-1)
            torch.testing.assert_close(response_logprobs(lm, ids, mask, T), expected, atol=TOL, rtol=0)


def test_response_logprobs_refuses_a_bad_temperature_chunk_or_model():
    lm = build_tiny_model("llama", "tiny")
    ids, mask, T = _rollout()
    assert _refused(ValueError, lambda: response_logprobs(lm, ids, mask, T, temperature=0)) == \
        "temperature must be > 0, got 0"
    assert _refused(ValueError, lambda: response_logprobs(lm, ids, mask, T, chunk_tokens=0)) == \
        "chunk_tokens must be >= 1, got 0"
    assert _refused(TypeError, lambda: response_logprobs(nn.Linear(2, 2), ids, mask, T)) == \
        "response_logprobs needs a causal LM with an lm_head, got Linear"
    assert _refused(TypeError, lambda: response_logprobs(ValueHeadModel(lm.model), ids, mask, T)) == \
        "response_logprobs needs a causal LM with an lm_head, got ValueHeadModel"


@pytest.mark.parametrize("field, value", [("final_logit_softcapping", 30.0), ("logit_scale", 0.5),
                                          ("logits_scaling", 2.0)])
def test_a_logit_transform_applies_only_where_the_models_forward_applies_it(field, value, monkeypatch):
    """Llama's forward ignores these config attributes: its log-probs stay the plain head's. A forward whose
    source cannot be read, with such an attribute set, is refused. (Gemma-2's softcap and Cohere2's scale, which
    their forwards apply, are held exact by the model-family matrix.)"""
    from rlhf_sg import packing

    lm = build_tiny_model("llama", "tiny")
    ids, mask, T = _rollout()
    with torch.no_grad():
        plain = response_logprobs(lm, ids, mask, T)
        setattr(lm.config, field, value)
        assert torch.equal(response_logprobs(lm, ids, mask, T), plain)
    monkeypatch.setattr(packing, "_HEAD_SOURCES", {type(lm): None})
    assert _refused(ValueError, lambda: response_logprobs(lm, ids, mask, T)) == (
        f"LlamaForCausalLM: config.{field}={value} and the forward's source cannot be read to tell whether it "
        "transforms the logits; packed log-probs do not support that")


def test_chunks_cover_every_response_token_of_a_long_batch():
    # 2 x 60 response tokens: more predicted tokens (120) than the model's hidden size (64); any chunk size
    # gives the same log-probs and entropies as one chunk
    lm = build_tiny_model("llama", "tiny", seed=2).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 100, (2, 64), generator=g)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        whole = response_logprobs(lm, ids, mask, 60, with_entropy=True, chunk_tokens=1024)
        for chunk in (7, 64):
            chunked = response_logprobs(lm, ids, mask, 60, with_entropy=True, chunk_tokens=chunk)
            torch.testing.assert_close(chunked, whole, atol=TOL, rtol=0)
    assert bool((whole[0] != 0).all())


@pytest.mark.parametrize("trainable", ["all", "backbone", "lm_head"])
def test_under_autograd_no_chunk_of_logits_is_kept_for_backward_and_gradients_reach_the_lm_head(trainable):
    # the [tokens, vocab] logits of a chunk are recomputed in backward (checkpointed), never saved by the
    # forward; gradients still reach whatever trains, the lm_head included when only it trains
    lm = build_tiny_model("llama", "tiny", seed=4)
    ids, mask, T = _rollout()
    for name, p in lm.named_parameters():
        p.requires_grad_(trainable == "all" or (trainable == "lm_head") == name.startswith("lm_head"))
    vocab, hidden = lm.config.vocab_size, lm.config.hidden_size
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        logp = response_logprobs(lm, ids, mask, T, chunk_tokens=2)
    assert {s for s in saved if s and s[-1] == vocab} <= {(hidden, vocab)}  # the lm_head's weight, no logits
    logp.sum().backward()
    # the reference: the same sum from a padded forward
    reference = build_tiny_model("llama", "tiny", seed=4)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = reference(ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits.float()
    P = ids.shape[1] - T
    (logits[:, P - 1 : -1].log_softmax(-1).gather(-1, ids[:, P:, None]).squeeze(-1) * mask[:, P:]).sum().backward()
    for (name, p), q in zip(lm.named_parameters(), reference.parameters()):
        if p.requires_grad:
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-3)


def test_the_model_is_asked_for_no_logits_of_its_own():
    # response_logprobs applies the lm_head itself, chunk by chunk: the model's forward keeps no logits
    lm = build_tiny_model("llama", "tiny")
    ids, mask, T = _rollout()
    shapes = []
    hook = lm.register_forward_hook(lambda m, args, out: shapes.append(tuple(out.logits.shape)))
    try:
        with torch.no_grad():
            response_logprobs(lm, ids, mask, T)
    finally:
        hook.remove()
    assert len(shapes) == 1 and shapes[0][1] == 0


def test_rows_are_filled_longest_sequence_first():
    # sequences of 2, 2, 3, 3 tokens into rows of 5: longest first gives 3 + 2 and 3 + 2 (2 rows); in the
    # given order 2 + 2, then 3, then 3 would need 3 rows
    lengths = [2, 2, 3, 3]
    mask = torch.tensor([[1] * n + [0] * (3 - n) for n in lengths])
    batch = pack(mask * 7, mask, row_tokens=5)
    assert batch.input_ids.shape == (2, 5)
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 0, 1]]


class _Engine(nn.Module):
    """A wrapper that keeps the model as ``.module`` and declares no device (as DDP does)."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_models_inside_a_wrapper_are_found_and_run_through_it():
    lm = build_tiny_model("llama", "tiny", seed=6)
    critic = ValueHeadModel(lm.model)
    ids, mask, T = _rollout()
    with torch.no_grad():
        torch.testing.assert_close(response_logprobs(_Engine(lm), ids, mask, T), response_logprobs(lm, ids, mask, T))
        torch.testing.assert_close(critic_values(_Engine(critic), ids, mask, T), critic_values(critic, ids, mask, T))
        torch.testing.assert_close(reward_scores(_Engine(critic), ids, mask), reward_scores(critic, ids, mask))


def test_pad_slots_continue_the_positions_of_their_rows_last_sequence():
    # sequences of 4, 2, 1 tokens in rows of 4: [s0] and [s1, s2] + one pad slot, whose position continues s2's
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    batch = pack(mask * 7, mask, row_tokens=4)
    assert batch.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 0, 1]]
    assert batch.input_ids.tolist() == [[7, 7, 7, 7], [7, 7, 7, 0]]


def test_padded_batch_refusals_name_what_is_wrong():
    ids = torch.tensor([[5, 6, 0], [7, 8, 9]])
    mask = (ids != 0).long()
    cases = [
        (TypeError, ([[5, 6]], mask), "input_ids and attention_mask must be tensors, got list and Tensor"),
        (TypeError, (ids, [[1, 1]]), "input_ids and attention_mask must be tensors, got Tensor and list"),
        (ValueError, (ids, mask[:, :2]),
         "input_ids (2, 3) and attention_mask (2, 2) must both be [batch, seq] of the same shape"),
        (ValueError, (ids, mask.to("meta")), "input_ids on cpu but attention_mask on meta"),
        (ValueError, (ids[:0], mask[:0]), "empty batch: input_ids has shape (0, 3)"),
        (ValueError, (ids[:, :0], mask[:, :0]), "empty batch: input_ids has shape (2, 0)"),
        (ValueError, (ids, mask * 2), "attention_mask must hold only 0 and 1"),
        (ValueError, (ids, torch.tensor([[1, 1, 0], [1, 0, 1]])),
         "attention_mask row 1 has padding between its real tokens (2 real tokens spread over columns 0..2); each "
         "row must be one contiguous run (a left-padded prompt followed by a right-padded response)"),
    ]
    for exc_type, args, message in cases:
        assert _refused(exc_type, lambda args=args: pack(*args)) == message


class _Recorder(nn.Module):
    """A model that records the arguments packed_forward calls it with."""

    def __init__(self, impl, **config):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.config = type("Config", (), {"_attn_implementation": impl, **config})()
        self.calls = []

    def forward(self, **kwargs):
        self.calls.append(kwargs)
        return kwargs["input_ids"]


def test_packed_forward_passes_the_documented_arguments_for_each_convention():
    ids, mask, _ = _rollout()  # sequences of 4, 6, 2 tokens
    batch = pack(ids, mask, row_tokens=6)  # rows [6] and [4, 2]: fewer rows than sequences
    for impl, mask_dtype in (("sdpa", torch.float32), ("eager", torch.float32)):  # additive, the model's dtype
        model = _Recorder(impl)
        packed_forward(model, batch)
        (kwargs,) = model.calls
        assert kwargs["use_cache"] is False  # a KV cache would make the model attend across the packed sequences
        assert torch.equal(kwargs["position_ids"], batch.position_ids)  # restarting at 0 for every sequence
        assert kwargs["attention_mask"].dtype == mask_dtype and kwargs["attention_mask"].shape == (2, 1, 6, 6)
    # one sequence per row: causal attention alone is exact, no mask is passed
    model = _Recorder("sdpa")
    packed_forward(model, pack(ids[1:2], mask[1:2], row_tokens=6))
    assert "attention_mask" not in model.calls[0]


def test_sliding_windows_are_in_the_packed_mask_per_layer_type():
    """The window a layer applies (transformers' overlay: key k kept iff q - k < window) is in its mask: one mask
    for a model whose layers share a window (``sliding_window`` without ``layer_types``: Mistral, Phi-3), the
    per-layer-type dict where full and sliding layers mix."""
    ids, mask, _ = _rollout()  # sequences of 4, 6, 2 tokens
    batch = pack(ids, mask, row_tokens=6)  # rows [6] and [4, 2]

    def expected(window):
        # per row, the sequence of each column and its position in it; keep k <= q in one sequence, q - k < window
        out = torch.zeros(2, 1, 6, 6, dtype=torch.bool)
        for r, lengths in enumerate(([6], [4, 2])):
            seq = [i for i, n in enumerate(lengths) for _ in range(n)]
            for q in range(6):
                for k in range(q + 1):
                    out[r, 0, q, k] = seq[q] == seq[k] and (window is None or q - k < window)
        return out

    mistral = _Recorder("sdpa", sliding_window=4)  # no layer_types: every layer slides
    packed_forward(mistral, batch)
    assert torch.equal(mistral.calls[0]["attention_mask"] == 0, expected(4))
    mixed = _Recorder("sdpa", layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    packed_forward(mixed, batch)
    masks = {t: m == 0 for t, m in mixed.calls[0]["attention_mask"].items()}
    assert set(masks) == {"sliding_attention", "full_attention"}
    assert torch.equal(masks["sliding_attention"], expected(3)) and torch.equal(masks["full_attention"], expected(None))
    full = _Recorder("sdpa", layer_types=["full_attention"], sliding_window=2)  # a window no layer uses
    packed_forward(full, batch)
    assert torch.equal(full.calls[0]["attention_mask"] == 0, expected(None))


def test_an_unknown_attention_convention_is_refused_with_what_to_do():
    ids, mask, _ = _rollout()
    assert _refused(ValueError, lambda: packed_forward(_Recorder("flex_attention"), pack(ids, mask))) == (
        "attn_implementation 'flex_attention' is not supported on packed rows; use one of ('flash_attention_2', "
        "'flash_attention_3', 'sdpa', 'eager') (model.set_attn_implementation(...)), or pass attn_implementation= "
        "naming the convention your attention function follows")
