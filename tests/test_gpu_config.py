"""Configurations that cannot work on GPU are refused before anything starts, naming the flag to change
(checked on CPU: the config and this machine's install are all they read)."""

import os

import pytest

from rlhf_sg import config as config_mod
from rlhf_sg.config import Config, ConfigError, check_gpu_install, validate
from rlhf_sg.tiny import save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_config")
    (root / "prompts.jsonl").write_text('{"prompt": "1+1="}\n')
    return save_tiny_model(str(root / "policy"))


def _cfg(model_dir, **overrides):
    cfg = Config()
    cfg.model.pretrain = model_dir
    cfg.data.prompt_data = os.path.join(os.path.dirname(model_dir), "prompts.jsonl")
    cfg.train.device = "cuda"
    cfg.reward.function = "my_task:score"
    cfg.model.dtype = "bfloat16"
    for key, value in overrides.items():
        section, field = key.split("__")
        setattr(getattr(cfg, section), field, value)
    return cfg


def _colocated(model_dir, transport):
    return _cfg(model_dir, train__colocate_all=True, train__advantage_estimator="grpo", train__ref_num_ranks=2,
                rollout__num_engines=2,
                rollout__n_samples_per_prompt=2, rollout__weight_transport=transport)


def test_colocate_all_with_the_collective_transport_is_refused_on_cuda(model_dir):
    with pytest.raises(ConfigError, match=r"--train.colocate_all on CUDA .* NCCL .* set --rollout.weight_transport "
                                          r"tensor"):
        validate(_colocated(model_dir, "collective"))
    validate(_colocated(model_dir, "tensor"))
    cpu = _colocated(model_dir, "collective")
    cpu.train.device, cpu.model.dtype = "cpu", "float32"
    validate(cpu)  # gloo groups two ranks of one CPU without complaint


def test_flash_attention_2_needs_cuda_and_half_precision(model_dir):
    with pytest.raises(ConfigError, match=r"flash_attention_2 has fp16/bf16 kernels only: set --model.dtype bfloat16"):
        validate(_cfg(model_dir, model__attn_implementation="flash_attention_2", model__dtype="float32"))
    with pytest.raises(ConfigError, match=r"flash_attention_2 runs on CUDA only"):
        validate(_cfg(model_dir, model__attn_implementation="flash_attention_2", train__device="cpu"))
    validate(_cfg(model_dir, model__attn_implementation="flash_attention_2"))


def test_fp32_sglang_engines_are_refused_on_cuda(model_dir):
    with pytest.raises(ConfigError, match=r"--rollout.backend sglang on CUDA: .* set --model.dtype bfloat16"):
        validate(_cfg(model_dir, rollout__backend="sglang", model__dtype="float32"))
    validate(_cfg(model_dir, rollout__backend="sglang"))


def test_flash_attn_missing_is_named(model_dir, monkeypatch):
    monkeypatch.setattr(config_mod, "_fused_adam_prebuilt", lambda: True)
    monkeypatch.setattr(config_mod, "_flash_attn_importable", lambda: False)
    cfg = _cfg(model_dir, model__attn_implementation="flash_attention_2")
    with pytest.raises(ConfigError, match=r"the flash_attn package is not installed; install it"):
        check_gpu_install(cfg)
    monkeypatch.setattr(config_mod, "_flash_attn_importable", lambda: True)
    check_gpu_install(cfg)


def test_fused_adam_without_its_toolchain_is_named(model_dir, monkeypatch):
    cfg = _cfg(model_dir)
    monkeypatch.setattr(config_mod, "_fused_adam_prebuilt", lambda: False)
    monkeypatch.setattr(config_mod, "_jit_toolchain_missing", lambda: ["nvcc (a CUDA toolkit; set CUDA_HOME to it)"])
    with pytest.raises(ConfigError, match=r"FusedAdam, which is not prebuilt here and whose JIT build needs nvcc .*"
                                          r"DS_BUILD_FUSED_ADAM=1"):
        check_gpu_install(cfg)
    monkeypatch.setattr(config_mod, "_jit_toolchain_missing", list)
    check_gpu_install(cfg)
    monkeypatch.setattr(config_mod, "_jit_toolchain_missing", lambda: ["ninja"])
    monkeypatch.setattr(config_mod, "_fused_adam_prebuilt", lambda: True)
    check_gpu_install(cfg)  # prebuilt: no toolchain needed
    cfg.train.device = "cpu"
    monkeypatch.setattr(config_mod, "_fused_adam_prebuilt", lambda: False)
    check_gpu_install(cfg)  # CPU trains with torch's AdamW


def test_the_probes_read_this_machine():
    # this CPU install: DeepSpeed built without ops, so FusedAdam would be JIT-built
    assert config_mod._fused_adam_prebuilt() is False
    assert isinstance(config_mod._jit_toolchain_missing(), list)
    assert isinstance(config_mod._flash_attn_importable(), bool)
