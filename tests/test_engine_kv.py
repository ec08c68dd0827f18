"""The embedded engine's KV buffers and decode attention (``backends.embedded.KVBuffers``, ``engine_attention``).

The reference is transformers itself: greedy completions equal ``model.generate`` (its own ``DynamicCache`` and
sdpa attention) token for token, sampled completions and their log-probs equal the engine's ``DynamicCache`` path,
and :func:`decode_attention` equals ``torch``'s sdpa over the KV heads repeated the way transformers' ``repeat_kv``
pairs them.
"""

from __future__ import annotations

import contextlib
import logging
import random

import pytest
import torch

from backends.base import BackendConfig, BackendError, SamplingParams
from backends.embedded import ENGINE_ATTENTION, EmbeddedBackend, KVBuffers, decode_attention, plan_waves
from rlhf_sg.tiny import EOS_ID, PAD_ID, save_tiny_model, tiny_config


def _prompts(num: int, seed: int, min_len: int = 2, max_len: int = 24) -> list[list[int]]:
    """Prompts of varied lengths (so every batch is left-padded) of ids that are neither pad nor EOS."""
    rng = random.Random(seed)
    return [[rng.randint(3, 90) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)]


@contextlib.contextmanager
def _dynamic_cache(engine: EmbeddedBackend):
    """Run ``engine`` through transformers' DynamicCache and sdpa (its path for models the buffers do not fit)."""
    engine.kv_buffers = False
    engine.model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        engine.kv_buffers = True
        engine.model.set_attn_implementation(ENGINE_ATTENTION)


def _engine(path: str, device: str = "cpu", dtype: str = "float32", max_model_len: int = 512,
            **extra) -> EmbeddedBackend:
    return EmbeddedBackend(BackendConfig(model_path=path, device=device, dtype=dtype, max_model_len=max_model_len,
                                         seed=0, num_threads=1, extra=extra))


@pytest.fixture(scope="module", params=["qwen2", "llama", "qwen2-mha"])
def model_dir(request, tmp_path_factory):
    arch = request.param.split("-")[0]
    path = str(tmp_path_factory.mktemp(request.param))
    if request.param.endswith("mha"):  # as many KV heads as query heads: no grouping
        from transformers import AutoModelForCausalLM

        config = tiny_config(arch)
        config.num_key_value_heads = config.num_attention_heads
        torch.manual_seed(1)
        save_tiny_model(path, model=AutoModelForCausalLM.from_config(config).eval())
    else:
        save_tiny_model(path, arch=arch, seed=1)
    return path


def test_greedy_completions_equal_transformers_generate(model_dir):
    """Left-padded prompts of 2..24 tokens, up to 150 new tokens: token for token what ``model.generate`` gives each
    prompt alone (no padding at all)."""
    engine = _engine(model_dir)
    assert engine.kv_buffers and engine.model.config._attn_implementation == ENGINE_ATTENTION
    prompts = _prompts(5, seed=0)
    out = engine.generate(prompts, SamplingParams(n=1, max_new_tokens=150, temperature=0.0))
    reference = build_reference(model_dir)
    for prompt, completion in zip(prompts, out):
        ids = torch.tensor([prompt])
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=150, do_sample=False,
                                      eos_token_id=None, pad_token_id=PAD_ID, min_new_tokens=150)[0, len(prompt):]
        # the engine stops on the model's EOS; the reference runs on, so compare up to the engine's stop
        assert completion.token_ids == expected[: len(completion.token_ids)].tolist(), f"prompt of {len(prompt)} tokens"
        if completion.finish_reason == "stop":
            assert completion.token_ids[-1] == EOS_ID
        else:
            assert len(completion.token_ids) == 150


def build_reference(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("max_batch_size", [256, 10])
def test_sampled_completions_equal_the_dynamic_cache_path(model_dir, max_batch_size):
    """n samples per prompt, stop tokens (rows finish early, so the batch is compacted), several chunks
    (``max_batch_size=10``) and 160 new tokens: the same tokens, finish reasons and log-probs
    (within 1e-5) as the engine's DynamicCache path."""
    engine = _engine(model_dir, max_batch_size=max_batch_size)
    prompts = _prompts(6, seed=2)
    for params in (SamplingParams(n=4, max_new_tokens=160, temperature=1.0, seed=3, stop_token_ids=[11]),
                   SamplingParams(n=3, max_new_tokens=40, temperature=0.7, top_k=20, top_p=0.9, seed=5,
                                  stop_token_ids=[EOS_ID, 7, 8])):
        buffered = engine.generate(prompts, params)
        with _dynamic_cache(engine):
            cached = engine.generate(prompts, params)
        assert [c.token_ids for c in buffered] == [c.token_ids for c in cached]
        assert [c.finish_reason for c in buffered] == [c.finish_reason for c in cached]
        assert {c.finish_reason for c in buffered} >= {"stop"}, "the batch should have been compacted"
        for b, c in zip(buffered, cached):
            torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(c.logprobs), atol=1e-5, rtol=0)


def _repeat_kv_reference(query, key, value, mask, scaling):
    """torch's sdpa over the KV heads repeated as transformers' ``repeat_kv`` does: query head h reads KV head
    h // group."""
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2)


def test_decode_attention_keeps_the_model_dtype():
    """bf16 in, bf16 out (scores and softmax in float32 inside), close to the float32 result."""
    torch.manual_seed(0)
    query, key, value = torch.randn(3, 4, 1, 8), torch.randn(3, 2, 6, 8), torch.randn(3, 2, 6, 8)
    bias = torch.zeros(3, 1, 1, 6, dtype=torch.bfloat16)
    out, _ = decode_attention(query.bfloat16(), key.bfloat16(), value.bfloat16(), bias, None)
    assert out.dtype == torch.bfloat16
    reference, _ = decode_attention(query, key, value, None, None)
    torch.testing.assert_close(out.float(), reference, atol=0.03, rtol=0.03)


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (6, 3)])
@pytest.mark.parametrize("mask_kind", ["bool", "float", "none"])
def test_decode_attention_equals_sdpa_over_repeated_kv_heads(heads, kv_heads, mask_kind):
    torch.manual_seed(0)
    batch, length, dim = 5, 13, 16
    # key / value as the buffers hand them: a view of the first `length` columns of a wider buffer
    key = torch.randn(batch, kv_heads, 32, dim)[:, :, :length]
    value = torch.randn(batch, kv_heads, 32, dim)[:, :, :length]
    query = torch.randn(batch, 1, heads, dim).transpose(1, 2)  # [B, H, 1, D] as the model's projection gives it
    pad = torch.tensor([0, 3, 7, 0, 12])  # left padding per row
    keep = torch.arange(length)[None, :] >= pad[:, None]
    low = torch.finfo(torch.float32).min
    mask = {"bool": keep[:, None, None, :],
            "float": torch.zeros(batch, 1, 1, length).masked_fill(~keep[:, None, None, :], low),
            "none": None}[mask_kind]
    for scaling in (None, 0.3):
        out, weights = decode_attention(query, key, value, mask, scaling)
        assert weights is None and out.shape == (batch, 1, heads, dim)
        torch.testing.assert_close(out, _repeat_kv_reference(query, key, value, mask, scaling), atol=1e-5, rtol=1e-5)


def test_kv_buffers_prefill_decode_and_selection_in_place():
    pad_mask = torch.tensor([[0, 0, 1], [1, 1, 1]])  # 2 prompts, width 3, the first of length 1
    buffers = KVBuffers(pad_mask, num_layers=2, capacity=9, dtype=torch.float32, n=2)
    assert buffers.rows == 4 and buffers.capacity == 9 and buffers.length == 3
    low = torch.finfo(torch.float32).min
    assert buffers.bias[:, :3].tolist() == [[low, low, 0.0]] * 2 + [[0.0, 0.0, 0.0]] * 2
    # prefill: prompt 0 alone (width 1, at column 2), then prompt 1 (width 3, at column 0); each written twice
    for layer in range(2):
        buffers.prefill = (slice(0, 2), 2, 2)
        k0 = torch.full((1, 1, 1, 2), 10.0 + layer)
        assert buffers.write(layer, k0, -k0)[0] is k0
        buffers.prefill = (slice(2, 4), 0, 2)
        k1 = torch.arange(3.0).view(1, 1, 3, 1).expand(1, 1, 3, 2) + 20 + layer
        buffers.write(layer, k1, -k1)
    buffers.prefill = None
    assert buffers.keys[1][:, 0, :3, 0].tolist() == [[0, 0, 11], [0, 0, 11], [21, 22, 23], [21, 22, 23]]
    assert torch.equal(buffers.values[1], -buffers.keys[1])
    storages = [t.untyped_storage().data_ptr() for t in buffers.keys + buffers.values]
    # decode: columns 3..8 are written in place, the capacity never changes
    for step in range(6):
        mask = buffers.step_mask()
        assert buffers.capacity == 9 and mask.shape == (4, 1, 1, buffers.length + 1)
        assert mask[:, 0, 0, -1].tolist() == [0.0] * 4  # the new token is attended
        for layer in range(2):
            new = torch.full((4, 1, 1, 2), 100.0 + step)
            keys, values = buffers.write(layer, new, -new)
            assert keys.shape == (4, 1, buffers.length + 1, 2)
            assert keys[:, 0, -1, 0].tolist() == [100.0 + step] * 4
        buffers.advance()
    generated = [100, 101, 102, 103, 104, 105]
    assert buffers.keys[0][:, 0, :, 0].tolist() == [[0, 0, 10, *generated]] * 2 + [[20, 21, 22, *generated]] * 2
    assert buffers.bias[0].tolist() == [low, low] + [0] * 7
    buffers.select(torch.tensor([3, 0]))
    assert buffers.rows == 2 and buffers.keys[1][:, 0, :3, 0].tolist() == [[21, 22, 23], [0, 0, 11]]
    assert buffers.bias[:, 0].tolist() == [0.0, low]
    # compacted in place: the same storages, no copy of the buffers
    assert [t.untyped_storage().data_ptr() for t in buffers.keys + buffers.values] == storages
    with pytest.raises(ValueError, match="column 9 is past the capacity 9"):
        buffers.step_mask()


def test_kv_buffers_mask_in_the_model_dtype_and_decode_one_column_a_step():
    buffers = KVBuffers(torch.tensor([[0, 1]]), num_layers=1, capacity=4, dtype=torch.bfloat16)
    assert buffers.bias.dtype == torch.bfloat16 and buffers.bias[0, 0] == torch.finfo(torch.bfloat16).min
    with pytest.raises(ValueError, match="a decode step writes one column, got 2"):
        buffers.write(0, torch.zeros(1, 1, 2, 4, dtype=torch.bfloat16), torch.zeros(1, 1, 2, 4, dtype=torch.bfloat16))


def test_kv_buffers_need_room_for_the_prompts():
    pad_mask = torch.ones((2, 5))
    assert KVBuffers(pad_mask, num_layers=1, capacity=5, dtype=torch.float32).capacity == 5  # exactly the prompts
    with pytest.raises(ValueError, match=r"KVBuffers: capacity 4 < the prompts' width 5"):
        KVBuffers(pad_mask, num_layers=1, capacity=4, dtype=torch.float32)


def _storage_bytes(buffers: KVBuffers) -> int:
    """What the buffers hold, measured on their tensors' storages."""
    tensors = [buffers.bias, *(t for t in buffers.keys + buffers.values if t is not None)]
    return sum(t.untyped_storage().nbytes() for t in tensors)


def test_kv_buffers_refuse_an_allocation_past_their_budget():
    """4 rows x 8 columns of 1 layer, 2 KV heads of dim 4 in float32: 4 x 8 x 4 bytes of mask, 2 x 4 x 2 x 8 x 4 x 4
    of keys and values. A budget one byte short of that refuses the layer's keys and values."""
    total = 4 * 8 * 4 + 2 * 4 * 2 * 8 * 4 * 4
    key = torch.zeros(4, 2, 3, 4)
    buffers = KVBuffers(torch.ones((4, 3)), num_layers=1, capacity=8, dtype=torch.float32, budget_bytes=total)
    buffers.prefill = (slice(0, 4), 0, 1)
    buffers.write(0, key, key)
    assert _storage_bytes(buffers) == buffers.storage_bytes() == total
    short = KVBuffers(torch.ones((4, 3)), num_layers=1, capacity=8, dtype=torch.float32, budget_bytes=total - 1)
    short.prefill = (slice(0, 4), 0, 1)
    with pytest.raises(ValueError, match=f"4 rows x 8 columns take {total} bytes or more, past the budget of "
                                         f"{total - 1} bytes"):
        short.write(0, key, key)


def test_plan_waves_fits_every_batch_to_the_budget():
    """Rows of 10 + 6 columns at 1 byte a column: 48 bytes hold 3 rows; n = 2 (2 rows a prompt, 1 prompt a wave) and
    n = 5 (a prompt's samples split 3 + 2); the row cap splits as before; one row over the budget is refused."""
    assert plan_waves([4, 10, 10], 2, 6, 256, 48, 1) == [(range(0, 1), range(2)), (range(1, 2), range(2)),
                                                          (range(2, 3), range(2))]
    assert plan_waves([10, 10], 5, 6, 256, 48, 1) == [(range(0, 1), range(0, 3)), (range(0, 1), range(3, 5)),
                                                     (range(1, 2), range(0, 3)), (range(1, 2), range(3, 5))]
    assert plan_waves([2, 2], 2, 2, 256, 32, 1) == [(range(0, 2), range(2))]  # 4 rows x 4 columns: exactly 16
    assert plan_waves([2, 2, 2], 2, 2, 4, 10**9, 1) == [(range(0, 2), range(2)), (range(2, 3), range(2))]
    with pytest.raises(ValueError, match="one row of 16 tokens needs 32 bytes of KV cache, past the budget of 31"):
        plan_waves([10], 1, 6, 256, 31, 2)


def test_kv_buffers_never_pass_the_engine_budget_and_waves_give_the_same_tokens(model_dir, monkeypatch):
    """An engine whose KV budget holds about 2.5 rows of 64 tokens: every decode batch's buffers (their storages,
    measured after each step) stay within it, the call runs in many waves with one prompt's samples split across
    them, and the completions (greedy, and sampled with a seed) equal those of one wave under the default budget."""
    roomy = _engine(model_dir, max_model_len=64)
    budget = int(2.5 * 64 * roomy._kv_bytes_per_token)
    tight = _engine(model_dir, max_model_len=64, kv_cache_bytes=budget)
    assert tight.kv_budget_bytes == budget
    seen: dict[KVBuffers, tuple[int, int]] = {}  # each decode batch's buffers: (rows at start, most bytes held)
    advance = KVBuffers.advance

    def measured(self):
        rows, held = seen.get(self, (self.rows, 0))
        seen[self] = (rows, max(held, _storage_bytes(self)))
        advance(self)

    prompts = _prompts(5, seed=9)
    for params in (SamplingParams(n=3, max_new_tokens=40, temperature=0.0),
                   SamplingParams(n=4, max_new_tokens=40, temperature=1.0, seed=11, stop_token_ids=[7])):
        expected = roomy.generate(prompts, params)
        seen.clear()
        with monkeypatch.context() as patch:
            patch.setattr(KVBuffers, "advance", measured)
            out = tight.generate(prompts, params)
        assert len(seen) > 2, f"{len(seen)} waves"
        assert any(rows < params.n for rows, _ in seen.values()), "no prompt's samples were split across waves"
        assert 0 < max(held for _, held in seen.values()) <= budget
        assert [c.token_ids for c in out] == [c.token_ids for c in expected]
        assert [c.finish_reason for c in out] == [c.finish_reason for c in expected]
        assert [c.prompt_index for c in out] == [c.prompt_index for c in expected]


def test_an_engine_whose_budget_cannot_hold_one_row_refuses_to_start(tmp_path):
    """One row of max_model_len tokens over the budget: the engine refuses at start, naming the flag to raise."""
    path = save_tiny_model(str(tmp_path / "m"), seed=1)
    per_token = _engine(path, max_model_len=64)._kv_bytes_per_token
    assert _engine(path, max_model_len=64, kv_cache_bytes=64 * per_token).kv_budget_bytes == 64 * per_token
    with pytest.raises(BackendError) as caught:
        _engine(path, max_model_len=64, kv_cache_bytes=64 * per_token - 1)
    assert str(caught.value) == (
        f"the embedded engine's KV cache budget is {64 * per_token - 1} bytes (BackendConfig.extra['kv_cache_bytes']); "
        f"one completion row of 64 tokens (BackendConfig.max_model_len=64, model max_position_embeddings=2048) needs "
        f"{64 * per_token} bytes ({per_token} bytes a token). Raise --rollout.engine_kwargs kv_cache_bytes, or lower "
        "--rollout.max_model_len")
    with pytest.raises(BackendError, match=r"KV cache budget is \d+ bytes \(--rollout.memory_fraction 1e-09 of the "
                                           r"\d+ bytes of host memory available at start\); .* Raise "
                                           r"--rollout.memory_fraction, or lower --rollout.max_model_len"):
        EmbeddedBackend(BackendConfig(model_path=path, max_model_len=64, num_threads=1, memory_fraction=1e-9))


@pytest.mark.parametrize("kwargs, fast", [
    ({}, True), ({"sliding_window": None, "softcap": None}, True), ({"dropout": 0.0}, True),
    ({"dropout": 0.1}, False), ({"softcap": 30.0}, False), ({"sliding_window": 4}, False), ({"s_aux": 1.0}, False),
    ({"sinks": 1.0}, False), ({"position_bias": 1.0}, False),
])
def test_engine_attention_takes_the_decode_path_only_for_plain_decode_steps(monkeypatch, kwargs, fast):
    """A decode step with buffers runs decode_attention unless a keyword changes the computation (dropout, softcap,
    window, sinks, bias): then transformers' sdpa, over the same buffered columns. Prefill always runs sdpa."""
    import transformers.integrations.sdpa_attention as sdpa_module

    import backends.embedded as embedded

    calls = []

    def sdpa(module, query, key, value, mask, **kw):
        calls.append(("sdpa", key.shape[2], sorted(kw)))
        return "sdpa", None

    monkeypatch.setattr(embedded, "decode_attention", lambda *a: calls.append(("decode", a[4])) or ("decode", None))
    monkeypatch.setattr(sdpa_module, "sdpa_attention_forward", sdpa)
    layer = torch.nn.Module()
    layer.layer_idx = 0
    kwargs = {**kwargs, "scaling": 0.25}  # a model's own scale (not always head_dim ** -0.5) reaches the decode path
    # 4 query heads, 2 KV heads; a 2-token prefill, so the decode step reads 3 columns (4 % 3 != 0: the grouping
    # check is on the heads, not the columns)
    buffers = KVBuffers(torch.ones((2, 2)), num_layers=1, capacity=8, dtype=torch.float32)
    buffers.prefill = (slice(0, 2), 0, 1)
    q, k = torch.randn(2, 4, 2, 8), torch.randn(2, 2, 2, 8)
    embedded.engine_attention(layer, q, k, k, None, kv_buffers=buffers, **kwargs)
    assert calls == [("sdpa", 2, sorted(kwargs))]
    buffers.prefill = None
    calls.clear()
    embedded.engine_attention(layer, q[:, :, :1], k[:, :, :1], k[:, :, :1], buffers.step_mask(), kv_buffers=buffers,
                              **kwargs)
    assert calls == ([("decode", 0.25)] if fast else [("sdpa", 3, sorted(kwargs))])
    calls.clear()
    embedded.engine_attention(layer, q[:, :, :1], k[:, :, :1], k[:, :, :1], None, **kwargs)  # no buffers: sdpa
    assert calls == [("sdpa", 1, sorted(kwargs))]


def test_models_the_buffers_do_not_fit_decode_through_the_dynamic_cache(tmp_path, caplog):
    """eager attention and sliding-window layers keep transformers' cache (and still equal ``generate``); a model
    whose layers do not route attention through the interface is caught by the probe, told, and set back to sdpa."""
    from transformers import AutoModelForCausalLM

    path = save_tiny_model(str(tmp_path / "plain"), seed=1)
    eager = _engine(path, attn_implementation="eager")
    assert not eager.kv_buffers and eager.model.config._attn_implementation == "eager"

    config = tiny_config("qwen2")
    config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 4, 0
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    torch.manual_seed(1)
    sliding_path = save_tiny_model(str(tmp_path / "sliding"), model=AutoModelForCausalLM.from_config(config).eval())
    sliding = _engine(sliding_path)
    assert not sliding.kv_buffers
    prompt = _prompts(1, seed=4, min_len=9, max_len=9)
    out = sliding.generate(prompt, SamplingParams(n=1, max_new_tokens=12, temperature=0.0))
    ids = torch.tensor(prompt)
    expected = build_reference(sliding_path).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                                      do_sample=False, eos_token_id=None, pad_token_id=PAD_ID,
                                                      min_new_tokens=12)
    assert out[0].token_ids == expected[0, 9:].tolist()

    engine = _engine(path)
    assert engine.kv_buffers
    attention = engine.model.model.layers[1].self_attn
    forward = attention.forward
    attention.forward = lambda *a, kv_buffers=None, **kw: forward(*a, **kw)  # drops the buffers: a bypass
    with caplog.at_level(logging.WARNING, logger="backends.embedded"):
        assert engine._use_engine_attention() is False
    assert engine.model.config._attn_implementation == "sdpa"
    assert "1 of 2 layers bypass the attention interface" in caplog.text


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_buffered_decode_on_cuda(tmp_path, dtype):
    """On a GPU, in fp32 and bf16: the buffered decode (``decode_attention`` in the model dtype with float32 softmax)
    gives the DynamicCache path's completions. fp32: every token equal. bf16: rounding may flip a near-tie, so
    the check is that most rows agree on their first 16 tokens and the log-probs of equal rows are close."""
    path = save_tiny_model(str(tmp_path / "m"), arch="qwen2", size="small", seed=1)
    engine = _engine(path, device="cuda", dtype=dtype)
    assert engine.kv_buffers
    prompts = _prompts(8, seed=6)
    params = SamplingParams(n=4, max_new_tokens=160, temperature=1.0, seed=7, stop_token_ids=[11])
    buffered = engine.generate(prompts, params)
    with _dynamic_cache(engine):
        cached = engine.generate(prompts, params)
    if dtype == "float32":
        assert [c.token_ids for c in buffered] == [c.token_ids for c in cached]
        return
    agree = sum(b.token_ids[:16] == c.token_ids[:16] for b, c in zip(buffered, cached))
    assert agree >= 0.75 * len(buffered), f"{agree} of {len(buffered)} rows agree on their first 16 tokens"
    for b, c in zip(buffered, cached):
        if b.token_ids == c.token_ids:
            torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(c.logprobs), atol=0.05, rtol=0)


def test_a_transformers_without_the_attention_interfaces_keeps_the_dynamic_cache(tmp_path, monkeypatch, caplog):
    """Where registering the attention function fails (a transformers without ``AttentionMaskInterface``), the
    engine still starts, on sdpa and ``DynamicCache``, and says why."""
    import backends.embedded as embedded

    def missing():
        raise ImportError("cannot import name 'AttentionMaskInterface'")

    monkeypatch.setattr(embedded, "_register_engine_attention", missing)
    path = save_tiny_model(str(tmp_path / "m"), seed=1)
    with caplog.at_level(logging.WARNING, logger="backends.embedded"):
        engine = _engine(path)
    assert not engine.kv_buffers and engine.model.config._attn_implementation == "sdpa"
    assert "ImportError: cannot import name 'AttentionMaskInterface'" in caplog.text
    params = SamplingParams(n=2, max_new_tokens=20, temperature=0.0)
    out = engine.generate(_prompts(3, seed=8), params)
    monkeypatch.undo()
    buffered = _engine(path)
    assert buffered.kv_buffers
    assert [c.token_ids for c in out] == [c.token_ids for c in buffered.generate(_prompts(3, seed=8), params)]


@pytest.mark.gpu
def test_the_cuda_kv_budget_is_the_memory_fraction_less_the_weights(tmp_path):
    """On CUDA the KV budget is ``memory_fraction`` of the device (``torch.cuda.mem_get_info``'s total) less the
    weights, the engine generates under it, and a fraction that leaves less than one row of max_model_len
    refuses the start naming ``--rollout.memory_fraction``. This is the path CPU runs cannot take."""
    path = save_tiny_model(str(tmp_path / "m"), seed=1)
    config = BackendConfig(model_path=path, device="cuda", max_model_len=64, memory_fraction=0.05)
    engine = EmbeddedBackend(config)
    _, total = torch.cuda.mem_get_info()
    weights = sum(t.nbytes for t in (*engine.model.parameters(), *engine.model.buffers()))
    assert engine.kv_budget_bytes == int(0.05 * total) - weights
    out = engine.generate(_prompts(8, seed=3), SamplingParams(n=4, max_new_tokens=32, temperature=0.0))
    assert len(out) == 32
    with pytest.raises(BackendError, match=r"Raise --rollout.memory_fraction, or lower --rollout.max_model_len"):
        EmbeddedBackend(BackendConfig(model_path=path, device="cuda", max_model_len=64, memory_fraction=1e-9))
