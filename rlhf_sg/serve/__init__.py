"""Serving the policy to agent harnesses: the router across a run's engines (:mod:`rlhf_sg.serve.router`)."""
