"""A trained model's DeepSpeed checkpoint converted between ZeRO-3 and an unpartitioned rank.

A group of one rank runs ZeRO-3 (``--train.single_rank_zero3 true``) or unpartitioned (``false``, the default: in
float32 DeepSpeed's stage 0 around a plain torch AdamW; in bfloat16 ZeRO stage 1, which at one rank partitions
nothing and keeps float32 master weights). They write different checkpoints:

* ZeRO-3: ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` per rank (the run's state and ``param_shapes``; the
  weights in it are empty partitions) and ``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` (flat float32
  master weights and Adam moments of the rank's partition);
* unpartitioned float32 (stage 0): ``mp_rank_00_model_states.pt``, the whole module and the optimizer's state dict,
  whose entries are numbered in the optimizer's parameter order (the trained parameters in ``named_parameters``
  order);
* unpartitioned bfloat16 (stage 1): ``mp_rank_00_model_states.pt`` with the whole bfloat16 module, and
  ``bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt`` with the flat float32 masters and moments.

The way between them is DeepSpeed's universal checkpoint: a folder per parameter holding its whole float32 weight
and Adam moments. DeepSpeed's ``ds_to_universal`` writes one from a ZeRO checkpoint of any stage (:func:`read_zero`),
and ZeRO engines of stage 1 and 3 load one (``checkpoint.load_universal``: :func:`write_universal`,
:func:`write_universal_stage1`). DeepSpeed's universal loading does not cover a plain torch optimizer, so a stage-0
checkpoint is read and written here (:func:`read_plain`, :func:`write_plain`). The conversion is written beside the
user's checkpoint (:func:`convert_checkpoint`), which it leaves as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

ZERO3, PLAIN = "zero3", "plain"
PLAIN_FILE = "mp_rank_00_model_states.pt"
#: the model-states file a ZeRO-3 engine of one rank reads (universal or not)
ZERO3_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"
_ZERO3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")
#: a ZeRO optimizer's states file (any stage; ``bf16_`` in bfloat16)
_ZERO_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
#: what marks a universal checkpoint (loaded with ``checkpoint.load_universal``)
UNIVERSAL_STATE = os.path.join("zero", "optimizer_state.pt")
#: model-states entries that describe ZeRO-3 partitions; an unpartitioned engine saves them as None
_ZERO3_ENTRIES = ("param_shapes", "frozen_param_shapes", "shared_params", "frozen_param_fragments")
MOMENTS = ("exp_avg", "exp_avg_sq")


def partitioning_of(directory: str) -> str | None:
    """:data:`ZERO3` or :data:`PLAIN` for a checkpoint directory (``<path>/<tag>``), None if it holds neither."""
    if not os.path.isdir(directory):
        return None
    files = os.listdir(directory)
    if PLAIN_FILE in files:
        return PLAIN
    if any(_ZERO3_MODEL.match(f) for f in files):
        return ZERO3
    return None


def zero3_world_size(directory: str) -> int:
    """How many ranks wrote a ZeRO-3 checkpoint (its model-states files)."""
    return sum(1 for f in os.listdir(directory) if _ZERO3_MODEL.match(f))


@dataclass
class WholeState:
    """A trained model's checkpoint with nothing partitioned."""

    #: trained parameter name -> its whole float32 weight
    weights: dict[str, torch.Tensor]
    #: trained parameter name -> {"exp_avg", "exp_avg_sq"}, each the weight's shape
    moments: dict[str, dict[str, torch.Tensor]]
    #: Adam's step count (the same for every parameter), as the optimizer keeps it
    step: Any
    #: the optimizer's hyperparameters (lr, betas, eps, weight_decay, initial_lr, ...), without its params
    param_group: dict[str, Any]
    #: the model-states file's other entries: LR scheduler, global / skipped steps, the client state (RNG)
    run_state: dict[str, Any]
    #: module entries that are not trained parameters: buffers, and weights shared under a second name
    module_extra: dict[str, torch.Tensor]
    #: a second name of a shared weight -> the trained parameter's name
    aliases: dict[str, str]

    def check_fits(self, shapes: dict[str, torch.Size], where: str) -> None:
        """Raise ValueError unless the trained parameters are those of ``shapes`` (name -> shape), shape for shape."""
        missing = [n for n in shapes if n not in self.weights]
        extra = [n for n in self.weights if n not in shapes]
        if missing or extra:
            raise ValueError(f"{where}: the checkpoint's trained parameters differ from this model's (missing "
                             f"{missing[:3]}, not in the model {extra[:3]}); was it written for another model?")
        for name, shape in shapes.items():
            if tuple(self.weights[name].shape) != tuple(shape):
                raise ValueError(f"{where}: {name} has shape {tuple(self.weights[name].shape)} in the checkpoint "
                                 f"and {tuple(shape)} in this model")


def read_zero(directory: str, scratch: str) -> WholeState:
    """A ZeRO checkpoint of one rank whole, ZeRO-3 or stage 1/2 (a bfloat16 unpartitioned rank): DeepSpeed's
    ``ds_to_universal`` merges it into ``scratch`` (which it needs empty), the weights and moments are read back in
    the shapes of the checkpoint's ``param_shapes``, the rest from the model-states file. The step is the
    optimizer's (ZeRO-3) or each parameter's ``step.pt`` (stage 1/2, which must all agree)."""
    from deepspeed.checkpoint import ds_to_universal

    universal = os.path.join(scratch, "universal")
    # inject_missing_state: stage 1/2 checkpoints hold no universal_checkpoint_info unless the client adds it (it is
    # read from the in-memory copy; the checkpoint is not written)
    args = argparse.Namespace(input_folder=directory, output_folder=universal, num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()):  # its progress lines
        ds_to_universal.main(args)
    model_file = ZERO3_FILE if os.path.isfile(os.path.join(directory, ZERO3_FILE)) else PLAIN_FILE
    run_state = torch.load(os.path.join(directory, model_file), map_location="cpu", weights_only=False)
    optim = torch.load(os.path.join(universal, UNIVERSAL_STATE), map_location="cpu", weights_only=False)
    shapes = {name: shape for group in run_state["param_shapes"] for name, shape in group.items()}
    weights, moments, steps = {}, {}, []
    for name, shape in shapes.items():
        folder = os.path.join(universal, "zero", name)
        weights[name] = _load_flat(os.path.join(folder, "fp32.pt")).view(shape)
        moments[name] = {k: _load_flat(os.path.join(folder, f"{k}.pt")).view(shape) for k in MOMENTS}
        if os.path.isfile(os.path.join(folder, "step.pt")):
            steps.append(torch.load(os.path.join(folder, "step.pt"), map_location="cpu", weights_only=False))
    if "optimizer_state_dict" in optim:  # ZeRO-3
        step, groups = optim["optimizer_state_dict"]["state"][0]["step"], optim["optimizer_state_dict"]["param_groups"]
    else:
        if len(steps) != len(shapes) or any(float(s) != float(steps[0]) for s in steps):
            raise ValueError(f"{directory}: the optimizer's parameters are at different steps, or some have none")
        step, groups = steps[0], optim["param_groups"]
    module = run_state.pop("module") or {}
    extra = {name: module[name] for name in run_state.get("buffer_names") or [] if name in module}
    aliases = dict(run_state.get("shared_params") or {})
    return WholeState(weights=weights, moments=moments, step=step, param_group=_hyperparameters(groups),
                      run_state=_without_optimizer(run_state), module_extra=extra, aliases=aliases)


def _load_flat(path: str) -> torch.Tensor:
    """A universal checkpoint's tensor file (a tensor, or a dict holding it as ``param``), flat, float32."""
    saved = torch.load(path, map_location="cpu", weights_only=False)
    tensor = saved["param"] if isinstance(saved, dict) else saved
    return tensor.detach().reshape(-1).float()


def _hyperparameters(param_groups: list[dict]) -> dict[str, Any]:
    if len(param_groups) != 1:
        raise ValueError(f"the checkpoint's optimizer has {len(param_groups)} parameter groups; one is converted")
    return {k: v for k, v in param_groups[0].items() if k != "params"}


def _without_optimizer(run_state: dict[str, Any]) -> dict[str, Any]:
    state = {k: v for k, v in run_state.items() if k not in ("module", "optimizer")}
    state.update({k: None for k in _ZERO3_ENTRIES})
    state["dp_world_size"] = 1
    return state


def read_plain(directory: str, names: list[str]) -> WholeState:
    """An unpartitioned rank's checkpoint whole. ``names``: the trained parameters in the optimizer's order (the
    engine's ``named_parameters`` that require grad), which numbers the optimizer state's entries. A parameter
    without optimizer state (no gradient yet) gets zero moments."""
    run_state = torch.load(os.path.join(directory, PLAIN_FILE), map_location="cpu", weights_only=False)
    module, optimizer = run_state["module"], run_state["optimizer"]
    group = _hyperparameters(optimizer["param_groups"])
    if len(optimizer["param_groups"][0]["params"]) != len(names):
        raise ValueError(f"{directory}: the optimizer holds {len(optimizer['param_groups'][0]['params'])} parameters "
                         f"and the model trains {len(names)}")
    missing = [n for n in names if n not in module]
    if missing:
        raise ValueError(f"{directory}: the module state lacks trained parameters {missing[:3]}")
    weights, moments, steps = {}, {}, []
    for index, name in zip(optimizer["param_groups"][0]["params"], names):
        weights[name] = module[name].detach().float()
        entry = optimizer["state"].get(index, {})
        for k in MOMENTS:
            if k in entry and tuple(entry[k].shape) != tuple(weights[name].shape):
                raise ValueError(f"{directory}: optimizer entry {index} ({k} {tuple(entry[k].shape)}) does not fit "
                                 f"{name} {tuple(weights[name].shape)}: the parameter order differs")
        moments[name] = {k: entry[k].detach().float() if k in entry else torch.zeros_like(weights[name])
                         for k in MOMENTS}
        if "step" in entry:
            steps.append(entry["step"])
    step = steps[0] if steps else torch.tensor(0.0)
    if any(float(s) != float(step) for s in steps):
        raise ValueError(f"{directory}: the optimizer's parameters are at different steps")
    extra = {k: v for k, v in module.items() if k not in weights}
    return WholeState(weights=weights, moments=moments, step=step, param_group=group,
                      run_state=_without_optimizer(run_state), module_extra=extra, aliases={})


def write_plain(state: WholeState, directory: str, names: list[str]) -> None:
    """``state`` as an unpartitioned float32 rank's checkpoint in ``directory``: the module (trained weights, shared
    names, buffers) and the optimizer's state dict numbered in the order of ``names``."""
    module = _whole_module(state, names, torch.float32)
    step = state.step
    optimizer = {
        "state": {i: {"step": step.clone() if torch.is_tensor(step) else step,
                      **{k: state.moments[name][k].clone() for k in MOMENTS}} for i, name in enumerate(names)},
        "param_groups": [dict(state.param_group, params=list(range(len(names))))],
    }
    os.makedirs(directory, exist_ok=True)
    torch.save(dict(state.run_state, module=module, optimizer=optimizer), os.path.join(directory, PLAIN_FILE))


def write_universal(state: WholeState, directory: str) -> None:
    """``state`` as a universal checkpoint in ``directory`` that a ZeRO-3 engine of one rank loads: ``zero/<name>/``
    with the float32 weight and moments of each trained parameter, ``zero/optimizer_state.pt`` with the step and
    hyperparameters, and the run's state in the ZeRO-3 model-states file."""
    zero = os.path.join(directory, "zero")
    _write_parameter_folders(state, zero)
    group = dict(state.param_group, params=[0])
    torch.save({"optimizer_state_dict": {"state": {0: {"step": state.step}}, "param_groups": [group]},
                "param_groups": [group]}, os.path.join(zero, "optimizer_state.pt"))
    torch.save(dict(state.run_state, module=None, optimizer=None), os.path.join(directory, ZERO3_FILE))


def write_universal_stage1(state: WholeState, directory: str, dtype: torch.dtype) -> None:
    """``state`` as a universal checkpoint in ``directory`` that an unpartitioned bfloat16 rank (ZeRO stage 1 at
    one rank) loads: ``zero/<name>/`` with the float32 weight, moments and step of each trained parameter,
    ``zero/optimizer_state.pt`` with the hyperparameters and the DeepSpeed version its loader requires, and the
    module (trained weights in ``dtype``, shared names, buffers) with the run's state in ``mp_rank_00``'s file.
    DeepSpeed then sets the module's weights from the float32 masters (``update_lp_params``)."""
    import deepspeed

    zero = os.path.join(directory, "zero")
    _write_parameter_folders(state, zero, with_step=True)
    torch.save({"param_groups": [dict(state.param_group, params=[0])], "ds_version": deepspeed.__version__},
               os.path.join(zero, "optimizer_state.pt"))
    module = _whole_module(state, list(state.weights), dtype)
    torch.save(dict(state.run_state, module=module, optimizer=None), os.path.join(directory, PLAIN_FILE))


def _write_parameter_folders(state: WholeState, zero: str, with_step: bool = False) -> None:
    """A universal checkpoint's ``zero/<name>/`` folders: each trained parameter's float32 weight and Adam moments,
    and with ``with_step`` its step (what stage 1/2 read per parameter; ZeRO-3 reads the optimizer's)."""
    step = state.step if torch.is_tensor(state.step) else torch.tensor(float(state.step))
    for name, weight in state.weights.items():
        folder = os.path.join(zero, name)
        os.makedirs(folder, exist_ok=True)
        torch.save({"param": weight.float()}, os.path.join(folder, "fp32.pt"))
        for k in MOMENTS:
            torch.save({"param": state.moments[name][k].float()}, os.path.join(folder, f"{k}.pt"))
        if with_step:
            torch.save(step.clone(), os.path.join(folder, "step.pt"))


def _whole_module(state: WholeState, names: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The module state of an unpartitioned rank: the trained weights ``names`` in ``dtype``, the shared names of
    those weights, and the buffers."""
    module = {name: state.weights[name].to(dtype, copy=True) for name in names}
    module.update({alias: module[name] for alias, name in state.aliases.items() if name in module})
    module.update(state.module_extra)
    return module


def is_universal(directory: str) -> bool:
    """Whether ``directory`` is a universal checkpoint (loaded with ``checkpoint.load_universal``)."""
    return os.path.isfile(os.path.join(directory, UNIVERSAL_STATE))


def convert_checkpoint(path: str, tag: str, to: str, shapes: dict[str, torch.Size], dtype: str = "float32") -> str:
    """Convert the checkpoint ``path/tag`` for a ``dtype`` engine of the other partitioning and return the tag of
    the conversion in ``path``, named by the DeepSpeed stage it is for: ``<tag>.converted-zero3`` (``to=ZERO3``),
    ``-zero0`` (``to=PLAIN`` in float32) or ``-zero1`` (``to=PLAIN`` in bfloat16). The ZeRO-3 and stage-1 ones are
    universal checkpoints (:func:`is_universal`). ``shapes``: the target engine's trained parameters in its
    optimizer's order, name -> whole shape. Written in a scratch directory in ``path`` and renamed into place (a
    conversion there before is replaced); ``path/tag`` is only read."""
    if to not in (ZERO3, PLAIN):
        raise ValueError(f"convert_checkpoint: to must be {ZERO3!r} or {PLAIN!r}, got {to!r}")
    source = os.path.join(path, tag)
    stage = "zero3" if to == ZERO3 else ("zero0" if dtype == "float32" else "zero1")
    converted = f"{tag}.converted-{stage}"
    scratch = tempfile.mkdtemp(prefix=f".{converted}.", dir=path)
    try:
        zero_format = any(_ZERO_OPTIM.match(f) for f in os.listdir(source))
        state = read_zero(source, scratch) if zero_format else read_plain(source, list(shapes))
        state.check_fits(shapes, source)
        out = os.path.join(scratch, "out")
        if to == ZERO3:
            write_universal(state, out)
        elif dtype == "float32":
            write_plain(state, out, list(shapes))
        else:
            write_universal_stage1(state, out, getattr(torch, dtype))
        target = os.path.join(path, converted)
        if os.path.isdir(target):
            shutil.rmtree(target)
        os.replace(out, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return converted


def conversion_refused(directory: str, written: str, role: str, world_size: int = 1) -> str | None:
    """Why the checkpoint ``directory``, written under ``written`` partitioning, is not converted for a group of
    ``world_size`` ``role`` ranks under the other one (a message naming the flag to resume it with), or None when it
    is: a checkpoint of one rank for one rank."""
    resume = ("--train.single_rank_zero3 true" if written == ZERO3
              else "--train.single_rank_zero3 false and one rank")
    what = (f"{role}: the checkpoint {directory} was written " + ("under ZeRO-3" if written == ZERO3 else
            "by an unpartitioned rank") + f" and this {role} group runs " + ("unpartitioned" if written == ZERO3
                                                                           else "ZeRO-3"))
    ranks = zero3_world_size(directory) if written == ZERO3 else 1
    if ranks != 1:
        return (f"{what}; a ZeRO-3 checkpoint of {ranks} ranks (world size {ranks}) is not converted for one "
                f"rank: resume it with {resume} and --train.{role}_num_ranks {ranks}")
    if world_size != 1:
        return (f"{what} over {world_size} ranks; a checkpoint of one rank is converted for one rank only: resume "
                f"it with {resume}")
    return None
