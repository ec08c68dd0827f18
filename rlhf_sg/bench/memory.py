"""Device memory per rank for a model shape and a sequence length, from :mod:`rlhf_sg.memory`'s formulas.

``python -m rlhf_sg.bench memory --model-config qwen2.5-7b --seq-len 16384 [--rows 1] [--world-size 8]
[--device-gib 80] [--memory-fraction 0.9] [--bucket-bytes 536870912] [--gradient-checkpointing]
[--attn-implementation sdpa]``

``--model-config``: a preset (``qwen2.5-7b``), a model directory or a ``config.json``. Prints, for one rank:
the dense attention mask of ``--rows`` rows of ``--seq-len`` tokens before (a boolean mask every layer converts
and keeps its own copy of) and after (one shared copy in the model dtype) and their ratio; the embedded engine's
KV budget at ``--memory-fraction`` of a ``--device-gib`` device and the rows of ``--seq-len`` tokens it holds;
the weight-sync buffers of a sending rank; the ZeRO-3 shards over ``--world-size`` ranks; and a training rank at
its backward's peak, a micro-batch of ``--rows`` x ``--seq-len`` tokens (``--train.max_tokens_per_microbatch``):
shards, activations, logits, mask and ZeRO-3's buffers, against the device. Nothing is allocated: the figures
are the formulas ``tests/test_memory.py`` holds to real tensors.

``[--prompt-len 1024] [--group-size 8] [--response-len 4096]``: the shared-prompt blocks on a group of that many
responses after one prompt, one segment as the ranks compute it on the blocks: what they keep for backward a layer
and a micro-batch, against the same group cut a segment a response with the key / value heads repeated (what the
blocks kept before a group was one segment however long).

``--sp N [N ...] [--sp-seq-len 32768 65536 131072]``: sequence parallelism (:mod:`rlhf_sg.parallel.memory`) in place
of the lines above: a table of one rank of an SP group of N among ``--world-size`` ZeRO-3 ranks, ``--rows`` rows of
each length split over N: the hidden states and the queries / keys / values after the all-to-all a layer, the
activations at the backward's peak, one logits chunk, the full rows' mask every rank builds on sdpa when a row packs
several sequences, and the rank's total on sdpa with packed rows and on flash-attention varlen, against the device.
"""

from __future__ import annotations

import argparse

from rlhf_sg import memory


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if abs(nbytes) >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def report(shape: memory.ModelShape, name: str, seq_len: int, rows: int, world_size: int, device_bytes: int,
           memory_fraction: float, bucket_bytes: int, gradient_checkpointing: bool = False,
           attn_implementation: str = "sdpa") -> list[str]:
    """The lines the bench prints."""
    per_layer = memory.dense_mask_bytes_per_layer(rows, seq_len, shape.dtype_bytes)
    before = memory.dense_mask_bytes_before(shape, rows, seq_len)
    after = memory.shared_mask_bytes(rows, seq_len, shape.dtype_bytes)
    budget = memory.kv_budget_bytes(shape, device_bytes, memory_fraction)
    row_bytes = memory.kv_cache_bytes(shape, 1, seq_len)
    kv_rows = max(0, budget) // row_bytes
    sync = memory.sync_bytes(shape, bucket_bytes)
    shards = memory.zero3_shard_bytes(shape, world_size)
    tokens = rows * seq_len
    rank = memory.training_rank_bytes(shape, world_size, tokens, gradient_checkpointing,
                                      dense_mask=attn_implementation != "flash_attention_2")
    return [
        f"model {name}: {shape.num_layers} layers, hidden {shape.hidden_size}, {shape.num_heads} heads / "
        f"{shape.num_kv_heads} KV heads of {shape.head_dim}, intermediate {shape.intermediate_size}, vocab "
        f"{shape.vocab_size}, {shape.dtype}: {memory.param_count(shape) / 1e9:.2f}e9 parameters "
        f"({_size(memory.weight_bytes(shape))})",
        f"per rank, {rows} row(s) of {seq_len} tokens:",
        f"  dense mask before (bool; each layer keeps its own {shape.dtype} copy, key axis padded to "
        f"{memory.pad16(seq_len)}): {_size(per_layer)} a layer, {_size(before)} for {shape.num_layers} layers",
        f"  dense mask after (one shared {shape.dtype} copy, key axis padded to {memory.pad16(seq_len)}): "
        f"{_size(after)} in all, every layer the same storage",
        f"  dense mask before / after: {before / after:.1f}x",
        f"  embedded engine KV cache at --memory-fraction {memory_fraction} of {_size(device_bytes)}: budget "
        f"{_size(budget)} (after {_size(memory.weight_bytes(shape))} of weights); a row of {seq_len} tokens takes "
        f"{_size(row_bytes)} ({memory.kv_bytes_per_token(shape)} bytes a token): {kv_rows} rows at once, "
        f"{_size(kv_rows * row_bytes)}",
        f"  weight sync (a sending rank): 2 bucket buffers {_size(sync['bucket_buffers'])} + gather staging "
        f"{_size(sync['gather_staging'])} (bucket = max(--bucket-bytes {bucket_bytes}, largest tensor "
        f"{memory.largest_tensor_bytes(shape)}))",
        f"  ZeRO-3 shards over {world_size} ranks: params {_size(shards['params'])}, grads {_size(shards['grads'])}, "
        f"optimizer {_size(shards['optimizer'])}, total {_size(sum(shards.values()))}",
        f"  a training rank at its backward's peak ({tokens} tokens a micro-batch, gradient checkpointing "
        f"{'on' if gradient_checkpointing else 'off'}, {attn_implementation}): shards "
        f"{_size(sum(rank[k] for k in memory.RESIDENT))} + activations {_size(rank['activations'])} + logits "
        f"{_size(rank['logits'])} + mask {_size(rank['mask'])} + ZeRO-3 buffers {_size(rank['buffers'])} = "
        f"{_size(sum(rank.values()))} of the device's {_size(device_bytes)}",
    ]


def shared_prompt_lines(shape: memory.ModelShape, prompt_len: int, group_size: int, response_len: int) -> list[str]:
    """The lines on the shared-prompt blocks: one group as one segment, against a segment a response with the key /
    value heads repeated."""
    blocks = memory.shared_prompt_block_bytes(shape, prompt_len, group_size, response_len)
    cut = memory.shared_prompt_block_bytes(shape, prompt_len, group_size, response_len, segments=group_size,
                                           kv_heads=shape.num_heads)
    layers = shape.num_layers
    total, cut_total = (layers * b["layer"] + b["indices"] for b in (blocks, cut))
    return [
        f"  shared-prompt blocks, a prompt of {prompt_len} and {group_size} responses of {response_len} (one segment "
        f"of {prompt_len + group_size * response_len} tokens, {memory.block_kv_heads(shape)} key / value heads to "
        f"sdpa): kept for backward {_size(blocks['layer'])} a layer, {_size(total)} a micro-batch over {layers} "
        f"layers (with gradient checkpointing one layer's at a time), indices {_size(blocks['indices'])} of it",
        f"  the same group a segment a response (the prompt in each), the {shape.num_heads} heads repeated: "
        f"{_size(cut['layer'])} a layer, {_size(cut_total)} a micro-batch; that / one segment: "
        f"{cut_total / total:.2f}x",
    ]


def sp_lines(shape: memory.ModelShape, name: str, seq_lens: list[int], sizes: list[int], rows: int,
             world_size: int, device_bytes: int, gradient_checkpointing: bool) -> list[str]:
    """The sequence-parallel table: a row per length and N (module doc)."""
    from rlhf_sg.parallel import memory as sp_memory
    from rlhf_sg.parallel.heads import sizes_that_split

    gib = f"{device_bytes / 2**30:.0f} GiB"
    lines = [
        f"model {name}: {shape.num_layers} layers, hidden {shape.hidden_size}, {shape.num_heads} heads / "
        f"{shape.num_kv_heads} KV heads of {shape.head_dim}, vocab {shape.vocab_size}, {shape.dtype}: "
        f"{memory.param_count(shape) / 1e9:.2f}e9 parameters; one rank of {world_size} (ZeRO-3 over all of them, "
        f"data-parallel x N), {rows} row(s) split over N, gradient checkpointing "
        f"{'on' if gradient_checkpointing else 'off'}",
        "",
        "| tokens | N | columns a rank | hidden a layer | q/k/v a layer: packed sdpa / flash | activations: packed "
        f"sdpa / flash | logits chunk | mask (packed sdpa, every rank) | shards + ZeRO-3 buffers | total packed sdpa "
        f"| total flash varlen | fits {gib}: sdpa / flash |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for seq_len in seq_lens:
        for size in sizes:
            if not sp_memory.splits(shape, size):
                lines.append(f"| {seq_len} | {size} | refused: {shape.num_heads} query / {shape.num_kv_heads} "
                             f"key-value heads split over "
                             f"{', '.join(map(str, sizes_that_split(shape.num_heads, shape.num_kv_heads)))} |")
                continue
            if world_size % size:
                lines.append(f"| {seq_len} | {size} | refused: {world_size} ranks are not a multiple of {size} |")
                continue
            sdpa, flash = (sp_memory.training_rank_bytes(shape, world_size, rows, seq_len, size,
                                                          gradient_checkpointing, implementation)
                           for implementation in ("sdpa", "flash_attention_2"))
            fixed = sum(sdpa[k] for k in (*memory.RESIDENT, "buffers"))
            qkv = (sp_memory.qkv_bytes(shape, rows, seq_len, size, masked) for masked in (True, False))
            fits = ("yes" if sum(b.values()) <= device_bytes else "no" for b in (sdpa, flash))
            lines.append(
                f"| {seq_len} | {size} | {sp_memory.rank_columns(seq_len, size)} | "
                f"{_size(sp_memory.hidden_bytes(shape, rows, seq_len, size))} | {' / '.join(map(_size, qkv))} | "
                f"{_size(sdpa['activations'])} / {_size(flash['activations'])} | {_size(sdpa['logits'])} | "
                f"{_size(sdpa['mask'])} | {_size(fixed)} | {_size(sum(sdpa.values()))} | "
                f"{_size(sum(flash.values()))} | {' / '.join(fits)} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    from rlhf_sg.config import RolloutConfig

    parser = argparse.ArgumentParser(prog="python -m rlhf_sg.bench memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", required=True,
                        help=f"a preset ({', '.join(sorted(memory.PRESETS))}), a model directory or a config.json")
    parser.add_argument("--seq-len", type=int, default=16384, help="tokens of a packed row / shared-prompt segment")
    parser.add_argument("--rows", type=int, default=1, help="rows in one forward (microbatch)")
    parser.add_argument("--prompt-len", type=int, default=1024, help="shared-prompt blocks: the group's prompt")
    parser.add_argument("--group-size", type=int, default=8, help="shared-prompt blocks: responses after the prompt")
    parser.add_argument("--response-len", type=int, default=4096, help="shared-prompt blocks: tokens a response")
    parser.add_argument("--world-size", type=int, default=8, help="ZeRO-3 ranks of the model")
    parser.add_argument("--device-gib", type=float, default=80.0, help="device memory, GiB")
    parser.add_argument("--memory-fraction", type=float, default=0.9, help="--rollout.memory_fraction")
    parser.add_argument("--bucket-bytes", type=int, default=RolloutConfig().bucket_bytes, help="--rollout.bucket_bytes")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="--train.gradient_checkpointing true")
    parser.add_argument("--attn-implementation", default="sdpa", choices=["sdpa", "eager", "flash_attention_2"],
                        help="--model.attn_implementation (flash attention keeps no dense mask)")
    parser.add_argument("--sp", type=int, nargs="+", metavar="N",
                        help="sequence parallelism: the table of one rank of an SP group of each N")
    parser.add_argument("--sp-seq-len", type=int, nargs="+", default=[32768, 65536, 131072], metavar="TOKENS",
                        help="--sp: the row lengths of the table")
    args = parser.parse_args(argv)
    try:
        shape = memory.load_shape(args.model_config)
    except ValueError as exc:
        parser.error(str(exc))
    if args.sp:
        if min(args.sp) < 1 or min(args.sp_seq_len) < 1 or args.rows < 1:
            parser.error("--sp, --sp-seq-len and --rows must be >= 1")
        for line in sp_lines(shape, args.model_config, args.sp_seq_len, args.sp, args.rows, args.world_size,
                             int(args.device_gib * 2**30), args.gradient_checkpointing):
            print(line)
        return
    for line in report(shape, args.model_config, args.seq_len, args.rows, args.world_size,
                       int(args.device_gib * 2**30), args.memory_fraction, args.bucket_bytes,
                       args.gradient_checkpointing, args.attn_implementation):
        print(line)
    for line in shared_prompt_lines(shape, args.prompt_len, args.group_size, args.response_len):
        print(line)


if __name__ == "__main__":
    main()
