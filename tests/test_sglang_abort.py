"""Partial rollout on SGLang: ``abort_generation`` cuts a running ``generate`` short, in the in-process
engine and against a running SGLang server (http mode, with API and admin keys).

A long greedy generate runs in one thread and is aborted from another. It must return early, every
completion with ``finish_reason="abort"`` and fewer tokens than asked, one log-prob per token, and the
tokens kept must be the right ones: a greedy generate continued from ``prompt + tokens so far`` with the
remaining budget reproduces the uninterrupted greedy generate. An abort while nothing runs changes nothing,
and an abort SGLang reports without ``abort_generation`` asking for it is still an error.

Runs in the SGLang venv (``recipes/install/sglang_cpu.sh``); skipped elsewhere. Real engines, CPU mode.
"""

from __future__ import annotations

import importlib.util
import secrets
import threading
import time

import pytest
from abort_checks import check_partial_rollout, full_greedy, generate_and_abort  # tests/ is on the path

from backends.base import BackendConfig, BackendError, SamplingParams
from rlhf_sg.tiny import BOS_ID, save_tiny_model

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed (sglang_cpu.sh)"),
    pytest.mark.slow,
]
#: prompts whose greedy answers on this model run MAX_NEW tokens without an EOS
PROMPTS = [[BOS_ID, 40, 41, 42, 43], [BOS_ID, 60, 61, 62], [BOS_ID, 5, 6, 7, 8, 9]]
#: long enough that the generate is still running when the abort comes (a few ms a step on CPU)
MAX_NEW = 900
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)
API_VAR, ADMIN_VAR = "RLHF_SG_TEST_ABORT_API_KEY", "RLHF_SG_TEST_ABORT_ADMIN_KEY"


def _config(model_path: str, **kw) -> BackendConfig:
    return BackendConfig(model_path=model_path, dtype="float32", max_model_len=1024, seed=0, num_threads=1, **kw)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return save_tiny_model(str(tmp_path_factory.mktemp("sglang-abort")), arch="qwen2", size="tiny", seed=3)


def _abort_at_start(backend, started) -> list:
    """Start a long greedy generate in a thread and abort it as soon as ``started()`` says the backend has
    it; the completions."""
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("out", backend.generate(PROMPTS, GREEDY)))
    thread.start()
    deadline = time.monotonic() + 60
    while not started() and time.monotonic() < deadline:
        time.sleep(0.0005)
    try:
        backend.abort_generation()
    finally:
        thread.join(timeout=300)
    assert "out" in result, "generate failed (see the thread's traceback above)"
    return result["out"]


# ---- in-process engine --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(model_path):
    from backends.sglang_backend import SGLangBackend

    backend = SGLangBackend(_config(model_path))
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def reference(engine):
    """The uninterrupted greedy generate (no EOS on the way)."""
    return full_greedy(engine, PROMPTS, MAX_NEW)


def test_engine_supports_abort(engine):
    assert type(engine).supports_abort is True


def test_engine_abort_keeps_the_tokens_so_far(engine, reference):
    check_partial_rollout(engine, PROMPTS, reference, MAX_NEW)


def test_engine_abort_as_the_generate_starts(engine):
    """An abort that comes while the requests are still on their way to SGLang's scheduler (which drops an
    abort of requests it does not have yet) still cuts the generate short."""
    out = _abort_at_start(engine, lambda: engine._inflight is not None)
    assert [c.finish_reason for c in out] == ["abort"] * len(PROMPTS)
    assert all(len(c.logprobs) == len(c.token_ids) < MAX_NEW for c in out)


def test_engine_abort_when_idle_changes_nothing(engine, reference):
    start = time.monotonic()
    engine.abort_generation()
    assert time.monotonic() - start < 5, "abort_generation with nothing running waited for something"
    out = engine.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in out] == [r.token_ids for r in reference]
    assert [c.finish_reason for c in out] == ["length"] * len(PROMPTS)


def test_engine_abort_nobody_asked_for_is_an_error(engine):
    """SGLang's abort of a request that abort_generation did not ask for (the engine's own) still raises."""
    errors: dict = {}

    def run():
        try:
            engine.generate(PROMPTS, GREEDY)
        except BackendError as exc:
            errors["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 60
    # until the scheduler has the requests: their first tokens have reached the tokenizer manager
    while not (engine._inflight is not None and engine.decode_steps) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.decode_steps, "the generate produced no tokens within 60 s"
    engine._driver.abort(engine._inflight)  # SGLang's abort_all, without abort_generation's mark
    thread.join(timeout=300)
    assert "aborted the completion of prompt" in str(errors.get("error"))


# ---- http mode ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    """(url, api key, admin key) of a running SGLang server started with both keys."""
    from test_sglang_http import keyed_server  # tests/ is on the path

    with keyed_server(model_path, tmp_path_factory.mktemp("sglang-abort-log"), "--max-total-tokens", "8192",
                      "--context-length", "1024", "--random-seed", "0", api_var=API_VAR, admin_var=ADMIN_VAR) as keys:
        yield keys


def test_http_abort_keeps_the_tokens_so_far(server, model_path, monkeypatch, reference):
    """Against a server: the abort is an admin call (POST /abort_request, abort_all), with the admin key."""
    from backends.sglang_backend import SGLangBackend

    url, api_key, admin_key = server
    monkeypatch.setenv(API_VAR, api_key)
    monkeypatch.setenv(ADMIN_VAR, admin_key)
    backend = SGLangBackend(
        _config(model_path, extra={"server_urls": [url], "api_key_env": API_VAR, "admin_api_key_env": ADMIN_VAR})
    )
    try:
        assert type(backend).supports_abort is True
        server_reference = backend.generate(PROMPTS, GREEDY)
        # the server runs the same model and engine: the same greedy tokens as the in-process engine
        assert [c.token_ids for c in server_reference] == [r.token_ids for r in reference]
        check_partial_rollout(backend, PROMPTS, server_reference, MAX_NEW)
        backend.abort_generation()  # idle: nothing happens
        assert [c.token_ids for c in backend.generate(PROMPTS, GREEDY)] == [r.token_ids for r in reference]
    finally:
        backend.shutdown()


def test_http_abort_with_a_wrong_admin_key_names_the_variable(server, model_path, monkeypatch):
    from backends.sglang_backend import SGLangBackend

    url, api_key, _ = server
    monkeypatch.setenv(API_VAR, api_key)
    monkeypatch.setenv(ADMIN_VAR, "wrong-" + secrets.token_hex(4))
    backend = SGLangBackend(
        _config(model_path, extra={"server_urls": [url], "api_key_env": API_VAR, "admin_api_key_env": ADMIN_VAR})
    )
    try:
        with pytest.raises(BackendError, match=rf"abort_request answered 40[13].*{ADMIN_VAR}"):
            generate_and_abort(backend, PROMPTS, GREEDY, delay_s=0.3)
    finally:
        backend.shutdown()
