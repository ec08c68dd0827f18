"""Device memory of one rank of an SP group (Ulysses, :mod:`rlhf_sg.parallel`) on long rows, as formulas.

What ``python -m rlhf_sg.bench memory --sp N`` prints and ``tests/test_parallel_memory.py`` holds to the tensors the
sharded path builds at small sizes; ``python -m rlhf_sg.bench sp-memory`` measures a rank's saved activations on N
spawned gloo ranks beside :func:`saved_activation_bytes`. Every count is per rank, in bytes, for ``rows`` packed rows
of ``seq_len`` tokens split over an SP group of ``size`` ranks, as the layout allocates them:

* Columns: every row padded to ``padded_width(seq_len, size)`` (:func:`rlhf_sg.parallel.layout.padded_width`), a rank
  holding ``width / size`` of them: the hidden states, norms and MLP of a rank cover its columns only.
* Attention, per layer: after the all-to-all a rank holds the WHOLE padded row for ``heads / size`` query heads
  (:func:`rlhf_sg.parallel.ulysses.sequence_to_heads`); the attention call keeps them for backward with its keys,
  values, output and float32 log-sum-exp over the whole row. Keys and values: the rank's own key / value heads
  (``kv / size``, or one replicated when ``kv < size``) where the kernel takes grouped heads (sdpa without a mask,
  flash-attention); sdpa with a mask is handed them repeated to the query heads (transformers' ``repeat_kv``). With
  ``size > 1`` the output comes back to the rank's columns (:func:`rlhf_sg.parallel.ulysses.heads_to_sequence`) as a
  new tensor, which o_proj keeps: one more ``columns x heads x head_dim`` copy a layer.
* Mask: a packed row holding several sequences on sdpa carries a ``[R, 1, L', pad16(L')]`` additive mask in the model
  dtype (``rlhf_sg.packing._block_causal_mask``), built from the full rows' position ids on EVERY rank of the group:
  it does not shrink with N (each rank needs only its heads' rows of it, but all of its keys; not split yet).
  Flash-attention's varlen path takes no mask; rows of one sequence each take causal sdpa and no mask.
* Logits: a rank projects only the hidden states of its columns that predict a response token, ``chunk_tokens`` at a
  time under checkpointing (``rlhf_sg.packing._logprob_chunk``): ``min(chunk_tokens, columns)`` tokens of
  :func:`rlhf_sg.memory.logits_chunk_bytes` at most, so the logits do not fall with N until a rank's columns are fewer
  than one chunk.

Not counted: the all-to-all's send / receive buffers (transient, one layer's queries at most), the eager
implementation (it keeps ``heads / N x L' x L'`` scores a layer: never a long-row choice).
"""

from __future__ import annotations

from rlhf_sg import memory
from rlhf_sg.memory import ModelShape
from rlhf_sg.parallel.heads import sizes_that_split
from rlhf_sg.parallel.layout import padded_width

#: attention implementations the formulas model (``--model.attn_implementation``)
IMPLEMENTATIONS = ("sdpa", "flash_attention_2")


def splits(shape: ModelShape, size: int) -> bool:
    """Whether an SP group of ``size`` can split ``shape``'s heads (:func:`rlhf_sg.parallel.heads.sizes_that_split`)."""
    return size in sizes_that_split(shape.num_heads, shape.num_kv_heads)


def rank_columns(seq_len: int, size: int) -> int:
    """The columns of a row one rank holds: the row padded to a multiple of ``size``, split evenly."""
    return padded_width(seq_len, size) // size


def rank_heads(shape: ModelShape, size: int) -> tuple[int, int]:
    """(query heads, key / value heads) one rank attends with after the all-to-all; a key / value head fewer than
    ``size`` is replicated, so each rank holds one."""
    kv = shape.num_kv_heads // size if shape.num_kv_heads % size == 0 else 1
    return shape.num_heads // size, kv


def packed_mask(implementation: str, several_per_row: bool) -> bool:
    """Whether the rows carry a dense mask: sdpa on a row packing several sequences (flash varlen takes none; a row
    of one sequence takes causal sdpa)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {implementation!r}: the SP memory formulas model "
                         f"{', '.join(IMPLEMENTATIONS)}")
    return implementation == "sdpa" and several_per_row


def qkv_bytes(shape: ModelShape, rows: int, seq_len: int, size: int, masked: bool) -> int:
    """The queries, keys and values one rank's attention call is handed a layer: the whole padded rows for its
    heads after the all-to-all, the key / value heads as the kernel takes them (module doc)."""
    heads, kv_heads = rank_heads(shape, size)
    if masked and kv_heads > 1:  # sdpa with a mask is handed them repeated to the query heads (repeat_kv: a view
        kv_heads = heads  # of one key / value head, a copy of several)
    return rows * padded_width(seq_len, size) * shape.head_dim * shape.dtype_bytes * (heads + 2 * kv_heads)


def attention_bytes_per_layer(shape: ModelShape, rows: int, seq_len: int, size: int, masked: bool) -> int:
    """What one layer's attention keeps for backward on one rank (module doc): queries, keys, values, output and
    float32 log-sum-exp over the whole padded rows for the rank's heads, and with ``size > 1`` o_proj's input back
    on the rank's columns."""
    heads = rank_heads(shape, size)[0]
    output = rows * padded_width(seq_len, size) * heads * (shape.head_dim * shape.dtype_bytes + 4)
    back = rows * rank_columns(seq_len, size) * shape.num_heads * shape.head_dim * shape.dtype_bytes if size > 1 else 0
    return qkv_bytes(shape, rows, seq_len, size, masked) + output + back


def hidden_bytes(shape: ModelShape, rows: int, seq_len: int, size: int) -> int:
    """One layer's hidden states on one rank: its columns only."""
    return rows * rank_columns(seq_len, size) * shape.hidden_size * shape.dtype_bytes


def layer_bytes(shape: ModelShape, rows: int, seq_len: int, size: int, masked: bool) -> int:
    """What one decoder layer keeps for backward on one rank: norms and MLP on its columns, the attention of
    :func:`attention_bytes_per_layer`."""
    tokens = rows * rank_columns(seq_len, size)
    return tokens * memory.outside_attention_bytes_per_token(shape) + attention_bytes_per_layer(
        shape, rows, seq_len, size, masked)


def saved_activation_bytes(shape: ModelShape, rows: int, seq_len: int, size: int, gradient_checkpointing: bool,
                           masked: bool) -> int:
    """What a rank's forward leaves for its backward: every layer's (:func:`layer_bytes`), or with gradient
    checkpointing each layer's input on its columns; the final norm's, and the ids and rotary tables once."""
    tokens = rows * rank_columns(seq_len, size)
    # the final norm's, and the int64 token ids the embedding keeps: the shard's columns, a copy, except where they
    # are a view of the full padded rows (one row, or N = 1)
    final = tokens * memory.final_norm_bytes_per_token(shape)
    ids = 8 * (tokens if rows > 1 and size > 1 else rows * padded_width(seq_len, size))
    if gradient_checkpointing:  # the rotary cos / sin are the checkpoints' inputs, not saved tensors (2 x head_dim
        # values a token, left out)
        return shape.num_layers * tokens * shape.dtype_bytes * shape.hidden_size + final + ids
    rotary = tokens * 2 * shape.head_dim * shape.dtype_bytes  # once for all layers
    return shape.num_layers * layer_bytes(shape, rows, seq_len, size, masked) + final + ids + rotary


def activation_bytes(shape: ModelShape, rows: int, seq_len: int, size: int, gradient_checkpointing: bool,
                     masked: bool) -> int:
    """A rank's activations at the backward's peak: what its forward saved, and with gradient checkpointing the one
    layer the backward recomputes."""
    recomputed = layer_bytes(shape, rows, seq_len, size, masked) if gradient_checkpointing else 0
    return saved_activation_bytes(shape, rows, seq_len, size, gradient_checkpointing, masked) + recomputed


def mask_bytes(shape: ModelShape, rows: int, seq_len: int, size: int, masked: bool) -> int:
    """The full padded rows' additive mask every rank of the group builds (module doc); 0 without one."""
    return memory.shared_mask_bytes(rows, padded_width(seq_len, size), shape.dtype_bytes) if masked else 0


def logits_tokens(seq_len: int, size: int, chunk_tokens: int = memory.LOGPROB_CHUNK_TOKENS) -> int:
    """Response positions whose logits one rank holds at once, at most: one chunk of its columns."""
    return min(chunk_tokens, rank_columns(seq_len, size))


def training_rank_bytes(shape: ModelShape, world_size: int, rows: int, seq_len: int, size: int,
                        gradient_checkpointing: bool, implementation: str = "sdpa", several_per_row: bool = True,
                        chunk_tokens: int = memory.LOGPROB_CHUNK_TOKENS) -> dict[str, int]:
    """One rank of a trained ZeRO-3 group of ``world_size`` ranks (data-parallel x ``size``; ZeRO-3 partitions over
    all of them) in the backward of ``rows`` rows of ``seq_len`` tokens split over ``size`` ranks: shards,
    activations, one logits chunk, the mask and ZeRO-3's buffers (:func:`rlhf_sg.memory.training_rank_bytes`'s
    keys)."""
    masked = packed_mask(implementation, several_per_row)
    return {
        **memory.zero3_shard_bytes(shape, world_size),
        "activations": activation_bytes(shape, rows, seq_len, size, gradient_checkpointing, masked),
        "logits": memory.logits_chunk_bytes(shape, logits_tokens(seq_len, size, chunk_tokens)),
        "mask": mask_bytes(shape, rows, seq_len, size, masked),
        "buffers": memory.zero3_buffer_bytes(shape, train=True),
    }
