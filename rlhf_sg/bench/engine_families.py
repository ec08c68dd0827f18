"""``python -m rlhf_sg.bench engine-families --backend sglang|vllm|hf``: the model-family matrix through an engine.

For each family of :data:`rlhf_sg.tiny.FAMILIES` (the matrix's tiny float32 configs; ``--head-dim 32`` widens the
heads of the families whose config takes ``head_dim``, for vLLM's CPU attention): start the engine on the model,
sample 2 completions of 2 prompts (9 and 3 tokens, past the matrix's 4-token window), and take the largest |Δ|
between the engine's log-probs and the model's own forward on each row alone; then sync another model's weights
into the engine as the trainer sends them (gathered in transformers' run-time layout, under the checkpoint's names:
:mod:`backends.checkpoint_names`), and measure again against that model. A family prints ``exact`` when both are
within the backend contract's 1e-4, ``refused`` with the engine's or the backend's reason when it did not start,
else ``WRONG``. The baseline of each row is the model itself (transformers), run in the same process.

One engine start per family (20-60 s each on this machine kind), so CI runs the families whose sync or attention
differs (tests/test_engine_families.py) and this command the whole matrix.
"""

from __future__ import annotations

import argparse
import time

import torch

#: the backend contract's engine-vs-trainer tolerance
TOLERANCE = 1e-4
PROMPTS = [[5, 17, 33, 9, 60, 61, 8, 30, 31], [40, 41, 12]]


def engine_gap(engine, model) -> float:
    """The largest |Δ| between the engine's log-probs of its samples and ``model``'s forward on each row alone."""
    from backends.base import SamplingParams

    worst = 0.0
    for c in engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=6, seed=1)):
        prompt = PROMPTS[c.prompt_index]
        ids = torch.tensor([prompt + c.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float(), -1)
        want = logp.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
        worst = max(worst, float((torch.tensor(c.logprobs) - want).abs().max()))
    return worst


def sync_buckets(model, bucket_bytes: int = 1 << 30):
    """``model``'s weights as the trainer's syncer sends them: flat buckets gathered in the run-time layout,
    described under the checkpoint's names."""
    from backends.checkpoint_names import checkpoint_manifest, saved_as
    from rlhf_sg.sync import gather_bucket, named_weights, plan_buckets

    named = named_weights(model)
    meta = [(n, p.shape, p.dtype) for n, p in named]
    renames, params = saved_as(model, meta), dict(named)
    for manifest in plan_buckets(meta, bucket_bytes):
        flat = torch.empty(manifest.numel, dtype=manifest.dtype)
        gather_bucket([params[s.name] for s in manifest.tensors], manifest, flat)
        yield checkpoint_manifest(manifest, renames), flat


def check_family(family: str, backend: str, out: str, head_dim: int | None) -> tuple[str, float, float]:
    """(verdict, |Δ| before the sync, |Δ| after it) of one family through ``backend``."""
    import os

    from backends.base import BackendConfig
    from backends.registry import create_backend
    from rlhf_sg.tiny import save_tiny_model, tiny_family_model

    overrides = {"head_dim": head_dim} if head_dim and family in _TAKES_HEAD_DIM else {}
    path = os.path.join(out, family)
    first = tiny_family_model(family, **overrides)
    save_tiny_model(path, model=first)
    second = tiny_family_model(family, seed=5, **overrides)
    try:
        engine = create_backend(backend, BackendConfig(model_path=path, dtype="float32", max_model_len=256, seed=0,
                                                       num_threads=1))
    except Exception as e:
        return f"refused: {type(e).__name__}: {str(e).splitlines()[0][:200]}", float("nan"), float("nan")
    try:
        before = engine_gap(engine, first)
        for manifest, flat in sync_buckets(second):
            engine.update_weights_from_tensor(manifest, flat)
        engine.finish_weight_update(1)
        after = engine_gap(engine, second)
    finally:
        engine.shutdown()
    verdict = "exact" if max(before, after) <= TOLERANCE else "WRONG"
    return verdict, before, after


#: families whose tiny config sets head_dim explicitly (the others derive it from hidden_size / heads)
_TAKES_HEAD_DIM = ("qwen3", "qwen3-moe", "qwen3.5", "qwen3-next", "gemma-3", "gemma-2", "cohere2", "gpt-oss")


def main(argv: list[str] | None = None) -> None:
    import tempfile

    from rlhf_sg.tiny import FAMILIES

    parser = argparse.ArgumentParser(prog="python -m rlhf_sg.bench engine-families", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="sglang", help="a rollout backend name (sglang, vllm, hf) or module:Class")
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), help=f"a subset of {', '.join(FAMILIES)}")
    parser.add_argument("--head-dim", type=int, default=None, help="widen the heads of the families that take it")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{'family':16s} {'verdict':60s} {'|Δ| before':>11s} {'after sync':>11s} {'s':>5s}", flush=True)
    with tempfile.TemporaryDirectory() as out:
        for family in args.families:
            start = time.perf_counter()
            verdict, before, after = check_family(family, args.backend, out, args.head_dim)
            print(f"{family:16s} {verdict[:60]:60s} {before:11.2e} {after:11.2e} {time.perf_counter() - start:5.0f}",
                  flush=True)


if __name__ == "__main__":
    main()
