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
