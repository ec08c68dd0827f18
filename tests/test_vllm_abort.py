"""Partial rollout on vLLM: ``abort_generation`` cuts a running ``generate`` short.

A long greedy generate runs in one thread and is aborted from another. It must return early, every
completion with ``finish_reason="abort"`` and fewer tokens than asked, one log-prob per token, and the
tokens kept must be the right ones: a greedy generate continued from ``prompt + tokens so far`` with the
remaining budget reproduces the uninterrupted greedy generate. An abort while nothing runs changes nothing.

Runs in the vLLM venv (``bash recipes/install/vllm_cpu.sh``); skipped elsewhere. vLLM's CPU build, a tiny
Qwen2 with 2 heads of 32 (a head size its CPU attention takes).
"""

from __future__ import annotations

import importlib.util
import threading
import time

import pytest
import torch
from abort_checks import check_partial_rollout, full_greedy, generate_and_abort  # tests/ is on the path

from backends.base import BackendConfig, SamplingParams
from rlhf_sg.tiny import BOS_ID, save_tiny_model, tiny_config

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (bash recipes/install/vllm_cpu.sh)"
)
#: prompts whose greedy answers on this model run MAX_NEW tokens without an EOS
PROMPTS = [[BOS_ID, 40, 41, 42, 43], [BOS_ID, 60, 61, 62], [BOS_ID, 5, 6, 7, 8, 9]]
#: long enough that the generate is still running when the abort comes
MAX_NEW = 900
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from backends.vllm_backend import VLLMBackend

    config = tiny_config("qwen2", "tiny")
    config.num_attention_heads, config.num_key_value_heads = 2, 1
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = save_tiny_model(str(tmp_path_factory.mktemp("vllm-abort")), model=model)
    engine = VLLMBackend(BackendConfig(model_path=path, max_model_len=1024, seed=0, num_threads=1))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(backend):
    return full_greedy(backend, PROMPTS, MAX_NEW)


def test_supports_abort(backend):
    assert type(backend).supports_abort is True


def test_abort_keeps_the_tokens_so_far(backend, reference):
    check_partial_rollout(backend, PROMPTS, reference, MAX_NEW)


def test_abort_before_the_first_step_returns_every_row_empty(backend, reference):
    """An abort that comes before the engine has run a step: every completion is cut, with no tokens (or a
    prefix of the uninterrupted ones if a step slipped in), and the engine is left clean."""
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("out", backend.generate(PROMPTS, GREEDY)))
    thread.start()
    deadline = time.monotonic() + 60
    while backend._generate_done is None and time.monotonic() < deadline:
        time.sleep(0.0005)
    try:
        backend.abort_generation()
    finally:
        thread.join(timeout=300)
    out = result["out"]
    assert [c.finish_reason for c in out] == ["abort"] * len(PROMPTS)
    for c, ref in zip(out, reference):
        assert len(c.logprobs) == len(c.token_ids) < MAX_NEW
        assert c.token_ids == ref.token_ids[: len(c.token_ids)]
    assert not backend.llm.llm_engine.has_unfinished_requests()


def test_abort_when_idle_changes_nothing(backend, reference):
    start = time.monotonic()
    backend.abort_generation()
    assert time.monotonic() - start < 5, "abort_generation with nothing running waited for something"
    out = backend.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))
    assert [c.token_ids for c in out] == [r.token_ids for r in reference]
    assert [c.finish_reason for c in out] == ["length"] * len(PROMPTS)
    # no generate runs: no progress, so a caller waiting for the next generate's tokens does not see this one's
    assert backend.decode_steps == 0


def test_abort_with_n_samples_keeps_each_row(backend):
    """n > 1: every sample of every prompt comes back, cut short, in prompt-major order."""
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=MAX_NEW)
    out = generate_and_abort(backend, PROMPTS, params, delay_s=0.5)
    assert [c.prompt_index for c in out] == [0, 0, 1, 1, 2, 2]
    assert all(c.finish_reason == "abort" and len(c.logprobs) == len(c.token_ids) < MAX_NEW for c in out)
    # the engine is clean afterwards: nothing of the aborted call is left running
    assert not backend.llm.llm_engine.has_unfinished_requests()


def test_generate_from_a_thread_with_its_own_openmp_count(backend, reference):
    """On CPU the in-process engine runs the model in the thread that calls generate (an abortable generate runs
    in one of its own), and OpenMP's thread count is per thread; vLLM's CPU attention aborts the process when the
    count differs between building its metadata and running its kernel. The backend runs every generate with the
    count the engine started with (1 here), whatever the calling thread's."""
    import ctypes
    import os

    # torch's own OpenMP runtime: this thread's count goes to 2 while torch's intra-op setting stays at 1, what a
    # thread has that starts in a process without OMP_NUM_THREADS in its environment
    gomp = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1"))
    result: dict = {}

    def run():
        gomp.omp_set_num_threads(2)
        result["out"] = backend.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=8))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=120)
    assert [c.token_ids for c in result["out"]] == [reference[0].token_ids[:8]]
