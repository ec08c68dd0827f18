"""Checkpoints of a run: the actor's and critic's DeepSpeed checkpoints (weights, optimizer, RNG) and the
trainer's own state (step, prompt stream position, shuffling RNG, KL coefficient), under
``<output_dir>/checkpoints``; ``latest`` names the newest complete one."""

from __future__ import annotations

import json
import logging
import os

log = logging.getLogger("rlhf_sg")


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def save_checkpoint(root: str, step: int, groups: dict, trainer_state: dict) -> str:
    """Save every group in ``groups`` (name -> ModelGroup or None) and ``trainer_state`` as ``step{step}``;
    then point ``latest`` at it. Returns the checkpoint's path prefix."""
    tag = f"step{step}"
    for name, group in groups.items():
        if group is not None:
            group.call("save_checkpoint", os.path.join(root, name), tag, {"step": step}, what=f"{name} checkpoint")
    with open(os.path.join(root, f"{tag}.trainer.json"), "w") as f:
        json.dump({**trainer_state, "step": step, "tag": tag}, f, default=list)
    with open(os.path.join(root, "latest"), "w") as f:
        f.write(tag)
    return os.path.join(root, tag)


def load_checkpoint(root: str, groups: dict) -> dict | None:
    """Load the checkpoint ``latest`` names into every group; returns its trainer state, or None (with a
    warning) when there is none."""
    latest = os.path.join(root, "latest")
    if not os.path.isfile(latest):
        log.warning("--log.resume: no checkpoint under %s; starting from step 0", root)
        return None
    with open(latest) as f:
        tag = f.read().strip()
    with open(os.path.join(root, f"{tag}.trainer.json")) as f:
        state = json.load(f)
    for name, group in groups.items():
        if group is not None:
            group.call("load_checkpoint", os.path.join(root, name), tag, what=f"{name} checkpoint load")
    return state


def rng_state_from_json(state: list) -> tuple:
    """A :meth:`random.Random.getstate` value back from its JSON form (tuples became lists)."""
    version, internal, gauss = state
    return version, tuple(internal), gauss

