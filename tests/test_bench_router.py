"""The router benchmark's simulation (rlhf_sg.bench.router): its prefix-cache model against hand-counted hits."""

from __future__ import annotations

import argparse
import copy

import pytest

from rlhf_sg.bench import router as bench


def _args(**kw):
    base = dict(engines=2, sessions=24, concurrency=8, mean_turns=3.0, turn_tokens=40, kv_tokens=10**9,
                step_base_s=0.01, step_row_s=0.001, prefill_token_s=1e-5)
    return argparse.Namespace(**{**base, **kw})


def test_sticky_routing_with_unbounded_memory_hits_every_reusable_token():
    """Every turn after the first finds its trajectory's previous context (all but the new observation) cached on
    its engine: the hit fraction is exactly sum(context - observation) / sum(context) over turns 2.."""
    args = _args()
    trajectories = bench.workload(args, seed=1)
    sent = reusable = 0
    for t in trajectories:
        context = t.prompt
        for prev, _ in zip(t.turns, t.turns[1:]):
            context += prev.gen + prev.obs
            sent += context
            reusable += context - prev.obs
    assert sent > 0
    got = bench.simulate("sticky_least_loaded", copy.deepcopy(trajectories), args)
    assert got["hit"] == pytest.approx(reusable / sent)
    # round robin moves every call: a turn finds its context only when an earlier turn ran on the same engine
    assert bench.simulate("round_robin", copy.deepcopy(trajectories), args)["hit"] < got["hit"]


def test_every_trajectory_finishes_and_the_bench_prints_each_policy(capsys):
    bench.main(["--sessions", "16", "--concurrency", "4", "--seeds", "1", "--kv-tokens", "20000"])
    out = capsys.readouterr().out
    assert out.startswith("SIMULATION")
    assert all(policy in out for policy in ("sticky_least_loaded", "round_robin", "consistent_hash"))
