"""Checkpoints of a run: the actor's and critic's DeepSpeed checkpoints (weights, optimizer, RNG) and the
trainer's own state (step, prompt stream position, shuffling RNG, KL coefficient), under
``<output_dir>/checkpoints``.

A checkpoint is complete only once ``step{N}.trainer.json`` exists: it is written after every group's
files, atomically (a temporary name, then a rename), and lists each file with its size; ``latest`` is
then pointed at it, also atomically. A run killed while saving leaves ``latest`` on the previous
checkpoint, and a resume verifies the files it loads, so a half-written checkpoint is never picked up.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re

log = logging.getLogger("rlhf_sg")

_TRAINER_STATE = re.compile(r"^step(\d+)\.trainer\.json$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or no complete one can be read."""


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def checkpoint_bytes(model_dir: str) -> int:
    """A checkpoint's size for a trained model saved in ``model_dir``: its weights as saved, plus fp32 master
    weights and two Adam moments (12 bytes a parameter; the parameter count from the safetensors headers)."""
    from safetensors import safe_open

    weights = params = 0
    for f in os.listdir(model_dir):
        if f.endswith(".safetensors"):
            path = os.path.join(model_dir, f)
            weights += os.path.getsize(path)
            with safe_open(path, "pt") as st:
                params += sum(math.prod(st.get_slice(name).get_shape()) for name in st.keys())
    return weights + 12 * params


def check_output_dir(output_dir: str, trained_model_dirs: list[str]) -> None:
    """Before any process starts: the output directory can be written, and its disk has room for a
    checkpoint of every trained model. Raises :class:`CheckpointError` naming the path and what to do."""
    import shutil

    try:
        os.makedirs(output_dir, exist_ok=True)
        probe = os.path.join(output_dir, f".write-test-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(f"--log.output_dir {output_dir!r} is not writable ({e}); choose a directory you can "
                              "write, or fix its permissions") from e
    need = sum(checkpoint_bytes(d) for d in trained_model_dirs)
    free = shutil.disk_usage(output_dir).free
    if free < need:
        raise CheckpointError(
            f"--log.output_dir {output_dir!r}: {free / 1e9:.2f} GB free, but one checkpoint of the trained models "
            f"takes about {need / 1e9:.2f} GB (weights, fp32 master weights and Adam moments); free space or "
            "choose another directory"
        )


def write_atomic(path: str, text: str) -> None:
    """``path`` holds either its old content or all of ``text``, never a part: written to a temporary file in
    the same directory, flushed to disk, then renamed over ``path``."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    directory = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _files(root: str, names: list[str], tag: str) -> dict[str, int]:
    """Every file of ``tag`` in the groups' directories: path relative to ``root`` -> size in bytes."""
    listing = {}
    for name in names:
        top = os.path.join(root, name, tag)
        for directory, _, files in os.walk(top):
            for f in files:
                path = os.path.join(directory, f)
                listing[os.path.relpath(path, root)] = os.path.getsize(path)
    return listing


def save_checkpoint(root: str, step: int, groups: dict, trainer_state: dict) -> str:
    """Save every group in ``groups`` (name -> ModelGroup or None) and ``trainer_state`` as ``step{step}``,
    then point ``latest`` at it. Returns the checkpoint's path prefix. A failure (a full disk, a directory that
    is not writable) raises :class:`CheckpointError` naming the path; the previous checkpoint stays complete."""
    tag = f"step{step}"
    names = [name for name, group in groups.items() if group is not None]
    try:
        os.makedirs(root, exist_ok=True)
        for name in names:
            groups[name].call("save_checkpoint", os.path.join(root, name), tag, {"step": step},
                              what=f"{name} checkpoint")
        state = {**trainer_state, "step": step, "tag": tag, "files": _files(root, names, tag)}
        write_atomic(os.path.join(root, f"{tag}.trainer.json"), json.dumps(state, default=list))
        write_atomic(os.path.join(root, "latest"), tag)
    except OSError as e:
        previous = _read_latest(root)
        raise CheckpointError(
            f"checkpoint {tag} could not be written under {root} ({e}); free space or fix the permissions there. "
            + (f"The last complete checkpoint, {previous}, is intact." if previous else "There is no earlier one.")
        ) from e
    return os.path.join(root, tag)


def latest_checkpoint(root: str) -> str | None:
    """The path prefix of the checkpoint ``latest`` names, or None."""
    tag = _read_latest(root)
    return os.path.join(root, tag) if tag else None


def _read_latest(root: str) -> str | None:
    try:
        with open(os.path.join(root, "latest")) as f:
            return f.read().strip() or None
    except OSError:
        return None


def verify(root: str, state: dict) -> str | None:
    """None when every file the checkpoint lists is there with its size; else what is wrong."""
    for rel, size in state.get("files", {}).items():
        path = os.path.join(root, rel)
        if not os.path.isfile(path):
            return f"{path} is missing"
        if os.path.getsize(path) != size:
            return f"{path} has {os.path.getsize(path)} bytes, the checkpoint wrote {size}"
    return None


def _candidates(root: str) -> list[str]:
    """Tags to try, best first: the one ``latest`` names, then every complete trainer state, newest first."""
    tags = []
    latest = _read_latest(root)
    if latest:
        tags.append(latest)
    steps = sorted((int(m.group(1)) for f in os.listdir(root) if (m := _TRAINER_STATE.match(f))), reverse=True)
    return tags + [f"step{s}" for s in steps if f"step{s}" not in tags]


def load_checkpoint(root: str, groups: dict) -> dict | None:
    """Load the newest complete checkpoint into every group and return its trainer state; None (with a
    warning) when there is none at all. A checkpoint whose files do not match its listing is skipped with a
    warning naming the file; if no checkpoint is complete, :class:`CheckpointError` says so."""
    if not os.path.isdir(root):
        log.warning("--log.resume: no checkpoint under %s; starting from step 0", root)
        return None
    tried = []
    for tag in _candidates(root):
        try:
            with open(os.path.join(root, f"{tag}.trainer.json")) as f:
                state = json.load(f)
        except (OSError, ValueError) as e:
            tried.append(f"{tag}: {e}")
            continue
        problem = verify(root, state)
        if problem is not None:
            tried.append(f"{tag}: {problem}")
            log.warning("--log.resume: checkpoint %s is incomplete (%s); trying an older one", tag, problem)
            continue
        for name, group in groups.items():
            if group is not None:
                group.call("load_checkpoint", os.path.join(root, name), tag, what=f"{name} checkpoint load")
        return state
    if not tried:
        log.warning("--log.resume: no checkpoint under %s; starting from step 0", root)
        return None
    raise CheckpointError(f"--log.resume: no complete checkpoint under {root}: " + "; ".join(tried)
                          + ". Start without --log.resume, or restore the files.")


def rng_state_from_json(state: list) -> tuple:
    """A :meth:`random.Random.getstate` value back from its JSON form (tuples became lists)."""
    version, internal, gauss = state
    return version, tuple(internal), gauss
