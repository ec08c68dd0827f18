"""Checks shared by the real-engine abort tests (``test_sglang_abort.py``, ``test_vllm_abort.py``): a long
greedy generate in one thread, ``abort_generation`` from another, and the continuation that proves the
tokens kept are the right ones."""

from __future__ import annotations

import threading
import time

import pytest

from backends.base import SamplingParams


def wait_for_a_token(backend, thread: threading.Thread, timeout_s: float = 120.0) -> None:
    """Wait until the generate running in ``thread`` has produced a token (``backend.decode_steps``, 0 while none of
    its generates runs) or has returned; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while thread.is_alive() and not backend.decode_steps and time.monotonic() < deadline:
        time.sleep(0.001)
    assert backend.decode_steps or not thread.is_alive(), f"the generate produced no token within {timeout_s:.0f} s"


def generate_and_abort(backend, prompts, params, delay_s: float):
    """Run ``generate`` in a thread and abort it from this one once the engine has produced tokens; the
    completions. When abort_generation raises, its error is raised once the generate has returned.

    The engine's progress comes from ``backend.decode_steps`` (the fewest tokens vLLM's output processor or SGLang's
    tokenizer manager holds for a request); a backend that does not count it (SGLang over HTTP: None) is aborted
    after ``delay_s``."""
    result: dict = {}

    def run():
        try:
            result["out"] = backend.generate(prompts, params)
        except BaseException as exc:  # re-raised below, in the test's thread
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    if getattr(backend, "decode_steps", None) is None:
        time.sleep(delay_s)
    else:
        wait_for_a_token(backend, thread)
    try:
        backend.abort_generation()
    finally:
        thread.join(timeout=300)
    assert not thread.is_alive(), "generate did not return after abort_generation"
    if "error" in result:
        raise result["error"]
    return result["out"]


def full_greedy(backend, prompts, max_new: int, min_seconds: float = 1.5):
    """The uninterrupted greedy generate: every row must run its whole length (no EOS on the way).

    A backend that counts its progress (``decode_steps``) is aborted once it has produced a token, and
    ``check_partial_rollout`` asserts each row was cut short of ``max_new``, so no wall time is assumed. One
    that does not (SGLang over HTTP) is aborted after a delay: its full generate must take longer than
    ``min_seconds`` for that delay to land halfway."""
    start = time.monotonic()
    ref = backend.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new))
    seconds = time.monotonic() - start
    assert [c.finish_reason for c in ref] == ["length"] * len(prompts)
    if getattr(backend, "decode_steps", None) is None:
        assert seconds > min_seconds, (f"the full generate took {seconds:.2f} s: too short to abort halfway; "
                                       "raise max_new")
    return ref


def check_partial_rollout(backend, prompts, reference, max_new: int, delay_s: float = 0.5) -> None:
    """Abort a long greedy generate, then continue every completion from where it stopped, as the trainer
    does (``prompt + tokens so far``, the remaining budget, n=1): the joined tokens and log-probs are the
    uninterrupted generate's."""
    out = generate_and_abort(backend, prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new), delay_s)
    assert len(out) == len(prompts)
    assert [c.prompt_index for c in out] == list(range(len(prompts)))
    assert [c.finish_reason for c in out] == ["abort"] * len(prompts)
    assert all(len(c.token_ids) < max_new for c in out), [len(c.token_ids) for c in out]
    if getattr(backend, "decode_steps", None) is None:  # aborted after delay_s
        assert any(len(c.token_ids) > 0 for c in out), "the abort came before any token: raise delay_s"
    else:  # aborted once every row held a token, and none is lost
        assert all(len(c.token_ids) > 0 for c in out), [len(c.token_ids) for c in out]
    for i, (c, ref) in enumerate(zip(out, reference)):
        k = len(c.token_ids)
        assert len(c.logprobs) == k
        assert c.token_ids == ref.token_ids[:k]
        assert c.logprobs == pytest.approx(ref.logprobs[:k], abs=1e-4)
        rest = backend.generate([prompts[i] + c.token_ids], SamplingParams(temperature=0.0, max_new_tokens=max_new - k))
        (rest,) = rest
        assert rest.finish_reason == "length"
        assert c.token_ids + rest.token_ids == ref.token_ids
        assert c.logprobs + rest.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
