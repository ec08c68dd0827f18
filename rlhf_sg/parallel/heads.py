"""Which sequence-parallel sizes a model's attention heads allow.

Ulysses gives each rank of an SP group of N ranks ``heads / N`` query heads over the whole sequence, so N must divide
the query heads. Grouped key / value heads are split as well when N divides them; when there are fewer than N, each
is replicated ``N / kv_heads`` times so that every rank holds the one its query heads read (N must then be a multiple
of the key / value heads, or a rank's query heads would straddle two of them).
"""

from __future__ import annotations

from typing import Any

from rlhf_sg.config import ConfigError


def head_counts(config: Any) -> tuple[int, int]:
    """(query heads, key / value heads) of a transformers config (a model without grouped heads: equal)."""
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or heads < 1:
        raise ConfigError(f"{type(config).__name__} has no num_attention_heads; sequence parallelism splits the "
                          "attention heads and needs to know them")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return heads, int(kv_heads)


def sizes_that_split(heads: int, kv_heads: int) -> list[int]:
    """Every SP size N the heads allow: N divides ``heads``, and N divides ``kv_heads`` or is a multiple of it."""
    return [n for n in range(1, heads + 1) if heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)]


def check_sequence_parallel_heads(model: str, heads: int, kv_heads: int, size: int, flag: str) -> None:
    """Refuse an SP ``size`` the heads cannot split, naming ``model``, its head counts and the sizes that work."""
    if size < 1:
        raise ConfigError(f"{flag}: must be >= 1, got {size}")
    if size in sizes_that_split(heads, kv_heads):
        return
    raise ConfigError(
        f"{flag} {size}: {model} has {heads} attention heads and {kv_heads} key/value heads, which {size} ranks "
        f"cannot split (each rank takes heads / {size} query heads and the key/value heads they read); sizes that "
        f"work for this model: {', '.join(map(str, sizes_that_split(heads, kv_heads)))}")
