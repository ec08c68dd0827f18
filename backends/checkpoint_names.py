"""A model's run-time parameters and the checkpoint tensors they are saved as.

transformers 5 runs some families in a layout of its own: a mixture-of-experts layer keeps its experts as two
fused 3-D parameters (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) where the
checkpoint holds one 2-D weight per expert and projection (``mlp.experts.{e}.gate_proj.weight``), and some
modules under new names (Mixtral's ``block_sparse_moe.experts.{e}.w1`` is a slice of ``mlp.experts.gate_up_proj``).
Loading converts (``conversion_mapping.py``); ``save_pretrained`` converts back
(``transformers.core_model_loading.revert_weight_conversion``). Engines load the checkpoint's names: SGLang's and
vLLM's loaders, and every engine's check of a sync plan against its checkpoint's headers.

:func:`saved_as` asks transformers' own reverse conversion, run once on meta tensors, what each run-time parameter
is saved as. It runs with ``Tensor.contiguous`` handing its tensor back as it is (the conversion's ops copy their
chunks to make them contiguous), so every checkpoint tensor comes back as a view of the run-time parameter it is
cut from, and its strides and storage offset say where its elements lie. Where each is a contiguous range of its
parameter's flat data (the fused experts: chunks along the expert axis and the projection axis), a flat bucket
holding the parameter as the trainer gathered it holds every piece too, so the sync only renames: the same bytes
under the checkpoint's names and offsets, nothing copied. A conversion that reorders elements (a transpose, an
interleave) or builds a tensor from several parameters is refused, naming the tensor, before any byte moves.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

import torch

from backends.base import BackendError, BucketManifest, TensorSpec

__all__ = ["SavedAs", "checkpoint_manifest", "checkpoint_names", "checkpoint_views", "saved_as", "text_config"]


@dataclass(frozen=True)
class SavedAs:
    """One checkpoint tensor of a run-time parameter: its name, shape, and element offset in the parameter's
    flat (row-major) data."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class _ContiguousAsViews(torch.overrides.TorchFunctionMode):
    """``Tensor.contiguous`` returns its tensor as it is, so chunks stay views of what they were cut from."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.contiguous:
            return args[0]
        return func(*args, **(kwargs or {}))


def _reverse_conversion():
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: models run in their checkpoint's layout
        return None
    return revert_weight_conversion


def checkpoint_names(path: str) -> set[str] | None:
    """The tensor names in the ``*.safetensors`` headers of model directory ``path`` (no weight read); None where
    there are none to read."""
    import glob
    import os

    files = sorted(glob.glob(os.path.join(path, "*.safetensors"))) if path and os.path.isdir(path) else []
    if not files:
        return None
    from safetensors import safe_open

    names: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt") as f:
            names.update(f.keys())
    return names


def saved_as(
    model: torch.nn.Module,
    named_shapes: Iterable[tuple[str, Sequence[int], torch.dtype]],
    checkpoint: Collection[str] | None = None,
) -> dict[str, tuple[SavedAs, ...]]:
    """For each run-time parameter whose checkpoint name or layout differs, the checkpoint tensors it is saved as
    (pieces in offset order, covering its data exactly once); parameters saved as they are do not appear.

    model: the transformers model (its own conversions, or its family's defaults, are reversed as
    ``save_pretrained`` reverses them). named_shapes: ``(run-time name, full shape, dtype)`` of every parameter,
    its shapes the full ones (ZeRO-3 keeps them in ``ds_shape``). checkpoint: the tensor names of the checkpoint
    the engines load (default: the headers in the directory the model was loaded from, ``config._name_or_path``).
    A prefix change transformers applied at load is reversed only where the checkpoint has the prefix: reversing
    it always would name Qwen3.5's text weights ``model.language_model.*`` for a checkpoint saved without it.
    Raises :class:`BackendError` naming the tensor when a checkpoint tensor is not a contiguous range of one
    parameter's data.
    """
    revert = _reverse_conversion()
    named_shapes = [(name, tuple(int(s) for s in shape), dtype) for name, shape, dtype in named_shapes]
    if revert is None or not named_shapes:
        return {}
    if checkpoint is None:
        checkpoint = checkpoint_names(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
    conversions = getattr(model, "_weight_conversions", None)
    variants = [conversions]
    if conversions:
        from transformers.core_model_loading import PrefixChange

        without_prefixes = [c for c in conversions if not isinstance(c, PrefixChange)]
        if len(without_prefixes) < len(conversions):
            variants.append(without_prefixes)
    results = []
    for variant in variants:
        model._weight_conversions = variant
        try:
            results.append(_saved_as(revert, model, named_shapes))
        finally:
            model._weight_conversions = conversions
            if conversions is None:
                del model._weight_conversions
        if checkpoint is None or _names(results[-1], named_shapes) <= set(checkpoint):
            return results[-1]
    return results[0]


def _names(renames: dict[str, tuple[SavedAs, ...]], named_shapes) -> set[str]:
    out = {name for name, _, _ in named_shapes if name not in renames}
    return out | {p.name for parts in renames.values() for p in parts}


def _saved_as(revert, model, named_shapes) -> dict[str, tuple[SavedAs, ...]]:
    sources = {name: torch.empty(shape, dtype=dtype, device="meta") for name, shape, dtype in named_shapes}
    with _ContiguousAsViews():
        saved = revert(model, dict(sources))
    if saved.keys() == sources.keys() and all(saved[k] is sources[k] for k in sources):
        return {}
    by_id = {id(t): name for name, t in sources.items()}
    pieces: dict[str, list[SavedAs]] = {}
    where = f"{type(model).__name__}: transformers' reverse conversion"
    for name, tensor in saved.items():
        source = by_id.get(id(tensor))
        base = tensor if source is not None else tensor._base
        source = source or (by_id.get(id(base)) if base is not None else None)
        if source is None or not tensor.is_contiguous():
            raise BackendError(
                f"{where} makes checkpoint tensor {name!r} by reordering elements of the run-time parameters, which "
                "the weight sync cannot express as slices of a gathered bucket; this model family cannot be synced "
                "into an engine: report it"
            )
        pieces.setdefault(source, []).append(SavedAs(name, tuple(tensor.shape), int(tensor.storage_offset())))
    out: dict[str, tuple[SavedAs, ...]] = {}
    for name, shape, _ in named_shapes:
        parts = sorted(pieces.get(name, ()), key=lambda p: p.offset)
        if not parts:
            raise BackendError(f"{where} saves run-time parameter {name!r} under no checkpoint name")
        if len(parts) == 1 and parts[0].name == name and parts[0].shape == shape:
            continue
        end = 0
        for part in parts:
            if part.offset != end:
                raise BackendError(f"{where} saves run-time parameter {name!r} {shape} as pieces that do not tile its "
                                   f"data ({[(p.name, p.offset, p.numel) for p in parts][:4]} ...)")
            end += part.numel
        total = math.prod(shape)
        if end != total:
            raise BackendError(f"{where} saves {end} of the {total} elements of run-time parameter {name!r}")
        out[name] = tuple(parts)
    return out


def checkpoint_manifest(manifest: BucketManifest, renames: dict[str, tuple[SavedAs, ...]]) -> BucketManifest:
    """The same flat bucket described under checkpoint names: each run-time tensor of ``manifest`` in ``renames``
    replaced by the checkpoint tensors it is saved as, at their offsets inside it. The bytes do not change."""
    if not renames:
        return manifest
    specs: list[TensorSpec] = []
    for spec in manifest.tensors:
        parts = renames.get(spec.name)
        if parts is None:
            specs.append(spec)
            continue
        specs += [TensorSpec(p.name, p.shape, spec.dtype, spec.offset + p.offset) for p in parts]
    return BucketManifest(tensors=tuple(specs), dtype=manifest.dtype, numel=manifest.numel)


def checkpoint_views(model: torch.nn.Module, renames: dict[str, tuple[SavedAs, ...]]) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint of ``model`` holds, by checkpoint name, as a view of the model's parameter data as
    it is now (a fused expert parameter's pieces are views into it), so copying into a view loads that checkpoint
    tensor. ``renames``: :func:`saved_as` of the model, computed once (the views are made anew at every call:
    moving the model between devices replaces its parameters' data). Tied parameters appear under each name."""
    views: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        parts = renames.get(name)
        if parts is None:
            views[name] = param.data
            continue
        flat = param.data.view(-1)
        for part in parts:
            views[part.name] = flat[part.offset : part.offset + part.numel].view(part.shape)
    return views


def text_config(config: dict):
    """The transformers config object of a ``config.json`` dict, through the family's own config class (so GPT-2's
    and Bloom's ``n_head`` / ``n_layer`` read as ``num_attention_heads`` / ``num_hidden_layers``: ``attribute_map``),
    its text part for a multimodal model; a dict with no ``model_type`` is read as plain keys."""
    from transformers import AutoConfig, PretrainedConfig

    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    built = (AutoConfig.for_model(config["model_type"], **kwargs) if config.get("model_type")
             else PretrainedConfig(**kwargs))
    return built.get_text_config()
