"""Rollout routing replay (R3): the experts an engine chose for every token, replayed in the trainer's forward.

With identical weights an engine's routers and the trainer's disagree on a share of tokens: another batch layout
or kernel moves a near-tied router score by a rounding error, top-k picks another expert, and the token's log-prob
moves by far more than the rounding (another expert's output). R3 records each MoE layer's top-k expert indices as
the engine computes them and, in the trainer's forward, hands each router those indices in place of its own top-k.
The gate weights are still computed from the live router scores at the replayed indices (``scores.gather(-1,
indices)``), so the router keeps its gradient and trains.

Every router transformers 5 ships (Qwen3-MoE, Qwen3-Next, Mixtral, GPT-OSS, ...) selects its experts with one
``torch.topk`` over its scores (probabilities, or logits) inside the module its model's
``_can_record_outputs["router_logits"]`` names. Recording and replay intercept that one call, and only while that
module's forward runs (a torch-function mode entered by a wrapper of the router's ``forward``), so the rest of the
model pays nothing for it. Routes are keyed by the absolute index of the decoder layer holding the router
(``model.layers.7.mlp.gate``: 7), never by call order, so a gradient-checkpointing recompute of a layer in the
backward, which runs its router again, gets the same indices as the forward did.

Shapes: one forward's routes are an integer tensor ``[tokens, moe_layers, top_k]`` (int16 at rest:
:func:`route_bytes_per_token`), its tokens the forward's flattened ``[rows, T]`` positions in row-major order, the
order the routers see them, its layers in :func:`router_layers`' order. ``-1`` across a token's entries means no
record: that token keeps the live router's choice (a row's pad slots).
"""

from __future__ import annotations

import re
from contextlib import contextmanager

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from rlhf_sg.moe.router_loss import _expert_counts, _router_modules

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
#: the dtype routes are kept in between the engine and the trainer (expert counts stay below 32,768)
ROUTE_DTYPE = torch.int16


#: router classes whose first ``torch.topk`` is the choice of experts (read from transformers 5.19's modeling files;
#: each family tested in tests/test_routing_replay.py). Others are refused: DeepSeek-V3's first top-k picks expert
#: groups, Jamba's router is a bare linear layer
REPLAYABLE_ROUTERS = frozenset({"Qwen3MoeTopKRouter", "MixtralTopKRouter", "GptOssTopKRouter", "Qwen3NextTopKRouter"})


def replay_refusal(model: nn.Module) -> str | None:
    """Why routing replay cannot serve ``model``, or None."""
    module = getattr(model, "module", model)
    routers = _router_modules(module)
    if not routers:
        return (f"{type(module).__name__} has no router whose top-k can be recorded (no "
                "_can_record_outputs['router_logits']): routing replay needs a mixture-of-experts model")
    unknown = sorted({type(r).__name__ for r, _ in routers} - REPLAYABLE_ROUTERS)
    if unknown:
        return (f"{type(module).__name__}'s router {unknown[0]} is not one routing replay knows to pick its experts "
                f"with its first top-k (it serves {sorted(REPLAYABLE_ROUTERS)})")
    return None


def router_layers(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """(router module, absolute decoder-layer index) of every MoE layer of ``model``, by layer index.

    Raises ValueError for a model without routers, a router outside a ``layers.N.`` module path, or two routers in
    one layer (routes could not be keyed by layer)."""
    module = getattr(model, "module", model)
    refusal = replay_refusal(module)
    if refusal is not None:
        raise ValueError(refusal)
    routers = _router_modules(module)
    names = {id(sub): name for name, sub in module.named_modules()}
    found: dict[int, nn.Module] = {}
    for router, _ in routers:
        name = names[id(router)]
        match = _LAYER_INDEX.search(name)
        if match is None:
            raise ValueError(f"router {name!r} lies in no 'layers.N.' module: its routes cannot be keyed by layer")
        layer = int(match.group(1))
        if layer in found:
            raise ValueError(f"decoder layer {layer} holds two routers ({names[id(found[layer])]!r}, {name!r}): "
                             "routing replay keys one router per layer")
        found[layer] = router
    return [(found[layer], layer) for layer in sorted(found)]


def route_bytes_per_token(moe_layers: int, top_k: int) -> int:
    """Host bytes one token's routes take at rest (48 MoE layers x top-8: 768 B; 24 MiB a 32k-token sequence)."""
    return moe_layers * top_k * ROUTE_DTYPE.itemsize


class _FirstTopk(TorchFunctionMode):
    """Hands the first ``torch.topk`` call made while it is active to ``on_topk(scores, topk_result)``."""

    def __init__(self, on_topk):
        super().__init__()
        self.on_topk = on_topk
        self.seen = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in (torch.topk, torch.Tensor.topk) and not self.seen:
            self.seen = True
            dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
            if dim not in (-1, args[0].dim() - 1):
                raise ValueError(f"a router took its top-k over dim {dim}, not over its experts (the last dim)")
            return self.on_topk(args[0], result)
        return result


@contextmanager
def _intercepting_topk(layers: list[tuple[nn.Module, int]], on_topk):
    """While the block runs, each router's first ``torch.topk`` per forward goes to ``on_topk(layer, scores,
    result)``, whose return value the router receives instead."""
    def wrap(router: nn.Module, layer: int):
        original = router.forward

        def forward(*args, **kwargs):
            with _FirstTopk(lambda scores, result: on_topk(layer, scores, result)):
                return original(*args, **kwargs)
        return forward

    patched = []
    try:
        for router, layer in layers:
            patched.append((router, router.__dict__.get("forward")))
            router.forward = wrap(router, layer)
        yield
    finally:
        for router, own in patched:
            if own is None:
                del router.forward  # the class's forward again
            else:
                router.forward = own


class RouteRecorder:
    """Records the top-k expert indices every router of ``model`` chooses.

    ``with recorder.recording(): model(...)`` (any number of forwards: a prefill and decode steps), then
    :meth:`take` hands back each forward's routes ``[tokens, moe_layers, top_k]`` (:data:`ROUTE_DTYPE`) in order."""

    def __init__(self, model: nn.Module):
        self.layers = router_layers(model)
        self.num_experts, self.top_k = _expert_counts(getattr(model, "module", model))
        self._calls: dict[int, list[torch.Tensor]] = {}

    @contextmanager
    def recording(self):
        self._calls = {layer: [] for _, layer in self.layers}

        def keep(layer, scores, result):
            self._calls[layer].append(result.indices.detach().to(ROUTE_DTYPE))
            return result

        with _intercepting_topk(self.layers, keep):
            yield self

    def take(self) -> list[torch.Tensor]:
        """The routes of each forward recorded so far, ``[tokens, moe_layers, top_k]`` each; clears them."""
        counts = {layer: len(calls) for layer, calls in self._calls.items()}
        if len(set(counts.values())) > 1:
            raise ValueError(f"routers ran unequal numbers of times (calls per layer: {counts}); a forward that "
                             "skipped a MoE layer cannot be recorded")
        forwards = next(iter(counts.values()), 0)
        out = [torch.stack([self._calls[layer][i] for _, layer in self.layers], dim=1) for i in range(forwards)]
        self._calls = {layer: [] for layer in self._calls}
        return out


class RouteReplay:
    """Replays recorded routes in ``model``'s forward (and in its backward's recomputation).

    ``with replay.replaying(routes): loss = model(...); loss.backward()``: ``routes`` ``[tokens, moe_layers,
    top_k]`` for the one forward the block runs (see the module docstring). Where the routes are known only inside
    the code that lays out the forward's rows (:func:`rlhf_sg.packing.response_logprobs`), the scope and the routes
    come apart: ``with replay.active(): ...`` around the forward and its backward, and :meth:`arm` before the
    forward. Checked when armed: shape, expert range, duplicates within a token; and when the scope ends, that every
    MoE layer consumed its routes (as often as every other layer: once, or twice under gradient checkpointing)."""

    def __init__(self, model: nn.Module):
        self.layers = router_layers(model)
        self.num_experts, self.top_k = _expert_counts(getattr(model, "module", model))
        self.consumed: dict[int, int] = {}
        self.replaced_fraction: float | None = None  # of recorded (token, layer) routes the live router differed on
        self._routes: torch.Tensor | None = None
        self._active = False
        self._differed: list[torch.Tensor] = []  # per layer's first call: [routes that differ, routes recorded]

    def check(self, routes: torch.Tensor) -> None:
        """Raise ValueError naming what is wrong with ``routes`` for this model."""
        if routes.dim() != 3 or routes.shape[1] != len(self.layers) or routes.shape[2] != self.top_k:
            raise ValueError(f"routes of shape {tuple(routes.shape)}; this model needs [tokens, {len(self.layers)} "
                             f"MoE layers, top_k {self.top_k}]")
        if routes.dtype.is_floating_point or routes.dtype == torch.bool:
            raise ValueError(f"routes must be an integer tensor, got {routes.dtype}")
        missing = routes < 0
        partial = missing.any(dim=(1, 2)) & ~missing.all(dim=(1, 2))
        if partial.any():
            token = int(partial.nonzero()[0, 0])
            raise ValueError(f"token {token}: routes recorded for some layers or slots only (-1 elsewhere); a token "
                             "has routes in every MoE layer or none")
        bad = (routes >= self.num_experts) | (routes < -1)
        if bad.any():
            token, j, _ = (int(v) for v in bad.nonzero()[0])
            raise ValueError(f"token {token}, MoE layer {self.layers[j][1]}: expert {int(routes[token, j].max())} "
                             f"outside [0, {self.num_experts})")
        if self.top_k > 1:
            ordered = routes.sort(dim=-1).values
            dup = ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any(dim=-1)
            if dup.any():
                token, j = (int(v) for v in dup.nonzero()[0])
                raise ValueError(f"token {token}, MoE layer {self.layers[j][1]}: an expert chosen twice "
                                 f"({routes[token, j].tolist()})")

    def arm(self, routes: torch.Tensor) -> None:
        """The routes of the next forward in the :meth:`active` scope (checked now)."""
        if not self._active:
            raise RuntimeError("RouteReplay.arm outside its active() scope: the forward would route live")
        self.check(routes)
        self._routes = routes
        self.consumed = {layer: 0 for _, layer in self.layers}
        self._differed = []

    @contextmanager
    def active(self):
        """Routers take the armed routes while the block runs (the live choice while none are armed)."""
        position = {layer: j for j, (_, layer) in enumerate(self.layers)}
        self._routes = None
        self.consumed = {layer: 0 for _, layer in self.layers}

        def replace(layer, scores, result):
            routes = self._routes
            if routes is None:
                return result
            if scores.shape[0] != routes.shape[0]:
                raise ValueError(f"MoE layer {layer}: its router saw {scores.shape[0]} tokens, the routes hold "
                                 f"{routes.shape[0]} (routes follow the forward's flattened [rows, T] positions)")
            recorded = routes[:, position[layer]].to(device=result.indices.device, dtype=result.indices.dtype)
            has = recorded[:, :1] >= 0
            indices = torch.where(has, recorded, result.indices)
            if self.consumed[layer] == 0:  # counted on the device, read once at the scope's end (no sync here)
                live = result.indices.sort(dim=-1).values
                self._differed.append(torch.stack([
                    ((live != indices.sort(dim=-1).values).any(-1) & has[:, 0]).sum(), has.sum()]))
            self.consumed[layer] += 1
            # the gate weights from the live scores at the replayed experts: the router's gradient flows
            return torch.return_types.topk((scores.gather(-1, indices), indices))

        self._active = True
        try:
            with _intercepting_topk(self.layers, replace):
                yield self
        finally:
            self._active = False
        armed, self._routes = self._routes is not None, None
        if not armed:
            return
        unconsumed = [layer for layer, n in self.consumed.items() if n == 0]
        if unconsumed:
            raise ValueError(f"routing replay: the routes of MoE layer(s) {unconsumed} were never consumed (the "
                             "forward skipped those routers)")
        if len(set(self.consumed.values())) > 1:
            raise ValueError(f"routing replay: MoE layers consumed their routes unequally ({self.consumed})")
        differed, recorded = (int(v) for v in torch.stack(self._differed).sum(0).tolist())
        self.replaced_fraction = differed / recorded if recorded else 0.0

    @contextmanager
    def replaying(self, routes: torch.Tensor):
        """:meth:`active` with ``routes`` armed for the block's forward."""
        with self.active():
            self.arm(routes)
            yield self
