"""Weight sync under checkpoint names: a family whose run-time layout differs from its checkpoint (transformers 5's
fused mixture-of-experts parameters, Mixtral's renamed modules) is sent under the names and offsets its checkpoint
holds, which every engine loads; and the embedded engine's generation per family against the model's own forward.

Before the sync planned under checkpoint names, a Qwen3-MoE or Mixtral run failed at its first sync:
``'model.layers.0.mlp.experts.gate_up_proj' is not a weight of the engine's checkpoint``; before the embedded engine
gave prompts their sample rows through ``reorder_cache``, Qwen3.5 and Qwen3-Next failed to generate several samples
per prompt: ``'LinearAttentionLayer' object has no attribute 'batch_repeat_interleave'``.
"""

from __future__ import annotations

import pytest
import torch

from backends.base import BackendConfig, BackendError, SamplingParams
from backends.checkpoint_names import checkpoint_manifest, checkpoint_views, saved_as
from rlhf_sg.sync import gather_bucket, named_weights, plan_buckets
from rlhf_sg.tiny import FAMILIES, save_tiny_model, tiny_family_model

#: families transformers runs in a layout other than their checkpoint's (fused experts; Mixtral also renamed)
CONVERTED = ("qwen3-moe", "qwen3-next", "mixtral")


def _save(family: str, path, seed: int = 0):
    model = tiny_family_model(family, seed=seed)
    save_tiny_model(str(path), model=model)
    return model


def _checkpoint(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _wire_buckets(model, bucket_bytes: int):
    """The sync's buckets of ``model``: gathered in its run-time layout, described under its checkpoint names."""
    named = named_weights(model)
    meta = [(n, p.shape, p.dtype) for n, p in named]
    plan = plan_buckets(meta, bucket_bytes)
    renames = saved_as(model, meta)
    params = dict(named)
    buckets = []
    for manifest in plan:
        flat = torch.empty(manifest.numel, dtype=manifest.dtype)
        gather_bucket([params[s.name] for s in manifest.tensors], manifest, flat)
        buckets.append((checkpoint_manifest(manifest, renames), flat))
    return plan, buckets


@pytest.mark.parametrize("family", CONVERTED)
@pytest.mark.parametrize("bucket_bytes", [2048, 1 << 30], ids=["small-buckets", "one-bucket"])
def test_buckets_hold_exactly_the_checkpoints_tensors(family, bucket_bytes, tmp_path):
    """Every tensor of the saved checkpoint, and nothing else, is in the buckets under its own name and shape, with
    its bytes; the engine's plan check (checkpoint headers) accepts them and refuses the run-time names."""
    from rlhf_sg.engine_actor import EngineActor

    model = _save(family, tmp_path)
    plan, buckets = _wire_buckets(model, bucket_bytes)
    sent = {name: t for manifest, flat in buckets for name, t in manifest.unflatten(flat)}
    checkpoint = _checkpoint(tmp_path)
    assert sorted(sent) == sorted(checkpoint)
    for name, tensor in checkpoint.items():
        assert torch.equal(sent[name], tensor), name
    actor = EngineActor("hf", BackendConfig(model_path=str(tmp_path), num_threads=1))
    try:
        assert actor.check_manifests([m for m, _ in buckets]) == len(checkpoint)
        with pytest.raises(BackendError, match=r"is not a weight of the engine's checkpoint"):
            actor.check_manifests(plan)
    finally:
        actor.shutdown()


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in CONVERTED])
def test_families_saved_as_they_run_keep_their_names(family):
    model = tiny_family_model(family)
    assert saved_as(model, [(n, p.shape, p.dtype) for n, p in model.named_parameters()]) == {}


@pytest.mark.parametrize("family", CONVERTED)
def test_the_embedded_engine_loads_checkpoint_named_buckets_into_its_fused_parameters(family, tmp_path):
    """An engine started from one model, sent another's buckets under checkpoint names, holds the other's weights
    in every run-time parameter, fused experts included."""
    from backends.embedded import EmbeddedBackend

    _save(family, tmp_path)
    other = tiny_family_model(family, seed=7)
    engine = EmbeddedBackend(BackendConfig(model_path=str(tmp_path), num_threads=1))
    try:
        before = {n: p.clone() for n, p in engine.model.named_parameters()}
        for manifest, flat in _wire_buckets(other, 4096)[1]:
            engine.update_weights_from_tensor(manifest, flat)
        for name, param in other.named_parameters():
            held = dict(engine.model.named_parameters())[name]
            assert torch.equal(held, param), name
            if "experts" in name:  # random in both models: the load changed them
                assert not torch.equal(before[name], param), name
    finally:
        engine.shutdown()


def test_the_embedded_engine_reloads_a_checkpoint_directory_of_a_moe_model(tmp_path):
    """The disk transport's reload takes the checkpoint's per-expert names too."""
    from backends.embedded import EmbeddedBackend

    _save("qwen3-moe", tmp_path / "engine")
    other = _save("qwen3-moe", tmp_path / "new", seed=5)
    engine = EmbeddedBackend(BackendConfig(model_path=str(tmp_path / "engine"), num_threads=1))
    try:
        engine.update_weights_from_disk(str(tmp_path / "new"))
        for name, param in other.named_parameters():
            assert torch.equal(dict(engine.model.named_parameters())[name], param), name
    finally:
        engine.shutdown()


def test_checkpoint_views_write_through_to_the_parameters():
    model = tiny_family_model("mixtral")
    renames = saved_as(model, [(n, p.shape, p.dtype) for n, p in model.named_parameters()])
    views = checkpoint_views(model, renames)
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"  # expert 2's up projection: the second half
    views[name].fill_(3.0)
    fused = dict(model.named_parameters())["model.layers.1.mlp.experts.gate_up_proj"]
    assert (fused[2, fused.shape[1] // 2 :] == 3.0).all()
    assert not (fused[2, : fused.shape[1] // 2] == 3.0).any() and not (fused[1] == 3.0).any()


def test_a_conversion_that_reorders_elements_is_refused(monkeypatch):
    """A checkpoint tensor that is not a contiguous range of one run-time parameter (a transpose) cannot go out as a
    slice of a gathered bucket: refused, naming it, before any byte moves."""
    import backends.checkpoint_names as names

    def transposing(model, state_dict):
        return {f"{k}.saved": v.t() if v.dim() == 2 else v for k, v in state_dict.items()}

    monkeypatch.setattr(names, "_reverse_conversion", lambda: transposing)
    model = tiny_family_model("qwen2")
    with pytest.raises(BackendError, match=r"checkpoint tensor 'model\.[^']+\.saved' by reordering elements"):
        saved_as(model, [(n, p.shape, p.dtype) for n, p in model.named_parameters()])


def _alone_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "phi-3-longrope"])
def test_the_embedded_engine_samples_each_family_as_its_model_scores_each_row_alone(family, tmp_path):
    """Several samples per prompt from prompts of different lengths (left-padded together), rows stopping at
    different steps (the decode compacts its cache): each completion's log-probs equal the model's own forward on
    that row alone, within the backend contract's 1e-4."""
    from backends.embedded import EmbeddedBackend

    model = _save(family, tmp_path)
    engine = EmbeddedBackend(BackendConfig(model_path=str(tmp_path), num_threads=1, max_model_len=64))
    prompts = [[5, 17, 33, 9, 60, 61, 8], [40, 41, 12], [70, 3, 99, 100, 101]]
    params = SamplingParams(n=3, max_new_tokens=8, temperature=1.0, seed=11, stop_token_ids=tuple(range(3, 40)))
    try:
        completions = engine.generate(prompts, params)
    finally:
        engine.shutdown()
    assert len(completions) == 9
    lengths = {len(c.token_ids) for c in completions}
    assert len(lengths) > 1, lengths  # rows stopped at different steps
    for c in completions:
        want = _alone_logprobs(model, prompts[c.prompt_index], c.token_ids)
        assert (torch.tensor(c.logprobs) - want).abs().max() <= 1e-4, (family, c)


@pytest.mark.parametrize("prefixed", [False, True], ids=["saved-plain", "saved-with-language_model"])
def test_a_prefix_change_is_reversed_only_where_the_checkpoint_has_the_prefix(prefixed, tmp_path):
    """transformers strips ``language_model.`` from a Qwen3.5 text checkpoint's names at load and would add it back
    on every save; the sync sends the names the checkpoint on disk holds, either way."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    _save("qwen3.5", tmp_path)
    if prefixed:
        weights = load_file(str(tmp_path / "model.safetensors"))
        renamed = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
                   for k, v in weights.items()}
        save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    meta = [(n, p.shape, p.dtype) for n, p in model.named_parameters()]
    renames = saved_as(model, meta)
    checkpoint = set(load_file(str(tmp_path / "model.safetensors")))
    sent = {n for n, _, _ in meta if n not in renames} | {p.name for parts in renames.values() for p in parts}
    assert sent == checkpoint
    assert bool(renames) == prefixed


def test_the_engine_families_bench_runs_the_matrix_through_an_engine(capsys):
    """``python -m rlhf_sg.bench engine-families`` on the embedded engine: a MoE family is exact before and after a
    sync of another model's weights under checkpoint names."""
    from rlhf_sg.bench.engine_families import main

    main(["--backend", "hf", "--families", "qwen3-moe", "mixtral"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(("qwen3-moe", "mixtral"))]
    assert [(r[0], r[1]) for r in rows] == [("qwen3-moe", "exact"), ("mixtral", "exact")]
