"""What every backend's suite checks of the OpenAI-compatible endpoint in front of its engine (rlhf_sg.serve),
through the real ``openai`` client and ``/v1/completions`` with token ids (the engine suites' models have no chat
template): the ids and log-probs a call records are the ones the engine gives for the same request; turns continue
a sample by token-id prefix and a drifting harness forks a new one; 401, 400 and budget answers; a call cut by the
engine's own abort (a weight sync) continues where it stopped. Called from tests/test_endpoint.py (embedded
engine), test_vllm_backend.py and test_sglang_backend.py, each on its module's one engine."""

from __future__ import annotations

from backends.base import SamplingParams


def check_recorded_ids_are_the_engines_own(backend, tokenizer, prompt_ids: list[int], seed: int = 7,
                                           max_tokens: int = 8, temperature: float = 1.0) -> None:
    """``/v1/completions`` with a token-id prompt, seeded: the call's recorded prompt, completion ids, log-probs
    and weight version equal ``backend.generate`` of the same request; the response carries the same ids. Engines
    that do not honour a seed (SGLang on CPU) are checked greedy (``temperature=0``); the log-probs within 1e-5, as
    the second request may be served from the engine's prefix cache."""
    import openai
    import torch

    from rlhf_sg.serve.endpoint import Endpoint, EndpointServer

    endpoint = Endpoint([backend], tokenizer, "policy")
    server = EndpointServer(endpoint)
    base_url = server.start()
    try:
        session, key = endpoint.open_session(budget_tokens=64, max_context=len(prompt_ids) + 32)
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=300)
        out = client.completions.create(model="policy", prompt=prompt_ids, max_tokens=max_tokens,
                                        temperature=temperature, seed=seed)
        (rec,) = session.calls
        direct = backend.generate([list(prompt_ids)], SamplingParams(temperature=temperature, max_new_tokens=max_tokens,
                                                                     seed=seed,
                                                                     stop_token_ids=endpoint.stop_token_ids))[0]
        assert rec.prompt_ids == list(prompt_ids)
        assert rec.completion_ids == direct.token_ids and len(rec.completion_ids) > 0
        torch.testing.assert_close(torch.tensor(rec.logprobs), torch.tensor(direct.logprobs), atol=1e-5, rtol=0)
        assert rec.weight_version == direct.weight_version and rec.finish_reason == direct.finish_reason
        assert out.choices[0].model_extra["token_ids"] == direct.token_ids
        assert out.choices[0].text == tokenizer.decode(direct.token_ids, skip_special_tokens=True)
        endpoint.close_session(session.session_id)
    finally:
        server.stop()


def _serve(backend, tokenizer, **kw):
    from rlhf_sg.serve.endpoint import Endpoint, EndpointServer

    endpoint = Endpoint([backend], tokenizer, "policy", **kw)
    server = EndpointServer(endpoint)
    return endpoint, server, server.start()


def _client(base_url: str, key: str):
    import openai

    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=300)


def _greedy(backend, endpoint, prompt_ids: list[int], max_tokens: int):
    (c,) = backend.generate([list(prompt_ids)], SamplingParams(temperature=0.0, max_new_tokens=max_tokens,
                                                               stop_token_ids=endpoint.stop_token_ids))
    return c


def check_turns_continue_by_prefix_and_a_drifting_harness_forks(backend, tokenizer, prompt_ids: list[int],
                                                                observation_ids: list[int]) -> None:
    """Three greedy ``/v1/completions`` calls of one session through the real client: the second prompted with the
    first's prompt and completion ids (as returned) plus ``observation_ids`` continues the first sample (the
    observation mask 0); the third, whose prompt edits the first token (a harness that rewrote its history), forks
    a new sample. Every call's completion is the engine's own greedy completion of its prompt."""
    endpoint, server, base_url = _serve(backend, tokenizer)
    try:
        session, key = endpoint.open_session(budget_tokens=64, max_context=len(prompt_ids) + 48)
        c = _client(base_url, key)
        first = c.completions.create(model="policy", prompt=prompt_ids, max_tokens=4, temperature=0)
        c1 = first.choices[0].model_extra["token_ids"]
        second_prompt = first.model_extra["prompt_token_ids"] + c1 + list(observation_ids)
        second = c.completions.create(model="policy", prompt=second_prompt, max_tokens=4, temperature=0)
        edited = [observation_ids[0]] + list(prompt_ids[1:])
        assert edited != list(prompt_ids)
        c.completions.create(model="policy", prompt=edited, max_tokens=4, temperature=0)
        assert (session.continued, session.forked) == (1, 1)
        assert [rec.sample for rec in session.calls] == [0, 0, 1]
        for rec in session.calls:
            direct = _greedy(backend, endpoint, rec.prompt_ids, 4)
            assert rec.completion_ids == direct.token_ids and len(rec.completion_ids) > 0
        c2 = second.choices[0].model_extra["token_ids"]
        kept, forked = session.samples
        assert kept.prompt_ids == list(prompt_ids) and kept.token_ids == c1 + list(observation_ids) + c2
        assert kept.action_mask == [True] * len(c1) + [False] * len(observation_ids) + [True] * len(c2)
        assert forked.prompt_ids == edited and forked.token_ids == session.calls[2].completion_ids
        endpoint.close_session(session.session_id)
    finally:
        server.stop()


def check_keys_bodies_and_budgets_are_refused(backend, tokenizer, prompt_ids: list[int]) -> None:
    """Through the real client: a wrong key gets 401 and reaches no engine; a body that is not JSON and a prompt id
    outside the vocabulary get 400 with a message; a session samples at most its budget left, then gets 400
    ``budget_exhausted``; a prompt that fills the session's context gets 400 ``context_length_exceeded``; a closed
    session's key gets 401."""
    import json
    import urllib.error
    import urllib.request

    import openai
    import pytest

    endpoint, server, base_url = _serve(backend, tokenizer)
    try:
        session, key = endpoint.open_session(budget_tokens=5, max_context=len(prompt_ids) + 16)
        with pytest.raises(openai.AuthenticationError):
            _client(base_url, key + "x").completions.create(model="policy", prompt=prompt_ids, max_tokens=2)
        assert session.calls == [] and all(e.calls == 0 for e in endpoint.router.engines)
        request = urllib.request.Request(f"{base_url}/completions", data=b'{"prompt": [1, 2', method="POST",
                                         headers={"Authorization": f"Bearer {key}"})
        with pytest.raises(urllib.error.HTTPError) as bad:
            urllib.request.urlopen(request, timeout=60)
        assert bad.value.code == 400 and json.loads(bad.value.read())["error"]["code"] == "invalid_json"
        c = _client(base_url, key)
        with pytest.raises(openai.BadRequestError, match="list of token ids"):
            c.completions.create(model="policy", prompt=list(prompt_ids) + [endpoint.vocab_size], max_tokens=2)
        with pytest.raises(openai.BadRequestError) as full:
            c.completions.create(model="policy", prompt=list(prompt_ids) * 2 + [prompt_ids[-1]] * 16, max_tokens=2)
        assert full.value.code == "context_length_exceeded"
        assert session.calls == []
        used = []
        while sum(used) < 5:  # every call samples at least one token, at most the session's budget left
            out = c.completions.create(model="policy", prompt=prompt_ids, max_tokens=50, temperature=1.0,
                                       seed=len(used))
            used.append(out.usage.completion_tokens)
            assert 1 <= used[-1] <= 5 - sum(used[:-1])
        with pytest.raises(openai.BadRequestError, match="sampled its budget of 5 tokens") as refused:
            c.completions.create(model="policy", prompt=prompt_ids, max_tokens=2)
        assert refused.value.code == "budget_exhausted" and len(session.calls) == len(used)
        endpoint.close_session(session.session_id)
        with pytest.raises(openai.AuthenticationError):
            c.completions.create(model="policy", prompt=prompt_ids, max_tokens=2)
        assert len(session.calls) == len(used)
    finally:
        server.stop()


class _Finishes:
    """The backend, with the finish reason of each of its ``generate`` calls kept (a spy: the engine does the
    work)."""

    def __init__(self, backend):
        self.backend, self.finishes = backend, []

    def generate(self, prompts, params):
        out = self.backend.generate(prompts, params)
        self.finishes.append([c.finish_reason for c in out])
        return out


def check_an_aborted_call_continues_where_it_stopped(backend, tokenizer, prompt_ids: list[int],
                                                     max_tokens: int = 48) -> None:
    """A greedy ``/v1/completions`` call whose generate the engine's own ``abort_generation`` cuts (a weight sync)
    once it has produced a token: the endpoint goes on from the tokens so far with the budget left, and the call's
    ids are the uninterrupted greedy completion, one log-prob each (no stop tokens: every call runs its length).
    The backend must count its progress (``decode_steps``): the abort waits for the first token."""
    import threading

    from abort_checks import wait_for_a_token

    assert getattr(backend, "decode_steps", None) is not None, f"{type(backend).__name__} does not count its progress"
    spy = _Finishes(backend)
    endpoint, server, base_url = _serve(spy, tokenizer, stop_token_ids=())  # no stop: every call runs its length
    try:
        whole = _greedy(backend, endpoint, prompt_ids, max_tokens)
        assert whole.finish_reason == "length"
        session, key = endpoint.open_session(budget_tokens=max_tokens, max_context=len(prompt_ids) + max_tokens)
        result = {}

        def call():
            result["out"] = _client(base_url, key).completions.create(model="policy", prompt=prompt_ids,
                                                                      max_tokens=max_tokens, temperature=0)

        thread = threading.Thread(target=call)
        thread.start()
        wait_for_a_token(backend, thread)
        backend.abort_generation()
        thread.join(timeout=300)
        assert not thread.is_alive() and "out" in result
        assert spy.finishes[0] == ["abort"], f"the abort did not cut the first generate: {spy.finishes}"
        (rec,) = session.calls
        assert rec.completion_ids == whole.token_ids and len(rec.logprobs) == len(whole.token_ids)
        assert rec.finish_reason == "length" and len(spy.finishes) >= 2
        assert result["out"].choices[0].model_extra["token_ids"] == whole.token_ids
        endpoint.close_session(session.session_id)
    finally:
        server.stop()
