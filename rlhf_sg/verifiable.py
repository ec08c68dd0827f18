"""Built-in verifiable rewards, chosen by name with ``--reward.function`` instead of ``module:function``:

``math_answer``
    1.0 when the completion's answer equals the label as mathematics, else 0.0. Both sides go through
    math-verify (``pip install -e ".[math]"``): the answer is the completion's ``\\boxed{...}`` where it has one,
    else its last number or expression; LaTeX (``\\frac{1}{2}``, ``\\dfrac``), decimals (``0.5``), plain fractions
    (``1/2``) and trailing units or text (``12 apples``, ``\\boxed{12\\text{ apples}}``) compare by value. Several
    boxed answers are one answer, a set (``\\boxed{3}`` and ``\\boxed{4}`` is {3, 4}): it equals only a label that
    is that set, so listing candidates earns nothing. A completion with nothing to parse scores 0.
``exact_match``
    1.0 when the completion's final answer equals the label after normalisation, else 0.0. The final answer is
    the text after the last ``####`` (GSM8K's marker) or ``\\boxed{...}``, else the last non-empty line;
    normalisation lower-cases, drops ``$``, thousands commas inside numbers, a trailing period and surrounding
    whitespace, and collapses inner whitespace.
``think_format``
    1.0 when the completion is ``<think>...</think>`` followed by an answer, else 0.0 (a format reward).
``NAME=WEIGHT,NAME=WEIGHT,...``
    The weighted sum of built-ins and/or ``module:function`` rewards, e.g. ``math_answer=0.9,think_format=0.1``.

A reward runs in a worker thread of the trainer (bounded by ``--reward.timeout_s``), so math-verify runs without
its own signal-based timeouts, which work in the main thread only.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

RewardFn = Callable[[list[str], list[str], list], Sequence[float]]


class VerifiableRewardError(ValueError):
    """A built-in reward is misnamed, misweighted or lacks its package."""


def _math_verify():
    try:
        import math_verify
    except ImportError as e:
        raise VerifiableRewardError(
            "--reward.function math_answer needs the math-verify package: pip install -e \".[math]\" "
            "(or pip install math-verify)") from e
    return math_verify


def _parse_math(text: str, math_verify) -> list:
    # parsing_timeout=None: no signal.alarm (rewards run in a worker thread; the trainer bounds the call)
    return math_verify.parse(text, parsing_timeout=None)


def math_answer(prompts: list[str], completions: list[str], labels: list) -> list[float]:
    """1.0 where the completion's answer equals its label as mathematics (see the module docstring)."""
    mv = _math_verify()
    scores = []
    golds: dict[str, list] = {}
    for completion, label in zip(completions, labels):
        if label is None:
            raise VerifiableRewardError("math_answer needs a label per prompt (the reference answer): set "
                                        "--data.label_key to the column that holds it")
        key = str(label)
        if key not in golds:
            gold = _parse_math(key if "\\boxed" in key or "$" in key else f"${key}$", mv)
            golds[key] = gold or _parse_math(key, mv)
        answer = _parse_math(completion, mv)
        ok = bool(golds[key]) and bool(answer) and mv.verify(golds[key], answer, timeout_seconds=None)
        scores.append(1.0 if ok else 0.0)
    return scores


_BOXED = re.compile(r"\\boxed\{")
_NUMBER_COMMAS = re.compile(r"(?<=\d),(?=\d{3}\b)")


def _last_boxed(text: str) -> str | None:
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def final_answer(text: str) -> str:
    """The completion's final answer: after the last ``####``, else the last ``\\boxed{...}``, else the last
    non-empty line."""
    if "####" in text:
        return text.rsplit("####", 1)[1]
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def normalize_answer(text: str) -> str:
    text = _NUMBER_COMMAS.sub("", text.replace("$", "")).strip().lower()
    text = re.sub(r"\s+", " ", text)
    return text[:-1].rstrip() if text.endswith(".") else text


def exact_match(prompts: list[str], completions: list[str], labels: list) -> list[float]:
    """1.0 where the completion's normalised final answer equals the normalised label."""
    if any(label is None for label in labels):
        raise VerifiableRewardError("exact_match needs a label per prompt: set --data.label_key")
    return [1.0 if normalize_answer(final_answer(c)) == normalize_answer(str(label)) else 0.0
            for c, label in zip(completions, labels)]


_THINK = re.compile(r"^\s*<think>.*?</think>\s*\S", re.DOTALL)


def think_format(prompts: list[str], completions: list[str], labels: list) -> list[float]:
    """1.0 where the completion is ``<think>...</think>`` followed by an answer."""
    return [1.0 if _THINK.match(c) else 0.0 for c in completions]


BUILTIN_REWARDS: dict[str, RewardFn] = {"math_answer": math_answer, "exact_match": exact_match,
                                        "think_format": think_format}


def is_builtin_spec(spec: str) -> bool:
    """Whether ``--reward.function`` names a built-in or a weighted sum, rather than one module:function."""
    return spec in BUILTIN_REWARDS or "=" in spec


def weighted_sum(parts: list[tuple[RewardFn, float]]) -> RewardFn:
    def score(prompts: list[str], completions: list[str], labels: list) -> list[float]:
        total = [0.0] * len(completions)
        for fn, weight in parts:
            for i, s in enumerate(fn(prompts, completions, labels)):
                total[i] += weight * float(s)
        return total

    return score


def load_builtin(spec: str, load_function: Callable[[str], RewardFn]) -> RewardFn:
    """The reward ``spec`` names: a built-in, or ``NAME=WEIGHT,...`` whose names are built-ins or
    ``module:function`` (loaded with ``load_function``). Raises :class:`VerifiableRewardError` naming the part."""
    if spec in BUILTIN_REWARDS:
        if spec == "math_answer":
            _math_verify()  # a missing package is named before any work starts
        return BUILTIN_REWARDS[spec]
    parts = []
    for part in spec.split(","):
        name, sep, weight = part.strip().rpartition("=")
        if not sep or not name:
            raise VerifiableRewardError(f"--reward.function {spec!r}: part {part!r} must be NAME=WEIGHT")
        try:
            w = float(weight)
        except ValueError:
            raise VerifiableRewardError(f"--reward.function {spec!r}: weight {weight!r} of {name!r} is not a "
                                        "number") from None
        if name in BUILTIN_REWARDS:
            fn = load_builtin(name, load_function)
        elif ":" in name:
            fn = load_function(name)
        else:
            raise VerifiableRewardError(f"--reward.function {spec!r}: {name!r} is neither a built-in "
                                        f"({', '.join(sorted(BUILTIN_REWARDS))}) nor module:function")
        parts.append((fn, w))
    return weighted_sum(parts)
