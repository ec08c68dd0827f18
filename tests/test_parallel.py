"""Sequence parallelism (Ulysses, rlhf_sg.parallel): N ranks on gloo equal one rank.

The multi-rank tests run each rank in a process of its own (:mod:`zero3_rank`), every collective of the group failing
after :data:`TIMEOUT_S`; one group of each size is spawned for the whole module and computes every check at that size
(:data:`GROUP_CASES`), each test asserting on its share. Each rank computes the log-probs, entropy and values of one
packed batch, the loss from them (the convention of rlhf_sg.parallel.forward: the whole batch's loss on every rank)
and its gradients, which the test sums over the SP group (what ZeRO-3 does given SP groups); all of that must equal
the one-rank packed forward, itself held to each row alone (tests/test_packing.py).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import functools
import os

import flash_reference
import pytest
import torch
from test_packing import TOL, assert_grads_close, padded_reference, rollout_batch, value_reference

from rlhf_sg.config import ConfigError
from rlhf_sg.packing import pack, pack_values
from rlhf_sg.parallel import check_sequence_parallel_heads, padded_width, shard_packed, sizes_that_split

#: prompt and response lengths: rows of 14 tokens (14 | 13 | 7 + 5), so row 2 packs two sequences, and sequence 0's
#: response (columns 5..13) crosses the shard edges of N = 2 (column 7) and N = 4 (columns 8 and 12 of 16)
PROMPTS, RESPONSES = [5, 3, 7, 2], [9, 4, 6, 3]
#: rows sharing prompts: rows 0-2 one prompt of 5 tokens, rows 3-4 one of 3, row 5 its own. On the tree mask (the
#: tiny model's 64-token segments) the segments are 25, 10 and 6 tokens: rows of 25 (the second 16 and its padding),
#: so N = 2 and 4 add pad columns; on the blocks one row of 41. Row 0's response crosses the shard edges.
SHARED = ([5, 5, 5, 3, 3, 2], [9, 4, 7, 5, 2, 4], [[0, 1, 2], [3, 4]])
TIMEOUT_S = 60
ENTROPY_COEF = 0.1


# ---- one process -----------------------------------------------------------------------------------------------


def test_sizes_that_split_follow_the_heads():
    assert sizes_that_split(4, 2) == [1, 2, 4]  # the tiny preset: 4 replicates the 2 key/value heads
    assert sizes_that_split(10, 5) == [1, 5, 10]
    assert sizes_that_split(32, 8) == [1, 2, 4, 8, 16, 32]
    assert sizes_that_split(12, 8) == [1, 2, 4]  # 3 divides the query heads but neither divides 8 nor is a multiple
    assert sizes_that_split(28, 4) == [1, 2, 4, 28]  # 7 and 14 would split one key/value head's query heads


def test_a_size_the_heads_cannot_split_is_refused_naming_model_counts_and_sizes():
    check_sequence_parallel_heads("Tiny", 4, 2, 4, "--train.sequence_parallel_size")
    with pytest.raises(ConfigError) as error:
        check_sequence_parallel_heads("Qwen2ForCausalLM", 10, 5, 4, "--train.sequence_parallel_size")
    message = str(error.value)
    for part in ("--train.sequence_parallel_size 4", "Qwen2ForCausalLM", "10 attention heads", "5 key/value heads",
                 "sizes that work for this model: 1, 5, 10"):
        assert part in message


def test_pad_columns_are_a_segment_of_their_own_and_labels_are_built_before_slicing():
    ids, mask, _ = rollout_batch(PROMPTS, RESPONSES, seed=1)
    batch = pack(ids, mask, row_tokens=14)
    assert batch.input_ids.shape == (3, 14)
    shards = [shard_packed(batch, 4, k) for k in range(4)]
    width = padded_width(14, 4)
    assert width == 16
    full = shards[0].full_position_ids
    # the two pad columns restart at 0: a segment of their own (column - position = 14)
    assert full[:, 14:].tolist() == [[0, 1]] * 3
    assert torch.equal(torch.cat([s.position_ids for s in shards], dim=1), full)
    assert torch.equal(torch.cat([s.input_ids for s in shards], dim=1)[:, :14], batch.input_ids)
    # every real token sits at its padded slot, and each shard's local index finds it
    flat = torch.cat([s.input_ids for s in shards], dim=1).reshape(-1)
    assert torch.equal(flat[shards[0].slots], pack_values(ids, batch))
    owners = torch.zeros(batch.num_tokens, dtype=torch.long)
    for shard in shards:
        mine, local = shard.local_index(shard.slots)
        assert torch.equal(shard.input_ids.reshape(-1)[local], pack_values(ids, batch)[mine])
        owners[mine] += 1
    assert owners.eq(1).all()
    # the token at shard 0's last column (row 0, column 3) keeps the label of the next token, on shard 1
    row0 = (shards[0].slots < 16).nonzero()[:, 0]
    at_edge = row0[shards[0].slots[row0] == 3]
    assert batch.labels[at_edge].item() == shards[1].input_ids[0, 0].item()


def test_a_switched_model_without_a_group_is_the_model_it_was():
    from rlhf_sg.packing import response_logprobs
    from rlhf_sg.parallel import use_ulysses_attention
    from rlhf_sg.tiny import build_tiny_model

    ids, mask, T = rollout_batch(PROMPTS, RESPONSES, seed=2)
    names = {"sdpa": "rlhf_sg_ulysses_sdpa", "eager": "rlhf_sg_ulysses_eager",
             FLASH: "rlhf_sg_ulysses_fa_attention_2"}  # no "flash": transformers would look for a kernel so named
    for implementation, name in names.items():
        lm = build_tiny_model("llama", "tiny", seed=4)
        if implementation == FLASH:
            lm.config._attn_implementation = implementation
        else:
            lm.set_attn_implementation(implementation)
        with _attention_kernels(implementation):  # the flash function loads its kernel by the wrapped name
            expected = response_logprobs(lm, ids, mask, T)
            switched = copy.deepcopy(lm)
            assert use_ulysses_attention(switched, 4) == implementation
            assert switched.config._attn_implementation == name
            got = response_logprobs(switched, ids, mask, T)  # it runs the implementation it wraps
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


# ---- N ranks ---------------------------------------------------------------------------------------------------


def _models(implementation: str, share: str | None = None):
    """The actor and critic; ``share`` "blocks": switched to the shared-prompt blocks (as a trainer's ranks are).
    ``flash_attention_2`` is set on the configs as it is (transformers would refuse it without the package: the
    kernel is :mod:`flash_reference`'s, under :func:`_attention_kernels`)."""
    from rlhf_sg.models import ValueHeadModel
    from rlhf_sg.packing import use_shared_prompt_attention
    from rlhf_sg.tiny import build_tiny_model

    lm = build_tiny_model("llama", "tiny", seed=5)
    torch.manual_seed(6)
    critic = ValueHeadModel(build_tiny_model("llama", "tiny", seed=7).model)
    for backbone in (lm, critic.model):
        if implementation == FLASH:
            backbone.config._attn_implementation = implementation
        else:
            backbone.set_attn_implementation(implementation)
    if share == "blocks":
        assert use_shared_prompt_attention(lm) and use_shared_prompt_attention(critic)
    return lm, critic


def _batch(prompts=PROMPTS, responses=RESPONSES, groups=()):
    """The rollout batch, random tokens; the rows of each of ``groups`` hold its first row's prompt."""
    ids, mask, T = rollout_batch(prompts, responses, seed=8)
    prompt_width = ids.shape[1] - T
    for rows in groups:
        ids[rows, :prompt_width] = ids[rows[0], :prompt_width]
    gen = torch.Generator().manual_seed(9)
    action = mask[:, -T:]
    return ids, mask, T, torch.randn(ids.shape[0], T, generator=gen) * action, torch.randn(ids.shape[0], T,
                                                                                          generator=gen) * action


def _losses(logp, entropy, values, advantages, returns, action):
    """The actor's and critic's losses over the whole batch, normalised by its response tokens (once)."""
    tokens = action.sum()
    actor = -((logp * advantages).sum() + ENTROPY_COEF * (entropy * action).sum()) / tokens
    critic = (((values - returns) * action) ** 2).sum() / tokens
    return actor, critic


FLASH = flash_reference.IMPLEMENTATION


def _attention_kernels(implementation: str):
    """The flash kernel's CPU reference for ``flash_attention_2`` (transformers' own flash path around it)."""
    return flash_reference.flash_kernel_reference() if implementation == FLASH else contextlib.nullcontext()


def _group_checks(group, implementation: str, perturb: bool, lengths: tuple, share: str | None) -> dict:
    with _attention_kernels(implementation):
        return _group_checks_on(group, implementation, perturb, lengths, share)


def _group_checks_on(group, implementation: str, perturb: bool, lengths: tuple, share: str | None) -> dict:
    """On one rank of ``group``: the batch's log-probs, entropy, values, losses, and the group's summed gradients;
    with ``perturb`` also the log-probs after changing sequence 1's tokens (row 2, before sequence 3). ``share``
    ("mask", "blocks"): the forwards share prompts, on the tree mask or the blocks (taken whatever they cost, and the
    attention calls that took them counted)."""
    import torch.distributed as dist

    from rlhf_sg.packing import blocks_whatever_they_cost, counting_block_layers
    from rlhf_sg.parallel import sp_critic_values, sp_response_logprobs, use_ulysses_attention

    lm, critic = _models(implementation, share)
    use_ulysses_attention(lm, group.size)
    use_ulysses_attention(critic, group.size)
    ids, mask, T, advantages, returns = _batch(*lengths)
    shared = share is not None
    with (blocks_whatever_they_cost() if share == "blocks" else contextlib.nullcontext()), \
            counting_block_layers() as block_layers:
        logp, entropy = sp_response_logprobs(lm, ids, mask, T, group, with_entropy=True, chunk_tokens=3,
                                             share_prompts=shared)
        values = sp_critic_values(critic, ids, mask, T, group, share_prompts=shared)
    actor_loss, critic_loss = _losses(logp, entropy, values, advantages, returns, mask[:, -T:])
    (actor_loss + critic_loss).backward()
    grads = {}
    for prefix, model in (("actor.", lm), ("critic.", critic)):
        for name, param in model.named_parameters():
            grad = param.grad.clone()
            dist.all_reduce(grad, group=group.group)
            grads[prefix + name] = grad
    seen = {"logp": logp.detach(), "entropy": entropy.detach(), "values": values.detach(),
            "actor_loss": actor_loss.item(), "critic_loss": critic_loss.item(), "grads": grads,
            "block_layers": block_layers[0]}
    if perturb:
        changed = ids.clone()
        changed[1][mask[1].bool()] = (changed[1][mask[1].bool()] + 7) % 90 + 3
        with torch.no_grad():  # both in one mode: sdpa's kernel may differ with and without autograd
            seen["unperturbed"] = sp_response_logprobs(lm, ids, mask, T, group)
            seen["perturbed"] = sp_response_logprobs(lm, changed, mask, T, group)
    return seen


#: one row of this many tokens for the saved-activation measurement
LONG_ROW = 1024
#: the layouts one spawned group of each size computes (every check of this module at that size), so the ranks
#: start and initialise once per size: (implementation, lengths, perturb, the sizes checked, shared prompts on)
GROUP_CASES = {
    "packed-sdpa": ("sdpa", (PROMPTS, RESPONSES), True, (2, 4), None),
    "packed-eager": ("eager", (PROMPTS, RESPONSES), False, (2, 4), None),
    "one-sequence-rows-sdpa": ("sdpa", ([3, 9], [20, 10]), False, (2,), None),
    "packed-flash": (FLASH, (PROMPTS, RESPONSES), False, (2, 4), None),
    "shared-sdpa": ("sdpa", SHARED, False, (2, 4), "mask"),
    "shared-eager": ("eager", SHARED, False, (2,), "mask"),
    "blocks": ("sdpa", SHARED, False, (2, 4), "blocks"),
}
#: the SP size whose group also measures the bytes kept for one long row (and rank 0 those of one rank alone)
SAVED_BYTES_SIZE = 2
#: the SP size whose group also runs the LoRA models and the reward model (:func:`_lora_and_reward`)
LORA_REWARD_SIZE = 2


def _sp_rank(rank: int, size: int, port: int) -> dict:
    """One rank of an SP group of ``size``, in a process of its own: every case of :data:`GROUP_CASES` on the group,
    and the bytes it keeps for the backward of one long row; rank 0 also measures that on a group of its own (N =
    1), in the same process."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import datetime

    import torch.distributed as dist

    from rlhf_sg.distributed import init_torch_distributed
    from rlhf_sg.parallel import SequenceParallelGroup

    torch.set_num_threads(1)
    init_torch_distributed(rank, size, "127.0.0.1", port, timeout_s=TIMEOUT_S, local_rank=0)
    try:
        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        group = SequenceParallelGroup.of(dist.new_group(list(range(size)), timeout=timeout))
        alone = [dist.new_group([k], timeout=timeout) for k in range(size)]  # every rank creates every group
        seen = {case: _group_checks(group, implementation, perturb, lengths, share)
                for case, (implementation, lengths, perturb, sizes, share) in GROUP_CASES.items() if size in sizes}
        if size == LORA_REWARD_SIZE:
            seen["lora_and_reward"] = _lora_and_reward(group)
        if size == SAVED_BYTES_SIZE:
            seen["saved_bytes"] = _saved_bytes(group, LONG_ROW)
            if rank == 0:
                seen["saved_bytes_alone"] = _saved_bytes(SequenceParallelGroup.of(alone[0]), LONG_ROW)
        return seen
    finally:
        dist.destroy_process_group()


def _one_rank(implementation: str, lengths: tuple = (PROMPTS, RESPONSES)) -> dict:
    """The same on one rank, through the project's packed forwards (rlhf_sg.packing); each row alone through sdpa
    for flash-attention (whose padded rows would take the kernel again)."""
    with _attention_kernels(implementation):
        out = _one_rank_on(implementation, lengths)
    if implementation == FLASH:
        lm, critic = _models("sdpa")
        ids, mask, T, _, _ = _batch(*lengths)
        out["padded_logp"], out["padded_entropy"] = (x.detach() for x in padded_reference(lm, ids, mask, T))
        out["padded_values"] = value_reference(critic, ids, mask, T).detach()
    return out


def _one_rank_on(implementation: str, lengths: tuple) -> dict:
    from rlhf_sg.packing import critic_values, response_logprobs

    lm, critic = _models(implementation)
    ids, mask, T, advantages, returns = _batch(*lengths)
    logp, entropy = response_logprobs(lm, ids, mask, T, with_entropy=True)
    values = critic_values(critic, ids, mask, T)
    actor_loss, critic_loss = _losses(logp, entropy, values, advantages, returns, mask[:, -T:])
    (actor_loss + critic_loss).backward()
    grads = {f"{prefix}{name}": p.grad.clone() for prefix, model in (("actor.", lm), ("critic.", critic))
             for name, p in model.named_parameters()}
    padded_logp, padded_entropy = padded_reference(lm, ids, mask, T)
    return {"logp": logp.detach(), "entropy": entropy.detach(), "values": values.detach(),
            "actor_loss": actor_loss.item(), "critic_loss": critic_loss.item(), "grads": grads,
            "padded_logp": padded_logp.detach(), "padded_entropy": padded_entropy.detach(),
            "padded_values": value_reference(critic, ids, mask, T).detach()}


#: each size's ranks' results, or the failure of its group (not spawned again by the next test)
_GROUPS: dict[int, list[dict] | str] = {}


def _run_group(size: int) -> list[dict]:
    """Every rank's :func:`_sp_rank` of an SP group of ``size``, spawned once per size for the whole module."""
    if size not in _GROUPS:
        from zero3_rank import in_fresh_process

        from rlhf_sg.distributed import free_port

        port = free_port()
        with concurrent.futures.ThreadPoolExecutor(size) as pool:
            futures = [pool.submit(in_fresh_process, _sp_rank, rank, size, port, timeout_s=4 * TIMEOUT_S)
                       for rank in range(size)]
            failed = {rank: f.exception() for rank, f in enumerate(futures)}
        _GROUPS[size] = ("\n".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, e in failed.items()
                                   if e is not None) if any(failed.values()) else [f.result() for f in futures])
    if isinstance(_GROUPS[size], str):
        pytest.fail(_GROUPS[size], pytrace=False)
    return _GROUPS[size]


def _responses_cross_an_edge(size: int, lengths: tuple = (PROMPTS, RESPONSES)) -> bool:
    """Whether some response's tokens lie on two ranks' columns at this SP size (the test's premise)."""
    ids, mask, T = rollout_batch(*lengths, seed=8)
    batch = pack(ids, mask, row_tokens=int(mask.sum(1).max()))
    shards = [shard_packed(batch, size, k) for k in range(size)]
    owner = torch.zeros(batch.num_tokens, dtype=torch.long)
    for k, shard in enumerate(shards):
        owner[shard.local_index(shard.slots)[0]] = k
    is_response = pack_values(torch.cat([torch.zeros_like(mask[:, :-T]), mask[:, -T:]], dim=1), batch).bool()
    starts = batch.cu_seqlens[:-1].long()
    ends = batch.cu_seqlens[1:].long()
    return any(len(set(owner[s:e][is_response[s:e]].tolist())) > 1 for s, e in zip(starts, ends))


#: the tiny preset's layers
_LAYERS = 2


def _shared_responses_cross_an_edge(size: int, case: str) -> bool:
    """Whether the case's shared-prompt rows (as its ranks lay them out: the model's default segments) gain pad
    columns at this SP size and some response's tokens lie on two ranks' columns (the test's premises)."""
    from rlhf_sg.packing import default_segment_tokens, pack_shared_prompts, prompt_groups
    from rlhf_sg.parallel import pad_shared_rows

    implementation, lengths, _, _, share = GROUP_CASES[case]
    lm, _ = _models(implementation, share)
    assert lm.config.num_hidden_layers == _LAYERS
    ids, mask, T, _, _ = _batch(*lengths)
    groups = prompt_groups(ids, mask, T)
    assert sorted(map(len, groups)) == [1, 2, 3]
    rows = pack_shared_prompts(ids, mask, T, default_segment_tokens(lm), groups=groups)
    padded = pad_shared_rows(rows, size)
    width = padded.input_ids.shape[1]
    owner = padded.predictor_slots % width // (width // size)
    sample = padded.block_positions // T
    crossing = any(len(set(owner[sample == b].tolist())) > 1 for b in range(ids.shape[0]))
    return width > rows.input_ids.shape[1] and crossing


@pytest.mark.parametrize("blocks", [False, True], ids=["mask", "blocks"])
@pytest.mark.parametrize("size", [2, 4])
def test_padded_shared_rows_are_the_rows_with_pad_columns_that_attend_to_themselves(size, blocks):
    """The pad columns an SP group adds to shared-prompt rows: the tree mask over the real columns is the rows' own,
    a pad column attends to itself only and no column attends to it, and every predictor slot and branch holds the
    tokens it held."""
    from rlhf_sg.packing import UNCAPPED_SEGMENT_TOKENS, pack_shared_prompts
    from rlhf_sg.parallel import pad_shared_rows, shard_shared

    ids, mask, T, _, _ = _batch(*SHARED)
    rows = pack_shared_prompts(ids, mask, T, UNCAPPED_SEGMENT_TOKENS if blocks else 64)
    padded = pad_shared_rows(rows, size)
    num_rows, length = rows.input_ids.shape
    width = padded.input_ids.shape[1]
    assert width % size == 0 and width > length
    tree, wide = rows.attention_mask(), padded.attention_mask()
    assert torch.equal(wide[:, :, :length, :length], tree)
    assert torch.equal(wide[:, 0, length:, :], torch.eye(width, dtype=torch.bool)[length:].expand(num_rows, -1, -1))
    assert not wide[:, 0, :length, length:].any()
    assert padded.holders[:, length:].eq(0).all() and torch.equal(padded.holders[:, :length], rows.holders)
    flat, wide_flat = rows.input_ids.reshape(-1), padded.input_ids.reshape(-1)
    assert torch.equal(wide_flat[padded.predictor_slots], flat[rows.predictor_slots])
    for k in (0, 2):  # a branch's prefix and its own run start at the same tokens
        assert torch.equal(wide_flat[padded.branches[:, k]], flat[rows.branches[:, k]])
    # the ranks' columns are the padded rows, and their slots every token some sequence holds
    shards = [shard_shared(rows, size, k)[1] for k in range(size)]
    assert torch.equal(torch.cat([s.input_ids for s in shards], dim=1), padded.input_ids)
    assert torch.equal(wide_flat[shards[0].slots], flat[rows.holders.reshape(-1) > 0])


@pytest.mark.slow
@pytest.mark.parametrize("size,layout", [(2, "shared-sdpa"), (4, "shared-sdpa"), (2, "shared-eager"), (2, "blocks"),
                                         (4, "blocks")])
def test_an_sp_group_equals_one_rank_on_shared_prompt_rows_and_the_blocks(size, layout):
    """Rows sharing prompts (a group of 3, one of 2, a row alone), computed once per segment by the SP group: on
    the tree mask (sdpa, eager; its rows padded for N) and on the blocks (every layer of both models takes them, N = 4
    replicating the key / value heads). Log-probs, entropy, values, losses and every summed gradient equal one rank's
    packed forward of the unshared rows, itself each row alone; a response crosses the shard edges."""
    _assert_group_equals_one_rank(size, layout)


@pytest.mark.slow
@pytest.mark.parametrize("size,implementation", [(2, "sdpa"), (4, "sdpa"), (2, "eager"), (4, "eager"), (2, "flash"),
                                                 (4, "flash")])
def test_an_sp_group_equals_one_rank_on_packed_rows(size, implementation):
    """N = 2 and 4 ranks (N = 4 replicates the tiny preset's 2 key/value heads), a response crossing shard edges, a
    row packing two sequences: log-probs, entropy, values, both losses (the same on every rank) and every parameter
    gradient summed over the group equal one rank's packed forward, itself equal to each row alone. ``flash``:
    transformers' flash_attention_2 path on the varlen kernel's CPU reference (:mod:`flash_reference`), each rank's
    heads over the whole packed row, its pad columns one more sequence in ``cu_seq_lens``."""
    _assert_group_equals_one_rank(size, f"packed-{implementation}")


#: the layouts the two-GPU test runs in bfloat16: (implementation, lengths, shared prompts)
CUDA_CASES = {"packed-flash": (FLASH, (PROMPTS, RESPONSES), None), "packed-sdpa": ("sdpa", (PROMPTS, RESPONSES), None),
              "blocks": ("sdpa", SHARED, "blocks")}


def _cuda_logp(case: str, group=None, device: str = "cuda") -> torch.Tensor:
    """The case's log-probs from the bfloat16 actor on this process's GPU: by ``group``, or (None) by one rank's
    packed forward; flash-attention on its own kernel."""
    import contextlib

    from rlhf_sg.packing import blocks_whatever_they_cost, response_logprobs
    from rlhf_sg.parallel import sp_response_logprobs, use_ulysses_attention

    implementation, lengths, share = CUDA_CASES[case]
    lm, _ = _models(implementation, share)
    lm = lm.to(device, torch.bfloat16)
    ids, mask, T, _, _ = _batch(*lengths)
    with torch.no_grad(), (blocks_whatever_they_cost() if share else contextlib.nullcontext()):
        if group is None:
            logp = response_logprobs(lm, ids, mask, T, share_prompts=share is not None)
        else:
            use_ulysses_attention(lm, group.size)
            logp = sp_response_logprobs(lm, ids, mask, T, group, share_prompts=share is not None)
    return logp.float().cpu()


def _cuda_rank(rank: int, size: int, port: int) -> dict:
    """One rank of an SP group of ``size`` on GPU ``rank`` (NCCL): every case of :data:`CUDA_CASES`."""
    os.environ["DS_ACCELERATOR"] = "cuda"
    import datetime

    import torch.distributed as dist

    from rlhf_sg.distributed import init_torch_distributed
    from rlhf_sg.parallel import SequenceParallelGroup

    torch.cuda.set_device(rank)
    init_torch_distributed(rank, size, "127.0.0.1", port, backend="nccl", timeout_s=TIMEOUT_S, local_rank=rank)
    try:
        group = SequenceParallelGroup.of(dist.new_group(list(range(size)),
                                                        timeout=datetime.timedelta(seconds=TIMEOUT_S)))
        return {case: _cuda_logp(case, group) for case in CUDA_CASES}
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_on_two_gpus_an_sp_group_equals_one_rank_on_flash_attention_sdpa_and_the_blocks():
    """2 ranks on 2 GPUs (NCCL's all-to-all; NCCL refuses two ranks on one device), bfloat16: flash-attention's
    varlen kernel on the packed row (its pad columns one more sequence), sdpa on the block-causal mask, and the
    shared-prompt blocks each give one rank's log-probs. bfloat16 rounds differently with the GEMMs' row counts, so
    the bound is twice what one rank's forward differs from each row alone by sdpa (plus 1e-3): a response seeing
    another sequence differs far more."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    pytest.importorskip("flash_attn")
    pytest.importorskip("deepspeed")
    from zero3_rank import in_fresh_process

    from rlhf_sg.distributed import free_port

    port = free_port()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        ranks = [f.result() for f in [pool.submit(in_fresh_process, _cuda_rank, rank, 2, port,
                                                  timeout_s=4 * TIMEOUT_S) for rank in range(2)]]
    for case, (_, lengths, share) in CUDA_CASES.items():
        expected = _cuda_logp(case)
        lm, _ = _models("sdpa", share)
        ids, mask, T, _, _ = _batch(*lengths)
        with torch.no_grad():
            alone, _ = padded_reference(lm.to("cuda", torch.bfloat16), ids.cuda(), mask.cuda(), T)
        bound = 2 * (expected - alone.float().cpu()).abs().max().item() + 1e-3
        for rank, seen in enumerate(ranks):
            gap = (seen[case] - expected).abs().max().item()
            assert gap <= bound, f"{case} rank {rank}: {gap} from one rank's log-probs (bound {bound})"


@pytest.mark.slow
def test_rows_of_one_sequence_take_causal_attention_over_the_whole_row():
    """Rows that hold one sequence each (23 and 19 tokens: no two fit a row) pass sdpa no mask: the wrapper asks
    for causal attention over the whole row, not over the shard's columns; the padded row's extra column comes after
    the sequence. Equal to one rank on 2 ranks, the response crossing the edge."""
    _assert_group_equals_one_rank(2, "one-sequence-rows-sdpa")


def _assert_group_equals_one_rank(size: int, case: str) -> None:
    implementation, lengths, _, sizes, share = GROUP_CASES[case]
    assert size in sizes
    assert _shared_responses_cross_an_edge(size, case) if share else _responses_cross_an_edge(size, lengths)
    expected = _one_rank(implementation, lengths)
    torch.testing.assert_close(expected["logp"], expected["padded_logp"], atol=TOL, rtol=0)
    torch.testing.assert_close(expected["values"], expected["padded_values"], atol=TOL, rtol=0)
    for rank, ranks_seen in enumerate(_run_group(size)):
        seen = ranks_seen[case]
        for key in ("logp", "entropy", "values"):
            torch.testing.assert_close(seen[key], expected[key], atol=TOL, rtol=0, msg=f"rank {rank} {key}")
        for key in ("actor_loss", "critic_loss"):  # the whole batch's loss on every rank, not a share of it
            assert seen[key] == pytest.approx(expected[key], abs=TOL), (rank, key)
        # both forwards' layers on the blocks (not the tree mask they stand in for), none elsewhere
        assert seen["block_layers"] == (2 * _LAYERS if share == "blocks" else 0), rank
        assert seen["grads"].keys() == expected["grads"].keys()
        for name, grad in expected["grads"].items():
            assert grad.abs().max() > 0, name  # every parameter takes part
            assert_grads_close(seen["grads"][name], grad, f"rank {rank} {name}")


@pytest.mark.slow
def test_no_attention_crosses_segments_in_an_sp_group():
    """Sequence 3 packs into a row after sequence 1 (FFD: 7 + 5 tokens), so causal attention alone would let it see
    sequence 1: changing every token of sequence 1 changes its own log-probs and leaves every other sequence's exactly
    as they were, on 2 ranks."""
    ids, mask, _ = rollout_batch(PROMPTS, RESPONSES, seed=8)
    batch = pack(ids, mask, row_tokens=14)
    row_of = batch.slots[batch.cu_seqlens[:-1].long()] // 14
    assert row_of[1] == row_of[3] and batch.slots[batch.cu_seqlens[1]] < batch.slots[batch.cu_seqlens[3]]
    for ranks_seen in _run_group(2):
        seen = ranks_seen["packed-sdpa"]
        others = [0, 2, 3]
        assert torch.equal(seen["perturbed"][others], seen["unperturbed"][others])
        assert (seen["perturbed"][1] - seen["unperturbed"][1]).abs().max() > 1e-3


# ---- LoRA models and the reward model -----------------------------------------------------------------------------


def _lora_models():
    """The actor and the critic of :func:`_models` (sdpa) wrapped in LoRA adapters as the workers wrap them (the
    critic's head trained whole beside its adapters), every B non-zero so that the adapters change the forwards and
    every A takes a gradient."""
    from rlhf_sg.lora import LoraSpec, apply_lora

    lm, critic = _models("sdpa")
    torch.manual_seed(10)  # the adapters' A
    spec = LoraSpec(rank=4, alpha=8.0)
    lm, critic = apply_lora(lm, spec, True), apply_lora(critic, spec, True, head="value_head")
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for model in (lm, critic):
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return lm, critic


def _reward_model():
    """A tiny reward model: a :class:`rlhf_sg.models.ValueHeadModel` (sdpa)."""
    from rlhf_sg.models import ValueHeadModel
    from rlhf_sg.tiny import build_tiny_model

    torch.manual_seed(12)
    model = ValueHeadModel(build_tiny_model("llama", "tiny", seed=13).model)
    model.model.set_attn_implementation("sdpa")
    return model


def _lora_and_reward(group=None) -> dict:
    """The LoRA actor's and critic's log-probs, entropy, values, losses and trainable parameters' gradients, the
    actor's log-probs with its adapter disabled (the reference of a LoRA run), and the reward model's scores and
    gradients of a weighted sum of them: by ``group`` (switched models, the gradients summed over the group), or
    without one on one rank through the packed forwards of rlhf_sg.packing."""
    import torch.distributed as dist

    from rlhf_sg.lora import adapter_disabled
    from rlhf_sg.packing import critic_values, response_logprobs, reward_scores
    from rlhf_sg.parallel import sp_critic_values, sp_response_logprobs, sp_reward_scores, use_ulysses_attention

    lm, critic = _lora_models()
    reward = _reward_model()
    ids, mask, T, advantages, returns = _batch()
    weights = torch.randn(ids.shape[0], generator=torch.Generator().manual_seed(14))
    if group is None:
        logp, entropy = response_logprobs(lm, ids, mask, T, with_entropy=True)
        values = critic_values(critic, ids, mask, T)
        scores = reward_scores(reward, ids, mask)
    else:
        for model in (lm, critic, reward):
            use_ulysses_attention(model, group.size)
        logp, entropy = sp_response_logprobs(lm, ids, mask, T, group, with_entropy=True, chunk_tokens=3)
        values = sp_critic_values(critic, ids, mask, T, group)
        scores = sp_reward_scores(reward, ids, mask, group)
    with torch.no_grad(), adapter_disabled(lm):
        base_logp = (response_logprobs(lm, ids, mask, T) if group is None
                     else sp_response_logprobs(lm, ids, mask, T, group))
    actor_loss, critic_loss = _losses(logp, entropy, values, advantages, returns, mask[:, -T:])
    (actor_loss + critic_loss + (scores * weights).sum()).backward()
    grads = {}
    for prefix, model in (("actor.", lm), ("critic.", critic), ("reward.", reward)):
        for name, param in model.named_parameters():
            if param.requires_grad:
                grad = param.grad.clone()
                if group is not None:
                    dist.all_reduce(grad, group=group.group)
                grads[prefix + name] = grad
    return {"logp": logp.detach(), "entropy": entropy.detach(), "values": values.detach(), "base_logp": base_logp,
            "scores": scores.detach(), "actor_loss": actor_loss.item(), "critic_loss": critic_loss.item(),
            "grads": grads}


def _last_token_owners(size: int) -> list[int]:
    """The rank whose columns hold each sequence's last token at SP size ``size`` (as sp_reward_scores packs)."""
    ids, mask, _, _, _ = _batch()
    batch = pack(ids, mask, row_tokens=int(mask.sum(1).max()))
    owners = torch.full((ids.shape[0],), -1)
    for k in range(size):
        shard = shard_packed(batch, size, k)
        mine, _ = shard.local_index(shard.slots[batch.cu_seqlens[1:].long() - 1])
        owners[mine] = k
    return owners.tolist()


def _assert_lora_and_reward_equal_one_rank(keys: tuple[str, ...], prefixes: tuple[str, ...]) -> None:
    expected = _one_rank_lora_and_reward()
    for rank, ranks_seen in enumerate(_run_group(LORA_REWARD_SIZE)):
        seen = ranks_seen["lora_and_reward"]
        for key in keys:
            if isinstance(expected[key], float):
                assert seen[key] == pytest.approx(expected[key], abs=TOL), (rank, key)
            else:
                torch.testing.assert_close(seen[key], expected[key], atol=TOL, rtol=0, msg=f"rank {rank} {key}")
        names = [name for name in expected["grads"] if name.startswith(prefixes)]
        assert names and [n for n in seen["grads"] if n.startswith(prefixes)] == names
        for name in names:
            assert expected["grads"][name].abs().max() > 0, name  # every trainable parameter takes part
            assert_grads_close(seen["grads"][name], expected["grads"][name], f"rank {rank} {name}")


@functools.cache
def _one_rank_lora_and_reward() -> dict:
    return _lora_and_reward()


@pytest.mark.slow
def test_an_sp_group_equals_one_rank_with_lora_adapters():
    """LoRA-wrapped actor and critic (PEFT's wrapper around the causal LM and around the value model, B non-zero) on 2
    ranks, a response crossing the shard edge: log-probs, entropy, values, both losses and every trainable
    parameter's gradient (the adapters' A and B and the critic's head, nothing else trains) summed over the group
    equal one rank's packed forward; so do the actor's log-probs with its adapter disabled (a LoRA run's reference),
    which the adapter changes."""
    lm, critic = _lora_models()
    trainable = [n for model in (lm, critic) for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n or "value_head" in n for n in trainable)
    expected = _one_rank_lora_and_reward()
    assert (expected["base_logp"] - expected["logp"]).abs().max() > 1e-3
    _assert_lora_and_reward_equal_one_rank(("logp", "entropy", "values", "base_logp", "actor_loss", "critic_loss"),
                                           ("actor.", "critic."))


@pytest.mark.slow
def test_an_sp_group_scores_as_one_reward_model():
    """A reward model (a ValueHeadModel) on 2 ranks: the score of each row's last real token, read by the rank whose
    columns hold it (some rows' on each rank), summed over the group: every rank's scores and the group's summed
    gradients of a weighted sum of them equal one rank's reward_scores."""
    assert set(_last_token_owners(LORA_REWARD_SIZE)) == {0, 1}
    _assert_lora_and_reward_equal_one_rank(("scores",), ("reward.",))


# ---- the trainer's optimizer steps -------------------------------------------------------------------------------


def _group_steps(ranks: int, size: int, normalize_rows: bool):
    """The actor's steps for a batch of 8 rows of random lengths (2 minibatches) as the trainer makes them for a group
    of ``ranks`` ranks in SP groups of ``size``: (per data-parallel rank, per rank), the batch and the config."""
    import random

    from rlhf_sg.config import Config
    from rlhf_sg.experience import build_rollout_batch
    from rlhf_sg.trainer.layout import Layout
    from rlhf_sg.trainer.ppo import group_update_steps

    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 9, (2, 8), generator=gen).tolist()
    batch = build_rollout_batch([[7] * n for n in lengths[0]], [[8] * n for n in lengths[1]],
                                [[0.0] * n for n in lengths[1]], pad_id=0)
    cfg = Config()
    cfg.train.actor_num_ranks, cfg.train.sequence_parallel_size, cfg.train.num_minibatches = ranks, size, 2
    plans, steps = group_update_steps(batch, Layout(cfg), "actor", cfg.train, random.Random(0),
                                      normalize_rows=normalize_rows)
    return plans, steps, batch


@pytest.mark.parametrize("normalize_rows", [False, True])
def test_each_token_weighs_in_the_reduced_gradient_as_on_one_rank(normalize_rows):
    """4 actor ranks in SP groups of 2 (2 data-parallel ranks): every rank of an SP group takes its data-parallel
    rank's steps, and a token's weight in the gradient ZeRO-3 reduces (the loss scale over all the group's ranks x
    the normaliser of the one SP group whose plan holds its row: the group's ranks back-propagate its columns' shares)
    is its weight on one rank (1 / the normaliser there): the normaliser counts the data-parallel ranks, not all."""
    from rlhf_sg.parallel import loss_scale

    (alone,), (alone_rank,), _ = _group_steps(1, 1, normalize_rows)
    assert alone == alone_rank
    plans, steps, batch = _group_steps(4, 2, normalize_rows)
    assert len(plans) == 2 and steps == [plans[0], plans[0], plans[1], plans[1]]
    for k, one in enumerate(alone):  # optimizer step k
        holders: dict[int, set[int]] = {}
        for rank, rank_steps in enumerate(steps):
            for row in (r for micro in rank_steps[k].plan for r in micro):
                holders.setdefault(row, set()).add(rank)
        assert sorted(holders) == sorted(r for micro in one.plan for r in micro)  # the same minibatch
        for row, ranks in holders.items():
            first = min(ranks)
            assert ranks == {first, first + 1} and first % 2 == 0, (row, ranks)  # one SP group
            weight = loss_scale(2) / (len(steps) * steps[first][k].normalizer)
            assert weight == pytest.approx(1 / one.normalizer, rel=1e-12), (k, row, weight, 1 / one.normalizer)
    assert batch.action_mask.sum() > batch.batch_size  # token and row normalisers differ


# ---- the flag ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sp_config(tmp_path_factory):
    """A valid config maker (the defaults, the tiny model: 4 heads / 2 key/value heads) and a copy of the model whose
    config.json says 6 heads / 3 key/value heads."""
    import json
    import shutil

    from rlhf_sg.config import Config
    from rlhf_sg.tiny import save_tiny_model

    model = save_tiny_model(str(tmp_path_factory.mktemp("m")))
    odd = str(tmp_path_factory.mktemp("odd") / "model")
    shutil.copytree(model, odd)
    with open(os.path.join(odd, "config.json")) as f:
        config = json.load(f)
    config.update(num_attention_heads=6, num_key_value_heads=3)
    with open(os.path.join(odd, "config.json"), "w") as f:
        json.dump(config, f)
    prompts = tmp_path_factory.mktemp("data") / "p.jsonl"
    prompts.write_text('{"prompt": "1+1="}\n')

    def make(size: int, ranks: int, path: str = model) -> Config:
        cfg = Config()
        cfg.model.pretrain, cfg.data.prompt_data, cfg.reward.function = path, str(prompts), "m:f"
        cfg.train.sequence_parallel_size = size
        cfg.train.actor_num_ranks = cfg.train.critic_num_ranks = cfg.train.ref_num_ranks = ranks
        cfg.rollout.prompts_per_step = 8
        return cfg

    make.odd = odd
    return make


def test_the_flag_is_validated_before_ray(sp_config):
    from rlhf_sg.config import apply_overrides, validate

    validate(sp_config(1, 2))
    cfg = sp_config(1, 2)
    apply_overrides(cfg, {"train.sequence_parallel_size": "2"}, "--train.sequence_parallel_size")
    assert cfg.train.sequence_parallel_size == 2
    cases = [
        (sp_config(0, 2), "--train.sequence_parallel_size must be >= 1, got 0"),
        (sp_config(4, 2), "--train.sequence_parallel_size 4: --train.actor_num_ranks 2 is not a multiple of it"),
        (sp_config(4, 4, sp_config.odd), f"--train.sequence_parallel_size 4: {sp_config.odd} has 6 attention heads "
                                         "and 3 key/value heads"),
    ]
    for cfg, message in cases:
        with pytest.raises(ConfigError) as error:
            validate(cfg)
        assert str(error.value).startswith(message), str(error.value)
    with pytest.raises(ConfigError, match="sizes that work for this model: 1, 3, 6"):
        validate(sp_config(4, 4, sp_config.odd))
    works = sp_config(2, 4)
    assert works.train.share_prompts  # shared-prompt rows and the blocks split as packed rows do
    validate(works)
    # what the SP groups do not run yet is refused by its flag, with the way out
    refused = {"--train.routing_replay": lambda cfg: setattr(cfg.train, "routing_replay", True)}
    for what, change in refused.items():
        cfg = sp_config(2, 4)
        change(cfg)
        with pytest.raises(ConfigError) as error:
            validate(cfg)
        assert str(error.value).startswith(f"--train.sequence_parallel_size 2 with {what}: "), str(error.value)
        assert str(error.value).endswith("(or set --train.sequence_parallel_size 1)"), str(error.value)
    critic = sp_config(2, 4)
    critic.train.critic_num_ranks = 3
    with pytest.raises(ConfigError, match="--train.critic_num_ranks 3 is not a multiple of it"):
        validate(critic)


def test_each_group_takes_its_own_size_under_its_own_flag(sp_config):
    """--train.actor_sequence_parallel_size / critic_ / ref_ override --train.sequence_parallel_size for their group
    (the layout's SP and data-parallel sizes follow), and each is checked, and refused, under its own flag."""
    from rlhf_sg.config import apply_overrides, shares_prompts, validate
    from rlhf_sg.trainer.layout import Layout

    cfg = sp_config(1, 4)
    cfg.train.share_prompts = False
    apply_overrides(cfg, {"train.actor_sequence_parallel_size": "4", "train.critic_sequence_parallel_size": "2"},
                    "--train.*_sequence_parallel_size")
    assert (cfg.train.actor_sequence_parallel_size, cfg.train.critic_sequence_parallel_size) == (4, 2)
    cfg.train.kl_coef = 0.01
    layout = Layout(validate(cfg))
    sizes = {role: (layout.sequence_parallel_size(role), layout.data_parallel_ranks(role))
             for role in ("actor", "critic", "ref")}
    assert sizes == {"actor": (4, 1), "critic": (2, 2), "ref": (1, 4)}, sizes
    cfg.train.sequence_parallel_size = 2  # the groups without a size of their own take it
    assert Layout(validate(cfg)).sequence_parallel_size("ref") == 2
    cases = {"--train.critic_sequence_parallel_size 3: --train.critic_num_ranks 4 is not a multiple of it":
             lambda c: setattr(c.train, "critic_sequence_parallel_size", 3),
             "--train.ref_sequence_parallel_size must be >= 1, got 0":
             lambda c: setattr(c.train, "ref_sequence_parallel_size", 0),
             "--train.actor_sequence_parallel_size 4 with --train.routing_replay: ":
             lambda c: setattr(c.train, "routing_replay", True)}
    for message, change in cases.items():
        bad = sp_config(1, 4)
        bad.train.share_prompts, bad.train.actor_sequence_parallel_size = False, 4
        change(bad)
        with pytest.raises(ConfigError) as error:
            validate(bad)
        assert str(error.value).startswith(message), str(error.value)
    # a group that does not split takes no refusal: the actor at 1 under a global 2, no critic, no reference
    alone = sp_config(2, 4)
    alone.train.actor_sequence_parallel_size, alone.train.advantage_estimator, alone.train.kl_coef = 1, "grpo", 0.0
    assert shares_prompts(validate(alone)) and Layout(alone).data_parallel_ranks("actor") == 4


def test_the_reward_models_group_splits_under_its_own_flag_and_a_lora_policy_splits(sp_config):
    """--reward.kind model under SP: --train.reward_sequence_parallel_size (unset: --train.sequence_parallel_size) is
    the reward group's size (the layout's SP and data-parallel sizes and its micro-batch budget follow), validated
    before Ray under the flag that set it: >= 1, a divisor of --reward.num_ranks, the reward model's heads. A LoRA
    policy (--lora.rank) splits as any other."""
    from rlhf_sg.config import apply_overrides, microbatch_tokens, validate
    from rlhf_sg.trainer.layout import Layout

    def with_reward_model(size: int, reward_ranks: int, path: str | None = None):
        cfg = sp_config(size, 4)
        cfg.reward.kind, cfg.reward.function = "model", None
        cfg.model.reward_pretrain, cfg.reward.num_ranks = path or cfg.model.pretrain, reward_ranks
        return cfg

    cfg = with_reward_model(2, 4)
    layout = Layout(validate(cfg))
    assert (layout.sequence_parallel_size("reward"), layout.data_parallel_ranks("reward")) == (2, 2)
    assert microbatch_tokens(cfg, "reward") == 2 * cfg.train.max_tokens_per_microbatch
    apply_overrides(cfg, {"train.reward_sequence_parallel_size": "4"}, "--train.reward_sequence_parallel_size")
    assert cfg.train.reward_sequence_parallel_size == 4
    assert Layout(validate(cfg)).data_parallel_ranks("reward") == 1
    assert Layout(validate(cfg)).sequence_parallel_size("actor") == 2  # the other groups keep the global size
    cases = {"--train.sequence_parallel_size 2: --reward.num_ranks 3 is not a multiple of it":
             with_reward_model(2, 3),
             "--train.reward_sequence_parallel_size 4: --reward.num_ranks 2 is not a multiple of it":
             with_reward_model(1, 2),
             "--train.reward_sequence_parallel_size must be >= 1, got 0": with_reward_model(1, 2),
             f"--train.reward_sequence_parallel_size 4: {sp_config.odd} has 6 attention heads":
             with_reward_model(1, 4, sp_config.odd)}
    sizes = iter([None, 4, 0, 4])
    for message, bad in cases.items():
        bad.train.reward_sequence_parallel_size = next(sizes)
        with pytest.raises(ConfigError) as error:
            validate(bad)
        assert str(error.value).startswith(message), str(error.value)
    unused = with_reward_model(2, 3)  # a reward function: no reward group to split
    unused.reward.kind, unused.reward.function = "function", "m:f"
    assert Layout(validate(unused)).sequence_parallel_size("actor") == 2
    lora = sp_config(2, 4)
    lora.lora.rank = 4
    assert Layout(validate(lora)).lora_of("actor") is not None


def test_the_teachers_group_splits_under_its_own_flag(sp_config):
    """--distill.teacher under SP: --train.teacher_sequence_parallel_size (unset: --train.sequence_parallel_size) is
    the teacher group's size (the layout's SP and data-parallel sizes and its micro-batch budget follow), validated
    before Ray under the flag that set it: a divisor of --distill.num_ranks, the teacher's heads."""
    from rlhf_sg.config import microbatch_tokens, validate
    from rlhf_sg.trainer.layout import Layout

    def with_teacher(size: int, teacher_ranks: int, own: int | None = None, path: str | None = None):
        cfg = sp_config(size, 4)
        cfg.distill.teacher, cfg.distill.num_ranks = path or cfg.model.pretrain, teacher_ranks
        cfg.train.teacher_sequence_parallel_size = own
        return cfg

    cfg = validate(with_teacher(2, 4))
    layout = Layout(cfg)
    assert (layout.sequence_parallel_size("teacher"), layout.data_parallel_ranks("teacher")) == (2, 2)
    assert microbatch_tokens(cfg, "teacher") == 2 * cfg.train.max_tokens_per_microbatch
    assert Layout(validate(with_teacher(1, 4, own=4))).data_parallel_ranks("teacher") == 1
    cases = {"--train.sequence_parallel_size 2: --distill.num_ranks 3 is not a multiple of it": with_teacher(2, 3),
             "--train.teacher_sequence_parallel_size 4: --distill.num_ranks 2 is not a multiple of it":
             with_teacher(1, 2, own=4),
             f"--train.teacher_sequence_parallel_size 4: {sp_config.odd} has 6 attention heads":
             with_teacher(1, 4, own=4, path=sp_config.odd)}
    for message, bad in cases.items():
        with pytest.raises(ConfigError) as error:
            validate(bad)
        assert str(error.value).startswith(message), str(error.value)


def test_a_harness_row_is_bounded_by_the_smallest_micro_batch_of_a_group_that_scores_it(sp_config):
    """A harness's row (nothing else caps it) must fit one micro-batch of every group that scores it: N x the budget
    for an SP group of N, the budget for a group that does not split, and the engines' context above them."""
    from rlhf_sg.config import row_token_limit, validate

    cfg = sp_config(1, 4)
    cfg.train.actor_sequence_parallel_size, cfg.train.max_tokens_per_microbatch = 4, 64
    cfg.train.advantage_estimator, cfg.train.kl_coef, cfg.rollout.max_model_len = "grpo", 0.0, 1024
    cfg.data.max_prompt_len, cfg.rollout.max_new_tokens = 16, 32
    assert row_token_limit(validate(cfg)) == 256  # the actor alone, 4 x 64
    cfg.train.kl_coef = 0.01  # a reference group at N = 1 scores the rows too
    assert row_token_limit(validate(cfg)) == 64
    cfg.train.ref_sequence_parallel_size = 2
    assert row_token_limit(validate(cfg)) == 128
    cfg.rollout.max_model_len = 100
    assert row_token_limit(validate(cfg)) == 100


def test_the_microbatch_budget_is_a_ranks_share_of_a_row(sp_config):
    """--train.max_tokens_per_microbatch counts what one rank holds: a row of 256 tokens (16 prompt + 240 response)
    over a budget of 64 fits 4 ranks of an SP group (64 columns each), not 2 (128 each) nor 1, each refused before
    Ray naming the flag and the way out; an SP group's micro-batches then hold N x the budget, its data-parallel
    ranks' plans packed to that (one row a micro-batch here), and a group that does not split keeps the budget."""
    import random

    from rlhf_sg.config import microbatch_tokens, validate
    from rlhf_sg.experience import build_rollout_batch
    from rlhf_sg.trainer.layout import Layout
    from rlhf_sg.trainer.ppo import group_update_steps

    def long_rows(size: int):
        cfg = sp_config(size, 4)
        cfg.train.share_prompts, cfg.train.advantage_estimator, cfg.train.kl_coef = False, "grpo", 0.0
        cfg.data.max_prompt_len, cfg.rollout.max_new_tokens, cfg.rollout.max_model_len = 16, 240, 256
        cfg.train.max_tokens_per_microbatch = 64
        return cfg

    cfg = validate(long_rows(4))
    cfg.train.teacher_sequence_parallel_size = 1  # a group at a size of 1 of its own keeps the budget
    assert microbatch_tokens(cfg, "actor") == 256 and microbatch_tokens(cfg, "teacher") == 64
    refusals = {1: "--train.max_tokens_per_microbatch (64) must hold one full sequence (max_prompt_len + "
                   "max_new_tokens = 256) on one rank of the actor group; raise it to 256, or split the rows over "
                   "an SP group (--train.sequence_parallel_size N: a rank holds 256 / N tokens of a row, N >= 4)",
                2: "--train.max_tokens_per_microbatch (64) must hold a rank's share of one full sequence "
                   "(max_prompt_len + max_new_tokens = 256 over --train.sequence_parallel_size 2: 128 tokens) in "
                   "the actor group; raise it to 128, or --train.sequence_parallel_size to at least 4"}
    for size, message in refusals.items():
        with pytest.raises(ConfigError) as error:
            validate(long_rows(size))
        assert str(error.value) == message
    critic = long_rows(4)  # the critic's own size under its own flag
    critic.train.advantage_estimator, critic.train.critic_sequence_parallel_size = "gae", 2
    with pytest.raises(ConfigError, match=r"over --train.critic_sequence_parallel_size 2: 128 tokens\) in the critic "
                                          r"group; raise it to 128, or --train.critic_sequence_parallel_size to at "
                                          r"least 4$"):
        validate(critic)
    # 8 rows of 200..256 tokens, each over 3 x the budget: at N = 4 (one data-parallel rank) one row a micro-batch,
    # each rank of the group holding at most 64 of its columns; one rank at the same budget refuses them
    lengths = [184, 200, 240, 230, 190, 210, 224, 236]
    batch = build_rollout_batch([[7] * 16] * 8, [[8] * n for n in lengths], [[0.0] * n for n in lengths], pad_id=0)
    (plan,), steps = group_update_steps(batch, Layout(cfg), "actor", cfg.train, random.Random(0))
    assert steps == [plan] * 4
    (step,) = plan
    assert sorted(r for mb in step.plan for r in mb) == list(range(8)) and len(step.plan) == 8
    for (row,) in step.plan:
        assert 3 * 64 < 16 + lengths[row] and -(-(16 + lengths[row]) // 4) <= 64
    one = long_rows(1)
    one.train.actor_num_ranks = 1
    with pytest.raises(ValueError, match="more than max_tokens_per_microbatch=64"):
        group_update_steps(batch, Layout(one), "actor", one.train, random.Random(0))


def _saved_bytes(group, length: int) -> int:
    """Bytes this rank of ``group`` keeps for the backward (parameters aside) in the log-prob forward of one row of
    ``length`` tokens (sdpa, half of it response)."""
    from rlhf_sg.memory import saved_for_backward
    from rlhf_sg.parallel import sp_response_logprobs, use_ulysses_attention
    from rlhf_sg.tiny import build_tiny_model

    lm = build_tiny_model("llama", "tiny", seed=1)
    lm.set_attn_implementation("sdpa")
    use_ulysses_attention(lm, group.size)
    ids = torch.randint(3, 90, (1, length), generator=torch.Generator().manual_seed(0))
    with saved_for_backward(lm) as saved:
        sp_response_logprobs(lm, ids, torch.ones_like(ids), length // 2, group, chunk_tokens=256)
    return sum(saved.values())


@pytest.mark.slow
def test_a_ranks_saved_activations_for_one_long_row_fall_as_one_over_n():
    """One row of 1024 tokens: what rank 0 keeps for the backward on 2 ranks is about half what one rank keeps (an
    SP group of one rank, measured in rank 0's process of the 2-rank group, after that group's checks)."""
    ranks = _run_group(SAVED_BYTES_SIZE)
    alone, per_rank = ranks[0]["saved_bytes_alone"], [seen["saved_bytes"] for seen in ranks]
    print(f"saved for the backward, one row of {LONG_ROW} tokens: N=1 {alone / 2**20:.2f} MiB, "
          f"N=2 {per_rank[0] / 2**20:.2f} / {per_rank[1] / 2**20:.2f} MiB per rank")
    for got in per_rank:
        assert 0.45 < got / alone < 0.6
