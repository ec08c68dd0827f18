"""One real ZeRO-3 actor rank in a process of its own, for worker-level tests.

DeepSpeed keeps process-wide group state (a second rank in one process after ``destroy_process_group`` finds its
groups unregistered), so each test runs its rank through :func:`in_fresh_process`.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from rlhf_sg.algorithms import ActorLossConfig
from rlhf_sg.experience import ActorUpdate, OptimizerStep

#: the actor's update settings for a plain PPO update (no KL, no entropy, symmetric clip; old log-probs given)
PLAIN_UPDATE = ActorUpdate(loss=ActorLossConfig(clip_low=0.2, clip_high=0.2), temperature=1.0)
#: the same for one update on fresh samples: the update's own forward gives the old log-probs
FRESH_UPDATE = ActorUpdate(loss=PLAIN_UPDATE.loss, temperature=1.0, old_logp_from_update=True)


#: imported once by the fork server, so a rank's process starts with them (about 6 s of imports a call otherwise);
#: none of them starts a thread or touches a process group when imported. ``deepspeed.initialize`` imports the
#: Muon optimizer, and with it torch's inductor (1.7 s), to check which optimizers ZeRO supports.
PRELOAD = ["torch", "deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer", "transformers", "ray",
           "rlhf_sg.workers", "rlhf_sg.trainer", "zero3_rank"]


def in_fresh_process(fn, *args, timeout_s: float = 600):
    """``fn(*args)`` in a new process (``fn`` must be importable there); its result.

    The process is forked from a fork server that has imported :data:`PRELOAD` and done nothing else, so it holds
    no process group or DeepSpeed state. A process that dies raises ``BrokenProcessPool`` at once.
    """
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: the first call of the session
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(fn, *args).result(timeout=timeout_s)


def actor_rank(model_path: str, device: str = "cpu", **spec_kwargs):
    """One ZeRO-3 actor rank (world size 1) of the model, a 4-row experience with advantages, and its plan.

    ``spec_kwargs`` go to :class:`rlhf_sg.workers.WorkerSpec` (e.g. an LR schedule).
    """
    os.environ["DS_ACCELERATOR"] = device
    from rlhf_sg.distributed import free_port
    from rlhf_sg.trainer import build_rollout_batch
    from rlhf_sg.workers import ModelWorker, WorkerSpec

    spec = WorkerSpec(role="actor", model_path=model_path, world_size=1, master_addr="127.0.0.1",
                      master_port=free_port(), train=True, lr=1e-2, device=device, timeout_s=120, **spec_kwargs)
    worker = ModelWorker(dataclasses.asdict(spec), 0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (int(n),), generator=gen).tolist() for n in (5, 9, 3, 7)]
    responses = [torch.randint(3, 90, (int(n),), generator=gen).tolist() for n in (6, 2, 8, 4)]
    rollout = [torch.randn(len(r), generator=gen).tolist() for r in responses]
    batch = build_rollout_batch(prompts, responses, rollout, pad_id=0)
    batch.advantages = torch.randn(batch.rollout_logp.shape, generator=gen) * batch.action_mask
    return worker, batch, [[0, 1, 2, 3]]


def one_step(plan, batch) -> list[OptimizerStep]:
    """The optimizer steps ``train_actor`` takes: one step over ``plan``, normalised by the batch's tokens."""
    return [OptimizerStep(plan=plan, normalizer=float(batch.action_mask.sum()))]


#: a forward's kept activations in MiB (a [tokens, hidden] and a [tokens, intermediate] tensor a layer, 8 layers)
ACTIVATION_MIB = (1, 3, 3, 3, 1) * 8


def activation_faults(steps: int = 3) -> tuple[float, int]:
    """Minor page faults a step takes in this process when it allocates and writes :data:`ACTIVATION_MIB` (C
    ``malloc`` and ``memset``, as torch's CPU allocator does), then frees them all, as a training step's forward and
    backward do; after two steps to warm up. And the pages a step writes. glibc's defaults give the pages back at
    each step's end (each buffer its own mapping, or the heap trimmed) and fault them in again at the next."""
    import ctypes
    import ctypes.util
    import resource

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]

    def step():
        kept = []
        for mib in ACTIVATION_MIB:
            kept.append(libc.malloc(mib << 20))
            ctypes.memset(kept[-1], 1, mib << 20)
        for pointer in kept:
            libc.free(pointer)

    step(), step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        step()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / steps, sum(ACTIVATION_MIB) << 8
