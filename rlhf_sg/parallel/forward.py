"""Log-probs, entropy and values of a rollout batch computed by an SP group, each rank on its columns.

Every rank of the group is given the same padded batch; it packs it (:func:`rlhf_sg.packing.pack`, labels included;
or, with ``share_prompts`` and a prompt repeated, :func:`rlhf_sg.packing.pack_shared_prompts`), pads and slices the
rows (:func:`rlhf_sg.parallel.layout.shard_packed`, :func:`~rlhf_sg.parallel.layout.shard_shared`), checks that the
group's shards are one batch (an all-gather of the shards' token and position ids: ranks given different batches
would train on a mix of them), and runs the model on its columns with the full rows' mask (the tree mask of
shared-prompt rows, or the blocks that stand in for it on a model switched to them), the attention going through the
Ulysses wrapper (:mod:`rlhf_sg.parallel.ulysses`). Each rank projects only the hidden states of its columns that
predict a response token (the lm_head in chunks, as :func:`rlhf_sg.packing.response_logprobs`), then the group sums
the [B, T] blocks (each response token is computed on exactly one rank, zero elsewhere), so every rank returns the
whole batch's result.

The loss convention (one, for every group): every rank of an SP group computes the whole batch's loss from these
gathered per-token results, with the whole batch's normaliser: the same number on every rank, reported once per group
(not summed over it). The gather's backward hands each rank the gradient of its own tokens only (no reduction), so a
rank's parameter gradients are its columns' share, and the SP group's gradients SUMMED equal the one-rank gradient:
what ZeRO-3 does given SP groups (all-reduce, divided by data-parallel ranks only).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from rlhf_sg.packing import (
    _FLASH_IMPLEMENTATIONS,
    PackedBatch,
    _attn_implementation,
    _block_causal_mask,
    _block_positions,
    _check_padded,
    _check_rollout,
    _dense_mask,
    _forward_replaced,
    _frozen_zero3,
    _FrozenHead,
    _lm_head_transform,
    _logprob_chunk,
    _model_device,
    _model_dtype,
    _response_predictors,
    _row_tokens,
    _shared_forward,
    _shared_groups,
    _to_response_block,
    _unwrap,
    _value_model,
    check_rope_regime,
    default_segment_tokens,
    one_sequence_per_row_reason,
    pack,
    pack_shared_prompts,
    pack_values,
    unwrap_adapters,
)
from rlhf_sg.parallel.layout import ShardedRows, shard_packed, shard_shared
from rlhf_sg.parallel.ulysses import SEQUENCE_PARALLEL_KWARG, SequenceParallelGroup, wrapped_implementation


class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum over the SP group (each entry is non-zero on one rank). Backward: the gradient as it is, since
    every rank computes the same loss from the sum (the group's gradients are summed afterwards, not here)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _check_one_batch(rows: ShardedRows, group: SequenceParallelGroup) -> None:
    """Gather the group's shards and hold them to this rank's full rows: the ranks of an SP group must be given the
    same batch."""
    for name, local, full in (("token ids", rows.input_ids, rows.full_input_ids),
                              ("position ids", rows.position_ids, rows.full_position_ids)):
        shards = [torch.empty_like(local) for _ in range(group.size)]
        dist.all_gather(shards, local.contiguous(), group=group.group)
        if not torch.equal(torch.cat(shards, dim=1), full):
            raise ValueError(f"sequence parallelism: the {name} of the SP group's shards are not this rank's "
                             f"(rank {group.rank} of {group.size}); every rank of an SP group must be given the same "
                             "batch")


def _implementation(module: nn.Module) -> str:
    """The attention implementation a switched model's Ulysses wrapper runs (sdpa for the shared-prompt blocks, whose
    every other call is sdpa's); refuses a model not switched, or one whose rows cannot be split."""
    if wrapped_implementation(module) is None:
        raise ValueError(f"{type(module).__name__} is not switched to sequence parallelism; call "
                         "rlhf_sg.parallel.use_ulysses_attention(model, size) first")
    reason = one_sequence_per_row_reason(module)
    if reason is not None:
        raise ValueError(f"{type(module).__name__}: {reason}, so its rows cannot be split across ranks; train it with "
                         "sequence_parallel_size 1")
    return _attn_implementation(module, None)


def _sharded_forward(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor,
                     group: SequenceParallelGroup, **forward_kwargs):
    """Pack, pad, slice, check, and call ``model`` on this rank's columns; returns (the model's output, the packed
    batch, the rank's rows)."""
    module = _unwrap(model)
    implementation = _implementation(module)
    device = _model_device(model)
    batch = pack(sequences, attention_mask, row_tokens=_row_tokens(implementation, attention_mask))
    rows = shard_packed(batch, group.size, group.rank)
    _check_one_batch(rows, group)
    kwargs = dict(forward_kwargs)
    if implementation in _FLASH_IMPLEMENTATIONS:  # one row; the pad columns are one more sequence
        width = rows.full_position_ids.shape[1]
        cu_seqlens = batch.cu_seqlens.to(device)
        if width > batch.num_tokens:
            cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([width])])
        longest = max(batch.max_seqlen, width - batch.num_tokens)
        kwargs.update(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=longest,
                      max_length_k=longest)
    elif implementation == "sdpa" and batch.input_ids.shape[0] == batch.num_sequences:
        group = dataclasses.replace(group, causal=True)  # one sequence per row: no [R, 1, L, L] mask
    else:
        dtype, positions = _model_dtype(module), rows.full_position_ids.to(device)
        kwargs["attention_mask"] = _dense_mask(module, lambda window: _block_causal_mask(positions, dtype, window))
    kwargs[SEQUENCE_PARALLEL_KWARG] = group
    out = model(input_ids=rows.input_ids.to(device), position_ids=rows.position_ids.to(device), use_cache=False,
                **kwargs)
    return out, batch, rows


def _response_tokens(batch: PackedBatch, rows: ShardedRows, attention_mask: torch.Tensor, response_width: int):
    """The response tokens' predictors in this rank's columns: (their flat index in the shard, labels, flat
    positions ``b * T + j`` in the response block)."""
    predicts = pack_values(_response_predictors(attention_mask, response_width), batch)
    mine, local = rows.local_index(rows.slots[predicts])
    positions = _block_positions(batch.indices[predicts], batch, response_width)
    return local, batch.labels[predicts][mine], positions[mine]


def _response_forward(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor, response_width: int,
                      group: SequenceParallelGroup, share_prompts: bool, segment_tokens: int | None,
                      **forward_kwargs):
    """``model`` on this rank's columns: of shared-prompt rows where ``share_prompts`` finds a prompt repeated
    (:func:`rlhf_sg.packing.pack_shared_prompts`, padded and sliced by :func:`rlhf_sg.parallel.layout.shard_shared`;
    the tree mask or the blocks are the whole rows', so after the all-to-all each rank's heads attend as one rank's
    do), else of packed rows. Returns the model's output and the response tokens whose predictors lie in this rank's
    columns: their flat index in the shard, labels, flat positions ``b * T + j`` in the response block."""
    module = _unwrap(model)
    groups = _shared_groups(module, share_prompts, sequences, attention_mask, response_width)
    if groups is None:
        out, batch, rows = _sharded_forward(model, sequences, attention_mask, group, **forward_kwargs)
        return (out, *_response_tokens(batch, rows, attention_mask, response_width))
    implementation = _implementation(module)
    shared = pack_shared_prompts(sequences, attention_mask, response_width,
                                 segment_tokens or default_segment_tokens(module), groups=groups)
    shared, rows = shard_shared(shared, group.size, group.rank)
    _check_one_batch(rows, group)
    forward_kwargs[SEQUENCE_PARALLEL_KWARG] = group
    out = _shared_forward(model, shared, implementation, input_ids=rows.input_ids, position_ids=rows.position_ids,
                          **forward_kwargs)
    mine, local = rows.local_index(shared.predictor_slots)
    return out, local, shared.labels[mine], shared.block_positions[mine]


def _gathered_block(values: torch.Tensor, positions: torch.Tensor, shape: tuple[int, int],
                    group: SequenceParallelGroup) -> torch.Tensor:
    return _SumOverGroup.apply(_to_response_block(values, positions, shape), group.group)


def sp_response_logprobs(
    model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor, response_width: int,
    group: SequenceParallelGroup, temperature: float = 1.0, with_entropy: bool = False, chunk_tokens: int = 1024,
    share_prompts: bool = False, segment_tokens: int | None = None,
):
    """:func:`rlhf_sg.packing.response_logprobs` by an SP group (module doc): ``logp`` [B, T] float32 (and
    ``entropy`` [B, T]), the whole batch's on every rank, equal to one rank's up to float rounding. ``model`` must
    have been switched (:func:`rlhf_sg.parallel.use_ulysses_attention`); every rank of ``group`` calls this with the
    same batch. ``share_prompts``, ``segment_tokens``: as in :func:`rlhf_sg.packing.response_logprobs` (the blocks
    where the model was switched to them before the Ulysses wrapper)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    module = _unwrap(model)
    lm_head = module.get_output_embeddings()
    head = _lm_head_transform(module)
    device = _model_device(model)
    sequences, attention_mask = sequences.to(device), attention_mask.to(device)
    _check_rollout(sequences, attention_mask, response_width)
    check_rope_regime(module, attention_mask.sum(dim=1).tolist())
    captured: dict[str, torch.Tensor] = {}

    def keep_hidden(_module, _args, output):
        captured["hidden"] = output[0]

    causal_lm = unwrap_adapters(module)
    hook = causal_lm.base_model.register_forward_hook(keep_hidden)
    try:
        _, local, labels, positions = _response_forward(
            model, sequences, attention_mask, response_width, group, share_prompts, segment_tokens,
            logits_to_keep=torch.empty(0, dtype=torch.long, device=device))
    finally:
        hook.remove()
    hidden = captured["hidden"].reshape(-1, captured["hidden"].shape[-1])[local.to(device)]
    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in lm_head.parameters()))

    def chunked(projection, states: torch.Tensor) -> torch.Tensor:
        """states [n, H] -> [2, n] log-probs and entropy; one chunk at least, so that a rank with no response token
        in its columns calls the head as the others do."""
        parts = []
        for start in range(0, max(states.shape[0], 1), chunk_tokens):
            args = (states[start:start + chunk_tokens], labels[start:start + chunk_tokens], projection, temperature,
                    with_entropy, head)
            logp, entropy = checkpoint(_logprob_chunk, *args, use_reentrant=False) if needs_grad \
                else _logprob_chunk(*args)
            parts.append(torch.stack((logp, entropy.expand_as(logp))))
        return torch.cat(parts, dim=1)

    if needs_grad and _frozen_zero3(lm_head):  # as response_logprobs: one full copy of a frozen ZeRO-3 head
        out = chunked(_FrozenHead(lm_head), hidden)
    else:
        with _forward_replaced(lm_head, functools.partial(chunked, lm_head.forward)):
            out = lm_head(hidden)
    shape = (sequences.shape[0], response_width)
    logp = _gathered_block(out[0], positions, shape, group)
    if not with_entropy:
        return logp
    return logp, _gathered_block(out[1], positions, shape, group)


def sp_critic_values(critic: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor, response_width: int,
                     group: SequenceParallelGroup, share_prompts: bool = False,
                     segment_tokens: int | None = None) -> torch.Tensor:
    """:func:`rlhf_sg.packing.critic_values` by an SP group: values [B, T] float32, the whole batch's on every
    rank; ``share_prompts``, ``segment_tokens`` as there."""
    _value_model(critic, "sp_critic_values")
    device = _model_device(critic)
    sequences, attention_mask = sequences.to(device), attention_mask.to(device)
    _check_rollout(sequences, attention_mask, response_width)
    check_rope_regime(_unwrap(critic), attention_mask.sum(dim=1).tolist())
    values, local, _, positions = _response_forward(critic, sequences, attention_mask, response_width, group,
                                                    share_prompts, segment_tokens)
    return _gathered_block(values.reshape(-1)[local.to(device)], positions, (sequences.shape[0], response_width),
                           group)


def sp_reward_scores(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor,
                     group: SequenceParallelGroup) -> torch.Tensor:
    """:func:`rlhf_sg.packing.reward_scores` by an SP group: scores [B] float32, each row's value at its last real
    token, the whole batch's on every rank. ``sequences`` / ``attention_mask`` [B, S] in any contiguous-row padding.
    The rank whose columns hold a sequence's last token reads its score (zero elsewhere) and the group sums them, as
    the log-probs' blocks; the backward keeps each rank's own scores (the module doc's convention)."""
    _value_model(model, "sp_reward_scores")
    device = _model_device(model)
    sequences, attention_mask = sequences.to(device), attention_mask.to(device)
    _check_padded(sequences, attention_mask)
    check_rope_regime(_unwrap(model), attention_mask.sum(dim=1).tolist())
    values, batch, rows = _sharded_forward(model, sequences, attention_mask, group)
    mine, local = rows.local_index(rows.slots[batch.cu_seqlens[1:].long() - 1])  # each sequence's last token
    scores = values.new_zeros(sequences.shape[0]).index_put((mine.nonzero().flatten().to(device),),
                                                            values.reshape(-1)[local.to(device)])
    return _SumOverGroup.apply(scores, group.group)
