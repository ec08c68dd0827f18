"""A training group's ranks as data-parallel ranks x SP groups, and the loss scale that makes ZeRO-3 follow the loss
convention of :mod:`rlhf_sg.parallel.forward`.

A group of ``world`` ranks with sequence-parallel size N holds ``world / N`` data-parallel ranks; SP group k is ranks
``k N .. k N + N - 1`` (consecutive ranks, so that on a node of several devices a group's all-to-alls stay on the
node). The controller splits a batch over the data-parallel ranks only; every rank of an SP group is given the same
micro-batches (:func:`rank_plans`).

Gradients. The convention asks for the SP group's gradients SUMMED (each rank's are its columns' share of the whole
batch's loss) and then averaged over the data-parallel ranks. DeepSpeed's ZeRO-3 here partitions and reduces over
all ``world`` ranks and divides by ``world`` (``stage3.py``: ``buffer_to_reduce.div_(averaging_world_sz /
sequence_parallel_size)``, with ``sequence_parallel_size`` read from a Megatron-style ``mpu`` given to
``deepspeed.initialize``, 1 without one). Rather than hand DeepSpeed an ``mpu`` (a process-wide setting that also
changes its data-parallel group, checkpoint names and batch-size arithmetic), each rank scales the loss it
back-propagates by N (:func:`loss_scale`): the average over ``world`` of N x (columns' share) is the data-parallel
mean of the SP groups' sums, exactly (N and ``world`` are what DeepSpeed divides by; for N a power of two the
scaling is exact in floating point). Metrics come from the unscaled loss.
"""

from __future__ import annotations

import datetime

from rlhf_sg.parallel.ulysses import SequenceParallelGroup


def data_parallel_ranks(world_size: int, size: int) -> int:
    """The data-parallel ranks of a group of ``world_size`` ranks with SP size ``size`` (which must divide it)."""
    if size < 1 or world_size % size:
        raise ValueError(f"sequence_parallel_size {size} does not divide the group's {world_size} ranks")
    return world_size // size


def rank_plans(plans: list, size: int) -> list:
    """Per-data-parallel-rank ``plans`` (micro-batches, optimizer steps: anything per rank) -> per rank: rank r
    takes data-parallel rank ``r // size``'s."""
    return [plan for plan in plans for _ in range(size)]


def loss_scale(size: int) -> float:
    """What a rank multiplies the loss it back-propagates by under SP size ``size`` (module doc)."""
    return float(size)


def sequence_parallel_groups(world_size: int, size: int, rank: int, timeout_s: float) -> SequenceParallelGroup:
    """Create the SP groups of the default process group (every rank calls this: torch.distributed needs every rank
    to create every group, in the same order) and return the one holding ``rank``; its collectives fail after
    ``timeout_s``."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    groups = [dist.new_group(list(range(k * size, (k + 1) * size)), timeout=timeout)
              for k in range(data_parallel_ranks(world_size, size))]
    return SequenceParallelGroup.of(groups[rank // size])
