"""The trainer end to end with the real engines: SGLang and vLLM in their CPU modes.

The same run as ``tests/test_trainer_e2e.py`` (the quickstart task, real Ray, a 2-rank DeepSpeed
ZeRO-3 actor, weight sync into the engine after every step), with ``--rollout.backend sglang`` or
``vllm``. Each engine's cases run in that engine's venv (``recipes/install/{sglang,vllm}_cpu.sh``;
CI does so) and are skipped where the engine is not installed.
"""

import importlib.util
import os
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)

from test_trainer_e2e import arith_task, make_cfg, mean, ray_cluster, task  # noqa: E402,F401  (fixtures)

pytestmark = pytest.mark.slow

ENGINES = {
    "vllm": "bash recipes/install/vllm_cpu.sh",
    "sglang": "bash recipes/install/sglang_cpu.sh",
}


def _need(backend: str) -> None:
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed here ({ENGINES[backend]} builds its venv)")


@pytest.mark.parametrize("algo", ["gae", "grpo"])
@pytest.mark.parametrize("backend", sorted(ENGINES))
def test_reward_rises_with_engine(ray_cluster, task, tmp_path, backend, algo):  # noqa: F811
    _need(backend)
    from rlhf_sg.trainer import train

    steps = 16
    cfg = make_cfg(task, str(tmp_path / f"{backend}-{algo}"), steps=steps, algo=algo, backend=backend)
    history = train(cfg, reward_fn=arith_task.addition_reward)
    rewards = [h["reward/mean"] for h in history]
    assert len(history) == steps
    # 128 samples a step: the step mean's noise is ~0.04, the rise seen over 16 steps ~0.15
    assert mean(rewards[-4:]) > mean(rewards[:4]) + 0.05, rewards
    assert history[-1]["weight_version"] == steps
    # the engine's log-probs and the trainer's agree (same weights, same temperature): a sync that
    # dropped or misplaced a tensor would open this gap step after step
    gaps = [h["rollout/logp_gap_engine_vs_trainer"] for h in history]
    assert max(gaps) < 0.05, gaps
