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
    monkeypatch.setattr(config_mod, "_jit_cuda_versions", lambda: (_nvcc("13.0"), "13.0"))
    check_gpu_install(cfg)
    monkeypatch.setattr(config_mod, "_jit_toolchain_missing", lambda: ["ninja"])
    monkeypatch.setattr(config_mod, "_fused_adam_prebuilt", lambda: True)
    check_gpu_install(cfg)  # prebuilt: no toolchain needed
    cfg.train.device = "cpu"
    monkeypatch.setattr(config_mod, "_fused_adam_prebuilt", lambda: False)
    check_gpu_install(cfg)  # CPU trains with torch's AdamW


def _nvcc(release: str) -> str:
    """What ``nvcc -V`` prints for a toolkit of ``release`` (major.minor)."""
    return ("nvcc: NVIDIA (R) Cuda compiler driver\nCopyright (c) 2005-2025 NVIDIA Corporation\n"
            "Built on Wed_Aug_20_01:58:59_PM_PDT_2025\n"
            f"Cuda compilation tools, release {release}, V{release}.88\nBuild cuda_{release}.r{release}/compiler_0\n")


@pytest.mark.parametrize(("nvcc", "torch_cuda", "builds"), [
    ("13.0", "13.0", True),
    ("13.1", "13.0", False),  # CUDA 13: DeepSpeed lets no minor version differ
    ("13.0", "13.2", False),
    ("12.8", "12.4", True),  # within CUDA 12 it does
    ("12.9", "12.1", True),
    ("12.8", "13.0", False),
    ("11.8", "12.1", False),
    ("12.7", "12.6", False),  # no toolkit 12.7 exists: not in DeepSpeed's list
])
def test_nvcc_against_torchs_cuda_as_deepspeeds_op_builder_judges_them(nvcc, torch_cuda, builds, monkeypatch, capsys):
    """Our verdict on an nvcc and a torch CUDA version is the installed DeepSpeed's (its op builder's
    ``assert_no_cuda_mismatch`` given the same versions), and a clash names the toolkit to install."""
    from deepspeed.ops.op_builder import builder

    monkeypatch.delenv("DS_SKIP_CUDA_CHECK", raising=False)
    monkeypatch.setattr(builder, "installed_cuda_version", lambda name="": tuple(map(int, nvcc.split("."))))
    monkeypatch.setattr(builder.torch.version, "cuda", torch_cuda)
    try:
        deepspeed_builds = builder.assert_no_cuda_mismatch("fused_adam")
    except builder.CUDAMismatchException:
        deepspeed_builds = False
    assert deepspeed_builds == builds
    clash = config_mod.cuda_toolkit_clash(_nvcc(nvcc), torch_cuda)
    if builds:
        assert clash is None
    else:
        assert clash == (f"nvcc is CUDA {nvcc} and torch was built with CUDA {torch_cuda}, which DeepSpeed refuses "
                         f"to build with (it lets minor versions differ only within CUDA 10, 11 and 12): install the "
                         f"CUDA {torch_cuda} toolkit and point CUDA_HOME at it")


def test_an_nvcc_deepspeed_would_refuse_is_named_before_the_run(model_dir, monkeypatch):
    """A CUDA 13.0 torch (the engines' stacks) beside a CUDA 13.1 toolkit: refused before anything starts, naming
    the toolkit to install; DeepSpeed's own escape (DS_SKIP_CUDA_CHECK=1) and a prebuilt FusedAdam pass."""
    cfg = _cfg(model_dir)
    monkeypatch.delenv("DS_SKIP_CUDA_CHECK", raising=False)
    monkeypatch.setattr(config_mod, "_fused_adam_prebuilt", lambda: False)
    monkeypatch.setattr(config_mod, "_jit_toolchain_missing", list)
    monkeypatch.setattr(config_mod, "_jit_cuda_versions", lambda: (_nvcc("13.1"), "13.0"))
    with pytest.raises(ConfigError, match=r"FusedAdam, .* JIT build would fail: nvcc is CUDA 13.1 and torch was "
                                          r"built with CUDA 13.0.*install the CUDA 13.0 toolkit"):
        check_gpu_install(cfg)
    monkeypatch.setenv("DS_SKIP_CUDA_CHECK", "1")
    check_gpu_install(cfg)
    monkeypatch.delenv("DS_SKIP_CUDA_CHECK")
    monkeypatch.setattr(config_mod, "_fused_adam_prebuilt", lambda: True)
    check_gpu_install(cfg)


def test_the_probes_read_this_machine():
    # this CPU install: DeepSpeed built without ops, so FusedAdam would be JIT-built
    assert config_mod._fused_adam_prebuilt() is False
    assert isinstance(config_mod._jit_toolchain_missing(), list)
    assert isinstance(config_mod._flash_attn_importable(), bool)
    nvcc, torch_cuda = config_mod._jit_cuda_versions()
    assert isinstance(nvcc, str) and torch_cuda is None  # a CPU build of torch


def test_the_gpu_acceptance_tests_run_configs_that_validate_on_cuda(tmp_path):
    """The run configs the GPU acceptance tests start their engines and trainer from (``--train.device cuda``)
    pass ``validate`` here, so none of them dies on a GPU node with a ConfigError (float32 SGLang, lengths the
    model or the micro-batch cannot hold); and they are bf16 there, as the GPU recipes run."""
    import inspect

    import test_gpu_placement
    import test_gpu_sync

    from rlhf_sg.packing import response_logprobs

    model_dir = test_gpu_sync.save_model_and_prompts(str(tmp_path / "sync"))
    configs = {name: test_gpu_sync.run_config(model_dir, name) for name in test_gpu_sync.ENGINES}
    configs["long_rollout"] = test_gpu_placement.long_rollout_config(str(tmp_path))
    for name, cfg in configs.items():
        assert cfg.train.device == "cuda" and cfg.model.dtype == "bfloat16", name
        validate(cfg)
    # a 1k-token prompt with 8 responses, and several log-prob chunks on every actor rank
    r, ranks = configs["long_rollout"].rollout, configs["long_rollout"].train.actor_num_ranks
    chunk_tokens = inspect.signature(response_logprobs).parameters["chunk_tokens"].default
    assert r.n_samples_per_prompt == 8 and max(test_gpu_placement.LONG_PROMPTS) >= 1000
    assert r.prompts_per_step * r.n_samples_per_prompt // ranks * r.max_new_tokens >= 4 * chunk_tokens
