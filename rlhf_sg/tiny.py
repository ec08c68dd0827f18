"""Tiny causal LMs and a character-level tokenizer, built locally from configs.

There is no model hub on CI machines, so tests, benchmarks and the CPU quickstart build their
models here and ``save_pretrained`` them. The tokenizer maps one character to one token, so a
round trip text -> ids -> text is exact; load it with :func:`load_tokenizer` (``AutoTokenizer``
would attach the architecture's own pre-tokenizer and silently drop spaces).
"""

from __future__ import annotations

import os
import string

import torch

from rlhf_sg.data import load_tokenizer  # noqa: F401  (the loader for the models saved here)

#: parameter-count presets (vocab is the character set below, ~100 tokens)
SIZES = {
    # name: (hidden, layers, heads, kv_heads, intermediate)
    "tiny": (64, 2, 4, 2, 128),  # ~0.1M, unit tests
    "small": (256, 4, 8, 4, 768),  # ~3M, end-to-end tests and the quickstart
    "25m": (512, 8, 8, 4, 1536),  # ~25M, generate / e2e benchmarks
    "50m": (640, 10, 10, 5, 1920),  # ~50M, packing benchmark
    "100m": (768, 14, 12, 4, 2304),  # ~100M, weight-sync benchmark
}

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>"]
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
CHARSET = string.printable.replace("\x0b", "").replace("\x0c", "")


def char_vocab() -> dict[str, int]:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARSET:
        vocab.setdefault(ch, len(vocab))
    return vocab


def build_tokenizer():
    """A fast tokenizer with one token per character of :data:`CHARSET` plus pad/bos/eos."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = char_vocab()
    # BPE with no merges splits text into single characters and keeps every space.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )


def tiny_config(arch: str = "qwen2", size: str = "tiny", vocab_size: int | None = None, max_len: int = 2048):
    """A transformers config for ``arch`` in {"qwen2", "llama"} at one of :data:`SIZES`."""
    from transformers import LlamaConfig, Qwen2Config

    if size not in SIZES:
        raise ValueError(f"size {size!r} unknown; choose one of {sorted(SIZES)}")
    hidden, layers, heads, kv_heads, inter = SIZES[size]
    common = dict(
        vocab_size=vocab_size or len(char_vocab()),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=inter,
        max_position_embeddings=max_len,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=False,
    )
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "llama":
        return LlamaConfig(**common)
    raise ValueError(f"arch {arch!r} unknown; choose 'qwen2' or 'llama'")


def build_tiny_model(arch: str = "qwen2", size: str = "tiny", seed: int = 0, **config_kw):
    """A randomly initialised causal LM (fp32, eval mode) from :func:`tiny_config`."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, size, **config_kw)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def save_tiny_model(path: str, arch: str = "qwen2", size: str = "tiny", seed: int = 0, model=None) -> str:
    """Build (or take) a tiny model, save it with the character tokenizer under ``path``."""
    os.makedirs(path, exist_ok=True)
    model = model if model is not None else build_tiny_model(arch, size, seed)
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer().save_pretrained(path)
    return path


# ---- model families ---------------------------------------------------------------------------------------

#: sliding window of the windowed families below: small, so rows longer than it make the window matter
FAMILY_WINDOW = 4
#: original_max_position_embeddings of the LongRoPE family: between the matrix batch's sequence lengths
LONGROPE_ORIGINAL = 16


def _family_configs() -> dict:
    """family name -> (config class name in transformers, kwargs): tiny dims, vocab 128, 2 layers."""
    w = FAMILY_WINDOW
    attn = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)
    return {
        "llama-3": ("LlamaConfig", dict(attn, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                                                "factor": 8.0, "low_freq_factor": 1.0,
                                                                "high_freq_factor": 4.0,
                                                                "original_max_position_embeddings": 64})),
        "qwen2": ("Qwen2Config", attn),
        "qwen2-window": ("Qwen2Config", dict(attn, use_sliding_window=True, sliding_window=w, max_window_layers=0)),
        "qwen3": ("Qwen3Config", dict(attn, head_dim=8)),
        "qwen3-moe": ("Qwen3MoeConfig", dict(attn, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=32)),
        "qwen3.5": ("Qwen3_5TextConfig", dict(attn, head_dim=8, layer_types=["linear_attention", "full_attention"],
                                              linear_num_key_heads=2, linear_num_value_heads=2,
                                              linear_key_head_dim=8, linear_value_head_dim=8)),
        "qwen3-next": ("Qwen3NextConfig", dict(attn, head_dim=8, layer_types=["linear_attention", "full_attention"],
                                               linear_num_key_heads=2, linear_num_value_heads=2,
                                               linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4,
                                               num_experts_per_tok=2, moe_intermediate_size=32,
                                               shared_expert_intermediate_size=32)),
        "mistral": ("MistralConfig", dict(attn, sliding_window=w)),
        "mixtral": ("MixtralConfig", dict(attn, sliding_window=w, num_local_experts=4, num_experts_per_tok=2)),
        "gemma-3": ("Gemma3TextConfig", dict(attn, head_dim=8, sliding_window=w,
                                             layer_types=["sliding_attention", "full_attention"])),
        "gpt-oss": ("GptOssConfig", dict(attn, head_dim=8, sliding_window=w, num_local_experts=4,
                                         num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"],
                                         rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                                          "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                          "original_max_position_embeddings": 8})),
        "phi-3": ("Phi3Config", dict(attn, sliding_window=w, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
        # LongRoPE past a small original length: the matrix batch's longest sequence (20 tokens) crosses it
        "phi-3-longrope": ("Phi3Config", dict(attn, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                              original_max_position_embeddings=LONGROPE_ORIGINAL,
                                              rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                               "short_factor": [1.0, 1.5, 2.0, 3.0],
                                                               "long_factor": [2.0, 4.0, 8.0, 16.0],
                                                               "original_max_position_embeddings":
                                                                   LONGROPE_ORIGINAL})),
        # final_logit_softcapping small enough to bite on random logits
        "gemma-2": ("Gemma2Config", dict(attn, head_dim=8, sliding_window=w, final_logit_softcapping=0.5,
                                         layer_types=["sliding_attention", "full_attention"])),
        "cohere2": ("Cohere2Config", dict(attn, head_dim=8, sliding_window=w, logit_scale=4.0, pad_token_id=0,
                                          bos_token_id=1, eos_token_id=2,
                                          layer_types=["sliding_attention", "full_attention"])),
        "starcoder2": ("Starcoder2Config", dict(attn, sliding_window=w, bos_token_id=1, eos_token_id=2)),
        "gpt-2": ("GPT2Config", dict(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=256,
                                   bos_token_id=1, eos_token_id=2)),
        "olmo-2": ("Olmo2Config", dict(attn, pad_token_id=0, eos_token_id=2)),
        "bloom": ("BloomConfig", dict(vocab_size=128, hidden_size=32, n_layer=2, n_head=4)),
    }


FAMILIES = tuple(_family_configs())


def tiny_family_model(family: str, attn_implementation: str | None = None, seed: int = 0):
    """A random-weight float32 causal LM of ``family`` (one of :data:`FAMILIES`), built from its config class;
    ``attn_implementation=None``: sdpa where the family has it, else eager (Bloom)."""
    import transformers

    configs = _family_configs()
    if family not in configs:
        raise ValueError(f"family {family!r} unknown; choose one of {sorted(configs)}")
    class_name, kwargs = configs[family]
    config = getattr(transformers, class_name)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation, dtype=torch.float32
    )
    return model.eval()
