"""Flash-attention's varlen kernel, as a reference on CPU: the one part of transformers' ``flash_attention_2`` path
that cannot run here. Everything above it, transformers' ``flash_attention_forward`` and ``_flash_attention_forward``
(how the kernel is chosen by ``module.config._attn_implementation``, how packed rows reach it as ``cu_seq_lens_q/k``),
and the project's code that calls them, runs as on a GPU.

The reference keeps to the kernel's contract (``flash_attn.flash_attn_varlen_func``): the same parameter names (which
transformers reads to decide what to pass), flattened ``[total, heads, dim]`` inputs, int32 cumulative lengths on the
inputs' device ending at the total, no sequence longer than ``max_seqlen``, key / value heads dividing the query
heads; causal attention within each sequence, never across them. A call outside the contract raises, as the kernel
would fail or compute something else.
"""

from __future__ import annotations

import contextlib

import torch

#: the attention implementation the reference stands in for
IMPLEMENTATION = "flash_attention_2"


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    for name, cu, x in (("cu_seqlens_q", cu_seqlens_q, q), ("cu_seqlens_k", cu_seqlens_k, k)):
        if cu.dtype != torch.int32 or cu.device != q.device:
            raise ValueError(f"{name}: int32 on the inputs' device, got {cu.dtype} on {cu.device}")
        if int(cu[0]) != 0 or int(cu[-1]) != x.shape[0] or bool((cu.diff() < 0).any()):
            raise ValueError(f"{name} {cu.tolist()} does not cover the {x.shape[0]} flattened tokens")
    if not torch.equal(cu_seqlens_q, cu_seqlens_k):
        raise ValueError("the reference computes self-attention only: cu_seqlens_q == cu_seqlens_k")
    longest = int(cu_seqlens_q.diff().max())
    if longest > max_seqlen_q or longest > max_seqlen_k:
        raise ValueError(f"a sequence of {longest} tokens over max_seqlen {max_seqlen_q} / {max_seqlen_k}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{k.shape[1]} key/value heads do not divide {q.shape[1]} query heads")
    if dropout_p or tuple(window_size) != (-1, -1) or softcap or alibi_slopes is not None or block_table is not None:
        raise ValueError("the reference computes plain attention: no dropout, window, softcap, ALiBi or block table")
    bounds = cu_seqlens_q.tolist()
    outputs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        query, key, value = (x[start:end].transpose(0, 1) for x in (q, k, v))  # [heads, n, dim]
        key, value = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=0) for x in (key, value))
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=causal,
                                                               scale=softmax_scale)
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs)


@contextlib.contextmanager
def flash_kernel_reference():
    """While open, transformers' flash-attention path takes :func:`flash_attn_varlen_func` as the ``flash_attention_2``
    kernel; any other implementation name is refused as transformers refuses a kernel it cannot find (it would look
    for it on the hub)."""
    import transformers.modeling_flash_attention_utils as fa

    real = fa._lazy_imports

    def lazy_imports(implementation, attention_wrapper=None, allow_all_kernels=False):
        if implementation != IMPLEMENTATION:
            raise ValueError(f"Could not find the currently requested flash attention implementation at "
                             f"`{implementation}`.")
        return None, flash_attn_varlen_func, None, fa._pad_input, fa._unpad_input

    fa._lazy_imports, fa._loaded_implementation = lazy_imports, None
    try:
        yield
    finally:
        fa._lazy_imports, fa._loaded_implementation = real, None
