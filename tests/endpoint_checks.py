"""What every backend's suite checks of the OpenAI-compatible endpoint in front of its engine (rlhf_sg.serve),
through the real ``openai`` client: the ids and log-probs a call records are the ones the engine gives for the same
request; turns continue a sample by token-id prefix and a drifting harness forks a new one; 401, 400 and budget
answers; a call cut by the engine's own abort (a weight sync) continues where it stopped (these on
``/v1/completions`` with token ids, on the suites' own models, which have no chat template); chat tool calls
round-trip, and harness rows' log-probs are the trainer's (on a model taught to call a tool, below). Called from
tests/test_endpoint.py (embedded engine), test_vllm_backend.py and test_sglang_backend.py.

Chat with tools needs a chat template with tool-call tokens and a model that writes a call on cue, which a random
tiny model never does: :func:`teach_tool_conversation` teaches a tiny model of the engine's own architecture, over
the byte-level BPE chat tokenizer (Qwen2.5's format), the two assistant turns of one calculator conversation (a few
seconds of teacher forcing); each suite starts one more engine on it, for :func:`check_tool_calls_round_trip` and
:func:`check_harness_rows_logprobs_match_the_trainer`."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from backends.base import SamplingParams

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "evaluate arithmetic",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
QUESTION = [{"role": "user", "content": "What is 417*38?"}]
CALL_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "417*38"}}\n</tool_call><|im_end|>'
ANSWER_TEXT = "The answer is 15846.<|im_end|>"
#: the context the tool checks need (the tools' description alone renders to ~250 tokens)
TOOL_CONTEXT = 512
#: engine vs trainer log-probs, fp32 (tests/test_backend_contract.py's LOGPROB_ATOL)
LOGPROB_ATOL = 1e-4


@dataclass
class Taught:
    """The taught conversation's ids: ``prompt`` (QUESTION with TOOLS, rendered), ``call`` (the tool call, its JSON
    one character a token), ``glue`` (the tool message's turn through the next generation prompt), ``answer``."""

    prompt: list[int]
    call: list[int]
    glue: list[int]
    answer: list[int]


def teach_tool_conversation(tokenizer, model, path: str, steps: int = 300) -> Taught:
    """Teach ``model`` (a tiny untrained causal LM with ``len(tokenizer)`` ids) the two assistant turns of the
    calculator conversation by teacher forcing; save it and the tokenizer under ``path``. (The model's config keeps
    rlhf_sg.tiny's eos, which the taught turns never sample: the endpoint stops a turn at the tokenizer's.)"""
    enc = lambda text: list(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    p1 = list(tokenizer.apply_chat_template(QUESTION, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                            return_dict=False))
    # the call as the engine may sample it: its JSON one character a token, which the tokenizer's merges would
    # encode otherwise (a re-rendering of the conversation gives other ids; the endpoint must keep these)
    body = CALL_TEXT[len("<tool_call>"):-len("</tool_call><|im_end|>")]
    call = enc("<tool_call>") + [i for ch in body for i in enc(ch)] + enc("</tool_call><|im_end|>")
    assert call != enc(CALL_TEXT)
    glue = enc("\n<|im_start|>user\n<tool_response>\n15846\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    p2 = p1 + call + glue
    answer = enc(ANSWER_TEXT)
    assert model.config.vocab_size == len(tokenizer), "the model's vocabulary is not the tokenizer's"
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    # one right-padded batch of the two turns (causal: the padding after a row changes nothing of it)
    rows = [(p1, call), (p2, answer)]
    width = max(len(p) + len(t) for p, t in rows)
    ids = torch.full((2, width), tokenizer.pad_token_id)
    labels, mask = torch.full_like(ids, -100), torch.zeros_like(ids)
    for r, (prompt, target) in enumerate(rows):
        n = len(prompt) + len(target)
        ids[r, :n], labels[r, len(prompt):n], mask[r, :n] = torch.tensor(prompt + target), torch.tensor(target), 1
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.01:
            break
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return Taught(p1, call, glue, answer)

def check_recorded_ids_are_the_engines_own(backend, tokenizer, prompt_ids: list[int], seed: int = 7,
                                           max_tokens: int = 8, temperature: float = 1.0) -> None:
    """``/v1/completions`` with a token-id prompt, seeded: the call's recorded prompt, completion ids, log-probs
    and weight version equal ``backend.generate`` of the same request; the response carries the same ids. Engines
    that do not honour a seed (SGLang on CPU) are checked greedy (``temperature=0``); the log-probs within 1e-5, as
    the second request may be served from the engine's prefix cache."""
    import openai

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


# ---- chat with tools, on a model taught the calculator conversation (teach_tool_conversation) ---------------------


def check_tool_calls_round_trip(backend, tokenizer, taught: Taught) -> None:
    """Through the real client, greedy: the model's tool call comes back parsed into ``tool_calls`` (finish
    ``tool_calls``); the ``tool`` message sent back continues the session's sample by token-id prefix (the ids the
    engine sampled, then the tool message's turn alone, mask 0) and the model answers with the tool's result. Every
    call's completion is the engine's own greedy completion of its recorded prompt."""
    endpoint, server, base_url = _serve(backend, tokenizer)
    try:
        session, key = endpoint.open_session(budget_tokens=200, max_context=TOOL_CONTEXT)
        c = _client(base_url, key)
        first = c.chat.completions.create(model="policy", messages=QUESTION, tools=TOOLS, temperature=0)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "calculator"
        assert json.loads(call.function.arguments) == {"expression": "417*38"}
        messages = QUESTION + [choice.message.model_dump(exclude_none=True),
                               {"role": "tool", "tool_call_id": call.id, "content": "15846"}]
        second = c.chat.completions.create(model="policy", messages=messages, tools=TOOLS, temperature=0)
        assert second.choices[0].message.content == "The answer is 15846."
        assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls
        first_call, second_call = session.calls
        # the engine's exact ids: the prompt the template renders, the ids it sampled, then the new turn's glue alone
        assert first_call.prompt_ids == taught.prompt and first_call.completion_ids == taught.call
        assert second_call.prompt_ids == taught.prompt + taught.call + taught.glue
        assert second_call.completion_ids == taught.answer
        for rec in session.calls:
            direct = _greedy(backend, endpoint, rec.prompt_ids, len(rec.completion_ids))
            assert rec.completion_ids == direct.token_ids and rec.finish_reason == "stop"
        assert (first_call.tool_calls, second_call.tool_calls) == (1, 0)
        assert first_call.tool_parse_errors == second_call.tool_parse_errors == 0
        (sample,) = session.samples
        assert sample.prompt_ids == taught.prompt
        assert sample.token_ids == taught.call + taught.glue + taught.answer
        assert sample.action_mask == [True] * len(taught.call) + [False] * len(taught.glue) + [True] * len(
            taught.answer)
        assert (session.continued, session.forked) == (1, 0)
        assert first.model_extra["prompt_token_ids"] == taught.prompt
        assert choice.model_extra["token_ids"] == taught.call
        endpoint.close_session(session.session_id)
    finally:
        server.stop()


def _calculate(arguments: str) -> str:
    """The calculator tool: ``a*b`` of the call's ``expression``, or an error message the model reads."""
    try:
        a, b = json.loads(arguments)["expression"].split("*")
        return str(int(a) * int(b))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"error: {type(e).__name__}"


async def sampling_calculator_harness(base_url, api_key, prompt):
    """An agent written with the openai package: the model's tool-call turn greedy, the tool run and its message
    sent, then the model's answer and, after a follow-up question, its second answer, both sampled at temperature 1
    (an engine's greedy log-probs are temperature 1's, so the row has one temperature); reward 1.0 when an answer
    holds 15846."""
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300) as client:
        messages = [{"role": "user", "content": prompt}]
        first = (await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                      temperature=0)).choices[0].message
        messages.append(first.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": call.id, "content": _calculate(call.function.arguments)}
                     for call in first.tool_calls or []]
        reward = 0.0
        for follow_up in (None, "Are you sure?"):
            if follow_up:
                messages.append({"role": "user", "content": follow_up})
            out = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                       temperature=1.0, max_tokens=24)
            messages.append(out.choices[0].message.model_dump(exclude_none=True))
            reward = max(reward, float("15846" in (out.choices[0].message.content or "")))
            if out.choices[0].finish_reason == "length":  # a cut turn is not continued (the next call would fork)
                break
    return reward


def check_harness_rows_logprobs_match_the_trainer(backend, tokenizer, model_path: str, runs: int = 4) -> None:
    """``runs`` harness runs (:func:`sampling_calculator_harness`: a tool call, the tool's message, an answer, a
    user's follow-up, an answer) against the endpoint, their samples made training rows as the trainer makes them
    (:func:`rlhf_sg.serve.harness.as_trajectory`, :func:`rlhf_sg.experience.build_rollout_batch`); the trainer's
    recomputation on that batch (:func:`rlhf_sg.packing.response_logprobs`, the model's own forward, fp32,
    temperature 1) equals the engine's log-prob of every sampled token within ``LOGPROB_ATOL``. Every row holds a
    tool message between turns, and the log-probs are spread enough that a comparison one token off would fail."""
    from transformers import AutoModelForCausalLM

    from rlhf_sg.experience import build_rollout_batch
    from rlhf_sg.packing import response_logprobs
    from rlhf_sg.serve.harness import as_trajectory, run_harnesses

    endpoint, server, base_url = _serve(backend, tokenizer)
    try:
        results = run_harnesses(endpoint, base_url, sampling_calculator_harness,
                                [QUESTION[0]["content"]], n=runs, workers=2, budget_tokens=400,
                                max_context=TOOL_CONTEXT, timeout_s=300)
    finally:
        server.stop()
    assert all(r.error is None and r.sample is not None for r in results), [r.error for r in results]
    rows = [as_trajectory(r, [], tokenizer.pad_token_id) for r in results]
    with_tools = [t for t in rows if t.tool_calls and t.turns > 1 and not all(t.action_mask)]
    assert len(with_tools) == len(rows), "a harness run's row holds no tool message between turns"
    exp = build_rollout_batch([t.prompt_ids for t in rows], [t.token_ids for t in rows], [t.logprobs for t in rows],
                              tokenizer.pad_token_id, action_masks=[t.action_mask for t in rows])
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        trainer = response_logprobs(model, exp.sequences, exp.attention_mask, exp.response_width, 1.0)
    mask = exp.action_mask
    worst = (trainer - exp.rollout_logp)[mask].abs().max().item()
    assert worst <= LOGPROB_ATOL, f"harness rows: engine vs trainer log-prob max abs diff {worst:.2e}"
    # the rows can tell a comparison one token off: the engine's log-probs against the trainer's of the next token
    shifted = (trainer[:, 1:] - exp.rollout_logp[:, :-1])[mask[:, 1:] & mask[:, :-1]].abs().max().item()
    assert shifted > 100 * LOGPROB_ATOL, f"the rows' log-probs are too alike to test ({shifted:.2e} one token off)"
    print(f"harness rows: {len(rows)}, {int(mask.sum())} sampled tokens; "
          f"engine vs trainer max abs diff {worst:.2e}, one token off {shifted:.2e}")
