"""Packing as a specification: the block-causal mask by hand, the model dtype of a plain module, the
attention convention passed by name (a custom attention function), exact-fit budgets and rows."""

import pytest
import torch
from torch import nn

from rlhf_sg.models import ValueHeadModel
from rlhf_sg.packing import (
    _block_causal_mask,
    _model_dtype,
    critic_values,
    pack,
    response_logprobs,
    reward_scores,
    token_budget_microbatches,
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
