"""Padding removal by tensor slicing: padded rollout rows <-> packed rows, and forwards on packed rows.

Three layouts of one batch:

- **padded**: ``sequences`` [B, S] = a left-padded prompt block of width P followed by a right-padded
  response block of width T (S = P + T); ``attention_mask`` [B, S] is 1 on real tokens, so each row's
  real tokens are one contiguous run.
- **token order**: the N real tokens, sequence after sequence (the row-major order of the padded batch).
  Per-token results live here as ``[N, ...]``; :func:`pack_values` and :func:`unpack` move tensors
  between this and the padded layout by gathering / scattering at ``PackedBatch.indices``.
- **packed rows**: what the model sees, ``input_ids`` [R, L]: sequences laid end to end, position ids
  restarting at 0 for each sequence, attention kept inside each sequence. How many rows depends on the
  attention kernel:

  * flash-attn varlen (``flash_attention_2``/``_3``) costs sum(len_i^2) whatever the row holds, so every
    sequence goes into ONE row [1, N] and the kernel gets ``cu_seqlens``;
  * ``sdpa`` and ``eager`` take an explicit 4D block-causal mask and cost R * L^2 (the masked-out pairs
    are computed too). One [1, N] row would cost N^2: in a trial on a mix like the benchmark's (16
    rollouts, 6k real tokens, 25M model, CPU, forward + backward, best of 2) it took 1.5x the padded
    time, where rows no longer than the longest sequence took 0.5x. So sequences are bin-packed
    (first-fit decreasing) into such rows, which keeps both the pad slots and the wasted attention
    small; a row holding one sequence needs no mask at all (causal attention is then exact), which
    lets sdpa use its causal kernel.

Attention across sequences never happens: with transformers 5.19, ``sdpa``/``eager`` given packed
``position_ids`` and no mask attend across sequences whenever the model builds a KV cache (the default
``use_cache``), logits off by ~0.5. We therefore always pass ``use_cache=False`` and, wherever a row
holds several sequences, an explicit 4D mask, which transformers hands to the attention function
untouched (``masking_utils`` returns a 4D mask as-is): an additive mask in the model's dtype for both ``sdpa``
and ``eager`` (a bool mask would be ADDED to the scores by eager: wrong; sdpa would convert it on every layer),
built once per forward and shared by every layer (see :func:`_finish_mask`).

Shared-prompt rows (:class:`SharedPromptRows`, a prompt once and its responses after it) take a tree mask, whose
[L, L] square the masked kernels compute whole though a response attends only to its prompt and itself. A model
switched to :data:`SHARED_PROMPT_ATTENTION` (:func:`use_shared_prompt_attention`; the trainer's workers switch an
sdpa model that shares prompts) computes them instead as blocks (:class:`SharedPromptBlocks`): each prompt causally,
each response over its prompt and itself, with sdpa's kernels on gathered keys and values. Any layer the blocks do
not describe (a sliding window, softcapping, sinks, a mask the model changed) gets the tree mask from sdpa as before,
and the start-up probe (:mod:`rlhf_sg.probe`) holds the result to each sequence alone.

The functions the trainer calls, all taking the padded layout and answering in it:
:func:`response_logprobs` (log-probs and entropy of response tokens, fp32, chunked over the vocabulary),
:func:`critic_values`, :func:`reward_scores`; and for the training loop :func:`token_budget_microbatches`.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import logging
import math
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

#: label of a sequence's last token: it has no next token in its own sequence
IGNORE_LABEL = -100

_FLASH_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3")
_MASKED_IMPLEMENTATIONS = ("sdpa", "eager")

logger = logging.getLogger(__name__)

#: key-axis alignment of the dense masks (torch's memory-efficient sdpa pads a mask's last dim to a multiple of
#: 16: ``lastDimAligned`` in ``torch/_meta_registrations.py``)
_MASK_KEY_ALIGNMENT = 16


@dataclass
class PackedBatch:
    """A padded batch with its padding removed.

    Packed rows (model input):
        input_ids: [R, L] long; slots after a row's last sequence hold 0.
        position_ids: [R, L] long; restart at 0 for every sequence. The pad slots at a row's end continue
            the positions of the row's last sequence, so to the block-causal mask they are part of it:
            real tokens never see them (they come later) and every pad query has keys (an all-masked
            query row would make sdpa return NaN). Rows are no longer than ``row_tokens`` (the longest
            sequence, as the forwards here pack), so the largest position id is the longest sequence's.
    Token order (N real tokens, sequence after sequence):
        labels: [N] long; the next token of the same sequence, taken by shifting the PADDED rows before
            unpadding, so no label crosses into another sequence; :data:`IGNORE_LABEL` at each
            sequence's last token.
        indices: [N] long; flat index ``b * S + s`` of each real token in the padded [B, S].
        slots: [N] long; flat index ``r * L + c`` of each real token in the packed rows.
        cu_seqlens: [B + 1] int32; sequence b is tokens ``cu_seqlens[b]:cu_seqlens[b + 1]``.
        max_seqlen: length of the longest sequence.
        padded_shape: (B, S).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    indices: torch.Tensor
    slots: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    padded_shape: tuple[int, int]

    @property
    def num_tokens(self) -> int:
        return int(self.indices.numel())

    @property
    def num_sequences(self) -> int:
        return self.padded_shape[0]


# ---- padded <-> packed ---------------------------------------------------------------------------------


def _check_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Validate a padded batch; return the per-row lengths [B] (long)."""
    if not isinstance(input_ids, torch.Tensor) or not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            f"input_ids and attention_mask must be tensors, got {type(input_ids).__name__} and "
            f"{type(attention_mask).__name__}"
        )
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must both "
            "be [batch, seq] of the same shape"
        )
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.device != attention_mask.device:
        raise ValueError(f"input_ids on {input_ids.device} but attention_mask on {attention_mask.device}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"empty batch: input_ids has shape {tuple(input_ids.shape)}")
    mask = attention_mask.bool()
    if (mask.to(attention_mask.dtype) != attention_mask).any():
        raise ValueError("attention_mask must hold only 0 and 1")
    lengths = mask.sum(dim=1)
    empty = (lengths == 0).nonzero()
    if empty.numel():
        raise ValueError(
            f"attention_mask row {int(empty[0])} has no real token; drop empty rows before packing"
        )
    seq = mask.shape[1]
    first = mask.int().argmax(dim=1)
    last = seq - 1 - mask.flip(1).int().argmax(dim=1)
    holes = (last - first + 1 != lengths).nonzero()
    if holes.numel():
        b = int(holes[0])
        raise ValueError(
            f"attention_mask row {b} has padding between its real tokens ({int(lengths[b])} real tokens "
            f"spread over columns {int(first[b])}..{int(last[b])}); each row must be one contiguous run "
            "(a left-padded prompt followed by a right-padded response)"
        )
    return lengths


def _first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of item indices, each bin's total <= capacity: longest first, into the first bin with room."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, load in enumerate(loads):
            if load + lengths[i] <= capacity:
                bins[r].append(i)
                loads[r] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def pack(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, row_tokens: int | None = None, one_per_row: bool = False
) -> PackedBatch:
    """Remove the padding of ``input_ids`` [B, S] (real tokens where ``attention_mask`` [B, S] is 1).

    ``row_tokens=None`` lays every sequence into one row [1, N] (for flash-attn varlen); an int bin-packs
    the sequences into rows of at most ``row_tokens`` tokens (for a dense block-causal mask), which must
    be at least the longest sequence; ``one_per_row`` gives each sequence its own row (for models with recurrent
    layers, :func:`one_sequence_per_row_reason`). Raises ValueError on a mask that is not 0/1, a row without real
    tokens, or a row whose real tokens are not contiguous.
    """
    lengths = _check_padded(input_ids, attention_mask)
    device = input_ids.device
    batch_size, seq = input_ids.shape
    mask = attention_mask.bool()
    indices = mask.flatten().nonzero().squeeze(1)
    num_tokens = indices.numel()

    # Shift in the padded layout, then gather: a token's label comes from its own row, never another's.
    next_ids = torch.full_like(input_ids, IGNORE_LABEL)
    next_ids[:, :-1] = torch.where(mask[:, 1:], input_ids[:, 1:], IGNORE_LABEL)
    labels = next_ids.flatten()[indices]

    cu_seqlens = torch.zeros(batch_size + 1, dtype=torch.int32, device=device)
    cu_seqlens[1:] = lengths.cumsum(0)
    seq_of_token = torch.repeat_interleave(torch.arange(batch_size, device=device), lengths)
    starts = cu_seqlens[:-1].long()
    token_position = torch.arange(num_tokens, device=device) - starts[seq_of_token]

    lengths_list = lengths.tolist()
    max_seqlen = max(lengths_list)
    if one_per_row:
        rows = [[b] for b in range(batch_size)]
    elif row_tokens is None:
        rows = [list(range(batch_size))]
    else:
        if row_tokens < max_seqlen:
            b = lengths_list.index(max_seqlen)
            raise ValueError(f"row_tokens={row_tokens} is shorter than sequence {b} ({max_seqlen} tokens)")
        rows = _first_fit_decreasing(lengths_list, row_tokens)
    row_of_seq = [0] * batch_size
    offset_of_seq = [0] * batch_size
    loads, last_starts = [], []
    for r, members in enumerate(rows):
        offset = 0
        for b in members:
            row_of_seq[b], offset_of_seq[b] = r, offset
            offset += lengths_list[b]
        loads.append(offset)
        last_starts.append(offset_of_seq[members[-1]])
    num_rows, row_len = len(rows), max(loads)
    row_of_seq_t = torch.tensor(row_of_seq, device=device)
    offset_of_seq_t = torch.tensor(offset_of_seq, device=device)
    slots = row_of_seq_t[seq_of_token] * row_len + offset_of_seq_t[seq_of_token] + token_position

    packed_ids = input_ids.new_zeros(num_rows * row_len)
    packed_ids[slots] = input_ids.flatten()[indices]
    # pad slots continue the positions of their row's last sequence (see PackedBatch)
    last_starts_t = torch.tensor(last_starts, device=device)
    position_ids = (torch.arange(row_len, device=device)[None, :] - last_starts_t[:, None]).flatten()
    position_ids[slots] = token_position
    return PackedBatch(
        input_ids=packed_ids.view(num_rows, row_len),
        position_ids=position_ids.view(num_rows, row_len),
        labels=labels,
        indices=indices,
        slots=slots,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        padded_shape=(batch_size, seq),
    )


def pack_values(values: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """Gather the real tokens of a padded tensor: ``values`` [B, S, ...] -> [N, ...] in token order."""
    if tuple(values.shape[:2]) != batch.padded_shape:
        raise ValueError(
            f"values of shape {tuple(values.shape)} do not match the packed batch's padded shape "
            f"{batch.padded_shape}"
        )
    return values.reshape(-1, *values.shape[2:])[batch.indices.to(values.device)]


def unpack(
    packed_values: torch.Tensor, batch: PackedBatch, pad_value: float | int | bool = 0
) -> torch.Tensor:
    """Scatter per-token values back: ``packed_values`` [N, ...] -> [B, S, ...], ``pad_value`` on padding.

    The exact inverse of :func:`pack_values` on real tokens (a copy, no arithmetic); differentiable.
    """
    if packed_values.dim() == 0 or packed_values.shape[0] != batch.num_tokens:
        raise ValueError(
            f"packed_values of shape {tuple(packed_values.shape)} must have the batch's {batch.num_tokens} "
            "real tokens in dim 0"
        )
    batch_size, seq = batch.padded_shape
    rest = packed_values.shape[1:]
    out = packed_values.new_full((batch_size * seq, *rest), pad_value)
    out = out.index_copy(0, batch.indices.to(packed_values.device), packed_values)
    return out.view(batch_size, seq, *rest)


def _rows_to_tokens(row_values: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """[R, L, ...] model outputs on packed rows -> [N, ...] in token order (row padding dropped)."""
    # index_select: its backward adds into the rows' gradient (an advanced index's accumulates by index_put, slower)
    return row_values.reshape(-1, *row_values.shape[2:]).index_select(0, batch.slots.to(row_values.device))


# ---- shared prompts ---------------------------------------------------------------------------------------


@dataclass
class SharedPromptRows:
    """Rollout rows packed so that rows with the same prompt compute it once.

    The samples of one prompt (GRPO's group, or any rows whose prompt tokens are equal) form a *segment*:
    the prompt once, then each sample's response, ``[prompt | response_1 | response_2 | ...]``. A response
    attends to the prompt before it and causally to itself, never to a sibling response; its position ids
    continue from the prompt's length, so every token sees exactly what it saw in its own padded row and the
    results are those of :func:`pack` up to float rounding. A group too long for one segment
    (``segment_tokens``) is split, each part with its own copy of the prompt. Segments are bin-packed
    (first-fit decreasing) into rows as long as the longest segment; with :data:`UNCAPPED_SEGMENT_TOKENS` (a model
    on the blocks) each group is one segment and every segment lies in one row (:func:`shared_prompt_segments`).

    Packed rows (model input):
        input_ids, position_ids: [R, L] long; pad slots hold 0.
        segment_start, prompt_end, branch_start: [R, L] long, per slot the columns where its segment starts,
            where the segment's prompt ends, and where the slot's own response starts (the segment start for a
            prompt slot). A pad slot has all three at its own column: it attends to itself only.
        holders: [R, L] long; how many of the batch's sequences hold the slot's token: the segment's responses
            for a prompt slot, 1 for a response slot, 0 for a pad slot (what a per-token statistic over the
            unshared batch weighs each slot by, e.g. :mod:`rlhf_sg.moe`'s router loss).
    Response tokens (the n real response tokens, row after row):
        predictor_slots: [n] long; flat slot ``r * L + c`` of the hidden state that predicts the token (the
            prompt's last slot for a response's first token, shared by the segment's responses).
        block_positions: [n] long; flat index ``b * T + j`` of the token in the [B, T] response block.
        labels: [n] long; the token.
    branches: [num_branches, 4] long, on the CPU: per *branch* (a segment's prompt, or one response) the flat slot
        where its prefix starts, the prefix's length (the segment's prompt for a response, 0 for the prompt), the
        flat slot where its own run starts and that run's length: a branch's slots attend to its prefix and
        causally to its own run, nothing else (what :class:`SharedPromptBlocks` computes in place of the mask).
    max_seqlen: the longest prompt + response (what any token attends over).
    segment_rows: each segment's batch rows, segments in the order they lie in the packed rows (row by row, left to
        right), so ``branches`` are each one's prompt then one per row (what a vision-language model's positions
        and image features are laid by: :func:`rlhf_sg.vision.shared_vision_kwargs`).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segment_start: torch.Tensor
    prompt_end: torch.Tensor
    branch_start: torch.Tensor
    holders: torch.Tensor
    predictor_slots: torch.Tensor
    block_positions: torch.Tensor
    labels: torch.Tensor
    branches: torch.Tensor
    num_segments: int
    max_seqlen: int
    segment_rows: list[list[int]]

    @property
    def num_slots(self) -> int:
        return int(self.input_ids.numel())

    def attention_mask(self, dtype: torch.dtype | None = None, window: int | None = None) -> torch.Tensor:
        """[R, 1, L, L]: query q sees key k iff k <= q, both in one segment, and k is in the prompt or in q's
        own response; with a ``window``, also ``pos[q] - pos[k] < window`` (a response's positions continue its
        prompt's, so this is the window of its own row). ``dtype=None``: bool (True = attend, for sdpa); else
        additive (0 or the dtype's minimum, for eager)."""
        columns = torch.arange(self.input_ids.shape[1], device=self.input_ids.device)
        key, query = columns[None, None, :], columns[None, :, None]
        allowed = (
            (key <= query)
            & (key >= self.segment_start[:, :, None])
            & ((key < self.prompt_end[:, :, None]) | (key >= self.branch_start[:, :, None]))
        )
        return _finish_mask(allowed, self.position_ids, dtype, window)


def prompt_groups(sequences: torch.Tensor, attention_mask: torch.Tensor, response_width: int,
                  images: list | None = None) -> list[list[int]]:
    """The rows of a rollout batch grouped by equal prompt tokens, each group in row order, groups in the order
    of their first row. ``images`` (a vision-language batch's, per row): rows group only when their images are the
    same too (prompts of equal text and image sizes hold equal ids: :func:`rlhf_sg.vision.image_groups`)."""
    prompt_width = sequences.shape[1] - response_width
    ids, mask = sequences[:, :prompt_width].cpu(), attention_mask[:, :prompt_width].bool().cpu()
    groups: dict[tuple[int, ...], list[int]] = {}
    for b in range(ids.shape[0]):
        groups.setdefault(tuple(ids[b][mask[b]].tolist()), []).append(b)
    if images is not None:
        from rlhf_sg.vision import image_groups

        return image_groups(list(groups.values()), images)
    return list(groups.values())


def shared_prompt_segments(
    groups: list[list[int]], prompt_len: list[int], response_len: list[int], capacity: int
) -> list[list[int]]:
    """The segments :func:`pack_shared_prompts` packs: each prompt group as few segments of at most ``capacity``
    tokens (prompt once + responses) as fit, each with about the same response tokens, row indices in group
    order. ``prompt_len`` / ``response_len``: real tokens per row.

    ``capacity`` :data:`UNCAPPED_SEGMENT_TOKENS` (a model on the blocks, whose response costs its prompt and itself
    whatever the segment holds): each group whole, its prompt once however long its responses, every segment in one
    row; but where the blocks would cost more than the tree mask on that row (:meth:`SharedPromptBlocks.pays`: they
    would gather more than twice its rows, one long response among short ones), cut at
    :data:`MAX_DEFAULT_SEGMENT_TOKENS` for the tree mask, whose [L, L] square must stay bounded."""
    return _cut_segments(groups, prompt_len, response_len, capacity)[0]


def _cut_segments(
    groups: list[list[int]], prompt_len: list[int], response_len: list[int], capacity: int
) -> tuple[list[list[int]], bool]:
    """:func:`shared_prompt_segments`, and whether they are the whole groups of an uncapped cut (laid in one row)."""
    if capacity >= UNCAPPED_SEGMENT_TOKENS:
        slots = sum(prompt_len[g[0]] + sum(response_len[b] for b in g) for g in groups)
        prompts = [prompt_len[g[0]] for g in groups]
        responses = [(prompt_len[b], response_len[b]) for g in groups for b in g if response_len[b]]
        if _BLOCKS_ALWAYS or _blocks_pay(prompts, responses, slots, slots):  # what pays() finds on the one row
            return [list(g) for g in groups], True
        capacity = max([MAX_DEFAULT_SEGMENT_TOKENS] + [prompt_len[b] + response_len[b] for g in groups for b in g])
    segments: list[list[int]] = []
    for members in groups:
        p, total = prompt_len[members[0]], sum(response_len[b] for b in members)
        target = total / min(len(members), max(1, math.ceil(total / max(capacity - p, 1))))
        current, load = [], 0
        for b in members:
            n = response_len[b]
            if current and (p + load + n > capacity or load + n / 2 > target):
                segments.append(current)
                current, load = [], 0
            current.append(b)
            load += n
        segments.append(current)
    return segments, False


def pack_shared_prompts(
    sequences: torch.Tensor, attention_mask: torch.Tensor, response_width: int, segment_tokens: int = 2048,
    groups: list[list[int]] | None = None,
) -> SharedPromptRows:
    """Pack a rollout batch (the layout of :func:`response_logprobs`) with each distinct prompt computed once
    per segment (:class:`SharedPromptRows`). ``segment_tokens``: a segment's most tokens (a longer group is
    split; never below the longest single sequence, which always fits alone; :data:`UNCAPPED_SEGMENT_TOKENS`: a
    group whole, all segments in one row, as :func:`shared_prompt_segments` says). ``groups``: the batch's
    :func:`prompt_groups` when the caller has them already."""
    if segment_tokens < 1:
        raise ValueError(f"segment_tokens must be >= 1, got {segment_tokens}")
    _check_rollout(sequences, attention_mask, response_width)
    device = sequences.device
    batch_size, seq = sequences.shape
    prompt_width = seq - response_width
    ids, mask = sequences.cpu(), attention_mask.bool().cpu()
    prompt_len = mask[:, :prompt_width].sum(dim=1).tolist()
    response_len = mask[:, prompt_width:].sum(dim=1).tolist()
    capacity = max(segment_tokens, max(p + r for p, r in zip(prompt_len, response_len)))

    groups = groups if groups is not None else prompt_groups(sequences, attention_mask, response_width)
    segments, one_row = _cut_segments(groups, prompt_len, response_len, capacity)
    lengths = [prompt_len[s[0]] + sum(response_len[b] for b in s) for s in segments]
    # on the blocks a row's length costs nothing (each branch is computed alone), so every segment goes in one row
    # and no row is padded
    rows = [list(range(len(segments)))] if one_row else _first_fit_decreasing(lengths, max(lengths))
    row_len = max(sum(lengths[i] for i in row) for row in rows)

    num_slots = len(rows) * row_len
    columns = torch.arange(row_len).repeat(len(rows))
    input_ids = torch.zeros(num_slots, dtype=ids.dtype)
    position_ids = torch.zeros(num_slots, dtype=torch.long)
    segment_start, prompt_end, branch_start = columns.clone(), columns.clone(), columns.clone()
    holders = torch.zeros(num_slots, dtype=torch.long)
    predictors, positions, labels, branches = [], [], [], []
    for r, row in enumerate(rows):
        base, offset = r * row_len, 0
        for i in row:
            members = segments[i]
            p = prompt_len[members[0]]
            start, end = base + offset, base + offset + p
            input_ids[start:end] = ids[members[0], prompt_width - p : prompt_width]
            position_ids[start:end] = torch.arange(p)
            prompt_end[start:end] = offset + p
            branch_start[start:end] = offset
            holders[start:end] = len(members)
            branches.append((start, 0, start, p))
            cursor = end
            for b in members:
                n = response_len[b]
                response = ids[b, prompt_width : prompt_width + n]
                input_ids[cursor : cursor + n] = response
                position_ids[cursor : cursor + n] = torch.arange(p, p + n)
                prompt_end[cursor : cursor + n] = offset + p
                branch_start[cursor : cursor + n] = cursor - base
                holders[cursor : cursor + n] = 1
                if n:
                    branches.append((start, p, cursor, n))
                # token j is predicted by the slot before it: the prompt's last for j = 0
                predictors.append(torch.cat([torch.tensor([end - 1]), torch.arange(cursor, cursor + n - 1)]))
                positions.append(b * response_width + torch.arange(n))
                labels.append(response)
                cursor += n
            segment_start[start:cursor] = offset
            offset = cursor - base
    view = lambda t: t.view(len(rows), row_len).to(device)  # noqa: E731
    return SharedPromptRows(
        input_ids=view(input_ids), position_ids=view(position_ids), segment_start=view(segment_start),
        prompt_end=view(prompt_end), branch_start=view(branch_start), holders=view(holders),
        predictor_slots=torch.cat(predictors).to(device), block_positions=torch.cat(positions).to(device),
        labels=torch.cat(labels).to(device), branches=torch.tensor(branches, dtype=torch.long).view(-1, 4),
        num_segments=len(segments),
        max_seqlen=max(p + r for p, r in zip(prompt_len, response_len)),
        segment_rows=[segments[i] for row in rows for i in row],
    )


def _shared_forward(model: nn.Module, rows: SharedPromptRows, impl: str, **forward_kwargs):
    """Call ``model`` on shared-prompt rows with their tree mask (additive, in the model's dtype); a model switched
    to :data:`SHARED_PROMPT_ATTENTION` gets the rows' :class:`SharedPromptBlocks` instead, which its full-attention
    layers compute in place of the mask's whole square, and for the unwindowed mask a stand-in
    (:class:`_TreeMaskStandIn`) that builds the tree mask only if something reads it."""
    if impl not in _MASKED_IMPLEMENTATIONS:
        raise ValueError(
            f"shared prompts need an attention that takes a mask ({_MASKED_IMPLEMENTATIONS}); {impl} (varlen) "
            "cannot keep sibling responses apart: pass share_prompts=False"
        )
    module = _unwrap(model)
    dtype = _model_dtype(module)
    switched = _implementation_run(module) == SHARED_PROMPT_ATTENTION
    blocks = None
    if (switched and None in _mask_windows(module).values()
            and (_BLOCKS_ALWAYS or SharedPromptBlocks.pays(rows))):
        blocks = SharedPromptBlocks.build(rows, _TreeMaskStandIn(module, rows, dtype))
        forward_kwargs[SHARED_PROMPT_BLOCKS_KWARG] = blocks
    mask = _dense_mask(module, lambda window: blocks.mask if blocks is not None and window is None
                       else rows.attention_mask(dtype, window))
    # a vision-language model's M-RoPE rows come in forward_kwargs ([4, R, L], the text row first); an SP rank's
    # columns of the rows too (rlhf_sg.parallel.forward), the mask and the blocks being the whole rows'
    position_ids = forward_kwargs.pop("position_ids", rows.position_ids)
    input_ids = forward_kwargs.pop("input_ids", rows.input_ids)
    return model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=False,
                 **forward_kwargs)


# ---- shared prompts without the mask's square ---------------------------------------------------------------

#: the transformers attention function (``AttentionInterface``) that computes shared-prompt rows block by block
#: (:func:`shared_prompt_attention`); every other call it hands to transformers' sdpa
SHARED_PROMPT_ATTENTION = "rlhf_sg_shared_prompts"
#: the model-forward keyword that carries a forward's :class:`SharedPromptBlocks` to the attention function
SHARED_PROMPT_BLOCKS_KWARG = "shared_prompt_blocks"
#: attention keyword arguments that change the computation: a call given any of them (not None) is not plain
#: softmax(q k^T scale + mask) v, so it takes transformers' own function
SPECIAL_ATTENTION_KWARGS = ("softcap", "sliding_window", "s_aux", "sinks", "position_bias")


@dataclass
class SharedPromptBlocks:
    """The attention of shared-prompt rows as small blocks, in place of the tree mask's [L, L] square per row (which
    the masked kernels compute whole: a segment of a prompt of p and n responses of r tokens costs (p + n r)^2 pairs
    where the tree needs about p^2/2 + n r (p + r/2)).

    - **prompts**: each segment's prompt, its slots padded to the longest prompt at the end: causal attention
      (a pad query sees real keys only before it, and no real query sees a pad).
    - **responses**, one batch per prompt length p: each response's queries, padded at the end to the batch's
      longest response (Q), over the keys of its prompt then its own slots (p + Q): causal attention aligned at the
      lower right (query i sees keys up to p + i), so no mask at all: a real query sees its whole prompt and itself
      up to i, never a pad (pads come after). CUDA's flash kernel takes such a call with grouped key / value heads as
      they are (:func:`_takes_grouped_heads`), where a mask would send grouped heads to the math kernel.

    The index tensors are flat slots ``r * L + c`` of the rows; ``slot_index`` takes each slot's output from the
    blocks' outputs laid end to end, a gather (whose backward keeps only the index, where a scatter's keeps what it
    scatters), every slot that is no real query (a row's padding) from a zero row after them: no real slot attends to
    it. ``mask`` is the tree mask these blocks stand in for (a :class:`_TreeMaskStandIn` from
    :func:`_shared_forward`, built only if read): the attention function takes the blocks only when a layer is
    handed that very tensor, so a layer whose mask differs (a sliding window, a bias the model adds) computes its
    own (:func:`counting_block_layers` counts the layers that took the blocks).
    """

    mask: torch.Tensor
    num_slots: int
    prompt_slots: torch.Tensor  # [S, P]
    responses: list[tuple[torch.Tensor, torch.Tensor]]  # per prompt length p: query slots [G, Q], keys [G, p + Q]
    slot_index: torch.Tensor  # [R * L] into the [S * P + sum G * Q] outputs and a zero row

    @staticmethod
    def pays(rows: SharedPromptRows) -> bool:
        """Whether the blocks cost less than the tree mask on these rows. Their queries and keys are padded to the
        longest prompt and to each prompt length's longest response, so one long response among short ones can make
        them dearer: they are taken only when their query-key pairs are fewer than the rows' R L^2 and the query, key
        and value rows they gather (which sdpa keeps for the backward) at most twice the 3 R L the tree mask's sdpa
        keeps (:func:`_blocks_pay`)."""
        branches = rows.branches
        prompts = branches[branches[:, 1] == 0][:, 3].tolist()
        responses = [tuple(b) for b in branches[branches[:, 1] > 0][:, [1, 3]].tolist()]
        return _blocks_pay(prompts, responses, rows.num_slots, rows.input_ids.shape[1])

    @classmethod
    def build(cls, rows: SharedPromptRows, mask: torch.Tensor) -> SharedPromptBlocks:
        branches = rows.branches
        prompts, responses = branches[branches[:, 1] == 0], branches[branches[:, 1] > 0]

        def runs(start: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """[k, w] slots start + j (w the longest run), padded by repeating each run's last slot; and where j is
            real."""
            column = torch.arange(int(length.max()))[None, :]
            real = column < length[:, None]
            return start[:, None] + torch.minimum(column, length[:, None] - 1), real

        prompt_slots, prompt_real = runs(prompts[:, 2], prompts[:, 3])
        blocks, outs, reals = [], [prompt_slots.reshape(-1)], [prompt_real.reshape(-1)]
        for p in sorted(set(responses[:, 1].tolist())):
            batch = responses[responses[:, 1] == p]
            query_slots, query_real = runs(batch[:, 2], batch[:, 3])
            prefix_slots = batch[:, :1] + torch.arange(p)[None, :]
            blocks.append((query_slots, torch.cat([prefix_slots, query_slots], dim=1)))
            outs.append(query_slots.reshape(-1))
            reals.append(query_real.reshape(-1))
        out_real = torch.cat(reals)
        slot_index = torch.full((rows.num_slots,), len(out_real), dtype=torch.long)
        slot_index[torch.cat(outs)[out_real]] = out_real.nonzero()[:, 0]
        device = mask.device
        return cls(mask=mask, num_slots=rows.num_slots, prompt_slots=prompt_slots.to(device),
                   responses=[(q.to(device), k.to(device)) for q, k in blocks], slot_index=slot_index.to(device))

    @functools.cached_property
    def _gather_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The gathers' indices, views of one storage that every layer shares: the responses' query slots, then the
        prompts' slots, then the responses' key slots; the queries read [responses' queries, prompts], the keys and
        values [prompts, responses' keys], the two overlapping at the prompts. Built at the first layer's call."""
        queries = sum(q.numel() for q, _ in self.responses)
        index = torch.cat([*(q.reshape(-1) for q, _ in self.responses), self.prompt_slots.reshape(-1),
                           *(k.reshape(-1) for _, k in self.responses)])
        return index[:queries + self.prompt_slots.numel()], index[queries:]

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
               ) -> torch.Tensor:
        """query [R, H, L, D], key / value [R, H_kv, L, D] of the rows -> the attention output [R, L, H, D] (the
        layout transformers' attention functions return)."""
        from torch.nn.attention.bias import causal_lower_right

        rows, heads, length, dim = query.shape
        kv_heads = key.shape[1]
        if heads % kv_heads:
            raise ValueError(f"shared-prompt blocks: {heads} query heads over {kv_heads} key/value heads")
        # token-major [R * L, h, d] once, each block a gather of its slots
        flat_query, flat_key, flat_value = (x.transpose(1, 2).reshape(rows * length, x.shape[1], x.shape[3])
                                            for x in (query, key, value))

        query_index, key_index = self._gather_index
        query_slots = [q for q, _ in self.responses] + [self.prompt_slots]
        key_slots = [self.prompt_slots] + [k for _, k in self.responses]

        def gather(flat: torch.Tensor, index: torch.Tensor, slots: list[torch.Tensor]) -> list[torch.Tensor]:
            # one gather for every block (-> each [k, h, w, d]): its backward zero-fills and scatters into the rows'
            # tensor once, where a gather per block would do both once per block and then add the gradients up
            parts = flat.index_select(0, index).split([s.numel() for s in slots])
            return [p.view(*s.shape, *flat.shape[1:]).transpose(1, 2) for p, s in zip(parts, slots)]

        *response_queries, prompt_queries = gather(flat_query, query_index, query_slots)
        queries = [prompt_queries, *response_queries]
        keys, values = gather(flat_key, key_index, key_slots), gather(flat_value, key_index, key_slots)

        def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **causal) -> torch.Tensor:
            grouped = heads == kv_heads or _takes_grouped_heads(q, k, v, "is_causal" in causal)
            if not grouped:  # repeated as transformers' sdpa path repeats them, after the gather: only what is used
                k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, scale=scaling, enable_gqa=grouped and heads != kv_heads, **causal)

        outputs = [sdpa(queries[0], keys[0], values[0], is_causal=True)]
        for (query_slots, key_slots), q, k, v in zip(self.responses, queries[1:], keys[1:], values[1:]):
            outputs.append(sdpa(q, k, v, attn_mask=causal_lower_right(query_slots.shape[1], key_slots.shape[1])))
        flat = [o.transpose(1, 2).reshape(-1, heads, value.shape[3]) for o in outputs]
        out = torch.cat([*flat, flat[0].new_zeros(1, heads, value.shape[3])]).index_select(0, self.slot_index)
        for counter in _BLOCK_COUNTERS:
            counter[0] += 1
        return out.view(rows, length, heads, value.shape[3])


def _takes_grouped_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool) -> bool:
    """Whether sdpa computes this unmasked call with the key / value heads as they are (fewer than the query's):
    torch's CPU kernels do; on CUDA only the flash kernel does (the memory-efficient one takes no grouped heads, the
    math one would keep the [Q, K] weights), so elsewhere the heads are repeated."""
    if query.device.type == "cpu":
        return True
    if query.device.type != "cuda":
        return False
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    return can_use_flash_attention(SDPAParams(query, key, value, None, 0.0, is_causal, True))


def _blocks_pay(prompts: list[int], responses: list[tuple[int, int]], slots: int, row_tokens: int) -> bool:
    """Whether :class:`SharedPromptBlocks` cost less than the tree mask on rows of ``slots`` slots ``row_tokens``
    long: ``prompts``, each segment's prompt length; ``responses``, each response's (prompt length, length). Their
    query-key pairs (the prompts padded to the longest, each response to the longest of its prompt length) must be
    fewer than the tree mask's ``slots x row_tokens``, and the query, key and value rows they gather at most twice
    the ``3 x slots`` the tree mask's sdpa keeps."""
    width = max(prompts)
    longest: dict[int, int] = {}
    count: dict[int, int] = {}
    for p, r in responses:
        longest[p] = max(longest.get(p, 0), r)
        count[p] = count.get(p, 0) + 1
    pairs = len(prompts) * width**2 + sum(count[p] * q * (p + q) for p, q in longest.items())
    gathered = 3 * len(prompts) * width + sum(count[p] * (q + 2 * (p + q)) for p, q in longest.items())
    return pairs < slots * row_tokens and gathered <= 2 * 3 * slots


class _TreeMaskStandIn(torch.Tensor):
    """What a forward on the blocks passes as the tree mask: an [R, 1, L, L] tensor with no storage of its own (one
    NaN, expanded), so a long segment's mask is never built where every layer takes the blocks. Its shape, dtype and
    device read as the mask's; any other use (a layer that does not take the blocks computing with it, a copy or a
    change the model makes to it) gets the tree mask itself, built once on first use, with a warning naming its
    bytes (once per model), and its later segments are capped at :data:`MAX_DEFAULT_SEGMENT_TOKENS`
    (:func:`default_segment_tokens`). Anything that read the stand-in's own value would read NaN, never a mask
    that lets a query see another response."""

    _METADATA = frozenset({torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel, torch.Tensor.untyped_storage,
                           torch.Tensor.shape.__get__, torch.Tensor.ndim.__get__, torch.Tensor.dtype.__get__,
                           torch.Tensor.device.__get__, torch.Tensor.requires_grad.__get__,
                           torch.Tensor.is_cuda.__get__, torch.Tensor.layout.__get__})

    @staticmethod
    def __new__(cls, module: nn.Module, rows: SharedPromptRows, dtype: torch.dtype):
        num_rows, length = rows.input_ids.shape
        nan = torch.full((1, 1, 1, 1), float("nan"), dtype=dtype, device=rows.input_ids.device)
        stand_in = torch.Tensor._make_subclass(cls, nan.expand(num_rows, 1, length, length))
        stand_in._module, stand_in._rows, stand_in._tree = module, rows, None
        return stand_in

    def tree_mask(self) -> torch.Tensor:
        if self._tree is None:
            module, (num_rows, length) = self._module, self._rows.input_ids.shape
            keys = -(-length // _MASK_KEY_ALIGNMENT) * _MASK_KEY_ALIGNMENT
            nbytes = num_rows * length * keys * self.dtype.itemsize
            # once per model; the start-up probe's tiny forwards find such a layer themselves
            if not getattr(module, _TREE_MASK_NEEDED_ATTRIBUTE, False) and not _BLOCKS_ALWAYS:
                logger.warning(
                    "%s: a layer did not take the shared-prompt blocks (a window, softcap, sinks or dropout, or a mask "
                    "the model copied or changed), so the [%d, 1, %d, %d] tree mask is built for it (%.1f MiB); its "
                    "segments are capped at %d tokens from now on", type(module).__name__, num_rows, length, length,
                    nbytes / 2**20, MAX_DEFAULT_SEGMENT_TOKENS)
            setattr(module, _TREE_MASK_NEEDED_ATTRIBUTE, True)
            self._tree = self._rows.attention_mask(self.dtype)
        return self._tree

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in cls._METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        from torch.utils._pytree import tree_map

        def real(x):
            return x.tree_mask() if isinstance(x, _TreeMaskStandIn) else x

        return func(*tree_map(real, args), **tree_map(real, kwargs))


#: set on a model one of whose layers needed the tree mask on the blocks (:class:`_TreeMaskStandIn`)
_TREE_MASK_NEEDED_ATTRIBUTE = "_rlhf_sg_tree_mask_needed"


_BLOCK_COUNTERS: list[list[int]] = []
_BLOCKS_ALWAYS: list[bool] = []


@contextlib.contextmanager
def blocks_whatever_they_cost():
    """While open, a switched model's shared forwards take the blocks even where they cost more than the tree mask
    (:meth:`SharedPromptBlocks.pays`): the start-up probe checks every layout a model may run on its tiny batch."""
    _BLOCKS_ALWAYS.append(True)
    try:
        yield
    finally:
        _BLOCKS_ALWAYS.pop()


@contextlib.contextmanager
def counting_block_layers():
    """A diagnostic: yields ``[count]``, the attention calls computed block by block while it is open (which layers
    of a model take the blocks; :mod:`rlhf_sg.bench.models` prints them per family)."""
    counter = [0]
    _BLOCK_COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _BLOCK_COUNTERS.remove(counter)


def shared_prompt_attention(module, query, key, value, attention_mask, shared_prompt_blocks=None, **kwargs):
    """The transformers attention function :data:`SHARED_PROMPT_ATTENTION`: with the forward's
    :class:`SharedPromptBlocks` (keyword :data:`SHARED_PROMPT_BLOCKS_KWARG`), a plain call (the blocks' own mask, no
    dropout, none of :data:`SPECIAL_ATTENTION_KWARGS`) is computed block by block; everything else is transformers'
    sdpa attention, unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    blocks = shared_prompt_blocks
    if (blocks is not None and attention_mask is blocks.mask and query.shape[0] * query.shape[2] == blocks.num_slots
            and not kwargs.get("dropout") and not kwargs.get("output_attentions")
            and all(kwargs.get(k) is None for k in SPECIAL_ATTENTION_KWARGS)):
        return blocks.attend(query, key, value, kwargs.get("scaling")), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def use_shared_prompt_attention(model: nn.Module) -> bool:
    """Switch an sdpa model to :data:`SHARED_PROMPT_ATTENTION` (registered here, with sdpa's mask builder), so its
    shared-prompt forwards skip the masked pairs; returns whether it did (a model on another attention keeps it).
    Every other forward of the model is sdpa's as before. Exactness is checked per model at start-up by the packing
    probe (:mod:`rlhf_sg.probe`), which compares the shared layout with each sequence alone."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    module = _unwrap(model)
    if getattr(module.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(SHARED_PROMPT_ATTENTION, shared_prompt_attention)
    AttentionMaskInterface.register(SHARED_PROMPT_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    _backbone(module).set_attn_implementation(SHARED_PROMPT_ATTENTION)
    return True


def stop_shared_prompt_attention(model: nn.Module) -> None:
    """Switch a model back from :data:`SHARED_PROMPT_ATTENTION` to sdpa (for one none of whose layers takes the
    blocks: its segments are then sized for the tree mask again, :func:`default_segment_tokens`)."""
    module = _unwrap(model)
    if getattr(module.config, "_attn_implementation", None) == SHARED_PROMPT_ATTENTION:
        _backbone(module).set_attn_implementation("sdpa")


def _implementation_run(module: nn.Module) -> str | None:
    """The attention implementation ``module``'s config names, a sequence-parallel wrapper's taken off: the one it
    runs (on an SP rank, over its heads of the whole rows: :mod:`rlhf_sg.parallel.ulysses`)."""
    from rlhf_sg.parallel.ulysses import unwrapped

    return unwrapped(getattr(getattr(module, "config", None), "_attn_implementation", None))


def _backbone(module: nn.Module) -> nn.Module:
    """The transformers model whose attention implementation a module's forwards use (a ValueHeadModel's own)."""
    return module.model if hasattr(module, "value_head") else module


#: the largest default shared-prompt segment on the tree mask: a row of 4096 slots has a 32 MiB bf16 mask, one
#: storage for all layers
MAX_DEFAULT_SEGMENT_TOKENS = 4096
#: the segment size of a model on the blocks: no cap, a group is one segment (its prompt computed once) however
#: long its responses (:func:`shared_prompt_segments`)
UNCAPPED_SEGMENT_TOKENS = sys.maxsize


#: config keys of a model's attention-probability dropout (Llama / Qwen style, GPT-2, BERT style)
_ATTENTION_DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")


def default_segment_tokens(module: nn.Module) -> int:
    """A shared-prompt segment's default size.

    On the tree mask, the model's hidden size d (2048 without one): the masked kernels compute every pair of a row,
    so a token in a row of L costs about 4 L d FLOPs of attention against about 24 d^2 of projections and MLP (a
    layer's 12 d^2 weights, forward): at L = d attention adds ~1/6, while a longer segment saves only the prompt
    copies it merges; and at most :data:`MAX_DEFAULT_SEGMENT_TOKENS`: the tree mask of a row holds L^2 entries in the
    model's dtype (a wide model's d would make it large).

    On :data:`SHARED_PROMPT_ATTENTION` a response's attention costs its prompt and itself whatever the segment holds,
    so a model whose every layer can take the blocks (one unwindowed mask, none of its layers has needed the tree
    mask: :class:`_TreeMaskStandIn`) gets :data:`UNCAPPED_SEGMENT_TOKENS`, a group's prompt computed once however
    long its responses, and no [L, L] mask is built. One with windowed layers, which need their mask, stays at
    :data:`MAX_DEFAULT_SEGMENT_TOKENS`; so does one with attention dropout (``--train.disable_dropout false``): its
    layers decline the blocks in training, which the start-up probe (in eval mode) does not see, and the first
    training forward would build an uncapped segment's whole mask."""
    config = getattr(module, "config", None)
    if _implementation_run(module) == SHARED_PROMPT_ATTENTION:
        every_layer = set(_mask_windows(module).values()) == {None}
        dropout = max(float(getattr(config, key, 0.0) or 0.0) for key in _ATTENTION_DROPOUT_KEYS)
        if every_layer and dropout == 0.0 and not getattr(module, _TREE_MASK_NEEDED_ATTRIBUTE, False):
            return UNCAPPED_SEGMENT_TOKENS
        return MAX_DEFAULT_SEGMENT_TOKENS
    hidden = getattr(config, "hidden_size", None)
    return min(int(hidden), MAX_DEFAULT_SEGMENT_TOKENS) if isinstance(hidden, int) and hidden > 0 else 2048


def _shared_groups(
    module: nn.Module, share_prompts: bool, sequences: torch.Tensor, attention_mask: torch.Tensor, response_width: int,
    images: list | None = None,
) -> list[list[int]] | None:
    """The batch's prompt groups when sharing is asked for and some prompt repeats; else None (plain packing).
    ``images`` (a vision-language model's, per row): rows share a prompt only when they share its images too."""
    if not share_prompts:
        return None
    groups = prompt_groups(sequences, attention_mask, response_width, images)
    if not any(len(g) > 1 for g in groups) or _one_sequence_per_row(module, "share_prompts"):
        return None
    return groups


# ---- forward on packed rows ------------------------------------------------------------------------------


def _unwrap(model: nn.Module) -> nn.Module:
    """The model itself when given a wrapper (DeepSpeedEngine, DDP) that keeps it as ``.module``."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def unwrap_adapters(model: nn.Module) -> nn.Module:
    """The model inside a PEFT (LoRA) wrapper; ``model`` itself without one. What its own forward and head are read
    from (the wrapper's forward applies the adapters and calls it)."""
    return model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model


def _model_device(model: nn.Module) -> torch.device:
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    return next(_unwrap(model).parameters()).device


def _attn_implementation(module: nn.Module, override: str | None) -> str:
    if override is not None:
        return override
    impl = _implementation_run(module)  # a sequence-parallel wrapper's: the implementation it wraps
    if impl == SHARED_PROMPT_ATTENTION:  # sdpa, with shared-prompt rows computed block by block
        return "sdpa"
    if impl is None:
        raise ValueError(
            f"{type(module).__name__} has no config._attn_implementation; pass attn_implementation= "
            f"(one of {_FLASH_IMPLEMENTATIONS + _MASKED_IMPLEMENTATIONS})"
        )
    return impl


def _row_tokens(impl: str, attention_mask: torch.Tensor) -> int | None:
    """One row for varlen kernels; rows of the longest sequence for dense masks (see the module doc)."""
    if impl in _FLASH_IMPLEMENTATIONS:
        return None
    return int(attention_mask.sum(dim=1).max())


def _pack_for(module: nn.Module, impl: str, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedBatch:
    """:func:`pack` as ``module`` and its attention kernel can take it: one sequence per row for a model that
    cannot take more (recurrent layers, ALiBi), else as :func:`_row_tokens` says."""
    _refuse_chunked_attention(module)
    if input_ids.shape[0] > 1 and _one_sequence_per_row(module, "packing"):
        return pack(input_ids, attention_mask, one_per_row=True)
    return pack(input_ids, attention_mask, row_tokens=_row_tokens(impl, attention_mask))


def _block_causal_mask(
    position_ids: torch.Tensor, dtype: torch.dtype | None, window: int | None = None
) -> torch.Tensor:
    """[R, 1, L, L] mask: query i sees key j iff j <= i and j is in i's sequence (and, with a ``window``,
    ``pos[i] - pos[j] < window``).

    A slot's sequence starts at column ``c - position_ids[c]`` (positions restart at 0 per sequence).
    ``dtype=None`` gives a bool mask (True = attend), else an additive mask (0 or the dtype's minimum).
    """
    row_len = position_ids.shape[1]
    col = torch.arange(row_len, device=position_ids.device)
    seq_start = col[None, :] - position_ids  # [R, L]
    allowed = (col[None, None, :] <= col[None, :, None]) & (col[None, None, :] >= seq_start[:, :, None])
    return _finish_mask(allowed, position_ids, dtype, window)


def _finish_mask(
    allowed: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype | None, window: int | None
) -> torch.Tensor:
    """[R, L, L] bool -> [R, 1, L, L] attention mask: the sliding window applied from positions
    (transformers' ``sliding_window_overlay``: key k is kept iff ``q - k < window``), then bool (``dtype=None``)
    or additive in ``dtype`` (0 or the dtype's minimum).

    The additive mask is a view of a buffer whose key axis is padded to a multiple of :data:`_MASK_KEY_ALIGNMENT`:
    torch's memory-efficient sdpa kernel copies (pads) a mask whose strides are not aligned, and converts a bool
    mask to float, on every call; aligned and in the model's dtype, every layer reads (and autograd keeps) the one
    storage transformers hands to all of them."""
    if window is not None:
        allowed = allowed & (position_ids[:, :, None] - position_ids[:, None, :] < window)
    allowed = allowed[:, None]
    if dtype is None:
        return allowed
    keys = allowed.shape[-1]
    padded = -(-keys // _MASK_KEY_ALIGNMENT) * _MASK_KEY_ALIGNMENT
    mask = torch.full((*allowed.shape[:-1], padded), torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
    return mask[..., :keys].masked_fill_(allowed, 0)


#: layer types whose attention a dense mask expresses exactly; the window of a sliding layer is in the mask
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
#: what the class names (lower case) of token mixers that are not attention contain: their state runs along the
#: row, so a mask cannot keep two sequences of one row apart (transformers 5.19: Mamba/Mamba2/Jamba/Zamba mixers,
#: Qwen3.5/Qwen3-Next/OLMo-hybrid GatedDeltaNet, Kimi/RWKV linear attention, MiniMax lightning attention, LFM2
#: ShortConv, RecurrentGemma); a class name ending in "Mixer" (Bamba, Falcon-H1) counts too
_RECURRENT_MIXERS = ("mamba", "gateddeltanet", "linearattention", "lightningattention", "shortconv", "rwkv",
                     "recurrent", "deltanet", "retention", "hyena")


def _mask_windows(module: nn.Module) -> dict[str, int | None]:
    """The window each attention layer type of ``module`` applies (None: none), as its modeling code does: from
    ``config.layer_types`` where the config has them (``sliding_attention`` layers use ``config.sliding_window``),
    else ``config.sliding_window`` on every layer (Mistral, Mixtral, Phi-3, Starcoder2 read it that way; Qwen2's
    config sets it to None unless ``use_sliding_window``)."""
    config = getattr(module, "config", None)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return {"full_attention": window}
    return {t: window if t == "sliding_attention" else None for t in dict.fromkeys(layer_types)
            if t in _ATTENTION_LAYER_TYPES}


def one_sequence_per_row_reason(module: nn.Module) -> str | None:
    """Why ``module`` cannot take several sequences in one row, or None when it can.

    - A layer that is not attention (linear attention, an SSM, a convolution mixer) carries state along the
      row, and transformers builds no mask for it when handed a 4D one: read from ``config.layer_types`` and
      from the module tree (any submodule whose class names one of :data:`_RECURRENT_MIXERS`).
    - ALiBi models (Bloom; ``config.alibi``) build their bias from a 2D padding mask, not from positions.
    - The start-up probe (:mod:`rlhf_sg.probe`) found the model's packed rows differ from its sequences alone."""
    module = _unwrap(module)
    probed = getattr(module, "_rlhf_sg_packing_probe", None)
    if probed:
        return probed
    config = getattr(module, "config", None)
    if getattr(config, "model_type", None) == "bloom" or getattr(config, "alibi", False) is True:
        return "its ALiBi bias is built from a 2D padding mask, not from position ids"
    for layer_type in getattr(config, "layer_types", None) or ():
        if layer_type not in _ATTENTION_LAYER_TYPES + ("chunked_attention",):
            return f"config.layer_types holds {layer_type!r} layers"
    for name, sub in module.named_modules():
        cls = type(sub).__name__.lower()
        if cls.endswith("mixer") or any(mixer in cls for mixer in _RECURRENT_MIXERS):
            return f"{name} is a {type(sub).__name__} (not attention)"
    return None


_FALLBACKS_LOGGED: set[tuple[str, str]] = set()


def _rope_scaling(config: Any) -> tuple[str, int] | None:
    """(rope type, original_max_position_embeddings) of a RoPE whose frequencies transformers picks from the
    forward's largest position id (``dynamic_rope_update``: ``longrope``, ``dynamic``); None for any other."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return None
    for entry in [params] + [v for v in params.values() if isinstance(v, dict)]:  # per-layer-type dicts too
        kind = entry.get("rope_type", entry.get("type"))
        if kind in ("longrope", "dynamic"):
            original = entry.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", None) or getattr(config, "max_position_embeddings", None)
            return kind, int(original)
    return None


def check_rope_regime(module: nn.Module, lengths: list[int]) -> None:
    """Refuse a forward over sequences of ``lengths`` that a LongRoPE / dynamic-NTK model would not give each
    sequence what it gives alone. transformers picks such a RoPE's frequencies once per forward from the largest
    position id (every layout here makes that the longest sequence's): LongRoPE takes its long factors for every
    sequence once one is longer than ``original_max_position_embeddings``, dynamic NTK rescales for the longest.
    A batch whose sequences are all within that length, or (LongRoPE) all beyond it, is exact."""
    rope = _rope_scaling(getattr(module, "config", None))
    if rope is None or not lengths:
        return
    kind, original = rope
    short, longest = min(lengths), max(lengths)
    mixed = short <= original < longest if kind == "longrope" else longest > original and short != longest
    if mixed:
        raise ValueError(
            f"{type(module).__name__}: its {kind} RoPE takes one set of frequencies per forward from the longest "
            f"sequence ({longest} tokens, over original_max_position_embeddings={original}), which a sequence of "
            f"{short} tokens alone would not use; one forward cannot give both their own. Keep every sequence "
            f"within {original} tokens (--data.max_prompt_len + --rollout.max_new_tokens)")


def _one_sequence_per_row(module: nn.Module, what: str) -> bool:
    """True when ``module`` cannot take several sequences in a row (:func:`one_sequence_per_row_reason`): then
    each sequence gets its own row (``what`` is the layout given up, logged once per model class)."""
    reason = one_sequence_per_row_reason(module)
    if reason is None:
        return False
    key = (type(module).__name__, what)
    if key not in _FALLBACKS_LOGGED:
        _FALLBACKS_LOGGED.add(key)
        logger.warning("%s: %s, so %s falls back to one sequence per row", type(module).__name__, reason, what)
    return True


def _dense_mask(module: nn.Module, build) -> torch.Tensor | dict[str, torch.Tensor]:
    """The attention mask for ``module``: ``build(window)`` once per distinct window; one tensor when every
    attention layer has the same window, else transformers' per-layer-type dict (which the models with mixed
    layer types take as ``attention_mask``, one entry per ``config.layer_types`` value)."""
    _refuse_chunked_attention(module)
    windows = _mask_windows(module)
    built: dict[int | None, torch.Tensor] = {}
    for window in windows.values():
        if window not in built:
            built[window] = build(window)
    if len(windows) == 1:
        return next(iter(built.values()))
    return {layer_type: built[window] for layer_type, window in windows.items()}


def _refuse_chunked_attention(module: nn.Module) -> None:
    """Refuse a model with chunked-attention layers (Llama 4: ``config.layer_types`` holds ``chunked_attention``,
    each query sees the keys of its ``attention_chunk_size`` block), in every layout: neither the packed nor the
    shared-prompt masks express the blocks, and transformers' flash path refuses them past one block. (One sequence
    per row would be exact, through the model's own mask, but :func:`response_logprobs` hooks
    ``Llama4ForCausalLM.base_model``, which is the whole model: its ``base_model_prefix`` names no attribute.)"""
    config = getattr(module, "config", None)
    if "chunked_attention" in (getattr(config, "layer_types", None) or ()):
        raise ValueError(
            f"{type(_backbone(module)).__name__}: config.layer_types holds 'chunked_attention' layers "
            f"(attention_chunk_size={getattr(config, 'attention_chunk_size', None)}), which neither the packed nor "
            "the shared-prompt attention masks express; train a model without chunked-attention layers"
        )


def _model_dtype(module: nn.Module) -> torch.dtype:
    dtype = getattr(module, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else next(module.parameters()).dtype


def packed_forward(
    model: nn.Module, batch: PackedBatch, attn_implementation: str | None = None, **forward_kwargs
):
    """Call ``model`` on the packed rows of ``batch`` with attention kept inside each sequence.

    ``model``: a transformers model or a :class:`rlhf_sg.models.ValueHeadModel`, or a DeepSpeedEngine
    around one (it is called through the wrapper so ZeRO-3's forward hooks run). The attention arguments
    follow ``attn_implementation`` (default: the model's ``config._attn_implementation``; pass it when
    the model uses a custom attention function that follows one of these conventions):

    - ``flash_attention_2``/``_3``: no mask; ``cu_seq_lens_q/k`` and ``max_length_q/k`` go to the
      varlen kernel (the batch must be one row: ``pack(..., row_tokens=None)``);
    - ``sdpa``: an additive block-causal mask [R, 1, L, L] in the model's dtype (as eager);
    - ``eager``: an additive float block-causal mask [R, 1, L, L] in the model's dtype;
    - either, when every row holds one sequence: no mask (plain causal attention is then exact).

    Returns whatever the model returns (for row outputs of shape [R, L, ...]).
    """
    module = _unwrap(model)
    impl = _attn_implementation(module, attn_implementation)
    device = _model_device(model)
    kwargs: dict[str, Any] = {}
    if impl in _FLASH_IMPLEMENTATIONS and batch.input_ids.shape[0] == batch.num_sequences:
        pass  # one sequence per row: causal attention alone keeps them apart
    elif impl in _FLASH_IMPLEMENTATIONS:
        if batch.input_ids.shape[0] != 1:
            raise ValueError(
                f"{impl} takes one packed row, got {batch.input_ids.shape[0]}; pack with row_tokens=None"
            )
        cu_seqlens = batch.cu_seqlens.to(device)
        kwargs.update(
            cu_seq_lens_q=cu_seqlens,
            cu_seq_lens_k=cu_seqlens,
            max_length_q=batch.max_seqlen,
            max_length_k=batch.max_seqlen,
        )
    elif impl in _MASKED_IMPLEMENTATIONS:
        # With one sequence per row, causal attention alone keeps sequences apart (row padding comes after
        # the sequence); passing no mask lets transformers build its own causal one (sdpa: is_causal).
        if batch.input_ids.shape[0] < batch.num_sequences:
            dtype = _model_dtype(module)
            position_ids = batch.position_ids.to(device)
            kwargs["attention_mask"] = _dense_mask(
                module, lambda window: _block_causal_mask(position_ids, dtype, window)
            )
    else:
        raise ValueError(
            f"attn_implementation {impl!r} is not supported on packed rows; use one of "
            f"{_FLASH_IMPLEMENTATIONS + _MASKED_IMPLEMENTATIONS} (model.set_attn_implementation(...)), or "
            "pass attn_implementation= naming the convention your attention function follows"
        )
    # a vision-language model's M-RoPE rows come in forward_kwargs ([4, R, L], the text row first)
    position_ids = forward_kwargs.pop("position_ids", batch.position_ids)
    return model(
        input_ids=batch.input_ids.to(device),
        position_ids=position_ids.to(device),
        use_cache=False,
        **kwargs,
        **forward_kwargs,
    )


# ---- log-probs, entropy, values, rewards --------------------------------------------------------------


def _check_rollout(sequences: torch.Tensor, attention_mask: torch.Tensor, response_width: int) -> None:
    """The rollout layout: every row has its last prompt token at column P - 1, first response token at P."""
    if not isinstance(response_width, int) or isinstance(response_width, bool):
        raise TypeError(f"response_width must be an int, got {type(response_width).__name__}")
    _check_padded(sequences, attention_mask)
    seq = sequences.shape[1]
    if not 1 <= response_width < seq:
        raise ValueError(
            f"response_width={response_width} must be in [1, {seq - 1}] for sequences of width {seq} "
            "(at least one prompt column)"
        )
    prompt_width = seq - response_width
    mask = attention_mask.bool()
    no_response = (~mask[:, prompt_width]).nonzero()
    if no_response.numel():
        b = int(no_response[0])
        raise ValueError(
            f"attention_mask row {b} has no response token (response columns {prompt_width}..{seq - 1} "
            "start with padding); drop empty completions, or check response_width and that responses are "
            "right-padded"
        )
    no_prompt = (~mask[:, prompt_width - 1]).nonzero()
    if no_prompt.numel():
        b = int(no_prompt[0])
        raise ValueError(
            f"attention_mask row {b}: the last prompt column ({prompt_width - 1}) is padding; prompts must "
            "be non-empty and left-padded"
        )


def _response_predictors(attention_mask: torch.Tensor, response_width: int) -> torch.Tensor:
    """[B, S] bool: positions whose next token is a real response token (columns P-1 .. S-2)."""
    mask = attention_mask.bool()
    prompt_width = mask.shape[1] - response_width
    predicts = torch.zeros_like(mask)
    predicts[:, prompt_width - 1 : -1] = mask[:, prompt_width:]
    return predicts


def _block_positions(flat_positions: torch.Tensor, batch: PackedBatch, response_width: int) -> torch.Tensor:
    """Predicting positions (padded flat index b*S+s, s = P-1+j) -> the predicted token's flat index b*T+j in
    the [B, T] response block."""
    seq = batch.padded_shape[1]
    row = flat_positions // seq
    column = flat_positions % seq - (seq - response_width - 1)
    return row * response_width + column


def _to_response_block(
    token_values: torch.Tensor, block_positions: torch.Tensor, shape: tuple[int, int]
) -> torch.Tensor:
    """Values of response tokens at flat ``b * T + j`` -> [B, T], 0 elsewhere."""
    out = token_values.new_zeros(shape[0] * shape[1])
    return out.index_copy(0, block_positions, token_values).view(shape)


def _slot_holders(batch: PackedBatch) -> torch.Tensor:
    """[R * L] long: 1 on the slots of real tokens, 0 on the rows' pad slots."""
    holders = torch.zeros(batch.input_ids.numel(), dtype=torch.long, device=batch.slots.device)
    return holders.index_fill_(0, batch.slots, 1)


def _frozen_zero3(module: nn.Module) -> bool:
    params = list(module.parameters())
    return bool(params) and all(hasattr(p, "ds_id") and not p.requires_grad for p in params)


class _FrozenHead:
    """A frozen, ZeRO-3 partitioned linear lm_head as one full detached copy, applied without its module hooks."""

    def __init__(self, lm_head: nn.Module):
        from rlhf_sg.sync.gather import gathered

        if not isinstance(lm_head, nn.Linear):
            raise TypeError(f"a frozen ZeRO-3 lm_head must be an nn.Linear, got {type(lm_head).__name__}")
        with gathered(list(lm_head.parameters())):
            self.weight = lm_head.weight.detach().clone()
            self.bias = None if lm_head.bias is None else lm_head.bias.detach().clone()

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(hidden, self.weight, self.bias)


@contextlib.contextmanager
def _forward_replaced(module: nn.Module, forward):
    """``module(...)`` runs ``forward`` inside the block, its hooks (DeepSpeed's gathers) firing as for its own."""
    own = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def _logprob_chunk(
    hidden: torch.Tensor, labels: torch.Tensor, lm_head, temperature: float, with_entropy: bool,
    head: tuple[str, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = lm_head(hidden).float()
    if head is not None:
        kind, value = head
        logits = torch.tanh(logits / value) * value if kind == "softcap" else logits * value
    if temperature != 1.0:
        logits = logits / temperature
    log_normalizer = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, labels[:, None]).squeeze(-1) - log_normalizer
    if not with_entropy:
        return logp, logp.new_zeros(())
    # entropy = -sum p log p = logsumexp(z) - sum p z
    entropy = log_normalizer - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy


#: what a causal LM's forward does to the lm_head's logits, found in its source (transformers 5.19): Gemma-2/3's
#: ``tanh(logits / final_logit_softcapping) * final_logit_softcapping``, Cohere's ``logits * logit_scale``,
#: Granite's ``logits / logits_scaling``
_HEAD_TRANSFORMS = (("final_logit_softcapping", "softcap", "logits / self.config.final_logit_softcapping"),
                    ("logit_scale", "scale", "logits * self.logit_scale"),
                    ("logits_scaling", "divide", "logits / self.config.logits_scaling"))
_HEAD_SOURCES: dict[type, str | None] = {}


def _forward_source(cls: type) -> str | None:
    if cls not in _HEAD_SOURCES:
        import inspect

        try:
            _HEAD_SOURCES[cls] = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            _HEAD_SOURCES[cls] = None
    return _HEAD_SOURCES[cls]


def _lm_head_transform(module: nn.Module) -> tuple[str, float] | None:
    """What ``module``'s own forward applies to the lm_head's logits, as ("softcap", cap) or ("scale", factor);
    None when nothing. Read from the forward's source, so a config attribute the model ignores changes nothing;
    raises ValueError when the config sets a transform and the source cannot be read, or sets more than one."""
    config = module.config
    module = unwrap_adapters(module)  # an adapter wrapper (PEFT): the model's own forward
    defaults = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}
    found = []
    for attribute, kind, line in _HEAD_TRANSFORMS:
        value = getattr(config, attribute, defaults[attribute])
        if value is None or value == defaults[attribute]:
            continue
        source = _forward_source(type(module))
        if source is None or "lm_head" not in source:  # unreadable, or a wrapper's forward, not the head's
            raise ValueError(f"{type(module).__name__}: config.{attribute}={value} and the forward's source cannot "
                             "be read to tell whether it transforms the logits; packed log-probs do not support that")
        if line in source:
            found.append(("scale", 1.0 / value) if kind == "divide" else (kind, float(value)))
    if len(found) > 1:
        raise ValueError(f"{type(module).__name__} transforms its logits in more than one way ({found}); packed "
                         "log-probs do not support that")
    return found[0] if found else None


def response_logprobs(
    model: nn.Module,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    response_width: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = 1024,
    attn_implementation: str | None = None,
    share_prompts: bool = False,
    segment_tokens: int | None = None,
    router=None,
    routes: torch.Tensor | None = None,
    replay=None,
    images=None,
):
    """Log-probs (and entropy) of the response tokens under a causal LM, computed on packed rows.

    sequences: [B, S] long (left-padded prompt block of width S - T, right-padded response block of width
        T = ``response_width``); attention_mask: [B, S]. Every row needs >= 1 prompt and >= 1 response token.
    model: a transformers causal LM (or a DeepSpeedEngine around one); inputs move to its device.
    Returns ``logp`` [B, T] float32 with ``logp[b, j] = log softmax(logits / temperature)[token]`` for the
    token at ``sequences[b, P + j]`` given ``sequences[b, :P + j]``, and 0 where the response is padding;
    with ``with_entropy`` also ``entropy`` [B, T] float32 of that temperature-scaled distribution.

    The model runs once through its own forward (so wrappers' hooks fire) with ``logits_to_keep`` empty;
    a forward hook takes the backbone's last hidden state, and the lm_head is applied only at positions
    that predict a response token, ``chunk_tokens`` at a time, log-softmax in fp32. Under autograd each
    chunk is checkpointed, so neither forward nor backward holds more than one chunk's [chunk, vocab]
    logits. The chunks run inside one call of the lm_head module, so under ZeRO-3 every rank gathers its
    parameters as often as the others (once in the forward, once in the backward) whatever its chunk count.

    ``share_prompts``: where rows repeat a prompt, compute it once per segment of ``segment_tokens``
    (:func:`pack_shared_prompts`; masked attention only); the results equal the unshared ones up to rounding.
    ``segment_tokens=None``: the model's default (:func:`default_segment_tokens`: its hidden size on the tree mask,
    uncapped on the blocks).
    ``router``: a :class:`rlhf_sg.moe.RouterLoad` that records the forward's router logits and gets each packed
    slot's weight (how many sequences hold its token), for the MoE load-balancing loss over the real tokens.
    ``routes`` [B, S, moe_layers, top_k] (-1: none) with ``replay``, a :class:`rlhf_sg.moe.RouteReplay` whose
    :meth:`~rlhf_sg.moe.RouteReplay.active` scope holds this call and the backward after it: the routes are laid
    into the packed rows and armed for the forward (routing replay). Each sequence then computes its own prompt
    (``share_prompts`` is not applied: the routes are per sample).
    ``images``: a vision-language model's :class:`rlhf_sg.vision.ImageInputs` (or None) per row; each sequence's
    M-RoPE positions are its own (:func:`rlhf_sg.vision.vision_forward_kwargs`); with ``share_prompts`` rows share a
    prompt when they share its images too, its positions laid once and each response's continuing them, the vision
    tower run once on the distinct prompts' images (:func:`rlhf_sg.vision.shared_vision_kwargs`).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    module = _unwrap(model)
    lm_head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    if lm_head is None:
        raise TypeError(f"response_logprobs needs a causal LM with an lm_head, got {type(module).__name__}")
    head = _lm_head_transform(module)
    device = _model_device(model)
    sequences, attention_mask = sequences.to(device), attention_mask.to(device)
    _check_rollout(sequences, attention_mask, response_width)
    check_rope_regime(module, attention_mask.sum(dim=1).tolist())
    impl = _attn_implementation(module, attn_implementation)
    if routes is not None and replay is None:
        raise ValueError("response_logprobs: routes need the RouteReplay whose active() scope replays them")
    groups = None if routes is not None else _shared_groups(module, share_prompts, sequences, attention_mask,
                                                            response_width, images)
    captured: dict[str, torch.Tensor] = {}

    def keep_hidden(_module, _args, output):
        captured["hidden"] = output[0]

    no_logits = torch.empty(0, dtype=torch.long, device=device)
    # the decoder backbone; a PEFT model (LoRA actor) wraps the causal LM, whose backbone it is
    causal_lm = unwrap_adapters(module)
    hook = causal_lm.base_model.register_forward_hook(keep_hidden)
    try:
        with router.recording() if router is not None else contextlib.nullcontext():
            if groups is not None:
                rows = pack_shared_prompts(sequences, attention_mask, response_width,
                                           segment_tokens or default_segment_tokens(module), groups=groups)
                extra = {}
                if images is not None:
                    from rlhf_sg.vision import shared_vision_kwargs

                    extra = shared_vision_kwargs(module, rows, sequences, attention_mask, images)
                _shared_forward(model, rows, impl, logits_to_keep=no_logits, **extra)
            else:
                batch = _pack_for(module, impl, sequences, attention_mask)
                if routes is not None:
                    replay.arm(_packed_routes(routes, batch).to(device))
                extra = {}
                if images is not None:
                    from rlhf_sg.vision import vision_forward_kwargs

                    extra = vision_forward_kwargs(module, batch, sequences, attention_mask, images)
                packed_forward(model, batch, impl, logits_to_keep=no_logits, **extra)
    finally:
        hook.remove()
    if router is not None:
        router.set_weights(rows.holders.reshape(-1) if groups is not None else _slot_holders(batch))
    # the predictors' hidden states by index_select, whose backward adds into the rows' gradient (index_add); an
    # advanced index's backward is an accumulating index_put, several times slower (CPU: 4.9 against 0.6 ms for
    # 2048 of 2213 rows of 512)
    if groups is not None:
        hidden = captured["hidden"].reshape(-1, captured["hidden"].shape[-1]).index_select(0, rows.predictor_slots)
        labels, positions = rows.labels, rows.block_positions
    else:
        hidden = _rows_to_tokens(captured["hidden"], batch)
        predicts = pack_values(_response_predictors(attention_mask, response_width), batch).nonzero()[:, 0]
        hidden, labels = hidden.index_select(0, predicts), batch.labels[predicts]
        positions = _block_positions(batch.indices[predicts], batch, response_width)

    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in lm_head.parameters())
    )

    def chunked(projection, states: torch.Tensor) -> torch.Tensor:
        """states: [N, H] -> logp [N], or [2, N] logp and entropy; ``chunk_tokens`` rows at a time."""
        logps, entropies = [], []
        for start in range(0, states.shape[0], chunk_tokens):
            args = (
                states[start : start + chunk_tokens],
                labels[start : start + chunk_tokens],
                projection,
                temperature,
                with_entropy,
                head,
            )
            logp, entropy = (
                checkpoint(_logprob_chunk, *args, use_reentrant=False) if needs_grad else _logprob_chunk(*args)
            )
            logps.append(logp)
            entropies.append(entropy)
        return torch.stack((torch.cat(logps), torch.cat(entropies))) if with_entropy else torch.cat(logps)

    if needs_grad and _frozen_zero3(lm_head):
        # a frozen ZeRO-3 lm_head (a LoRA actor's): DeepSpeed partitions it again after each call, also after the
        # backward's recomputation of a chunk, which then finds it empty; one full copy for this call instead,
        # gathered once (no collective in the backward)
        out = chunked(_FrozenHead(lm_head), hidden)
    else:
        # ZeRO-3 gathers a module's parameters at every call of it, and the chunk count differs across ranks: the
        # head is called once, the chunks running inside that call on its own forward, so its hooks gather once in
        # the forward, once in the backward before the chunks' recomputation, and release when the backward has
        # passed every chunk
        with _forward_replaced(lm_head, functools.partial(chunked, lm_head.forward)):
            out = lm_head(hidden)
    shape = (sequences.shape[0], response_width)
    if not with_entropy:
        return _to_response_block(out, positions, shape)
    return _to_response_block(out[0], positions, shape), _to_response_block(out[1], positions, shape)


def _packed_routes(routes: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """Padded routes [B, S, moe_layers, top_k] -> the packed rows' flattened slots [R * L, moe_layers, top_k],
    -1 on the rows' pad slots (their routers keep their own choice)."""
    rows, row_len = batch.input_ids.shape
    packed = torch.full((rows * row_len, *routes.shape[2:]), -1, dtype=routes.dtype)
    packed[batch.slots.cpu()] = pack_values(routes.cpu(), batch)
    return packed


def _value_model(model: nn.Module, caller: str) -> nn.Module:
    from rlhf_sg.models import ValueHeadModel

    module = _unwrap(model)
    module = unwrap_adapters(module)  # LoRA adapters on it (PEFT): called through the wrapper
    if not isinstance(module, ValueHeadModel):
        raise TypeError(
            f"{caller} needs a rlhf_sg.models.ValueHeadModel (load it with ValueHeadModel.from_pretrained), "
            f"got {type(module).__name__}"
        )
    return module


def critic_values(
    critic: nn.Module,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    response_width: int,
    attn_implementation: str | None = None,
    share_prompts: bool = False,
    segment_tokens: int | None = None,
) -> torch.Tensor:
    """Critic values of the response states, computed on packed rows.

    ``values[b, j]`` [B, T] float32 is the value head's output at position P + j - 1: the state is the
    prefix BEFORE response token j is emitted (PPO's convention). 0 where the response is padding.
    ``critic``: a :class:`rlhf_sg.models.ValueHeadModel` (or a DeepSpeedEngine around one).
    ``share_prompts``, ``segment_tokens``: as in :func:`response_logprobs`.
    """
    module = _value_model(critic, "critic_values")
    device = _model_device(critic)
    sequences, attention_mask = sequences.to(device), attention_mask.to(device)
    _check_rollout(sequences, attention_mask, response_width)
    check_rope_regime(module, attention_mask.sum(dim=1).tolist())
    impl = _attn_implementation(module, attn_implementation)
    shape = (sequences.shape[0], response_width)
    groups = _shared_groups(module, share_prompts, sequences, attention_mask, response_width)
    if groups is not None:
        rows = pack_shared_prompts(sequences, attention_mask, response_width,
                                   segment_tokens or default_segment_tokens(module), groups=groups)
        values = _shared_forward(critic, rows, impl).reshape(-1).index_select(0, rows.predictor_slots)
        return _to_response_block(values, rows.block_positions, shape)
    batch = _pack_for(module, impl, sequences, attention_mask)
    values = _rows_to_tokens(packed_forward(critic, batch, impl), batch)
    predicts = pack_values(_response_predictors(attention_mask, response_width), batch)
    return _to_response_block(values[predicts], _block_positions(batch.indices[predicts], batch, response_width),
                              shape)


def reward_scores(
    reward_model: nn.Module,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    attn_implementation: str | None = None,
    read_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reward-model scores [B] float32: the value head's output at each row's last real token, or with
    ``read_index`` [B] long at column ``read_index[b]`` of row b (a real token; reward-model training reads at the
    last token of the response, wherever template tokens follow it). Positions come from the attention mask and the
    index, never from a pad id (a pad id equal to EOS would find the first EOS, inside the prompt).

    ``sequences`` [B, S] and ``attention_mask`` [B, S] in any contiguous-row padding (left, right or the
    rollout layout). ``reward_model``: a :class:`rlhf_sg.models.ValueHeadModel` or an engine around one.
    """
    module = _value_model(reward_model, "reward_scores")
    device = _model_device(reward_model)
    sequences, attention_mask = sequences.to(device), attention_mask.to(device)
    impl = _attn_implementation(module, attn_implementation)
    _check_padded(sequences, attention_mask)
    check_rope_regime(module, attention_mask.sum(dim=1).tolist())
    batch = _pack_for(module, impl, sequences, attention_mask)
    values = _rows_to_tokens(packed_forward(reward_model, batch, impl), batch)
    if read_index is None:
        return values[batch.cu_seqlens[1:].long() - 1]
    read_index = read_index.to(device=device, dtype=torch.long)
    rows, seq = sequences.shape
    if read_index.shape != (rows,) or bool(((read_index < 0) | (read_index >= seq)).any()):
        raise ValueError(f"read_index must be [{rows}] columns in 0..{seq - 1}, got {read_index.tolist()}")
    if not bool(attention_mask.gather(1, read_index[:, None]).bool().all()):
        raise ValueError("read_index points at padding in some row; it must name a real token of each row")
    token_of = torch.full((rows * seq,), -1, dtype=torch.long, device=device)
    token_of[batch.indices.to(device)] = torch.arange(batch.num_tokens, device=device)
    return values[token_of[torch.arange(rows, device=device) * seq + read_index]]


# ---- token-budget micro-batches ------------------------------------------------------------------------


def token_budget_microbatches(
    lengths: list[int], max_tokens_per_microbatch: int, dp_size: int
) -> list[list[list[int]]]:
    """Split an experience batch into micro-batches of at most ``max_tokens_per_microbatch`` real tokens.

    ``lengths[i]``: real tokens of sample i. Returns ``plan[rank][k]`` = the sample indices (ascending) of
    rank ``rank``'s k-th micro-batch. Every rank gets the same number M of micro-batches (ZeRO-3 gathers
    parameters collectively, so ranks must run forwards in lockstep), none of them empty, and the
    micro-batches hold nearly equal token counts:

    1. K = M * dp_size micro-batches, M starting at the least that the total allows;
    2. longest-processing-time bin packing: samples longest first, each into the micro-batch holding the
       fewest tokens (if it does not fit there it fits nowhere: M += 1 and retry);
    3. micro-batches heaviest first, each to the rank with the fewest tokens among those with < M.

    A rank's micro-batches come heaviest first, so running out of memory shows on the first one. Raises
    ValueError for a sample longer than the budget, fewer samples than ranks, or when dp_size * M
    non-empty micro-batches cannot be formed (too few samples for the micro-batches their lengths need).
    """
    if max_tokens_per_microbatch < 1:
        raise ValueError(f"max_tokens_per_microbatch must be >= 1, got {max_tokens_per_microbatch}")
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    lengths = [int(n) for n in lengths]
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError(f"sample {i} has {n} tokens; every sample needs at least one")
        if n > max_tokens_per_microbatch:
            raise ValueError(
                f"sample {i} has {n} tokens, more than max_tokens_per_microbatch="
                f"{max_tokens_per_microbatch}; raise the budget to at least the longest sequence (prompt + "
                "response)"
            )
    if len(lengths) < dp_size:
        raise ValueError(
            f"{len(lengths)} samples cannot give each of dp_size={dp_size} ranks a micro-batch; use more "
            "samples per optimizer step or fewer ranks"
        )
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    per_rank = max(1, math.ceil(math.ceil(sum(lengths) / max_tokens_per_microbatch) / dp_size))
    while True:
        num_micro = per_rank * dp_size
        if num_micro > len(lengths):
            raise ValueError(
                f"cannot split {len(lengths)} samples into {dp_size} ranks x {per_rank} non-empty "
                f"micro-batches of at most {max_tokens_per_microbatch} tokens; raise the budget"
            )
        micro = _least_loaded_bins(order, lengths, num_micro, max_tokens_per_microbatch)
        if micro is not None:
            break
        per_rank += 1

    loads = [sum(lengths[i] for i in m) for m in micro]
    plan: list[list[list[int]]] = [[] for _ in range(dp_size)]
    rank_loads = [0] * dp_size
    for k in sorted(range(num_micro), key=lambda k: (-loads[k], k)):
        rank = min((r for r in range(dp_size) if len(plan[r]) < per_rank), key=lambda r: (rank_loads[r], r))
        plan[rank].append(sorted(micro[k]))
        rank_loads[rank] += loads[k]
    return plan


def shared_prompt_microbatches(
    groups: list[list[int]], prompt_lengths: list[int], lengths: list[int], max_tokens_per_microbatch: int,
    dp_size: int,
) -> list[list[list[int]]]:
    """:func:`token_budget_microbatches` for shared-prompt forwards (:func:`pack_shared_prompts`): the samples of
    a group (``groups``: sample indices with one prompt) go into one micro-batch where they can, so the prompt is
    computed once for all of them, and a micro-batch's tokens are counted as computed (each group's prompt once).

    ``prompt_lengths[i]``, ``lengths[i]``: sample i's prompt and prompt + response tokens. Groups are split in
    halves, quarters, ... only as far as the budget and ``dp_size`` x M non-empty micro-batches need; split down
    to single samples it is :func:`token_budget_microbatches` itself, with its errors. Same return as that."""
    largest = max((len(g) for g in groups), default=1)
    pieces = 1
    while pieces < largest:
        units = []
        for group in groups:
            size = math.ceil(len(group) / pieces)
            units += [group[k : k + size] for k in range(0, len(group), size)]
        costs = [prompt_lengths[u[0]] + sum(lengths[i] - prompt_lengths[i] for i in u) for u in units]
        try:
            plan = token_budget_microbatches(costs, max_tokens_per_microbatch, dp_size)
        except ValueError:
            pieces *= 2
            continue
        return [[sorted(i for k in micro for i in units[k]) for micro in rank] for rank in plan]
    return token_budget_microbatches(lengths, max_tokens_per_microbatch, dp_size)


def _least_loaded_bins(
    order: list[int], lengths: list[int], num_bins: int, capacity: int
) -> list[list[int]] | None:
    """Items (in ``order``) each into the least-loaded of ``num_bins`` bins; None if one does not fit."""
    heap = [(0, k) for k in range(num_bins)]
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for i in order:
        load, k = heapq.heappop(heap)
        if load + lengths[i] > capacity:
            return None
        bins[k].append(i)
        heapq.heappush(heap, (load + lengths[i], k))
    return bins

