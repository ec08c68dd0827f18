"""GPU acceptance for the vLLM backend's weight paths: NCCL and CUDA IPC into a real vLLM engine.

Runs on a GPU node with the CUDA build of vLLM 0.32 (``pip install 'rlhf-sg[vllm]'``):
``python -m pytest -m gpu tests/test_gpu_vllm.py``. Without CUDA (conftest) or without vLLM every
test here is skipped with its reason; the module always collects. The CPU legs of the same code
paths (shared memory instead of CUDA IPC, gloo instead of NCCL) run in ``tests/test_vllm_backend.py``.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import os
import socket
import sys
import threading
import time

import pytest
import torch

from backends.base import BackendConfig, BackendError, BucketManifest, TensorSpec, WeightGroupSpec
from rlhf_sg.tiny import BOS_ID, EOS_ID

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not importable (on a GPU node: pip install 'rlhf-sg[vllm]')"),
]
two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two GPUs: the trainer's sender on cuda:1, the engine on cuda:0"
)
TIMEOUT_S = 120.0
PROMPTS = [[BOS_ID, 40, 41, 42, 43, 44], [BOS_ID, 50, 12, 77, 13, 9], [BOS_ID, 7, 7, 7]]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from test_vllm_backend import _head32_model

    from rlhf_sg.tiny import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("gpu-vllm-model")), model=_head32_model(seed=0))


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def new_model():
    from test_vllm_backend import _head32_model

    return _head32_model(seed=1)


@pytest.fixture(scope="module")
def engine(model_dir):
    """One vLLM engine on cuda:0 for the module (fp32, so weights compare exactly)."""
    from backends.vllm_backend import VLLMBackend

    backend = VLLMBackend(
        BackendConfig(model_path=model_dir, device="cuda", max_model_len=96, extra={"gpu_memory_utilization": 0.3})
    )
    yield backend
    backend.shutdown()


def _named(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().float().contiguous() for name, p in model.named_parameters()}


def _buckets(named: dict[str, torch.Tensor]) -> list[tuple[BucketManifest, torch.Tensor]]:
    import test_backend_contract as contract

    return contract.make_buckets(named, bucket_bytes=96 * 1024)


def _greedy_matches_transformers(engine, model) -> None:
    """Greedy tokens of ``engine`` equal transformers' greedy decode of ``model`` (on cuda:0, fp32)."""
    import test_backend_contract as contract

    model = model.to("cuda:0")
    try:
        expected = [contract.hf_greedy(model, p, 12, {EOS_ID}) for p in PROMPTS]
    finally:
        model.to("cpu")
    assert contract.greedy(engine, PROMPTS) == expected


def _restore(engine, reference) -> None:
    for manifest, flat in _buckets(_named(reference)):
        engine.update_weights_from_tensor(manifest, flat.to("cuda:0"))
    engine.finish_weight_update(engine.weight_version + 1)


def _nccl_sender(flats: list[torch.Tensor], device: str):
    """Host a weight-update group as rank 0 on ``device`` and broadcast ``flats``, in a thread."""
    from backends.embedded import open_weight_update_group

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = WeightGroupSpec("127.0.0.1", port, 1, 2, "gpu_vllm_weights", "nccl", TIMEOUT_S)

    def send():
        try:
            torch.cuda.set_device(device)
            group = open_weight_update_group(spec, 0)
            for flat in flats:
                opts = torch.distributed.BroadcastOptions()
                opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, datetime.timedelta(seconds=TIMEOUT_S)
                work = group.broadcast([flat.to(device)], opts)
                deadline = time.monotonic() + TIMEOUT_S
                while not work.is_completed():  # never a timed wait on NCCL work
                    assert time.monotonic() < deadline, "a broadcast did not complete"
                    time.sleep(0.001)
                work.wait()
            torch.cuda.synchronize(device)
        except Exception as exc:  # reported by the test that joins the thread
            thread.error = exc

    thread = threading.Thread(target=send, name="nccl-sender", daemon=True)
    thread.error = None
    thread.start()
    return spec, thread


@two_gpus
def test_nccl_sync_into_vllm_is_exact_and_greedy_matches_transformers(engine, reference, new_model):
    """NCCL collective transport into vLLM: a sender on cuda:1 broadcasts flat buckets on the side
    group, vLLM's worker on cuda:0 receives and loads them. Proves the NCCL group forms between a
    plain torch ``ProcessGroupNCCL`` and vLLM's worker, every weight arrives exactly, and the
    engine then decodes greedily exactly as transformers does with the same weights."""
    sent = _named(new_model)
    buckets = _buckets(sent)
    spec, thread = _nccl_sender([flat for _, flat in buckets], "cuda:1")
    try:
        engine.init_weight_update_group(spec)
        try:
            for manifest, _ in buckets:
                engine.update_weights_from_collective(manifest, 0)
            engine.finish_weight_update(engine.weight_version + 1)
        finally:
            thread.join(TIMEOUT_S)
            engine.destroy_weight_update_group()
        assert thread.error is None, f"sender failed: {thread.error!r}"
        for name, tensor in sent.items():
            assert torch.equal(engine.get_weights_by_name(name), tensor), f"{name} differs after the NCCL sync"
        _greedy_matches_transformers(engine, new_model)
    finally:
        _restore(engine, reference)


def test_cuda_ipc_handoff_into_vllm_is_exact_owned_and_greedy_matches_transformers(engine, reference, new_model):
    """CUDA IPC tensor transport into vLLM from an unrelated process on the same GPU.

    The sender packs each bucket with ``VLLMBackend.pack_tensor_bucket`` (the payload names its
    GPU by UUID, the same one the engine's worker sees), reuses ONE buffer for every bucket, and
    fills it with NaN after the last load. Proves: the payload is a handle, not the bytes; the
    worker opened the sender's memory on its own device; each load had finished copying out of
    the IPC memory before it returned (else a later bucket or the NaN would show); greedy output
    then equals transformers'."""
    from test_vllm_backend import sync_from_sender_process

    from backends.shared_tensor import device_identity

    sent = _named(new_model)
    try:
        received = sync_from_sender_process(engine, _buckets(sent), "cuda:0")
        for payload, size in received:
            assert payload.device_type == "cuda" and payload.device_id == device_identity(torch.device("cuda:0"))
            assert size < 4096, f"the payload pickles to {size} bytes: the bucket went by value"
        for name, tensor in sent.items():
            assert torch.equal(engine.get_weights_by_name(name), tensor), f"{name} differs after the IPC sync"
        _greedy_matches_transformers(engine, new_model)
    finally:
        _restore(engine, reference)


def test_ipc_payload_from_another_gpu_is_refused_naming_both(engine):
    """A CUDA IPC payload shared on another physical GPU is refused by the worker before any load,
    with a message naming both devices (GPU UUIDs). With two GPUs the payload really comes from
    cuda:1; with one, the payload's UUID is replaced by one no GPU has."""
    from backends.shared_tensor import device_identity
    from backends.vllm_backend import VLLMBackend

    name = "model.layers.0.mlp.down_proj.weight"
    before = engine.get_weights_by_name(name)
    manifest = BucketManifest((TensorSpec(name, tuple(before.shape), torch.float32, 0),), torch.float32, before.numel())
    if torch.cuda.device_count() >= 2:
        flat = (before + 1.0).reshape(-1).to("cuda:1")
        payload = VLLMBackend.pack_tensor_bucket(manifest, flat, num_tp_ranks=1)
        other = device_identity(torch.device("cuda:1"))
    else:
        flat = (before + 1.0).reshape(-1).to("cuda:0")
        other = "GPU-00000000-0000-0000-0000-000000000000"
        payload = dataclasses.replace(
            VLLMBackend.pack_tensor_bucket(manifest, flat, num_tp_ranks=1),
            device_id=other,
            device_name=f"cuda:7 (some GPU, {other})",
        )
    mine = device_identity(torch.device("cuda:0"))
    with pytest.raises(
        BackendError, match=rf"shared on cuda:\d \(.*{other}\).*this worker runs on cuda:0 \(.*{mine}\)"
    ):
        engine.update_weights_from_tensor(manifest, payload)
    assert torch.equal(engine.get_weights_by_name(name), before)


@two_gpus
def test_device_identity_is_the_physical_gpu_uuid():
    """Two GPUs have two identities, each the UUID torch reports for it (what nvidia-smi -L shows)."""
    from backends.shared_tensor import device_identity

    ids = [device_identity(torch.device(f"cuda:{i}")) for i in range(2)]
    assert ids[0] != ids[1]
    assert ids == [f"GPU-{torch.cuda.get_device_properties(i).uuid}" for i in range(2)]


@two_gpus
def test_open_shared_on_a_named_device_refuses_another_gpu():
    """``open_shared(payload, device)``, what the vLLM worker opens its payload with, maps the payload's
    GPU UUID onto ``device`` only: a payload from cuda:1 opened for cuda:0 is refused naming both GPUs
    (without ``device`` it would open on whichever local GPU has the UUID), before any IPC handle is
    opened. Proves the worker-side check does not rely on the bucket's own ``device_id`` field alone."""
    from backends.shared_tensor import device_identity, open_shared, share

    payload = share(torch.arange(8.0, device="cuda:1"))
    mine, other = device_identity(torch.device("cuda:0")), device_identity(torch.device("cuda:1"))
    with pytest.raises(RuntimeError, match=rf"shared on {other}.*this worker runs on cuda:0 \(.*{mine}\)"):
        open_shared(payload, torch.device("cuda:0"))


def test_vllm_own_transfer_engines_compared_with_ours():
    """vLLM 0.32's own "ipc" engine (and with two GPUs its "nccl" engine) against ours, each into a
    fresh real engine, through ``python -m rlhf_sg.bench vllm-transfer``. Proves both sides of every
    pair deliver the trainer's weights exactly; the printed table gives their times and the ratio
    the README's decision rests on (no time is asserted)."""
    from rlhf_sg.bench.vllm_transfer import run

    out = run(["ipc", "nccl"], size="small", bucket_mb=1, rounds=2, dtype="float32")  # prints the table (-s)
    assert {"ours-ipc", "vllm-ipc"} <= set(out)
    for variant, res in out.items():
        assert not res["wrong"], f"{variant}: weights differ after the sync: {res['wrong'][:3]}"


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
def test_a_moe_models_per_expert_checkpoint_tensors_load_into_vllm_on_gpu(tmp_path, family):
    """On GPU the vLLM backend takes mixture-of-experts models (its CPU build is refused: it packs expert weights at
    load only). Another model's buckets, gathered in transformers' fused run-time layout and sent under the
    checkpoint's per-expert names, go through vLLM's own expert loader: afterwards the engine's log-probs are the
    other model's (float32, the backend contract's 1e-4), where before they were not."""
    from backends.base import SamplingParams
    from backends.vllm_backend import VLLMBackend
    from rlhf_sg.tiny import save_tiny_model, tiny_family_model

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_checkpoint_names import _wire_buckets

    overrides = {"head_dim": 32} if family == "qwen3-moe" else {"sliding_window": None}
    path = str(tmp_path / family)
    save_tiny_model(path, model=tiny_family_model(family, **overrides))
    other = tiny_family_model(family, seed=9, **overrides).cuda()
    engine = VLLMBackend(BackendConfig(model_path=path, device="cuda", dtype="float32", max_model_len=64))
    try:
        def gap() -> float:
            c = engine.generate(PROMPTS[:1], SamplingParams(n=1, max_new_tokens=6, seed=1))[0]
            ids = torch.tensor([PROMPTS[0] + c.token_ids], device="cuda")
            with torch.no_grad():
                logits = other(input_ids=ids).logits[0, len(PROMPTS[0]) - 1 : -1].float()
            want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids, device="cuda")[:, None])
            return (torch.tensor(c.logprobs, device="cuda") - want.squeeze(-1)).abs().max().item()

        assert gap() > 1e-3  # the engine starts from another model
        for manifest, flat in _wire_buckets(other.cpu(), 1 << 20)[1]:
            engine.update_weights_from_tensor(manifest, flat.cuda())
        engine.finish_weight_update(1)
        other.cuda()
        assert gap() <= 1e-4
    finally:
        engine.shutdown()
