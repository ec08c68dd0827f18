"""Shared prompts (``--train.share_prompts``): the rows of one prompt compute it once, in a segment
``[prompt | response_1 | response_2 | ...]`` whose responses see the prompt and themselves only.

Specified by hand (the layout, the tree mask, the predicting slots), held to an independent reference (each row
run alone through the model's own forward, no packing) for log-probs, entropy, values and gradients, and the
micro-batch planner that keeps a group together, by hand."""

import random

import pytest
import torch
from test_packing_spec import _Recorder  # tests/ is on the path: the model that records its arguments

from rlhf_sg.experience import ActorUpdate, Experience
from rlhf_sg.models import ValueHeadModel
from rlhf_sg.packing import (
    SHARED_PROMPT_ATTENTION,
    SharedPromptBlocks,
    counting_block_layers,
    critic_values,
    default_segment_tokens,
    pack_shared_prompts,
    prompt_groups,
    response_logprobs,
    shared_prompt_microbatches,
    token_budget_microbatches,
    use_shared_prompt_attention,
)
from rlhf_sg.tiny import build_tiny_model

TOL = 2e-5


def _hand_batch():
    # prompt width 3, response width 3; rows 0 and 2 share the prompt [5, 6], row 1 has its own [9, 10, 11]
    ids = torch.tensor([[0, 5, 6, 7, 8, 0], [9, 10, 11, 12, 0, 0], [0, 5, 6, 13, 14, 15]])
    return ids, (ids != 0).long(), 3


def test_the_layout_by_hand():
    ids, mask, width = _hand_batch()
    rows = pack_shared_prompts(ids, mask, width)
    assert prompt_groups(ids, mask, width) == [[0, 2], [1]]
    assert rows.num_segments == 2
    # segments, longest first: [5, 6 | 7, 8 | 13, 14, 15] (7 tokens), then [9, 10, 11 | 12] (4), one row each
    assert rows.input_ids.tolist() == [[5, 6, 7, 8, 13, 14, 15], [9, 10, 11, 12, 0, 0, 0]]
    # responses continue the prompt's positions, each from the prompt's length
    assert rows.position_ids[0].tolist() == [0, 1, 2, 3, 2, 3, 4]
    assert rows.position_ids.dtype == torch.long and rows.input_ids.dtype == ids.dtype
    assert rows.position_ids[1, :4].tolist() == [0, 1, 2, 3]
    # response token (b, j) at flat b*T + j, predicted by the slot before it; a response's first token by the
    # prompt's last slot (slot 1 for both responses of row 0's segment)
    got = sorted(zip(rows.block_positions.tolist(), rows.predictor_slots.tolist(), rows.labels.tolist()))
    L = 7
    assert got == [
        (0, 1, 7), (1, 2, 8),                       # row 0: tokens 7, 8
        (3, L + 2, 12),                             # row 1: token 12, after its prompt's last slot
        (6, 1, 13), (7, 4, 14), (8, 5, 15),         # row 2: tokens 13, 14, 15
    ]
    # branches (prefix start, prefix length, own start, own length), flat slots: row 0's prompt, its two
    # responses after that prompt, then row 1's prompt and its response
    assert rows.branches.tolist() == [[0, 0, 0, 2], [0, 2, 2, 2], [0, 2, 4, 3], [L, 0, L, 3], [L, 3, L + 3, 1]]


def test_the_tree_mask_by_hand():
    ids, mask, width = _hand_batch()
    rows = pack_shared_prompts(ids, mask, width)
    allowed = torch.tensor([
        # 5  6  7  8 13 14 15
        [1, 0, 0, 0, 0, 0, 0],  # 5
        [1, 1, 0, 0, 0, 0, 0],  # 6
        [1, 1, 1, 0, 0, 0, 0],  # 7: the prompt and itself
        [1, 1, 1, 1, 0, 0, 0],  # 8
        [1, 1, 0, 0, 1, 0, 0],  # 13: the prompt, not its sibling 7, 8
        [1, 1, 0, 0, 1, 1, 0],  # 14
        [1, 1, 0, 0, 1, 1, 1],  # 15
    ], dtype=torch.bool)
    mask4 = rows.attention_mask()
    assert mask4.shape == (2, 1, 7, 7) and mask4.dtype == torch.bool
    assert torch.equal(mask4[0, 0], allowed)
    second = torch.zeros(7, 7, dtype=torch.bool)
    second[:4, :4] = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    second[4:, 4:] = torch.eye(3, dtype=torch.bool)  # pad slots see themselves only (no all-masked query)
    assert torch.equal(mask4[1, 0], second)
    additive = rows.attention_mask(torch.float32)
    assert torch.equal(additive[0, 0] == 0, allowed)
    assert rows.attention_mask(torch.bfloat16).dtype == torch.bfloat16  # the model's dtype, added to its scores
    assert (additive[0, 0][~allowed] == torch.finfo(torch.float32).min).all()


def test_a_group_longer_than_a_segment_is_split_evenly_each_part_with_its_prompt():
    prompt = [3, 4]
    ids = torch.tensor([prompt + [10 + i, 20 + i, 30 + i] for i in range(4)])
    rows = pack_shared_prompts(ids, torch.ones_like(ids), 3, segment_tokens=12)
    # 2 + 4 x 3 = 14 tokens > 12: two segments of two responses (8 tokens each), not 3 + 1 (11 and 5)
    assert rows.num_segments == 2
    assert sorted(r[:8] for r in rows.input_ids.tolist()) == [
        [3, 4, 10, 20, 30, 11, 21, 31], [3, 4, 12, 22, 32, 13, 23, 33]]
    with pytest.raises(ValueError, match="segment_tokens must be >= 1"):
        pack_shared_prompts(ids, torch.ones_like(ids), 3, segment_tokens=0)


def test_the_default_segment_is_the_hidden_size_on_the_tree_mask_and_uncapped_on_the_blocks():
    from rlhf_sg.packing import MAX_DEFAULT_SEGMENT_TOKENS, UNCAPPED_SEGMENT_TOKENS, stop_shared_prompt_attention
    from rlhf_sg.tiny import tiny_family_model

    model = build_tiny_model("qwen2", "tiny", seed=0)
    model.config._attn_implementation = "sdpa"
    assert default_segment_tokens(model) == model.config.hidden_size
    assert use_shared_prompt_attention(model)
    assert default_segment_tokens(model) == UNCAPPED_SEGMENT_TOKENS  # a response's cost is its prompt and itself
    windowed = tiny_family_model("gemma-3")  # its sliding layers need their mask: the cap keeps it bounded
    assert use_shared_prompt_attention(windowed) and default_segment_tokens(windowed) == MAX_DEFAULT_SEGMENT_TOKENS
    stop_shared_prompt_attention(model)
    assert model.config._attn_implementation == "sdpa" and default_segment_tokens(model) == model.config.hidden_size
    assert default_segment_tokens(torch.nn.Linear(2, 2)) == 2048
    for hidden, expected in ((1, 1), (0, 2048), (4096, 4096), (8192, 4096)):  # capped: the mask grows as L^2
        module = torch.nn.Linear(2, 2)
        module.config = type("Config", (), {"hidden_size": hidden})()
        assert default_segment_tokens(module) == expected


def _groups_batch(vocab: int, seed: int = 1):
    """12 rows, prompt width 6, response width 7: groups of 4, 3, 1 and 4 rows with prompts of unequal lengths
    and responses of unequal lengths."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    width, prompt_width = 7, 6
    ids = torch.zeros(12, prompt_width + width, dtype=torch.long)
    b = 0
    for size in (4, 3, 1, 4):
        p = rng.randint(1, prompt_width)
        prompt = torch.randint(1, vocab, (p,), generator=gen)
        for _ in range(size):
            r = rng.randint(1, width)
            ids[b, prompt_width - p : prompt_width] = prompt
            ids[b, prompt_width : prompt_width + r] = torch.randint(1, vocab, (r,), generator=gen)
            b += 1
    return ids, (ids != 0).long(), width


def _reference_logprobs(model, ids, mask, width):
    """Each row alone, its padding cut off, through the model's own forward: log-probs and entropy [B, T]."""
    logp = torch.zeros(ids.shape[0], width)
    entropy = torch.zeros(ids.shape[0], width)
    prompt_width = ids.shape[1] - width
    for b in range(ids.shape[0]):
        real = ids[b][mask[b].bool()][None]
        p = int(mask[b, :prompt_width].sum())
        logits = model(input_ids=real, use_cache=False).logits[0].float()
        dist = torch.log_softmax(logits[p - 1 : -1], dim=-1)
        n = real.shape[1] - p
        logp[b, :n] = dist.gather(-1, real[0, p:, None]).squeeze(-1)
        entropy[b, :n] = -(dist.exp() * dist).sum(-1)
    return logp, entropy


@pytest.mark.parametrize("impl", ["sdpa", "eager", "blocks"])
@pytest.mark.parametrize("segment_tokens", [None, 8])
def test_log_probs_entropy_and_gradients_are_each_rows_own(impl, segment_tokens):
    """``blocks``: the model switched to the shared-prompt attention, whose every layer must take the blocks (the
    tiny model's grouped key / value heads included)."""
    model = build_tiny_model("qwen2", "tiny", seed=0)
    model.config._attn_implementation = "sdpa" if impl == "blocks" else impl
    ids, mask, width = _groups_batch(model.config.vocab_size)
    weights = torch.linspace(-1.0, 1.0, width)  # unequal weights per column: no cancelling errors

    ref_logp, ref_entropy = _reference_logprobs(model, ids, mask, width)
    action = mask[:, -width:].bool()
    model.zero_grad()
    ((ref_logp * weights)[action]).sum().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]

    model.zero_grad()
    if impl == "blocks":
        assert use_shared_prompt_attention(model) and model.config._attn_implementation == SHARED_PROMPT_ATTENTION
    with counting_block_layers() as counted:
        logp, entropy = response_logprobs(model, ids, mask, width, with_entropy=True, share_prompts=True,
                                          segment_tokens=segment_tokens)
    ((logp * weights)[action]).sum().backward()
    assert counted[0] == (model.config.num_hidden_layers if impl == "blocks" else 0)
    assert torch.allclose(logp.detach(), ref_logp.detach(), atol=TOL)
    assert torch.allclose(entropy.detach(), ref_entropy.detach(), atol=TOL)
    assert (logp[~action] == 0).all() and (entropy[~action] == 0).all()
    for got, want in zip((p.grad for p in model.parameters()), ref_grads):
        assert torch.allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("blocks", [False, True], ids=["mask", "blocks"])
def test_critic_values_are_each_rows_own(blocks):
    critic = ValueHeadModel(build_tiny_model("qwen2", "tiny", seed=0).model)
    critic.config._attn_implementation = "sdpa"
    if blocks:
        assert use_shared_prompt_attention(critic)
    ids, mask, width = _groups_batch(critic.config.vocab_size, seed=3)
    with counting_block_layers() as counted:
        shared = critic_values(critic, ids, mask, width, share_prompts=True)
    assert counted[0] == (critic.config.num_hidden_layers if blocks else 0)
    prompt_width = ids.shape[1] - width
    for b in range(ids.shape[0]):
        real = ids[b][mask[b].bool()][None]
        p = int(mask[b, :prompt_width].sum())
        values = critic(input_ids=real, use_cache=False)[0]  # [L]: the value at each position
        n = real.shape[1] - p
        assert torch.allclose(shared[b, :n], values[p - 1 : -1].float(), atol=TOL), b
        assert (shared[b, n:] == 0).all()


def test_varlen_attention_is_refused_with_what_to_do():
    model = build_tiny_model("qwen2", "tiny", seed=0)
    ids, mask, width = _groups_batch(model.config.vocab_size)
    with pytest.raises(ValueError, match="share_prompts=False"):
        response_logprobs(model, ids, mask, width, share_prompts=True, attn_implementation="flash_attention_2")


def test_the_actor_loss_is_the_same_shared_or_not():
    from rlhf_sg.algorithms import ActorLossConfig
    from rlhf_sg.workers import actor_microbatch_loss

    model = build_tiny_model("qwen2", "tiny", seed=0)
    model.config._attn_implementation = "sdpa"
    ids, mask, width = _groups_batch(model.config.vocab_size, seed=5)
    action = mask[:, -width:].bool()
    mb = Experience(sequences=ids, attention_mask=mask, action_mask=action,
                    rollout_logp=torch.zeros(ids.shape[0], width))
    mb.advantages = torch.linspace(-2.0, 3.0, ids.shape[0])[:, None].expand(-1, width) * action
    losses, grads = [], []
    for share in (False, True):
        update = ActorUpdate(loss=ActorLossConfig(clip_low=0.2, clip_high=0.3), old_logp_from_update=True,
                             share_prompts=share)
        model.zero_grad()
        loss, _ = actor_microbatch_loss(model, mb, update, normalizer=float(action.sum()))
        loss.backward()
        losses.append(loss.item())
        grads.append([p.grad.clone() for p in model.parameters()])
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-5)


# ---- the planner ----------------------------------------------------------------------------------------


def test_a_group_stays_in_one_microbatch_and_its_prompt_counts_once():
    # two groups of 3 samples: prompt 10 tokens, responses 5 (15 tokens a sample, 45 unshared, 25 shared)
    groups, prompts, lengths = [[0, 1, 2], [3, 4, 5]], [10] * 6, [15] * 6
    assert shared_prompt_microbatches(groups, prompts, lengths, 50, 1) == [[[0, 1, 2, 3, 4, 5]]]
    # unshared, the same budget needs two micro-batches (90 tokens) and splits the groups by length only
    assert len(token_budget_microbatches(lengths, 50, 1)[0]) == 2
    # a budget of 25 holds one whole group each
    assert shared_prompt_microbatches(groups, prompts, lengths, 25, 1) == [[[0, 1, 2], [3, 4, 5]]]


def test_groups_are_halved_only_as_far_as_the_budget_or_the_ranks_need():
    groups, prompts, lengths = [[0, 1, 2, 3]], [10] * 4, [15] * 4
    # 10 + 4 x 5 = 30 > 24: halves of 20 tokens each
    assert shared_prompt_microbatches(groups, prompts, lengths, 24, 1) == [[[0, 1], [2, 3]]]
    # one group, two ranks: halves, one each
    assert shared_prompt_microbatches(groups, prompts, lengths, 100, 2) == [[[0, 1]], [[2, 3]]]
    # down to single samples it is the unshared planner, with its errors
    with pytest.raises(ValueError, match="more than max_tokens_per_microbatch"):
        shared_prompt_microbatches(groups, prompts, lengths, 14, 1)


def test_every_sample_is_planned_once_within_the_budget():
    rng = random.Random(0)
    groups, prompts, lengths, i = [], [], [], 0
    for _ in range(9):
        size, p = rng.randint(1, 6), rng.randint(1, 30)
        groups.append(list(range(i, i + size)))
        for _ in range(size):
            prompts.append(p)
            lengths.append(p + rng.randint(1, 40))
        i += size
    budget, world = 120, 2
    plan = shared_prompt_microbatches(groups, prompts, lengths, budget, world)
    assert len(plan) == world and len({len(rank) for rank in plan}) == 1
    planned = sorted(s for rank in plan for micro in rank for s in micro)
    assert planned == list(range(i))
    group_of = {s: g for g, members in enumerate(groups) for s in members}
    for rank in plan:
        for micro in rank:
            computed = 0
            for g in {group_of[s] for s in micro}:
                members = [s for s in micro if group_of[s] == g]
                computed += prompts[members[0]] + sum(lengths[s] - prompts[s] for s in members)
            assert computed <= budget


# ---- what the model is called with, and what is refused ----------------------------------------------------


def test_the_model_gets_the_tree_mask_positions_no_cache_and_the_callers_arguments():
    from rlhf_sg.packing import _shared_forward

    ids, mask, width = _hand_batch()
    rows = pack_shared_prompts(ids, mask, width)
    for impl in ("sdpa", "eager"):  # both an additive mask in the model's dtype
        model = _Recorder(impl)
        _shared_forward(model, rows, impl, logits_to_keep=7)
        (kwargs,) = model.calls
        assert kwargs["use_cache"] is False  # a KV cache would let responses attend to their siblings
        assert kwargs["logits_to_keep"] == 7
        assert torch.equal(kwargs["position_ids"], rows.position_ids)
        assert kwargs["attention_mask"].dtype == torch.float32
        assert torch.equal(kwargs["attention_mask"], rows.attention_mask(torch.float32))
        assert torch.equal(kwargs["attention_mask"] == 0, rows.attention_mask())


def test_refusals_say_what_to_do():
    from rlhf_sg.packing import _shared_forward

    ids, mask, width = _hand_batch()
    rows = pack_shared_prompts(ids, mask, width)  # rows of 7 slots
    with pytest.raises(ValueError) as err:
        _shared_forward(_Recorder("flash_attention_2"), rows, "flash_attention_2")
    assert str(err.value) == (
        "shared prompts need an attention that takes a mask (('sdpa', 'eager')); flash_attention_2 (varlen) cannot "
        "keep sibling responses apart: pass share_prompts=False")
    # a sliding window from positions: a response's positions continue its prompt's, so q - k is the distance in
    # its own row; the shared mask is the unwindowed one with pos[q] - pos[k] >= window removed
    sliding = _Recorder("sdpa", layer_types=["full_attention", "sliding_attention"], sliding_window=2)
    _shared_forward(sliding, rows, "sdpa")
    masks = {t: m == 0 for t, m in sliding.calls[0]["attention_mask"].items()}
    full = rows.attention_mask()
    pos = rows.position_ids
    assert torch.equal(masks["full_attention"], full)
    assert torch.equal(masks["sliding_attention"], full & (pos[:, None, :, None] - pos[:, None, None, :] < 2))
    assert not torch.equal(masks["sliding_attention"], full)  # the window matters in these rows
    bare = _Recorder("sdpa")
    del bare.config  # a module without a config, its attention named by the caller
    _shared_forward(bare, rows, "sdpa")
    assert len(bare.calls) == 1


def test_segments_fit_exactly_and_never_fall_below_the_longest_sequence():
    prompt = [3, 4]
    ids = torch.tensor([prompt + [10 + i, 20 + i, 30 + i] for i in range(4)])
    ones = torch.ones_like(ids)
    # 2 + 4 x 3 = 14 tokens: a segment of exactly 14 holds the whole group
    assert pack_shared_prompts(ids, ones, 3, segment_tokens=14).num_segments == 1
    assert pack_shared_prompts(ids, ones, 3, segment_tokens=13).num_segments == 2
    # a segment smaller than a sequence (5 tokens) still takes one whole sequence
    rows = pack_shared_prompts(ids, ones, 3, segment_tokens=1)
    assert rows.num_segments == 4 and rows.input_ids.shape[1] == 5


def test_only_a_repeated_prompt_counts_as_shared():
    from rlhf_sg.packing import _shared_groups

    ids, mask, width = _hand_batch()
    model = _Recorder("sdpa")
    assert _shared_groups(model, True, ids[:2], mask[:2], width) is None  # rows 0, 1: different prompts, plain packing
    assert _shared_groups(model, True, ids, mask, width) == [[0, 2], [1]]  # rows 0 and 2 share one
    assert _shared_groups(model, False, ids, mask, width) is None  # not asked
    recurrent = _Recorder("sdpa", layer_types=["linear_attention", "full_attention"])
    assert _shared_groups(recurrent, True, ids, mask, width) is None  # its layers cannot share a row


def test_an_empty_batch_is_refused_as_the_unshared_planner_refuses_it():
    with pytest.raises(ValueError) as shared:
        shared_prompt_microbatches([], [], [], 10, 1)
    with pytest.raises(ValueError) as plain:
        token_budget_microbatches([], 10, 1)
    assert str(shared.value) == str(plain.value)


def test_a_large_group_is_cut_into_quarters_when_halves_do_not_fit():
    # 8 samples: prompt 10, responses 5; half a group costs 10 + 20 = 30, a quarter 10 + 10 = 20
    groups, prompts, lengths = [list(range(8))], [10] * 8, [15] * 8
    assert shared_prompt_microbatches(groups, prompts, lengths, 20, 1) == [[[0, 1], [2, 3], [4, 5], [6, 7]]]


def _segments(prompt_len, responses, segment_tokens):
    """The segments pack_shared_prompts makes of one group: each a list of its responses' lengths."""
    width = max(responses)
    ids = torch.zeros(len(responses), prompt_len + width, dtype=torch.long)
    for b, n in enumerate(responses):
        ids[b, :prompt_len] = torch.arange(1, prompt_len + 1)
        ids[b, prompt_len : prompt_len + n] = 100 + b  # each response's tokens name its row
    rows = pack_shared_prompts(ids, (ids != 0).long(), width, segment_tokens)
    segments = []
    for row in rows.input_ids.tolist():
        current = []
        for token in row[prompt_len:]:
            if token == 1:  # the next segment's prompt
                segments.append(current)
                current = []
            elif token >= 100 and (not current or current[-1][0] != token):
                current.append([token])
            elif token >= 100:
                current[-1].append(token)
        segments.append(current)
    return sorted([len(r) for r in s] for s in segments if s), rows


@pytest.mark.parametrize("responses, segment_tokens, expected", [
    # 16 response tokens, at most 10 a segment: two of about 8; the second response (8) would overfill the first
    # segment (2 + 4 + 8 = 14 > 12) though it is only half past the even share: every segment keeps to the cap
    ([4, 8, 4], 12, [[4], [4], [8]]),
    # 6 response tokens, at most 4 a segment: two of 3; the second response lands exactly on the share (2 + 1 = 3)
    ([2, 2, 2], 6, [[2], [2, 2]]),
    # 7 tokens, at most 6 a segment: shares of 3.5; the 4-token response goes past it by half of itself
    ([2, 4, 1], 8, [[1], [2], [4]]),
    # after a cut the new segment starts empty: 1 + 3 fits the 4 tokens a segment may hold
    ([4, 1, 3], 6, [[1, 3], [4]]),
    # a segment smaller than the longest sequence (6) is raised to it: the two short responses still share
    ([1, 1, 4], 1, [[1, 1], [4]]),
])
def test_segments_keep_to_the_cap_and_to_an_even_share(responses, segment_tokens, expected):
    got, rows = _segments(2, responses, segment_tokens)
    assert got == expected
    assert rows.input_ids.shape[1] <= max(segment_tokens, 2 + max(responses))  # the cap, or the longest sequence


def test_rows_compute_their_own_prompt_unless_asked_and_the_default_segment_is_the_hidden_size(monkeypatch):
    import rlhf_sg.packing as packing

    model = build_tiny_model("qwen2", "tiny", seed=0)
    model.config._attn_implementation = "sdpa"
    critic = ValueHeadModel(build_tiny_model("qwen2", "tiny", seed=0).model)
    critic.config._attn_implementation = "sdpa"
    ids, mask, width = _groups_batch(model.config.vocab_size)
    seen = []
    real = packing.pack_shared_prompts
    monkeypatch.setattr(packing, "pack_shared_prompts", lambda *a, **k: seen.append(a[3]) or real(*a, **k))
    response_logprobs(model, ids, mask, width)
    critic_values(critic, ids, mask, width)
    assert seen == []  # off by default
    response_logprobs(model, ids, mask, width, share_prompts=True)
    critic_values(critic, ids, mask, width, share_prompts=True)
    assert seen == [model.config.hidden_size, critic.config.hidden_size]


def test_the_model_is_asked_for_no_logits_of_its_own_on_shared_rows():
    model = build_tiny_model("qwen2", "tiny", seed=0)
    model.config._attn_implementation = "sdpa"
    ids, mask, width = _groups_batch(model.config.vocab_size)
    asked = []
    model.register_forward_pre_hook(lambda _m, _a, kwargs: asked.append(kwargs.get("logits_to_keep")),
                                    with_kwargs=True)
    response_logprobs(model, ids, mask, width, share_prompts=True)
    (keep,) = asked
    assert isinstance(keep, torch.Tensor) and keep.numel() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("blocks", [False, True], ids=["tree-mask", "blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_shared_log_probs_and_gradients_are_each_rows_own(dtype, blocks):
    """On a GPU, sdpa takes the tree mask through its memory-efficient kernel (CPU runs its flash kernel with a
    mask): the shared log-probs and gradients must still be each row's own, in fp32 and bf16, with the rows
    built, masked and gathered on the device. ``blocks``: the shared-prompt attention's blocks on CUDA in every layer,
    unmasked (a response's causal attention aligned at the lower right): the flash kernel takes the grouped key /
    value heads as they are in bf16; in fp32 they are repeated for the memory-efficient kernel."""
    model = build_tiny_model("qwen2", "tiny", seed=0).to("cuda", dtype)
    model.config._attn_implementation = "sdpa"
    if blocks:
        assert use_shared_prompt_attention(model)
    ids, mask, width = _groups_batch(model.config.vocab_size)
    ids, mask = ids.cuda(), mask.cuda()
    action = mask[:, -width:].bool()
    results = []
    for share in (False, True):
        model.zero_grad()
        with counting_block_layers() as counted:
            logp = response_logprobs(model, ids, mask, width, share_prompts=share)
        assert counted[0] == (model.config.num_hidden_layers if share and blocks else 0)
        logp[action].sum().backward()
        results.append((logp.detach().float(), [p.grad.float().clone() for p in model.parameters()]))
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    assert results[1][0].device.type == "cuda"
    assert torch.allclose(results[0][0], results[1][0], atol=tol)
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.allclose(a, b, atol=tol * 10)


def test_the_blocks_compute_what_the_tree_mask_computes_and_hand_every_other_call_to_sdpa(monkeypatch):
    """The attention function against sdpa on the tree mask, layer-sized random inputs with grouped heads: equal
    outputs and input gradients; a call with another mask (a sliding layer's), a window or dropout goes to sdpa."""
    from transformers.integrations import sdpa_attention

    from rlhf_sg.packing import shared_prompt_attention

    ids, mask, width = _groups_batch(128)
    rows = pack_shared_prompts(ids, mask, width, segment_tokens=8)
    tree = rows.attention_mask(torch.float32)
    blocks = SharedPromptBlocks.build(rows, tree)
    R, L = rows.input_ids.shape
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(R, h, L, 8, generator=gen, requires_grad=True) for h in (4, 2, 2))

    class Layer(torch.nn.Module):
        num_key_value_groups, is_causal, training = 2, True, False

    want, _ = sdpa_attention.sdpa_attention_forward(Layer(), q, k, v, tree, scaling=0.3)
    with counting_block_layers() as counted:
        got, _ = shared_prompt_attention(Layer(), q, k, v, tree, shared_prompt_blocks=blocks, scaling=0.3)
        assert counted[0] == 1
    assert got.shape == want.shape == (R, L, 4, 8)
    real = rows.holders > 0  # the slots of real tokens
    assert torch.allclose(got[real], want[real], atol=1e-6)
    assert (got[~real] == 0).all()
    weights = torch.randn(want[real].shape, generator=gen)
    grads = [torch.autograd.grad((out[real] * weights).sum(), (q, k, v)) for out in (want, got)]
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-5)

    handed = []
    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", lambda *a, **kw: handed.append(kw) or (None, None))
    windowed = rows.attention_mask(torch.float32, window=2)
    with counting_block_layers() as counted:
        shared_prompt_attention(Layer(), q, k, v, windowed, shared_prompt_blocks=blocks)
        shared_prompt_attention(Layer(), q, k, v, tree, shared_prompt_blocks=blocks, sliding_window=4)
        shared_prompt_attention(Layer(), q, k, v, tree, shared_prompt_blocks=blocks, dropout=0.1)
        shared_prompt_attention(Layer(), q, k, v, tree)
    assert len(handed) == 4 and counted[0] == 0


def test_a_windowed_layer_computes_its_own_mask_and_the_rest_take_the_blocks():
    """Gemma-3's sliding and full layers: the sliding one gets its windowed mask from sdpa, the full one the blocks,
    and the log-probs stay each row's own (sequences longer than the window)."""
    from rlhf_sg.tiny import tiny_family_model

    model = tiny_family_model("gemma-3")
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    ids, mask, width = _groups_batch(model.config.vocab_size)
    ref_logp, _ = _reference_logprobs(model, ids, mask, width)
    assert use_shared_prompt_attention(model)
    with counting_block_layers() as counted:
        logp = response_logprobs(model, ids, mask, width, share_prompts=True, segment_tokens=8)
    assert counted[0] == 1
    assert torch.allclose(logp, ref_logp, atol=TOL)


def test_only_an_sdpa_model_is_switched_and_its_saved_config_does_not_name_the_switch(tmp_path):
    """An eager model keeps its attention; a switched one saves a config that loads anywhere (the attention
    implementation is not written), and its unshared forwards are sdpa's."""
    import json

    eager = build_tiny_model("qwen2", "tiny", seed=0)
    eager.config._attn_implementation = "eager"
    assert not use_shared_prompt_attention(eager) and eager.config._attn_implementation == "eager"
    model = build_tiny_model("qwen2", "tiny", seed=0)
    model.config._attn_implementation = "sdpa"
    ids = torch.tensor([[5, 6, 7, 8]])
    before = model(input_ids=ids).logits
    assert use_shared_prompt_attention(model)
    assert torch.equal(model(input_ids=ids).logits, before)
    model.save_pretrained(tmp_path)
    assert SHARED_PROMPT_ATTENTION not in (tmp_path / "config.json").read_text()
    assert "attn_implementation" not in json.loads((tmp_path / "config.json").read_text())


def test_the_blocks_of_a_long_group_hold_a_fraction_of_the_tree_masks_bytes():
    """Memory at a real size: a 1024-token prompt and 8 responses of 2048 (one 17,408-token segment), bf16. The tree
    mask of that row would be 17,408^2 x 2 bytes (578 MiB); the blocks hold their indices and no mask (a response's
    causal attention over its prompt and itself is aligned at the lower right), and what stands in for the tree mask
    holds one element."""
    from rlhf_sg.packing import _TreeMaskStandIn

    prompt, responses, n = 1024, 2048, 8
    ids = torch.ones(n, prompt + responses, dtype=torch.long)
    rows = pack_shared_prompts(ids, torch.ones_like(ids), responses, segment_tokens=prompt + n * responses)
    assert rows.input_ids.shape == (1, prompt + n * responses)
    stand_in = _TreeMaskStandIn(torch.nn.Linear(1, 1), rows, torch.bfloat16)
    assert stand_in.shape == (1, 1, rows.num_slots, rows.num_slots) and stand_in.dtype == torch.bfloat16
    blocks = SharedPromptBlocks.build(rows, stand_in)
    tensors = (blocks.prompt_slots, *(t for pair in blocks.responses for t in pair), blocks.slot_index, blocks.mask)
    held = sum(t.untyped_storage().nbytes() for t in tensors)
    tree = rows.num_slots**2 * 2
    assert stand_in.untyped_storage().nbytes() == 2 and stand_in._tree is None  # never built
    assert [k.shape for _, k in blocks.responses] == [(n, prompt + responses)]
    assert held < tree / 50, (held, tree)


def test_a_checkpointed_backward_recomputes_on_the_blocks_and_gives_the_same_gradients():
    """transformers' gradient checkpointing replays a layer with its keywords: the recomputation takes the blocks
    too (twice the layer calls), and the gradients are those of the plain backward, bit for bit."""
    grads, calls = [], []
    for checkpointed in (False, True):
        model = build_tiny_model("qwen2", "tiny", seed=0)
        model.config._attn_implementation = "sdpa"
        model.train()
        assert use_shared_prompt_attention(model)
        if checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ids, mask, width = _groups_batch(model.config.vocab_size)
        with counting_block_layers() as counted:
            response_logprobs(model, ids, mask, width, share_prompts=True).sum().backward()
        calls.append(counted[0])
        grads.append([p.grad.clone() for p in model.parameters()])
    layers = model.config.num_hidden_layers
    assert calls == [layers, 2 * layers]
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_lora_model_keeps_the_blocks_under_its_adapter_wrapper():
    from rlhf_sg.lora import LoraSpec, apply_lora

    model = build_tiny_model("qwen2", "tiny", seed=0)
    model.config._attn_implementation = "sdpa"
    assert use_shared_prompt_attention(model)
    wrapped = apply_lora(model, LoraSpec(rank=4, alpha=8), True, trainable=True)
    ids, mask, width = _groups_batch(model.config.vocab_size)
    with counting_block_layers() as counted:
        logp = response_logprobs(wrapped, ids, mask, width, share_prompts=True)
    reference, _ = _reference_logprobs(wrapped, ids, mask, width)
    assert counted[0] == model.config.num_hidden_layers
    assert torch.allclose(logp, reference, atol=TOL)


def test_blocks_that_would_cost_more_than_the_tree_mask_are_not_taken_unless_the_probe_asks():
    """One long response among short ones pads every response's block to it: then the pairs exceed the rows' R L^2
    and the forward keeps the tree mask (exact either way); the start-up probe's context takes them anyway."""
    from rlhf_sg.packing import blocks_whatever_they_cost

    model = build_tiny_model("qwen2", "tiny", seed=0)
    model.config._attn_implementation = "sdpa"
    assert use_shared_prompt_attention(model)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    lengths = [40] + [2] * 7 + [2] * 8  # two groups of 8; one long response in the first
    prompt_width, width = 3, max(lengths)
    ids = torch.zeros(len(lengths), prompt_width + width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, :prompt_width] = torch.tensor([5, 6, 7]) if b < 8 else torch.tensor([8, 9, 10])
        ids[b, prompt_width : prompt_width + n] = torch.randint(3, vocab, (n,), generator=gen)
        mask[b, : prompt_width + n] = 1
    rows = pack_shared_prompts(ids, mask, width, segment_tokens=4096)
    assert not SharedPromptBlocks.pays(rows)
    reference, _ = _reference_logprobs(model, ids, mask, width)
    with counting_block_layers() as counted:
        logp = response_logprobs(model, ids, mask, width, share_prompts=True)
    assert counted[0] == 0 and torch.allclose(logp, reference, atol=TOL)
    with blocks_whatever_they_cost(), counting_block_layers() as counted:
        logp = response_logprobs(model, ids, mask, width, share_prompts=True)
    assert counted[0] == model.config.num_hidden_layers and torch.allclose(logp, reference, atol=TOL)


def _long_groups_batch(vocab: int):
    """Two groups, each longer than a segment cap of 8 tokens: a prompt of 5 with 4 responses of 2 to 6, and a prompt
    of 3 with 3 responses of 4 to 6. Each row alone fits the cap."""
    gen = torch.Generator().manual_seed(7)
    width, prompt_width = 6, 5
    ids = torch.zeros(7, prompt_width + width, dtype=torch.long)
    for members, p, lengths in (((0, 1, 2, 3), 5, (6, 2, 4, 5)), ((4, 5, 6), 3, (4, 6, 5))):
        prompt = torch.randint(1, vocab, (p,), generator=gen)
        for b, r in zip(members, lengths):
            ids[b, prompt_width - p : prompt_width] = prompt
            ids[b, prompt_width : prompt_width + r] = torch.randint(1, vocab, (r,), generator=gen)
    return ids, (ids != 0).long(), width


@pytest.mark.parametrize("heads", ["grouped", "repeated"])
def test_a_group_longer_than_the_cap_is_one_segment_on_the_blocks_its_prompt_computed_once(monkeypatch, heads):
    """On a model whose every layer takes the blocks, a group is one segment however long its responses: with the cap
    lowered to 8 tokens, groups of 5 + 17 and 3 + 15 tokens each compute their prompt once (the model is handed
    exactly the batch's 40 distinct real tokens, no copy of a prompt, no padding), no [L, L] tree mask is built, and
    log-probs, entropy and gradients are each row's own, with the key / value heads handed to sdpa grouped (CPU, and
    CUDA's flash kernel) or repeated (where no kernel takes them grouped)."""
    import rlhf_sg.packing as packing

    monkeypatch.setattr(packing, "MAX_DEFAULT_SEGMENT_TOKENS", 8)
    if heads == "repeated":
        monkeypatch.setattr(packing, "_takes_grouped_heads", lambda *a: False)
    model = build_tiny_model("qwen2", "tiny", seed=0)
    model.config._attn_implementation = "sdpa"
    ids, mask, width = _long_groups_batch(model.config.vocab_size)
    weights = torch.linspace(-1.0, 1.0, width)
    action = mask[:, -width:].bool()
    ref_logp, ref_entropy = _reference_logprobs(model, ids, mask, width)
    model.zero_grad()
    ((ref_logp * weights)[action]).sum().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]

    assert use_shared_prompt_attention(model)
    handed, built = [], []
    model.model.embed_tokens.register_forward_pre_hook(lambda _m, args: handed.append(args[0].shape))
    tree = packing.SharedPromptRows.attention_mask
    monkeypatch.setattr(packing.SharedPromptRows, "attention_mask", lambda *a, **k: built.append(1) or tree(*a, **k))
    model.zero_grad()
    with counting_block_layers() as counted:
        logp, entropy = response_logprobs(model, ids, mask, width, with_entropy=True, share_prompts=True)
    ((logp * weights)[action]).sum().backward()
    assert handed == [(1, 5 + 17 + 3 + 15)]  # one row: each prompt once, every response, nothing else
    assert built == [] and counted[0] == model.config.num_hidden_layers
    assert torch.allclose(logp.detach(), ref_logp.detach(), atol=TOL)
    assert torch.allclose(entropy.detach(), ref_entropy.detach(), atol=TOL)
    for got, want in zip((p.grad for p in model.parameters()), ref_grads):
        assert torch.allclose(got, want, atol=1e-4)


def test_segments_of_the_blocks_are_whole_groups_unless_the_blocks_cost_more(monkeypatch):
    """``shared_prompt_segments`` at the blocks' size (what the ranks and the FLOP accounting cut): each group whole
    past the cap; one long response among short ones of its prompt (every response's block padded to it, more than
    twice the rows the tree mask keeps) is cut at the cap for the tree mask, as the ranks then run it."""
    import rlhf_sg.packing as packing
    from rlhf_sg.packing import UNCAPPED_SEGMENT_TOKENS, shared_prompt_segments

    monkeypatch.setattr(packing, "MAX_DEFAULT_SEGMENT_TOKENS", 8)
    groups = [[0, 1, 2, 3], [4, 5, 6]]
    prompts, responses = [5] * 4 + [3] * 3, [6, 2, 4, 5, 4, 6, 5]
    assert shared_prompt_segments(groups, prompts, responses, UNCAPPED_SEGMENT_TOKENS) == groups
    assert shared_prompt_segments(groups, prompts, responses, 8) == [[0], [1], [2], [3], [4], [5], [6]]
    long_tail = [40] + [1] * 7
    cut = shared_prompt_segments([list(range(8))], [2] * 8, long_tail, UNCAPPED_SEGMENT_TOKENS)
    assert cut == shared_prompt_segments([list(range(8))], [2] * 8, long_tail, 42) == [[0], list(range(1, 8))]
    # the rows the ranks pack: the whole groups in one row; the long tail cut, in rows of the longest segment
    ids, mask, width = _long_groups_batch(100)
    rows = pack_shared_prompts(ids, mask, width, UNCAPPED_SEGMENT_TOKENS)
    assert rows.num_segments == 2 and rows.input_ids.shape == (1, 40)
    ids = torch.zeros(8, 42, dtype=torch.long)
    ids[:, :2] = 5
    for b, n in enumerate(long_tail):
        ids[b, 2 : 2 + n] = 7
    rows = pack_shared_prompts(ids, (ids != 0).long(), 40, UNCAPPED_SEGMENT_TOKENS)
    assert rows.num_segments == 2 and rows.input_ids.shape == (2, 42)


def test_a_layer_that_does_not_take_the_blocks_gets_the_tree_mask_built_on_use(caplog):
    """The stand-in for the tree mask holds no mask; a layer handed a copy of it (as DeepSpeed's ZeRO-3 hooks copy a
    module's positional inputs) computes with the real tree mask, built then, with a warning that names it, and the
    model's later segments are capped again; the log-probs stay each row's own."""
    import logging

    from rlhf_sg.packing import MAX_DEFAULT_SEGMENT_TOKENS, UNCAPPED_SEGMENT_TOKENS

    model = build_tiny_model("qwen2", "tiny", seed=0)
    model.config._attn_implementation = "sdpa"
    ids, mask, width = _long_groups_batch(model.config.vocab_size)
    reference, _ = _reference_logprobs(model, ids, mask, width)
    assert use_shared_prompt_attention(model) and default_segment_tokens(model) == UNCAPPED_SEGMENT_TOKENS

    def copy_mask(_layer, args, kwargs):
        return args, {**kwargs, "attention_mask": kwargs["attention_mask"].detach()}

    model.model.layers[0].register_forward_pre_hook(copy_mask, with_kwargs=True)
    with caplog.at_level(logging.WARNING, logger="rlhf_sg.packing"), counting_block_layers() as counted:
        logp = response_logprobs(model, ids, mask, width, share_prompts=True)
    assert counted[0] == model.config.num_hidden_layers - 1
    assert torch.allclose(logp, reference, atol=TOL)
    assert "a layer did not take the shared-prompt blocks" in caplog.text and "[1, 1, 40, 40] tree mask" in caplog.text
    assert default_segment_tokens(model) == MAX_DEFAULT_SEGMENT_TOKENS


def test_a_model_with_attention_dropout_keeps_capped_segments_on_the_blocks():
    """Layers decline the blocks in training when their attention has dropout (--train.disable_dropout false), which
    the start-up probe, in eval mode, does not see; such a model keeps segments of MAX_DEFAULT_SEGMENT_TOKENS, so the
    first training forward never builds an uncapped segment's whole tree mask."""
    from rlhf_sg.packing import MAX_DEFAULT_SEGMENT_TOKENS, UNCAPPED_SEGMENT_TOKENS, default_segment_tokens
    from rlhf_sg.packing import use_shared_prompt_attention as switch
    from rlhf_sg.tiny import build_tiny_model

    model = build_tiny_model("qwen2", "tiny")
    switch(model)
    assert default_segment_tokens(model) == UNCAPPED_SEGMENT_TOKENS
    model.config.attention_dropout = 0.1
    assert default_segment_tokens(model) == MAX_DEFAULT_SEGMENT_TOKENS
