"""Serving the policy to agent harnesses: the router across a run's engines (:mod:`rlhf_sg.serve.router`, pure
Python, used by the agent loop too), the per-model renderers (:mod:`rlhf_sg.serve.renderer`), the sessions and their
token-exact records (:mod:`rlhf_sg.serve.sessions`) and the OpenAI-compatible endpoint
(:mod:`rlhf_sg.serve.endpoint`, needs the ``agents`` extra: fastapi, uvicorn)."""
