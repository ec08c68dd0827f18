"""Sequence parallelism (Ulysses) for the training groups: one long row split over the N ranks of an SP group.

- :mod:`.heads`: which N a model's attention heads allow (key / value heads fewer than N are replicated).
- :mod:`.ulysses`: the all-to-all wrapper around the attention function the model runs (sdpa, eager, flash-attention
  varlen), so the project's own masks apply to the whole rows on each rank's heads.
- :mod:`.layout`: pack (or share prompts), labels, pad to a multiple of N (pad columns their own segment), slice.
- :mod:`.forward`: log-probs, entropy, values and reward scores by an SP group, and the loss convention (module doc).
- :mod:`.groups`: a training group's SP groups, the data-parallel split of its plans and the loss scale that makes
  ZeRO-3's reduction follow the convention.
- :mod:`.memory`: one rank's bytes on long rows (``python -m rlhf_sg.bench memory --sp N``).
"""

from rlhf_sg.parallel.forward import sp_critic_values, sp_response_logprobs, sp_reward_scores
from rlhf_sg.parallel.groups import data_parallel_ranks, loss_scale, rank_plans, sequence_parallel_groups
from rlhf_sg.parallel.heads import check_sequence_parallel_heads, head_counts, sizes_that_split
from rlhf_sg.parallel.layout import ShardedRows, pad_shared_rows, padded_width, shard_packed, shard_shared
from rlhf_sg.parallel.ulysses import (
    SEQUENCE_PARALLEL_KWARG,
    SequenceParallelGroup,
    heads_to_sequence,
    sequence_to_heads,
    use_ulysses_attention,
    wrapped_implementation,
)

__all__ = ["SEQUENCE_PARALLEL_KWARG", "SequenceParallelGroup", "ShardedRows", "check_sequence_parallel_heads",
           "data_parallel_ranks", "head_counts", "heads_to_sequence", "loss_scale", "pad_shared_rows", "padded_width",
           "rank_plans", "sequence_parallel_groups", "sequence_to_heads", "shard_packed", "shard_shared",
           "sizes_that_split", "sp_critic_values", "sp_response_logprobs", "sp_reward_scores", "use_ulysses_attention",
           "wrapped_implementation"]
