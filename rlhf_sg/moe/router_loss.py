"""The router load-balancing loss of mixture-of-experts models, over the real tokens of our packed layouts.

transformers' MoE causal LMs (Qwen3-MoE, Qwen3-Next, Mixtral, GPT-OSS, ...) add Switch Transformer's auxiliary
loss when ``output_router_logits`` is on: over every token the 2D ``attention_mask`` marks real (pad tokens
excluded) and every MoE layer jointly,

    f_e = (top-k assignments to expert e) / (real tokens x layers)
    P_e = (sum of softmax(router logits)_e) / (real tokens x layers)
    aux = num_experts x sum_e f_e P_e

(``load_balancing_loss_func`` in each model's modeling file). Our forwards hand the model packed rows and a 4D (or
per-layer-type) mask that function cannot read, so :class:`RouterLoad` records the router logits itself (forward
hooks on the modules the model's ``_can_record_outputs["router_logits"]`` names, as transformers does) and weighs
every slot of the packed rows by how many of the batch's sequences hold its token: 1 for a packed token, 0 for a
row's pad slots, and for a shared prompt (:func:`rlhf_sg.packing.pack_shared_prompts`) the number of responses
that share it, since the unpacked batch computes that prompt once per row. The result is the model's own
``aux_loss`` on the same sequences run unpadded with a 2D mask, to float rounding.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


def _router_specs(module: nn.Module) -> list[tuple[nn.Module, type | None, str | None, str | None, int]]:
    """(submodel, target class, class-name suffix, layer name, output index) of every ``router_logits`` recorder
    the model's submodels declare (``_can_record_outputs``)."""
    specs = []
    for sub in module.modules():
        table = getattr(type(sub), "_can_record_outputs", None)
        if not isinstance(table, dict) or "router_logits" not in table:
            continue
        entries = table["router_logits"]
        for spec in entries if isinstance(entries, list) else [entries]:
            if isinstance(spec, (type, str)):  # transformers' shorthand: a class (or class-name suffix), output 1
                specs.append((sub, spec if isinstance(spec, type) else None, spec if isinstance(spec, str) else None,
                              None, 1))
            else:
                specs.append((sub, spec.target_class, spec.class_name, spec.layer_name, spec.index))
    return specs


def _router_modules(module: nn.Module) -> list[tuple[nn.Module, int]]:
    """The router modules of ``module`` and the index of their output that holds the logits."""
    found, seen = [], set()
    for owner, target, class_name, layer_name, index in _router_specs(module):
        for name, sub in owner.named_modules(prefix=""):
            match = (target is not None and isinstance(sub, target)) or (
                class_name is not None and name.endswith(class_name))
            if not match or (layer_name is not None and f".{layer_name.strip('.')}." not in f".{name}."):
                continue
            if id(sub) not in seen:
                seen.add(id(sub))
                found.append((sub, index))
    return found


def _expert_counts(module: nn.Module) -> tuple[int, int]:
    """(experts, experts per token) as the model's causal-LM head reads them (``num_experts`` /
    ``num_experts_per_tok``, else the config's ``num_experts`` / ``num_local_experts``)."""
    config = getattr(module, "config", None)
    config = getattr(config, "text_config", None) or config
    experts = getattr(module, "num_experts", None) or getattr(config, "num_experts", None) or getattr(
        config, "num_local_experts", None)
    top_k = getattr(module, "num_experts_per_tok", None) or getattr(config, "num_experts_per_tok", None)
    if not experts or not top_k:
        raise ValueError(f"{type(module).__name__} records router logits but names no expert count "
                         "(num_experts / num_local_experts and num_experts_per_tok)")
    return int(experts), int(top_k)


def has_router(module: nn.Module) -> bool:
    """Whether ``module`` (a causal LM, or a wrapper around one) has routers whose logits can be recorded."""
    return bool(_router_modules(getattr(module, "module", module)))


def default_router_aux_loss_coef(config) -> float:
    """The coefficient a model applies to its own aux loss in training: ``router_aux_loss_coef`` when
    ``output_router_logits`` is on (the model then adds it to its loss), else 0 (it does not)."""
    config = getattr(config, "text_config", None) or config
    if not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def load_balancing_loss(router_logits: list[torch.Tensor], token_weights: torch.Tensor, num_experts: int,
                        top_k: int) -> torch.Tensor:
    """Switch Transformer's load-balancing loss over weighted tokens: each layer's ``router_logits`` [slots, E]
    (one row per slot of the packed rows), ``token_weights`` [slots] how many sequences hold each slot's token (0:
    a pad slot). All layers count jointly, as in transformers' ``load_balancing_loss_func``; fp32."""
    if not router_logits:
        raise ValueError("load_balancing_loss: no router logits were recorded")
    weights = token_weights.reshape(-1).float()
    assigned = weights.new_zeros(num_experts)
    probability = weights.new_zeros(num_experts)
    total = weights.new_zeros(())
    for logits in router_logits:
        if logits.shape[0] != weights.shape[0]:
            raise ValueError(f"router logits of {logits.shape[0]} tokens for {weights.shape[0]} weighted slots")
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        assigned = assigned + torch.zeros_like(assigned).scatter_add_(
            0, chosen.reshape(-1), weights.to(probs.device).repeat_interleave(top_k))
        probability = probability + (probs * weights[:, None]).sum(0)
        total = total + weights.sum()
    return num_experts * torch.sum((assigned / total) * (probability / total))


class RouterLoad:
    """Records a model's router logits over one forward and turns them into :func:`load_balancing_loss`.

    ``with load.recording(): model(...)``, then :meth:`set_weights` with the packed rows' slot weights and
    :meth:`loss`. Raises ValueError on a model without routers."""

    def __init__(self, model: nn.Module):
        module = getattr(model, "module", model)
        self.routers = _router_modules(module)
        if not self.routers:
            raise ValueError(f"{type(module).__name__} has no router whose logits can be recorded (no "
                             "_can_record_outputs['router_logits']): it is not a mixture-of-experts model")
        self.num_experts, self.top_k = _expert_counts(module)
        self.logits: list[torch.Tensor] = []
        self.weights: torch.Tensor | None = None

    @contextmanager
    def recording(self):
        """Record every router's logits while the block runs (hooks removed after it, so a gradient-checkpointing
        recompute in the backward records nothing)."""
        self.logits = []

        def hook(index):
            def keep(_module, _args, output):
                self.logits.append(output[index] if isinstance(output, (tuple, list)) else output)
            return keep

        handles = [router.register_forward_hook(hook(index)) for router, index in self.routers]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def set_weights(self, weights: torch.Tensor) -> None:
        self.weights = weights

    def loss(self) -> torch.Tensor:
        if self.weights is None:
            raise ValueError("RouterLoad.loss: no slot weights; the forward did not set them")
        return load_balancing_loss(self.logits, self.weights, self.num_experts, self.top_k)
