"""The OpenAI-compatible endpoint (rlhf_sg.serve) with the real ``openai`` client against the embedded engine:
tool calls round-trip, recorded ids are the engine's own, turns continue by token-id prefix and a drifting harness
forks, 401 / 400 / 413 and budget answers, and a generation cut by a weight sync continues.

The tool-call model is the tiny Qwen2 model of rlhf_sg.tiny over the byte-level BPE chat tokenizer (Qwen2.5's
format), taught for a few seconds to answer one conversation with a tool call and, after the tool's answer, with the
result (endpoint_checks.teach_tool_conversation, which the SGLang and vLLM suites use too): a random tiny model never
writes a tool call on cue."""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request

import pytest
import torch

openai = pytest.importorskip("openai")

from endpoint_checks import QUESTION, TOOL_CONTEXT, TOOLS, Taught, teach_tool_conversation  # noqa: E402

from backends.base import BackendConfig, SamplingParams  # noqa: E402
from rlhf_sg.serve.endpoint import Endpoint, EndpointServer  # noqa: E402
from rlhf_sg.serve.renderer import HermesRenderer, renderer_for  # noqa: E402


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from backends.embedded import EmbeddedBackend
    from rlhf_sg.tiny import build_chat_tokenizer, build_tiny_model

    tok = build_chat_tokenizer()
    path = str(tmp_path_factory.mktemp("endpoint_model"))
    taught = dataclasses.astuple(teach_tool_conversation(tok, build_tiny_model(vocab_size=len(tok), seed=0,
                                                                               max_len=TOOL_CONTEXT), path))
    backend = EmbeddedBackend(BackendConfig(model_path=path, max_model_len=TOOL_CONTEXT, num_threads=1))
    endpoint = Endpoint([backend], tok, "tiny-qwen", max_request_bytes=64 * 1024)
    server = EndpointServer(endpoint)
    base_url = server.start()
    yield endpoint, backend, tok, base_url, taught
    server.stop()
    backend.shutdown()


def client(base_url, key):
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)


def test_tool_calls_round_trip_and_the_next_turn_continues_the_sample(served):
    from endpoint_checks import check_tool_calls_round_trip

    endpoint, backend, tok, base_url, taught = served
    check_tool_calls_round_trip(backend, tok, Taught(*taught))


def test_a_streaming_client_gets_the_recorded_completion_replayed(served):
    endpoint, backend, tok, base_url, (p1, call_ids, _, _) = served
    session, key = endpoint.open_session(budget_tokens=200, max_context=512)
    stream = client(base_url, key).chat.completions.create(model="tiny-qwen", messages=QUESTION, tools=TOOLS,
                                                           temperature=0, stream=True,
                                                           stream_options={"include_usage": True})
    chunks = list(stream)
    calls = [c for chunk in chunks for choice in chunk.choices for c in choice.delta.tool_calls or []]
    finish = [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("calculator", {"expression": "417*38"})]
    assert finish == ["tool_calls"] and chunks[-1].usage.completion_tokens == len(call_ids)
    (rec,) = session.calls
    assert rec.prompt_ids == p1 and rec.completion_ids == call_ids


def test_recorded_ids_and_logprobs_are_the_engines_own(served):
    endpoint, backend, tok, base_url, _ = served
    session, key = endpoint.open_session(budget_tokens=200, max_context=512)
    c = client(base_url, key)
    out = c.chat.completions.create(model="tiny-qwen", messages=[{"role": "user", "content": "Say something."}],
                                    temperature=1.0, seed=1234, max_tokens=12)
    (rec,) = session.calls
    assert rec.prompt_ids == list(tok.apply_chat_template([{"role": "user", "content": "Say something."}],
                                                          add_generation_prompt=True, tokenize=True,
                                                          return_dict=False))
    again = backend.generate([rec.prompt_ids], SamplingParams(temperature=1.0, max_new_tokens=12, seed=1234,
                                                              stop_token_ids=(tok.eos_token_id,)))[0]
    assert rec.completion_ids == again.token_ids and rec.logprobs == again.logprobs
    assert rec.weight_version == again.weight_version == backend.weight_version
    assert out.choices[0].model_extra["token_ids"] == again.token_ids
    assert out.usage.completion_tokens == len(again.token_ids)


def test_completions_with_token_ids_record_the_engines_ids(served):
    from endpoint_checks import check_recorded_ids_are_the_engines_own

    endpoint, backend, tok, base_url, (p1, _, _, _) = served
    check_recorded_ids_are_the_engines_own(backend, tok, p1[-20:])


def test_completions_continue_by_prefix_and_a_drifting_harness_forks(served):
    from endpoint_checks import check_turns_continue_by_prefix_and_a_drifting_harness_forks

    endpoint, backend, tok, base_url, (p1, _, glue, _) = served
    check_turns_continue_by_prefix_and_a_drifting_harness_forks(backend, tok, p1[-20:], glue[:3])


def test_completions_refuse_keys_bodies_and_budgets(served):
    from endpoint_checks import check_keys_bodies_and_budgets_are_refused

    endpoint, backend, tok, base_url, (p1, _, _, _) = served
    check_keys_bodies_and_budgets_are_refused(backend, tok, p1[-20:])


def test_a_call_cut_by_the_engines_own_abort_continues(served):
    from endpoint_checks import check_an_aborted_call_continues_where_it_stopped

    endpoint, backend, tok, base_url, (p1, _, _, _) = served
    check_an_aborted_call_continues_where_it_stopped(backend, tok, p1[-20:], max_tokens=200)


def test_a_harness_that_edits_its_history_forks_a_new_sample(served):
    endpoint, backend, tok, base_url, _ = served
    session, key = endpoint.open_session(budget_tokens=400, max_context=512)
    c = client(base_url, key)
    first = c.chat.completions.create(model="tiny-qwen", messages=QUESTION, tools=TOOLS, temperature=0)
    reply = first.choices[0].message.model_dump(exclude_none=True)
    tool = {"role": "tool", "tool_call_id": "x", "content": "15846"}
    # the harness rewrites the user's question before the next turn: the conversation no longer extends the ids
    edited = [{"role": "user", "content": "What is 417 * 38?"}, reply, tool]
    c.chat.completions.create(model="tiny-qwen", messages=edited, tools=TOOLS, temperature=0, max_tokens=4)
    # and a faithful harness continues the first sample
    c.chat.completions.create(model="tiny-qwen", messages=QUESTION + [reply, tool], tools=TOOLS, temperature=0,
                              max_tokens=4)
    assert (session.continued, session.forked) == (1, 1)
    assert len(session.samples) == 2
    assert [rec.sample for rec in session.calls] == [0, 1, 0]
    forked = session.samples[1]
    assert forked.prompt_ids == session.calls[1].prompt_ids and all(forked.action_mask)


def test_keys_bodies_and_budgets_are_refused_with_their_status(served):
    endpoint, backend, tok, base_url, _ = served
    session, key = endpoint.open_session(budget_tokens=5, max_context=512)
    with pytest.raises(openai.AuthenticationError):
        client(base_url, key + "x").chat.completions.create(model="m", messages=QUESTION)
    with pytest.raises(openai.AuthenticationError):
        client(base_url, key + "x").models.list()
    assert session.calls == [] and all(e.calls == 0 for e in endpoint.router.engines)
    assert [m.id for m in client(base_url, key).models.list().data] == ["tiny-qwen"]

    def post(body: bytes):
        req = urllib.request.Request(f"{base_url}/chat/completions", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    status, err = post(b'{"model": "m", "messages": [')
    assert status == 400 and err["error"]["code"] == "invalid_json" and "not JSON" in err["error"]["message"]
    status, err = post(json.dumps({"model": "m", "messages": "hi"}).encode())
    assert status == 400 and "'messages' must be" in err["error"]["message"]
    status, err = post(json.dumps({"model": "m", "messages": QUESTION, "pad": "x" * 70_000}).encode())
    assert status == 413 and err["error"]["code"] == "request_too_large"
    assert session.calls == []
    c = client(base_url, key)
    used = []
    while sum(used) < 5:  # every call samples at least one token, at most the session's budget left
        out = c.chat.completions.create(model="m", messages=QUESTION, max_tokens=50, temperature=1.0,
                                        seed=len(used))
        used.append(out.usage.completion_tokens)
        assert 1 <= used[-1] <= 5 - sum(used[:-1])
    with pytest.raises(openai.BadRequestError, match="sampled its budget of 5 tokens") as refused:
        c.chat.completions.create(model="m", messages=QUESTION)
    assert refused.value.code == "budget_exhausted" and len(session.calls) == len(used)
    endpoint.close_session(session.session_id)
    with pytest.raises(openai.AuthenticationError):  # a closed session's key
        c.chat.completions.create(model="m", messages=QUESTION)
    assert len(session.calls) == len(used)


def test_a_generation_cut_by_a_weight_sync_continues_where_it_stopped(served):
    """The engine answers ``abort`` with the tokens so far (a weight sync); the endpoint continues from there with
    the budget left, and the call keeps every id and the oldest version."""
    endpoint, backend, tok, base_url, _ = served

    class CutOnce:
        def __init__(self, inner):
            self.inner, self.cut = inner, False

        def generate(self, prompts, params):
            out = self.inner.generate(prompts, params)
            if self.cut:
                return out
            self.cut = True
            c = out[0]
            c.token_ids, c.logprobs, c.finish_reason = c.token_ids[:3], c.logprobs[:3], "abort"
            return out

    cut = Endpoint([CutOnce(backend)], tok, "tiny-qwen")
    session, _ = cut.open_session(budget_tokens=100, max_context=512)
    import asyncio

    asyncio.run(cut.chat(session, {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 10,
                                   "temperature": 0}))
    (rec,) = session.calls
    whole = backend.generate([rec.prompt_ids], SamplingParams(temperature=0, max_new_tokens=10,
                                                              stop_token_ids=(tok.eos_token_id,)))[0]
    assert rec.completion_ids == whole.token_ids and len(rec.logprobs) == len(whole.token_ids)
    assert rec.finish_reason == whole.finish_reason


def test_tool_calls_are_found_by_token_id_not_by_text(served):
    _, _, tok, _, _ = served
    r = renderer_for(tok)
    assert isinstance(r, HermesRenderer)
    body = '\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n'
    by_id = [r.open_id] + list(tok.encode(body, add_special_tokens=False)) + [r.close_id, tok.eos_token_id]
    (call,) = r.parse(by_id).tool_calls
    assert call["function"]["name"] == "calculator"
    # the same characters written as plain text pieces: not a call
    as_text = [i for ch in "<tool_call>" for i in tok.encode(ch, add_special_tokens=False)] + by_id[1:-2]
    parsed = r.parse(as_text)
    assert parsed.tool_calls == [] and "<tool_call>" in parsed.content and parsed.parse_errors == 0
    # a call whose JSON is broken stays in the content, counted
    broken = r.parse([r.open_id] + list(tok.encode('{"name": ', add_special_tokens=False)) + [r.close_id])
    assert broken.tool_calls == [] and broken.parse_errors == 1


# ---- harness runs as rollouts --------------------------------------------------------------------------------------


async def calculator_harness(base_url, api_key, prompt):
    """An agent written with the openai package: call the model, run the tool calls it makes, until it answers."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": prompt}]
    for _ in range(4):
        out = await client.chat.completions.create(model="tiny-qwen", messages=messages, tools=TOOLS, temperature=0)
        message = out.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return 1.0 if "15846" in (message.content or "") else 0.0
        for call in message.tool_calls:
            expression = json.loads(call.function.arguments)["expression"]
            a, b = expression.split("*")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(int(a) * int(b))})
    return None


def test_harness_runs_become_rows_with_masks_from_provenance_and_the_trainers_logprobs(served):
    from rlhf_sg.experience import build_rollout_batch
    from rlhf_sg.serve.harness import run_harnesses

    endpoint, backend, tok, base_url, (p1, call_ids, glue, answer_ids) = served
    results = run_harnesses(endpoint, base_url, calculator_harness, ["What is 417*38?"], n=2, workers=2,
                            budget_tokens=200, max_context=512, timeout_s=120)
    assert [r.prompt_index for r in results] == [0, 0]
    for r in results:
        assert r.error is None and r.reward == 1.0 and (r.calls, r.continued, r.forked, r.tool_calls) == (2, 1, 0, 1)
        assert r.sample.prompt_ids == p1 and r.sample.token_ids == call_ids + glue + answer_ids
    batch = build_rollout_batch([r.sample.prompt_ids for r in results], [r.sample.token_ids for r in results],
                                [r.sample.logprobs for r in results], tok.pad_token_id,
                                action_masks=[r.sample.action_mask for r in results])
    # the trainer's forward on the row gives the engine's log-probs on every sampled token
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(backend.config.model_path, dtype=torch.float32).eval()
    sample = results[0].sample
    ids = torch.tensor([sample.prompt_ids + sample.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    P = len(sample.prompt_ids)
    trainer = logp[P - 1:].gather(1, ids[0, P:, None]).squeeze(1)
    mask = torch.tensor(sample.action_mask)
    assert torch.allclose(trainer[mask], torch.tensor(sample.logprobs)[mask], atol=1e-4)
    assert batch.action_mask[0].sum().item() == len(call_ids) + len(answer_ids)


def test_sampled_harness_rows_with_tool_messages_have_the_trainers_logprobs(served):
    from endpoint_checks import check_harness_rows_logprobs_match_the_trainer

    endpoint, backend, tok, base_url, _ = served
    check_harness_rows_logprobs_match_the_trainer(backend, tok, backend.config.model_path, runs=2)  # fast tier


def test_harness_pool_is_bounded_and_failures_stay_with_their_sample(served):
    from rlhf_sg.serve.harness import load_harness, run_harnesses

    endpoint, backend, tok, base_url, _ = served
    running, peak, keys = 0, 0, []

    async def harness(base_url, api_key, prompt):
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        keys.append(api_key)
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}], max_tokens=3)
        running -= 1
        if prompt == "fail":
            raise RuntimeError("the sandbox died")
        if prompt == "posted":  # the reward reported to the endpoint instead of returned
            with pytest.raises(openai.BadRequestError, match="finite number"):
                await client.post("/rl/reward", cast_to=dict, body={"reward": "high"})
            await client.post("/rl/reward", cast_to=dict, body={"reward": 0.25})
            return None
        return None if prompt == "unscored" else 0.5

    results = run_harnesses(endpoint, base_url, harness, ["a", "fail", "unscored", "posted"], n=2, workers=2,
                            budget_tokens=50, max_context=512, timeout_s=120)
    assert peak == 2
    assert [r.reward for r in results] == [0.5, 0.5, None, None, None, None, 0.25, 0.25]
    assert [r.error for r in results] == [None] * 2 + ["RuntimeError: the sandbox died"] * 2 + [None] * 4
    assert all(r.sample is not None and r.calls == 1 for r in results)
    with pytest.raises(openai.AuthenticationError):  # every session is closed at its run's end
        client(base_url, keys[0]).models.list()
    with pytest.raises(ValueError, match="not an async function"):
        load_harness("json:dumps")


def test_auxiliary_calls_are_served_and_budgeted_but_left_out_of_the_row(served):
    """A harness that asks for a title between its turns and a summary after its answer (header X-RL-Auxiliary):
    both are answered and spend the session's budget, yet the row is the two trained calls alone, the second still
    continuing the first, and the summary, whose prompt extends the whole conversation, joins no sample."""
    from rlhf_sg.serve.endpoint import AUXILIARY_HEADER
    from rlhf_sg.serve.harness import run_harnesses

    endpoint, backend, tok, base_url, (p1, call_ids, glue, answer_ids) = served
    aux = {AUXILIARY_HEADER: "true"}
    answered = []

    async def harness(base_url, api_key, prompt):
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120) as c:
            first = await c.chat.completions.create(model="m", messages=QUESTION, tools=TOOLS, temperature=0)
            reply = first.choices[0].message.model_dump(exclude_none=True)
            title = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Title?"}],
                                                    max_tokens=3, temperature=0, extra_headers=aux)
            messages = QUESTION + [reply, {"role": "tool", "tool_call_id": "x", "content": "15846"}]
            second = await c.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0)
            messages += [second.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "Summarize."}]
            summary = await c.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=3,
                                                      temperature=0, extra_headers=aux)
            answered.append((title.usage.completion_tokens, summary.usage.completion_tokens))
        return 1.0

    (r,) = run_harnesses(endpoint, base_url, harness, ["q"], n=1, workers=1, budget_tokens=200, max_context=512,
                         timeout_s=120)
    assert r.error is None and (r.calls, r.auxiliary, r.continued, r.forked, r.tool_calls) == (2, 2, 1, 0, 1)
    assert all(k >= 1 for k in answered[0])
    assert r.sample.prompt_ids == p1 and r.sample.token_ids == call_ids + glue + answer_ids

    # the budget counts them; a header that is neither true nor false is refused
    session, key = endpoint.open_session(budget_tokens=3, max_context=512)
    c = client(base_url, key)
    out = c.completions.create(model="m", prompt=p1[-5:], max_tokens=3, temperature=0, extra_headers=aux)
    (rec,) = session.calls
    assert rec.auxiliary and rec.sample == -1 and session.samples == []
    assert session.budget_left == 3 - out.usage.completion_tokens
    with pytest.raises(openai.BadRequestError, match=AUXILIARY_HEADER):
        c.completions.create(model="m", prompt=p1[-5:], max_tokens=1, extra_headers={AUXILIARY_HEADER: "maybe"})
    assert len(session.calls) == 1
    endpoint.close_session(session.session_id)


def test_mistral_tool_calls_are_found_by_the_tool_calls_token():
    """Mistral's format on a tokenizer that has the [TOOL_CALLS] token (the BPE chat tokenizer plus it: no Mistral
    tokenizer can be fetched here, so its chat template is not exercised, only the parse by id)."""
    from tokenizers import AddedToken

    from rlhf_sg.serve.renderer import MistralRenderer
    from rlhf_sg.tiny import build_chat_tokenizer

    tok = build_chat_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [AddedToken("[TOOL_CALLS]", special=True)]})
    r = MistralRenderer(tok)
    enc = lambda text: list(tok.encode(text, add_special_tokens=False))  # noqa: E731
    calls = '[{"name": "calculator", "arguments": {"expression": "2*3"}}, {"name": "search", "arguments": {}}]'
    parsed = r.parse(enc("Let me compute.") + [r.open_id] + enc(calls) + [tok.eos_token_id])
    assert parsed.content == "Let me compute." and parsed.parse_errors == 0
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == [
        ("calculator", {"expression": "2*3"}), ("search", {})]
    as_text = r.parse([i for ch in "[TOOL_CALLS]" for i in enc(ch)] + enc(calls))  # the characters, not the token
    assert as_text.tool_calls == [] and as_text.content.startswith("[TOOL_CALLS]")
    broken = r.parse([r.open_id] + enc('[{"name": "calculator", "arguments": '))
    assert broken.tool_calls == [] and broken.parse_errors == 1
