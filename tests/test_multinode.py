"""Two Ray nodes simulated on one machine: the actor's ZeRO-3 ranks and the engines land on both, and a
full PPO step (generate, reward, reference, critic, train, weight sync) runs across them."""

import os
import sys

import pytest
from conftest import two_ray_nodes
from test_netns_node import _netns_usable

RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")
sys.path.insert(0, RECIPES)

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow


@pytest.mark.skipif(_netns_usable() is None, reason="tests/test_netns_node.py trains across two nodes, the second "
                    "with an address of its own (this simulated pair shares one address: run where that cannot)")
def test_step_across_two_nodes(tmp_path):
    import arith_task
    from quickstart_cpu import make_config, prepare

    from rlhf_sg.trainer import PPOTrainer

    trainer = None
    with two_ray_nodes(3, [RECIPES]):
        try:
            assert len([n for n in ray.nodes() if n["Alive"]]) == 2
            policy, prompts = prepare(str(tmp_path / "task"), warm_start_steps=5)
            cfg = make_config(policy, prompts, str(tmp_path / "run"), steps=1, algo="gae", backend="hf")
            cfg.rollout.num_engines = 2
            cfg.rollout.prompts_per_step = 4
            cfg.train.placement_strategy = "STRICT_SPREAD"
            cfg.rollout.sleep_engines_while_training = True  # the colocated layout: engines sleep while training
            cfg.train.max_steps = 2
            cfg.log.progress_bar = cfg.log.tensorboard = cfg.log.export_hf = False
            trainer = PPOTrainer(cfg, reward_fn=arith_task.addition_reward)
            trainer.setup()
            actor_nodes = trainer.cluster.actor.call("node_id")
            assert len(set(actor_nodes)) == 2, actor_nodes
            engine_nodes = ray.get([e.describe.remote() for e in trainer.engines], timeout=120)
            assert {e["engine_index"] for e in engine_nodes} == {0, 1}
            trainer.train_step()
            metrics = trainer.train_step()  # generates with engines that slept through the first step's training
            assert metrics["weight_version"] == 2
            assert all(metrics[f"time/{p}"] > 0 for p in ("generate", "reference", "critic", "train", "weight_sync"))
            versions = ray.get([e.weight_version.remote() for e in trainer.engines], timeout=120)
            assert versions == [2, 2]
        finally:
            if trainer is not None:
                trainer.shutdown()
