"""Fused kernels (:mod:`rlhf_sg.kernels`): the swapped modules compute what the model's own do, forward and backward,
on every model family, and a module whose forward is not one of the forms keeps its own."""

from __future__ import annotations

import pytest
import torch

from rlhf_sg import tiny
from rlhf_sg.kernels import FUSED_ATTR, fuse_kernels, fused_counts, unfuse_kernels

#: per family, what must be swapped (class -> op); a family absent here has no fused form
EXPECTED = {
    "llama-3": {"LlamaAttention": "rotary", "LlamaMLP": "silu_mul", "LlamaRMSNorm": "rms_norm_cast_then_scale"},
    "qwen2": {"Qwen2Attention": "rotary", "Qwen2MLP": "silu_mul", "Qwen2RMSNorm": "rms_norm_cast_then_scale"},
    "qwen2-window": {"Qwen2Attention": "rotary", "Qwen2MLP": "silu_mul", "Qwen2RMSNorm": "rms_norm_cast_then_scale"},
    "qwen3": {"Qwen3Attention": "rotary", "Qwen3MLP": "silu_mul", "Qwen3RMSNorm": "rms_norm_cast_then_scale"},
    "qwen3-moe": {"Qwen3MoeAttention": "rotary", "Qwen3MoeRMSNorm": "rms_norm_cast_then_scale"},
    "qwen3.5": {"Qwen3_5MLP": "silu_mul", "Qwen3_5RMSNorm": "rms_norm_offset"},
    "qwen3-next": {"Qwen3NextMLP": "silu_mul", "Qwen3NextRMSNorm": "rms_norm_offset"},
    "mistral": {"MistralAttention": "rotary", "MistralMLP": "silu_mul", "MistralRMSNorm": "rms_norm_cast_then_scale"},
    "mixtral": {"MixtralAttention": "rotary", "MixtralRMSNorm": "rms_norm_cast_then_scale"},
    "gemma-3": {"Gemma3Attention": "rotary", "Gemma3MLP": "gelu_tanh_mul", "Gemma3RMSNorm": "rms_norm_offset"},
    "gpt-oss": {"GptOssRMSNorm": "rms_norm_scale_then_cast"},
    "phi-3": {"Phi3RMSNorm": "rms_norm_cast_then_scale"},
    "phi-3-longrope": {"Phi3RMSNorm": "rms_norm_cast_then_scale"},
    "gemma-2": {"Gemma2Attention": "rotary", "Gemma2MLP": "gelu_tanh_mul", "Gemma2RMSNorm": "rms_norm_offset"},
    "cohere2": {"Cohere2MLP": "silu_mul"},
    "starcoder2": {"Starcoder2Attention": "rotary"},
    "olmo-2": {"Olmo2MLP": "silu_mul", "Olmo2RMSNorm": "rms_norm_scale_then_cast"},
}


def _randomise_norms(model: torch.nn.Module, seed: int) -> None:
    """Norm weights away from their init (ones, or zeros for Gemma's ``1 + w``), so a form that scales differently
    computes something else."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if "Norm" in type(module).__name__ and isinstance(getattr(module, "weight", None), torch.Tensor):
                module.weight.copy_(torch.randn(module.weight.shape, generator=g) * 0.5 + 1.0)


def _forward_backward(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    (logits.float().log_softmax(-1)[..., 5].sum()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _family_case(family: str):
    model = tiny.tiny_family_model(family, seed=1)
    model.eval()  # dropout off (gpt-2's tiny config keeps it); gradients flow as in training
    _randomise_norms(model, seed=2)
    ids = torch.randint(3, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    return model, ids


def _check_family(family: str) -> None:
    model, ids = _family_case(family)
    logits, grads = _forward_backward(model, ids)
    swapped = fuse_kernels(model)
    assert swapped == EXPECTED.get(family, {})
    for module in model.modules():
        if type(module).__name__ in swapped:
            assert getattr(module, FUSED_ATTR) == swapped[type(module).__name__]
            assert module.forward.__func__ is not type(module).forward
    fused_logits, fused_grads = _forward_backward(model, ids)
    torch.testing.assert_close(fused_logits, logits, atol=2e-5, rtol=1e-4)
    assert fused_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, atol=2e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")
    counts = fused_counts(model)
    assert unfuse_kernels(model) == sum(counts.values())


def test_the_fused_qwen2_model_computes_the_models_logits_and_gradients():
    """Fast tier: the bench's family. Every RMSNorm and MLP swapped, logits and every parameter's gradient equal
    the model's own up to float32 rounding."""
    _check_family("qwen2")


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in tiny.FAMILIES if f != "qwen2"])
def test_the_fused_model_computes_the_models_logits_and_gradients_on_every_family(family):
    _check_family(family)


def test_unfuse_gives_every_module_its_forward_back():
    model, ids = _family_case("llama-3")
    fuse_kernels(model)
    counts = fused_counts(model)
    assert counts == {"rms_norm_cast_then_scale": 2 * model.config.num_hidden_layers + 1,
                      "silu_mul": model.config.num_hidden_layers, "rotary": model.config.num_hidden_layers}
    assert fuse_kernels(model) == EXPECTED["llama-3"]  # idempotent: nothing swapped twice
    assert unfuse_kernels(model) == sum(counts.values())
    assert not fused_counts(model)
    assert all("forward" not in vars(m) for m in model.modules())


def test_the_rotary_swap_points_the_name_at_the_fused_op_only_while_a_fused_attention_runs():
    """The rotary embedding is a global of the model's module: a fused attention points it at the fused op during
    its own forward and back after (after an error too); a model of the same family that is not fused, run in the
    same process, computes with the module's own function."""
    import sys

    from rlhf_sg.kernels import ops

    fused, ids = _family_case("qwen2")
    plain, _ = _family_case("qwen2")
    namespace = sys.modules[type(fused.model.layers[0].self_attn).__module__].__dict__
    own = namespace["apply_rotary_pos_emb"]
    fuse_kernels(fused)
    seen = []

    def spy(*args, **kwargs):
        seen.append(namespace["apply_rotary_pos_emb"])
        return own(*args, **kwargs)

    namespace["apply_rotary_pos_emb"] = spy
    try:
        plain(input_ids=ids)
        assert seen and all(f is spy for f in seen)  # the plain model called the module's function (the spy)
        seen.clear()
        fused(input_ids=ids)  # each fused attention points the name at the fused op, so the spy is not called
        assert not seen and namespace["apply_rotary_pos_emb"] is spy  # and the name is the spy again after
        with pytest.raises(AttributeError):  # no hidden states: the attention's own forward fails inside the swap
            fused.model.layers[0].self_attn(None, None, None)
        assert namespace["apply_rotary_pos_emb"] is spy
    finally:
        namespace["apply_rotary_pos_emb"] = own
    assert ops.rotary is not own


def test_an_attention_whose_module_rotates_otherwise_keeps_its_forward(monkeypatch):
    """Mutation of the check: a family whose ``rotate_half`` interleaves instead of swapping halves (as some do)
    keeps its attention's own forward; its norms and MLPs are still swapped."""
    import sys

    model, _ = _family_case("llama-3")
    namespace = sys.modules[type(model.model.layers[0].self_attn).__module__]

    def rotate_half(x):
        x1 = x[..., ::2]
        x2 = x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)

    monkeypatch.setattr(namespace, "rotate_half", rotate_half)
    swapped = fuse_kernels(model)
    assert "LlamaAttention" not in swapped and swapped["LlamaMLP"] == "silu_mul"


@pytest.mark.parametrize("family", ["qwen2", "olmo-2", "gemma-3"])
def test_half_precision_norms_round_where_the_model_rounds(family):
    """In bfloat16 Llama's norm casts back before it scales, OLMo-2's after, Gemma's scales by ``1 + w`` in float32:
    each fused op gives the module's own bits, so the three forms are not interchangeable (a form swapped for
    another differs in a quarter of the elements)."""
    model = tiny.tiny_family_model(family, seed=1).to(torch.bfloat16)
    _randomise_norms(model, seed=4)
    norm = next(m for m in model.modules() if "RMSNorm" in type(m).__name__)
    x = torch.randn(3, 7, norm.weight.shape[0], generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    expected = norm(x)
    fuse_kernels(model)
    assert torch.equal(norm(x), expected)


def test_gated_products_in_half_precision_round_once():
    """The fused ``act(gate) * up`` rounds once where eager rounds the activation too: at most one bfloat16 unit in
    the last place apart, and equal in float32 up to rounding."""
    from rlhf_sg.kernels import ops

    g = torch.Generator().manual_seed(6)
    gate, up = torch.randn(4, 9, 64, generator=g), torch.randn(4, 9, 64, generator=g)
    torch.testing.assert_close(ops.silu_mul(gate, up), torch.nn.functional.silu(gate) * up)
    torch.testing.assert_close(ops.gelu_tanh_mul(gate, up),
                               torch.nn.functional.gelu(gate, approximate="tanh") * up)
    half = ops.silu_mul(gate.bfloat16(), up.bfloat16()).float()
    eager = (torch.nn.functional.silu(gate.bfloat16()) * up.bfloat16()).float()
    assert ((half - eager).abs() <= eager.abs() * 2 ** -7 + 1e-6).all()


def test_a_module_whose_forward_is_not_a_form_keeps_its_own():
    """A subclass that changes one statement (eps outside the root), a GELU computed by its Python formula, and an
    MLP whose forward adds a term: none is swapped, and each still computes its own forward."""
    from transformers.activations import GELUTanh
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm

    class ShiftedNorm(Qwen2RMSNorm):
        def forward(self, hidden_states):
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance) + self.variance_epsilon
            return self.weight * hidden_states.to(input_dtype)

    class BiasedMLP(Qwen2MLP):
        def forward(self, x):
            down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) + 1.0)
            return down_proj

    config = tiny.tiny_config("qwen2")
    python_gelu = Qwen2MLP(config)
    python_gelu.act_fn = GELUTanh(use_gelu_tanh_python=True)
    model = torch.nn.ModuleDict({"norm": ShiftedNorm(config.hidden_size), "mlp": BiasedMLP(config),
                                 "gelu": python_gelu, "plain": Qwen2RMSNorm(config.hidden_size)})
    assert fuse_kernels(model) == {"Qwen2RMSNorm": "rms_norm_cast_then_scale"}
    assert [name for name, m in model.items() if getattr(m, FUSED_ATTR, None)] == ["plain"]


def test_a_form_swapped_for_another_is_caught_by_the_family_check(monkeypatch):
    """Mutation: Llama's norm run through OLMo-2's op. The family check must fail on it (in float32 the two differ
    only in rounding, so the check runs the model in bfloat16, where they do not)."""
    from rlhf_sg.kernels import fuse as fuse_module
    from rlhf_sg.kernels import ops

    norms = tuple((form, methods, ops.rms_norm_scale_then_cast if op is ops.rms_norm_cast_then_scale else op, eps)
                  for form, methods, op, eps in fuse_module._NORMS)
    monkeypatch.setattr(fuse_module, "_NORMS", norms)
    with pytest.raises(AssertionError):
        test_half_precision_norms_round_where_the_model_rounds("qwen2")


def test_the_worker_loads_its_model_fused_when_the_flag_says(tmp_path):
    """``WorkerSpec.fused_kernels``: ``load_worker_model`` swaps the modules (the policy and a value model); off,
    it swaps nothing."""
    from rlhf_sg.workers import WorkerSpec, load_worker_model

    path = tiny.save_tiny_model(str(tmp_path / "m"), arch="qwen2")
    base = dict(model_path=path, world_size=1, master_addr="", master_port=0, packing_probe=False)
    actor = load_worker_model(WorkerSpec(role="actor", fused_kernels=True, **base))
    assert fused_counts(actor)["silu_mul"] == actor.config.num_hidden_layers
    critic = load_worker_model(WorkerSpec(role="critic", fused_kernels=True, **base))
    assert fused_counts(critic)["rms_norm_cast_then_scale"] > 0
    assert not fused_counts(load_worker_model(WorkerSpec(role="actor", **base)))


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen2", "olmo-2", "gemma-3"])
def test_on_a_gpu_the_triton_kernels_compute_the_models_values(family):
    """On CUDA Inductor writes Triton kernels: in bfloat16 each norm gives the module's own bits, and the whole
    model's logits and gradients stay within bfloat16 rounding of its own (the products round once)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model, ids = _family_case(family)
    model, ids = model.to("cuda", torch.bfloat16), ids.to("cuda")
    norm = next(m for m in model.modules() if "RMSNorm" in type(m).__name__)
    x = torch.randn(3, 7, norm.weight.shape[0], device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    x = x.to(torch.bfloat16)
    expected_norm = norm(x)
    logits, grads = _forward_backward(model, ids)
    assert fuse_kernels(model) == EXPECTED[family]
    assert torch.equal(norm(x), expected_norm)
    fused_logits, fused_grads = _forward_backward(model, ids)
    torch.testing.assert_close(fused_logits.float(), logits.float(), atol=0.1, rtol=0.05)
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name].float(), grad.float(), atol=0.1, rtol=0.05,
                                   msg=lambda m, name=name: f"{name}: {m}")
