"""One real ZeRO-3 actor rank in a spawned process, for worker-level tests.

DeepSpeed keeps process-wide group state, so each test runs its rank through :func:`in_fresh_process`.
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


def in_fresh_process(fn, *args):
    """``fn(*args)`` in a spawned process (``fn`` must be importable there); its result."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply_async(fn, args).get(timeout=600)


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
