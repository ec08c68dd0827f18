"""The plan of a weight sync: which tensors go in which flat bucket, and the check before any byte moves.

:func:`plan_buckets` packs the model's parameters (Hugging Face names) into flat 1-D buffers of at
most ``bucket_bytes``, one dtype each, described by a :class:`~backends.base.BucketManifest` (name,
shape, dtype, element offset). A tensor larger than ``bucket_bytes`` gets a bucket of its own.
Within one dtype the model's parameter order is kept; buckets are ordered by their first parameter.

:func:`check_plan`: before the first sync of a plan every engine checks it against the model it
was started from (``EngineActor.check_manifests``: checkpoint headers, no weight read), and every
trainer rank learns of any rank's refusal, so all ranks fail together before any byte moves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from backends.base import BucketManifest, TensorSpec

__all__ = ["check_plan", "full_shape", "hf_name", "manifest_bytes", "named_weights", "plan_buckets"]

_WRAPPER_PREFIXES = ("module", "_orig_mod")  # DeepSpeedEngine.module, torch.compile's wrapper


def hf_name(name: str) -> str:
    """The Hugging Face name of a parameter: wrapper prefixes (``module.``, ``_orig_mod.``) removed."""
    parts = name.split(".")
    while len(parts) > 1 and parts[0] in _WRAPPER_PREFIXES:
        parts.pop(0)
    return ".".join(parts)


def named_weights(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``(HF name, parameter)`` for every parameter of ``model`` (a DeepSpeed engine or a module).

    Model order; a tied parameter appears once, under its first name.
    """
    out, seen = [], set()
    for name, param in model.named_parameters():
        name = hf_name(name)
        if name in seen:
            raise ValueError(f"two parameters map to the HF name {name!r}; is the model wrapped twice?")
        seen.add(name)
        out.append((name, param))
    if not out:
        raise ValueError(f"{type(model).__name__} has no parameters to sync")
    return out


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """A parameter's full shape (ZeRO-3 keeps it in ``ds_shape``; ``shape`` is then empty)."""
    return tuple(param.ds_shape) if hasattr(param, "ds_shape") else tuple(param.shape)


def plan_buckets(
    named_meta: Sequence[tuple[str, Sequence[int], torch.dtype]], bucket_bytes: int
) -> list[BucketManifest]:
    """Pack tensors into flat buckets of at most ``bucket_bytes``, one dtype per bucket.

    named_meta: ``(name, shape, dtype)`` per tensor, in model order. A tensor larger than
    ``bucket_bytes`` gets a bucket of its own. One bucket per dtype is open at a time, so within a
    dtype the order is kept; buckets come out in the order of their first tensor. Pure.
    """
    if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"plan_buckets: bucket_bytes must be a positive int, got {bucket_bytes!r}")
    seen: set[str] = set()
    open_buckets: dict[torch.dtype, tuple[int, list[TensorSpec]]] = {}  # dtype -> (first index, specs)
    closed: list[tuple[int, list[TensorSpec]]] = []

    def bucket_numel(specs: list[TensorSpec]) -> int:
        return specs[-1].offset + specs[-1].numel

    for index, (name, shape, dtype) in enumerate(named_meta):
        if name in seen:
            raise ValueError(f"plan_buckets: tensor {name!r} appears twice")
        seen.add(name)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"plan_buckets: tensor {name!r} has dtype {dtype!r}, not a torch.dtype")
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"plan_buckets: tensor {name!r} has a negative dimension in shape {shape}")
        spec = TensorSpec(name, shape, dtype, 0)
        nbytes = spec.numel * dtype.itemsize
        if dtype in open_buckets:
            first, specs = open_buckets[dtype]
            if (bucket_numel(specs) + spec.numel) * dtype.itemsize > bucket_bytes:
                closed.append(open_buckets.pop(dtype))
        if dtype in open_buckets:
            first, specs = open_buckets[dtype]
            specs.append(TensorSpec(name, shape, dtype, bucket_numel(specs)))
        else:
            open_buckets[dtype] = (index, [spec])
        if nbytes >= bucket_bytes:  # full (or oversized): nothing else fits
            closed.append(open_buckets.pop(dtype))
    closed.extend(open_buckets.values())
    closed.sort(key=lambda bucket: bucket[0])
    return [
        BucketManifest(tensors=tuple(specs), dtype=specs[0].dtype, numel=bucket_numel(specs)) for _, specs in closed
    ]


def manifest_bytes(manifest: BucketManifest) -> int:
    """Bytes of the bucket's flat buffer."""
    return manifest.numel * manifest.dtype.itemsize


def check_plan(
    plan: list[BucketManifest],
    ask_engines: Callable[[list[BucketManifest]], None],
    world_size: int,
    distributed: bool,
) -> None:
    """Every engine checks the plan; all ranks raise together if any engine of any rank refuses it.

    ask_engines: calls ``check_manifests(plan)`` on this rank's engines and waits (raises
    ``EngineCallError`` naming the engine). ``distributed``: the trainer's default group is up
    (then a collective: every rank calls this with its own engines).
    """
    from rlhf_sg.engine_actor import EngineCallError

    error = None
    try:
        ask_engines(plan)
    except EngineCallError as exc:
        error = str(exc)
    errors: list[Any] = [error]
    if distributed:
        errors = [None] * world_size
        dist.all_gather_object(errors, error)
    failed = [(r, err) for r, err in enumerate(errors) if err is not None]
    if failed:
        detail = "; ".join(f"trainer rank {r}: {err}" for r, err in failed)
        raise ValueError(f"the weights do not match the engines' model, nothing was sent: {detail}")
