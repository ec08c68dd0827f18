"""LoRA policies: the actor trains low-rank adapters on a frozen base, and the engines get the policy either
merged (``W + scaling * B @ A``, computed in fp32 into the send buffer) or as the adapter's own tensors.

Names. PEFT wraps the model, so the trainer's parameters are named
``base_model.model.<hf module>.base_layer.weight`` (a targeted layer's frozen weight),
``base_model.model.<hf module>.lora_A.default.weight`` / ``lora_B.default.weight`` (the adapter) and
``base_model.model.<hf name>`` (every other weight). :func:`merged_name` maps them to the engine's HF names
(a LoRA tensor to None: it goes into its base weight); :func:`adapter_name` to the names of PEFT's saved
``adapter_model.safetensors`` (``...lora_A.weight``). Any other PEFT tensor (DoRA magnitudes, embedding
adapters, a second adapter) has no name an engine knows, and is refused before any byte moves.

The trainer's parameters are never written: a merged bucket is the gathered base weights (a copy, in the
send buffer) plus the adapter's product added in fp32 (:func:`merge_into_bucket`), so repeated syncs cannot
drift the base as in-place merge / unmerge in bf16 does.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from backends.base import BucketManifest

__all__ = ["ADAPTER", "LoraSpec", "LoraTensors", "adapter_disabled", "adapter_name", "apply_lora", "base_hash",
           "merge_into_bucket", "merged_name", "merged_state_dict", "split_lora"]

#: the adapter's name inside the trainer's PeftModel
ADAPTER = "default"
_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraSpec:
    """What the actor's adapter is (from ``--lora.*``); the same r, alpha and rsLoRA flag reach the engines."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: str | tuple[str, ...] = "all-linear"
    rslora: bool = False
    sync_mode: str = "merged"
    init_adapter: str | None = None

    @property
    def scaling(self) -> float:
        return self.alpha / (self.rank**0.5 if self.rslora else self.rank)

    def peft_config(self) -> dict[str, Any]:
        """The adapter_config.json keys an engine needs to serve the adapter."""
        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return {"peft_type": "LORA", "r": self.rank, "lora_alpha": self.alpha, "use_rslora": self.rslora,
                "target_modules": targets, "lora_dropout": 0.0, "bias": "none"}

    @classmethod
    def from_config(cls, lora) -> LoraSpec:
        """From a :class:`rlhf_sg.config.LoraConfig` (or its dict)."""
        from rlhf_sg.config import LoraConfig, lora_target_modules

        if isinstance(lora, dict):
            lora = LoraConfig(**lora)
        targets = lora_target_modules(lora)
        return cls(rank=lora.rank, alpha=float(lora.alpha), dropout=float(lora.dropout),
                   target_modules=targets if isinstance(targets, str) else tuple(targets), rslora=lora.rslora,
                   sync_mode=lora.sync_mode, init_adapter=lora.init_adapter)


def apply_lora(model: torch.nn.Module, spec: LoraSpec, disable_dropout: bool, trainable: bool = True,
               head: str | None = None):
    """Wrap a causal LM in a PEFT LoRA model: only the adapter's parameters train.

    The adapter gets the base's dtype (``autocast_adapter_dtype=False``): under ZeRO-3 a mix of bf16 and fp32
    parameters breaks the coalesced gathers. With ``disable_dropout`` the adapters' dropout is 0 (PEFT builds
    its dropout modules after our zeroing of the model's own ran), so the first update's ratio is exactly 1.
    ``spec.init_adapter``: load that saved adapter's weights instead of a fresh one (B = 0).
    ``head``: a value model's head module (``value_head`` of :class:`rlhf_sg.models.ValueHeadModel`, wrapped as a
    plain PeftModel): given no adapter, it trains whole beside the adapters (its weight keeps its own name, so a
    merge passes it through).
    """
    from peft import LoraConfig, PeftModel, get_peft_model

    dropout = 0.0 if disable_dropout else spec.dropout
    targets = spec.target_modules if isinstance(spec.target_modules, str) else list(spec.target_modules)
    if spec.init_adapter is not None:
        peft_model = PeftModel.from_pretrained(model, spec.init_adapter, adapter_name=ADAPTER,
                                               is_trainable=trainable, autocast_adapter_dtype=False)
        config = peft_model.peft_config[ADAPTER]
        config.lora_dropout = dropout
    else:
        config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=dropout, target_modules=targets,
                            use_rslora=spec.rslora, bias="none", task_type="CAUSAL_LM" if head is None else None,
                            exclude_modules=[head] if head is not None else None)
        peft_model = get_peft_model(model, config, adapter_name=ADAPTER, autocast_adapter_dtype=False)
    if disable_dropout:
        for module in peft_model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    dtype = next(p.dtype for n, p in peft_model.named_parameters() if "lora_" not in n)
    for name, param in peft_model.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(dtype)
            param.requires_grad_(trainable)
    if head is not None:
        peft_model.get_base_model().get_submodule(head).requires_grad_(trainable)
    if not trainable:
        peft_model.requires_grad_(False)
    return peft_model


def _strip(name: str) -> str:
    return name[len(_PREFIX):] if name.startswith(_PREFIX) else name


def is_lora_tensor(name: str) -> bool:
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def merged_name(peft_name: str) -> str | None:
    """The engine's HF name of a trainer parameter for a merged sync; None for a LoRA A / B tensor.

    ``base_model.model.X.base_layer.weight`` -> ``X.weight``; ``base_model.model.Y`` -> ``Y``. Raises
    ValueError for a PEFT tensor an engine cannot take (DoRA magnitudes, embedding adapters, another adapter).
    """
    if is_lora_tensor(peft_name):
        return None
    parts = _strip(peft_name).split(".")
    if any(p.startswith("lora_") for p in parts):
        raise ValueError(
            f"LoRA sync: trainer tensor {peft_name!r} has no engine name (only lora_A / lora_B of adapter "
            f"{ADAPTER!r} on linear layers merge into base weights); nothing was sent"
        )
    return ".".join(p for p in parts if p != "base_layer")


def adapter_name(peft_name: str) -> str:
    """The saved-adapter name of a LoRA tensor: ``base_model.model.X.lora_A.default.weight`` ->
    ``base_model.model.X.lora_A.weight`` (PEFT's adapter_model.safetensors convention)."""
    if not is_lora_tensor(peft_name):
        raise ValueError(f"{peft_name!r} is not a LoRA A / B tensor of adapter {ADAPTER!r}")
    return peft_name.replace(f".{ADAPTER}.", ".")


@dataclass
class LoraTensors:
    """One base weight's adapter: A [r, in], B [out, r] (trainer parameters, maybe ZeRO-3 partitioned)."""

    a: torch.nn.Parameter
    b: torch.nn.Parameter


Named = list[tuple[str, torch.nn.Parameter]]


def split_lora(named: Sequence[tuple[str, torch.nn.Parameter]]) -> tuple[Named, dict[str, LoraTensors], Named]:
    """Split a PeftModel's ``(name, parameter)`` pairs (wrapper prefixes removed).

    Returns (base weights under the engine's HF names, in model order; engine name -> its adapter's A / B;
    the LoRA tensors under their PEFT names, in model order).
    """
    base: list[tuple[str, torch.nn.Parameter]] = []
    lora_params: list[tuple[str, torch.nn.Parameter]] = []
    halves: dict[str, dict[str, torch.nn.Parameter]] = {}
    for name, param in named:
        target = merged_name(name)
        if target is not None:
            base.append((target, param))
            continue
        lora_params.append((name, param))
        module, which = name.split(".lora_", 1)
        key = merged_name(f"{module}.base_layer.weight")
        halves.setdefault(key, {})[which[0]] = param
    names = {n for n, _ in base}
    adapters = {}
    for key, pair in halves.items():
        if key not in names or set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA sync: the adapter of {key!r} has halves {sorted(pair)} and its base weight "
                             f"{'is' if key in names else 'is not'} in the model; expected lora_A and lora_B on a "
                             "base_layer")
        adapters[key] = LoraTensors(a=pair["A"], b=pair["B"])
    return base, adapters, lora_params


@torch.no_grad()
def merge_into_bucket(manifest: BucketManifest, out: torch.Tensor, deltas: dict[str, tuple[torch.Tensor, torch.Tensor]],
                      scaling: float) -> None:
    """Add each adapter's product to its base weight in the bucket: ``W + scaling * B @ A``, in fp32.

    out: [manifest.numel] of manifest.dtype holding the gathered base weights (the send buffer, never a trainer
    parameter); deltas: engine name -> (A [r, in], B [out, r]) full tensors for the bucket's weights that have
    an adapter. The sum is rounded once, into the buffer's dtype.
    """
    for spec in manifest.tensors:
        pair = deltas.get(spec.name)
        if pair is None:
            continue
        a, b = pair
        view = out[spec.offset: spec.offset + spec.numel].view(spec.shape)
        merged = view.float().addmm_(b.float(), a.float(), alpha=scaling)
        view.copy_(merged)


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module, spec: LoraSpec, keep: bool = True) -> dict[str, torch.Tensor]:
    """The merged model's full weights under the base model's names, on the CPU: each adapted weight
    ``W + scaling * B @ A`` computed in fp32 and cast to W's dtype, every other weight as it is (the trainer's
    parameters are not written). ``model``: a PeftModel or a DeepSpeed engine around one; ZeRO-3 partitioned
    parameters are gathered one weight (and its adapter) at a time, a collective every rank enters; only a rank
    with ``keep`` holds the result (the others get ``{}``)."""
    from rlhf_sg.sync import gathered, hf_name

    base, adapters, _ = split_lora([(hf_name(n), p) for n, p in model.named_parameters()])
    merged = {}
    for name, param in base:
        pair = adapters.get(name)
        with gathered([param] + ([pair.a, pair.b] if pair else [])):
            if not keep:
                continue
            weight = param.data.detach().to("cpu", torch.float32, copy=True)
            if pair is not None:
                weight.addmm_(pair.b.data.float().cpu(), pair.a.data.float().cpu(), alpha=spec.scaling)
            merged[name] = weight.to(param.dtype)
    return merged


@contextlib.contextmanager
def adapter_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block the PeftModel (or a DeepSpeed engine around one) computes as its base model."""
    module = getattr(model, "module", model)
    with module.disable_adapter():
        yield


def base_hash(model_path: str) -> str:
    """A SHA-256 over the base model's weight files (names, sizes and bytes), to tie a saved adapter to it."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(model_path)):
        if not name.endswith((".safetensors", ".bin")):
            continue
        digest.update(name.encode())
        with open(os.path.join(model_path, name), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def write_adapter_dir(path: str, tensors: dict[str, torch.Tensor], spec: LoraSpec, base_model_path: str) -> str:
    """A PEFT adapter directory: adapter_model.safetensors (saved names) and adapter_config.json."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "adapter_model.safetensors"))
    config = dict(spec.peft_config(), task_type="CAUSAL_LM", base_model_name_or_path=base_model_path,
                  inference_mode=True)
    with open(os.path.join(path, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return path
