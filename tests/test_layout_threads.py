"""Threads per rank and per engine on CPU (:class:`rlhf_sg.trainer.layout.Layout`): the cores shared among the
processes that compute at the same time, hand-counted for an 8-core machine."""

from __future__ import annotations

import pytest

from rlhf_sg.config import Config
from rlhf_sg.trainer import layout as layout_module
from rlhf_sg.trainer.layout import Layout


@pytest.fixture
def eight_cores(monkeypatch):
    monkeypatch.setattr(layout_module.os, "cpu_count", lambda: 8)


def _cfg(estimator="grpo", actor=2, critic=1, kl=0.0, threads=None, engines=1, mode="sync", **train):
    cfg = Config()
    cfg.model.pretrain = "MODEL"
    cfg.train.advantage_estimator = estimator
    cfg.train.actor_num_ranks, cfg.train.critic_num_ranks, cfg.train.kl_coef = actor, critic, kl
    cfg.train.worker_threads = threads
    cfg.rollout.num_engines = engines
    cfg.rollout.mode = mode
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


def test_sync_grpo_actor_ranks_share_every_core(eight_cores):
    assert Layout(_cfg(actor=2)).worker_threads("actor") == 4
    assert Layout(_cfg(actor=1)).worker_threads("actor") == 8
    assert Layout(_cfg(actor=3)).worker_threads("actor") == 2  # 8 // 3: never more threads than cores
    assert Layout(_cfg(actor=1)).engine_threads() == 8  # the engines generate while every rank waits


def test_actor_and_critic_train_together_and_the_reference_runs_alone(eight_cores):
    layout = Layout(_cfg("gae", actor=2, critic=2, kl=0.01))
    assert layout.worker_threads("actor") == 2 and layout.worker_threads("critic") == 2  # 4 ranks at once
    assert layout.worker_threads("ref") == 8  # its forward is a phase of its own (1 rank)


def test_async_rollout_splits_the_cores_between_engines_and_trainer(eight_cores):
    layout = Layout(_cfg(actor=1, engines=1, mode="async"))
    assert layout.overlaps_rollout()
    assert layout.worker_threads("actor") == 4 and layout.engine_threads() == 4
    # colocated, an async run stays sync: the phases take turns again
    colocated = Layout(_cfg(actor=1, engines=1, mode="async", colocate_all=True))
    assert not colocated.overlaps_rollout()
    assert colocated.worker_threads("actor") == 8 and colocated.engine_threads() == 8


def test_a_set_thread_count_wins_and_gpu_ranks_get_one(eight_cores):
    assert Layout(_cfg(threads=3)).worker_threads("actor") == 3
    assert Layout(_cfg(device="cuda")).worker_threads("actor") == 1


def test_one_core_gives_every_rank_one_thread(monkeypatch):
    monkeypatch.setattr(layout_module.os, "cpu_count", lambda: 1)
    assert Layout(_cfg(actor=2)).worker_threads("actor") == 1
    assert Layout(_cfg(actor=1, mode="async")).engine_threads() == 1


def test_the_worker_spec_carries_the_rank_threads(eight_cores):
    assert Layout(_cfg(actor=2)).worker_spec("actor").threads == 4
    assert Layout(_cfg(actor=2, threads=1)).worker_spec("actor").threads == 1


def test_only_a_group_of_one_rank_goes_unpartitioned_unless_told_to_stay_zero3():
    assert Layout(_cfg(actor=1)).zero_stage("actor") == 0  # by default a group of one rank is unpartitioned
    assert Layout(_cfg(actor=1, single_rank_zero3=True)).zero_stage("actor") == 3
    assert Layout(_cfg(actor=2, single_rank_zero3=False)).zero_stage("actor") == 3  # several ranks: ZeRO-3
    cfg = _cfg("gae", actor=2, critic=1, kl=0.01, single_rank_zero3=False, ref_num_ranks=1, ref_offload=True)
    layout = Layout(cfg)
    assert layout.zero_stage("critic") == 0
    assert layout.zero_stage("ref") == 3  # parameter offload is ZeRO-3's
    assert layout.worker_spec("critic").zero_stage == 0 and layout.worker_spec("actor").zero_stage == 3


def test_the_unpartitioned_deepspeed_config():
    from rlhf_sg.distributed import zero3_config

    fp32 = zero3_config(stage=0, max_grad_norm=0.5)
    # float32: the torch optimizer clips and skips itself (rlhf_sg.workers.NonFiniteSkip), so DeepSpeed does not clip
    assert fp32["zero_optimization"] == {"stage": 0} and fp32["gradient_clipping"] == 0.0
    bf16 = zero3_config(dtype="bfloat16", stage=0, max_grad_norm=0.5)
    # bfloat16: ZeRO stage 1 over one rank (float32 master weights), which clips and skips
    assert bf16["zero_optimization"] == {"stage": 1} and bf16["gradient_clipping"] == 0.5
    assert bf16["bf16"] == {"enabled": True, "check_grad_overflow": True}
    assert zero3_config(dtype="bfloat16", stage=0, train=False)["zero_optimization"] == {"stage": 0}
    assert zero3_config(max_grad_norm=0.5)["zero_optimization"]["stage"] == 3
    with pytest.raises(ValueError, match="parameter offload needs ZeRO-3"):
        zero3_config(stage=0, offload=True)
    with pytest.raises(ValueError, match="stage must be 0 or 3"):
        zero3_config(stage=2)


def test_an_engine_driving_servers_elsewhere_asks_ray_for_no_gpu(monkeypatch):
    """The engines' Ray actors ask for tensor_parallel_size GPUs each on CUDA, and for none when they drive SGLang
    servers running elsewhere: the HTTP client holds no GPU, and under RAY_ADDRESS (where the device check is
    skipped) an actor asking for the servers' GPU count would never be scheduled. What the cluster hands
    ``start_engine_actors`` is bound to its real signature."""
    import inspect

    from rlhf_sg import engine_actor
    from rlhf_sg.config import check_devices
    from rlhf_sg.trainer.cluster import Cluster

    real = inspect.signature(engine_actor.start_engine_actors)
    asked = []
    monkeypatch.setattr(engine_actor, "start_engine_actors",
                        lambda *a, **kw: asked.append(real.bind(*a, **kw).arguments["num_gpus"]) or [])

    def cfg(**engine_kwargs):
        config = _cfg(actor=8, device="cuda")
        config.rollout.backend, config.rollout.tensor_parallel_size = "sglang", 16
        config.rollout.engine_kwargs = engine_kwargs
        return config

    on_servers = cfg(server_urls=["http://node1:30000", "http://node2:30000"])
    Cluster(on_servers)._start_engines()
    Cluster(cfg())._start_engines()
    assert asked == [0.0, 16.0]
    check_devices(on_servers, visible=8)  # the trainer's 8 ranks are all this cluster's GPUs hold
