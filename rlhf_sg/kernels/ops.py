"""The fused elementwise ops: each one ``torch.compile`` region, so the forward is one kernel and its backward one more
(Inductor writes them: C++ with OpenMP on CPU, Triton on CUDA), where eager runs five to eight ops, each reading and
writing the whole activation. The matmuls around them stay eager.

Each op computes what the transformers module it stands in for computes, in the same order and dtypes
(:mod:`rlhf_sg.kernels.fuse` checks a module's source against that form before it swaps it in). Compiled with
``dynamic=True``: packed rows change length every micro-batch, and one graph serves every length.

Shapes: ``x [..., hidden]`` in the model's dtype, ``weight [hidden]``; ``gate``, ``up [..., intermediate]``;
``q [B, H, T, D]``, ``k [B, H_kv, T, D]``, ``cos``, ``sin [B, T, D]``.

The norms give the module's bits in every dtype. The products (the gated MLP's, the rotary embedding's) compute in
float32 inside the kernel and round once: in float32 that is the module's value up to rounding, in half precision
at most one unit in the last place from it (eager rounds after each op).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Inductor rounds at every cast the eager code makes (a half-precision model's norm casts back before it scales;
#: by default Inductor keeps the float32 value and rounds once, which is a different result)
_OPTIONS = {"emulate_precision_casts": True}


def _normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


@torch.compile(dynamic=True, fullgraph=True, options=_OPTIONS)
def rms_norm_cast_then_scale(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm (Qwen2/3, Mistral, Mixtral, Phi-3): normalised in float32, cast back, then scaled."""
    return weight * _normed(x, eps).to(x.dtype)


@torch.compile(dynamic=True, fullgraph=True, options=_OPTIONS)
def rms_norm_scale_then_cast(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """OLMo-2's and gpt-oss's RMSNorm: scaled in float32, then cast back."""
    return (weight * _normed(x, eps)).to(x.dtype)


@torch.compile(dynamic=True, fullgraph=True, options=_OPTIONS)
def rms_norm_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm (Gemma-2/3, Qwen3-Next, Qwen3.5): scaled by ``1 + weight`` in float32, then cast back."""
    return (_normed(x, eps) * (1.0 + weight.float())).type_as(x)


@torch.compile(dynamic=True, fullgraph=True, options=_OPTIONS)
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """A gated MLP's product with SiLU: ``silu(gate) * up``."""
    return F.silu(gate) * up


@torch.compile(dynamic=True, fullgraph=True, options=_OPTIONS)
def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """A gated MLP's product with tanh-approximated GELU (Gemma): ``gelu_tanh(gate) * up``."""
    return F.gelu(gate, approximate="tanh") * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@torch.compile(dynamic=True, fullgraph=True, options=_OPTIONS)
def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding of queries and keys (Llama's ``apply_rotary_pos_emb``, whole head dim rotated, halves
    swapped): ``x cos + rotate_half(x) sin``."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
