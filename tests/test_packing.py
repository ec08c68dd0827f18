"""Packing: padded <-> packed round trips, packed forwards against padded ones, gradients, micro-batches."""

import copy
import datetime
import socket

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_sg.models import ValueHeadModel
from rlhf_sg.packing import (
    IGNORE_LABEL,
    critic_values,
    pack,
    pack_values,
    packed_forward,
    response_logprobs,
    reward_scores,
    token_budget_microbatches,
    unpack,
)
from rlhf_sg.tiny import PAD_ID, build_tiny_model

TOL = 1e-5


def rollout_batch(prompt_lens, response_lens, prompt_width=None, response_width=None, seed=0, vocab=100):
    """The trainer's layout: left-padded prompts of width P, right-padded responses of width T."""
    P = prompt_width or max(prompt_lens)
    T = response_width or max(response_lens)
    B = len(prompt_lens)
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, P + T, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        mask[b, P - p : P + r] = 1
    ids = torch.full((B, P + T), PAD_ID, dtype=torch.long)
    ids[mask.bool()] = torch.randint(3, vocab, (int(mask.sum()),), generator=gen)
    return ids, mask, T


CASES = {
    "one_token_response": ([4, 7, 2], [1, 6, 1]),
    "row_at_max_length": ([8, 3, 5], [6, 2, 6]),  # row 0 fills all P + T columns
    "equal_lengths": ([5, 5, 5, 5], [4, 4, 4, 4]),
    "batch_of_one": ([6], [3]),
    "very_uneven": ([1, 30, 2, 3], [40, 1, 3, 2]),
    "one_per_row_with_row_padding": ([6, 4], [5, 3]),  # 11 and 7 tokens: no two share a row
}


def assert_grads_close(actual, expected, name, rel=1e-5):
    """fp32 sums in another order: differences scale with the tensor's largest entry, not each entry."""
    scale = expected.abs().max().item()
    err = (actual - expected).abs().max().item()
    assert err <= rel * scale + 1e-8, f"{name}: max |diff| {err:.3g} > {rel} x max |grad| {scale:.3g}"


def padded_reference(model, ids, mask, T, temperature=1.0):
    """The usual padded forward: full logits over [B, S], fp32 log-softmax; logp, entropy [B, T]."""
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits.float()
    logp_all = (logits / temperature).log_softmax(-1)
    P = ids.shape[1] - T
    logp_pred = logp_all[:, P - 1 : -1]
    logp = logp_pred.gather(-1, ids[:, P:, None]).squeeze(-1)
    entropy = -(logp_pred.exp() * logp_pred).sum(-1)
    action = mask[:, P:].bool()
    return logp * action, entropy * action


def value_reference(critic, ids, mask, T):
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    values = critic(ids, attention_mask=mask, position_ids=position_ids, use_cache=False)
    P = ids.shape[1] - T
    return values[:, P - 1 : -1] * mask[:, P:]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def models(arch):
    lm = build_tiny_model(arch, "tiny", seed=1)
    critic = ValueHeadModel(copy.deepcopy(lm.model))
    torch.nn.init.normal_(critic.value_head.weight, std=1.0)  # values of order 1: differences show
    return lm, critic


# ---- padded <-> packed -----------------------------------------------------------------------------


@st.composite
def padded_batches(draw):
    B = draw(st.integers(1, 6))
    S = draw(st.integers(1, 12))
    starts, lengths = [], []
    for _ in range(B):
        length = draw(st.integers(1, S))
        starts.append(draw(st.integers(0, S - length)))
        lengths.append(length)
    mask = torch.zeros(B, S, dtype=torch.long)
    for b, (s, n) in enumerate(zip(starts, lengths)):
        mask[b, s : s + n] = 1
    seed = draw(st.integers(0, 2**16))
    return mask, seed


@settings(max_examples=60, deadline=None)
@given(padded_batches(), st.sampled_from([None, "longest", "wide"]))
def test_round_trip_is_exact_for_every_tensor_kind(case, rows):
    mask, seed = case
    gen = torch.Generator().manual_seed(seed)
    B, S = mask.shape
    ids = torch.randint(0, 1000, (B, S), generator=gen)
    longest = int(mask.sum(1).max())
    row_tokens = {None: None, "longest": longest, "wide": 2 * longest + 1}[rows]
    batch = pack(ids, mask, row_tokens=row_tokens)
    real = mask.bool()
    tensors = {
        "ids": ids,
        "mask": mask.bool(),
        "float32": torch.randn(B, S, generator=gen),
        "bfloat16": torch.randn(B, S, generator=gen).bfloat16(),
        "float64_trailing": torch.randn(B, S, 3, 2, generator=gen, dtype=torch.float64),
    }
    for name, x in tensors.items():
        pad = x.new_zeros(()) if x.dtype != torch.bool else torch.tensor(False)
        expected = torch.where(real.view(B, S, *[1] * (x.dim() - 2)), x, pad)
        assert torch.equal(unpack(pack_values(x, batch), batch), expected), name
    # the packed rows hold exactly the real tokens, in the slots the batch records
    assert torch.equal(batch.input_ids.flatten()[batch.slots], ids[real])
    assert batch.num_tokens == int(mask.sum())
    if row_tokens is None:
        assert batch.input_ids.shape == (1, batch.num_tokens)
    else:
        assert batch.input_ids.shape[1] <= row_tokens


@settings(max_examples=40, deadline=None)
@given(padded_batches())
def test_labels_positions_and_cu_seqlens_stay_inside_each_sequence(case):
    mask, seed = case
    ids = torch.randint(3, 1000, mask.shape, generator=torch.Generator().manual_seed(seed))
    batch = pack(ids, mask, row_tokens=int(mask.sum(1).max()))
    expected_labels, expected_positions = [], []
    for b in range(mask.shape[0]):
        seq = ids[b][mask[b].bool()].tolist()
        expected_labels += seq[1:] + [IGNORE_LABEL]
        expected_positions += list(range(len(seq)))
    assert batch.labels.tolist() == expected_labels
    assert batch.position_ids.flatten()[batch.slots].tolist() == expected_positions
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.cu_seqlens.diff().tolist() == mask.sum(1).tolist()
    assert batch.max_seqlen == int(mask.sum(1).max())


def test_row_packing_fills_rows_up_to_the_longest_sequence():
    mask = torch.zeros(5, 10, dtype=torch.long)
    for b, n in enumerate([10, 6, 4, 3, 7]):
        mask[b, :n] = 1
    batch = pack(torch.ones_like(mask), mask, row_tokens=10)
    # first-fit decreasing: [10], [7, 3], [6, 4]
    assert batch.input_ids.shape == (3, 10)
    assert (batch.input_ids != 0).sum().item() == 30


# ---- bad input --------------------------------------------------------------------------------------


def test_mask_with_a_hole_is_an_error_naming_the_row():
    ids, mask, T = rollout_batch([3, 4], [2, 3])
    mask[1, 4] = 0  # inside row 1's real tokens
    with pytest.raises(ValueError, match="row 1 has padding between its real tokens"):
        pack(ids, mask)
    lm = build_tiny_model("llama", "tiny")
    with pytest.raises(ValueError, match="row 1 has padding between"):
        response_logprobs(lm, ids, mask, T)


def test_row_without_response_token_is_an_error():
    ids, mask, T = rollout_batch([3, 4, 2], [2, 3, 1])
    mask[2, -T:] = 0
    lm = build_tiny_model("llama", "tiny")
    with pytest.raises(ValueError, match="row 2 has no response token"):
        response_logprobs(lm, ids, mask, T)
    critic = ValueHeadModel(lm.model)
    with pytest.raises(ValueError, match="row 2 has no response token"):
        critic_values(critic, ids, mask, T)


def test_other_bad_input_is_named():
    ids, mask, T = rollout_batch([3, 4], [2, 3])
    lm = build_tiny_model("llama", "tiny")
    with pytest.raises(ValueError, match="same shape"):
        pack(ids, mask[:, :-1])
    with pytest.raises(ValueError, match="same shape"):
        pack(ids[0], mask[0])
    with pytest.raises(ValueError, match="only 0 and 1"):
        pack(ids, mask * 2)
    with pytest.raises(TypeError, match="integer token ids"):
        pack(ids.float(), mask)
    empty = mask.clone()
    empty[0] = 0
    with pytest.raises(ValueError, match="row 0 has no real token"):
        pack(ids, empty)
    with pytest.raises(ValueError, match="row_tokens=3 is shorter than sequence 1"):
        pack(ids, mask, row_tokens=3)
    with pytest.raises(ValueError, match="response_width=9"):
        response_logprobs(lm, ids, mask, 9)
    no_prompt = mask.clone()
    no_prompt[0, : ids.shape[1] - T] = 0
    with pytest.raises(ValueError, match="row 0: the last prompt column"):
        response_logprobs(lm, ids, no_prompt, T)
    batch = pack(ids, mask)
    with pytest.raises(ValueError, match="real tokens in dim 0"):
        unpack(torch.zeros(batch.num_tokens + 1), batch)
    with pytest.raises(ValueError, match="padded shape"):
        pack_values(torch.zeros(3, 3), batch)
    with pytest.raises(TypeError, match="ValueHeadModel"):
        critic_values(lm, ids, mask, T)
    with pytest.raises(ValueError, match="not supported on packed rows"):
        response_logprobs(lm, ids, mask, T, attn_implementation="flex_attention")


# ---- packed forward == padded forward ------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_forward_matches_padded(models, impl, case):
    lm, critic = models
    lm.set_attn_implementation(impl)
    critic.model.set_attn_implementation(impl)
    ids, mask, T = rollout_batch(*CASES[case], seed=len(case))
    with torch.no_grad():
        ref_logp, ref_entropy = padded_reference(lm, ids, mask, T, temperature=0.7)
        logp, entropy = response_logprobs(
            lm, ids, mask, T, temperature=0.7, with_entropy=True, chunk_tokens=5
        )
        ref_values = value_reference(critic, ids, mask, T)
        values = critic_values(critic, ids, mask, T)
    assert logp.shape == entropy.shape == values.shape == (ids.shape[0], T)
    assert logp.dtype == entropy.dtype == values.dtype == torch.float32
    torch.testing.assert_close(logp, ref_logp, atol=TOL, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=TOL, rtol=0)
    torch.testing.assert_close(values, ref_values, atol=TOL, rtol=0)
    assert (logp[mask[:, -T:] == 0] == 0).all()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_reward_scores_are_the_value_at_each_last_token(models, impl):
    _, critic = models
    critic.model.set_attn_implementation(impl)
    ids, mask, _ = rollout_batch(*CASES["very_uneven"])
    with torch.no_grad():
        scores = reward_scores(critic, ids, mask)
        expected = []
        for b in range(ids.shape[0]):  # each sequence alone, no padding at all
            expected.append(critic(ids[b][mask[b].bool()][None], use_cache=False)[0, -1])
    assert scores.shape == (ids.shape[0],)
    torch.testing.assert_close(scores, torch.stack(expected), atol=TOL, rtol=0)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_one_row_of_many_sequences_matches_each_sequence_alone(models, impl):
    """All sequences in one [1, N] row (the flash layout) with the dense mask: no attention across them."""
    lm, _ = models
    lm.set_attn_implementation(impl)
    ids, mask, _ = rollout_batch([5, 2, 9], [4, 8, 1], seed=3)
    batch = pack(ids, mask)
    assert batch.input_ids.shape[0] == 1
    with torch.no_grad():
        logits = packed_forward(lm, batch).logits[0]
        for b in range(ids.shape[0]):
            alone = lm(ids[b][mask[b].bool()][None], use_cache=False).logits[0]
            start, end = batch.cu_seqlens[b].item(), batch.cu_seqlens[b + 1].item()
            torch.testing.assert_close(logits[start:end], alone, atol=TOL, rtol=0)


# ---- gradients ------------------------------------------------------------------------------------------


def test_one_step_on_packed_equals_one_step_on_padded(arch):
    lm = build_tiny_model(arch, "tiny", seed=2).train()
    ids, mask, T = rollout_batch([3, 9, 5], [7, 1, 4], seed=5)
    action = mask[:, -T:].float()
    advantages = torch.randn(ids.shape[0], T, generator=torch.Generator().manual_seed(0))
    n = action.sum()

    def token_mean_loss(logp, entropy):
        return (-(logp * advantages * action).sum() - 0.1 * (entropy * action).sum()) / n

    results = {}
    for name in ("padded", "packed"):
        model = copy.deepcopy(lm)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        if name == "padded":
            logp, entropy = padded_reference(model, ids, mask, T)
        else:
            logp, entropy = response_logprobs(model, ids, mask, T, with_entropy=True, chunk_tokens=4)
        token_mean_loss(logp, entropy).backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        results[name] = grads, dict(model.named_parameters())
    (g_pad, p_pad), (g_pack, p_pack) = results["padded"], results["packed"]
    assert any(g.abs().max() > 1e-4 for g in g_pad.values())
    for k in g_pad:
        assert_grads_close(g_pack[k], g_pad[k], k)
        torch.testing.assert_close(p_pack[k], p_pad[k], atol=1e-6, rtol=1e-5)


def test_critic_gradients_match_padded(models):
    _, critic = models
    critic.model.set_attn_implementation("sdpa")
    ids, mask, T = rollout_batch([3, 9, 5], [7, 1, 4], seed=6)
    returns = torch.randn(ids.shape[0], T, generator=torch.Generator().manual_seed(1))
    action = mask[:, -T:].float()
    grads = {}
    for name in ("padded", "packed"):
        model = copy.deepcopy(critic).train()
        values = (
            value_reference(model, ids, mask, T) if name == "padded" else critic_values(model, ids, mask, T)
        )
        (((values - returns) ** 2 * action).sum() / action.sum()).backward()
        grads[name] = {k: p.grad for k, p in model.named_parameters()}
    for k in grads["padded"]:
        assert_grads_close(grads["packed"][k], grads["padded"][k], k)


# ---- token-budget micro-batches and loss scale ------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(1, 50), min_size=1, max_size=40),
    st.integers(50, 200),
    st.integers(1, 4),
)
def test_microbatches_cover_every_sample_within_budget_and_in_lockstep(lengths, budget, dp):
    try:
        plan = token_budget_microbatches(lengths, budget, dp)
    except ValueError as e:
        assert len(lengths) < dp or "non-empty micro-batches" in str(e)
        return
    assert len(plan) == dp
    assert len({len(rank) for rank in plan}) == 1
    seen = sorted(i for rank in plan for micro in rank for i in micro)
    assert seen == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in micro) for rank in plan for micro in rank]
    assert all(micro for rank in plan for micro in rank)
    assert max(loads) <= budget
    # longest-first into the least-loaded micro-batch: loads differ by at most one sample
    assert max(loads) - min(loads) <= max(lengths)
    rank_loads = [sum(lengths[i] for micro in rank for i in micro) for rank in plan]
    assert max(rank_loads) - min(rank_loads) <= max(loads)


def test_microbatches_hand_case_and_errors():
    plan = token_budget_microbatches([10, 9, 8, 7, 6, 5, 4, 3], 20, 2)
    # 52 tokens -> 3 micro-batches needed -> 2 per rank; LPT gives loads 13, 13, 13, 13
    assert [[sum([10, 9, 8, 7, 6, 5, 4, 3][i] for i in m) for m in rank] for rank in plan] == [
        [13, 13],
        [13, 13],
    ]
    with pytest.raises(ValueError, match="sample 2 has 30 tokens, more than max_tokens_per_microbatch=20"):
        token_budget_microbatches([5, 5, 30], 20, 1)
    with pytest.raises(ValueError, match="2 samples cannot give each of dp_size=3"):
        token_budget_microbatches([5, 5], 20, 3)
    with pytest.raises(ValueError, match="non-empty micro-batches"):
        token_budget_microbatches([20, 20, 20], 20, 2)


@pytest.mark.parametrize("use_gas", [False, True])
def test_loss_scale_makes_the_step_one_token_mean(use_gas):
    """Simulate DeepSpeed: each rank backward()s loss / gas per micro-batch; gradients average over ranks."""
    lm = build_tiny_model("qwen2", "tiny", seed=3).train()
    lm.set_attn_implementation("sdpa")
    prompt_lens, response_lens = [3, 8, 2, 6, 4, 7, 5], [9, 1, 6, 2, 8, 3, 5]
    ids, mask, T = rollout_batch(prompt_lens, response_lens, seed=7)
    action = mask[:, -T:].float()
    advantages = torch.randn(ids.shape[0], T, generator=torch.Generator().manual_seed(2))

    reference = copy.deepcopy(lm)
    logp = response_logprobs(reference, ids, mask, T)
    (-(logp * advantages * action).sum() / action.sum()).backward()

    dp = 2
    plan = token_budget_microbatches(mask.sum(1).tolist(), 18, dp)
    assert len(plan[0]) > 1
    gas = len(plan[0]) if use_gas else 1
    scale = dp * gas / int(action.sum())  # the step's token mean: each rank's sum over N / dp tokens, x gas
    replicas = []
    for rank_plan in plan:
        replica = copy.deepcopy(lm)
        for micro in rank_plan:
            idx = torch.tensor(micro)
            logp = response_logprobs(replica, ids[idx], mask[idx], T)
            token_sum = -(logp * advantages[idx] * action[idx]).sum()
            (token_sum * scale / gas).backward()
        replicas.append(replica)
    for name, p in reference.named_parameters():
        averaged = sum(dict(r.named_parameters())[name].grad for r in replicas) / dp
        assert_grads_close(averaged, p.grad, name)


# ---- DeepSpeed ZeRO-3 and GPU ------------------------------------------------------------------------


@pytest.mark.slow
def test_through_a_deepspeed_zero3_engine(monkeypatch):
    """A ZeRO-3 engine (one CPU rank) given to response_logprobs: the same log-probs as the plain model,
    before and after one AdamW step taken through engine.backward / engine.step."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(key, value)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
    import deepspeed
    import torch.distributed as dist

    lm = build_tiny_model("llama", "tiny", seed=4).train()
    lm.set_attn_implementation("sdpa")
    ids, mask, T = rollout_batch(*CASES["very_uneven"], seed=9)
    action = mask[:, -T:]

    def loss_of(logp):
        return -(logp * action).sum() / action.sum()

    plain = copy.deepcopy(lm)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    expected = []
    for _ in range(2):
        logp, _ = padded_reference(plain, ids, mask, T)
        expected.append(logp.detach())
        plain_opt.zero_grad()
        loss_of(logp).backward()
        plain_opt.step()

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
        "steps_per_print": 10**9,
    }
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        model = copy.deepcopy(lm)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        for step in range(2):
            logp = response_logprobs(engine, ids, mask, T, chunk_tokens=7)
            # after the step: Adam divides by |grad|, which magnifies fp32 summation-order differences
            torch.testing.assert_close(logp.detach(), expected[step], atol=TOL if step == 0 else 1e-3, rtol=0)
            engine.backward(loss_of(logp))
            engine.step()
    finally:
        dist.destroy_process_group()
    assert (expected[1] - expected[0]).abs().max() > 0.1  # the step changed the model


@pytest.mark.gpu
def test_flash_attention_2_varlen_matches_padded():
    pytest.importorskip("flash_attn")
    lm = build_tiny_model("qwen2", "tiny", seed=5).to("cuda", torch.bfloat16)
    ids, mask, T = rollout_batch(*CASES["very_uneven"], seed=11)
    lm.set_attn_implementation("sdpa")
    with torch.no_grad():
        ref_logp, _ = padded_reference(lm, ids.cuda(), mask.cuda(), T)
        lm.set_attn_implementation("flash_attention_2")
        logp = response_logprobs(lm, ids, mask, T)
    assert logp.device.type == "cuda"
    torch.testing.assert_close(logp, ref_logp, atol=5e-2, rtol=0)


def test_chunk_size_does_not_change_results(models):
    lm, _ = models
    lm.set_attn_implementation("sdpa")
    ids, mask, T = rollout_batch(*CASES["one_token_response"], seed=4)
    with torch.no_grad():
        whole = response_logprobs(lm, ids, mask, T, with_entropy=True, chunk_tokens=10_000)
        one_by_one = response_logprobs(lm, ids, mask, T, with_entropy=True, chunk_tokens=1)
    for a, b in zip(whole, one_by_one):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)
