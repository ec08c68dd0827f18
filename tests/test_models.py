"""ValueHeadModel: loading from a causal LM, from its own checkpoint and from a sequence classifier."""

import logging
import os

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModel, AutoModelForSequenceClassification

from rlhf_sg.models import VALUE_HEAD_FILE, ValueHeadModel
from rlhf_sg.packing import reward_scores
from rlhf_sg.tiny import PAD_ID, save_tiny_model, tiny_config

IDS = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]])


@pytest.fixture(scope="module")
def causal_lm_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("lm")), arch="qwen2", size="tiny", seed=3)


def test_from_a_causal_lm_checkpoint_the_head_is_fresh_and_said_so(causal_lm_dir, caplog):
    from transformers import AutoModelForCausalLM

    with caplog.at_level(logging.WARNING, logger="rlhf_sg.models"):
        model = ValueHeadModel.from_pretrained(causal_lm_dir)
    assert "value head freshly initialised" in caplog.text
    lm = AutoModelForCausalLM.from_pretrained(causal_lm_dir)
    for name, p in lm.model.named_parameters():
        torch.testing.assert_close(dict(model.model.named_parameters())[name], p, atol=0, rtol=0)
    values = model(IDS)
    assert values.shape == IDS.shape and values.dtype == torch.float32
    assert model.value_head.weight.abs().max() > 0


def test_save_then_load_restores_the_head(causal_lm_dir, tmp_path, caplog):
    model = ValueHeadModel.from_pretrained(causal_lm_dir)
    torch.nn.init.normal_(model.value_head.weight, std=1.0)
    model.save_pretrained(str(tmp_path))
    assert os.path.isfile(tmp_path / VALUE_HEAD_FILE)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlhf_sg.models"):
        loaded = ValueHeadModel.from_pretrained(str(tmp_path))
    assert "freshly initialised" not in caplog.text
    torch.testing.assert_close(loaded.value_head.weight, model.value_head.weight, atol=0, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS), model(IDS), atol=0, rtol=0)
    # the backbone stays an ordinary transformers checkpoint
    assert isinstance(AutoModel.from_pretrained(str(tmp_path)), type(model.model))


def test_save_from_a_gathered_state_dict(causal_lm_dir, tmp_path):
    """Under ZeRO-3 the caller gathers the weights and passes them (names as in named_parameters)."""
    model = ValueHeadModel.from_pretrained(causal_lm_dir)
    state = {name: p.detach() + 1.0 for name, p in model.named_parameters()}
    model.save_pretrained(str(tmp_path), state_dict=state)
    loaded = ValueHeadModel.from_pretrained(str(tmp_path))
    for name, p in loaded.named_parameters():
        torch.testing.assert_close(p, state[name], atol=0, rtol=0)
    with pytest.raises(KeyError, match="value_head.weight"):
        model.save_pretrained(
            str(tmp_path / "x"), state_dict={k: v for k, v in state.items() if k.startswith("model.")}
        )


def test_from_a_sequence_classification_reward_model(tmp_path):
    """The usual reward-model checkpoint: score.weight becomes the head, scores match transformers'."""
    config = tiny_config("llama", "tiny")
    config.num_labels = 1
    torch.manual_seed(0)
    classifier = AutoModelForSequenceClassification.from_config(config).eval()
    classifier.save_pretrained(str(tmp_path))
    model = ValueHeadModel.from_pretrained(str(tmp_path)).eval()
    torch.testing.assert_close(model.value_head.weight, classifier.score.weight, atol=0, rtol=0)

    lengths = [5, 2, 4]
    ids = torch.full((3, 5), PAD_ID)
    mask = torch.zeros(3, 5, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.arange(10, 10 + n) + b
        mask[b, :n] = 1
    with torch.no_grad():
        expected = classifier(ids, attention_mask=mask).logits.squeeze(-1)
        scores = reward_scores(model, ids, mask)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)


def test_bad_checkpoints_are_named(tmp_path, causal_lm_dir):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ValueHeadModel.from_pretrained(str(tmp_path))
    model = ValueHeadModel.from_pretrained(causal_lm_dir)
    model.save_pretrained(str(tmp_path / "ckpt"))
    save_file({"value_head.weight": torch.zeros(1, 3)}, str(tmp_path / "ckpt" / VALUE_HEAD_FILE))
    with pytest.raises(ValueError, match=r"value head of shape \(1, 3\), expected \(1, 64\)"):
        ValueHeadModel.from_pretrained(str(tmp_path / "ckpt"))


def test_a_family_without_sdpa_loads_with_eager_attention(caplog):
    """transformers refuses sdpa for GPT-OSS (its attention sinks) and Bloom; a run asking for the default sdpa
    loads them with eager, and says so, where the load failed at start-up before."""
    import logging

    from transformers import AutoModelForCausalLM

    from rlhf_sg.models import attention_implementation
    from rlhf_sg.tiny import tiny_family_model

    for family, want in (("gpt-oss", "eager"), ("bloom", "eager"), ("qwen2", "sdpa"), ("gemma-3", "sdpa")):
        config = tiny_family_model(family).config
        with caplog.at_level(logging.WARNING, logger="rlhf_sg.models"):
            got = attention_implementation(config, "sdpa")
        assert got == want, family
        AutoModelForCausalLM.from_config(config, attn_implementation=got)  # loads
        assert attention_implementation(config, "flash_attention_2") == "flash_attention_2"
    assert sum("no sdpa attention" in r.getMessage() for r in caplog.records) == 2
