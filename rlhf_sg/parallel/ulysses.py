"""Ulysses around the attention functions the project runs: sequence-sharded in, head-sharded over the whole
sequence inside, sequence-sharded out.

Each rank of an SP group of N ranks holds ``L / N`` consecutive columns of the packed rows. Embeddings, projections,
RoPE (from the shard's own position ids), MLPs and norms are per token and run on the shard. At each attention call
the query, key and value [R, heads, L / N, D] are exchanged (one all-to-all each) into [R, heads / N, L, D]: the rank
now holds the whole rows for its heads, so the attention function the model would have run, with the full rows' mask
(block-causal for packed rows, the tree for shared prompts; the caller builds it for all L columns) or its varlen
arguments, computes exactly what one rank computes for those heads. One more all-to-all brings the output back to the
shard's columns with every head. The exchange is DeepSpeed's ``_dim_zero_all_to_all`` (an operator with a declared
backward: the backward is the reverse exchange), which runs on gloo as on NCCL.

A model switched here (:func:`use_ulysses_attention`) keeps its attention: a forward without
:data:`SEQUENCE_PARALLEL_KWARG` (the start-up probe's, a one-rank group's) calls the wrapped function unchanged.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch
from torch import nn

from rlhf_sg.packing import _backbone, _unwrap, unwrap_adapters
from rlhf_sg.parallel.heads import check_sequence_parallel_heads, head_counts

#: the model-forward keyword that carries a forward's :class:`SequenceParallelGroup` to the attention function
SEQUENCE_PARALLEL_KWARG = "sequence_parallel"
#: prefix of the attention implementations registered here (:func:`wrapper_name`)
ULYSSES_PREFIX = "rlhf_sg_ulysses_"
#: each registered wrapper's name -> the implementation it wraps
_WRAPPED: dict[str, str] = {}


def wrapper_name(implementation: str) -> str:
    """The name the Ulysses wrapper of ``implementation`` is registered under: ``rlhf_sg_ulysses_<implementation>``,
    with "flash" written "fa". transformers takes any implementation whose name holds "flash" for a flash-attention
    kernel to load by that name (``set_attn_implementation`` preloads it, and would look for a kernel called
    ``rlhf_sg_ulysses_flash_attention_2`` on the hub); the wrapped function is handed a module whose config names
    the wrapped implementation, so the flash function loads its own kernel."""
    return ULYSSES_PREFIX + implementation.replace("flash", "fa")


def unwrapped(name: str | None) -> str | None:
    """The implementation a model whose config names ``name`` runs: the wrapped one for a Ulysses wrapper, else
    ``name`` itself."""
    return _WRAPPED.get(name, name) if isinstance(name, str) else name


@dataclass(frozen=True)
class SequenceParallelGroup:
    """An SP group: its process group, size N and this rank's index in it (shard ``rank`` of every row). ``causal``
    (set per forward by :mod:`rlhf_sg.parallel.forward` on sdpa when every row holds one sequence): causal attention
    over the whole rows, in place of whatever mask the model built from the shard's columns (its position ids restart
    at the pad columns, which transformers reads as packed sequences)."""

    group: object  # torch.distributed.ProcessGroup
    size: int
    rank: int
    causal: bool = False

    @classmethod
    def of(cls, group) -> SequenceParallelGroup:
        import torch.distributed as dist
        from deepspeed.sequence.layer import register_all_to_all_group

        register_all_to_all_group(group)  # DeepSpeed's exchange finds its group by name
        return cls(group=group, size=dist.get_world_size(group), rank=dist.get_rank(group))


def _exchange(group: SequenceParallelGroup, chunks: torch.Tensor) -> torch.Tensor:
    """[N, ...]: chunk j to rank j; returns [N, ...] with chunk i from rank i (differentiable)."""
    from deepspeed.sequence.layer import _dim_zero_all_to_all

    return _dim_zero_all_to_all(group.group, chunks)


def sequence_to_heads(x: torch.Tensor, group: SequenceParallelGroup) -> torch.Tensor:
    """[R, h, L / N, D] (this rank's columns, every head) -> [R, h / N, L, D] (every column, this rank's heads)."""
    rows, heads, local, dim = x.shape
    n = group.size
    chunks = x.reshape(rows, n, heads // n, local, dim).permute(1, 0, 2, 3, 4)  # [N, R, h / N, L / N, D]
    received = _exchange(group, chunks.contiguous())  # chunk i: rank i's columns of my heads
    return received.permute(1, 2, 0, 3, 4).reshape(rows, heads // n, n * local, dim)


def heads_to_sequence(x: torch.Tensor, group: SequenceParallelGroup) -> torch.Tensor:
    """[R, L, h / N, D] (an attention function's output for this rank's heads) -> [R, L / N, h, D]."""
    rows, length, heads, dim = x.shape
    n = group.size
    chunks = x.reshape(rows, n, length // n, heads, dim).permute(1, 0, 2, 3, 4)  # [N, R, L / N, h / N, D]
    received = _exchange(group, chunks.contiguous())  # chunk i: my columns of rank i's heads
    return received.permute(1, 2, 0, 3, 4).reshape(rows, length // n, n * heads, dim)


class _ConfigAs:
    """A model config read as it is, but naming ``implementation`` as its attention implementation."""

    def __init__(self, config, implementation: str):
        self._config = config
        self._attn_implementation = implementation

    def __getattr__(self, name):
        return getattr(self._config, name)


class _AsWrapped:
    """The attention module as the wrapped function sees it: its own attributes, but its config naming the wrapped
    implementation (transformers' flash-attention function loads its kernels by the name
    ``module.config._attn_implementation`` gives, which on a switched model is the wrapper's) and, on an SP rank, the
    query heads per key / value head that the rank holds (``num_key_value_groups``, which transformers' sdpa and eager
    functions repeat the key / value heads by; it changes when the key / value heads were replicated)."""

    def __init__(self, module: nn.Module, implementation: str, groups: int | None = None):
        self._module = module
        self.config = _ConfigAs(module.config, implementation)
        if groups is not None:
            self.num_key_value_groups = groups

    def __getattr__(self, name):
        return getattr(self._module, name)


def _wrapped_function(module: nn.Module, implementation: str):
    if implementation == "eager":  # each modeling file has its own; the model passes it as the default
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if eager is None:
            raise ValueError(f"{type(module).__name__}: its modeling module has no eager_attention_forward to run "
                             "under sequence parallelism; use sdpa")
        return eager
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[implementation]


def ulysses_attention(module, query, key, value, attention_mask, *, implementation: str, sequence_parallel=None,
                      **kwargs):
    """The attention function registered as :func:`wrapper_name` of ``implementation``: query [R, h, L / N, D] and key /
    value [R, h_kv, L / N, D] of this rank's columns; ``attention_mask`` the full rows' (or None with varlen
    arguments, which describe the full rows); returns [R, L / N, h, D] and None. Without ``sequence_parallel``
    it is the wrapped function."""
    attend = _wrapped_function(module, implementation)
    group = sequence_parallel
    if group is None or group.size == 1:
        return attend(_AsWrapped(module, implementation), query, key, value, attention_mask, **kwargs)
    kv_heads = key.shape[1]
    if kv_heads < group.size:  # replicated so that rank i holds the one its query heads read
        key, value = (x.repeat_interleave(group.size // kv_heads, dim=1) for x in (key, value))
    query, key, value = (sequence_to_heads(x, group) for x in (query, key, value))
    local = _AsWrapped(module, implementation, query.shape[1] // key.shape[1])
    if group.causal:  # one sequence per row, the pad columns after it: causal over the whole rows is exact
        attention_mask, kwargs["is_causal"] = None, True
    elif kwargs.get("cu_seq_lens_q") is not None:
        pass  # varlen: no mask, the arguments describe the full rows (the kernel refuses lengths that do not add up)
    elif attention_mask is None or attention_mask.shape[-2] != query.shape[2]:
        raise ValueError(f"sequence parallelism: the attention mask covers "
                         f"{None if attention_mask is None else attention_mask.shape[-2]} queries, not the full rows' "
                         f"{query.shape[2]}; pass the full rows' mask (rlhf_sg.parallel.forward)")
    out, _ = attend(local, query, key, value, attention_mask, **kwargs)
    return heads_to_sequence(out, group), None


def _attention_model(model: nn.Module) -> nn.Module:
    """The transformers model whose config names the attention a forward of ``model`` runs: inside a DeepSpeed
    engine, a PEFT (LoRA) wrapper (whose attribute lookups would reach a value model's head model, not its backbone)
    and a value model's head."""
    return _backbone(unwrap_adapters(_unwrap(model)))


def use_ulysses_attention(model: nn.Module, size: int) -> str:
    """Switch ``model``'s attention to the Ulysses wrapper of the one it runs (sdpa, eager, flash-attention, the
    shared-prompt blocks); returns the wrapped implementation's name. Refuses (ConfigError) an SP ``size`` its heads
    cannot split. A model already switched stays as it is."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    backbone = _attention_model(model)
    config = backbone.config
    heads, kv_heads = head_counts(config)
    check_sequence_parallel_heads(type(backbone).__name__, heads, kv_heads, size, "sequence_parallel_size")
    current = config._attn_implementation
    if current in _WRAPPED:
        return _WRAPPED[current]
    name = wrapper_name(current)
    _WRAPPED[name] = current
    AttentionInterface.register(name, functools.partial(ulysses_attention, implementation=current))
    # the model builds its masks as the wrapped one would (a 4-D mask the caller passes is used as it is)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current if current in
                                                                    ALL_MASK_ATTENTION_FUNCTIONS else "sdpa"])
    backbone.set_attn_implementation(name)
    return current


def wrapped_implementation(module: nn.Module) -> str | None:
    """The implementation a switched model's Ulysses wrapper runs; None for a model not switched."""
    return _WRAPPED.get(getattr(_attention_model(module).config, "_attn_implementation", None))
