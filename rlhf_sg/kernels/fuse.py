"""Swap a model's RMSNorms, gated-MLP products and rotary embeddings for the fused ops of
:mod:`rlhf_sg.kernels.ops`, module by module.

A module is swapped only when its class's ``forward`` is, statement for statement, one of the forms below (its
source parsed and compared, argument names aside). A transformers release that changes a forward, or a family
with its own norm, then runs as it is instead of running a fused op that computes something else. The forms are
the transformers code the ops stand in for.

The swap sets the module's instance ``forward``, so the module keeps its parameters, hooks (ZeRO-3's gathers,
LoRA's adapters on the projections) and state dict. :func:`unfuse_kernels` removes it again.

The rotary embedding is a function of the model's module (``apply_rotary_pos_emb``), called by name from the
attention's forward. An attention module of a family whose function and ``rotate_half`` are the forms gets a
forward that points that name at the fused op while the module's own forward runs, and back after: other models
of the family in the process keep their own.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
import types
from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

from rlhf_sg.kernels import ops

#: set on a swapped module: the name of the op it runs
FUSED_ATTR = "_rlhf_sg_fused"


# ---- the forms (transformers' code, the ops' specification) -----------------------------------------------


class _CastThenScale:
    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class _ScaleThenCast:
    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight * hidden_states).to(input_dtype)


class _Offset:
    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class _GatedMLP:
    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


def _rotate_half_form(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _apply_rotary_form(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)  # noqa: F821 -- the model module's, checked as _rotate_half_form
    k_embed = (k * cos) + (rotate_half(k) * sin)  # noqa: F821
    return q_embed, k_embed


#: the model-module functions the rotary swap checks: name -> form
_ROTARY_FUNCTIONS = {"apply_rotary_pos_emb": _apply_rotary_form, "rotate_half": _rotate_half_form}


def _norm_forward(op: Callable, eps_attr: str):
    def forward(self, hidden_states):
        return op(hidden_states, self.weight, getattr(self, eps_attr))
    return forward


def _mlp_forward(op: Callable):
    def forward(self, x):
        return self.down_proj(op(self.gate_proj(x), self.up_proj(x)))
    return forward


#: (form class, the methods that must match, the op, the attribute holding the norm's epsilon)
_NORMS = (
    (_CastThenScale, ("forward",), ops.rms_norm_cast_then_scale, "variance_epsilon"),
    (_ScaleThenCast, ("forward",), ops.rms_norm_scale_then_cast, "variance_epsilon"),
    (_Offset, ("forward", "_norm"), ops.rms_norm_offset, "eps"),
)


# ---- matching ----------------------------------------------------------------------------------------------


class _Rename(ast.NodeTransformer):
    def __init__(self, old: str):
        self.old = old

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.Name(id="x", ctx=node.ctx) if node.id == self.old else node


@functools.cache
def _parsed(fn: Callable) -> tuple[ast.FunctionDef, list[ast.stmt]] | None:
    """``fn``'s definition and its body without the docstring; None when its source cannot be read."""
    try:
        node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    except (OSError, TypeError, SyntaxError):
        return None
    if not isinstance(node, ast.FunctionDef):
        return None
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]
    return node, body


@functools.cache
def _shape_of(fn: Callable) -> str | None:
    """A method's body as an AST dump (comments and annotations dropped), its argument after ``self`` named ``x``;
    None for any other signature or unreadable source."""
    parsed = _parsed(fn)
    if parsed is None:
        return None
    node, body = parsed
    if len(node.args.args) != 2 or node.args.vararg or node.args.kwarg:
        return None
    rename = _Rename(node.args.args[1].arg)
    return "\n".join(ast.dump(rename.visit(stmt), annotate_fields=False) for stmt in body)


@functools.cache
def _function_shape(fn: Callable) -> str | None:
    """A module-level function's arguments (names and defaults) and body as an AST dump; None when its source
    cannot be read."""
    parsed = _parsed(fn)
    if parsed is None:
        return None
    node, body = parsed
    args = ast.dump(ast.arguments(posonlyargs=[], args=[ast.arg(a.arg) for a in node.args.args], kwonlyargs=[],
                                  kw_defaults=[], defaults=node.args.defaults))
    return args + "\n" + "\n".join(ast.dump(stmt, annotate_fields=False) for stmt in body)


def _calls(fn: Callable, name: str) -> bool:
    """Whether ``fn``'s source calls ``name`` by its bare name (a global of its module)."""
    parsed = _parsed(fn)
    return parsed is not None and any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name
                                      for n in ast.walk(parsed[0]))


def _rotary_namespace(cls: type) -> dict | None:
    """The globals of ``cls``'s module when its forward calls ``apply_rotary_pos_emb`` and that module's
    ``apply_rotary_pos_emb`` and ``rotate_half`` are the forms; else None."""
    namespace = getattr(sys.modules.get(cls.__module__), "__dict__", None)
    if namespace is None or not _calls(cls.forward, "apply_rotary_pos_emb"):
        return None
    for name, form in _ROTARY_FUNCTIONS.items():
        fn = namespace.get(name)
        if not callable(fn) or _function_shape(fn) is None or _function_shape(fn) != _function_shape(form):
            return None
    return namespace


def _rotary_forward(namespace: dict, own: Callable):
    def forward(self, *args, **kwargs):
        saved = namespace["apply_rotary_pos_emb"]
        namespace["apply_rotary_pos_emb"] = ops.rotary
        try:
            return own(self, *args, **kwargs)
        finally:
            namespace["apply_rotary_pos_emb"] = saved
    return forward


def _matches(cls: type, form: type, methods: tuple[str, ...]) -> bool:
    for name in methods:
        mine, theirs = getattr(cls, name, None), getattr(form, name)
        if mine is None or _shape_of(mine) is None or _shape_of(mine) != _shape_of(theirs):
            return False
    return True


def _activation_op(act: nn.Module) -> Callable | None:
    """The fused product for a gated MLP's activation module: SiLU, or GELU's tanh approximation computed by
    ``F.gelu`` (transformers' ``GELUTanh`` unless built with its Python formula, which rounds differently)."""
    from transformers import activations

    if type(act) in (nn.SiLU, activations.SiLUActivation):
        return ops.silu_mul
    fn = getattr(act, "act", None)
    if (type(act).__name__ == "GELUTanh" and isinstance(fn, functools.partial)
            and fn.func is torch.nn.functional.gelu and fn.keywords == {"approximate": "tanh"}):
        return ops.gelu_tanh_mul
    return None


def _fused_forward(module: nn.Module) -> tuple[str, Callable] | None:
    """The op name and forward that stand in for ``module``'s, None when its forward is none of the forms."""
    cls = type(module)
    if "RMSNorm" in cls.__name__ and isinstance(getattr(module, "weight", None), torch.Tensor):
        for form, methods, op, eps_attr in _NORMS:
            if _matches(cls, form, methods):
                return op.__name__, _norm_forward(op, eps_attr)
        return None
    if all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")) \
            and _matches(cls, _GatedMLP, ("forward",)):
        op = _activation_op(module.act_fn)
        if op is not None:
            return op.__name__, _mlp_forward(op)
        return None
    if cls.__name__.endswith("Attention"):
        namespace = _rotary_namespace(cls)
        if namespace is not None:
            return ops.rotary.__name__, _rotary_forward(namespace, cls.forward)
    return None


def fuse_kernels(model: nn.Module) -> dict[str, str]:
    """Swap each module of ``model`` whose forward is one of the forms for its fused op.

    Returns ``{class name: op name}`` of what was swapped (empty: nothing in the model has a fused form, and it
    runs as it is). Idempotent."""
    swapped: dict[str, str] = {}
    for module in model.modules():
        if getattr(module, FUSED_ATTR, None):
            swapped[type(module).__name__] = getattr(module, FUSED_ATTR)
            continue
        fused = _fused_forward(module)
        if fused is None:
            continue
        name, forward = fused
        module.forward = types.MethodType(forward, module)
        setattr(module, FUSED_ATTR, name)
        swapped[type(module).__name__] = name
    return swapped


def unfuse_kernels(model: nn.Module) -> int:
    """Give every swapped module of ``model`` its own forward back; returns how many were swapped."""
    count = 0
    for module in model.modules():
        if getattr(module, FUSED_ATTR, None):
            del module.forward
            delattr(module, FUSED_ATTR)
            count += 1
    return count


def fused_counts(model: nn.Module) -> Counter:
    """``{op name: modules running it}`` of ``model``."""
    return Counter(getattr(m, FUSED_ATTR) for m in model.modules() if getattr(m, FUSED_ATTR, None))


def describe(swapped: dict[str, str]) -> str:
    """One line for a log: what runs fused, or that nothing does."""
    if not swapped:
        return "fused kernels: no module of this model has a fused form; it runs as it is"
    return "fused kernels: " + ", ".join(f"{cls} -> {op}" for cls, op in sorted(swapped.items()))
