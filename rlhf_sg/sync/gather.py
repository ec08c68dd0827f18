"""The gather: full buckets out of DeepSpeed ZeRO-3 shards, one bucket at a time.

Under ZeRO-3 every trainer rank holds a shard of every parameter. For each bucket all ranks gather
together (a collective on the trainer's group), so a rank never holds more than one bucket of full
weights (two with overlap), never the whole model. The gather is one exchange of the bucket's
concatenated shards (:func:`gather_bucket`): on gloo, one broadcast from each of the W ranks, all
in flight at once; in the benchmark that gather took 1.3-1.8x less time than
``deepspeed.zero.GatheredParameters`` (per-parameter all-gathers: gloo's all-gather moved bytes
about 4x slower than its broadcasts on the same machine). It reads DeepSpeed's partition layout
(``param.ds_tensor``); buckets it cannot handle that way (NVMe-swapped or quantized shards) go
through ``GatheredParameters(bucket, modifier_rank=None)``.

The collectives here run on the trainer's default group, whose timeout (``init_torch_distributed``)
bounds them; their work handles are waited for without a timeout argument (on NCCL a ``wait`` whose
timeout expires aborts the communicator).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from backends.base import BucketManifest, TensorSpec

__all__ = ["GatherStaging", "gather_bucket", "gathered"]


@contextlib.contextmanager
def gathered(params: Sequence[torch.nn.Parameter]) -> Iterator[None]:
    """Inside the block every parameter of ``params`` holds its full data (``param.data``).

    ZeRO-3 partitioned parameters are all-gathered on entry and re-partitioned on exit, read-only
    (``modifier_rank=None``): a collective, so every trainer rank must enter it with the same
    parameters in the same order. Parameters that are not partitioned pass through untouched.
    """
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield


class GatherStaging:
    """Memory :func:`gather_bucket` reuses from bucket to bucket for the shard exchange."""

    def __init__(self):
        self._buffer: torch.Tensor | None = None

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A [numel] tensor of ``dtype`` on ``device`` (its contents are not kept)."""
        nbytes = numel * dtype.itemsize
        if self._buffer is None or self._buffer.numel() < nbytes or self._buffer.device != device:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self._buffer[:nbytes].view(dtype)

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.nbytes


def _exchangeable(params: Sequence[torch.nn.Parameter]) -> bool:
    """Whether the shards of these ZeRO-3 parameters can be exchanged straight from ``ds_tensor``.

    True when every one is partitioned (not gathered) over one process group, with its shard in
    memory (not swapped to NVMe), unquantized, of the parameter's dtype.
    """
    group = params[0].ds_process_group
    for p in params:
        shard = getattr(p, "ds_tensor", None)
        if (
            shard is None
            or p.ds_status.name != "NOT_AVAILABLE"
            or p.ds_process_group is not group
            or getattr(getattr(shard, "status", None), "name", "AVAILABLE") != "AVAILABLE"
            or hasattr(shard, "ds_quant_scale")
            or shard.dtype != p.dtype
        ):
            return False
    return True


def _exchange_shards(
    params: Sequence[torch.nn.Parameter],
    specs: Sequence[TensorSpec],
    out: torch.Tensor | None,
    staging: GatherStaging,
    timings: dict[str, float] | None,
) -> None:
    """Gather partitioned ZeRO-3 parameters with one exchange of their concatenated shards.

    DeepSpeed's layout: a parameter of N elements is split into W partitions of ``ceil(N / W)``
    elements (the last padded) and group rank r holds partition r in ``param.ds_tensor``. Every rank
    puts its shards of the bucket in its row of a [W, S] staging buffer, the rows are exchanged
    (gloo: W concurrent broadcasts, which move the bytes several times faster than gloo's
    all-gather; NCCL: one all-gather), and each parameter is copied out of the W rows.
    """
    group = params[0].ds_process_group
    world, me = dist.get_world_size(group), dist.get_rank(group)
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    start = time.perf_counter()
    sizes = [p.ds_tensor.numel() for p in params]
    total = sum(sizes)
    flat = staging.get(world * total, params[0].dtype, device)
    rows = flat.view(world, total)
    offset = 0
    for p, size in zip(params, sizes):
        rows[me, offset : offset + size].copy_(p.ds_tensor.reshape(-1))
        offset += size
    if nccl:
        dist.all_gather_into_tensor(flat, rows[me], group=group)
    else:
        works = [
            dist.broadcast(rows[r], src=dist.get_global_rank(group, r), group=group, async_op=True)
            for r in range(world)
        ]
        for work in works:
            work.wait()
    exchanged = time.perf_counter()
    if timings is not None:
        timings["exchange_s"] = timings.get("exchange_s", 0.0) + exchanged - start
    if out is None:
        return
    offset = 0
    for spec, size in zip(specs, sizes):
        dest = out[spec.offset : spec.offset + spec.numel]
        whole = spec.numel // size  # partitions that are all data; the next one holds the tail
        dest[: whole * size].view(whole, size).copy_(rows[:whole, offset : offset + size])
        tail = spec.numel - whole * size
        if tail:
            dest[whole * size :].copy_(rows[whole, offset : offset + tail])
        offset += size
    if timings is not None:
        timings["copy_s"] = timings.get("copy_s", 0.0) + time.perf_counter() - exchanged


@torch.no_grad()
def gather_bucket(
    params: Sequence[torch.nn.Parameter],
    manifest: BucketManifest,
    out: torch.Tensor | None,
    staging: GatherStaging | None = None,
    timings: dict[str, float] | None = None,
) -> None:
    """Gather one bucket's parameters and copy them into ``out`` at the manifest's offsets.

    params: the bucket's parameters, in manifest order. out: [manifest.numel] of manifest.dtype,
    or None on a rank that only has to take part in the gather. staging: memory to reuse across
    buckets. A collective over the ZeRO-3 group when parameters are partitioned: every rank calls
    it for every bucket in the same order. Partitioned parameters are gathered with one exchange of
    their shards (:func:`_exchange_shards`); any that cannot be (NVMe-swapped, quantized, mixed
    groups) make the bucket go through DeepSpeed's ``GatheredParameters`` instead. ``timings``: adds
    the seconds spent exchanging shards (``exchange_s``) and copying them into ``out`` (``copy_s``).
    """
    partitioned = [i for i, p in enumerate(params) if hasattr(p, "ds_id") and p.ds_status.name != "AVAILABLE"]
    if partitioned and _exchangeable([params[i] for i in partitioned]):
        _exchange_shards(
            [params[i] for i in partitioned],
            [manifest.tensors[i] for i in partitioned],
            out,
            staging or GatherStaging(),
            timings,
        )
        if out is not None:
            done = set(partitioned)
            for i, (spec, param) in enumerate(zip(manifest.tensors, params)):
                if i not in done:  # whole on every rank already
                    out[spec.offset : spec.offset + spec.numel].copy_(param.data.reshape(-1))
        return
    start = time.perf_counter()
    with gathered(params):
        exchanged = time.perf_counter()
        if out is not None:
            for spec, param in zip(manifest.tensors, params):
                out[spec.offset : spec.offset + spec.numel].copy_(param.data.reshape(-1))
        if timings is not None:
            timings["exchange_s"] = timings.get("exchange_s", 0.0) + exchanged - start
            timings["copy_s"] = timings.get("copy_s", 0.0) + time.perf_counter() - exchanged
