"""The whole loop through the engines on the families whose weights the sync renames: Qwen3-MoE and Mixtral
(transformers 5 runs their experts fused; the engines load the checkpoint's per-expert names). Two GRPO steps with a
2-rank ZeRO-3 actor and a sync into the engine between them; after the sync the engine's log-probs are the
trainer's. Each engine's cases run in that engine's venv (CI's engine suites) and are skipped where it is not
installed; the embedded engine runs every family of the matrix in tests/test_family_loop.py.

vLLM 0.32's CPU build takes the per-expert tensors (its expert loader maps them into its fused parameters) but packs
expert weights into its kernel's layout at load only: after a weight update the engine computes with the
checkpoint's layout as if packed. Measured on a tiny Qwen3-MoE: reloading the very weights it started with (from
buckets or from disk) moved its log-probs by 4e-3 from the model's, where a dense Qwen3 stays at 5e-7. So the vLLM
backend refuses a mixture-of-experts model on CPU at start, naming it (the test below); on GPU it is not refused.

The families are the matrix's tiny configs (for vLLM with 32-wide attention heads, which its CPU attention needs).
"""

from __future__ import annotations

import os
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)

from test_engine_e2e import _need  # noqa: E402
from test_family_loop import family_config, prompts, train_recording_gaps  # noqa: E402,F401  (fixture)

pytestmark = pytest.mark.slow

#: the engines' log-probs against the trainer's, per token, after a sync (float32 on both sides; an engine left with
#: step 1's weights is off by far more at the test's learning rate)
GAP = 1e-3


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
@pytest.mark.parametrize("backend", ["sglang"])
def test_a_moe_family_trains_and_syncs_through_the_engine(ray_cluster, prompts, tmp_path, backend, family):  # noqa: F811
    _need(backend)
    from rlhf_sg.tiny import save_tiny_model, tiny_family_model

    model_path = str(tmp_path / family)
    # without the matrix's 4-token window: SGLang's Mixtral passes no window to its attention (as the published
    # Mixtral checkpoints set none), so windowed rows would differ before any sync
    overrides = {"sliding_window": None} if family == "mixtral" else {}
    save_tiny_model(model_path, model=tiny_family_model(family, **overrides))
    cfg = family_config(family, model_path, prompts, str(tmp_path / "run"))
    cfg.rollout.backend = backend
    history, gaps = train_recording_gaps(cfg)
    assert [h["weight_version"] for h in history] == [1, 2]
    assert len(gaps) == 2 and max(gaps) <= GAP, (backend, family, gaps)


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral", "qwen3-next"])
def test_vllm_on_cpu_refuses_a_moe_model_by_name(tmp_path, family):
    _need("vllm")
    from backends.base import BackendConfig, BackendError
    from backends.vllm_backend import VLLMBackend
    from rlhf_sg.tiny import save_tiny_model, tiny_family_model

    path = str(tmp_path / family)
    save_tiny_model(path, model=tiny_family_model(family, head_dim=32))
    with pytest.raises(BackendError, match=r"is a mixture of experts \(4 experts\).*--rollout.backend sglang or hf"):
        VLLMBackend(BackendConfig(model_path=path, num_threads=1))


@pytest.mark.parametrize("family", ["mistral", "qwen2-window", "mixtral", "starcoder2", "phi-3"])
def test_sglang_refuses_a_window_its_model_class_drops(tmp_path, family):
    """SGLang's Mistral, Qwen2, Mixtral, Starcoder2 and Phi-3 classes pass no sliding window to their attention, where
    transformers applies ``config.sliding_window``: measured, the tiny Mistral (window 4) was 0.14 off the trainer's
    log-probs before any sync. With a context past the window the backend refuses it before the engine starts, naming
    the window and the way out; within the window it is exact and starts."""
    _need("sglang")
    from backends.base import BackendConfig, BackendError
    from backends.sglang_backend import SGLangBackend, _unserved_window
    from rlhf_sg.tiny import FAMILY_WINDOW, save_tiny_model, tiny_family_model

    path = str(tmp_path / family)
    save_tiny_model(path, model=tiny_family_model(family))
    with pytest.raises(BackendError, match=rf"sliding window of {FAMILY_WINDOW} tokens.*--rollout.max_model_len"):
        SGLangBackend(BackendConfig(model_path=path, dtype="float32", max_model_len=64, num_threads=1))
    assert _unserved_window(path, FAMILY_WINDOW) is None


@pytest.mark.parametrize("family", ["gemma-2", "gemma-3", "qwen2", "olmo-2"])
def test_sglang_takes_the_windows_its_model_classes_pass(tmp_path, family):
    _need("sglang")
    from backends.sglang_backend import _unserved_window
    from rlhf_sg.tiny import save_tiny_model, tiny_family_model

    path = str(tmp_path / family)
    save_tiny_model(path, model=tiny_family_model(family))
    assert _unserved_window(path, 64) is None


def test_sglang_starts_a_windowed_model_whose_class_takes_the_window_and_matches_it(tmp_path):
    """The window check runs after the engine's settings put SGLang in its CPU mode (checking first imported sglang
    before that, and every windowed model then failed to start); Gemma-3's windowed layers through SGLang give the
    model's own log-probs on rows past the window."""
    _need("sglang")
    from backends.base import BackendConfig
    from backends.sglang_backend import SGLangBackend
    from rlhf_sg.bench.engine_families import engine_gap
    from rlhf_sg.tiny import save_tiny_model, tiny_family_model

    path = str(tmp_path / "gemma-3")
    model = tiny_family_model("gemma-3")
    save_tiny_model(path, model=model)
    engine = SGLangBackend(BackendConfig(model_path=path, dtype="float32", max_model_len=64, num_threads=1))
    try:
        assert engine_gap(engine, model) <= 1e-4
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family", ["cohere2", "gemma-2"])
def test_sglang_refuses_the_architectures_it_was_measured_not_to_serve(tmp_path, family):
    """``bench engine-families --backend sglang``: Cohere2's engine log-probs were 0.18 off the model's before any
    sync; Gemma-2's scheduler failed at start on transformers 5's config and SIGQUIT the process that started it.
    Both are refused by name before the engine starts."""
    _need("sglang")
    from backends.base import BackendConfig, BackendError
    from backends.sglang_backend import SGLangBackend
    from rlhf_sg.tiny import save_tiny_model, tiny_family_model

    path = str(tmp_path / family)
    save_tiny_model(path, model=tiny_family_model(family))
    with pytest.raises(BackendError, match=r"(Cohere2|Gemma2)ForCausalLM\): SGLang does not serve it"):
        SGLangBackend(BackendConfig(model_path=path, dtype="float32", max_model_len=64, num_threads=1))
