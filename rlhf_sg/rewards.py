"""Reward sources: a Python rule function, or a remote HTTP scorer. (Reward *models* run as a
:class:`rlhf_sg.workers.ModelGroup` of role ``reward``.)

A reward function has the signature ``fn(prompts: list[str], completions: list[str], labels: list)
-> list[float]`` — one score per completion, in order. ``labels`` holds each prompt's label column
(``--data.label_key``) or ``None``.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import urllib.request
from collections.abc import Callable, Sequence

RewardFn = Callable[[list[str], list[str], list], Sequence[float]]


class RewardError(ValueError):
    """A reward source is misconfigured or returned something unusable."""


def load_reward_function(spec: str) -> RewardFn:
    """Import ``module:function`` and check it takes (prompts, completions, labels)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise RewardError(f"--reward.function must look like module:function, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RewardError(
            f"--reward.function {spec!r}: cannot import {module_name!r} ({e}); is it on PYTHONPATH?"
        ) from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"--reward.function {spec!r}: {module_name} has no callable {attr!r}")
    try:
        inspect.signature(fn).bind([], [], [])
    except TypeError as e:
        raise RewardError(
            f"--reward.function {spec!r} must accept (prompts, completions, labels); its signature is "
            f"{inspect.signature(fn)}"
        ) from e
    return fn


def check_scores(scores: Sequence[float], n: int, source: str) -> list[float]:
    """One finite float per completion, or a RewardError naming the source and the bad entry."""
    scores = list(scores)
    if len(scores) != n:
        raise RewardError(f"{source} returned {len(scores)} scores for {n} completions")
    out = []
    for i, s in enumerate(scores):
        try:
            f = float(s)
        except (TypeError, ValueError) as e:
            raise RewardError(f"{source}: score {i} is {s!r}, not a number") from e
        if not math.isfinite(f):
            raise RewardError(f"{source}: score {i} is {f}; rewards must be finite")
        out.append(f)
    return out


def remote_reward(url: str, prompts: list[str], completions: list[str], labels: list, timeout_s: float) -> list[float]:
    """POST ``{"prompts", "completions", "labels"}`` as JSON; expects ``{"rewards": [...]}``."""
    body = json.dumps({"prompts": prompts, "completions": completions, "labels": labels}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            payload = json.loads(response.read())
    except OSError as e:
        raise RewardError(f"remote reward {url}: request failed or timed out after {timeout_s:.0f} s ({e})") from e
    if not isinstance(payload, dict) or "rewards" not in payload:
        raise RewardError(f"remote reward {url}: expected a JSON object with 'rewards', got {str(payload)[:200]}")
    return check_scores(payload["rewards"], len(completions), f"remote reward {url}")
