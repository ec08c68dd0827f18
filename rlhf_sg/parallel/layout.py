"""Packed rows laid out for an SP group: pad every row to a multiple of N columns, then give rank k columns
``[k L' / N, (k + 1) L' / N)`` of every row. Shared-prompt rows (:func:`shard_shared`) are padded and sliced the same
way, their pad columns attending to themselves only.

The order is fixed: :func:`rlhf_sg.packing.pack` packs and builds each token's label from its own sequence, THEN the
rows are padded and sliced, so a token at a shard's last column keeps its label (the next token, on the next rank).
The pad columns added here form a segment of their own (position ids 0, 1, ...): no real token sees them (they come
after every real token of the row, and a block-causal mask keeps a segment's keys to itself) and each pad query has
keys (itself), so no attention row is all masked.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rlhf_sg.packing import PackedBatch, SharedPromptRows


@dataclass
class ShardedRows:
    """One rank's share of packed rows padded for an SP group of ``size`` ranks.

    input_ids, position_ids: [R, L' / N] long, this rank's columns.
    full_input_ids, full_position_ids: [R, L'] long, every column (the mask is built from the full position ids).
    slots: [n_tok] long, each real token's flat slot ``r * L' + c`` in the padded rows (token order).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    full_input_ids: torch.Tensor
    full_position_ids: torch.Tensor
    slots: torch.Tensor
    size: int
    rank: int

    @property
    def shard_columns(self) -> int:
        return int(self.input_ids.shape[1])

    def local_index(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded flat slots -> (which of them lie in this rank's columns [bool], their flat index in the shard
        ``r * L' / N + c - rank * L' / N``)."""
        width = self.full_position_ids.shape[1]
        row, column = slots // width, slots % width
        local_column = column - self.rank * self.shard_columns
        mine = (local_column >= 0) & (local_column < self.shard_columns)
        return mine, (row * self.shard_columns + local_column)[mine]


def padded_width(length: int, size: int) -> int:
    """The least multiple of ``size`` that is at least ``length``."""
    return -(-length // size) * size


def _widened(slots: torch.Tensor, length: int, width: int) -> torch.Tensor:
    """Flat slots ``r * length + c`` of rows ``length`` long -> ``r * width + c`` of the same rows padded to
    ``width``."""
    return slots // length * width + slots % length


def _shard(input_ids: torch.Tensor, position_ids: torch.Tensor, slots: torch.Tensor, size: int,
           rank: int) -> ShardedRows:
    """Rank ``rank``'s columns of rows already padded to a multiple of ``size``."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in an SP group of {size}")
    width = input_ids.shape[1]
    if width % size:
        raise ValueError(f"rows of {width} columns do not split over an SP group of {size}; pad them first")
    columns = slice(rank * (width // size), (rank + 1) * (width // size))
    return ShardedRows(input_ids=input_ids[:, columns].contiguous(), position_ids=position_ids[:, columns].contiguous(),
                       full_input_ids=input_ids, full_position_ids=position_ids, slots=slots, size=size, rank=rank)


def shard_packed(batch: PackedBatch, size: int, rank: int) -> ShardedRows:
    """Rank ``rank``'s columns of ``batch``'s packed rows padded to a multiple of ``size`` (pad columns their own
    segment, see the module doc)."""
    rows, length = batch.input_ids.shape
    width = padded_width(length, size)
    pad = width - length
    input_ids = torch.cat([batch.input_ids, batch.input_ids.new_zeros(rows, pad)], dim=1)
    pad_positions = torch.arange(pad, device=batch.position_ids.device).expand(rows, pad)
    position_ids = torch.cat([batch.position_ids, pad_positions], dim=1)
    return _shard(input_ids, position_ids, _widened(batch.slots, length, width), size, rank)


def pad_shared_rows(rows: SharedPromptRows, size: int) -> SharedPromptRows:
    """Shared-prompt rows with every row padded to a multiple of ``size`` columns. A pad column is what the rows' own
    padding is (:class:`rlhf_sg.packing.SharedPromptRows`): token and position 0, held by no sequence, its segment,
    prompt end and branch start its own column, so it attends to itself only and nothing attends to it; the flat
    slots (the predictors', the branches') are re-indexed to the wider rows, so the tree mask and the blocks built
    from the result are the rows' own with the pad columns beside them."""
    num_rows, length = rows.input_ids.shape
    width = padded_width(length, size)
    if width == length:
        return rows
    device = rows.input_ids.device
    columns = torch.arange(length, width, device=device).expand(num_rows, width - length)
    zeros = torch.zeros(num_rows, width - length, dtype=torch.long, device=device)

    def widen(values: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return torch.cat([values, pad.to(values.dtype)], dim=1)

    branches = rows.branches.clone()
    branches[:, 0], branches[:, 2] = (_widened(branches[:, k], length, width) for k in (0, 2))
    return dataclasses.replace(
        rows, input_ids=widen(rows.input_ids, zeros), position_ids=widen(rows.position_ids, zeros),
        segment_start=widen(rows.segment_start, columns), prompt_end=widen(rows.prompt_end, columns),
        branch_start=widen(rows.branch_start, columns), holders=widen(rows.holders, zeros),
        predictor_slots=_widened(rows.predictor_slots, length, width), branches=branches)


def shard_shared(rows: SharedPromptRows, size: int, rank: int) -> tuple[SharedPromptRows, ShardedRows]:
    """Shared-prompt rows padded for an SP group of ``size`` (:func:`pad_shared_rows`) and rank ``rank``'s columns of
    them (``slots``: every slot a sequence holds)."""
    padded = pad_shared_rows(rows, size)
    real = padded.holders.reshape(-1).nonzero()[:, 0]
    return padded, _shard(padded.input_ids, padded.position_ids, real, size, rank)
