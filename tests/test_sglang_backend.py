"""The SGLang backend beyond the shared contract: its CPU mode, start-up errors, log-prob pin,
the weight round trip from a 2-rank ZeRO-3 trainer, and the http mode against a real server.

Runs in the SGLang venv (``recipes/install/sglang_cpu.sh``); elsewhere only the "package missing"
test runs. The engines here are real SGLang engines in their CPU mode on tiny models.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from backends.base import BackendConfig, BackendError, SamplingParams
from rlhf_sg.tiny import BOS_ID, EOS_ID, build_tiny_model, save_tiny_model

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
needs_sglang = pytest.mark.skipif(not HAVE_SGLANG, reason="sglang not installed (recipes/install/sglang_cpu.sh)")
TIMEOUT_S = 120.0
PROMPTS = [[BOS_ID, 40, 41, 42, 43], [BOS_ID, 50, 12, 77, 13, 9, 20], [BOS_ID, 7]]


def _config(model_path: str, **kw) -> BackendConfig:
    return BackendConfig(model_path=model_path, dtype="float32", max_model_len=256, seed=0, num_threads=1, **kw)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    """A tiny Llama: SGLang can read its weights back (its Qwen2 class cannot, in 0.5.23)."""
    return save_tiny_model(str(tmp_path_factory.mktemp("sglang-llama")), arch="llama", size="tiny", seed=0)


def _hf(model_path: str, state: dict[str, torch.Tensor] | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state, strict=True)
    return model


def _trainer_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """logp [T] float32 of ``tokens`` after ``prompt`` under softmax(logits / T); T = 1 for greedy."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
    return logp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def _hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    tokens: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            tokens.append(int(model(torch.tensor([prompt + tokens])).logits[0, -1].argmax()))
            if tokens[-1] == EOS_ID:
                break
    return tokens


# ---- start-up errors (no engine is started) -------------------------------------------------------
@pytest.mark.skipif(HAVE_SGLANG, reason="sglang is installed here")
def test_missing_package_names_the_install_command(tmp_path):
    from backends.sglang_backend import SGLangBackend

    with pytest.raises(BackendError, match=r"sglang_cpu\.sh"):
        SGLangBackend(_config(str(tmp_path)))


@needs_sglang
def test_bad_configs_fail_before_the_engine_starts(tmp_path, llama_dir):
    """Each message comes from a check that runs before sglang.Engine is built."""
    from backends.sglang_backend import SGLangBackend

    cases = [
        (_config(str(tmp_path / "missing")), "is not a directory"),
        (_config(str(tmp_path)), "no config.json"),
        (_config(llama_dir, tensor_parallel_size=64), "tensor_parallel_size=64"),
        (_config(llama_dir, device="cuda"), "no CUDA device"),
        (_config(llama_dir, extra={"temperature": 1}), r"\['temperature'\]"),
        (_config(llama_dir, extra={"engine_kwargs": {"model_path": "x"}}), "may not set"),
        (_config(llama_dir, extra={"router_url": "http://127.0.0.1:1"}), "server_urls"),
        (_config(llama_dir, extra={"server_urls": "http://127.0.0.1:1"}), "non-empty list"),
    ]
    for config, message in cases:
        with pytest.raises(BackendError, match=message):
            SGLangBackend(config)


@needs_sglang
def test_cpu_mode_not_set_up_is_a_clear_error(llama_dir, monkeypatch):
    from backends import sglang_cpu
    from backends.sglang_backend import SGLangBackend

    monkeypatch.delitem(sys.modules, sglang_cpu.HOOK_MODULE)  # as in an interpreter without the .pth hook
    with pytest.raises(BackendError, match=r"CPU mode.*sglang_cpu\.sh"):
        SGLangBackend(_config(llama_dir))


# ---- the CPU-mode shims --------------------------------------------------------------------------
@needs_sglang
def test_install_writes_a_pth_that_loads_both_shims(tmp_path):
    from backends import sglang_cpu

    path = sglang_cpu.install(tmp_path)
    lines = path.read_text().splitlines()
    assert lines == [str(sglang_cpu.SHIM_DIR), f"import {sglang_cpu.HOOK_MODULE}"]
    with pytest.raises(FileNotFoundError):
        sglang_cpu.install(tmp_path / "nowhere")


def test_the_torchvision_hook_pth_loads_the_hook_alone(tmp_path):
    """The vLLM venv's .pth: a fresh interpreter that reads it has the torchvision hook loaded and no stand-in
    sgl_kernel on its path (vLLM imports a real one where it finds it)."""
    from backends import sglang_cpu

    path = sglang_cpu.install_torchvision_hook(tmp_path)
    assert path.name == sglang_cpu.TORCHVISION_PTH_NAME
    code = (f"import site, sys, importlib.util; site.addsitedir({str(tmp_path)!r}); "
            f"assert {sglang_cpu.HOOK_MODULE!r} in sys.modules, 'hook not loaded'; "
            "assert importlib.util.find_spec('sgl_kernel') is None, 'stand-in kernels on the path'; print('ok')")
    # -S: no site-packages of this venv (the SGLang venv's own .pth puts the stand-in kernels on every path)
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
    with pytest.raises(FileNotFoundError):
        sglang_cpu.install_torchvision_hook(tmp_path / "nowhere")


@needs_sglang
def test_shims_are_active_in_a_fresh_process_of_the_venv():
    """What every SGLang child process sees: the hook loaded at start, the stand-in kernels, torchvision."""
    code = (
        "import sys, torch; from backends import sglang_cpu; "
        "assert sglang_cpu.HOOK_MODULE in sys.modules, 'hook not loaded at start'; "
        "assert 'torchvision' not in sys.modules; "
        "import torchvision, sgl_kernel; "
        "assert sglang_cpu.hook_active() and not sglang_cpu.cpu_mode_problems(); "
        "torch.ops.torchvision.nms; print(sgl_kernel.__file__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "sglang_cpu/shims/sgl_kernel" in out.stdout


@needs_sglang
def test_stand_in_kernels_raise_naming_the_feature():
    import sgl_kernel

    with pytest.raises(NotImplementedError, match="verify_tree_greedy_cpu.*speculative decoding"):
        sgl_kernel.verify_tree_greedy_cpu()


# ---- one engine for the behavioural tests ----------------------------------------------------------
@pytest.fixture(scope="module")
def engine(llama_dir):
    """Started with SGLANG_RETURN_ORIGINAL_LOGPROB=1 in the environment: the backend must pin it to 0."""
    from backends.sglang_backend import SGLangBackend

    saved = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB")
    os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
    try:
        backend = SGLangBackend(_config(llama_dir))
    finally:
        if saved is None:
            os.environ.pop("SGLANG_RETURN_ORIGINAL_LOGPROB", None)
        else:
            os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = saved
    yield backend
    backend.shutdown()


@needs_sglang
@pytest.mark.slow
def test_logprobs_are_temperature_scaled_despite_the_environment(engine, llama_dir):
    reference = _hf(llama_dir)
    for temperature in (0.5, 1.6):
        params = SamplingParams(n=2, temperature=temperature, top_p=0.9, max_new_tokens=10)
        for c in engine.generate(PROMPTS, params):
            expected = _trainer_logprobs(reference, PROMPTS[c.prompt_index], c.token_ids, temperature)
            unscaled = _trainer_logprobs(reference, PROMPTS[c.prompt_index], c.token_ids, 1.0)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)
            assert (expected - unscaled).abs().max() > 1e-3, "the test cannot tell the conventions apart"


@needs_sglang
@pytest.mark.slow
def test_the_endpoint_records_the_sglang_engines_own_ids(engine, llama_dir):
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from endpoint_checks import check_recorded_ids_are_the_engines_own

    from rlhf_sg.data import load_tokenizer

    # greedy: SGLang's CPU sampler does not honour a seed (the next test)
    check_recorded_ids_are_the_engines_own(engine, load_tokenizer(llama_dir), PROMPTS[1], temperature=0.0)


@needs_sglang
@pytest.mark.slow
def test_the_endpoint_ties_turns_by_prefix_and_forks_on_drift_on_sglang(engine, llama_dir):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from endpoint_checks import check_turns_continue_by_prefix_and_a_drifting_harness_forks

    from rlhf_sg.data import load_tokenizer

    check_turns_continue_by_prefix_and_a_drifting_harness_forks(engine, load_tokenizer(llama_dir), PROMPTS[1],
                                                                [40, 41, 42])


@needs_sglang
@pytest.mark.slow
def test_the_endpoint_refuses_keys_bodies_and_budgets_on_sglang(engine, llama_dir):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from endpoint_checks import check_keys_bodies_and_budgets_are_refused

    from rlhf_sg.data import load_tokenizer

    check_keys_bodies_and_budgets_are_refused(engine, load_tokenizer(llama_dir), PROMPTS[1])


@needs_sglang
@pytest.mark.slow
def test_an_endpoint_call_cut_by_an_sglang_abort_continues(engine, llama_dir):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from endpoint_checks import check_an_aborted_call_continues_where_it_stopped

    from rlhf_sg.data import load_tokenizer

    check_an_aborted_call_continues_where_it_stopped(engine, load_tokenizer(llama_dir), PROMPTS[0], max_tokens=200)


@needs_sglang
@pytest.mark.slow
def test_unseeded_engine_says_so_and_samples_distinct_rows(engine):
    assert engine.honours_seed is False  # CPU: SGLang's seeded sampler needs a GPU attention backend
    out = engine.generate([PROMPTS[0]], SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=3))
    assert len({tuple(c.token_ids) for c in out}) > 1


@needs_sglang
@pytest.mark.slow
def test_weights_read_back_at_checkpoint_shapes(engine, llama_dir):
    reference = dict(_hf(llama_dir).named_parameters())
    shapes = engine.weight_shapes()
    assert shapes == {name: tuple(p.shape) for name, p in reference.items()}
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight", "lm_head.weight"):
        assert torch.equal(engine.get_weights_by_name(name), reference[name].detach()), name


@needs_sglang
@pytest.mark.slow
def test_sleep_wake_then_generate_still_matches(engine, llama_dir):
    expected = [_hf_greedy(_hf(llama_dir), p, 8) for p in PROMPTS]
    engine.sleep()
    with pytest.raises(BackendError, match="asleep"):
        engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
    engine.wake()
    out = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
    assert [c.token_ids for c in out] == expected


@needs_sglang
@pytest.mark.slow
def test_tensor_transport_takes_a_bucket_packed_in_this_process(engine, llama_dir):
    """In-process use: a tensor handed to the backend is packed here (this process owns it) into one
    payload per TP rank, which SGLang's scheduler process opens from shared memory."""
    from backends.sglang_backend import SGLangBackend
    from rlhf_sg.sync import plan_buckets

    new = dict(build_tiny_model("llama", "tiny", seed=4).named_parameters())
    (manifest,) = plan_buckets([(n, p.shape, p.dtype) for n, p in new.items()], 1 << 30)
    flat = torch.cat([new[t.name].detach().reshape(-1) for t in manifest.tensors])
    with pytest.raises(BackendError, match=r"expected 1 payload\(s\)"):
        engine.update_weights_from_tensor(manifest, SGLangBackend.pack_tensor_bucket(manifest, flat, 2))
    engine.update_weights_from_tensor(manifest, flat)
    engine.finish_weight_update(engine.weight_version + 1)
    assert torch.equal(
        engine.get_weights_by_name("model.layers.1.mlp.down_proj.weight"),
        new["model.layers.1.mlp.down_proj.weight"].detach(),
    )
    engine.update_weights_from_disk(llama_dir)  # back to the checkpoint for later tests
    engine.finish_weight_update(engine.weight_version + 1)


# ---- the trainer's own path: WeightSyncer on 2 ZeRO-3 Ray ranks into an SGLang engine actor ------------
@needs_sglang
@pytest.mark.slow
def test_weight_syncer_reaches_sglang_engine_actors_without_a_group_hook(ray_cluster, llama_dir):
    """The trainer's sync from a 2-rank ZeRO-3 actor over gloo into an SGLang engine actor: the sender builds
    SGLang's group layout by itself (no ``open_group=`` passed), as the trainer does; the engine then holds the
    trainer's weights bit for bit, and its greedy tokens and its log-probs, greedy and sampled at temperature 0.8,
    are the trainer model's."""
    ray = ray_cluster
    from rlhf_sg.bench.weight_sync import start_trainer_ranks
    from rlhf_sg.engine_actor import start_engine_actors

    engines, ranks = [], []
    try:
        engines = start_engine_actors("sglang", _config(llama_dir), 1, start_timeout_s=300)
        ranks = start_trainer_ranks(llama_dir, 2, timeout_s=300.0)
        ray.get([r.perturb.remote(seed=3) for r in ranks], timeout=300)
        ray.get([r.setup_syncer.remote(engines, transport="collective", bucket_bytes=16384, timeout_s=TIMEOUT_S)
                 for r in ranks], timeout=300)
        stats = ray.get([r.sync.remote(1) for r in ranks], timeout=300)
        ray.get([r.close_syncer.remote() for r in ranks], timeout=300)
        assert stats[0]["buckets"] > 2
        trainer = ray.get([r.full_state_dict.remote() for r in ranks], timeout=300)[0]
        assert ray.get(engines[0].weight_version.remote(), timeout=60) == 1
        for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight",
                     "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"):
            got = ray.get(engines[0].get_weights_by_name.remote(name), timeout=300)
            assert torch.equal(got, trainer[name]), name
        trainer_model = _hf(llama_dir, trainer)
        for temperature in (0.0, 0.8):
            params = SamplingParams(temperature=temperature, max_new_tokens=10)
            for c in ray.get(engines[0].generate.remote(PROMPTS, params), timeout=300):
                prompt = PROMPTS[c.prompt_index]
                logp = _trainer_logprobs(trainer_model, prompt, c.token_ids, temperature)
                torch.testing.assert_close(torch.tensor(c.logprobs), logp, atol=1e-4, rtol=0)
                if temperature == 0.0:
                    assert c.token_ids == _hf_greedy(trainer_model, prompt, 10)
                assert c.weight_version == 1
    finally:
        for actor in engines + ranks:  # the session's cluster stays up
            ray.kill(actor)


def test_a_call_fails_soon_after_an_engine_process_dies_naming_it():
    """A scheduler that hits an exception in the model's forward exits, and the in-process engine's generate then
    waits for outputs that never come (a Mixtral whose head size SGLang's KV pool and attention read differently
    waited so for 8 minutes). The driver checks the engine's processes between short waits: the call fails within a
    few seconds, naming the dead process, and later calls are refused."""
    import backends.sglang_backend as sb

    driver = sb._EngineDriver.__new__(sb._EngineDriver)  # the waiting logic alone; no engine is started
    driver._thread = sb.concurrent.futures.ThreadPoolExecutor(max_workers=1)
    driver._timeout_s, driver._stuck = 600.0, None
    child = subprocess.Popen([sys.executable, "-c", "pass"])  # stands in for a scheduler that exits
    driver._engine_children = [child.pid]
    release = threading.Event()
    start = time.monotonic()
    try:
        with pytest.raises(BackendError, match=rf"generate \(2 rows\): its process {child.pid} \(.*\) died"):
            driver.run("generate (2 rows)", lambda: release.wait(120))
        assert time.monotonic() - start < 30
        with pytest.raises(BackendError, match="an earlier call .* overran its deadline|unusable"):
            driver.run("generate (1 rows)", lambda: None)
    finally:
        release.set()
        child.wait()
        driver._thread.shutdown(wait=True)


# ---- the endpoint's chat with tools, on a second engine (last in the module: it runs beside the first for these
# tests alone) --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tool_engine(tmp_path_factory):
    """An engine on a tiny Llama taught to call the calculator over the chat tokenizer (endpoint_checks: the module's
    own model has no chat template); (engine, tokenizer, taught ids, model path)."""
    from endpoint_checks import TOOL_CONTEXT, teach_tool_conversation

    from backends.sglang_backend import SGLangBackend
    from rlhf_sg.tiny import build_chat_tokenizer

    tok = build_chat_tokenizer()
    path = str(tmp_path_factory.mktemp("sglang-tool-llama"))
    taught = teach_tool_conversation(tok, build_tiny_model("llama", "tiny", seed=0, vocab_size=len(tok),
                                                           max_len=TOOL_CONTEXT), path)
    backend = SGLangBackend(BackendConfig(model_path=path, dtype="float32", max_model_len=TOOL_CONTEXT, seed=0,
                                          num_threads=1))
    yield backend, tok, taught, path
    backend.shutdown()


@needs_sglang
@pytest.mark.slow
def test_the_endpoint_round_trips_chat_tool_calls_on_sglang(tool_engine):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from endpoint_checks import check_tool_calls_round_trip

    backend, tok, taught, _ = tool_engine
    check_tool_calls_round_trip(backend, tok, taught)


@needs_sglang
@pytest.mark.slow
def test_harness_rows_from_the_endpoint_have_the_trainers_logprobs_on_sglang(tool_engine):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from endpoint_checks import check_harness_rows_logprobs_match_the_trainer

    backend, tok, _, path = tool_engine
    check_harness_rows_logprobs_match_the_trainer(backend, tok, path)
