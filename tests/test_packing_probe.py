"""The start-up packing probe (:mod:`rlhf_sg.probe`): it passes a model that packs exactly, catches one whose
layout decision is wrong (a recurrent model packed two to a row) and makes it take one sequence per row, and
refuses a model that is wrong even then."""

from __future__ import annotations

import logging

import pytest
import torch

from rlhf_sg import packing
from rlhf_sg.bench.models import TOLERANCE, alone, rollout_batch
from rlhf_sg.models import ValueHeadModel
from rlhf_sg.probe import PROBE_REASON_ATTRIBUTE, check_packing
from rlhf_sg.tiny import tiny_family_model


def _pack_everything(monkeypatch):
    """The layout decision made wrong: no model is held to one sequence per row unless the probe marked it."""
    monkeypatch.setattr(packing, "one_sequence_per_row_reason",
                        lambda module: getattr(packing._unwrap(module), PROBE_REASON_ATTRIBUTE, None))


def _outputs(model, sequences, mask, width, share_prompts):
    with torch.no_grad():
        if isinstance(model, ValueHeadModel):
            return packing.critic_values(model, sequences, mask, width, share_prompts=share_prompts)
        return packing.response_logprobs(model, sequences, mask, width, share_prompts=share_prompts)


@pytest.mark.parametrize("share_prompts", [False, True])
def test_an_exact_model_passes_and_keeps_packing(share_prompts):
    model = tiny_family_model("qwen2")
    deltas = check_packing(model, share_prompts)
    assert set(deltas) == ({"packed", "shared"} if share_prompts else {"packed"})
    assert all(d <= 1e-5 for d in deltas.values())
    assert not hasattr(model, PROBE_REASON_ATTRIBUTE)


def test_wrong_blocks_are_caught_by_the_probe_and_the_model_falls_back(monkeypatch, caplog):
    """The shared-prompt blocks are what the probe's shared layout runs on a switched model: blocks that let a
    response see its sibling (each response's prefix moved onto the slots just before it) are found, and the model
    falls back."""
    model = tiny_family_model("qwen2")
    assert packing.use_shared_prompt_attention(model)
    assert check_packing(model, share_prompts=True)["shared"] <= 1e-5
    build = packing.SharedPromptBlocks.build.__func__

    def leaky(cls, rows, mask):
        blocks = build(cls, rows, mask)
        # each response's prefix the slots just before it: a second response sees its sibling's, not its prompt
        blocks.responses = [(q, torch.cat([q[:, :1] - k.shape[1] + q.shape[1] + torch.arange(k.shape[1] - q.shape[1]),
                                           q], dim=1)) for q, k in blocks.responses]
        return blocks

    monkeypatch.setattr(packing.SharedPromptBlocks, "build", classmethod(leaky))
    with caplog.at_level(logging.WARNING, logger="rlhf_sg.probe"):
        deltas = check_packing(model, share_prompts=True)
    assert deltas["packed"] <= 1e-5 and deltas["shared"] > 1e-3 and deltas["one per row"] <= 1e-5
    assert "shared max |Δ|" in getattr(model, PROBE_REASON_ATTRIBUTE)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_a_recurrent_model_packed_by_a_wrong_decision_is_caught_and_falls_back(monkeypatch, caplog, role):
    """Qwen3.5's linear-attention state runs across a packed row; with the layer-type check defeated the probe sees
    it, marks the model, and every later forward (log-probs or values) gives each row what it gives alone."""
    _pack_everything(monkeypatch)
    lm = tiny_family_model("qwen3.5")
    critic = ValueHeadModel(lm.base_model)
    model = lm if role == "actor" else critic
    sequences, mask, width = rollout_batch()
    ref_logp, _, ref_values = alone(lm, sequences, mask, width, critic)
    reference = ref_logp if role == "actor" else ref_values
    before = _outputs(model, sequences, mask, width, share_prompts=True)
    assert (before - reference).abs().max() > 1e-3  # the wrong decision really is wrong

    with caplog.at_level(logging.WARNING, logger="rlhf_sg.probe"):
        deltas = check_packing(model, share_prompts=True)
    assert deltas["packed"] > 1e-3 and deltas["shared"] > 1e-3 and deltas["one per row"] <= 1e-5
    reason = getattr(model, PROBE_REASON_ATTRIBUTE)
    assert reason.startswith("the start-up packing probe found sequences packed together differ from each alone "
                             "(packed max |Δ| ")
    assert [r.getMessage() for r in caplog.records if r.name == "rlhf_sg.probe"] == [
        f"{type(model).__name__}: {reason}; every forward now takes one sequence per row"]
    for share_prompts in (False, True):
        after = _outputs(model, sequences, mask, width, share_prompts)
        assert (after - reference).abs().max() <= TOLERANCE


def test_the_ranks_decide_together():
    """The reduce sees every measured |Δ| and its result decides: a rank whose own forward was exact falls back
    when another rank's was not."""
    model = tiny_family_model("qwen2")
    seen = []

    def other_rank_was_wrong(values):
        seen.append(list(values))
        return [max(v, 0.5) for v in values] if len(seen) == 1 else values

    deltas = check_packing(model, share_prompts=False, reduce=other_rank_was_wrong)
    assert deltas["packed"] == 0.5 and len(seen) == 2 and hasattr(model, PROBE_REASON_ATTRIBUTE)


def test_a_model_wrong_even_one_sequence_per_row_is_refused(monkeypatch):
    original = packing._rows_to_tokens
    monkeypatch.setattr(packing, "_rows_to_tokens", lambda values, batch: original(values, batch).roll(1, 0))
    model = tiny_family_model("qwen2")
    with pytest.raises(RuntimeError, match=r"Qwen2ForCausalLM: the start-up packing probe found .* and one "
                                           r"sequence per row still differs \(max \|Δ\| "):
        check_packing(model, share_prompts=False)


def test_in_bfloat16_a_model_wrong_even_one_sequence_per_row_is_a_warning(monkeypatch, caplog):
    original = packing._rows_to_tokens
    monkeypatch.setattr(packing, "_rows_to_tokens", lambda values, batch: original(values, batch).roll(1, 0))
    model = tiny_family_model("qwen2").to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="rlhf_sg.probe"):
        deltas = check_packing(model, share_prompts=False)
    assert deltas["one per row"] > 0.1 and hasattr(model, PROBE_REASON_ATTRIBUTE)
    assert "one sequence per row still differs" in caplog.records[-1].getMessage()
    assert caplog.records[-1].getMessage().endswith("(in torch.bfloat16 this may be rounding; run the probe in "
                                                    "float32 to tell)")
