"""What every backend's suite checks of the OpenAI-compatible endpoint in front of its engine (rlhf_sg.serve):
the ids and log-probs a call records are the ones the engine gives for the same request, through the real ``openai``
client. Called from tests/test_endpoint.py (embedded engine), test_vllm_backend.py and test_sglang_backend.py."""

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
