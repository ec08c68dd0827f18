"""``response_logprobs`` on two ZeRO-3 ranks whose micro-batches hold different numbers of response tokens.

A token budget balances all tokens, not response tokens, so the ranks of one group run different numbers of lm_head
chunks; DeepSpeed gathers a partitioned module's parameters at every call of the module, so every rank must call it
as often as the others (forward, the no-grad scoring forward, and the backward's recomputation) or the group's
collectives pair up wrongly and hang or abort. Each rank runs in a process of its own (:mod:`zero3_rank`), and every
collective of its group fails after :data:`TIMEOUT_S` instead of hanging.
"""

from __future__ import annotations

import concurrent.futures
import os

import pytest
import torch
from test_packing import TOL, assert_grads_close, padded_reference, rollout_batch

#: lm_head chunk size; rank 0's rollout has 3 response tokens (2 chunks), rank 1's 9 (5 chunks), both 13 tokens
CHUNK_TOKENS = 2
ROLLOUTS = {0: ([4, 6], [1, 2]), 1: ([3, 1], [4, 5])}
STEPS = 3
LR = 0.5
#: the group's collective timeout: a mismatched gather fails the rank after this long
TIMEOUT_S = 60


def _model():
    from rlhf_sg.tiny import build_tiny_model

    lm = build_tiny_model("llama", "tiny", seed=3)
    lm.set_attn_implementation("sdpa")
    return lm


def _rollout(rank: int):
    """Rank ``rank``'s rollout: sequences, attention mask, response width, advantages [B, T]."""
    ids, mask, T = rollout_batch(*ROLLOUTS[rank], seed=20 + rank)
    advantages = torch.randn(ids.shape[0], T, generator=torch.Generator().manual_seed(30 + rank))
    return ids, mask, T, advantages * mask[:, -T:]


def _loss(logp: torch.Tensor, entropy: torch.Tensor, advantages: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    return -((logp * advantages).sum() + 0.1 * (entropy * action).sum()) / action.sum()


def _rank_steps(rank: int, port: int, fused: bool = False) -> dict[str, list[torch.Tensor]]:
    """One of two ZeRO-3 ranks: :data:`STEPS` SGD steps on its rollout; at each, the scoring forward's log-probs
    (no grad, eval mode), the update's log-probs and entropy, the lm_head's full gradient and its weight after the
    step. ``fused``: the model's norms and MLP products run as fused kernels (:mod:`rlhf_sg.kernels`), inside
    ZeRO-3's gathers."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from rlhf_sg.distributed import init_torch_distributed, zero3_config
    from rlhf_sg.packing import response_logprobs

    init_torch_distributed(rank, 2, "127.0.0.1", port, timeout_s=TIMEOUT_S, local_rank=0)
    try:
        model = _model()
        if fused:
            from rlhf_sg.kernels import fuse_kernels

            assert fuse_kernels(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        # on CPU every parameter is partitioned (persistence threshold 0), the lm_head included; no clipping
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=zero3_config(max_grad_norm=0.0))
        ids, mask, T, advantages = _rollout(rank)
        seen: dict[str, list[torch.Tensor]] = {"scored": [], "logp": [], "entropy": [], "grad": [], "weight": []}
        head = engine.module.lm_head.weight
        for _ in range(STEPS):
            engine.eval()
            with torch.no_grad():
                seen["scored"].append(response_logprobs(engine.module, ids, mask, T, chunk_tokens=CHUNK_TOKENS))
            engine.train()
            logp, entropy = response_logprobs(engine, ids, mask, T, with_entropy=True, chunk_tokens=CHUNK_TOKENS)
            engine.backward(_loss(logp, entropy, advantages, mask[:, -T:]))
            seen["grad"].append(safe_get_full_grad(head).clone())
            engine.step()
            seen["weight"].append(safe_get_full_fp32_param(head).clone())
            seen["logp"].append(logp.detach())
            seen["entropy"].append(entropy.detach())
        return seen
    finally:
        dist.destroy_process_group()


def _reference() -> tuple[dict[int, dict[str, list[torch.Tensor]]], dict[str, list[torch.Tensor]]]:
    """The same steps on one unpartitioned model in this process: each rank's log-probs and entropy, and the
    lm_head's gradient (the mean of the ranks' gradients, as data parallelism averages them) and weight."""
    model = _model().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    per_rank = {rank: {"logp": [], "entropy": []} for rank in ROLLOUTS}
    head: dict[str, list[torch.Tensor]] = {"grad": [], "weight": []}
    for _ in range(STEPS):
        optimizer.zero_grad()
        losses = []
        for rank in ROLLOUTS:
            ids, mask, T, advantages = _rollout(rank)
            logp, entropy = padded_reference(model, ids, mask, T)
            per_rank[rank]["logp"].append(logp.detach())
            per_rank[rank]["entropy"].append(entropy.detach())
            losses.append(_loss(logp, entropy, advantages, mask[:, -T:]))
        (sum(losses) / len(losses)).backward()
        head["grad"].append(model.lm_head.weight.grad.clone())
        optimizer.step()
        head["weight"].append(model.lm_head.weight.detach().clone())
    return per_rank, head


@pytest.mark.slow
@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused-kernels"])
def test_two_zero3_ranks_with_different_response_tokens_match_one_unpartitioned_model(fused):
    """Two ZeRO-3 ranks (gloo), 2 vs 5 lm_head chunks, three steps (DeepSpeed records its module trace in the first
    and prefetches from it after): the scoring forward's and the update's log-probs, the entropy, the lm_head's
    gradient and its stepped weight equal one unpartitioned model's up to fp32 rounding; with the ranks' norms and
    MLP products fused too (the reference stays eager)."""
    from zero3_rank import in_fresh_process

    from rlhf_sg.distributed import free_port

    per_rank, head = _reference()
    port = free_port()
    with concurrent.futures.ThreadPoolExecutor(len(ROLLOUTS)) as ranks:
        futures = {rank: ranks.submit(in_fresh_process, _rank_steps, rank, port, fused, timeout_s=4 * TIMEOUT_S)
                   for rank in ROLLOUTS}
        failed = {rank: future.exception() for rank, future in futures.items()}
    if any(failed.values()):
        pytest.fail("\n".join(f"rank {rank}: {type(error).__name__}: {error}"
                              for rank, error in failed.items() if error is not None), pytrace=False)
    seen = {rank: future.result() for rank, future in futures.items()}
    for rank, expected in per_rank.items():
        for step in range(STEPS):
            torch.testing.assert_close(seen[rank]["scored"][step], expected["logp"][step], atol=TOL, rtol=0)
            torch.testing.assert_close(seen[rank]["logp"][step], expected["logp"][step], atol=TOL, rtol=0)
            torch.testing.assert_close(seen[rank]["entropy"][step], expected["entropy"][step], atol=TOL, rtol=0)
            assert_grads_close(seen[rank]["grad"][step], head["grad"][step], f"rank {rank} step {step} lm_head grad")
            torch.testing.assert_close(seen[rank]["weight"][step], head["weight"][step], atol=TOL, rtol=0)
    assert (per_rank[1]["logp"][-1] - per_rank[1]["logp"][0]).abs().max() > 0.1  # the steps changed the model
