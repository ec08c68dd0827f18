"""Sequence parallelism in the trainer's workers: an actor or critic group of 2 ZeRO-3 ranks with
``sequence_parallel_size`` 2 (one SP group, one data-parallel rank) takes the same training step as one rank alone.

Each rank is a real :class:`rlhf_sg.workers.ModelWorker` (DeepSpeed ZeRO-3 on gloo) in a process of its own
(:mod:`zero3_rank`); both ranks of the SP group are given the same batch and plan, as the controller gives them
(the trainer's :func:`rlhf_sg.trainer.ppo.group_update_steps`: the split and the normaliser over the data-parallel
ranks). Each runs the scoring forward, then one optimizer step through ``train_actor`` / ``train_critic``; the test
reads the gradients DeepSpeed reduced (at the step, before the optimizer consumes them),
the reported loss and gradient norm, and the parameters after the step. All must equal the one-rank group's: the SP
group's gradients are summed (the loss convention of :mod:`rlhf_sg.parallel.forward`) and not averaged by ZeRO-3's
reduction over the group's ranks (the loss scale of :mod:`rlhf_sg.parallel.groups`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import random

import pytest
import torch
from test_packing import TOL, assert_grads_close

#: every collective of a rank's groups fails after this long
TIMEOUT_S = 120
#: prompt and response lengths of the batch: packed rows of 14 tokens (14 | 13 | 7 + 5), so that one row packs two
#: sequences, and sequence 0's response (columns 5..13) crosses the shard edge of N = 2 (column 7)
PROMPTS, RESPONSES = (5, 3, 7, 2), (9, 4, 6, 3)
LR = 1e-2
#: the token budget of a micro-batch: the whole batch (or a data-parallel rank's part) in one
MAX_TOKENS = 64
#: a gradient entry above this fraction of its tensor's largest is 10 x the fp32 rounding of a sum in another
#: order (1e-5 of the largest, :func:`test_packing.assert_grads_close`)
STEADY = 1e-4


def _model_dir(path: str) -> str:
    """The tiny preset's llama saved with a value head (so the critic's head is the same on every run)."""
    from safetensors.torch import save_file

    from rlhf_sg.models import VALUE_HEAD_FILE, VALUE_HEAD_KEY
    from rlhf_sg.tiny import build_tiny_model

    model = build_tiny_model("llama", "tiny", seed=11)
    model.save_pretrained(path)
    head = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(12)) * 0.1
    save_file({VALUE_HEAD_KEY: head}, os.path.join(path, VALUE_HEAD_FILE))
    return path


def _experience():
    """The batch: rollout log-probs, advantages, old values and returns (the old log-probs are the scoring
    forward's, shifted, so that the ratio's clip binds on some tokens)."""
    from rlhf_sg.trainer import build_rollout_batch

    gen = torch.Generator().manual_seed(13)
    prompts = [torch.randint(3, 90, (n,), generator=gen).tolist() for n in PROMPTS]
    responses = [torch.randint(3, 90, (n,), generator=gen).tolist() for n in RESPONSES]
    batch = build_rollout_batch(prompts, responses, [[0.0] * len(r) for r in responses], pad_id=0)
    action = batch.action_mask
    batch.advantages = torch.randn(action.shape, generator=gen) * action
    batch.values = torch.randn(action.shape, generator=gen) * action
    batch.returns = torch.randn(action.shape, generator=gen) * action
    batch.old_logp = torch.randn(action.shape, generator=gen) * 0.3  # added to the scoring forward's
    return batch


def _rank(role: str, rank: int, world: int, size: int, port: int, model_dir: str, checkpointing: bool,
          lora: bool = False) -> dict:
    """One rank of a ``role`` group of ``world`` ranks in SP groups of ``size``, given its micro-batches as the
    controller gives them (the batch split over the data-parallel ranks, the normaliser per data-parallel rank): the
    scoring forward's rows and result, one optimizer step's metrics, the reduced gradients at the step and the
    trained parameters before and after it. ``checkpointing``: gradient checkpointing (the backward recomputes each
    layer, its all-to-alls included). ``lora``: the model carries a fresh LoRA adapter (:data:`LORA`), only it
    trains."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad
    from zero3_rank import PLAIN_UPDATE

    from rlhf_sg.config import Config, LoraConfig
    from rlhf_sg.experience import CriticUpdate
    from rlhf_sg.trainer.layout import Layout
    from rlhf_sg.trainer.ppo import group_update_steps
    from rlhf_sg.workers import ModelWorker, WorkerSpec

    torch.set_num_threads(1)
    spec = WorkerSpec(role=role, model_path=model_dir, world_size=world, master_addr="127.0.0.1", master_port=port,
                      train=True, lr=LR, timeout_s=TIMEOUT_S, zero_stage=3,
                      sequence_parallel_size=size, gradient_checkpointing=checkpointing,
                      lora=dataclasses.asdict(LoraConfig(**LORA)) if lora else None)
    worker = ModelWorker(dataclasses.asdict(spec), rank)
    try:
        columns: list[int] = []  # the widest rows the model's embedding was handed (this rank's columns)
        embedding = next(m for name, m in worker.module.named_modules() if name.endswith("embed_tokens"))
        embedding.register_forward_hook(lambda _m, args, _out: columns.append(args[0].shape[-1]))
        layer_calls: list[int] = []  # the first decoder layer's forwards begun (a recomputation, which stops once it
        # has what the backward needs, counts)
        layer = next(m for name, m in worker.module.named_modules() if name.endswith("layers.0"))
        layer.register_forward_pre_hook(lambda *_: layer_calls.append(1))
        batch = _experience()
        # the controller's optimizer step, as the trainer makes it (the split and the normaliser over the
        # data-parallel ranks): one epoch, one minibatch
        cfg = Config()
        t = cfg.train
        t.ppo_epochs, t.num_minibatches, t.max_tokens_per_microbatch = 1, 1, MAX_TOKENS
        t.actor_num_ranks = t.critic_num_ranks = world
        t.sequence_parallel_size = size
        steps = group_update_steps(batch, Layout(cfg), role, t, random.Random(0))[1][rank]
        order, scored = worker.forward(batch, steps[0].plan)
        named = [(name, p) for name, p in worker.module.named_parameters() if p.requires_grad]
        initial = {name: safe_get_full_fp32_param(p).clone() for name, p in named}
        grads: dict[str, torch.Tensor] = {}
        losses: list[float] = []
        step, backward = worker.engine.step, worker.engine.backward

        def step_reading_grads(*args, **kwargs):
            grads.update({name: safe_get_full_grad(p).clone() for name, p in named})
            return step(*args, **kwargs)

        def backward_reading_loss(loss, **kwargs):
            losses.append(loss.item())
            return backward(loss, **kwargs)

        worker.engine.step, worker.engine.backward = step_reading_grads, backward_reading_loss
        if role == "actor":
            batch.old_logp[order] += scored
            metrics = worker.train_actor(batch, steps, PLAIN_UPDATE)
        else:
            metrics = worker.train_critic(batch, steps, CriticUpdate(value_clip=0.2))
        params = {name: safe_get_full_fp32_param(p).clone() for name, p in named}
        worker.save_checkpoint(_checkpoint_dir(model_dir, role, world, size, checkpointing, lora), TAG, {})
        return {"rows": order, "scored": scored, "metrics": metrics, "grads": grads, "params": params,
                "initial": initial,
                "moments": _moments(named), "backward_loss": losses, "columns": max(columns),
                "layer_calls": len(layer_calls)}
    finally:
        dist.destroy_process_group()


def _lora_rank(role: str, rank: int, world: int, size: int, port: int, model_dir: str, checkpointing: bool) -> dict:
    """:func:`_rank` with a LoRA adapter."""
    return _rank(role, rank, world, size, port, model_dir, checkpointing, lora=True)


#: the tag each group's checkpoint after its step is saved under
TAG = "step1"
#: the adapter of a ``lora`` group (--lora.*): every linear layer, B = 0 at the start as a fresh adapter's
LORA = {"rank": 4, "alpha": 8.0}


def _checkpoint_dir(model_dir: str, role: str, world: int, size: int, checkpointing: bool, lora: bool = False) -> str:
    return f"{model_dir}-checkpoint-{role}-{world}-{size}-{checkpointing}" + ("-lora" if lora else "")


def _moments(named) -> dict[str, torch.Tensor]:
    """Adam's first and second moments of every parameter, whole (gathered from the ZeRO-3 partitions)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    return {f"{name} {key}": safe_get_full_optimizer_state(p, key).clone() for name, p in named
            for key in ("exp_avg", "exp_avg_sq")}


def _loading_rank(role: str, rank: int, world: int, size: int, port: int, model_dir: str, path: str) -> dict:
    """One rank of a fresh ``role`` group of ``world`` ranks in SP groups of ``size`` that loads the checkpoint in
    ``path`` (as a resume does): its parameters and optimizer moments."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param

    from rlhf_sg.workers import ModelWorker, WorkerSpec

    torch.set_num_threads(1)
    spec = WorkerSpec(role=role, model_path=model_dir, world_size=world, master_addr="127.0.0.1", master_port=port,
                      train=True, lr=LR, timeout_s=TIMEOUT_S, zero_stage=3, sequence_parallel_size=size)
    worker = ModelWorker(dataclasses.asdict(spec), rank)
    try:
        worker.load_checkpoint(path, TAG)
        named = list(worker.module.named_parameters())
        return {"params": {name: safe_get_full_fp32_param(p).clone() for name, p in named},
                "moments": _moments(named)}
    finally:
        dist.destroy_process_group()


#: each group's ranks' results, by (role, ranks, SP size, model): the one-rank step is shared by the tests
_GROUPS: dict[tuple, list[dict]] = {}


def _group(role: str, world: int, size: int, model_dir: str, checkpointing: bool = False,
           lora: bool = False) -> list[dict]:
    key = (role, world, size, model_dir, checkpointing, lora)
    if key not in _GROUPS:
        _GROUPS[key] = _spawn(*key[:-1], run=_lora_rank if lora else None)
    return _GROUPS[key]


def _spawn(role: str, world: int, size: int, model_dir: str, last, run=None) -> list[dict]:
    """``run`` (``_rank`` by default) in a process for each of the ``world`` ranks, ``last`` its last argument."""
    from zero3_rank import in_fresh_process

    from rlhf_sg.distributed import free_port

    port = free_port()
    with concurrent.futures.ThreadPoolExecutor(world) as pool:
        futures = [pool.submit(in_fresh_process, run or _rank, role, rank, world, size, port, model_dir, last,
                               timeout_s=4 * TIMEOUT_S) for rank in range(world)]
        failed = {rank: f.exception() for rank, f in enumerate(futures)}
    if any(failed.values()):
        pytest.fail("\n".join(f"{role} rank {rank}: {type(e).__name__}: {e}" for rank, e in failed.items()
                              if e is not None), pytrace=False)
    return [f.result() for f in futures]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return _model_dir(str(tmp_path_factory.mktemp("tiny-sp")))


def _assert_the_one_rank_step(role: str, alone: dict, split: list[dict], size: int) -> None:
    """Each rank of ``split`` (SP groups of ``size``) saw ``alone``'s step: its rows' scoring results, the loss,
    metrics, gradient norm, every reduced gradient, and the updated weights (fp32, the one-rank packed forward's
    tolerance). Each rank back-propagates ``size`` x its data-parallel rank's loss (ZeRO-3 divides the sum over the
    group's ranks by all of them)."""
    steady_weights = []
    assert f"{role}/grad_norm" in alone["metrics"], sorted(alone["metrics"])
    for rank, seen in enumerate(split):
        where = f"{role} rank {rank} of {len(split)} (SP {size})"
        expected = torch.stack([alone["scored"][alone["rows"].index(row)] for row in seen["rows"]])
        torch.testing.assert_close(seen["scored"], expected, atol=TOL, rtol=0, msg=where)
        norm = f"{role}/grad_norm"
        assert seen["metrics"][norm] == pytest.approx(alone["metrics"][norm], rel=1e-5), \
            f"{where}: gradient norm {seen['metrics'][norm]} vs one rank's {alone['metrics'][norm]}"
        assert seen["metrics"].keys() == alone["metrics"].keys(), where
        for key, value in alone["metrics"].items():  # the losses' parts, the clip fractions, the entropy
            assert seen["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), f"{where}: {key}"
        for name, grad in alone["grads"].items():
            assert_grads_close(seen["grads"][name], grad, f"{where} grad {name}")
        for name, param in alone["params"].items():
            # Adam's first step moves a weight by LR x g / (|g| + 1e-8): exact where the gradient is 0 (rows of tokens
            # not in the batch) or well above its rounding, and hanging on the rounding of the few that are not
            grad = alone["grads"][name]
            steady = (grad == 0) | (grad.abs() > STEADY * grad.abs().max())
            steady_weights += [steady.sum().item(), grad.numel()]
            torch.testing.assert_close(seen["params"][name][steady], param[steady], atol=TOL, rtol=0,
                                       msg=lambda m, at=f"{where} {name}": f"{at}: {m}")
    assert sum(steady_weights[::2]) > 0.99 * sum(steady_weights[1::2]), steady_weights
    # the SP group's ranks back-propagate one loss, size x their data-parallel rank's; those average to one rank's
    groups = [split[k:k + size] for k in range(0, len(split), size)]
    assert all(seen["backward_loss"] == group[0]["backward_loss"] for group in groups for seen in group)
    mean = sum(group[0]["backward_loss"][0] for group in groups) / (size * len(groups))
    assert mean == pytest.approx(alone["backward_loss"][0], rel=1e-5), (mean, alone["backward_loss"])
    moved = max((alone["params"][n] - p).abs().max().item() for n, p in alone["initial"].items())
    assert moved > LR / 2  # the step changed the weights (Adam's first step moves each by about the LR)


@pytest.mark.slow
@pytest.mark.parametrize("role,lora", [("actor", False), ("critic", False), ("actor", True)],
                         ids=["actor", "critic", "lora-actor"])
def test_an_sp_group_of_two_ranks_takes_the_one_rank_training_step(role, lora, model_dir):
    """One SP group of 2 ranks (one data-parallel rank) takes one rank's step, each rank on half the columns; a LoRA
    actor (PEFT's wrapper inside the DeepSpeed engine, switched to the Ulysses attention through it) too, its
    adapters alone training."""
    (alone,) = _group(role, 1, 1, model_dir, lora=lora)
    split = _group(role, 2, 2, model_dir, lora=lora)
    assert all(("lora_" in name) == lora for name in alone["params"])
    # each rank ran its half of the packed rows' columns (a response crosses the edge), the rank alone all of them
    assert alone["columns"] == max(p + r for p, r in zip(PROMPTS, RESPONSES))
    assert [seen["columns"] for seen in split] == [alone["columns"] // 2] * 2, (alone["columns"], split)
    _assert_the_one_rank_step(role, alone, split, 2)


def _scoring_rank(role: str, rank: int, world: int, size: int, port: int, model_dir: str, plan) -> dict:
    """One rank of a forward-only ``role`` group (reward model, teacher) of ``world`` ranks in SP groups of ``size``:
    its scoring forward of the batch's rows in ``plan``."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import torch.distributed as dist

    from rlhf_sg.workers import ModelWorker, WorkerSpec

    torch.set_num_threads(1)
    spec = WorkerSpec(role=role, model_path=model_dir, world_size=world, master_addr="127.0.0.1", master_port=port,
                      train=False, timeout_s=TIMEOUT_S, zero_stage=3, sequence_parallel_size=size)
    worker = ModelWorker(dataclasses.asdict(spec), rank)
    try:
        return dict(zip(("rows", "scores"), worker.forward(_experience(), plan)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_reward_models_sp_group_of_two_ranks_scores_as_one_rank(model_dir, tmp_path):
    """A reward-model group of 2 ranks in one SP group (ZeRO-3) scores the batch as the one-rank forward does: each
    row's last token (some rows' on each rank's columns) through the value head, normalised by the statistics the
    reward model was saved with."""
    import json
    import shutil

    from rlhf_sg.models import REWARD_NORMALIZATION_FILE
    from rlhf_sg.packing import pack, reward_scores
    from rlhf_sg.parallel import shard_packed
    from rlhf_sg.workers import WorkerSpec, load_worker_model

    reward_dir = str(tmp_path / "reward_model")
    shutil.copytree(model_dir, reward_dir)
    with open(os.path.join(reward_dir, REWARD_NORMALIZATION_FILE), "w") as f:
        json.dump({"mean": 0.5, "std": 2.0}, f)
    batch, plan = _experience(), [[2, 0, 3, 1]]  # one micro-batch, its rows out of order
    micro = batch.rows(plan[0])
    packed = pack(micro.sequences, micro.attention_mask, row_tokens=int(micro.attention_mask.sum(1).max()))
    last = packed.cu_seqlens[1:].long() - 1
    owners = [k for k in range(2) if shard_packed(packed, 2, k).local_index(packed.slots[last])[0].any()]
    assert owners == [0, 1]
    model = load_worker_model(WorkerSpec(role="reward", model_path=reward_dir, world_size=1, master_addr="",
                                         master_port=0, train=False))
    assert (model.reward_mean, model.reward_std) == (0.5, 2.0)
    with torch.no_grad():
        expected = model.normalize_rewards(reward_scores(model, batch.sequences, batch.attention_mask))
    for rank, seen in enumerate(_spawn("reward", 2, 2, reward_dir, plan, run=_scoring_rank)):
        assert seen["rows"] == [2, 0, 3, 1], rank
        torch.testing.assert_close(seen["scores"], expected[seen["rows"]], atol=TOL, rtol=0, msg=f"rank {rank}")


@pytest.mark.slow
def test_a_teachers_sp_group_of_two_ranks_scores_as_one_rank(model_dir):
    """A teacher group of 2 ranks in one SP group (ZeRO-3, forward only) gives the one-rank log-probs of the rows it
    is handed, in their order (a response crossing the shard edge)."""
    from rlhf_sg.packing import response_logprobs
    from rlhf_sg.workers import WorkerSpec, load_worker_model

    batch, plan = _experience(), [[1, 3, 0, 2]]
    model = load_worker_model(WorkerSpec(role="teacher", model_path=model_dir, world_size=1, master_addr="",
                                         master_port=0, train=False))
    with torch.no_grad():
        expected = response_logprobs(model, batch.sequences, batch.attention_mask, batch.response_width)
    for rank, seen in enumerate(_spawn("teacher", 2, 2, model_dir, plan, run=_scoring_rank)):
        assert seen["rows"] == [1, 3, 0, 2], rank
        torch.testing.assert_close(seen["scores"], expected[seen["rows"]], atol=TOL, rtol=0, msg=f"rank {rank}")


@pytest.mark.slow
def test_an_sp_groups_checkpoint_resumes_at_another_size(model_dir):
    """The checkpoint the actor's SP group of 2 saved after its step (ZeRO-3 partitions over all the group's ranks,
    not the data-parallel ones: DeepSpeed is given no SP groups) loads into 2 ranks at N = 1 as a resume loads it:
    every parameter and Adam moment as the SP group held them. (The other way, N = 1 -> 2, is the same files.)"""
    split = _group("actor", 2, 2, model_dir)
    path = _checkpoint_dir(model_dir, "actor", 2, 2, False)
    for seen in _spawn("actor", 2, 1, model_dir, path, run=_loading_rank):
        for key in ("params", "moments"):
            assert seen[key].keys() == split[0][key].keys()
            for name, value in split[0][key].items():
                assert torch.equal(seen[key][name], value), f"{key} {name}"
    assert any(m.abs().max() > 0 for m in split[0]["moments"].values())  # the step left moments to resume


@pytest.mark.slow
def test_two_data_parallel_sp_groups_with_gradient_checkpointing_take_the_one_rank_training_step(model_dir):
    """4 actor ranks: 2 data-parallel ranks x SP groups of 2, the batch split over the data-parallel ranks only (as
    the controller splits it) and each SP group's gradients summed, then averaged over data parallelism; with
    gradient checkpointing, whose backward recomputes each layer, all-to-alls included, in the same order on the
    group's ranks."""
    (alone,) = _group("actor", 1, 1, model_dir)
    split = _group("actor", 4, 2, model_dir, checkpointing=True)
    # scoring forward, the update's forward, and the backward's recomputation of the layer
    assert alone["layer_calls"] == 2 and [seen["layer_calls"] for seen in split] == [3] * 4, split
    assert split[0]["rows"] == split[1]["rows"] and split[2]["rows"] == split[3]["rows"]
    assert sorted(split[0]["rows"] + split[2]["rows"]) == [0, 1, 2, 3]
    _assert_the_one_rank_step("actor", alone, split, 2)


@pytest.mark.slow
def test_a_trainer_run_with_sequence_parallel_groups(ray_cluster, tmp_path):
    """PPO with a critic (GAE), a reference and a reward model through the trainer, every group 2 ranks in one SP
    group of 2 on the tiny preset, sharing prompts (4 samples a prompt; sdpa: the ranks' models on the blocks): the
    run completes its steps, the reward model's SP group scores every completion (one plan per data-parallel rank),
    and the actor's SP forward on the shared-prompt rows gives the engine's log-probs of the sampled tokens (the gap
    every run logs, within the tolerance the other end-to-end runs hold)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
    import arith_task
    from quickstart_cpu import make_config

    from rlhf_sg.models import ValueHeadModel
    from rlhf_sg.tiny import build_tiny_model, build_tokenizer
    from rlhf_sg.trainer import train

    policy, reward_model = str(tmp_path / "policy"), str(tmp_path / "reward_model")
    tokenizer = build_tokenizer()
    build_tiny_model("qwen2", "tiny", seed=0).save_pretrained(policy, safe_serialization=True)
    tokenizer.save_pretrained(policy)
    torch.manual_seed(1)
    ValueHeadModel.from_pretrained(policy).save_pretrained(reward_model)
    prompts = arith_task.write_prompts(str(tmp_path / "prompts.jsonl"), seed=0)
    steps = 2
    cfg = make_config(policy, prompts, str(tmp_path / "run"), steps=steps, algo="gae", backend="hf")
    cfg.log.progress_bar = cfg.log.tensorboard = cfg.log.export_hf = False
    cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt = 4, 4
    cfg.train.critic_warmup_steps = 0
    cfg.train.sequence_parallel_size = 2
    cfg.train.actor_num_ranks = cfg.train.critic_num_ranks = cfg.train.ref_num_ranks = cfg.reward.num_ranks = 2
    cfg.reward.kind, cfg.reward.function, cfg.model.reward_pretrain = "model", None, reward_model
    cfg.train.colocate_critic_reward = True  # the cluster's 8 CPUs: 7 bundles with the engine
    assert cfg.train.share_prompts and cfg.model.attn_implementation == "sdpa"
    history = train(cfg)
    assert len(history) == steps and history[-1]["weight_version"] == steps
    first = history[0]
    assert first["time/actor_logprob"] > 0 and first["time/critic"] > 0 and first["time/reference"] > 0
    assert all(math.isfinite(h["reward/mean"]) and h["reward/std"] > 0 for h in history)  # the model's scores
    assert all(h["actor/updates"] > 0 and h["critic/updates"] > 0 and h["actor/grad_norm"] > 0 for h in history)
    print("engine vs trainer log-prob gap per step:", [h["rollout/logp_gap_engine_vs_trainer"] for h in history])
    assert 0 <= first["rollout/logp_gap_engine_vs_trainer"] < 0.05, first["rollout/logp_gap_engine_vs_trainer"]


def _digits_reward(prompts: list[str], completions: list[str], labels: list) -> list[float]:
    """The share of a completion's characters that are digits: a score that differs between random completions,
    so GRPO's advantages (and the gradients) are not all zero."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


@pytest.mark.slow
def test_a_long_response_run_whose_rows_are_several_times_a_ranks_budget(ray_cluster, tmp_path):
    """GRPO through the trainer on a policy that never ends a response (no EOS id in its configs or tokenizer), so
    every row is the prompt and 240 response tokens, over 3 x ``--train.max_tokens_per_microbatch`` 64: 4 actor
    ranks in one SP group of 4 (64 columns of a row each) score and train 2 steps; the same config on 4 ranks at
    N = 1 is refused before Ray starts, naming the flag."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
    import arith_task
    from quickstart_cpu import make_config

    from rlhf_sg.config import ConfigError
    from rlhf_sg.tiny import build_tiny_model, build_tokenizer
    from rlhf_sg.trainer import train

    policy = str(tmp_path / "policy")
    model = build_tiny_model("qwen2", "tiny", seed=0)
    model.config.eos_token_id = model.generation_config.eos_token_id = None
    model.save_pretrained(policy, safe_serialization=True)
    tokenizer = build_tokenizer()
    tokenizer.eos_token = None
    tokenizer.save_pretrained(policy)
    prompts = arith_task.write_prompts(str(tmp_path / "prompts.jsonl"), seed=0)
    budget, response = 64, 240

    def long_rows(size: int):
        cfg = make_config(policy, prompts, str(tmp_path / f"run{size}"), steps=2, algo="grpo", backend="hf")
        cfg.log.progress_bar = cfg.log.tensorboard = cfg.log.export_hf = False
        cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt = 2, 2
        cfg.rollout.max_new_tokens, cfg.rollout.max_model_len = response, cfg.data.max_prompt_len + response
        cfg.train.kl_coef, cfg.train.share_prompts = 0.0, False
        cfg.train.recompute_old_logp = True  # the scoring forward's micro-batches too
        cfg.train.actor_num_ranks, cfg.train.sequence_parallel_size = 4, size
        cfg.train.max_tokens_per_microbatch = budget
        return cfg

    with pytest.raises(ConfigError, match=r"^--train.max_tokens_per_microbatch \(64\) must hold one full sequence "):
        train(long_rows(1), reward_fn=_digits_reward)
    history = train(long_rows(4), reward_fn=_digits_reward)
    assert len(history) == 2 and history[-1]["weight_version"] == 2
    for h in history:
        assert h["time/actor_logprob"] > 0
        assert h["rollout/response_len"] == response and h["rollout/truncated_frac"] == 1.0  # rows > 3 x budget
        assert h["actor/updates"] > 0 and h["actor/grad_norm"] > 0
    print("engine vs trainer log-prob gap per step:", [h["rollout/logp_gap_engine_vs_trainer"] for h in history])
    assert 0 <= history[0]["rollout/logp_gap_engine_vs_trainer"] < 0.05
