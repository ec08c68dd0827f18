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

from test_trainer_e2e import arith_task, make_cfg, mean  # noqa: E402,F401  (fixtures)

pytestmark = pytest.mark.slow

ENGINES = {
    "vllm": "bash recipes/install/vllm_cpu.sh",
    "sglang": "bash recipes/install/sglang_cpu.sh",
}


def _need(backend: str) -> None:
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed here ({ENGINES[backend]} builds its venv)")


@pytest.mark.parametrize("backend", sorted(ENGINES))
def test_reward_rises_with_engine(ray_cluster, task, tmp_path, backend, algo="gae"):  # noqa: F811
    """PPO with a critic learns the task through the engine, whose log-probs stay the trainer's. GRPO through each
    engine runs in the two tests below (the engine killed and restarted; async rollout); GRPO's learning through
    the trainer is test_async_rollout.py's (the estimators do not touch the engine)."""
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


@pytest.mark.parametrize("backend", sorted(ENGINES))
def test_an_engine_whose_process_is_killed_is_restarted_with_the_current_weights(ray_cluster, task, tmp_path,  # noqa: F811
                                                                                backend):
    """Before the second step generates, the engine's process (and with it whatever it runs: SGLang's scheduler
    processes) is SIGKILLed. The step restarts the engine, forms the weight-sync group again, pushes the current
    weights and generates the prompts on the new engine: the step trains on a full batch, the new engine's
    log-probs match the trainer's (it holds the trained weights, not the checkpoint's), and no process of the
    killed engine is left (the embedded engine's case: tests/test_faults.py)."""
    _need(backend)
    import time

    from rlhf_sg.bench.faults import running, trainer_killing_engine
    from rlhf_sg.trainer import train

    killing, killed = trainer_killing_engine(0, at_step=1)
    cfg = make_cfg(task, str(tmp_path / backend), steps=3, algo="grpo", backend=backend, train__kl_coef=0.0)
    history = train(cfg, trainer_cls=killing, reward_fn=arith_task.addition_reward)
    assert [h["rollout/engine_restarts"] for h in history] == [0, 1, 0]
    assert all(h["rollout/samples"] == history[0]["rollout/samples"] for h in history)
    assert [h["weight_version"] for h in history] == [1, 2, 3]
    gaps = [h["rollout/logp_gap_engine_vs_trainer"] for h in history]
    assert max(gaps) < 0.05, gaps
    deadline = time.monotonic() + 30
    while running(killed):
        assert time.monotonic() < deadline, f"processes of the killed engine still running: {running(killed)}"
        time.sleep(1)


@pytest.mark.parametrize("backend", sorted(ENGINES))
def test_async_rollout_with_engine_stays_within_the_staleness_bound(ray_cluster, task, tmp_path, backend):  # noqa: F811
    """``--rollout.mode async`` through the real engine: generation runs ahead of training by one weight version
    at most (every sample is checked by the trainer; the logged staleness shows it ran ahead), weight versions
    advance once per step, and the engine's own abort backs partial rollout where the engine has one."""
    _need(backend)
    from rlhf_sg.trainer import train

    steps = 5
    cfg = make_cfg(task, str(tmp_path / f"{backend}-async"), steps=steps, algo="grpo", backend=backend,
                   rollout__mode="async", train__kl_coef=0.0)
    history = train(cfg, reward_fn=arith_task.addition_reward)
    assert len(history) == steps and history[-1]["weight_version"] == steps
    assert all(h["rollout/staleness_max"] <= 1 for h in history)
    assert max(h["rollout/staleness_max"] for h in history) == 1
