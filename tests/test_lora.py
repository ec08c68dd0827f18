"""LoRA policies: the --lora.* settings, the merged and adapter weight syncs, and the actor under ZeRO-3.

The syncs are checked with a nonzero adapter (B random: a zero adapter leaves the base unchanged and proves
nothing), against the trainer's own PeftModel, and the base weights are compared bitwise after many syncs.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from backends.base import SamplingParams
from backends.embedded import EmbeddedBackend
from rlhf_sg.config import Config, ConfigError, apply_overrides, parse_args, validate
from rlhf_sg.lora import LoraSpec, adapter_name, apply_lora, merge_into_bucket, merged_name, split_lora
from rlhf_sg.sync import plan_buckets
from rlhf_sg.tiny import save_tiny_model

pytest.importorskip("peft")

class MergedOnlyBackend(EmbeddedBackend):
    """A backend that does not declare it can load an adapter (as SGLang's on CPU)."""

    supports_lora_adapter = False


PROMPTS = [[1, 40, 41, 42, 43, 44], [1, 50, 12, 77, 13, 9]]
GREEDY = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)


def _cfg(tmp_path, **lora) -> Config:
    model = save_tiny_model(str(tmp_path / "m")) if not (tmp_path / "m").exists() else str(tmp_path / "m")
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    cfg = Config()
    apply_overrides(cfg, {"model.pretrain": model, "data.prompt_data": str(data), "reward.function": "m:f",
                          **{f"lora.{k}": v for k, v in lora.items()}}, "flag")
    return cfg


def test_lora_is_off_by_default_and_its_settings_are_validated(tmp_path):
    cfg = _cfg(tmp_path)
    assert cfg.lora.rank == 0 and validate(cfg).lora.sync_mode == "merged"
    validate(_cfg(tmp_path, rank=8, alpha=16, sync_mode="adapter"))  # the embedded engine serves adapters
    for bad, match in (({"rank": -1}, "--lora.rank"), ({"rank": 8, "alpha": 0}, "--lora.alpha"),
                       ({"rank": 8, "dropout": 1.0}, "--lora.dropout"), ({"rank": 8, "sync_mode": "x"}, "sync_mode"),
                       ({"init_adapter": str(tmp_path)}, "needs --lora.rank")):
        with pytest.raises(ConfigError, match=match):
            validate(_cfg(tmp_path, **bad))
    cfg = _cfg(tmp_path, rank=8, sync_mode="adapter")
    cfg.rollout.backend = f"{os.path.abspath(__file__)}:MergedOnlyBackend"
    with pytest.raises(ConfigError, match="does not declare it can load a LoRA adapter.*merged"):
        validate(cfg)


def test_the_head_and_embeddings_are_refused_as_lora_targets(tmp_path):
    """The log-probs call the lm_head once with the chunked log-softmax inside; a LoRA-wrapped head calls its own
    submodules per chunk, which under ZeRO-3 would gather them as many times as each rank has chunks."""
    validate(_cfg(tmp_path, rank=8, target_modules="all-linear"))
    validate(_cfg(tmp_path, rank=8, target_modules="q_proj,v_proj"))
    for targets in ("q_proj,lm_head", "embed_tokens", " lm_head "):
        with pytest.raises(ConfigError, match=r"--lora.target_modules names \['(lm_head|embed_tokens)'\]"):
            validate(_cfg(tmp_path, rank=8, target_modules=targets))


@pytest.mark.parametrize("option", ["use_dora", "modules_to_save", "rank_pattern", "alpha_pattern"])
def test_options_the_engines_cannot_serve_are_refused_by_name(tmp_path, option):
    with pytest.raises(ConfigError, match=f"--lora.{option}: .* not supported"):
        parse_args(["--lora." + option, "true"])
    with pytest.raises(ConfigError, match=f"lora.{option}: .* not supported"):
        apply_overrides(Config(), {f"lora.{option}": 1}, "run.yaml")
    # a saved adapter that uses one is refused too
    import json

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, option: {"q_proj": 4}}))
    with pytest.raises(ConfigError, match="init_adapter .* not supported"):
        validate(_cfg(tmp_path, rank=8, init_adapter=str(adapter)))


def test_peft_names_map_to_the_engine_names_and_others_are_refused():
    p = "base_model.model."
    q = "model.layers.0.self_attn.q_proj"
    assert merged_name(f"{p}{q}.base_layer.weight") == f"{q}.weight"
    assert merged_name(p + "model.norm.weight") == "model.norm.weight"
    assert merged_name(p + "model.layers.0.self_attn.q_proj.lora_A.default.weight") is None
    assert adapter_name(f"{p}{q}.lora_B.default.weight") == f"{p}{q}.lora_B.weight"
    for unknown in ("model.layers.0.self_attn.q_proj.lora_magnitude_vector.default.weight",
                    "model.embed_tokens.lora_embedding_A.default", "model.layers.0.mlp.up_proj.lora_A.other.weight"):
        with pytest.raises(ValueError, match="has no engine name"):
            merged_name(p + unknown)


@pytest.mark.parametrize("rslora", [False, True])
def test_merged_bucket_is_base_plus_scaled_product_in_fp32_and_the_inputs_stay(rslora):
    gen = torch.Generator().manual_seed(0)
    spec = LoraSpec(rank=4, alpha=8.0, rslora=rslora)
    assert spec.scaling == (8.0 / 2.0 if rslora else 2.0)
    shapes = {"a.weight": (6, 5), "b.weight": (3,), "c.weight": (7, 6)}
    plan = plan_buckets([(n, s, torch.float32) for n, s in shapes.items()], 1 << 20)[0]
    out = torch.randn(plan.numel, generator=gen)
    before = out.clone()
    deltas = {n: (torch.randn(4, s[1], generator=gen), torch.randn(s[0], 4, generator=gen))
              for n, s in shapes.items() if len(s) == 2}
    kept = {n: (a.clone(), b.clone()) for n, (a, b) in deltas.items()}
    merge_into_bucket(plan, out, deltas, spec.scaling)
    for t in plan.tensors:
        got = out[t.offset: t.offset + t.numel].view(t.shape)
        base = before[t.offset: t.offset + t.numel].view(t.shape)
        if t.name in deltas:
            a, b = deltas[t.name]
            torch.testing.assert_close(got, base + spec.scaling * b @ a, rtol=1e-6, atol=1e-6)
            assert torch.equal(a, kept[t.name][0]) and torch.equal(b, kept[t.name][1])
        else:
            assert torch.equal(got, base)


def _peft_model(model_path: str, rank: int = 4, seed: int = 1, rslora: bool = False):
    """The trainer's view: the tiny model with a LoRA adapter whose B is random (nonzero)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    peft_model = apply_lora(model, LoraSpec(rank=rank, alpha=2.0 * rank, dropout=0.3, rslora=rslora),
                            disable_dropout=True)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return peft_model.eval()


def _logp(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def _assert_engine_serves(generate, model, not_base: bool = False) -> None:
    """The engine's greedy completions carry ``model``'s log-probs; ``not_base``: and those differ from the base
    model's (``model`` a PeftModel, its adapter disabled), so the adapter is really in them."""
    for prompt, completion in zip(PROMPTS, generate(PROMPTS, GREEDY)):
        want = _logp(model, prompt, completion.token_ids)
        torch.testing.assert_close(torch.tensor(completion.logprobs), want, atol=1e-4, rtol=0)
        if not_base:
            with model.disable_adapter():
                assert (want - _logp(model, prompt, completion.token_ids)).abs().max() > 1e-2


def test_embedded_engine_serves_a_loaded_adapter_as_the_peft_model_computes_it(tmp_path):
    """The adapter path of the embedded engine, in-process: load the adapter's tensors, generate, compare."""
    from backends.base import BackendConfig
    from backends.embedded import EmbeddedBackend

    path = save_tiny_model(str(tmp_path / "m"))
    peft_model = _peft_model(path, rslora=True)
    _, _, lora_named = split_lora(list(peft_model.named_parameters()))
    manifest = plan_buckets([(adapter_name(n), p.shape, p.dtype) for n, p in lora_named], 1 << 30)[0]
    flat = torch.cat([p.detach().reshape(-1) for _, p in lora_named])
    engine = EmbeddedBackend(BackendConfig(model_path=path, num_threads=1))
    spec = LoraSpec(rank=4, alpha=8.0, rslora=True)
    engine.load_lora_adapter(manifest, flat, spec.peft_config())
    _assert_engine_serves(engine.generate, peft_model, not_base=True)
    # a wrong rank is refused before anything changes
    with pytest.raises(Exception, match="expected"):
        engine.load_lora_adapter(manifest, flat, dict(spec.peft_config(), r=8))
    _assert_engine_serves(engine.generate, peft_model)
    engine.unload_lora_adapter()
    with peft_model.disable_adapter():
        _assert_engine_serves(engine.generate, peft_model)
    engine.shutdown()


# ---- through Ray: an engine actor and the weight syncer ---------------------------------------------


@pytest.fixture(scope="module")
def engine(ray_cluster, tmp_path_factory):
    import ray

    from backends.base import BackendConfig
    from rlhf_sg.engine_actor import start_engine_actors

    path = save_tiny_model(str(tmp_path_factory.mktemp("lora") / "m"))
    (actor,) = start_engine_actors("hf", BackendConfig(model_path=path, num_threads=1), 1)
    yield {"actor": actor, "path": path}
    ray.kill(actor)


def _syncer(engine, spec: LoraSpec):
    from rlhf_sg.sync import WeightSyncer

    syncer = WeightSyncer(rank=0, world_size=1, engines=[engine["actor"]], transport="collective", timeout_s=120,
                          device="cpu", lora=spec, group_name=f"lora-{spec.sync_mode}-{os.getpid()}")
    syncer.setup()
    return syncer


def _engine_generate(actor):
    import ray

    return lambda prompts, params: ray.get(actor.generate.remote(prompts, params), timeout=120)


@pytest.mark.slow
def test_merged_sync_serves_the_peft_model_and_never_moves_the_base(engine):
    """A merged sync with B random: the engine computes the trainer's PeftModel, not the base; the trainer's base
    weights are bitwise unchanged after 100 syncs; with B set back to 0 the engine serves the base."""
    peft_model = _peft_model(engine["path"])
    spec = LoraSpec(rank=4, alpha=8.0)
    base_before = {n: p.detach().clone() for n, p in peft_model.named_parameters() if "lora_" not in n}
    syncer = _syncer(engine, spec)
    generate = _engine_generate(engine["actor"])
    try:
        stats = syncer.sync(peft_model, 1)
        assert stats["lora_bytes_gathered"] > 0
        _assert_engine_serves(generate, peft_model, not_base=True)
        for version in range(2, 101):
            syncer.sync(peft_model, version)
        for n, p in peft_model.named_parameters():
            if "lora_" not in n:
                assert torch.equal(p, base_before[n]), n
        _assert_engine_serves(generate, peft_model)
        with torch.no_grad():
            for n, p in peft_model.named_parameters():
                if "lora_B" in n:
                    p.zero_()
        syncer.sync(peft_model, 101)
        with peft_model.disable_adapter():
            _assert_engine_serves(generate, peft_model)
    finally:
        syncer.close()


@pytest.mark.slow
def test_adapter_sync_sends_the_base_once_then_only_the_lora_tensors(engine):
    """Adapter mode: the first sync sends the base weights then the adapter; later syncs gather and send only the
    LoRA tensors (their bytes counted), and the engine serves the PeftModel."""
    peft_model = _peft_model(engine["path"], seed=2)
    spec = LoraSpec(rank=4, alpha=8.0, sync_mode="adapter")
    base, _, lora_named = split_lora(list(peft_model.named_parameters()))
    base_bytes = sum(p.numel() * p.element_size() for _, p in base)
    lora_bytes = sum(p.numel() * p.element_size() for _, p in lora_named)
    syncer = _syncer(engine, spec)
    generate = _engine_generate(engine["actor"])
    try:
        first = syncer.sync(peft_model, 200)
        assert first["bytes"] == base_bytes + lora_bytes and first["lora_bytes_gathered"] == lora_bytes
        _assert_engine_serves(generate, peft_model, not_base=True)
        with torch.no_grad():
            for n, p in peft_model.named_parameters():
                if "lora_A" in n:
                    p.mul_(-1.5)
        second = syncer.sync(peft_model, 201)
        assert second["bytes"] == lora_bytes == second["lora_bytes_gathered"]
        assert lora_bytes * 8 < base_bytes
        _assert_engine_serves(generate, peft_model)
    finally:
        syncer.close()


@pytest.mark.slow
def test_raw_peft_names_are_refused_by_the_plan_check_before_any_byte_moves(engine):
    """Without the name mapping (no lora spec given to the syncer) the PEFT names reach the plan check and the
    engine refuses them."""
    from rlhf_sg.sync import WeightSyncer

    peft_model = _peft_model(engine["path"])
    syncer = WeightSyncer(rank=0, world_size=1, engines=[engine["actor"]], transport="collective", timeout_s=120,
                          device="cpu", group_name=f"lora-raw-{os.getpid()}")
    syncer.setup()
    try:
        with pytest.raises(ValueError, match="nothing was sent.*base_model"):
            syncer.sync(peft_model, 300)
    finally:
        syncer.close()


# ---- the actor under ZeRO-3 ---------------------------------------------------------------------------


def _zero3_lora_actor(model_path: str, out_dir: str) -> dict:
    """One ZeRO-3 LoRA actor rank (adapter dropout 0.3, --train.disable_dropout): its first update, the reference
    from its disabled adapter, the optimizer state, a checkpoint round trip and the exports."""
    import torch.distributed as dist
    from zero3_rank import PLAIN_UPDATE, actor_rank, one_step

    lora = {"rank": 4, "alpha": 8.0, "dropout": 0.3, "target_modules": "all-linear"}
    worker, batch, plan = actor_rank(model_path, lora=lora)
    try:
        out = {"dtypes": {str(p.dtype) for p in worker.module.parameters()}}
        out["trainable"] = sorted({n.split(".")[-3] for n, p in worker.module.named_parameters() if p.requires_grad})
        lora_numel = sum(math.prod(p.ds_shape) for n, p in worker.module.named_parameters() if "lora_" in n)
        batch.old_logp = worker.forward(batch, plan)[1]
        out["first"] = worker.train_actor(batch, one_step(plan, batch), PLAIN_UPDATE)
        out["lora_numel"], out["state"] = lora_numel, worker.optimizer_state_bytes()
        out["after"] = worker.forward(batch, plan)[1]
        out["ref"] = worker.forward(batch, plan, without_adapter=True)[1]
        worker.save_checkpoint(out_dir, "step1", {"step": 1})
        out["ckpt_bytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out_dir) for f in fs)
        # the next step's first update: B is nonzero now, so adapter dropout would show in the ratio
        batch.old_logp = out["after"]
        out["second"] = worker.train_actor(batch, one_step(plan, batch), PLAIN_UPDATE)
        out["moved"] = worker.forward(batch, plan)[1]
        worker.load_checkpoint(out_dir, "step1")
        out["resumed"] = worker.forward(batch, plan)[1]
        worker.export_lora(os.path.join(out_dir, "adapter"), os.path.join(out_dir, "merged"))
        out["batch"] = batch
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_zero3_lora_actor_trains_the_adapter_only_and_its_reference_is_the_base(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from zero3_rank import in_fresh_process

    from rlhf_sg.packing import response_logprobs

    path = save_tiny_model(str(tmp_path / "m"))
    out = in_fresh_process(_zero3_lora_actor, path, str(tmp_path / "ckpt"))
    assert out["dtypes"] == {"torch.float32"}
    assert out["trainable"] == ["lora_A", "lora_B"]
    total = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())
    # Adam's two fp32 moments and the fp32 master copy of the adapter's elements, nothing for the base
    state = out["state"]
    assert state["trainable"] == out["lora_numel"]
    assert state["moments"] == 8 * out["lora_numel"] and state["master"] == 4 * out["lora_numel"]
    assert out["lora_numel"] < total / 5
    # dropout 0.3 asked for, zeroed with disable_dropout: a step's first update has a ratio of exactly 1, also once
    # B is nonzero (at the first step B = 0 hides any adapter dropout)
    for update in ("first", "second"):
        assert out[update]["actor/ratio_mean"] == 1.0 and out[update]["actor/ppo_kl"] == 0.0, update
    batch = out["batch"]
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        base_logp = response_logprobs(base, batch.sequences, batch.attention_mask, batch.response_width)
    assert (out["after"] - out["ref"]).abs().max() > 1e-3  # the update moved the policy...
    torch.testing.assert_close(out["ref"], base_logp, rtol=0, atol=1e-5)  # ...and the reference is the base
    assert out["ckpt_bytes"] < 4 * total  # the adapter and its optimizer state, not the base's
    assert not torch.equal(out["moved"], out["after"])
    assert torch.equal(out["resumed"], out["after"])
    adapter = PeftModel.from_pretrained(base, str(tmp_path / "ckpt" / "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt" / "merged"), dtype=torch.float32).eval()
    with torch.no_grad():
        for model in (adapter, merged):
            logp = response_logprobs(model, batch.sequences, batch.attention_mask, batch.response_width)
            torch.testing.assert_close(logp, out["after"], rtol=0, atol=1e-5)


def test_a_saved_adapter_starts_a_policy_that_computes_as_the_saved_one(tmp_path):
    """--lora.init_adapter: an adapter written in the export's format (PEFT's) loads back into the same policy,
    trainable for the actor and frozen for the reference."""
    from transformers import AutoModelForCausalLM

    from rlhf_sg.lora import write_adapter_dir

    path = save_tiny_model(str(tmp_path / "m"))
    trained = _peft_model(path, seed=4)
    _, _, lora_named = split_lora(list(trained.named_parameters()))
    spec = LoraSpec(rank=4, alpha=8.0)
    adapter = write_adapter_dir(str(tmp_path / "adapter"), {adapter_name(n): p.detach() for n, p in lora_named},
                                spec, path)
    validate(_cfg(tmp_path, rank=4, alpha=8.0, init_adapter=adapter))
    with pytest.raises(ConfigError, match="set --lora.rank, --lora.alpha"):
        validate(_cfg(tmp_path, rank=8, alpha=8.0, init_adapter=adapter))
    prompt, tokens = PROMPTS[0], [7, 8, 9, 10]
    for trainable in (True, False):
        loaded = apply_lora(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                            LoraSpec(rank=4, alpha=8.0, init_adapter=adapter), disable_dropout=True,
                            trainable=trainable).eval()
        assert torch.equal(_logp(loaded, prompt, tokens), _logp(trained, prompt, tokens))
        assert {p.requires_grad for n, p in loaded.named_parameters() if "lora_" in n} == {trainable}
