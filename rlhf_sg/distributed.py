"""Process groups and DeepSpeed ZeRO-3 set-up shared by the model workers and the weight sync.

Two kinds of group live side by side in a trainer process:

* the default group of the trainer's ranks (:func:`init_torch_distributed`), over which DeepSpeed
  partitions and gathers ZeRO-3 parameters;
* side groups between one trainer rank and the rollout engines (:func:`create_group_store` +
  :func:`open_side_group`), built straight on a ``TCPStore`` so they never touch the default group
  and an engine never has to join the trainer's world.

On CPU, DeepSpeed picks its accelerator when it is first imported, so ``DS_ACCELERATOR=cpu`` must be
in the environment before that import (for Ray actors: in the actor's ``runtime_env`` env_vars).

DeepSpeed compiles its ops (on CPU its communication op, ``deepspeed_shm_comm``) with torch's JIT extension build,
cached under one directory per Python version and device kind. The build's command names the sources by their path
inside the interpreter's environment, so two environments (this project's SGLang and vLLM engines each take a venv
of their own) sharing that directory rebuild the op every time a process of the other one starts it: a compile of
30 s or more on CPU, and a wait on the build's lock for every rank meanwhile. :func:`pin_torch_extensions_dir`
gives each environment a directory of its own unless ``TORCH_EXTENSIONS_DIR`` is set.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from rlhf_sg.placement import free_port

__all__ = [
    "RendezvousPortTaken",
    "create_group_store",
    "free_port",
    "init_torch_distributed",
    "open_side_group",
    "pin_torch_extensions_dir",
    "side_broadcast",
    "zero3_config",
]

_BACKENDS = ("gloo", "nccl")


def pin_torch_extensions_dir() -> str:
    """The directory torch's JIT extension builds use in this process: ``TORCH_EXTENSIONS_DIR`` when it is set
    (kept as given), else one of this Python environment's own under torch's default root, which is then put in
    ``TORCH_EXTENSIONS_DIR`` (children and Ray workers started from here inherit it). Called before DeepSpeed
    builds or loads an op; see the module's docstring for why one directory per environment."""
    given = os.environ.get("TORCH_EXTENSIONS_DIR")
    if given:
        return given
    from torch.utils.cpp_extension import get_default_build_root

    kind = "cpu" if torch.version.cuda is None and torch.version.hip is None else "gpu"
    env = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:12]
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    path = os.path.join(get_default_build_root(), f"{python}_{kind}-env-{env}")
    os.environ["TORCH_EXTENSIONS_DIR"] = path
    return path


class RendezvousPortTaken(TimeoutError):
    """Rank 0 could not listen on the group's rendezvous port: another process bound it after it was picked free
    (the pick and the bind are seconds apart, and other jobs on the node bind ports meanwhile). A group that picked
    its own port starts again on another (:class:`rlhf_sg.workers.ModelGroup`)."""


def init_torch_distributed(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    local_rank: int | None = None,
) -> None:
    """Join the trainer's default process group (and DeepSpeed's view of it) as ``rank``.

    Sets MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE / LOCAL_RANK for DeepSpeed, and
    ``DS_ACCELERATOR=cpu`` for ``backend="gloo"`` when DeepSpeed is not imported yet. Every
    collective on the group then fails after ``timeout_s`` instead of hanging. ``LOCAL_RANK`` is
    ``local_rank``, else this process's device index from :mod:`rlhf_sg.placement` (0 inside a one-GPU
    Ray actor); never the global rank, which DeepSpeed would take for a CUDA index.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"init_torch_distributed: backend must be one of {_BACKENDS}, got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"init_torch_distributed: rank {rank} outside world_size {world_size}")
    if timeout_s <= 0:
        raise ValueError(f"init_torch_distributed: timeout_s must be > 0, got {timeout_s}")
    if backend == "gloo" and os.environ.get("DS_ACCELERATOR") != "cpu":
        if "deepspeed" in sys.modules:
            raise RuntimeError(
                "init_torch_distributed(backend='gloo'): deepspeed was imported before DS_ACCELERATOR=cpu "
                "was set, so it chose another accelerator; put DS_ACCELERATOR=cpu in the process environment "
                "(for Ray actors: runtime_env={'env_vars': {'DS_ACCELERATOR': 'cpu'}})"
            )
        os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank), WORLD_SIZE=str(world_size))
    if local_rank is None:
        from rlhf_sg.placement import this_rank

        local_rank = this_rank().local_rank
    os.environ["LOCAL_RANK"] = str(local_rank)
    pin_torch_extensions_dir()
    import deepspeed

    where = f"rank {rank} of {world_size} at {master_addr}:{master_port} ({backend})"
    try:
        deepspeed.init_distributed(
            dist_backend=backend,
            auto_mpi_discovery=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            verbose=False,
        )
    except Exception as exc:  # the rendezvous reports a missing peer as several exception types
        # the store's listen on a port in use: torch's libuv store names EADDRINUSE, its older one the errno's text
        if "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower():
            raise RendezvousPortTaken(
                f"init_torch_distributed: {where}: port {master_port} is in use on {master_addr} (another process "
                f"bound it after it was picked free): {type(exc).__name__}: {exc}. A group that picked its own port "
                "starts again on another; a port you gave must be free on rank 0's node"
            ) from exc
        raise TimeoutError(
            f"init_torch_distributed: {where} could not form the default group within {timeout_s} s: "
            f"{type(exc).__name__}: {exc}. Are all {world_size} ranks started with the same master address?"
        ) from exc


def zero3_config(
    dtype: str = "float32",
    offload: bool = False,
    train: bool = True,
    max_grad_norm: float = 1.0,
    param_persistence_threshold: int | None = None,
    device: str = "cpu",
    stage: int = 3,
) -> dict[str, Any]:
    """A DeepSpeed ZeRO stage-3 config dict for one model (``stage=0``: no partitioning, for a group of one rank).

    ``dtype``: "float32" or "bfloat16". ``offload``: parameters (and, when ``train``, optimizer states)
    live in CPU memory between uses (a GPU memory saver; meaningless on the CPU accelerator).
    ``param_persistence_threshold``: parameters with fewer elements stay whole on every rank (None: 0 on
    CPU, where the tests must see every parameter partitioned; DeepSpeed's 1e5 on CUDA, where gathering
    every norm and bias per forward costs many tiny all-gathers). ``device``: "cuda" also overlaps the
    gradient reduction with the backward (``overlap_comm``), which only pays on a device with streams.
    The optimizer is the caller's (a torch optimizer passed to ``deepspeed.initialize``).

    ``stage=0`` (a group of one rank, where partitioning buys nothing and costs its gathers and hooks): whole
    parameters. With float32, DeepSpeed's plain engine and a plain torch optimizer that clips and skips a
    non-finite step itself as ZeRO-3 does (:class:`rlhf_sg.workers.NonFiniteSkip`), so DeepSpeed's own clipping is
    off. With bfloat16, ZeRO stage 1 at world size 1 (one rank partitions nothing): DeepSpeed's ZeRO optimizer keeps
    the float32 master weights as ZeRO-3 does, clips, skips a non-finite step (``check_grad_overflow``) and can move
    its states off the device (colocated offload).
    """
    if stage not in (0, 3):
        raise ValueError(f"zero3_config: stage must be 0 or 3, got {stage!r}")
    if stage == 0 and offload:
        raise ValueError("zero3_config: parameter offload needs ZeRO-3 partitioning (stage=3)")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"zero3_config: dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"zero3_config: device must be 'cpu' or 'cuda', got {device!r}")
    cuda = device == "cuda"
    if param_persistence_threshold is None:
        param_persistence_threshold = 100_000 if cuda else 0
    unpartitioned = {"stage": 1 if dtype == "bfloat16" and train else 0}
    zero: dict[str, Any] = unpartitioned if stage == 0 else {
        "stage": 3,
        "stage3_param_persistence_threshold": int(param_persistence_threshold),
        "contiguous_gradients": True,
        "overlap_comm": cuda,
    }
    if offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        if train:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == "bfloat16",
                 **({"check_grad_overflow": True} if stage == 0 and dtype == "bfloat16" else {})},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if train:
        config["gradient_clipping"] = 0.0 if stage == 0 and dtype == "float32" else float(max_grad_norm)
        # The optimizer is a plain torch one; DeepSpeed wraps it in its ZeRO-3 partitioned optimizer.
        config["zero_allow_untested_optimizer"] = True
    return config


def create_group_store(host: str, timeout_s: float) -> dist.TCPStore:
    """The TCP store a side group's rank 0 hosts, on a port the OS picks (``store.port``).

    Binding port 0 leaves no window in which another process can take the port between choosing
    and binding it. Returns at once; peers connect when they join the group.
    """
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s))


def open_side_group(
    store: dist.Store, rank: int, world_size: int, backend: str, timeout_s: float, group_name: str
) -> dist.ProcessGroup:
    """Build one side group on ``store`` (no key prefix: the store belongs to this group alone).

    Blocks until all ``world_size`` ranks have joined, at most ``timeout_s``; every later collective
    on the group also fails after ``timeout_s``. Returns a ``ProcessGroupGloo`` / ``ProcessGroupNCCL``.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"side group {group_name!r}: backend must be one of {_BACKENDS}, got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if backend == "gloo":
            return dist.ProcessGroupGloo(store, rank, world_size, timeout)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    except Exception as exc:  # store waits and rendezvous failures come as several exception types
        raise TimeoutError(
            f"side group {group_name!r} ({backend}, world_size {world_size}): rank {rank} could not form the "
            f"group within timeout_s={timeout_s}: {type(exc).__name__}: {exc}"
        ) from exc


def side_broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int, timeout_s: float) -> dist.Work:
    """Start a broadcast of ``tensor`` from group rank ``src``; returns the work handle (async)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    opts.timeout = datetime.timedelta(seconds=timeout_s)
    return group.broadcast([tensor], opts)
