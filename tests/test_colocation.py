"""Colocated layouts: which groups share devices, checked where Ray placed them, and a run in each.

The placement test runs on two simulated Ray nodes of one CPU each, with the shared bundles spread
across them (STRICT_SPREAD): everything the run starts fits only if every group and engine takes a
share of the same two bundles, and rank i of each group must sit on bundle i's node.
"""

import dataclasses
import os
import sys

import pytest
import torch

from rlhf_sg.config import ConfigError, offload_states, sleep_engines, validate
from rlhf_sg.trainer import filter_groups

RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")
sys.path.insert(0, RECIPES)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from quickstart_cpu import prepare

    return prepare(str(tmp_path_factory.mktemp("colocation")), warm_start_steps=5)


def _cfg(task, out, algo="gae", **overrides):
    from quickstart_cpu import make_config

    policy, prompts = task
    cfg = make_config(policy, prompts, out, 2, algo, "hf")
    cfg.log.progress_bar = cfg.log.tensorboard = cfg.log.export_hf = False
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        setattr(getattr(cfg, section), key, value)
    return cfg


# ---- validation (no Ray) ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"train__colocate_actor_ref": True, "train__kl_coef": 0.0}, "no reference model"),
        ({"train__colocate_actor_ref": True, "train__ref_num_ranks": 1}, "--train.ref_num_ranks"),
        ({"train__colocate_critic_reward": True}, "--reward.kind model"),
        ({"train__colocate_all": True, "rollout__num_engines": 1, "train__critic_num_ranks": 2,
          "train__ref_num_ranks": 2}, "--rollout.num_engines"),
        ({"train__colocate_all": True, "rollout__num_engines": 2, "train__critic_num_ranks": 1},
         "--train.critic_num_ranks"),
        ({"train__colocate_all": True, "rollout__num_engines": 2, "train__critic_num_ranks": 2,
          "train__ref_num_ranks": 2, "rollout__tensor_parallel_size": 2}, "--rollout.tensor_parallel_size"),
    ],
)
def test_bad_colocation_is_refused_naming_the_flag(task, tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate(_cfg(task, str(tmp_path), **overrides))


def test_colocate_all_turns_on_sleep_and_offload_unless_the_user_said_otherwise(task, tmp_path):
    base = _cfg(task, str(tmp_path))
    assert not sleep_engines(base) and not offload_states(base)
    together = dict(train__colocate_all=True, rollout__num_engines=2, train__critic_num_ranks=2,
                    train__ref_num_ranks=2)
    cfg = validate(_cfg(task, str(tmp_path), **together))
    assert sleep_engines(cfg) and offload_states(cfg)
    cfg = validate(_cfg(task, str(tmp_path), rollout__sleep_engines_while_training=False,
                        train__offload_states_while_generating=False, **together))
    assert not sleep_engines(cfg) and not offload_states(cfg)


def test_filter_groups_keeps_groups_with_signal_and_every_tensor_in_step():
    n = 4
    scores = torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 0, 0.5, 0.5, 0.5, 0.5, 0, 0, 0, 0.2])
    batch = {"scores": scores, "sequences": torch.arange(16).unsqueeze(1).repeat(1, 3)}
    kept, frac = filter_groups(batch, n)
    assert frac == 0.5
    assert kept["scores"].tolist() == [0, 1, 0, 0, 0, 0, 0, pytest.approx(0.2)]
    assert kept["sequences"][:, 0].tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    none, frac = filter_groups({"scores": torch.ones(8), "sequences": torch.zeros(8, 2)}, n)
    assert none is None and frac == 0.0


# ---- placement and a run (real Ray, DeepSpeed ZeRO-3) --------------------------------------------------------


@pytest.mark.slow
def test_colocate_all_places_rank_i_of_every_group_on_bundle_i_and_trains(task, tmp_path):
    ray = pytest.importorskip("ray")
    import arith_task
    from conftest import two_ray_nodes

    from rlhf_sg.trainer import PPOTrainer

    trainer = None
    with two_ray_nodes(1, [RECIPES]):
        try:
            cfg = _cfg(task, str(tmp_path / "run"), train__colocate_all=True, rollout__num_engines=2,
                       train__critic_num_ranks=2, train__ref_num_ranks=2, train__placement_strategy="STRICT_SPREAD",
                       train__dynamic_filtering=True, train__critic_warmup_steps=0, rollout__prompts_per_step=4,
                       train__gradient_checkpointing=True)
            trainer = PPOTrainer(validate(cfg), reward_fn=arith_task.addition_reward)
            assert trainer.colocation() == [["actor", "ref", "critic", "engines"]]
            trainer.setup()
            where = {role: group.call("resources") for role, group in
                     (("actor", trainer.actor), ("ref", trainer.ref), ("critic", trainer.critic))}
            where["engines"] = ray.get([e.resources.remote() for e in trainer.engines], timeout=120)
            shared_pg = trainer._shared[0].pg.id.hex()
            for role, ranks in where.items():
                assert [r["placement_group_id"] for r in ranks] == [shared_pg] * 2, role
                assert [r["resources"].get("CPU") for r in ranks] == [0.25, 0.25], role  # four tenants a bundle
            assert [r["gradient_checkpointing"] for r in where["actor"] + where["critic"]] == [True] * 4
            assert [r["gradient_checkpointing"] for r in where["ref"]] == [False] * 2  # forwards only
            nodes = [where["actor"][i]["node_id"] for i in range(2)]
            assert nodes[0] != nodes[1]  # the bundles are spread, so "same bundle" shows as "same node"
            for role, ranks in where.items():
                assert [r["node_id"] for r in ranks] == nodes, role

            for step in (1, 2):
                metrics = trainer.train_step()
                # a step whose groups all scored alike trains nothing and syncs nothing (dynamic filtering)
                assert metrics["weight_version"] == trainer.weight_version <= step
                assert "rollout/groups_kept_frac" in metrics
                # CPU: nothing moves (states already in host memory), but the phase is taken and timed
                assert metrics["offload/device_GB"] == 0.0 and metrics["time/offload"] > 0
            versions = ray.get([e.weight_version.remote() for e in trainer.engines], timeout=120)
            assert versions == [trainer.weight_version] * 2  # slept through training, woke for each sync
        finally:
            if trainer is not None:
                trainer.shutdown()


# ---- ZeRO-3 state offload around generation -------------------------------------------------------------------


# Each of these runs one real ZeRO-3 actor rank in a spawned process: DeepSpeed keeps process-wide group state.

_HP = {"temperature": 1.0, "clip_low": 0.2, "clip_high": 0.2, "dual_clip": None, "tis_cap": None,
       "loss_aggregation": "token_mean", "kl_mode": "reward", "kl_coef": 0.0, "kl_estimator": "k1", "entropy_coef": 0.0}


def _in_fresh_process(fn, *args):
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply_async(fn, args).get(timeout=600)


def _actor_rank(model_path: str, device: str):
    """One ZeRO-3 actor rank (world size 1) of the model, and a 4-row rollout batch with its plan."""
    os.environ["DS_ACCELERATOR"] = device
    from rlhf_sg.distributed import free_port
    from rlhf_sg.trainer import build_rollout_batch
    from rlhf_sg.workers import ModelWorker, WorkerSpec

    spec = WorkerSpec(role="actor", model_path=model_path, world_size=1, master_addr="127.0.0.1",
                      master_port=free_port(), train=True, lr=1e-2, device=device, timeout_s=120)
    worker = ModelWorker(dataclasses.asdict(spec), 0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (int(n),), generator=gen).tolist() for n in (5, 9, 3, 7)]
    responses = [torch.randint(3, 90, (int(n),), generator=gen).tolist() for n in (6, 2, 8, 4)]
    rollout = [torch.randn(len(r), generator=gen).tolist() for r in responses]
    batch = build_rollout_batch(prompts, responses, rollout, pad_id=0)
    batch["advantages"] = torch.randn(batch["rollout_logp"].shape, generator=gen) * batch["action_mask"]
    return worker, batch, [[0, 1, 2, 3]]


def _one_step(plan, batch) -> list[dict]:
    return [{"plan": plan, "normalizer": float(batch["action_mask"].sum())}]


def _offload_round_trip(model_path: str, device: str) -> dict:
    """Forward, offload, reload, forward; then a train step after another round trip, and a forward."""
    import torch.distributed as dist

    worker, batch, plan = _actor_rank(model_path, device)
    try:
        _, before = worker.forward(batch, plan)
        freed = worker.offload_states()
        taken = worker.reload_states()
        _, after = worker.forward(batch, plan)
        batch.update(old_logp=before, advantages=torch.ones_like(before), ref_logp=before)
        worker.offload_states()
        worker.reload_states()
        worker.train_actor(batch, _one_step(plan, batch), _HP)
        _, trained = worker.forward(batch, plan)
        return {"freed": freed, "taken": taken, "before": before, "after": after, "trained": trained}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_offload_then_reload_leaves_the_worker_exact_and_trainable(tmp_path, device):
    """A real ZeRO-3 actor rank: its log-probs are bit-identical after an offload and reload, it still takes
    an optimizer step, and on GPU the offload frees device memory (on CPU there is nothing to move and it
    says so with 0)."""
    from rlhf_sg.tiny import save_tiny_model

    path = save_tiny_model(str(tmp_path / "m"), arch="qwen2", size="tiny")
    out = _in_fresh_process(_offload_round_trip, path, device)
    if device == "cuda":
        assert out["freed"] > 0 and out["taken"] > 0
    else:
        assert out["freed"] == 0 and out["taken"] == 0
    assert torch.equal(out["before"], out["after"])
    assert (out["trained"] - out["before"]).abs().max() > 1e-3  # the step after a round trip moved the policy


def test_the_offload_calls_match_the_installed_deepspeed():
    """What :meth:`ModelWorker.offload_states` relies on, read from the installed DeepSpeed: the engine's
    offload/reload signatures, and that ZeRO-3 moves optimizer states only for FusedAdam (hence the
    worker's GPU optimizer)."""
    import inspect

    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    offload = inspect.signature(DeepSpeedEngine.offload_states).parameters
    assert {"include", "device", "pin_memory", "non_blocking"} <= set(offload)
    assert "non_blocking" in inspect.signature(DeepSpeedEngine.reload_states).parameters
    assert "FusedAdam" in inspect.getsource(DeepSpeedZeroOptimizer_Stage3.offload_states)


def _one_update(model_path: str, with_old_logp: bool) -> dict:
    """One PPO update, given the old log-probs from a separate forward or not (then the update's own forward
    supplies them). Returns the log-probs after and the update's metrics."""
    import torch.distributed as dist

    worker, batch, plan = _actor_rank(model_path, "cpu")
    try:
        if with_old_logp:
            batch["old_logp"] = worker.forward(batch, plan)[1]
        hp = dict(_HP, tis_cap=2.0, kl_mode="loss")
        metrics = worker.train_actor(batch, _one_step(plan, batch), hp)
        return {"after": worker.forward(batch, plan)[1], "metrics": metrics}
    finally:
        dist.destroy_process_group()


def test_one_update_without_the_old_logprob_pass_equals_the_update_with_it(tmp_path):
    """Skipping the separate old-log-prob forward (one update per batch) changes nothing in the update."""
    from rlhf_sg.tiny import save_tiny_model

    path = save_tiny_model(str(tmp_path / "m"), arch="qwen2", size="tiny")
    separate = _in_fresh_process(_one_update, path, True)
    fused = _in_fresh_process(_one_update, path, False)
    torch.testing.assert_close(fused["after"], separate["after"], rtol=0, atol=1e-6)
    assert "actor/logp_gap_engine_vs_trainer" in fused["metrics"]
    assert "actor/logp_gap_engine_vs_trainer" not in separate["metrics"]
