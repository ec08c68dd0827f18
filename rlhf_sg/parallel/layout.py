"""Packed rows laid out for an SP group: pad every row to a multiple of N columns, then give rank k columns
``[k L' / N, (k + 1) L' / N)`` of every row.

The order is fixed: :func:`rlhf_sg.packing.pack` packs and builds each token's label from its own sequence, THEN the
rows are padded and sliced, so a token at a shard's last column keeps its label (the next token, on the next rank).
The pad columns added here form a segment of their own (position ids 0, 1, ...): no real token sees them (they come
after every real token of the row, and a block-causal mask keeps a segment's keys to itself) and each pad query has
keys (itself), so no attention row is all masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf_sg.packing import PackedBatch


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


def shard_packed(batch: PackedBatch, size: int, rank: int) -> ShardedRows:
    """Rank ``rank``'s columns of ``batch``'s packed rows padded to a multiple of ``size`` (pad columns their own
    segment, see the module doc)."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in an SP group of {size}")
    rows, length = batch.input_ids.shape
    width = padded_width(length, size)
    pad = width - length
    input_ids = torch.cat([batch.input_ids, batch.input_ids.new_zeros(rows, pad)], dim=1)
    pad_positions = torch.arange(pad, device=batch.position_ids.device).expand(rows, pad)
    position_ids = torch.cat([batch.position_ids, pad_positions], dim=1)
    slots = batch.slots // length * width + batch.slots % length
    columns = slice(rank * (width // size), (rank + 1) * (width // size))
    return ShardedRows(input_ids=input_ids[:, columns].contiguous(), position_ids=position_ids[:, columns].contiguous(),
                       full_input_ids=input_ids, full_position_ids=position_ids, slots=slots, size=size, rank=rank)
