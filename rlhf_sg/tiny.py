"""Tiny causal LMs and tokenizers, built locally from configs.

There is no model hub on CI machines, so tests, benchmarks and the CPU quickstart build their
models here and ``save_pretrained`` them. The character tokenizer (:func:`build_tokenizer`) maps one
character to one token, so a round trip text -> ids -> text is exact; load it with
:func:`load_tokenizer` (``AutoTokenizer`` would attach the architecture's own pre-tokenizer and
silently drop spaces). The chat tokenizer (:func:`build_chat_tokenizer`) is a real byte-level BPE
with merges, Qwen2.5's special tokens and a Qwen-style chat template, for what the character
tokenizer would hide: ids that a decode / re-encode round trip changes, template glue at turn
boundaries.
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


# ---- a byte-level BPE chat tokenizer in Qwen2.5's format ---------------------------------------------------

#: Qwen2's pre-tokenizer split (its tokenizer.json): words, single digits, punctuation runs with their newlines
QWEN_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                      r"|\s*[\r\n]+|\s+(?!\S)|\s+")
#: special tokens, as Qwen2.5 has them: skipped by ``decode(skip_special_tokens=True)``
CHAT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: added tokens that are not special (as in Qwen2.5 and Qwen3): they stay in decoded text, where tool calls are
#: parsed from
CHAT_TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

#: Renders messages as Qwen2.5's chat template does (system / user / assistant turns between <|im_start|> and
#: <|im_end|>, an assistant's tool calls as <tool_call> JSON, tool results as <tool_response> blocks in one user
#: turn), without its default system prompt; ``tools`` are listed in a system turn.
QWEN_STYLE_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nFunctions you may call, one signature a line:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nCall one with its name and arguments as JSON within <tool_call></tool_call> tags:\\n"
    "<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for call in message.tool_calls %}"
    "{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' + (call['arguments'] | tojson)"
    " + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

#: what the BPE merges are learned from: prose, chat roles, arithmetic and tool-call JSON (a few hundred merges)
_CHAT_CORPUS = """\
The quick brown fox jumps over the lazy dog. A tool call is a JSON object with a name and its arguments.
You are a helpful assistant. Answer the question, and call a tool when you need one.
What is 417*38? Let me call the calculator. The answer is 15846.
What is 12+34? The answer is 46. What is 250-75? The answer is 175.
system user assistant tool
{"name": "calculator", "arguments": {"expression": "417*38"}}
{"name": "calculator", "arguments": {"expression": "12+34"}}
{"name": "search", "arguments": {"query": "the capital of France"}}
{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}
{"result": 15846} {"error": "unknown tool"} {"temperature": 21, "unit": "celsius"}
The capital of France is Paris. It is sunny and warm in Paris today.
def add(a, b):
    return a + b
Reinforcement learning from human feedback trains a policy with rewards; the policy writes answers, the
reward model scores them, and the trainer updates the weights.
"""


def build_chat_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer in Qwen2.5's format, trained here on a small built-in corpus (deterministic).

    Qwen2's pre-tokenizer split (:data:`QWEN_SPLIT_PATTERN`) and byte-level alphabet, about ``vocab_size`` ids of
    learned merges (``"name"``, ``" answer"``, ``'"}}'``), then :data:`CHAT_SPECIAL_TOKENS` (special) and
    :data:`CHAT_TOOL_TOKENS` (added, not special) at the end of the vocabulary as in Qwen's; eos ``<|im_end|>``,
    pad ``<|endoftext|>``; chat template :data:`QWEN_STYLE_CHAT_TEMPLATE`. Text that the merges would join,
    sampled one piece at a time, decodes to the same text but re-encodes to other ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CHAT_CORPUS.splitlines() * 4, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in CHAT_TOOL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens=["<|im_start|>", "<|im_end|>"], clean_up_tokenization_spaces=False,
        chat_template=QWEN_STYLE_CHAT_TEMPLATE,
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


def tiny_family_model(family: str, attn_implementation: str | None = None, seed: int = 0, **overrides):
    """A random-weight float32 causal LM of ``family`` (one of :data:`FAMILIES`), built from its config class;
    ``attn_implementation=None``: sdpa where the family has it, else eager (Bloom). ``overrides``: config fields
    to change (``head_dim=32`` for an engine whose CPU kernels take no smaller head)."""
    import transformers

    configs = _family_configs()
    if family not in configs:
        raise ValueError(f"family {family!r} unknown; choose one of {sorted(configs)}")
    class_name, kwargs = configs[family]
    config = getattr(transformers, class_name)(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation, dtype=torch.float32
    )
    return model.eval()


# ---- vision-language families -----------------------------------------------------------------------------

#: the image / video placeholders and the vision start / end marks, as Qwen-VL's tokenizers have them, and LLaVA's
#: image placeholder (all special)
VISION_SPECIAL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<image>")


def build_vision_tokenizer():
    """:func:`build_chat_tokenizer` with :data:`VISION_SPECIAL_TOKENS` added (special) at the end of its vocabulary,
    as the Qwen-VL processors need them (``<|image_pad|>`` is what an image expands into)."""
    from tokenizers import AddedToken

    tok = build_chat_tokenizer()
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_SPECIAL_TOKENS],
                   special_tokens=True)
    return tok


def _vision_family_configs(vocab_size: int, token_ids: dict[str, int], eos_id: int, pad_id: int) -> dict:
    """vision family -> (config class name in transformers, kwargs): a 2-layer text model of hidden size 32 with
    M-RoPE (``mrope_section`` [2, 1, 1] of the head's 4 frequency pairs) and a 2-block vision tower whose merger
    outputs the text hidden size; ``token_ids``: the config's image / video / vision start / end ids."""
    text = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=eos_id, pad_token_id=pad_id,
                bos_token_id=None)
    mrope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    return {
        "qwen2-vl": ("Qwen2VLConfig", dict(
            token_ids, text_config=dict(text, rope_parameters=mrope),
            vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
                               spatial_merge_size=2, temporal_patch_size=2))),
        # window attention over 2x2 merged patches (window_size / patch_size / merge), full attention in block 1
        "qwen2.5-vl": ("Qwen2_5_VLConfig", dict(
            token_ids, text_config=dict(text, rope_parameters=mrope),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                               patch_size=14, spatial_merge_size=2, window_size=56, fullatt_block_indexes=[1]))),
        # patch 16, interleaved M-RoPE, a learned 8x8 position grid and deepstack features from block 0
        "qwen3-vl": ("Qwen3VLConfig", dict(
            token_ids, text_config=dict(text, head_dim=8, rope_parameters=dict(mrope, mrope_interleaved=True)),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                               patch_size=16, spatial_merge_size=2, num_position_embeddings=64,
                               deepstack_visual_indexes=[0]))),
        # a Llama text model (1-D RoPE) and a CLIP tower on 28x28 images: (28 / 14)² = 4 tokens an image (its CLS
        # feature dropped, the "default" strategy)
        "llava": ("LlavaConfig", dict(
            token_ids, text_config=dict(text, model_type="llama"), vision_feature_layer=-1,
            vision_feature_select_strategy="default", image_seq_length=4,
            vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14,
                               projection_dim=32))),
    }


def _vision_config_classes() -> dict:
    import transformers

    return {name: cls for name, (cls, _) in _vision_family_configs(1, {}, 0, 0).items() if hasattr(transformers, cls)}


#: the vision-language families the installed transformers can build
VISION_FAMILIES = tuple(_vision_config_classes())


def tiny_vision_model(family: str, tokenizer=None, seed: int = 0, head_dim: int | None = None):
    """A random-weight float32 vision-language model of ``family`` (one of :data:`VISION_FAMILIES`), in eval
    mode, its vocabulary and image / vision start / end ids those of ``tokenizer`` (default
    :func:`build_vision_tokenizer`). ``head_dim``: a Qwen-VL text model of 2 heads of that size (1 key/value head,
    ``mrope_section`` a quarter, an eighth and an eighth of the head), as vLLM's CPU attention needs (32, 64, ...)."""
    import transformers

    if family not in VISION_FAMILIES:
        raise ValueError(f"vision family {family!r} unknown; choose one of {list(VISION_FAMILIES)}")
    tok = tokenizer if tokenizer is not None else build_vision_tokenizer()
    start, end, image, video, llava_image = (tok.convert_tokens_to_ids(t) for t in VISION_SPECIAL_TOKENS)
    token_ids = dict(image_token_id=image, video_token_id=video, vision_start_token_id=start,
                     vision_end_token_id=end)
    if family == "llava":
        token_ids = dict(image_token_index=llava_image)
    class_name, kwargs = _vision_family_configs(len(tok), token_ids, tok.eos_token_id, tok.pad_token_id)[family]
    if head_dim is not None:
        if family == "llava":
            raise ValueError("head_dim is for the Qwen-VL families")
        text = kwargs["text_config"]
        text.update(hidden_size=2 * head_dim, intermediate_size=4 * head_dim, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=head_dim,
                    rope_parameters=dict(text["rope_parameters"], mrope_section=[head_dim // 4, head_dim // 8,
                                                                                 head_dim // 8]))
        kwargs["vision_config"]["hidden_size" if family == "qwen2-vl" else "out_hidden_size"] = 2 * head_dim
    config = getattr(transformers, class_name)(**kwargs)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    return model.eval()
