"""The whole loop on every model family of the matrix: load, generate, score, train, sync into the engine, generate
again, through the trainer (real Ray, a 2-rank DeepSpeed ZeRO-3 actor, the embedded engine, two GRPO steps).

Tried this way on 58cc92a, 7 of the 18 families the matrix holds exact failed: Qwen3-MoE and Mixtral at their first
sync (fused expert parameters sent under their run-time names), Qwen3.5 and Qwen3-Next in the engine's generate
(no ``batch_repeat_interleave`` on linear-attention cache layers), GPT-OSS at load (transformers has no sdpa for it),
GPT-2 and Bloom at start-up (``KeyError: 'num_attention_heads'``: their configs name it ``n_head``).

After the sync the engine's log-probs of step 2's samples are the trainer's own (the backend contract's 1e-4, as a
maximum over tokens): an engine that kept step 1's weights would be off by the update, which the learning rate here
makes large enough to see.
"""

from __future__ import annotations

import os
import sys

import pytest

from rlhf_sg.tiny import FAMILIES

RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")
sys.path.insert(0, RECIPES)

pytestmark = [pytest.mark.slow, pytest.mark.families]

#: families refused before Ray starts, and the words that name why
REFUSED = {"phi-3-longrope": "longrope"}

#: families whose loop repeats other families' in every part the loop exercises (the classes and names ZeRO-3
#: gathers and the sync sends, the attention's layout, the config's keys), and the families that cover them; the
#: fast tier still runs each of them alone (layouts against each row alone, checkpoint names, the embedded engine's
#: sampling and log-probs). Marked ``family_repeat``: ``pytest -m families`` runs them, CI leaves them out
#: (`.ci/run`), as the engines' family tests keep the families whose sync or attention differs.
REPEATS = {
    "qwen2": "qwen2-window (the same class, its window the one difference)",
    "qwen3": "qwen3-moe (the same attention with its q / k norms) and llama-3 (a dense MLP)",
    "mistral": "mixtral (the same attention and window from config.sliding_window alone)",
    "starcoder2": "mixtral (a window from config.sliding_window alone) and gpt-2 (biases, layer norms)",
    "olmo-2": "qwen3-moe (q / k norms) and llama-3 (a dense MLP, the same projection names)",
    "gemma-2": "gemma-3 (sliding and full layers by layer_types) and cohere2 (a transform of the final logits)",
}


def digits_reward(prompts: list[str], completions: list[str], labels: list) -> list[float]:
    """The digits a completion writes: a random model's samples differ in it, so every group has advantages and
    every step moves the weights (the task's own reward is 0 for nearly every sample of a random model)."""
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def train_recording_gaps(cfg) -> tuple[list[dict], list[float]]:
    """Train ``cfg`` with :func:`digits_reward`; returns the history and, per step, the largest |engine log-prob -
    trainer log-prob| over the step's sampled tokens (the trainer's from its own forward before the update)."""
    from rlhf_sg.trainer import PPOTrainer, train

    gaps: list[float] = []

    class Gaps(PPOTrainer):
        def on_experience(self, experience):
            mask = experience.action_mask.bool()
            gaps.append(float((experience.rollout_logp - experience.old_logp).abs()[mask].max()))

    return train(cfg, Gaps, reward_fn=digits_reward), gaps


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    import arith_task

    return arith_task.write_prompts(str(tmp_path_factory.mktemp("family_loop") / "prompts.jsonl"))


def family_config(family: str, model_path: str, prompts: str, out: str):
    from rlhf_sg.config import Config

    cfg = Config()
    cfg.model.pretrain = model_path
    cfg.data.prompt_data, cfg.data.label_key, cfg.data.max_prompt_len = prompts, "answer", 16
    cfg.rollout.backend = "hf"
    cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt = 4, 4
    cfg.rollout.max_new_tokens, cfg.rollout.max_model_len = 4, 64
    cfg.train.advantage_estimator, cfg.train.kl_coef = "grpo", 0.0
    cfg.train.actor_num_ranks, cfg.train.max_steps = 2, 2
    cfg.train.recompute_old_logp = True  # the engine-vs-trainer gap per token, before the update
    cfg.train.actor_lr = 1e-2  # a step moves log-probs far past the contract's 1e-4, so a stale engine shows
    cfg.reward.kind, cfg.reward.function = "function", "test_family_loop:digits_reward"
    cfg.log.output_dir = out
    cfg.log.progress_bar = cfg.log.tensorboard = cfg.log.export_hf = False
    return cfg


@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=pytest.mark.family_repeat) if f in REPEATS else f for f in FAMILIES]
)
def test_every_family_trains_end_to_end_and_the_engine_holds_the_trained_weights(ray_cluster, prompts, tmp_path,
                                                                                  family):
    from rlhf_sg.config import ConfigError
    from rlhf_sg.tiny import save_tiny_model, tiny_family_model
    from rlhf_sg.trainer import train

    model_path = str(tmp_path / family)
    save_tiny_model(model_path, model=tiny_family_model(family))
    cfg = family_config(family, model_path, prompts, str(tmp_path / "run"))
    if family in REFUSED:
        with pytest.raises(ConfigError, match=REFUSED[family]):
            train(cfg, reward_fn=digits_reward)
        return

    history, gaps = train_recording_gaps(cfg)
    assert [h["weight_version"] for h in history] == [1, 2]
    assert history[0]["reward/std"] > 0, history[0]  # advantages, so step 1 moved the weights
    assert len(gaps) == 2
    # step 1 generates from the checkpoint, step 2 from the weights step 1 trained and synced
    assert max(gaps) <= 1e-4, (family, gaps)


def test_every_repeated_family_names_families_the_loop_runs():
    """A family left out of CI's loop is covered by families CI runs (each named in its reason), never by one also
    left out."""
    for family, reason in REPEATS.items():
        assert family in FAMILIES, family
        named = [f for f in FAMILIES if f"{f} (" in reason]
        assert named and not set(named) & set(REPEATS), (family, named)


def test_routing_replay_keeps_the_trainer_on_the_engines_experts(ray_cluster, prompts, tmp_path):
    """``--train.routing_replay`` through the trainer (and ZeRO-3's gathers, gradient checkpointing's recompute): a
    Qwen3-MoE whose routers tie to a few ulps, where the engine's batched decode and the trainer's packed rows pick
    other experts for a fifth of the routes (0.04 apart in log-prob without replay:
    tests/test_routing_replay.py), stays within the contract's 1e-4 of the engine on both steps."""
    from test_routing_replay import _near_ties

    from rlhf_sg.tiny import save_tiny_model, tiny_family_model

    model_path = str(tmp_path / "near-ties")
    save_tiny_model(model_path, model=_near_ties(tiny_family_model("qwen3-moe", seed=0), eps=1e-7))
    cfg = family_config("qwen3-moe", model_path, prompts, str(tmp_path / "run"))
    cfg.train.routing_replay = cfg.train.gradient_checkpointing = True
    history, gaps = train_recording_gaps(cfg)
    assert [h["weight_version"] for h in history] == [1, 2]
    assert max(gaps) <= 1e-4, gaps
    assert all(h["rollout/frac_logp_gap_over_ln2"] == 0.0 and 0 <= h["rollout/k3_kl_engine_vs_trainer"] < 1e-6
               for h in history), history
