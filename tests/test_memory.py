"""The memory formulas of :mod:`rlhf_sg.memory` (what ``python -m rlhf_sg.bench memory`` prints) against real tensors
at small sizes: the masks sdpa saves for backward, the embedded engine's KV buffers, a model's parameters."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf_sg import memory
from rlhf_sg.tiny import build_tiny_model, save_tiny_model, tiny_config


def _shape(arch: str = "qwen2", dtype: str = "bfloat16") -> memory.ModelShape:
    config = tiny_config(arch).to_dict()
    config["model_type"] = arch
    return memory.ModelShape.from_hf_config(config, dtype=dtype)


def _saved_mask_storages(mask: torch.Tensor, layers: int) -> dict[int, int]:
    """Run ``layers`` sdpa calls with ``mask`` (as a model's layers do) under autograd; the storages of the masks
    they save for backward, data pointer -> bytes."""
    rows, length = mask.shape[0], mask.shape[2]
    query = torch.randn(rows, 4, length, 8, dtype=torch.bfloat16, requires_grad=True)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 4 and t.shape[1] == 1 and t.shape[2] == length:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = query
        for _ in range(layers):
            hidden = torch.nn.functional.scaled_dot_product_attention(hidden, hidden, hidden, attn_mask=mask)
    return saved


def test_dense_mask_formulas_against_what_sdpa_saves():
    """Before: a boolean mask makes every layer save its own bf16 copy (L = 48, a multiple of 16, where CPU and CUDA
    agree), ``layers x R x L x L x 2`` bytes in all; the per-layer figure at L = 37 is the converted mask padded to 48
    as CUDA's kernel pads it. After: one bf16 mask whose key axis is allocated to 48 is saved by every layer as the
    same storage, ``R x 37 x 48 x 2`` bytes."""
    shape, rows = _shape(), 2
    causal = torch.ones(48, 48, dtype=torch.bool).tril()
    before = _saved_mask_storages(causal.expand(rows, 1, 48, 48).clone(), shape.num_layers)
    assert len(before) == shape.num_layers
    assert sum(before.values()) == memory.dense_mask_bytes_before(shape, rows, 48) == 2 * rows * 48 * 48 * 2

    bool_mask = torch.ones(rows, 1, 37, 37, dtype=torch.bool).tril()
    padded = torch.nn.functional.pad(torch.zeros(rows, 1, 37, 37, dtype=torch.bfloat16)
                                     .masked_fill(~bool_mask, torch.finfo(torch.bfloat16).min), (0, 48 - 37))
    assert padded.nbytes == memory.dense_mask_bytes_per_layer(rows, 37, 2)

    shared = torch.zeros(rows, 1, 37, memory.pad16(37), dtype=torch.bfloat16)[..., :37]
    shared.masked_fill_(~bool_mask, torch.finfo(torch.bfloat16).min)
    after = _saved_mask_storages(shared, shape.num_layers)
    assert after == {shared.untyped_storage().data_ptr(): memory.shared_mask_bytes(rows, 37, 2)}
    assert memory.shared_mask_bytes(rows, 37, 2) == rows * 37 * 48 * 2


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_parameter_formula_equals_the_model(arch):
    """Every parameter's element count (so the weights and the ZeRO-3 shards, partitioned per parameter) as the
    real model has them."""
    model = build_tiny_model(arch, seed=0)
    shape = _shape(arch, dtype="float32")
    assert sorted(memory.param_numels(shape)) == sorted(p.numel() for p in model.parameters())
    assert memory.weight_bytes(shape) == sum(p.nbytes for p in model.parameters())
    world = 3
    shards = memory.zero3_shard_bytes(shape, world)
    assert shards["params"] == sum(-(-p.numel() // world) * 4 for p in model.parameters())
    assert shards["optimizer"] == 2 * shards["params"]  # fp32 weights: Adam's m and v only


def _layered_config(arch: str, layers: int, **kw):
    """:func:`tiny_config` with ``layers`` decoder layers (a config built at 2 keeps its 2 layer types)."""
    config = tiny_config(arch, **kw)
    return type(config)(**{**config.to_dict(), "num_hidden_layers": layers, "layer_types": None})


def _saved_activation_bytes(model, tokens: int) -> int:
    """Bytes of the tensors a training forward of ``tokens`` tokens through ``model``'s backbone keeps for its
    backward (distinct storages, the parameters left out)."""
    ids = torch.randint(3, 90, (1, tokens), generator=torch.Generator().manual_seed(0))
    with memory.saved_for_backward(model) as saved:
        model.model(input_ids=ids)
    return sum(saved.values())


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["all-layers", "checkpointed"])
def test_activation_formula_against_what_a_training_forward_saves(arch, checkpointing):
    """A bf16 model of 6 layers under sdpa keeps for its backward what ``memory.saved_activation_bytes`` counts
    (norms, attention, MLP per layer; with gradient checkpointing each layer's input), within 2 %: the figure
    behind the activations of a training rank."""
    config = _layered_config(arch, 6)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    shape = memory.ModelShape.from_hf_config({**config.to_dict(), "model_type": arch}, dtype="bfloat16")
    measured = _saved_activation_bytes(model, 256)
    assert measured == pytest.approx(memory.saved_activation_bytes(shape, 256, checkpointing), rel=0.02)


def _optimizer_state_after_a_step(model_path: str, zero_stage: int, dtype: str) -> dict:
    """One actor rank (world size 1) at ``zero_stage`` in ``dtype`` after an optimizer step: what it reports of its
    optimizer state (the figure the trainer logs)."""
    import torch.distributed as dist
    from zero3_rank import PLAIN_UPDATE, actor_rank, one_step

    worker, batch, plan = actor_rank(model_path, zero_stage=zero_stage, dtype=dtype)
    try:
        batch.old_logp = worker.forward(batch, plan)[1]
        worker.train_actor(batch, one_step(plan, batch), PLAIN_UPDATE)
        return worker.optimizer_state_bytes()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(("zero_stage", "dtype"), [(3, "bfloat16"), (0, "bfloat16"), (0, "float32")],
                         ids=["zero3-bf16", "unpartitioned-bf16", "unpartitioned-fp32"])
def test_a_ranks_optimizer_state_is_what_the_shard_formula_counts(tmp_path, zero_stage, dtype):
    """A trained rank's optimizer state is ``zero3_shard_bytes``' optimizer figure for one rank: Adam's two float32
    moments, and with a bf16 model float32 master weights, which ZeRO-3 keeps in its partitioned flat groups and
    the ZeRO stage-1 optimizer of an unpartitioned bf16 rank (``--train.single_rank_zero3 false``) in its single
    partition; an unpartitioned float32 rank's torch optimizer steps the weights themselves and keeps no copy."""
    from zero3_rank import in_fresh_process

    path = save_tiny_model(str(tmp_path / "m"))
    state = in_fresh_process(_optimizer_state_after_a_step, path, zero_stage, dtype)
    shape = _shape(dtype=dtype)
    assert state["trainable"] == memory.param_count(shape)
    assert state["master"] == (4 * state["trainable"] if dtype == "bfloat16" else 0)
    assert state["moments"] + state["master"] == memory.zero3_shard_bytes(shape, 1)["optimizer"]


def test_kv_formula_equals_the_embedded_engine_buffers(tmp_path, monkeypatch):
    """The engine's bytes a token (its probe's measure) and the storages of a real decode batch's buffers equal the
    formula for the model's shape."""
    from backends.base import BackendConfig, SamplingParams
    from backends.embedded import EmbeddedBackend, KVBuffers

    path = save_tiny_model(str(tmp_path / "m"), seed=1)
    engine = EmbeddedBackend(BackendConfig(model_path=path, max_model_len=64, num_threads=1, dtype="bfloat16"))
    with open(f"{path}/config.json") as f:
        shape = memory.ModelShape.from_hf_config(json.load(f), dtype="bfloat16")
    assert engine._kv_bytes_per_token == memory.kv_bytes_per_token(shape)
    held = []
    advance = KVBuffers.advance

    def measured(self):
        if not held:
            held.append((self.rows, self.capacity, self.storage_bytes()))
        advance(self)

    monkeypatch.setattr(KVBuffers, "advance", measured)
    engine.generate([[5, 6, 7], [8, 9]], SamplingParams(n=3, max_new_tokens=10, temperature=0.0))
    rows, capacity, nbytes = held[0]
    assert (rows, capacity) == (6, 13)
    assert nbytes == memory.kv_cache_bytes(shape, rows, capacity)


def test_load_shape_from_a_preset_a_model_directory_and_a_json(tmp_path):
    assert memory.load_shape("qwen2.5-7b").num_kv_heads == 4
    path = save_tiny_model(str(tmp_path / "m"), seed=1)
    assert memory.load_shape(path).num_layers == tiny_config().num_hidden_layers
    own = tmp_path / "shape.json"
    own.write_text(json.dumps({"num_layers": 2, "hidden_size": 8, "num_heads": 2, "num_kv_heads": 1, "head_dim": 4,
                               "intermediate_size": 16, "vocab_size": 10}))
    assert memory.load_shape(str(own)) == memory.ModelShape(2, 8, 2, 1, 4, 16, 10)
    with pytest.raises(ValueError, match="--model-config 'nope': neither a preset"):
        memory.load_shape("nope")


def test_bench_memory_prints_the_mask_before_and_after(capsys):
    """The Qwen2.5-7B shape at 16k tokens: 512 MiB of mask a layer, 14 GiB over 28 layers before; one 512 MiB copy
    after; the 7.62e9 parameters its config.json gives."""
    from rlhf_sg.bench.memory import main

    main(["--model-config", "qwen2.5-7b", "--seq-len", "16384"])
    out = capsys.readouterr().out
    assert "7.62e9 parameters" in out
    assert "512.0 MiB a layer, 14.00 GiB for 28 layers" in out
    assert "512.0 MiB in all, every layer the same storage" in out
    assert "before / after: 28.0x" in out


def _shared_prompt_backward_peak(layers: int, rows: int, prompt: int, response: int, device: str) -> int:
    """Peak device bytes above the model of one shared-prompt segment's forward and backward (a prompt of
    ``prompt`` tokens and ``rows`` responses of ``response``, one segment) through a bf16 model of ``layers``."""
    from transformers import AutoModelForCausalLM

    from rlhf_sg.packing import response_logprobs

    segment = prompt + rows * response
    config = _layered_config("qwen2", layers, max_len=segment + 16)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device).train()
    ids = torch.randint(3, config.vocab_size, (rows, prompt + response), device=device)
    ids[:, :prompt] = ids[0, :prompt]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    logp = response_logprobs(model, ids, torch.ones_like(ids), response, share_prompts=True, segment_tokens=segment)
    logp.sum().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.gpu
def test_a_16k_token_shared_prompt_backward_holds_one_mask_on_cuda():
    """On CUDA, in bf16, one shared-prompt segment of 16384 tokens (a 1024-token prompt and 16 responses of 960)
    forward and backward through the same model at 2 and at 6 layers: the 4 added layers raise the peak by less than
    one dense-mask copy (``memory.dense_mask_bytes_per_layer``, 512 MiB at 16k tokens), and the 6-layer peak stays
    within a budget of two shared masks plus 1 GiB of activations. With a boolean mask, which the CUDA kernel
    converts and pads per layer and every layer keeps for its backward, each added layer costs a whole copy (2 GiB
    over 4 layers): this proves the layers share one mask storage on the device, which CPU's kernel (no padding)
    cannot show."""
    rows, prompt, response = 16, 1024, 960
    seq_len = prompt + rows * response
    per_layer = memory.dense_mask_bytes_per_layer(1, seq_len, 2)
    two, six = (_shared_prompt_backward_peak(layers, rows, prompt, response, "cuda") for layers in (2, 6))
    assert six - two < per_layer, f"4 more layers took {six - two} bytes; one layer's mask copy is {per_layer}"
    budget = 2 * memory.shared_mask_bytes(1, seq_len, 2) + 2**30
    assert six <= budget, f"peak {six} bytes over the budget of {budget}"


@pytest.mark.parametrize("family", ["gpt-2", "bloom", "qwen3-moe", "gemma-3"])
def test_model_shapes_read_each_familys_own_config_keys(family, tmp_path):
    """GPT-2 and Bloom name their head and layer counts ``n_head`` / ``n_layer`` (transformers' ``attribute_map``);
    reading Llama's keys failed the run at start-up with ``KeyError: 'num_attention_heads'``."""
    from rlhf_sg.memory import load_shape
    from rlhf_sg.tiny import tiny_family_model

    model = tiny_family_model(family)
    model.config.save_pretrained(str(tmp_path))
    shape = load_shape(str(tmp_path))
    text = model.config.get_text_config()
    assert (shape.num_layers, shape.num_heads, shape.hidden_size, shape.vocab_size) == (
        text.num_hidden_layers, text.num_attention_heads, text.hidden_size, text.vocab_size)
    assert shape.head_dim == getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def _blocks_saved_per_layer(model, ids, response_width: int, segment_tokens: int | None) -> list[dict[int, tuple]]:
    """A shared-prompt forward of ``ids`` (one group) through ``model`` on the blocks: per layer, the storages its
    blocks keep for backward, data pointer -> (bytes, shape, dtype)."""
    from rlhf_sg import packing

    layers: list[dict[int, tuple]] = []
    attend = packing.SharedPromptBlocks.attend

    def measured(self, *args):
        saved: dict[int, tuple] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), tuple(t.shape), t.dtype)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = attend(self, *args)
        layers.append(saved)
        return out

    packing.SharedPromptBlocks.attend = measured
    try:
        packing.response_logprobs(model, ids, torch.ones_like(ids), response_width, share_prompts=True,
                                  segment_tokens=segment_tokens)
    finally:
        packing.SharedPromptBlocks.attend = attend
    return layers


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped-heads", "repeated-heads"])
@pytest.mark.parametrize("segments", [1, 3], ids=["one-segment", "a-segment-a-response"])
def test_shared_prompt_block_formula_against_what_the_blocks_save(monkeypatch, grouped, segments):
    """A bf16 model of 2 layers (4 query heads over 2 key / value heads of 16) on the blocks: a prompt of 6 tokens and
    3 responses of 5, as one segment (the blocks' default) or a segment a response (the old 11-token cap). Each layer
    keeps what ``memory.shared_prompt_block_bytes`` counts a layer, with the key / value heads as the kernel takes
    them (grouped, as CPU and CUDA's flash kernel take them; repeated, as elsewhere), apart from the [5, 11] mask CPU's
    kernel builds for the lower-right causal call (CUDA's kernels need none); the indices are one storage all layers
    share."""
    from rlhf_sg import packing
    from rlhf_sg.packing import use_shared_prompt_attention

    if not grouped:
        monkeypatch.setattr(packing, "_takes_grouped_heads", lambda *a: False)
    config = tiny_config("qwen2")
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).train()
    assert use_shared_prompt_attention(model)
    prompt, group, response = 6, 3, 5
    ids = torch.randint(3, 90, (group, prompt + response), generator=torch.Generator().manual_seed(0))
    ids[:, :prompt] = ids[0, :prompt]
    layers = _blocks_saved_per_layer(model, ids, response, None if segments == 1 else prompt + response)
    assert len(layers) == config.num_hidden_layers
    shared = set(layers[0]) & set(layers[1])
    shape = _shape()
    formula = memory.shared_prompt_block_bytes(shape, prompt, group, response, segments,
                                               kv_heads=shape.num_kv_heads if grouped else shape.num_heads)
    assert sum(layers[0][p][0] for p in shared) == formula["indices"]
    for saved in layers:
        own = {p: v for p, v in saved.items() if p not in shared}
        cpu_masks = [v for v in own.values() if len(v[1]) == 2]
        assert [v[1] for v in cpu_masks] == [(response, prompt + response)]
        assert sum(v[0] for v in own.values()) - sum(v[0] for v in cpu_masks) == formula["layer"]


def test_bench_memory_prints_the_shared_prompt_blocks(capsys):
    """The Qwen2.5-7B shape, a 1024-token prompt and 8 responses of 4096 (one 33,792-token segment): 547.6 MiB a layer
    kept for backward (the 4 key / value heads as flash takes them), 14.97 GiB over 28 layers; cut a segment a
    response with the heads repeated, 1.21 GiB a layer and 33.81 GiB."""
    from rlhf_sg.bench.memory import main

    main(["--model-config", "qwen2.5-7b", "--seq-len", "16384"])
    out = capsys.readouterr().out
    assert "(one segment of 33792 tokens, 4 key / value heads to sdpa): kept for backward 547.6 MiB a layer, " \
           "14.97 GiB a micro-batch over 28 layers" in out
    assert "the 28 heads repeated: 1.21 GiB a layer, 33.81 GiB a micro-batch; that / one segment: 2.26x" in out


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl", "llava"])
def test_a_vision_language_models_shape_counts_its_tower_once_and_trains_none_of_it(family, tmp_path):
    """A vision-language model directory: the language model's parameters as the text formulas count them, the
    rest (vision tower, LLaVA's projector) counted whole as the model itself holds it, in the weights the engine
    keeps and in a ZeRO-3 rank's weight shard, never in its gradients or optimizer states (the tower trains frozen)."""
    from rlhf_sg.vision import save_tiny_vision_model
    from rlhf_sg.vision.positions import vision_core, vision_tower

    path = save_tiny_vision_model(str(tmp_path / "vl"), family)
    model = __import__("transformers").AutoModelForImageTextToText.from_pretrained(path)
    core = vision_core(model)
    language = sum(p.numel() for p in core.language_model.parameters()) + model.lm_head.weight.numel()
    tower = sum(p.numel() for p in model.parameters()) - language
    assert tower >= sum(p.numel() for p in vision_tower(core).parameters()) > 0
    shape = memory.load_shape(path)
    assert shape.vision_params == tower
    if family != "qwen3-vl":  # the text formulas hold the Llama / Qwen2 layout (Qwen3's per-head q / k norms aside)
        assert sum(memory.param_numels(shape)) == language
        assert memory.weight_bytes(shape) == sum(p.nbytes for p in model.parameters())  # what an engine holds
    text_only = memory.zero3_shard_bytes(dataclasses.replace(shape, vision_params=0), 4)
    shards = memory.zero3_shard_bytes(shape, 4)
    assert shards["params"] - text_only["params"] == -(-tower // 4) * shape.dtype_bytes
    assert (shards["grads"], shards["optimizer"]) == (text_only["grads"], text_only["optimizer"])
    assert memory.load_shape("qwen2.5-vl-7b").vision_params == 676_550_144
